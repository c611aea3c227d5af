"""Weights as they sit in device memory, and the matrix products over them for each kernel backend.

`tensor` keeps a quantized weight as its raw GGUF blocks and dequantizes lazily inside the product (a packed dot: each
group's scale multiplies after the group's inner sum); `fp16_cache` dequantizes once at load into an fp16 matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor, dtypes

from model.quants import F16, FLOAT_TYPES, QUANT_TYPES, factors, to_float


@dataclass
class QWeight:
  raw: Tensor  # uint8 (rows, row_bytes) on the device, exactly the file's bytes
  ggml_type: int
  shape: tuple[int, ...]  # numpy order: (out, in) or (experts, out, in) or (heads, out, in)
  backend: str = "tensor"
  cache: Tensor | None = None  # fp16 matrix with `shape`, for the fp16_cache backend

  @property
  def quant(self) -> str: return QUANT_TYPES[self.ggml_type].name

  def to_float(self) -> Tensor: return to_float(self.raw, self.ggml_type, self.shape)

  def use_fp16_cache(self) -> None:
    self.backend, self.cache = "fp16_cache", self.to_float().cast(dtypes.float16).contiguous().realize()
    self.raw = Tensor.empty(0, dtype=dtypes.uint8, device=self.raw.device)

  def rows(self, idx: Tensor) -> Tensor:
    """Float rows selected by an integer tensor (embedding lookup): (*idx.shape, in)."""
    if self.cache is not None: return self.cache[idx].float()
    return to_float(self.raw[idx], self.ggml_type, (*idx.shape, self.shape[-1]))

  def split_rows(self, n: int) -> tuple[QWeight, QWeight]:
    """The first n rows of every leading index and the rest, as two weights (e.g. q_b's nope and rope rows per head)."""
    lead, out = self.shape[:-2], self.shape[-2]
    raw = self.raw.reshape(*lead, out, -1)
    a, b = raw[..., :n, :].contiguous(), raw[..., n:, :].contiguous()
    return (QWeight(a.reshape(-1, a.shape[-1]), self.ggml_type, (*lead, n, self.shape[-1])),
            QWeight(b.reshape(-1, b.shape[-1]), self.ggml_type, (*lead, out - n, self.shape[-1])))


def concat_rows(a: QWeight, b: QWeight) -> QWeight:
  """[a; b] along the output rows of each leading index, at load time (merged gate+up)."""
  if a.ggml_type != b.ggml_type: raise ValueError(f"cannot merge weights of types {a.quant} and {b.quant}")
  lead = a.shape[:-2]
  ra, rb = a.raw.reshape(*lead, a.shape[-2], -1), b.raw.reshape(*lead, b.shape[-2], -1)
  raw = ra.cat(rb, dim=-2).contiguous().realize()
  return QWeight(raw.reshape(-1, raw.shape[-1]), a.ggml_type, (*lead, a.shape[-2] + b.shape[-2], a.shape[-1]))


def _dot(x: Tensor, raw: Tensor, ggml_type: int, out: int, inp: int) -> Tensor:
  """x (..., 1, in) against raw rows (..., out, row_bytes) broadcast over the leading dims -> (..., out)."""
  if ggml_type in FLOAT_TYPES:
    w = to_float(raw, ggml_type, (*raw.shape[:-1], inp))
    if ggml_type == F16: w = w.cast(dtypes.float16)
    return (x.cast(w.dtype) * w).sum(-1, dtype=dtypes.float32)
  qt = QUANT_TYPES[ggml_type]
  scale, code, bias = factors(raw.reshape(*raw.shape[:-1], -1, qt.nbytes), ggml_type)
  xg = x.reshape(*x.shape[:-1], -1, qt.group).float()
  y = (xg * code).sum(-1) * scale
  if bias is not None: y = y + xg.sum(-1) * bias
  return y.sum(-1)


def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  out, inp = w.shape
  if w.cache is not None: return x.cast(dtypes.float16).matmul(w.cache.T, dtype=dtypes.float32)
  return _dot(x.unsqueeze(-2), w.raw, w.ggml_type, out, inp)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out): one small matrix per head (MLA's k_b and v_b)."""
  _, out, inp = w.shape
  if w.cache is not None: return (x.cast(dtypes.float16).unsqueeze(-2) * w.cache).sum(-1, dtype=dtypes.float32)
  return _dot(x.unsqueeze(-2), w.raw.reshape(*w.shape[:-1], -1), w.ggml_type, out, inp)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out).

  The selected experts' rows are indexed inside the product (tinygrad folds the gather into the loads)."""
  _, out, inp = w.shape
  if w.cache is not None: return (x.cast(dtypes.float16).unsqueeze(-2) * w.cache[sel]).sum(-1, dtype=dtypes.float32)
  return _dot(x.unsqueeze(-2), w.raw.reshape(w.shape[0], out, -1)[sel], w.ggml_type, out, inp)
