// CUDA C on the CPU, for tests (tests/cuda_cpu.py compiles a kernel source with this header and runs it).
//
// Blocks run one after another, in one OS thread: the threads of a block are fibers (their stacks reused across blocks)
// that switch only where one waits (__syncthreads, a warp call, GRID_WAIT) or returns, to the next thread round-robin
// that can go on. So __syncthreads, __shared__ memory and warp-synchronous calls behave as on a GPU; but a thread that
// spins on memory another thread of its block writes, with no barrier in the loop, hangs (as it may on a GPU without
// independent thread scheduling). When no thread can go on (a deadlock), the launch waits for cuda_cpu.py's timeout,
// which reports where each thread waits. A warp is 32 consecutive threads (threadIdx.x fastest). A thread that returns
// leaves every barrier (later barriers wait for the others only). A warp call waits for every running lane of the warp;
// what a GPU leaves undefined there (running lanes at different warp calls, a mask that leaves running lanes out, a
// shuffle reading a lane that has exited) ends the launch with a message. Faults (a stack overflow too) record the
// faulting thread. Shared memory holds 0xff bytes (float NaN, int -1) at the start of each block, so a read of what no
// thread of the block wrote shows.
// GRID_WAIT (a native kernel's wait for the kernels before it: griddepcontrol.wait) is a block-wide meeting here: the
// arrays a launch guards (those earlier kernels write) are inaccessible from the start of each block until every thread
// of the block has called it or exited, so a read or write of them before it faults and names the argument.
// Not emulated: device-specific helpers (kernels define them under __CUDACC_RTC__, which is not defined here; h2f and f2h
// are below), dynamic shared memory, partial-warp masks, the GPU's approximate math (__expf and rsqrtf are libm's).
#pragma once
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ __attribute__((section("cuda_cpu_shared"))) static

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
struct int3 { int x, y, z; };
struct float3 { float x, y, z; };
struct __align__(8) int2 { int x, y; };
struct __align__(8) uint2 { unsigned x, y; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(16) float4 { float x, y, z, w; };
inline int2 make_int2(int x, int y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline uint3 threadIdx, blockIdx;  // the running thread's: the scheduler sets threadIdx as it switches
inline dim3 blockDim, gridDim;
constexpr int warpSize = 32;

namespace cuda_cpu {

// shared with the launching Python process (tests/cuda_cpu.py's Report mirrors it): why a launch failed, and where each
// thread of the running block is, read when the launch deadlocks
enum State { RUNNING, AT_SYNCTHREADS, AT_WARP, EXITED, AT_GRID_WAIT };
struct Report {
  char error[1024];
  int signal;
  unsigned long long addr;
  unsigned thread[3], block[3];
  int nthreads;
  int state[1024];
};

// a fiber switch that saves no signal mask (swapcontext's costs a syscall); the _longjmp symbol itself, as
// _FORTIFY_SOURCE's longjmp refuses a jump to another stack
extern "C" [[noreturn]] void jump(jmp_buf, int) __asm__("_longjmp");
inline void switch_to(jmp_buf from, jmp_buf to) { if (!_setjmp(from)) jump(to, 1); }

inline void yield();

// a reusable barrier that a leaving thread drops out of; `live` (for warps: the lanes still running) is snapshotted as
// each phase completes, for the threads released by it
struct Barrier {
  int expected = 0, arrived = 0;
  unsigned phase = 0, live = 0, snap[2] = {};
  void (*on_complete)() = nullptr;  // run by the thread that completes a phase, before the others go on
  void reset(int n, unsigned lanes) { expected = n, arrived = 0, phase = 0, live = lanes; }
  void complete() {
    if (on_complete) on_complete();
    arrived = 0, snap[phase & 1] = live, phase++;
  }
  unsigned wait();  // -> the phase this thread waited for
  void drop(unsigned lane_bit) {
    live &= ~lane_bit;
    if (--expected == arrived && arrived) complete();
  }
};

struct Warp {
  Barrier bar;
  unsigned long long slot[2][32];  // each lane's value, double-buffered by phase parity
  int op[2][32];
};

struct Fiber {
  jmp_buf ctx;  // where it resumes
  uint3 idx;
  bool exited;
  unsigned warp_ops;  // warp calls it made in this block: the parity of its warp barrier's phase
  const Barrier* bar;  // the barrier it waits at, for the end of phase `phase`; null while it can run
  unsigned phase;
};

constexpr size_t STACK = 256 << 10;  // a fiber's stack, below which an inaccessible page catches an overflow
inline Report* report;
inline Barrier block_bar, wait_bar;
struct Pages { void* addr; size_t len; };
inline Pages guarded[64];  // the pages of the arrays GRID_WAIT guards
inline int nguarded;
inline Warp warps[32];
inline Fiber fibers[1024];
inline int nthreads, running;  // the block's threads, those of them that have not returned
inline int tid;  // the running fiber
inline jmp_buf main_ctx;  // run()'s, resumed when a block's threads have all returned
inline void (*body)(void*);
inline void* body_ctx;

extern "C" char __start_cuda_cpu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cuda_cpu_shared[] __attribute__((weak, visibility("hidden")));

// end the launch: the message goes to the report, the launching process raises it
[[noreturn]] inline __attribute__((format(printf, 1, 2))) void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(report->error, sizeof(report->error), fmt, ap);
  va_end(ap);
  report->thread[0] = threadIdx.x, report->thread[1] = threadIdx.y, report->thread[2] = threadIdx.z;
  _exit(1);
}

inline void on_signal(int sig, siginfo_t* info, void*) {
  report->signal = sig, report->addr = (unsigned long long)info->si_addr;
  report->thread[0] = threadIdx.x, report->thread[1] = threadIdx.y, report->thread[2] = threadIdx.z;
  _exit(128 + sig);
}

// from the running fiber, which waits or has returned, to the next one round-robin that can go on; to run() when all
// have returned
inline void yield() {
  const int from = tid;
  for (int i = 0, j = from; i < nthreads; i++) {
    j = j + 1 == nthreads ? 0 : j + 1;
    const Fiber& f = fibers[j];
    if (f.exited || (f.bar && f.bar->phase == f.phase)) continue;
    tid = j, threadIdx = f.idx;
    return switch_to(fibers[from].ctx, fibers[j].ctx);
  }
  if (!running) return switch_to(fibers[from].ctx, main_ctx);
  for (;;) pause();  // a deadlock: cuda_cpu.py's timeout ends the process, reporting report->state
}

inline unsigned Barrier::wait() {
  const unsigned p = phase;
  if (++arrived == expected) complete();
  else {
    fibers[tid].bar = this, fibers[tid].phase = p;
    yield();
    fibers[tid].bar = nullptr;
  }
  return p;
}

enum Op { SHFL = 1, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, ANY, ALL, SYNCWARP };
inline const char* const op_names[] = {"", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync",
                                       "__any_sync", "__all_sync", "__syncwarp"};

// every running lane of the warp posts `v` and meets the others: -> the posted values, `live` set to the running lanes
inline const unsigned long long* warp_sync(Op op, unsigned mask, unsigned long long v, unsigned& live) {
  const int lane = tid & 31;
  Warp& w = warps[tid >> 5];
  if (!(mask >> lane & 1)) fail("%s: lane %d calls it with mask %#x, which leaves itself out", op_names[op], lane, mask);
  const unsigned par = fibers[tid].warp_ops++ & 1;
  w.slot[par][lane] = v, w.op[par][lane] = op;
  report->state[tid] = AT_WARP;
  w.bar.wait();
  report->state[tid] = RUNNING;
  live = w.bar.snap[par];
  if ((mask & live) != live) fail("%s: mask %#x leaves out running lanes %#x of warp %d (partial-warp masks are not emulated)",
                                  op_names[op], mask, live & ~mask, tid >> 5);
  for (unsigned l = 0; l < 32; l++)
    if ((live >> l & 1) && w.op[par][l] != op) fail("lane %d of warp %d is at %s while lane %u is at %s", lane, tid >> 5, op_names[op], l,
                                                    op_names[w.op[par][l]]);
  return w.slot[par];
}

// PTX shfl.sync: source lane j of mode `op` with operand b and segment `width`; a source outside the segment gives the
// lane its own value
template <class T> T shfl(Op op, unsigned mask, T var, int b, int width) {
  static_assert(std::is_arithmetic_v<T> && sizeof(T) <= 8, "shuffles move one arithmetic value of at most 8 bytes");
  if (width < 1 || width > 32 || (width & (width - 1))) fail("%s: width %d is not a power of 2 up to 32", op_names[op], width);
  unsigned long long v = 0;
  memcpy(&v, &var, sizeof(T));
  unsigned live;
  const unsigned long long* slots = warp_sync(op, mask, v, live);
  const int lane = tid & 31, seg = 32 - width, min_lane = lane & seg, max_lane = min_lane | (31 & ~seg);
  int j = op == SHFL ? min_lane | (b & 31 & ~seg) : op == SHFL_UP ? lane - b : op == SHFL_DOWN ? lane + b : lane ^ (b & 31);
  if (op == SHFL_UP ? j < min_lane : j > max_lane) j = lane;
  if (!(live >> j & 1)) fail("%s: lane %d reads lane %d, which is not running", op_names[op], lane, j);
  memcpy(&var, &slots[j], sizeof(T));
  return var;
}

inline unsigned vote(Op op, unsigned mask, int pred, unsigned& live) {  // -> the running lanes whose pred holds
  unsigned votes = 0;
  const unsigned long long* slots = warp_sync(op, mask, pred != 0, live);
  for (unsigned l = 0; l < 32; l++) votes |= (unsigned)(live >> l & slots[l]) << l;
  return votes;
}

template <class T, class F> T atomic_update(T* p, F f) {  // CAS loop: f(old) -> new; -> old
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, f(old), true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
  return old;
}

template <class T> T cas(T* p, T cmp, T v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;
}

inline void guard(int prot) {
  for (int i = 0; i < nguarded; i++)
    if (mprotect(guarded[i].addr, guarded[i].len, prot)) fail("mprotect of a guarded array failed");
}

// a fiber's code: parked until run() resumes it for a block, then each time the kernel for the block it is resumed in
[[noreturn]] inline void fiber_main() {
  switch_to(fibers[tid].ctx, main_ctx);
  for (;;) {
    body(body_ctx);
    report->state[tid] = EXITED, fibers[tid].exited = true, running--;
    warps[tid >> 5].bar.drop(1u << (tid & 31));
    block_bar.drop(0);
    wait_bar.drop(0);
    yield();
  }
}

// run body(ctx) as every thread of every block: -> 0, or the process ends (fail, or a fault)
inline int run(const unsigned* grid, const unsigned* block, void (*fn)(void*), void* ctx) {
  static char altstack[64 << 10];  // the signal handler's: a fault may be a fiber's stack overflow
  stack_t ss = {};
  ss.ss_sp = altstack, ss.ss_size = sizeof(altstack);
  if (sigaltstack(&ss, nullptr)) fail("sigaltstack failed");
  struct sigaction sa = {};
  sa.sa_sigaction = on_signal, sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(sig, &sa, nullptr);
  const int n = (int)(block[0] * block[1] * block[2]);
  if (n < 1 || n > 1024) fail("a block of %u x %u x %u threads: CUDA allows 1 to 1024", block[0], block[1], block[2]);
  body = fn, body_ctx = ctx, report->nthreads = nthreads = n;
  blockDim = {block[0], block[1], block[2]}, gridDim = {grid[0], grid[1], grid[2]};
  wait_bar.on_complete = [] { guard(PROT_READ | PROT_WRITE); };
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), span = page + STACK;
  char* stacks = (char*)mmap(nullptr, n * span, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (stacks == MAP_FAILED) fail("cannot map the stacks of %d threads", n);
  ucontext_t uc;
  getcontext(&uc);
  for (int i = 0; i < n; i++) {
    char* base = stacks + i * span;
    if (mprotect(base, page, PROT_NONE)) fail("mprotect of a stack's guard page failed");
    uc.uc_stack.ss_sp = base + page, uc.uc_stack.ss_size = STACK, uc.uc_link = nullptr;
    makecontext(&uc, fiber_main, 0);
    tid = i, fibers[i].idx = {i % blockDim.x, i / blockDim.x % blockDim.y, i / (blockDim.x * blockDim.y)};
    if (!_setjmp(main_ctx)) setcontext(&uc);  // fiber_main parks it at once
  }
  for (unsigned z = 0; z < grid[2]; z++)
    for (unsigned y = 0; y < grid[1]; y++)
      for (unsigned x = 0; x < grid[0]; x++) {
        blockIdx = {x, y, z}, report->block[0] = x, report->block[1] = y, report->block[2] = z;
        block_bar.reset(n, 0), wait_bar.reset(n, 0);
        guard(PROT_NONE);
        for (int w = 0; w < (n + 31) / 32; w++) warps[w].bar.reset(n - 32 * w < 32 ? n - 32 * w : 32, n - 32 * w < 32 ? (1u << (n - 32 * w)) - 1 : ~0u);
        for (int i = 0; i < n; i++) report->state[i] = RUNNING, fibers[i].exited = false, fibers[i].warp_ops = 0;
        if (__start_cuda_cpu_shared) memset(__start_cuda_cpu_shared, 0xff, __stop_cuda_cpu_shared - __start_cuda_cpu_shared);
        running = n, tid = 0, threadIdx = fibers[0].idx;
        switch_to(main_ctx, fibers[0].ctx);
      }
  return 0;
}

// the kernel's parameters, checked against what Python passed: kind 0 an array, 1 a signed, 2 an unsigned integer, 3 a float
template <class P> void check_arg(int i, int kind, int size) {
  if constexpr (std::is_pointer_v<P>) {
    using E = std::remove_cv_t<std::remove_pointer_t<P>>;
    if (kind != 0) fail("argument %d: the kernel takes a pointer, got a scalar", i);
    // a pointer to numbers takes an array of their size (not float64 for float); one to vectors (float4), of a divisor
    if constexpr (std::is_arithmetic_v<E>) {
      if ((int)sizeof(E) != size) fail("argument %d: the kernel takes a pointer to %d-byte numbers, got an array of %d-byte items", i, (int)sizeof(E), size);
    } else if constexpr (!std::is_void_v<E>) {
      if (sizeof(E) % size) fail("argument %d: the kernel takes a pointer to %d-byte elements, got an array of %d-byte items", i, (int)sizeof(E), size);
    }
  } else if constexpr (std::is_integral_v<P> || std::is_floating_point_v<P>) {
    const int want = std::is_floating_point_v<P> ? 3 : std::is_signed_v<P> ? 1 : 2;
    const char* kinds[] = {"an array", "a signed integer", "an unsigned integer", "a float"};
    if (kind != want || (int)sizeof(P) != size)
      fail("argument %d: the kernel takes %s of %d bytes, got %s of %d bytes", i, kinds[want], (int)sizeof(P), kinds[kind], size);
  } else {
    static_assert(std::is_pointer_v<P>, "kernel parameters must be pointers or arithmetic scalars");
  }
}

template <class P> P arg(void* a) {
  if constexpr (std::is_pointer_v<P>) return (P)a;
  else return *(P*)a;
}

template <class... P> struct Call {
  void (*fn)(P...);
  void** args;
  static void body(void* ctx) {
    Call* c = (Call*)ctx;
    [c]<size_t... I>(std::index_sequence<I...>) { c->fn(arg<P>(c->args[I])...); }(std::index_sequence_for<P...>{});
  }
};

// the launch: args[i] is array i's data, or the address of scalar i
template <class... P> int launch(void (*fn)(P...), const unsigned* grid, const unsigned* block, void** args, const int* kinds,
                                 const int* sizes, int nargs, Report* rep, void** guard_addrs, const size_t* guard_lens,
                                 int nguards) {
  report = rep;
  if (nguards > 64) fail("%d guarded arrays: at most 64", nguards);
  for (int i = 0; i < nguards; i++) guarded[i] = {guard_addrs[i], guard_lens[i]};
  nguarded = nguards;
  if (nargs != (int)sizeof...(P)) fail("the kernel takes %d arguments, got %d", (int)sizeof...(P), nargs);
  [&]<size_t... I>(std::index_sequence<I...>) { (check_arg<P>((int)I, kinds[I], sizes[I]), ...); }(std::index_sequence_for<P...>{});
  Call<P...> call{fn, args};
  return run(grid, block, Call<P...>::body, &call);
}

}  // namespace cuda_cpu

inline void grid_wait_cpu() {
  cuda_cpu::report->state[cuda_cpu::tid] = cuda_cpu::AT_GRID_WAIT;
  cuda_cpu::wait_bar.wait();
  cuda_cpu::report->state[cuda_cpu::tid] = cuda_cpu::RUNNING;
}
#define GRID_WAIT() grid_wait_cpu()

inline void __syncthreads() {
  cuda_cpu::report->state[cuda_cpu::tid] = cuda_cpu::AT_SYNCTHREADS;
  cuda_cpu::block_bar.wait();
  cuda_cpu::report->state[cuda_cpu::tid] = cuda_cpu::RUNNING;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { unsigned live; cuda_cpu::warp_sync(cuda_cpu::SYNCWARP, mask, 0, live); }
template <class T> T __shfl_sync(unsigned mask, T var, int src, int width = 32) { return cuda_cpu::shfl(cuda_cpu::SHFL, mask, var, src, width); }
template <class T> T __shfl_up_sync(unsigned mask, T var, unsigned d, int width = 32) { return cuda_cpu::shfl(cuda_cpu::SHFL_UP, mask, var, (int)d, width); }
template <class T> T __shfl_down_sync(unsigned mask, T var, unsigned d, int width = 32) { return cuda_cpu::shfl(cuda_cpu::SHFL_DOWN, mask, var, (int)d, width); }
template <class T> T __shfl_xor_sync(unsigned mask, T var, int m, int width = 32) { return cuda_cpu::shfl(cuda_cpu::SHFL_XOR, mask, var, m, width); }
inline unsigned __ballot_sync(unsigned mask, int pred) { unsigned live; return cuda_cpu::vote(cuda_cpu::BALLOT, mask, pred, live); }
inline int __any_sync(unsigned mask, int pred) { unsigned live; return cuda_cpu::vote(cuda_cpu::ANY, mask, pred, live) != 0; }
inline int __all_sync(unsigned mask, int pred) { unsigned live; return cuda_cpu::vote(cuda_cpu::ALL, mask, pred, live) == live; }

// atomics: relaxed, as CUDA's; the fences are full fences
#define CUDA_CPU_ATOMIC(T, name, builtin) inline T name(T* p, T v) { return builtin(p, v, __ATOMIC_RELAXED); }
CUDA_CPU_ATOMIC(int, atomicAdd, __atomic_fetch_add)
CUDA_CPU_ATOMIC(unsigned, atomicAdd, __atomic_fetch_add)
CUDA_CPU_ATOMIC(unsigned long long, atomicAdd, __atomic_fetch_add)
CUDA_CPU_ATOMIC(int, atomicExch, __atomic_exchange_n)
CUDA_CPU_ATOMIC(unsigned, atomicExch, __atomic_exchange_n)
#undef CUDA_CPU_ATOMIC
inline int atomicMax(int* p, int v) { return cuda_cpu::atomic_update(p, [v](int o) { return o > v ? o : v; }); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return cuda_cpu::atomic_update(p, [v](unsigned o) { return o > v ? o : v; }); }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  return cuda_cpu::atomic_update(p, [v](unsigned long long o) { return o > v ? o : v; });
}
inline int atomicMin(int* p, int v) { return cuda_cpu::atomic_update(p, [v](int o) { return o < v ? o : v; }); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return cuda_cpu::atomic_update(p, [v](unsigned o) { return o < v ? o : v; }); }
inline int atomicCAS(int* p, int cmp, int v) { return cuda_cpu::cas(p, cmp, v); }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) { return cuda_cpu::cas(p, cmp, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp, unsigned long long v) { return cuda_cpu::cas(p, cmp, v); }
inline long long clock64() {  // a monotonic count of ns here (a multiprocessor's cycles on a GPU)
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float __int_as_float(int v) { return __builtin_bit_cast(float, v); }
inline int __float_as_int(float v) { return __builtin_bit_cast(int, v); }
inline float __uint_as_float(unsigned v) { return __builtin_bit_cast(float, v); }
inline unsigned __float_as_uint(float v) { return __builtin_bit_cast(unsigned, v); }
inline float atomicAdd(float* p, float v) {
  return __uint_as_float(cuda_cpu::atomic_update((unsigned*)p, [v](unsigned o) { return __float_as_uint(__uint_as_float(o) + v); }));
}
inline float atomicExch(float* p, float v) { return __uint_as_float(atomicExch((unsigned*)p, __float_as_uint(v))); }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcs(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
inline int __ffs(int v) { return __builtin_ffs(v); }

inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 32; i += 8) c += (int)(signed char)(a >> i) * (int)(signed char)(b >> i);
  return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
  for (int i = 0; i < 32; i += 8) c += (a >> i & 255) * (b >> i & 255);
  return c;
}
// byte n of the result: byte (s >> 4n) & 7 of y:x (x the low word); bit 3 of that nibble replicates the byte's sign
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = (unsigned long long)y << 32 | x;
  unsigned r = 0;
  for (int n = 0; n < 4; n++) {
    const unsigned sel = s >> 4 * n & 15, b = v >> 8 * (sel & 7) & 255;
    r |= (sel & 8 ? (b & 128 ? 255u : 0u) : b) << 8 * n;
  }
  return r;
}

// libm's correctly rounded or near functions stand in for the GPU's approximate ones
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }

// integer min/max of CUDA's overloads: the usual arithmetic conversions, then the smaller/larger
template <class A, class B> auto min(A a, B b) {
  using T = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<T>) return fmin((T)a, (T)b);
  else return (T)a < (T)b ? (T)a : (T)b;
}
template <class A, class B> auto max(A a, B b) {
  using T = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<T>) return fmax((T)a, (T)b);
  else return (T)a > (T)b ? (T)a : (T)b;
}

// what kernels define under __CUDACC_RTC__ with PTX: IEEE half <-> float, exact, round to nearest even (cvt.rn.f16.f32)
inline float h2f(unsigned short h) {
  const unsigned s = (h & 0x8000u) << 16, e = h >> 10 & 31, m = h & 1023;
  if (e == 0) return s ? -(float)m * 0x1p-24f : (float)m * 0x1p-24f;  // zero, subnormal: exact
  return __uint_as_float(s | (e == 31 ? 0x7f800000u : (e + 112) << 23) | m << 13);
}
inline unsigned short f2h(float f) {
  const unsigned x = __float_as_uint(f), s = x >> 16 & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned short)(s | 0x7e00u | (a >> 13 & 0x3ffu));  // NaN: quiet, payload's top bits
  if (a >= 0x477ff000u) return (unsigned short)(s | 0x7c00u);  // >= 65520 rounds to infinity
  if (a >= 0x38800000u) { const unsigned r = a - 0x38000000u; return (unsigned short)(s | (r + 0xfffu + (r >> 13 & 1)) >> 13); }
  const unsigned e = a >> 23;  // below 2^-14: a multiple of 2^-24, the half's subnormal unit
  if (e < 102) return (unsigned short)s;
  const unsigned m = (a & 0x7fffffu) | 0x800000u, sh = 126 - e, q = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
  return (unsigned short)(s | (q + (rem > half || (rem == half && (q & 1)))));
}
