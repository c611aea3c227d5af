"""The native backend's decode kernels alone, at the real shapes of GLM-4.7-Flash and DeepSeek-V2-Lite Q4_0, beside a
plain read of as many bytes (what one launch of that size reaches) and the device's streaming bandwidth, all measured in
one process; with --against, the same kernels built by another version of model/backends/cuda_src.py, timed interleaved.

  python benchmarks/kernel_lab.py [--models ...] [--kinds ...] [--against OLD/model/backends/cuda_src.py] [--json
  out.jsonl] [--handoff rule|on|off] [--route ids|logits]

Kinds: the output head; the attention's norm-folded products (q_a and kv_a, q_b), the MLA absorption (k_b per head), the
MLA attention (a float16 cache of the evaluator's decode context, CTX, read from position POS; a source whose v_b
merges the splits writes them alone), v_b per head (with that merge where it has it) and the output projection with its
residual; the router; the fused MoE kernels (gate+up+SiLU over the selected experts and the
shared expert; down with the weighted combine), with float32, 8-bit and 16-bit (x16) activations. Launches run back to
back in one CUDA graph (cupy), as tinygrad's graph runs them, over enough copies of the weights (and, for the MoE
kernels, other experts each launch) that L2 holds none of a launch's weight bytes when it starts. `us`: median device
time per launch (3 timings of 5 graph replays); GB/s: the weight bytes a launch must read over that time; `err`: max
|out - the first source's out| over the std of the latter, where both write the same format (gate+up's 8-bit output for
down is not the float output of the code before it). The 8- and 16-bit MoE kernels are built as native.py builds them:
gate+up writes its output in their form and down reads it where native.handoff_rows says so (where down splits over
units; with half the rows a group, 8-bit only, where gate+up's blocks would not fit one wave), or as --handoff says.
"""
import argparse
import datetime
import importlib.machinery
import importlib.util
import inspect
import json
import statistics
import sys

import cupy as cp
import numpy as np
from tinygrad import dtypes

from model.backends import cuda_src
from model.backends.native import R_LARGE, handoff_rows
from model.presets import PRESETS
from model.quants import F32, LAYOUTS, Q4_0, QUANT_TYPES

KINDS = ["head", "norm_qa_kva", "norm_qb", "absorb", "attention", "v_b", "dense_res", "router", "glu", "down"]
CTX, POS = 256, 127  # the attention's cache (the evaluator's decode context) and the position it attends from
FLOOR = r"""
extern "C" __global__ void __launch_bounds__(256) floor_read(const uint4* __restrict__ p, unsigned long long n16,
                                                              unsigned* out) {
  const unsigned long long i = (unsigned long long)blockIdx.x * 1024 + threadIdx.x;
  unsigned acc = 0;
  uint4 v[4];
  for (int j = 0; j < 4; j++) v[j] = i + 256 * j < n16 ? p[i + 256 * j] : make_uint4(0, 0, 0, 0);
  for (int j = 0; j < 4; j++) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def load_src(path: str):
  spec = importlib.util.spec_from_file_location("other_cuda_src", path,
                                                loader=importlib.machinery.SourceFileLoader("other_cuda_src", path))
  mod = sys.modules["other_cuda_src"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
  spec.loader.exec_module(mod)
  return mod


def weight(rows: int, inp: int, ggml_type: int = Q4_0) -> list:
  """Random planes of a (rows, inp) weight of a type, on the device, in the kernels' argument order (LAYOUTS): float16
  scales as uint16 (small normal values), every other plane random bytes."""
  nb = inp // QUANT_TYPES[ggml_type].block
  return [(cp.random.standard_normal((rows, nb * (e - s) // 2), dtype=cp.float32) * 0.01).astype(cp.float16)
          .view(cp.uint16) if dt == dtypes.float16 else cp.random.randint(0, 256, (rows, nb * (e - s)), dtype=cp.uint8)
          for s, e, dt in LAYOUTS[ggml_type].values()]


def rb(inp: int, ggml_type: int = Q4_0) -> int:
  return inp // QUANT_TYPES[ggml_type].block * QUANT_TYPES[ggml_type].nbytes


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


def timed(call, launches: list) -> float:
  """Median device seconds per launch of `launches` (arg tuples of call) replayed in one CUDA graph."""
  stream = cp.cuda.Stream(non_blocking=True)
  with stream:
    for a in launches[:4]: call(*a)
    stream.begin_capture()
    for a in launches: call(*a)
    graph = stream.end_capture()
    graph.launch(stream)
    out = []
    for _ in range(5):
      s, e = cp.cuda.Event(), cp.cuda.Event()
      s.record(stream); graph.launch(stream); e.record(stream); e.synchronize()
      out.append(cp.cuda.get_elapsed_time(s, e) / 1e3 / len(launches))
  return statistics.median(out)


def floor(nbytes: int, copies: int) -> float:
  """Device seconds per launch of a plain read of nbytes (4 independent 16-byte loads a thread, one pass)."""
  fn, sink = cp.RawKernel(FLOOR, "floor_read"), cp.zeros(1, dtype=cp.uint32)
  bufs = [cp.random.randint(0, 256, nbytes, dtype=cp.uint8) for _ in range(copies)]
  return timed(lambda b: fn((-(-nbytes // 16384),), (256,), (b, np.uint64(nbytes // 16), sink)),
               [(b,) for b in bufs] * max(1, 80 // copies))


def kernels(mod, kind: str, preset: str, handoff: str, sms: int, logits: bool = False) -> list[tuple[str, object]]:
  """(activation form, kernel) of one kind built by a cuda_src module (this tree's API, or the one before staged
  inputs); handoff: the 8- and 16-bit MoE kernels' hand-off where this tree's native.handoff_rows puts it on a device
  of `sms` multiprocessors, with its rows per group (rule), wherever down can read it (on, R_LARGE), or nowhere (off).
  logits: where the module has routes (cuda_src.Route), the router writes the logits alone and gate+up and down rank
  them (native.routed_moe's kernels); else the router ranks and they read its ids."""
  hp = PRESETS[preset]
  dim, F, E, K, V, H = hp.dim, hp.expert_ffn, hp.n_experts, hp.n_used, hp.vocab, hp.n_heads
  Fs = hp.expert_ffn * hp.n_shared
  W = lambda inp, prefix="": mod.W(prefix, Q4_0, inp)
  old = "q8" in inspect.signature(mod.glu).parameters
  wave = {"sms": sms} if "sms" in inspect.signature(mod.glu).parameters else {}  # sources that size for one wave
  routed, plain = mod.FFN(W(dim), W(dim), W(F), F, E, F, 0), mod.FFN(W(dim), W(dim), W(Fs), Fs, 0, Fs, 0)
  first, nq = hp.q_lora or H * (hp.qk_nope + hp.qk_rope), H * (hp.qk_nope + hp.qk_rope)
  if kind == "head":  # with the final norm folded in where the source has it (cuda_src.head)
    return [("f32", mod.head(Q4_0, (V, dim), hp.rms_eps) if hasattr(mod, "head")
             else mod.product("dense", Q4_0, (V, dim), tn=1, n=1))]
  if kind == "norm_qa_kva":  # as native.attention builds it (sources before QKV_ROWS: 4 rows, 4 warps)
    shape = ({"warps": mod.QKV_WARPS} if hasattr(mod, "QKV_WARPS") else {}) | wave
    return [("f32", mod.dense(((W(dim, "a_"), first), (W(dim, "b_"), hp.kv_lora + hp.qk_rope)),
                              getattr(mod, "QKV_ROWS", 4), hp.rms_eps, **shape))]
  if kind == "norm_qb":
    return [("f32", mod.dense(((W(hp.q_lora, "a_"), nq),), 4, hp.rms_eps, **wave))] if hp.q_lora else []
  if kind == "absorb":
    return [("f32",
             mod.absorb_rope_kv(W(hp.qk_nope, "k_"), H, hp.qk_nope, hp.qk_rope, hp.kv_lora, 4096, hp.rms_eps, False))]
  if kind == "attention":
    return [("f32", mod.mla_attention(H, hp.kv_lora, hp.qk_rope, CTX, (hp.qk_nope + hp.qk_rope) ** -0.5, True))]
  if kind == "v_b":
    return [("f32", mod.mla_vb(W(hp.kv_lora, "w_"), H, hp.kv_lora, hp.v_head, CTX) if hasattr(mod, "mla_vb") else
             mod.product("per_head", Q4_0, (H, hp.v_head, hp.kv_lora), tn=1, n=1, heads=H))]
  if kind == "dense_res": return [("f32", mod.dense(((W(H * hp.v_head, "a_"), dim),), 2, None, residual=True, **wave))]
  how = (E, K, 2 if hp.gating == "sigmoid" else 1, hp.exp_probs_bias, hp.norm_topk, hp.routed_scale)
  route = {"route": mod.Route(*how)} if logits and hasattr(mod, "Route") else {}
  if kind == "router":  # float32 rows, as GGUF files hold ffn_gate_inp (llama.cpp's quantize leaves it unquantized)
    return [("f32", mod.router(mod.W("g_", F32, dim), hp.rms_eps, mod.Route(*how), logits_only=bool(route))
             if hasattr(mod, "Route") else mod.router(mod.W("g_", F32, dim), *how[:2], hp.rms_eps, *how[2:]))]
  out, x16 = [], not old and "x16" in inspect.getsource(mod.stage_decl)  # sources with staged 16-bit activations
  forms = getattr(mod, "HANDOFF", {"q8": 0} if hasattr(mod, "glu_q8_blocks") else {})  # the forms glu hands down
  reads = getattr(mod, "down_reads_handoff", getattr(mod, "down_reads_q8", None))
  for act in ("q8", "x16", "f32") if x16 else ("q8", "f32"):
    R = 8 if act == "q8" else 4  # the sources before staged inputs: their rows per group
    ho = (0 if old or act not in forms or handoff == "off" else handoff_rows(routed, plain, K, sms, act)
          if handoff == "rule" else R_LARGE if reads(routed, plain) else 0)
    if old:
      k = (mod.glu(routed, plain, K, dim, hp.rms_eps, R, q8=act == "q8") if kind == "glu"
           else mod.down(routed, plain, K, dim, R, q8=act == "q8"))
    elif ho:
      k = (mod.glu(routed, plain, K, dim, hp.rms_eps, ho, act, True, **wave, **route) if kind == "glu"
           else mod.down(routed, plain, K, dim, act, act, **route))
    else:
      k = (mod.glu(routed, plain, K, dim, hp.rms_eps, R_LARGE, act, **wave, **route) if kind == "glu"
           else mod.down(routed, plain, K, dim, act, **route))
    out.append((act, k))
  return out


def weight_bytes(kind: str, preset: str, head_type: int = Q4_0) -> int:
  """The weight bytes one launch of a kind must read (the output head of type head_type, every other weight Q4_0)."""
  hp = PRESETS[preset]
  dim, F, K, Fs, H = hp.dim, hp.expert_ffn, hp.n_used, hp.expert_ffn * hp.n_shared, hp.n_heads
  first, kv, nq = hp.q_lora or H * (hp.qk_nope + hp.qk_rope), hp.kv_lora + hp.qk_rope, H * (hp.qk_nope + hp.qk_rope)
  return {"head": hp.vocab * rb(dim, head_type), "norm_qa_kva": (first + kv) * rb(dim),
          "norm_qb": nq * rb(hp.q_lora) if hp.q_lora else 0, "absorb": H * hp.kv_lora * rb(hp.qk_nope),
          "attention": (POS + 1) * (hp.kv_lora + hp.qk_rope) * 2,
          "v_b": H * hp.v_head * rb(hp.kv_lora), "dense_res": dim * rb(H * hp.v_head), "router": hp.n_experts * dim * 4,
          "glu": (2 * K * F + 2 * Fs) * rb(dim), "down": (K * F + Fs) * rb(dim)}[kind]


def launches(kind: str, preset: str, head_type: int = Q4_0) -> tuple[object, object]:
  """(output array, args(k) -> launch arg tuples) of one kind: its weights over copies (and experts), allocated here;
  the output head's of type head_type."""
  hp = PRESETS[preset]
  dim, F, E, K, V, H = hp.dim, hp.expert_ffn, hp.n_experts, hp.n_used, hp.vocab, hp.n_heads
  Fs = hp.expert_ffn * hp.n_shared
  rng = np.random.default_rng(0)
  x = cp.random.standard_normal(max(dim, H * hp.v_head, K * F + Fs, H * hp.kv_lora, H * (hp.qk_nope + hp.qk_rope)),
                                dtype=cp.float32)
  gamma = cp.random.standard_normal(max(dim, hp.kv_lora, hp.q_lora), dtype=cp.float32)
  f = lambda n: cp.zeros(n, dtype=cp.float32)
  if kind == "head":
    cs = [weight(V, dim, head_type) for _ in range(2)]
    o = f(V)
    return o, lambda k: [(o, x, *([gamma] if "_norm_" in k.name else []), *c) for c in cs * 8]
  if kind in ("norm_qa_kva", "norm_qb"):
    first, kv, nq = hp.q_lora or H * (hp.qk_nope + hp.qk_rope), hp.kv_lora + hp.qk_rope, H * (hp.qk_nope + hp.qk_rope)
    shapes = [(first, dim), (kv, dim)] if kind == "norm_qa_kva" else [(nq, hp.q_lora)]
    cs = [[p for rows, inp in shapes for p in weight(rows, inp)] for _ in range(8)]
    outs = [f(rows) for rows, _ in shapes]
    return outs[0], lambda k: [(*outs, x, gamma, *c) for c in cs * 10]
  if kind == "absorb":
    cs = [weight(H * hp.kv_lora, hp.qk_nope) for _ in range(8)]
    D = hp.kv_lora + hp.qk_rope
    qc, cache, half = f(H * D), f(4096 * D), hp.qk_rope // 2
    cos, sin, pos = f(4096 * half) + 1, f(4096 * half), cp.array([100], dtype=cp.int32)
    return qc, lambda k: [(qc, cache, x, x, gamma, cos, sin, pos, *c) for c in cs * 10]
  if kind == "attention":  # float16 caches, as many splits' partials as any source may use; every source writes the
    # partials of POS's splits (older ones merged them in the same launch), so those are the output compared
    D = hp.kv_lora + hp.qk_rope
    caches = [cp.random.standard_normal(CTX * D, dtype=cp.float32).astype(cp.float16).view(cp.uint16) for _ in range(8)]
    o, part, cnt = f(H * hp.kv_lora), f(H * CTX * (hp.kv_lora + 2)), cp.zeros(H, dtype=cp.int32)
    qc, pos = cp.random.standard_normal(H * D, dtype=cp.float32) * 0.05, cp.array([POS], dtype=cp.int32)
    return part, lambda k: [(part, qc, c, pos) if "_parts_" in k.name else (o, part, cnt, qc, c, pos)
                            for c in caches * 10]
  if kind == "v_b":  # mla_vb merges the splits of position POS (positive sums)
    cs = [weight(H * hp.v_head, hp.kv_lora) for _ in range(8)]
    o, pos = f(H * hp.v_head), cp.array([POS], dtype=cp.int32)
    part = cp.abs(cp.random.standard_normal(H * CTX * (hp.kv_lora + 2), dtype=cp.float32)) + 0.1
    return o, lambda k: [(o, part, pos, *c) if "_mla_vb_" in k.name else (o, x, *c) for c in cs * 10]
  if kind == "dense_res":
    cs = [weight(dim, H * hp.v_head) for _ in range(8)]
    o, res = f(dim), cp.random.standard_normal(dim, dtype=cp.float32)
    return o, lambda k: [(o, x, res, *c) for c in cs * 10]
  bias = [f(E)] if hp.exp_probs_bias else []
  if kind == "router":
    cs = [[cp.random.standard_normal(E * dim, dtype=cp.float32) * 0.02] for _ in range(8)]
    sel, wts, logits, cnt = cp.zeros(K, dtype=cp.int32), f(K), f(E), cp.zeros(1, dtype=cp.int32)
    return logits, lambda k: [(logits, x, gamma, *c) if k.name.endswith("_logits")
                              else (sel, wts, logits, cnt, x, gamma, *bias, *c) for c in cs * 10]
  layers = [dict(g=weight(E * F, dim), u=weight(E * F, dim), d=weight(E * dim, F), sg=weight(Fs, dim),
                 su=weight(Fs, dim), sd=weight(dim, Fs))
            for _ in range(8)]
  sels = [cp.asarray(rng.choice(E, K, replace=False).astype(np.int32)) for _ in range(80)]
  wts = cp.asarray(rng.random(K).astype(np.float32))
  Ls = [layers[i % 8] for i in range(80)]
  # the routed forms rank logits of their own each launch (other experts each launch, as with sels)
  route = lambda k, i: [lgs[i], *bias] if "_route_" in k.name else [sels[i]] + ([] if kind == "glu" else [wts])
  lgs = [cp.random.standard_normal(E, dtype=cp.float32) for _ in range(80)]
  if kind == "glu":
    o, own = f(K * F + Fs), cp.zeros(K, dtype=cp.int32)
    return o, lambda k: [(o, *([own] if "_route_" in k.name else []), x, gamma, *route(k, i), *L["g"], *L["u"],
                          *L["sg"], *L["su"]) for i, L in enumerate(Ls)]
  # down's input as floats, or as glu's hand-off (random codes, scale 0.01, sum 0): 8 words a unit (q8), 16 (x16)
  o, nu = f(dim), (K * F + Fs) // 32
  hand = {w: cp.concatenate([cp.random.randint(-2**31, 2**31 - 1, nu * w, dtype=cp.int64).astype(cp.int32).view(
    cp.float32), cp.full(nu, 0.01, dtype=cp.float32), cp.zeros(nu, dtype=cp.float32)]) for w in (8, 16)}
  return o, lambda k: [(o, gamma, hand[8] if "_inq8" in k.name else hand[16] if "_inx16" in k.name else x,
                        *route(k, i), *L["d"], *L["sd"]) for i, L in enumerate(Ls)]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", nargs="+", default=["glm-4.7-flash", "deepseek-v2-lite"],
                 choices=["glm-4.7-flash", "deepseek-v2-lite"])
  p.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
  p.add_argument("--against",
                 help="another model/backends/cuda_src.py whose kernels are timed interleaved with this tree's")
  p.add_argument("--label", default="this tree", help="the name of this tree's kernels in the output")
  p.add_argument("--json", help="append one JSON line per kernel")
  p.add_argument("--handoff", choices=["rule", "on", "off"], default="rule",
                 help="the 8- and 16-bit hand-off from gate+up to down: where native.handoff_rows would put it, "
                 "wherever down can read it, or nowhere")
  p.add_argument("--route", choices=["ids", "logits"], default="ids",
                 help="the MoE kernels of sources that can route from the logits: reading the router's ids, or "
                 "ranking its logits themselves (with the logits-only router), as native.routed_moe runs them")
  args = p.parse_args()
  srcs = {args.label: cuda_src} | ({f"against {args.against}": load_src(args.against)} if args.against else {})
  bw, sms = bandwidth(), cp.cuda.Device().attributes["MultiProcessorCount"]
  dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
  print(f"{dev}: streaming bandwidth {bw:.0f} GB/s", flush=True)
  for preset in args.models:
    for kind in args.kinds:
      logits = args.route == "logits"
      built = {name: kernels(mod, kind, preset, args.handoff, sms, logits) for name, mod in srcs.items()}
      if not built[args.label]: continue
      nbytes = weight_bytes(kind, preset)
      fl = floor(nbytes, 2 if nbytes > 64 << 20 else 8)  # before the kind's own buffers exist
      out, make = launches(kind, preset)
      print(f"{preset:17s} {kind:11s} {'plain read':34s} {fl * 1e6:8.2f} us {nbytes / fl / 1e9:6.0f} GB/s "
            f"({nbytes / fl / 1e9 / bw:5.1%})  {nbytes / 1e6:.2f} MB", flush=True)
      calls, first = {}, {}
      for name, ks in built.items():
        for act, k in ks:
          fn = cp.RawKernel(k.src, k.name, options=("--std=c++17",))
          call = lambda *a, fn=fn, k=k: fn(k.grid, (getattr(k, "threads", cuda_src.THREADS), 1, 1), a)
          ls = make(k)
          call(*ls[0]); cp.cuda.Device().synchronize()
          o = cp.asnumpy(out).astype(np.float64)
          # compared where the formats and inputs match (mla_vb reads the splits' partials, an older v_b a float input;
          # the routed MoE kernels choose their experts from logits, the others take random ids)
          ref = first.setdefault((act, "_outq8" in k.name or "_inq8" in k.name, "_mla_vb_" in k.name,
                                  "_route_" in k.name), o)
          calls[(name, act)] = (call, ls, fn, k, float(np.abs(o - ref).max() / (ref.std() or 1.0)))
      times: dict[tuple[str, str], list[float]] = {}
      for _ in range(3):  # the sources interleaved
        for key, (call, ls, *_) in calls.items(): times.setdefault(key, []).append(timed(call, ls))
      for (name, act), ts in times.items():
        t, (_, _, fn, k, err) = statistics.median(ts), calls[(name, act)]
        print(f"{preset:17s} {kind:11s} {act + ' ' + name[:30]:34s} {t * 1e6:8.2f} us {nbytes / t / 1e9:6.0f} GB/s "
              f"({nbytes / t / 1e9 / bw:5.1%}) [{min(ts) * 1e6:.2f}-{max(ts) * 1e6:.2f}] regs {fn.num_regs} grid "
              f"{k.grid} err {err:.1e}  {k.name}", flush=True)
        if args.json:
          with open(args.json, "a") as fh:
            fh.write(json.dumps({"date": datetime.date.today().isoformat(), "kind": "kernel_lab",
                                 "device": f"{dev} (CUDA, cupy graph)", "model": f"{preset} (synthetic, exact shapes)",
                                 "layers": 0, "quant": "Q4_0", "kernel": kind, "act": act, "source": name,
                                 "name": k.name, "us": round(t * 1e6, 2), "us_min": round(min(ts) * 1e6, 2),
                                 "us_max": round(max(ts) * 1e6, 2), "gb_s": round(nbytes / t / 1e9),
                                 "bandwidth_gb_s": round(bw), "bandwidth_share": round(nbytes / t / 1e9 / bw, 4),
                                 "floor_us": round(fl * 1e6, 2), "regs": fn.num_regs, "err": err,
                                 "command": "python benchmarks/kernel_lab.py " + " ".join(sys.argv[1:])}) + "\n")
      cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
  main()
