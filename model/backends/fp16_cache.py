"""The `fp16_cache` backend: the weight dequantized once at load into an fp16 matrix, products as float matmuls over it
(twice the bytes of Q8_0 and 3.6x those of Q4_0 per token, but no dequantization in the hot path)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tinygrad import Tensor

from model.backends.registry import Backend, register

if TYPE_CHECKING:
  from model.weights import QWeight


class Fp16CacheBackend(Backend):
  name = "fp16_cache"

  def attach(self, w: QWeight, device: str | None) -> QWeight:
    super().attach(w, device)
    w.use_fp16_cache()
    return w

  def linear(self, x: Tensor, w: QWeight) -> Tensor: return x.float() @ w.cache.T.float()
  def per_head(self, x: Tensor, w: QWeight) -> Tensor: return (x.float().unsqueeze(-2) * w.cache.float()).sum(-1)
  def expert(self, x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
    return (x.float().unsqueeze(-2) * w.cache[sel].float()).sum(-1)


BACKEND = register(Fp16CacheBackend())
