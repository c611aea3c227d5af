"""The dsl backend (model/dsl.py): its custom kernels compute the tensor backend's products, and a model built on them
decodes the baseline's logits with the custom kernels in place of the tensor path's gathered products.

Model logits are compared with an fp32 KV cache on both sides: with the baseline's fp16 cache, any reordering of the
float32 sums that feed the cache (the kv_a projection) moves some entries across an fp16 rounding boundary, an error of
~1e-3 of the logits' std that has nothing to do with the kernels (tests/test_space.py holds backend knobs to 2e-2 for
it).
"""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
from knobcheck import assert_close
from products import check_products

from model.backends import catalog
from model.deepseek2 import Transformer
from model.generate import Generator, jit_kernels
from model.gguf_file import GGUFFile
from model.structure import QUANT_NAMES, StructureConfig
from space.knobs import ModelInfo, knobs

TOKENS = [(7919 * i + 17) % 1000 for i in range(16)]


@pytest.mark.parametrize("quant", sorted(catalog.get("dsl").quants))
def test_products_equal_the_tensor_backend(quant: str) -> None:
  check_products("dsl", quant)


def test_space_offers_dsl_exactly_for_supported_types(gguf_file, monkeypatch) -> None:
  assert catalog.get("dsl").quants == set(QUANT_NAMES) and "dsl" in catalog.names()
  info = ModelInfo.from_gguf(GGUFFile(gguf_file("tiny", "q4_k_m")))
  domains = {k.name: k.choices for k in knobs(info) if k.name.startswith("backend.")}
  # native: CUDA only (tests/test_native.py)
  assert domains and all(c == ("tensor", "fp16_cache", "dsl") for c in domains.values())
  monkeypatch.setitem(catalog.CATALOG, "dsl", dataclasses.replace(catalog.get("dsl"), quants=frozenset({"Q4_K"})))
  domains = {k.name: k.choices for k in knobs(info) if k.name.startswith("backend.")}
  assert domains["backend.Q4_K.expert"] == domains["backend.Q4_K.dense"] == ("tensor", "fp16_cache", "dsl")
  assert domains["backend.Q6_K.expert"] == domains["backend.Q5_K.dense"] == ("tensor", "fp16_cache")


@functools.cache
def run(path: str, cfg_json: str) -> tuple[np.ndarray, np.ndarray, tuple[tuple[str, str], ...], frozenset[int]]:
  """Teacher-forced prefill logits, decode step logits, that step's kernels (the search's decode step but for the argmax
  after the head: one decode graph captured per config), and the sizes of the expert weights' largest planes (their
  codes; no other buffer of the tiny models has those sizes)."""
  model = Transformer(GGUFFile(path), StructureConfig.from_json(cfg_json), max_context=32)
  gen = Generator(model, chunk=len(TOKENS))
  prefill = gen.prefill(TOKENS).astype(np.float64)
  steps = np.stack([gen.step_logits(1, len(TOKENS) + i) for i in range(3)]).astype(np.float64)
  exps = frozenset(max(p.numel() for p in w.planes.values()) for b in model.blocks if b.moe
                   for w in (b.gate_exps, b.up_exps, b.down_exps))
  return prefill, steps, tuple(jit_kernels(gen.step_logits_jit)), exps


def reads(src: str, sizes: frozenset[int]) -> bool:
  """Whether a kernel takes a buffer of one of these sizes (tinygrad names kernel buffers data<i>_<size>)."""
  return any(int(n) in sizes for n in re.findall(r"\bdata\d+_(\d+)\b", src))


# the Q4_K_M mix with every type on dsl at once in `make test-slow`: each of its types' dsl backend is proved alone at
# GLM-4.7-Flash's widths (tests/test_space_glm_mixes.py) and its products per type here (test_products_equal_...)
@pytest.mark.parametrize("quant", ["q4_0", pytest.param("q4_k_m", marks=pytest.mark.slow), "f16"])
def test_decode_matches_the_baseline_with_custom_kernels(gguf_file, quant: str) -> None:
  path = gguf_file("tiny", quant)
  info = ModelInfo.from_gguf(GGUFFile(path))
  backends = {f"{q}:{role}": "dsl" for role, qs in info.quants.items() for q in qs}
  if quant == "q4_0": assert backends == {"Q4_0:expert": "dsl", "Q4_0:dense": "dsl"}
  base_prefill, base_steps, base_kernels, exps = run(path, StructureConfig(kv_dtype="float32").to_json())
  prefill, steps, kernels, _ = run(path, StructureConfig(kv_dtype="float32", backends=backends).to_json())
  for got, want in ((prefill, base_prefill), (steps, base_steps)):
    assert_close("dsl backends, fp32 KV cache", got, want, 1e-4)
  names = [n for n, _ in kernels]
  n_moe = sum(n.endswith(".ffn_gate_exps.weight") for n in GGUFFile(path).tensors)
  assert not any(n.startswith("dsl_") for n, _ in base_kernels)
  assert sum(n.startswith("dsl_expert_") for n in names) == 3 * n_moe and any(n.startswith("dsl_dense_") for n in names)
  # the baseline's gathered expert products read the expert weights' codes; with dsl only the custom kernels do
  assert any(reads(s, exps) for n, s in base_kernels)
  assert all(n.startswith("dsl_expert_") for n, s in kernels if reads(s, exps))


def test_default_config_with_dsl_stays_within_fp16_rounding(gguf_file) -> None:
  """With the baseline's fp16 KV cache (see the module docstring), the GLM-4.7-Flash type (Q4_0) everywhere on dsl."""
  path = gguf_file("tiny", "q4_0")
  base_prefill, base_steps, _, _ = run(path, StructureConfig().to_json())
  prefill, steps, _, _ = run(path, StructureConfig(backends={"Q4_0:expert": "dsl", "Q4_0:dense": "dsl"}).to_json())
  for got, want in ((prefill, base_prefill), (steps, base_steps)): assert_close("dsl backends", got, want, 2e-2)
