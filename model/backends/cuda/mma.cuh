// Tensor-core helpers for kernels that include this before their signature (cuda_src.device_kernel `pre`). mma16816:
// d += a . b, a warp's 16x8x16 product of float16 operands with float32 accumulators in the fragments of PTX's
// mma.m16n8k16.row.col (lane l: g = l / 4, t = l % 4; a[0..3]: rows g, g + 8 by columns 2t, 2t + 1 and 2t + 8, 2t + 9,
// as (row g, k < 8), (row g + 8, k < 8), (row g, k >= 8), (row g + 8, k >= 8); b[0..1]: rows 2t, 2t + 1 and 2t + 8,
// 2t + 9 of column g; d[0..3]: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)); each 32-bit register holds two
// halves, the lower column or row first. Elsewhere (the tests' CPU emulator) the same product from the lanes'
// fragments gathered by shuffles, summed in float32 in k's order.
__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
  return (unsigned)f2h(lo) | ((unsigned)f2h(hi) << 16);
}
#ifdef __CUDACC_RTC__
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
__device__ __forceinline__ float half_of(unsigned w, int hi) { return h2f((unsigned short)(hi ? w >> 16 : w & 0xffffu)); }
__device__ inline void mma16816(float* d, const unsigned* a, const unsigned* b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int k = 0; k < 16; k++) {
    const int src = (k & 7) >> 1, hi = k & 1, r = k >> 3;
    const float a0 = half_of(__shfl_sync(0xffffffffu, a[2 * r], g * 4 + src), hi);
    const float a1 = half_of(__shfl_sync(0xffffffffu, a[2 * r + 1], g * 4 + src), hi);
    const float b0 = half_of(__shfl_sync(0xffffffffu, b[r], (2 * t) * 4 + src), hi);
    const float b1 = half_of(__shfl_sync(0xffffffffu, b[r], (2 * t + 1) * 4 + src), hi);
    d[0] += a0 * b0; d[1] += a0 * b1; d[2] += a1 * b0; d[3] += a1 * b1;
  }
}
#endif
