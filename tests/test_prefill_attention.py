"""Decompressed prefill attention (model/prefill.py attention, StructureConfig.prefill_attention): the absorbed form's
arithmetic, causal over the cache prefix and the chunk's own keys, on random inputs, on the CPU and under the Metal
emulator; a prompt longer than a chunk and not a multiple of it prefilled in that form matches the float64 reference
and the decode steps, writes the same cache rows, and the decode after it reads them; the gate passes it and fails it
with its mask one key off. Its kernels and logits against the absorbed form's: tests/test_space.py (knobcheck's prefill
proof)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from knobcheck import mix_info
from reference import reference_logits
from tinygrad import Tensor, dtypes

import evaluator.gate as gate
import model.prefill as prefill
from model.deepseek2 import Transformer
from model.generate import Generator, jit_kernels
from model.gguf_file import GGUFFile
from model.structure import ConfigError, StructureConfig
from space.knobs import knobs

H, NOPE, ROPE, KVL, V, T, START = 3, 8, 4, 16, 6, 5, 4  # the chunk's 5 queries at positions 4..8 over 9 keys
PROMPT = [(7919 * i + 17) % 1000 for i in range(12)]  # two chunks of 8, the second 4 tokens long
DECOMPRESSED = StructureConfig(prefill_attention="decompressed")


def inputs(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
  """q_nope (1, T, H, nope), q_pe (1, T, H, rope), the cache rows (1, START + T, kv_lora + rope), k_b (H, kv_lora,
  nope), v_b (H, v_head, kv_lora), float32."""
  shapes = ((1, T, H, NOPE), (1, T, H, ROPE), (1, START + T, KVL + ROPE), (H, KVL, NOPE), (H, V, KVL))
  return tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)


def absorbed(q_nope, q_pe, rows, k_b, v_b, scale: float) -> np.ndarray:
  """The absorbed form in float64, query by query: q absorbed into kv_lora dims, scored against the compressed rows of
  the positions up to its own, softmax over them, then v_b per head: (1, T, H * v_head)."""
  out = np.zeros((T, H, V))
  for t in range(T):
    c, k_pe = rows[0, :START + t + 1, :KVL].astype(np.float64), rows[0, :START + t + 1, KVL:].astype(np.float64)
    for h in range(H):
      s = (c @ (k_b[h] @ q_nope[0, t, h]) + k_pe @ q_pe[0, t, h]) * scale
      p = np.exp(s - s.max())
      out[t, h] = v_b[h] @ (p / p.sum() @ c)
  return out.reshape(1, T, H * V)


def test_decompressed_attention_is_the_absorbed_form_over_the_prefix_and_the_chunk() -> None:
  a = inputs(np.random.default_rng(0))
  got = prefill.attention(*(Tensor(x) for x in a), START, 0.3).numpy()
  np.testing.assert_allclose(got, absorbed(*a, 0.3), rtol=1e-4, atol=1e-5)
  # each query reads every key up to its own position and none past it
  for t in range(T - 1):
    late = a[2].copy()
    late[0, START + t + 1:] += 1.0
    moved = prefill.attention(*(Tensor(x) for x in (*a[:2], late, *a[3:])), START, 0.3).numpy()
    np.testing.assert_array_equal(moved[0, :t + 1], got[0, :t + 1])
    assert np.abs(moved[0, t + 1] - got[0, t + 1]).max() > 1e-2


EMULATED = """
import sys
sys.path[:0] = ["tests", "."]
import numpy as np
from tinygrad import Device, Tensor
import model.prefill as prefill
from test_prefill_attention import inputs
assert Device.DEFAULT == "PYTHON", Device.DEFAULT
np.save(sys.argv[1], prefill.attention(*(Tensor(x) for x in inputs(np.random.default_rng(1))), 4, 0.3).numpy())
"""


def test_decompressed_attention_under_the_metal_emulator(tmp_path) -> None:
  env = {**os.environ, "DEV": "PYTHON::METAL"}
  out = subprocess.run([sys.executable, "-c", EMULATED, str(tmp_path / "o.npy")], env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  np.testing.assert_allclose(np.load(tmp_path / "o.npy"), absorbed(*inputs(np.random.default_rng(1)), 0.3), rtol=1e-4,
                             atol=1e-5)


def test_decompressed_needs_the_projected_q() -> None:
  """mla_absorb=load folds q's nope rows into k_b: a config refuses both, the space offers the form without it."""
  with pytest.raises(ConfigError, match="needs mla_absorb=runtime"):
    StructureConfig(prefill_attention="decompressed", mla_absorb="load")
  k = next(k for k in knobs(mix_info("q4_0")) if k.name == "prefill_attention")
  assert k.choices == ("absorbed", "decompressed") and ("mla_absorb", "runtime") in k.enable
  assert k.when({"mla_absorb": "runtime"}) and not k.when({"mla_absorb": "load"})


def test_decompressed_prefill_matches_the_float64_reference(gguf_file) -> None:
  """With a float32 cache, 12 tokens in chunks of 8 against the numpy reference's causal pass, as tests/test_model.py
  holds the absorbed prefill: on a legacy file, whose k_b is attn_kv_b's nope rows (Block.k_b_float)."""
  path = gguf_file("tiny", "q8_0", True)
  cfg = StructureConfig(prefill_attention="decompressed", kv_dtype="float32")
  got = Generator(Transformer(GGUFFile(path), cfg, max_context=32), chunk=8).prefill(PROMPT)
  assert gate.rel_err(got, reference_logits(path, PROMPT)).max() < 1e-4


@pytest.fixture(scope="module")
def tiny(gguf_file) -> str: return gguf_file("tiny", "q4_0")


@pytest.fixture(scope="module")
def reference(tiny) -> gate.Reference:
  """The baseline's decode steps over the prompt (its logits and cache rows) and the greedy step after it."""
  return gate.make_reference(Generator(Transformer(GGUFFile(tiny), max_context=32)), PROMPT, 1)


def test_decompressed_prefill_matches_decode_and_decode_reads_its_cache(tiny, reference) -> None:
  """12 tokens in the prefill graph's chunks of 8 (the second padded, attending to the first's 8 rows and its own 4):
  the logits over the prompt and the cache rows against the decode steps', then the decode step after it. The same
  prompt in one chunk against the absorbed prefill: tests/test_space.py."""
  dec, P = Generator(Transformer(GGUFFile(tiny), DECOMPRESSED, max_context=32), chunk=8), len(PROMPT)
  assert (gate.rel_err(dec.prefill(PROMPT), reference.prompt_logits) < 1e-3).all()
  assert (gate.rel_err(dec.cache_rows(P), reference.cache) < 5e-3).all()
  # the graph attends the keys of a chunk's index times the chunk (the tensor cores' condition, below)
  assert any("(chunk_at*8+8)" in name for name, _ in jit_kernels(dec.prefill_jit))
  after = dec.step_logits(int(reference.tokens[P]), P)[None]
  assert (gate.rel_err(after, reference.logits[:1]) < 1e-3).all()


def test_gate_passes_decompressed_prefill_and_fails_it_a_key_off(tiny, reference, monkeypatch) -> None:
  """The gate's prefill check over two chunks: the decompressed form within float32's class; with each query reading
  the key after its own, outside it."""
  f = GGUFFile(tiny)
  tol = gate.tolerance(DECOMPRESSED, 256)[0]
  c = gate.prefill_check(Generator(Transformer(f, DECOMPRESSED, max_context=32), chunk=8), reference, tol)
  assert tol == gate.FP32_TOL and c["prefill_ok"] and c["prefill_max_rel_err"] < tol / 5, c
  monkeypatch.setattr(prefill, "causal_mask", lambda T, sp: Tensor.full((1, 1, T, sp + T), -np.inf).triu(sp + 2))
  c = gate.prefill_check(Generator(Transformer(f, DECOMPRESSED, max_context=32), chunk=8), reference, tol)
  assert not c["prefill_ok"] and c["prefill_max_rel_err"] > tol, c


def test_decompressed_attention_multiplies_on_the_tensor_cores() -> None:
  """At a chunk's position as the prefill graph gives it (model/generate.py: the chunk's index times the chunk), each
  product over the keys (the decompressions, the scores, the probabilities by the values) is one float16 reduction
  over a key count tinygrad knows to be a multiple of the chunk, which it renders on CUDA's tensor cores: a score as
  two reductions (nope and rope) or a free position would leave them on the plain cores."""
  from test_portable import kernels, render_source, renderer
  from tinygrad import UOp
  from tinygrad.codegen.opt import tc
  chunk, h, nope, rope, kvl, v = 32, 2, 32, 16, 64, 32
  rng = np.random.default_rng(2)
  x = lambda *s: Tensor(rng.standard_normal(s).astype(np.float32)).realize()
  cache = x(1, 4 * chunk, kvl + rope)
  at = UOp.variable("chunk_at", 0, 3).bind(2) * chunk
  rotated = x(1, chunk, h, rope) * Tensor.arange(rope).cos()  # q's rope part as the model makes it, an expression
  out = prefill.attention(x(1, chunk, h, nope), rotated, cache[:, :at + chunk], x(h, kvl, nope), x(h, v, kvl), at, 0.3,
                          dtypes.float16)
  ren = renderer("CUDA")
  ren.tensor_cores = tc.get_cuda("sm_90")
  assert sum("__WMMA" in render_source(k, ren) for k in kernels(out)) == 4


@pytest.mark.parametrize("keys", [9, 48, 384])
def test_the_softmax_over_the_keys_in_blocks(keys: int) -> None:
  """The probabilities over the keys (the rows) of scores (B, H, S, T), as the reductions in blocks of keys give them
  (S a multiple of 8, 128 or neither), masked keys included: numpy's softmax."""
  rng = np.random.default_rng(keys)
  s = rng.standard_normal((1, 2, keys, 5)).astype(np.float32) * 4
  s[0, :, -3:, 1] = -np.inf
  want = np.exp(s - s.max(2, keepdims=True))
  got = prefill._softmax_keys(Tensor(s), dtypes.float32).numpy()
  np.testing.assert_allclose(got, want / want.sum(2, keepdims=True), rtol=1e-5, atol=1e-7)
