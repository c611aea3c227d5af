// mla_vb's merge of head h's splits of mla_attention (part: SPLITS x (max, sum, KVL unnormalised outputs)) into o in
// stage_x's padded shared memory `sx` (cuda_src.sx_at), the `active` splits that hold positions, while the block's
// weight reads are in flight: MERGE splits at a time, each thread's columns and their maxes and sums together through L2
// (`__ldcg`: one wait for all of them), rescaled as an online softmax from one chunk to the next. Defines: SPLITS, KVL,
// MERGE, THREADS.
#define NC ((KVL + THREADS - 1) / THREADS)  // the columns a thread merges
{ const float* ph = part + (size_t)h * SPLITS * (KVL + 2);
  float MX = -INFINITY, LT = 0.f, a[NC];
  for (int i = 0; i < NC; i++) a[i] = 0.f;
  for (int s0 = 0; s0 < active; s0 += MERGE) {
    float pm[MERGE], pl[MERGE], v[MERGE][NC];
    for (int u = 0; u < MERGE; u++) { const bool ok = s0 + u < active; const float* p = ph + (s0 + u) * (KVL + 2);
      pm[u] = ok ? __ldcg(p) : -INFINITY; pl[u] = ok ? __ldcg(p + 1) : 0.f;
      for (int i = 0; i < NC; i++) { const int c = threadIdx.x + THREADS * i;
        v[u][i] = ok && c < KVL ? __ldcg(p + 2 + c) : 0.f; } }
    float mn = MX;
    for (int u = 0; u < MERGE; u++) mn = fmaxf(mn, pm[u]);
    const float corr = expf(MX - mn);
    LT *= corr;
    for (int i = 0; i < NC; i++) a[i] *= corr;
    for (int u = 0; u < MERGE; u++) { const float f = expf(pm[u] - mn); LT += f * pl[u];
      for (int i = 0; i < NC; i++) a[i] = fmaf(f, v[u][i], a[i]); }
    MX = mn;
  }
  for (int i = 0; i < NC; i++) { const int c = threadIdx.x + THREADS * i;
    if (c < KVL) sx[(c) + ((c) >> 5) * 4] = a[i] / LT; }
  __syncthreads(); }
