"""The knob proof shared by the space tests: one config's teacher-forced logits and decode-step kernels, and the check
that a knob value keeps the baseline's logits (within its arithmetic's tolerance) while running different kernels.

Tolerances, relative to the logits' std per position: 1e-3 for knobs that only reorder float32 work; 2e-2 for knobs that
round to fp16 (fp16 weights cache, fp16 activations, the fp16 absorbed q projection, fp16 router input); 5e-2 (the
gate's FP16_TOL) for 8-bit activations (the FFN's, the attention's dense products') and the q8_0 KV cache. A float32
reordering alone moves logits by ~1e-6 of their std, but the baseline keeps an fp16 KV cache: a reordered sum that feeds
it can land on the other side of an fp16 rounding boundary (2^-11 of the entry), which later positions read, and that
reaches the order of 1e-4 of the logits' std. A real defect moves them by O(1). For the same reason kv_dtype=float32 is
held to the fp16 bound, and so are the backends: fp16_cache rounds weights to fp16, and the others sum a row's products
in another order than the baseline's float32 reduction.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from evaluator.gate import FP16_TOL, rel_err
from model.deepseek2 import Transformer
from model.generate import Generator, jit_kernels, jit_stats
from model.gguf_file import GGUFFile
from model.structure import KNOBS, StructureConfig
from space.knobs import ModelInfo, flat, to_config

FP16_KNOBS = ("backend.", "fused.", "act_dtype", "mla_absorb", "router_fp32", "kv_dtype", "attn_layout",
              "prefill_dtype", "prefill_attn_dtype")
# the prompt's: proved on the prefill graph (run_prefill), which decode never runs
PREFILL_KNOBS = ("prefill_",)
# 8-bit activations and the 8-bit KV cache: held to the gate's tolerance of their class
Q8_KNOBS = ("ffn_act", "attn_act", "kv_dtype=q8_0")


def mix_info(mix: str, preset: str = "tiny") -> ModelInfo:
  """What the space knows of a synthetic MoE file (preset tiny or glm: GLM-4.7-Flash-shaped) in a quant mix: q4_k_m
  mixes Q4_K, Q5_K, Q6_K and Q8_0 dense weights (in the attention's dense products Q5_K, and on tiny Q8_0 too) with
  Q4_K and Q6_K experts; the others are pure."""
  mixed = {"dense": ("Q4_K", "Q5_K", "Q6_K", "Q8_0"), "expert": ("Q4_K", "Q6_K")}
  quants = mixed if mix == "q4_k_m" else dict.fromkeys(("dense", "expert"), (mix.upper(),))
  ffn = ("Q4_K", "Q5_K", "Q6_K") if mix == "q4_k_m" else (mix.upper(),)
  attn = ({"tiny": ("Q5_K", "Q8_0"), "glm": ("Q5_K",)}[preset] if mix == "q4_k_m" else (mix.upper(),))
  return ModelInfo(True, True, True, quants, frozenset({"routed", "shared", "dense"}), ffn_quants=ffn, attn_quants=attn)


@functools.cache
def gguf(path: str) -> GGUFFile:
  """One parsed file per path (its tensors are read from the page cache by each config: kept in memory, the bytes of the
  GLM-width files of four mixes would hold gigabytes for the worker's whole life)."""
  return GGUFFile(path)


@functools.cache
def run(path: str, cfg_json: str, tokens: tuple[int, ...]) -> tuple[np.ndarray, tuple[tuple[str, str], ...]]:
  """Under one config, the decode step's logits teacher-forced on `tokens` (one step per token: the path the search
  measures) and that step's kernels (name, source). The kernels are the logits step's graph, the search's decode step
  but for the argmax after the head: one graph captured per config (each costs seconds of scheduling on the CPU)."""
  m = Transformer(gguf(path), StructureConfig.from_json(cfg_json), max_context=len(tokens) + 1)
  logits, gen = decode(m, tokens, 0)
  return logits, tuple(jit_kernels(gen.step_logits_jit))


def decode(m: Transformer, tokens: tuple[int, ...], steps: int) -> tuple[np.ndarray, Generator]:
  """Teacher-forced decode logits (len(tokens), vocab) float64, then `steps` more decode steps so the step JIT is
  captured."""
  gen = Generator(m, chunk=1)
  logits = np.stack([gen.step_logits(t, i) for i, t in enumerate(tokens)]).astype(np.float64)
  for i in range(steps): gen.step(1, len(tokens) + i)
  return logits, gen


@functools.cache
def routed(path: str, cfg_json: str, tokens: tuple[int, ...], sel: bytes | None = None) -> tuple[np.ndarray, bytes]:
  """Teacher-forced decode logits (len(tokens), vocab) through the correctness check's path (Generator.check_step),
  every MoE block using the experts of `sel` (the bytes of an int array (positions, n_moe, K)) where given; and its
  own selections, as such bytes."""
  gen = Generator(Transformer(gguf(path), StructureConfig.from_json(cfg_json), max_context=len(tokens) + 1), chunk=1)
  forced = None if sel is None else np.frombuffer(sel, np.int64).reshape(len(tokens), -1, gen.model.hp.n_used)
  out = [gen.check_step(t, i, None if forced is None else forced[i]) for i, t in enumerate(tokens)]
  return np.stack([o[0] for o in out]).astype(np.float64), np.stack([o[1] for o in out]).astype(np.int64).tobytes()


@functools.cache
def run_prefill(path: str, cfg_json: str, tokens: tuple[int, ...]) -> tuple[np.ndarray, tuple[tuple[str, str], ...]]:
  """Under one config, the prefill's logits over `tokens` (len(tokens), vocab) float64, in the config's chunks, and the
  kernels of its captured prefill graph. The cache holds the largest chunk, so no chunk is cut to fit."""
  size = max(KNOBS["prefill_chunk"].valid())
  gen = Generator(Transformer(gguf(path), StructureConfig.from_json(cfg_json), max_context=size))
  return gen.prefill(list(tokens)).astype(np.float64), tuple(jit_kernels(gen.prefill_jit))


def check_prefill_knob(path: str, label: str, cfg: StructureConfig, tokens: tuple[int, ...]) -> None:
  """check_knob's proof on the prefill graph: logits over the prompt within the knob's tolerance of the baseline's, and
  other kernels than the config's with this knob at its default (a knob that needs another's value is proved against
  that value, not against the baseline, which the other knob alone already changes)."""
  name = label.split("=")[0]
  base_logits = run_prefill(path, StructureConfig().to_json(), tokens)[0]
  logits, kernels = run_prefill(path, cfg.to_json(), tokens)
  own = to_config(flat(cfg) | {name: KNOBS[name].default})
  assert_close(label, logits, base_logits, 2e-2 if label.startswith(FP16_KNOBS) else 1e-3)
  assert code(kernels) != code(run_prefill(path, own.to_json(), tokens)[1]), (f"{label} runs exactly the prefill "
                                                                              "kernels it runs without it")


def check_knob(path: str, label: str, cfg: StructureConfig, tokens: tuple[int, ...]) -> None:
  """(a) logits equal the baseline's within the knob's tolerance, the top token agrees wherever the baseline's lead
  exceeds it; (b) the decode step runs different kernels (names or sources) than the baseline's. 8-bit knobs are
  compared with every MoE block routed as the baseline routes (the gate's forced routing): their rounding may send a
  router's near-tie to the other expert, which free routing then carries on. The prefill knobs: check_prefill_knob."""
  if label.startswith(PREFILL_KNOBS): return check_prefill_knob(path, label, cfg, tokens)
  base_logits, base_kernels = run(path, StructureConfig().to_json(), tokens)
  logits, kernels = run(path, cfg.to_json(), tokens)
  if label.startswith(Q8_KNOBS):
    base_logits, sel = routed(path, StructureConfig().to_json(), tokens)
    logits = routed(path, cfg.to_json(), tokens, sel)[0]
  assert_close(label, logits, base_logits,
               FP16_TOL if label.startswith(Q8_KNOBS) else 2e-2 if label.startswith(FP16_KNOBS) else 1e-3)
  assert code(kernels) != code(base_kernels), (f"{label} runs exactly the baseline's kernels (same sources): it "
                                               "changes nothing")
  k = KNOBS.get(label.partition("=")[0])  # None: a label of several knobs (test_space_glm's barriers=realize)
  # against the fused stage it needs with the knob at its default, which differs from the baseline
  if k is not None and k.fused_in:
    enabling = to_config(flat(cfg) | {k.name: k.default})
    assert code(kernels) != code(run(path, enabling.to_json(), tokens)[1]), (
      f"{label} runs exactly the kernels of {enabling.non_defaults()} (same sources): it changes nothing")


def code(kernels: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
  """The kernels' sources without their parameters' names, which number the graph's buffers (data1_160 for the same
  parameter of the same kernel in another graph): a knob whose only trace is that numbering changes nothing."""
  return tuple(re.sub(r"\b(data\d+)_\d+\b", r"\1", src) for _, src in kernels)


def assert_close(label: str, logits: np.ndarray, base: np.ndarray, tol: float) -> None:
  """Per position: max |logit - base| within tol x the base logits' std, and the same top token where base's lead > 2
  tol."""
  scale, err = base.std(axis=1), rel_err(logits, base)
  assert err.max() <= tol, (f"{label}: positions {np.flatnonzero(err > tol).tolist()}: max |dlogit|/std "
                            f"{err.max():.3g} > {tol:.3g}")
  top2 = np.sort(base, axis=1)[:, -2:]
  decisive = top2[:, 1] - top2[:, 0] > 2 * tol * scale
  np.testing.assert_array_equal(logits.argmax(1)[decisive], base.argmax(1)[decisive])


@functools.cache
def run_fresh(path: str, cfg_json: str, tokens: tuple[int, ...], steps: int = 3) -> tuple[np.ndarray, tuple, int]:
  """`run` in a fresh process with the config's tinygrad process settings applied at its start, as a trial applies them
  (tinygrad reads them once and caches compiled kernels by their AST alone), plus the decode step's JIT graph
  batches."""
  with tempfile.TemporaryDirectory() as d:
    subprocess.run([sys.executable, __file__, path, cfg_json, ",".join(map(str, tokens)), str(steps), d], check=True)
    logits = np.load(os.path.join(d, "logits.npy"))
    with open(os.path.join(d, "kernels.json")) as f: out = json.load(f)
  return logits, tuple(map(tuple, out["kernels"])), out["batches"]


def check_process_setting(path: str, label: str, cfg: StructureConfig, tokens: tuple[int, ...]) -> None:
  """A process-setting knob value against the baseline at the same BEAM, each in a fresh process: decode logits within
  the fp16 bound (a new schedule reorders float32 sums, which moves entries of the baseline's fp16 KV cache across a
  rounding boundary), the top token kept where decisive, and different kernels (names or sources) or, for the JIT batch
  size, different graph batches."""
  base_logits, base_kernels, base_batches = run_fresh(path, StructureConfig(beam=cfg.beam).to_json(), tokens)
  logits, kernels, batches = run_fresh(path, cfg.to_json(), tokens)
  changed = batches != base_batches if label.startswith("jit_batch_size") else code(kernels) != code(base_kernels)
  assert changed, f"{label} runs exactly the baseline's kernels and graph batches: it changes nothing"
  assert_close(label, logits, base_logits, 2e-2)


if __name__ == "__main__":
  from model.settings import apply_process_settings
  path, cfg_json, toks, steps, out_dir = sys.argv[1:]
  cfg = StructureConfig.from_json(cfg_json)
  apply_process_settings(cfg)
  tokens = tuple(int(t) for t in toks.split(","))
  logits, gen = decode(Transformer(GGUFFile(path), cfg, max_context=len(tokens) + int(steps) + 1), tokens, int(steps))
  np.save(os.path.join(out_dir, "logits.npy"), logits)
  with open(os.path.join(out_dir, "kernels.json"), "w") as f:
    json.dump({"kernels": jit_kernels(gen.step_jit), "batches": jit_stats(gen.step_jit)[1]}, f)
