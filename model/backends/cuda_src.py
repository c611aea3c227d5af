"""CUDA C sources of the native backend (model/backends/native.py runs them inside tinygrad's graphs).

Every kernel here is generated from one description of each GGUF type's block layout: a *unit* is the piece of a weight
row one lane reads at a time (a Q4_0 or Q8_0 block, a 64-element quarter of a K-quant block, 8 float16 weights, ...)
with 16-byte loads; its elements are integer codes in groups that share a scale and a minimum, so a lane computes
    sum over groups of  scale * (x . code) + min * sum(x)
with the codes turned into floats by the exponent trick (`MAG`, two full-rate instructions instead of a quarter-rate
int->float conversion; `MAGB` for a code that fills a byte of a masked word, one byte permute and a subtraction) and the
group sums of x taken once per lane, not once per row.

Matrix-vector products (one decode token) keep the input in registers: the lanes of a *row group* (G lanes, the smallest
power of two covering a row's units, at most 32) own fixed units of the input, load their part of x once and reuse it
for the R output rows the group computes, so the weight bytes are the only memory traffic that grows with the matrix.
Rows far longer than the register budget go in chunks. A shuffle reduction inside the group sums its lanes; lane 0 of
the group applies the kernel's epilogue. A decode kernel runs for a few µs as one wave of blocks, so what it waits on in
sequence is its cost: its weight reads are issued first (`early`), and the block stages its input once into shared
memory while they are in flight (`stage_x`: normalised where an RMSNorm is folded in), rather than each warp after them.
Those reads are weak streaming loads (`__ldcs`) before the staging's barrier and the products read shared memory after
it: ptxas moves read-only (`.nc`) loads freely, and left to itself it interleaves them with the products to save
registers, so a lane would wait on memory several times in turn; it moves neither a weak load below a barrier nor a
shared read above one. Down's row sums over a warp are scattered by a butterfly (`lane_sums`): n sums in n - 1 +
log2(32/n) shuffles. The MoE down projection splits its work over (slot, unit) pairs, a thread each. Wide products (the
output head: many waves) are bound by their instruction count instead, and read x as two 8-bit planes with integer dot
products (`x16`). Multi-token products (prefill) read x from memory instead and share each weight read among up to
TOKENS tokens.

Kernels use static shared memory of at most the input's width in floats (8 KB at width 2048), no dynamic shared memory
and no cooperative launches, so tinygrad can batch them into its CUDA graphs like its own.

The C that does not depend on a weight type's unit lives in device files (model/backends/cuda/: the helpers, the MLA
attention, the absorption's RoPE and cache write, the merge of the attention's splits, the router and the routing),
parameterised by defines; a kernel's source, the one string tinygrad compiles, is its variant's defines, the helpers,
its signature (name and parameters, written here) and its files with their includes in place. The products (gemv and
the per-unit code around it) are still generated here. Device-specific helpers (inline PTX) sit inside
`#ifdef __CUDACC_RTC__` (NVRTC defines it), so the same source also runs on the CPU emulator of the tests.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from model.quants import BF16, F16, F32, LAYOUTS, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, QUANT_TYPES

WARPS, TOKENS, XREGS = 4, 8, 64  # warps per block, tokens per prefill tile, input floats a lane keeps in registers
STAGE_MAX = 8192  # the widest input a single-token product stages in shared memory (36 KB of padded floats: sx_at)
# unit reads a lane keeps in flight at once where x is staged in shared memory (5 registers each for Q4_0)
STAGED_READS = 16
THREADS = 32 * WARPS
CTYPES = {"half": "unsigned short", "unsigned short": "unsigned short", "unsigned char": "unsigned char",
          "signed char": "signed char",
          "float": "float"}  # tinygrad dtype name -> the C type a kernel reads it as

CUDA_DIR = Path(__file__).with_name("cuda")  # the device files (package data)


@functools.cache
def device_file(name: str) -> str:
  """A device file with its includes in place (tinygrad compiles a single source, so the source carries them)."""
  return includes((CUDA_DIR / name).read_text())


def includes(c: str) -> str:
  """C with each line `#include "<device file>"` replaced by the file."""
  return re.sub(r'^[ \t]*#include "([\w.]+)"[ \t]*$', lambda m: device_file(m[1]).rstrip("\n"), c, flags=re.M)


PRELUDE = "\n" + device_file("common.cuh")  # the helpers every kernel's source starts with


def _words(v: str, expr: str, n16: int) -> tuple[tuple[tuple[str, str, str], ...], str]:
  """n16 16-byte loads from the byte address `expr` (loads), and the 32-bit words v[0..4*n16) made of them (decode)."""
  loads = tuple(("uint4", f"{v}{i}", f"{expr} + {16 * i}") for i in range(n16))
  return loads, f"const unsigned {v}[{4 * n16}] = {{{', '.join(f'{v}{i}.{c}' for i in range(n16) for c in 'xyzw')}}};"


@dataclass(frozen=True)
class Unit:
  """One type's unit: `elems` input elements of row `row` (a size_t) at unit index `u`. `index` (C) computes the indices
  the unit's memory reads need (`$` stands for the weight's plane prefix, `$NB` for its blocks per row, `$IN` for its
  row length); `loads` are those reads, (C type, name, byte address); `decode` (C) turns them into what the groups use.
  Quantized types: `groups` of (scale, min, ((element, code), ...)) with the unsigned integer codes as floats (MAG,
  MAGB); float types: one group (None, None, ((element, value), ...)). Reads apart from decoding let a kernel issue
  every read of its rows at once."""
  elems: int
  index: str
  loads: tuple[tuple[str, str, str], ...]
  decode: str
  groups: tuple[tuple[str | None, str | None, tuple[tuple[int, str], ...]], ...]
  xbase: str  # C: the row offset of element 0 of unit {u}
  xoff: Callable[[int], int]  # element -> offset from xbase
  # integer dot products with 8-bit activations (types whose codes are bytes or nibbles of a scale per group): (C int
  # of 4 codes, the index of the 4 activations' word) per dp4a, the scale, and the codes' offset (the value of a code c
  # is c + ioff); igroups: where the unit's groups have scales of their own, (scale, first word, words) each; imin: the
  # unit's min (value = scale * code + imin), for the types that have one
  idot: tuple[tuple[str, int], ...] = ()
  iscale: str = ""
  ioff: int = 0
  igroups: tuple[tuple[str, int, int], ...] = ()
  imin: str = ""

  @property
  def quantized(self) -> bool: return self.groups[0][0] is not None


def _b(plane: str) -> str: return f"(const unsigned char*)${plane}"


# a K-quant block's scales and mins (Q4_K, Q5_K): its d and dmin, its 12 bytes of 6-bit scales and mins as 3 words
# (loads), and group g's scale and min from them as ggml's get_scale_min_k4 (C, with d, dmin, sw and g in scope)
_K_LOADS = (("unsigned short", "dh", f"{_b('d')} + b * 2"), ("unsigned short", "mh", f"{_b('dmin')} + b * 2"),
            *(("unsigned", f"sw{i}", f"{_b('sc')} + b * 12 + {4 * i}") for i in range(3)))
_K_HEAD = "const float d = h2f(dh), dmin = h2f(mh); const unsigned sw[3] = {sw0, sw1, sw2};"
_K_SCALE = "d * (float)(g < 4 ? BYTE(sw, g) & 63u : (BYTE(sw, g + 4) & 15u) | ((BYTE(sw, g - 4) >> 6) << 4))"
_K_MIN = "dmin * (float)(g < 4 ? BYTE(sw, g + 4) & 63u : (BYTE(sw, g + 4) >> 4) | ((BYTE(sw, g) >> 6) << 4))"


def _k_quant(qh: bool) -> Unit:
  """Q4_K, or Q5_K with its fifth bits (bit g of qh byte e for element e of group g). Unit j of a block: qs bytes 32j..
  hold group 2j (low nibbles) and 2j+1 (high); 6-bit scales and mins as ggml's get_scale_min_k4."""
  fifth = lambda h: f" | (((BYTE(qh, {{e}}) >> (2 * j + {h})) & 1u) << 4)" if qh else ""
  ql, qd = _words("q", f"{_b('qs')} + b * 128 + j * 32", 2)
  hl, hd = _words("qh", f"{_b('qh')} + b * 32", 2) if qh else ((), "")
  decode = (f"{_K_HEAD} float sc[2], mn[2]; for (int h = 0; h < 2; h++) {{ const int g = 2 * j + h; sc[h] = {_K_SCALE};"
            f" mn[h] = {_K_MIN}; }} {qd} {hd}")
  groups = tuple((f"sc[{h}]", f"-mn[{h}]",
                  tuple((32 * h + e, f"MAG((BYTE(q, {e}) {'& 15u' if h == 0 else '>> 4'}){fifth(h).format(e=e)})")
                                               for e in range(32))) for h in range(2))
  return Unit(64, "const size_t b = row * $NB + (u >> 2); const int j = u & 3;", (*_K_LOADS, *ql, *hl), decode, groups,
              "{u} * 64", lambda e: e)


def _q6_k() -> Unit:
  """Q6_K unit (half hh, j0) of a block: ql bytes 64hh+32j0.. hold quarters j0 (low nibbles) and 2+j0 (high) of half hh;
  their high 2 bits sit at bits 2j of qh bytes 32hh..; one int8 scale per 16 elements."""
  ll, ld = _words("l", f"{_b('ql')} + b * 128 + hh * 64 + j0 * 32", 2)
  hl, hd = _words("hb", f"{_b('qh')} + b * 64 + hh * 32", 2)
  loads = (("unsigned short", "dh", f"{_b('d')} + b * 2"),
           *(("unsigned", f"sw{i}", f"{_b('sc')} + b * 16 + hh * 8 + {4 * i}") for i in range(2)), *ll, *hl)
  sc = lambda i: f"d * (float)(signed char)BYTE(sw, {i})"
  decode = (f"const float d = h2f(dh); const unsigned sw[2] = {{sw0, sw1}}; const float s0 = {sc('j0 * 2')}, s1 = "
            f"{sc('j0 * 2 + 1')}, s2 = {sc('j0 * 2 + 4')}, s3 = {sc('j0 * 2 + 5')}; {ld} {hd}")
  lo = lambda e: f"MAG((BYTE(l, {e}) & 15u) | (((BYTE(hb, {e}) >> (2 * j0)) & 3u) << 4))"
  hi = lambda e: f"MAG((BYTE(l, {e}) >> 4) | (((BYTE(hb, {e}) >> (2 * j0 + 4)) & 3u) << 4))"
  groups = (("s0", "-32.f * s0", tuple((e, lo(e)) for e in range(16))),
            ("s1", "-32.f * s1", tuple((e, lo(e)) for e in range(16, 32))),
            ("s2", "-32.f * s2", tuple((32 + e, hi(e)) for e in range(16))),
            ("s3", "-32.f * s3", tuple((32 + e, hi(e)) for e in range(16, 32))))
  return Unit(64, "const size_t b = row * $NB + (u >> 2); const int hh = (u >> 1) & 1, j0 = u & 1;", loads, decode,
              groups, "({u} >> 2) * 256 + (({u} >> 1) & 1) * 128 + ({u} & 1) * 32", lambda e: e if e < 32 else e + 32)


def _q_0(bits: int) -> Unit:
  """Q4_0 (two 4-bit codes per byte, 16 bytes a block) or Q8_0 (one 8-bit code, stored signed: bias 128 by xor).
  Elements 4j..4j+3 are the bytes of word j of the block's codes, masked once for its four codes: the float products
  read each byte as a float (MAGB), the integer ones dot the word (idot)."""
  ql, qd = _words("q", f"{_b('qs')} + b * {bits * 4}", bits // 4)
  words = ([f"(q[{m}] & 0x0F0F0F0Fu)" for m in range(4)] + [f"((q[{m}] >> 4) & 0x0F0F0F0Fu)" for m in range(4)]
           if bits == 4 else [f"q[{m}]" for m in range(8)])
  unsigned = (lambda w: w) if bits == 4 else (lambda w: f"({w} ^ 0x80808080u)")
  codes = tuple((e, f"MAGB({unsigned(words[e >> 2])}, {e & 3})") for e in range(32))
  idot = tuple((f"(int){w}", m) for m, w in enumerate(words))
  return Unit(32, "const size_t b = row * $NB + u;", (("unsigned short", "dh", f"{_b('d')} + b * 2"), *ql),
              "const float d = h2f(dh); " + qd, (("d", f"-{1 << (bits - 1)}.f * d", codes),), "{u} * 32", lambda e: e,
              idot, "d", -8 if bits == 4 else 0)


def _f16(bf: bool) -> Unit:
  ql, qd = _words("q", f"{_b('w')} + (row * $IN + u * 8) * 2", 1)
  half = lambda e: f"(q[{e >> 1}] >> {16 * (e & 1)})"
  value = (lambda e: f"__uint_as_float({half(e)} << 16)") if bf else (lambda e: f"h2f((unsigned short){half(e)})")
  return Unit(8, "", ql, qd, ((None, None, tuple((e, value(e)) for e in range(8))),), "{u} * 8", lambda e: e)


UNITS: dict[int, Unit] = {Q4_0: _q_0(4), Q8_0: _q_0(8), Q4_K: _k_quant(qh=False), Q5_K: _k_quant(qh=True),
                          Q6_K: _q6_k(), F16: _f16(False), BF16: _f16(True),
                          F32: Unit(4, "", (("float4", "q", f"{_b('w')} + (row * $IN + u * 4) * 4"),), "",
                                    ((None, None, tuple((e, f"q.{'xyzw'[e]}") for e in range(4))),), "{u} * 4",
                                    lambda e: e)}


def _k_quant32(qh: bool) -> Unit:
  """Q4_K (Q5_K) as units of 32, one group g of a block each, for the integer dot products: the codes of group g are
  the low (g even) or high nibbles of qs bytes 32(g >> 1).. (with the fifth bits, bit g of qh byte e), so the
  activations' units of 32 meet the weight's one to one."""
  ql, qd = _words("q", f"{_b('qs')} + b * 128 + (g >> 1) * 32", 2)
  hl, hd = _words("qh", f"{_b('qh')} + b * 32", 2) if qh else ((), "")
  decode = f"{_K_HEAD} const float sc = {_K_SCALE}, mn = {_K_MIN}; {qd} {hd}"
  fifth = lambda m: f" | (((qh[{m}] >> g) & 0x01010101u) << 4)" if qh else ""
  words = [f"(((q[{m}] >> (4 * (g & 1))) & 0x0F0F0F0Fu){fifth(m)})" for m in range(8)]
  codes = tuple((e, f"MAGB({words[e >> 2]}, {e & 3})") for e in range(32))
  return Unit(32, "const size_t b = row * $NB + (u >> 3); const int g = u & 7;", (*_K_LOADS, *ql, *hl), decode,
              (("sc", "-mn", codes),), "{u} * 32", lambda e: e, tuple((f"(int){w}", m) for m, w in enumerate(words)),
              "sc", imin="-mn")


def _q6_k32() -> Unit:
  """Q6_K as units of 32, quarter k of half hh of a block each, for the integer dot products: its codes are the low
  (k < 2) or high nibbles of ql bytes 64hh + 32(k & 1).., their high 2 bits at bits 2k of qh bytes 32hh..; an int8
  scale per 16 elements (two groups a unit), codes offset by -32."""
  ll, ld = _words("l", f"{_b('ql')} + b * 128 + hh * 64 + (k & 1) * 32", 2)
  hl, hd = _words("hb", f"{_b('qh')} + b * 64 + hh * 32", 2)
  loads = (("unsigned short", "dh", f"{_b('d')} + b * 2"),
           ("unsigned short", "sh", f"{_b('sc')} + b * 16 + hh * 8 + k * 2"), *ll, *hl)
  decode = ("const float d = h2f(dh), s0 = d * (float)(signed char)(sh & 255u),"
            f" s1 = d * (float)(signed char)(sh >> 8); {ld} {hd}")
  words = [f"(((l[{m}] >> (4 * (k >> 1))) & 0x0F0F0F0Fu) | (((hb[{m}] >> (2 * k)) & 0x03030303u) << 4))"
           for m in range(8)]
  code = lambda e: f"MAGB({words[e >> 2]}, {e & 3})"
  groups = (("s0", "-32.f * s0", tuple((e, code(e)) for e in range(16))),
            ("s1", "-32.f * s1", tuple((e, code(e)) for e in range(16, 32))))
  return Unit(32, "const size_t b = row * $NB + (u >> 3); const int hh = (u >> 2) & 1, k = u & 3;", loads, decode,
              groups, "{u} * 32", lambda e: e, tuple((f"(int){w}", m) for m, w in enumerate(words)), ioff=-32,
              igroups=(("s0", 0, 4), ("s1", 4, 4)))


# the units of the types whose UNITS are wider than the activations' 32, as the integer dot products read them (W with
# `integer`): one unit of 32 activations against one of 32 codes
IUNITS: dict[int, Unit] = {Q4_K: _k_quant32(qh=False), Q5_K: _k_quant32(qh=True), Q6_K: _q6_k32()}


@dataclass(frozen=True)
class W:
  """A weight argument of a kernel: its planes are params `<prefix><plane>`; rows of `inp` elements. integer: read in
  the units of its integer dot products (IUNITS, where its type has them)."""
  prefix: str
  ggml_type: int
  inp: int
  integer: bool = False

  @property
  def unit(self) -> Unit:
    return IUNITS.get(self.ggml_type, UNITS[self.ggml_type]) if self.integer else UNITS[self.ggml_type]
  @property
  def units(self) -> int: return self.inp // self.unit.elems
  @property
  def nb(self) -> int: return self.inp // QUANT_TYPES[self.ggml_type].block
  @property
  def group_lanes(self) -> int:
    """The lanes of a row group, by the type's own units (the same in integer units, each lane taking more)."""
    return min(32, 1 << (self.inp // UNITS[self.ggml_type].elems - 1).bit_length())
  @property
  def params(self) -> list[str]:
    return [f"const {ct}* __restrict__ {self.prefix}{n}" for n, ct in plane_types(self.ggml_type)]

  def fill(self, c: str) -> str:
    return c.replace("$NB", str(self.nb)).replace("$IN", str(self.inp)).replace("$", self.prefix)


def integer(w: W, act: str) -> W:
  """w as a product with activations in `act` reads it: in its integer dot products' units for q8 and x16."""
  return replace(w, integer=act != "f32")


def plane_types(ggml_type: int) -> tuple[tuple[str, str], ...]:
  """The planes of a weight of this type, in argument order, with their C element types."""
  return tuple((k, CTYPES[dt.name]) for k, (_, _, dt) in LAYOUTS[ggml_type].items())


def supported(ggml_type: int, inp: int) -> bool: return ggml_type in UNITS and inp % UNITS[ggml_type].elems == 0


def unit_loads(w: W, row: str, u: str, tag: str, stream: bool = False) -> str:
  """C: the memory reads of unit u of weight row `row`, into registers named <load name><tag> (declared here)."""
  un = w.unit
  decl = " ".join(f"{t} {n}{tag};" for t, n, _ in un.loads)
  read = (lambda t, a: f"__ldcs((const {t}*)({a}))") if stream else (lambda t, a: f"*(const {t}*)({a})")
  reads = " ".join(f"{n}{tag} = {read(t, w.fill(a))};" for t, n, a in un.loads)
  return f"{decl} {{ const int u = {u}; const size_t row = {row}; {w.fill(un.index)} {reads} }}"


def unit_dot(w: W, row: str, u: str, X: Callable[[int], str], XS: Callable[[int], str] | None, acc: str,
             tag: str) -> str:
  """C: acc += (unit u of weight row `row`) . x from the registers unit_loads(w, row, u, tag) filled, with X(e) the x
  value at element e of the unit and XS(g) the sum of x over group g (None: summed here)."""
  un, lines = w.unit, []
  for g, (scale, mn, elems) in enumerate(un.groups):
    if not un.quantized:
      lines += [f"r = fmaf({X(e)}, {v}, r);" for e, v in elems]
      continue
    body = " ".join(f"s = fmaf({X(e)}, {c}, s);" for e, c in elems)
    xs = XS(g) if XS is not None else "(" + " + ".join(X(e) for e, _ in elems) + ")"
    lines.append(f"{{ float s = 0.f; {body} r = fmaf({scale}, s, r); r = fmaf({mn}, {xs}, r); }}")
  return f"{{ {_unit_values(w, row, u, tag)} float r = 0.f; {' '.join(lines)} {acc} += r; }}"


def unit_idot(w: W, row: str, u: str, xq: Callable[[int], str], dx: str, sq: str, acc: str, tag: str) -> str:
  """C: acc += (unit u of weight row `row`) . x with x quantized to 8 bits (xq(m): the int of activations 4m..4m+3, dx
  their scale, sq the sum of their ints): the dot product in integers (codes with their offset), then the two scales."""
  un = w.unit
  if un.igroups:  # a scale per group: each group's dot, its codes' offset by its activations' sum (a dp4a with ones)
    parts = []
    for g, (scale, first, n) in enumerate(un.igroups):
      dots = " ".join(f"i{g} = __dp4a({c}, {xq(m)}, i{g}); z{g} = __dp4a({xq(m)}, 0x01010101, z{g});"
                      for c, m in un.idot[first:first + n])
      parts.append(f"int i{g} = 0, z{g} = 0; {dots} {acc} += ({scale} * {dx}) * (float)(i{g} + {un.ioff} * z{g});")
    return f"{{ {_unit_values(w, row, u, tag)} {' '.join(parts)} }}"
  dots = " ".join(f"isum = __dp4a({c}, {xq(m)}, isum);" for c, m in un.idot)
  off = f" isum += {un.ioff} * {sq};" if un.ioff else ""
  mn = f" {acc} += ({un.imin} * {dx}) * (float){sq};" if un.imin else ""
  return (f"{{ {_unit_values(w, row, u, tag)} int isum = 0; {dots}{off} {acc} += ({un.iscale} * {dx}) * (float)isum;"
          f"{mn} }}")


def _unit_values(w: W, row: str, u: str, tag: str) -> str:
  """C: unit u of weight row `row` decoded from the registers unit_loads(w, row, u, tag) filled (its index, loads and
  decode)."""
  regs = " ".join(f"const {t} {n} = {n}{tag};" for t, n, _ in w.unit.loads)
  return f"const int u = {u}; const size_t row = {row}; {w.fill(w.unit.index)} {regs} {w.fill(w.unit.decode)}"


# a unit's 8-bit step from its largest |x| (`am`), and the step's inverse: llama.cpp's q8_1 rounding, written here once
# for every kernel that rounds activations (quantize_x, quantize_x16, stage_x, glu's hand-off; dsl.q8_round in tensor
# ops); X16_INV: the inverse of the 16-bit form's remainder step, 1/254 of the 8-bit one (x16_split)
Q8_STEP, Q8_INV, X16_INV = "am / 127.f", "am > 0.f ? 127.f / am : 0.f", "am > 0.f ? 32258.f / am : 0.f"


def q8_code(x: str, q: str) -> str:
  """C: x as its 8-bit code q, rounded to nearest even, with iv (Q8_INV) of its unit in scope."""
  return f"const int {q} = (int)rintf({x} * iv);"


def quantize_x(i: int, un: Unit) -> str:
  """C: the registers x<i>_<e> of one unit as 8-bit integers xq<i>[8] (4 to a word, their sum sq<i>) with the scale
  dx<i> = max|x| / 127, rounded to nearest even: llama.cpp's q8_1 activations, one scale per 32 (model/backends/dsl.py's
  q8_round is the same rounding in tensor ops)."""
  assert un.elems == 32
  am = " ".join(f"am = fmaxf(am, fabsf(x{i}_{e}));" for e in range(32))
  qs = " ".join(q8_code(f"x{i}_{e}", f"q{e}") for e in range(32))
  words = " ".join(f"xq{i}[{m}] = " + " | ".join(f"((q{4 * m + j} & 255) << {8 * j})" for j in range(
    4)) + ";" for m in range(8))
  return (f"float dx{i}; int xq{i}[8], sq{i}; {{ float am = 0.f; {am} dx{i} = {Q8_STEP}; const float iv = {Q8_INV};"
          f" {qs} {words} sq{i} = {' + '.join(f'q{e}' for e in range(32))}; }}")


def x16_split(x: str, h: str, a: str, b: str, dh: str) -> str:
  """C: the value x as quantize_x16's two codes, a (its 8-bit code, h as a float) and b (the remainder at 1/254 of the
  step dh, clamped to 8 bits), with iv (Q8_INV) and il (X16_INV) of its unit in scope: the one place the
  16-bit rounding is written (stage_x, quantize_x16, glu's hand-off; dsl.x16_round in tensor ops)."""
  return (f"const float {h} = rintf({x} * iv); const int {a} = (int){h}, {b} = max(-127, min(127, (int)rintf(fmaf(-{h},"
          f" {dh}, {x}) * il)));")


def quantize_x16(i: int, un: Unit) -> str:
  """C: the registers x<i>_<e> of one unit as two 8-bit planes, x ~ dh<i> * xh<i> + dl<i> * xl<i> (4 to a word each):
  the high plane as quantize_x's, the low plane the remainder at 1/254 of its step, so x is kept to 1/64516 of the
  unit's largest value (16 bits) and the products stay integer dot products at twice q8's count. The codes' offset is
  applied through the float sum of x, not the planes'."""
  assert un.elems == 32
  am = " ".join(f"am = fmaxf(am, fabsf(x{i}_{e}));" for e in range(32))
  qs = " ".join(x16_split(f"x{i}_{e}", f"h{e}", f"a{e}", f"b{e}", f"dh{i}") for e in range(32))
  words = " ".join(f"xh{i}[{m}] = " + " | ".join(f"((a{4 * m + j} & 255) << {8 * j})" for j in range(4)) + "; "
                   + f"xl{i}[{m}] = " + " | ".join(f"((b{4 * m + j} & 255) << {8 * j})" for j in range(
                     4)) + ";" for m in range(8))
  return (f"float dh{i}, dl{i}; int xh{i}[8], xl{i}[8]; {{ float am = 0.f; {am} dh{i} = {Q8_STEP}; dl{i} = dh{i} / "
          f"254.f; const float iv = {Q8_INV}, il = {X16_INV}; {qs} {words} }}")


def unit_idot16(w: W, row: str, u: str, i: int, acc: str, tag: str) -> str:
  """C: acc += (unit u of weight row `row`) . x with x in quantize_x16's two planes (group sum xs<i>_0 for the codes'
  offset)."""
  un = w.unit
  if un.igroups:  # a scale per group: its codes' offset by the sums of its activations' two planes (dp4a with ones)
    parts = []
    for g, (scale, first, n) in enumerate(un.igroups):
      dots = " ".join(f"ih{g} = __dp4a({c}, xh{i}[{m}], ih{g}); il{g} = __dp4a({c}, xl{i}[{m}], il{g});"
                      f" zh{g} = __dp4a(xh{i}[{m}], 0x01010101, zh{g}); zl{g} = __dp4a(xl{i}[{m}], 0x01010101, zl{g});"
                      for c, m in un.idot[first:first + n])
      parts.append(f"int ih{g} = 0, il{g} = 0, zh{g} = 0, zl{g} = 0; {dots} {acc} = fmaf({scale}, fmaf(dh{i}, "
                   f"(float)(ih{g} + {un.ioff} * zh{g}), dl{i} * (float)(il{g} + {un.ioff} * zl{g})), {acc});")
    return f"{{ {_unit_values(w, row, u, tag)} {' '.join(parts)} }}"
  dots = " ".join(f"ih = __dp4a({c}, xh{i}[{m}], ih); il = __dp4a({c}, xl{i}[{m}], il);" for c, m in un.idot)
  off = f" + {float(un.ioff)!r}f * xs{i}_0" if un.ioff else ""
  mn = f" {acc} = fmaf({un.imin}, xs{i}_0, {acc});" if un.imin else ""
  return (f"{{ {_unit_values(w, row, u, tag)} int ih = 0, il = 0; {dots}"
          f" {acc} = fmaf({un.iscale}, fmaf(dh{i}, (float)ih, fmaf(dl{i}, (float)il, 0.f){off}), {acc});{mn} }}")


def sx_at(k: str) -> str:
  """C: the place of input element k in stage_x's padded float32 shared memory `sx`: 4 floats of padding after every
  32, so the lanes of a row group, which read units of 32 or more elements (a Q4_0 block: 128 bytes apart), read
  different banks with their 16-byte loads instead of the same four (on an H100: the residual product 7.8 -> 5.7 us,
  the router 5.2 -> 4.3). gate+up's float32 form, which reads each value for 8 rows, runs faster unpadded (14.7 against
  16.0 us: benchmarks/kernel_lab.py)."""
  return f"({k}) + (({k}) >> 5) * 4"


def block_rs(n: int, eps: float, warps: int) -> str:
  """C, run by the whole block (it synchronises): `rs` = 1/sqrt(mean(x^2) + eps) over x[0..n) from each thread's sum of
  squares `ss` (its share of x), through stage_decl's `sred`; `rs` is declared by the caller."""
  return (f"ss = group_sum(ss, 32); if ((threadIdx.x & 31) == 0) sred[threadIdx.x >> 5] = ss; __syncthreads(); "
          f"float t = 0.f; for (int w = 0; w < {warps}; w++) t += sred[w]; rs = 1.f / sqrtf(t / {n}.f + {eps!r}f);")


def stage_x(xp: str, n: int, eps: float | None, act: str, warps: int = WARPS, pad: bool = True) -> str:
  """C, run by the whole block (it synchronises): the input x[0..n) at xp, RMS-normalised and scaled by `gamma` where
  eps is given, into shared memory once for all the block's warps: as floats `sx` (act f32; pad: each at sx_at), or as
  quantize_x's 8-bit form (act q8): words `sxq`, scales `sdx` and sums `ssq` per unit of 32, or as quantize_x16's two
  planes (act x16): words `sxh` and `sxl`, scales `sdh` and float sums `sxs`. Every read (x and gamma) is issued first,
  so the prologue waits on memory once; each group of 8 lanes holds one unit (4 values a lane), so a unit's largest
  value and its sum are 3 shuffles; the rounding is quantize_x's (quantize_x16's)."""
  assert act in ACTS and n % 32 == 0
  its, out = range(-(-n // (warps * 128))), []
  for it in its:  # lane l of warp w holds x[k..k+4), k = it * 128 * warps + 128 w + 4 l
    gm = f" stg{it} = *(const float4*)(gamma + stk{it});" if eps is not None else ""
    out.append(f"const int stk{it} = {it * warps * 128} + (threadIdx.x >> 5) * 128 + (threadIdx.x & 31) * 4;"
               f" float4 stv{it} = make_float4(0.f, 0.f, 0.f, 0.f), stg{it} = stv{it};"
               f" if (stk{it} < {n}) {{ stv{it} = *(const float4*)({xp} + stk{it});{gm} }}")
  if eps is not None:
    ss = " ".join(f"ss += stv{it}.x * stv{it}.x + stv{it}.y * stv{it}.y + stv{it}.z * stv{it}.z + stv{it}.w * "
                  f"stv{it}.w;" for it in its)
    out.append(f"float rs; {{ float ss = 0.f; {ss} {block_rs(n, eps, warps)} }}")
  for it in its:
    vals = " ".join(f"const float a{j} = " + (
      f"(stv{it}.{c} * rs) * stg{it}.{c};" if eps is not None else f"stv{it}.{c};")
                    for j, c in enumerate("xyzw"))
    k, inside = f"stk{it}", f"stk{it} < {n}"
    if act == "f32":
      out.append(f"if ({inside}) {{ {vals} *(float4*)(sx + {sx_at(k) if pad else k}) = make_float4(a0, a1, a2, a3); }}")
      continue
    if act == "x16":  # quantize_x16's two planes: codes c, remainders b at 1/254 of a step
      cb = " ".join(x16_split(f"a{j}", f"h{j}", f"c{j}", f"b{j}", "dh") for j in range(4))
      word = lambda v: " | ".join(f"(({v}{j} & 255) << {8 * j})" for j in range(4))
      out.append(f"{{ {vals} float am = fmaxf(fmaxf(fabsf(a0), fabsf(a1)), fmaxf(fabsf(a2), fabsf(a3))), xs = a0 + "
                 "a1 + a2 + a3; for (int m = 4; m > 0; m >>= 1) { am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, m));"
                 f" xs += __shfl_xor_sync(0xffffffffu, xs, m); }} const float dh = {Q8_STEP}, iv = {Q8_INV},"
                 f" il = {X16_INV}; {cb} if ({inside}) {{ sxh[{k} >> 2] = {word('c')};"
                 f" sxl[{k} >> 2] = {word('b')}; if (({k} & 31) == 0) {{ sdh[{k} >> 5] = dh; sxs[{k} >> 5] = xs; }} }}"
                 " }")
      continue
    q = " ".join(q8_code(f"a{j}", f"q{j}") for j in range(4))
    out.append(f"{{ {vals} float am = fmaxf(fmaxf(fabsf(a0), fabsf(a1)), fmaxf(fabsf(a2), fabsf(a3)));"
               " for (int m = 4; m > 0; m >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, m));"
               f" const float iv = {Q8_INV}; {q} int sq = q0 + q1 + q2 + q3;"
               " for (int m = 4; m > 0; m >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, m);"
               f" if ({inside}) {{ sxq[{k} >> 2] = (q0 & 255) | ((q1 & 255) << 8) | ((q2 & 255) << 16) | ((q3 & 255) "
               f"<< 24); if (({k} & 31) == 0) {{ sdx[{k} >> 5] = {Q8_STEP}; ssq[{k} >> 5] = sq; }} }} }}")
  out.append("__syncthreads();")
  return " ".join(out)


def stage_decl(n: int, act: str, warps: int = WARPS, pad: bool = True) -> str:
  """C: the shared memory stage_x fills (declared once at the top of a kernel whose branches stage)."""
  arrays = {"f32": f"__align__(16) float sx[{n + n // 8 if pad else n}]",  # read and written as float4
            "q8": f"__align__(16) int sxq[{n // 4}]; __shared__ int ssq[{n // 32}]; __shared__ float sdx[{n // 32}]",
            "x16": f"__align__(16) int sxh[{n // 4}]; __shared__ __align__(16) int sxl[{n // 4}]; __shared__ float "
                   f"sdh[{n // 32}], sxs[{n // 32}]"}[act]
  return f"__shared__ {arrays}; __shared__ float sred[{warps}];"


def load_xq(i: int, words: str, scales: str, sums: str, u: str, units: int | None = None) -> str:
  """C: xq<i>[8], dx<i>, sq<i> of unit u of an input in quantize_x's 8-bit form (C arrays of its words, 8 a unit, of its
  scales and of its sums; stage_x's shared memory or glu's q8 hand-off), zero where u is past `units` (None: u is
  always a unit of the input)."""
  guard = f"if ({u} < {units}) " if units is not None else ""
  return (f"int xq{i}[8] = {{0, 0, 0, 0, 0, 0, 0, 0}}; float dx{i} = 0.f; int sq{i} = 0; {guard}{{"
          f" const int4 a = *(const int4*)({words} + ({u}) * 8), b = *(const int4*)({words} + ({u}) * 8 + 4);"
          f" xq{i}[0] = a.x; xq{i}[1] = a.y; xq{i}[2] = a.z; xq{i}[3] = a.w; xq{i}[4] = b.x; xq{i}[5] = b.y; xq{i}[6] "
          f"= b.z; xq{i}[7] = b.w; dx{i} = {scales}[{u}]; sq{i} = {sums}[{u}]; }}")


def load_xq16(i: int, u: str, units: int) -> str:
  """C: xh<i>[8], xl<i>[8], dh<i>, dl<i> and the unit's float sum xs<i>_0 of unit u of stage_x's x16 form (shared memory
  sxh, sxl, sdh, sxs), zero where u is past `units`: what unit_idot16 reads."""
  z = "{0, 0, 0, 0, 0, 0, 0, 0}"
  ld = lambda a, v: (f"{{ const int4 c = *(const int4*)({a} + ({u}) * 8), d = *(const int4*)({a} + ({u}) * 8 + 4);"
                     + "".join(f" {v}{i}[{m}] = {'c' if m < 4 else 'd'}.{'xyzw'[m % 4]};" for m in range(8)) + " }")
  return (f"int xh{i}[8] = {z}, xl{i}[8] = {z}; float dh{i} = 0.f, dl{i} = 0.f, xs{i}_0 = 0.f; if ({u} < {units}) {{ "
          f"{ld('sxh', 'xh')} {ld('sxl', 'xl')} dh{i} = sdh[{u}]; dl{i} = dh{i} / 254.f; xs{i}_0 = sxs[{u}]; }}")


def _runs(un: Unit) -> list[tuple[int, int]]:
  """(first element, offset) of each run of 4 consecutive input floats of a unit (float4 loads)."""
  return [(e, un.xoff(e)) for e in range(0, un.elems, 4)]


def load_x(w: W, i: int, xp: str, u: str, pad: bool = False) -> str:
  """C: registers x<i>_<e> (and group sums xs<i>_<g>) for unit u of an input at xp, zero where u is past the row; pad:
  xp is stage_x's padded shared memory (sx_at)."""
  un, out = w.unit, []
  out.append(" ".join(f"float x{i}_{e} = 0.f;" for e in range(un.elems)))
  loads = []
  for e, off in _runs(un):
    idx = f"{un.xbase.format(u=f'({u})')} + {off}"
    loads.append(f"{{ const float4 v = *(const float4*)({xp} + {sx_at(idx) if pad else idx});")
    loads.append(" ".join(f"x{i}_{e + k} = v.{c};" for k, c in enumerate("xyzw")) + " }")
  out.append(f"if ({u} < {w.units}) {{ {' '.join(loads)} }}")
  if un.quantized:
    out += [f"const float xs{i}_{g} = " + " + ".join(f"x{i}_{e}" for e, _ in elems) + ";" for g, (
      _, _, elems) in enumerate(un.groups)]
  return " ".join(out)


def prefetch_rows(comps: list[tuple[W, str, str]], first: str, last: str, lane: str, lanes: int) -> str:
  """C: L2 prefetches of every plane of each component's rows `first` .. `last` (C expressions of output rows), 128
  bytes a lane, from lanes `lane` of `lanes`. Fire and forget: the bytes are on their way while the kernel does other
  work (an RMSNorm prologue, another slot), and its loads then find them in L2 instead of waiting on memory one after
  another."""
  out = []
  for w, row, _ in comps:
    layout = LAYOUTS[w.ggml_type]
    for plane, (a, b, _) in layout.items():
      rb = (w.inp if len(layout) == 1 else w.nb) * (b - a)
      lo, hi = f"(({row.format(o=first)}) * {rb})", f"(({row.format(o=last)}) + 1) * {rb}"
      out.append(f"{{ const unsigned char* pp = (const unsigned char*){w.prefix}{plane};"
                 f" for (size_t k = ({lo} & ~(size_t)127) + {lane} * 128; k < {hi}; k += {lanes * 128}) PREFETCH(pp + "
                 f"k); }}")
  return " ".join(out)


# a kernel's wait for the kernels before it (PRELUDE's GRID_WAIT; model/backends/cuda_graph.py), stamped in the
# timeline's build
WAIT = "GRID_WAIT(); STAMP_WAIT();"
# parameters a kernel may read before its wait, besides its weights: `early_pos`, the step's position as the attention
# and mla_vb name it, and `early_sel`, the selected experts as down names them. The kernel before each (the absorption;
# gate+up) reads it (as `pos`; `sel`) after its wait, so whichever kernel writes it has finished when they start (a
# kernel starts once every block of the one before it has waited on the one before that); down reads it through L2
# (__ldcg). Kernels without that guarantee name it `pos` (`sel`) and read it after their wait.
EARLY = ("early_pos", "early_sel", "early_logits", "early_bias")
ACTS = ("f32", "q8", "x16")  # a gemv's input: float32, 8 bits per 32 (llama.cpp's q8_1), or two 8-bit planes (16 bits)


def gemv(comps: list[tuple[W, str, str]], xp: str, rows: int, R: int, epilogue: Callable[[str, list[str]], str] | None,
         G: int | None = None, prologue: str = "", act: str = "f32", early: bool = False, staged: bool = False,
         pad: bool = True, wait: bool = False) -> str:
  """C body: the row group of this lane computes outputs o = obase .. obase+R-1 (< rows) of one or more components, each
  a weight with its row for output o (a C template with `{o}`) and an accumulator name; all components share the input
  at xp. `obase`, `gl` (lane in group) must be defined; epilogue(o, accs) is C run by lane 0 of the group for each valid
  o (None: the reduced sums stay in every lane's accumulators). G: the row group width (default: the weights' own).
  prologue: C run before the products. act: the input's form in the products
  (ACTS; q8 and x16 for types with integer codes, `idot`). early: each chunk's weight reads are issued before the work
  that precedes its products (the first chunk's before the prologue, the next chunk's before this one's products).
  staged: the prologue is stage_x's, and x comes from its shared memory (xp `sx` for f32, padded where `pad` says, as
  stage_x wrote it): x takes no registers, so the row group's reads go out in one chunk (up to STAGED_READS a lane), as
  weak loads the prologue's barrier holds before the products. wait (with early; for rows that do not depend on
  the kernel's inputs): the kernel's GRID_WAIT goes between the first chunk's weight reads and the prologue, so the
  reads are in flight while the kernels before it finish."""
  assert early or not wait, "the wait follows the early reads"
  comps = [(integer(w, act), row, a) for w, row, a in comps]
  w0 = comps[0][0]
  assert all((w.inp, w.unit.elems) == (w0.inp, w0.unit.elems)
             for w, _, _ in comps), ("components of one gemv share the input " "layout")
  assert act in ACTS and (act == "f32" or all(w.unit.idot
                                              for w, _, _ in comps)), (f"{act} activations need integer " "codes")
  G, nw = G or w0.group_lanes, w0.unit.elems
  per_lane = -(-w0.units // G)
  # x in registers bounds a chunk (XREGS); staged, x is in shared memory and every read of the row group goes out at
  # once
  upl = per_lane if staged and per_lane * R * len(comps) <= STAGED_READS else max(1, min(per_lane, XREGS // nw))
  nch = -(-per_lane // upl)
  accs = [f"{a}{r}" for _, _, a in comps for r in range(R)]
  # rows past the end and units past the row are clamped, not skipped (their x is zero, their sums are not stored), so
  # no weight load sits behind a branch and a lane issues all of its loads at once
  body = [" ".join(f"float {a} = 0.f;" for a in accs) + " " + " ".join(
    f"const int o{r} = min(obase + {r}, {rows - 1});" for r in range(R))]
  work = [(w, row, a, r, i) for r in range(R) for w, row, a in comps for i in range(upl)]
  def units(c: str) -> tuple[list[str], list[str]]:
    us = [f"({c} * {G * upl} + gl + {G * i})" for i in range(upl)]
    return us, us if nch * upl * G == w0.units else [f"min({u}, {w0.units - 1})" for u in us]
  def loads(c: str, tag: str) -> list[str]:  # every read of a chunk before any use
    uw = units(c)[1]
    return [unit_loads(w, row.format(o=f"o{r}"), uw[i], f"_{a}{r}_{i}{tag}", staged) for w, row, a, r, i in work]
  def products(c: str, tag: str, reads: list[str]) -> list[str]:  # reads: C issued after the chunk's x is ready
    us, uw = units(c)
    if staged and act == "q8": out = [load_xq(i, "sxq", "sdx", "ssq", us[i], w0.units) for i in range(upl)]
    elif staged and act == "x16": out = [load_xq16(i, us[i], w0.units) for i in range(upl)]
    else: out = [load_x(w0, i, xp, us[i], staged and pad) for i in range(upl)]
    if act == "q8" and not staged: out += [quantize_x(i, w0.unit) for i in range(upl)]
    if act == "x16" and not staged: out += [quantize_x16(i, w0.unit) for i in range(upl)]
    out += reads
    for w, row, a, r, i in work:
      row, acc, rt = row.format(o=f"o{r}"), f"{a}{r}", f"_{a}{r}_{i}{tag}"
      if act == "q8": out.append(unit_idot(w, row, uw[i], lambda m, i=i: f"xq{i}[{m}]", f"dx{i}", f"sq{i}", acc, rt))
      elif act == "x16": out.append(unit_idot16(w, row, uw[i], i, acc, rt))
      else:
        out.append(unit_dot(w, row, uw[i], lambda e, i=i: f"x{i}_{e}",
                            (lambda g, i=i: f"xs{i}_{g}") if w.unit.quantized else None, acc, rt))
    return out
  if early:  # chunks unrolled: chunk c + 1's reads go out before chunk c's products
    body += loads("0", "_0") + ([WAIT] if wait else []) + [prologue]
    for c in range(nch):
      if c + 1 < nch: body += loads(str(c + 1), f"_{c + 1}")
      body.append("{ " + " ".join(products(str(c), f"_{c}", [])) + " }")
  else:
    body += [prologue, f"for (int c = 0; c < {nch}; c++) {{", *products("c", "", loads("c", "")), "}"]
  body.append(" ".join(f"{a} = group_sum({a}, {G});" for a in accs))
  for r in range(R if epilogue is not None else 0):
    body.append(f"if (gl == 0 && obase + {r} < {rows}) {{ const int o = obase + {r}; "
                f"{epilogue('o', [f'{a}{r}' for _, _, a in comps])} }}")
  return "\n  ".join(body)


def group_setup(G: int, R: int, cta_rows_dim: str = "blockIdx.x", warps: int = WARPS) -> str:
  """C: gl (lane in row group), obase (first output row of the group) and wbase (of the warp) for warps of 32/G groups
  of R rows each."""
  per_warp = 32 // G
  return (f"const int lane = threadIdx.x & 31, gl = lane & {G - 1}, wbase = ({cta_rows_dim} * {warps} + (threadIdx.x "
          f">> 5)) * {per_warp * R}; const int obase = wbase + (lane >> {G.bit_length() - 1}) * {R};")


def rows_per_block(G: int, R: int, warps: int = WARPS) -> int: return warps * (32 // G) * R


def expert_id(v: str, experts: int) -> str:
  """C: the expert id v clamped to the experts, so no id reads outside the expert weights."""
  return f"min(max({v}, 0), {experts - 1})"


def signature(name: str, params: list[str], threads: int = THREADS, resident: int = 1) -> str:
  """A kernel's signature: its name and parameters, the launch's side of its source. resident: the blocks a
  multiprocessor must be able to hold at once (__launch_bounds__' second argument: ptxas caps the registers to fit
  them)."""
  bounds = f"{threads}, {resident}" if resident > 1 else f"{threads}"
  return f"extern \"C\" __global__ void __launch_bounds__({bounds}) {name}({', '.join(params)} STAMP_PARAM)"


def kernel(name: str, params: list[str], body: str, threads: int = THREADS, waited: bool = False,
           resident: int = 1, **defines: int | str) -> str:
  """The source of a kernel whose body is generated here; it starts with GRID_WAIT unless `waited` (its body waits on
  every path before it touches any buffer but its weights: model/backends/cuda_graph.py lets it start while the kernels
  before it finish). defines: those of the device files it includes."""
  body = body if waited else f"{WAIT}\n  {body}"
  return (_defines(defines) + PRELUDE
          + includes(f"\n{signature(name, params, threads, resident)} {{\n  STAMP_ENTER();\n  {body}\n}}\n"))


def device_kernel(name: str, params: list[str], file: str, threads: int = THREADS,
                  generated: dict[str, str] | None = None, pre: tuple[str, ...] = (), **defines: int | str) -> str:
  """The source of a kernel whose body is the device file `file` (which stamps its entry and waits itself): the defines
  its variant needs (names and numbers), the common helpers, the device files `pre` (helpers of its own), its signature
  and the file, one string, as tinygrad compiles a single source. generated: C generated here (gemv's products, for
  now) in place of the file's lines that hold its key alone."""
  body = device_file(file)
  for key, c in (generated or {}).items():
    body = re.sub(rf"^[ \t]*{key}[ \t]*$", lambda _, c=c: "  " + c, body, flags=re.M)
  helpers = "".join("\n" + device_file(f) for f in pre)
  return _defines(defines) + PRELUDE + helpers + f"\n{signature(name, params, threads)} {{\n{body}}}\n"


def _defines(defines: dict[str, int | str]) -> str: return "".join(f"#define {k} {v}\n" for k, v in defines.items())


def stamped(src: str) -> str:
  """A kernel's source in the step timeline's build (PRELUDE's Stamp): one more parameter, `stamp_slot`, its launch's
  4 words of stamps (model/profile.py step_timeline)."""
  return "#define STAMP\n" + src


REGS = 65536  # 32-bit registers a multiprocessor holds (every CUDA device since compute capability 5.0 up to 9.0)
# the fewest registers a thread of glu (dense) is held to for one wave: ptxas spills at most 4 (112) bytes a thread of
# glu's 16-bit (float32) form at 128 and 48 of DeepSeek-V2-Lite's q_a/kv_a product at 80 (sm_90)
GLU_REGS, DENSE_REGS = 128, 80


def one_wave(blocks: int, threads: int, sms: int, least_regs: int) -> int:
  """The blocks a multiprocessor must hold for a grid of `blocks` to run as one wave on `sms` multiprocessors, where
  that leaves each thread at least `least_regs` registers; else (or with no device) 1, no bound. In one wave every
  block is resident as the kernel before it ends, so all of them issue their weight reads early (cuda_graph's
  programmatic launch); where the bound only cuts a grid's waves, its spills cost more than it saves (DeepSeek-V2-Lite's
  float32 gate+up: -1% end to end on an H100)."""
  need = -(-blocks // sms) if sms else 1
  return need if 1 < need <= REGS // (least_regs * threads) else 1


@dataclass(frozen=True)
class Kernel:
  name: str
  src: str
  grid: tuple[int, int, int]
  outs: tuple[int, ...]  # params written (the rest are read)
  threads: int = THREADS  # per block


# ------------------------------------------------------------------ products of the backend (tensor API)
# -----------------

def _tile_body(w: W, role: str, out: int, dims: dict[str, int]) -> str:
  """The multi-token (prefill) product: one warp per output row, lanes over units, x read from memory, TOKENS tokens
  share each weight read."""
  tn, n = dims["tn"], dims["n"]
  if role == "dense":
    setup = (f"const size_t wrow = o; const int t0 = blockIdx.y * {tn}, nt = min({tn}, {n} - t0);"
             f" auto xrow = [&](int t) {{ return x + (size_t)(t0 + t) * {w.inp}; }};"
             f" auto outidx = [&](int t) {{ return (size_t)(t0 + t) * {out} + o; }};")
  elif role == "per_head":
    H = dims["heads"]
    setup = (f"const int h = blockIdx.y; const size_t wrow = (size_t)h * {out} + o; const int t0 = blockIdx.z * {tn}, "
             f"nt = min({tn}, {n} - t0); auto xrow = [&](int t) {{ return x + ((size_t)(t0 + t) * {H} + h) * "
             f"{w.inp}; }}; auto outidx = [&](int t) {{ return ((size_t)(t0 + t) * {H} + h) * {out} + o; }};")
  else:
    setup = (f"const int y = blockIdx.y, e = {expert_id('sel[y]', dims['experts'])}; const size_t wrow = (size_t)e "
             f"* {out} + o; const int nt = 1; auto xrow = [&](int t) {{ return x + (size_t)({dims['xk']} > 1 ? y : y / "
             f"{dims['k']}) * {w.inp}; }}; auto outidx = [&](int t) {{ return (size_t)y * {out} + o; }};")
  un = w.unit
  xidx = lambda e: f"xrow(t)[{un.xbase.format(u='uu')} + {un.xoff(e)}]"
  dot = unit_loads(w, "wrow", "uu", "_") + " " + unit_dot(w, "wrow", "uu", xidx, None, "acc[t]", "_")
  return (f"const int lane = threadIdx.x & 31, o = blockIdx.x * {WARPS} + (threadIdx.x >> 5); if (o >= {out}) return; "
          f"{setup}\n  float acc[{tn}]; for (int t = 0; t < {tn}; t++) acc[t] = 0.f;\n"
          f"  for (int uu = lane; uu < {w.units}; uu += 32) {{ for (int t = 0; t < {tn}; t++) {{ if (t >= nt) break; "
          f"{dot} }} }}\n  for (int t = 0; t < {tn}; t++) {{ const float a = group_sum(acc[t], 32); if (lane == 0 && t "
          f"< nt) out[outidx(t)] = a; }}")


# output rows per row group of single-token products; of wide ones (WIDE rows or more), and of wide ones of a type
R_PRODUCT, R_WIDE, WIDE = 4, 8, 16384
WIDE_ROWS = {Q4_0: 16}


def single_token_form(ggml_type: int, out: int) -> tuple[str, int]:
  """(act, R) of a single-token product with `out` rows. A wide one (the output head: many waves of blocks) is bound by
  its instruction count, not by latency: it reads x as two 8-bit planes (x16: integer dot products, 16 bits of x) where
  the type has integer codes, else float32, with the rows per group of its type (WIDE_ROWS, else R_WIDE). On an H200
  (benchmarks/kernel_sweep.py --kinds head), DeepSeek-V2-Lite's head of Q4_0 takes 40.34 us at 16 rows against 45.40 at
  8 (+0.5-1.0% end to end), of Q8_0 59.35 at 8 against 98.16 at 16."""
  if out < WIDE: return "f32", R_PRODUCT
  return ("x16" if UNITS[ggml_type].idot else "f32"), WIDE_ROWS.get(ggml_type, R_WIDE)


@functools.cache
def product(role: str, ggml_type: int, shape: tuple[int, ...], **dims: int) -> Kernel:
  """One product of the backend: role dense (out = x @ w.T), per_head or expert; shape: the weight's (..., out, in).
  dims: n (tokens) and tn (tokens per tile) for dense/per_head, heads; experts, k (slots per token), xk (inputs per
  token) and slots (all tokens' slots) for expert. Single-token products issue their weight reads first (gemv's
  `early`)."""
  out, inp = shape[-2:]
  w = W("w_", ggml_type, inp)
  single = role == "expert" or dims.get("n") == 1
  act, R = single_token_form(ggml_type, out) if single else ("f32", 0)
  sizes = "_".join(map(str, (*shape, *dims.values())))
  name = f"native_{role}_{QUANT_TYPES[ggml_type].name.lower()}_{sizes}{_act_tag(act)}"
  params = (["float* out", "const float* __restrict__ x"]
            + (["const int* __restrict__ sel"] if role == "expert" else []) + w.params)
  if not single:
    grid = (-(-out // WARPS), -(-dims["n"] // dims["tn"]),
            1) if role == "dense" else (-(-out // WARPS), dims["heads"], -(-dims["n"] // dims["tn"]))
    return Kernel(name, kernel(name, params, _tile_body(w, role, out, dims)), grid, (0,))
  G = w.group_lanes
  blocks = -(-out // rows_per_block(G, R))
  # x into shared memory once per block (the wide x16 products quantize it per lane)
  staged = act == "f32" and inp <= STAGE_MAX
  def body(xp: str, row: str, store: str) -> str:
    return (group_setup(G, R) + (" " + stage_decl(inp, "f32") if staged else "") + "\n  "
            + gemv([(w, row, "a")], "sx" if staged else xp, out, R, lambda o, a: f"{store.format(o=o)} = {a[0]};",
                   prologue=stage_x(xp, inp, None, "f32") if staged else "", act=act, early=True, staged=staged,
                   wait=role != "expert"))
  if role == "dense":
    return Kernel(name, kernel(name, params, body("x", "{o}", "out[{o}]"), waited=True), (blocks, 1, 1), (0,))
  if role == "per_head":
    src = (f"const int h = blockIdx.y; const float* xh = x + (size_t)h * {inp};\n  "
           + body("xh", f"(size_t)h * {out} + {{o}}", f"out[(size_t)h * {out} + {{o}}]"))
    return Kernel(name, kernel(name, params, src, waited=True), (blocks, dims["heads"], 1), (0,))
  src = (f"const int y = blockIdx.y, e = {expert_id('sel[y]', dims['experts'])};"
         f" const float* xe = x + (size_t)({dims['xk']} > 1 ? y : y / {dims['k']}) * {inp};\n  "
         + body("xe", f"(size_t)e * {out} + {{o}}", f"out[(size_t)y * {out} + {{o}}]"))
  return Kernel(name, kernel(name, params, src), (blocks, dims["slots"], 1), (0,))


@functools.cache
def rows(ggml_type: int, shape: tuple[int, int], n: int) -> Kernel:
  """out (n, in) = rows sel[0..n) of a (rows, in) weight as float32 (the embedding lookup): a thread per unit of a row,
  the units over blockIdx.x and the rows over blockIdx.y; an id outside the weight reads its nearest row."""
  V, inp = shape
  w = W("w_", ggml_type, inp)
  un, threads = w.unit, min(THREADS, -(-w.units // 32) * 32)
  value = lambda scale, mn, c: c if scale is None else f"fmaf({scale}, {c}, {mn})"
  values = " ".join(f"o[{un.xbase.format(u='uu')} + {un.xoff(e)}] = {value(scale, mn, c)};"
                    for scale, mn, elems in un.groups for e, c in elems)
  name = f"native_rows_{QUANT_TYPES[ggml_type].name.lower()}_{V}_{inp}_{n}"
  body = (f"const int uu = blockIdx.x * {threads} + threadIdx.x; if (uu >= {w.units}) return;"
          f" const size_t r = {expert_id('sel[blockIdx.y]', V)}; float* o = out + (size_t)blockIdx.y * {inp};\n  "
          f"{unit_loads(w, 'r', 'uu', '_')} {{ {_unit_values(w, 'r', 'uu', '_')} {values} }}")
  params = ["float* out", "const int* __restrict__ sel", *w.params]
  return Kernel(name, kernel(name, params, body, threads), (-(-w.units // threads), n, 1), (0,), threads)


# ------------------------------------------------------------------ fused decode stages (one token)
# ----------------------

def _gemv_block(ws: list[tuple[W, str, str]], xp: str, rows: int, R: int, epilogue, prologue: str = "",
                act: str = "f32", early: bool = False, staged: bool = False, warps: int = WARPS,
                pad: bool = True, wait: bool = False, cta: str = "blockIdx.x") -> str:
  """A braced gemv with its own row-group setup (its weights' group width), so kernels can branch between weight types;
  with `staged` (the prologue is stage_x's and synchronises the block), a block with no rows leaves before it. cta:
  the block's index among the gemv's blocks."""
  G = ws[0][0].group_lanes
  leave = f" if ({cta} * {rows_per_block(G, R, warps)} >= {rows}) return;" if staged else ""
  body = gemv(ws, xp, rows, R, epilogue, prologue=prologue, act=act, early=early, staged=staged, pad=pad, wait=wait)
  return "{ " + group_setup(G, R, cta, warps) + leave + "\n  " + body + " }"


QKV_ROWS, QKV_WARPS = 2, 8  # the first attention kernel (q_a and kv_a, norm folded): rows per row group, warps a block
# (on an H100: DeepSeek-V2-Lite 5.8 -> 4.9 us against 4 and 4, GLM-4.7-Flash the same; benchmarks/kernel_sweep.py)


@functools.cache
def dense(ws: tuple[tuple[W, int], ...], R: int, eps: float | None = None, residual: bool = False,
          warps: int = WARPS, act: str = "f32", sms: int = 0) -> Kernel:
  """out_j = [res +] W_j . [rmsnorm(x) * gamma] for each weight j (blockIdx.y picks it): a norm folded into one or two
  products of one input (q_a and kv_a; the output head: head), or a residual add folded into one (the attention
  output). Each warp issues its weight reads first; the block (`warps` warps) stages x (normalised, with a norm) once
  into shared memory while they are in flight (stage_x), up to STAGE_MAX inputs; act q8 (x16): staged in quantize_x's
  8-bit form (quantize_x16's two planes), read by integer dot products. sms: the device's multiprocessors, so the grid
  runs as one wave where 80 registers a thread allow it (one_wave)."""
  assert act in ACTS
  tag = "_".join(f"{QUANT_TYPES[w.ggml_type].name.lower()}x{rows}x{w.inp}" for w, rows in ws)
  name = f"native_dense_{'norm_' if eps is not None else ''}{'res_' if residual else ''}{tag}{_act_tag(act)}"
  params = [f"float* out{j}" for j in range(len(ws))] + ["const float* __restrict__ x"]
  params += (["const float* __restrict__ gamma"] if eps is not None else []) + ([
    "const float* __restrict__ res"] if residual else [])
  for w, _ in ws: params += w.params
  inp = ws[0][0].inp
  staged = eps is not None or inp <= STAGE_MAX or act != "f32"
  pro, xp, body = ((stage_x("x", inp, eps, act, warps), "sx", [stage_decl(inp, act, warps)]) if staged
                   else ("", "x", []))
  for j, (w, rows) in enumerate(ws):
    epi = lambda o, a, j=j: f"out{j}[{o}] = " + (f"res[{o}] + {a[0]};" if residual else f"{a[0]};")
    body.append(f"if (blockIdx.y == {j}) " + _gemv_block([(w, "{o}", "a")], xp, rows, R, epi, pro, act, True, staged,
                                                         warps, wait=True))
  blocks = max(-(-rows // rows_per_block(w.group_lanes, R, warps)) for w, rows in ws)
  res = one_wave(blocks * len(ws), 32 * warps, sms, DENSE_REGS)
  name += f"_b{res}" if res > 1 else ""
  return Kernel(name, kernel(name, params, "\n  ".join(body), 32 * warps, waited=True, resident=res),
                (blocks, len(ws), 1), tuple(range(len(ws))), 32 * warps)


def head(ggml_type: int, shape: tuple[int, int], eps: float) -> Kernel:
  """The output head of one token with the final RMSNorm folded in: out = W . rmsnorm(x) * gamma, a dense kernel in
  single_token_form's input form, x normalised and staged once a block (stage_x; x16: quantized once a block, not once
  a warp), where the norm's two tinygrad kernels ran before the product. Staged, a wide head runs fastest at R_WIDE
  rows a group (WIDE_ROWS is for x quantized by each warp): on an H200 (benchmarks/kernel_sweep.py --kinds head),
  GLM-4.7-Flash's head of Q4_0 with x16 takes 48.16 us at 8 rows, 58.71 at 16, and 57.41 without the norm as the
  product's 16 rows ran it."""
  out, inp = shape
  act, R = single_token_form(ggml_type, out)
  return dense(((W("a_", ggml_type, inp), out),), R_WIDE if out >= WIDE else R, eps, act=act)


@functools.cache
def absorb_rope_kv(kb: W, heads: int, nope: int, rope: int, kvl: int, max_ctx: int, eps: float, cache_half: bool,
                   R: int = 2) -> Kernel:
  """MLA's per-token step before attention: per head, q_nope absorbed through k_b into the compressed space (blockIdx.y
  < H); the extra row of blocks (blockIdx.y == H) rotates q_pe, normalises c_kv, rotates k_pe and writes [c_kv, k_pe]
  to the KV cache row of the position, an element a thread (each block sums c_kv's squares itself), so no block waits
  on memory more than once before its stores. Out: qc (H, kvl + rope) = [q_abs, rotated q_pe] and the cache."""
  name = (f"native_mla_absorb_{QUANT_TYPES[kb.ggml_type].name.lower()}_h{heads}_{nope}_{rope}_{kvl}_c{max_ctx}"
          f"{'' if cache_half else '_f32'}")
  absorb = _gemv_block([(kb, f"(size_t)h * {kvl} + {{o}}", "a")], "xh", kvl, R,
                       lambda o, a: f"qc[(size_t)h * {kvl + rope} + {o}] = {a[0]};", early=True, wait=True)
  blocks = -(-kvl // rows_per_block(kb.group_lanes, R))
  ct = "unsigned short" if cache_half else "float"
  params = ["float* qc", f"{ct}* cache", "const float* __restrict__ q", "const float* __restrict__ kv",
            "const float* __restrict__ gamma", "const float* __restrict__ cosv", "const float* __restrict__ sinv",
            "const int* __restrict__ pos"] + kb.params
  src = device_kernel(name, params, "absorb_rope_kv.cu", HEADS=heads, NOPE=nope, ROPE=rope, KVL=kvl, EPS=f"{eps!r}f",
                      CACHE_HALF=int(cache_half), WARPS=WARPS, THREADS=THREADS, NT=blocks * THREADS,
                      generated={"ABSORB": absorb})
  return Kernel(name, src, (blocks, heads + 1, 1), (0, 1))


ATT_CHUNK, ATT_SPLITS = 32, 64  # the fewest positions an MLA attention block scores, the most splits of the context


def attention_splits(max_ctx: int) -> tuple[int, int]:
  """(positions per split, splits) of the MLA attention kernel for a cache of max_ctx positions: ATT_CHUNK positions per
  block, more where the context is long, at most ATT_SPLITS splits."""
  ch = max(ATT_CHUNK, -(-max_ctx // ATT_SPLITS))
  return ch, -(-max_ctx // ch)


ATT_BATCH = 8  # positions a warp scores at once (independent loads and reductions, then one softmax update)
ATT_MERGE = 8  # splits whose outputs mla_vb's blocks read at once (every column of a thread: one wait on L2 for 8)


@functools.cache
def mla_attention(heads: int, kvl: int, rope: int, max_ctx: int, scale: float, cache_half: bool) -> Kernel:
  """MLA decode attention over the compressed cache, split over the context (grid: heads x splits): each block scores
  its positions with the absorbed query (all kvl + rope dims; the values are the cache's first kvl dims: V is a slice of
  K), keeps an online softmax per warp, merges its warps and writes its split's (max, sum, unnormalised output) to part
  (H, splits, kvl + 2); blocks past the last position return at once. mla_vb merges the splits. Both read the position
  before they wait on the kernel before them (EARLY), so only one wait on memory follows that wait."""
  ch, S = attention_splits(max_ctx)
  name = f"native_mla_attention_parts_h{heads}_{kvl}_{rope}_c{max_ctx}{'' if cache_half else '_f32'}"
  params = ["float* part", "const float* __restrict__ qc", f"const {'unsigned short' if cache_half else 'float'}* "
            "__restrict__ cache", "const int* __restrict__ early_pos"]
  src = device_kernel(name, params, "mla_attention.cu", KVL=kvl, ROPE=rope, CH=ch, SPLITS=S, SCALE=f"{scale!r}f",
                      CACHE_HALF=int(cache_half), WARPS=WARPS, THREADS=THREADS, BATCH=ATT_BATCH)
  return Kernel(name, src, (heads, S, 1), (0,))


AH_THREADS, AH_TILE = 256, 16  # the all-heads attention's threads a block, and the positions it stages at once
AH_LEAST = 64  # the fewest positions a split of it holds: a split's partial (heads x kv_lora floats) is not worth less
COMBINE_COLS = 32  # the columns a block of mla_combine merges (a warp's loads of a split: one 128-byte line)


def heads_splits(max_ctx: int, sms: int) -> int:
  """The splits of the all-heads attention for a cache of max_ctx positions: two blocks a multiprocessor, fewer where
  the cache holds fewer tiles. The positions a split holds follow the step's position (cuda/heads_split.cuh)."""
  return min(2 * sms, -(-max_ctx // AH_LEAST))


@functools.cache
def mla_attention_heads(heads: int, kvl: int, rope: int, max_ctx: int, scale: float, cache_half: bool,
                        sms: int) -> Kernel:
  """MLA decode attention for all heads at once (grid: splits of the context): each block reads each position of its
  split once, AH_TILE at a time staged as float16, scores it against every head and accumulates P . V on the tensor
  cores (mma.cuh), and writes its split's (max, sum, unnormalised output) per head to part (H, splits, kvl + 2) for
  mla_combine."""
  S = heads_splits(max_ctx, sms)
  name = f"native_mla_attention_heads_h{heads}_{kvl}_{rope}_c{max_ctx}_s{S}{'' if cache_half else '_f32'}"
  params = ["float* part", "const float* __restrict__ qc", f"const {'unsigned short' if cache_half else 'float'}* "
            "__restrict__ cache", "const int* __restrict__ early_pos"]
  src = device_kernel(name, params, "mla_heads.cu", threads=AH_THREADS, pre=("mma.cuh",), HEADS=heads, KVL=kvl,
                      ROPE=rope, SPLITS=S, SCALE=f"{scale!r}f", CACHE_HALF=int(cache_half), THREADS=AH_THREADS,
                      TP=AH_TILE, LEAST=AH_LEAST)
  return Kernel(name, src, (S, 1, 1), (0,), AH_THREADS)


@functools.cache
def mla_combine(heads: int, kvl: int, max_ctx: int, sms: int) -> Kernel:
  """The all-heads attention's splits merged once per head (grid: heads x blocks of COMBINE_COLS columns, its warps
  over the splits): o (H, kvl), which mla_vb (merged) reads."""
  S = heads_splits(max_ctx, sms)
  name = f"native_mla_combine_h{heads}_{kvl}_s{S}"
  params = ["float* o", "const float* __restrict__ part", "const int* __restrict__ early_pos"]
  src = device_kernel(name, params, "mla_combine.cu", threads=AH_THREADS, KVL=kvl, SPLITS=S, TP=AH_TILE,
                      THREADS=AH_THREADS, CC=COMBINE_COLS, MERGE=ATT_MERGE, LEAST=AH_LEAST)
  return Kernel(name, src, (heads, kvl // COMBINE_COLS, 1), (0,), AH_THREADS)


MLA_MERGE = '\n#include "mla_merge.cuh"\n'  # mla_vb's prologue
MLA_LOAD = '\n#include "mla_load.cuh"\n'  # mla_vb's prologue after mla_combine


@functools.cache
def mla_vb(vb: W, heads: int, kvl: int, v_head: int, max_ctx: int, merged: bool = False) -> Kernel:
  """MLA's output per head, out (H, v_head) = v_b . o (grid: row blocks x heads): each block issues its v_b rows' reads,
  then stages o in shared memory while they are in flight: merged, o as mla_combine wrote it; else merging the head's
  splits of mla_attention, ATT_MERGE splits at a time, each thread's columns and their maxes and sums together through
  L2 (`__ldcg`: one wait for all of them), rescaled as an online softmax from one chunk to the next."""
  ch, S = attention_splits(max_ctx)
  assert vb.inp == kvl
  G, R = vb.group_lanes, R_PRODUCT
  name = f"native_mla_vb_{QUANT_TYPES[vb.ggml_type].name.lower()}_h{heads}_{kvl}_{v_head}_c{max_ctx}"
  if merged:
    name, first = name + "_o", f"const int h = blockIdx.y; {stage_decl(kvl, 'f32')}"
    params = ["float* out", "const float* __restrict__ o"] + vb.params
  else:
    first = f"const int h = blockIdx.y, active = (early_pos[0] + {ch}) / {ch}; {stage_decl(kvl, 'f32')}"
    params = ["float* out", "const float* __restrict__ part", "const int* __restrict__ early_pos"] + vb.params
  body = (first + "\n  " + group_setup(G, R) + "\n  " + gemv([(vb, f"(size_t)h * {v_head} + {{o}}", "a")], "sx", v_head,
          R, lambda o, a: f"out[(size_t)h * {v_head} + {o}] = {a[0]};", prologue=MLA_LOAD if merged else MLA_MERGE,
          early=True, staged=True, wait=True))
  blocks = -(-v_head // rows_per_block(G, R))
  defines = dict(KVL=kvl, THREADS=THREADS) if merged else dict(SPLITS=S, KVL=kvl, MERGE=ATT_MERGE, THREADS=THREADS)
  return Kernel(name, kernel(name, params, body, waited=True, **defines), (blocks, heads, 1), (0,))


GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}


@dataclass(frozen=True)
class Route:
  """How an MoE block chooses k of its experts from the router's logits and weights them: the gating function (GATING),
  the selection bias, the weights' normalisation and scale, as the model says. forced (the correctness check only): the
  ids used come from an input (`force`) and the kernel's own top k goes to an extra output, so a candidate runs with the
  reference's routing while its own is compared."""
  experts: int
  k: int
  gating: int
  bias: bool
  norm_w: bool
  w_scale: float
  forced: bool = False

  @property
  def tag(self) -> str:
    return (f"k{self.k}_{GATING[self.gating]}{'_bias' if self.bias else ''}{'_norm' if self.norm_w else ''}"
            f"{'_forced' if self.forced else ''}")

  def params(self, pre: str = "") -> list[str]:
    """The inputs `rank` (named with `pre`) and `used` read besides the logits."""
    return (([f"const float* __restrict__ {pre}bias"] if self.bias else [])
            + (["const int* __restrict__ force"] if self.forced else []))

  def defines(self, threads: int, pre: str = "") -> dict[str, int | str]:
    """The defines of route_rank.cuh and route_weights.cuh for a block of `threads` whose logits and bias parameters
    are named with `pre`."""
    scale = {"ROUTE_SCALE": f"{self.w_scale!r}f"} if self.w_scale not in (0.0, 1.0) else {}
    return dict(ROUTE_E=self.experts, ROUTE_K=self.k, ROUTE_GATING=self.gating, ROUTE_BIAS=int(self.bias),
                ROUTE_NORM=int(self.norm_w), ROUTE_FORCED=int(self.forced), ROUTE_THREADS=threads,
                ROUTE_LOGITS=f"{pre}logits", ROUTE_BIAS_IN=f"{pre}bias") | scale

  def used(self, t: str) -> str:
    """C: the expert slot t uses (rank's `ssel`, or `force` where forced), clamped to the experts."""
    return f"ROUTE_USED({t})"


# Route's ranking (every thread of the block) and weights (one thread, after it) in a generated body, with the route's
# defines in the kernel's source
ROUTE_RANK, ROUTE_WEIGHTS = '\n#include "route_rank.cuh"\n', '\n#include "route_weights.cuh"\n'
ROUTER_R, ROUTER_WARPS = 1, 4  # the router's rows per row group and warps per block: 16 blocks for 64 experts


@functools.cache
def router(w: W, eps: float, route: Route, logits_only: bool = False) -> Kernel:
  """The MoE router in one kernel: each block computes some experts' logits from the normalised input (RMSNorm folded);
  the last block to finish (an atomic count, reset by it) reads them once through L2, ranks them (Route.rank) and
  writes the ids used and their weights (Route.weights); forced: its own top k to `own`. logits_only: the logits alone,
  for gate+up and down to route from themselves (their `route`)."""
  name = f"native_router_{QUANT_TYPES[w.ggml_type].name.lower()}_{route.experts}x{w.inp}"
  name += "_logits" if logits_only else f"_{route.tag}"
  R, warps = ROUTER_R, ROUTER_WARPS
  products = _gemv_block([(w, "{o}", "a")], "sx", route.experts, R, lambda o, a: f"logits[{o}] = {a[0]};",
                         stage_x("x", w.inp, eps, "f32", warps), "f32", True, True, warps, wait=True)
  blocks = -(-route.experts // rows_per_block(w.group_lanes, R, warps))
  if logits_only:
    params = ["float* logits", "const float* __restrict__ x", "const float* __restrict__ gamma"] + w.params
    body = f"{stage_decl(w.inp, 'f32', warps)}\n  {products}"
    return Kernel(name, kernel(name, params, body, 32 * warps, waited=True), (blocks, 1, 1), (0,), 32 * warps)
  params = (["int* sel", "float* wts", "float* logits", "int* cnt"] + (["int* own"] if route.forced else [])
            + ["const float* __restrict__ x", "const float* __restrict__ gamma"] + route.params() + w.params)
  src = device_kernel(name, params, "router.cu", 32 * warps, **route.defines(32 * warps),
                      generated={"ROUTER_PRODUCTS": f"{stage_decl(w.inp, 'f32', warps)}\n  {products}"})
  return Kernel(name, src, (blocks, 1, 1), (0, 1, 2, 3) + ((4,) if route.forced else ()), 32 * warps)


@dataclass(frozen=True)
class FFN:
  """The FFN weights one pair of fused kernels reads: gate and up (one merged weight with `up_off` rows, or two), down,
  rows of the hidden layer; experts > 0 for a routed stack (rows indexed by the selected expert)."""
  gate: W
  up: W
  down: W
  hidden: int
  experts: int = 0
  gate_rows: int = 0  # rows per expert of the gate (and up) weight: hidden, or 2*hidden when merged
  up_off: int = 0  # row of up's first row inside its expert's rows (hidden when gate and up are one merged weight)

  @property
  def merged(self) -> bool: return self.up_off > 0
  @property
  def params(self) -> list[str]: return self.gate.params + ([] if self.merged else self.up.params)


def _ffn_w(f: FFN, tag: str) -> FFN:
  """The FFN with its weights' plane prefixes set for kernel parameters (routed: r, plain: p)."""
  gate = W(f"{tag}g_", f.gate.ggml_type, f.gate.inp)
  up = gate if f.merged else W(f"{tag}u_", f.up.ggml_type, f.up.inp)
  return FFN(gate, up, W(f"{tag}d_", f.down.ggml_type, f.down.inp), f.hidden, f.experts, f.gate_rows, f.up_off)


def _act_tag(act: str) -> str: return "" if act == "f32" else f"_{act}"


def _ffn_tag(f: FFN | None) -> str:
  if f is None: return "none"
  t = lambda w: QUANT_TYPES[w.ggml_type].name.lower()
  return f"{t(f.gate)}{'m' if f.merged else t(f.up)}{t(f.down)}x{f.hidden}" + (f"e{f.experts}" if f.experts else "")


@functools.cache
def glu(routed: FFN | None, plain: FFN | None, k: int, dim: int, eps: float, R: int = 4, act: str = "f32",
        handoff: bool = False, sms: int = 0, route: Route | None = None) -> Kernel:
  """SiLU(gate) * up of the normalised input (RMSNorm folded) for the k selected experts of a routed stack (slots
  0..k-1) and a plain FFN (the shared expert, or a dense block's FFN; slot k), into act = [k x hidden, plain hidden].
  The grid is one row of blocks, the plain FFN's first, then each slot's, as many as its rows need: DeepSeek-V2-Lite's
  routed slots are half as wide as its shared experts, and the plain FFN's blocks start (and read their weights)
  earliest, as the grid's first. Each warp issues its weight reads first; the block normalises the input once into
  shared memory (quantized to 8 bits per 32 with act q8, to two 8-bit planes with x16) while they are in flight
  (stage_x). handoff (act q8 or x16): a block computes 32 consecutive outputs (as many warps as that takes) and writes
  them in the form down's products read (act_in): quantize_x's (every unit's 8 words, then every unit's scale, then its
  sum) or quantize_x16's (every unit's 8 words of codes, then its 8 of remainders, its scale, its float sum); HANDOFF
  floats a unit. sms: the device's multiprocessors, so the grid runs as one wave where 128 registers a thread allow it
  (one_wave). route: each routed block chooses its expert from the router's `logits` after its wait (Route.rank), in
  place of reading `sel`, and each slot's first block writes its own choice to `own` (for the correctness check; forced:
  `force`'s)."""
  assert not handoff or act in HANDOFF, act
  assert route is None or (routed is not None and route.k == k), "a route for the routed stack"
  name = f"native_glu_{_ffn_tag(routed)}_{_ffn_tag(plain)}_k{k}_{dim}{_act_tag(act)}{f'_out{act}' if handoff else ''}"
  name += f"_route_{route.tag}" if route else ""
  r, p = routed and _ffn_w(routed, "r"), plain and _ffn_w(plain, "p")
  params = (["float* act"] + (["int* own"] if route else [])
            + ["const float* __restrict__ x", "const float* __restrict__ gamma"])
  if r: params += ["const float* __restrict__ logits"] + route.params() if route else ["const int* __restrict__ sel"]
  params += (r.params if r else []) + (p.params if p else [])
  G = (r or p).gate.group_lanes
  warps = handoff_warps(G, R) if handoff else WARPS
  assert not handoff or (warps >= 1 and rows_per_block(G, R, warps) == 32
                         and all(f.hidden % 32 == 0 for f in (r, p) if f)), ("32 outputs " "a block")
  silu = lambda a: f"({a[0]} * (1.f / (1.f + expf(-{a[0]})))) * {a[1]}"
  units = ((k * r.hidden if r else 0) + (p.hidden if p else 0)) // 32
  # one row of blocks: the plain FFN's first (their weight rows are fixed: they read them before the wait), then each
  # routed slot's, each only as many as its rows need; (bx, by): a block's index in its FFN, and its slot (k: plain)
  nb = lambda f: -(-f.hidden // rows_per_block(f.gate.group_lanes, R, warps)) if f else 0
  pb, rb = nb(p), nb(r)
  slot_of = (f"const int bx = blockIdx.x < {pb} ? blockIdx.x : (blockIdx.x - {pb}) % {max(rb, 1)}, "
             f"by = blockIdx.x < {pb} ? {k if r else 0} : (blockIdx.x - {pb}) / {max(rb, 1)};")
  pro, body = (stage_x("x", dim, eps, act, warps, False), [slot_of, stage_decl(dim, act, warps, False)]
               + (["__shared__ float sact[32];"] if handoff else []))
  block = lambda ws, rows, epi, wait: _gemv_block(ws, "sx", rows, R, epi, pro, act, True, True, warps, False, wait,
                                                  "bx")
  def store(base: str):  # the output of row o, at act[base + o], or into its block's 32 for the hand-off
    if not handoff: return lambda o, a: f"act[{base} + {o}] = {silu(a)};"
    return lambda o, a: f"sact[{o} - bx * 32] = {silu(a)};"
  # warp 0 writes the block's 32 outputs as one unit g, rounded as quantize_x (quantize_x16) rounds
  pack = lambda v, at: (f"{{ const int c1 = __shfl_down_sync(0xffffffffu, {v}, 1), c2 = __shfl_down_sync(0xffffffffu, "
                        f"{v}, 2), c3 = __shfl_down_sync(0xffffffffu, {v}, 3); if ((l & 3) == 0) ((int*)act)[{at} + "
                        f"(l >> 2)] = ({v} & 255) | ((c1 & 255) << 8) | ((c2 & 255) << 16) | ((c3 & 255) << 24); }}")
  rounding = {
    "q8": (f"{q8_code('v', 'q')} int sq = q; for (int m = 16; m > 0; m >>= 1) sq += __shfl_xor_sync(0xffffffffu, "
           f"sq, m); {pack('q', 'g * 8')} if (l == 0) {{ act[{units * 8} + g] = {Q8_STEP}; ((int*)act)[{units * 9} + g]"
           " = sq; }"),
    "x16": (f"const float dh = {Q8_STEP}, il = {X16_INV}; {x16_split('v', 'h', 'a', 'b', 'dh')}"
            " float xs = v; for (int m = 16; m > 0; m >>= 1) xs += __shfl_xor_sync(0xffffffffu, xs, m);"
            f" {pack('a', 'g * 8')} {pack('b', f'{units * 8} + g * 8')} if (l == 0) {{ act[{units * 16} + g] = dh;"
            f" act[{units * 17} + g] = xs; }}")}
  def quantize(base: str) -> str:
    if not handoff: return ""
    return (f" __syncthreads(); if (threadIdx.x < 32) {{ const int l = threadIdx.x, g = ({base} + bx * 32) / "
            f"32; const float v = sact[l]; const float am = warp_max(fabsf(v)), iv = {Q8_INV}; {rounding[act]} }}")
  if r:
    choose = (f"{ROUTE_RANK} const int y = by, e = {route.used('y')};"
              + " if (bx == 0 && threadIdx.x == 0) own[y] = ssel[y];" if route
              else f"const int y = by, e = {expert_id('sel[y]', r.experts)};")
    body.append(f"if (by < {k}) {{ {WAIT} {choose}\n  "
                + block([(r.gate, f"(size_t)e * {r.gate_rows} + {{o}}", "g"),
                         (r.up, f"(size_t)e * {r.gate_rows} + {r.up_off} + {{o}}", "u")],
                        r.hidden, store(f"(size_t)y * {r.hidden}"), False) + quantize(f"y * {r.hidden}") + " }")
  if p:
    base = k * r.hidden if r else 0
    body.append(f"if (by == {k if r else 0}) {{ "
                + block([(p.gate, "{o}", "g"), (p.up, f"{p.up_off} + {{o}}", "u")], p.hidden,
                        store(str(base)), True) + quantize(str(base)) + " }")
  grid = (pb + k * rb, 1, 1)
  res = one_wave(grid[0], 32 * warps, sms, GLU_REGS)
  name += f"_b{res}" if res > 1 else ""
  src = kernel(name, params, "\n  ".join(body), 32 * warps, waited=True, resident=res,
               **(route.defines(32 * warps) if route else {}))
  return Kernel(name, src, grid, (0, 1) if route else (0,), 32 * warps)


HANDOFF = {"q8": 10, "x16": 18}  # floats a unit of 32 activations takes in glu's hand-off, by form (glu's docstring)


def handoff_blocks(routed: FFN | None, plain: FFN | None, k: int) -> int:
  """The blocks glu runs with its hand-off (one per 32 outputs of each slot)."""
  return (k * -(-routed.hidden // 32) if routed else 0) + (-(-plain.hidden // 32) if plain else 0)


def down_reads_handoff(routed: FFN | None, plain: FFN | None) -> bool:
  """Whether down splits over units for these FFNs (and so can read glu's hand-off)."""
  base = routed or plain
  return not (routed and plain) or (plain.down.ggml_type == base.down.ggml_type and plain.hidden % base.hidden == 0)


def handoff_warps(G: int, R: int) -> int:
  """The warps of a glu block with the hand-off: 32 outputs, R rows per group of G lanes."""
  return 32 // ((32 // G) * R)


def handoff_fits(routed: FFN | None, plain: FFN | None, k: int, sms: int, R: int) -> bool:
  """Whether glu's blocks of 32 outputs with the hand-off (R rows per group: handoff_warps, at most GLU_REGS registers a
  thread) run as one wave on a device of `sms` multiprocessors."""
  threads = 32 * handoff_warps((routed or plain).gate.group_lanes, R)
  return handoff_blocks(routed, plain, k) <= REGS // (GLU_REGS * threads) * sms


# the rows a block of down (split over units) sums: 8, and 16 above 256 threads with a float input, whose units take
# registers that leave one such block a multiprocessor, so that 16 rows keep the grid one wave (DeepSeek-V2-Lite's 384
# threads on an H200: 8-bit 8.51 us against 10.64 with 8 rows, float32 10.02 against 10.99); from glu's hand-off a
# thread needs 70 registers at 8 rows, two blocks a multiprocessor (6.54 us against 6.96 with 16;
# benchmarks/kernel_sweep.py)
DOWN_ROWS = (8, 16)


@functools.cache
def down(routed: FFN | None, plain: FFN | None, k: int, dim: int, act: str = "f32", act_in: str = "f32",
         route: Route | None = None) -> Kernel:
  """out = res + sum over the k selected experts of weight_k * (down_e . act_k) + down_plain . act_plain: the routed
  experts' down projections, their weighted combine, the shared expert (or a dense block's down projection) and the
  residual add. Split over units (_down_units) where down_reads_handoff, else a warp per slot (_down_slots). act_in q8
  or x16: act is glu's hand-off in that form. route: the experts and their weights come from the router's logits
  (`early_logits`, EARLY: glu read them after its wait), ranked by the block before its weight reads (Route.rank), in
  place of `early_sel` and `wts`; forced: it waits first, then reads `force`."""
  assert route is None or (routed is not None and route.k == k), "a route for the routed stack"
  if down_reads_handoff(routed, plain): return _down_units(routed, plain, k, dim, act, act_in, route)
  assert act_in == "f32", "a warp per slot reads float activations"
  return _down_slots(routed, plain, k, dim, 4 if act == "f32" else 8, act, route)


def lane_sums(accs: list[str], lane: str = "lane", G: int = 32) -> tuple[str, str]:
  """C: the sums of accs over each group of G lanes, scattered over its lanes: afterwards `lsum` in lane l holds the sum
  of accs[k], k the returned C expression of l (lanes l and l + len(accs) hold the same). A butterfly: each level sends
  half of a lane's remaining sums to its partner and keeps the other half, so n sums take n - 1 + log2(G / n) shuffles,
  not n log2(G); len(accs) is a power of two up to G."""
  n, cur, out, d = len(accs), list(accs), [], 1
  assert n & (n - 1) == 0 and n <= G
  while len(cur) > 1:
    h, nxt = len(cur) // 2, []
    for i in range(h):
      out.append(f"const float bf{d}_{i} = (({lane} & {d}) ? {cur[i + h]} : {cur[i]})"
                 f" + __shfl_xor_sync(0xffffffffu, ({lane} & {d}) ? {cur[i]} : {cur[i + h]}, {d});")
      nxt.append(f"bf{d}_{i}")
    cur, d = nxt, d * 2
  # the levels left: each lane's one sum, plainly
  rest = (1 << b for b in range(d.bit_length() - 1, G.bit_length() - 1))
  out.append(f"float lsum = {cur[0]};" + "".join(f" lsum += __shfl_xor_sync(0xffffffffu, lsum, {m});" for m in rest))
  bits = n.bit_length() - 1
  return " ".join(out), " | ".join(f"((({lane} >> {b}) & 1) << {bits - 1 - b})" for b in range(bits)) or "0"


def _down_combine(store: str, R: int, dim: int, warps: int) -> list[str]:
  """C: the block's per-warp sums of output rows obase..obase+R-1 (`store` puts them into part[warp][row]) added up over
  its warps, plus the residual, into out."""
  return [f"__shared__ float part[{warps}][{R}];", store, "__syncthreads();",
          f"if (threadIdx.x < {R} && obase + threadIdx.x < {dim}) {{ float t = 0.f; for (int w = 0; w < {warps}; w++) "
          "t += part[w][threadIdx.x]; out[obase + threadIdx.x] = res[obase + threadIdx.x] + t; }"]


def _down_routing(r: FFN | None, route: Route | None, threads: int) -> tuple[list[str], str, Callable[[str], str],
                                                                          str, Callable[[str], str]]:
  """down's routing, for a block of `threads`: (its parameters, C before its weight reads, the C expert of slot s, C
  after its wait that makes the weights readable (every thread), the C weight of slot s). The router's choice
  (`early_sel`, read through L2, and `wts`), or with a route its own from the logits (forced: waiting first)."""
  if r is None: return [], "", lambda sl: "0", "", lambda sl: "1.f"
  if route is None:
    return (["const int* __restrict__ early_sel", "const float* __restrict__ wts"], "",
            lambda sl: expert_id(f"__ldcg(early_sel + {sl})", r.experts), "", lambda sl: f"wts[{sl}]")
  keep = f"__shared__ float swt[{route.k}]; if (threadIdx.x == 0) {{ {ROUTE_WEIGHTS} }}"
  return (["const float* __restrict__ early_logits"] + route.params("early_"),
          (f"{WAIT} " if route.forced else "") + ROUTE_RANK, route.used, keep + " __syncthreads();",
          lambda sl: f"swt[{sl}]")


def _down_defines(route: Route | None, threads: int) -> dict[str, int | str]:
  """down's defines for its route: Route.defines of the `early_` parameters, the weights kept in shared `swt`."""
  return route.defines(threads, "early_") | {"ROUTE_STORE(t, wv)": "swt[t] = wv;"} if route else {}


def _down_slots(routed: FFN | None, plain: FFN | None, k: int, dim: int, R: int, act: str,
                route: Route | None = None) -> Kernel:
  """down with a warp per slot: a block computes R output rows; its warps take the slots (the k experts, then the plain
  FFN) in turn, each its slot's rows in full, and the warps' sums meet in shared memory. Every slot's rows are
  prefetched into L2 before the kernel's wait (the selected experts are `early_sel`: EARLY). For FFNs the unit layout
  cannot take."""
  name = f"native_down_{_ffn_tag(routed)}_{_ffn_tag(plain)}_k{k}_{dim}{_act_tag(act)}_slots"
  name += f"_route_{route.tag}" if route else ""
  r, p = routed and _ffn_w(routed, "r"), plain and _ffn_w(plain, "p")
  rparams, choose, expert, weights, weight = _down_routing(r, route, THREADS)
  params = ["float* out", "const float* __restrict__ res", "const float* __restrict__ act"]
  params += (rparams + r.down.params if r else []) + (p.down.params if p else [])
  slots = (k if r else 0) + (1 if p else 0)
  first, last = "obase", f"min(obase + {R - 1}, {dim - 1})"
  fetch = ([f"if (sl < {k}) {{ const int e = {expert('sl')}; "
            + prefetch_rows([(r.down, f"(size_t)e * {dim} + {{o}}", "")], first, last, "lane", 32) + " }"] if r else [])
  fetch += [f"{'else ' if r else ''}{{ " + prefetch_rows([(p.down, "{o}", "")], first, last, "lane",
                                                         32) + " }"] if p else []
  body = [f"const int lane = threadIdx.x & 31, gl = lane, warp = threadIdx.x >> 5, obase = blockIdx.x * {R};", choose,
          # every slot's rows on their way first, while the kernels before it finish
          f"for (int sl = warp; sl < {slots}; sl += {WARPS}) {{ {' '.join(fetch)} }}",
          "" if route and route.forced else WAIT, weights,
          " ".join(f"float tot{i} = 0.f;" for i in range(R)), f"for (int sl = warp; sl < {slots}; sl += {WARPS}) {{"]
  if r:
    body.append(f"if (sl < {k}) {{ const int e = {expert('sl')}; const float wk = {weight('sl')};"
                f" const float* xk = act + (size_t)sl * {r.hidden};\n  "
                + gemv([(r.down, f"(size_t)e * {dim} + {{o}}", "a")], "xk", dim, R, None, 32, act=act) + "\n  "
                + " ".join(f"tot{i} += wk * a{i};" for i in range(R)) + " }")
  if p:
    xp = f"act + {k * r.hidden if r else 0}"
    body.append(f"{'else ' if r else ''}{{ " + gemv([(p.down, "{o}", "b")], xp, dim, R, None, 32, act=act) + "\n  "
                + " ".join(f"tot{i} += b{i};" for i in range(R)) + " }")
  body += ["}",
           *_down_combine("if (lane == 0) { " + " ".join(f"part[warp][{i}] = tot{i};" for i in range(R)) + " }", R, dim,
                          WARPS)]
  return Kernel(name, kernel(name, params, "\n  ".join(body), waited=True, **_down_defines(route, THREADS)),
                (-(-dim // R), 1, 1), (0,))


def _down_handoff(act_in: str, threads: int, J: int, P: int) -> list[str]:
  """C: each thread's J units of glu's hand-off (act_in q8 or x16; none for f32) into shared memory, read back after the
  barrier: 8 words (at float `at` of act) to the thread's 8 in `sw`, then the unit's scale and sum."""
  t = lambda j: f"(threadIdx.x + {threads * j})"
  words = lambda sw, at, j: (f"{{ const int4* a = (const int4*)act + ({at}) / 4; ((int4*){sw})[{t(j)} * 2] = a[0];"
                             f" ((int4*){sw})[{t(j)} * 2 + 1] = a[1]; }}")
  if act_in == "q8":
    return [f"__shared__ __align__(16) int sxq[{threads * J * 8}], ssq[{threads * J}]; __shared__ float "
            f"sdx[{threads * J}];"] + [
      f"{words('sxq', f'p{j} * 8', j)} sdx[{t(j)}] = act[{P * 8} + p{j}]; ssq[{t(j)}] = ((const int*)act)["
      f"{P * 9} + p{j}];" for j in range(J)]
  if act_in == "x16":
    return [f"__shared__ __align__(16) int sxh[{threads * J * 8}]; __shared__ __align__(16) int sxl["
            f"{threads * J * 8}]; __shared__ float sdh[{threads * J}], sxs[{threads * J}];"] + [
      f"{words('sxh', f'p{j} * 8', j)} {words('sxl', f'{P * 8} + p{j} * 8', j)} sdh[{t(j)}] = act[{P * 16} + "
      f"p{j}]; sxs[{t(j)}] = act[{P * 17} + p{j}];" for j in range(J)]
  return []


def _down_units(routed: FFN | None, plain: FFN | None, k: int, dim: int, act: str, act_in: str = "f32",
                route: Route | None = None) -> Kernel:
  """down with the work split over (slot, unit) pairs: the k routed slots and the plain FFN's rows cut into slots of the
  routed hidden width are one list of units; each thread of a block (as many threads as units, in warps, up to 512)
  takes one or more, issues the reads of its units for the block's R rows at once and adds their weighted products into
  R sums, which meet through a butterfly (lane_sums) and shared memory. R (DOWN_ROWS) keeps the grid one wave. The
  weight reads go out before the kernel's wait (the selected experts are `early_sel`: EARLY), so they are in flight
  while gate+up finishes; they are weak loads before a barrier; glu's hand-off (act_in q8 or x16, the form of the
  products) crosses it through shared memory, so no product can start before every read is out."""
  base = routed or plain
  Fv, ty = base.hidden, base.down.ggml_type
  r, p = routed and _ffn_w(routed, "r"), plain and _ffn_w(plain, "p")
  assert act_in in ("f32", act), "a hand-off in the products' form"
  name = f"native_down_{_ffn_tag(routed)}_{_ffn_tag(plain)}_k{k}_{dim}{_act_tag(act)}"
  name += (f"_in{act_in}" if act_in != "f32" else "") + (f"_route_{route.tag}" if route else "")
  kr = k if r else 0
  m = plain.hidden // Fv if p else 0  # virtual slots of the plain FFN
  U = Fv // integer(W("", ty, Fv), act).unit.elems
  P = (kr + m) * U
  threads = min(512, 128 * -(-P // 128))
  R, J = DOWN_ROWS[threads > 256 and act_in == "f32"], -(-P // threads)
  rparams, choose, expert, weights, weight = _down_routing(r, route, threads)
  params = ["float* out", "const float* __restrict__ res", "const float* __restrict__ act"]
  params += (rparams + r.down.params if r else []) + (p.down.params if p else [])
  body = [f"const int obase = blockIdx.x * {R}, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;", choose,
          " ".join(f"float acc{i} = 0.f; const int o{i} = min(obase + {i}, {dim - 1});" for i in range(R))]
  loads, ws, rows = [], [integer(W(f"j{j}_", ty, Fv), act) for j in range(J)], []
  for j, w in enumerate(ws):
    sj = f"s{j}"
    sel_planes = " ".join(f"const {ct}* __restrict__ j{j}_{n} = "
                          + (f"isr{j} ? rd_{n} : pd_{n};" if r and p else f"{'rd_' if r else 'pd_'}{n};")
                          for n, ct in plane_types(ty))
    loads.append(f"const int p{j} = min((int)threadIdx.x + {threads * j}, {P - 1}); const bool live{j} = "
                 f"(int)threadIdx.x + {threads * j} < {P}; const int s{j} = p{j} / {U}, u{j} = p{j} % {U}; const bool "
                 f"isr{j} = s{j} < {kr}; const int e{j} = "
                 f"{f'isr{j} ? {expert(sj)} : 0' if r else '0'}; "
                 f"{sel_planes}")
    rows.append([f"(isr{j} ? (size_t)e{j} * {dim} + o{i} : (size_t)o{i} * {max(m, 1)} + (s{j} - {kr}))" if r
                 and p else (
                 f"((size_t)e{j} * {dim} + o{i})" if r else f"((size_t)o{i} * {m} + s{j})") for i in range(R)])
    loads += [unit_loads(w, row, f"u{j}", f"_{j}_{i}", True) for i, row in enumerate(rows[j])]
  # the reads out while gate+up finishes (EARLY: early_sel, early_logits)
  body += loads + ([] if route and route.forced else [WAIT]) + [weights]
  body += _down_handoff(act_in, threads, J, P) + ["__syncthreads();"]
  t = lambda j: f"(threadIdx.x + {threads * j})"
  for j, w in enumerate(ws):
    sj = f"s{j}"
    if act_in == "q8": xs = [load_xq(j, "sxq", "sdx", "ssq", t(j))]
    elif act_in == "x16": xs = [load_xq16(j, t(j), threads * J)]
    else:
      xs = [load_x(w, j, f"(act + (size_t)s{j} * {Fv})", f"u{j}")] + (
        [quantize_x(j, w.unit)] if act == "q8" else [quantize_x16(j, w.unit)] if act == "x16" else [])
    wk = f"(live{j} ? {f'(isr{j} ? {weight(sj)} : 1.f)' if r else '1.f'} : 0.f)"
    dots = []
    for i, row in enumerate(rows[j]):
      t = f"t{j}_{i}"
      if act == "q8": d = unit_idot(w, row, f"u{j}", lambda mm, j=j: f"xq{j}[{mm}]", f"dx{j}", f"sq{j}", t, f"_{j}_{i}")
      elif act == "x16": d = unit_idot16(w, row, f"u{j}", j, t, f"_{j}_{i}")
      else:
        d = unit_dot(w, row, f"u{j}", lambda e, j=j: f"x{j}_{e}",
                     (lambda g, j=j: f"xs{j}_{g}") if w.unit.quantized else None, t, f"_{j}_{i}")
      dots.append(f"{{ float {t} = 0.f; {d} acc{i} = fmaf(wk{j}, {t}, acc{i}); }}")
    body.append("{ " + " ".join(xs) + f" const float wk{j} = {wk}; " + " ".join(dots) + " }")
  sums, k = lane_sums([f"acc{i}" for i in range(R)])
  body += [sums, *_down_combine(f"if (lane < {R}) part[warp][{k}] = lsum;", R, dim, threads // 32)]
  return Kernel(name, kernel(name, params, "\n  ".join(body), threads, waited=True, **_down_defines(route, threads)),
                (-(-dim // R), 1, 1), (0,), threads)
