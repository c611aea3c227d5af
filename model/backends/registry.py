"""The kernel registry: the implementations of the catalog's backends, each imported the first time it is asked for.

The model's products dispatch here by the backend a weight names (QWeight.backend); a fused stage's kernels come from
`get(name)`. What a backend serves and where it runs is its catalog row (model/backends/catalog.py).
"""
from __future__ import annotations

import abc
import importlib
from typing import TYPE_CHECKING

from tinygrad import Device, Tensor, UOp

from model.backends import catalog
from model.errors import ConfigError

if TYPE_CHECKING:
  from tinygrad.dtype import DType

  from model.stages import AttentionStage, FfnStage, MoeStage, RouterStage
  from model.weights import QWeight


class Backend(abc.ABC):
  """An implementation of a catalog row. Every backend computes the products (linear, per_head, expert) of the weights
  attached to it, and the lookup rows. The fused decode stages (attention, router, moe, ffn: one token) are the methods
  a backend whose row lists the stage overrides; each receives the stage's inputs as the model built them at load
  (model/stages.py) and the call's dynamic inputs. routed_moe and norm_linear are optional ones the model calls where a
  backend has them (`offers`); grouped and prefill_attention, the prompt's products in tiles and its attention, ones a
  config asks of the native backend. Calling a stage a backend lacks raises ConfigError."""
  name: str = ""

  @property
  def row(self) -> catalog.Row: return catalog.get(self.name)

  def offers(self, method: str) -> bool:
    """Whether this backend implements a fused stage (attention, router, moe, ffn) or one of the other optional methods
    (routed_moe, norm_linear): it overrides Backend's."""
    return getattr(type(self), method) is not getattr(Backend, method)

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

  def scratch(self, n_heads: int, kv_lora: int, max_context: int, device: str | None) -> dict[str, Tensor]:
    """The buffers its fused stages share, allocated once per model for a row with `scratch` (the stages receive them
    as their `scratch`), sized by the model's attention heads, kv_lora and context."""
    return {}

  def rows(self, w: QWeight, idx: Tensor) -> Tensor:
    """Float rows of w (rows, in) selected by an integer tensor (the embedding lookup): (*idx.shape, in)."""
    return w.rows(idx)

  @abc.abstractmethod
  def linear(self, x: Tensor, w: QWeight) -> Tensor:
    """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""

  @abc.abstractmethod
  def per_head(self, x: Tensor, w: QWeight) -> Tensor:
    """x (..., H, in) with w (H, out, in) -> (..., H, out): one small matrix per head (MLA's k_b and v_b)."""

  @abc.abstractmethod
  def expert(self, x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
    """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out), the selected experts'
    rows indexed inside the product (no gather of whole experts)."""

  def attention(self, st: AttentionStage, x: Tensor, start_pos: int | UOp, pos: Tensor | None) -> Tensor:
    """h = x + attention(x) for one token x (1, 1, dim) at position start_pos (an int, or a JIT's bound variable), which
    it writes into st.cache; pos: the position as a device tensor (1,) int32. Returns (1, 1, dim)."""
    raise self._lacks("attention")

  def router(self, st: RouterStage, h: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The routing of one token h (1, 1, dim): (the ids used (1, 1, K) int32, their weights (1, 1, K), the router's own
    top-k ids (1, 1, K), its logits (1, 1, E)). forced (1, 1, K): the ids to use instead of its own, for the
    correctness check."""
    raise self._lacks("router")

  def moe(self, st: MoeStage, h: Tensor, sel: Tensor, wts: Tensor, logits: Tensor) -> Tensor:
    """h + MoE FFN(h) for one token h (1, 1, dim), routed by the router's sel and wts (1, 1, K), or by sel and the
    logits (1, 1, E) the weights come from (a backend reads either). Returns (1, 1, dim)."""
    raise self._lacks("moe")

  def ffn(self, st: FfnStage, h: Tensor) -> Tensor:
    """h + FFN(h) for one token h (1, 1, dim) of a dense block. Returns (1, 1, dim)."""
    raise self._lacks("ffn")

  def routed_moe(self, router: RouterStage, moe: MoeStage, h: Tensor,
                 forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The router and MoE stages in one, for a config that gives both to this backend: (h + MoE FFN(h), the router's
    own top-k ids (1, 1, K), its logits (1, 1, E)); forced as `router`'s."""
    raise self._lacks("routed_moe")

  def norm_linear(self, x: Tensor, gamma: Tensor, eps: float, w: QWeight) -> Tensor:
    """linear(rms_norm(x, gamma, eps), w): the final norm folded into the output head."""
    raise self._lacks("norm_linear")

  def dequantised(self, w: QWeight, dt: DType, after: Tensor | None = None) -> Tensor:
    """w's values in dt, a buffer of their own (shape w.shape): the prompt's weights (model/prefill.py). With `after`
    (1,) int32, whose value (>= 0) adds min(after, 0), a zero, they are made after it: the every-expert weights
    (prefill_weights=indexed) after the layer's routing, so that a graph makes them in the layer that reads them and
    not with the weight-only kernels at its start, each layer's buffer reused by the next."""
    v = w.to_float().cast(dt)
    return (v if after is None else v + after.minimum(0).cast(dt)).contiguous()

  def grouped(self, x: Tensor, w: QWeight, tile_expert: Tensor | None, used: Tensor | None) -> Tensor:
    """The prompt's product in tiles (model/prefill.py, prefill_weights=quantised): x (N, tile, in) float16, each tile's
    rows by the matrix of w (E, out, in) that tile_expert (N,) int32 names, or where it is None in the matrices' order,
    N / E tiles each (w (out, in): all by w) -> (N, tile, out) float32; the tiles from used (1,) int32 on (None: none)
    are zeros."""
    raise self._lacks("grouped")

  def prefill_attention(self, qc: Tensor, cache: Tensor, start: Tensor, kvl: int, scale: float,
                        tokens: int = 1, at: int | UOp = 0) -> Tensor:
    """The prompt's causal attention in the absorbed form (model/deepseek2.py, prefill_attention=all_heads): the chunk's
    queries qc (T, H, kvl + rope), absorbed and rotated, over the compressed cache (1, positions, kvl + rope) that holds
    the chunk's own rows, token t at position start[0] + t -> (T, H, kvl) float32, before v_b. tokens: how many tokens'
    queries read each staged piece of the cache together (StructureConfig.prefill_attn_tokens); at: start[0] on the
    host, a number or the graph's position variable, for the launches' work estimates (the profile's TFLOPS)."""
    raise self._lacks("prefill_attention")

  def _lacks(self, method: str) -> ConfigError: return ConfigError(f"backend {self.name} has no {method} stage")


REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  """Called by an implementation's module at import: its backend under its catalog name, which implements every fused
  stage its row lists."""
  if missing := sorted(s for s in catalog.get(backend.name).stages if not backend.offers(s)):
    raise ConfigError(f"backend {backend.name} implements no {', '.join(missing)} stage, which its catalog row lists")
  REGISTRY[backend.name] = backend
  return backend


def get(name: str) -> Backend:
  """The implementation of a catalog backend, its module imported on first use."""
  if name not in REGISTRY: importlib.import_module(catalog.get(name).module)
  if name not in REGISTRY: raise ConfigError(f"{catalog.get(name).module} registers no backend {name!r}")
  return REGISTRY[name]


# products and lookups: dispatched to the weight's backend (Backend's methods of the same names)
def rows(w: QWeight, idx: Tensor) -> Tensor: return get(w.backend).rows(w, idx)
def linear(x: Tensor, w: QWeight) -> Tensor: return get(w.backend).linear(x, w)
def per_head(x: Tensor, w: QWeight) -> Tensor: return get(w.backend).per_head(x, w)
def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor: return get(w.backend).expert(x, sel, w)
