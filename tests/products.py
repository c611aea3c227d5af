"""Random quantized weights for the product tests of the custom-kernel backends (tests/test_dsl.py,
tests/test_native.py)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tinygrad import Tensor, dtypes

from model.backends import cuda_src
from model.backends.registry import expert, linear, per_head
from model.quants import BF16, LAYOUTS, QUANT_TYPES
from model.weights import QWeight

TYPES = {QUANT_TYPES[t].name: t for t in QUANT_TYPES}


def random_blocks(rng: np.random.Generator, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
  """Raw GGUF blocks (rows, blocks per row, block bytes) of a weight of `shape`: random bytes in every integer field
  (all bit patterns of codes, scales and mins), unit-scale floats in the float fields."""
  qt, rows = QUANT_TYPES[ggml_type], int(np.prod(shape[:-1]))
  blocks = rng.integers(0, 256, (rows, shape[-1] // qt.block, qt.nbytes), dtype=np.uint8)
  for a, b, dt in LAYOUTS[ggml_type].values():
    if dt == dtypes.float16: v = (rng.standard_normal((*blocks.shape[:2], (b - a) // 2)) * 0.05).astype(np.float16)
    elif dt == dtypes.float32: v = rng.standard_normal((*blocks.shape[:2], 1)).astype(np.float32)
    elif ggml_type == BF16:
      v = (rng.standard_normal((*blocks.shape[:2], 1)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else: continue
    blocks[..., a:b] = v.view(np.uint8)
  return blocks


def kernel_weight(t: int, shape: tuple[int, ...], seed: int) -> tuple[list[np.ndarray], np.ndarray]:
  """Random GGUF blocks of a weight as the native kernel's planes (model/quants.py's `planes`, in plane_types order),
  and the weight dequantized by gguf, float64."""
  blocks = random_blocks(np.random.default_rng(seed), t, shape)
  planes = {k: blocks[..., a:b].copy().view(np.dtype(dt.fmt)) for k, (a, b, dt) in LAYOUTS[t].items()}
  w = dequantize(blocks.reshape(blocks.shape[0], -1), GGMLQuantizationType(t)).astype(np.float64).reshape(shape)
  return [planes[k] for k, _ in cuda_src.plane_types(t)], w


def random_weight(rng: np.random.Generator, ggml_type: int, shape: tuple[int, ...], backend: str = "tensor") -> QWeight:
  """A QWeight of random_blocks."""
  blocks = random_blocks(rng, ggml_type, shape)
  w = QWeight.from_bytes(blocks.reshape(blocks.shape[0], -1), ggml_type, shape)
  w.backend = backend
  return w


def rel_err(got: Tensor, want: Tensor) -> float:
  g, w = got.numpy(), want.numpy()
  assert g.shape == w.shape
  return float(np.abs(g - w).max() / np.abs(w).max())


def check_products(backend: str, quant: str, shape: str = "small") -> None:
  """A backend's dense, per-head and expert products equal the tensor backend's (relative error < 1e-5) at small shapes
  or GLM-4.7-Flash's widths: decode, prefill (13 tokens: a full tile of 8 and a partial one), fp16 input, expert ids
  that repeat and hit the last expert, one input for all K slots (gate, up) or one per slot (down)."""
  rng, t = np.random.default_rng(TYPES[quant]), TYPES[quant]
  n_out, n_in, E, K, H = (48, 512, 5, 3, 4) if shape == "small" else (1536, 2048, 64, 4, 20)
  x = lambda *s, dt=np.float32: Tensor(rng.standard_normal(s).astype(dt))
  other = lambda w: QWeight(w.planes, t, w.shape, backend=backend)
  w = random_weight(rng, t, (n_out, n_in))
  for xi in (x(1, 1, n_in), x(1, 5, n_in), x(1, 13, n_in), x(2, 3, n_in, dt=np.float16)):
    assert rel_err(linear(xi, other(w)), linear(xi, w)) < 1e-5
  w = random_weight(rng, t, (H, 64, n_in // 4 if shape == "glm" else n_in))
  for xh in (x(1, 1, H, w.shape[-1]), x(1, 11, H, w.shape[-1])):
    assert rel_err(per_head(xh, other(w)), per_head(xh, w)) < 1e-5
  w = random_weight(rng, t, (E, n_out, n_in))
  for sel in (rng.choice(E, (1, 1, K), replace=False), np.array([[[E - 1] * K, [0] * K, list(range(K))]]),
              np.array([[[E - 1, E - 1] + [0] * (K - 2)]]),
              np.array([[[E - 1, 2] + [E - 1] * (K - 2), [1] * K, [0, E - 1] + [3] * (K - 2)]])):
    s = Tensor(sel.astype(np.int32))
    for xe in (x(1, s.shape[1], 1, n_in), x(1, s.shape[1], K, n_in)):
      assert rel_err(expert(xe, s, other(w)), expert(xe, s, w)) < 1e-5
