"""The search space as data: every StructureConfig knob with its domain, default and the condition under which it applies.

Optuna needs each parameter name to keep one set of choices for a whole study; a study belongs to one model file and one
device kind, and knobs whose domain depends on the file (per-quant-type backends) carry the type in their name.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model import backends
from model.backends import device_kind
from model.gguf_file import GGUFFile
from model.quants import QUANT_TYPES
from model.structure import (
  ATTENTION,
  BARRIER_MODES,
  BEAM_WIDTHS,
  DEFAULT_BARRIERS,
  DTYPES,
  FFN_ACTS,
  MLA_ABSORB,
  PROCESS_SETTINGS,
  TOPK_VARIANTS,
  ConfigError,
  StructureConfig,
)

SPACE_VERSION = 5
GPU_DEVICES = ("CUDA", "NV", "AMD", "METAL", "CL", "QCOM", "WEBGPU")  # renderers with local (workgroup) dims
GRAPH_DEVICES = ("CUDA", "NV", "AMD", "METAL")  # devices whose JIT batches kernels into graphs


@dataclass(frozen=True)
class ModelInfo:
  """What the space needs to know of a model file."""
  moe: bool
  dense_blocks: bool
  shared_experts: bool
  quants: dict[str, tuple[str, ...]]  # role -> quant types of that role's weight matrices
  mergeable: frozenset[str] = frozenset()  # FFN kinds whose gate and up share one type in every block (routed, shared, dense)
  split_kv_b: bool = True  # attn_k_b/attn_v_b tensors (False: the legacy attn_kv_b, which the fused attention does not read)
  ffn_quants: tuple[str, ...] = ()  # quant types of the FFN matrices (gate, up, down: routed, shared and dense)

  @classmethod
  def from_gguf(cls, f: GGUFFile) -> ModelInfo:
    roles: dict[str, set[str]] = {"dense": set(), "expert": set()}
    ffn: set[str] = set()
    for t in f.tensors.values():
      if len(t.shape) < 2 or t.name.endswith(("norm.weight", "ffn_gate_inp.weight")): continue
      quant = QUANT_TYPES[t.ggml_type].name
      roles["expert" if "_exps." in t.name else "dense"].add(quant)
      if t.name.split(".")[-2].startswith(("ffn_gate", "ffn_up", "ffn_down")): ffn.add(quant)
    n_dense = f.key("leading_dense_block_count", 0)
    pairs = {"routed": ("ffn_gate_exps", "ffn_up_exps"), "shared": ("ffn_gate_shexp", "ffn_up_shexp"), "dense": ("ffn_gate", "ffn_up")}
    def same_types(gate: str, up: str) -> bool:
      found = [(t, f.tensors.get(t.name.replace(gate, up))) for t in f.tensors.values() if t.name.endswith(f".{gate}.weight")]
      return bool(found) and all(u is not None and u.ggml_type == g.ggml_type for g, u in found)
    return cls(moe=bool(roles["expert"]), dense_blocks=n_dense > 0, shared_experts=any("_shexp." in n for n in f.tensors),
               quants={r: tuple(sorted(q)) for r, q in roles.items() if q},
               mergeable=frozenset(k for k, (g, u) in pairs.items() if same_types(g, u)),
               split_kv_b=not any(n.endswith("attn_kv_b.weight") for n in f.tensors), ffn_quants=tuple(sorted(ffn)))


@dataclass(frozen=True)
class Knob:
  name: str
  choices: tuple
  default: Any
  applies: Callable[[ModelInfo], bool]
  doc: str
  when: Callable[[dict[str, Any]], bool] | None = None  # a condition on the values of the knobs before it (None: always)
  enable: tuple[tuple[str, Any], ...] = ()  # earlier knob values under which `when` holds (for single-knob changes)


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

# the fused stages a model has, and what each needs of the file: attention the split k_b/v_b tensors, moe and ffn one type
# for gate and up (their kernels read both rows in one pass)
_STAGE_APPLIES: dict[str, Callable[[ModelInfo], bool]] = {
  "attention": lambda m: m.split_kv_b, "router": _moe,
  "moe": lambda m: m.moe and "routed" in m.mergeable and (not m.shared_experts or "shared" in m.mergeable),
  "ffn": lambda m: (m.dense_blocks or not m.moe) and "dense" in m.mergeable}
# the per-op code a knob changes, by the fused stage that replaces it for decode: the knob applies while that stage is off,
# or (second set) also where the stage's dsl twin still runs that per-op code
_KNOB_STAGE = {"barrier.q_proj": "attention", "barrier.kv_a": "attention", "barrier.attn_out": "attention", "barrier.kv_write": "attention",
               "mla_absorb": "attention", "attention": "attention", "barrier.router_logits": "router", "topk": "router", "router_fp32": "router",
               "barrier.moe_gate_up": "moe", "barrier.expert_down": "moe", "barrier.moe_out": "moe", "barrier.shexp_gate_up": "moe",
               "merge_gate_up_routed": "moe", "merge_gate_up_shared": "moe", "barrier.dense_gate_up": "ffn", "merge_gate_up_dense": "ffn"}
_DSL_KEEPS = {"barrier.kv_write", "attention", "topk"}


def _stage_off(stage: str, knob: str) -> Callable[[dict[str, Any]], bool]:
  keep = ("off", "dsl") if knob in _DSL_KEEPS else ("off",)
  return lambda v: v.get(f"fused.{stage}", "off") in keep


def _block_out(info: ModelInfo) -> Callable[[dict[str, Any]], bool]:
  """block_out bounds the per-op FFN's output: it matters while any block's FFN stage (moe, ffn) runs per op."""
  stages = [s for s, has in (("moe", info.moe), ("ffn", info.dense_blocks or not info.moe)) if has]
  return lambda v: any(v.get(f"fused.{s}", "off") == "off" for s in stages)


def knobs(info: ModelInfo, device: str = "CPU") -> list[Knob]:
  """The knobs that apply to this model on this device kind, in a fixed order: the fused stages first (with the fused FFN
  stages' activations), then the per-op knobs (each only while the stage it belongs to runs per op), BEAM and the knobs
  that need BEAM > 0 last."""
  ks = [Knob(f"fused.{st}", ("off", *backends.stage_choices(st, device)), "off", _STAGE_APPLIES[st],
             f"decode {st} as fused kernels of a backend (model/backends STAGES), or per op") for st in backends.STAGES]
  ffn_stages = [s for s in ("moe", "ffn") if _STAGE_APPLIES[s](info) and backends.stage_choices(s, device)]
  if ffn_stages and info.ffn_quants and set(info.ffn_quants) <= set(backends.Q8_TYPES):
    choices = backends.stage_choices(ffn_stages[0], device)
    ks.append(Knob("ffn_act", FFN_ACTS, "float32", _always, "the fused FFN stages' activations: float32, or rounded to 8 bits per 32 "
                   "with integer dot products (llama.cpp's mmvq)", lambda v: any(v.get(f"fused.{s}", "off") != "off" for s in ("moe", "ffn")),
                   ((f"fused.{ffn_stages[0]}", "native" if "native" in choices else choices[0]),)))
  ks += [Knob(f"barrier.{p}", BARRIER_CHOICES.get(p, BARRIER_MODES), DEFAULT_BARRIERS[p], _BARRIER_APPLIES.get(p, _always),
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
    ks += [Knob(f"backend.{q}.{role}", backends.choices(q, device), "tensor", _always, f"kernel backend for {q} {role} weights",
                _stage_off("moe", "") if role == "expert" else None) for q in quants]
  ks.append(Knob("beam", BEAM_WIDTHS, 0, _always, "BEAM width for the decode kernels"))
  kind, base = device_kind(device), StructureConfig()
  for f, (var, allowed) in PROCESS_SETTINGS.items():
    if f == "beam_local_max" and kind not in GPU_DEVICES: continue  # no local (workgroup) dims to limit
    if f.startswith("beam_"):
      ks.append(Knob(f, allowed, getattr(base, f), _always, f"tinygrad {var} (when BEAM > 0)", lambda v: v["beam"] > 0, (("beam", 2),)))
    elif f == "jit_batch_size" and kind in GRAPH_DEVICES: ks.append(Knob(f, allowed, getattr(base, f), _always, f"tinygrad {var}"))
  out = []
  for k in ks:
    if not k.applies(info): continue
    stage = _KNOB_STAGE.get(k.name)
    if stage and _STAGE_APPLIES[stage](info) and backends.stage_choices(stage, device): k = dataclasses.replace(k, when=_stage_off(stage, k.name))
    elif k.name == "barrier.block_out": k = dataclasses.replace(k, when=_block_out(info))
    out.append(k)
  return out


def to_config(values: dict[str, Any]) -> StructureConfig:
  """Knob values (by knob name; absent knobs keep their defaults) -> a StructureConfig."""
  fields: dict[str, Any] = {"barriers": dict(DEFAULT_BARRIERS), "backends": {}, "fused": {}}
  for name, v in values.items():
    kind, _, rest = name.partition(".")
    if kind == "barrier": fields["barriers"][rest] = v
    elif kind == "fused":
      if v != "off": fields["fused"][rest] = v
    elif kind == "backend":
      q, role = rest.split(".")
      if v != "tensor": fields["backends"][f"{q}:{role}"] = v
    else: fields[name] = v
  return StructureConfig(**fields)


def to_params(cfg: StructureConfig, info: ModelInfo, device: str = "CPU") -> dict[str, Any]:
  """The knob values of a config, as Optuna parameters of this model's space (inverse of to_config); ConfigError when the
  config sets something this space cannot express (a knob that does not apply here, or a value outside its domain)."""
  d, ks = cfg.to_dict(), knobs(info, device)
  value = lambda k: (d["barriers"][k.name[8:]] if k.name.startswith("barrier.") else
                     cfg.backend(*k.name[8:].split(".")) if k.name.startswith("backend.") else
                     cfg.fused.get(k.name[6:], "off") if k.name.startswith("fused.") else d[k.name])
  params = _choose(ks, value)
  for k in ks:
    if k.name in params and params[k.name] not in k.choices:
      raise ConfigError(f"{k.name}={params[k.name]!r} is outside this space's domain: {', '.join(map(str, k.choices))}")
  if to_config(params) != cfg:
    extra = set(describe(cfg).split()) - set(describe(to_config(params)).split())
    raise ConfigError(f"the config sets knobs that do not apply to this model and device: {' '.join(sorted(extra))}")
  return params


def _choose(ks: list[Knob], pick: Callable[[Knob], Any]) -> dict[str, Any]:
  values: dict[str, Any] = {}
  for k in ks:
    if k.when is None or k.when(values): values[k.name] = pick(k)
  return values


def suggest(trial, info: ModelInfo, device: str = "CPU", fixed: dict[str, Any] | None = None) -> StructureConfig:
  """Define-by-run: ask an Optuna trial for every knob that applies to this model and device (conditional ones only when
  they apply), except the knobs pinned in `fixed`."""
  fixed = fixed or {}
  return to_config(_choose(knobs(info, device), lambda k: fixed[k.name] if k.name in fixed else trial.suggest_categorical(k.name, k.choices)))


def parse_pins(pins: list[str], info: ModelInfo, device: str = "CPU") -> dict[str, Any]:
  """`knob=value` strings (the CLI's --fix) -> knob values, checked against this space."""
  ks, out = {k.name: k for k in knobs(info, device)}, {}
  for pin in pins:
    name, _, text = pin.partition("=")
    if name not in ks: raise ConfigError(f"--fix {pin}: no knob {name!r} in this space; knobs: {', '.join(ks)}")
    match = [c for c in ks[name].choices if str(c).lower() == text.lower()]
    if not match: raise ConfigError(f"--fix {pin}: {name} takes one of {', '.join(map(str, ks[name].choices))}")
    out[name] = match[0]
  return out


def sample(info: ModelInfo, seed: int, device: str = "CPU") -> StructureConfig:
  rng = random.Random(seed)
  return to_config(_choose(knobs(info, device), lambda k: rng.choice(k.choices)))


def size(info: ModelInfo, device: str = "CPU", pins: dict[str, Any] | None = None) -> int:
  """Distinct configurations of this model's space on this device kind (conditional knobs counted where they apply; with
  `pins`: of the sub-space they leave)."""
  pins = pins or {}
  ks = knobs(info, device)
  roots = [k for k in ks if k.name.startswith("fused.") or k.name == "beam"]  # every condition reads only these
  rest = [k for k in ks if k not in roots]
  n = lambda k: 1 if k.name in pins else len(k.choices)
  combos = itertools.product(*([pins[r.name]] if r.name in pins else r.choices for r in roots))
  values = (dict(zip([r.name for r in roots], c, strict=True)) for c in combos)
  return sum(math.prod(n(k) for k in rest if k.when is None or k.when(v)) for v in values)


def defaults(ks: list[Knob], fixed: dict[str, Any] | None = None) -> dict[str, Any]:
  """The baseline's knob values (the pinned ones at their pins), every knob that applies under them."""
  fixed = fixed or {}
  return _choose(ks, lambda k: fixed.get(k.name, k.default))


def one_knob_away(values: dict[str, Any], ks: list[Knob], fixed: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
  """(knob, knob values) of every config one knob away from `values` (all the knobs that apply under them, pinned ones
  included), in the space's order: each knob that applies and is not pinned, each of its other choices in order; the
  knobs a change makes apply come at their defaults (or pins), the others keep their values."""
  fixed, out = fixed or {}, []
  for k in ks:
    if k.name not in values or k.name in fixed: continue
    for v in k.choices:
      if v != values[k.name]:
        out.append((k.name, _choose(ks, lambda j, k=k, v=v: v if j.name == k.name else fixed.get(j.name, values.get(j.name, j.default)))))
  return out


def single_knob_changes(info: ModelInfo, device: str = "CPU") -> list[tuple[str, StructureConfig]]:
  """(label, config) for every non-default value of every knob, all else at the baseline (a conditional knob with the
  earlier values that make it apply: BEAM's limits at BEAM=2)."""
  return [(f"{k.name}={v}", to_config(dict(k.enable) | {k.name: v})) for k in knobs(info, device) for v in k.choices if v != k.default]


def describe(config: StructureConfig) -> str:
  """The knob values where a config differs from the baseline, as `name=value` (empty for the baseline)."""
  base, d, parts = StructureConfig().to_dict(), config.to_dict(), []
  for name, v in d.items():
    if name in ("barriers", "backends", "fused"):
      label, default = {"barriers": ("barrier", None), "backends": ("backend", "tensor"), "fused": ("fused", "off")}[name]
      parts += [f"{label}.{p}={m}" for p, m in sorted(v.items()) if base[name].get(p, default) != m]
    elif v != base[name]: parts.append(f"{name}={v}")
  return " ".join(parts)

