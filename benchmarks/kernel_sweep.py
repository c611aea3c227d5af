"""The native decode kernels' launch shapes swept, at the real shapes of GLM-4.7-Flash and DeepSeek-V2-Lite Q4_0: the
router's rows per group and warps (ROUTER_R, ROUTER_WARPS), the MLA attention's positions per block and per warp
(ATT_CHUNK, ATT_BATCH), the residual and norm-folded products' rows per group, warps, staged reads and activations
(f32, or 8 bits per 32: q8), the output head's input form and rows per group (of each of --head-types), and the MoE
kernels (gate+up and down: moe()). Each variant is built from this tree's model/backends/cuda_src.py with those
constants or arguments and timed as benchmarks/kernel_lab.py times a kernel (median of 3 interleaved timings of one CUDA
graph of launches over weights L2 does not hold).

  PYTHONPATH=. python benchmarks/kernel_sweep.py [--kinds router attention dense_res glu down head ...]
    [--head-types Q4_0 Q8_0 ...] [--json out.jsonl]
"""
import argparse
import datetime
import json
import statistics
import sys

import cupy as cp

from benchmarks import kernel_lab as L
from model.backends import cuda_src as C
from model.presets import PRESETS
from model.quants import F32, Q4_0, QUANT_TYPES


def build(fn, consts: dict, *a, **kw):
  """fn's kernel built with cuda_src's module constants set to consts (and restored)."""
  saved = {k: getattr(C, k) for k in consts}
  for k, v in consts.items(): setattr(C, k, v)
  try: return fn.__wrapped__(*a, **kw)
  finally:
    for k, v in saved.items(): setattr(C, k, v)


def route(hp) -> C.Route:
  """The routed stack's ranking, as the preset's router makes it."""
  return C.Route(hp.n_experts, hp.n_used, 2 if hp.gating == "sigmoid" else 1, hp.exp_probs_bias, hp.norm_topk,
                 hp.routed_scale)


def moe(preset: str, sms: int) -> dict[str, dict[str, object]]:
  """gate+up (glu) over rows per group, warps a block (WARPS), the register floor of a one-wave grid (GLU_REGS) and the
  8- and 16-bit hand-off (h: 32 outputs a block), and down in each activation form, from floats or from the hand-off
  (in), over its rows a block (DOWN_ROWS), each ranking the router's logits as native.routed_moe's kernels do."""
  hp = PRESETS[preset]
  W = lambda inp: C.W("", Q4_0, inp)
  dim, F, E, K, Fs = hp.dim, hp.expert_ffn, hp.n_experts, hp.n_used, hp.expert_ffn * hp.n_shared
  routed, plain = C.FFN(W(dim), W(dim), W(F), F, E, F, 0), C.FFN(W(dim), W(dim), W(Fs), Fs, 0, Fs, 0)
  rt = route(hp)
  glu = lambda act, R, w, regs, ho: build(C.glu, {"WARPS": w, "GLU_REGS": regs}, routed, plain, K, dim, hp.rms_eps, R,
                                          act, ho, sms, rt)
  shapes = ((4, 4, 128), (2, 4, 128), (8, 4, 128), (4, 8, 128), (2, 8, 128), (8, 2, 128), (4, 2, 128), (4, 4, 80),
            (2, 4, 80), (8, 4, 168))
  out = {"glu": {f"{a}R{R}w{w}r{regs}": glu(a, R, w, regs, False) for a in ("q8", "f32") for R, w, regs in shapes}}
  out["glu"] |= {f"x16R{R}w{w}r{regs}": glu("x16", R, w, regs, False) for R, w, regs in ((4, 4, 128), (2, 8, 128))}
  forms = [("f32", "f32"), ("q8", "f32"), ("x16", "f32")]
  if C.down_reads_handoff(routed, plain):
    out["glu"] |= {f"{a}hR{R}r{regs}": glu(a, R, 4, regs, True) for a in ("q8", "x16")
                   for R, regs in ((4, 128), (8, 128), (2, 128), (8, 168), (4, 80), (2, 40))}
    forms += [("q8", "q8"), ("x16", "x16")]
  # rows a block: DOWN_ROWS (8 rows, and rows above 256 threads with a float input)
  out["down"] = {f"{a}{'in' if i != 'f32' else ''}r{rows[0]}-{rows[1]}": build(C.down, {"DOWN_ROWS": rows}, routed,
                                                                             plain, K, dim, a, i, rt)
                 for a, i in forms for rows in ((8, 16), (4, 8), (8, 8), (16, 32))}
  return out


def head(preset: str, ggml_type: int) -> dict[str, object]:
  """The output head of a type over its input's form (x16 and q8 where the type has integer codes) and rows per group
  (single_token_form's, for a wide product): the product alone, and with the final norm folded in (cuda_src.head:
  norm-prefixed, x staged once a block)."""
  hp = PRESETS[preset]
  acts = ("x16", "q8", "f32") if C.UNITS[ggml_type].idot else ("f32",)
  form = lambda a, R: {"single_token_form": lambda t, rows, a=a, R=R: (a, R)}
  out = {f"{a}R{R}": build(C.product, form(a, R), "dense", ggml_type, (hp.vocab, hp.dim), tn=1, n=1)
         for a in acts for R in (8, 4, 16)}
  return out | {f"norm{a}R{R}": C.dense(((C.W("a_", ggml_type, hp.dim), hp.vocab),), R, hp.rms_eps, act=a)
                for a in acts for R in (8, 4, 16)}


def variants(preset: str, sms: int) -> dict[str, dict[str, object]]:
  hp = PRESETS[preset]
  W = lambda inp, p="": C.W(p, Q4_0, inp)
  H, dim = hp.n_heads, hp.dim
  first, kv, nq = hp.q_lora or H * (hp.qk_nope + hp.qk_rope), hp.kv_lora + hp.qk_rope, H * (hp.qk_nope + hp.qk_rope)
  out = {
    "router": {f"R{R}w{w}": build(C.router, {"ROUTER_R": R, "ROUTER_WARPS": w}, C.W("g_", F32, dim), hp.rms_eps,
                                  route(hp))
               for R, w in ((2, 4), (1, 4), (1, 2), (1, 1), (2, 2), (2, 1), (4, 4), (1, 8), (2, 8))},
    "attention": {f"ch{ch}b{b}": build(C.mla_attention, {"ATT_CHUNK": ch, "ATT_BATCH": b}, H, hp.kv_lora, hp.qk_rope,
                                       L.CTX, (hp.qk_nope + hp.qk_rope) ** -0.5, True)
                  for ch in (32, 64, 128) for b in (4, 2, 8)},
    "dense_res": {f"R{R}w{w}s{s}{a}": build(C.dense, {"STAGED_READS": s}, ((W(H * hp.v_head, "a_"), dim),), R,
                                            None, True, w, a)
                  for R, w, s, a in ((2, 4, 16, "f32"), (2, 4, 16, "q8"), (4, 4, 24, "q8"), (2, 8, 16, "q8"),
                                     (1, 8, 16, "q8"), (4, 8, 24, "q8"), (1, 4, 16, "q8"), (2, 2, 16, "q8"))},
    "norm_qa_kva": {f"R{R}w{w}{a}": build(C.dense, {"STAGED_READS": 24}, ((W(dim, "a_"), first), (W(dim, "b_"), kv)),
                                          R, hp.rms_eps, False, w, a)
                    for R, w, a in ((2, 8, "f32"), (2, 8, "q8"), (4, 4, "q8"), (2, 4, "q8"), (4, 8, "q8"),
                                    (1, 8, "q8"))},
  }
  if hp.q_lora:
    out["norm_qb"] = {f"R{R}w{w}{a}": build(C.dense, {"STAGED_READS": 24}, ((W(hp.q_lora, "a_"), nq),), R,
                                            hp.rms_eps, False, w, a)
                      for R, w, a in ((4, 4, "f32"), (4, 4, "q8"), (2, 4, "q8"), (2, 8, "q8"), (4, 8, "q8"),
                                      (8, 4, "q8"), (1, 4, "q8"))}
  return out | moe(preset, sms)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--kinds", nargs="+", default=["router", "attention", "dense_res", "norm_qa_kva", "norm_qb"])
  p.add_argument("--head-types", nargs="+", default=["Q4_0"], choices=[QUANT_TYPES[t].name for t in C.UNITS],
                 help="the output head's weight types (kind head)")
  p.add_argument("--json", help="append one JSON line per variant")
  args = p.parse_args()
  types = {q.name: t for t, q in QUANT_TYPES.items()}
  dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
  sms = cp.cuda.Device().attributes["MultiProcessorCount"]
  for preset in ("glm-4.7-flash", "deepseek-v2-lite"):
    heads = [("head", types[n], head(preset, types[n])) for n in args.head_types] if "head" in args.kinds else []
    for kind, wt, ks in heads + [(k, Q4_0, ks) for k, ks in variants(preset, sms).items() if k in args.kinds]:
      nbytes = L.weight_bytes(kind, preset, wt)
      out, make = L.launches(kind, preset, wt)
      calls = {}
      for label, k in ks.items():
        fn = cp.RawKernel(k.src, k.name, options=("--std=c++17",))
        calls[label] = (lambda *a, fn=fn, k=k: fn(k.grid, (k.threads, 1, 1), a), make(k), k, fn)
      times: dict[str, list[float]] = {}
      for _ in range(3):
        for label, (call, ls, _, _) in calls.items(): times.setdefault(label, []).append(L.timed(call, ls))
      for label, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        t, (_, _, k, fn) = statistics.median(ts), calls[label]
        print(f"{preset:17s} {kind:11s} {QUANT_TYPES[wt].name:5s} {label:12s} {t * 1e6:7.2f} us "
              f"[{min(ts) * 1e6:.2f}-{max(ts) * 1e6:.2f}] "
              f"{nbytes / t / 1e9:5.0f} GB/s regs {fn.num_regs} grid {k.grid} threads {k.threads}", flush=True)
        if args.json:
          with open(args.json, "a") as fh:
            fh.write(json.dumps({"date": datetime.date.today().isoformat(), "kind": "kernel_sweep",
                                 "device": f"{dev} (CUDA, cupy graph)", "model": f"{preset} (synthetic, exact shapes)",
                                 "layers": 0, "quant": QUANT_TYPES[wt].name, "kernel": kind, "variant": label,
                                 "name": k.name,
                                 "us": round(t * 1e6, 2), "us_min": round(min(ts) * 1e6, 2),
                                 "us_max": round(max(ts) * 1e6, 2), "regs": fn.num_regs, "grid": list(k.grid),
                                 "threads": k.threads,
                                 "command": "python benchmarks/kernel_sweep.py " + " ".join(sys.argv[1:])}) + "\n")
      cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
  main()
