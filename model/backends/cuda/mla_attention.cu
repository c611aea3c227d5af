// MLA decode attention over the compressed cache, split over the context (cuda_src.mla_attention; grid: heads x
// splits). Each block scores its positions with the absorbed query (all KVL + ROPE dims; the values are the cache's
// first KVL dims: V is a slice of K), keeps an online softmax per warp, merges its warps and writes its split's (max,
// sum, unnormalised output) to part (H, SPLITS, KVL + 2); blocks past the last position return at once. A warp scores
// BATCH positions at once (independent loads and reductions, then one softmax update).
// The kernel's body (cuda_src writes its signature: part, qc, cache, early_pos). Defines: KVL, ROPE, CH (positions a split), SPLITS, SCALE (a float literal), CACHE_HALF (0 or 1), WARPS,
// THREADS, BATCH.
#define D (KVL + ROPE)  // a cache row
#define ND (D / 32)  // the query's and a key's values a lane holds
#define NV (KVL / 32)  // the output's
  STAMP_ENTER();
  const int h = blockIdx.x, sp = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = early_pos[0] + 1, j0 = sp * CH, j1 = min(n, j0 + CH);
  GRID_WAIT(); STAMP_WAIT();
  if (j0 >= n) return;
  float qv[ND], ov[NV], m = -INFINITY, l = 0.f;
  for (int k = 0; k < ND; k++) qv[k] = qc[(size_t)h * D + lane + 32 * k];
  for (int k = 0; k < NV; k++) ov[k] = 0.f;
  for (int jb = j0 + warp * BATCH; jb < j1; jb += WARPS * BATCH) {
    float v[BATCH][ND], sc[BATCH];
    for (int b = 0; b < BATCH; b++) {
      const int j = min(jb + b, j1 - 1); sc[b] = 0.f;
      for (int k = 0; k < ND; k++) {
        v[b][k] = cache_value(cache[(size_t)j * D + lane + 32 * k]); sc[b] = fmaf(qv[k], v[b][k], sc[b]);
      }
    }
    for (int mm = 16; mm > 0; mm >>= 1) for (int b = 0; b < BATCH; b++) sc[b] += __shfl_xor_sync(0xffffffffu, sc[b], mm);
    float mn = m;
    for (int b = 0; b < BATCH; b++) { sc[b] = jb + b < j1 ? sc[b] * SCALE : -INFINITY; mn = fmaxf(mn, sc[b]); }
    const float corr = expf(m - mn);
    l *= corr;
    for (int k = 0; k < NV; k++) ov[k] *= corr;
    for (int b = 0; b < BATCH; b++) {
      const float p = expf(sc[b] - mn); l += p;
      for (int k = 0; k < NV; k++) ov[k] = fmaf(p, v[b][k], ov[k]);
    }
    m = mn;
  }
  __shared__ float sm[WARPS], sl[WARPS], so[WARPS][KVL];
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
  for (int k = 0; k < NV; k++) so[warp][lane + 32 * k] = ov[k];
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < WARPS; w++) M = fmaxf(M, sm[w]);
  float f[WARPS], L = 0.f;
  for (int w = 0; w < WARPS; w++) { f[w] = sm[w] == -INFINITY ? 0.f : expf(sm[w] - M); L += f[w] * sl[w]; }
  float* mine = part + ((size_t)h * SPLITS + sp) * (KVL + 2);
  for (int c = threadIdx.x; c < KVL; c += THREADS) {
    float a = 0.f; for (int w = 0; w < WARPS; w++) a += f[w] * so[w][c];
    mine[2 + c] = a;
  }
  if (threadIdx.x == 0) { mine[0] = M; mine[1] = L; }
