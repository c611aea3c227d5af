"""One benchmark at a time per physical device: an exclusive file lock per device on this host (flock, released by the
kernel when the holder dies, so a killed worker never leaves a stale lock). Device names that mean the same hardware
(`CUDA`, `CUDA:0`, `NV`) take the same lock; two cards of one host are locked apart (evaluator/devices.py)."""
from __future__ import annotations

import fcntl
import os
import pathlib
import re
import time
from collections.abc import Callable

from evaluator.devices import physical
from model.registry import cache_dir


class DeviceLock:
  def __init__(self, device: str, on_wait: Callable[[str], None] | None = None, what: str = ""):
    self.path = cache_dir() / "locks" / (re.sub(r"[^A-Za-z0-9_.-]", "_", physical(device).key) + ".lock")
    self.device, self.on_wait, self.what, self.fd = device, on_wait, what, -1

  def __enter__(self) -> DeviceLock:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try: fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if self.on_wait: self.on_wait(f"waiting for device {self.device}: {self._named_holder()} is benchmarking on it")
      fcntl.flock(self.fd, fcntl.LOCK_EX)
    os.ftruncate(self.fd, 0)
    os.pwrite(self.fd, f"pid {os.getpid()} on {self.device} {self.what}".strip().encode(), 0)
    return self

  def holder(self) -> str:
    return pathlib.Path(self.path).read_text().strip() if self.path.exists() else ""

  def _named_holder(self) -> str:
    """The holder's name: it writes it just after taking the lock, so a waiter that comes in between waits for it a
    moment."""
    for _ in range(50):
      if name := self.holder(): return name
      time.sleep(0.01)
    return "another process"

  def __exit__(self, *exc) -> None:
    os.ftruncate(self.fd, 0)
    fcntl.flock(self.fd, fcntl.LOCK_UN)
    os.close(self.fd)
