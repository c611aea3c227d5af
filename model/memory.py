"""The host memory high-water mark of this process."""
from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
  """Peak resident memory of this process's own program: Linux's VmHWM, which starts afresh at exec (getrusage's maxrss
  keeps the forking parent's resident size across exec, so a process started from a large one reports the parent's)."""
  try:
    with open("/proc/self/status") as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
  except (OSError, StopIteration):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
