"""StructureConfig: the structural build options of the model, as data.

The default is the baseline. Every field changes real code paths in `model/`; `space/` describes the domains the search
explores and turns an Optuna trial into one of these.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from model import backends
from model.errors import ConfigError

SCHEMA_VERSION = 3
# fields removed since an earlier schema version, dropped when a stored config of that version is read: tinygrad's BEAM=0
# matvec heuristic (MV_*) takes no kernel of this model, so those settings built identical kernels (docs/benchmarks.md)
REMOVED_FIELDS = {1: ("mv_blocksize", "mv_threads_per_row", "mv_rows_per_thread")}

# split points where the model may place a kernel boundary (.contiguous()) or an execution barrier (.realize())
BARRIER_POINTS = ("q_proj", "kv_a", "attn_out", "router_logits", "moe_gate_up", "expert_down", "moe_out",
                  "shexp_gate_up", "dense_gate_up", "block_out", "kv_write")
BARRIER_MODES = ("none", "contiguous", "realize")
TOPK_VARIANTS = ("pairwise", "sort", "argmax")
QUANT_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
MLA_ABSORB = ("runtime", "load")
DTYPES = ("float16", "float32")
ATTENTION = ("explicit", "sdpa")
FFN_ACTS = ("float32", "q8")  # the fused FFN stages' activations (model/backends: Q8_TYPES)
BEAM_WIDTHS = (0, 1, 2, 4, 8)
# tinygrad process settings that change generated code or its execution: StructureConfig field -> (environment variable, allowed values)
PROCESS_SETTINGS: dict[str, tuple[str, tuple]] = {
  "beam_upcast_max": ("BEAM_UPCAST_MAX", (64, 128, 256)),  # BEAM: largest upcast a candidate may apply
  "beam_local_max": ("BEAM_LOCAL_MAX", (256, 512, 1024)),  # BEAM: largest local (workgroup) size
  "beam_min_progress": ("BEAM_MIN_PROGRESS", (0.01, 1.0, 5.0)),  # BEAM: stop when the best candidate gains less (µs)
  "jit_batch_size": ("JIT_BATCH_SIZE", (0, 8, 32, 128)),  # kernels in the first JIT graph batch, doubling after (0: one graph)
}

DEFAULT_BARRIERS = {p: "none" for p in BARRIER_POINTS} | {"moe_gate_up": "contiguous", "dense_gate_up": "contiguous",
                                                          "shexp_gate_up": "contiguous", "block_out": "contiguous"}


def _check(name: str, value: Any, allowed: tuple) -> None:
  if value not in allowed: raise ConfigError(f"{name}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


@dataclass(frozen=True)
class StructureConfig:
  barriers: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_BARRIERS))
  merge_gate_up_routed: bool = False
  merge_gate_up_shared: bool = False
  merge_gate_up_dense: bool = False
  topk: str = "pairwise"
  backends: dict[str, str] = field(default_factory=dict)  # "<QUANT>:<role>" -> backend (model/backends); absent means "tensor"
  fused: dict[str, str] = field(default_factory=dict)  # decode stage (model/backends.STAGES) -> backend; absent: the per-op path
  mla_absorb: str = "runtime"
  kv_dtype: str = "float16"
  attention: str = "explicit"
  act_dtype: str = "float32"
  ffn_act: str = "float32"  # the fused FFN stages' activations: float32, or q8 (rounded to 8 bits per 32, llama.cpp's mmvq)
  router_fp32: bool = True
  beam: int = 0
  beam_upcast_max: int = 256
  beam_local_max: int = 1024
  beam_min_progress: float = 0.01
  jit_batch_size: int = 32
  schema_version: int = SCHEMA_VERSION

  def __post_init__(self):
    if self.schema_version != SCHEMA_VERSION: raise ConfigError(f"schema_version={self.schema_version} is not supported (expected {SCHEMA_VERSION})")
    for p, m in self.barriers.items():
      _check("barriers point", p, BARRIER_POINTS)
      _check(f"barriers.{p}", m, BARRIER_MODES)
    object.__setattr__(self, "barriers", {p: self.barriers.get(p, DEFAULT_BARRIERS[p]) for p in BARRIER_POINTS})  # unnamed points keep their default
    if isinstance(self.beam_min_progress, int) and not isinstance(self.beam_min_progress, bool):  # JSON/TOML may write 1.0 as 1
      object.__setattr__(self, "beam_min_progress", float(self.beam_min_progress))
    for k, b in self.backends.items():
      quant, _, role = k.partition(":")
      _check("backends quant type", quant, QUANT_NAMES)
      _check("backends role", role, backends.ROLES)
      _check(f"backends.{k}", b, backends.NAMES)
    for stage, b in self.fused.items():
      _check("fused stage", stage, backends.STAGES)
      _check(f"fused.{stage}", b, tuple(n for n in backends.NAMES if stage in backends.REGISTRY[n].stages))
    if "attention" in self.fused and self.mla_absorb != "runtime":
      raise ConfigError("fused.attention absorbs k_b per token: it needs mla_absorb=runtime")
    if "moe" in self.fused and (k := next((k for k in self.backends if k.endswith(":expert")), None)):
      raise ConfigError(f"backends.{k} does not apply with fused.moe: the fused stage reads the expert weights itself")
    _check("ffn_act", self.ffn_act, FFN_ACTS)
    if self.ffn_act != "float32" and not {"moe", "ffn"} & set(self.fused):
      raise ConfigError(f"ffn_act={self.ffn_act} is read by the fused FFN stages only: set fused.moe or fused.ffn")
    for name, allowed in (("topk", TOPK_VARIANTS), ("mla_absorb", MLA_ABSORB), ("kv_dtype", DTYPES),
                          ("attention", ATTENTION), ("act_dtype", DTYPES), ("beam", BEAM_WIDTHS),
                          *((f, allowed) for f, (_, allowed) in PROCESS_SETTINGS.items())):
      _check(name, getattr(self, name), allowed)
    for name in ("merge_gate_up_routed", "merge_gate_up_shared", "merge_gate_up_dense", "router_fp32"):
      if not isinstance(getattr(self, name), bool): raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

  def backend(self, quant: str, role: str) -> str: return self.backends.get(f"{quant}:{role}", "tensor")
  def stage(self, name: str) -> str | None: return self.fused.get(name)

  def process_env(self) -> dict[str, str]:
    """The tinygrad environment variables of a trial process (BEAM itself is scoped to decode by model.generate)."""
    return {var: str(getattr(self, f)) for f, (var, _) in PROCESS_SETTINGS.items()}

  def to_dict(self) -> dict[str, Any]: return dataclasses.asdict(self)
  def to_json(self) -> str: return json.dumps(self.to_dict(), sort_keys=True)
  def to_toml(self) -> str: return tomli_w.dumps(self.to_dict())

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> StructureConfig:
    if isinstance(v := d.get("schema_version"), int) and v < SCHEMA_VERSION:  # a stored config of an earlier schema
      d = {k: x for k, x in d.items() if k not in {f for old in range(v, SCHEMA_VERSION) for f in REMOVED_FIELDS.get(old, ())}}
      d["schema_version"] = SCHEMA_VERSION
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown: raise ConfigError(f"unknown field(s) {', '.join(sorted(unknown))}; known: {', '.join(f.name for f in dataclasses.fields(cls))}")
    return cls(**d)

  @classmethod
  def from_json(cls, text: str) -> StructureConfig:
    try: d = json.loads(text)
    except json.JSONDecodeError as e: raise ConfigError(f"config is not valid JSON: {e}") from None
    if not isinstance(d, dict): raise ConfigError("config must be a JSON object")
    return cls.from_dict(d)

  @classmethod
  def from_toml(cls, text: str) -> StructureConfig:
    try: return cls.from_dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e: raise ConfigError(f"config is not valid TOML: {e}") from None

  @classmethod
  def load(cls, path: str) -> StructureConfig:
    try: text = open(path).read()
    except OSError as e: raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    return cls.from_toml(text) if path.endswith(".toml") else cls.from_json(text)
