"""Synthetic deepseek2 GGUF files: a preset's exact shapes, metadata and tokenizer layout, random weights.

Quantized weights are generated directly as raw blocks (nothing is quantized from floats), tensor by tensor and in
CHUNK_BYTES pieces, so memory stays bounded even for a full-size model (~0.5 GB peak). Matrices have std 1/sqrt(fan_in)
(the router 2/sqrt(fan_in), token embeddings unit rms), norm weights 1 + N(0, 0.05^2). Quantized codes are zero-mean:
uniform Q4_0 nibbles would average -0.5 after the -8 offset, a bias that adds up across a row until every token routes
to the same experts. Each tensor draws from its own stream (seed, crc32(name)), so a file shortened with `layers` holds
exactly the first blocks of the full one.
"""
from __future__ import annotations

import math
import pathlib
import re
import zlib
from collections import Counter
from typing import NamedTuple

import gguf
import numpy as np
from gguf import MODEL_TENSOR as MT
from gguf import GGMLQuantizationType as T

from model.presets import ModelShape, get_preset

QUANT_CHOICES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m")
CHUNK_BYTES = 64 << 20
N_MERGES = 300

_PURE = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K,
         "q6_k": T.Q6_K}
_F = gguf.LlamaFileType
_FTYPE = {"f32": _F.ALL_F32, "f16": _F.MOSTLY_F16, "bf16": _F.MOSTLY_BF16, "q8_0": _F.MOSTLY_Q8_0,
          "q4_0": _F.MOSTLY_Q4_0, "q4_k": _F.MOSTLY_Q4_K_S, "q5_k": _F.MOSTLY_Q5_K_S, "q6_k": _F.MOSTLY_Q6_K,
          "q4_k_m": _F.MOSTLY_Q4_K_M}


class _Tensor(NamedTuple):
  name: str
  ne: tuple[int, ...]        # ggml order: ne[0] is the row (input) length
  type: T
  std: float
  mean: float = 0.0


def _use_more_bits(layer: int, n_layers: int) -> bool:
  return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _q4_k_m(name: str, layer: int | None, n_layers: int) -> T:
  """The q4_k_m mixture, modelled on unsloth's GLM-4.7-Flash Q4_K_M rather than stock llama-quantize.

  From llama.cpp's src/llama-quant.cpp: output.weight -> Q6_K; ffn_down, ffn_down_exps, ffn_down_shexp and the legacy
  attn_kv_b -> Q6_K on use_more_bits layers (the first and last eighth, and every third layer between), else the base
  Q4_K; token_embd and everything else -> Q4_K. Unlike stock Q4_K_M, the per-token attention projections (attn_q*,
  attn_kv_a_mqa, attn_k_b, attn_v_b, attn_kv_b, attn_output) and the shared expert get Q5_K, and rows that are not a
  multiple of 256 (attn_k_b: qk_nope wide) fall back to Q8_0 (see _qtype) where llama-quantize would pick Q5_0.
  """
  if name == "output.weight": return T.Q6_K
  if layer is not None and ("ffn_down" in name or "attn_kv_b" in name) and _use_more_bits(layer, n_layers):
    return T.Q6_K
  if "_shexp" in name or ".attn_" in name: return T.Q5_K
  return T.Q4_K


def _qtype(quant: str, name: str, row: int, layer: int | None, n_layers: int) -> T:
  want = _q4_k_m(name, layer, n_layers) if quant == "q4_k_m" else _PURE[quant]
  return next(t for t in (want, T.Q8_0, T.F16) if row % gguf.GGML_QUANT_SIZES[t][0] == 0)


def tensor_plan(s: ModelShape, quant: str = "q4_0", legacy_kv_b: bool = False,
                routing: str = "random") -> list[_Tensor]:
  """Every tensor of the file in write order, with its ggml shape as llama.cpp's deepseek2 loader expects it. With
  decisive routing the projections that write into the residual stream are scaled by 1/sqrt(blocks), so the stream stays
  near unit rms through depth and the embeddings' routing signature stays readable in the last block as in the first."""
  out: list[_Tensor] = []
  residual = s.n_layers ** -0.5 if routing == "decisive" else 1.0
  def tn(t: MT, bid: int | None = None, suffix: str = "weight") -> str:
    return f"{gguf.TENSOR_NAMES[t].format(bid=bid)}.{suffix}"
  def mat(name: str, *ne: int, layer: int | None = None, std: float | None = None) -> None:
    if std is None: std = ne[0] ** -0.5 * (residual if name.split(".")[-2] in _WRITES_RESIDUAL else 1.0)
    out.append(_Tensor(name, ne, _qtype(quant, name, ne[0], layer, s.n_layers), std))
  def norm(name: str, n: int) -> None: out.append(_Tensor(name, (n,), T.F32, 0.05, 1.0))
  # unit-rms embeddings keep the token identity from drowning in the first blocks' outputs (rms ~1), so routing varies
  # by token; a tied table is the output head too and takes the geometric mean of that and 1/sqrt(dim)
  mat(tn(MT.TOKEN_EMBD), s.dim, s.vocab, std=s.dim ** -0.25 if s.tied else 1.0)
  for i in range(s.n_layers):
    norm(tn(MT.ATTN_NORM, i), s.dim)
    if s.q_lora:
      mat(tn(MT.ATTN_Q_A, i), s.dim, s.q_lora, layer=i)
      norm(tn(MT.ATTN_Q_A_NORM, i), s.q_lora)
      mat(tn(MT.ATTN_Q_B, i), s.q_lora, s.n_heads * s.qk_head, layer=i)
    else: mat(tn(MT.ATTN_Q, i), s.dim, s.n_heads * s.qk_head, layer=i)
    mat(tn(MT.ATTN_KV_A_MQA, i), s.dim, s.kv_lora + s.qk_rope, layer=i)
    norm(tn(MT.ATTN_KV_A_NORM, i), s.kv_lora)
    if legacy_kv_b: mat(tn(MT.ATTN_KV_B, i), s.kv_lora, s.n_heads * (s.qk_nope + s.v_head), layer=i)
    else:
      mat(tn(MT.ATTN_K_B, i), s.qk_nope, s.kv_lora, s.n_heads, layer=i)
      mat(tn(MT.ATTN_V_B, i), s.kv_lora, s.v_head, s.n_heads, layer=i)
    mat(tn(MT.ATTN_OUT, i), s.n_heads * s.v_head, s.dim, layer=i)
    norm(tn(MT.FFN_NORM, i), s.dim)
    if i < s.n_dense:
      mat(tn(MT.FFN_GATE, i), s.dim, s.dense_ffn, layer=i)
      mat(tn(MT.FFN_UP, i), s.dim, s.dense_ffn, layer=i)
      mat(tn(MT.FFN_DOWN, i), s.dense_ffn, s.dim, layer=i)
      continue
    # wider logits: top-k varies by token
    out.append(_Tensor(tn(MT.FFN_GATE_INP, i), (s.dim, s.n_experts), T.F32, 2 * s.dim ** -0.5))
    if s.exp_probs_bias: out.append(_Tensor(tn(MT.FFN_EXP_PROBS_B, i, "bias"), (s.n_experts,), T.F32, 0.02))
    mat(tn(MT.FFN_GATE_EXP, i), s.dim, s.expert_ffn, s.n_experts, layer=i)
    mat(tn(MT.FFN_UP_EXP, i), s.dim, s.expert_ffn, s.n_experts, layer=i)
    mat(tn(MT.FFN_DOWN_EXP, i), s.expert_ffn, s.dim, s.n_experts, layer=i)
    if s.n_shared:
      mat(tn(MT.FFN_GATE_SHEXP, i), s.dim, s.expert_ffn * s.n_shared, layer=i)
      mat(tn(MT.FFN_UP_SHEXP, i), s.dim, s.expert_ffn * s.n_shared, layer=i)
      mat(tn(MT.FFN_DOWN_SHEXP, i), s.expert_ffn * s.n_shared, s.dim, layer=i)
  norm(tn(MT.OUTPUT_NORM), s.dim)
  if not s.tied: mat(tn(MT.OUTPUT), s.dim, s.vocab)
  return out


# *** random blocks: gen(rng, n_blocks, std) -> array of n_blocks * type_size bytes whose dequantized values have
# that std

def _raw(rng: np.random.Generator, n: int) -> np.ndarray:
  return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
def _lut(rng: np.random.Generator, n: int, lut: np.ndarray) -> np.ndarray:
  return np.take(lut, _raw(rng, n).view(np.uint16)).view(np.uint8)
# per-block fp16 scales, jittered by U(0.75, 1.25)
def _d(rng: np.random.Generator, nb: int, scale: float) -> np.ndarray:
  return (scale / _JITTER_RMS * rng.uniform(0.75, 1.25, nb)).astype(np.float16).view(np.uint8).reshape(nb, 2)
def _lut16(lut8: np.ndarray) -> np.ndarray:
  v = np.arange(1 << 16)
  return lut8[v & 255].astype(np.uint16) | lut8[v >> 8].astype(np.uint16) << 8   # two bytes per lookup

_JITTER_RMS = math.sqrt(1 + 0.5 ** 2 / 12)
_B = np.arange(256)
_NIB = np.arange(16, dtype=np.uint8)
_NIB[0] = 8   # Q4_0: nibble 0 (code -8) becomes 8 (code 0), so codes are 1..15, symmetric around 8
_Q4_0_LUT, _Q4_0_SD = _lut16(_NIB[_B & 15] | _NIB[_B >> 4] << 4), float(np.sqrt(np.mean((_NIB - 8.0) ** 2)))
# Q8_0: int8 -128 becomes 0, so codes are symmetric in -127..127
_Q8_CODES = np.where(_B == 128, 0, _B).astype(np.uint8)
_Q8_0_LUT, _Q8_0_SD = _lut16(_Q8_CODES), float(np.sqrt(np.mean(_Q8_CODES.view(np.int8).astype(np.float64) ** 2)))
_Q6_SC = np.arange(8, 17)
_Q6_K_SD = float(np.sqrt(np.mean((np.arange(1, 64) - 32.0) ** 2) * np.mean(_Q6_SC ** 2.0)))


def _f32(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
  return rng.standard_normal(n, dtype=np.float32) * np.float32(std)
def _f16(rng: np.random.Generator, n: int, std: float) -> np.ndarray: return _f32(rng, n, std).astype(np.float16)
def _bf16(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
  return (_f32(rng, n, std).view(np.uint32) >> 16).astype(np.uint16)


def _q4_0(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
  out = np.empty((nb, 18), np.uint8)
  out[:, :2], out[:, 2:] = _d(rng, nb, std / _Q4_0_SD), _lut(rng, nb * 16, _Q4_0_LUT).reshape(nb, 16)
  return out


def _q8_0(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
  out = np.empty((nb, 34), np.uint8)
  out[:, :2], out[:, 2:] = _d(rng, nb, std / _Q8_0_SD), _lut(rng, nb * 32, _Q8_0_LUT).reshape(nb, 32)
  return out


def _kscales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
  """8 six-bit scales and mins -> the 12 bytes that gguf.quants.Q4_K.get_scale_min unpacks."""
  lo, hi = (sc[:, :4], mn[:, :4]), (sc[:, 4:], mn[:, 4:])
  return np.concatenate([lo[0] | (hi[0] >> 4) << 6, lo[1] | (hi[1] >> 4) << 6, (hi[0] & 15) | (hi[1] & 15) << 4],
                        axis=1)


def _qk(bits: int, top: int, size: int):
  """Q4_K/Q5_K: value = d*sc*q - dmin*m with uniform q in 0..2^bits-1. With dmin = d and m = sc*(2^bits-1)/2 every
  sub-block is zero-mean; sc is even (2..2*top) so m is an integer, and top keeps m within 6 bits."""
  sd = math.sqrt(np.mean(np.arange(2, 2 * top + 1, 2) ** 2.0) * (4 ** bits - 1) / 12)
  def gen(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    sc = rng.integers(1, top + 1, (nb, 8), dtype=np.uint8) * np.uint8(2)
    out = np.empty((nb, size), np.uint8)
    out[:, 0:2] = out[:, 2:4] = _d(rng, nb, std / sd)
    out[:, 4:16] = _kscales(sc, sc * np.uint8(2 ** bits - 1) // 2)
    out[:, 16:] = _raw(rng, nb * (size - 16)).reshape(nb, size - 16)
    return out
  return gen


def _q6_k(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
  q = rng.integers(1, 64, (nb, 2, 128), dtype=np.uint8)   # codes q-32 in -31..31
  lo, hi = q & 15, (q >> 4).reshape(nb, 2, 4, 32)
  out = np.empty((nb, 210), np.uint8)
  out[:, :128] = (lo[:, :, :64] | lo[:, :, 64:] << 4).reshape(nb, 128)
  out[:, 128:192] = (hi[:, :, 0] | hi[:, :, 1] << 2 | hi[:, :, 2] << 4 | hi[:, :, 3] << 6).reshape(nb, 64)
  sc = rng.choice(_Q6_SC.astype(np.int8), (nb, 16)) * rng.choice(np.array([-1, 1], np.int8), (nb, 16))
  out[:, 192:208], out[:, 208:] = sc.view(np.uint8), _d(rng, nb, std / _Q6_K_SD)
  return out


GENERATORS = {T.F32: _f32, T.F16: _f16, T.BF16: _bf16, T.Q4_0: _q4_0, T.Q8_0: _q8_0, T.Q4_K: _qk(4, 4, 144),
              T.Q5_K: _qk(5, 2, 176), T.Q6_K: _q6_k}


def _nbytes(t: _Tensor) -> int:
  bs, ts = gguf.GGML_QUANT_SIZES[t.type]
  return math.prod(t.ne) // bs * ts


def _write_tensor(fout, t: _Tensor, seed: int) -> None:
  rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(t.name.encode())])))
  bs, ts = gguf.GGML_QUANT_SIZES[t.type]
  n, step = math.prod(t.ne) // bs, max(1, CHUNK_BYTES // ts)
  for i in range(0, n, step):
    x = GENERATORS[t.type](rng, min(step, n - i), t.std)
    if t.mean: x += np.float32(t.mean)
    fout.write(x.data)


# *** tokenizer: GPT-2 byte-level BPE, merges learned from a paragraph of English

_TEXT = ("The old lighthouse stood at the end of the long stone pier, and every evening the keeper climbed its winding "
         "stairs to light the lamp. From the top he could see the whole harbour: the fishing boats coming home, the "
         "gulls circling over the water, and the town with its narrow streets and red roofs. In the winter of 1923 a "
         "storm broke the great window, and for three nights the light was dark. The people of the town remembered "
         "that winter for a long time. Children asked their parents why the light had gone out, and the parents told "
         "them about the storm, the broken glass, and the keeper who worked through the night to mend it. Today the "
         "lighthouse is a museum, and visitors climb the same stairs to look out over the same water, where the boats "
         "still come home in the evening light. On clear days you can count forty-two ships between the islands; on "
         "grey days the fog hides everything except the sound of the bell, ringing slowly, as it has rung for more "
         "than 150 years.")


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's printable stand-ins for the 256 bytes, in its vocabulary order."""
  bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
  extra = [b for b in range(256) if b not in bs]
  return dict(zip(bs + extra, map(chr, bs + [256 + i for i in range(len(extra))]), strict=True))


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
  out, i = [], 0
  while i < len(word):
    if word[i:i + 2] == pair: out.append(pair[0] + pair[1]); i += 2
    else: out.append(word[i]); i += 1
  return tuple(out)


def train_bpe(n_merges: int, text: str = _TEXT) -> list[tuple[str, str]]:
  b2u = _bytes_to_unicode()
  pieces = re.findall(r" ?[A-Za-z]+| ?\d+| ?[^\sA-Za-z\d]+|\s+", text)
  words: dict[tuple[str, ...], int] = Counter(tuple(b2u[b] for b in w.encode()) for w in pieces)
  merges: list[tuple[str, str]] = []
  while len(merges) < n_merges:
    pairs: Counter[tuple[str, str]] = Counter()
    for w, c in words.items():
      for p in zip(w[:-1], w[1:], strict=True): pairs[p] += c
    if not pairs: break
    merges.append(best := min(pairs, key=lambda p: (-pairs[p], p)))
    words = {_merge(w, best): c for w, c in words.items()}
  return merges


def build_vocab(s: ModelShape) -> tuple[list[str], list[int], list[str]]:
  """Tokens, token types and merges: bytes and merged tokens, [PAD{id}] fillers, then the special tokens at the end."""
  tokens = list(_bytes_to_unicode().values())
  merges = train_bpe(min(N_MERGES, s.vocab - len(tokens) - len(s.specials)))
  tokens += list(dict.fromkeys(a + b for a, b in merges))
  n_normal, n_special = len(tokens), len(s.specials)
  if n_normal + n_special > s.vocab:
    raise ValueError(f"vocab {s.vocab} is too small for 256 byte tokens and {n_special} special tokens")
  tokens += [f"[PAD{i}]" for i in range(n_normal, s.vocab - n_special)] + list(s.specials)
  TT = gguf.TokenType
  types = [TT.NORMAL] * n_normal + [TT.UNUSED] * (s.vocab - n_normal - n_special) + [TT.CONTROL] * n_special
  return tokens, [int(t) for t in types], [f"{a} {b}" for a, b in merges]


def _write_metadata(w: gguf.GGUFWriter, s: ModelShape, quant: str, legacy_kv_b: bool) -> None:
  w.add_name(f"{s.name} (synthetic)")
  w.add_description(f"random weights with the exact shapes of {s.hf_repo or s.name}; not a trained model")
  w.add_file_type(_FTYPE[quant])
  if quant not in ("f32", "f16", "bf16"): w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  w.add_block_count(s.n_layers)
  w.add_context_length(s.ctx)
  w.add_embedding_length(s.dim)
  w.add_feed_forward_length(s.dense_ffn)
  w.add_head_count(s.n_heads)
  if legacy_kv_b:   # pre-MLA-split files: plain MHA over decompressed heads, no *_mla keys
    w.add_head_count_kv(s.n_heads)
    w.add_key_length(s.qk_head)
    w.add_value_length(s.v_head)
  else:             # MLA as MQA over the latent: one kv head of kv_lora (+rope)
    w.add_head_count_kv(1)
    w.add_key_length(s.kv_lora + s.qk_rope)
    w.add_value_length(s.kv_lora)
    w.add_key_length_mla(s.qk_head)
    w.add_value_length_mla(s.v_head)
  w.add_layer_norm_rms_eps(s.rms_eps)
  w.add_q_lora_rank(s.q_lora)
  w.add_kv_lora_rank(s.kv_lora)
  w.add_rope_dimension_count(s.qk_rope)
  w.add_rope_freq_base(s.rope_theta)
  if s.yarn_factor:
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(s.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(s.yarn_orig_ctx)
    w.add_rope_scaling_yarn_beta_fast(s.yarn_beta_fast)
    w.add_rope_scaling_yarn_beta_slow(s.yarn_beta_slow)
    # converter's legacy convention, llama.cpp divides by 0.1
    w.add_rope_scaling_yarn_log_mul(0.1 * s.yarn_mscale_all_dim)
  else: w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
  w.add_leading_dense_block_count(s.n_dense)
  w.add_expert_feed_forward_length(s.expert_ffn)
  w.add_expert_count(s.n_experts)
  w.add_expert_used_count(s.n_used)
  w.add_expert_shared_count(s.n_shared)
  w.add_expert_weights_scale(s.routed_scale)
  w.add_expert_weights_norm(s.norm_topk)
  w.add_expert_gating_func(
    gguf.ExpertGatingFuncType.SIGMOID if s.gating == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX)
  w.add_vocab_size(s.vocab)
  w.add_nextn_predict_layers(0)
  tokens, types, merges = build_vocab(s)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(s.tokenizer_pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  ids = {tok: s.vocab - len(s.specials) + i for i, tok in enumerate(s.specials)}
  for role, tok in s.special_roles: getattr(w, f"add_{role}_token_id")(ids[tok])
  w.add_add_bos_token(s.add_bos)
  w.add_add_eos_token(False)
  w.add_chat_template(s.chat_template)


_WRITES_RESIDUAL = ("attn_output", "ffn_down", "ffn_down_exps", "ffn_down_shexp")
_QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0)  # the embedding types gguf's numpy quantizer writes


# *** decisive routing: token embeddings carry a signature that each layer's router reads, so the top experts of a token
# lead by a clear margin as in trained models (with random weights, the k-th and (k+1)-th scores are near ties at depth)

ROUTING = ("random", "decisive")
# signature size on each of a token's experts' directions; router scales
SIGNATURE, ROUTER_GAIN, ROUTER_NOISE = 10.0, 0.4, 0.05


class _Decisive:
  """The structure of a decisive-routing file: one unit direction per expert (orthonormal), a random set of n_used
  experts per token, a random permutation of the experts per layer (each layer routes a token to its own experts)."""

  def __init__(self, s: ModelShape, seed: int):
    if s.n_experts > s.dim:
      raise ValueError(f"decisive routing needs no more experts ({s.n_experts}) than dimensions ({s.dim})")
    rng = np.random.default_rng([seed, 0xD1CE])
    # (E, dim), orthonormal rows
    self.dirs = np.linalg.qr(rng.standard_normal((s.dim, s.n_experts)))[0].T.astype(np.float32)
    self.experts = np.argsort(rng.random((s.vocab, s.n_experts)), -1)[:, :s.n_used]  # per token
    self.perm = {i: rng.permutation(s.n_experts) for i in range(s.n_layers)}

  def embedding(self, rng: np.random.Generator, rows: slice, dim: int, std: float) -> np.ndarray:
    x = rng.standard_normal((rows.stop - rows.start, dim), dtype=np.float32) * np.float32(std)
    return x + SIGNATURE * std * self.dirs[self.experts[rows]].sum(1)

  def router(self, rng: np.random.Generator, layer: int, dim: int) -> np.ndarray:
    """Router rows (E, dim): expert e of this layer reads the direction of the expert the permutation maps it to."""
    return ROUTER_GAIN * self.dirs[self.perm[layer]] + ROUTER_NOISE * dim ** -0.5 * rng.standard_normal(
      self.dirs.shape, dtype=np.float32)


def _write_decisive(fout, t: _Tensor, seed: int, d: _Decisive) -> bool:
  """Write a tensor of a decisive-routing file that carries its structure (False: it is an ordinary random one)."""
  rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(t.name.encode())])))
  if t.name == "token_embd.weight":
    dim, vocab = t.ne
    for i in range(0, vocab, step := max(1, CHUNK_BYTES // (16 * dim))):
      fout.write(gguf.quants.quantize(d.embedding(rng, slice(i, min(vocab, i + step)), dim, t.std), t.type).data)
    return True
  if t.name.endswith("ffn_gate_inp.weight"):
    fout.write(d.router(rng, int(t.name.split(".")[1]), t.ne[0]).data)
    return True
  return False


def write_synthetic(path: str | pathlib.Path, preset: str | ModelShape, layers: int | None = None, quant: str = "q4_0",
                    seed: int = 0, legacy_kv_b: bool = False, routing: str = "random") -> pathlib.Path:
  """Write a deepseek2 GGUF with random weights and the preset's exact shapes (the first `layers` blocks if given);
  routing "decisive": a token's experts lead by a clear margin in every layer (see _Decisive)."""
  s = get_preset(preset) if isinstance(preset, str) else preset
  if quant not in QUANT_CHOICES: raise ValueError(f"unknown quant {quant!r}: choose one of {', '.join(QUANT_CHOICES)}")
  if routing not in ROUTING: raise ValueError(f"unknown routing {routing!r}: choose one of {', '.join(ROUTING)}")
  if layers is not None: s = s.with_layers(layers)
  path = pathlib.Path(path)
  plan = tensor_plan(s, quant, legacy_kv_b, routing)
  decisive = _Decisive(s, seed) if routing == "decisive" and s.n_experts else None
  if decisive is not None and (emb := plan[0].type) not in _QUANTIZABLE:
    raise ValueError("decisive routing writes the token embedding from floats, which gguf cannot quantize to "
                     f"{emb.name} ({quant}); use one of: "
                     f"{', '.join(q for q in QUANT_CHOICES if _PURE.get(q) in _QUANTIZABLE)}")
  w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
  _write_metadata(w, s, quant, legacy_kv_b)
  for t in plan: w.add_tensor_info(t.name, t.ne[::-1], np.dtype(np.float32), _nbytes(t), raw_dtype=t.type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  assert w.fout is not None
  fout = w.fout[0]
  try:
    w.write_padding(fout, fout.tell())
    for t in plan:
      if decisive is None or not _write_decisive(fout, t, seed, decisive): _write_tensor(fout, t, seed)
      w.write_padding(fout, _nbytes(t))
  finally: w.close()
  return path
