"""The search space as data: the knobs of one model file on one device kind, derived from their declarations beside the
StructureConfig fields (model/structure.py): domain, default, and the condition under which each applies.

Optuna needs each parameter name to keep one set of choices for a whole study; a study belongs to one model file and one
device kind, and knobs whose domain depends on the file (per-quant-type backends) carry the type in their name. A knob's
name is its one spelling: Optuna's parameter, `--fix`, `--where` and the views' columns.
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model.backends import catalog
from model.backends.catalog import device_kind
from model.gguf_file import GGUFFile
from model.quant_types import QUANT_TYPES
from model.structure import KNOBS, STAGES, ConfigError, StructureConfig, knob_named

SPACE_VERSION = 10


@dataclass(frozen=True)
class ModelInfo:
  """What the space needs to know of a model file."""
  moe: bool
  dense_blocks: bool
  shared_experts: bool
  quants: dict[str, tuple[str, ...]]  # role -> quant types of that role's weight matrices
  # FFN kinds whose gate and up share one type in every block (routed, shared, dense)
  mergeable: frozenset[str] = frozenset()
  # attn_k_b/attn_v_b tensors (False: the legacy attn_kv_b, which the fused attention does not read)
  split_kv_b: bool = True
  ffn_quants: tuple[str, ...] = ()  # quant types of the FFN matrices (gate, up, down: routed, shared and dense)
  # quant types of the attention's dense products (q_a, kv_a, q_b or q, the output projection): what attn_act reads
  attn_quants: tuple[str, ...] = ()
  # the fused stages by the weight bytes their per-op path reads per decoded token, most first (stage_bytes); empty (a
  # study stored before it): the declared order
  stage_order: tuple[str, ...] = ()

  @classmethod
  def from_gguf(cls, f: GGUFFile) -> ModelInfo:
    roles: dict[str, set[str]] = {"dense": set(), "expert": set()}
    ffn, attn = set(), set()
    for t in f.tensors.values():
      if len(t.shape) < 2 or t.name.endswith(("norm.weight", "ffn_gate_inp.weight")): continue
      quant = QUANT_TYPES[t.ggml_type].name
      roles["expert" if "_exps." in t.name else "dense"].add(quant)
      if t.name.split(".")[-2].startswith(("ffn_gate", "ffn_up", "ffn_down")): ffn.add(quant)
      if t.name.split(".")[-2] in catalog.ATTN_DENSE: attn.add(quant)
    n_dense, weights = f.key("leading_dense_block_count", 0), stage_bytes(f)
    pairs = {"routed": ("ffn_gate_exps", "ffn_up_exps"), "shared": ("ffn_gate_shexp", "ffn_up_shexp"),
             "dense": ("ffn_gate", "ffn_up")}
    def same_types(gate: str, up: str) -> bool:
      found = [(t, f.tensors.get(t.name.replace(gate, up))) for t in f.tensors.values()
               if t.name.endswith(f".{gate}.weight")]
      return bool(found) and all(u is not None and u.ggml_type == g.ggml_type for g, u in found)
    return cls(moe=bool(roles["expert"]), dense_blocks=n_dense > 0,
               shared_experts=any("_shexp." in n for n in f.tensors),
               quants={r: tuple(sorted(q)) for r, q in roles.items() if q},
               mergeable=frozenset(k for k, (g, u) in pairs.items() if same_types(g, u)),
               split_kv_b=not any(n.endswith("attn_kv_b.weight") for n in f.tensors), ffn_quants=tuple(sorted(ffn)),
               attn_quants=tuple(sorted(attn)),
               stage_order=tuple(sorted(STAGES, key=lambda st: -weights[st])))


def stage_bytes(f: GGUFFile) -> dict[str, int]:
  """Weight bytes each decode stage reads per token: the attention's projections, the router's matrix, the MoE's shared
  experts and its routed experts' used share (expert_used_count of expert_count), the dense blocks' FFN."""
  out = dict.fromkeys(STAGES, 0)
  used = f.key("expert_used_count", 0) / max(1, f.key("expert_count", 1))
  for t in f.tensors.values():
    kind = t.name.split(".")[-2]
    if len(t.shape) < 2 or kind.endswith("norm"): continue
    if kind.startswith("attn_"): out["attention"] += t.nbytes
    elif kind == "ffn_gate_inp": out["router"] += t.nbytes
    elif kind.endswith("_exps"): out["moe"] += round(t.nbytes * used)
    elif kind.endswith("_shexp"): out["moe"] += t.nbytes
    elif kind.startswith("ffn_"): out["ffn"] += t.nbytes
  return out


@dataclass(frozen=True)
class Knob:
  """A knob of one model's space on one device: the values the search tries, its default, what it changes, the condition
  on the values of the knobs before it under which it applies (None: always), and earlier knob values under which that
  condition holds (for single-knob changes)."""
  name: str
  choices: tuple
  default: Any
  doc: str
  when: Callable[[dict[str, Any]], bool] | None = None
  enable: tuple[tuple[str, Any], ...] = ()


def _fused(stage: str) -> str: return f"fused.{stage}"


def knobs(info: ModelInfo, device: str = "CPU", family: str = "all") -> list[Knob]:
  """The knobs that apply to this model on this device kind with this backend family (catalog.FAMILIES), in the order of
  their declarations: the fused stages first (with the fused FFN stages' activations), then the weights' kernel backends
  and the dsl backend's rows (in the GPU studies the dense backends moved a fused step more than any knob but the
  stages: docs/benchmarks.md), then the per-op knobs (each only while a stage it belongs to runs per op) and the dtypes,
  BEAM and the knobs that need BEAM > 0 last. The fused stages come in the model's stage_order: fusing a stage saves at
  most what its per-op kernels take, and the stage that reads the most weights (the MoE of an MoE model: per op, the
  decode step is mostly its kernels) is the one to try first."""
  kind = device_kind(device)
  fusable = lambda s: KNOBS[_fused(s)].applies(info) and bool(catalog.stage_choices(s, device, family))
  out = []
  for d in KNOBS.values():
    if not d.applies(info) or (d.devices is not None and kind not in d.devices): continue
    # a knob that needs a value another knob does not offer here never applies (all_heads' settings off CUDA)
    if any(value not in KNOBS[other].domain(device, family) for other, _, value in d.needs): continue
    conds, enable = [], ()
    # while one of its stages runs per op (or on a backend that keeps it)
    if stages := [s for s in d.stages if fusable(s)]:
      keep = ("off", *(n for n in catalog.names() if d.name in catalog.get(n).keeps))
      conds.append(lambda v, stages=stages, keep=keep: any(v.get(_fused(s), "off") in keep for s in stages))
    # only while one of these stages is fused; a single change fuses the first, device-specific where there is one
    if d.fused_in:
      only = d.on(info) if callable(d.on) else d.on
      by = lambda s, only=only: only is None or only in catalog.stage_choices(s, device, family)
      if not (on := [s for s in d.fused_in if fusable(s) and by(s)]): continue
      runs = lambda backend, only=only: backend == only if only else backend != "off"
      conds.append(lambda v, on=on, runs=runs: any(runs(v.get(_fused(s), "off")) for s in on))
      enable += ((_fused(on[0]), only or max(catalog.stage_choices(on[0], device, family),
                                             key=lambda b: not catalog.get(b).portable)),)
    for other, cond, value in d.needs:
      conds.append(lambda v, other=other, cond=cond: cond(v.get(other, KNOBS[other].default)))
      enable += ((other, value),)
    when = None if not conds else conds[0] if len(conds) == 1 else lambda v, conds=conds: all(c(v) for c in conds)
    out.append(Knob(d.name, d.domain(device, family), d.default, d.doc, when, enable))
  # the fused-stage knobs apply whatever the other knobs are, so their order among themselves is free
  rank = {_fused(st): i for i, st in enumerate(info.stage_order)}
  at = [i for i, k in enumerate(out) if k.name in rank]
  for i, k in zip(at, sorted((out[i] for i in at), key=lambda k: rank[k.name]), strict=True): out[i] = k
  return out


def to_config(values: dict[str, Any]) -> StructureConfig:
  """Knob values (by knob name; absent knobs keep their defaults) -> a StructureConfig."""
  fields: dict[str, Any] = {}
  for name, v in values.items():
    d = KNOBS[name]
    if d.key is None: fields[name] = v
    elif v != d.default: fields.setdefault(d.field, {})[d.key] = v
  return StructureConfig(**fields)


def flat(cfg: StructureConfig) -> dict[str, Any]:
  """Every knob value of a config, by knob name (the knobs of every model and device)."""
  return {name: d.value(cfg) for name, d in KNOBS.items()}


def changes(cfg: StructureConfig, base: StructureConfig) -> dict[str, Any]:
  """The knob values where a config differs from `base` (a study's baseline)."""
  b = flat(base)
  return {k: v for k, v in flat(cfg).items() if b[k] != v}


def describe(cfg: StructureConfig, base: StructureConfig | None = None) -> str:
  """The knob values where a config differs from `base` (default: the default config), as `name=value` (empty for
  it)."""
  return " ".join(f"{k}={v}" for k, v in changes(cfg, base or StructureConfig()).items())


def to_params(cfg: StructureConfig, info: ModelInfo, device: str = "CPU", family: str = "all") -> dict[str, Any]:
  """The knob values of a config, as Optuna parameters of this model's space (inverse of to_config); ConfigError when
  the config sets something this space cannot express (a knob that does not apply here, or a value outside its
  domain)."""
  ks = knobs(info, device, family)
  params = _choose(ks, lambda k: KNOBS[k.name].value(cfg))
  for k in ks:
    if k.name in params and params[k.name] not in k.choices:
      raise ConfigError(f"{k.name}={params[k.name]!r} is outside this space's domain: {', '.join(map(str, k.choices))}")
  if to_config(params) != cfg:
    raise ConfigError("the config sets knobs that do not apply to this model and device: "
                      f"{describe(cfg, to_config(params))}")
  return params


def _choose(ks: list[Knob], pick: Callable[[Knob], Any]) -> dict[str, Any]:
  values: dict[str, Any] = {}
  for k in ks:
    if k.when is None or k.when(values): values[k.name] = pick(k)
  return values


def suggest(trial, ks: list[Knob], fixed: dict[str, Any] | None = None) -> StructureConfig:
  """Define-by-run: ask an Optuna trial for every knob of the space `ks` (a study's: Setup.knobs; conditional ones only
  when they apply), except the knobs pinned in `fixed`, which hold their pins even where they do not apply (a config
  differs from the baseline only in what was changed)."""
  fixed = fixed or {}
  pick = lambda k: fixed[k.name] if k.name in fixed else trial.suggest_categorical(k.name, k.choices)
  return to_config(fixed | _choose(ks, pick))


def parse_pins(pins: list[str], info: ModelInfo, device: str = "CPU", family: str = "all") -> dict[str, Any]:
  """`knob=value` strings (the CLI's --fix) -> knob values, checked against this space."""
  ks, out = {k.name: k for k in knobs(info, device, family)}, {}
  for pin in pins:
    text, _, value = pin.partition("=")
    try: k = knob_named(text, ks)
    except ConfigError:
      raise ConfigError(f"--fix {pin}: no knob {text!r} in this space; knobs: {', '.join(ks)}") from None
    match = [c for c in k.choices if str(c).lower() == value.lower()]
    if not match: raise ConfigError(f"--fix {pin}: {k.name} takes one of {', '.join(map(str, k.choices))}")
    out[k.name] = match[0]
  return out


def sample(info: ModelInfo, seed: int, device: str = "CPU", family: str = "all") -> StructureConfig:
  rng = random.Random(seed)
  return to_config(_choose(knobs(info, device, family), lambda k: rng.choice(k.choices)))


def size(info: ModelInfo, device: str = "CPU", pins: dict[str, Any] | None = None, family: str = "all") -> int:
  """Distinct configurations of this model's space on this device kind (conditional knobs counted where they apply; with
  `pins`: of the sub-space they leave)."""
  pins = pins or {}
  ks = knobs(info, device, family)
  # every condition reads only these
  read = {_fused(s) for s in STAGES} | {n[0] for d in KNOBS.values() for n in d.needs}
  roots = [k for k in ks if k.name in read]
  rest = [k for k in ks if k not in roots]
  n = lambda k: 1 if k.name in pins else len(k.choices)
  combos = itertools.product(*([pins[r.name]] if r.name in pins else r.choices for r in roots))
  values = (dict(zip([r.name for r in roots], c, strict=True)) for c in combos)
  return sum(math.prod(n(k) for k in rest if k.when is None or k.when(v)) for v in values)


def defaults(ks: list[Knob], fixed: dict[str, Any] | None = None) -> dict[str, Any]:
  """The baseline's knob values (the pinned ones at their pins), every knob that applies under them."""
  fixed = fixed or {}
  return _choose(ks, lambda k: fixed.get(k.name, k.default))


def one_knob_away(values: dict[str, Any], ks: list[Knob],
                  fixed: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
  """(knob, knob values) of every config one knob away from `values` (all the knobs that apply under them, pinned ones
  included), in the space's order: each knob that applies and is not pinned, each of its other choices in order; the
  knobs a change makes apply come at their defaults (or pins), the others keep their values."""
  fixed, out = fixed or {}, []
  for k in ks:
    if k.name not in values or k.name in fixed: continue
    for v in k.choices:
      if v != values[k.name]:
        out.append((k.name,
                    _choose(ks, lambda j, k=k,
                            v=v: v if j.name == k.name else fixed.get(j.name, values.get(j.name, j.default)))))
  return out


FAMILY = "backends"  # a family move's name where a knob's would be: in the sampler's pass and the climb's chart


def backend_knob(name: str) -> bool:
  """Whether a knob chooses a kernel backend: a fused stage's, or a weight type's."""
  return KNOBS[name].field in ("fused", "backends")


def family_moves(values: dict[str, Any], ks: list[Knob],
                 fixed: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
  """(backend, knob values) of every config that puts each unpinned backend knob offering that backend on it at once,
  for the backends that fuse stages, in catalog order, where that changes more than one knob (a one-knob move is
  one_knob_away's). Backends pay as a family: one stage moved to another backend can measure slower than the config
  it left while all of them moved at once is much faster, so single changes from a family's config never leave it
  (docs/benchmarks.md, sessions 9 and 11)."""
  fixed, out = fixed or {}, []
  for b in (n for n in catalog.names() if catalog.get(n).stages):
    pick = lambda j, b=b: (b if backend_knob(j.name) and j.name not in fixed and b in j.choices
                           else fixed.get(j.name, values.get(j.name, j.default)))
    moved = _choose(ks, pick)
    if sum(moved.get(k) != values.get(k) for k in moved.keys() | values.keys() if backend_knob(k)) > 1:
      out.append((b, moved))
  return out


def differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
  """The knobs that apply to both configs (knob values) with different values."""
  return [k for k in a if k in b and a[k] != b[k]]


def family_move(a: dict[str, Any], b: dict[str, Any]) -> str | None:
  """The backend that config b (knob values) puts more than one backend knob of config a on, where those are all the
  knobs that apply to both with other values (a family move, as family_moves makes); else None."""
  ks = differ(a, b)
  to = {b[k] for k in ks}
  return to.pop() if len(ks) > 1 and len(to) == 1 and all(backend_knob(k) for k in ks) else None


def single_knob_changes(info: ModelInfo, device: str = "CPU", family: str = "all") -> list[tuple[str, StructureConfig]]:
  """(label, config) for every non-default value of every knob, all else at the baseline (a conditional knob with the
  earlier values that make it apply: BEAM's limits at BEAM=2)."""
  return [(f"{k.name}={v}", to_config(dict(k.enable) | {k.name: v})) for k in knobs(info, device, family)
          for v in k.choices if v != k.default]
