"""The device's streaming read bandwidth, measured through tinygrad: `python -m evaluator.bandwidth DEVICE` prints JSON.

Reductions over a large float32 buffer read every byte once and write almost nothing, like a decode step's matvecs.
Three shapes (long rows, short rows, one flat sum) are timed at BEAM=0 and, off the CPU, at BEAM=2 (the best schedule
tinygrad finds), ten JIT replays back to back per timing; the best median of 5 timings is the figure: what tinygrad
reaches on this device, the ceiling a decode step is held to."""
from __future__ import annotations

import json
import os
import sys
import time


def measure(device: str) -> dict:
  os.environ["DEV"] = device
  from tinygrad import Device, Tensor, TinyJit
  from tinygrad.helpers import Context
  n = (1 << 28) if device != "CPU" else (1 << 26)  # 1 GiB, 256 MiB on the CPU
  a = Tensor.empty(n, device=device).realize()
  shapes = {"rows4096": lambda: a.reshape(-1, 4096).sum(1), "rows256": lambda: a.reshape(-1, 256).sum(1),
            "flat": lambda: a.sum()}
  out = {"device": device, "bytes": n * 4}
  for beam in (0, 2) if device != "CPU" else (0,):
    for name, fn in shapes.items():
      with Context(BEAM=beam):
        run = TinyJit(lambda fn=fn: fn().realize())  # replayed: no Python scheduling between the timed kernels
        for _ in range(3): run()
        ts = []
        for _ in range(5):
          Device[device].synchronize()
          t0 = time.perf_counter()
          for _ in range(10): run()
          Device[device].synchronize()
          ts.append((time.perf_counter() - t0) / 10)
      out[f"gb_s_{name}_beam{beam}"] = n * 4 / sorted(ts)[len(ts) // 2] / 1e9
  out["gb_s"] = max(v for k, v in out.items() if k.startswith("gb_s_"))
  return out


if __name__ == "__main__":
  print(json.dumps(measure(sys.argv[1])))
