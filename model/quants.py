"""GGML tensor types in tinygrad tensor ops.

Every quantized type is decoded into the same factored form, per group of `group` consecutive elements of a row:
    w[g, e] = scale[g] * code[g, e] + bias[g]        (bias only for Q4_K / Q5_K)
so one packed dot product serves all of them: sum_g scale[g] * (x[g] . code[g]) + bias[g] * sum(x[g]).
Layouts follow ggml-common.h / ggml-quants.c.
"""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor, dtypes

F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 13, 14, 30


@dataclass(frozen=True)
class QuantType:
  name: str
  block: int  # elements per block
  nbytes: int  # bytes per block
  group: int  # elements sharing one scale (the block itself for float types)


QUANT_TYPES: dict[int, QuantType] = {
  F32: QuantType("F32", 1, 4, 1), F16: QuantType("F16", 1, 2, 1), BF16: QuantType("BF16", 1, 2, 1),
  Q4_0: QuantType("Q4_0", 32, 18, 32), Q8_0: QuantType("Q8_0", 32, 34, 32),
  Q4_K: QuantType("Q4_K", 256, 144, 32), Q5_K: QuantType("Q5_K", 256, 176, 32), Q6_K: QuantType("Q6_K", 256, 210, 16),
}
FLOAT_TYPES = (F32, F16, BF16)


def type_name(ggml_type: int) -> str:
  return QUANT_TYPES[ggml_type].name if ggml_type in QUANT_TYPES else f"ggml type {ggml_type}"


def _f16(b: Tensor) -> Tensor: return b.bitcast(dtypes.float16).cast(dtypes.float32)


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
  """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins."""
  lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
  sc = (lo & 63).cat((hi & 0xF) | ((lo >> 6) << 4), dim=-1)
  mn = (mid & 63).cat((hi >> 4) | ((mid >> 6) << 4), dim=-1)
  return sc.cast(dtypes.float32), mn.cast(dtypes.float32)


def factors(blocks: Tensor, ggml_type: int) -> tuple[Tensor, Tensor, Tensor | None]:
  """uint8 blocks (..., nblocks, nbytes) -> scale (..., G), code (..., G, group), bias (..., G) or None; G = nblocks * groups per block."""
  lead = blocks.shape[:-2]
  if ggml_type == Q4_0:
    q = blocks[..., 2:]
    code = (q & 0xF).cat(q >> 4, dim=-1).cast(dtypes.float32) - 8
    return _f16(blocks[..., 0:2]).reshape(*lead, -1), code.reshape(*lead, -1, 32), None
  if ggml_type == Q8_0:
    return _f16(blocks[..., 0:2]).reshape(*lead, -1), blocks[..., 2:].bitcast(dtypes.int8).cast(dtypes.float32).reshape(*lead, -1, 32), None
  if ggml_type in (Q4_K, Q5_K):
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 1, 32)
    code = (qs & 0xF).cat(qs >> 4, dim=-2).reshape(*blocks.shape[:-1], 8, 32)
    if ggml_type == Q5_K:
      qh = blocks[..., 16:48].reshape(*blocks.shape[:-1], 1, 32)
      bits = Tensor.stack(*[(qh >> g) & 1 for g in range(8)], dim=-2).reshape(*blocks.shape[:-1], 8, 32)
      code = code + bits * 16
    return (d * sc).reshape(*lead, -1), code.cast(dtypes.float32).reshape(*lead, -1, 32), (-(dmin * mn)).reshape(*lead, -1)
  if ggml_type == Q6_K:
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
    low = (ql & 0xF).cat(ql >> 4, dim=-1)
    high = Tensor.stack(*[(qh >> (2 * j)) & 3 for j in range(4)], dim=-2).reshape(*blocks.shape[:-1], 2, 128)
    code = (low | (high << 4)).cast(dtypes.float32) - 32
    scale = _f16(blocks[..., 208:210]) * blocks[..., 192:208].bitcast(dtypes.int8).cast(dtypes.float32)
    return scale.reshape(*lead, -1), code.reshape(*lead, -1, 16), None
  raise ValueError(f"{type_name(ggml_type)} is not a quantized type")


def to_float(raw: Tensor, ggml_type: int, shape: tuple[int, ...]) -> Tensor:
  """Raw bytes (..., row_bytes) of a tensor -> float32 values with `shape` (lazy: fuses into whatever consumes it)."""
  if ggml_type == F32: return raw.bitcast(dtypes.float32).reshape(shape)
  if ggml_type == F16: return raw.bitcast(dtypes.float16).cast(dtypes.float32).reshape(shape)
  if ggml_type == BF16: return (raw.bitcast(dtypes.uint16).cast(dtypes.uint32) << 16).bitcast(dtypes.float32).reshape(shape)
  qt = QUANT_TYPES[ggml_type]
  scale, code, bias = factors(raw.reshape(*raw.shape[:-1], -1, qt.nbytes), ggml_type)
  w = scale.unsqueeze(-1) * code + (0 if bias is None else bias.unsqueeze(-1))
  return w.reshape(shape)
