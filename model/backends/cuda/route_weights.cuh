// Route.weights (cuda_src.Route), for one thread after route_rank.cuh: the routing weight of each slot's expert (its
// probability; gating 3, softmax_weight: their softmax; normalised to their sum where ROUTE_NORM, scaled by ROUTE_SCALE
// where defined), kept by ROUTE_STORE(t, wv) for slot t.
float wsel[ROUTE_K]; for (int t = 0; t < ROUTE_K; t++) wsel[t] = sp[ROUTE_USED(t)];
#if ROUTE_GATING == 3
  float ws = -INFINITY; for (int t = 0; t < ROUTE_K; t++) ws = fmaxf(ws, wsel[t]); float se = 0.f;
  for (int t = 0; t < ROUTE_K; t++) { wsel[t] = expf(wsel[t] - ws); se += wsel[t]; }
  for (int t = 0; t < ROUTE_K; t++) wsel[t] /= se;
#endif
  float sum = 0.f; for (int t = 0; t < ROUTE_K; t++) sum += wsel[t];
  for (int t = 0; t < ROUTE_K; t++) { float wv = wsel[t];
#if ROUTE_NORM
    wv = wv / fmaxf(sum, 6.103515625e-5f);
#endif
#ifdef ROUTE_SCALE
    wv *= ROUTE_SCALE;
#endif
    ROUTE_STORE(t, wv) }
