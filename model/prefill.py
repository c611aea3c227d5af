"""The prompt's chunks of T > 1 tokens in the forms that suit many queries. The FFN as batched products of dequantised
weights (StructureConfig.prefill_ffn = grouped), where decode's per-token path gathers and dequantises each token's own
experts, with no reuse over the chunk.

Routed experts: the chunk's T*K (token, slot) pairs are laid out by expert in tiles of `prefill_tile` rows, each
expert's pairs filling whole tiles of their own in the pairs' order (a counting sort on the device: `layout`); each
tile's rows are multiplied by its expert's weights, then each pair's row is read back and weighted into its token. An
expert with c pairs takes ceil(c / tile) tiles, so a chunk takes at most (T*K + m * (tile - 1)) // tile tiles with m =
min(E, T*K): that static bound sizes the products, so a chunk size and a tile give one set of kernel shapes whatever the
routing, no pair ever overflows, and the padding is at most tile - 1 rows per expert in use. The weights are read
either `indexed`: every expert dequantised once per chunk into one buffer of `prefill_dtype`, which the product indexes
per row by its tile's expert; or `copied`: each tile's expert dequantised into a matrix of its own (a weight read per
tile), which the product then reads as a plain batched matmul (tensor cores where the device has them); or `quantised`:
the native backend's tensor-core kernels read each tile's expert quantised and dequantise it into shared memory
(model/backends/cuda_prefill.py), no dequantised copy written. The shared expert and the dense FFN are plain matmuls of
weights dequantised once per chunk, or native's kernels over the chunk's rows in tiles.

The attention (StructureConfig.prefill_attention = decompressed), as llama.cpp and FlashMLA prefill: each head's
keys (k_b^T c_kv, qk_nope dims) and values (v_b c_kv, v_head dims) decompressed from the compressed cache rows once per
chunk, then ordinary causal attention with q's nope part as projected, the rope part of the keys one for all heads. A
(query, key) pair then costs qk_nope + qk_rope + v_head products instead of the absorbed form's 2 * kv_lora + qk_rope,
for kv_lora * (qk_nope + v_head) per head and key to decompress: it saves products where a chunk's queries outnumber
kv_lora * (qk_nope + v_head) / (2 * kv_lora - qk_nope - v_head), and costs them in smaller chunks. Both forms read and
write the same compressed cache rows.
"""
from __future__ import annotations

import math

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType

from model.backends import registry as K
from model.quants import to_float
from model.stages import Glu
from model.structure import StructureConfig
from model.weights import QWeight


def dtype(cfg: StructureConfig) -> DType: return dtypes.float16 if cfg.prefill_dtype == "float16" else dtypes.float32


def dequant(w: QWeight, dt: DType, idx: Tensor | None = None) -> Tensor:
  """w's values in dt, a buffer of their own (contiguous): all of them, by w's backend, or the matrices of the leading
  indices idx."""
  if idx is None: return K.get(w.backend).dequantised(w, dt)
  if w.cache is not None: return w.cache[idx].cast(dt).contiguous()
  return to_float(w.view(w.shape, idx), w.ggml_type, (*idx.shape, *w.shape[1:])).cast(dt).contiguous()


def _in_tiles(xs: Tensor, w: QWeight) -> Tensor:
  """Native's product in tiles of G groups of M rows, xs (G, M, in), group g's rows by w's matrix g (w (G, out, in)),
  or by w itself (w (out, in), G = 1) -> (G, M, out) float32. Tiles of 64 rows where the rows fill several, else 16
  (a short chunk pads less)."""
  G, M, inp = xs.shape
  tile = 64 if M >= 256 else 16
  per = -(-M // tile)  # a group's tiles
  rows = xs.pad((None, (0, per * tile - M), None)).cast(dtypes.float16).reshape(G * per, tile, inp)
  return K.get("native").grouped(rows, w, None, None).reshape(G, per * tile, -1)[:, :M]


def linear(x: Tensor, w: QWeight, cfg: StructureConfig) -> Tensor:
  """x (..., in) @ w.T (out, in) -> (..., out) float32: one matmul for all the chunk's tokens, of w dequantised to the
  config's dtype, or native's product of the rows in tiles (prefill_weights=quantised)."""
  if cfg.prefill_weights == "quantised" and w.cache is None:
    lead, inp = x.shape[:-1], x.shape[-1]
    return _in_tiles(x.reshape(1, math.prod(lead), inp), w)[0].reshape(*lead, -1)
  dt = dtype(cfg)
  return x.cast(dt).matmul(dequant(w, dt).T, dtype=dtypes.float32)


def per_head(x: Tensor, w: QWeight, cfg: StructureConfig) -> Tensor:
  """x (..., H, in) with w (H, out, in) -> (..., H, out) float32: each head's matrix by all the chunk's tokens at once,
  dequantised to the config's dtype for one batched matmul, or native's product in tiles with the heads as experts
  (prefill_weights=quantised)."""
  lead, (H, out, inp) = x.shape[:-2], w.shape
  xh = x.reshape(math.prod(lead), H, inp).transpose(0, 1)  # (H, M, in)
  if cfg.prefill_weights == "quantised" and w.cache is None: y = _in_tiles(xh, w)
  else:
    dt = dtype(cfg)
    y = xh.cast(dt).matmul(dequant(w, dt).transpose(-1, -2), dtype=dtypes.float32)  # (H, M, out)
  return y.transpose(0, 1).reshape(*lead, H, out)


def glu(x: Tensor, f: Glu, cfg: StructureConfig) -> Tensor:
  """The SiLU-gated FFN f of x (..., dim), its products as `linear`: (..., dim) float32."""
  if f.gate_up is not None: g, u = linear(x, f.gate_up, cfg).split(f.hidden, dim=-1)
  else: g, u = linear(x, f.gate, cfg), linear(x, f.up, cfg)
  return linear((g.silu() * u).contiguous(), f.down, cfg)


def layout(sel: Tensor, n_experts: int, tile: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """The pairs of sel (T, K) by expert in tiles: (each tile's expert (N,), the token each row reads (N * tile,), each
  pair's row (T * K,), the tiles in use (1,)). Padding rows read token 0 and no pair reads them back; tiles past the
  last used one take the last expert."""
  (T, K), E = sel.shape, n_experts
  P = T * K
  e, ar = sel.reshape(P).cast(dtypes.int32), Tensor.arange(P)
  onehot = e.unsqueeze(1) == Tensor.arange(E).unsqueeze(0)  # (P, E)
  tiles = (onehot.sum(0) + tile - 1) // tile  # each expert's tiles
  end = tiles.cumsum()
  start = end - tiles
  # each pair's rank among its expert's pairs
  rank = ((e.unsqueeze(0) == e.unsqueeze(1)) & (ar.unsqueeze(0) < ar.unsqueeze(1))).sum(1)
  row = (onehot.where(start.unsqueeze(0), 0).sum(1) * tile + rank).cast(dtypes.int32)
  N = (P + min(E, P) * (tile - 1)) // tile
  tile_expert = (end.unsqueeze(0) <= Tensor.arange(N).unsqueeze(1)).sum(1).minimum(E - 1).cast(dtypes.int32)
  token = (row.unsqueeze(0) == Tensor.arange(N * tile).unsqueeze(1)).where((ar // K).unsqueeze(0), 0).sum(1)
  used = end[-1:].cast(dtypes.int32)
  return tile_expert.contiguous(), token.cast(dtypes.int32).contiguous(), row.contiguous(), used.contiguous()


def _product(x: Tensor, w: QWeight, tile_expert: Tensor, used: Tensor, cfg: StructureConfig) -> Tensor:
  """x (N, tile, in) by each tile's expert of w (E, out, in) -> (N, tile, out) float32 (quantised: zeros past the used
  tiles)."""
  if cfg.prefill_weights == "quantised" and w.cache is None:
    return K.get("native").grouped(x.cast(dtypes.float16), w, tile_expert, used)
  (N, tile, _), dt = x.shape, dtype(cfg)
  if cfg.prefill_weights == "copied":
    return x.matmul(dequant(w, dt, tile_expert).transpose(-1, -2), dtype=dtypes.float32)
  # every expert, by the weight's backend, after the layer's routing: its buffer is reused from layer to layer instead
  # of every layer's living from the graph's start, as weight-only kernels would be scheduled (GLM-4.7-Flash: 2.4 GB a
  # layer). The index expanded over the tile's rows before the gather: tinygrad then reads the weights inside the
  # product instead of copying each tile's matrix out first
  every = K.get(w.backend).dequantised(w, dt, used)
  wt = every[tile_expert.reshape(N, 1).expand(N, tile)]  # (N, tile, out, in)
  return (x.unsqueeze(-2) * wt).sum(-1, dtype=dtypes.float32)


def moe(xn: Tensor, sel: Tensor, wts: Tensor, experts: Glu, shared: Glu | None, n_experts: int,
        cfg: StructureConfig) -> Tensor:
  """The routed experts' outputs weighted and summed, plus the shared expert's, for xn (B, T, D) routed by sel and wts
  (B, T, K): (B, T, D) float32."""
  (B, T, D), K, tile = xn.shape, sel.shape[-1], cfg.prefill_tile
  tile_expert, token, row, used = layout(sel.reshape(B * T, K), n_experts, tile)
  x = xn.reshape(B * T, D)[token].cast(dtypes.float16 if cfg.prefill_weights == "quantised" else dtype(cfg))
  x = x.reshape(-1, tile, D)
  if experts.gate_up is not None:
    g, u = _product(x, experts.gate_up, tile_expert, used, cfg).split(experts.hidden, dim=-1)
  else:
    g, u = _product(x, experts.gate, tile_expert, used, cfg), _product(x, experts.up, tile_expert, used, cfg)
  act = (g.silu() * u).cast(x.dtype).contiguous()
  y = _product(act, experts.down, tile_expert, used, cfg).reshape(-1, D)
  out = (y[row].reshape(B, T, K, D) * wts.unsqueeze(-1)).sum(2)
  # the shared expert's output a buffer of its own: its down product fused with the sum over the slots would be one
  # kernel of two reductions, off the tensor cores
  return out if shared is None else out + glu(xn, shared, cfg).contiguous()


def causal_mask(T: int, start_pos: int | UOp) -> Tensor:
  """(1, 1, T, start_pos + T): 0 where the chunk's query t (at position start_pos + t) reads the key, -inf past it."""
  return Tensor.full((1, 1, T, start_pos + T), -math.inf).triu(start_pos + 1)


def attn_dtype(cfg: StructureConfig, T: int) -> DType:
  """The dtype a chunk of T tokens multiplies its attention in (prefill_attn_dtype; decode's single token: float32)."""
  return dtypes.float16 if T > 1 and cfg.prefill_attn_dtype == "float16" else dtypes.float32


def attention(q_nope: Tensor, q_pe: Tensor, rows: Tensor, k_b: Tensor, v_b: Tensor, start_pos: int | UOp,
              scale: float, dt: DType = dtypes.float32) -> Tensor:
  """The chunk's queries q_nope (B, T, H, nope) and rotated q_pe (B, T, H, rope) over the cache rows (B, S, kv_lora +
  rope) of positions 0..start_pos + T (the prefix and the chunk's own), decompressed per head by k_b (H, kv_lora, nope)
  and v_b (H, v_head, kv_lora), causal: (B, T, H * v_head) float32. Its scores are explicit whatever the `attention`
  knob, which picks decode's form. dt: the dtype its products multiply in (sums in float32), and the decompressed keys
  and values are held in."""
  (B, T, H, _), kvl, S = q_nope.shape, k_b.shape[1], rows.shape[1]
  rows = rows.cast(dt)
  c, k_pe = rows[..., :kvl].unsqueeze(1), rows[..., kvl:].unsqueeze(1)  # (B, 1, S, kvl), (B, 1, S, rope)
  mm = lambda a, b: a.matmul(b, dtype=dtypes.float32)
  # buffers of their own: the weights dequantised and the keys and values decompressed once per chunk, not per query;
  # each head's keys whole (nope and rope), so that a score is one product, a single reduction (tensor cores), where a
  # sum of the nope and rope products is one kernel of two reductions (none)
  k_nope = mm(c, k_b.cast(dt).contiguous()).cast(dt)  # (B, H, S, nope)
  k = k_nope.cat(k_pe.expand(B, H, S, k_pe.shape[-1]), dim=-1).contiguous()  # (B, H, S, nope + rope)
  v = mm(c, v_b.cast(dt).contiguous().transpose(-1, -2)).cast(dt).contiguous()  # (B, H, S, v_head)
  # the queries a buffer too: in the model's graph the scores' kernel otherwise fuses their making (the rope) and falls
  # off the tensor cores where the keys' count is a constant (a prompt of one chunk)
  q = q_nope.cat(q_pe, dim=-1).transpose(1, 2).cast(dt).contiguous()  # (B, H, T, nope + rope)
  s = mm(k, q.transpose(-1, -2)) * scale + causal_mask(T, start_pos).transpose(-1, -2)  # (B, H, S, T)
  # the probabilities a buffer of their own: a plain product by v, not a softmax recomputed per tile of v's columns
  return mm(_softmax_keys(s, dt).transpose(-1, -2), v).transpose(1, 2).reshape(B, T, H * v.shape[-1])


def _softmax_keys(s: Tensor, dt: DType) -> Tensor:
  """The softmax of the scores s (B, H, S, T) over their keys, in dt, a buffer of its own. The keys in the rows, the
  queries along them: adjacent threads read adjacent scores. Each reduction over the keys in two steps, per block of
  up to 128 keys then over the blocks, which spreads it over the GPU where one reduction per query would give too few
  threads (B * H * T) to load the memory."""
  B, H, S, T = s.shape
  block = next((b for b in (128, 64, 32, 16, 8) if (S % b == 0 if isinstance(S, int) else S.divides(b) is not None)), S)
  sb = s.reshape(B, H, S // block, block, T)
  m = sb.max(3, keepdim=True).contiguous().max(2, keepdim=True).contiguous()
  e = (sb - m).exp()
  z = e.sum(3, keepdim=True).contiguous().sum(2, keepdim=True).contiguous()
  return (e / z).cast(dt).reshape(B, H, S, T).contiguous()
