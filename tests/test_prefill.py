"""Grouped prefill (model/prefill.py): the chunk's expert products grouped by expert in tiles equal the per-token
products for every quant type the synthetic writer makes, in every way of reading the weights; decode after a grouped
prefill reads the cache that prefill wrote; and the gate checks prefill, passing grouped prefill and failing a broken
one. The prefill knobs' kernels and logits: tests/test_space.py (tests/knobcheck.py check_prefill_knob)."""
from __future__ import annotations

import functools
import pathlib

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

import evaluator.gate as gate
import model.prefill as prefill
from evaluator.runner import Evaluator
from model.deepseek2 import Transformer
from model.generate import Generator
from model.gguf_file import GGUFFile
from model.stages import Glu
from model.structure import StructureConfig

QUANTS = ("q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "f16", "bf16", "f32")
PROMPT = [(7919 * i + 17) % 1000 for i in range(12)]
GROUPED = StructureConfig(prefill_ffn="grouped")
CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks/configs"


def routing(T: int, E: int, K: int) -> np.ndarray:
  """(1, T, K) expert ids: expert 0 in every token's first slot (a group over two tiles of 16 at T = 24), the other
  slots spread over experts 1..E-2, and expert E-1 unused."""
  return np.stack([np.zeros(T, np.int32), *[1 + (np.arange(T) + k) % (E - 2) for k in range(1, K)]], -1)[None]


def test_layout_puts_each_expert_in_whole_tiles_of_its_own() -> None:
  sel = routing(24, 8, 2)[0]
  tile_expert, token, row, used = (t.numpy() for t in prefill.layout(Tensor(sel), 8, 16))
  P, tile = sel.size, 16
  assert len(tile_expert) == (P + min(8, P) * (tile - 1)) // tile and len(token) == len(tile_expert) * tile
  assert len(set(row.tolist())) == P  # one row per pair
  # each pair's row lies in a tile of its expert and reads its token; the tiles in expert order, expert 0's 24 pairs in
  # two, unused expert 7 in none (the tiles past the used ones, padding, take the last expert)
  np.testing.assert_array_equal(tile_expert[row // tile], sel.reshape(-1))
  np.testing.assert_array_equal(token[row], np.arange(P) // 2)
  np.testing.assert_array_equal(tile_expert, [0, 0, 1, 2, 3, 4, 5, 6, 7, 7])
  assert used.tolist() == [8]  # expert 0's two tiles and one each for experts 1..6


@functools.cache
def blocks(path: str, merged: bool) -> Transformer:
  cfg = StructureConfig(merge_gate_up_routed=merged, merge_gate_up_shared=merged, merge_gate_up_dense=merged)
  return Transformer(GGUFFile(path), cfg, max_context=8, n_layers=2)


@pytest.mark.parametrize("quant", QUANTS)
def test_grouped_products_match_the_per_token_path(gguf_file, quant: str) -> None:
  """The dense block's FFN and the MoE block's experts (routed and shared) of one chunk, grouped against per token: in
  float32 up to the sums' order, with indexed weights in tiles of 16 and copied ones in tiles of 64; on Q4_0 also in
  float16 within its rounding (the dequantisation is the float32 one's, cast) and with gate and up merged."""
  rng = np.random.default_rng(0)
  copied = StructureConfig(prefill_ffn="grouped", prefill_weights="copied", prefill_tile=64)
  half = StructureConfig(prefill_ffn="grouped", prefill_dtype="float16")
  cases = [(False, GROUPED, 1e-5), (False, copied, 1e-5)]
  if quant == "q4_0": cases += [(False, half, 1e-2), (True, GROUPED, 1e-5)]
  for merged, cfg, tol in cases:
    m = blocks(gguf_file("tiny", quant), merged)
    (dense, moe), hp, T = m.blocks, m.hp, 24
    xn = Tensor(rng.standard_normal((1, T, hp.dim)).astype(np.float32)).realize()
    sel = Tensor(routing(T, hp.n_experts, hp.n_used), dtype=dtypes.int32)
    w = Tensor(rng.random((1, T, hp.n_used)).astype(np.float32))
    experts = Glu(moe.gate_exps, moe.up_exps, moe.gate_up_exps, moe.down_exps)
    got = prefill.moe(xn, sel, w, experts, Glu(moe.gate_sh, moe.up_sh, moe.gate_up_sh, moe.down_sh), hp.n_experts, cfg)
    assert (gate.rel_err(got.numpy()[0], moe.experts(xn, sel, w).numpy()[0]) <= tol).all(), (quant, merged, cfg)
    if cfg.prefill_weights == "copied": continue  # the dense FFN reads no tiles
    got = prefill.glu(xn, Glu(dense.gate, dense.up, dense.gate_up, dense.down), cfg).numpy()
    want = dense._ffn(xn, dense.gate, dense.up, dense.down, dense.gate_up, "dense_gate_up").numpy()
    assert (gate.rel_err(got[0], want[0]) <= tol).all(), (quant, merged, cfg)


@pytest.fixture(scope="module")
def tiny(gguf_file) -> str: return gguf_file("tiny", "q4_0")


def test_decode_after_prefill_reads_the_cache_prefill_wrote(tiny) -> None:
  """A grouped prefill of 12 tokens in chunks of 8 (the second padded), then decode, against the same config fed the
  prompt by decode steps: the same cache rows, and the same logits at the decode steps after it."""
  f = GGUFFile(tiny)
  a, b = (Generator(Transformer(f, GROUPED, max_context=32), chunk=8) for _ in range(2))
  full = a.prefill(PROMPT)
  # a generation's prefill: the head on each chunk's last token alone (the second chunk's is its fourth)
  np.testing.assert_allclose(a.prefill(PROMPT, last=True), full[-1], rtol=0, atol=1e-5 * np.abs(full[-1]).max())
  first = int(full[-1].argmax())
  for i, t in enumerate(PROMPT): b.step_logits(t, i)
  assert (gate.rel_err(a.cache_rows(len(PROMPT)), b.cache_rows(len(PROMPT))) < 5e-3).all()
  for i, t in enumerate([first, 5, 77]):
    np.testing.assert_array_less(gate.rel_err(a.step_logits(t, len(PROMPT) + i)[None],
                                              b.step_logits(t, len(PROMPT) + i)[None]), 1e-3)


def test_gate_checks_prefill(tiny, monkeypatch) -> None:
  """Grouped prefill in float16 passes the gate's prefill check against the baseline's decode-step reference, within its
  precision class; a grouped prefill whose routed experts are 2% off fails it, and the verdict says so."""
  f, prompt = GGUFFile(tiny), PROMPT[:8]  # one chunk of 8
  ref = gate.make_reference(Generator(Transformer(f, max_context=32)), prompt, 1)
  cfg = StructureConfig(prefill_ffn="grouped", prefill_dtype="float16", prefill_tile=64)
  tol = gate.tolerance(cfg, 256)[0]
  c = gate.prefill_check(Generator(Transformer(f, cfg, max_context=32), chunk=8), ref, tol)
  assert tol == gate.FP16_TOL and c["prefill_ok"] and c["prefill_max_rel_err"] < tol / 5, c
  moe = prefill.moe
  monkeypatch.setattr(prefill, "moe", lambda *a: moe(*a) * 1.02)
  c = gate.prefill_check(Generator(Transformer(f, GROUPED, max_context=32), chunk=8), ref, gate.FP32_TOL)
  assert not c["prefill_ok"] and c["prefill_max_rel_err"] > gate.FP32_TOL and c["prefill_cache_err"] > gate.FP32_TOL, c
  assert "prefill differs" in gate.verdict({"failed_positions": 0, "wrong_routing": 0, "max_router_err": 0,
                                            "tolerance": gate.FP32_TOL} | c)


def test_a_trial_checks_its_prefill(tiny) -> None:
  """A trial (the evaluator's own process) runs the prefill check before the decode check and fails on it: grouped
  prefill in float16 passes within its class, and its prefill is timed."""
  ev = Evaluator.for_model(tiny, "CPU", n=8, rounds=1, prefill=True, timeout=300)
  r = ev.run({"prefill_ffn": "grouped", "prefill_dtype": "float16"})
  assert r.ok and r.check["prefill_ok"], r.error
  assert 0 < r.check["prefill_max_rel_err"] <= r.check["prefill_tolerance"] == gate.FP16_TOL
  assert r.metrics["prefill_tok_s"] > 0


def test_indexed_weights_are_read_in_place_and_multiplied_on_the_tensor_cores(gguf_file) -> None:
  """The portable prompt config (dsl's word planes, indexed weights in float16): every expert dequantised once by dsl's
  kernel, which reads the quantised words where they lie (a gather by a tensor would first copy them: a kernel writing
  words), and each product over the chunk's rows (the routed experts' gate+up and down, the shared expert's) renders
  on CUDA's tensor cores: the shared expert's output is a buffer apart from the sum over the slots, which would
  otherwise make one kernel of two reductions."""
  from test_portable import kernels, render_source, renderer
  from tinygrad.codegen.opt import tc
  cfg = StructureConfig.load(str(CONFIGS / "prefill-portable-indexed.json"))
  m = Transformer(GGUFFile(gguf_file("tiny", "q4_0")), cfg, max_context=8, n_layers=2)
  rng, T = np.random.default_rng(1), 32
  moe, hp = m.blocks[1], m.hp
  xn = Tensor(rng.standard_normal((1, T, hp.dim)).astype(np.float32)).realize()
  sel = Tensor(routing(T, hp.n_experts, hp.n_used), dtype=dtypes.int32).realize()
  w = Tensor(rng.random((1, T, hp.n_used)).astype(np.float32)).realize()
  chunk = lambda: prefill.moe(xn, sel, w, Glu(moe.gate_exps, moe.up_exps, moe.gate_up_exps, moe.down_exps),
                              Glu(moe.gate_sh, moe.up_sh, moe.gate_up_sh, moe.down_sh), hp.n_experts, cfg)
  out = chunk()
  ren = renderer("CUDA")
  ren.tensor_cores = tc.get_cuda("sm_90")
  asts = kernels(out)
  srcs = [render_source(k, ren) for k in asts]
  assert not [s for s in srcs if "(unsigned int* data0" in s or "(uint* data0" in s]
  assert sum("__WMMA" in s for s in srcs) == 4
  # dsl's kernel dequantises them (model/backends/dsl.py dequant_kernel), the routed experts' and the shared expert's
  # gate+up and down, and the chunk's outputs are the per-token path's within float16's rounding
  assert sum(k.arg.name == "dsl_dequant_q4_0" for k in asts) == 4
  assert (gate.rel_err(chunk().numpy()[0], moe.experts(xn, sel, w).numpy()[0]) <= 1e-2).all()
