"""The device's streaming memory bandwidth through tinygrad: a large copy-and-scale, bytes read + written over time."""
import time

from tinygrad import Device, Tensor
from tinygrad.helpers import Context

n = 1 << 28  # 1 GiB of float32
a = Tensor.empty(n).realize()
for beam in (0, 2):
  with Context(BEAM=beam):
    for _ in range(2): (a * 2).realize()
    Device[Device.DEFAULT].synchronize()
    ts = []
    for _ in range(10):
      t0 = time.perf_counter()
      (a * 2).realize()
      Device[Device.DEFAULT].synchronize()
      ts.append(time.perf_counter() - t0)
  print(f"{Device.DEFAULT} BEAM={beam}: {2 * n * 4 / sorted(ts)[len(ts) // 2] / 1e9:.0f} GB/s (1 GiB read + 1 GiB written, median of 10)")
