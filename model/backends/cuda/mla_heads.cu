// MLA decode attention over the compressed cache for all heads at once (cuda_src.mla_attention_heads; grid: SPLITS
// splits of the context, THREADS threads): a block reads each position of its split once, TP positions at a time staged
// in shared memory as float16 (the next tile's reads in flight in registers meanwhile), and scores them against every
// head on the tensor cores (mma.cuh): S (heads x TP) = Q . C^T, the heads padded to HP, the warps splitting the heads'
// tiles and the k-steps of the cache row; then an online softmax per head over the tile, its weights in float16, and
// O (heads x KVL) += P . V, each warp holding KVL / NW columns of every head (V is the first KVL values of the cache
// rows). It writes its split's (max, sum, unnormalised output) per head to part (HEADS, SPLITS, KVL + 2) for
// mla_combine; blocks past the last position return at once.
// The kernel's body (cuda_src writes its signature: part, qc, cache, early_pos). Defines: HEADS, KVL, ROPE, SPLITS,
// SCALE (a float literal), CACHE_HALF (0 or 1), THREADS, TP (16); TOKENS for a prompt's chunk of that many tokens at
// positions early_pos[0].., TT of them a block (grid: splits x groups of TT tokens): the block's rows are its tokens'
// heads, each token's rows scoring the positions up to its own, so the staged cache serves TT tokens at once (a row
// of an earlier token may hold no position of a split past its own: NaN there, in its row alone, which no merge reads).
#ifdef TOKENS
#define ROWS (HEADS * TT)  // the block's rows of queries: its tokens' heads, token by token
#else
#define ROWS HEADS
#endif
#define D (KVL + ROPE)  // a cache row
#define HP ((ROWS + 15) / 16 * 16)  // the rows padded to the product's 16
#define MT (HP / 16)  // the heads' row tiles
#define NW (THREADS / 32)  // warps
#define KG (NW / MT)  // the warps of a row tile in S = Q . C^T, each over its share of the k-steps
#define KS (D / 16)  // the k-steps of a cache row
#define KMAX ((KS + KG - 1) / KG)  // a warp's k-steps at most
#define SROW (D + 8)  // halves a staged row takes (padded: the fragments' loads hit distinct banks)
#define PROW (TP + 8)  // halves a row of P takes
#define NT (KVL / NW / 8)  // a warp's 8-column tiles of O
#define LOADS ((TP * D / 8 + THREADS - 1) / THREADS)  // a thread's 16-byte pieces of a staged tile
  STAMP_ENTER();
  const int sp = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#ifdef TOKENS  // the prompt's chunk (cuda_prefill.mla_prefill): TT tokens a grid row, their queries and partials
  qc += (size_t)blockIdx.y * ROWS * D; part += (size_t)blockIdx.y * ROWS * SPLITS * (KVL + 2);
  // the positions its first token attends (its last token's: n, which sizes the splits) and the rows it holds
  const int n0 = early_pos[0] + 1 + blockIdx.y * TT, rows = min(TT, TOKENS - (int)blockIdx.y * TT) * HEADS;
  const int n = n0 + rows / HEADS - 1;
#define ROW_END(r) min(j1, n0 + (r) / HEADS)  // past the positions row r's token attends (causal)
#else
  const int n = early_pos[0] + 1, rows = HEADS;
#define ROW_END(r) j1
#endif
#include "heads_split.cuh"
  const int j0 = sp * ch, j1 = min(n, j0 + ch);
  GRID_WAIT(); STAMP_WAIT();
  if (j0 >= n) return;
  __shared__ __align__(16) unsigned short sc[TP * SROW];
  __shared__ __align__(16) unsigned short sp16[HP * PROW];
  __shared__ float ss[KG][HP][TP + 1];
  __shared__ float srow[3][HP];  // per head: the running max, the running sum, the tile's rescale of O
  const int mt = warp % MT, kg = warp / MT, ks0 = kg * KS / KG, ks1 = (kg + 1) * KS / KG;
  unsigned qa[KMAX][4];  // the warp's fragments of the absorbed query (and the rotated q_pe) in float16
  for (int i = 0; i < KMAX; i++) for (int r = 0; r < 4; r++) {
    const int h = mt * 16 + g + 8 * (r & 1), c = (ks0 + i) * 16 + 2 * t + 8 * (r >> 1);
    const bool ok = kg < KG && ks0 + i < ks1 && h < rows;
    qa[i][r] = ok ? pack_h2(qc[(size_t)h * D + c], qc[(size_t)h * D + c + 1]) : 0u;
  }
  float o[MT][NT][4];
  for (int m = 0; m < MT; m++) for (int c = 0; c < NT; c++) for (int r = 0; r < 4; r++) o[m][c][r] = 0.f;
  if (tid < HP) { srow[0][tid] = -INFINITY; srow[1][tid] = 0.f; }
#if CACHE_HALF
  typedef uint4 Piece[LOADS];
#else
  typedef float4 Piece[LOADS][2];
#endif
  Piece nx0, nx1;  // the reads of the next two tiles, in flight while a tile is scored
  auto fetch = [&](Piece& nx, int j) {  // the reads of tile j: rows past j1 repeat the last valid one
    if (j >= j1) return;
    for (int i = 0; i < LOADS; i++) {
      const int u = min(tid + i * THREADS, TP * (D / 8) - 1), r = u / (D / 8), c = u % (D / 8) * 8;
      const size_t at = (size_t)min(j + r, j1 - 1) * D + c;
#if CACHE_HALF
      nx[i] = *(const uint4*)(cache + at);
#else
      nx[i][0] = *(const float4*)(cache + at); nx[i][1] = *(const float4*)(cache + at + 4);
#endif
    }
  };
  auto tile = [&](Piece& nx, int j) {  // tile j from nx: staged, its reads j + 2 TP issued into nx, then scored
    for (int i = 0; i < LOADS; i++) {
      const int u = tid + i * THREADS;
      if (u >= TP * (D / 8)) break;
#if CACHE_HALF
      const uint4 v = nx[i];
#else
      const float4 a = nx[i][0], b = nx[i][1];
      uint4 v; v.x = pack_h2(a.x, a.y); v.y = pack_h2(a.z, a.w); v.z = pack_h2(b.x, b.y); v.w = pack_h2(b.z, b.w);
#endif
      *(uint4*)(sc + u / (D / 8) * SROW + u % (D / 8) * 8) = v;
    }
    __syncthreads();
    fetch(nx, j + 2 * TP);
    if (kg < KG) {  // S's partial sums over the warp's k-steps
      float s[TP / 8][4];
      for (int c = 0; c < TP / 8; c++) for (int r = 0; r < 4; r++) s[c][r] = 0.f;
      for (int i = 0; i < KMAX; i++) if (ks0 + i < ks1) for (int c = 0; c < TP / 8; c++) {
        const unsigned short* row = sc + (c * 8 + g) * SROW + (ks0 + i) * 16 + 2 * t;
        const unsigned b[2] = {*(const unsigned*)row, *(const unsigned*)(row + 8)};
        mma16816(s[c], qa[i], b);
      }
      for (int c = 0; c < TP / 8; c++) { const int col = c * 8 + 2 * t, h = mt * 16 + g;
        ss[kg][h][col] = s[c][0]; ss[kg][h][col + 1] = s[c][1]; ss[kg][h + 8][col] = s[c][2];
        ss[kg][h + 8][col + 1] = s[c][3]; }
    }
    __syncthreads();
    for (int h = tid >> 3; h < HP; h += THREADS / 8) {  // the softmax: 8 threads a head, 2 positions each
      const int c = (tid & 7) * 2;
      float v[2], mx = -INFINITY;
      for (int e = 0; e < 2; e++) {
        float a = 0.f; for (int q = 0; q < KG; q++) a += ss[q][h][c + e];
        v[e] = j + c + e < ROW_END(h) ? a * SCALE : -INFINITY; mx = fmaxf(mx, v[e]);
      }
      for (int m = 4; m > 0; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
      const float mo = srow[0][h], mn = fmaxf(mo, mx);
      const unsigned short p0 = f2h(expf(v[0] - mn)), p1 = f2h(expf(v[1] - mn));
      *(unsigned*)(sp16 + h * PROW + c) = (unsigned)p0 | ((unsigned)p1 << 16);
      float l = h2f(p0) + h2f(p1);
      for (int m = 4; m > 0; m >>= 1) l += __shfl_xor_sync(0xffffffffu, l, m);
      __syncwarp();
      if ((tid & 7) == 0) { const float corr = expf(mo - mn); srow[0][h] = mn; srow[1][h] = srow[1][h] * corr + l;
                            srow[2][h] = corr; }
    }
    __syncthreads();
    unsigned pa[MT][4];  // P's fragments (heads x the tile's positions)
    float corr[MT][2];
    for (int m = 0; m < MT; m++) {
      const unsigned short* p = sp16 + (m * 16 + g) * PROW + 2 * t;
      pa[m][0] = *(const unsigned*)p; pa[m][1] = *(const unsigned*)(p + 8 * PROW);
      pa[m][2] = *(const unsigned*)(p + 8); pa[m][3] = *(const unsigned*)(p + 8 * PROW + 8);
      corr[m][0] = srow[2][m * 16 + g]; corr[m][1] = srow[2][m * 16 + g + 8];
    }
    for (int c = 0; c < NT; c++) {
      const int col = (warp * NT + c) * 8 + g;
      const unsigned b[2] = {sc[2 * t * SROW + col] | ((unsigned)sc[(2 * t + 1) * SROW + col] << 16),
                             sc[(2 * t + 8) * SROW + col] | ((unsigned)sc[(2 * t + 9) * SROW + col] << 16)};
      for (int m = 0; m < MT; m++) {
        o[m][c][0] *= corr[m][0]; o[m][c][1] *= corr[m][0]; o[m][c][2] *= corr[m][1]; o[m][c][3] *= corr[m][1];
        mma16816(o[m][c], pa[m], b);
      }
    }
    __syncthreads();
  };
  fetch(nx0, j0); fetch(nx1, j0 + TP);
  for (int j = j0; j < j1; j += 2 * TP) { tile(nx0, j); if (j + TP < j1) tile(nx1, j + TP); }
  for (int m = 0; m < MT; m++) for (int c = 0; c < NT; c++) {
    const int h = m * 16 + g, col = (warp * NT + c) * 8 + 2 * t;
    if (h < rows) { float* p = part + ((size_t)h * SPLITS + sp) * (KVL + 2) + 2 + col; p[0] = o[m][c][0]; p[1] = o[m][c][1]; }
    if (h + 8 < rows) { float* p = part + ((size_t)(h + 8) * SPLITS + sp) * (KVL + 2) + 2 + col;
                         p[0] = o[m][c][2]; p[1] = o[m][c][3]; }
  }
  if (tid < rows) { float* p = part + ((size_t)tid * SPLITS + sp) * (KVL + 2); p[0] = srow[0][tid]; p[1] = srow[1][tid]; }
