"""Every knob of the space is real and safe: for each non-default value, on the tiny model (q4_k_m mixes Q4_K, Q5_K,
Q6_K and Q8_0 weights), (a) logits on a teacher-forced sequence equal the baseline's within the tolerance of that
knob's arithmetic and the top token agrees wherever the baseline's lead exceeds it, and (b) the decode step runs a
different set of kernels than the baseline's.

Tolerances: tests/knobcheck.py. The same proof at GLM-4.7-Flash's widths: tests/test_space_glm.py.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from knobcheck import check_knob, mix_info

from model.gguf_file import GGUFFile
from model.structure import STAGES, ConfigError, StructureConfig
from space.knobs import ModelInfo, knobs, sample, single_knob_changes, size, stage_bytes, suggest, to_config

TOKENS = tuple((7919 * i + 17) % 1000 for i in range(16))
# proved elsewhere: BEAM's settings, and the dsl products' rows per thread, which keep each row's sum in the same order
# (tests/test_portable.py runs them all in one decode and checks each product's kernel)
# and the 8-bit activations, which move this file's logits beyond FP16_TOL on Q4_0 as on K-quants (routed alike):
# tests/test_dsl_kquant.py decodes both in one config
SEPARATE = ("beam", "dsl_rows", "ffn_act", "attn_act")
TINY_INFO = mix_info("q4_k_m")


@functools.cache
def info(path: str) -> ModelInfo: return ModelInfo.from_gguf(GGUFFile(path))


def changes(path: str) -> list[tuple[str, StructureConfig]]:
  return [(label, cfg) for label, cfg in single_knob_changes(info(path)) if not label.startswith(SEPARATE)]


@pytest.fixture(scope="module")
def tiny(gguf_file) -> str: return gguf_file("tiny", "q4_k_m")


def test_space_covers_every_knob_for_a_moe_model(tiny) -> None:
  names = {k.name for k in knobs(info(tiny))}
  assert {"merge_gate_up_routed", "merge_gate_up_shared", "merge_gate_up_dense", "topk", "mla_absorb", "kv_dtype",
          "attention", "act_dtype", "router_fp32", "beam", "barrier.q_proj", "barrier.kv_write",
          "barrier.expert_down"} <= names
  assert {"backend.Q4_K.expert", "backend.Q6_K.expert", "backend.Q5_K.dense", "backend.Q8_0.dense"} <= names
  assert {f"fused.{s}" for s in ("attention", "router", "moe", "ffn")} <= names


def enumerate_configs(info_: ModelInfo, device: str, free: set[str]) -> set[str]:
  """Every distinct config of the sub-space where only the `free` knobs vary, by brute force over their choices."""
  import itertools
  ks = knobs(info_, device)
  out = set()
  for combo in itertools.product(*(k.choices for k in ks if k.name in free)):
    chosen, values = dict(zip([k.name for k in ks if k.name in free], combo, strict=True)), {}
    for k in ks:
      if k.when is None or k.when(values): values[k.name] = chosen.get(k.name, k.default)
    out.add(to_config(values).to_json())
  return out


@pytest.mark.parametrize("device", ["CPU", "CUDA"])
def test_space_size_counts_conditional_knobs(device: str) -> None:
  """size() against brute force over a sub-space with stage, per-op and BEAM-conditional knobs."""
  free = {"fused.moe", "fused.router", "backend.Q4_K.expert", "merge_gate_up_routed", "topk", "beam", "beam_upcast_max",
          "kv_dtype"}
  pins = {k.name: k.default for k in knobs(TINY_INFO, device) if k.name not in free}
  assert size(TINY_INFO, device, pins) == len(enumerate_configs(TINY_INFO, device, free)) > 100


def test_dense_model_has_no_expert_knobs(gguf_file) -> None:
  from model.synth import write_synthetic
  del gguf_file
  names = {k.name for k in knobs(info(str(write_synthetic("/tmp/structsearch-test-youtu.gguf", "youtu", layers=1,
                                                          quant="q8_0"))))}
  assert not any(n.startswith(("topk", "merge_gate_up_routed", "barrier.expert", "barrier.router")) for n in names)
  assert "merge_gate_up_dense" in names and not any(".expert" in n for n in names)


def test_sample_and_suggest_give_valid_configs(tiny) -> None:
  import optuna
  for seed in range(20): StructureConfig.from_json(sample(info(tiny), seed).to_json())
  study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
  for _ in range(5):
    trial = study.ask()
    assert isinstance(suggest(trial, knobs(info(tiny))), StructureConfig)
    study.tell(trial, 1.0)
  assert to_config({}) == StructureConfig()


def test_tiny_model_info(tiny) -> None:
  got = info(tiny)
  assert replace(got, stage_order=()) == TINY_INFO
  # per token the MoE reads its shared experts and 2 of its 8 routed experts, still the most weights of the four stages
  f, b = GGUFFile(tiny), stage_bytes(GGUFFile(tiny))
  exps = sum(t.nbytes for t in f.tensors.values() if "_exps." in t.name)
  shexp = sum(t.nbytes for t in f.tensors.values() if "_shexp." in t.name)
  assert b["moe"] == pytest.approx(shexp + exps * 2 / 8, abs=4) and b["router"] < b["ffn"] < b["attention"] < b["moe"]
  assert got.stage_order == ("moe", "attention", "ffn", "router")
  # the coordinate sampler's first changes fuse the stage that reads the most; stored studies keep their order
  assert [k.name for k in knobs(got)][:4] == ["fused.moe", "fused.attention", "fused.ffn", "fused.router"]
  assert [k.name for k in knobs(TINY_INFO)][:4] == [f"fused.{st}" for st in STAGES]
  # then the fused stages' 8-bit activations (the tiny file's K-quants on dsl) and the weights' kernel backends, before
  # the per-op knobs
  names = [k.name for k in knobs(got, "CUDA")]
  backends = [i for i, n in enumerate(names) if n.startswith(("backend.", "dsl_rows."))]
  later = [i for i, n in enumerate(names) if n.startswith(("barrier.", "merge_", "topk", "kv_dtype", "act_dtype"))]
  assert names[4:6] == ["ffn_act", "attn_act"]
  assert len(backends) > 4 and backends == list(range(6, 6 + len(backends))) and max(backends) < min(later)


@pytest.mark.parametrize("label", [lbl for lbl, _ in single_knob_changes(TINY_INFO) if not lbl.startswith(SEPARATE)])
def test_knob_is_equivalent_and_changes_the_kernels(tiny, label: str) -> None:
  check_knob(tiny, label, dict(changes(tiny))[label], TOKENS)


def test_device_and_beam_conditional_knobs() -> None:
  from model.structure import PROCESS_SETTINGS
  from space.knobs import parse_pins, to_params
  cpu, cuda = {k.name for k in knobs(TINY_INFO, "CPU")}, {k.name for k in knobs(TINY_INFO, "CUDA:0")}
  # no graphs on the CPU, no local (workgroup) dims to limit, no native prompt attention (prefill_attention=all_heads)
  assert cuda - cpu == {"jit_batch_size", "beam_local_max", "prefill_attn_tokens"}
  assert {"beam_upcast_max", "beam_min_progress"} <= cpu
  beam_limits = {k.name for k in knobs(TINY_INFO, "CUDA") if k.enable == (("beam", 2),)}
  assert beam_limits == {"beam_upcast_max", "beam_local_max", "beam_min_progress"}
  # every sampled config round-trips through Optuna parameters, conditional knobs only where they apply
  for seed in range(30):
    cfg = sample(TINY_INFO, seed, "CUDA")
    params = to_params(cfg, TINY_INFO, "CUDA")
    assert to_config(params) == cfg and ("beam_local_max" in params) == (cfg.beam > 0)
  assert (StructureConfig(jit_batch_size=0).process_env()
          == {"BEAM_UPCAST_MAX": "256", "BEAM_LOCAL_MAX": "1024", "BEAM_MIN_PROGRESS": "0.01", "JIT_BATCH_SIZE": "0"}
          and len(PROCESS_SETTINGS) == 4)
  assert (parse_pins(["beam=0", "topk=sort", "router_fp32=false"], TINY_INFO)
          == {"beam": 0, "topk": "sort", "router_fp32": False})
  # a value outside the domain, an unknown knob, a GPU knob on the CPU
  for bad in ("beam=3", "nosuch=1", "jit_batch_size=0"):
    with pytest.raises(ConfigError): parse_pins([bad], TINY_INFO, "CPU")
  for cfg in (StructureConfig(jit_batch_size=8), StructureConfig(beam=2, beam_local_max=512)):
    with pytest.raises(ConfigError, match="do not apply"): to_params(cfg, TINY_INFO, "CPU")


def test_configs_of_an_earlier_schema_are_read_without_their_removed_fields() -> None:
  from model.structure import REMOVED_FIELDS
  old = {"schema_version": 1, "topk": "sort", **dict.fromkeys(REMOVED_FIELDS[1], 4)}
  assert StructureConfig.from_dict(old) == StructureConfig(topk="sort")
  with pytest.raises(ConfigError, match="unknown field"):
    StructureConfig.from_dict({"schema_version": 2, "mv_blocksize": 4})


def test_dsl_rows_apply_while_their_stage_runs_on_dsl() -> None:
  """A product's rows per thread is read by the dsl backend only: it applies while a stage holding that product is fused
  on dsl, not per op or on native; a config that sets it otherwise is refused."""
  rows = {k.name: k for k in knobs(TINY_INFO, "CUDA") if k.name.startswith("dsl_rows.")}
  assert set(rows) == {"dsl_rows.qkv_a", "dsl_rows.attn_out", "dsl_rows.gate_up", "dsl_rows.down"}
  down = rows["dsl_rows.down"]
  assert down.when({"fused.moe": "dsl"}) and down.when({"fused.moe": "native", "fused.ffn": "dsl"})
  assert not down.when({}) and not down.when({"fused.moe": "native", "fused.ffn": "native"})
  assert not rows["dsl_rows.qkv_a"].when({"fused.moe": "dsl", "fused.attention": "native"})
  assert down.enable == (("fused.moe", "dsl"),) and rows["dsl_rows.qkv_a"].enable == (("fused.attention", "dsl"),)
  assert StructureConfig(fused={"moe": "dsl"}, dsl_rows={"down": 4}).rows("down") == 4
  assert StructureConfig(fused={"moe": "dsl"}).rows("down") == 1
  for bad in ({"fused": {"moe": "native"}, "dsl_rows": {"down": 4}}, {"fused": {"moe": "dsl"}, "dsl_rows": {"down": 3}},
              {"fused": {"moe": "dsl"}, "dsl_rows": {"qkv_a": 1}}):
    with pytest.raises(ConfigError): StructureConfig(**bad)
