"""Every knob of the space is real and safe: for each non-default value, on the tiny model (q4_k_m mixes Q4_K, Q5_K,
Q6_K and Q8_0 weights), (a) logits on a teacher-forced sequence equal the baseline's within the tolerance of that
knob's arithmetic and the top token agrees wherever the baseline's lead exceeds it, and (b) the decode step runs a
different set of kernels than the baseline's.

Tolerances, relative to the logits' std per position: 1e-4 for knobs that only reorder float32 work; 2e-2 for knobs that
round to fp16 (fp16 weights cache, fp16 activations, the fp16 absorbed q projection, fp16 router input). The baseline
itself keeps an fp16 KV cache, so kv_dtype=float32 is held to the fp16 bound too.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from model.deepseek2 import Transformer
from model.generate import Generator, jit_kernels
from model.gguf_file import GGUFFile
from model.structure import ConfigError, StructureConfig
from space.knobs import ModelInfo, knobs, sample, single_knob_changes, size, suggest, to_config

FP16_KNOBS = ("backend.", "act_dtype", "mla_absorb", "router_fp32", "kv_dtype")
TOKENS = [(7919 * i + 17) % 1000 for i in range(16)]
TINY_INFO = ModelInfo(True, True, True, {"dense": ("Q4_K", "Q5_K", "Q6_K", "Q8_0"), "expert": ("Q4_K", "Q6_K")},
                      frozenset({"routed", "shared", "dense"}))


@functools.cache
def info(path: str) -> ModelInfo: return ModelInfo.from_gguf(GGUFFile(path))


@functools.cache
def run(path: str, cfg_json: str) -> tuple[np.ndarray, tuple[tuple[str, str], ...]]:
  """Teacher-forced logits and the decode step's kernels (name, source) under one config."""
  gen = Generator(Transformer(GGUFFile(path), StructureConfig.from_json(cfg_json), max_context=32), chunk=len(TOKENS))
  logits = gen.prefill(TOKENS).astype(np.float64)
  for i in range(3): gen.step(1, len(TOKENS) + i)
  return logits, tuple(jit_kernels(gen.step_jit))


def changes(path: str) -> list[tuple[str, StructureConfig]]:
  return [(label, cfg) for label, cfg in single_knob_changes(info(path)) if not label.startswith("beam")]


@pytest.fixture(scope="module")
def tiny(gguf_file) -> str: return gguf_file("tiny", "q4_k_m")


def test_space_covers_every_knob_for_a_moe_model(tiny) -> None:
  names = {k.name for k in knobs(info(tiny))}
  assert {"merge_gate_up_routed", "merge_gate_up_shared", "merge_gate_up_dense", "topk", "mla_absorb", "kv_dtype",
          "attention", "act_dtype", "router_fp32", "beam", "barrier.q_proj", "barrier.kv_write", "barrier.expert_down"} <= names
  assert {"backend.Q4_K.expert", "backend.Q6_K.expert", "backend.Q5_K.dense", "backend.Q8_0.dense"} <= names
  unconditional = np.prod([len(k.choices) for k in knobs(info(tiny)) if k.when_beam is None and k.name != "beam"])
  assert size(info(tiny)) == unconditional * (1 + 4 * 27)  # BEAM=0, or one of 4 widths with its 3 x 3 x 3 limits


def test_dense_model_has_no_expert_knobs(gguf_file) -> None:
  from model.synth import write_synthetic
  del gguf_file
  names = {k.name for k in knobs(info(str(write_synthetic("/tmp/structsearch-test-youtu.gguf", "youtu", layers=1, quant="q8_0"))))}
  assert not any(n.startswith(("topk", "merge_gate_up_routed", "barrier.expert", "barrier.router")) for n in names)
  assert "merge_gate_up_dense" in names and not any(".expert" in n for n in names)


def test_sample_and_suggest_give_valid_configs(tiny) -> None:
  import optuna
  for seed in range(20): StructureConfig.from_json(sample(info(tiny), seed).to_json())
  study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
  for _ in range(5):
    trial = study.ask()
    assert isinstance(suggest(trial, info(tiny)), StructureConfig)
    study.tell(trial, 1.0)
  assert to_config({}) == StructureConfig()


def test_tiny_model_info(tiny) -> None:
  assert info(tiny) == TINY_INFO


@pytest.mark.parametrize("label", [lbl for lbl, _ in single_knob_changes(TINY_INFO) if not lbl.startswith("beam")])
def test_knob_is_equivalent_and_changes_the_kernels(tiny, label: str) -> None:
  cfg = dict(changes(tiny))[label]
  base_logits, base_kernels = run(tiny, StructureConfig().to_json())
  logits, kernels = run(tiny, cfg.to_json())
  scale = base_logits.std(axis=1)
  tol = 2e-2 if label.startswith(FP16_KNOBS) else 1e-4
  err = np.abs(logits - base_logits).max(axis=1) / scale
  assert err.max() <= tol, f"{label}: max |dlogit|/std {err.max():.3g} > {tol}"
  top2 = np.sort(base_logits, axis=1)[:, -2:]
  decisive = top2[:, 1] - top2[:, 0] > 2 * tol * scale
  np.testing.assert_array_equal(logits.argmax(1)[decisive], base_logits.argmax(1)[decisive])
  assert kernels != base_kernels, f"{label} runs exactly the baseline's kernels (same sources): it changes nothing"


def test_device_and_beam_conditional_knobs() -> None:
  from model.structure import PROCESS_SETTINGS
  from space.knobs import parse_pins, to_params
  cpu, cuda = {k.name for k in knobs(TINY_INFO, "CPU")}, {k.name for k in knobs(TINY_INFO, "CUDA:0")}
  assert cuda - cpu == {"mv_blocksize", "mv_threads_per_row", "mv_rows_per_thread", "jit_batch_size"}  # no matvec heuristic or graphs on CPU
  assert {"beam_upcast_max", "beam_local_max", "beam_min_progress"} <= cpu
  fixed = np.prod([len(k.choices) for k in knobs(TINY_INFO, "CUDA") if k.when_beam is None and k.name != "beam"])
  assert size(TINY_INFO, "CUDA") == fixed * (4 * 5 * 4 + 4 * 3 * 3 * 3)  # BEAM=0: the matvec knobs; BEAM>0: the BEAM limits
  for seed in range(30):  # every sampled config round-trips through Optuna parameters, conditional knobs only where they apply
    cfg = sample(TINY_INFO, seed, "CUDA")
    params = to_params(cfg, TINY_INFO, "CUDA")
    assert to_config(params) == cfg and ("mv_blocksize" in params) == (cfg.beam == 0) and ("beam_local_max" in params) == (cfg.beam > 0)
  assert StructureConfig(jit_batch_size=0).process_env()["JIT_BATCH_SIZE"] == "0" and len(PROCESS_SETTINGS) == 7
  assert parse_pins(["beam=0", "topk=sort", "router_fp32=false"], TINY_INFO) == {"beam": 0, "topk": "sort", "router_fp32": False}
  for bad in ("beam=3", "nosuch=1", "mv_blocksize=4"):  # a value outside the domain, an unknown knob, a GPU knob on the CPU
    with pytest.raises(ConfigError): parse_pins([bad], TINY_INFO, "CPU")
  with pytest.raises(ConfigError, match="do not apply"): to_params(StructureConfig(mv_blocksize=2), TINY_INFO, "CPU")
