"""Weights as they sit in device memory, and the matrix products over them for each kernel backend.

`tensor` keeps a quantized weight as its GGUF blocks (split into one plane per block field at load, nothing dequantized)
and dequantizes lazily inside the product, as a packed dot: each group's scale multiplies after the group's inner sum.
`fp16_cache` dequantizes once at load into an fp16 matrix.
`dsl` keeps the planes as `tensor` does and runs each product as one of model/dsl.py's custom kernels; `native` runs
model/native.py's hand-written CUDA C over the same planes.
"""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor, dtypes

from model import dsl, native
from model.quants import FLOAT_TYPES, QUANT_TYPES, factors, float_weight, planes, to_float


@dataclass
class QWeight:
  planes: dict[str, Tensor]  # each (rows, nblocks, field_len); rows = prod(shape[:-1])
  ggml_type: int
  shape: tuple[int, ...]  # numpy order: (out, in), (experts, out, in) or (heads, out, in)
  cache: Tensor | None = None  # the fp16_cache backend's matrix, with `shape`
  backend: str = "tensor"  # "dsl" / "native": the products over the planes run model/dsl.py's / model/native.py's kernels

  @classmethod
  def from_raw(cls, raw: Tensor, ggml_type: int, shape: tuple[int, ...]) -> QWeight:
    return cls({k: v.realize() for k, v in planes(raw, ggml_type).items()}, ggml_type, shape)

  @classmethod
  def fp16(cls, w: Tensor) -> QWeight: return cls({}, 1, tuple(w.shape), w.cast(dtypes.float16).contiguous().realize())

  @property
  def quant(self) -> str: return QUANT_TYPES[self.ggml_type].name

  def view(self, shape: tuple[int, ...], idx: Tensor | None = None) -> dict[str, Tensor]:
    """The planes reshaped to (*shape[:-1], nblocks, k), optionally indexed along the first dim by `idx`."""
    p = {k: v.reshape(*shape[:-1], *v.shape[1:]) for k, v in self.planes.items()}
    return p if idx is None else {k: v[idx] for k, v in p.items()}

  def to_float(self) -> Tensor: return self.cache.float() if self.cache is not None else to_float(self.view(self.shape), self.ggml_type, self.shape)

  def use_fp16_cache(self) -> None:
    self.cache, self.planes = self.to_float().cast(dtypes.float16).contiguous().realize(), {}

  def rows(self, idx: Tensor) -> Tensor:
    """Float rows selected by an integer tensor (embedding lookup): (*idx.shape, in)."""
    if self.cache is not None: return self.cache[idx].float()
    return to_float(self.view(self.shape, idx), self.ggml_type, (*idx.shape, self.shape[-1]))

  def split_rows(self, n: int) -> tuple[QWeight, QWeight]:
    """The first n rows of every leading index and the rest, as two weights (e.g. q_b's nope and rope rows per head)."""
    *lead, out, inp = self.shape
    if self.cache is not None: return QWeight.fp16(self.cache[..., :n, :]), QWeight.fp16(self.cache[..., n:, :])
    p = self.view(self.shape)
    a = {k: v[..., :n, :, :].contiguous().reshape(-1, *v.shape[-2:]).realize() for k, v in p.items()}
    b = {k: v[..., n:, :, :].contiguous().reshape(-1, *v.shape[-2:]).realize() for k, v in p.items()}
    return (QWeight(a, self.ggml_type, (*lead, n, inp), backend=self.backend),
            QWeight(b, self.ggml_type, (*lead, out - n, inp), backend=self.backend))


def concat_rows(a: QWeight, b: QWeight) -> QWeight:
  """[a; b] along the output rows of each leading index, at load time (merged gate+up)."""
  if a.ggml_type != b.ggml_type: raise ValueError(f"cannot merge weights of types {a.quant} and {b.quant}")
  *lead, out, inp = a.shape
  shape = (*lead, out + b.shape[-2], inp)
  if a.cache is not None: return QWeight.fp16(a.cache.cat(b.cache, dim=-2))
  pa, pb = a.view(a.shape), b.view(b.shape)
  return QWeight({k: pa[k].cat(pb[k], dim=-3).reshape(-1, *pa[k].shape[-2:]).contiguous().realize() for k in pa}, a.ggml_type, shape,
                 backend=a.backend)


def _dot(x: Tensor, p: dict[str, Tensor], ggml_type: int) -> Tensor:
  """x (..., 1, in) against planes (..., out, nblocks, k) broadcast over the leading dims -> (..., out) float32."""
  if ggml_type in FLOAT_TYPES: return (x.float() * float_weight(p, ggml_type).float()).sum(-1)
  scale, code, bias = factors(p, ggml_type)
  xg = x.reshape(*x.shape[:-1], -1, code.shape[-1]).float()
  y = (xg * code).sum(-1) * scale
  if bias is not None: y = y + xg.sum(-1) * bias
  return y.sum(-1)


def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  if w.cache is not None: return x.float() @ w.cache.T.float()
  if w.backend == "dsl": return dsl.linear(x, w)
  if w.backend == "native": return native.linear(x, w)
  return _dot(x.unsqueeze(-2), w.planes, w.ggml_type)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out): one small matrix per head (MLA's k_b and v_b)."""
  if w.cache is not None: return (x.float().unsqueeze(-2) * w.cache.float()).sum(-1)
  if w.backend == "dsl": return dsl.per_head(x, w)
  if w.backend == "native": return native.per_head(x, w)
  return _dot(x.unsqueeze(-2), w.view(w.shape), w.ggml_type)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out).

  The selected experts' rows are indexed inside the product (tinygrad folds the gather into the loads)."""
  if w.cache is not None: return (x.float().unsqueeze(-2) * w.cache[sel].float()).sum(-1)
  if w.backend == "dsl": return dsl.expert(x, sel, w)
  if w.backend == "native": return native.expert(x, sel, w)
  return _dot(x.unsqueeze(-2), w.view(w.shape, sel), w.ggml_type)
