"""The `tensor` backend: products as tinygrad ops over the GGUF block planes, dequantized lazily inside the product as a
packed dot (each group's scale multiplies after the group's inner sum), which tinygrad fuses into the product's
kernel."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tinygrad import Tensor

from model.backends.registry import Backend, register
from model.quants import FLOAT_TYPES, factors, float_weight

if TYPE_CHECKING:
  from model.weights import QWeight


def _dot(x: Tensor, p: dict[str, Tensor], ggml_type: int) -> Tensor:
  """x (..., 1, in) against planes (..., out, nblocks, k) broadcast over the leading dims -> (..., out) float32."""
  if ggml_type in FLOAT_TYPES: return (x.float() * float_weight(p, ggml_type).float()).sum(-1)
  scale, code, bias = factors(p, ggml_type)
  xg = x.reshape(*x.shape[:-1], -1, code.shape[-1]).float()
  y = (xg * code).sum(-1) * scale
  if bias is not None: y = y + xg.sum(-1) * bias
  return y.sum(-1)


class TensorBackend(Backend):
  name = "tensor"

  def linear(self, x: Tensor, w: QWeight) -> Tensor: return _dot(x.unsqueeze(-2), w.planes, w.ggml_type)
  def per_head(self, x: Tensor, w: QWeight) -> Tensor: return _dot(x.unsqueeze(-2), w.view(w.shape), w.ggml_type)
  def expert(self, x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
    return _dot(x.unsqueeze(-2), w.view(w.shape, sel), w.ggml_type)


BACKEND = register(TensorBackend())
