// The native backend's device helpers, first in every kernel's source (model/backends/cuda_src.py joins a kernel's
// defines, this file and its device file into the one source tinygrad compiles with NVRTC). Device-specific helpers
// (inline PTX) sit inside `#ifdef __CUDACC_RTC__` (NVRTC defines it), so the same source also runs on the CPU emulator
// of the tests (tests/cuda_cpu.h provides h2f and f2h there).
#define BYTE(v, i) (((v)[(i) >> 2] >> (8 * ((i) & 3))) & 255u)
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#define MAG(c) (__int_as_float(0x4B000000u | (unsigned)(c)) - 8388608.f)
#define MAGB(v, k) (__int_as_float(__byte_perm((v), 0x4B000000u, 0x7440u | (k))) - 8388608.f)
#ifdef __CUDACC_RTC__
__device__ __forceinline__ float h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
#define PREFETCH(p) asm volatile("prefetch.global.L2 [%0];" :: "l"(p))
// a block's arrival at a count (its thread 0, after a __syncthreads): -> the count before it. Release: the block's
// earlier writes are visible to the block that reads the last count; acquire: that block (after a __syncthreads) sees
// every arrived block's writes (read them through L2: __ldcg).
__device__ __forceinline__ int arrive(int* cnt) {
  int old; asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(cnt) : "memory"); return old;
}
#if __CUDA_ARCH__ >= 900
#define GRID_WAIT() do { asm volatile("griddepcontrol.wait;" ::: "memory"); \
                         asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); } while (0)
#else
#define GRID_WAIT() ((void)0)
#endif
#else
#define PREFETCH(p) ((void)(p))
__device__ __forceinline__ int arrive(int* cnt) { __threadfence(); return atomicAdd(cnt, 1); }
#ifndef GRID_WAIT
#define GRID_WAIT() ((void)0)
#endif
#endif
#ifdef STAMP
// The step timeline's build of a kernel (model/profile.py step_timeline compiles the sources again with STAMP
// defined): each kernel takes one more parameter, its launch's 4 words, into which its blocks put a clock in ns by max
// reductions, never waiting on them: the first block's entry and the first return from GRID_WAIT (both inverted: ~t),
// the last return from GRID_WAIT and the last block's exit (its last thread's return).
#define STAMP_PARAM , unsigned long long* stamp_slot
#ifdef __CUDACC_RTC__
__device__ __forceinline__ unsigned long long stamp_now() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
#else
__device__ __forceinline__ unsigned long long stamp_now() { return clock64(); }
#endif
// the block's threads that have returned; 16 bytes, so the kernel's own arrays keep their alignment beside it
__shared__ __align__(16) unsigned stamp_ended[4];
struct Stamp {
  unsigned long long* slot;
  __device__ explicit Stamp(unsigned long long* s) : slot(s) {
    if (threadIdx.x == 0) { stamp_ended[0] = 0; atomicMax(slot, ~stamp_now()); }
    __syncthreads();
  }
  __device__ void wait() const {
    if (threadIdx.x == 0) { const unsigned long long t = stamp_now(); atomicMax(slot + 1, ~t); atomicMax(slot + 2, t); }
  }
  __device__ ~Stamp() {
    __threadfence_block();
    if (atomicAdd(stamp_ended, 1u) == blockDim.x * blockDim.y * blockDim.z - 1) atomicMax(slot + 3, stamp_now());
  }
};
#define STAMP_ENTER() Stamp stamp_(stamp_slot)
#define STAMP_WAIT() stamp_.wait()
#else
#define STAMP_PARAM
#define STAMP_ENTER() ((void)0)
#define STAMP_WAIT() ((void)0)
#endif
__device__ __forceinline__ float group_sum(float a, int g) {
  for (int m = g >> 1; m > 0; m >>= 1) a += __shfl_xor_sync(0xffffffffu, a, m);
  return a;
}
__device__ __forceinline__ float warp_max(float a) {
  for (int m = 16; m > 0; m >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, m));
  return a;
}
#ifdef CACHE_HALF
// the KV cache's element (a kernel that reads or writes the cache defines CACHE_HALF): float16 (1) or float32 (0)
#if CACHE_HALF
typedef unsigned short cache_t;
__device__ __forceinline__ float cache_value(cache_t v) { return h2f(v); }
__device__ __forceinline__ cache_t cache_store(float v) { return f2h(v); }
#else
typedef float cache_t;
__device__ __forceinline__ float cache_value(cache_t v) { return v; }
__device__ __forceinline__ cache_t cache_store(float v) { return v; }
#endif
#endif
