// The prompt's grouped product on the tensor cores (cuda_prefill.grouped; grid: tiles x blocks of BN outputs, THREADS
// threads): y (tiles * TILE, OUT) float32 = each tile's TILE rows of x (float16, rows of IN) by the weight rows of the
// matrix its tile_expert names (E matrices of OUT rows; a dense weight is one). A block holds TILE rows by BN outputs and
// walks the input BK elements a stage: the stage's rows of x copied into shared memory, the weight's BN rows read
// quantised and dequantised there as float16 (DEQUANT_UNIT: cuda_prefill.unit_store, one unit of UE elements of a row),
// then the warps' products with mma16816 (mma.cuh), float32 accumulators, stored once at the end. Weight rows past OUT
// are zeros and not stored. The tiles of one expert are neighbours in the grid's fastest dimension, so their blocks
// read the same weight rows at about the same time (through L2). Tiles from used[0] on hold no rows: their outputs
// are zeros.
// The kernel's body (cuda_prefill writes its signature: y, x, tile_expert, used, the weight's planes). Defines: IN,
// OUT, TILE (16, 32 or 64), BN (64), BK (a multiple of the span of a unit's elements in the row), UE, THREADS (128), WR
// (warps over the rows).
#define WC (THREADS / 32 / WR)  // warps over the outputs
#define MT (TILE / WR / 16)  // a warp's 16-row tiles
#define NT (BN / WC / 8)  // a warp's 8-column tiles
#define SROW (BK + 8)  // halves a staged row takes (padded: a fragment's loads hit distinct banks)
#define UNITS (BN * (BK / UE))  // weight units a stage dequantises
  STAMP_ENTER();
  const int tile = blockIdx.x, o0 = blockIdx.y * BN, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, wr = warp % WR, wc = warp / WR;
  __shared__ __align__(16) unsigned short xs[TILE * SROW];
  __shared__ __align__(16) unsigned short ws[BN * SROW];
  GRID_WAIT(); STAMP_WAIT();
  if (tile >= used[0]) {  // a tile past the ones in use: zeros (a gather by rows may read them)
    for (int i = tid; i < TILE * BN; i += THREADS)
      if (o0 + i % BN < OUT) y[((size_t)tile * TILE + i / BN) * OUT + o0 + i % BN] = 0.f;
    return;
  }
  const size_t base = (size_t)tile_expert[tile] * OUT;  // the expert's first weight row
  const unsigned short* xt = x + (size_t)tile * TILE * IN;
  float acc[MT][NT][4];
  for (int m = 0; m < MT; m++) for (int c = 0; c < NT; c++) for (int r = 0; r < 4; r++) acc[m][c][r] = 0.f;
  for (int k0 = 0; k0 < IN; k0 += BK) {
    for (int i = tid; i < TILE * (BK / 8); i += THREADS) {  // x: 16 bytes a thread at a time
      const int r = i / (BK / 8), c = i % (BK / 8) * 8;
      *(uint4*)(xs + r * SROW + c) = *(const uint4*)(xt + (size_t)r * IN + k0 + c);
    }
    for (int i = tid; i < UNITS; i += THREADS) {  // the weight: a unit a thread at a time
      const int n = i / (BK / UE), uu = k0 / UE + i % (BK / UE);  // the row's unit uu
      unsigned short* dst = ws + n * SROW;  // the unit's elements go to dst[their place in the row - k0]
      if (o0 + n < OUT) {
        const size_t wrow = base + o0 + n;
        DEQUANT_UNIT
      } else if (i % (BK / UE) == 0) {
        for (int e = 0; e < BK; e += 2) *(unsigned*)(dst + e) = 0u;
      }
    }
    __syncthreads();
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[MT][4], b[NT][2];
      for (int m = 0; m < MT; m++) for (int r = 0; r < 4; r++) {
        const int row = (wr * MT + m) * 16 + g + 8 * (r & 1), col = kk + 2 * t + 8 * (r >> 1);
        a[m][r] = *(const unsigned*)(xs + row * SROW + col);
      }
      for (int c = 0; c < NT; c++) for (int r = 0; r < 2; r++) {
        const int n = (wc * NT + c) * 8 + g, col = kk + 2 * t + 8 * r;
        b[c][r] = *(const unsigned*)(ws + n * SROW + col);
      }
      for (int m = 0; m < MT; m++) for (int c = 0; c < NT; c++) mma16816(acc[m][c], a[m], b[c]);
    }
    __syncthreads();
  }
  for (int m = 0; m < MT; m++) for (int c = 0; c < NT; c++) for (int h = 0; h < 2; h++) {
    const int row = (wr * MT + m) * 16 + g + 8 * h, o = o0 + (wc * NT + c) * 8 + 2 * t;
    if (o < OUT) *(float2*)(y + ((size_t)tile * TILE + row) * OUT + o) = make_float2(acc[m][c][2 * h], acc[m][c][2 * h + 1]);
  }
