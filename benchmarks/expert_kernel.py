"""The routed-expert product (llama.cpp's mul_mat_id) alone, per kernel backend: GB/s of expert weights read.

  python benchmarks/expert_kernel.py [--beam 0] [--quant Q4_0]   # GLM-4.7-Flash gate_exps shape: 64 experts, 1536 x 2048, 4 selected
"""
import argparse
import time

import numpy as np
from tinygrad import Device, Tensor, TinyJit
from tinygrad.helpers import Context

from model.quants import Q4_0, Q4_K, Q6_K, Q8_0, QUANT_TYPES
from model.weights import QWeight, expert

p = argparse.ArgumentParser()
p.add_argument("--beam", type=int, default=0)
p.add_argument("--quant", default="Q4_0", choices=["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
args = p.parse_args()
E, OUT, IN, K = 64, 1536, 2048, 4
qtype = {"Q4_0": Q4_0, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q6_K": Q6_K}[args.quant]
qt = QUANT_TYPES[qtype]
rng = np.random.default_rng(0)
raw = rng.integers(0, 256, (E * OUT, IN // qt.block, qt.nbytes), dtype=np.uint8)
for off in {Q4_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q6_K: (208,)}[qtype]:
  raw[..., off:off + 2] = (rng.standard_normal((E * OUT, IN // qt.block, 1)) * 0.01).astype(np.float16).view(np.uint8)
for backend in ("tensor", "fp16_cache"):
  w = QWeight.from_raw(Tensor(raw.reshape(E * OUT, -1)), qtype, (E, OUT, IN))
  if backend == "fp16_cache": w.use_fp16_cache()
  read = K * OUT * IN * (2 if backend == "fp16_cache" else qt.nbytes / qt.block)
  f = TinyJit(lambda x, sel, w=w: expert(x, sel, w).contiguous())
  with Context(BEAM=args.beam):
    ts = []
    for i in range(30):
      x = Tensor.randn(1, 1, 1, IN).realize()
      sel = Tensor(rng.choice(E, K, replace=False).reshape(1, 1, K).astype(np.int32)).realize()
      Device[Device.DEFAULT].synchronize()
      t0 = time.perf_counter()
      f(x, sel)
      Device[Device.DEFAULT].synchronize()
      if i >= 5: ts.append(time.perf_counter() - t0)
  t = float(np.median(ts))
  print(f"{Device.DEFAULT} BEAM={args.beam} {args.quant} {backend:10s} {t * 1e6:9.1f} us  {read / t / 1e9:8.1f} GB/s of expert weights")
  del w, f
