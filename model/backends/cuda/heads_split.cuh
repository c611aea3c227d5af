// The positions ch a split of the all-heads attention holds for n positions in the cache (mla_heads.cu and
// mla_combine.cu compute it alike): a multiple of TP, at least LEAST, as few as keep all SPLITS splits busy once n
// allows. Defines: SPLITS, TP, LEAST.
const int ch = max(LEAST, (n + SPLITS * TP - 1) / (SPLITS * TP) * TP);
