"""The 8-bit KV cache (kv_dtype=q8_0, llama.cpp's -ctk q8_0): rounded as llama.cpp rounds, 34 bytes per 32 values,
within its precision class at a context of hundreds of positions, and refused where the fused attention would read it.
The knob proof (other kernels, the baseline's logits) runs with every knob value's in tests/test_space.py."""
from __future__ import annotations

import math

import gguf.quants as gq
import numpy as np
import pytest
from knobcheck import assert_close, gguf, mix_info, routed
from tinygrad import Tensor

from evaluator import gate
from evaluator.gate import FP32_TOL, Q8_TOL, tolerance, twin
from model.backends import catalog
from model.deepseek2 import KVCache, Transformer
from model.errors import ConfigError
from model.structure import StructureConfig
from model.weights import read
from search.leaderboard import precision
from space.knobs import knobs

Q8 = StructureConfig(kv_dtype="q8_0")


def test_the_cache_rounds_as_llama_cpp() -> None:
  """Rows written at a position hold the codes and scales of gguf.quants' Q8_0 (bit-exact with ggml's reference
  quantizer): an all-zero block, ties (rounded away from zero) and an outlier included; read back, they
  are its dequantized values. Its planes take 34 bytes per 32 values."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((1, 3, 64)) * 3).astype(np.float32)
  x[0, 0, :32] = 0
  x[0, 1, :32] = np.arange(-16, 16) + 0.5  # with a maximum of 127, a scale of 1: every code a tie, away from zero
  x[0, 1, 0] = 127
  x[0, 2, 40] = 1e3
  kv = KVCache("q8_0", 6, 64, None)
  Tensor.realize(*kv.store(2, Tensor(x)))
  want = gq.quantize(x.reshape(-1, 64), gq.GGMLQuantizationType.Q8_0).reshape(-1, 34)
  codes, scales = read(kv.planes[0])[0, 2:5].reshape(-1, 32), read(kv.planes[1])[0, 2:5].reshape(-1)
  np.testing.assert_array_equal(codes, want[:, 2:].view(np.int8))
  np.testing.assert_array_equal(scales, want[:, :2].copy().view(np.float16).reshape(-1))
  back = read(kv.rows(5).contiguous().realize())[0]
  np.testing.assert_array_equal(back[2:], gq.dequantize(want.reshape(-1), gq.GGMLQuantizationType.Q8_0).reshape(3, 64))
  assert not back[:2].any() and kv.nbytes() == 6 * 64 * 34 // 32
  with pytest.raises(ConfigError, match="blocks of 32"): KVCache("q8_0", 6, 48, None)


def test_the_cache_stays_within_its_precision_class(gguf_file) -> None:
  """Teacher-forced decode over 256 positions (every MoE block routed as the float16 cache's run routes): the logits of
  the q8_0 cache within the q8 class's tolerance at the model's width of the float16 cache's, the top token kept where
  decisive; the gate checks it against its twin (the baseline with the same cache) with the attention at that
  tolerance. The cache takes 34 bytes per 32 values."""
  path, tokens = gguf_file("tiny", "q4_0"), tuple((7919 * i + 17) % 1000 for i in range(256))
  m = Transformer(gguf(path), Q8, max_context=len(tokens))
  assert m.kv_cache_bytes == m.hp.n_layers * len(tokens) * (m.hp.kv_lora + m.hp.qk_rope) * 34 // 32
  tol = Q8_TOL * math.sqrt(2048 / m.hp.dim)
  base, sel = routed(path, StructureConfig().to_json(), tokens)
  q8 = routed(path, Q8.to_json(), tokens, sel)[0]
  assert_close("kv_dtype=q8_0", q8, base, tol)
  assert twin(Q8) == Q8 and tolerance(Q8, m.hp.dim) == (FP32_TOL, {"attention": tol}) and precision(Q8) == "q8"


def test_the_fused_attention_refuses_the_cache_and_the_space_does_not_offer_it() -> None:
  """The fused attention stages read a float cache: kv_dtype=q8_0 with fused.attention is refused in one line, and the
  space offers kv_dtype while the attention runs per op only (a float32 cache with fused attention stays a valid
  config)."""
  fusing = [n for n in catalog.names() if "attention" in catalog.get(n).stages]
  for backend in fusing:
    with pytest.raises(ConfigError, match=r"^kv_dtype=q8_0 is read by the per-op attention only"):
      StructureConfig(kv_dtype="q8_0", fused={"attention": backend})
  StructureConfig(kv_dtype="float32", fused={"attention": "dsl"})
  for device in ("CPU", "CUDA"):
    k = next(k for k in knobs(mix_info("q4_0"), device) if k.name == "kv_dtype")
    assert k.choices == ("float16", "float32", "q8_0") and k.when({}) and k.when({"fused.moe": "dsl"})
    assert not any(k.when({"fused.attention": b}) for b in fusing)



def test_the_prefill_is_checked_against_the_twin(gguf_file) -> None:
  """Prefill writes the 8-bit cache: the gate checks it against the twin's reference (the baseline with the same cache,
  fed by decode steps), where it passes, within the attention's q8 tolerance; against the exact reference (a float16
  cache) it would not pass at the float tolerance."""
  from model.generate import Generator
  f, prompt = gguf(gguf_file("tiny", "q4_0")), [(7919 * i + 17) % 1000 for i in range(8)]
  exact, ref = (gate.make_reference(Generator(Transformer(f, c, max_context=32)), prompt, 1) for c in (None, Q8))
  tol, part_tol = tolerance(Q8, 256)
  basis, prefill_tol = gate.prefill_basis(Q8, ref, exact, tol, part_tol)
  assert basis is ref and prefill_tol == part_tol["attention"]
  assert gate.prefill_basis(StructureConfig(), exact, None, tol, {}) == (exact, tol)
  gen = lambda: Generator(Transformer(f, Q8, max_context=32), chunk=8)
  c = gate.prefill_check(gen(), basis, prefill_tol, part_tol)
  assert c["prefill_ok"] and c["prefill_cache_err"] < FP32_TOL, c
  assert not gate.prefill_check(gen(), exact, tol, part_tol)["prefill_ok"]
