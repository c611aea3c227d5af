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

from model.backends.registry import Backend, register
from model.quants import BF16, F16, F32, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, QUANT_TYPES

if TYPE_CHECKING:
  from model.deepseek2 import Block
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


def _term(xv: Callable[[UOp], UOp], p: Planes, ggml_type: int, r: UOp, axis: int) -> tuple[UOp, tuple[UOp, ...]]:
  """x[i] * w[r, i] for one input element i, float32, and the REDUCE ranges (axis ids from `axis`) over blocks and block
  elements that sum it into the dot product; xv(i): the x value at input index i."""
  dims, element = _ELEMENTS[ggml_type]
  nb = next(iter(p.values())).shape[1]
  b, *rngs = (UOp.range(n, axis + i, AxisType.REDUCE) for i, n in enumerate((nb, *dims)))
  off, w = element(p, r, b, *rngs)
  return _f(xv(b * QUANT_TYPES[ggml_type].block + off)) * w, (b, *rngs)


def _dot(xv: Callable[[UOp], UOp], p: Planes, ggml_type: int, r: UOp, axis: int) -> UOp:
  term, rngs = _term(xv, p, ggml_type, r, axis)
  return term.reduce(*rngs, arg=Ops.ADD)


def _sink(store: UOp, ranges: tuple[UOp, ...], role: str, ggml_type: int) -> UOp:
  return store.end(*ranges).sink(arg=KernelInfo(name=f"dsl_{role}_{QUANT_TYPES[ggml_type].name.lower()}"))


def dense_kernel(out: UOp, x: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int) -> UOp:
  """out (N, O) = x (N, I) @ w.T for planes of w (O, I)."""
  n, o = (UOp.range(s, i) for i, s in enumerate(out.shape))
  acc = _dot(lambda i: x[n, i], dict(zip(names, planes, strict=True)), ggml_type, o, 2)
  return _sink(out[n, o].store(acc), (n, o), "dense", ggml_type)


def per_head_kernel(out: UOp, x: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int) -> UOp:
  """out (N, H, O): per head h, x (N, H, I) @ w[h].T for planes of w (H*O, I)."""
  n, h, o = (UOp.range(s, i) for i, s in enumerate(out.shape))
  acc = _dot(lambda i: x[n, h, i], dict(zip(names, planes, strict=True)), ggml_type, h * out.shape[2] + o, 3)
  return _sink(out[n, h, o].store(acc), (n, h, o), "per_head", ggml_type)


def expert_kernel(out: UOp, x: UOp, sel: UOp, *planes: UOp, names: tuple[str, ...], ggml_type: int, n_experts: int) -> UOp:
  """out (M, K, O): for token m and slot k, x (M, K or 1, I) @ w[sel[m, k]].T for planes of w (E*O, I).

  The expert id is a load from `sel` inside the kernel (clamped to a valid expert, so no id can read outside the weight)."""
  m, k, o = (UOp.range(s, i) for i, s in enumerate(out.shape))
  e = _i(sel[m, k]).clip(0, n_experts - 1).cast(dtypes.weakint)
  xk = k if x.shape[1] > 1 else UOp.const(0, dtypes.weakint)  # gate and up share one input for all K slots
  acc = _dot(lambda i: x[m, xk, i], dict(zip(names, planes, strict=True)), ggml_type, e * out.shape[2] + o, 3)
  return _sink(out[m, k, o].store(acc), (m, k, o), "expert", ggml_type)


def _run(kernel: Callable[..., UOp], out_shape: tuple[int, ...], x: Tensor, srcs: tuple[Tensor, ...], w: QWeight, **kw) -> Tensor:
  names = tuple(w.planes)
  out = Tensor.empty(*out_shape, dtype=dtypes.float32, device=x.device)
  fxn = partial(kernel, names=names, ggml_type=w.ggml_type, **kw)
  return out.custom_kernel(x, *srcs, *(w.planes[k] for k in names), fxn=fxn)[0]


# ------------------------------------------------------------------ fused decode stages (one token) ----------------------
# The same stage boundaries as the native kernels where a product carries them (an RMSNorm folded into the products that
# read its output, SiLU(gate)*up, the experts' weighted combine with the shared expert and the residual add), each a UOp
# kernel; attention's softmax and the router's top-k stay tinygrad ops (a UOp kernel cannot rank the outputs of its own
# reduce), so this twin runs a few more kernels than native.

def _planes(ws: list[tuple[QWeight, str]], srcs: tuple[UOp, ...]) -> dict[str, Planes]:
  """The kernel's plane params, split per weight (in the order `_plane_srcs` passed them)."""
  out, i = {}, 0
  for w, tag in ws:
    out[tag] = dict(zip(tuple(w.planes), srcs[i:i + len(w.planes)], strict=True))
    i += len(w.planes)
  return out


def _plane_srcs(ws: list[QWeight]) -> list[Tensor]: return [v for w in ws for v in w.planes.values()]


def _rs(x: UOp, n: int, eps: float, axis: int) -> UOp:
  """1 / sqrt(mean(x^2) + eps) over x[0..n), as a reduce of its own inside the kernel."""
  j = UOp.range(n, axis, AxisType.REDUCE)
  ss = (_f(x[j]) * _f(x[j])).reduce(j, arg=Ops.ADD)
  return (ss / n + eps).sqrt().reciprocal()


def _silu(g: UOp) -> UOp: return g * (1 + (g * (-1 / 0.6931471805599453)).exp2()).reciprocal()


def dense_norm_kernel(out: UOp, x: UOp, *srcs: UOp, w: QWeight, eps: float | None, residual: bool) -> UOp:
  """out (O,) = [res +] w . [rmsnorm(x) * gamma]: srcs = [gamma], [res], planes."""
  o, i = UOp.range(out.shape[0], 0), 0
  gamma = srcs[i] if eps is not None else None
  i += eps is not None
  res = srcs[i] if residual else None
  p = _planes([(w, "w")], srcs[i + residual:])["w"]
  acc = _dot(lambda k: _f(x[k]) * _f(gamma[k]) if gamma is not None else x[k], p, w.ggml_type, o, 1)
  if gamma is not None: acc = acc * _rs(x, x.shape[0], eps, 9)
  if res is not None: acc = _f(res[o]) + acc
  return _sink(out[o].store(acc), (o,), "dense_norm" if eps is not None else "dense_res", w.ggml_type)


def glu_kernel(out: UOp, x: UOp, *srcs: UOp, gate: QWeight, up: QWeight | None, eps: float | None, rows: int, up_off: int,
               experts: int) -> UOp:
  """out (S, F) = SiLU(gate . xn) * (up . xn), xn = rmsnorm(x) * gamma (srcs = gamma, ...; eps None: x is xn already), for S
  selected experts (srcs = ..., sel, planes) or one plain FFN (S = 1); up None: gate and up are one merged weight (up's rows
  at up_off)."""
  y, o = UOp.range(out.shape[0], 0), UOp.range(out.shape[1], 1)
  gamma, srcs = (srcs[0], srcs[1:]) if eps is not None else (None, srcs)
  sel, srcs = (srcs[0], srcs[1:]) if experts else (None, srcs)
  ps = _planes([(gate, "g")] + ([(up, "u")] if up is not None else []), srcs)
  base = _i(sel[y]).clip(0, experts - 1).cast(dtypes.weakint) * rows if sel is not None else UOp.const(0, dtypes.weakint)
  xv = (lambda k: _f(x[k]) * _f(gamma[k])) if gamma is not None else (lambda k: _f(x[k]))
  g = _dot(xv, ps["g"], gate.ggml_type, base + o, 2)
  u = _dot(xv, ps["u" if up is not None else "g"], (up or gate).ggml_type, base + up_off + o, 10)
  if eps is not None:
    rs = _rs(x, x.shape[0], eps, 20)
    g, u = g * rs, u * rs
  return _sink(out[y, o].store(_silu(g) * u), (y, o), "glu", gate.ggml_type)


def down_kernel(out: UOp, res: UOp, *srcs: UOp, routed: QWeight | None, plain: QWeight | None, k: int) -> UOp:
  """out (D,) = res + sum_k wts[k] * (down[sel[k]] . act[k]) + down_plain . act_plain; srcs = [act, sel, wts, routed planes],
  [act_plain, plain planes]."""
  o, i, acc = UOp.range(out.shape[0], 0), 0, None
  if routed is not None:
    act, sel, wts = srcs[:3]
    p = _planes([(routed, "d")], srcs[3:3 + len(routed.planes)])["d"]
    i = 3 + len(routed.planes)
    kk = UOp.range(k, 1, AxisType.REDUCE)
    e = _i(sel[kk]).clip(0, routed.shape[0] - 1).cast(dtypes.weakint)
    term, rngs = _term(lambda j: act[kk, j], p, routed.ggml_type, e * out.shape[0] + o, 2)
    acc = (_f(wts[kk]) * term).reduce(kk, *rngs, arg=Ops.ADD)
  if plain is not None:
    act_p, p = srcs[i], _planes([(plain, "d")], srcs[i + 1:])["d"]
    d = _dot(lambda j: act_p[j], p, plain.ggml_type, o, 10)
    acc = d if acc is None else acc + d
  return _sink(out[o].store(_f(res[o]) + acc), (o,), "down", (routed or plain).ggml_type)


def _custom(kernel: Callable[..., UOp], shape: tuple[int, ...], srcs: list[Tensor], dtype=dtypes.float32, **kw) -> Tensor:
  out = Tensor.empty(*shape, dtype=dtype, device=srcs[0].device)
  return out.custom_kernel(*srcs, fxn=partial(kernel, **kw))[0]


def dense_norm(x: Tensor, w: QWeight, gamma: Tensor | None = None, eps: float | None = None, res: Tensor | None = None) -> Tensor:
  """[res +] w . [rmsnorm(x) * gamma] for one token: x (in,) -> (out,)."""
  srcs = [x.float().contiguous()] + ([gamma] if gamma is not None else []) + ([res.float().contiguous()] if res is not None else [])
  return _custom(dense_norm_kernel, (w.shape[0],), srcs + _plane_srcs([w]), w=w, eps=eps, residual=res is not None)


def attention(blk: Block, x: Tensor, start_pos, pos: Tensor | None) -> Tensor:
  """h = x + attention(x) for one token: the projections with the norm folded in, the per-op RoPE, cache write, attention
  and v_b (tinygrad ops and the weights' products), the output projection with the residual add folded in."""
  hp = blk.hp
  H, nope, rope, dim = hp.n_heads, hp.qk_nope, hp.qk_rope, hp.dim
  xf = x.reshape(dim)
  if hp.q_lora: q = dense_norm(dense_norm(xf, blk.q_a, blk.attn_norm, hp.eps), blk.q_b, blk.q_a_norm, hp.eps)
  else: q = dense_norm(xf, blk.q_b, blk.attn_norm, hp.eps)
  kv = dense_norm(xf, blk.kv_a, blk.attn_norm, hp.eps).reshape(1, 1, -1)
  q = q.reshape(1, 1, H, nope + rope)
  out = blk.attend(blk.absorb(q[..., :nope]), q[..., nope:], kv, start_pos)
  return dense_norm(out.reshape(-1), blk.wo, res=xf).reshape(1, 1, dim)


def router(blk: Block, h: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """The router logits with the norm folded in (a UOp kernel); gating, bias, top-k and weights as the per-op path."""
  hp = blk.hp
  logits = dense_norm(h.reshape(hp.dim), blk.gate_inp, blk.ffn_norm, hp.eps).reshape(1, 1, hp.n_experts)
  return *blk.route(logits, forced), logits


def q8_round(x: Tensor) -> Tensor:
  """x rounded to 8 bits per 32 consecutive values (scale max|x| / 127, to nearest even), back in float32: what the native
  kernels' integer dot products read with ffn_act=q8 (model/backends/cuda_src.py quantize_x), as tensor ops."""
  b = x.float().reshape(-1, 32)
  am = b.abs().max(-1, keepdim=True)
  return ((b * (am > 0).where(127 / am, 0)).round() * (am / 127)).reshape(x.shape)


def _glu(x: Tensor, gamma: Tensor, eps: float, gate: QWeight, up: QWeight | None, hidden: int, rows: int, up_off: int, q8: bool,
         sel: Tensor | None = None, experts: int = 0) -> Tensor:
  """With q8, the normalised input rounded to 8 bits goes in (the kernel's norm is left out)."""
  slots = sel.shape[-1] if sel is not None else 1
  xin = [q8_round((x * (x.square().mean() + eps).rsqrt()) * gamma).contiguous()] if q8 else [x, gamma]
  srcs = xin + ([sel.reshape(slots).cast(dtypes.int32).contiguous()] if sel is not None else []) + _plane_srcs([gate] + ([up] if up else []))
  return _custom(glu_kernel, (slots, hidden), srcs, gate=gate, up=up, eps=None if q8 else eps, rows=rows, up_off=up_off, experts=experts)


def _act(act: Tensor, q8: bool) -> Tensor: return q8_round(act).contiguous() if q8 else act


def _ffn_args(gate: QWeight | None, up: QWeight | None, gate_up: QWeight | None, hidden: int) -> dict:
  if gate_up is not None: return {"gate": gate_up, "up": None, "rows": 2 * hidden, "up_off": hidden}
  return {"gate": gate, "up": up, "rows": hidden, "up_off": 0}


def moe(blk: Block, h: Tensor, sel: Tensor, wts: Tensor) -> Tensor:
  """h + MoE FFN(h) for one token: the selected experts' gate+up+SiLU (one kernel), the shared expert's (one kernel), the
  down projections with the routing weights, the shared expert and the residual add (one kernel)."""
  hp, q8 = blk.hp, blk.cfg.ffn_act == "q8"
  hf, K, F = h.reshape(hp.dim).float().contiguous(), hp.n_used, blk.n_ff_exp
  act = _glu(hf, blk.ffn_norm, hp.eps, hidden=F, q8=q8, sel=sel, experts=hp.n_experts,
             **_ffn_args(blk.gate_exps, blk.up_exps, blk.gate_up_exps, F))
  srcs = [hf, _act(act, q8), sel.reshape(K).cast(dtypes.int32).contiguous(), wts.reshape(K).float().contiguous()] + _plane_srcs([blk.down_exps])
  plain = None
  if blk.shared:
    Fp = blk.down_sh.shape[-1]
    act_p = _glu(hf, blk.ffn_norm, hp.eps, hidden=Fp, q8=q8, **_ffn_args(blk.gate_sh, blk.up_sh, blk.gate_up_sh, Fp)).reshape(Fp)
    srcs += [_act(act_p, q8)] + _plane_srcs([blk.down_sh])
    plain = blk.down_sh
  return _custom(down_kernel, (hp.dim,), srcs, routed=blk.down_exps, plain=plain, k=K).reshape(1, 1, hp.dim)


def ffn(blk: Block, h: Tensor) -> Tensor:
  """h + FFN(h) for one token of a dense block: gate+up+SiLU with the norm folded in, down with the residual add."""
  hp, q8 = blk.hp, blk.cfg.ffn_act == "q8"
  hf, F = h.reshape(hp.dim).float().contiguous(), blk.down.shape[-1]
  act = _glu(hf, blk.ffn_norm, hp.eps, hidden=F, q8=q8, **_ffn_args(blk.gate, blk.up, blk.gate_up, F)).reshape(F)
  return _custom(down_kernel, (hp.dim,), [hf, _act(act, q8)] + _plane_srcs([blk.down]), routed=None, plain=blk.down, k=0).reshape(1, 1, hp.dim)


class DslBackend(Backend):
  name = "dsl"
  attention, router, moe, ffn = staticmethod(attention), staticmethod(router), staticmethod(moe), staticmethod(ffn)

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


BACKEND = register(DslBackend())
