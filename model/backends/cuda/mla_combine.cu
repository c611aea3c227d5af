// The all-heads attention's splits merged once per head (cuda_src.mla_combine; grid: heads x blocks of CC columns,
// THREADS threads): o (HEADS, KVL) = the active splits' outputs (part: HEADS x SPLITS x (max, sum, KVL unnormalised
// outputs), mla_heads.cu), weighted as one softmax over all positions, for mla_vb (mla_load.cuh). The block's warps
// take every (THREADS / CC)-th split, a lane a column, MERGE splits at a time read together through L2 (`__ldcg`: the
// kernel before wrote them), then merge their sums in shared memory.
// The kernel's body (cuda_src writes its signature: o, part, early_pos). Defines: KVL, SPLITS, TP, THREADS, CC, MERGE.
#define SG (THREADS / CC)  // the block's groups of splits
  STAMP_ENTER();
  const int h = blockIdx.x, sg = threadIdx.x / CC, c = blockIdx.y * CC + threadIdx.x % CC, n = early_pos[0] + 1;
#include "heads_split.cuh"
  const int active = (n + ch - 1) / ch;
  GRID_WAIT(); STAMP_WAIT();
  const float* ph = part + (size_t)h * SPLITS * (KVL + 2);
  float mx = -INFINITY, lt = 0.f, a = 0.f;
  for (int s0 = sg; s0 < active; s0 += SG * MERGE) {
    float pm[MERGE], pl[MERGE], v[MERGE];
    for (int u = 0; u < MERGE; u++) {
      const int s = s0 + u * SG; const bool ok = s < active; const float* p = ph + (size_t)s * (KVL + 2);
      pm[u] = ok ? __ldcg(p) : -INFINITY; pl[u] = ok ? __ldcg(p + 1) : 0.f; v[u] = ok ? __ldcg(p + 2 + c) : 0.f;
    }
    float mn = mx;
    for (int u = 0; u < MERGE; u++) mn = fmaxf(mn, pm[u]);
    const float corr = expf(mx - mn);
    lt *= corr; a *= corr;
    for (int u = 0; u < MERGE; u++) { const float f = expf(pm[u] - mn); lt += f * pl[u]; a = fmaf(f, v[u], a); }
    mx = mn;
  }
  __shared__ float sm[SG][CC], sl[SG][CC], sa[SG][CC];
  sm[sg][threadIdx.x % CC] = mx; sl[sg][threadIdx.x % CC] = lt; sa[sg][threadIdx.x % CC] = a;
  __syncthreads();
  if (sg == 0) {
    float M = -INFINITY, L = 0.f, A = 0.f;
    for (int q = 0; q < SG; q++) M = fmaxf(M, sm[q][threadIdx.x]);
    for (int q = 0; q < SG; q++) {
      const float f = sm[q][threadIdx.x] == -INFINITY ? 0.f : expf(sm[q][threadIdx.x] - M);
      L += f * sl[q][threadIdx.x]; A += f * sa[q][threadIdx.x];
    }
    o[(size_t)h * KVL + c] = A / L;
  }
