  // The MoE router's body (cuda_src.router; its signature: sel, wts, logits, cnt, [own], x, gamma, [bias], [force], the
  // weight's planes): each block computes some experts' logits from the normalised input (ROUTER_PRODUCTS, RMSNorm
  // folded); the last block to finish (an atomic count, reset by it) reads them once through L2, ranks them
  // (route_rank.cuh) and writes the ids used and their weights (route_weights.cuh); forced: its own top k to `own`.
  // Defines: route_rank.cuh's, ROUTE_NORM, ROUTE_SCALE (where the weights are scaled), ROUTER_PRODUCTS.
#if ROUTE_FORCED
#define ROUTE_STORE(t, wv) sel[t] = ROUTE_USED(t); wts[t] = wv; own[t] = ssel[t];
#else
#define ROUTE_STORE(t, wv) sel[t] = ROUTE_USED(t); wts[t] = wv;
#endif
  STAMP_ENTER();
  ROUTER_PRODUCTS
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) last = arrive(cnt) == (int)gridDim.x - 1;
  __syncthreads();
  if (!last) return;
#include "route_rank.cuh"
  if (threadIdx.x != 0) return;
#include "route_weights.cuh"
  cnt[0] = 0;
