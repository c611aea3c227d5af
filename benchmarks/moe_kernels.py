"""The native backend's fused MoE kernels (gate+up+SiLU `glu`, down + combine `down`) alone, at the real shapes of
GLM-4.7-Flash and DeepSeek-V2-Lite Q4_0, against the device's streaming bandwidth measured in the same process.

  python benchmarks/moe_kernels.py [--rows-per-group 1 2 4] [--against OTHER_cuda_src.py] [--json out.jsonl]

Each launch reads a different layer's copy of the weights (8 copies, other experts selected each time), as a decode step
does, so L2 holds none of a launch's weights when it starts; launches run back to back inside one CUDA graph (cupy), as
tinygrad's graph runs them. `us`: device time per launch (median of 5 replays of 80 launches); GB/s: the weight bytes a
launch must read (the selected experts' rows and the shared expert's) over that time. --against: the same kernels from
another version of model/backends/cuda_src.py, timed interleaved with this one, outputs compared.
"""
import argparse
import datetime
import importlib.machinery
import importlib.util
import json
import statistics
import sys

import cupy as cp
import numpy as np

from model.backends import cuda_src
from model.presets import PRESETS
from model.quants import Q4_0, QUANT_TYPES

COPIES, PER_REPLAY, REPLAYS = 8, 80, 5
Q = QUANT_TYPES[Q4_0]


def load_src(path: str):
  spec = importlib.util.spec_from_file_location("other_cuda_src", path, loader=importlib.machinery.SourceFileLoader("other_cuda_src", path))
  mod = sys.modules["other_cuda_src"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
  spec.loader.exec_module(mod)
  return mod


def weight(rows: int, inp: int) -> list:
  """Random Q4_0 planes (d: float16 scales as uint16, qs: codes) of a (rows, inp) weight, on the device."""
  nb = inp // Q.block
  d = (cp.random.standard_normal((rows, nb), dtype=cp.float32) * 0.01).astype(cp.float16).view(cp.uint16)
  return [d, cp.random.randint(0, 256, (rows, nb * 16), dtype=cp.uint8)]


def bandwidth() -> float:
  """GB/s of a float32 sum over 1 GiB (read once), median of 5."""
  a = cp.ones(1 << 28, dtype=cp.float32)
  a.sum()
  times = []
  for _ in range(5):
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record(); a.sum(); e.record(); e.synchronize()
    times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
  return a.nbytes / statistics.median(times) / 1e9


def timed(fn, launches: list) -> float:
  """Median device seconds per launch of `launches` (arg tuples of fn) replayed in one CUDA graph."""
  stream = cp.cuda.Stream(non_blocking=True)
  with stream:
    for a in launches[:COPIES]: fn(*a)  # compile and warm
    stream.begin_capture()
    for a in launches: fn(*a)
    graph = stream.end_capture()
    graph.launch(stream)
    out = []
    for _ in range(REPLAYS):
      s, e = cp.cuda.Event(), cp.cuda.Event()
      s.record(stream); graph.launch(stream); e.record(stream); e.synchronize()
      out.append(cp.cuda.get_elapsed_time(s, e) / 1e3 / len(launches))
  return statistics.median(out)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows-per-group", type=int, nargs="+", default=[4], help="R: output rows per row group")
  p.add_argument("--against", help="another cuda_src.py to time interleaved and compare outputs with")
  p.add_argument("--q8", action="store_true", help="also time the kernels with 8-bit activations (integer dot products)")
  p.add_argument("--models", nargs="+", default=["glm-4.7-flash", "deepseek-v2-lite"], choices=["glm-4.7-flash", "deepseek-v2-lite"])
  p.add_argument("--json", help="append one JSON line per kernel and source")
  args = p.parse_args()
  srcs = {"current": (cuda_src, False)} | ({"current-q8": (cuda_src, True)} if args.q8 else {})
  srcs |= {"against": (load_src(args.against), False)} if args.against else {}
  bw = bandwidth()
  dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
  print(f"{dev}: streaming bandwidth {bw:.0f} GB/s", flush=True)
  rng = np.random.default_rng(0)
  for preset in args.models:
    hp = PRESETS[preset]
    dim, F, E, K, Fs = hp.dim, hp.expert_ffn, hp.n_experts, hp.n_used, hp.expert_ffn * hp.n_shared
    layers = [dict(g=weight(E * F, dim), u=weight(E * F, dim), d=weight(E * dim, F), sg=weight(Fs, dim), su=weight(Fs, dim), sd=weight(dim, Fs))
              for _ in range(COPIES)]
    x, gamma = cp.random.standard_normal(dim, dtype=cp.float32), cp.random.standard_normal(dim, dtype=cp.float32)
    act = cp.random.standard_normal(K * F + Fs, dtype=cp.float32)
    sels = [cp.asarray(rng.choice(E, K, replace=False).astype(np.int32)) for _ in range(PER_REPLAY)]
    wts = cp.asarray(rng.random(K).astype(np.float32))
    glu_bytes = (2 * K * F + 2 * Fs) * dim // Q.block * Q.nbytes
    down_bytes = (K * dim * F + dim * Fs) // Q.block * Q.nbytes
    for R in args.rows_per_group:
      results: dict[tuple[str, str], list[float]] = {}
      outs: dict[tuple[str, str], np.ndarray] = {}
      kernels = {}
      for name, (mod, q8) in srcs.items():
        W = lambda inp, m=mod: m.W("", Q4_0, inp)
        routed = mod.FFN(W(dim), W(dim), W(F), F, E, F, 0)
        plain = mod.FFN(W(dim), W(dim), W(Fs), Fs, 0, Fs, 0)
        q = {"q8": True} if q8 else {}
        for kind, k in (("glu", mod.glu(routed, plain, K, dim, hp.rms_eps, R, **q)), ("down", mod.down(routed, plain, K, dim, R, **q))):
          fn = cp.RawKernel(k.src, k.name, options=("--std=c++17",))
          kernels[(name, kind)] = (fn, k)
      calls = {}
      for name in srcs:
        for kind in ("glu", "down"):
          fn, k = kernels[(name, kind)]
          out = cp.zeros(K * F + Fs if kind == "glu" else dim, dtype=cp.float32)
          Ls = [layers[i % COPIES] for i in range(PER_REPLAY)]
          if kind == "glu": launches = [(out, x, gamma, sel, *L["g"], *L["u"], *L["sg"], *L["su"]) for L, sel in zip(Ls, sels, strict=True)]
          else: launches = [(out, x, act, sel, wts, *L["d"], *L["sd"]) for L, sel in zip(Ls, sels, strict=True)]
          call = lambda *a, fn=fn, k=k: fn(k.grid, (cuda_src.THREADS, 1, 1), a)
          call(*launches[0]); cp.cuda.Device().synchronize()
          outs[(name, kind)] = cp.asnumpy(out)
          calls[(name, kind)] = (call, launches)
      for _ in range(3):  # the sources interleaved
        for key, (call, launches) in calls.items(): results.setdefault(key, []).append(timed(call, launches))
      for (name, kind), ts in results.items():
        t = statistics.median(ts)
        nbytes = glu_bytes if kind == "glu" else down_bytes
        diff = ""
        if name != "current":
          ref = outs[("current", kind)]
          diff = f"  max |diff| vs current {np.abs(outs[(name, kind)] - ref).max() / np.abs(ref).max():.1e} (rel)"
        print(f"{preset:17s} {kind:4s} R={R} {name:8s} {t * 1e6:7.2f} us [{min(ts) * 1e6:.2f}-{max(ts) * 1e6:.2f}] "
              f"{nbytes / t / 1e9:7.0f} GB/s ({nbytes / t / 1e9 / bw:5.1%}) grid {kernels[(name, kind)][1].grid}{diff}", flush=True)
        if args.json:
          with open(args.json, "a") as f:
            f.write(json.dumps({"date": datetime.date.today().isoformat(), "kind": "moe_kernel", "device": f"{dev} (CUDA, cupy graph)",
                                "model": f"{preset} (synthetic, exact shapes)", "layers": 0, "quant": "Q4_0", "kernel": kind,
                                "source": name, "rows_per_group": R, "us": round(t * 1e6, 2), "gb_s": round(nbytes / t / 1e9),
                                "bandwidth_gb_s": round(bw), "bandwidth_share": round(nbytes / t / 1e9 / bw, 4),
                                "command": "python benchmarks/moe_kernels.py " + " ".join(sys.argv[1:])}) + "\n")
    layers.clear(); calls.clear()
    cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
  main()
