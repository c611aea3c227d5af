"""The `native` backend: hand-written CUDA C for the quantized matrix products, run by tinygrad as compiled programs.

Each product is one kernel whose source is written here (tinygrad's codegen does not see inside it) and returned from
`Tensor.custom_kernel` as a PROGRAM: tinygrad compiles it with its own NVRTC pipeline and the JIT batches it into its
CUDA graph like any other kernel. BEAM leaves these kernels alone; their schedule is the one below.

One warp per output row, `WARPS` warps per block. The lanes stride over the row in *units* of one type's layout (a Q4_0
or Q8_0 block, a 64-element quarter of a K-quant block, 8 float16 weights): a lane loads its unit with 16-byte loads,
dequantizes it into registers and multiplies it with up to `TOKENS` input rows (prefill shares each weight read among
them); a shuffle reduction sums the lanes. The expert kernel loads each selected expert id inside the kernel and indexes
the weight's rows by it, so no gather kernel runs.

Only tinygrad's CUDA C renderer compiles this source, so the backend exists on the `CUDA` device alone (`available`);
the space never proposes it elsewhere. A Metal version would follow the same layout once someone can run it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from tinygrad import Device, Tensor, dtypes
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

from model.backends import Backend
from model.errors import ConfigError
from model.quants import BF16, F16, F32, LAYOUTS, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, QUANT_TYPES

if TYPE_CHECKING:
  from model.weights import QWeight

WARPS, TOKENS = 4, 8


@dataclass(frozen=True)
class _Layout:
  seg: int  # elements per contiguous segment of input a unit multiplies
  nseg: int  # segments per unit
  per_block: int  # units per GGUF block (float types: 0, units of `seg` elements along the row)
  load: str  # C: fills w[nseg*seg] and xo[nseg] (segment offsets in the row) for unit u of weight row `row`


def _words(v: str, expr: str, n16: int) -> str:
  """C: n16 16-byte loads from `expr` into the 32-bit words v[0..4*n16)."""
  loads = " ".join(f"const uint4 {v}{i} = *(const uint4*)({expr} + {16 * i});" for i in range(n16))
  return f"{loads} const unsigned {v}[{4 * n16}] = {{{', '.join(f'{v}{i}.{c}' for i in range(n16) for c in 'xyzw')}}};"


def _k_quant(qh: bool) -> _Layout:
  """Q4_K, or Q5_K with its fifth bits (bit g of qh byte e for element e of group g). Unit j of a block: qs bytes 32j..
  hold group 2j (low nibbles) and 2j+1 (high); 6-bit scales and mins as ggml's get_scale_min_k4."""
  fifth = lambda g: f" | (((BYTE(qh, e) >> ({g})) & 1) << 4)" if qh else ""
  return _Layout(32, 2, 4, """
    const size_t b = row * NB + (u >> 2); const int j = u & 3; const float d = h2f(p_d[b]), dmin = h2f(p_dmin[b]);
    const unsigned char* s = p_sc + b * 12; float sc[2], mn[2];
    #pragma unroll
    for (int h = 0; h < 2; h++) { const int g = 2 * j + h;
      sc[h] = d * (float)(g < 4 ? s[g] & 63 : (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4));
      mn[h] = dmin * (float)(g < 4 ? s[g + 4] & 63 : (s[g + 4] >> 4) | ((s[g] >> 6) << 4)); }
    """ + _words("q", "p_qs + b * 128 + j * 32", 2) + (" " + _words("qh", "p_qh + b * 32", 2) if qh else "") + f"""
    xo[0] = u * 64; xo[1] = u * 64 + 32;
    #pragma unroll
    for (int e = 0; e < 32; e++) {{ const int c = BYTE(q, e);
      w[e] = sc[0] * (float)((c & 15){fifth("2 * j")}) - mn[0]; w[e + 32] = sc[1] * (float)((c >> 4){fifth("2 * j + 1")}) - mn[1]; }}""")


_LAYOUTS: dict[int, _Layout] = {
  Q4_0: _Layout(32, 1, 1, """
    const size_t b = row * NB + u; const float d = h2f(p_d[b]);
    """ + _words("q", "p_qs + b * 16", 1) + """
    xo[0] = u * 32;
    #pragma unroll
    for (int j = 0; j < 16; j++) { const int c = BYTE(q, j); w[j] = d * (float)((c & 15) - 8); w[j + 16] = d * (float)((c >> 4) - 8); }"""),
  Q8_0: _Layout(32, 1, 1, """
    const size_t b = row * NB + u; const float d = h2f(p_d[b]);
    """ + _words("q", "p_qs + b * 32", 2) + """
    xo[0] = u * 32;
    #pragma unroll
    for (int j = 0; j < 32; j++) w[j] = d * (float)(signed char)BYTE(q, j);"""),
  # Q6_K unit (half hh, j0) of a block: ql bytes 64hh+32j0.. hold quarters j0 (low nibbles) and 2+j0 (high) of half hh;
  # their high 2 bits sit at bits 2j of qh bytes 32hh..; one int8 scale per 16 elements
  Q6_K: _Layout(32, 2, 4, """
    const size_t b = row * NB + (u >> 2); const int hh = (u >> 1) & 1, j0 = u & 1; const float d = h2f(p_d[b]);
    const signed char* s = p_sc + b * 16 + hh * 8;
    """ + _words("l", "p_ql + b * 128 + hh * 64 + j0 * 32", 2) + " " + _words("h", "p_qh + b * 64 + hh * 32", 2) + """
    xo[0] = (u >> 2) * 256 + hh * 128 + j0 * 32; xo[1] = xo[0] + 64;
    #pragma unroll
    for (int e = 0; e < 32; e++) { const int c = BYTE(l, e), hb = BYTE(h, e);
      w[e] = d * (float)s[j0 * 2 + (e >> 4)] * (float)(((c & 15) | (((hb >> (2 * j0)) & 3) << 4)) - 32);
      w[e + 32] = d * (float)s[(j0 + 2) * 2 + (e >> 4)] * (float)(((c >> 4) | (((hb >> (2 * j0 + 4)) & 3) << 4)) - 32); }"""),
  F16: _Layout(8, 1, 0, """
    """ + _words("q", "(const unsigned char*)(p_w + row * IN + u * 8)", 1) + """
    xo[0] = u * 8;
    #pragma unroll
    for (int j = 0; j < 8; j++) w[j] = h2f((unsigned short)(q[j >> 1] >> (16 * (j & 1))));"""),
  BF16: _Layout(8, 1, 0, """
    """ + _words("q", "(const unsigned char*)(p_w + row * IN + u * 8)", 1) + """
    xo[0] = u * 8;
    #pragma unroll
    for (int j = 0; j < 8; j++) w[j] = __uint_as_float((q[j >> 1] >> (16 * (j & 1))) << 16);"""),
  F32: _Layout(4, 1, 0, """
    const float4 v = *(const float4*)(p_w + row * IN + u * 4); xo[0] = u * 4; w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;"""),
}
_LAYOUTS[Q4_K], _LAYOUTS[Q5_K] = _k_quant(qh=False), _k_quant(qh=True)

_CTYPES = {dtypes.float16: "unsigned short", dtypes.uint16: "unsigned short", dtypes.uint8: "unsigned char", dtypes.int8: "signed char",
           dtypes.float32: "float"}

_KERNEL = r"""
#define BYTE(v, i) (((v)[(i) >> 2] >> (8 * ((i) & 3))) & 255)
#ifdef __CUDACC_RTC__
__device__ __forceinline__ float h2f(unsigned short h) {{ float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }}
#endif
#define NB {nb}
#define IN {inp}
#define O {out}
extern "C" __global__ void __launch_bounds__({threads}) {name}(float* out, const float* x, {params}) {{
  const int lane = threadIdx.x & 31, o = blockIdx.x * {warps} + (threadIdx.x >> 5);
  if (o >= O) return;
  {setup}
  float acc[{tn}];
  #pragma unroll
  for (int t = 0; t < {tn}; t++) acc[t] = 0.f;
  for (int u = lane; u < {units}; u += 32) {{
    float w[{nw}]; int xo[{nseg}];
    {{ {load} }}
    #pragma unroll
    for (int s = 0; s < {nseg}; s++) {{
      #pragma unroll
      for (int t = 0; t < {tn}; t++) {{
        if (t >= nt) break;
        const float4* xv = (const float4*)(xrow(t) + xo[s]);
        float a = 0.f;
        #pragma unroll
        for (int i = 0; i < {seg4}; i++) {{
          const float4 v = xv[i];
          a += w[s * {seg} + 4 * i] * v.x + w[s * {seg} + 4 * i + 1] * v.y + w[s * {seg} + 4 * i + 2] * v.z + w[s * {seg} + 4 * i + 3] * v.w;
        }}
        acc[t] += a;
      }}
    }}
  }}
  #pragma unroll
  for (int t = 0; t < {tn}; t++) {{
    float a = acc[t];
    #pragma unroll
    for (int m = 16; m > 0; m >>= 1) a += __shfl_xor_sync(0xffffffffu, a, m);
    if (lane == 0 && t < nt) out[outidx(t)] = a;
  }}
}}
"""

# per role: the weight row, the input row of token slot t, the output index of slot t, and nt (valid token slots)
_SETUP = {
  "dense": "const size_t row = o; const int t0 = blockIdx.y * {tn}, nt = min({tn}, {n} - t0);"
           " auto xrow = [&](int t) {{ return x + (size_t)(t0 + t) * IN; }}; auto outidx = [&](int t) {{ return (size_t)(t0 + t) * O + o; }};",
  "per_head": "const int h = blockIdx.y; const size_t row = (size_t)h * O + o; const int t0 = blockIdx.z * {tn}, nt = min({tn}, {n} - t0);"
              " auto xrow = [&](int t) {{ return x + ((size_t)(t0 + t) * {heads} + h) * IN; }};"
              " auto outidx = [&](int t) {{ return ((size_t)(t0 + t) * {heads} + h) * O + o; }};",
  "expert": "const int y = blockIdx.y, e = min(max(sel[y], 0), {experts} - 1); const size_t row = (size_t)e * O + o; const int nt = 1;"
            " auto xrow = [&](int t) {{ return x + (size_t)({xk} > 1 ? y : y / {k}) * IN; }};"
            " auto outidx = [&](int t) {{ return (size_t)y * O + o; }};",
}


class NativeBackend(Backend):
  name = "native"
  quants = frozenset(QUANT_TYPES[t].name for t in _LAYOUTS)
  device_kinds = ("CUDA",)

  def check(self, device: str | None) -> None:
    """Only tinygrad's CUDA device rendering CUDA C (not PTX=1) compiles this source."""
    from tinygrad.renderer.cstyle import CUDARenderer
    dev = Device.canonicalize(device)
    if not (self.runs_on(dev) and type(Device[dev].renderer) is CUDARenderer):
      raise ConfigError(f"backend native needs tinygrad's CUDA device rendering CUDA C; this process runs on {dev}")

  def attach(self, w: QWeight, device: str | None) -> QWeight:
    super().attach(w, device)
    lay = _LAYOUTS[w.ggml_type]
    if lay.per_block == 0 and w.shape[-1] % lay.seg: raise ConfigError(f"backend native needs {w.quant} rows of a multiple of {lay.seg} elements")
    return w

  def linear(self, x: Tensor, w: QWeight) -> Tensor: return linear(x, w)
  def per_head(self, x: Tensor, w: QWeight) -> Tensor: return per_head(x, w)
  def expert(self, x: Tensor, sel: Tensor, w: QWeight) -> Tensor: return expert(x, sel, w)


def available(device: str | None = None) -> bool:
  """True where the native kernels can run in this process."""
  try: BACKEND.check(device)
  except ConfigError: return False
  return True


def plane_types(ggml_type: int) -> tuple[tuple[str, str], ...]:
  """The planes of a weight of this type, in argument order, with their C element types."""
  return tuple((k, _CTYPES[dt]) for k, (_, _, dt) in LAYOUTS[ggml_type].items())


@functools.cache
def source(role: str, ggml_type: int, shape: tuple[int, ...], **dims: int) -> tuple[str, str]:
  """(function name, CUDA C) of one product; shape: the weight's (..., out, in). The planes follow in plane_types order."""
  lay, qt = _LAYOUTS[ggml_type], QUANT_TYPES[ggml_type]
  out, inp = shape[-2:]
  tn = dims.get("tn", 1)
  name = f"native_{role}_{qt.name.lower()}_{'_'.join(map(str, (*shape, *dims.values())))}"
  params = ", ".join(([] if role != "expert" else ["const int* sel"]) + [f"const {ct}* __restrict__ p_{n}" for n, ct in plane_types(ggml_type)])
  src = _KERNEL.format(nb=inp // qt.block, inp=inp, out=out, threads=32 * WARPS, warps=WARPS, name=name, params=params, tn=tn,
                       setup=_SETUP[role].format(**dims), units=inp // qt.block * lay.per_block if lay.per_block else inp // lay.seg,
                       nw=lay.seg * lay.nseg, nseg=lay.nseg, seg=lay.seg, seg4=lay.seg // 4, load=lay.load)
  return name, src


def _run(role: str, grid: tuple[int, int, int], out_shape: tuple[int, ...], x: Tensor, srcs: tuple[Tensor, ...], w: QWeight,
         rows_read: int, **dims: int) -> Tensor:
  name, src = source(role, w.ggml_type, w.shape, **dims)
  x = x.float()
  out = Tensor.empty(*out_shape, dtype=dtypes.float32, device=x.device)
  target = Device[x.device].renderer.target
  tokens, row_bytes = prod(out_shape) // out_shape[-1], w.shape[-1] // QUANT_TYPES[w.ggml_type].block * QUANT_TYPES[w.ggml_type].nbytes
  mem = rows_read * row_bytes + x.nbytes() + prod(out_shape) * 4

  def fxn(*params: UOp) -> UOp:
    info = ProgramInfo(name=name, global_size=grid, local_size=(32 * WARPS, 1, 1), globals=tuple(range(len(params))), outs=(0,),
                       ins=tuple(range(1, len(params))), target=target)
    sink = UOp.sink(arg=KernelInfo(name=name, estimates=Estimates(ops=2 * tokens * out_shape[-1] * w.shape[-1], lds=mem, mem=mem)))
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=params), UOp(Ops.SOURCE, arg=src)), arg=info)
  return out.custom_kernel(x, *srcs, *(w.planes[k] for k, _ in plane_types(w.ggml_type)), fxn=fxn)[0]


def _blocks(out: int) -> int: return -(-out // WARPS)


def linear(x: Tensor, w: QWeight) -> Tensor:
  """x (..., in) @ w.T -> (..., out) float32, for a weight of shape (out, in)."""
  lead, (out, inp) = x.shape[:-1], w.shape
  n = prod(lead)
  tn = min(n, TOKENS)
  grid = (_blocks(out), -(-n // tn), 1)
  return _run("dense", grid, (n, out), x.reshape(n, inp), (), w, out * -(-n // tn), tn=tn, n=n).reshape(*lead, out)


def per_head(x: Tensor, w: QWeight) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out)."""
  lead, (H, out, inp) = x.shape[:-2], w.shape
  n = prod(lead)
  tn = min(n, TOKENS)
  grid = (_blocks(out), H, -(-n // tn))
  return _run("per_head", grid, (n, H, out), x.reshape(n, H, inp), (), w, H * out * -(-n // tn), tn=tn, n=n, heads=H).reshape(*lead, H, out)


def expert(x: Tensor, sel: Tensor, w: QWeight) -> Tensor:
  """x (B, T, K or 1, in), selected experts sel (B, T, K), w (E, out, in) -> (B, T, K, out)."""
  (B, T, K), (E, out, inp) = sel.shape, w.shape
  xk = x.shape[2]
  grid = (_blocks(out), B * T * K, 1)
  return _run("expert", grid, (B * T * K, out), x.reshape(B * T * xk, inp), (sel.reshape(B * T * K).cast(dtypes.int32),), w,
              B * T * K * out, experts=E, xk=xk, k=K).reshape(B, T, K, out)


BACKEND = NativeBackend()
