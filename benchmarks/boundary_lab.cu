// What a dependency between two steps of a decode costs on this GPU, by how the second step learns that the first is
// done. A step is a decode product's tail: each block reads the whole previous vector through L2 (D floats: 768, 2048
// and 5120, the widths of GLM-4.7-Flash's q_b, hidden-state and output-projection inputs), reduces it (a sum of squares
// over the block) and writes its outputs, so step p + 1 needs every block of step p. N steps run as:
//   graph-full  N kernels in a CUDA graph, ordinary edges (a kernel starts when the one before has finished);
//   graph-pdl   the same kernels with programmatic edges, as model/backends/cuda_graph.py's OverlapGraph makes them:
//               each kernel launches once the blocks before it have passed their wait, and waits at griddepcontrol.wait;
//   ticket      one kernel of N*B blocks: a block takes a ticket (an atomic count) that names its step and its index in
//               it, and waits for its step's predecessor by polling that step's count of arrived blocks. Tickets go in
//               the order blocks start, so a waiting block waits only on blocks already running: no deadlock, with any
//               number of steps in flight;
//   persistent  one kernel of B blocks (one wave) looping over the steps with a grid-wide barrier between them: one
//               count every block adds to and polls;
//   flags       the same with a flag per block (its last step done), which the next step's blocks poll with a thread
//               per flag: no atomics, and each flag is written by one block;
//   unsynced    persistent's loop with no barrier at all: what the steps' work costs alone (its vector is not checked:
//               a step reads what another block may not have written yet), so each variant's excess over it is what
//               its hand-off costs.
// Every other variant's last vector must equal graph-full's, bit for bit. The variants run interleaved, a repetition of
// each in turn. Output: one JSON line per width, block count and variant: microseconds per step (median, min, max of
// the repetitions).
//   nvcc -O3 -arch=sm_90 -o /tmp/boundary_lab benchmarks/boundary_lab.cu && /tmp/boundary_lab [steps] [reps]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); exit(1); } } while (0)

constexpr int T = 128;

__device__ __forceinline__ int load_acquire(const int* p) {
  int v; asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void arrive(int* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(p) : "memory");
}

// one step of block b of B: x -> y
template <int D> __device__ __forceinline__ void step(const float* x, float* y, int b, int B) {
  __shared__ float part[T / 32];
  float v[D / T], ss = 0.f;
  for (int i = 0; i < D / T; i++) { v[i] = __ldcg(x + threadIdx.x + T * i); ss += v[i] * v[i]; }
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  ss = 0.f;
  for (int w = 0; w < T / 32; w++) ss += part[w];
  const float r = rsqrtf(ss / D + 1e-6f);
  // the outputs of this block: its D/B in a row, as a product's rows
  for (int i = b * D / B + threadIdx.x; i < (b + 1) * D / B; i += T) y[i] = __ldcg(x + i) * r * 0.75f + 0.25f;
}

template <int D> __global__ void __launch_bounds__(T) one(const float* x, float* y, int pdl) {
  if (pdl) { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;"); }
  step<D>(x, y, blockIdx.x, gridDim.x);
}

template <int D> __global__ void __launch_bounds__(T) ticket(float* buf, int* cnt, int B) {
  __shared__ int t;
  if (threadIdx.x == 0) t = atomicAdd(cnt, 1);
  __syncthreads();
  const int p = t / B, b = t % B;
  int* done = cnt + 1;
  if (p > 0 && threadIdx.x == 0) while (load_acquire(done + p - 1) < B) {}
  __syncthreads();
  step<D>(buf + D * (p & 1), buf + D * ((p + 1) & 1), b, B);
  __syncthreads();
  if (threadIdx.x == 0) arrive(done + p);
}

template <int D> __global__ void __launch_bounds__(T) persistent(float* buf, int* done, int N, int sync) {
  for (int p = 0; p < N; p++) {
    if (p > 0 && sync) {
      if (threadIdx.x == 0) while (load_acquire(done) < (int)gridDim.x * p) {}
      __syncthreads();
    }
    step<D>(buf + D * (p & 1), buf + D * ((p + 1) & 1), blockIdx.x, gridDim.x);
    __syncthreads();
    if (threadIdx.x == 0 && sync) arrive(done);
  }
}

template <int D> __global__ void __launch_bounds__(T) flags(float* buf, int* flag, int N) {
  for (int p = 0; p < N; p++) {
    if (p > 0) {
      for (int b = threadIdx.x; b < (int)gridDim.x; b += T) while (load_acquire(flag + b) < p) {}
      __syncthreads();
    }
    step<D>(buf + D * (p & 1), buf + D * ((p + 1) & 1), blockIdx.x, gridDim.x);
    __syncthreads();
    if (threadIdx.x == 0) store_release(flag + blockIdx.x, p + 1);
  }
}

template <int D> static cudaGraphExec_t chain(float* buf, int N, int B, bool pdl, cudaStream_t s) {
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int p = 0; p < N; p++) {
    cudaLaunchConfig_t c = {};
    cudaLaunchAttribute a[1];
    a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a[0].val.programmaticStreamSerializationAllowed = 1;
    c.gridDim = dim3(B); c.blockDim = dim3(T); c.stream = s; c.attrs = a; c.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&c, one<D>, (const float*)(buf + D * (p & 1)), buf + D * ((p + 1) & 1), (int)pdl));
  }
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  CHECK(cudaGraphInstantiate(&e, g, 0));
  CHECK(cudaGraphDestroy(g));
  return e;
}

template <int D> static void run(int N, int R, cudaStream_t s, const cudaDeviceProp& prop) {
  float *buf; int* cnt;
  CHECK(cudaMalloc(&buf, 2 * D * sizeof(float)));
  const int CNT = N + 1 + 1024;  // ticket: its count and each step's arrivals; persistent: one count; flags: a flag a block
  CHECK(cudaMalloc(&cnt, CNT * sizeof(int)));
  std::vector<float> init(D), want(D), got(D);
  for (int i = 0; i < D; i++) init[i] = (float)((i * 7919) % 1000) / 1000.f - 0.5f;
  cudaEvent_t e0, e1; CHECK(cudaEventCreate(&e0)); CHECK(cudaEventCreate(&e1));
  const char* names[] = {"graph-full", "graph-pdl", "ticket", "persistent", "flags", "unsynced"};
  constexpr int V = 6;
  for (int B : {16, prop.multiProcessorCount, 2 * prop.multiProcessorCount}) {
    cudaGraphExec_t full = chain<D>(buf, N, B, false, s), pdl = chain<D>(buf, N, B, true, s);
    std::vector<float> us[V];
    bool equal[V];
    for (int r = 0; r < R + 3; r++) for (int v = 0; v < V; v++) {  // 3 warm-up rounds
      CHECK(cudaMemcpyAsync(buf, init.data(), D * sizeof(float), cudaMemcpyHostToDevice, s));
      CHECK(cudaMemsetAsync(cnt, 0, CNT * sizeof(int), s));
      CHECK(cudaEventRecord(e0, s));
      if (v == 0) CHECK(cudaGraphLaunch(full, s));
      if (v == 1) CHECK(cudaGraphLaunch(pdl, s));
      if (v == 2) ticket<D><<<N * B, T, 0, s>>>(buf, cnt, B);
      if (v == 3 || v == 5) persistent<D><<<B, T, 0, s>>>(buf, cnt, N, v == 3);
      if (v == 4) flags<D><<<B, T, 0, s>>>(buf, cnt, N);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaStreamSynchronize(s));
      float ms; CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 3) us[v].push_back(ms * 1e3f / N);
      CHECK(cudaMemcpy(got.data(), buf + D * (N & 1), D * sizeof(float), cudaMemcpyDeviceToHost));
      if (v == 0) want = got;
      equal[v] = (r == 0 || equal[v]) && !memcmp(got.data(), want.data(), D * sizeof(float));
    }
    for (int v = 0; v < V; v++) {
      std::sort(us[v].begin(), us[v].end());
      printf("{\"variant\": \"%s\", \"width\": %d, \"blocks\": %d, \"steps\": %d, \"reps\": %d, \"us\": %.3f, "
             "\"us_min\": %.3f, \"us_max\": %.3f, \"equal\": %s, \"gpu\": \"%s\"}\n", names[v], D, B, N, R,
             us[v][us[v].size() / 2], us[v].front(), us[v].back(), v == 5 ? "null" : equal[v] ? "true" : "false",
             prop.name);
    }
    fflush(stdout);
    CHECK(cudaGraphExecDestroy(full)); CHECK(cudaGraphExecDestroy(pdl));
  }
  CHECK(cudaFree(buf)); CHECK(cudaFree(cnt));
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 400, R = argc > 2 ? atoi(argv[2]) : 20;
  cudaStream_t s; CHECK(cudaStreamCreate(&s));
  cudaDeviceProp prop; CHECK(cudaGetDeviceProperties(&prop, 0));
  run<768>(N, R, s, prop);
  run<2048>(N, R, s, prop);
  run<5120>(N, R, s, prop);
  return 0;
}
