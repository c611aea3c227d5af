"""The UOp building blocks the dsl backend's kernels share (model/backends/dsl.py, dsl_attention.py): casts, and
ranges of given kinds that split an index without division in the kernel."""
from __future__ import annotations

from collections.abc import Iterator
from math import prod

from tinygrad import UOp, dtypes
from tinygrad.uop.ops import AxisType


def _i(v: UOp) -> UOp: return v.cast(dtypes.int32)
def _f(v: UOp) -> UOp: return v.cast(dtypes.float32)


def _axis(size: int, ids: Iterator[int], kind: AxisType) -> tuple[UOp, ...]:
  """(index, range) over `size`, or (constant 0,) for a single one: tinygrad folds a range of one away."""
  if size == 1: return (UOp.const(0, dtypes.weakint),)
  return (r := UOp.range(size, next(ids), kind)), r


def _split(n: int, ids: Iterator[int], kinds: tuple[AxisType, ...],
           sizes: tuple[int, ...]) -> tuple[UOp, tuple[UOp, ...]]:
  """An index over n made of ranges of the given kinds and sizes (innermost last; the first takes what is left), and
  its ranges: a loop split into threads of a workgroup and unrolled steps, without division in the kernel."""
  idx, ranges = UOp.const(0, dtypes.weakint), []
  for size, kind in zip((n // prod(sizes), *sizes), kinds, strict=True):
    r, *rr = _axis(size, ids, kind)
    idx, ranges = idx * size + r, ranges + rr
  return idx, tuple(ranges)


def _pow2(n: int, most: int) -> int: return next(g for g in (64, 32, 16, 8, 4, 2, 1) if g <= most and n % g == 0)
