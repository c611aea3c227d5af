"""The dsl backend's MLA decode attention over the compressed KV cache, as tinygrad UOp custom kernels: the cache write,
and softmax(q . c_kv) @ c_kv for every head, in one of two layouts (StructureConfig.attn_layout).

per_head: the scores of each head and position (a workgroup each, reading the position's row), then a thread per head
and value that walks every position: the cache is read once per head, and the walk is not split over the context.

all_heads: the scores of every head at once (`scores_all_kernel`: each row read once, the heads unrolled), then the
context split in chunks of `chunk` positions: per split and head its softmax (normalised within the split) and the
log of its sum (`split_softmax_kernel`), per split the weighted sum of its rows for every head (`pv_split_kernel`: the
cache's values read once for all heads), and the splits merged per head by their log-sums (`merge_kernel`), as
flash-decoding does. Splits past the decode position are not launched: their count is a function of the bound
position. Two kernels more than per_head, and the cache read twice instead of twice per head.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import count

from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from model.backends.dsl_uops import _axis, _f, _pow2, _split

POSITIONS = 4  # positions per thread of the all_heads scores
THREADS = 32  # threads per workgroup of the all_heads scores
COLUMNS = 4  # consecutive values of a row per thread of the all_heads weighted sum
SPLITS = 128  # at most this many splits of a full cache: times kv_lora's column chunks, a few hundred workgroups


def chunk(context: int) -> int:
  """Positions per split of a cache of `context` positions: the power of two (at least 16) that leaves at most SPLITS
  splits."""
  return max(16, 1 << ((context - 1) // SPLITS).bit_length())


def _position(start_pos: int | UOp) -> tuple[int | UOp, list[Tensor]]:
  """The decode position as a kernel reads it, and the sources that bind it: a JIT's position is a bound variable, which
  a kernel reads as a parameter and its call takes as a source (after the buffers: the kernels take it as `*_var`)."""
  if isinstance(start_pos, int): return start_pos, []
  return start_pos.src[0].replace(op=Ops.PARAM), [Tensor(start_pos)]


def _roped(x: Callable[[UOp], UOp], cos: UOp, sin: UOp, pos: UOp | int, i: UOp, j: UOp) -> UOp:
  """Element 2i + j of x (its values x(0..)) rotated by RoPE at position pos (adjacent pairs, as apply_rope)."""
  x0, x1, c, s = x(i * 2), x(i * 2 + 1), _f(cos[pos, i]), _f(sin[pos, i])
  return (j.eq(0).where(x0 * c - x1 * s, x0 * s + x1 * c) if isinstance(j, UOp)
          else (x0 * c - x1 * s if j == 0 else x0 * s + x1 * c))


def _sink(store: UOp, ranges: tuple[UOp, ...], name: str) -> UOp:
  """The kernel's schedule is in its ranges' types: no heuristic or BEAM search changes it."""
  return store.end(*ranges).sink(arg=KernelInfo(name=name, opts_to_apply=()))


def kv_write_kernel(cache: UOp, kv: UOp, gamma: UOp, cos: UOp, sin: UOp, *_var: UOp, pos: UOp | int, at: int,
                    eps: float, local: bool) -> UOp:
  """The KV cache's row at `pos` from kv_a's output, at offset `at` of kv (kv_lora + rope values): the first kv_lora
  values normalised (times their 1/rms and gamma), the last rope values rotated, stored in the cache's dtype. A thread
  computes UPCAST consecutive values; each workgroup reduces the 1/rms, its threads splitting the sum of squares."""
  ids, kvl, width = count(), gamma.shape[0], cache.shape[-1]
  u = _pow2(width, 8)
  c, cr = _split(width, ids, (AxisType.GLOBAL if local else AxisType.WEAK, AxisType.UPCAST), (u,))
  j, red = _split(kvl, ids, (AxisType.REDUCE, AxisType.GROUP_REDUCE), (_pow2(kvl, 64) if local else 1,))
  rs = ((_f(kv[at + j]) * _f(kv[at + j])).reduce(*red, arg=Ops.ADD) * (1 / kvl) + eps).rsqrt()
  rope = width - kvl
  i = ((c - kvl) // 2).maximum(0).minimum(rope // 2 - 1)
  rot = _roped(lambda k: _f(kv[at + kvl + k]), cos, sin, pos, i, (c - kvl) % 2)
  normed = _f(kv[at + c.minimum(kvl - 1)]) * rs * _f(gamma[c.minimum(kvl - 1)])
  return _sink(cache[0, pos, c].store((c < kvl).where(normed, rot).cast(cache.dtype)), cr, "dsl_kv_write")


def _pair_step(width: int) -> int: return 2 if width % 4 else 4  # values of a row a thread reads per step
def _row_threads(width: int, local: bool) -> int: return _pow2(width // _pair_step(width), 16) if local else 1


def _score(q: UOp, q_abs: UOp, cache: UOp, cos: UOp, sin: UOp, pos: UOp | int, t: UOp, h: UOp, scale: float, nope: int,
           ids: Iterator[int], local: bool) -> UOp:
  """scale * (q_abs[h] . c_kv[t] + rope(q_pe[h]) . k_pe[t]): q (H * (nope + rope),) is q_b's output, whose rope part is
  rotated as it is read. The threads of a workgroup split the row of the cache (GROUP_REDUCE), each reading pairs of
  values in unrolled steps."""
  (_, kvl), width = q_abs.shape, cache.shape[-1]
  rope, u, g = width - kvl, _pair_step(width), _row_threads(width, local)
  base, red = _split(width // 2, ids, (AxisType.REDUCE, AxisType.GROUP_REDUCE, AxisType.UNROLL), (g, u // 2))
  j = UOp.range(2, next(ids), AxisType.UNROLL)
  r = base * 2 + j  # the value of the row: pair base, element j of it
  i = (base - kvl // 2).maximum(0).minimum(rope // 2 - 1)  # the pair of the rope part
  qpe = _roped(lambda k: _f(q[h * (nope + rope) + nope + k]), cos, sin, pos, i, j)
  qv = (r < kvl).where(_f(q_abs[h, r.minimum(kvl - 1)]), qpe)
  return (qv * _f(cache[0, t, r])).reduce(*red, j, arg=Ops.ADD) * scale


def scores_kernel(out: UOp, q: UOp, q_abs: UOp, cache: UOp, cos: UOp, sin: UOp, *_var: UOp, pos: UOp | int,
                  scale: float, nope: int, local: bool) -> UOp:
  """out (H, context): the attention scores (`_score`) of the positions 0..pos, a workgroup per head and position."""
  ids, H = count(), q_abs.shape[0]
  h, *hr = _axis(H, ids, AxisType.GLOBAL if local else AxisType.WEAK)
  t = UOp.range(pos + 1, next(ids), AxisType.GLOBAL if local else AxisType.WEAK)
  return _sink(out[h, t].store(_score(q, q_abs, cache, cos, sin, pos, t, h, scale, nope, ids, local)), (*hr, t),
               "dsl_scores")


def scores_all_kernel(out: UOp, q: UOp, q_abs: UOp, cache: UOp, cos: UOp, sin: UOp, *_var: UOp, pos: UOp | int,
                      scale: float, nope: int, local: bool) -> UOp:
  """out (H, context): the attention scores (`_score`) of the positions 0..pos for every head, POSITIONS of them per
  thread group that splits a row: each value of a row read once serves every head, and each value of the query every
  position (heads and positions unrolled). A workgroup holds groups of consecutive positions up to THREADS threads."""
  ids, H, (_, ctx, width) = count(), q_abs.shape[0], cache.shape
  spread = max(1, THREADS // _row_threads(width, local)) if local else 1
  h, *hr = _axis(H, ids, AxisType.UPCAST)
  tg, *tr = _upto(pos // (POSITIONS * spread) + 1, ids, AxisType.GLOBAL if local else AxisType.WEAK)
  tl, *lr = _axis(spread, ids, AxisType.LOCAL)
  t = (tg * spread + tl) * POSITIONS + (tu := UOp.range(POSITIONS, next(ids), AxisType.UPCAST))
  dot = _score(q, q_abs, cache, cos, sin, pos, t.minimum(ctx - 1), h, scale, nope, ids, local)
  return _sink(out[h, t.valid(t <= pos)].store(dot), (*hr, *tr, *lr, tu), "dsl_scores_all")


def _threads(n: int, ids: Iterator[int], local: bool) -> tuple[UOp, tuple[UOp, ...]]:
  """An index over n values, a thread each: consecutive threads of a workgroup read consecutive values."""
  return _split(n, ids, (AxisType.GLOBAL if local else AxisType.WEAK, AxisType.LOCAL), (_pow2(n, 32) if local else 1,))


def pv_kernel(out: UOp, s: UOp, cache: UOp, *_var: UOp, pos: UOp | int, local: bool) -> UOp:
  """out (H, kv_lora) = softmax(s[h, 0..pos]) @ c_kv[0..pos]: a thread per head and value; each thread reduces the
  scores' max and sum of exponentials itself, then the weighted sum of the cache's column (consecutive threads read
  consecutive values of a row)."""
  ids, (H, kvl) = count(), out.shape
  h, *hr = _axis(H, ids, AxisType.GLOBAL if local else AxisType.WEAK)
  c, rows = _threads(kvl, ids, local)
  def positions() -> UOp: return UOp.range(pos + 1, next(ids), AxisType.REDUCE)
  m = _f(s[h, t := positions()]).reduce(t, arg=Ops.MAX)
  z = (_f(s[h, t := positions()]) - m).exp().reduce(t, arg=Ops.ADD)
  o = ((_f(s[h, t := positions()]) - m).exp() * _f(cache[0, t, c])).reduce(t, arg=Ops.ADD) / z
  return _sink(out[h, c].store(o), (*hr, *rows), "dsl_pv")


def _upto(n: UOp | int, ids: Iterator[int], kind: AxisType) -> tuple[UOp, ...]:
  """`_axis` over n, an int or an expression of the bound decode position (one whose bounds leave a single value is
  folded as a range of one)."""
  return _axis(1 if isinstance(n, UOp) and n.vmax <= 1 else n, ids, kind)


def _live(pos: UOp | int, ch: int, ids: Iterator[int], kind: AxisType) -> tuple[UOp, ...]:
  """`_axis` over the splits that hold positions 0..pos (ch each)."""
  return _upto(pos // ch + 1, ids, kind)


def split_softmax_kernel(w: UOp, s: UOp, *_var: UOp, pos: UOp | int, local: bool) -> UOp:
  """w (splits, H, ch + 1): per split of ch positions and head, the softmax of its scores s (H, context) within the
  split (0 past pos), then the log of its sum of exponentials (its max added back). A thread per split and head."""
  ids, (_, H, n), ctx = count(), w.shape, s.shape[1]
  ch = n - 1
  sp, *sr = _live(pos, ch, ids, AxisType.GLOBAL if local else AxisType.WEAK)
  h, *hr = _axis(H, ids, AxisType.LOCAL if local else AxisType.WEAK)
  def score(i: UOp) -> UOp:
    t = sp * ch + i
    return (t <= pos).where(_f(s[h, t.minimum(ctx - 1)]), UOp.const(-float("inf"), dtypes.float32))
  m = score(r := UOp.range(ch, next(ids), AxisType.REDUCE)).reduce(r, arg=Ops.MAX)
  z = (score(r := UOp.range(ch, next(ids), AxisType.REDUCE)) - m).exp().reduce(r, arg=Ops.ADD)
  i = UOp.range(n, next(ids), AxisType.LOOP)
  v = (i < ch).where((score(i.minimum(ch - 1)) - m).exp() / z, m + z.log())
  return _sink(w[sp, h, i].store(v), (*sr, *hr, i), "dsl_split_softmax")


def pv_split_kernel(o: UOp, w: UOp, cache: UOp, *_var: UOp, pos: UOp | int, local: bool) -> UOp:
  """o (splits, H, kv_lora): per split, sum over its positions of softmax weight w[split, h] times the cache's row, for
  every head h (unrolled: each value of a row read once serves them all). A thread per split and COLUMNS values (each
  weight read once serves them all)."""
  ids, (_, H, kvl), ch, ctx = count(), o.shape, w.shape[2] - 1, cache.shape[1]
  sp, *sr = _live(pos, ch, ids, AxisType.GLOBAL if local else AxisType.WEAK)
  u = _pow2(kvl, COLUMNS)
  c, cr = _split(kvl, ids, (AxisType.GLOBAL if local else AxisType.WEAK, AxisType.LOCAL, AxisType.UPCAST),
                 (_pow2(kvl // u, 32) if local else 1, u))
  h, *hr = _axis(H, ids, AxisType.UPCAST)
  t = sp * ch + (i := UOp.range(ch, next(ids), AxisType.REDUCE))
  v = (t <= pos).where(_f(w[sp, h, i]) * _f(cache[0, t.minimum(ctx - 1), c]), UOp.const(0.0, dtypes.float32))
  return _sink(o[sp, h, c].store(v.reduce(i, arg=Ops.ADD)), (*sr, *cr, *hr), "dsl_pv_split")


def merge_kernel(out: UOp, w: UOp, o: UOp, *_var: UOp, pos: UOp | int, local: bool) -> UOp:
  """out (H, kv_lora): the splits' outputs o merged per head, each weighted by its share of the softmax's sum (from
  the log-sums in w's last column). A thread per head and value."""
  ids, (H, kvl), ch = count(), out.shape, w.shape[2] - 1
  h, *hr = _axis(H, ids, AxisType.GLOBAL if local else AxisType.WEAK)
  c, cr = _threads(kvl, ids, local)
  lse = lambda sp: _f(w[sp, h, ch])
  def over(v: Callable[[UOp], UOp], op: Ops) -> UOp:  # reduced over the live splits
    sp, *sr = _live(pos, ch, ids, AxisType.REDUCE)
    return v(sp).reduce(*sr, arg=op) if sr else v(sp)
  m = over(lse, Ops.MAX)
  z = over(lambda sp: (lse(sp) - m).exp(), Ops.ADD)
  v = over(lambda sp: (lse(sp) - m).exp() * _f(o[sp, h, c]), Ops.ADD) / z
  return _sink(out[h, c].store(v), (*hr, *cr), "dsl_merge")
