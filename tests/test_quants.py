import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tinygrad import Tensor, dtypes

from model.quants import BF16, F16, F32, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, QUANT_TYPES, factors, planes, to_float


def device_planes(raw: np.ndarray, ggml_type: int) -> dict:
  """The planes of raw GGUF rows as tensors, as a loaded QWeight holds them."""
  return {k: Tensor(v) for k, v in planes(raw, ggml_type).items()}


# byte offsets of each type's fp16 scale fields: random bytes there could be inf/nan, so they get real fp16 values
F16_FIELDS = {Q4_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}


def random_blocks(ggml_type: int, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
  qt = QUANT_TYPES[ggml_type]
  if ggml_type == F32: return rng.standard_normal((rows, blocks_per_row), dtype=np.float32).view(np.uint8)
  if ggml_type == F16: return rng.standard_normal((rows, blocks_per_row)).astype(np.float16).view(np.uint8)
  if ggml_type == BF16:
    return (rng.standard_normal((rows, blocks_per_row),
                                dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
  raw = rng.integers(0, 256, (rows, blocks_per_row, qt.nbytes), dtype=np.uint8)
  for off in F16_FIELDS[ggml_type]:
    raw[..., off:off + 2] = (rng.standard_normal((rows, blocks_per_row, 1)) * 0.05).astype(np.float16).view(np.uint8)
  return raw.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", sorted(QUANT_TYPES))
def test_dequant_matches_gguf(ggml_type: int) -> None:
  rng = np.random.default_rng(ggml_type)
  qt = QUANT_TYPES[ggml_type]
  rows, nblk = 3, 4
  raw = random_blocks(ggml_type, rows, nblk, rng)
  ref = dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(rows, nblk * qt.block)
  ours = to_float(device_planes(raw, ggml_type), ggml_type, (rows, nblk * qt.block)).numpy()
  np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q8_0, Q4_K, Q5_K, Q6_K])
def test_factored_dot_equals_dense_dot(ggml_type: int) -> None:
  rng = np.random.default_rng(7)
  qt = QUANT_TYPES[ggml_type]
  raw = random_blocks(ggml_type, 5, 2, rng)
  w = dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(5, -1)
  x = rng.standard_normal(w.shape[1]).astype(np.float32)
  scale, code, bias = factors(device_planes(raw, ggml_type), ggml_type)
  xg = Tensor(x).reshape(-1, qt.group)
  y = ((xg * code).sum(-1) * scale + (0 if bias is None else xg.sum(-1) * bias)).sum(-1)
  np.testing.assert_allclose(y.numpy(), w @ x, rtol=1e-4, atol=1e-4)


def test_bf16_bitcast_dtype() -> None:
  assert to_float(device_planes(np.zeros((1, 2), np.uint8), BF16), BF16, (1, 1)).dtype == dtypes.float32
