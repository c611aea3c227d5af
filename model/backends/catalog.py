"""The backend catalog: every kernel backend's name, what it serves and its traits, as data (it loads no tinygrad).

The config, the space, the correctness gate and the model ask the catalog (`get(name)` and the queries below) for what a
backend is; none of them compares backend names. The implementations live in the modules the rows name and register
with model/backends/registry.py, which imports a row's module the first time its kernels are asked for.

A new backend is one module that registers a `registry.Backend` under its name, and one row here.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.errors import ConfigError

QUANT_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the GGUF tensor types the model reads
ROLES = ("dense", "expert")  # a weight's role: a matrix (`dense`), or a stack of experts' matrices (`expert`)
# fused decode stages (one token): each replaces the per-op path of a part of a block by a few kernels of one backend
#   attention: norm folded into q_a/kv_a (or q), q_b, k_b absorption with RoPE and the KV cache write, MLA attention
#              over the compressed cache, v_b, and the output projection with the residual add
#   router:    norm folded into the router logits, gating, selection bias, top-k, weight normalisation and scale
#   moe:       norm folded into the selected experts' (and the shared expert's) gate+up with SiLU(gate)*up, then their
#              down projections with the routing weights, the shared expert and the residual add
#   ffn:       the same pair of kernels for a dense FFN block
STAGES = ("attention", "router", "moe", "ffn")
# weight types whose products can read 8-bit activations (StructureConfig.ffn_act, attn_act = q8): integer codes with a
# scale (and a min) per group, which a backend dots with the activations' 8-bit codes (its row's `q8_quants`)
Q8_QUANTS = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# the attention's dense products (GGUF tensor kinds), which the fused attention reads in 8 bits with attn_act=q8; k_b
# and v_b, per-head products of other kernels, keep float32 input
ATTN_DENSE = ("attn_q_a", "attn_q_b", "attn_q", "attn_kv_a_mqa", "attn_output")
# the backends a study may use: every one that runs on its device, or the portable ones only
FAMILIES = ("all", "portable")


@dataclass(frozen=True)
class Row:
  """One backend. `devices` None: portable (renders for every device); else the device kinds it runs on. `precision`:
  the class of its arithmetic against the baseline's (fp32: reordered float32 work; fp16: weights rounded to fp16).
  `twin`: the portable backend that computes what it computes, rounding alike (the gate's reference for its 8-bit
  stages). `scratch`: its fused stages share buffers the model allocates once. `keeps`: the per-op knobs its fused
  stages still read. `q8_quants`: the weight types its fused stages dot with 8-bit activations (ffn_act, attn_act)."""
  name: str
  module: str  # the implementation, imported on first use
  doc: str
  quants: frozenset[str] = frozenset(QUANT_NAMES)
  roles: tuple[str, ...] = ROLES
  stages: frozenset[str] = frozenset()
  devices: tuple[str, ...] | None = None
  precision: str = "fp32"
  twin: str | None = None
  scratch: bool = False
  keeps: frozenset[str] = frozenset()
  q8_quants: frozenset[str] = frozenset(Q8_QUANTS)

  @property
  def portable(self) -> bool: return self.devices is None

  def runs_on(self, device: str) -> bool: return self.devices is None or device_kind(device) in self.devices

  def serves(self, quant: str, role: str, device: str) -> bool:
    return quant in self.quants and role in self.roles and self.runs_on(device)


CATALOG: dict[str, Row] = {r.name: r for r in (
  Row("tensor", "model.backends.tensor",
      "tinygrad ops over the GGUF block planes (each group's scale after the group's sum)"),
  Row("fp16_cache", "model.backends.fp16_cache", "the weight dequantized once at load into an fp16 matrix",
      precision="fp16"),
  Row("dsl", "model.backends.dsl", "tinygrad UOp custom kernels that read the planes", stages=frozenset(STAGES)),
  Row("native", "model.backends.native", "CUDA C generated per GGUF type, run inside tinygrad's CUDA graphs",
      stages=frozenset(STAGES), devices=("CUDA",), twin="dsl", scratch=True),
)}
DEFAULT = "tensor"  # computes every product the config names no backend for
FP16 = "fp16_cache"  # computes the products of weights held as fp16 matrices (an absorbed q projection)


def device_kind(device: str) -> str:
  """"CUDA:1" -> "CUDA": the part of a device name that decides which backends run on it."""
  return device.split(":")[0].upper()


def names() -> tuple[str, ...]: return tuple(CATALOG)


def get(name: str) -> Row:
  if name not in CATALOG: raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(CATALOG)}")
  return CATALOG[name]


def in_family(row: Row, family: str) -> bool:
  if family not in FAMILIES:
    raise ConfigError(f"unknown backend family {family!r}; choose one of: {', '.join(FAMILIES)}")
  return family == "all" or row.portable


def choices(quant: str, role: str, device: str, family: str = "all") -> tuple[str, ...]:
  """The backends that compute products of this quant type and role on this device, in catalog order."""
  return tuple(r.name for r in CATALOG.values() if r.serves(quant, role, device) and in_family(r, family))


def stage_choices(stage: str, device: str, family: str = "all") -> tuple[str, ...]:
  """The backends that implement a fused stage on this device."""
  return tuple(r.name for r in CATALOG.values() if stage in r.stages and r.runs_on(device) and in_family(r, family))


def q8_backends(quants: tuple[str, ...]) -> tuple[str, ...]:
  """The backends with fused stages that dot every one of these weight types with 8-bit activations (none for none)."""
  return tuple(r.name for r in CATALOG.values() if r.stages and quants and set(quants) <= r.q8_quants)


def twin(name: str) -> str:
  """The portable backend that rounds as this one does: its twin, or itself."""
  return get(name).twin or name
