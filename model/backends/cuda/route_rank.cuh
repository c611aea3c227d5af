// Route.rank (cuda_src.Route), for every thread of a block of ROUTE_THREADS (it holds barriers): the first warp reads the
// logits (ROUTE_LOGITS, through L2) and applies the gating function and the bias (ROUTE_BIAS_IN) into shared `sp`
// (probabilities) and `ssc` (scores: -inf past the experts or where not a number); a thread per expert counts the scores
// above its own (ties to the lower index, as the pairwise top-k) and puts the top ROUTE_K ids in rank order into shared
// `ssel`. Defines: ROUTE_E (experts), ROUTE_K, ROUTE_GATING (cuda_src.GATING), ROUTE_BIAS (0 or 1), ROUTE_FORCED (0
// or 1: the ids used come from `force`), ROUTE_THREADS, ROUTE_LOGITS, ROUTE_BIAS_IN.
#define ROUTE_EPL ((ROUTE_E + 31) / 32)  // experts a lane of the first warp holds
#define ROUTE_BEATS(c, d) (v.c > s || (v.c == s && j + d < e))
#if ROUTE_FORCED
#define ROUTE_USED(t) min(max(force[t], 0), ROUTE_E - 1)
#else
#define ROUTE_USED(t) min(max(ssel[t], 0), ROUTE_E - 1)
#endif
__shared__ int ssel[ROUTE_K];
  __shared__ __align__(16) float ssc[32 * ROUTE_EPL];
  __shared__ float sp[32 * ROUTE_EPL];
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float lg[ROUTE_EPL];
    for (int i = 0; i < ROUTE_EPL; i++) lg[i] = lane + 32 * i < ROUTE_E ? __ldcg(ROUTE_LOGITS + lane + 32 * i) : 0.f;
#if ROUTE_GATING == 1
    float mx = -INFINITY, den = 0.f; for (int i = 0; i < ROUTE_EPL; i++) if (lane + 32 * i < ROUTE_E) mx = fmaxf(mx, lg[i]); mx = warp_max(mx); for (int i = 0; i < ROUTE_EPL; i++) if (lane + 32 * i < ROUTE_E) den += expf(lg[i] - mx); den = group_sum(den, 32);
#endif
    for (int i = 0; i < ROUTE_EPL; i++) {
      const int e = lane + 32 * i;
#if ROUTE_GATING == 1
      const float p = expf(lg[i] - mx) / den,
#elif ROUTE_GATING == 2
      const float p = 1.f / (1.f + expf(-lg[i])),
#elif ROUTE_GATING == 3
      const float p = lg[i],
#else
      const float p = sqrtf(logf(1.f + expf(lg[i]))),
#endif
#if ROUTE_BIAS
        s = e < ROUTE_E ? p + ROUTE_BIAS_IN[e] : 0.f;
#else
        s = e < ROUTE_E ? p : 0.f;
#endif
      sp[e] = p; ssc[e] = e < ROUTE_E && s == s ? s : -INFINITY;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < ROUTE_E; e += ROUTE_THREADS) {
    const float s = ssc[e]; int rank = 0;
    for (int j = 0; j < 32 * ROUTE_EPL; j += 4) {
      const float4 v = *(const float4*)(ssc + j);
      rank += ROUTE_BEATS(x, 0) + ROUTE_BEATS(y, 1) + ROUTE_BEATS(z, 2) + ROUTE_BEATS(w, 3);
    }
    if (rank < ROUTE_K) ssel[rank] = e;
  }
  __syncthreads();
