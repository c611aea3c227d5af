"""The native backend's prompt products (StructureConfig.prefill_weights = native): many rows of float16 activations by
quantised weights on the tensor cores, each tile of rows by its own expert's matrix (cuda/grouped_mma.cu). The weight is
read quantised, a stage of BN rows by BK inputs at a time, and dequantised into shared memory as float16 by the unit
decoders the decode kernels use (cuda_src.UNITS), so no dequantised copy of any matrix is ever written to memory."""
from __future__ import annotations

import functools

from model.backends.cuda_src import UNITS, Kernel, Unit, W, _unit_values, device_kernel, unit_loads
from model.quants import QUANT_TYPES

THREADS, BN = 128, 64  # a block's threads (4 warps) and outputs
TILES = (16, 32, 64)  # the rows a tile may hold (StructureConfig.prefill_tile)


def span(un: Unit) -> int:
  """The elements of a row a unit's elements lie within, rounded up to a power of two (Q6_K: its units' two runs of 32
  lie within 128 elements)."""
  end = max(un.xoff(e) for _, _, elems in un.groups for e, _ in elems) + 1
  return 1 << (end - 1).bit_length()


def stage_k(ggml_type: int, inp: int) -> int | None:
  """The inputs a stage of the product walks for a weight of this type and row length: 128 where the row holds whole
  stages of it, else 64; None where neither is a multiple of the unit's span or divides the row."""
  if ggml_type not in UNITS: return None
  return next((bk for bk in (128, 64) if inp % bk == 0 and bk % span(UNITS[ggml_type]) == 0), None)


def unit_store(w: W) -> str:
  """C: unit uu of weight row `wrow` dequantised into shared memory as float16: its element at place p of the row goes
  to dst[p - k0], two elements to a 32-bit store (the groups' elements come in pairs of neighbouring places)."""
  un, stores = w.unit, []
  for scale, mn, elems in un.groups:
    vals = [(un.xoff(e), c if scale is None else f"fmaf({scale}, {c}, {mn})") for e, c in elems]
    for (p0, v0), (p1, v1) in zip(vals[::2], vals[1::2], strict=True):
      assert p1 == p0 + 1 and p0 % 2 == 0, "a unit's elements come in pairs of neighbouring places"
      stores.append(f"*(unsigned*)(dst + at + {p0}) = pack_h2({v0}, {v1});")
  xbase = un.xbase.format(u="u")
  values = _unit_values(w, "wrow", "uu", "_s")
  return f"{{ {unit_loads(w, 'wrow', 'uu', '_s')} {{ {values} const int at = {xbase} - k0; {' '.join(stores)} }} }}"


@functools.cache
def grouped(ggml_type: int, experts: int, out: int, inp: int, tile: int, tiles: int) -> Kernel:
  """The product of `tiles` tiles of `tile` rows (x: tiles * tile rows of inp float16 values) by a weight of this type
  (experts matrices of out rows; 1: a dense weight), each tile by the matrix tile_expert names, the first used[0] tiles:
  y (tiles * tile, out) float32, zeros past them. grid: tiles x blocks of BN outputs."""
  bk, w = stage_k(ggml_type, inp), W("w", ggml_type, inp)
  assert bk is not None and tile in TILES, (ggml_type, inp, tile)
  name = f"native_grouped_{QUANT_TYPES[ggml_type].name.lower()}_e{experts}_{out}_{inp}_t{tile}x{tiles}"
  params = ["float* y", "const unsigned short* __restrict__ x", "const int* __restrict__ tile_expert",
            "const int* __restrict__ used", *w.params]
  src = device_kernel(name, params, "grouped_mma.cu", threads=THREADS, pre=("mma.cuh",),
                      generated={"DEQUANT_UNIT": unit_store(w)}, IN=inp, OUT=out, TILE=tile, BN=BN, BK=bk,
                      UE=w.unit.elems, THREADS=THREADS, WR=max(1, tile // 32))
  return Kernel(name, src, (tiles, -(-out // BN), 1), (0,), THREADS)
