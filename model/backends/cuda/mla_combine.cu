// The all-heads attention's splits merged once per head (cuda_src.mla_combine; grid: heads x blocks of THREADS
// columns): o (HEADS, KVL) = the active splits' outputs (part: HEADS x SPLITS x (max, sum, KVL unnormalised outputs),
// mla_heads.cu), weighted as one softmax over all positions, for mla_vb (mla_load.cuh). MERGE splits at a time, a
// thread's column and the splits' maxes and sums read together through L2 (`__ldcg`: the kernel before wrote them).
// The kernel's body (cuda_src writes its signature: o, part, early_pos). Defines: KVL, SPLITS, TP, THREADS, MERGE.
  STAMP_ENTER();
  const int h = blockIdx.x, c = blockIdx.y * THREADS + threadIdx.x, n = early_pos[0] + 1;
#include "heads_split.cuh"
  const int active = (n + ch - 1) / ch;
  GRID_WAIT(); STAMP_WAIT();
  const float* ph = part + (size_t)h * SPLITS * (KVL + 2);
  float mx = -INFINITY, lt = 0.f, a = 0.f;
  for (int s0 = 0; s0 < active; s0 += MERGE) {
    float pm[MERGE], pl[MERGE], v[MERGE];
    for (int u = 0; u < MERGE; u++) {
      const bool ok = s0 + u < active; const float* p = ph + (size_t)(s0 + u) * (KVL + 2);
      pm[u] = ok ? __ldcg(p) : -INFINITY; pl[u] = ok ? __ldcg(p + 1) : 0.f; v[u] = ok && c < KVL ? __ldcg(p + 2 + c) : 0.f;
    }
    float mn = mx;
    for (int u = 0; u < MERGE; u++) mn = fmaxf(mn, pm[u]);
    const float corr = expf(mx - mn);
    lt *= corr; a *= corr;
    for (int u = 0; u < MERGE; u++) { const float f = expf(pm[u] - mn); lt += f * pl[u]; a = fmaf(f, v[u], a); }
    mx = mn;
  }
  if (c < KVL) o[(size_t)h * KVL + c] = a / lt;
