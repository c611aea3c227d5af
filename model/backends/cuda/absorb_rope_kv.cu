// MLA's per-token step before attention (cuda_src.absorb_rope_kv): per head, q_nope absorbed through k_b into the
// compressed space (blockIdx.y < HEADS: ABSORB, the product); the extra row of blocks (blockIdx.y == HEADS) rotates
// q_pe, normalises c_kv, rotates k_pe and writes [c_kv, k_pe] to the KV cache row of the position, an element a thread
// (each block sums c_kv's squares itself), so no block waits on memory more than once before its stores. Out: qc
// (HEADS, KVL + ROPE) = [q_abs, rotated q_pe] and the cache.
// The kernel's body (cuda_src writes its signature: qc, cache, q, kv, gamma, cosv, sinv, pos, k_b's planes). Defines:
// HEADS, NOPE, ROPE, KVL, EPS (a float literal), CACHE_HALF, WARPS, THREADS, NT (the threads of a row
// of blocks), ABSORB (the product of head h's rows from xh into qc).
#define D (KVL + ROPE)  // a cache row
#define HALF (ROPE / 2)  // RoPE's pairs
  STAMP_ENTER();
  if (blockIdx.y < HEADS) { const int h = blockIdx.y; const float* xh = q + (size_t)h * (NOPE + ROPE);
  ABSORB }
  else { GRID_WAIT(); STAMP_WAIT(); const int p = pos[0], g = blockIdx.x * THREADS + threadIdx.x;
  const float cv = g < KVL ? kv[g] : 0.f, cg = g < KVL ? gamma[g] : 0.f;
  for (int i = g; i < HEADS * HALF; i += NT) { const int h = i / HALF, k = i % HALF;
    const float x0 = q[h * (NOPE + ROPE) + NOPE + 2 * k], x1 = q[h * (NOPE + ROPE) + NOPE + 2 * k + 1];
    const float c = cosv[p * HALF + k], s = sinv[p * HALF + k];
    qc[h * D + KVL + 2 * k] = x0 * c - x1 * s; qc[h * D + KVL + 2 * k + 1] = x0 * s + x1 * c; }
  for (int k = g; k < HALF; k += NT) { const float x0 = kv[KVL + 2 * k], x1 = kv[KVL + 2 * k + 1];
    const float c = cosv[p * HALF + k], s = sinv[p * HALF + k];
    cache[(size_t)p * D + KVL + 2 * k] = cache_store(x0 * c - x1 * s);
    cache[(size_t)p * D + KVL + 2 * k + 1] = cache_store(x0 * s + x1 * c); }
  __shared__ float sred[WARPS];
  float ss = 0.f, rs;
  for (int k = threadIdx.x * 4; k < KVL; k += THREADS * 4) { const float4 v = *(const float4*)(kv + k);
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }
  ss = group_sum(ss, 32); if ((threadIdx.x & 31) == 0) sred[threadIdx.x >> 5] = ss; __syncthreads();
  float t = 0.f; for (int w = 0; w < WARPS; w++) t += sred[w]; rs = 1.f / sqrtf(t / (float)KVL + EPS);
  if (g < KVL) cache[(size_t)p * D + g] = cache_store((cv * rs) * cg);
  for (int k = g + NT; k < KVL; k += NT) cache[(size_t)p * D + k] = cache_store((kv[k] * rs) * gamma[k]); }
