"""GGML tensor types in tinygrad tensor ops.

Every quantized type is decoded into the same factored form, per group of `group` consecutive elements of a row:
    w[g, e] = scale[g] * code[g, e] + bias[g]        (bias only for Q4_K / Q5_K)
so one packed dot product serves all of them: sum_g scale[g] * (x[g] . code[g]) + bias[g] * sum(x[g]).
Layouts follow ggml-common.h / ggml-quants.c.
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from model.quant_types import BF16, F16, F32, FLOAT_TYPES, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, QUANT_TYPES, type_name

# byte ranges of each type's block fields, and the dtype each field is read as
LAYOUTS: dict[int, dict[str, tuple[int, int, DType]]] = {
  Q4_0: {"d": (0, 2, dtypes.float16), "qs": (2, 18, dtypes.uint8)},
  Q8_0: {"d": (0, 2, dtypes.float16), "qs": (2, 34, dtypes.int8)},
  Q4_K: {"d": (0, 2, dtypes.float16), "dmin": (2, 4, dtypes.float16), "sc": (4, 16, dtypes.uint8),
         "qs": (16, 144, dtypes.uint8)},
  Q5_K: {"d": (0, 2, dtypes.float16), "dmin": (2, 4, dtypes.float16), "sc": (4, 16, dtypes.uint8),
         "qh": (16, 48, dtypes.uint8), "qs": (48, 176, dtypes.uint8)},
  Q6_K: {"ql": (0, 128, dtypes.uint8), "qh": (128, 192, dtypes.uint8), "sc": (192, 208, dtypes.int8),
         "d": (208, 210, dtypes.float16)},
  F32: {"w": (0, 4, dtypes.float32)}, F16: {"w": (0, 2, dtypes.float16)}, BF16: {"w": (0, 2, dtypes.uint16)},
}


def planes(raw: np.ndarray, ggml_type: int) -> dict[str, np.ndarray]:
  """Raw GGUF rows (rows, row_bytes) uint8 -> one array per block field, each (rows, nblocks, field_len) in its own
  dtype.

  Done once at load, on the host (no device kernel): the hot path then never reinterprets bytes (a size-changing bitcast
  after a gather makes tinygrad materialize its input), and each field of a row is contiguous, which suits vector loads.
  A field is a strided copy, several times slower than memcpy per thread, so row chunks are copied on all cores (numpy
  releases the GIL)."""
  layout, nbytes, raw = LAYOUTS[ggml_type], QUANT_TYPES[ggml_type].nbytes, np.ascontiguousarray(raw)
  if len(layout) == 1:
    return {k: raw.view(np.dtype(dt.fmt)).reshape(raw.shape[0], -1, 1) for k, (_, _, dt) in layout.items()}
  kinds = {k: np.dtype(dt.fmt) for k, (_, _, dt) in layout.items()}
  fields = np.dtype({"names": list(layout), "offsets": [a for a, _, _ in layout.values()], "itemsize": nbytes,
                     "formats": [(kinds[k], ((b - a) // kinds[k].itemsize,)) for k, (a, b, _) in layout.items()]})
  blocks = raw.reshape(-1).view(fields).reshape(raw.shape[0], -1)
  out = {k: np.empty((*blocks.shape, (b - a) // kinds[k].itemsize), kinds[k]) for k, (a, b, _) in layout.items()}
  step = max(1, (SPLIT_CHUNK_BYTES // max(1, raw.shape[1])))
  def copy(r: int) -> None:
    for k, o in out.items(): o[r:r + step] = blocks[k][r:r + step]
  list(_split_pool().map(copy, range(0, raw.shape[0], step)))
  return out


SPLIT_CHUNK_BYTES = 4 << 20


@functools.cache
def _split_pool() -> ThreadPoolExecutor:
  return ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="planes")


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
  """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins."""
  lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
  sc = (lo & 63).cat((hi & 0xF) | ((lo >> 6) << 4), dim=-1)
  mn = (mid & 63).cat((hi >> 4) | ((mid >> 6) << 4), dim=-1)
  return sc.cast(dtypes.float32), mn.cast(dtypes.float32)


def byte_planes(p: dict[str, Tensor], ggml_type: int) -> dict[str, Tensor]:
  """Planes whose integer fields are kept as 32-bit words (model/backends/dsl.py to_words) -> the fields' own dtypes."""
  def unpack(k: str, v: Tensor) -> Tensor:
    dt = LAYOUTS[ggml_type][k][2]
    if v.dtype != dtypes.uint32 or dt == dtypes.uint32: return v
    shifts = Tensor([0, 8, 16, 24], dtype=dtypes.uint32, device=v.device)
    b = ((v.unsqueeze(-1) >> shifts) & 255).cast(dtypes.uint8).reshape(*v.shape[:-1], v.shape[-1] * 4)
    return b.bitcast(dtypes.int8) if dt == dtypes.int8 else b
  return {k: unpack(k, v) for k, v in p.items()}


def factors(p: dict[str, Tensor], ggml_type: int) -> tuple[Tensor, Tensor, Tensor | None]:
  """Planes (..., nblocks, k) -> scale (..., G), code (..., G, group), bias (..., G) or None; G = nblocks * groups per
  block."""
  p = byte_planes(p, ggml_type)
  d = p["d"].float() if "d" in p else None
  lead = p["d"].shape[:-2]
  if ggml_type == Q4_0:
    code = (p["qs"] & 0xF).cat(p["qs"] >> 4, dim=-1).cast(dtypes.float32) - 8
    return d.reshape(*lead, -1), code.reshape(*lead, -1, 32), None
  if ggml_type == Q8_0: return d.reshape(*lead, -1), p["qs"].cast(dtypes.float32).reshape(*lead, -1, 32), None
  nb = p["d"].shape[:-1]  # (..., nblocks)
  if ggml_type in (Q4_K, Q5_K):
    sc, mn = _k_scales(p["sc"])
    qs = p["qs"].reshape(*nb, 4, 1, 32)
    code = (qs & 0xF).cat(qs >> 4, dim=-2).reshape(*nb, 8, 32)
    if ggml_type == Q5_K:
      qh = p["qh"].reshape(*nb, 1, 32)
      code = code + Tensor.stack(*[(qh >> g) & 1 for g in range(8)], dim=-2).reshape(*nb, 8, 32) * 16
    return (d * sc).reshape(*lead, -1), code.cast(dtypes.float32).reshape(*lead, -1, 32), (-(p["dmin"].float()
                                                                                             * mn)).reshape(*lead, -1)
  if ggml_type == Q6_K:
    ql, qh = p["ql"].reshape(*nb, 2, 64), p["qh"].reshape(*nb, 2, 1, 32)
    low = (ql & 0xF).cat(ql >> 4, dim=-1)
    high = Tensor.stack(*[(qh >> (2 * j)) & 3 for j in range(4)], dim=-2).reshape(*nb, 2, 128)
    code = (low | (high << 4)).cast(dtypes.float32) - 32
    return (d * p["sc"].cast(dtypes.float32)).reshape(*lead, -1), code.reshape(*lead, -1, 16), None
  raise ValueError(f"{type_name(ggml_type)} is not a quantized type")


def float_weight(p: dict[str, Tensor], ggml_type: int) -> Tensor:
  """The values of a float type's planes (..., n, 1), in float32 (F32, BF16) or float16 (F16), shape (..., n)."""
  w = p["w"][..., 0]
  return (w.cast(dtypes.uint32) << 16).bitcast(dtypes.float32) if ggml_type == BF16 else w


def to_float(p: dict[str, Tensor], ggml_type: int, shape: tuple[int, ...]) -> Tensor:
  """Planes of a tensor -> float32 values with `shape` (lazy: fuses into whatever consumes it)."""
  if ggml_type in FLOAT_TYPES: return float_weight(p, ggml_type).float().reshape(shape)
  scale, code, bias = factors(p, ggml_type)
  w = scale.unsqueeze(-1) * code + (0 if bias is None else bias.unsqueeze(-1))
  return w.reshape(shape)
