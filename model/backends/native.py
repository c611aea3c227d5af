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
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

from model.backends import cuda_graph
from model.backends import cuda_src as C
from model.backends.registry import Backend, register
from model.deepseek2 import rms_norm
from model.errors import ConfigError
from model.quants import QUANT_TYPES

if TYPE_CHECKING:
  from model.deepseek2 import Block
  from model.weights import QWeight


def launch(k: C.Kernel, params: list[Tensor], mem: int, ops: int = 0) -> list[Tensor]:
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


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out)."""
  (B, T, K), (E, out, inp) = sel.shape, w.shape
  xk, slots = x.shape[2], B * T * K
  return _product("expert", (slots, out), x.reshape(B * T * xk, inp),
                  [sel.reshape(slots).cast(dtypes.int32).contiguous()], w, slots * out, experts=E, xk=xk, k=K,
                  slots=slots).reshape(B, T, K, out)


# ------------------------------------------------------------------ fused decode stages
# ---------------------------------

R_SMALL, R_LARGE = 2, 4  # rows per row group: 2 where a matrix has few rows (more blocks in flight), 4 otherwise and
# wherever a kernel normalises its input (more rows share the block's staged input), but the first attention kernel's
# (C.QKV_ROWS)


def _rows_r(rows: int) -> int: return R_LARGE if rows >= 4096 else R_SMALL
# warps a block of the attention's dense products with 8-bit input (attn_act=q8): the staged input takes a quarter of
# float32's shared memory, and a block of 8 warps shares it over twice the rows (GLM-4.7-Flash: the residual
# product 5.43 us against 6.67 with 4 warps, q_b 2.84 against 3.02 on an H100: benchmarks/kernel_sweep.py)
Q8_WARPS = 8


def attention(blk: Block, x: Tensor, start_pos, pos: Tensor) -> Tensor:
  """h = x + attention(x) for one token: norm + q_a/kv_a (or q/kv_a), q_a norm + q_b, absorption + RoPE + cache write,
  MLA attention split over the context, the splits' merge with v_b, output projection + residual: 6 kernels. With
  attn_act=q8 the three dense products stage their input in 8 bits (cuda_src.stage_x) and dot it in integers."""
  hp, dev = blk.hp, x.device
  H, nope, rope, kvl, dim = hp.n_heads, hp.qk_nope, hp.qk_rope, hp.kv_lora, hp.dim
  xf = f32(x)
  first = blk.q_a if hp.q_lora else blk.q_b
  rows = (first.shape[0], blk.kv_a.shape[0])
  sms = sm_count(dev)
  # the dense products' input: float32, or 8 bits (attn_act=q8) in blocks of Q8_WARPS warps
  act, warps = ("q8", Q8_WARPS) if blk.cfg.attn_act == "q8" else ("f32", C.WARPS)
  k1 = C.dense(((cw("a_", first), rows[0]), (cw("b_", blk.kv_a), rows[1])), C.QKV_ROWS, hp.eps,
               warps=C.QKV_WARPS, act=act, sms=sms)
  qa, kv = launch(k1, [empty(rows[0], device=dev), empty(rows[1], device=dev), xf, blk.attn_norm, *planes(first),
                       *planes(blk.kv_a)], row_bytes(first) * rows[0] + row_bytes(blk.kv_a) * rows[1])[:2]
  if hp.q_lora:
    nq = blk.q_b.shape[0]
    k2 = C.dense(((cw("a_", blk.q_b), nq),), R_LARGE, hp.eps, warps=warps, act=act, sms=sms)
    q = launch(k2, [empty(nq, device=dev), qa, blk.q_a_norm, *planes(blk.q_b)], row_bytes(blk.q_b) * nq)[0]
  else: q = qa
  D, cache_half = kvl + rope, blk.cache.dtype == dtypes.float16
  k3 = C.absorb_rope_kv(cw("k_", blk.k_b), H, nope, rope, kvl, blk.cache.shape[1], hp.eps, cache_half)
  qc, cache = launch(k3, [empty(H * D, device=dev), blk.cache, q, kv, blk.kv_a_norm, blk.cos, blk.sin, pos,
                          *planes(blk.k_b)], row_bytes(blk.k_b) * H * kvl + D * 2)[:2]
  k4 = C.mla_attention(H, kvl, rope, blk.cache.shape[1], hp.kq_scale, cache_half)
  part = launch(k4, [blk.scratch["part"], qc, cache, pos], cache.nbytes() // 4)[0]
  k5 = C.mla_vb(cw("w_", blk.v_b), H, kvl, hp.v_head, blk.cache.shape[1])
  a = launch(k5, [empty(H * hp.v_head, device=dev), part, pos, *planes(blk.v_b)],
             row_bytes(blk.v_b) * H * hp.v_head)[0]
  k6 = C.dense(((cw("a_", blk.wo), dim),), _rows_r(dim), None, residual=True, warps=warps, act=act, sms=sms)
  return launch(k6, [empty(1, 1, dim, device=dev), a, xf, *planes(blk.wo)], row_bytes(blk.wo) * dim)[0]


def _route(blk: Block, forced: Tensor | None) -> tuple[C.Route, list[Tensor]]:
  """The block's routing as the kernels compute it, and the inputs it reads besides the logits (C.Route.params)."""
  hp = blk.hp
  route = C.Route(hp.n_experts, hp.n_used, hp.gating, blk.probs_b is not None, hp.norm_w, hp.w_scale,
                  forced is not None)
  return route, ([blk.probs_b] if blk.probs_b is not None else []) + ([i32(forced)] if forced is not None else [])


def router(blk: Block, h: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """(the ids used (1, 1, K), their weights, the router's own top-k ids, its logits (1, 1, E)) for one token; forced:
  ids to use instead of its own (the correctness check)."""
  hp, dev, w = blk.hp, h.device, blk.gate_inp
  E, K = hp.n_experts, hp.n_used
  route, ins = _route(blk, forced)
  outs = [empty(1, 1, K, dtype=dtypes.int32, device=dev), empty(1, 1, K, device=dev), empty(1, 1, E, device=dev),
          blk.scratch["router_cnt"]] + ([empty(1, 1, K, dtype=dtypes.int32, device=dev)] if forced is not None else [])
  res = launch(C.router(cw("g_", w), hp.eps, route), [*outs, f32(h), blk.ffn_norm, *ins, *planes(w)], row_bytes(w) * E)
  return res[0], res[1], res[4] if forced is not None else res[0], res[2]


def _ffn(gate: QWeight | None, up: QWeight | None, down: QWeight, gate_up: QWeight | None, hidden: int,
         experts: int = 0) -> C.FFN:
  g = gate_up if gate_up is not None else gate
  rows = g.shape[-2]
  return C.FFN(cw("", g), cw("", g if gate_up is not None else up), cw("", down), hidden, experts, rows,
               hidden if gate_up is not None else 0)


def _ffn_planes(gate: QWeight | None, up: QWeight | None, gate_up: QWeight | None) -> list[Tensor]:
  return planes(gate_up) if gate_up is not None else planes(gate) + planes(up)


def moe(blk: Block, h: Tensor, sel: Tensor, wts: Tensor, logits: Tensor) -> Tensor:
  """h + MoE FFN(h) for one token, routed by sel/wts (the router logits they come from are not read): the selected
  experts' and the shared expert's gate+up+SiLU in one kernel, their down projections with the routing weights, the
  shared expert and the residual add in another."""
  sel = i32(sel)
  return _moe(blk, h, None, [sel], [sel, f32(wts)])[0]


def routed_moe(blk: Block, h: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
  """The router and the MoE in one (both stages native): (h + MoE FFN(h), the own top-k ids (1, 1, K), the router
  logits (1, 1, E)) for one token. The router kernel computes the logits alone; gate+up's and down's blocks each rank
  them themselves (C.Route), so no kernel waits on a ranking: the router's last-block count and ranking leave the
  step. forced: ids to use instead of its own (the correctness check)."""
  hp, w = blk.hp, blk.gate_inp
  route, ins = _route(blk, forced)
  logits = launch(C.router(cw("g_", w), hp.eps, route, logits_only=True),
                  [empty(1, 1, hp.n_experts, device=h.device), f32(h), blk.ffn_norm, *planes(w)],
                  row_bytes(w) * hp.n_experts)[0]
  out, own = _moe(blk, h, route, [logits, *ins], [logits, *ins])
  return out, own, logits


def _moe(blk: Block, h: Tensor, route: C.Route | None, glu_in: Sequence[Tensor],
         down_in: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
  hp, dev, K, F = blk.hp, h.device, blk.hp.n_used, blk.n_ff_exp
  routed = _ffn(blk.gate_exps, blk.up_exps, blk.down_exps, blk.gate_up_exps, F, hp.n_experts)
  rp = _ffn_planes(blk.gate_exps, blk.up_exps, blk.gate_up_exps)
  plain, pp, Fp = None, [], 0
  if blk.shared:
    Fp = blk.down_sh.shape[-1]
    plain, pp = (_ffn(blk.gate_sh, blk.up_sh, blk.down_sh, blk.gate_up_sh, Fp),
                 _ffn_planes(blk.gate_sh, blk.up_sh, blk.gate_up_sh))
  return _glu_down(blk, h, routed, plain, rp, pp, K * F + Fp,
                   row_bytes(blk.down_exps) * hp.dim * K + (row_bytes(blk.down_sh) * hp.dim if blk.shared else 0), dev,
                   route, glu_in, down_in)


def ffn(blk: Block, h: Tensor) -> Tensor:
  """h + FFN(h) for one token of a dense block: gate+up+SiLU in one kernel, down + residual in another."""
  F = blk.down.shape[-1]
  plain = _ffn(blk.gate, blk.up, blk.down, blk.gate_up, F)
  return _glu_down(blk, h, None, plain, [], _ffn_planes(blk.gate, blk.up, blk.gate_up), F,
                   row_bytes(blk.down) * blk.hp.dim, h.device)[0]


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
  thread. On an H200 (benchmarks/kernel_sweep.py), DeepSeek-V2-Lite's 352 blocks: 8-bit, gate+up 11.13 -> 11.41 us and
  down 8.51 -> 6.54; 16-bit, whose blocks of 16 warps take 100 registers a thread (one a multiprocessor), gate+up
  12.74 -> 16.56 against down 9.84 -> 7.20, so none."""
  if not C.down_reads_handoff(routed, plain): return 0
  if C.handoff_fits(routed, plain, k, sms, R_LARGE): return R_LARGE
  return R_SMALL if form == "q8" else 0


def _glu_down(blk: Block, h: Tensor, routed: C.FFN | None, plain: C.FFN | None, rp: list[Tensor], pp: list[Tensor],
              n_act: int, down_bytes: int, dev: str, route: C.Route | None = None, glu_in: Sequence[Tensor] = (),
              down_in: Sequence[Tensor] = ()) -> tuple[Tensor, Tensor | None]:
  """(h + the FFNs' output, with a route gate+up's own top-k ids); glu_in, down_in: the routed stack's routing
  inputs of each kernel (the ids, and down's weights; with a route, the logits and Route.params)."""
  hp, K = blk.hp, blk.hp.n_used if routed else 0
  hf = f32(h)
  gu_bytes = n_act * 2 * (hp.dim // QUANT_TYPES[(routed
                                                 or plain).gate.ggml_type].block) * QUANT_TYPES[(
                                                   routed or plain).gate.ggml_type].nbytes
  form = {"float32": "f32"}.get(blk.cfg.ffn_act, blk.cfg.ffn_act)
  ho = handoff_rows(routed, plain, K, sm_count(dev), form) if form in C.HANDOFF else 0
  kg = C.glu(routed, plain, K, hp.dim, hp.eps, ho or R_LARGE, form, ho > 0, sm_count(dev), route)
  outs = [empty(n_act // 32 * C.HANDOFF[form] if ho else n_act, device=dev)]
  outs += [empty(1, 1, K, dtype=dtypes.int32, device=dev)] if route else []
  res = launch(kg, [*outs, hf, blk.ffn_norm, *glu_in, *rp, *pp], gu_bytes)
  kd = C.down(routed, plain, K, hp.dim, form, form if ho else "f32", route)
  routed_down = [*down_in, *planes(blk.down_exps)] if routed else []
  plain_down = planes(blk.down_sh if routed else blk.down) if plain else []
  out = launch(kd, [empty(1, 1, hp.dim, device=dev), hf, res[0], *routed_down, *plain_down], down_bytes)[0]
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

  def scratch(self, hp, max_context: int, device: str | None) -> dict[str, Tensor]:
    """Split attention's partials and the router's counter, shared by the blocks."""
    splits = C.attention_splits(max_context)[1]
    return {"part": Tensor.zeros(hp.n_heads * splits * (hp.kv_lora + 2), device=device).contiguous().realize(),
            "router_cnt": Tensor.zeros(1, dtype=dtypes.int32, device=device).contiguous().realize()}

  def rows(self, w: QWeight, idx: Tensor) -> Tensor: return rows(w, idx)
  norm_linear = staticmethod(norm_linear)
  def linear(self, x: Tensor, w: QWeight) -> Tensor: return linear(x, w)
  def per_head(self, x: Tensor, w: QWeight) -> Tensor: return per_head(x, w)
  def expert(self, x: Tensor, sel: Tensor, w: QWeight) -> Tensor: return expert(x, sel, w)
  attention, router, moe, ffn = staticmethod(attention), staticmethod(router), staticmethod(moe), staticmethod(ffn)
  routed_moe = staticmethod(routed_moe)


def available(device: str | None = None) -> bool:
  """True where the native kernels can run in this process."""
  try: BACKEND.check(device)
  except ConfigError: return False
  return True


BACKEND = register(NativeBackend())
