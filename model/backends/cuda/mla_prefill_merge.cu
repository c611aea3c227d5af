// The prompt's all-heads attention's splits merged per token and head (cuda_prefill.mla_prefill; grid: heads x
// tokens, THREADS threads): o (tokens, HEADS, KVL) = token t's active splits' outputs (part: tokens x HEADS x SPLITS x
// (max, sum, KVL unnormalised outputs), mla_heads.cu with TOKENS), weighted as one softmax over its positions 0 ..
// early_pos[0] + t. A block holds a token's head, a thread KVL / THREADS of its columns, and walks the splits in order
// (a token's splits are few: its context over 1,024 positions a split).
// The kernel's body (cuda_prefill writes its signature: o, part, early_pos). Defines: HEADS, KVL, SPLITS, TP, LEAST,
// THREADS, TOKENS, TT (the tokens a block of the attention held: the last of them sized its splits).
#define NC ((KVL + THREADS - 1) / THREADS)  // the columns a thread merges
  STAMP_ENTER();
  const int h = blockIdx.x, tok = blockIdx.y, own = early_pos[0] + 1 + tok;  // the positions the token attends
  const int n = early_pos[0] + min(tok / TT * TT + TT, TOKENS);  // those of its attention block's last token
#include "heads_split.cuh"
  const int active = (own + ch - 1) / ch;
  GRID_WAIT(); STAMP_WAIT();
  const float* ph = part + ((size_t)tok * HEADS + h) * SPLITS * (KVL + 2);
  float mx = -INFINITY, lt = 0.f, a[NC];
  for (int i = 0; i < NC; i++) a[i] = 0.f;
  for (int s = 0; s < active; s++) {
    const float* p = ph + (size_t)s * (KVL + 2);
    const float m = __ldg(p), mn = fmaxf(mx, m), corr = expf(mx - mn), f = expf(m - mn);
    lt = fmaf(lt, corr, f * __ldg(p + 1));
    for (int i = 0; i < NC; i++) {
      const int c = threadIdx.x + THREADS * i;
      a[i] = fmaf(a[i], corr, c < KVL ? f * __ldg(p + 2 + c) : 0.f);
    }
    mx = mn;
  }
  float* oh = o + ((size_t)tok * HEADS + h) * KVL;
  for (int i = 0; i < NC; i++) if (threadIdx.x + THREADS * i < KVL) oh[threadIdx.x + THREADS * i] = a[i] / lt;
