"""The native backend's prompt kernels. Its products (StructureConfig.prefill_weights = quantised): many rows of float16
activations by quantised weights on the tensor cores, each tile of rows by its own expert's matrix
(cuda/grouped_mma.cu); the weight is read quantised, a stage of BN rows by BK inputs at a time, and dequantised into
shared memory as float16 by the unit decoders the decode kernels use (cuda_src.UNITS), so no dequantised copy of any
matrix is ever written to memory. Its attention (StructureConfig.prefill_attention = all_heads): decode's all-heads
kernel (cuda/mla_heads.cu) with a token a grid row, each token at its own position (causal), and a merge of each
token's splits (cuda/mla_prefill_merge.cu)."""
from __future__ import annotations

import functools

from model.backends.cuda_src import (
  AH_LEAST,
  AH_THREADS,
  AH_TILE,
  UNITS,
  Kernel,
  Unit,
  W,
  _unit_values,
  device_kernel,
  unit_loads,
)
from model.quants import QUANT_TYPES

THREADS, BN = 128, 64  # a block's threads (4 warps) and outputs
TILES = (16, 32, 64)  # the rows a tile may hold (StructureConfig.prefill_tile)


def span(un: Unit) -> int:
  """The elements of a row a unit's elements lie within, rounded up to a power of two (Q6_K: its units' two runs of 32
  lie within 128 elements)."""
  end = max(un.xoff(e) for _, _, elems in un.groups for e, _ in elems) + 1
  return 1 << (end - 1).bit_length()


def stage_k(ggml_type: int, inp: int) -> int | None:
  """The inputs a stage of the product walks for a weight of this type and row length: the most of 128, 64 and 32 that
  divides the row and is a multiple of the unit's span; None where none is."""
  if ggml_type not in UNITS: return None
  return next((bk for bk in (128, 64, 32) if inp % bk == 0 and bk % span(UNITS[ggml_type]) == 0), None)


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


MERGE_THREADS = 128  # a block of the prompt attention's merge (a token's head): 4 of kv_lora's columns a thread
PREFILL_SPLIT = 1024  # the positions a split of the prompt's attention holds at most (a token's splits: its partials)


def prefill_splits(max_ctx: int) -> int:
  """The splits of a prompt token's attention over a cache of max_ctx positions: a chunk's tokens fill the device
  already, so a split holds up to PREFILL_SPLIT positions (its partials, per token, stay small)."""
  return -(-max_ctx // PREFILL_SPLIT)


@functools.cache
def mla_prefill(heads: int, kvl: int, rope: int, max_ctx: int, scale: float, cache_half: bool,
                tokens: int, tt: int = 1) -> tuple[Kernel, Kernel]:
  """The absorbed attention of a chunk of `tokens` tokens at positions early_pos[0].. over the compressed cache, each
  token's heads over the positions up to its own: (the all-heads kernel, grid splits x groups of `tt` tokens, whose
  heads are a block's rows, writing part (tokens, heads, splits, kvl + 2); the merge of each token's splits, grid heads
  x tokens, writing o (tokens, heads, kvl))."""
  S = prefill_splits(max_ctx)
  tag = f"h{heads}_{kvl}_{rope}_c{max_ctx}_s{S}_t{tokens}{f'x{tt}' if tt > 1 else ''}{'' if cache_half else '_f32'}"
  params = ["float* part", "const float* __restrict__ qc", f"const {'unsigned short' if cache_half else 'float'}* "
            "__restrict__ cache", "const int* __restrict__ early_pos"]
  attn = device_kernel(f"native_mla_prefill_{tag}", params, "mla_heads.cu", threads=AH_THREADS, pre=("mma.cuh",),
                       HEADS=heads, KVL=kvl, ROPE=rope, SPLITS=S, SCALE=f"{scale!r}f", CACHE_HALF=int(cache_half),
                       THREADS=AH_THREADS, TP=AH_TILE, LEAST=AH_LEAST, TOKENS=tokens, TT=tt)
  merge = device_kernel(f"native_mla_prefill_merge_{tag}", ["float* o", "const float* __restrict__ part",
                                                             "const int* __restrict__ early_pos"],
                        "mla_prefill_merge.cu", threads=MERGE_THREADS, HEADS=heads, KVL=kvl, SPLITS=S, TP=AH_TILE,
                        LEAST=AH_LEAST, THREADS=MERGE_THREADS, TOKENS=tokens, TT=tt)
  return (Kernel(f"native_mla_prefill_{tag}", attn, (S, -(-tokens // tt), 1), (0,), AH_THREADS),
          Kernel(f"native_mla_prefill_merge_{tag}", merge, (heads, tokens, 1), (0,), MERGE_THREADS))
