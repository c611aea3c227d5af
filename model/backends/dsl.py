"""The `dsl` backend: quantized matrix products as tinygrad UOp custom kernels that read the GGUF block planes directly.

One kernel per product: a range per output index (left WEAK, so tinygrad makes them global dims on a GPU) and REDUCE
ranges over the weight's blocks and over the elements of a block, each element dequantized from its planes where it is
multiplied (see `_ELEMENTS`). The kernels carry no schedule (no `opts_to_apply`), so tinygrad's heuristics or BEAM choose
upcasts, unrolls, locals and group reduces as for any kernel. The expert kernel takes the selected expert ids as an input
buffer, loads each id inside the kernel and indexes the weight's rows by it: one kernel computes the rows of all K
selected experts, with no gather kernel. Every product takes batched input (prefill) as well as a single token (decode).

A custom kernel fuses with nothing: its input (a norm's output, say) is realized into a buffer first, and whatever
consumes its output runs as a kernel of its own.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from math import prod
from typing import TYPE_CHECKING

from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from model.backends import Backend
from model.quants import BF16, F16, F32, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, QUANT_TYPES

if TYPE_CHECKING:
  from model.weights import QWeight

Planes = dict[str, UOp]  # each (rows, nblocks, field_len), as QWeight keeps them


def _i(v: UOp) -> UOp: return v.cast(dtypes.int32)
def _f(v: UOp) -> UOp: return v.cast(dtypes.float32)
def _bits(v: UOp, shift: UOp, n: int) -> UOp: return (_i(v) >> _i(shift)) & ((1 << n) - 1)


# Per type: the ranges that split one block's elements, and the element at those ranges as (offset in the block, value),
# read from row r, block b of the planes. Layouts as in model/quants.py (ggml-common.h).

def _q4_0(p: Planes, r: UOp, b: UOp, h: UOp, e: UOp) -> tuple[UOp, UOp]:
  """Q4_0: element 16*h + e is nibble h of qs byte e."""
  return h * 16 + e, _f(p["d"][r, b, 0]) * _f(_bits(p["qs"][r, b, e], h * 4, 4) - 8)


def _q8_0(p: Planes, r: UOp, b: UOp, e: UOp) -> tuple[UOp, UOp]: return e, _f(p["d"][r, b, 0]) * _f(p["qs"][r, b, e])


def _q45_k(p: Planes, r: UOp, b: UOp, c1: UOp, c0: UOp, h: UOp, e: UOp) -> tuple[UOp, UOp]:
  """Q4_K and Q5_K: group g = 4*c1 + 2*c0 + h of 32 elements, the low (h=0) or high nibbles of qs bytes 32*(2*c1+c0)..;
  its 6-bit scale and min sit in bytes j, j+4, j+8 of sc (j = g % 4), split differently for the first and last 4 groups."""
  g, j = c1 * 4 + c0 * 2 + h, c0 * 2 + h
  a, m, hi = _i(p["sc"][r, b, j]), _i(p["sc"][r, b, j + 4]), _i(p["sc"][r, b, j + 8])
  first = c1 < 1
  sc = first.where(a & 63, (hi & 15) | ((a >> 6) << 4))
  mn = first.where(m & 63, (hi >> 4) | ((m >> 6) << 4))
  q = _bits(p["qs"][r, b, (c1 * 2 + c0) * 32 + e], h * 4, 4)
  if "qh" in p: q = q + _bits(p["qh"][r, b, e], g, 1) * 16
  return g * 32 + e, _f(p["d"][r, b, 0]) * _f(sc) * _f(q) - _f(p["dmin"][r, b, 0]) * _f(mn)


def _q6_k(p: Planes, r: UOp, b: UOp, hh: UOp, j1: UOp, j0: UOp, eh: UOp, el: UOp) -> tuple[UOp, UOp]:
  """Q6_K: element e = 16*eh + el of quarter j = 2*j1 + j0 of half hh; its low 4 bits are nibble j1 of ql byte
  64*hh + 32*j0 + e, its high 2 bits are bits 2j.. of qh byte 32*hh + e; one int8 scale per 16 elements."""
  j, e = j1 * 2 + j0, eh * 16 + el
  low = _bits(p["ql"][r, b, hh * 64 + j0 * 32 + e], j1 * 4, 4)
  high = _bits(p["qh"][r, b, hh * 32 + e], j * 2, 2)
  scale = _f(p["d"][r, b, 0]) * _f(p["sc"][r, b, hh * 8 + j * 2 + eh])
  return hh * 128 + j * 32 + e, scale * _f((low | (high << 4)) - 32)


def _float(p: Planes, r: UOp, b: UOp) -> tuple[UOp, UOp]:
  w = p["w"][r, b, 0]
  return UOp.const(0, dtypes.weakint), (_i(w).cast(dtypes.uint32) << 16).bitcast(dtypes.float32) if w.dtype == dtypes.uint16 else _f(w)


_ELEMENTS: dict[int, tuple[tuple[int, ...], Callable[..., tuple[UOp, UOp]]]] = {
  Q4_0: ((2, 16), _q4_0), Q8_0: ((32,), _q8_0), Q4_K: ((2, 2, 2, 32), _q45_k), Q5_K: ((2, 2, 2, 32), _q45_k),
  Q6_K: ((2, 2, 2, 2, 16), _q6_k), F32: ((), _float), F16: ((), _float), BF16: ((), _float)}


def _dot(x: UOp, lead: tuple[UOp, ...], p: Planes, ggml_type: int, r: UOp, axis: int) -> UOp:
  """sum over the input of x[*lead, i] * w[r, i], float32: REDUCE ranges (axis ids from `axis`) over blocks and block elements."""
  dims, element = _ELEMENTS[ggml_type]
  nb = next(iter(p.values())).shape[1]
  b, *rngs = (UOp.range(n, axis + i, AxisType.REDUCE) for i, n in enumerate((nb, *dims)))
  off, w = element(p, r, b, *rngs)
  return (_f(x[(*lead, b * QUANT_TYPES[ggml_type].block + off)]) * w).reduce(b, *rngs, arg=Ops.ADD)


def _sink(store: UOp, ranges: tuple[UOp, ...], role: str, ggml_type: int) -> UOp:
  return store.end(*ranges).sink(arg=KernelInfo(name=f"dsl_{role}_{QUANT_TYPES[ggml_type].name.lower()}"))


def dense_kernel(out: UOp, x: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int) -> UOp:
  """out (N, O) = x (N, I) @ w.T for planes of w (O, I)."""
  n, o = (UOp.range(s, i) for i, s in enumerate(out.shape))
  acc = _dot(x, (n,), dict(zip(names, planes, strict=True)), ggml_type, o, 2)
  return _sink(out[n, o].store(acc), (n, o), "dense", ggml_type)


def per_head_kernel(out: UOp, x: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int) -> UOp:
  """out (N, H, O): per head h, x (N, H, I) @ w[h].T for planes of w (H*O, I)."""
  n, h, o = (UOp.range(s, i) for i, s in enumerate(out.shape))
  acc = _dot(x, (n, h), dict(zip(names, planes, strict=True)), ggml_type, h * out.shape[2] + o, 3)
  return _sink(out[n, h, o].store(acc), (n, h, o), "per_head", ggml_type)


def expert_kernel(out: UOp, x: UOp, sel: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int, n_experts: int) -> UOp:
  """out (M, K, O): for token m and slot k, x (M, K or 1, I) @ w[sel[m, k]].T for planes of w (E*O, I).

  The expert id is a load from `sel` inside the kernel (clamped to a valid expert, so no id can read outside the weight)."""
  m, k, o = (UOp.range(s, i) for i, s in enumerate(out.shape))
  e = _i(sel[m, k]).clip(0, n_experts - 1).cast(dtypes.weakint)
  xk = k if x.shape[1] > 1 else UOp.const(0, dtypes.weakint)  # gate and up share one input for all K slots
  acc = _dot(x, (m, xk), dict(zip(names, planes, strict=True)), ggml_type, e * out.shape[2] + o, 3)
  return _sink(out[m, k, o].store(acc), (m, k, o), "expert", ggml_type)


def _run(kernel: Callable[..., UOp], out_shape: tuple[int, ...], x: Tensor, srcs: tuple[Tensor, ...], w: QWeight, **kw) -> Tensor:
  names = tuple(w.planes)
  out = Tensor.empty(*out_shape, dtype=dtypes.float32, device=x.device)
  fxn = partial(kernel, names=names, ggml_type=w.ggml_type, **kw)
  return out.custom_kernel(x, *srcs, *(w.planes[k] for k in names), fxn=fxn)[0]


class DslBackend(Backend):
  name = "dsl"
  quants = frozenset(QUANT_TYPES[t].name for t in _ELEMENTS)

  def linear(self, x: Tensor, w: QWeight) -> Tensor: return linear(x, w)
  def per_head(self, x: Tensor, w: QWeight) -> Tensor: return per_head(x, w)
  def expert(self, x: Tensor, sel: Tensor, w: QWeight) -> Tensor: return expert(x, sel, w)


def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  lead, (out, inp) = x.shape[:-1], w.shape
  return _run(dense_kernel, (prod(lead), out), x.reshape(-1, inp), (), w).reshape(*lead, out)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out)."""
  lead, (H, out, inp) = x.shape[:-2], w.shape
  return _run(per_head_kernel, (prod(lead), H, out), x.reshape(-1, H, inp), (), w).reshape(*lead, H, out)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out)."""
  (B, T, K), (E, out, inp) = sel.shape, w.shape
  xs = x.reshape(B * T, x.shape[2], inp)
  return _run(expert_kernel, (B * T, K, out), xs, (sel.reshape(B * T, K),), w, n_experts=E).reshape(B, T, K, out)


BACKEND = DslBackend()
