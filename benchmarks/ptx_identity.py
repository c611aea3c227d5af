"""Whether the native backend's kernels compile to the same code as another version of the source: every kernel variant
of cuda_src's builders over the tiny, tiny-lite, GLM-4.7-Flash and DeepSeek-V2-Lite shapes (the per-type kernels in all
8 types and their activation forms at the tiny shapes, Q4_0 and Q4_K at the real ones) compiled to PTX for sm_90 with
NVRTC on the CPU (the nvidia-cuda-nvrtc-cu12 wheel), plain and in the step timeline's build (cuda_src.stamped).

  PYTHONPATH=<the other checkout> python benchmarks/ptx_identity.py --dump before.json   # the version to compare with
  PYTHONPATH=. python benchmarks/ptx_identity.py before.json [--only substring]

prints a line per kernel: its builder call, same/different, and the PTX instruction counts before -> after. Comments,
the compiler's header and the kernel's name are left out of the comparison; NVRTC does not always give one source the
same PTX (an instruction more or less, in a few large kernels), so a kernel counts as different only where RETRIES
compiles all differ. A kernel whose PTX differs is one to time on the GPU (benchmarks/kernel_lab.py --against).
"""
import argparse
import ctypes
import glob
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

from model.backends import cuda_src as C
from model.presets import PRESETS
from model.quants import F32, Q4_0, Q4_K

ARCH = "sm_90"
CTX = 256  # the KV cache's positions (the evaluator's decode context)
RETRIES = 6  # compiles of a kernel whose PTX differs before it counts as different


def variants() -> dict[str, tuple]:
  """{label: (builder, args, kwargs)} of every kernel compared."""
  out: dict[str, tuple] = {}
  def add(fn, *args, **kw):  # the calls the builder takes (an assertion refuses the rest)
    try: fn(*args, **kw)
    except AssertionError: return
    out[f"{fn.__name__}{args!r}{kw!r}".replace(" ", "")] = (fn.__name__, args, kw)
  for preset, types in (("tiny", list(C.UNITS)), ("tiny-lite", list(C.UNITS)), ("glm-4.7-flash", [Q4_0, Q4_K]),
                        ("deepseek-v2-lite", [Q4_0, Q4_K])):
    hp = PRESETS[preset]
    dim, H, kvl, rope, nope, E, K, F = (hp.dim, hp.n_heads, hp.kv_lora, hp.qk_rope, hp.qk_nope, hp.n_experts, hp.n_used,
                                        hp.expert_ffn)
    Fs, eps, V = F * hp.n_shared, hp.rms_eps, 16384 if preset.startswith("tiny") else hp.vocab  # tiny: a wide head
    first, nq = hp.q_lora or H * (nope + rope), H * (nope + rope)
    for cache_half in (True, False): add(C.mla_attention, H, kvl, rope, CTX, (nope + rope) ** -0.5, cache_half)
    gating = 2 if hp.gating == "sigmoid" else 1
    for bias, gate, forced in ((hp.exp_probs_bias, gating, False), (hp.exp_probs_bias, gating, True), (False, 3, False),
                               (False, 4, False)):
      route = C.Route(E, K, gate, bias, hp.norm_topk, hp.routed_scale, forced)
      for logits_only in (False, True): add(C.router, C.W("g_", F32, dim), eps, route, logits_only)
    for t in types:
      W = lambda inp, prefix="", t=t: C.W(prefix, t, inp)
      ok = lambda *ns, t=t: all(C.supported(t, n) for n in ns)
      acts = ("f32", "q8", "x16") if C.UNITS[t].idot else ("f32",)
      if ok(dim):
        add(C.product, "dense", t, (first, dim), tn=1, n=1)
        add(C.product, "dense", t, (first, dim), tn=8, n=13)
        add(C.product, "expert", t, (E, F, dim), experts=E, k=K, xk=1, slots=K)
        add(C.rows, t, (V, dim), 3)
        add(C.head, t, (V, dim), eps)
        add(C.router, W(dim, "g_"), eps, C.Route(E, K, gating, hp.exp_probs_bias, hp.norm_topk, hp.routed_scale))
      if ok(kvl):
        add(C.product, "per_head", t, (H, hp.v_head, kvl), tn=1, n=1, heads=H)
        add(C.product, "per_head", t, (H, hp.v_head, kvl), tn=8, n=11, heads=H)
        add(C.mla_vb, W(kvl, "w_"), H, kvl, hp.v_head, CTX)
      if ok(F): add(C.product, "expert", t, (E, dim, F), experts=E, k=K, xk=K, slots=K)
      if ok(nope):
        for half in (True, False): add(C.absorb_rope_kv, W(nope, "k_"), H, nope, rope, kvl, CTX, eps, half)
      routed, plain = C.FFN(W(dim), W(dim), W(F), F, E, F, 0), C.FFN(W(dim), W(dim), W(Fs), Fs, 0, 2 * Fs, Fs)
      route = C.Route(E, K, gating, hp.exp_probs_bias, hp.norm_topk, hp.routed_scale)
      for act in acts:
        if ok(dim):
          for warps in (C.WARPS, C.QKV_WARPS):
            add(C.dense, ((W(dim, "a_"), first), (W(dim, "b_"), kvl + rope)), C.QKV_ROWS, eps, warps=warps, act=act,
                sms=132)
        if hp.q_lora and ok(hp.q_lora): add(C.dense, ((W(hp.q_lora, "a_"), nq),), 4, eps, act=act, sms=132)
        if ok(H * hp.v_head): add(C.dense, ((W(H * hp.v_head, "a_"), dim),), 2, None, residual=True, act=act, sms=132)
        if not ok(dim, F, Fs): continue
        for r, p, rt in ((routed, plain, None), (routed, plain, route), (None, plain, None), (routed, None, None)):
          k = K if r else 0
          add(C.glu, r, p, k, dim, eps, 4, act, False, 132, rt)
          add(C.down, r, p, k, dim, act, "f32", rt)
          if act in C.HANDOFF and C.down_reads_handoff(r, p):
            for R in (2, 4):
              if C.handoff_warps((r or p).gate.group_lanes, R) >= 1:
                add(C.glu, r, p, k, dim, eps, R, act, True, 132, rt)
            add(C.down, r, p, k, dim, act, act, rt)
  return out


def nvrtc():
  """libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel (or the system's)."""
  import nvidia.cuda_nvrtc
  libs = glob.glob(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib", "libnvrtc.so*")) or ["libnvrtc.so"]
  return ctypes.CDLL(sorted(libs)[0])


def ptx(src: str) -> str:
  """src compiled for ARCH, as tinygrad's NVRTC compiler compiles it."""
  lib, prog = nvrtc(), ctypes.c_void_p()
  assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
  opts = [f"--gpu-architecture={ARCH}".encode()]
  rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
  size = ctypes.c_size_t()
  if rc:
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    raise RuntimeError(log.value.decode())
  lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
  buf = ctypes.create_string_buffer(size.value)
  lib.nvrtcGetPTX(prog, buf)
  lib.nvrtcDestroyProgram(ctypes.byref(prog))
  return buf.value.decode()


def normal(p: str, name: str) -> str:
  """PTX without comments, the compiler's header lines and the kernel's name."""
  lines = [ln.split("//")[0].rstrip() for ln in p.splitlines()]
  header = (".version", ".target", ".address_size")
  return "\n".join(ln.replace(name, "KERNEL") for ln in lines if ln.strip() and not ln.startswith(header))


def instructions(p: str) -> int:
  """PTX instructions: statements inside the kernel's body that are not declarations or labels."""
  return sum(1 for ln in p.splitlines() if re.match(r"\s+[@a-z]", ln) and not re.match(r"\s+\.(reg|shared|local)", ln))


def compiled(label: str) -> dict:
  fn, args, kw = VARIANTS[label]
  k = getattr(C, fn)(*args, **kw)
  return {"name": k.name, "ptx": normal(ptx(k.src), k.name), "stamped": normal(ptx(C.stamped(k.src)), k.name)}


VARIANTS = variants()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("before", nargs="?", help="the dump to compare with")
  ap.add_argument("--dump", help="write this tree's PTX here instead")
  ap.add_argument("--only", default="", help="the variants whose label contains this")
  ap.add_argument("--jobs", type=int, default=os.cpu_count())
  a = ap.parse_args()
  if not (a.before or a.dump): ap.error("a dump to compare with, or --dump")
  labels = [k for k in VARIANTS if a.only in k]
  with ProcessPoolExecutor(a.jobs) as pool: got = dict(zip(labels, pool.map(compiled, labels), strict=True))
  if a.dump:
    with open(a.dump, "w") as f: json.dump(got, f)
    print(f"{len(got)} kernels -> {a.dump}")
    return
  with open(a.before) as f: before = json.load(f)
  differ = 0
  for label, now in got.items():
    if label not in before:
      print(f"{label} {now['name']}: not in {a.before}")
      continue
    was = before[label]
    same = was["ptx"] == now["ptx"] and was["stamped"] == now["stamped"]
    for _ in range(RETRIES if not same else 0):  # NVRTC's output varies between compiles of one source now and then
      if same := (now := compiled(label)) == was: break
    differ += not same
    print(f"{now['name']} {label}: {'same' if same else 'different'} {instructions(was['ptx'])}->"
          f"{instructions(now['ptx'])} (stamped {instructions(was['stamped'])}->{instructions(now['stamped'])})")
  print(f"{len(got) - differ} of {len(got)} kernels compile to the same PTX")
  sys.exit(1 if differ else 0)


if __name__ == "__main__":
  main()
