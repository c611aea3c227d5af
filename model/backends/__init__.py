"""Kernel backends: the one registry of the implementations behind the model's quantized products and fused decode stages.

Each backend says which weights it serves (quant type and role: `dense` matrices, `expert` stacks), on which device kinds it
runs, which fused decode stages it implements (`STAGES`), and builds their kernels. The model asks the registry for every
product (a QWeight names its backend), the config and the space ask it for the allowed values; nothing else keeps a list.

  tensor      tinygrad ops over the GGUF block planes (a packed dot: each group's scale after the group's sum)
  fp16_cache  the weight dequantized once at load into an fp16 matrix
  dsl         tinygrad UOp custom kernels that read the planes (model/backends/dsl.py): every device
  native      hand-written CUDA C run as compiled programs inside tinygrad's graphs (model/backends/native.py): CUDA only
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tinygrad import Device, Tensor

from model.backends import cuda_src
from model.errors import ConfigError
from model.quants import QUANT_TYPES

if TYPE_CHECKING:
  from model.weights import QWeight

ROLES = ("dense", "expert")
# fused decode stages (one token): each replaces the per-op path of a part of a block by a few kernels of one backend
#   attention: norm folded into q_a/kv_a (or q), q_b, k_b absorption with RoPE and the KV cache write, MLA attention over the
#              compressed cache, v_b, and the output projection with the residual add
#   router:    norm folded into the router logits, gating, selection bias, top-k, weight normalisation and scale
#   moe:       norm folded into the selected experts' (and the shared expert's) gate+up with SiLU(gate)*up, then their down
#              projections with the routing weights, the shared expert and the residual add
#   ffn:       the same pair of kernels for a dense FFN block
STAGES = ("attention", "router", "moe", "ffn")
# weight types whose fused FFN stages (moe, ffn) can read 8-bit activations (StructureConfig.ffn_act = q8): one scale per
# block and byte or nibble codes, so the native kernels dot them with the quantized activations in integers (dp4a)
Q8_TYPES = tuple(QUANT_TYPES[t].name for t, unit in cuda_src.UNITS.items() if unit.idot)


def device_kind(device: str) -> str:
  """"CUDA:1" -> "CUDA": the part of a device name that decides which backends run on it."""
  return device.split(":")[0].upper()


class Backend:
  name: str = ""
  quants: frozenset[str] = frozenset()  # quant types whose products it computes
  device_kinds: tuple[str, ...] | None = None  # where it runs; None: every device
  stages: frozenset[str] = frozenset()  # fused decode stages it implements

  def runs_on(self, kind: str) -> bool: return self.device_kinds is None or device_kind(kind) in self.device_kinds

  def serves(self, quant: str, kind: str) -> bool: return quant in self.quants and self.runs_on(kind)

  def check(self, device: str | None) -> None:
    """Raise ConfigError where this process cannot run the backend on `device` (the space never proposes that)."""
    if not self.runs_on(Device.canonicalize(device)):
      raise ConfigError(f"backend {self.name} runs on {', '.join(self.device_kinds or ())} only; this process runs on {Device.canonicalize(device)}")

  def attach(self, w: QWeight, device: str | None) -> QWeight:
    """Make `w` this backend's (at load): check that it can serve it here, then prepare what its products read."""
    self.check(device)
    if w.quant not in self.quants:
      raise ConfigError(f"backend {self.name} has no kernel for {w.quant}; it serves {', '.join(sorted(self.quants))}")
    w.backend = self.name
    return w

  # each backend defines its products: linear(x, w), per_head(x, w), expert(x, sel, w), with the signatures below


REGISTRY: dict[str, Backend] = {}


def get(name: str) -> Backend:
  if name not in REGISTRY: raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(REGISTRY)}")
  return REGISTRY[name]


def choices(quant: str, kind: str) -> tuple[str, ...]:
  """The backends that compute products of this quant type on this device kind, in registry order."""
  return tuple(b.name for b in REGISTRY.values() if b.serves(quant, kind))


def stage_choices(stage: str, kind: str) -> tuple[str, ...]:
  """The backends that implement a fused stage on this device kind."""
  return tuple(b.name for b in REGISTRY.values() if stage in b.stages and b.runs_on(kind))


# products: dispatched to the weight's backend
def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  return REGISTRY[w.backend].linear(x, w)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out): one small matrix per head (MLA's k_b and v_b)."""
  return REGISTRY[w.backend].per_head(x, w)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out); the selected experts' rows are
  indexed inside the product (no gather of whole experts)."""
  return REGISTRY[w.backend].expert(x, sel, w)


from model.backends import dsl, fp16_cache, native, tensor  # noqa: E402  (they import this module's base class)

for _b in (tensor.BACKEND, fp16_cache.BACKEND, dsl.BACKEND, native.BACKEND): REGISTRY[_b.name] = _b
NAMES = tuple(REGISTRY)
__all__ = ["ROLES", "STAGES", "NAMES", "Backend", "REGISTRY", "choices", "stage_choices", "get", "linear", "per_head", "expert",
           "device_kind", "dsl", "fp16_cache", "native", "tensor"]
