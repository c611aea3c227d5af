"""GGML tensor types: their ids, block sizes and names (no tinygrad, so the search parent and the views can read them;
their decoding into tensor ops is model/quants.py)."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

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
  """The type's GGML name, also for a type we do not support (for the error that says so)."""
  if ggml_type in QUANT_TYPES: return QUANT_TYPES[ggml_type].name
  try: return GGMLQuantizationType(ggml_type).name
  except ValueError: return f"ggml type {ggml_type}"
