"""Random quantized weights for the product tests of the custom-kernel backends (tests/test_dsl.py, tests/test_native.py)."""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from model.quants import BF16, LAYOUTS, QUANT_TYPES
from model.weights import QWeight

TYPES = {QUANT_TYPES[t].name: t for t in QUANT_TYPES}


def random_weight(rng: np.random.Generator, ggml_type: int, shape: tuple[int, ...], backend: str = "tensor") -> QWeight:
  """Random bytes in every integer field (all bit patterns of codes, scales and mins), unit-scale floats in the float fields."""
  qt, rows = QUANT_TYPES[ggml_type], int(np.prod(shape[:-1]))
  blocks = rng.integers(0, 256, (rows, shape[-1] // qt.block, qt.nbytes), dtype=np.uint8)
  for a, b, dt in LAYOUTS[ggml_type].values():
    if dt == dtypes.float16: v = (rng.standard_normal((*blocks.shape[:2], (b - a) // 2)) * 0.05).astype(np.float16)
    elif dt == dtypes.float32: v = rng.standard_normal((*blocks.shape[:2], 1)).astype(np.float32)
    elif ggml_type == BF16: v = (rng.standard_normal((*blocks.shape[:2], 1)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else: continue
    blocks[..., a:b] = v.view(np.uint8)
  w = QWeight.from_raw(Tensor(blocks.reshape(rows, -1)), ggml_type, shape)
  w.backend = backend
  return w


def rel_err(got: Tensor, want: Tensor) -> float:
  g, w = got.numpy(), want.numpy()
  assert g.shape == w.shape
  return float(np.abs(g - w).max() / np.abs(w).max())
