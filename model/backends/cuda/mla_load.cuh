// mla_vb's prologue after the all-heads attention (its splits merged by mla_combine): head h's o (KVL values) into
// stage_x's padded shared memory `sx` (cuda_src.sx_at), while the block's weight reads are in flight. Defines: KVL,
// THREADS.
{ for (int c = threadIdx.x; c < KVL; c += THREADS) sx[(c) + ((c) >> 5) * 4] = __ldcg(o + (size_t)h * KVL + c);
  __syncthreads(); }
