"""The native backend (model/backends/native.py). Everywhere: the space offers native only on CUDA, a model asked to
build it elsewhere refuses with a message, every kernel a model builds compiles with NVRTC, and each kernel runs alone
on the CPU through the CUDA emulator (tests/native_cpu.py; tests/test_native_model.py runs them in a model). Where it
runs (tinygrad's CUDA device: DEV=CUDA on an NVIDIA GPU): each product equals the tensor backend's at small shapes and
at GLM-4.7-Flash's widths, every native knob value (backends and fused stages) passes tests/knobcheck.py's proof on the
tiny preset and on the 2-layer GLM-4.7-Flash file in each quant mix, the JIT batch size of a CUDA study changes the
decode step's graphs, and the BEAM limits its kernels.
"""
from __future__ import annotations

import os
import platform
import re
import sys
import types
from multiprocessing.pool import ThreadPool

import numpy as np
import pytest
from knobcheck import check_knob, check_process_setting, decode, gguf, mix_info
from native_cpu import ALL_NATIVE, TOKENS_EMU, launch_kernel, model_kernels, native_on_cpu
from products import TYPES, check_products, kernel_weight
from tinygrad import Context, Device, Tensor, Variable
from tinygrad.device import CompileError
from tinygrad.uop.ops import Ops

from evaluator.gate import rel_err, tolerance
from model.backends import catalog, cuda_graph, cuda_prefill, cuda_src, native, registry
from model.deepseek2 import Transformer
from model.generate import Generator, jit_kernels
from model.gguf_file import GGUFFile
from model.quants import QUANT_TYPES
from model.structure import ConfigError, StructureConfig
from space.knobs import ModelInfo, knobs, single_knob_changes

needs_cuda = pytest.mark.skipif(not native.available(),
                                reason="native kernels run on tinygrad's CUDA device: DEV=CUDA on an NVIDIA GPU")
TOKENS = tuple((7919 * i + 17) % 1000 for i in range(16))
MIXES = ("q4_0", "q8_0", "q4_k_m", "f16")  # every type the issue names: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (q4_k_m) and F16


def native_changes(info: ModelInfo) -> list[tuple[str, StructureConfig]]:
  return [(label, cfg) for label, cfg in single_knob_changes(info, "CUDA") if label.endswith("=native")]


def test_space_offers_native_only_on_cuda() -> None:
  info = mix_info("q4_k_m")
  for device, offered in (("CPU", False), ("METAL", False), ("CUDA", True), ("CUDA:1", True)):
    domains = [k.choices for k in knobs(info, device) if k.name.startswith("backend.")]
    assert domains and all(("native" in c) == offered for c in domains), device
  assert catalog.get("native").quants >= {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16"}


def nvrtc(arch: str):
  """tinygrad's NVRTC compiler for `arch`, from the system's CUDA or the nvidia-cuda-nvrtc-cu12 wheel
  (tests/conftest.py)."""
  try:
    from tinygrad.runtime.support.compiler_cuda import NVRTCCompiler
    return NVRTCCompiler(arch)
  except Exception as e:  # noqa: BLE001 - no NVRTC here: what is missing is reported
    why = f"NVRTC is not available ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc-cu12"
    if os.environ.get("CI") and sys.platform == "linux" and platform.machine() == "x86_64":
      pytest.fail(why + " (a dev dependency here)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def glm_shape(tmp_path_factory):
  """mix -> a 2-layer GLM-4.7-Flash-shaped file whose weights are holes (zeros): a model of its shape builds the same
  kernels as with random weights, and the file is written in a moment (random weights: 1.7 GB of writes)."""
  from model import synth
  def hole(fout, t, seed: int) -> None:
    fout.seek(synth._nbytes(t) - 1, os.SEEK_CUR)
    fout.write(b"\0")
  paths: dict[str, str] = {}
  def get(mix: str) -> str:
    if mix not in paths:
      with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synth, "_write_tensor", hole)
        paths[mix] = str(synth.write_synthetic(tmp_path_factory.mktemp("glm") / f"glm2-{mix}.gguf", "glm", layers=2,
                                               quant=mix))
    return paths[mix]
  return get


TYPE_NAMES = "|".join(sorted((q.name.lower() for q in QUANT_TYPES.values()), key=len, reverse=True))


def kind(name: str) -> str:
  """A kernel's role and variant: its name with its weight types and sizes left out."""
  return re.sub(r"\d+", "#", re.sub(TYPE_NAMES, "T", name))


def test_native_sources_compile_for_ampere_and_hopper(glm_shape, gguf_file, monkeypatch) -> None:
  """Every native kernel a decode step of GLM-4.7-Flash's shape builds (Q4_0 and the Q4_K_M mix, all stages fused, with
  float and integer activations, and the per-op products), of the tiny-lite preset (direct q, softmax router, two shared
  experts), the multi-token products of each type and the prompt's kernels, compiles with NVIDIA's runtime compiler as
  tinygrad compiles it on the GPU: every distinct source for sm_90, and one of each kind (role and variant) for sm_80
  and in the step timeline's build (STAMP), which differ from sm_90 only in the preprocessor branches of the helpers
  (cuda/common.cuh). Two threads compile at once (NVRTC compiles separate programs concurrently); this runs on any Linux
  machine."""
  hopper, ampere = (nvrtc(arch) for arch in ("sm_90", "sm_80"))
  kernels = [k
             for path,
             cfg in ((glm_shape("q4_0"), ALL_NATIVE), (glm_shape("q4_0"), ALL_NATIVE | {"ffn_act": "q8", "attn_act":
                                                                                            "q8"}),
                     (glm_shape("q4_0"), ALL_NATIVE | {"attn_layout": "all_heads"}),
                     (glm_shape("q4_k_m"), ALL_NATIVE),
                     (glm_shape("q4_k_m"), ALL_NATIVE | {"ffn_act": "x16", "attn_act": "q8"}), (
                 gguf_file("tiny-lite", "q4_0"), ALL_NATIVE), (
                     glm_shape("q4_k_m"), StructureConfig(
                         backends={f"{q}:{r}": "native" for q in ("Q4_K", "Q5_K", "Q6_K", "Q8_0") for r in (
                             "dense", "expert")})))
             for k in model_kernels(path, StructureConfig.from_dict(cfg) if isinstance(cfg, dict)
                                    else cfg, monkeypatch)]
  kernels += [cuda_src.product(role, t, shape, **dims) for t in cuda_src.UNITS
              for role, shape, dims in (("dense", (1536, 2048), {"tn": 8, "n": 13}),
                                        ("per_head", (20, 512, 256), {"tn": 8, "n": 11, "heads": 20}))]
  # the prompt's: products of three stage widths and tiles, the attention and its merge
  kernels += [cuda_prefill.grouped(TYPES[t], 4, 64, inp, tile, 3) for t, inp, tile in (("Q4_K", 256, 64),
                                                                                      ("Q6_K", 256, 16),
                                                                                      ("Q8_0", 96, 32))]
  kernels += cuda_prefill.mla_prefill(20, 512, 64, 2048, 0.1, True, 8)
  names = {k.name.split("_")[1] for k in kernels}
  assert {"dense", "per", "expert", "mla", "router", "glu", "down", "rows", "grouped"} <= names, names
  sources = {k.src: k for k in kernels}.values()  # each source once: the configs share most of their kernels
  for k in sources: assert re.search(rf"void __launch_bounds__\({k.threads}(, \d+)?\) {k.name}\(", k.src), k.name
  kinds = {kind(k.name): k for k in sources}.values()
  jobs = ([(hopper, k.src, k.name) for k in sources] + [(ampere, k.src, k.name) for k in kinds]
          + [(hopper, cuda_src.stamped(k.src), f"{k.name} (stamped)") for k in kinds])
  def error(job: tuple) -> str | None:
    compiler, src, what = job
    try: return None if compiler.compile(src) else f"{what}: no PTX for {compiler.arch}"
    except CompileError as e: return f"{what} for {compiler.arch}: {e}"
  with ThreadPool(2) as pool: failed = [e for e in pool.map(error, jobs) if e]
  assert not failed, "\n".join(failed)


@pytest.mark.parametrize("preset", ["tiny", "tiny-lite"])
def test_router_and_moe_in_one_in_the_cpu_emulator(gguf_file, monkeypatch, preset: str) -> None:
  """Where the router and MoE stages are both native, a block runs them as one (native.routed_moe: the router kernel
  writes the logits alone, gate+up and down rank them), and computes what the router kernel and the moe stage compute
  from the router's ids, with its own routing and with forced ids (the correctness check), with the same own top k and
  logits. Where only the router is native, its kernel ranks them."""
  path = gguf_file(preset, "q4_0")
  names = lambda cfg: [k.name for k in model_kernels(path, StructureConfig.from_dict(cfg), monkeypatch)]
  joint, alone = names(ALL_NATIVE), names({"fused": {"router": "native"}})
  assert any(n.startswith("native_router_") and n.endswith("_logits") for n in joint), joint
  assert sum("_route_" in n for n in joint) == 2 and not any("_route_" in n for n in alone), (joint, alone)
  assert any(n.startswith("native_router_") and not n.endswith("_logits") for n in alone), alone
  monkeypatch.undo()
  rng = np.random.default_rng(1)
  with native_on_cpu(monkeypatch):
    m = Transformer(gguf(path), StructureConfig.from_dict(ALL_NATIVE), max_context=16)
    blk, K = next(b for b in m.blocks if b.moe), m.hp.n_used
    router, moe = blk.router_in, blk.moe_in  # what the stages receive (model/stages.py)
    h = Tensor(rng.standard_normal((1, 1, m.hp.dim)).astype(np.float32))
    for forced in (None, Tensor(np.arange(K, dtype=np.int32)[::-1].copy().reshape(1, 1, K))):
      out, own, logits = native.routed_moe(router, moe, h, forced)
      sel, wts, own_r, logits_r = native.router(router, h, forced)
      np.testing.assert_array_equal(own.numpy(), own_r.numpy())
      np.testing.assert_array_equal(logits.numpy(), logits_r.numpy())
      np.testing.assert_allclose(out.numpy(), native.moe(moe, h, sel, wts, logits_r).numpy(), rtol=1e-5, atol=1e-6)


def _glu_case(t: int, seed: int, dim: int, F: int, E: int, Fs: int) -> tuple:
  """A routed stack (E experts, F wide) and a plain FFN (Fs wide) of weight type t on a dim-wide input, their gate and
  up weights (routed, then plain; kernel planes and dequantized), and an input and its norm's gamma drawn from seed."""
  rng, W = np.random.default_rng(seed), lambda inp: cuda_src.W("", t, inp)
  routed, plain = cuda_src.FFN(W(dim), W(dim), W(F), F, E, F, 0), cuda_src.FFN(W(dim), W(dim), W(Fs), Fs, 0, Fs, 0)
  gate_up = [kernel_weight(t, s, i) for i, s in enumerate([(E, F, dim), (E, F, dim), (Fs, dim), (Fs, dim)])]
  x, gamma = rng.standard_normal(dim).astype(np.float32), rng.standard_normal(dim).astype(np.float32)
  return routed, plain, gate_up, x, gamma


@pytest.mark.parametrize("act,handoff", [("f32", False), ("q8", False), ("q8", True)])
def test_glu_runs_a_block_per_row_block(act: str, handoff: bool) -> None:
  """gate+up's grid is one row with a block for each of its FFNs' row blocks, the plain FFN's first: no block without
  rows where the routed slots are narrower than the shared experts (DeepSeek-V2-Lite: 1408 against 2816)."""
  W = lambda: cuda_src.W("", TYPES["Q4_0"], 2048)
  routed, plain = cuda_src.FFN(W(), W(), W(), 1408, 64, 1408), cuda_src.FFN(W(), W(), W(), 2816)
  k = cuda_src.glu(routed, plain, 6, 2048, 1e-6, native.R_LARGE, act, handoff)
  rows = 32 if handoff else cuda_src.rows_per_block(32, native.R_LARGE)
  assert k.grid == (2816 // rows + 6 * 1408 // rows, 1, 1), k.grid
  assert "blockIdx.y" not in k.src and f"by = blockIdx.x < {2816 // rows} ? 6 : " in k.src


@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_q8_kernels_compute_the_dsl_twins_rounding(quant: str) -> None:
  """ffn_act=q8: the native glu and down kernels (in the emulator) equal float products of the activations rounded by
  the dsl twin's q8_round. Down reads its input as given, so it matches to float rounding; glu normalises first, and a
  value whose norm differs by an ulp may round to the neighbouring 8-bit step (one element of one row: ~1e-3 of the
  row). K-quants in units of 32, one scale (and min) group each (cuda_src.IUNITS), as the activations' units."""
  from model.backends.dsl import q8_round
  t, dim, F, E, K, Fs = TYPES[quant], 256, *((64, 8, 2, 128) if quant in ("Q4_0", "Q8_0") else (256, 8, 2, 256))
  routed, plain, ((g, gw), (u, uw), (sg, sgw), (su, suw)), x, gamma = _glu_case(t, 3, dim, F, E, Fs)
  (d, dw), (sd, sdw) = kernel_weight(t, (E, dim, F), 5), kernel_weight(t, (dim, Fs), 6)
  sel, wts = np.array([3, 7], np.int32), np.array([0.6, 0.4], np.float32)
  q8 = lambda v: q8_round(Tensor(v.astype(np.float32))).numpy().astype(np.float64)
  k = cuda_src.glu(routed, plain, K, dim, 1e-5, act="q8")
  act = np.zeros(K * F + Fs, np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [act, x, gamma, sel, *g, *u, *sg, *su])
  xn = q8(x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * gamma)
  silu = lambda a: a * 0.5 * (1 + np.tanh(a / 2))  # SiLU, without exp overflowing on large K-quant sums
  want = np.concatenate([silu(gw[e] @ xn) * (uw[e] @ xn) for e in sel] + [silu(sgw @ xn) * (suw @ xn)])
  assert rel_err(act[None], want[None]).max() < 3e-3
  k = cuda_src.down(routed, plain, K, dim, act="q8")
  out = np.zeros(dim, np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [out, x, act, sel, wts, *d, *sd])
  want = x + sum(wk * (dw[e] @ q8(act[i * F:(i + 1) * F])) for i, (e, wk) in enumerate(zip(
    sel, wts, strict=True))) + sdw @ q8(act[K * F:])
  assert rel_err(out[None], want[None]).max() < 1e-5
  f32 = cuda_src.down(routed, plain, K, dim)
  launch_kernel(f32.src, f32.name, f32.grid, (f32.threads, 1, 1), [out, x, act, sel, wts, *d, *sd])
  assert rel_err(out[None], want[None]).max() > 1e-4, "q8 activations compute what float32 ones do"


@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_x16_glu_holds_its_input_to_16_bits(quant: str) -> None:
  """ffn_act=x16: glu stages its normalised input as two 8-bit planes and dots both with the codes in integers. It stays
  within 2e-3 of the float products (it measures 3-4e-4 here; the float32 form 3e-6, the 8-bit one 5-8e-2, and one
  plane alone would be as far), and is not the float32 form's arithmetic."""
  t, dim, F, E, K, Fs = TYPES[quant], 256, 64, 8, 2, 128
  routed, plain, ((g, gw), (u, uw), (sg, sgw), (su, suw)), x, gamma = _glu_case(t, 4, dim, F, E, Fs)
  sel = np.array([5, 1], np.int32)
  xf = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * gamma
  silu = lambda a: a * 0.5 * (1 + np.tanh(a / 2))  # SiLU, without exp overflowing on large K-quant sums
  glu = lambda v: np.concatenate([silu(gw[e] @ v) * (uw[e] @ v) for e in sel] + [silu(sgw @ v) * (suw @ v)])
  got = {}
  for form in ("x16", "f32"):
    k = cuda_src.glu(routed, plain, K, dim, 1e-5, act=form)
    got[form] = np.zeros(K * F + Fs, np.float32)
    launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [got[form], x, gamma, sel, *g, *u, *sg, *su])
  assert rel_err(got["x16"][None], glu(xf)[None]).max() < 2e-3
  assert rel_err(got["f32"][None], glu(xf)[None]).max() < 1e-5
  assert (got["x16"] != got["f32"]).mean() > 0.5, "x16 activations compute what float32 ones do"


@pytest.mark.parametrize("form", ["q8", "x16"])
@pytest.mark.parametrize("quant,Fs,R", [("Q4_0", 128, 4), ("Q8_0", 64, 4), ("Q4_0", 0, 4), ("Q4_0", 128, 2),
                                        ("Q4_K", 256, 4), ("Q5_K", 256, 4), ("Q6_K", 256, 4)])
def test_glu_hands_down_its_output(quant: str, Fs: int, R: int, form: str) -> None:
  """With 8- or 16-bit activations, glu writes its output as down reads it (q8: words of codes, scales and sums per 32;
  x16: words of codes, words of remainders, scales and float sums): the values it holds are the dsl twin's rounding of
  the float output (q8_round, x16_round), and down computes from them what it computes from the floats in that form;
  also with R rows a group of 2 (blocks of twice the warps: native.handoff_rows)."""
  from model.backends.dsl import act_round
  t, rng, dim, F, E, K = TYPES[quant], np.random.default_rng(9), 256, 64 if quant in ("Q4_0", "Q8_0") else 256, 8, 2
  W = lambda inp: cuda_src.W("", t, inp)
  routed, plain = (cuda_src.FFN(W(dim), W(dim), W(F), F, E, F, 0), Fs
                   and cuda_src.FFN(W(dim), W(dim), W(Fs), Fs, 0, Fs, 0) or None)
  (g, _), (u, _), (d, dw) = (kernel_weight(t, (E, F, dim), 1), kernel_weight(t, (E, F, dim), 2),
                             kernel_weight(t, (E, dim, F), 3))
  (sg, _), (su, _), (sd, sdw) = ((kernel_weight(t, s, i) for i, s in ((4, (Fs, dim)), (5, (Fs, dim)), (6, (dim, Fs))))
                                 if Fs else (([], None),) * 3)
  x, gamma = rng.standard_normal(dim).astype(np.float32), rng.standard_normal(dim).astype(np.float32)
  sel, wts = rng.choice(E, K, replace=False).astype(np.int32), rng.random(K).astype(np.float32)
  assert cuda_src.down_reads_handoff(routed, plain)
  floats, units = np.zeros(K * F + Fs, np.float32), (K * F + Fs) // 32
  k = cuda_src.glu(routed, plain, K, dim, 1e-5, act=form)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [floats, x, gamma, sel, *g, *u, *sg, *su])
  packed = np.zeros(units * cuda_src.HANDOFF[form], np.float32)
  k = cuda_src.glu(routed, plain, K, dim, 1e-5, R, act=form, handoff=True)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [packed, x, gamma, sel, *g, *u, *sg, *su])
  codes = lambda at: packed[at * units:(at + 8) * units].view(np.int8).reshape(units, 32).astype(np.float64)
  if form == "q8":
    scales = packed[units * 8:units * 9].astype(np.float64)
    assert (codes(0).sum(1) == packed[units * 9:].view(np.int32)).all()
    act = (codes(0) * scales[:, None]).reshape(-1)
  else:
    scales = packed[units * 16:units * 17].astype(np.float64)
    np.testing.assert_allclose(packed[units * 17:], floats.reshape(units, 32).sum(1), rtol=1e-5, atol=1e-6)
    act = ((codes(0) + codes(8) / 254) * scales[:, None]).reshape(-1)
  twin = act_round(form)(Tensor(floats)).numpy()
  assert rel_err(act[None], twin[None]).max() < 1e-5
  out, direct = np.zeros(dim, np.float32), np.zeros(dim, np.float32)
  for buf, act_in, inp in ((out, form, packed), (direct, "f32", floats)):
    k = cuda_src.down(routed, plain, K, dim, form, act_in)
    launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [buf, x, inp, sel, wts, *d, *sd])
  want = x + sum(wk * (dw[e] @ act[i * F:(i + 1) * F]) for i, (e, wk) in enumerate(zip(sel, wts, strict=True))) + (
    sdw @ act[K * F:] if Fs else 0)
  # x16 applies Q4_0's code offset through the float sum of the output, not of its 16-bit form (quantize_x16)
  assert rel_err(out[None], want[None]).max() < (1e-5 if form == "q8" else 1e-3)
  assert rel_err(out[None], direct[None]).max() < 1e-5


def test_handoff_rows_follow_one_wave() -> None:
  """glu hands down its 8- or 16-bit output where down splits over units (not with a plain FFN of another type than
  the experts'): with R_LARGE rows a group where its 32-output blocks fit two to a multiprocessor (GLM-4.7-Flash's 240
  on a 132-multiprocessor card), else 8-bit with R_SMALL, blocks of twice the warps (DeepSeek-V2-Lite's 352: 6 experts
  of 1408 and 2816 shared outputs), and 16-bit not at all; blocks of fewer warps (rows of fewer units) fit more to a
  multiprocessor, as the bound glu asks ptxas for says. down then sums 8 rows a block from the hand-off, 16 from floats
  (DOWN_ROWS: DeepSeek-V2-Lite's 384 threads)."""
  from model.presets import PRESETS
  def ffns(preset: str, plain_t: int = TYPES["Q4_0"]) -> tuple:
    hp, W = PRESETS[preset], lambda t, inp: cuda_src.W("", t, inp)
    F, Fs, q = hp.expert_ffn, hp.expert_ffn * hp.n_shared, TYPES["Q4_0"]
    return (cuda_src.FFN(W(q, hp.dim), W(q, hp.dim), W(q, F), F, hp.n_experts, F, 0),
            cuda_src.FFN(W(plain_t, hp.dim), W(plain_t, hp.dim), W(plain_t, Fs), Fs, 0, Fs, 0), hp.n_used)
  for form in ("q8", "x16"):
    assert native.handoff_rows(*ffns("glm-4.7-flash"), 132, form) == native.R_LARGE
    assert native.handoff_rows(*ffns("glm-4.7-flash", TYPES["Q8_0"]), 132, form) == 0
  ds = ffns("deepseek-v2-lite")
  assert native.handoff_rows(*ds, 132, "q8") == native.R_SMALL and native.handoff_rows(*ds, 132, "x16") == 0
  assert native.handoff_rows(*ds, 200, "q8") == native.R_LARGE == native.handoff_rows(*ds, 200, "x16")
  k = cuda_src.glu(*ds, 2048, 1e-6, native.R_SMALL, "q8", True, 132)
  assert k.grid == (352, 1, 1) and k.threads == 512, (k.grid, k.threads)
  for act_in, blocks in (("q8", 256), ("f32", 128)):
    k = cuda_src.down(*ds[:2], 6, 2048, "q8", act_in)
    assert k.grid == (blocks, 1, 1) and k.threads == 384, (act_in, k.grid, k.threads)
  # rows of 512 inputs: 16 units, groups of 16 lanes, so glu's blocks of 32 outputs are 4 warps, 4 to a multiprocessor
  W = lambda inp: cuda_src.W("", TYPES["Q4_0"], inp)
  small = lambda k: (cuda_src.FFN(W(512), W(512), W(64), 64, 8, 64, 0), cuda_src.FFN(W(512), W(512), W(64), 64, 0, 64,
                                                                                       0), k)
  assert native.handoff_rows(*small(1), 1, "q8") == native.R_LARGE
  assert native.handoff_rows(*small(2), 1, "q8") == native.R_SMALL
  k = cuda_src.glu(*small(1), 512, 1e-5, native.R_LARGE, "q8", True, 1)
  assert k.threads == 128 and "__launch_bounds__(128, 4)" in k.src


def test_glu_and_dense_ask_for_one_wave(monkeypatch) -> None:
  """On a 132-multiprocessor card, glu and the attention's dense products ask ptxas for as many resident blocks as one
  wave of their grid needs, where that leaves a thread GLU_REGS (DENSE_REGS) registers: GLM-4.7-Flash's 16-bit gate+up
  (480 blocks of 128 threads) 4, DeepSeek-V2-Lite's q_a/kv_a (384 of 256) 3, GLM-4.7-Flash's (96) nothing, a grid no
  bound brings to one wave nothing; without a device count, nothing."""
  monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
  from benchmarks import kernel_lab
  bounds = lambda k: re.search(r"__launch_bounds__\(([\d, ]+)\)", k.src).group(1)
  for sms, glu, qkv_ds, qkv_glm in ((132, "128, 4", "256, 3", "256"), (0, "128", "256", "256")):
    built = lambda kind, preset, sms=sms: dict(kernel_lab.kernels(cuda_src, kind, preset, "off", sms))
    assert bounds(built("glu", "glm-4.7-flash")["x16"]) == glu
    assert bounds(built("norm_qa_kva", "deepseek-v2-lite")["f32"]) == qkv_ds
    assert bounds(built("norm_qa_kva", "glm-4.7-flash")["f32"]) == qkv_glm
  assert cuda_src.one_wave(480, 128, 132, cuda_src.GLU_REGS) == 4
  assert cuda_src.one_wave(1232, 128, 132, cuda_src.GLU_REGS) == 1, "no one wave at 128 registers: no bound"
  assert cuda_src.one_wave(100, 128, 132, cuda_src.GLU_REGS) == 1


@pytest.mark.parametrize("handoff,glm,deepseek", [("rule", (256, 256), (512, 0)), ("on", (256, 256), (256, 256)),
                                                   ("off", (0, 0), (0, 0))])
def test_kernel_lab_builds_the_handoff_as_asked(monkeypatch, handoff: str, glm: tuple, deepseek: tuple) -> None:
  """benchmarks/kernel_lab.py --handoff: its 8- and 16-bit MoE kernels hand off where this tree's rule puts it on a
  132-multiprocessor card, with its rows a group (rule: DeepSeek-V2-Lite's 8-bit gate+up in blocks of 16 warps, its
  16-bit not at all), wherever down can read it (on, 8 warps), or nowhere (off); its float kernels never. glm and
  deepseek: the 8- and 16-bit gate+up's threads a block with the hand-off (0: none). cupy is not imported here: the lab
  only builds sources."""
  monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
  from benchmarks import kernel_lab
  for preset, threads in (("glm-4.7-flash", glm), ("deepseek-v2-lite", deepseek)):
    glu, down = (dict(kernel_lab.kernels(cuda_src, kind, preset, handoff, 132)) for kind in ("glu", "down"))
    for form, t in zip(("q8", "x16"), threads, strict=True):
      assert (f"_out{form}" in glu[form].name, f"_in{form}" in down[form].name) == (t > 0, t > 0), (preset, handoff)
      assert not t or glu[form].threads == t, (preset, handoff, glu[form].threads)
    assert "_out" not in glu["f32"].name and "_in" not in down["f32"].name


def test_kernel_lab_builds_the_routed_forms_as_asked(monkeypatch) -> None:
  """benchmarks/kernel_lab.py --route logits: the router writes the logits alone and gate+up and down rank them, in
  every activation form, as native.routed_moe runs them; --route ids: the router ranks and they read its ids."""
  monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
  from benchmarks import kernel_lab
  for preset in ("glm-4.7-flash", "deepseek-v2-lite"):
    for logits in (False, True):
      router, = (k for _, k in kernel_lab.kernels(cuda_src, "router", preset, "rule", 132, logits))
      assert router.name.endswith("_logits") == logits, router.name
      for kind in ("glu", "down"):
        ks = dict(kernel_lab.kernels(cuda_src, kind, preset, "rule", 132, logits))
        assert set(ks) == {"f32", "q8", "x16"} and all(("_route_" in k.name) == logits for k in ks.values()), ks


@pytest.mark.parametrize("n,G", [(1, 32), (2, 32), (8, 32), (16, 32), (32, 32), (4, 8), (8, 8)])
def test_lane_sums_scatter_each_sum_over_its_group(n: int, G: int) -> None:
  """lane_sums: after the butterfly, lane l of each group of G holds the group's sum of accs[k(l)], every lane of a
  warp."""
  sums, k = cuda_src.lane_sums([f"a[{i}]" for i in range(n)], "lane", G)
  src = (cuda_src.PRELUDE + f'extern "C" __global__ void ls(float* out, int* idx, const float* x) {{ const int lane = '
         'threadIdx.x & 31;'
         f" float a[{n}]; for (int i = 0; i < {n}; i++) a[i] = x[threadIdx.x * {n} + i]; {sums} out[threadIdx.x] = "
         f"lsum; idx[threadIdx.x] = {k}; }}")
  x = np.random.default_rng(n * G).standard_normal((64, n)).astype(np.float32)
  out, idx = np.zeros(64, np.float32), np.zeros(64, np.int32)
  launch_kernel(src, "ls", (1, 1, 1), (64, 1, 1), [out, idx, x])
  lanes = np.arange(64)
  assert (idx == lanes % 32 % n if n == 1
          else idx == np.array([int(f"{lane % n:0{n.bit_length() - 1}b}"[::-1], 2) for lane in lanes])).all()
  want = x.reshape(64 // G, G, n).sum(1)[lanes // G, idx]
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("routed_t,plain_t,Fs,layout", [("Q4_0", "Q4_0", 64, "units"), ("Q8_0", "Q8_0", 128, "units"),
                                                        ("Q4_0", "Q8_0", 64, "slots"), ("Q4_0", "Q4_0", 96, "slots"),
                                                        (None, "Q4_0", 160, "units")])
def test_down_layouts(routed_t: str | None, plain_t: str, Fs: int, layout: str) -> None:
  """down splits its work over (slot, unit) pairs where the plain FFN's down weight has the routed one's type and a
  multiple of its width (the shared experts of DeepSeek-V2-Lite: twice it), else a warp per slot; both compute res + the
  weighted routed products + the plain one (a dense block's FFN alone too), float32, 8-bit and 16-bit (x16), in the
  emulator: x16 within 1e-3 of the float products (it measures 0.9-1.7e-4 here)."""
  from model.backends.dsl import q8_round
  rng, dim, F, E, K = np.random.default_rng(5), 256, 64, 8, 3
  rt, pt = routed_t and TYPES[routed_t], TYPES[plain_t]
  routed = rt and cuda_src.FFN(cuda_src.W("", rt, dim), cuda_src.W("", rt, dim), cuda_src.W("", rt, F), F, E, F, 0)
  plain = cuda_src.FFN(cuda_src.W("", pt, dim), cuda_src.W("", pt, dim), cuda_src.W("", pt, Fs), Fs, 0, Fs, 0)
  (d, dw), (sd, sdw) = kernel_weight(rt or pt, (E, dim, F), 1), kernel_weight(pt, (dim, Fs), 2)
  k_ = K if routed else 0
  x, act = rng.standard_normal(dim).astype(np.float32), rng.standard_normal(k_ * F + Fs).astype(np.float32)
  sel, wts = rng.choice(E, K, replace=False).astype(np.int32), rng.random(K).astype(np.float32)
  outs = {}
  for form, tol in (("f32", 1e-5), ("q8", 1e-5), ("x16", 1e-3)):
    q = (lambda v: q8_round(Tensor(v)).numpy().astype(np.float64)) if form == "q8" else (lambda v: v.astype(np.float64))
    want = x + sdw @ q(act[k_ * F:]) + (sum(wk * (dw[e] @ q(act[i * F:(i + 1) * F])) for i, (e, wk) in enumerate(zip(
      sel, wts, strict=True)))
                                       if routed else 0)
    k = cuda_src.down(routed, plain, k_, dim, form)
    assert k.name.endswith("_slots") == (layout == "slots"), k.name
    out = np.zeros(dim, np.float32)
    launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [out, x, act, *([sel, wts, *d] if routed else []), *sd])
    assert rel_err(out[None], want[None]).max() < tol, (form, k.name)
    outs[form] = out.copy()
  assert (outs["x16"] != outs["f32"]).mean() > 0.5, "x16 activations compute what float32 ones do"


@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0"])
def test_dense_products_with_8bit_staged_input(quant: str) -> None:
  """cuda_src.dense with act q8 (the form benchmarks/kernel_sweep.py times): the residual product is res + W . x with x
  rounded by the dsl's q8_round, to float rounding; the norm-folded one W . rmsnorm(x) * gamma so rounded, up to a value
  one 8-bit step apart (glu's bound); neither computes what the float32 form does."""
  from model.backends.dsl import q8_round
  t, rng, inp, rows = TYPES[quant], np.random.default_rng(6), 256, 96
  w, wd = kernel_weight(t, (rows, inp), 7)
  x, res, gamma = (rng.standard_normal(inp if n != 1 else rows).astype(np.float32) for n in range(3))
  q8 = lambda v: q8_round(Tensor(v.astype(np.float32))).numpy().astype(np.float64)
  xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * gamma
  for eps, extra, want, tol in ((None, res, res + wd @ q8(x), 1e-5), (1e-5, gamma, wd @ q8(xn), 3e-3)):
    got = {}
    for act in ("q8", "f32"):
      k = cuda_src.dense(((cuda_src.W("a_", t, inp), rows),), 2, eps, residual=eps is None, act=act)
      got[act] = np.zeros(rows, np.float32)
      launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [got[act], x, extra, *w])
    assert rel_err(got["q8"][None], want[None]).max() < tol, (eps, k.name)
    assert (got["q8"] != got["f32"]).mean() > 0.5, "8-bit input computes what float32 input does"


def test_staged_float_input_is_padded_where_a_row_group_reads_it() -> None:
  """The float32 input a decode kernel stages in shared memory has 4 floats of padding after every 32 (sx_at), written
  and read at the same places, so the lanes of a row group, a unit apart, read different banks; gate+up's float form
  stages it unpadded (it reads each value for several rows). The emulator tests check the values these kernels
  compute."""
  t, dim = TYPES["Q4_0"], 256
  W = lambda inp, p="": cuda_src.W(p, t, inp)
  padded = [(160, cuda_src.dense(((W(160, "a_"), dim),), 2, None, residual=True)),
            (dim, cuda_src.dense(((W(dim, "a_"), 96), (W(dim, "b_"), 40)), cuda_src.QKV_ROWS, 1e-5,
                                 warps=cuda_src.QKV_WARPS)),
            (dim, cuda_src.router(W(dim, "g_"), 1e-5, cuda_src.Route(8, 2, 2, True, True, 1.0))),
            (dim, cuda_src.product("dense", t, (96, dim), tn=1, n=1))]
  routed = cuda_src.FFN(W(dim), W(dim), W(64), 64, 8, 64, 0)
  for n, k, pad in [(n, k, True) for n, k in padded] + [(dim, cuda_src.glu(routed, None, 2, dim, 1e-5), False)]:
    assert f"float sx[{n + n // 8 if pad else n}]" in k.src, k.name
    writes, reads = k.src.split("*(float4*)(sx + ")[1:], k.src.split("*(const float4*)(sx + ")[1:]
    assert writes and reads, k.name
    assert all((">> 5) * 4)" in a.split(";")[0]) == pad for a in writes + reads), k.name


def test_decode_kernels_issue_their_weight_reads_before_their_first_barrier() -> None:
  """The latency-bound decode kernels (gate+up, down, the norm-folded and residual products, the single-token products,
  the router) read their weights as weak streaming loads (__ldcs) before the block's first barrier, and
  their input from shared memory after it (down: glu's 8-bit output, or float32 read after the barrier). The compiler
  moves neither a weak load below a barrier nor a shared read above it, so every weight read of a lane is in flight
  before its first product waits on memory; read-only loads it did sink below the products."""
  t, dim, F = TYPES["Q4_0"], 256, 64
  W = lambda inp, p="": cuda_src.W(p, t, inp)
  routed = cuda_src.FFN(W(dim), W(dim), W(F), F, 8, F, 0)
  ks = [cuda_src.glu(routed, None, 2, dim, 1e-5, act=act)
        for act in ("f32", "q8")] + [cuda_src.glu(routed, None, 2, dim, 1e-5, 4, "q8", True)]
  ks += [cuda_src.dense(((W(dim, "a_"), 96), (W(dim, "b_"), 40)), 4, 1e-5),
         cuda_src.dense(((W(160, "a_"), dim),), 2, None, residual=True)]
  ks += [cuda_src.product("per_head", t, (4, 64, 128), tn=1, n=1, heads=4),
         cuda_src.product("dense", t, (96, dim), tn=1, n=1)]
  ks += [cuda_src.router(W(dim, "g_"), 1e-5, cuda_src.Route(8, 2, 2, True, True, 1.0))]
  downs = [cuda_src.down(routed, None, 2, dim, "q8", act_in) for act_in in ("f32", "q8")]
  for k in ks + downs:
    branches = [b for b in k.src[k.src.index(k.name):].split("if (blockIdx.y") if "__ldcs(" in b]  # a weight per branch
    assert branches, k.name
    for body in branches:
      barrier = body.index("__syncthreads")
      assert "__ldcs(" not in body[barrier:], k.name
      if k not in downs: assert ("sxq" if "_q8" in k.name else "sx") in body[barrier:], k.name
  assert "sxq" in downs[1].src[downs[1].src.index("__syncthreads"):]


def test_down_issues_its_weight_reads_before_its_wait() -> None:
  """down's rows follow the router's choice, two kernels back: it reads the choice (`early_sel`, cuda_src.EARLY; or the
  router's logits, `early_logits`, and ranks them) and issues every weight read (the unit split: its loads; a warp per
  slot: L2 prefetches) before its only GRID_WAIT, so they are in flight while gate+up finishes; with forced ids it waits
  first. gate+up's output, the routing weights and the residual are read after it
  (test_down_layouts and test_fused_stages_in_the_cpu_emulator run it in the CPU emulator, which faults a read of them
  before it)."""
  t, dim, F = TYPES["Q4_0"], 256, 64
  W = lambda inp: cuda_src.W("", t, inp)
  routed = cuda_src.FFN(W(dim), W(dim), W(F), F, 8, F, 0)
  shared = cuda_src.FFN(W(dim), W(dim), W(F), F)
  odd = cuda_src.FFN(W(dim), W(dim), W(96), 96)  # a shared expert of 96 rows: a warp per slot
  route = cuda_src.Route(8, 2, 2, True, True, 1.8)
  for how in (None, route):  # the router's ids, or its logits ranked by down itself (`early_logits`)
    units = [cuda_src.down(routed, shared, 2, dim, "q8", "q8", how),
             cuda_src.down(routed, None, 2, dim, "f32", route=how)]
    slots = cuda_src.down(routed, odd, 2, dim, route=how)
    assert "_slots" in slots.name and not any("_slots" in k.name for k in units)
    for k, reads in [(k, "__ldcs(") for k in units] + [(slots, "PREFETCH(")]:
      body = k.src[k.src.index(k.name):]
      assert body.count(cuda_src.WAIT) == 1, k.name
      before, after = body.split(cuda_src.WAIT)
      assert reads in before and reads not in after and ("early_logits" if how else "early_sel") in before, k.name
      assert not any(f"{p}[" in before or f"{p} +" in before for p in ("act", "wts", "swt", "res")), k.name
  # forced ids (the correctness check) come from outside the graph's chain: that form waits before any read
  forced = cuda_src.down(routed, shared, 2, dim, "q8", "q8", cuda_src.Route(8, 2, 2, True, True, 1.8, True))
  body = forced.src[forced.src.index(forced.name):]
  assert "#define ROUTE_LOGITS early_logits" in forced.src  # route_rank.cuh's read of the logits
  assert body.index(cuda_src.WAIT) < min(body.index("ROUTE_LOGITS +"), body.index("force["), body.index("__ldcs("))


@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"])
def test_rows_dequantize_the_selected_rows(quant: str) -> None:
  """The embedding lookup (cuda_src.rows): each selected row of the weight as gguf dequantizes it, in one kernel of a
  thread per unit; an id outside the weight reads its nearest row."""
  t, V, inp = TYPES[quant], 5, 512
  planes, w = kernel_weight(t, (V, inp), 11)
  ids = np.array([3, 0, 4, 9, -2], np.int32)
  k = cuda_src.rows(t, (V, inp), len(ids))
  out = np.zeros((len(ids), inp), np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [out, ids, *planes])
  want = w[np.clip(ids, 0, V - 1)]
  assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max(), quant


@pytest.mark.parametrize("quant,form,rows", [("Q4_0", "x16", 16), ("Q8_0", "x16", 8), ("Q4_K", "f32", 8),
                                            ("Q6_K", "f32", 8)])
def test_wide_products_read_x_as_two_8bit_planes(quant: str, form: str, rows: int) -> None:
  """A single-token product of WIDE rows or more (the output head) reads x as two 8-bit planes per 32 where the type has
  integer codes: x kept to 1/64516 of each unit's largest value, so its products stay within 1e-3 of the float product's
  std (an outlier 40x the others included), where 8 bits alone are off by about 3e-2; at its type's rows per group."""
  t, rng, inp = TYPES[quant], np.random.default_rng(7), 256
  assert cuda_src.single_token_form(t, cuda_src.WIDE - 1) == ("f32", cuda_src.R_PRODUCT)
  assert cuda_src.single_token_form(t, cuda_src.WIDE) == (form, rows)
  planes, w = kernel_weight(t, (cuda_src.WIDE, inp), 3)
  x = rng.standard_normal(inp).astype(np.float32)
  x[5] = 40.0
  k = cuda_src.product("dense", t, (cuda_src.WIDE, inp), tn=1, n=1)
  assert k.name.endswith("_x16") == (form == "x16"), k.name
  out = np.zeros(cuda_src.WIDE, np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [out, x, *planes])
  want = w @ x.astype(np.float64)
  err = np.abs(out - want).max() / want.std()
  assert err < (1e-3 if form == "x16" else 1e-5), err


@pytest.mark.parametrize("quant,rows,form", [("Q4_0", cuda_src.WIDE, "x16"), ("Q8_0", cuda_src.WIDE, "x16"),
                                             ("Q4_K", cuda_src.WIDE, "f32"), ("Q4_0", 96, "f32")])
def test_the_head_folds_the_final_norm(quant: str, rows: int, form: str) -> None:
  """The output head (cuda_src.head) is one kernel of W . rmsnorm(x) * gamma in its type's single-token form: within
  1e-3 of the float product's std with x16 (x normalised, then kept to 16 bits once a block), to float rounding with
  float32 input, an outlier 40x the others included."""
  t, rng, inp, eps = TYPES[quant], np.random.default_rng(8), 256, 1e-5
  planes, w = kernel_weight(t, (rows, inp), 5)
  x, gamma = rng.standard_normal(inp).astype(np.float32), rng.uniform(0.5, 1.5, inp).astype(np.float32)
  x[5] = 40.0
  k = cuda_src.head(t, (rows, inp), eps)
  assert k.name.startswith("native_dense_norm_") and k.name.endswith("_x16") == (form == "x16"), k.name
  out = np.zeros(rows, np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [out, x, gamma, *planes])
  xd = x.astype(np.float64)
  want = w @ (xd / np.sqrt(np.mean(xd ** 2) + eps) * gamma)
  err = np.abs(out - want).max() / want.std()
  assert err < (1e-3 if form == "x16" else 1e-5), err


# the tiny Q4_K_M mix's attention reads Q5_K (q_a, kv_a) and Q8_0 (q_b, the output): the all-Q8_0 file adds no type
# to the default suite, only to make test-slow
@pytest.mark.parametrize("mix", ["q4_0", pytest.param("q8_0", marks=pytest.mark.slow), "q4_k_m"])
def test_q8_attention_input_in_the_cpu_emulator(gguf_file, monkeypatch, mix: str) -> None:
  """attn_act=q8: the fused attention's dense products (q_a and kv_a with the norm, q_b with q_a's norm, the output
  projection with the residual) stage their input in 8 bits in blocks of Q8_WARPS warps and dot it in integers. The
  stage alone, native (emulated) against its dsl twin (which rounds the same inputs with q8_round), on the same inputs
  position after position (each writing its cache row): their updates agree within the gate's tolerance for the
  attention's 8-bit stages, and are much nearer each other than either is to float32's. (Whole models are not compared
  here: a rounding flip moves a router's near-tie, and free routing amplifies it; the gate forces the routing.)"""
  path = gguf_file("tiny", mix)
  cfg = lambda b, act="q8": StructureConfig(fused={"attention": b}, attn_act=act)
  dense = [k for k in model_kernels(path, cfg("native"), monkeypatch) if k.name.startswith("native_dense_")]
  assert len(dense) == 3 and all(k.name.endswith("_q8") and k.threads == 32 * native.Q8_WARPS for k in dense), dense
  monkeypatch.undo()
  rng, runs = np.random.default_rng(3), {}
  xs = [Tensor(rng.standard_normal((1, 1, 256)).astype(np.float32)) for _ in TOKENS_EMU]
  with native_on_cpu(monkeypatch):
    for name, c in (("native", cfg("native")), ("dsl", cfg("dsl")), ("float32", cfg("native", "float32"))):
      m = Transformer(gguf(path), c, max_context=16)
      att, backend = m.blocks[0].attention_in, registry.get(c.fused["attention"])
      start = lambda i, name=name: Variable("start_pos", 0, 15).bind(i) if name == "dsl" else i
      runs[name] = np.stack([(backend.attention(att, x, start(i), m.device_pos(i, 1)) - x).numpy().reshape(-1)
                             for i, x in enumerate(xs)])
  tol = tolerance(cfg("native"), 256)[1]["attention"]
  twin, far = rel_err(runs["native"], runs["dsl"]), rel_err(runs["native"], runs["float32"])
  assert twin.max() <= tol and twin.max() < far.min() / 4, (twin, far)


def test_q8_activations_need_a_fused_ffn_stage_and_integer_codes(gguf_file, monkeypatch) -> None:
  with pytest.raises(ConfigError, match="fused FFN stages only"): StructureConfig(ffn_act="q8")
  kinds = "Q4_0, Q4_K, Q5_K, Q6_K or Q8_0"
  with native_on_cpu(monkeypatch), pytest.raises(ConfigError, match=f"ffn_act=q8 on native needs the fused moe stage's "
                                                  f"weights in {kinds}; blk.1.ffn_gate_exps.weight is F16"):
    Transformer(GGUFFile(gguf_file("tiny", "f16")), StructureConfig(fused={"moe": "native"}, ffn_act="q8"),
                max_context=16)
  # a K-quant mix as Q4_0: native dots its types in integers too (cuda_src.IUNITS)
  on = lambda mix, name: next((k.enable for k in knobs(mix_info(mix), "CUDA") if k.name == name), None)
  assert on("q4_0", "ffn_act") == on("q8_0", "ffn_act") == on("q4_k_m", "ffn_act") == (("fused.moe", "native"),)
  with pytest.raises(ConfigError, match="fused attention stage only"): StructureConfig(attn_act="q8")
  refusal = f"attn_act=q8 on native needs the attention's dense weights in {kinds}; blk.0.attn_q_a.weight is F16"
  with native_on_cpu(monkeypatch), pytest.raises(ConfigError, match=refusal):
    Transformer(GGUFFile(gguf_file("tiny", "f16")), StructureConfig(fused={"attention": "native"}, attn_act="q8"),
                max_context=16)
  assert on("q4_0", "attn_act") == on("q4_k_m", "attn_act") == (("fused.attention", "native"),)


@pytest.mark.skipif(native.available(), reason="checks the refusal where native cannot run")
def test_model_refuses_native_where_it_cannot_run(gguf_file) -> None:
  with pytest.raises(ConfigError, match="backend native needs tinygrad's CUDA device"):
    Transformer(GGUFFile(gguf_file("tiny", "q4_0")), StructureConfig(backends={"Q4_0:dense": "native"}), max_context=16)


@needs_cuda
@pytest.mark.parametrize("quant", sorted(catalog.get("native").quants))
@pytest.mark.parametrize("shape", ["small", "glm"])
def test_products_equal_the_tensor_backend(quant: str, shape: str) -> None:
  check_products("native", quant, shape)


@needs_cuda
@pytest.mark.parametrize("mix", ["q4_0", "q4_k_m"])
def test_decode_runs_native_kernels_in_the_graph(gguf_file, mix: str) -> None:
  """All weights on native: every product of the decode step is a native kernel, batched into the JIT's CUDA graph."""
  path = gguf_file("tiny", mix)
  info = ModelInfo.from_gguf(GGUFFile(path))
  cfg = StructureConfig(backends={f"{q}:{role}": "native" for role, qs in info.quants.items() for q in qs})
  gen = Generator(Transformer(GGUFFile(path), cfg, max_context=32), chunk=4)
  gen.prefill(list(TOKENS[:4]))
  for i in range(3): gen.step(1, 4 + i)
  names = [n for n, _ in jit_kernels(gen.step_jit)]
  n_moe = sum(n.endswith(".ffn_gate_exps.weight") for n in GGUFFile(path).tensors)
  assert sum(n.startswith("native_expert_") for n in names) == 3 * n_moe and any(n.startswith(
    "native_dense_") for n in names)
  assert not any(c.src[0].op is Ops.PROGRAM
                 for c in gen.step_jit.captured.linear.src), ("a kernel runs outside the " "JIT's graphs")


def test_timeline_parts_sum_to_the_step() -> None:
  """model/profile.py timeline_rows: each launch's part of the step runs from the previous stamped launch's last exit
  to its own, split at its first return from the wait; the parts of a step sum to its span; the first step of a run
  (no predecessor in the graph) is left out; a launch with no stamp is named."""
  from model.profile import timeline_rows
  names, others = ["a", "b", "a"], [2, 0, 1]
  def run(t0: int) -> np.ndarray:  # 3 steps of 3 launches, times in ns: each launch (entry, wait0, wait1, end)
    rows = []
    for s in range(3):
      base = t0 + s * 10_000
      rows.append([(base + 500, base + 1_000, base + 1_200, base + 3_000), (base + 2_500, base + 3_500, base + 3_600,
                   base + 6_000), (base + 5_000, base + 7_000, base + 7_000, base + 10_000)])
    w = np.array(rows, dtype=np.uint64)
    w[..., 0], w[..., 1] = ~w[..., 0], ~w[..., 1]
    return w
  rows, spans = timeline_rows(names, others, [run(1_000_000), run(5_000_000)])
  assert spans == [10.0] * 4
  a, b = (next(r for r in rows if r["name"] == n) for n in "ab")
  # a: 3.0 us after the previous step's end (1 us hand-off, 2 of work) + 4.0 (1 + 3); b: 3.0 (0.5 + 2.5)
  assert (a["count"], a["us_per_token"], a["handoff_us"], a["work_us"]) == (2, 7.0, 2.0, 5.0)
  assert (b["count"], b["us_per_token"], b["handoff_us"], b["work_us"]) == (1, 3.0, 0.5, 2.5)
  # lead: a starts 0.5 us after the step before ends, then 1 us before b ends; b 0.5 us before a ends
  assert a["lead_us_per_launch"] == 0.25 and b["lead_us_per_launch"] == 0.5 and a["others_before"] == 3
  assert [r["name"] for r in rows] == ["a", "b"] and a["share"] == 0.7 and a["rank"] == 1
  broken = run(0)
  broken[1, 1, 3] = 0
  with pytest.raises(RuntimeError, match="no stamp: b"): timeline_rows(names, others, [broken])


@needs_cuda
def test_step_timeline_accounts_for_the_step(glm_file) -> None:
  """On the GPU, the stamped step (model/profile.py step_timeline) of GLM-4.7-Flash's shape, all stages native, with
  programmatic edges where the decode graph has them: every native launch stamped, the parts of a step summing to its
  span, which is the stamped graph's own time a step within 25%, and the stamps cost the plain graph less than 25%."""
  from model.profile import step_timeline
  cfg = StructureConfig.from_dict(ALL_NATIVE | {"backends": {"Q4_0:dense": "native"}, "ffn_act": "q8"})
  _, gen = decode(Transformer(gguf(glm_file("q4_0")), cfg, max_context=32), TOKENS, 2)
  t = step_timeline(gen.step_jit, {"start_pos": 2}, steps=8, rounds=3)
  assert t["programmatic"] == (Device[Device.DEFAULT].graph is cuda_graph.OverlapGraph)
  names = {n for n, src in jit_kernels(gen.step_jit) if cuda_src.WAIT in src}
  assert {r["name"] for r in t["kernels"]} == names
  assert abs(sum(r["us_per_token"] for r in t["kernels"]) - t["span_us"]) < 0.05 * t["span_us"]
  assert 0.75 < t["span_us"] / t["stamped_us"] < 1.25 and t["stamped_us"] < 1.25 * t["plain_us"], t


@needs_cuda
def test_programmatic_launch_decodes_as_one_launch_at_a_time(glm_file) -> None:
  """Where the device launches programmatically (sm_90: model/backends/cuda_graph.py), the decode step's graphs start
  each native kernel before the kernels it waits on have ended: a read before its GRID_WAIT of what they write would
  race there, and nowhere else. The fused native stages with 8-bit activations (every kind of native kernel) decode the
  same logits, bit for bit, as the same kernels launched one at a time without graphs (JIT=2)."""
  path = glm_file("q4_0")
  cfg = StructureConfig.from_dict(ALL_NATIVE | {"backends": {"Q4_0:dense": "native"}, "ffn_act": "q8",
                                                "attn_act": "q8"})
  model = lambda: Transformer(gguf(path), cfg, max_context=32)
  graphed, gen = decode(model(), TOKENS, 2)
  if Device[Device.DEFAULT].graph is not cuda_graph.OverlapGraph: pytest.skip("no programmatic launch on this device")
  waiting = [n for n, src in jit_kernels(gen.step_jit) if cuda_src.WAIT in src]
  assert {n.split("_")[1] for n in waiting} >= {"dense", "mla", "router", "glu", "down"}, waiting
  with Context(JIT=2): one_by_one, _ = decode(model(), TOKENS, 2)
  np.testing.assert_array_equal(graphed, one_by_one)


@needs_cuda
@pytest.mark.parametrize("mix,label", [(m, lbl) for m in MIXES for lbl, _ in native_changes(mix_info(m))])
def test_tiny_native_knob(gguf_file, mix: str, label: str) -> None:
  path = gguf_file("tiny", mix)
  check_knob(path, label, dict(native_changes(ModelInfo.from_gguf(GGUFFile(path))))[label], TOKENS)


@needs_cuda
@pytest.mark.parametrize("mix", MIXES)
def test_glm_native_knobs(glm_file, mix: str) -> None:
  path = glm_file(mix)
  for label, cfg in native_changes(ModelInfo.from_gguf(gguf(path))):
    check_knob(path, label, cfg, TOKENS[:8])


CUDA_SETTINGS = [(lbl, cfg) for lbl, cfg in single_knob_changes(mix_info("q4_0"), "CUDA")
                 if lbl.startswith(("jit_batch_size", "beam_"))]


@needs_cuda
@pytest.mark.parametrize("label", [lbl for lbl, _ in CUDA_SETTINGS])
def test_cuda_process_setting_changes_the_decode_step(gguf_file, label: str) -> None:
  """The JIT batch size at BEAM=0; the BEAM limits at BEAM=2, against the baseline at BEAM=2 (minutes of search
  each)."""
  check_process_setting(gguf_file("tiny", "q4_0"), label, dict(CUDA_SETTINGS)[label], TOKENS)


def test_attention_kernel_splits_the_context(monkeypatch) -> None:
  """The MLA attention kernel and the v_b kernel that merges its splits, alone (CUDA emulator): one split, and several
  (fewer and more than mla_vb reads at once: ATT_MERGE), for v_b types of different row groups. The partials buffer
  starts as NaN, as stale splits of another layer or position: only the active splits' partials may be read."""
  H, rope, scale = 2, 32, 0.11
  rng = np.random.default_rng(0)
  long = 64 * (cuda_src.ATT_MERGE + 1) + 5  # a 4096 cache's splits are 64 positions: ATT_MERGE + 2 of them
  assert cuda_src.attention_splits(4096)[0] == 64
  cases = ((64, 256, 20, "Q4_0", 40), (64, 256, 94, "Q8_0", 24), (256, 4096, long, "Q6_K", 72))  # 1, 1, 2 columns
  for kvl, ctx, p, quant, vh in cases:
    cache = rng.standard_normal((ctx, kvl + rope)).astype(np.float16)
    qc = rng.standard_normal((H, kvl + rope)).astype(np.float32)
    vb_planes, vb = kernel_weight(TYPES[quant], (H, vh, kvl), kvl)
    ka = cuda_src.mla_attention(H, kvl, rope, ctx, scale, True)
    kv = cuda_src.mla_vb(cuda_src.W("w_", TYPES[quant], kvl), H, kvl, vh, ctx)
    S, pos = cuda_src.attention_splits(ctx)[1], np.array([p], np.int32)
    part, out = np.full(H * S * (kvl + 2), np.nan, np.float32), np.zeros((H, vh), np.float32)
    launch_kernel(ka.src, ka.name, ka.grid, (ka.threads, 1, 1), [part, qc, cache.view(np.uint16), pos])
    launch_kernel(kv.src, kv.name, kv.grid, (kv.threads, 1, 1), [out, part, pos, *vb_planes])
    c = cache[:p + 1].astype(np.float64)
    s = qc.astype(np.float64) @ c.T * scale
    w = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hvc,hc->hv", vb, (w / w.sum(-1, keepdims=True)) @ c[:, :kvl])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("H, kvl, rope, half", [(2, 64, 32, True), (20, 128, 64, False)])
def test_all_heads_attention_kernel(H: int, kvl: int, rope: int, half: bool) -> None:
  """The all-heads MLA attention kernel (attn_layout=all_heads), the merge of its splits and mla_vb reading the merged
  output (CUDA emulator, the tensor-core products through mma.cuh's shuffles): one row tile of heads and two (20 heads:
  12 padded), a float16 and a float32 cache; 4 splits of which 3 hold positions, 4 tiles each, the last ending inside
  its second tile; stale NaN partials past them. Query and weights go through float16: held to 3e-3 of the output."""
  ctx, p, scale, sms = 256, 149, 0.11, 4
  S = cuda_src.heads_splits(ctx, sms)
  assert S == 4
  rng = np.random.default_rng(2)
  cache = rng.standard_normal((ctx, kvl + rope)).astype(np.float16 if half else np.float32)
  qc = rng.standard_normal((H, kvl + rope)).astype(np.float32)
  vb_planes, vb = kernel_weight(TYPES["Q8_0"], (H, 32, kvl), kvl)
  ka, km = cuda_src.mla_attention_heads(H, kvl, rope, ctx, scale, half, sms), cuda_src.mla_combine(H, kvl, ctx, sms)
  kv = cuda_src.mla_vb(cuda_src.W("w_", TYPES["Q8_0"], kvl), H, kvl, 32, ctx, merged=True)
  part, o = np.full(H * S * (kvl + 2), np.nan, np.float32), np.zeros((H, kvl), np.float32)
  out, pos = np.zeros((H, 32), np.float32), np.array([p], np.int32)
  launch_kernel(ka.src, ka.name, ka.grid, (ka.threads, 1, 1), [part, qc, cache.view(np.uint16) if half else cache, pos])
  launch_kernel(km.src, km.name, km.grid, (km.threads, 1, 1), [o, part, pos])
  launch_kernel(kv.src, kv.name, kv.grid, (kv.threads, 1, 1), [out, o, *vb_planes])
  c = cache[:p + 1].astype(np.float64)
  s = qc.astype(np.float64) @ c.T * scale
  w = np.exp(s - s.max(-1, keepdims=True))
  want_o = (w / w.sum(-1, keepdims=True)) @ c[:, :kvl]
  np.testing.assert_allclose(o, want_o, rtol=3e-3, atol=3e-3 * np.abs(want_o).max())
  want = np.einsum("hvc,hc->hv", vb, want_o)
  np.testing.assert_allclose(out, want, rtol=3e-3, atol=3e-3 * np.abs(want).max())
  assert np.isnan(part.reshape(H, S, kvl + 2)[:, 3:]).all()  # the split past the position wrote nothing


def test_combine_merges_every_active_split() -> None:
  """mla_combine alone (CUDA emulator): the splits that hold positions, more than a block's groups read at once (its
  warps' groups times ATT_MERGE), merged as one softmax; the stale NaN splits past them are not read."""
  H, kvl, ctx, sms, p = 3, 64, 65536, 132, 30000
  S = cuda_src.heads_splits(ctx, sms)
  ch = max(cuda_src.AH_LEAST, -(-(p + 1) // (S * cuda_src.AH_TILE)) * cuda_src.AH_TILE)
  active = -(-(p + 1) // ch)
  assert active > cuda_src.AH_THREADS // cuda_src.COMBINE_COLS * cuda_src.ATT_MERGE and active < S
  rng = np.random.default_rng(3)
  part = np.full((H, S, kvl + 2), np.nan, np.float32)
  part[:, :active, 0] = rng.uniform(-3, 3, (H, active))
  part[:, :active, 1] = rng.uniform(0.5, 2, (H, active))
  part[:, :active, 2:] = rng.standard_normal((H, active, kvl))
  k, o = cuda_src.mla_combine(H, kvl, ctx, sms), np.zeros((H, kvl), np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [o, part.reshape(-1), np.array([p], np.int32)])
  f = np.exp(part[:, :active, 0].astype(np.float64) - part[:, :active, 0].max(1, keepdims=True))
  want = np.einsum("hs,hsc->hc", f, part[:, :active, 2:]) / (f * part[:, :active, 1]).sum(1)[:, None]
  np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("quant, heads, nope, rope, kvl", [("Q4_0", 3, 32, 16, 512), ("Q8_0", 20, 64, 64, 128)])
def test_absorption_kernel(quant: str, heads: int, nope: int, rope: int, kvl: int) -> None:
  """The absorption kernel alone (CUDA emulator): q_nope through k_b and q_pe rotated per head, c_kv normalised and
  k_pe rotated into the cache row of the position, fp16; shapes where its extra row of blocks has fewer threads than
  the cache row's elements, and more rotations than threads."""
  t, ctx, eps, p = TYPES[quant], 16, 1e-5, 5
  rng = np.random.default_rng(1)
  kb_planes, kb = kernel_weight(t, (heads, kvl, nope), 3)
  q = rng.standard_normal((heads, nope + rope)).astype(np.float32)
  kv = rng.standard_normal(kvl + rope).astype(np.float32)
  gamma = (1 + 0.1 * rng.standard_normal(kvl)).astype(np.float32)
  ang = rng.uniform(0, 6.28, (ctx, rope // 2))
  cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
  k = cuda_src.absorb_rope_kv(cuda_src.W("k_", t, nope), heads, nope, rope, kvl, ctx, eps, True)
  qc, cache = np.zeros((heads, kvl + rope), np.float32), np.zeros((ctx, kvl + rope), np.float16)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [qc, cache.view(np.uint16), q, kv, gamma, cos, sin,
                                                           np.array([p], np.int32), *kb_planes])
  rot = lambda x, c, s: np.stack([x[..., 0::2] * c - x[..., 1::2] * s, x[..., 0::2] * s + x[..., 1::2] * c],
                                 -1).reshape(x.shape)
  want_q = np.concatenate([np.einsum("hok,hk->ho", kb, q[:, :nope].astype(np.float64)),
                           rot(q[:, nope:], cos[p], sin[p])], -1)
  np.testing.assert_allclose(qc, want_q, rtol=1e-4, atol=1e-4 * np.abs(want_q).max())
  c_kv = kv[:kvl] / np.sqrt((kv[:kvl].astype(np.float64) ** 2).mean() + eps) * gamma
  want_row = np.concatenate([c_kv, rot(kv[kvl:], cos[p], sin[p])]).astype(np.float16)
  np.testing.assert_allclose(cache[p].astype(np.float32), want_row.astype(np.float32), rtol=2e-3, atol=2e-3)
  assert not cache[np.arange(ctx) != p].any()
  blocks = k.grid[0]
  assert blocks * k.threads < kvl or heads * (rope // 2) > blocks * k.threads


def routing(lg: np.ndarray, bias: np.ndarray | None, gating: int, K: int, norm_w: bool, scale: float,
            forced: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(own top-k ids, the ids used, their weights) of logits lg as the model's per-op routing computes them."""
  probs = {1: np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum(), 2: 1 / (1 + np.exp(-lg)), 3: lg,
           4: np.sqrt(np.log1p(np.exp(lg)))}[gating]
  own = np.argsort(-(probs + (0 if bias is None else bias)), kind="stable")[:K]
  ids = own if forced is None else forced
  wt = probs[ids]
  if gating == 3: wt = np.exp(wt - wt.max()) / np.exp(wt - wt.max()).sum()
  if norm_w: wt = wt / max(wt.sum(), 6.103515625e-5)
  return own, ids, wt * scale


ROUTES = ((True, True, None), (False, False, np.array([7, 0, 39], np.int32)))  # bias, norm_w, forced ids


@pytest.mark.parametrize("gating", sorted(cuda_src.GATING))
def test_router_kernel(gating: int) -> None:
  """The router kernel alone (CUDA emulator), each gating function, with and without the selection bias, its own top-k
  and with forced ids (the correctness check's variant): ids, weights and counter as the model's per-op routing computes
  them. The best expert's row and bias are copied to a lower and a higher index, so the top k is a three-way tie that
  only the order of indices breaks."""
  E, K, dim, eps, scale = 40, 3, 256, 1e-5, 1.8
  rng = np.random.default_rng(gating)
  x, gamma = rng.standard_normal(dim).astype(np.float32), (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
  w, bias = (rng.standard_normal((E, dim)) * 0.2).astype(np.float32), (0.01 * rng.standard_normal(E)).astype(np.float32)
  xn = x / np.sqrt((x.astype(np.float64) ** 2).mean() + eps) * gamma
  best = int(np.argmax(w.astype(np.float64) @ xn))  # the gating functions are increasing: the best with or without bias
  bias[best] = bias.max() + 0.01
  for twin in (0 if best else 1, E - 1 if best != E - 1 else E - 2): w[twin], bias[twin] = w[best], bias[best]
  lg = w.astype(np.float64) @ xn
  for use_bias, norm_w, forced in ROUTES:
    k = cuda_src.router(cuda_src.W("g_", 0, dim), eps,
                        cuda_src.Route(E, K, gating, use_bias, norm_w, scale, forced is not None))
    own, ids, wt = routing(lg, bias if use_bias else None, gating, K, norm_w, scale, forced)
    sel, wts, logits, cnt = (np.zeros(K, np.int32), np.zeros(K, np.float32), np.zeros(E, np.float32),
                             np.zeros(1, np.int32))
    args = ([sel, wts, logits, cnt] + ([np.zeros(K, np.int32)] if forced is not None else []) + [x, gamma]
            + ([bias] if use_bias else []) + ([forced] if forced is not None else []))
    launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), args + [w.reshape(E, dim, 1)])
    np.testing.assert_array_equal(sel, ids)
    if forced is not None: np.testing.assert_array_equal(args[4], own)
    np.testing.assert_allclose(logits, lg, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(wts, wt, rtol=1e-4, atol=1e-6)
    assert cnt[0] == 0
  k = cuda_src.router(cuda_src.W("g_", 0, dim), eps, cuda_src.Route(E, K, gating, True, True, scale), logits_only=True)
  logits = np.zeros(E, np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [logits, x, gamma, w.reshape(E, dim, 1)])
  np.testing.assert_allclose(logits, lg, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gating", sorted(cuda_src.GATING))
def test_gate_up_and_down_route_from_the_logits(gating: int) -> None:
  """With a route (the router and MoE stages both native: native.routed_moe), gate+up's routed blocks and down rank the
  router's logits themselves (Route.rank): gate+up computes what it computes from the router's ids and writes its own
  top k, down what it computes from the router's ids and weights, in both of its layouts, float32 and from glu's 8-bit
  hand-off; with forced ids (the correctness check) both use those, and gate+up still writes its own. Three experts tie
  at the top, so only the order of indices breaks it."""
  t, rng, dim, F, E, K, scale = TYPES["Q4_0"], np.random.default_rng(gating), 256, 64, 40, 3, 1.8
  W = lambda inp: cuda_src.W("", t, inp)
  routed = cuda_src.FFN(W(dim), W(dim), W(F), F, E, F, 0)
  g, u, d = (kernel_weight(t, (E, *s), i)[0] for i, s in enumerate(((F, dim), (F, dim), (dim, F)), 1))
  x, gamma = rng.standard_normal(dim).astype(np.float32), rng.standard_normal(dim).astype(np.float32)
  lg, bias = rng.standard_normal(E).astype(np.float32), (0.01 * rng.standard_normal(E)).astype(np.float32)
  best = int(np.argmax(lg))
  bias[best] = bias.max() + 0.01
  for twin in (0 if best else 1, E - 1 if best != E - 1 else E - 2): lg[twin], bias[twin] = lg[best], bias[best]
  for use_bias, norm_w, forced in ROUTES:
    route = cuda_src.Route(E, K, gating, use_bias, norm_w, scale, forced is not None)
    own, ids, wt = routing(lg.astype(np.float64), bias if use_bias else None, gating, K, norm_w, scale, forced)
    ins = [lg] + ([bias] if use_bias else []) + ([forced] if forced is not None else [])
    sel, wts = ids.astype(np.int32), wt.astype(np.float32)
    for Fs, form in ((64, "f32"), (64, "q8"), (96, "f32")):  # a shared expert of 96 rows: down's warp per slot
      plain = cuda_src.FFN(W(dim), W(dim), W(Fs), Fs, 0, Fs, 0)
      sg, su, sd = (kernel_weight(t, s, 4 + i)[0] for i, s in enumerate(((Fs, dim), (Fs, dim), (dim, Fs))))
      ho = form != "f32"
      n = (K * F + Fs) // 32 * cuda_src.HANDOFF[form] if ho else K * F + Fs
      act, mine, got = np.zeros(n, np.float32), np.zeros(n, np.float32), np.full(K, -1, np.int32)
      k = cuda_src.glu(routed, plain, K, dim, 1e-5, act=form, handoff=ho)
      launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [act, x, gamma, sel, *g, *u, *sg, *su])
      k = cuda_src.glu(routed, plain, K, dim, 1e-5, act=form, handoff=ho, route=route)
      launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [mine, got, x, gamma, *ins, *g, *u, *sg, *su])
      np.testing.assert_array_equal(mine, act)
      np.testing.assert_array_equal(got, own)
      want, out = np.zeros(dim, np.float32), np.zeros(dim, np.float32)
      k = cuda_src.down(routed, plain, K, dim, form, form)
      launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [want, x, act, sel, wts, *d, *sd])
      k = cuda_src.down(routed, plain, K, dim, form, form, route)
      assert k.name.endswith(f"_route_{route.tag}") and ("_slots" in k.name) == (Fs == 96), k.name
      launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [out, x, act, *ins, *d, *sd])
      assert rel_err(out[None], want[None]).max() < 1e-5, (form, Fs, k.name)
