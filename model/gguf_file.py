"""GGUF files: metadata and tensor infos through the `gguf` package, a tensor's raw bytes read on demand."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from model.quants import QUANT_TYPES, type_name


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


def _field_value(field) -> Any:
  vtype = field.types[0]
  if vtype == GGUFValueType.ARRAY:
    if field.types[1] == GGUFValueType.STRING: return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    return [v.item() for i in field.data for v in field.parts[i]]
  if vtype == GGUFValueType.STRING: return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
  v = field.parts[field.data[0]][0].item()
  return bool(v) if vtype == GGUFValueType.BOOL else v


class _InfoReader(GGUFReader):
  """GGUFReader that records tensor infos without viewing tensor data, so a truncated file can be reported per tensor."""

  def _build_tensors(self, start_offs: int, fields: list) -> None:
    self.infos = []
    for field in fields:
      _, name, _, dims, raw_type, offset = field.parts
      ggml_type, n = int(raw_type[0]), int(np.prod(dims))
      block, nbytes = GGML_QUANT_SIZES.get(GGMLQuantizationType(ggml_type), (1, 0)) if ggml_type in _KNOWN else (1, 0)
      self.infos.append(TensorInfo(bytes(name).decode(), ggml_type, tuple(int(d) for d in reversed(dims.tolist())),
                                   int(start_offs + offset[0]), n * nbytes // block))
    self.tensors = []


_KNOWN = {t.value for t in GGMLQuantizationType}


class GGUFFile:
  """One GGUF file. Tensor data stays on disk until `read()` reads one tensor's bytes."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    if not self.path.is_file(): raise GGUFError(f"no GGUF file at {self.path}")
    size = self.path.stat().st_size
    try: reader = _InfoReader(self.path)
    except Exception as e: raise GGUFError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    self.metadata: dict[str, Any] = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    self.tensors: dict[str, TensorInfo] = {}
    for info in reader.infos:
      if info.ggml_type not in QUANT_TYPES:
        raise GGUFError(f"{self.path.name}: tensor {info.name} has type {info.type_name}, which is not supported "
                        f"(supported: {', '.join(type_name(q) for q in QUANT_TYPES)})")
      if info.offset + info.nbytes > size:
        raise GGUFError(f"{self.path.name}: tensor {info.name} ({info.type_name}) ends at byte {info.offset + info.nbytes} "
                        f"but the file has {size} bytes: the file is truncated")
      self.tensors[info.name] = info
    self.arch: str = self.metadata.get("general.architecture", "")
    del reader  # drops the memory map

  def key(self, name: str, default: Any = None) -> Any:
    """An architecture key such as `block_count` (read as `<arch>.block_count`)."""
    return self.metadata.get(f"{self.arch}.{name}", default)

  def read(self, name: str) -> np.ndarray:
    """The tensor's raw bytes (uint8, shape (rows, row_bytes)) in host memory.

    Read with one pread into a buffer that lives only until its planes are on the device, so host memory stays bounded by
    the largest tensor (mapping the whole file would leave every page of it resident)."""
    info = self.tensors[name]
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    return np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, info.nbytes // rows)

