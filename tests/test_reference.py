"""The float64 numpy reference (tests/reference.py) against llama.cpp on synthetic deepseek2 files, and its causality.

Per position, max_v |reference - llama.cpp| / std_v(llama.cpp logits) must stay within `llamacpp_error_bound`: ~1e-4 for
an F32 model with an f32 KV cache, otherwise the activation-rounding bound derived in `reference.llamacpp_logits`. Token
sequences avoid routing near-ties, where a legitimate expert flip would exceed any rounding bound.
"""
from __future__ import annotations

import numpy as np
import pytest
from knobcheck import assert_close
from reference import llamacpp_error_bound, llamacpp_logits, reference_logits, robust_tokens

N_TOKENS = 32
# (preset, quant, legacy attn_kv_b, llama.cpp KV cache type). An F32 model with an f32 cache leaves llama.cpp nothing to
# round but its f32 arithmetic, so those cases check the semantics (YaRN, gating, both attention layouts) to ~1e-6.
CASES = [("tiny", "f32", False, "f32"), ("tiny-lite", "f32", False, "f32"), ("tiny", "f32", True, "f32"),
         ("tiny", "f32", False, "f16"), ("tiny", "f16", False, "f16"), ("tiny", "bf16", False, "f16"),
         ("tiny", "q8_0", False, "f16"), ("tiny", "q4_0", False, "f16"), ("tiny", "q4_k", False, "f16"),
         ("tiny", "q5_k", False, "f16"), ("tiny", "q6_k", False, "f16"), ("tiny", "q4_k_m", False, "f16"),
         ("tiny-lite", "q4_k", False, "f16"), ("tiny", "q8_0", True, "f16"),]


@pytest.mark.parametrize("preset,quant,legacy,kv_cache", CASES,
                         ids=[f"{p}-{q}{'-legacy' if lg else ''}-kv{kv}" for p, q, lg, kv in CASES])
def test_matches_llama_cpp(gguf_file, preset: str, quant: str, legacy: bool, kv_cache: str) -> None:
  pytest.importorskip("llama_cpp")
  path = gguf_file(preset, quant, legacy)
  tokens = robust_tokens(path, kv_cache, N_TOKENS)
  ref, lcpp = reference_logits(path, tokens), llamacpp_logits(path, tokens, kv_cache)
  # each logit within bound*std, and the top token where llama.cpp's lead is more than twice that (it cannot be
  # overturned)
  assert_close("reference vs llama.cpp", ref, lcpp, llamacpp_error_bound(path, tokens, kv_cache))


def test_reference_is_causal(gguf_file) -> None:
  path = gguf_file("tiny", "q4_0")
  tokens = np.random.default_rng(1).integers(0, 1000, N_TOKENS).tolist()
  changed = tokens[:20] + [(t + 1) % 1000 for t in tokens[20:]]
  a, b = reference_logits(path, tokens), reference_logits(path, changed)
  np.testing.assert_allclose(b[:20], a[:20], rtol=0, atol=1e-12 * np.abs(a).max())
  assert np.abs(b[20:] - a[20:]).max(axis=1).min() > 1e-3 * np.abs(a).max()
