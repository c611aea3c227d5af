"""tests/cuda_cpu.py runs CUDA C on the CPU: each primitive against numpy (bit for bit where the GPU's result is exact),
the misuse and faults it reports, and every native product kernel (model/backends/cuda_src.py) of each type and role
against the product of the weight dequantized by gguf."""
from __future__ import annotations

import os

import cuda_cpu
import numpy as np
import pytest
from products import TYPES, kernel_weight

from model.backends import cuda_src


@pytest.fixture(autouse=True)
def _gxx() -> None:
  """Without g++ the tests skip, except in CI (where the Makefile installs it): there the launch's error fails them."""
  if not cuda_cpu.available() and not os.environ.get("CI"):
    pytest.skip("g++ is not installed (`make deps` installs it)")


SHUFFLES = r"""
extern "C" __global__ void shuffles(int* out, long long* wide, const float* f, float* sums) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x, n = gridDim.x * blockDim.x;
  int k = 0;
  for (int w = 1; w <= 32; w *= 2) {
    out[k++ * n + t] = __shfl_sync(0xffffffffu, t, 37, w);
    out[k++ * n + t] = __shfl_up_sync(0xffffffffu, t, 3, w);
    out[k++ * n + t] = __shfl_down_sync(0xffffffffu, t, 3, w);
    out[k++ * n + t] = __shfl_xor_sync(0xffffffffu, t, 5, w);
  }
  wide[t] = __shfl_down_sync(0xffffffffu, (long long)t << 33, 1);
  float a = f[t], b = f[t];
  for (int m = 16; m > 0; m >>= 1) a += __shfl_xor_sync(0xffffffffu, a, m);
  for (int d = 16; d > 0; d >>= 1) b += __shfl_down_sync(0xffffffffu, b, d);
  sums[2 * t] = a, sums[2 * t + 1] = b;
}
"""


def test_warp_shuffles() -> None:
  """CUDA's documented sources for each shuffle and width (a source lane past the width wraps; a later segment or a lane
  off the warp gives the lane its own value), 8-byte values, and float reductions equal to numpy's in the same order."""
  n, rng = 128, np.random.default_rng(0)
  out, wide, f, sums = (np.zeros((24, n), np.int32), np.zeros(n, np.int64), rng.standard_normal(n).astype(np.float32),
                        np.zeros((n, 2), np.float32))
  cuda_cpu.launch(SHUFFLES, "shuffles", (2, 1, 1), (64, 1, 1), [out, wide, f, sums])
  t = np.arange(n)
  lane, base = t % 32, t - t % 32
  for i, w in enumerate(2 ** np.arange(6)):
    seg = lane - lane % w
    want = (seg + 37 % w, np.where(lane % w >= 3, lane - 3, lane), np.where(lane % w + 3 < w, lane + 3, lane),
            np.where(lane ^ 5 < seg + w, lane ^ 5, lane))
    for j, lanes in enumerate(want): assert (out[4 * i + j] == base + lanes).all(), (w, j)
  assert (wide == np.where(lane < 31, t + 1, t).astype(np.int64) << 33).all()
  a, b = f.reshape(-1, 32).copy(), f.reshape(-1, 32).copy()
  for m in (16, 8, 4, 2, 1): a = a + a[:, np.arange(32) ^ m]
  for d in (16, 8, 4, 2, 1): b = b + b[:, np.where(np.arange(32) + d < 32, np.arange(32) + d, np.arange(32))]
  assert (sums[:, 0] == a.reshape(-1)).all() and (sums[:, 1] == b.reshape(-1)).all()


def test_votes_in_a_partial_warp() -> None:
  """A block of 48 threads: the second warp has 16 lanes, and the lanes that do not exist do not vote."""
  src = r"""
  extern "C" __global__ void votes(unsigned* out) {
    const int t = threadIdx.x;
    out[3 * t] = __ballot_sync(0xffffffffu, t % 3 == 0);
    out[3 * t + 1] = __any_sync(0xffffffffu, t == 40);
    out[3 * t + 2] = __all_sync(0xffffffffu, t < 40) + 2 * __all_sync(0xffffffffu, t < 48);
  }"""
  out = np.zeros((48, 3), np.uint32)
  cuda_cpu.launch(src, "votes", (1, 1, 1), (48, 1, 1), [out])
  t = np.arange(48)
  ballot = [sum(1 << (u - 32 * w) for u in range(32 * w, min(32 * w + 32, 48)) if u % 3 == 0) for w in (0, 1)]
  assert (out[:, 0] == np.array(ballot)[t // 32]).all()
  assert (out[:, 1] == (t >= 32)).all() and (out[:, 2] == np.where(t < 32, 3, 2)).all()


def test_shared_memory_reduction_across_3d_blocks() -> None:
  """A tree reduction through __shared__ memory and __syncthreads in 16x4x2 blocks, whose last 32 threads return before
  the first barrier; shared memory reads as NaN where no thread of the block wrote it (the previous block wrote
  s[50])."""
  src = r"""
  extern "C" __global__ void reduce(float* out, float* unwritten, const float* x) {
    __shared__ float s[128];
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int b = blockIdx.x + gridDim.x * blockIdx.y;
    if (t == 0) unwritten[b] = s[50];
    __syncthreads();
    if (t >= 96) return;
    s[t] = x[b * 96 + t];
    __syncthreads();
    for (int stride = 64; stride > 0; stride >>= 1) {
      if (t < stride && t + stride < 96) s[t] += s[t + stride];
      __syncthreads();
    }
    if (t == 0) out[b] = s[0];
  }"""
  x = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32)
  out, unwritten = np.zeros(6, np.float32), np.zeros(6, np.float32)
  cuda_cpu.launch(src, "reduce", (2, 3, 1), (16, 4, 2), [out, unwritten, x])
  s = x.copy()
  for stride in (64, 32, 16, 8, 4, 2, 1):
    k = np.arange(min(stride, 96 - stride))
    s[:, k] = s[:, k] + s[:, k + stride]
  assert (out == s[:, 0]).all() and np.isnan(unwritten).all()


def test_atomics() -> None:
  src = r"""
  extern "C" __global__ void atomics(int* i, unsigned* u, float* f, int* old) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x, v = t * 37 % 101 - 50;
    atomicAdd(&i[0], 1); atomicAdd(&u[0], 2u); atomicAdd(&f[0], 0.5f);
    atomicMax(&i[1], v); atomicMin(&i[2], v); atomicMax(&u[1], (unsigned)t); atomicMin(&u[2], (unsigned)t + 5);
    for (int seen = atomicCAS(&i[3], 0, 0);;) {
      const int got = atomicCAS(&i[3], seen, seen + 3); if (got == seen) break; seen = got;
    }
    old[t] = atomicExch(&i[4], t + 1);
    atomicExch(&f[1], 2.5f);
  }"""
  i, u, f, old = (np.array([0, -1000, 1000, 0, 0], np.int32), np.array([0, 0, 1 << 20], np.uint32),
                  np.zeros(2, np.float32), np.zeros(256, np.int32))
  cuda_cpu.launch(src, "atomics", (4, 1, 1), (64, 1, 1), [i, u, f, old])
  v = np.arange(256) * 37 % 101 - 50
  assert list(i[:4]) == [256, v.max(), v.min(), 768] and list(u) == [512, 255, 5] and list(f) == [128.0, 2.5]
  assert sorted([*old, i[4]]) == list(range(257))  # each thread got the value one other thread (or the initial 0) left


def test_dp4a() -> None:
  src = r"""
  extern "C" __global__ void dp4a(int* s, unsigned* u, const int* a, const int* b, const int* c) {
    const int t = threadIdx.x;
    s[t] = __dp4a(a[t], b[t], c[t]);
    u[t] = __dp4a((unsigned)a[t], (unsigned)b[t], (unsigned)c[t]);
  }"""
  a, b, c = np.random.default_rng(2).integers(-2**31, 2**31, (3, 256), dtype=np.int64).astype(np.int32)
  s, u = np.zeros(256, np.int32), np.zeros(256, np.uint32)
  cuda_cpu.launch(src, "dp4a", (1, 1, 1), (256, 1, 1), [s, u, a, b, c])
  dot = lambda dt: (a.view(dt).reshape(-1, 4).astype(np.int64) * b.view(dt).reshape(-1, 4)).sum(1)
  assert (s == (dot(np.int8) + c).astype(np.int32)).all() and (u == (dot(np.uint8) + c.view(np.uint32)).astype(
    np.uint32)).all()


def test_byte_perm() -> None:
  """PTX prmt's default mode: each selector nibble picks a byte of y:x (x low), its bit 3 replicates that byte's sign;
  the selectors MAGB uses (0x7440 | k) put byte k of x under the exponent byte 0x4B."""
  src = r"""
  extern "C" __global__ void perm(unsigned* r, const unsigned* x, const unsigned* y, const unsigned* s) {
    const int t = threadIdx.x;
    r[t] = __byte_perm(x[t], y[t], s[t]);
  }"""
  x, y, s = np.random.default_rng(3).integers(0, 2**32, (3, 256), dtype=np.uint64).astype(np.uint32)
  s[:4] = 0x7440 | np.arange(4)
  y[:4] = 0x4B000000
  r = np.zeros(256, np.uint32)
  cuda_cpu.launch(src, "perm", (1, 1, 1), (256, 1, 1), [r, x, y, s])
  v = (y.astype(np.uint64) << 32 | x).view(np.uint8).reshape(-1, 8)
  sel = (s[:, None] >> (4 * np.arange(4, dtype=np.uint32))) & 15
  b = np.take_along_axis(v, (sel & 7).astype(np.int64), 1)
  want = np.where(sel & 8, np.where(b & 128, 255, 0), b).astype(np.uint8).view(np.uint32).ravel()
  assert (r == want).all()
  assert list(r[:4]) == [0x4B000000 | (x[k] >> 8 * k & 255) for k in range(4)]


def test_half_conversions_equal_numpy() -> None:
  """h2f of all 65536 bit patterns; f2h (round to nearest even) of every half's value, of the midpoints between
  neighbours and the floats beside them, of the overflow boundary and of random bit patterns."""
  src = r"""
  extern "C" __global__ void halves(float* f, unsigned short* h, const float* x, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
      if (i < 65536) f[i] = h2f((unsigned short)i);
      h[i] = f2h(x[i]);
    }
  }"""
  halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
  finite = np.sort(halves[np.isfinite(halves)].astype(np.float32))
  mids = (finite[:-1] + (finite[1:] - finite[:-1]) / 2).astype(np.float32)
  x = np.concatenate([halves.astype(np.float32), mids, np.nextafter(mids, np.float32(np.inf)),
                      np.nextafter(mids, np.float32(-np.inf)),
                      np.array([65519.996, 65520, -65520, 1e30, 2**-25, 2**-26], np.float32),
                      np.random.default_rng(3).integers(0, 2**32, 100_000,
                                                        dtype=np.uint64).astype(np.uint32).view(np.float32)])
  f, h = np.zeros(65536, np.float32), np.zeros(len(x), np.uint16)
  cuda_cpu.launch(src, "halves", (4, 1, 1), (256, 1, 1), [f, h, x, np.int32(len(x))])
  want_f, nan = halves.astype(np.float32), np.isnan(halves)
  assert (f.view(np.uint32)[~nan] == want_f.view(np.uint32)[~nan]).all() and np.isnan(f[nan]).all()
  with np.errstate(over="ignore"): want_h, nan = x.astype(np.float16), np.isnan(x)
  assert (h[~nan] == want_h.view(np.uint16)[~nan]).all() and np.isnan(h[nan].view(np.float16)).all()


def test_math_casts_and_vector_types() -> None:
  src = r"""
  static_assert(alignof(float4) == 16 && alignof(uint4) == 16 && alignof(int4) == 16 && alignof(float2) == 8
                && alignof(int2) == 8 && alignof(uint2) == 8 && sizeof(float4) == 16);
  extern "C" __global__ void maths(float* f, int* i, const float* x, const float4* v) {
    const int t = threadIdx.x;
    const float a = x[t], b = x[t + 32];
    f[8 * t] = rsqrtf(fabsf(a)); f[8 * t + 1] = __fdividef(a, b);
    f[8 * t + 2] = fmaxf(a, b); f[8 * t + 3] = fminf(a, INFINITY);
    f[8 * t + 4] = __expf(a); f[8 * t + 5] = tanhf(a) + __logf(fabsf(b)); f[8 * t + 6] = sqrtf(fabsf(a)) + expf(b);
    f[8 * t + 7] = __int_as_float(__float_as_int(a) ^ 1) + __uint_as_float(__float_as_uint(b) ^ 1u);
    const float4 q = __ldg(&v[t]);
    const uint2 p = make_uint2(1u, 2u);
    i[4 * t] = (int)min(t - 16, 4u) * 100 + min(t - 16, 5);  // int and unsigned compare as unsigned, as in CUDA
    i[4 * t + 1] = max(t, 20) + (int)(q.x + q.y + q.z + q.w);
    i[4 * t + 2] = (int)(p.x + p.y) + make_int4(t, 0, 0, 1).w + warpSize;
    i[4 * t + 3] = __popc(t * 2654435761u) * 10000 + __clz(t) * 100 + __ffs(t << 3);
  }"""
  rng = np.random.default_rng(4)
  x, v = rng.standard_normal(64).astype(np.float32), rng.integers(-8, 8, (32, 4)).astype(np.float32)
  f, i = np.zeros((32, 8), np.float32), np.zeros((32, 4), np.int32)
  cuda_cpu.launch(src, "maths", (1, 1, 1), (32, 1, 1), [f, i, x, v])
  a, b, one = x[:32], x[32:], np.uint32(1)
  exact = [np.float32(1) / np.sqrt(np.abs(a)), a / b, np.maximum(a, b), a,
           None, None, None, (a.view(np.uint32) ^ one).view(np.float32) + (b.view(np.uint32) ^ one).view(np.float32)]
  for k, want in enumerate(exact):
    if want is not None: assert (f[:, k] == want).all(), k
  np.testing.assert_allclose(f[:, 4:7],
                             np.stack([np.exp(a), np.tanh(a) + np.log(np.abs(b)), np.sqrt(np.abs(a)) + np.exp(b)], 1),
                             rtol=1e-6)
  t = np.arange(32)
  assert (i[:, 0] == np.where(t < 16, 4, np.minimum(t - 16, 4)) * 100 + np.minimum(t - 16, 5)).all()
  assert (i[:, 1] == np.maximum(t, 20) + v.sum(1)).all() and (i[:, 2] == 36).all()
  bits = lambda v: np.array([int(u).bit_length() for u in v])
  popc, ffs = [bin(u).count("1") for u in t.astype(np.uint32) * np.uint32(2654435761)], np.where(t > 0, bits((
    t << 3) & -(t << 3)), 0)
  assert (i[:, 3] == np.array(popc) * 10000 + (32 - bits(t)) * 100 + ffs).all()


MISUSE = r"""
extern "C" __global__ void misuse(float* out, int mode) {
  float v = threadIdx.x;
  if (mode == 1) v = __shfl_xor_sync(threadIdx.x & 16 ? 0xffff0000u : 0xffffu, v, 1);
  if (mode == 6) v = __shfl_xor_sync(0xfffffffeu, v, 1);
  if (mode == 2) { if (threadIdx.x >= 16) return; v = __shfl_xor_sync(0xffffffffu, v, 16); }
  if (mode == 3) { if (threadIdx.x & 1) v = __shfl_xor_sync(0xffffffffu, v, 1); else __syncwarp(); }
  if (mode == 4) { if (threadIdx.x == 0) __syncthreads(); else __syncwarp(); }
  if (mode == 5) out[threadIdx.x + 1] = v;
  out[threadIdx.x] = v;
}
"""


@pytest.mark.parametrize("mode,match", [
  (0, None),
  (1, r"mask 0x\w+ leaves out running lanes 0x\w+ of warp [01] \(partial-warp masks are not emulated\)"),
  (2, r"__shfl_xor_sync: lane \d+ reads lane \d+, which is not running"),
  (3, r"is at (__syncwarp|__shfl_xor_sync) while lane \d+ is at"),
  (5, r"SIGSEGV at address 0x[0-9a-f]+ \(0 bytes past the end of argument 0, 256 bytes\) in thread \(63, 0, 0\) "
      r"of block \(0, 0, 0\)"),
  (6, r"__shfl_xor_sync: lane 0 calls it with mask 0xfffffffe, which leaves itself out"),
])
def test_misuse_and_faults_are_reported(mode: int, match: str | None) -> None:
  """What a GPU leaves undefined or hangs on ends the launch with a message, and the caller's process survives it."""
  out = np.zeros(64, np.float32)
  if match is None:
    cuda_cpu.launch(MISUSE, "misuse", (1, 1, 1), (64, 1, 1), [out, np.int32(mode)])
    assert (out == np.arange(64)).all()
    return
  with pytest.raises(cuda_cpu.KernelError, match=match):
    cuda_cpu.launch(MISUSE, "misuse", (1, 1, 1), (64, 1, 1), [out, np.int32(mode)])


def test_deadlock_fails_after_the_timeout_saying_where_threads_wait() -> None:
  """Thread 0 waits at __syncthreads for lanes 1-31, which wait at __syncwarp for thread 0 (a GPU hangs too)."""
  where = "thread 0 at __syncthreads; threads 1-31 at a warp call; threads 32-63 exited"
  with pytest.raises(cuda_cpu.KernelError, match=f"did not finish in 1 s .*: {where}$"):
    cuda_cpu.launch(MISUSE, "misuse", (1, 1, 1), (64, 1, 1), [np.zeros(64, np.float32), np.int32(4)], timeout=1)


WAITS = r"""
extern "C" __global__ void waits(float* out, const float* x, const float* w, int early) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const float a = w[t];  // a weight: readable before the wait
  if (threadIdx.x >= 48) return;  // threads that leave before the wait do not hold it up
  float b = early == 1 ? x[t] : 0.f;  // read before the wait
  if (early == 2) out[t] = 0.f;  // written before the wait
  GRID_WAIT();
  out[t] = a * (early ? b : x[t]);
}
"""


@pytest.mark.parametrize("early", [0, 1, 2])
def test_guarded_arrays_are_touched_only_after_grid_wait(early: int) -> None:
  """GRID_WAIT meets the block's threads (those that left do not count); guarded arrays are readable and writable
  after it, in every block, and a read or write of one before it faults, naming the argument."""
  x, w = np.arange(128, dtype=np.float32), np.full(128, 2.0, np.float32)
  out = np.full(128, -1.0, np.float32)
  if early:
    with pytest.raises(cuda_cpu.KernelError, match=f"argument {2 - early}, which it may touch only after GRID_WAIT"):
      cuda_cpu.launch(WAITS, "waits", (2, 1, 1), (64, 1, 1), [out, x, w, np.int32(early)], guard=(0, 1))
    return
  cuda_cpu.launch(WAITS, "waits", (2, 1, 1), (64, 1, 1), [out, x, w, np.int32(0)], guard=(0, 1))
  live = (np.arange(128) % 64) < 48
  assert np.array_equal(out[live], 2 * x[live]) and np.all(out[~live] == -1)


@pytest.mark.parametrize("args,match",
                         [([np.zeros(64, np.float64), np.int32(0)], "argument 0: the kernel takes a pointer to 4-byte "
                           "numbers, got an array of 8-byte items"),
                          ([np.zeros(64, np.float32), np.int64(0)], "argument 1: the kernel takes a signed integer of "
                           "4 bytes, got a signed integer of 8 bytes"),
                          ([np.zeros(64, np.float32), np.uint32(0)], "argument 1: the kernel takes a signed integer of "
                           "4 bytes, got an unsigned integer of 4"),
                          ([np.zeros(64, np.float32)], "the kernel takes 2 arguments, got 1"),])
def test_arguments_are_checked_against_the_kernels_parameters(args: list, match: str) -> None:
  with pytest.raises(cuda_cpu.KernelError, match=match):
    cuda_cpu.launch(MISUSE, "misuse", (1, 1, 1), (64, 1, 1), args)
  with pytest.raises(TypeError, match="argument 1: pass arrays and numpy scalars"):
    cuda_cpu.launch(MISUSE, "misuse", (1, 1, 1), (64, 1, 1), [args[0], 0])


def test_compile_errors_show_gxx_message() -> None:
  with pytest.raises(cuda_cpu.CompileError, match=r"broken\.cu:2:.*error"):
    src = 'extern "C" __global__ void broken(float* out) {\n  out[0] = undeclared;\n}'
    cuda_cpu.launch(src, "broken", (1, 1, 1), (1, 1, 1), [np.zeros(1, np.float32)])


# 10 rows: the last block's last two warps have none; 2304: 9 K-quant blocks, more units than lanes
ROWS, IN, E, K = 10, 2304, 4, 3


def _run(role: str, t: int, shape: tuple[int, ...], out: np.ndarray, args: list, **dims: int) -> np.ndarray:
  k = cuda_src.product(role, t, shape, **dims)
  cuda_cpu.launch(k.src, k.name, k.grid, (k.threads, 1, 1), [out, *args])
  return out


def rel_err(got: np.ndarray, want: np.ndarray) -> float: return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("quant", sorted(q for q, t in TYPES.items() if t in cuda_src.UNITS))
def test_native_kernels_equal_the_dequantized_product(quant: str) -> None:
  """Each role's kernel as model/native.py launches it: dense decode (1 token) and prefill (13: a full tile of 8 and a
  partial one), per-head (3 heads, 2 tokens), expert with one input for all K slots and one per slot, ids that repeat
  and hit the last expert."""
  t, rng = TYPES[quant], np.random.default_rng(5)
  x = lambda *s: rng.standard_normal(s).astype(np.float32)
  planes, w = kernel_weight(t, (ROWS, IN), 6)
  for n, tn in ((1, 1), (13, 8)):
    xi = x(n, IN)
    got = _run("dense", t, (ROWS, IN), np.zeros((n, ROWS), np.float32), [xi, *planes], tn=tn, n=n)
    assert rel_err(got, xi @ w.T) < 1e-5, (quant, n)
  H, n, inp = 3, 2, 512
  planes, w = kernel_weight(t, (H, ROWS, inp), 7)
  xh = x(n, H, inp)
  got = _run("per_head", t, (H, ROWS, inp), np.zeros((n, H, ROWS), np.float32), [xh, *planes], tn=n, n=n, heads=H)
  assert rel_err(got, np.einsum("nhi,hoi->nho", xh, w)) < 1e-5, quant
  got = _run("per_head", t, (H, ROWS, inp), np.zeros((1, H, ROWS), np.float32), [xh[:1], *planes], tn=1, n=1, heads=H)
  assert rel_err(got, np.einsum("nhi,hoi->nho", xh[:1], w)) < 1e-5, quant
  planes, w = kernel_weight(t, (E, ROWS, IN), 8)
  sel = np.array([E - 1, E - 1, 0, 1, E - 1, 2], np.int32)  # 2 tokens x K slots
  for xk in (1, K):
    xe = x(len(sel) // K * xk, IN)
    got = _run("expert", t, (E, ROWS, IN), np.zeros((len(sel), ROWS), np.float32), [xe, sel, *planes], experts=E, xk=xk,
               k=K, slots=len(sel))
    want = np.stack([w[e] @ xe[y if xk > 1 else y // K] for y, e in enumerate(sel)])
    assert rel_err(got, want) < 1e-5, (quant, xk)
