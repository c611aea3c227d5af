"""The kernel registry: the implementations of the catalog's backends, each imported the first time it is asked for.

The model's products dispatch here by the backend a weight names (QWeight.backend); a fused stage's kernels come from
`get(name)`. What a backend serves and where it runs is its catalog row (model/backends/catalog.py).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tinygrad import Device, Tensor

from model.backends import catalog
from model.errors import ConfigError

if TYPE_CHECKING:
  from model.weights import QWeight


class Backend:
  """An implementation of a catalog row: the products linear(x, w), per_head(x, w), expert(x, sel, w) and the lookup
  rows(w, idx) (signatures below; rows is tinygrad's QWeight.rows unless the backend has its own), and for each fused
  stage of its row a function of the same name (attention, router, moe, ffn). routed_moe, where it has one: the router
  and MoE stages in one, for a config that gives both to it: (blk, h, forced) -> (h + MoE FFN(h), its own top-k ids,
  the router logits). norm_linear, where it has one: the final norm folded into the output head, (x, gamma, eps, w) ->
  linear(rmsnorm(x) * gamma, w)."""
  name: str = ""
  routed_moe = norm_linear = None

  @property
  def row(self) -> catalog.Row: return catalog.get(self.name)

  def check(self, device: str | None) -> None:
    """Raise ConfigError where this process cannot run the backend on `device` (the space never proposes that)."""
    dev = Device.canonicalize(device)
    if not self.row.runs_on(dev):
      raise ConfigError(f"backend {self.name} runs on {', '.join(self.row.devices or ())} only; this process runs on "
                        f"{dev}")

  def attach(self, w: QWeight, device: str | None) -> QWeight:
    """Make `w` this backend's (at load): check that it can serve it here, then prepare what its products read."""
    self.check(device)
    if w.quant not in self.row.quants:
      raise ConfigError(f"backend {self.name} has no kernel for {w.quant}; it serves "
                        f"{', '.join(sorted(self.row.quants))}")
    w.backend = self.name
    return w

  def rows(self, w: QWeight, idx: Tensor) -> Tensor: return w.rows(idx)

  def scratch(self, hp, max_context: int, device: str | None) -> dict[str, Tensor]:
    """The buffers its fused stages share, allocated once per model (for a row with `scratch`)."""
    return {}


REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  """Called by an implementation's module at import: its backend under its catalog name."""
  catalog.get(backend.name)
  REGISTRY[backend.name] = backend
  return backend


def get(name: str) -> Backend:
  """The implementation of a catalog backend, its module imported on first use."""
  if name not in REGISTRY: importlib.import_module(catalog.get(name).module)
  if name not in REGISTRY: raise ConfigError(f"{catalog.get(name).module} registers no backend {name!r}")
  return REGISTRY[name]


# products and lookups: dispatched to the weight's backend
def rows(w: QWeight, idx: Tensor) -> Tensor:
  """Float rows of w (rows, in) selected by an integer tensor (the embedding lookup): (*idx.shape, in)."""
  return get(w.backend).rows(w, idx)


def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  return get(w.backend).linear(x, w)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out): one small matrix per head (MLA's k_b and v_b)."""
  return get(w.backend).per_head(x, w)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out); the selected experts' rows
  are indexed inside the product (no gather of whole experts)."""
  return get(w.backend).expert(x, sel, w)
