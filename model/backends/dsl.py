"""The `dsl` backend: the portable kernels. Quantized matrix products as tinygrad UOp custom kernels that read the GGUF
block planes directly, each with an explicit schedule, rendered by tinygrad for whatever device runs them.

A product is one kernel: a range per output index and REDUCE ranges over the weight's blocks, over the scale groups of a
block and over the elements of a group (see `_SPECS`). Each group's codes are summed against the input first and scaled
once (a packed dot); a group with a min (Q4_K, Q5_K) sums its values. The integer planes are kept as 32-bit words
(`to_words`, at load), so a thread reads a block's codes and scales with a few wide loads instead of one per byte.

The schedule (the types of a kernel's ranges) is the same on every device that has workgroups: the elements of a block
are unrolled, the blocks of a row are split over a workgroup (GROUP: consecutive threads read consecutive blocks, and
the partial sums meet in shared memory), and each thread computes `ROWS` output rows, so one read of the input serves
them all. Where the device has no workgroups (the CPU) the blocks stay a loop. On every device the arithmetic is the
same.

The expert kernel loads the selected expert ids inside the kernel and indexes the weight's rows by them: one kernel
computes the rows of all K selected experts, with no gather. A custom kernel fuses with nothing: its input is realized
into a buffer first, and whatever consumes its output runs as a kernel of its own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import count
from math import prod
from typing import TYPE_CHECKING

from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from model.backends.dsl_attention import (
  _position,
  chunk,
  kv_write_kernel,
  merge_kernel,
  pv_kernel,
  pv_split_kernel,
  scores_all_kernel,
  scores_kernel,
  split_softmax_kernel,
)
from model.backends.dsl_uops import _axis, _f, _i, _pow2, _split
from model.backends.registry import Backend, register
from model.quants import BF16, F16, F32, LAYOUTS, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, QUANT_TYPES
from model.stages import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, SQRT_SOFTPLUS, rms_norm

if TYPE_CHECKING:
  from model.stages import AttentionStage, FfnStage, Glu, MoeStage, RouterStage, Routing
  from model.weights import QWeight
  Ffn = tuple[QWeight | None, QWeight | None, QWeight | None]  # gate, up, merged gate+up (merged, or the others)

Planes = dict[str, UOp]  # each (rows, nblocks, field_len), as QWeight keeps them

ROWS = 4  # output rows per thread
GROUP = 32  # threads that split a row (at most): LANES per block, times a divisor of the block count
LANES = 4  # threads that split the words of a block (at most), so that consecutive threads read consecutive words
THREADS = 32  # at least this many threads per workgroup: rows are spread over workgroup threads when GROUP is smaller
STEP = 8  # at most this many of a thread's blocks per unrolled step
MIN_THREADS = 16384  # fewer threads than this in a launch: one row per thread, so that more threads share the work


def _signed(ggml_type: int, name: str) -> bool: return LAYOUTS[ggml_type][name][2] == dtypes.int8


# the planes read as 32-bit words
WORDS = {Q4_0: ("qs",), Q8_0: ("qs",), Q4_K: ("sc", "qs"), Q5_K: ("sc", "qh", "qs"), Q6_K: ("ql", "qh", "sc")}


def to_words(w: QWeight) -> QWeight:
  """w's integer planes (WORDS: codes and packed scales) as 32-bit words (each field's bytes, little-endian), realized
  once."""
  for k in WORDS.get(w.ggml_type, ()):
    if (v := w.planes[k]).dtype == dtypes.uint32: continue
    # a buffer of its own: bitcast(...).contiguous() of a realized buffer stays a lazy view, copied by each kernel
    # that reads it
    words = Tensor.empty(*v.shape[:-1], v.shape[-1] * v.dtype.itemsize // 4, dtype=dtypes.uint32, device=v.device)
    w.planes[k] = words.assign(v.bitcast(dtypes.uint32)).realize()
  return w


def _byte(p: Planes, name: str, ggml_type: int, r: UOp, b: UOp, word: UOp | int, byte: UOp | int) -> UOp:
  """Byte 4*word + byte of field `name` of row r, block b, as int32 (sign-extended for int8 fields), from a word plane
  or a byte plane. The caller splits the index: tinygrad's unrolled ranges take no division."""
  v = p[name]
  if getattr(v.dtype, "base", v.dtype) != dtypes.uint32: return _i(v[r, b, word * 4 + byte])
  w, shift = v[r, b, word], UOp.const(byte * 8, dtypes.uint32)
  if _signed(ggml_type, name): return (w << (24 - shift)).bitcast(dtypes.int32) >> 24
  return _i((w >> shift) & 255)


@dataclass(frozen=True)
class _Spec:
  """How a block splits: `outer` ranges pick a scale group, `inner` ranges an element of it.
  code(p, r, b, *outer, *inner) -> (the element's offset in the block, its integer code as float32);
  scale(p, r, b, *outer) -> (scale, bias or None): the element's value is scale * code + bias.
  `word` is the inner range that picks a 32-bit word of the codes, which LANES threads can split (None: the block is
  not split)."""
  outer: tuple[int, ...]
  inner: tuple[int, ...]
  code: Callable[..., tuple[UOp, UOp]]
  scale: Callable[..., tuple[UOp, UOp | None]]
  word: int | None = None


def _d(p: Planes, r: UOp, b: UOp, *_) -> tuple[UOp, None]: return _f(p["d"][r, b, 0]), None


def _q4_0(p: Planes, r: UOp, b: UOp, h: UOp, wi: UOp, bi: UOp) -> tuple[UOp, UOp]:
  """Q4_0: element 16*h + e is nibble h of qs byte e."""
  e = wi * 4 + bi
  return h * 16 + e, _f(((_byte(p, "qs", Q4_0, r, b, wi, bi) >> _i(h * 4)) & 15) - 8)


def _q8_0(p: Planes, r: UOp, b: UOp, wi: UOp, bi: UOp) -> tuple[UOp, UOp]:
  return wi * 4 + bi, _f(_byte(p, "qs", Q8_0, r, b, wi, bi))


def _k_code(t: int):
  def code(p: Planes, r: UOp, b: UOp, c1: UOp, c0: UOp, h: UOp, ew: UOp, eb: UOp) -> tuple[UOp, UOp]:
    """Q4_K and Q5_K: group g = 4*c1 + 2*c0 + h of 32 elements, the low (h=0) or high nibbles of qs bytes
    32*(2*c1+c0)..; Q5_K's fifth bit is bit g of qh byte e."""
    e, g = ew * 4 + eb, c1 * 4 + c0 * 2 + h
    q = (_byte(p, "qs", t, r, b, (c1 * 2 + c0) * 8 + ew, eb) >> _i(h * 4)) & 15
    if "qh" in p: q = q + ((_byte(p, "qh", t, r, b, ew, eb) >> _i(g)) & 1) * 16
    return g * 32 + e, _f(q)
  return code


def _k_scale(t: int):
  def scale(p: Planes, r: UOp, b: UOp, c1: UOp, c0: UOp, h: UOp) -> tuple[UOp, UOp]:
    """Group g's 6-bit scale and min sit in sc bytes j, j+4, j+8 (j = g % 4), split one way for the first 4 groups
    and another for the last 4."""
    j = c0 * 2 + h
    a, m, hi = (_byte(p, "sc", t, r, b, word, j) for word in (0, 1, 2))
    first = c1 < 1
    sc = first.where(a & 63, (hi & 15) | ((a >> 6) << 4))
    mn = first.where(m & 63, (hi >> 4) | ((m >> 6) << 4))
    return _f(p["d"][r, b, 0]) * _f(sc), -(_f(p["dmin"][r, b, 0]) * _f(mn))
  return scale


def _q6_k(p: Planes, r: UOp, b: UOp, hh: UOp, j1: UOp, j0: UOp, eh: UOp, ew: UOp, eb: UOp) -> tuple[UOp, UOp]:
  """Q6_K: element e = 16*eh + el of quarter j = 2*j1 + j0 of half hh; its low 4 bits are nibble j1 of ql byte
  64*hh + 32*j0 + e, its high 2 bits are bits 2j.. of qh byte 32*hh + e."""
  j, e = j1 * 2 + j0, eh * 16 + ew * 4 + eb
  low = (_byte(p, "ql", Q6_K, r, b, hh * 16 + j0 * 8 + eh * 4 + ew, eb) >> _i(j1 * 4)) & 15
  high = (_byte(p, "qh", Q6_K, r, b, hh * 8 + eh * 4 + ew, eb) >> _i(j * 2)) & 3
  return hh * 128 + j * 32 + e, _f((low | (high << 4)) - 32)


def _q6_k_scale(p: Planes, r: UOp, b: UOp, hh: UOp, j1: UOp, j0: UOp, eh: UOp) -> tuple[UOp, None]:
  """One int8 scale per 16 elements."""
  return _f(p["d"][r, b, 0]) * _f(_byte(p, "sc", Q6_K, r, b, hh * 2 + j1, j0 * 2 + eh)), None


def _float(p: Planes, r: UOp, b: UOp) -> tuple[UOp, UOp]:
  w = p["w"][r, b, 0]
  return (UOp.const(0, dtypes.weakint), (_i(w).cast(dtypes.uint32) << 16).bitcast(dtypes.float32)
          if w.dtype == dtypes.uint16 else _f(w))


_SPECS: dict[int, _Spec] = {
  Q4_0: _Spec((), (2, 4, 4), _q4_0, _d, 1), Q8_0: _Spec((), (8, 4), _q8_0, _d, 0),
  Q4_K: _Spec((2, 2, 2), (8, 4), _k_code(Q4_K), _k_scale(Q4_K), 0),
  Q5_K: _Spec((2, 2, 2), (8, 4), _k_code(Q5_K), _k_scale(Q5_K), 0),
  Q6_K: _Spec((2, 2, 2, 2), (4, 4), _q6_k, _q6_k_scale, 0),
  F32: _Spec((), (), _float, lambda *_: (None, None)), F16: _Spec((), (), _float, lambda *_: (None, None)),
  BF16: _Spec((), (), _float, lambda *_: (None, None))}


def _lanes(ggml_type: int) -> int:
  """Threads that split the words of one block (1 where the type's blocks are not split)."""
  spec = _SPECS[ggml_type]
  return 1 if spec.word is None else min(LANES, spec.inner[spec.word])


def _divisor(n: int, most: int) -> int:
  """The largest divisor of n up to `most`."""
  return next(d for d in range(min(n, most), 0, -1) if n % d == 0)


def _group(blocks: int, ggml_type: int, local: bool) -> int:
  """Threads that split a row (1: no workgroups): `_lanes` per block, times the largest divisor of the block count that
  keeps them to GROUP; where that leaves each thread a block count `_dot` cannot unroll (a loop of single blocks, as 11
  of DeepSeek-V2-Lite's 44), more threads (up to 2 * GROUP) with STEP or fewer blocks each."""
  if not local: return 1
  lanes = _lanes(ggml_type)
  g, wide = _divisor(blocks, GROUP // lanes), blocks // _divisor(blocks, STEP)
  if _divisor(per := blocks // g, STEP) < min(per, 4) and lanes * wide <= 2 * GROUP: g = wide
  return lanes * g


def _rows(n: int, ids: Iterator[int], local: bool, group: int, lead: int = 1,
          per: int | None = None) -> tuple[UOp, tuple[UOp, ...]]:
  """The row index of n output rows (of each of `lead` leading outputs) and its ranges: `per` rows per thread (UPCAST;
  None: ROWS where that leaves MIN_THREADS threads), spread over workgroup threads (LOCAL) until a workgroup has THREADS
  threads with the group, the rest over workgroups (GLOBAL, or a loop without workgroups)."""
  if per is None: per = ROWS if lead * n // ROWS * group >= MIN_THREADS else 1
  if n % per: per = 1
  spread = max(1, THREADS // group) if local else 1
  while spread > 1 and (n // per) % spread: spread //= 2
  parts = ((n // (per * spread), AxisType.GLOBAL if local else AxisType.WEAK), (spread, AxisType.LOCAL),
           (per, AxisType.UPCAST))
  idx, ranges = UOp.const(0, dtypes.weakint), []
  for size, kind in parts:
    if size > 1:
      ranges.append(r := UOp.range(size, next(ids), kind))
      idx = idx * size + r
  return idx, tuple(ranges)


def _dot(xv: Callable[[UOp], UOp], p: Planes, ggml_type: int, r: UOp, ids: Iterator[int], group: int,
         ss: tuple[UOp, Callable[[UOp], UOp]] | None = None) -> UOp:
  """sum over the input of x[i] * w[r, i] (float32): the blocks split over `group` threads (GROUP_REDUCE), the ranges
  inside a block unrolled. ss = (pair, raw): the sum of raw(i)^2 over the same input rides along as element 1 of an
  unrolled pair (element 0 the product), so one reduction carries both (see `_rms_folded`)."""
  spec = _SPECS[ggml_type]
  nb = next(iter(p.values())).shape[1]
  split = group > 1  # the blocks split over workgroup threads (group 1: a device without workgroups)
  lanes = _lanes(ggml_type) if split else 1
  group //= lanes
  # a thread's blocks: read in unrolled steps of `step` where workgroups split them (their loads issued together);
  # without workgroups a loop of single blocks (unrolled steps of K-quant blocks take a minute to generate on a CPU)
  per = nb // group
  step = _divisor(per, STEP) if split else 1
  (bo, *red_o), (bu, *red_u) = _axis(per // step, ids, AxisType.REDUCE), _axis(step, ids, AxisType.UNROLL)
  wl, *red_l = _axis(lanes, ids, AxisType.GROUP_REDUCE)  # before the blocks' range: a workgroup's fastest threads
  bg, *red_g = _axis(group, ids, AxisType.GROUP_REDUCE)
  b, red = (bo * step + bu) * group + bg, (*red_o, *red_u, *red_l, *red_g)
  outer = tuple(UOp.range(n, next(ids), AxisType.UNROLL) for n in spec.outer)
  inner = [UOp.range(n // (lanes if j == spec.word else 1), next(ids), AxisType.UNROLL)
           for j, n in enumerate(spec.inner)]
  at = [v * lanes + wl if j == spec.word else v for j, v in enumerate(inner)]  # lane wl reads every lanes-th word
  off, code = spec.code(p, r, b, *outer, *at)
  x = _f(xv(i := b * QUANT_TYPES[ggml_type].block + off))
  scale, bias = spec.scale(p, r, b, *outer)
  # a group with a min: its elements' values summed against the input, one reduction (a second one, of the input alone,
  # would let tinygrad merge its word and byte ranges apart from the codes' reduction, which it cannot expand)
  if bias is not None: code, scale = scale * code + bias, None
  inner_sum = lambda v: v.reduce(*inner, arg=Ops.ADD) if inner else v
  # product(v, sq): v in the product's element of the pair, sq in the sum of squares' (v alone without a pair)
  product = (lambda v, sq: ss[0].eq(0).where(v, sq)) if ss is not None else (lambda v, sq: v)
  raw = _f(ss[1](i)) if ss is not None else None
  term = inner_sum(product(x * code, raw * raw if raw is not None else None))
  if scale is not None: term = term * product(scale, UOp.const(1.0, dtypes.float32))
  return term.reduce(*red, *outer, arg=Ops.ADD) if (red or outer) else term


def _rms_folded(acc: UOp, pair: UOp, n: int, eps: float) -> UOp:
  """The product times 1/rms of its input, from `_dot`'s pair (product, sum of squares over the n input values)."""
  return pair.eq(0).where(acc, (acc * (1 / n) + eps).rsqrt()).reduce(pair, arg=Ops.MUL)


@dataclass(frozen=True)
class _Pick:
  """The planes of two weights read as one: where `first` holds, a's at (row, block); elsewhere b's at to_b(row, block).
  Both loads are gated, so a thread reads only the weight its row is in."""
  first: UOp
  a: UOp
  b: UOp
  to_b: Callable[[UOp, UOp], tuple[UOp, UOp]]

  @property
  def dtype(self): return self.a.dtype

  @property
  def shape(self) -> tuple[int, ...]: return self.a.shape

  def __getitem__(self, idx: tuple[UOp, UOp, UOp | int]) -> UOp:
    r, blk, w = idx
    rb, bb = self.to_b(r, blk)
    return self.first.where(self.a[r.valid(self.first), blk, w], self.b[rb.valid(self.first.logical_not()), bb, w])


def _picked(first: UOp, a: Planes, b: Planes, to_b: Callable[[UOp, UOp], tuple[UOp, UOp]]) -> Planes:
  return {k: _Pick(first, a[k], b[k], to_b) for k in a}


def _sink(store: UOp, ranges: tuple[UOp, ...], role: str, ggml_type: int) -> UOp:
  """The kernel's schedule is in its ranges' types: no heuristic or BEAM search changes it."""
  return store.end(*ranges).sink(arg=KernelInfo(name=f"dsl_{role}_{QUANT_TYPES[ggml_type].name.lower()}",
                                                opts_to_apply=()))


def _blocks(p: Planes) -> int: return next(iter(p.values())).shape[1]


def _lead(size: int, ids: Iterator[int]) -> UOp:
  """A leading output range (tokens, heads, slots), or the constant 0 for a single one."""
  return _axis(size, ids, AxisType.WEAK)[0]


def dense_kernel(out: UOp, x: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int, local: bool) -> UOp:
  """out (N, O) = x (N, I) @ w.T for planes of w (O, I)."""
  ids, p = count(), dict(zip(names, planes, strict=True))
  group = _group(_blocks(p), ggml_type, local)
  n = _lead(out.shape[0], ids)
  o, rows = _rows(out.shape[1], ids, local, group, out.shape[0])
  acc = _dot(lambda i: x[n, i], p, ggml_type, o, ids, group)
  return _sink(out[n, o].store(acc), (*_ranges(n), *rows), "dense", ggml_type)


def per_head_kernel(out: UOp, x: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int, local: bool) -> UOp:
  """out (N, H, O): per head h, x (N, H, I) @ w[h].T for planes of w (H*O, I)."""
  ids, p = count(), dict(zip(names, planes, strict=True))
  group = _group(_blocks(p), ggml_type, local)
  n, h = _lead(out.shape[0], ids), _lead(out.shape[1], ids)
  o, rows = _rows(out.shape[2], ids, local, group, out.shape[0] * out.shape[1])
  acc = _dot(lambda i: x[n, h, i], p, ggml_type, h * out.shape[2] + o, ids, group)
  return _sink(out[n, h, o].store(acc), (*_ranges(n, h), *rows), "per_head", ggml_type)


def _ranges(*us: UOp) -> tuple[UOp, ...]: return tuple(u for u in us if u.op is Ops.RANGE)


def _expert_id(sel: UOp, n_experts: int, *idx: UOp) -> UOp:
  """The expert id at sel[idx], clamped to a valid expert, so no id can read outside the weight."""
  return _i(sel[idx]).clip(0, n_experts - 1).cast(dtypes.weakint)


def expert_kernel(out: UOp, x: UOp, sel: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int, n_experts: int,
                  local: bool) -> UOp:
  """out (M, K, O): for token m and slot k, x (M, K or 1, I) @ w[sel[m, k]].T for planes of w (E*O, I)."""
  ids, p = count(), dict(zip(names, planes, strict=True))
  group = _group(_blocks(p), ggml_type, local)
  m, k = _lead(out.shape[0], ids), _lead(out.shape[1], ids)
  o, rows = _rows(out.shape[2], ids, local, group, out.shape[0] * out.shape[1])
  xk = k if x.shape[1] > 1 else UOp.const(0, dtypes.weakint)  # gate and up share one input for all K slots
  acc = _dot(lambda i: x[m, xk, i], p, ggml_type, _expert_id(sel, n_experts, m, k) * out.shape[2] + o, ids, group)
  return _sink(out[m, k, o].store(acc), (*_ranges(m, k), *rows), "expert", ggml_type)


def dequant_kernel(out: UOp, *srcs: UOp, names: tuple[str, ...], ggml_type: int, local: bool) -> UOp:
  """out (R, I) = the values of w's planes (R rows of I), in out's dtype. A thread per scale group of a block (its
  group on a workgroup's thread, its block and row over the grid) writes the group's elements (UPCAST) to consecutive
  addresses, which tinygrad stores as vectors. srcs: the planes, after a tensor (1,) int32 where one comes first (more
  sources than names), which is read as a zero (min(after, 0), after >= 0), so a graph runs the kernel where `after`
  is made instead of with the weight-only kernels at its start."""
  after, planes = (srcs[0], srcs[1:]) if len(srcs) > len(names) else (None, srcs)
  ids, p, spec = count(), dict(zip(names, planes, strict=True)), _SPECS[ggml_type]
  grid, group = (AxisType.GLOBAL, AxisType.LOCAL) if local else (AxisType.WEAK, AxisType.LOOP)
  # a workgroup: up to 64 threads on consecutive blocks of a row (its fastest), each block's groups, then rows to 128
  groups = prod(spec.outer)
  lb = _pow2(_blocks(p), 64 // groups) if local else 1
  lr = _pow2(out.shape[0], max(1, 128 // (lb * groups))) if local else 1
  b, b_ranges = _split(_blocks(p), ids, (grid, group), (lb,))
  outer = tuple(UOp.range(n, next(ids), group) for n in spec.outer)
  r, r_ranges = _split(out.shape[0], ids, (grid, group), (lr,))
  inner = tuple(UOp.range(n, next(ids), AxisType.UPCAST) for n in spec.inner)
  off, code = spec.code(p, r, b, *outer, *inner)
  scale, bias = spec.scale(p, r, b, *outer)
  v = code if scale is None else scale * code if bias is None else scale * code + bias
  if after is not None: v = v + _f(_i(after[0]).minimum(0))
  store = out[r, b * QUANT_TYPES[ggml_type].block + off].store(v.cast(out.dtype))
  return _sink(store, (*b_ranges, *outer, *r_ranges, *inner), "dequant", ggml_type)


def dequantised(w: QWeight, dt: DType, after: Tensor | None = None) -> Tensor:
  """w's values in dt, a buffer of their own (shape w.shape), made after `after` (1,) int32 where given
  (dequant_kernel)."""
  planes = list(w.planes.values())
  device = planes[0].device
  out = Tensor.empty(prod(w.shape[:-1]), w.shape[-1], dtype=dt, device=device)
  fxn = partial(dequant_kernel, names=tuple(w.planes), ggml_type=w.ggml_type, local=_local(device))
  return out.custom_kernel(*([] if after is None else [after]), *planes, fxn=fxn)[0].reshape(w.shape)


def _local(device: str) -> bool:
  """Whether the device runs kernels in workgroups with shared memory (the schedule's GROUP and LOCAL need both)."""
  ren = Device[device].renderer
  return bool(ren.has_local and ren.has_shared)


def _run(kernel: Callable[..., UOp], out_shape: tuple[int, ...], x: Tensor, srcs: tuple[Tensor, ...], w: QWeight,
         **kw) -> Tensor:
  names = tuple(w.planes)
  out = Tensor.empty(*out_shape, dtype=dtypes.float32, device=x.device)
  fxn = partial(kernel, names=names, ggml_type=w.ggml_type, local=_local(x.device), **kw)
  return out.custom_kernel(x, *srcs, *(w.planes[k] for k in names), fxn=fxn)[0]


# ---- fused decode stages (one token): the inputs each reads are model/stages.py's
# The same stage boundaries as the native kernels where a product carries them: each RMSNorm is folded into the products
# that read it, whose reduction computes its 1/rms alongside the product; the routing weights, the sum over the selected
# experts, the shared expert and the residual add sit in down's kernel (the residual in the output projection's).
# Attention's softmax and the router's top-k are kernels of their own, as a UOp kernel cannot rank or normalise the
# outputs of its own reduce.

Norm = tuple[Tensor, float]  # an RMSNorm folded into a product: gamma and eps (the product reduces the 1/rms itself)


def _normed(x: UOp, gamma: UOp | None) -> Callable[[UOp], UOp]:
  """x's value at i, times gamma[i] where an RMSNorm is folded in (its 1/rms scales the dot product afterwards)."""
  return (lambda i: _f(x[i]) * _f(gamma[i])) if gamma is not None else (lambda i: x[i])


def _norm_dot(x: UOp, gamma: UOp | None, eps: float | None, p: Planes, ggml_type: int, r: UOp, ids: Iterator[int],
              group: int) -> UOp:
  """w[r] . (rmsnorm(x) * gamma), the 1/rms reduced alongside the product; w[r] . x where gamma is None."""
  if gamma is None: return _dot(_normed(x, None), p, ggml_type, r, ids, group)
  pair = UOp.range(2, next(ids), AxisType.UNROLL)
  acc = _dot(_normed(x, gamma), p, ggml_type, r, ids, group, ss=(pair, lambda i: x[i]))
  return _rms_folded(acc, pair, _blocks(p) * QUANT_TYPES[ggml_type].block, eps)


def _front(srcs: tuple[UOp, ...], present: bool) -> tuple[UOp | None, tuple[UOp, ...]]:
  """The first of srcs where it is present, and the rest."""
  return (srcs[0], srcs[1:]) if present else (None, srcs)


def _planes(w: QWeight, srcs: tuple[UOp, ...]) -> tuple[Planes, tuple[UOp, ...]]:
  """w's planes from the front of srcs, and the rest."""
  n = len(w.planes)
  return dict(zip(w.planes, srcs[:n], strict=True)), srcs[n:]


def vector_kernel(out: UOp, x: UOp, *srcs: UOp, ws: tuple[QWeight, ...], eps: float | None, residual: bool,
                  rows: int | None, local: bool) -> UOp:
  """out (O,) = [res +] w . [rmsnorm(x) * gamma] for one token: srcs = [gamma], [res], the planes of each weight of ws.
  Two weights (of one type and width) are one product over their rows stacked, the second's after the first's."""
  gamma, srcs = _front(srcs, eps is not None)
  res, srcs = _front(srcs, residual)
  ids, (p, srcs) = count(), _planes(ws[0], srcs)
  group = _group(_blocks(p), ws[0].ggml_type, local)
  o, ranges = _rows(out.shape[0], ids, local, group, per=rows)
  if len(ws) == 2:
    n0 = ws[0].shape[0]
    p = _picked(o < n0, p, _planes(ws[1], srcs)[0], lambda r, b: (r - n0, b))
  acc = _norm_dot(x, gamma, eps, p, ws[0].ggml_type, o, ids, group)
  if res is not None: acc = _f(res[o]) + acc
  return _sink(out[o].store(acc), ranges, "res" if residual else "vec", ws[0].ggml_type)


def gate_up_kernel(out: UOp, x: UOp, *srcs: UOp, w: QWeight, shared: QWeight | None, eps: float | None, experts: int,
                   glu: bool, rows: int, local: bool) -> UOp:
  """out (S, R) = w[sel[s]] . xn for the K selected experts (srcs = [gamma], sel (K,), the planes of w [and of shared];
  R rows per expert), then for S - K pseudo-experts the rows of the shared expert `shared`, R each; or one plain FFN
  (S = 1, no sel). xn = rmsnorm(x) * gamma where the norm is folded in, else x. glu: the weights are merged gate+up (an
  expert's gate rows, then its up rows) and out = SiLU(gate . xn) * (up . xn): a thread computes a gate row and its up
  row in one pass over the input (an unrolled pair of rows), and their product is a multiplying reduction over that
  pair of rows."""
  gamma, srcs = _front(srcs, eps is not None)
  sel, srcs = _front(srcs, experts > 0)
  ids, (p, srcs) = count(), _planes(w, srcs)
  group = _group(_blocks(p), w.ggml_type, local)
  y, R = _lead(out.shape[0], ids), out.shape[1]
  o, ranges = _rows(R, ids, local, group, per=rows)
  half = UOp.range(2, next(ids), AxisType.UNROLL) if glu else UOp.const(0, dtypes.weakint)
  row = half * R + o
  if sel is not None:
    K = sel.shape[0]
    row = _expert_id(sel, experts, y.minimum(K - 1)) * (2 * R if glu else R) + row
    if shared is not None:
      sh_row = half * ((out.shape[0] - K) * R) + (y - K) * R + o
      p = _picked(y < K, p, _planes(shared, srcs)[0], lambda r, b: (sh_row, b))
  acc = _norm_dot(x, gamma, eps, p, w.ggml_type, row, ids, group)
  if glu: acc = half.eq(0).where(acc.silu(), acc).reduce(half, arg=Ops.MUL)
  return _sink(out[y, o].store(acc), (*_ranges(y), *ranges), "glu" if glu else "gate_up", w.ggml_type)


Route = tuple[int, bool, float]  # how routing weights are computed: the gating function, normalisation, scale


def down_kernel(out: UOp, res: UOp, act: UOp, *srcs: UOp, w: QWeight, shared: QWeight | None, route: Route | None,
                rows: int, local: bool) -> UOp:
  """out (D,) = res + sum_k weight_k * (down[sel[k]] . act[k]) over the K selected experts (srcs = sel (K,), the router
  logits, the planes of w [and of shared]), their routing weights computed from the logits (`_routing_weight`), plus,
  with `shared`, the shared expert's down . act over act's rows after the K (its input split into pseudo-experts of
  act's width); or res + down . act for a plain FFN (route None; srcs = planes). A thread's sums per slot (an unrolled
  range) are weighted after their reduction."""
  ids = count()
  sel, srcs = _front(srcs, route is not None)
  logits, srcs = _front(srcs, route is not None)
  p, srcs = _planes(w, srcs)
  group = _group(_blocks(p), w.ggml_type, local)
  o, ranges = _rows(out.shape[0], ids, local, group, per=rows)
  if route is None:
    acc = _dot(lambda i: act[0, i], p, w.ggml_type, o, ids, group)
    return _sink(out[o].store(_f(res[o]) + acc), ranges, "down", w.ggml_type)
  K = sel.shape[0]
  k, *kr = _axis(act.shape[0], ids, AxisType.UNROLL)
  ks = k.minimum(K - 1)
  weight = _routing_weight(logits, sel, ks, route, ids)
  if shared is not None:
    nb = _blocks(p)
    p = _picked(k < K, p, _planes(shared, srcs)[0], lambda r, b: (o, b + (k - K) * nb))
    weight = (k < K).where(weight, UOp.const(1.0, dtypes.float32))
  acc = _dot(lambda i: act[k, i], p, w.ggml_type, _expert_id(sel, w.shape[0], ks) * out.shape[0] + o, ids, group)
  acc = (acc * weight).reduce(*kr, arg=Ops.ADD) if kr else acc * weight
  return _sink(out[o].store(_f(res[o]) + acc), ranges, "down", w.ggml_type)


def _custom(kernel: Callable[..., UOp], shape: tuple[int, ...], srcs: list[Tensor], dtype=dtypes.float32,
            **kw) -> Tensor:
  out = Tensor.empty(*shape, dtype=dtype, device=srcs[0].device)
  return out.custom_kernel(*srcs, fxn=partial(kernel, local=_local(srcs[0].device), **kw))[0]


def _vec(x: Tensor, ws: tuple[QWeight, ...], norm: Norm | None = None, res: Tensor | None = None,
         rows: int | None = None) -> Tensor:
  """[res +] w . [rmsnorm(x) * gamma] for one token: x (in,) -> (out,) float32; two weights' rows stacked; `rows` per
  thread (None: `_rows`' rule)."""
  srcs = [x.float(), *norm[:1]] if norm else [x.float()]
  srcs += ([res.float()] if res is not None else []) + [t for w in ws for t in w.planes.values()]
  return _custom(vector_kernel, (sum(w.shape[0] for w in ws),), srcs, ws=ws, eps=norm[1] if norm else None,
                 residual=res is not None, rows=rows)


def _decode(q: Tensor, q_abs: Tensor, cache: Tensor, rope: tuple[Tensor, Tensor], at: tuple[int | UOp, list[Tensor]],
            scale: float, nope: int, layout: str) -> Tensor:
  """softmax(scores) @ c_kv (H, kv_lora) of one token's query (q_b's output q, the absorbed q_abs (H, kv_lora)) over
  the cache's positions 0..pos (at: `_position`'s), in the kernels of the layout (per_head or all_heads: see
  model/backends/dsl_attention.py)."""
  (H, kvl), ctx, (pos, bind) = q_abs.shape, cache.shape[1], at
  s = _custom(scores_kernel if layout == "per_head" else scores_all_kernel, (H, ctx), [q, q_abs, cache, *rope, *bind],
              pos=pos, scale=scale, nope=nope)
  if layout == "per_head": return _custom(pv_kernel, (H, kvl), [s, cache, *bind], pos=pos)
  ch = chunk(ctx)
  w = _custom(split_softmax_kernel, (-(-ctx // ch), H, ch + 1), [s, *bind], pos=pos)
  part = _custom(pv_split_kernel, (w.shape[0], H, kvl), [w, cache, *bind], pos=pos)
  return _custom(merge_kernel, (H, kvl), [w, part, *bind], pos=pos)


def attention(st: AttentionStage, x: Tensor, start_pos: int | UOp, pos: Tensor | None) -> Tensor:
  """h = x + attention(x) for one token, in UOp kernels: q_a (or q) and kv_a as one product with the norm folded in,
  the KV cache write (each workgroup reduces c_kv's 1/rms), q_b with q_a's norm folded in, k_b reading q in place, the
  scores (q_pe rotated as they are read) and softmax(scores) @ c_kv (`_decode`), v_b, and the output projection with
  the residual add folded in. With attn_act=q8 the three dense products (q_a/kv_a, q_b, the output projection) read
  their input normalised and rounded as the native kernels stage it (q8_round)."""
  q8, eps = st.act == "q8", st.eps
  H, nope, rope, kvl, dim = st.n_heads, st.qk_nope, st.qk_rope, st.kv_lora, st.dim
  xf = x.reshape(dim).float()
  # a dense product's input: normalised inside the kernel, or with attn_act=q8 normalised and rounded to 8 bits first
  def inp(v: Tensor, gamma: Tensor | None) -> tuple[Tensor, Norm | None]:
    if not q8: return v, (gamma, eps) if gamma is not None else None
    return q8_round((rms_norm(v, gamma, eps) if gamma is not None else v).contiguous()).contiguous(), None
  first = st.q_a if st.q_a is not None else st.q_b
  # kv_a's output at offset `at` of kv: after q_a's (or q's) in one product where the two weights share a type
  one = first.ggml_type == st.kv_a.ggml_type
  xa, norm = inp(xf, st.attn_norm)
  qkv = _vec(xa, (first, st.kv_a) if one else (first,), norm, rows=st.qkv_a_rows)
  kv, at = (qkv, first.shape[0]) if one else (_vec(xa, (st.kv_a,), norm, rows=st.qkv_a_rows), 0)
  pos, bind = _position(start_pos)
  cache = st.cache.custom_kernel(kv, st.kv_a_norm, st.cos, st.sin, *bind, fxn=partial(
    kv_write_kernel, pos=pos, at=at, eps=eps, local=_local(kv.device)))[0]
  q = qkv[:first.shape[0]]
  if st.q_a is not None:  # q_b reads q_a's output in place (the first rows of qkv) where the norm is folded in
    qa, norm = inp(q if q8 else qkv, st.q_a_norm)
    q = _vec(qa, (st.q_b,), norm)
  q_abs = per_head(q.reshape(1, 1, H, nope + rope), st.k_b).reshape(H, kvl)  # k_b reads q's nope part in place
  o = _decode(q, q_abs, cache, (st.cos, st.sin), (pos, bind), st.kq_scale, nope, st.layout)
  out = per_head(o.reshape(1, H, kvl), st.v_b)
  return _vec(inp(out.reshape(-1), None)[0], (st.wo,), res=xf, rows=st.attn_out_rows).reshape(1, 1, dim)


def _gating(logits: UOp, gating: int, ids: Iterator[int]) -> Callable[[UOp], UOp]:
  """The gating function's value at expert i, with the per-op path's arithmetic; softmax's max and sum over the experts
  are reductions of the kernel (each thread computes them)."""
  n, logit = logits.shape[0], lambda i: _f(logits[i])
  if gating == SOFTMAX:
    r = UOp.range(n, next(ids), AxisType.REDUCE)
    m = logit(r).reduce(r, arg=Ops.MAX)
    r = UOp.range(n, next(ids), AxisType.REDUCE)
    z = (logit(r) - m).exp().reduce(r, arg=Ops.ADD)
    return lambda i: (logit(i) - m).exp() / z
  return {SIGMOID: lambda i: logit(i).sigmoid(), SOFTMAX_WEIGHT: logit,
          SQRT_SOFTPLUS: lambda i: logit(i).softplus().sqrt()}[gating]


def topk_kernel(own: UOp, logits: UOp, *bias: UOp, gating: int, local: bool) -> UOp:
  """own (K,): the K experts of highest score (the gating function of the logits plus the selection bias), in rank
  order. A thread per expert counts the experts that beat its score (higher, or equal at a lower index: the per-op
  pairwise rule) and writes its id at that rank when the rank is below K."""
  ids, n, k = count(), logits.shape[0], own.shape[0]
  e, *er = _axis(n, ids, AxisType.LOCAL if local else AxisType.WEAK)
  p = _gating(logits, gating, ids)
  score = (lambda i: p(i) + _f(bias[0][i])) if bias else p
  u = _pow2(n, 4)  # the other experts compared in unrolled steps, split over g threads of a workgroup
  j, red = _split(n, ids, (AxisType.REDUCE, AxisType.GROUP_REDUCE, AxisType.UNROLL),
                  (_pow2(n // u, 8) if local else 1, u))
  beats = (score(e) < score(j)) | (score(j).eq(score(e)) & (j < e))
  rank = beats.where(UOp.const(1, dtypes.int32), UOp.const(0, dtypes.int32)).reduce(*red, arg=Ops.ADD)
  store = own[rank.cast(dtypes.weakint).valid(rank < k)].store(_i(e))
  return store.end(*er).sink(arg=KernelInfo(name="dsl_topk", opts_to_apply=()))


def _routing_weight(logits: UOp, sel: UOp, s: UOp, route: Route, ids: Iterator[int]) -> UOp:
  """The routing weight of slot s of the selected experts sel (K,): the gating function's value (softmax over the K
  selected logits where gating says so), normalised to sum 1 over the K where the route says so, times its scale; as the
  per-op path computes it."""
  (gating, norm, scale), n, k = route, logits.shape[0], sel.shape[0]
  p = _gating(logits, gating, ids)
  val = lambda i: p(_expert_id(sel, n, i))
  if gating == SOFTMAX_WEIGHT:
    r = UOp.range(k, next(ids), AxisType.REDUCE)
    m = val(r).reduce(r, arg=Ops.MAX)
    r = UOp.range(k, next(ids), AxisType.REDUCE)
    z, plain = (val(r) - m).exp().reduce(r, arg=Ops.ADD), val
    val = lambda i: (plain(i) - m).exp() / z
  v = val(s)
  if norm:
    r = UOp.range(k, next(ids), AxisType.REDUCE)
    v = v / val(r).reduce(r, arg=Ops.ADD).maximum(6.103515625e-5)
  return v * scale if scale not in (0.0, 1.0) else v


def weights_kernel(w: UOp, logits: UOp, sel: UOp, *, route: Route, local: bool) -> UOp:
  """w (K,): the routing weights of the selected experts sel (K,), a thread each (`_routing_weight`)."""
  ids = count()
  s, *sr = _axis(w.shape[0], ids, AxisType.LOCAL if local else AxisType.WEAK)
  v = _routing_weight(logits, sel, s, route, ids)
  return w[s].store(v).end(*sr).sink(arg=KernelInfo(name="dsl_weights", opts_to_apply=()))


def _route(r: Routing) -> Route: return r.gating, r.norm_w, r.w_scale


def router(st: RouterStage, h: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """The router logits with the norm folded in, the top-k (its own ids) and the routing weights of the ids used (its
  own, or `forced`): three UOp kernels."""
  r = st.routing
  logits = _vec(h.reshape(st.dim).float(), (st.gate_inp,), (st.ffn_norm, st.eps))
  bias = [st.probs_b] if st.probs_b is not None else []
  own = _custom(topk_kernel, (r.n_used,), [logits, *bias], dtype=dtypes.int32, gating=r.gating)
  sel = own if forced is None else forced.reshape(-1).cast(dtypes.int32)
  w = _custom(weights_kernel, (r.n_used,), [logits, sel], route=_route(r))
  K = lambda t: t.reshape(1, 1, r.n_used)
  return K(sel), K(w), K(own), logits.reshape(1, 1, r.n_experts)


def q8_round(x: Tensor) -> Tensor:
  """x rounded to 8 bits per 32 consecutive values (scale max|x| / 127, to nearest even), back in float32: what the
  native kernels' integer dot products read with ffn_act=q8 (model/backends/cuda_src.py quantize_x), as tensor ops."""
  b = x.float().reshape(-1, 32)
  am = b.abs().max(-1, keepdim=True)
  return ((b * (am > 0).where(127 / am, 0)).round() * (am / 127)).reshape(x.shape)


def x16_round(x: Tensor) -> Tensor:
  """x held to 16 bits per 32 consecutive values as two 8-bit planes, back in float32: q8_round's codes plus the
  remainder rounded at 1/254 of their step, what the native kernels' integer dot products read with ffn_act=x16
  (model/backends/cuda_src.py quantize_x16), as tensor ops."""
  b = x.float().reshape(-1, 32)
  am = b.abs().max(-1, keepdim=True)
  step, hi = am / 127, (b * (am > 0).where(127 / am, 0)).round()
  lo = ((b - hi * step) * (am > 0).where(32258 / am, 0)).round().clip(-127, 127)
  return (hi * step + lo * (step / 254)).reshape(x.shape)


def act_round(act: str) -> Callable[[Tensor], Tensor]:
  """How the fused FFN stages round their activations for ffn_act=act (float32: as they are)."""
  return {"q8": q8_round, "x16": x16_round}.get(act, lambda a: a)


def _glu(x: Tensor, norm: Norm | None, w: Ffn, rows: int, sel: Tensor | None = None, shared: Ffn | None = None,
         pseudo: int = 0) -> Tensor:
  """SiLU(gate . xn) * (up . xn): (S, hidden) for the S selected experts (sel) followed by the shared expert's rows as
  `pseudo` experts, or (1, hidden) for one plain FFN. Merged gate+up is one kernel with SiLU(gate) * up inside;
  separate gate and up are a kernel each and an elementwise one."""
  slots = sel.numel() + pseudo if sel is not None else 1
  srcs = [x, *norm[:1]] if norm else [x]
  if sel is not None: srcs.append(sel.reshape(-1).cast(dtypes.int32))
  def prod_(w: QWeight, sh: QWeight | None, glu: bool) -> Tensor:
    planes = list(w.planes.values()) + (list(sh.planes.values()) if sh is not None else [])
    return _custom(gate_up_kernel, (slots, w.shape[-2] // (2 if glu else 1)), srcs + planes, w=w, shared=sh,
                   eps=norm[1] if norm else None, experts=w.shape[0] if sel is not None else 0, glu=glu, rows=rows)
  (gate, up, gate_up), (sg, su, sgu) = w, shared or (None, None, None)
  if gate_up is not None: return prod_(gate_up, sgu, True)
  return prod_(gate, sg, False).silu() * prod_(up, su, False)


def _gate_up(g: Glu) -> Ffn: return g.gate, g.up, g.gate_up


def _down(res: Tensor, act: Tensor, w: QWeight, rows: int, routed: tuple[Tensor, Tensor, Route] | None = None,
          shared: QWeight | None = None) -> Tensor:
  """res + down . act [over the selected experts of routed = (sel, router logits, route), weighted by their routing
  weights, then the shared expert's down over act's rows after theirs]."""
  srcs = [res.float(), act]
  if routed is not None: srcs += [routed[0].reshape(-1).cast(dtypes.int32), routed[1].reshape(-1).float()]
  srcs += list(w.planes.values()) + (list(shared.planes.values()) if shared is not None else [])
  return _custom(down_kernel, (res.shape[0],), srcs, w=w, shared=shared, route=routed[2] if routed else None,
                 rows=rows)


def _ffn_input(hf: Tensor, gamma: Tensor, eps: float, act: str) -> tuple[Tensor, Norm | None]:
  """What the gate and up products read: h with the norm folded in, or with ffn_act q8 (x16) the normalised h rounded to
  8 bits (16 bits) as the native kernels round it, which their output is rounded like before down reads it."""
  if act != "float32": return act_round(act)(rms_norm(hf, gamma, eps).contiguous()).contiguous(), None
  return hf, (gamma, eps)


def _pseudo_experts(st: MoeStage) -> int:
  """How many pseudo-experts of the routed experts' width the shared expert runs as, inside the routed experts' kernels:
  its hidden width over theirs, where its weights have their types and form (merged gate+up or not); 0 where they do
  not (it runs kernels of its own)."""
  if st.shared is None: return 0
  kinds = lambda g: [None if w is None else w.ggml_type for w in (g.gate, g.up, g.gate_up, g.down)]
  if kinds(st.experts) != kinds(st.shared): return 0
  hidden, width = st.shared.hidden, st.experts.hidden
  return hidden // width if hidden % width == 0 else 0


def moe(st: MoeStage, h: Tensor, sel: Tensor, wts: Tensor, logits: Tensor) -> Tensor:
  """h + MoE FFN(h) for one token: SiLU(gate) * up of the selected experts and the shared expert (one kernel), then
  down over both with the routing weights (computed there from the router logits; wts is not read) and the residual
  add (another). A shared expert that cannot run as the routed experts' pseudo-experts (_pseudo_experts) has a kernel
  pair of its own."""
  gu, dn = st.gate_up_rows, st.down_rows
  hf = h.reshape(st.dim).float()
  x, norm = _ffn_input(hf, st.ffn_norm, st.eps, st.act)
  rnd, shared, n, res = act_round(st.act), st.shared, _pseudo_experts(st), hf
  if shared is not None and not n:  # the shared expert's kernels of its own, before the routed experts'
    res, shared = _down(hf, rnd(_glu(x, norm, _gate_up(shared), gu)), shared.down, dn), None
  act = rnd(_glu(x, norm, _gate_up(st.experts), gu, sel, shared and _gate_up(shared), n))
  out = _down(res, act, st.experts.down, dn, (sel, logits, _route(st.routing)), shared.down if n else None)
  return out.reshape(1, 1, st.dim)


def ffn(st: FfnStage, h: Tensor) -> Tensor:
  """h + FFN(h) for one token of a dense block: SiLU(gate) * up with the norm folded in, down with the residual add."""
  hf = h.reshape(st.dim).float()
  x, norm = _ffn_input(hf, st.ffn_norm, st.eps, st.act)
  act = _glu(x, norm, _gate_up(st.ffn), st.gate_up_rows)
  return _down(hf, act_round(st.act)(act), st.ffn.down, st.down_rows).reshape(1, 1, st.dim)


def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  lead, (out, inp) = x.shape[:-1], w.shape
  return _run(dense_kernel, (prod(lead), out), x.reshape(-1, inp), (), w).reshape(*lead, out)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in or wider: its first `in` values per head are read) with w (H, out, in) -> (..., H, out)."""
  lead, (H, out, _) = x.shape[:-2], w.shape
  return _run(per_head_kernel, (prod(lead), H, out), x.reshape(-1, H, x.shape[-1]), (), w).reshape(*lead, H, out)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out)."""
  (B, T, K), (E, out, inp) = sel.shape, w.shape
  xs = x.reshape(B * T, x.shape[2], inp)
  return _run(expert_kernel, (B * T, K, out), xs, (sel.reshape(B * T, K).cast(dtypes.int32),), w,
              n_experts=E).reshape(B, T, K, out)


class DslBackend(Backend):
  name = "dsl"
  # its stages and products: this module's functions
  attention = staticmethod(attention)
  router = staticmethod(router)
  moe = staticmethod(moe)
  ffn = staticmethod(ffn)
  linear = staticmethod(linear)
  per_head = staticmethod(per_head)
  expert = staticmethod(expert)
  dequantised = staticmethod(dequantised)

  def attach(self, w: QWeight, device: str | None) -> QWeight: return to_words(super().attach(w, device))


BACKEND = register(DslBackend())
