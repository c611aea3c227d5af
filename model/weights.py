"""Weights as they sit in device memory: a quantized weight keeps its GGUF blocks, split at load into one plane per
block field (nothing dequantized), and names the kernel backend that computes its products (model/backends)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import _from_np_dtype, _to_np_dtype

from model.backends import catalog
from model.quants import QUANT_TYPES, planes, to_float


def write(t: Tensor, arr: np.ndarray) -> Buffer:
  """Copy a host array into the buffer of a buffer-backed tensor of its size; returns the buffer. The device allocator's
  copy-in is called directly, as tinygrad's own copy ends up doing: Buffer.copy_from first builds and runs a graph of
  the copy, host time paid at every call, and the correctness check writes 3 inputs per block and step."""
  buf, arr = t.uop.buffer.ensure_allocated(), np.ascontiguousarray(arr)
  # a view of the file's read-only mapping: device copies take the address of a writable buffer
  if not arr.flags.writeable: arr = arr.copy()
  if arr.nbytes != buf.nbytes: raise ValueError(f"copy size mismatch: {arr.nbytes} bytes into a buffer of {buf.nbytes}")
  buf.allocator._copyin(buf._buf, memoryview(arr.reshape(-1)).cast("B"))
  return buf


def read(t: Tensor) -> np.ndarray:
  """A realized tensor's values on the host, copied straight from its buffer by the device allocator's copy-out (which
  waits for the device), as tinygrad's own copy ends up doing without first building a graph of the copy."""
  buf = t.uop.buffer.ensure_allocated()
  out = np.empty(buf.size, _to_np_dtype(buf.dtype))
  buf.allocator._copyout(memoryview(out).cast("B"), buf._buf)
  return out.reshape(t.shape)


SYNC_BYTES = 1 << 30
_unsynced: dict[str, int] = {}


def upload(arr: np.ndarray, device: str | None = None) -> Tensor:
  """A host array as a new device tensor, copied straight into its buffer. Tensor(arr).realize() schedules a graph per
  tensor, and the scheduler walks every live tensor: a model's thousands of weights loaded that way cost time quadratic
  in their number. The device is synchronised after each GiB, which frees the pinned staging of the copies before it (a
  device copies through it asynchronously) instead of holding the model's size in pinned host memory."""
  buf = write(t := Tensor.empty(*arr.shape, dtype=_from_np_dtype(arr.dtype), device=device), arr)
  _unsynced[buf.device] = _unsynced.get(buf.device, 0) + arr.nbytes
  if _unsynced[buf.device] >= SYNC_BYTES: Device[buf.device].synchronize(); _unsynced[buf.device] = 0
  return t


@dataclass
class QWeight:
  planes: dict[str, Tensor]  # each (rows, nblocks, field_len); rows = prod(shape[:-1])
  ggml_type: int
  shape: tuple[int, ...]  # numpy order: (out, in), (experts, out, in) or (heads, out, in)
  cache: Tensor | None = None  # the fp16_cache backend's matrix, with `shape`
  backend: str = catalog.DEFAULT  # the catalog name of the backend that computes its products

  @classmethod
  def from_bytes(cls, raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], device: str | None = None) -> QWeight:
    """A weight from its GGUF bytes (rows, row_bytes): its planes split on the host, each copied to the device once."""
    return cls({k: upload(v, device) for k, v in planes(raw, ggml_type).items()}, ggml_type, shape)

  @classmethod
  def fp16(cls, w: Tensor) -> QWeight:
    return cls({}, 1, tuple(w.shape), w.cast(dtypes.float16).contiguous().realize(), catalog.FP16)

  @property
  def quant(self) -> str: return QUANT_TYPES[self.ggml_type].name

  def view(self, shape: tuple[int, ...], idx: Tensor | None = None) -> dict[str, Tensor]:
    """The planes reshaped to (*shape[:-1], nblocks, k), optionally indexed along the first dim by `idx`."""
    p = {k: v.reshape(*shape[:-1], *v.shape[1:]) for k, v in self.planes.items()}
    return p if idx is None else {k: v[idx] for k, v in p.items()}

  def to_float(self) -> Tensor:
    return self.cache.float() if self.cache is not None else to_float(self.view(self.shape), self.ggml_type, self.shape)

  def use_fp16_cache(self) -> None:
    self.cache, self.planes, self.backend = (self.to_float().cast(dtypes.float16).contiguous().realize(), {},
                                             catalog.FP16)

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
  return QWeight({k: pa[k].cat(pb[k], dim=-3).reshape(-1, *pa[k].shape[-2:]).contiguous().realize() for k in pa},
                 a.ggml_type, shape, backend=a.backend)
