"""GGUF files: metadata and tensor infos parsed from the header, a tensor's raw bytes read on demand."""
from __future__ import annotations

import math
import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from model.quant_types import QUANT_TYPES, type_name


class GGUFError(ValueError):
  """A GGUF file that cannot be used: missing, corrupt, truncated, or holding a tensor type we do not support."""


@dataclass(frozen=True)
class TensorInfo:
  name: str
  ggml_type: int
  shape: tuple[int, ...]  # numpy order (ggml's ne reversed): (rows, row_length) for a matrix
  offset: int  # absolute byte offset in the file
  nbytes: int

  @property
  def type_name(self) -> str: return type_name(self.ggml_type)


# GGUF value types (gguf's GGUFValueType): numbers by their little-endian struct (and numpy) format, then strings
# and arrays
_NUMBERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Header:
  """GGUF v2/v3 metadata and tensor infos, parsed from the file's first bytes. (gguf's GGUFReader builds numpy views for
  every part of every field, which each trial process would pay for a large vocabulary; this reads strings in one pass
  and number arrays in one frombuffer.)"""

  def __init__(self, buf: memoryview):
    self.buf, self.pos = buf, 4
    if bytes(buf[:4]) != b"GGUF": raise ValueError("no GGUF magic number")
    version, n_tensors, n_kv = self._unpack("<IQQ")
    if version not in (2, 3): raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    self.metadata = {self._string(): self._value(self._unpack("<I")[0]) for _ in range(n_kv)}
    raw = [(self._string(), *self._infos()) for _ in range(n_tensors)]
    align = int(self.metadata.get("general.alignment", 32))
    start = -(-self.pos // align) * align
    self.infos = [TensorInfo(name, t, dims, start + off, _nbytes(t, dims)) for name, t, dims, off in raw]

  def _unpack(self, fmt: str) -> tuple:
    out = struct.unpack_from(fmt, self.buf, self.pos)
    self.pos += struct.calcsize(fmt)
    return out

  def _string(self) -> str:
    (n,) = self._unpack("<Q")
    if self.pos + n > len(self.buf): raise ValueError("a string runs past the end of the file")
    self.pos += n
    return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

  def _value(self, vtype: int) -> Any:
    if vtype == _STRING: return self._string()
    if vtype in _NUMBERS: return self._unpack(_NUMBERS[vtype])[0]
    if vtype != _ARRAY: raise ValueError(f"unknown metadata value type {vtype}")
    item, n = self._unpack("<IQ")
    if item in _NUMBERS:
      arr = np.frombuffer(self.buf, dtype=_NUMBERS[item], count=n, offset=self.pos)
      self.pos += arr.nbytes
      return arr.tolist()
    return [self._value(item) for _ in range(n)]

  def _infos(self) -> tuple[int, tuple[int, ...], int]:
    (n_dims,) = self._unpack("<I")
    dims = self._unpack(f"<{n_dims}Q")
    ggml_type, offset = self._unpack("<IQ")
    return ggml_type, tuple(reversed(dims)), offset


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
  t = QUANT_TYPES.get(ggml_type)
  return 0 if t is None else math.prod(shape) // t.block * t.nbytes


ARCHITECTURES = ("deepseek2",)  # the GGUF architectures model/deepseek2.py builds
# the sizes a model of them cannot have at 0: layers, widths, heads, ranks
POSITIVE_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                 "attention.head_count_kv", "attention.kv_lora_rank", "attention.key_length", "attention.value_length",
                 "rope.dimension_count", "vocab_size")


class GGUFFile:
  """One GGUF file. Tensor data stays on disk until `read()` reads one tensor's bytes."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    if not self.path.is_file(): raise GGUFError(f"no GGUF file at {self.path}")
    size = self.path.stat().st_size
    try:
      with open(self.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        with memoryview(mm) as buf: header = _Header(buf)
        del header.buf
    except Exception as e:
      raise GGUFError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    self.metadata: dict[str, Any] = header.metadata
    self.tensors: dict[str, TensorInfo] = {}
    for info in header.infos:
      if info.ggml_type not in QUANT_TYPES:
        raise GGUFError(f"{self.path.name}: tensor {info.name} has type {info.type_name}, which is not supported "
                        f"(supported: {', '.join(type_name(q) for q in QUANT_TYPES)})")
      if info.offset + info.nbytes > size:
        raise GGUFError(f"{self.path.name}: tensor {info.name} ({info.type_name}) ends at byte "
                        f"{info.offset + info.nbytes} but the file has {size} bytes: the file is truncated")
      if 0 in info.shape: raise GGUFError(f"{self.path.name}: tensor {info.name} has a zero dimension {info.shape}")
      self.tensors[info.name] = info
    self.arch: str = self.metadata.get("general.architecture", "")
    if self.arch not in ARCHITECTURES:
      raise GGUFError(f"{self.path.name}: architecture {self.arch!r} is not supported (supported: "
                      f"{', '.join(ARCHITECTURES)})")
    for name in POSITIVE_KEYS:
      if (v := self.key(name)) is not None and not (isinstance(v, int) and v > 0):
        raise GGUFError(f"{self.path.name}: {self.arch}.{name} is {v!r}, not a positive integer")

  def key(self, name: str, default: Any = None) -> Any:
    """An architecture key such as `block_count` (read as `<arch>.block_count`)."""
    return self.metadata.get(f"{self.arch}.{name}", default)

  def read(self, name: str) -> np.ndarray:
    """The tensor's raw bytes (uint8, shape (rows, row_bytes)), read-only, mapped from the file.

    Only the tensor's own range is mapped, and only while the array lives, so host memory stays bounded by the largest
    tensor; the pages are populated in one call (a file in the page cache maps at memory speed, where reading it into a
    fresh buffer costs a copy and a fault per page of that buffer)."""
    info = self.tensors[name]
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
    with open(self.path, "rb") as fh:
      m = mmap.mmap(fh.fileno(), info.offset + info.nbytes - start,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ, offset=start)
    return np.frombuffer(m, dtype=np.uint8, count=info.nbytes, offset=info.offset
                         - start).reshape(rows, info.nbytes // rows)

