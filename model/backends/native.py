"""The `native` backend: hand-written CUDA C (model/backends/cuda_src.py) for the quantized products and the fused
decode stages, run by tinygrad as compiled programs.

Each kernel's source is returned from `Tensor.custom_kernel` as a PROGRAM: tinygrad compiles it with its own NVRTC
pipeline and the JIT batches it into its CUDA graph like any other kernel (BEAM leaves it alone: its schedule is its
source). Only tinygrad's CUDA C renderer compiles this source, so the backend runs on the `CUDA` device alone; the space
never proposes it elsewhere. The tests run every kernel on the CPU through an emulator (tests/cuda_cpu.py) and on the
GPU through tinygrad.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING

from tinygrad import Device, Tensor, dtypes
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp, sint

from model.backends import cuda_graph
from model.backends import cuda_prefill as G
from model.backends import cuda_src as C
from model.backends.registry import Backend, register
from model.errors import ConfigError
from model.quants import QUANT_TYPES
from model.stages import rms_norm

if TYPE_CHECKING:
  from model.stages import AttentionStage, FfnStage, Glu, MoeStage, RouterStage
  from model.weights import QWeight


def launch(k: C.Kernel, params: list[Tensor], mem: sint, ops: sint = 0) -> list[Tensor]:
  """Run kernel k over params (its C parameters in order: outputs first); returns every param after the kernel."""
  target = Device[params[0].device].renderer.target
  def fxn(*ps: UOp) -> UOp:
    info = ProgramInfo(name=k.name, global_size=k.grid, local_size=(k.threads, 1, 1), globals=tuple(range(len(ps))),
                       outs=k.outs, ins=tuple(i for i in range(len(ps)) if i not in k.outs), target=target)
    sink = UOp.sink(arg=KernelInfo(name=k.name, estimates=Estimates(ops=ops, lds=mem, mem=mem)))
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=ps), UOp(Ops.SOURCE, arg=k.src)), arg=info)
  return params[0].custom_kernel(*params[1:], fxn=fxn)


def planes(w: QWeight) -> list[Tensor]: return [w.planes[n] for n, _ in C.plane_types(w.ggml_type)]
def row_bytes(w: QWeight) -> int: return w.shape[-1] // QUANT_TYPES[w.ggml_type].block * QUANT_TYPES[w.ggml_type].nbytes
def cw(prefix: str, w: QWeight) -> C.W: return C.W(prefix, w.ggml_type, w.shape[-1])
def f32(x: Tensor) -> Tensor:
  """x as float32 for a kernel input; a float32 tensor is passed as it is (a copy would cost a kernel per call)."""
  return x if x.dtype == dtypes.float32 else x.float()


def i32(x: Tensor) -> Tensor: return x if x.dtype == dtypes.int32 else x.cast(dtypes.int32)
def empty(*shape: int, dtype=dtypes.float32, device: str | None = None) -> Tensor:
  return Tensor.empty(*shape, dtype=dtype, device=device)


def _product(role: str, out_shape: tuple[int, ...], x: Tensor, extra: list[Tensor], w: QWeight, rows_read: int,
             **dims: int) -> Tensor:
  k = C.product(role, w.ggml_type, w.shape, **dims)
  x = f32(x)
  mem = rows_read * row_bytes(w) + x.nbytes() + prod(out_shape) * 4
  out = empty(*out_shape, device=x.device)
  return launch(k, [out, x, *extra, *planes(w)], mem, 2 * prod(out_shape) * w.shape[-1])[0]


def rows(w: QWeight, idx: Tensor) -> Tensor:
  """Float rows selected by an integer tensor (the embedding lookup): (*idx.shape, in), in one kernel."""
  n, inp = prod(idx.shape), w.shape[-1]
  out = launch(C.rows(w.ggml_type, w.shape, n), [empty(n, inp, device=idx.device), i32(idx).reshape(n), *planes(w)],
               n * (row_bytes(w) + inp * 4))[0]
  return out.reshape(*idx.shape, inp)


def norm_linear(x: Tensor, gamma: Tensor, eps: float, w: QWeight) -> Tensor:
  """linear(rmsnorm(x) * gamma, w): for one token in one kernel (C.head, the norm folded into the product), else the
  norm's tensor ops and linear."""
  lead, (out, inp) = x.shape[:-1], w.shape
  if prod(lead) != 1: return linear(rms_norm(x, gamma, eps), w)
  k = C.head(w.ggml_type, w.shape, eps)
  return launch(k, [empty(out, device=x.device), f32(x).reshape(inp), gamma, *planes(w)],
                out * row_bytes(w) + 2 * inp * 4 + out * 4)[0].reshape(*lead, out)


def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  lead, (out, inp) = x.shape[:-1], w.shape
  n = prod(lead)
  tn = min(n, C.TOKENS)
  return _product("dense", (n, out), x.reshape(n, inp), [], w, out * -(-n // tn), tn=tn, n=n).reshape(*lead, out)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out)."""
  lead, (H, out, inp) = x.shape[:-2], w.shape
  n = prod(lead)
  tn = min(n, C.TOKENS)
  return _product("per_head", (n, H, out), x.reshape(n, H, inp), [], w, H * out * -(-n // tn), tn=tn, n=n,
                  heads=H).reshape(*lead, H, out)


@functools.cache
def _int32s(values: tuple[int, ...], device: str) -> Tensor:
  """A constant int32 vector on the device, copied there once: the grouped product's default inputs, which as fresh
  tensors would be two kernels in every product of every layer of a chunk."""
  return Tensor(list(values), dtype=dtypes.int32, device=device).realize()


def grouped(x: Tensor, w: QWeight, tile_expert: Tensor | None, used: Tensor | None) -> Tensor:
  """The prompt's product in tiles (Backend.grouped): cuda/grouped_mma.cu."""
  (N, tile, inp), out, E = x.shape, w.shape[-2], w.shape[0] if len(w.shape) == 3 else 1
  if G.stage_k(w.ggml_type, inp) is None or tile not in G.TILES:
    raise ConfigError(f"prefill_weights=quantised has no product for {w.quant} rows of {inp} in tiles of {tile}")
  if tile_expert is None and N % E: raise ConfigError(f"{N} tiles do not split evenly over {E} matrices")
  te = _int32s(tuple(i // (N // E) for i in range(N)), x.device) if tile_expert is None else i32(tile_expert)
  used = _int32s((N,), x.device) if used is None else i32(used)
  # the matrices of at most min(N, E) experts, each tile's rows and outputs
  mem = min(N, E) * out * row_bytes(w) + x.nbytes() + N * tile * out * 4
  y = launch(G.grouped(w.ggml_type, E, out, inp, tile, N),
             [empty(N * tile, out, device=x.device), x, te, used, *planes(w)], mem, 2 * N * tile * out * inp)[0]
  return y.reshape(N, tile, out)


def prefill_work(T: int, H: int, D: int, kvl: int, tt: int, at: int | UOp, itemsize: int) -> tuple[sint, sint]:
  """(2 x multiply-adds, cache bytes read) of the prompt attention of T tokens at positions at..: each token's heads
  over its at + t + 1 positions, (D + kvl) each; each block of tt tokens reads the rows up to its last token's once. A
  symbolic `at` (the graph's position variable, its binding removed) keeps both symbolic, one kernel for every chunk:
  tinygrad and the profile infer them per launch."""
  at = at.unbind_all()[0] if isinstance(at, UOp) else at
  blocks = -(-T // tt)
  return (2 * H * (D + kvl) * (T * at + T * (T + 1) // 2),
          (blocks * at + sum(min((b + 1) * tt, T) for b in range(blocks))) * D * itemsize)


def prefill_attention(qc: Tensor, cache: Tensor, start: Tensor, kvl: int, scale: float, tokens: int = 1,
                      at: int | UOp = 0) -> Tensor:
  """The prompt's absorbed attention (Backend.prefill_attention): cuda_prefill.mla_prefill."""
  (T, H, D), ctx = qc.shape, cache.shape[-2]
  if cache.dtype not in (dtypes.float16, dtypes.float32):
    raise ConfigError(f"prefill_attention=all_heads reads a float16 or float32 cache, not {cache.dtype.name}")
  tt = min(tokens, T)
  ka, km = G.mla_prefill(H, kvl, D - kvl, ctx, scale, cache.dtype == dtypes.float16, T, tt)
  S, (ops, reads) = G.prefill_splits(ctx), prefill_work(T, H, D, kvl, tt, at, cache.dtype.itemsize)
  part = launch(ka, [empty(T * H * S * (kvl + 2), device=qc.device), f32(qc).contiguous(), cache, i32(start)],
                reads + T * H * D * 4 + T * H * S * (kvl + 2) * 4, ops)[0]
  o = launch(km, [empty(T * H * kvl, device=qc.device), part, i32(start)], T * H * S * (kvl + 2) * 4)[0]
  return o.reshape(T, H, kvl)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out)."""
  (B, T, K), (E, out, inp) = sel.shape, w.shape
  xk, slots = x.shape[2], B * T * K
  return _product("expert", (slots, out), x.reshape(B * T * xk, inp),
                  [sel.reshape(slots).cast(dtypes.int32).contiguous()], w, slots * out, experts=E, xk=xk, k=K,
                  slots=slots).reshape(B, T, K, out)


# ---- fused decode stages (one token): the inputs each reads are model/stages.py's

# rows per row group: 2 where a matrix has few rows (more blocks in flight); 4 otherwise, and wherever a kernel
# normalises its input (more rows share the block's staged input), but in the first attention kernel (C.QKV_ROWS)
R_SMALL, R_LARGE = 2, 4


def _rows_r(rows: int) -> int: return R_LARGE if rows >= 4096 else R_SMALL


# warps a block of the attention's dense products with 8-bit input (attn_act=q8): the staged input takes a quarter of
# float32's shared memory, and a block of 8 warps shares it over twice the rows (benchmarks/kernel_sweep.py)
Q8_WARPS = 8


def attention(st: AttentionStage, x: Tensor, start_pos: int | UOp, pos: Tensor) -> Tensor:
  """h = x + attention(x) for one token: norm + q_a/kv_a (or q/kv_a), q_a norm + q_b, absorption + RoPE + cache write,
  MLA attention split over the context, the splits' merge with v_b, output projection + residual: 6 kernels; with
  attn_layout=all_heads the attention reads each position once for all heads on the tensor cores and its splits are
  merged by a kernel of their own before v_b (7). With attn_act=q8 the three dense products stage their input in 8 bits
  (cuda_src.stage_x) and dot it in integers."""
  dev = x.device
  H, nope, rope, kvl, dim = st.n_heads, st.qk_nope, st.qk_rope, st.kv_lora, st.dim
  xf = f32(x)
  first = st.q_a if st.q_a is not None else st.q_b
  rows = (first.shape[0], st.kv_a.shape[0])
  sms = sm_count(dev)
  # the dense products' input: float32, or 8 bits (attn_act=q8) in blocks of Q8_WARPS warps
  act, warps = ("q8", Q8_WARPS) if st.act == "q8" else ("f32", C.WARPS)
  k1 = C.dense(((cw("a_", first), rows[0]), (cw("b_", st.kv_a), rows[1])), C.QKV_ROWS, st.eps,
               warps=C.QKV_WARPS, act=act, sms=sms)
  qa, kv = launch(k1, [empty(rows[0], device=dev), empty(rows[1], device=dev), xf, st.attn_norm, *planes(first),
                       *planes(st.kv_a)], row_bytes(first) * rows[0] + row_bytes(st.kv_a) * rows[1])[:2]
  if st.q_a is not None:
    nq = st.q_b.shape[0]
    k2 = C.dense(((cw("a_", st.q_b), nq),), R_LARGE, st.eps, warps=warps, act=act, sms=sms)
    q = launch(k2, [empty(nq, device=dev), qa, st.q_a_norm, *planes(st.q_b)], row_bytes(st.q_b) * nq)[0]
  else: q = qa
  D, ctx, cache_half = kvl + rope, st.cache.shape[1], st.cache.dtype == dtypes.float16
  k3 = C.absorb_rope_kv(cw("k_", st.k_b), H, nope, rope, kvl, ctx, st.eps, cache_half)
  qc, cache = launch(k3, [empty(H * D, device=dev), st.cache, q, kv, st.kv_a_norm, st.cos, st.sin, pos,
                          *planes(st.k_b)], row_bytes(st.k_b) * H * kvl + D * 2)[:2]
  vb_bytes = row_bytes(st.v_b) * H * st.v_head
  if st.layout == "all_heads":  # every position read once for all heads; the splits merged once, then v_b
    k4 = C.mla_attention_heads(H, kvl, rope, ctx, st.kq_scale, cache_half, sms)
    part = launch(k4, [st.scratch["part"], qc, cache, pos], cache.nbytes() // 4)[0]
    o = launch(C.mla_combine(H, kvl, ctx, sms), [empty(H * kvl, device=dev), part, pos],
               H * C.heads_splits(ctx, sms) * (kvl + 2) * 4)[0]
    k5 = C.mla_vb(cw("w_", st.v_b), H, kvl, st.v_head, ctx, merged=True)
    a = launch(k5, [empty(H * st.v_head, device=dev), o, *planes(st.v_b)], vb_bytes)[0]
  else:
    part = launch(C.mla_attention(H, kvl, rope, ctx, st.kq_scale, cache_half), [st.scratch["part"], qc, cache, pos],
                  cache.nbytes() // 4)[0]
    k5 = C.mla_vb(cw("w_", st.v_b), H, kvl, st.v_head, ctx)
    a = launch(k5, [empty(H * st.v_head, device=dev), part, pos, *planes(st.v_b)], vb_bytes)[0]
  k6 = C.dense(((cw("a_", st.wo), dim),), _rows_r(dim), None, residual=True, warps=warps, act=act, sms=sms)
  return launch(k6, [empty(1, 1, dim, device=dev), a, xf, *planes(st.wo)], row_bytes(st.wo) * dim)[0]


def _route(st: RouterStage, forced: Tensor | None) -> tuple[C.Route, list[Tensor]]:
  """The routing as the kernels compute it, and the inputs it reads besides the logits (C.Route.params)."""
  r = st.routing
  route = C.Route(r.n_experts, r.n_used, r.gating, st.probs_b is not None, r.norm_w, r.w_scale, forced is not None)
  return route, ([st.probs_b] if st.probs_b is not None else []) + ([i32(forced)] if forced is not None else [])


def router(st: RouterStage, h: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """(the ids used (1, 1, K), their weights, the router's own top-k ids, its logits (1, 1, E)) for one token; forced:
  ids to use instead of its own (the correctness check)."""
  dev, w, E, K = h.device, st.gate_inp, st.routing.n_experts, st.routing.n_used
  route, ins = _route(st, forced)
  outs = [empty(1, 1, K, dtype=dtypes.int32, device=dev), empty(1, 1, K, device=dev), empty(1, 1, E, device=dev),
          st.scratch["router_cnt"]] + ([empty(1, 1, K, dtype=dtypes.int32, device=dev)] if forced is not None else [])
  res = launch(C.router(cw("g_", w), st.eps, route), [*outs, f32(h), st.ffn_norm, *ins, *planes(w)], row_bytes(w) * E)
  return res[0], res[1], res[4] if forced is not None else res[0], res[2]


def _ffn(g: Glu, experts: int = 0) -> tuple[C.FFN, list[Tensor]]:
  """An FFN (or a stack of `experts`) as the kernels take it, and its gate and up planes."""
  first = g.gate_up if g.gate_up is not None else g.gate
  ffn = C.FFN(cw("", first), cw("", first if g.gate_up is not None else g.up), cw("", g.down), g.hidden, experts,
              first.shape[-2], g.hidden if g.gate_up is not None else 0)
  return ffn, planes(g.gate_up) if g.gate_up is not None else planes(g.gate) + planes(g.up)


def moe(st: MoeStage, h: Tensor, sel: Tensor, wts: Tensor, logits: Tensor) -> Tensor:
  """h + MoE FFN(h) for one token, routed by sel/wts (the router logits they come from are not read): the selected
  experts' and the shared expert's gate+up+SiLU in one kernel, their down projections with the routing weights, the
  shared expert and the residual add in another."""
  sel = i32(sel)
  return _moe(st, h, None, [sel], [sel, f32(wts)])[0]


def routed_moe(router: RouterStage, moe: MoeStage, h: Tensor,
               forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
  """The router and the MoE in one (both stages native): (h + MoE FFN(h), the own top-k ids (1, 1, K), the router
  logits (1, 1, E)) for one token. The router kernel computes the logits alone; gate+up's and down's blocks each rank
  them themselves (C.Route), so no kernel waits on a ranking: the router's last-block count and ranking leave the
  step. forced: ids to use instead of its own (the correctness check)."""
  w, E = router.gate_inp, router.routing.n_experts
  route, ins = _route(router, forced)
  logits = launch(C.router(cw("g_", w), router.eps, route, logits_only=True),
                  [empty(1, 1, E, device=h.device), f32(h), router.ffn_norm, *planes(w)], row_bytes(w) * E)[0]
  out, own = _moe(moe, h, route, [logits, *ins], [logits, *ins])
  return out, own, logits


def _moe(st: MoeStage, h: Tensor, route: C.Route | None, glu_in: Sequence[Tensor],
         down_in: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
  K, routed_down = st.routing.n_used, st.experts.down
  routed, rp = _ffn(st.experts, st.routing.n_experts)
  plain, pp, plain_down = None, [], []
  down_bytes = row_bytes(routed_down) * st.dim * K
  if st.shared is not None:
    (plain, pp), plain_down = _ffn(st.shared), planes(st.shared.down)
    down_bytes += row_bytes(st.shared.down) * st.dim
  n_act = K * st.experts.hidden + (st.shared.hidden if st.shared is not None else 0)
  return _glu_down(st, h, routed, plain, rp, pp, n_act, down_bytes, route, glu_in,
                   [*down_in, *planes(routed_down)], plain_down)


def ffn(st: FfnStage, h: Tensor) -> Tensor:
  """h + FFN(h) for one token of a dense block: gate+up+SiLU in one kernel, down + residual in another."""
  plain, pp = _ffn(st.ffn)
  return _glu_down(st, h, None, plain, [], pp, st.ffn.hidden, row_bytes(st.ffn.down) * st.dim,
                   plain_down=planes(st.ffn.down))[0]


@functools.cache
def sm_count(device: str) -> int:
  """The CUDA device's streaming multiprocessors."""
  import tinygrad.runtime.autogen.cuda as cuda
  from tinygrad.runtime.ops_cuda import check
  v = ctypes.c_int()
  check(cuda.cuDeviceGetAttribute(ctypes.byref(v), cuda.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                  Device[device].cu_device))
  return v.value


def handoff_rows(routed: C.FFN | None, plain: C.FFN | None, k: int, sms: int, form: str) -> int:
  """glu's rows per row group where it writes its output in the form down's products read (C.HANDOFF), else 0: where
  down reads it (C.down_reads_handoff), with R_LARGE where its blocks of 32 outputs fit one wave on a device of `sms`
  multiprocessors (C.handoff_fits); else, 8-bit, with R_SMALL, blocks of twice the warps at half the registers a
  thread; 16-bit, none: its blocks of 16 warps would take a multiprocessor each (benchmarks/kernel_sweep.py)."""
  if not C.down_reads_handoff(routed, plain): return 0
  if C.handoff_fits(routed, plain, k, sms, R_LARGE): return R_LARGE
  return R_SMALL if form == "q8" else 0


def _glu_down(st: MoeStage | FfnStage, h: Tensor, routed: C.FFN | None, plain: C.FFN | None, rp: list[Tensor],
              pp: list[Tensor], n_act: int, down_bytes: int, route: C.Route | None = None,
              glu_in: Sequence[Tensor] = (), routed_down: Sequence[Tensor] = (),
              plain_down: Sequence[Tensor] = ()) -> tuple[Tensor, Tensor | None]:
  """(h + the FFNs' output, with a route gate+up's own top-k ids): gate+up with SiLU over the routed stack's rp and the
  plain FFN's pp planes, then down over routed_down (its routing inputs, then its planes) and plain_down; glu_in: the
  routed stack's routing inputs of gate+up (the ids; with a route, the logits and Route.params)."""
  dev, K, hf = h.device, st.routing.n_used if routed else 0, f32(h)
  g = (routed or plain).gate
  gu_bytes = n_act * 2 * (st.dim // QUANT_TYPES[g.ggml_type].block) * QUANT_TYPES[g.ggml_type].nbytes
  form = {"float32": "f32"}.get(st.act, st.act)
  ho = handoff_rows(routed, plain, K, sm_count(dev), form) if form in C.HANDOFF else 0
  kg = C.glu(routed, plain, K, st.dim, st.eps, ho or R_LARGE, form, ho > 0, sm_count(dev), route)
  outs = [empty(n_act // 32 * C.HANDOFF[form] if ho else n_act, device=dev)]
  outs += [empty(1, 1, K, dtype=dtypes.int32, device=dev)] if route else []
  res = launch(kg, [*outs, hf, st.ffn_norm, *glu_in, *rp, *pp], gu_bytes)
  kd = C.down(routed, plain, K, st.dim, form, form if ho else "f32", route)
  out = launch(kd, [empty(1, 1, st.dim, device=dev), hf, res[0], *routed_down, *plain_down], down_bytes)[0]
  return out, res[1] if route else None


class NativeBackend(Backend):
  name = "native"

  def check(self, device: str | None) -> None:
    """Only tinygrad's CUDA device rendering CUDA C (not PTX=1) compiles this source."""
    from tinygrad.renderer.cstyle import CUDARenderer
    dev = Device.canonicalize(device)
    if not (self.row.runs_on(dev) and type(Device[dev].renderer) is CUDARenderer):
      raise ConfigError(f"backend native needs tinygrad's CUDA device rendering CUDA C; this process runs on {dev}")

  def attach(self, w: QWeight, device: str | None) -> QWeight:
    """As Backend.attach; the device's CUDA graphs also launch the native kernels early (cuda_graph.install)."""
    super().attach(w, device)
    if not C.supported(w.ggml_type, w.shape[-1]):
      raise ConfigError(f"backend native needs {w.quant} rows of a multiple of {C.UNITS[w.ggml_type].elems} elements")
    cuda_graph.install(Device.canonicalize(device))
    return w

  def scratch(self, n_heads: int, kv_lora: int, max_context: int, device: str | None) -> dict[str, Tensor]:
    """Split attention's partials and the router's counter, shared by the blocks."""
    splits = max(C.attention_splits(max_context)[1], C.heads_splits(max_context, sm_count(device or Device.DEFAULT)))
    return {"part": Tensor.zeros(n_heads * splits * (kv_lora + 2), device=device).contiguous().realize(),
            "router_cnt": Tensor.zeros(1, dtype=dtypes.int32, device=device).contiguous().realize()}

  # its products and stages: this module's functions
  rows = staticmethod(rows)
  linear = staticmethod(linear)
  per_head = staticmethod(per_head)
  expert = staticmethod(expert)
  grouped = staticmethod(grouped)
  prefill_attention = staticmethod(prefill_attention)
  norm_linear = staticmethod(norm_linear)
  attention = staticmethod(attention)
  router = staticmethod(router)
  moe = staticmethod(moe)
  ffn = staticmethod(ffn)
  routed_moe = staticmethod(routed_moe)


def available(device: str | None = None) -> bool:
  """True where the native kernels can run in this process."""
  try: BACKEND.check(device)
  except ConfigError: return False
  return True


BACKEND = register(NativeBackend())
