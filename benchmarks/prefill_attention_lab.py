"""The prompt's all-heads attention alone (native.prefill_attention: cuda_prefill.mla_prefill's kernel and its merge),
at the real head counts of GLM-4.7-Flash (20) and DeepSeek-V2-Lite (16): a chunk of --chunk tokens at each position of
--at over a float16 cache of --ctx positions, for each count of tokens a block (prefill_attn_tokens, --tokens). The
variants run interleaved, --rounds times; each timing is one TinyJit call of
the pair, synchronized, wall clock (a call's launch overhead is a few µs against the ms the pair takes). TFLOPS counts
the causal work as the launch's estimate does (native.prefill_work): each token's heads over the positions up to its
own, (kv_lora + rope) + kv_lora multiply-adds each.
`err`: max |out - the first variant's out| over the latter's std.

  DEV=CUDA PYTHONPATH=. python benchmarks/prefill_attention_lab.py [--tokens 1 2] [--json out.jsonl]
"""
import argparse
import datetime
import json
import statistics
import sys
import time

import numpy as np
from tinygrad import Device, Tensor, TinyJit, dtypes

from model.backends import native
from model.presets import PRESETS

p = argparse.ArgumentParser()
p.add_argument("--models", nargs="+", default=["glm-4.7-flash", "deepseek-v2-lite"])
p.add_argument("--tokens", type=int, nargs="+", default=[1, 2], help="tokens a block (prefill_attn_tokens)")
p.add_argument("--chunk", type=int, default=512)
p.add_argument("--at", type=int, nargs="+", default=[0, 3584], help="the chunk's first position")
p.add_argument("--ctx", type=int, default=4128, help="the cache's positions (the evaluator's: prompt + 32)")
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--reps", type=int, default=10, help="calls a timing takes the median of")
p.add_argument("--json", help="append one kernel_sweep line per variant")
args = p.parse_args()


def timed(fn) -> float:
  ts = []
  for _ in range(args.reps):
    Device[Device.DEFAULT].synchronize()
    t = time.perf_counter()
    fn()
    Device[Device.DEFAULT].synchronize()
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


def main() -> None:
  dev = Device[Device.DEFAULT]
  for preset in args.models:
    hp = PRESETS[preset]
    H, kvl, rope, T = hp.n_heads, hp.kv_lora, hp.qk_rope, args.chunk
    scale = 1.0 / float(np.sqrt(hp.qk_nope + rope))
    rng = np.random.default_rng(0)
    cache = Tensor(rng.standard_normal((1, args.ctx, kvl + rope)).astype(np.float16)).realize()
    qc = Tensor(rng.standard_normal((T, H, kvl + rope)).astype(np.float32)).realize()
    for at in args.at:
      start = Tensor([at], dtype=dtypes.int32).realize()
      flop = native.prefill_work(T, H, kvl + rope, kvl, 1, at, 2)[0]
      calls, outs = {}, {}
      for v in args.tokens:
        jit = TinyJit(lambda q=qc, c=cache, s=start, n=kvl, f=scale, tt=v: native.prefill_attention(q, c, s, n, f,
                                                                                                  tt).realize())
        for _ in range(3): out = jit()
        outs[v], calls[v] = out.numpy(), jit
      ref = outs[args.tokens[0]]
      times: dict[int, list[float]] = {v: [] for v in args.tokens}
      for _ in range(args.rounds):  # interleaved
        for v, fn in calls.items(): times[v].append(timed(fn))
      for v, ts in times.items():
        t, err = statistics.median(ts), float(np.abs(outs[v] - ref).max() / ref.std())
        print(f"{preset:17s} at {at:5d} tokens {v} {t * 1e6:9.1f} us [{min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f}] "
              f"{flop / t / 1e12:6.1f} TFLOPS  err {err:.1e}", flush=True)
        if args.json:
          with open(args.json, "a") as fh:
            fh.write(json.dumps({
              "date": datetime.date.today().isoformat(), "kind": "kernel_sweep", "device": f"{dev.device} (tinygrad)",
              "model": f"{preset} (synthetic, exact shapes)", "layers": 0, "quant": "-",
              "kernel": "prefill_attention", "variant": f"tokens {v}",
              "name": f"mla_prefill at {at}, {T} tokens, cache {args.ctx}", "us": round(t * 1e6, 1),
              "us_min": round(min(ts) * 1e6, 1), "us_max": round(max(ts) * 1e6, 1),
              "tflops": round(flop / t / 1e12, 1), "err": err,
              "command": "python benchmarks/prefill_attention_lab.py " + " ".join(sys.argv[1:])}) + "\n")


if __name__ == "__main__":
  main()
