"""The routed-expert product (llama.cpp's mul_mat_id) alone, per kernel backend: GB/s of expert weights read, against
the device's streaming bandwidth measured through tinygrad in the same process (evaluator/bandwidth.py).

  python benchmarks/expert_kernel.py --beam 0 [--quant Q4_0] [--json out.jsonl]   # GLM-4.7-Flash ffn_gate_exps: 64 x
  1536 x 2048, 4 selected

One decode token, 4 experts chosen by a tensor (the gather happens inside the product). `kernel`: the product's kernels
timed on the device (tinygrad's DEBUG=2 event timing, median of 20 runs after 5 warm-ups); `call`: one TinyJit call,
synchronized, wall clock (launch and Python included, as a decode step's graph amortizes them).
"""
import argparse
import contextlib
import datetime
import io
import json
import time

import numpy as np
from products import random_weight  # tests/products.py (run with PYTHONPATH=tests)
from tinygrad import Device, GlobalCounters, Tensor, TinyJit
from tinygrad.helpers import Context

from evaluator.bandwidth import measure
from evaluator.child import environment
from model.backends import catalog, native
from model.backends import registry as K_
from model.quants import QUANT_TYPES
from model.weights import QWeight

p = argparse.ArgumentParser()
p.add_argument("--beam", type=int, default=0)
p.add_argument("--quant", default="Q4_0", choices=sorted(catalog.get("native").quants))
p.add_argument("--json", help="append one JSON line per backend")
args = p.parse_args()
E, OUT, IN, K, REPS = 64, 1536, 2048, 4, 20
qtype = next(t for t, q in QUANT_TYPES.items() if q.name == args.quant)
qt, dev = QUANT_TYPES[qtype], Device.DEFAULT
bw = measure(dev)["gb_s"]
label = f"{environment(dev)['device_name']} ({dev})"
rng = np.random.default_rng(0)
base = random_weight(rng, qtype, (E, OUT, IN))
backends = [n for n in catalog.names() if catalog.get(n).portable or native.available()]
print(f"{dev} BEAM={args.beam} {args.quant}: streaming bandwidth {bw:.0f} GB/s")
for backend in backends:
  w = K_.get(backend).attach(QWeight(base.planes, qtype, base.shape), dev)
  read = K * OUT * IN * (2 if catalog.get(backend).precision == "fp16" else qt.nbytes / qt.block)
  one = TinyJit(lambda x, sel, w=w: K_.expert(x, sel, w).contiguous())
  times: dict[str, list[float]] = {"kernel": [], "call": []}
  with Context(BEAM=args.beam):
    for i in range(25):
      x = Tensor.randn(1, 1, 1, IN).realize()
      sel = Tensor(rng.choice(E, K, replace=False).reshape(1, 1, K).astype(np.int32)).realize()
      Device[dev].synchronize()
      t0, k0 = time.perf_counter(), GlobalCounters.time_sum_s
      one(x, sel)
      Device[dev].synchronize()
      call = time.perf_counter() - t0
      with Context(DEBUG=2), contextlib.redirect_stdout(io.StringIO()): K_.expert(x, sel, w).realize()
      if i >= 5: times["call"].append(call); times["kernel"].append(GlobalCounters.time_sum_s - k0)
  times = {k: float(np.median(v)) for k, v in times.items()}
  gb_s = {k: read / t / 1e9 for k, t in times.items()}
  print(f"{backend:10s} kernel {times['kernel'] * 1e6:8.1f} us {gb_s['kernel']:7.1f} GB/s "
        f"({gb_s['kernel'] / bw:6.1%})   call {times['call'] * 1e6:8.1f} us {gb_s['call']:7.1f} GB/s", flush=True)
  if args.json:  # a benchmarks/results.jsonl line
    with open(args.json, "a") as f:
      f.write(json.dumps({"date": datetime.date.today().isoformat(), "kind": "expert_kernel", "device": label,
                          "model": f"glm-4.7-flash ffn_gate_exps ({E} x {OUT} x {IN}, {K} selected)", "layers": 0,
                          "quant": args.quant, "config": f"expert product, backend {backend}", "backend": backend,
                          "beam": args.beam, "us_kernel": round(times["kernel"] * 1e6, 1),
                          "us_call": round(times["call"] * 1e6, 1), "gb_s_kernel": round(gb_s["kernel"], 1),
                          "gb_s_call": round(gb_s["call"], 1), "bandwidth_gb_s": round(bw),
                          "bandwidth_share": round(gb_s["kernel"] / bw, 5),
                          "command": f"DEV={dev} PYTHONPATH=tests python benchmarks/expert_kernel.py --beam "
                          f"{args.beam} --quant {args.quant}"})
              + "\n")
  del w, one
