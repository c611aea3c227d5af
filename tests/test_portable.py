"""The portable kernels (model/backends/dsl.py) are portable by construction: each renders for tinygrad's CUDA, METAL
and AMD renderers with its workgroup schedule, runs correctly under tinygrad's Python emulator of Metal (workgroups,
shared memory), and nothing in them reads the device's name. No Metal or AMD hardware is involved: rendering proves the
source is produced, the emulator that it computes the right numbers with Metal's features."""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from products import TYPES, random_weight
from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen import full_rewrite_to_sink, line_rewrite, linearize, pm_linearize_cleanups
from tinygrad.helpers import Target
from tinygrad.renderer.cstyle import CStyleLanguage, CUDARenderer, HIPRenderer, MetalRenderer
from tinygrad.uop.ops import Ops

import model.backends.dsl as dsl
from model.backends import catalog
from model.deepseek2 import Block
from model.stages import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, SQRT_SOFTPLUS
from model.structure import DSL_ROWS
from model.weights import QWeight

RENDERERS = {"CUDA": (CUDARenderer, Target("CUDA", "CUDA", "sm_90")),
             "METAL": (MetalRenderer, Target("METAL", "METAL", "Apple9")),
             "AMD": (HIPRenderer, Target("AMD", "HIP", "gfx1100"))}


def renderer(kind: str) -> CStyleLanguage:
  """The renderer of a device kind, without its compiler (which needs the device's toolchain)."""
  cls, target = RENDERERS[kind]
  r = cls.__new__(cls)
  CStyleLanguage.__init__(r, target)
  r.compiler, r.tensor_cores = None, []
  return r


def render_source(kernel, ren: CStyleLanguage) -> str:
  """The source tinygrad renders for a kernel AST, its schedule applied, as its compile step would receive it."""
  return ren.render(line_rewrite(linearize(full_rewrite_to_sink(kernel, ren)), pm_linearize_cleanups))


def kernels(*outs: Tensor) -> list:
  """The kernel ASTs that realizing `outs` would run."""
  lin, _ = Tensor.linear_with_vars(*outs)
  return [c.src[0] for c in lin.toposort() if c.op is Ops.CALL and c.src[0].op is Ops.SINK]


def portable_outputs(quant: str) -> list[Tensor]:
  """Every portable kernel kind at small shapes, built with workgroups (as on a GPU): dense (prefill rows), per head,
  the selected experts' products, the one-token product with a residual and with a folded norm, merged gate+up, and
  down over the selected experts. For the seed files' types (Q4_0, Q8_0) the products also read a second weight in the
  same kernel (two projections stacked, the shared expert as pseudo-experts) and gate+up computes its default rows
  per thread (4); a K-quant's unrolled blocks read twice, or for 4 rows, take minutes to render, and neither the second
  weight's reads nor the rows per thread depend on the type."""
  rng, t = np.random.default_rng(TYPES[quant]), TYPES[quant]
  x = lambda *s: Tensor(rng.standard_normal(s).astype(np.float32))
  w = lambda shape: dsl.to_words(random_weight(rng, t, shape, "dsl"))
  dense, heads, exps = w((64, 512)), w((4, 32, 512)), w((5, 64, 512))
  sel = Tensor(np.array([[[4, 0, 2]]], dtype=np.int32))
  route, two = (sel, x(5), (SIGMOID, True, 1.8)), quant in ("Q4_0", "Q8_0")
  norm, shared, pseudo = (x(512), 1e-5), w((2 * 64, 512)) if two else None, 2 if two else 0
  rows = DSL_ROWS["gate_up"].default if two else 1
  return [dsl.linear(x(1, 5, 512), dense), dsl.per_head(x(1, 1, 4, 512), heads), dsl.expert(x(1, 1, 1, 512), sel, exps),
          dsl._vec(x(512), (dense,), res=x(64)), dsl._vec(x(512), (dense, shared) if two else (dense,), norm),
          dsl._glu(x(512), norm, (None, None, exps), rows, sel, (None, None, shared) if two else None, pseudo),
          dsl._glu(x(512), None, (dense, dense, None), 1),
          dsl._down(x(64), x(3 + pseudo, 512), w((5, 64, 512)), 1, route, w((64, 1024)) if two else None)]


# a K-quant's unrolled blocks take seconds to render per kernel and target: in the default suite each of its kernels
# renders for one target in turn (every kernel and every target rendered for the type, and every kernel for every target
# with the other types); `make test-slow` renders every one for every target
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
RENDER_CASES = [pytest.param(q, q not in K_QUANTS, id=q) for q in sorted(catalog.get("dsl").quants)] + [
  pytest.param(q, True, id=f"{q}-every-target", marks=pytest.mark.slow) for q in K_QUANTS]


@pytest.mark.parametrize("quant,every", RENDER_CASES)
def test_every_portable_kernel_renders_for_cuda_metal_and_amd(quant: str, every: bool, monkeypatch) -> None:
  monkeypatch.setattr(dsl, "_local", lambda device: True)
  asts = [a for a in kernels(*portable_outputs(quant)) if a.arg.name.startswith("dsl_")]
  assert {a.arg.name.split("_")[1] for a in asts} == {"dense", "per", "expert", "res", "vec", "gate", "glu", "down"}
  kinds = list(RENDERERS)
  for i, a in enumerate(asts):
    for kind in kinds if every else [kinds[i % len(kinds)]]:
      src = render_source(a, renderer(kind))
      assert a.arg.name in src
      shared = {"CUDA": "__shared__", "METAL": "threadgroup", "AMD": "__attribute__((shared"}[kind]
      # every block count here splits over a group
      assert shared in src, f"{a.arg.name} on {kind}: no workgroup reduction"


@pytest.mark.parametrize("quant", sorted(catalog.get("dsl").quants))
def test_dequantised_weights_are_their_values_and_written_as_vectors(quant: str, monkeypatch) -> None:
  """The prompt's dequantisation (dsl.dequantised: the every-expert weights of prefill_weights=indexed, after a tensor
  whose value adds nothing, and the dense weights, without): on the CPU the weights' values, in float32 and float16;
  with workgroups it renders for CUDA, METAL and AMD, and on CUDA a thread's scale group of a quantised type is stored
  in vectors of four halves."""
  rng, t = np.random.default_rng(TYPES[quant]), TYPES[quant]
  ref = random_weight(rng, t, (3, 8, 512))
  port, after = dsl.to_words(QWeight(dict(ref.planes), t, ref.shape, backend="dsl")), Tensor([3], dtype=dtypes.int32)
  want = ref.to_float().numpy()
  np.testing.assert_allclose(dsl.dequantised(port, dtypes.float32, after).numpy(), want, rtol=1e-6, atol=0)
  np.testing.assert_array_equal(dsl.dequantised(port, dtypes.float16, after).numpy(), want.astype(np.float16))
  np.testing.assert_array_equal(dsl.dequantised(port, dtypes.float16).numpy(), want.astype(np.float16))  # no wait
  monkeypatch.setattr(dsl, "_local", lambda device: True)
  (ast,) = kernels(dsl.dequantised(port, dtypes.float16, after))
  for kind in RENDERERS:
    src = render_source(ast, renderer(kind))
    assert f"dsl_dequant_{quant.lower()}" in src
    if kind == "CUDA" and quant not in ("F32", "F16", "BF16"): assert "*((half4*)" in src, src


EMULATED = """
import sys
sys.path[:0] = ["tests", "."]
import numpy as np
from tinygrad import Device, Tensor, dtypes
from products import TYPES, random_weight, rel_err
import model.backends.dsl as dsl
from model.backends import catalog
from model.backends import tensor
from model.structure import DSL_ROWS
from model.weights import QWeight, concat_rows
assert dsl._local(Device.DEFAULT), Device.DEFAULT
for quant in sys.argv[1:]:
  rng, t = np.random.default_rng(0), TYPES[quant]
  x = lambda *s: Tensor(rng.standard_normal(s).astype(np.float32))
  ref = random_weight(rng, t, (5, 16, 512))
  port = dsl.to_words(QWeight(dict(ref.planes), t, ref.shape, backend="dsl"))
  sel, xe = Tensor(np.array([[[4, 0]]], dtype=np.int32)), x(1, 1, 1, 512)
  print(quant, "expert", rel_err(dsl.expert(xe, sel, port), tensor.BACKEND.expert(xe, sel, ref)))
  act, logits, res = x(2, 512), x(5), x(16)
  wts = logits[sel.reshape(-1)].softmax()  # softmax over the selected experts' logits (gating 3)
  want = res + (tensor.BACKEND.expert(act.reshape(1, 1, 2, 512), sel, ref)[0, 0] * wts.unsqueeze(-1)).sum(0)
  got = dsl._down(res, act, port, 1, (sel, logits, (3, False, 1.0)))
  print(quant, "down", rel_err(got, want))
  # 44 blocks a row (DeepSeek-V2-Lite's down, 1408 wide: 32-element blocks only): 11 threads of 4 blocks each, the
  # wide split of `_group`
  if quant in ("Q4_0", "Q8_0"):
    ref44 = random_weight(rng, t, (5, 4, 1408))
    port44, act44 = dsl.to_words(QWeight(dict(ref44.planes), t, ref44.shape, backend="dsl")), x(2, 1408)
    want = res[:4] + (tensor.BACKEND.expert(act44.reshape(1, 1, 2, 1408), sel, ref44)[0, 0] * wts.unsqueeze(-1)).sum(0)
    print(quant, "down44", rel_err(dsl._down(res[:4], act44, port44, 1, (sel, logits, (3, False, 1.0))), want))
  gamma, xg, up = x(512), x(512), random_weight(rng, t, (5, 16, 512))
  xn = xg * (xg.square().mean() + 1e-5).rsqrt() * gamma
  g, u = (tensor.BACKEND.expert(xn.reshape(1, 1, 1, 512), sel, r)[0, 0] for r in (ref, up))
  dslw = lambda r: QWeight(dict(r.planes), t, r.shape, backend="dsl")
  merged = dsl.to_words(concat_rows(dslw(ref), dslw(up)))
  # its default rows per thread for the seed files' types (a K-quant's unrolled block, 4 times over, takes a minute to
  # emulate; the rows per thread do not depend on the type)
  got = dsl._glu(xg, (gamma, 1e-5), (None, None, merged), DSL_ROWS["gate_up"].default if quant in ("Q4_0", "Q8_0")
                 else 1, sel)
  print(quant, "glu", rel_err(got, g.silu() * u))
  after = Tensor([2], dtype=dtypes.int32)
  print(quant, "dequant", rel_err(dsl.dequantised(port, dtypes.float32, after), ref.to_float()))
"""


# a type's emulated kernels take a CPU quarter-minute: a seed file's type and a K-quant here, two more in make test-slow
@pytest.mark.parametrize("quants", [pytest.param(("Q4_0", "Q4_K"), id="Q4_0-Q4_K"),
                                    pytest.param(("Q8_0", "Q6_K"), id="Q8_0-Q6_K", marks=pytest.mark.slow)])
def test_portable_kernels_compute_the_reference_under_the_metal_emulator(quants: tuple[str, ...]) -> None:
  """tinygrad's Python emulator with Metal's features (workgroups, shared memory): the experts' product, SiLU(gate) * up
  of merged gate+up weights (one kernel) with the norm folded in and down over the selected experts equal the tensor
  backend's, for the types of the seed files (Q4_0, Q8_0) and K-quants, with rows of 16 and of 44 blocks, and gate+up at
  its default 4 rows per thread for the seed files' types; the weights' values (the prompt's dequantisation) equal
  theirs."""
  env = {**os.environ, "DEV": "PYTHON::METAL"}
  out = subprocess.run([sys.executable, "-c", EMULATED, *quants], env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  errs = {tuple(line.split()[:2]): float(line.split()[2]) for line in out.stdout.splitlines()}
  wide = {(q, "down44") for q in quants if q in ("Q4_0", "Q8_0")}
  assert set(errs) == {(q, k) for q in quants for k in ("expert", "down", "glu", "dequant")} | wide
  assert all(e < 1e-5 for e in errs.values()), errs


def test_nothing_portable_reads_the_device_name() -> None:
  """The arithmetic of the portable kernels is the same everywhere: dsl.py names no device, and its only look at the
  device is whether it has workgroups (the renderer's has_local and has_shared)."""
  src = inspect.getsource(dsl)
  names = {"CUDA", "METAL", "AMD", "HIP", "NV", "CPU", "CL", "WEBGPU", "PYTHON"}
  literals = {n.value for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
  assert not {s for s in literals if s.upper() in names or s.split(":")[0].upper() in names}
  local = inspect.getsource(dsl._local)
  assert "has_local" in local and "has_shared" in local and "device_kind" not in src


@pytest.mark.parametrize("gating", [SOFTMAX, SIGMOID, SOFTMAX_WEIGHT, SQRT_SOFTPLUS])
def test_routing_kernels_select_and_weigh_as_the_per_op_path(gating: int) -> None:
  """The top-k kernel's ids and the weights kernel's weights (of its own ids and of forced ones) equal the per-op path's
  pairwise top-k and weights, ties included (equal scores rank by index), for every gating function the model reads."""
  rng, (E, K) = np.random.default_rng(gating), (16, 4)
  logits = rng.standard_normal(E).astype(np.float32)
  logits[[3, 9, 12]] = logits.max() + 0.5  # a three-way tie at the top
  for bias, norm_w, scale in ((None, True, 1.8), (rng.standard_normal(E).astype(np.float32), False, 1.0)):
    hp = SimpleNamespace(gating=gating, n_used=K, norm_w=norm_w, w_scale=scale)
    blk = Block.__new__(Block)
    blk.hp, blk.probs_b, blk.cfg = hp, None if bias is None else Tensor(bias), SimpleNamespace(topk="pairwise")
    lt, b = Tensor(logits), [] if bias is None else [Tensor(bias)]
    forced = Tensor(np.array([1, 7, 3, 15], dtype=np.int32))
    for f in (None, forced):
      sel, w, own = blk.route(lt.reshape(1, 1, E), None if f is None else f.reshape(1, 1, K))
      got_own = dsl._custom(dsl.topk_kernel, (K,), [lt, *b], dtype=dtypes.int32, gating=gating)
      got_w = dsl._custom(dsl.weights_kernel, (K,), [lt, got_own if f is None else f], route=(gating, norm_w, scale))
      assert got_own.tolist() == own.reshape(-1).tolist()
      np.testing.assert_allclose(got_w.numpy(), w.reshape(-1).numpy(), rtol=1e-6, atol=1e-7)


def test_every_stage_kernel_renders_for_cuda_metal_and_amd(monkeypatch) -> None:
  """The attention's and the router's UOp kernels (the cache write, the scores, softmax @ c_kv, top-k, the routing
  weights) render for each target, the decode position a bound variable, and the workgroup reductions (the cache
  write's 1/rms, the scores, top-k) in shared memory."""
  monkeypatch.setattr(dsl, "_local", lambda device: True)
  rng, (H, kvl, rope, nope, ctx) = np.random.default_rng(0), (4, 128, 32, 32, 64)
  x = lambda *s: Tensor(rng.standard_normal(s).astype(np.float32)).realize()
  cache = Tensor.zeros(1, ctx, kvl + rope, dtype=dtypes.float16).contiguous().realize()
  qkv, gamma, cos, sin = x(96 + kvl + rope), x(kvl), x(ctx, rope // 2), x(ctx, rope // 2)
  pos, bind = dsl._position(UOp.variable("start_pos", 0, ctx - 1).bind(5))
  c = cache.custom_kernel(qkv, gamma, cos, sin, *bind,
                          fxn=partial(dsl.kv_write_kernel, pos=pos, at=96, eps=1e-5, local=True))[0]
  s = dsl._custom(dsl.scores_kernel, (H, ctx), [x(H * (nope + rope)), x(H, kvl), c, cos, sin, *bind], pos=pos,
                  scale=0.1, nope=nope)
  o = dsl._custom(dsl.pv_kernel, (H, kvl), [s, c, *bind], pos=pos)
  lt = x(16)
  own = dsl._custom(dsl.topk_kernel, (4,), [lt, x(16)], dtype=dtypes.int32, gating=SIGMOID)
  w = dsl._custom(dsl.weights_kernel, (4,), [lt, own], route=(SIGMOID, True, 1.8))
  asts = {a.arg.name: a for a in kernels(o, w) if a.arg.name.startswith("dsl_")}
  assert set(asts) == {"dsl_kv_write", "dsl_scores", "dsl_pv", "dsl_topk", "dsl_weights"}
  for kind in RENDERERS:
    for name, a in asts.items():
      src = render_source(a, renderer(kind))
      if name in ("dsl_kv_write", "dsl_scores", "dsl_topk"):
        assert {"CUDA": "__shared__", "METAL": "threadgroup_barrier",
                "AMD": "__attribute__((shared"}[kind] in src, (kind, name)


def test_each_products_rows_per_thread_change_its_kernel() -> None:
  """dsl_rows: each value of a product's rows per thread gives that product another kernel (rows over UPCAST and the
  launch), here on the CPU as on a device with workgroups."""
  rng, t = np.random.default_rng(1), TYPES["Q4_0"]
  x = lambda *s: Tensor(rng.standard_normal(s).astype(np.float32))
  w = lambda shape: dsl.to_words(random_weight(rng, t, shape, "dsl"))
  dense, exps, sel = w((64, 512)), w((5, 64, 512)), Tensor(np.array([4, 0, 2], dtype=np.int32))
  norm, route = (x(512), 1e-5), (sel, x(5), (SIGMOID, True, 1.8))
  products = {"vec": lambda r: dsl._vec(x(512), (dense,), norm, rows=r),
              "res": lambda r: dsl._vec(x(512), (dense,), res=x(64), rows=r),
              "glu": lambda r: dsl._glu(x(512), norm, (None, None, exps), r, sel),
              "down": lambda r: dsl._down(x(64), x(3, 512), w((5, 64, 512)), r, route)}
  for name, product in products.items():
    asts = [next(a for a in kernels(product(r)) if a.arg.name.startswith("dsl")) for r in (1, 2, 4)]
    assert len({a.key for a in asts}) == 3, name


def test_without_workgroups_a_rows_blocks_stay_a_loop(monkeypatch) -> None:
  """On a device with workgroups a thread reads its share of a row's blocks in unrolled steps of up to dsl.STEP (their
  loads issued together); without (the CPU) the row's blocks are a loop of one block a turn: unrolled, a K-quant
  product takes a minute to generate there."""
  rng = np.random.default_rng(2)
  w = dsl.to_words(random_weight(rng, TYPES["Q4_0"], (64, 64 * 32), "dsl"))  # 64 blocks a row
  x = Tensor(rng.standard_normal(64 * 32).astype(np.float32))
  def ranges(local: bool) -> list[tuple[int, str]]:
    monkeypatch.setattr(dsl, "_local", lambda device: local)
    a = next(a for a in kernels(dsl._vec(x, (w,))) if a.arg.name.startswith("dsl_"))
    return [(r.src[0].arg, r.arg[-1].name) for r in a.toposort() if r.op is Ops.RANGE]
  # a block's 32 codes: 2 nibbles x 4 words x 4 bytes, unrolled on both
  assert (64, "REDUCE") in ranges(False) and (dsl.STEP, "UNROLL") not in ranges(False)
  # 4 lanes x 8 threads split the row, each thread's 8 blocks in one unrolled step
  assert (dsl.STEP, "UNROLL") in ranges(True) and (64, "REDUCE") not in ranges(True)


ROWS_OFF_DEFAULT = {"dsl_rows": {"qkv_a": 4, "attn_out": 2, "gate_up": 2, "down": 4}}


@pytest.mark.parametrize("preset,change", [("tiny", {}), ("tiny-lite", {}), ("tiny", {"merge_gate_up_shared": False}),
                                           ("tiny", ROWS_OFF_DEFAULT)])
def test_portable_stages_decode_as_the_per_op_path(tmp_path, preset: str, change: dict) -> None:
  """Every stage on dsl (attention, router, moe, ffn: UOp kernels end to end) gives the per-op path's logits at each
  position, with and without q_lora, sigmoid gating with a selection bias and softmax gating (fp32 KV cache), the
  shared expert as one or two pseudo-experts of the routed experts' kernels, or in kernels of its own where its weights
  are not merged like theirs, and with every product's rows per thread off its default."""
  import json

  from model.deepseek2 import Transformer
  from model.generate import Generator
  from model.gguf_file import GGUFFile
  from model.structure import StructureConfig
  from model.synth import write_synthetic
  path = write_synthetic(tmp_path / "m.gguf", preset, quant="q4_0", layers=3, routing="decisive")
  portable = json.loads(open("benchmarks/configs/portable.json").read())
  outs = []
  for cfg in ({"kv_dtype": "float32"}, {**portable, **change, "kv_dtype": "float32"}):
    g = Generator(Transformer(GGUFFile(path), StructureConfig.from_dict(cfg), max_context=64))
    g.prefill([1, 2, 3, 4, 5, 6, 7, 8])
    outs.append(np.stack([g.step_logits(t, 8 + i) for i, t in enumerate([9, 10, 11, 12])]))
  assert np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max() < 1e-5
