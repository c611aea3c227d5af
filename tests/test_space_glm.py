"""Every knob of the space is real and safe at GLM-4.7-Flash's widths: a synthetic 2-layer file (its leading dense block
and one MoE block: 20 heads, q_lora 768, kv_lora 512, 64 experts of 1536, the full 154880-token vocabulary) in each
quant mix. The proof is tests/knobcheck.py's, on 8 teacher-forced tokens: for Q4_0 (the benchmarked mix) every
single-knob change of the space, the barriers in two joint configs (joint_barriers); for Q8_0, Q4_K_M (Q4_K, Q5_K,
Q6_K and Q8_0 weights) and F16 the backend knobs, the knobs whose code depends on the weights' type (the structural
knobs build the same graph around any product; fp16_cache's products are the same float matmuls over a matrix
dequantized by the baseline's own code, so Q4_0 proves them). The mixes run from tests/test_space_glm_mixes.py, so that
a parallel run can give them a worker of their own; F16's and Q8_0's in `make test-slow` (F16's file is 2.7 GB, and
tests/test_dsl.py decodes the tiny F16 file on dsl; Q4_K_M's mix holds Q8_0 weights at these widths, and
tests/test_dsl.py proves the Q8_0 products on their own).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from knobcheck import check_knob, gguf, mix_info

from model.structure import STAGES, StructureConfig
from space.knobs import ModelInfo, single_knob_changes

TOKENS = tuple((7919 * i + 17) % 1000 for i in range(8))
INFO = {mix: mix_info(mix, "glm") for mix in ("q4_0", "q8_0", "q4_k_m", "f16")}
MIXES = ("q4_0",)
SLOW = ("f16", "q8_0")


def cases(mixes: tuple[str, ...]) -> list[tuple[str, str, object]]:
  # BEAM and dsl rows: see tests/test_space.py SEPARATE; the barriers: joint_barriers; the prefill knobs: proved on the
  # tiny file (tests/test_space.py) and per quant type (tests/test_prefill.py), as grouped prefill dequantises every
  # expert of a chunk, gigabytes in float32 at these widths
  out = [(mix, label, cfg) for mix in mixes for label, cfg in single_knob_changes(INFO[mix])
         if not label.startswith(("beam", "dsl_rows", "barrier.", "prefill_"))
         and (mix == "q4_0" or label.startswith("backend.") and not label.endswith("=fp16_cache"))]
  if "q4_0" in mixes: out += [("q4_0", label, cfg) for label, cfg in joint_barriers()]
  return out


def joint_barriers() -> list[tuple[str, StructureConfig]]:
  """The barrier knobs at these widths, in two configs: every point's realize, and every point's other value. A barrier
  only cuts the graph where the code places it, whatever the widths: tests/test_space.py proves each value alone (its
  logits and its own kernels) on the tiny file; here the cuts together keep the logits and change the kernels."""
  base, groups = StructureConfig().barriers, {"realize": {}, "other": {}}
  for label, cfg in single_knob_changes(INFO["q4_0"]):
    if label.startswith("barrier."):
      for point, value in cfg.barriers.items():
        if value != base[point]: groups["realize" if value == "realize" else "other"][point] = value
  return [(f"barriers={g}", StructureConfig(barriers={**base, **pts})) for g, pts in groups.items()]


def pytest_generate_tests(metafunc) -> None:
  mixes = metafunc.module.MIXES
  marks = lambda mix: [pytest.mark.slow] if mix in SLOW else []
  if "label" in metafunc.fixturenames:
    cs = [pytest.param(*c, id=f"{c[0]}-{c[1]}", marks=marks(c[0])) for c in cases(mixes)]
    metafunc.parametrize("mix,label,cfg", cs)
  elif "mix" in metafunc.fixturenames: metafunc.parametrize("mix", [pytest.param(m, marks=marks(m)) for m in mixes])


def test_glm_model_info(glm_file, mix: str) -> None:
  info = ModelInfo.from_gguf(gguf(glm_file(mix)))
  # the stage order of a 2-block file (its dense FFN block weighs as much as its one MoE block) is not the full model's
  assert replace(info, stage_order=()) == INFO[mix] and sorted(info.stage_order) == sorted(STAGES)
  assert info.stage_order[-1] == "router"


def test_glm_knob_is_equivalent_and_changes_the_kernels(glm_file, mix: str, label: str, cfg) -> None:
  check_knob(glm_file(mix), label, cfg, TOKENS)
