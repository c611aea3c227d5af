"""The search space as data: every StructureConfig knob with its domain, default and the condition under which it applies.

Optuna needs each parameter name to keep one set of choices for a whole study; a study belongs to one model file and one
device kind, and knobs whose domain depends on the file (per-quant-type backends) carry the type in their name.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model.gguf_file import GGUFFile
from model.quants import QUANT_TYPES
from model.structure import (
  ATTENTION,
  BACKENDS,
  BARRIER_MODES,
  DEFAULT_BARRIERS,
  DTYPES,
  MLA_ABSORB,
  TOPK_VARIANTS,
  StructureConfig,
)

SPACE_VERSION = 1


@dataclass(frozen=True)
class ModelInfo:
  """What the space needs to know of a model file."""
  moe: bool
  dense_blocks: bool
  shared_experts: bool
  quants: dict[str, tuple[str, ...]]  # role -> quant types of that role's weight matrices
  mergeable: frozenset[str] = frozenset()  # FFN kinds whose gate and up share one type in every block (routed, shared, dense)

  @classmethod
  def from_gguf(cls, f: GGUFFile) -> ModelInfo:
    roles: dict[str, set[str]] = {"dense": set(), "expert": set()}
    for t in f.tensors.values():
      if len(t.shape) < 2 or t.name.endswith(("norm.weight", "ffn_gate_inp.weight")): continue
      roles["expert" if "_exps." in t.name else "dense"].add(QUANT_TYPES[t.ggml_type].name)
    n_dense = f.key("leading_dense_block_count", 0)
    pairs = {"routed": ("ffn_gate_exps", "ffn_up_exps"), "shared": ("ffn_gate_shexp", "ffn_up_shexp"), "dense": ("ffn_gate", "ffn_up")}
    def same_types(gate: str, up: str) -> bool:
      found = [(t, f.tensors.get(t.name.replace(gate, up))) for t in f.tensors.values() if t.name.endswith(f".{gate}.weight")]
      return bool(found) and all(u is not None and u.ggml_type == g.ggml_type for g, u in found)
    return cls(moe=bool(roles["expert"]), dense_blocks=n_dense > 0, shared_experts=any("_shexp." in n for n in f.tensors),
               quants={r: tuple(sorted(q)) for r, q in roles.items() if q},
               mergeable=frozenset(k for k, (g, u) in pairs.items() if same_types(g, u)))


@dataclass(frozen=True)
class Knob:
  name: str
  choices: tuple
  default: Any
  applies: Callable[[ModelInfo], bool]
  doc: str


_moe = lambda m: m.moe
_always = lambda m: True
_BARRIER_APPLIES: dict[str, Callable[[ModelInfo], bool]] = {
  "router_logits": _moe, "moe_gate_up": _moe, "expert_down": _moe, "moe_out": _moe,
  "shexp_gate_up": lambda m: m.shared_experts, "dense_gate_up": lambda m: m.dense_blocks or not m.moe,
}


# where tinygrad's scheduler already ends a kernel, "none" and "contiguous" build identical kernels (tests/test_space.py
# compares kernel sources), so those points offer only one of the two
BARRIER_CHOICES = {"q_proj": ("none", "realize"), "kv_a": ("none", "realize"), "kv_write": ("none", "realize"),
                   "dense_gate_up": ("contiguous", "realize"), "block_out": ("contiguous", "realize")}


def knobs(info: ModelInfo) -> list[Knob]:
  """The knobs that apply to this model, in a fixed order."""
  ks = [Knob(f"barrier.{p}", BARRIER_CHOICES.get(p, BARRIER_MODES), DEFAULT_BARRIERS[p], _BARRIER_APPLIES.get(p, _always),
             f"kernel boundary (contiguous) or execution barrier (realize) at {p}") for p in DEFAULT_BARRIERS]
  ks += [Knob(f"merge_gate_up_{kind}", (False, True), False, lambda m, kind=kind: kind in m.mergeable, f"{kind} FFN gate and up as one matrix")
         for kind in ("routed", "shared", "dense")]
  ks += [
         Knob("topk", TOPK_VARIANTS, "pairwise", _moe, "top-k routing: pairwise comparison matrix, sort-based, or k argmax passes"),
         Knob("mla_absorb", MLA_ABSORB, "runtime", _always, "apply k_b per token, or absorb it into the q projection at load (fp16)"),
         Knob("kv_dtype", DTYPES, "float16", _always, "KV cache dtype"),
         Knob("attention", ATTENTION, "explicit", _always, "explicit matmul+softmax or scaled_dot_product_attention"),
         Knob("act_dtype", DTYPES, "float32", _always, "residual stream dtype"),
         Knob("router_fp32", (True, False), True, _moe, "router matmul input in float32")]
  for role, quants in info.quants.items():
    ks += [Knob(f"backend.{q}.{role}", BACKENDS, "tensor", _always, f"kernel backend for {q} {role} weights") for q in quants]
  ks.append(Knob("beam", (0, 1, 2, 4, 8), 0, _always, "BEAM width for the decode kernels"))
  return [k for k in ks if k.applies(info)]


def to_config(values: dict[str, Any]) -> StructureConfig:
  """Knob values (by knob name; absent knobs keep their defaults) -> a StructureConfig."""
  fields: dict[str, Any] = {"barriers": dict(DEFAULT_BARRIERS), "backends": {}}
  for name, v in values.items():
    kind, _, rest = name.partition(".")
    if kind == "barrier": fields["barriers"][rest] = v
    elif kind == "backend":
      q, role = rest.split(".")
      if v != "tensor": fields["backends"][f"{q}:{role}"] = v
    else: fields[name] = v
  return StructureConfig(**fields)


def suggest(trial, info: ModelInfo) -> StructureConfig:
  """Define-by-run: ask an Optuna trial for every knob that applies to this model."""
  return to_config({k.name: trial.suggest_categorical(k.name, k.choices) for k in knobs(info)})


def sample(info: ModelInfo, seed: int) -> StructureConfig:
  rng = random.Random(seed)
  return to_config({k.name: rng.choice(k.choices) for k in knobs(info)})


def size(info: ModelInfo) -> int:
  """Distinct configurations of this model's space."""
  return math.prod(len(k.choices) for k in knobs(info))


def single_knob_changes(info: ModelInfo) -> list[tuple[str, StructureConfig]]:
  """(label, config) for every non-default value of every knob, all else at the baseline."""
  return [(f"{k.name}={v}", to_config({k.name: v})) for k in knobs(info) for v in k.choices if v != k.default]

