"""The deepseek2 architecture (DeepSeek-V2 MLA attention + MoE) in tinygrad, with llama.cpp's semantics.

MLA runs in its absorbed form over one compressed cache of kv_lora + rope dims per position (V is its first kv_lora
dims), as llama.cpp does. Where a StructureConfig option applies, the code names it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tinygrad import GlobalCounters, Tensor, UOp, dtypes
from tinygrad.uop.ops import resolve

from model import prefill
from model import stages as S
from model import weights as W
from model.backends import catalog
from model.backends import registry as K
from model.errors import ConfigError
from model.gguf_file import GGUFError, GGUFFile
from model.quants import F32, QUANT_TYPES
from model.stages import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, SQRT_SOFTPLUS, rms_norm
from model.structure import StructureConfig
from model.weights import QWeight, upload


@dataclass(frozen=True)
class Hparams:
  n_layers: int
  n_dense_lead: int
  dim: int
  n_heads: int
  q_lora: int
  kv_lora: int
  qk_nope: int
  qk_rope: int
  v_head: int
  n_experts: int
  n_used: int
  gating: int
  norm_w: bool
  w_scale: float
  eps: float
  vocab: int
  context_length: int
  rope_base: float
  freq_scale: float  # 1/factor for linear and YaRN scaling
  ext_factor: float  # YaRN extrapolation mix (1 with YaRN)
  attn_factor: float  # llama.cpp's cparams.yarn_attn_factor
  beta_fast: float
  beta_slow: float
  n_ctx_orig: int
  kq_scale: float

  @staticmethod
  def from_gguf(f: GGUFFile) -> Hparams:
    if f.arch != "deepseek2": raise GGUFError(f"{f.path.name}: architecture {f.arch!r} is not deepseek2")
    def need(key: str):
      if (v := f.key(key)) is None: raise GGUFError(f"{f.path.name}: metadata key {f.arch}.{key} is missing")
      return v
    n_layers = need("block_count") - f.key("nextn_predict_layers", 0)
    vocab = (f.key("vocab_size") or len(f.metadata.get("tokenizer.ggml.tokens", []))
             or f.tensors["token_embd.weight"].shape[0])
    gating = (f.key("expert_gating_func", 0)
              or (SIGMOID if need("block_count") in (47, 48) and vocab == 154880 else SOFTMAX))
    key_len, rope = need("attention.key_length"), need("rope.dimension_count")
    head_k = f.key("attention.key_length_mla", key_len)
    # rope scaling and the attention scale, as llama.cpp derives them (llama-context.cpp, models/deepseek2.cpp)
    scaling, factor = f.key("rope.scaling.type", "none"), f.key("rope.scaling.factor", 0.0) or 1.0
    freq_scale = 1.0 if scaling == "none" else 1.0 / factor
    # llama.cpp reads no yarn_ext_factor/attn_factor/beta keys: ext 1 with YaRN, attn 1, beta_fast 32, beta_slow 1
    ext_factor = 1.0 if scaling == "yarn" else 0.0
    log_mul = f.key("rope.scaling.yarn_log_multiplier", 0.0) / 0.1
    attn_factor = 1.0
    if ext_factor != 0:  # with a log multiplier, deepseek2's mscale equals mscale_all_dim and their ratio is 1
      attn_factor = (1.0 if log_mul != 0 or factor <= 1
                     else 1.0 + 0.1 * math.log(factor)) / (1.0 + 0.1 * math.log(factor))
    attn_factor *= f.key("rope.scaling.attn_factor", 1.0)
    mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale)) * (1.0 + 0.1 * log_mul * math.log(1.0 / freq_scale))
    return Hparams(
      n_layers=n_layers, n_dense_lead=f.key("leading_dense_block_count", 0), dim=need("embedding_length"),
      n_heads=need("attention.head_count"), q_lora=f.key("attention.q_lora_rank", 0)
      if "blk.0.attn_q_a.weight" in f.tensors
      else 0, kv_lora=need("attention.kv_lora_rank"), qk_nope=head_k - rope, qk_rope=rope,
      v_head=f.key("attention.value_length_mla", f.key("attention.value_length")), n_experts=f.key("expert_count", 0),
      n_used=f.key("expert_used_count", 0), gating=gating, norm_w=bool(f.key("expert_weights_norm", False)),
      w_scale=float(f.key("expert_weights_scale", 0.0)), eps=need("attention.layer_norm_rms_epsilon"), vocab=vocab,
      context_length=need("context_length"), rope_base=f.key("rope.freq_base", 10000.0), freq_scale=freq_scale,
      ext_factor=ext_factor, attn_factor=attn_factor, beta_fast=32.0, beta_slow=1.0,
      n_ctx_orig=f.key("rope.scaling.original_context_length", need("context_length")),
      kq_scale=mscale * mscale / math.sqrt(head_k))


def rope_table(hp: Hparams, max_context: int) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin (max_context, rope/2) exactly as ggml's rope_yarn computes them (mode NORM: adjacent pairs)."""
  n_dims = hp.qk_rope
  corr = lambda beta: n_dims * math.log(hp.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(hp.rope_base))
  lo, hi = max(0.0, math.floor(corr(hp.beta_fast))), min(n_dims - 1.0, math.ceil(corr(hp.beta_slow)))
  i0 = np.arange(0, n_dims, 2, dtype=np.float64)
  theta_extrap = np.arange(max_context, dtype=np.float64)[:, None] * hp.rope_base ** (-i0 / n_dims)[None]
  theta = hp.freq_scale * theta_extrap
  mscale = hp.attn_factor
  if hp.ext_factor != 0:
    ramp = (1 - np.clip((i0 / 2 - lo) / max(0.001, hi - lo), 0, 1)) * hp.ext_factor
    theta = theta * (1 - ramp) + theta_extrap * ramp
    mscale *= 1.0 + 0.1 * math.log(1.0 / hp.freq_scale)
  return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
  """x (B, T, H, rope) with cos/sin (T, rope/2): rotate adjacent pairs."""
  xp = x.reshape(*x.shape[:-1], -1, 2)
  x0, x1 = xp[..., 0], xp[..., 1]
  c, s = cos.reshape(1, cos.shape[0], 1, -1), sin.reshape(1, sin.shape[0], 1, -1)
  return Tensor.stack(x0 * c - x1 * s, x0 * s + x1 * c, dim=-1).reshape(x.shape)


def topk_indices(scores: Tensor, k: int, variant: str) -> Tensor:
  """Indices (…, k) of the k largest scores (StructureConfig.topk)."""
  n = scores.shape[-1]
  if variant == "sort": return scores.topk(k, dim=-1)[1].cast(dtypes.int32)
  if variant == "argmax":
    idx, masked = [], scores
    for _ in range(k):
      i = masked.argmax(-1, keepdim=True)
      idx.append(i)
      masked = (Tensor.arange(n) == i).where(-math.inf, masked)
    return idx[0].cat(*idx[1:], dim=-1).cast(dtypes.int32)
  # pairwise: rank of each score = number of scores beating it (ties broken by lower index); pick ranks 0..k-1
  a, b = scores.unsqueeze(-1), scores.unsqueeze(-2)
  ar = Tensor.arange(n)
  beats = (b > a) | ((b == a) & (ar.reshape(1, n) < ar.reshape(n, 1)))
  rank = beats.sum(-1)  # (…, n)
  onehot = rank.unsqueeze(-1) == Tensor.arange(k)  # (…, n, k)
  return (onehot * ar.reshape(n, 1)).sum(-2).cast(dtypes.int32)


Q8_BLOCK = 32  # values per q8_0 block of the KV cache (llama.cpp's QK8_0)
FLOAT_KV = {"float16": dtypes.float16, "float32": dtypes.float32}


class KVCache:
  """One block's compressed KV cache of (1, context, width) values in StructureConfig.kv_dtype: one float16 or float32
  tensor, or q8_0 as llama.cpp's -ctk q8_0 stores it, blocks of 32 int8 codes with one float16 scale (scale = max |x| /
  127, code = x / scale rounded half away from zero), held as two planes, the codes (1, context, width) and the scales
  (1, context, width / 32), so that a read of either stays coalesced."""

  def __init__(self, dtype: str, context: int, width: int, device: str | None):
    self.q8, self.blocks = dtype == "q8_0", width // Q8_BLOCK
    if self.q8 and width % Q8_BLOCK:
      raise ConfigError(f"kv_dtype=q8_0 needs a cache width (kv_lora + rope) in blocks of {Q8_BLOCK}; this is {width}")
    shapes = ((width, dtypes.int8), (self.blocks, dtypes.float16)) if self.q8 else ((width, FLOAT_KV[dtype]),)
    self.planes = tuple(Tensor.zeros(1, context, w, dtype=dt, device=device).contiguous().realize() for w, dt in shapes)

  def encode(self, x: Tensor) -> tuple[Tensor, ...]:
    """Rows (1, T, width) as the planes store them."""
    if not self.q8: return (x.cast(self.planes[0].dtype),)
    blocks = x.float().reshape(*x.shape[:-1], self.blocks, Q8_BLOCK)
    d = blocks.abs().max(-1, keepdim=True) / 127
    a = (blocks * (d == 0).where(0.0, 1 / d)).abs()
    # roundf: half away from zero; floor(a + 0.5) would round 0.49999997 up
    code = (a.floor() + (2 * (a - a.floor())).floor()) * blocks.sign()
    return code.cast(dtypes.int8).reshape(x.shape), d.reshape(*x.shape[:-1], self.blocks).cast(dtypes.float16)

  def decode(self, planes: tuple[Tensor, ...], n: int | UOp) -> Tensor:
    """Positions 0..n-1 of the planes as float32 (1, n, width)."""
    if not self.q8: return planes[0][:, 0:n].float()
    codes, scales = planes[0][:, 0:n], planes[1][:, 0:n]
    blocks = codes.float().reshape(*scales.shape, Q8_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).reshape(codes.shape)

  def store(self, start: int | UOp, new: Tensor) -> tuple[Tensor, ...]:
    """The planes after the rows `new` (1, T, width) are stored at positions start..start+T-1, in one graph with what
    reads them."""
    at = slice(start, start + new.shape[1])
    return tuple(Tensor(p.uop.after(p[:, at].uop.store(e.uop))) for p, e in zip(self.planes, self.encode(new),
                                                                                 strict=True))

  def rows(self, n: int) -> Tensor: return self.decode(self.planes, n)
  def cleared(self) -> list[Tensor]: return [p.assign(Tensor.zeros_like(p)) for p in self.planes]
  def nbytes(self) -> int: return sum(p.nbytes() for p in self.planes)


class Block:
  """One block: the per-op path's weights and code, and the inputs of the stages the config fuses (model/stages.py),
  which the backends' fused stages receive. rope: the RoPE tables (cos, sin); scratch: by name, each fused backend's
  buffers."""

  def __init__(self, f: GGUFFile, i: int, hp: Hparams, cfg: StructureConfig, load, max_context: int, device: str | None,
               rope: tuple[Tensor, Tensor], scratch: dict[str, dict[str, Tensor]]):
    self.hp, self.cfg, self.i = hp, cfg, i
    (self.cos, self.sin), self.scratch = rope, scratch
    p = f"blk.{i}."
    has = lambda n: p + n + ".weight" in f.tensors
    self.attn_norm, self.ffn_norm, self.kv_a_norm = (load(p + n + ".weight", norm=True)
                                                     for n in ("attn_norm", "ffn_norm", "attn_kv_a_norm"))
    att = lambda n, **kw: load(p + n + ".weight", stage="attention", **kw)
    if hp.q_lora:
      self.q_a, self.q_a_norm, self.q_b = att("attn_q_a"), load(p + "attn_q_a_norm.weight", norm=True), att("attn_q_b")
    else:
      self.q_b = att("attn_q")
    self.kv_a = att("attn_kv_a_mqa")
    H, nope, v = hp.n_heads, hp.qk_nope, hp.v_head
    self.k_b_t: QWeight | None = None  # legacy files: k_b as (H, nope, kv_lora), applied transposed
    if has("attn_k_b"):
      self.k_b = att("attn_k_b", shape=(H, hp.kv_lora, nope))
      self.v_b = att("attn_v_b", shape=(H, v, hp.kv_lora))
    elif has("attn_kv_b"):  # legacy file: one (H*(nope+v), kv_lora) matrix; per head, its nope rows are k_b transposed
      if cfg.stage("attention"): raise ConfigError("fused.attention needs split attn_k_b/attn_v_b tensors; "
                                                   f"{f.path.name} has the legacy attn_kv_b")
      self.k_b_t, self.v_b = att("attn_kv_b", shape=(H, nope + v, hp.kv_lora)).split_rows(nope)
    else:
      raise GGUFError(f"{f.path.name}: block {i} has neither attn_k_b/attn_v_b nor attn_kv_b")
    self.wo = att("attn_output")
    if cfg.mla_absorb == "load": self._absorb_k_b()
    self.moe = i >= hp.n_dense_lead
    self.gate_up_exps = self.gate_up_sh = self.gate_up = None
    if self.moe:
      self.gate_inp = load(p + "ffn_gate_inp.weight", stage="router")
      self.probs_b = load(p + "exp_probs_b.bias", norm=True) if p + "exp_probs_b.bias" in f.tensors else None
      exps = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
      self.gate_exps, self.up_exps, self.down_exps = (load(p + n + ".weight", role="expert", stage="moe") for n in exps)
      self.n_ff_exp = self.gate_exps.shape[1]
      if cfg.merge_gate_up_routed:
        self.gate_up_exps, self.gate_exps, self.up_exps = W.concat_rows(self.gate_exps, self.up_exps), None, None
      self.shared = has("ffn_gate_shexp")
      if self.shared:
        self.gate_sh, self.up_sh, self.down_sh = (load(p + n + ".weight", stage="moe")
                                                  for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"))
        if cfg.merge_gate_up_shared:
          self.gate_up_sh, self.gate_sh, self.up_sh = W.concat_rows(self.gate_sh, self.up_sh), None, None
    else:
      self.gate, self.up, self.down = (load(p + n + ".weight", stage="ffn") for n in ("ffn_gate", "ffn_up", "ffn_down"))
      if cfg.merge_gate_up_dense: self.gate_up, self.gate, self.up = W.concat_rows(self.gate, self.up), None, None
    self.kv = KVCache(cfg.kv_dtype, max_context, hp.kv_lora + hp.qk_rope, device)
    self.attention_in, self.router_in, self.moe_in, self.ffn_in = self._stage_inputs()

  def _stage_inputs(self) -> tuple[S.AttentionStage | None, S.RouterStage | None, S.MoeStage | None,
                                   S.FfnStage | None]:
    """The inputs of the stages the config fuses in this block (None for the others): the attention's, and the router's
    and MoE's of an MoE block or the FFN's of a dense one."""
    hp, cfg, fused = self.hp, self.cfg, self.cfg.fused
    scratch = lambda stage: self.scratch.get(fused[stage], {})
    att = S.AttentionStage(
      hp.dim, hp.n_heads, hp.qk_nope, hp.qk_rope, hp.kv_lora, hp.v_head, hp.eps, hp.kq_scale, self.attn_norm,
      self.q_a if hp.q_lora else None, self.q_a_norm if hp.q_lora else None, self.q_b, self.kv_a, self.kv_a_norm,
      self.k_b, self.v_b, self.wo, self.kv.planes[0], self.cos, self.sin, scratch("attention"), cfg.attn_act,
      cfg.rows("qkv_a"), cfg.rows("attn_out"), cfg.attn_layout) if "attention" in fused else None
    # what the FFN stages share: the norm and the knobs of their products
    common = dict(dim=hp.dim, eps=hp.eps, ffn_norm=self.ffn_norm, act=cfg.ffn_act, gate_up_rows=cfg.rows("gate_up"),
                  down_rows=cfg.rows("down"))
    if not self.moe:
      ffn = S.FfnStage(ffn=S.Glu(self.gate, self.up, self.gate_up, self.down), **common) if "ffn" in fused else None
      return att, None, None, ffn
    routing = S.Routing(hp.n_experts, hp.n_used, hp.gating, hp.norm_w, hp.w_scale)
    router = (S.RouterStage(hp.dim, hp.eps, self.ffn_norm, self.gate_inp, self.probs_b, routing, scratch("router"))
              if "router" in fused else None)
    experts = S.Glu(self.gate_exps, self.up_exps, self.gate_up_exps, self.down_exps)
    shared = S.Glu(self.gate_sh, self.up_sh, self.gate_up_sh, self.down_sh) if self.shared else None
    moe = S.MoeStage(routing=routing, experts=experts, shared=shared, **common) if "moe" in fused else None
    return att, router, moe, None

  def _absorb_k_b(self) -> None:
    """MLA absorption at load time: q_b's nope rows of each head pre-multiplied by k_b, stored as one fp16 matrix."""
    hp, qb = self.hp, self.q_b
    H, nope, rope, d_in = hp.n_heads, hp.qk_nope, hp.qk_rope, qb.shape[-1]
    if qb.cache is not None:
      qf = qb.cache.reshape(H, nope + rope, d_in)
      q_nope, self.q_pe = qf[:, :nope].float(), QWeight.fp16(qf[:, nope:].reshape(H * rope, d_in))
    else:
      wn, self.q_pe = QWeight(qb.planes, qb.ggml_type, (H, nope + rope, d_in), backend=qb.backend).split_rows(nope)
      self.q_pe.shape, q_nope = (H * rope, d_in), wn.to_float()
    self.q_abs = QWeight.fp16((self.k_b_float() @ q_nope).reshape(H * hp.kv_lora, d_in))  # (H, kv_lora, in) per head
    self.q_b = None  # replaced by q_abs and q_pe: keeping it would hold the quantized q projection twice

  def k_b_float(self) -> Tensor:
    return self.k_b.to_float() if self.k_b_t is None else self.k_b_t.to_float().permute(0, 2, 1)

  def absorb(self, q_nope: Tensor) -> Tensor:
    """q_nope (B, T, H, nope) -> (B, T, H, kv_lora): per head, k_b applied to q (MLA absorption at run time)."""
    if self.k_b_t is None: return self.per_head(q_nope, self.k_b)
    return (q_nope.unsqueeze(-1) * self.k_b_t.to_float()).sum(-2)

  def barrier(self, x: Tensor, point: str) -> Tensor:
    mode = self.cfg.barriers[point]
    return x if mode == "none" else x.contiguous().realize() if mode == "realize" else x.contiguous()

  def product(self, x: Tensor, w: QWeight) -> Tensor:
    """x (B, T, in) @ w.T, an attention product: the weight's backend's, or for a prompt's chunk with prefill_dense =
    batched one product of the chunk's tokens (model/prefill.py linear)."""
    return prefill.linear(x, w, self.cfg) if self.batched(x.shape[1]) else K.linear(x, w)

  def per_head(self, x: Tensor, w: QWeight) -> Tensor:
    """x (B, T, H, in) by w (H, out, in), k_b's and v_b's products: the weight's backend's, or for a prompt's chunk with
    prefill_dense = batched each head's product over the chunk's tokens at once (model/prefill.py per_head)."""
    return prefill.per_head(x, w, self.cfg) if self.batched(x.shape[1]) else K.per_head(x, w)

  def batched(self, T: int) -> bool:
    """Whether a chunk of T tokens runs the attention's products over all its tokens at once (prefill_dense)."""
    return T > 1 and self.cfg.prefill_dense == "batched" and self.cfg.prefill_ffn == "grouped"

  def decompressed(self, T: int) -> bool:
    """Whether a chunk of T tokens attends in the decompressed form (model/prefill.py): the prompt's, by the config."""
    return T > 1 and self.cfg.prefill_attention == "decompressed"

  def project(self, xn: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's projections of the normalised input: absorbed q (B, T, H, kv_lora), or q's nope part (B, T, H,
    nope) as projected for the decompressed form; q_pe (B, T, H, rope) and kv (B, T, kv_lora + rope)."""
    hp, (B, T, _) = self.hp, xn.shape
    H, nope, rope, kvl = hp.n_heads, hp.qk_nope, hp.qk_rope, hp.kv_lora
    xq = rms_norm(self.product(xn, self.q_a), self.q_a_norm, hp.eps) if hp.q_lora else xn
    if self.cfg.mla_absorb == "load":
      q_abs = self.barrier(self.product(xq, self.q_abs), "q_proj").reshape(B, T, H, kvl)
      q_pe = self.product(xq, self.q_pe).reshape(B, T, H, rope)
    else:
      q = self.barrier(self.product(xq, self.q_b), "q_proj").reshape(B, T, H, nope + rope)
      q_abs, q_pe = q[..., :nope] if self.decompressed(T) else self.absorb(q[..., :nope]), q[..., nope:]
    return q_abs, q_pe, self.barrier(self.product(xn, self.kv_a), "kv_a")

  def attend(self, q_abs: Tensor, q_pe: Tensor, kv: Tensor, start_pos: int | UOp, pos: Tensor | None) -> Tensor:
    """RoPE, the KV cache write, attention over the compressed cache and v_b (or, for a decompressed chunk, over the
    keys and values decompressed from it), before the output projection: (B, T, H * v_head). pos: start_pos as a
    device tensor, for the prompt's all-heads kernels."""
    hp, (B, T, H, _) = self.hp, q_abs.shape
    rope, kvl = hp.qk_rope, hp.kv_lora
    cos, sin = self.cos[start_pos:start_pos + T], self.sin[start_pos:start_pos + T]
    q_pe = apply_rope(q_pe, cos, sin)
    c_kv = rms_norm(kv[..., :kvl], self.kv_a_norm, hp.eps)
    k_pe = apply_rope(kv[..., kvl:].reshape(B, T, 1, rope), cos, sin).reshape(B, T, rope)
    planes = self.kv.store(start_pos, c_kv.cat(k_pe, dim=-1))
    if self.cfg.barriers["kv_write"] == "realize": planes = tuple(p.realize() for p in planes)
    elif self.cfg.barriers["kv_write"] == "contiguous": planes = tuple(p.contiguous() for p in planes)
    if T > 1 and self.cfg.prefill_attention == "all_heads":  # the prompt's attention in native's all-heads kernels
      qc = q_abs.cat(q_pe, dim=-1).reshape(B * T, H, kvl + rope)
      assert pos is not None, "the all-heads prompt attention reads the position from the device"
      o = K.get("native").prefill_attention(qc, planes[0], pos, kvl, hp.kq_scale, self.cfg.prefill_attn_tokens,
                                            start_pos).reshape(B, T, H, kvl)
      return self.per_head(o, self.v_b).reshape(B, T, H * hp.v_head)
    rows = self.kv.decode(planes, start_pos + T)  # (B, S, kvl+rope)
    dt = prefill.attn_dtype(self.cfg, T)
    if self.decompressed(T):
      return prefill.attention(q_abs, q_pe, rows, self.k_b_float(), self.v_b.to_float(), start_pos, hp.kq_scale, dt)
    k = rows.unsqueeze(1).cast(dt)  # (B, 1, S, kvl+rope)
    qc = q_abs.cat(q_pe, dim=-1).transpose(1, 2).cast(dt)  # (B, H, T, kvl+rope)
    mask = prefill.causal_mask(T, start_pos) if resolve(T != 1) else None
    if self.cfg.attention == "sdpa":
      o = (qc * (hp.kq_scale * math.sqrt(kvl + rope))).scaled_dot_product_attention(k, k[..., :kvl], attn_mask=mask)
      o = o.float()
    else:
      s = qc.matmul(k.transpose(-1, -2), dtype=dtypes.float32) * hp.kq_scale
      o = (s if mask is None else s + mask).softmax(-1).cast(dt).matmul(k[..., :kvl], dtype=dtypes.float32)
    return self.per_head(o.transpose(1, 2), self.v_b).reshape(B, T, H * hp.v_head)

  def attention(self, xn: Tensor, start_pos: int | UOp, pos: Tensor | None) -> Tensor:
    return self.product(self.barrier(self.attend(*self.project(xn), start_pos, pos), "attn_out"), self.wo)

  def _ffn(self, x: Tensor, gate: QWeight | None, up: QWeight | None, down: QWeight, gate_up: QWeight | None,
           point: str) -> Tensor:
    if gate_up is not None:
      gu = K.linear(x, gate_up)
      g, u = gu[..., :down.shape[1]], gu[..., down.shape[1]:]
    else:
      g, u = K.linear(x, gate), K.linear(x, up)
    return K.linear(self.barrier(g.silu() * u, point), down)

  def router_logits(self, xn: Tensor) -> Tensor:
    """router_fp32=False rounds the input to fp16 in a buffer of its own, since tinygrad folds
    cast(cast(x, half), float) into x."""
    return self.barrier(K.linear(xn.float() if self.cfg.router_fp32
                                 else xn.cast(dtypes.float16).contiguous(), self.gate_inp), "router_logits")

  def probs(self, logits: Tensor) -> Tensor:
    return {SOFTMAX: logits.softmax(-1), SIGMOID: logits.sigmoid(), SOFTMAX_WEIGHT: logits,
            SQRT_SOFTPLUS: logits.softplus().sqrt()}[self.hp.gating]

  def scores(self, logits: Tensor) -> Tensor:
    """What top-k selects on: the gating function's output plus the selection bias."""
    probs = self.probs(logits)
    return probs if self.probs_b is None else probs + self.probs_b

  def route(self, logits: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(the ids used, their weights, the router's own top-k ids), each (B, T, K); forced: the ids to use instead of
    the router's own."""
    hp = self.hp
    probs = self.probs(logits)
    own = topk_indices(probs if self.probs_b is None else probs + self.probs_b, hp.n_used, self.cfg.topk)  # (B, T, K)
    sel = own if forced is None else forced
    w = probs.gather(-1, sel)
    if hp.gating == SOFTMAX_WEIGHT: w = w.softmax(-1)
    if hp.norm_w: w = w / w.sum(-1, keepdim=True).maximum(6.103515625e-5)
    if hp.w_scale not in (0.0, 1.0): w = w * hp.w_scale
    return sel, w, own

  def experts(self, xn: Tensor, sel: Tensor, w: Tensor) -> Tensor:
    """The routed experts' outputs weighted and summed, plus the shared expert: (B, T, D)."""
    B, T, D = xn.shape
    xe = xn.reshape(B, T, 1, D)
    if self.gate_up_exps is not None:
      gu = K.expert(xe, sel, self.gate_up_exps)
      g, u = gu[..., :self.n_ff_exp], gu[..., self.n_ff_exp:]
    else:
      g, u = K.expert(xe, sel, self.gate_exps), K.expert(xe, sel, self.up_exps)
    act = self.barrier(g.silu() * u, "moe_gate_up")
    y = self.barrier(K.expert(act, sel, self.down_exps), "expert_down")  # (B, T, K, D)
    out = self.barrier((y * w.unsqueeze(-1)).sum(2), "moe_out")
    if self.shared: out = out + self._ffn(xn, self.gate_sh, self.up_sh, self.down_sh, self.gate_up_sh, "shexp_gate_up")
    return out

  def __call__(self, x: Tensor, start_pos: int | UOp, pos: Tensor | None, act, check: Check | None = None) -> Tensor:
    """One block. A fused stage of the config replaces its part of the per-op path for a single token (decode); `pos`
    holds the position for the native kernels. check: the correctness check's records and inputs (model.deepseek2.Check:
    the attention's output and the FFN's input; routing in MoE blocks)."""
    hp, fused = self.hp, self.cfg.fused if x.shape[1] == 1 else {}
    stage = lambda name: K.get(fused[name]) if name in fused else None
    if (b := stage("attention")) is not None: h = b.attention(self.attention_in, x, start_pos, pos).cast(act)
    else: h = x + self.attention(rms_norm(x, self.attn_norm, hp.eps), start_pos, pos).cast(act)
    if check is not None: h = check.feed(h)
    xn = None
    def norm() -> Tensor:
      nonlocal xn
      if xn is None: xn = rms_norm(h, self.ffn_norm, hp.eps)
      return xn
    # the prompt's chunk: its FFN products over all its tokens at once (model/prefill.py)
    grouped = x.shape[1] > 1 and self.cfg.prefill_ffn == "grouped"
    if not self.moe:
      # a kernel's output: block_out bounds nothing here
      if (b := stage("ffn")) is not None: return b.ffn(self.ffn_in, h).cast(act)
      ffn = (prefill.glu(norm(), S.Glu(self.gate, self.up, self.gate_up, self.down), self.cfg) if grouped else
             self._ffn(norm(), self.gate, self.up, self.down, self.gate_up, "dense_gate_up"))
      return self.barrier(h + ffn.cast(act), "block_out")
    forced, rb = check.forced if check is not None else None, stage("router")
    # one backend's router and MoE in one, where it offers that: its MoE kernels route from the logits themselves
    joint = rb is not None and rb is stage("moe") and rb.offers("routed_moe")
    if joint: out, own, logits = rb.routed_moe(self.router_in, self.moe_in, h, forced)
    elif rb is not None: sel, w, own, logits = rb.router(self.router_in, h, forced)
    else:
      logits = self.router_logits(norm())
      sel, w, own = self.route(logits, forced)
    if check is not None:
      check.own, check.logits = own.reshape(-1, hp.n_used), logits.float().reshape(-1, hp.n_experts)
      check.scores = self.scores(logits.float()).reshape(-1, hp.n_experts)
    if joint: return out.cast(act)
    if (b := stage("moe")) is not None: return b.moe(self.moe_in, h, sel, w, logits).cast(act)
    if grouped:
      shared = S.Glu(self.gate_sh, self.up_sh, self.gate_up_sh, self.down_sh) if self.shared else None
      out = prefill.moe(norm(), sel, w, S.Glu(self.gate_exps, self.up_exps, self.gate_up_exps, self.down_exps), shared,
                        hp.n_experts, self.cfg)
    else: out = self.experts(norm(), sel, w)
    return self.barrier(h + out.cast(act), "block_out")


@dataclass
class Check:
  """The correctness check's view into one block of a decode step (evaluator/gate.py; model/generate.py check_step runs
  the blocks one by one). forced (1, 1, K): the expert ids an MoE block uses instead of its own (None: its own). h (1,
  1, D) with per_stage (1,) true: the FFN reads h, the attention output a reference recorded, instead of the block's
  own, so each stage is checked on its own inputs. Records the attention's output (att), and an MoE router's own top-k
  ids (T, K), its selection scores (T, E) and the logits they are computed from (T, E)."""
  forced: Tensor | None = None
  h: Tensor | None = None
  per_stage: Tensor | None = None
  att: Tensor | None = None
  own: Tensor | None = None
  scores: Tensor | None = None
  logits: Tensor | None = None

  def feed(self, h: Tensor) -> Tensor:
    """Record the attention stage's output h (1, 1, D); return the FFN stage's input."""
    self.att = h.float().contiguous()
    return h if self.h is None else self.per_stage.reshape(1, 1, 1).where(self.h.cast(h.dtype), h)


class Transformer:
  """A deepseek2 model built from a GGUF file and a StructureConfig, with its KV cache on `device`."""

  def __init__(self, f: GGUFFile, cfg: StructureConfig | None = None, max_context: int = 4096,
               device: str | None = None, n_layers: int | None = None):
    self.file, self.cfg, self.hp = f, cfg or StructureConfig(), Hparams.from_gguf(f)
    hp, self.device = self.hp, device
    self.max_context = min(max_context, hp.context_length)
    self.act = dtypes.float16 if self.cfg.act_dtype == "float16" else dtypes.float32
    self.load_peak_bytes = 0  # device memory high-water mark while loading (raw bytes and their planes coexist briefly)

    def load(name: str, norm: bool = False, role: str = "dense", shape: tuple[int, ...] | None = None,
             stage: str | None = None):
      """A tensor of the file on the device: a norm as float32, a matrix as a QWeight of the backend that computes its
      products (the fused stage's where its stage is fused, else the config's backend for its type and role)."""
      if name not in f.tensors: raise GGUFError(f"{f.path.name}: tensor {name} is missing")
      info = f.tensors[name]
      if norm and info.ggml_type == F32: return upload(f.read(name).view(np.float32).reshape(-1), device)
      quant = QUANT_TYPES[info.ggml_type].name
      # the 8-bit activation knob that reads this weight's products, and what it covers
      knob, what = (("ffn_act", f"the fused {stage} stage's weights") if stage in ("moe", "ffn") else
                    ("attn_act", "the attention's dense weights")
                    if stage == "attention" and name.split(".")[-2] in catalog.ATTN_DENSE else (None, ""))
      if (knob and (fused := self.cfg.stage(stage)) and (act := getattr(self.cfg, knob)) != "float32"
          and quant not in (q8 := catalog.get(fused).q8_quants)):
        kinds = sorted(q8)
        raise ConfigError(f"{knob}={act} on {fused} needs {what} in {', '.join(kinds[:-1])} or {kinds[-1]}; {name} is "
                          f"{quant}")
      w = QWeight.from_bytes(f.read(name), info.ggml_type, shape or info.shape, device)
      self.load_peak_bytes = max(self.load_peak_bytes, GlobalCounters.mem_used)
      if norm: return w.to_float().reshape(-1).contiguous().realize()
      return K.get(self.cfg.stage(stage) or self.cfg.backend(w.quant, role)).attach(w, device)

    if self.cfg.prefill_weights == "quantised" or self.cfg.prefill_attention == "all_heads":  # the prompt's CUDA
      K.get("native").check(device)
    n = hp.n_layers if n_layers is None else n_layers
    if not 1 <= n <= hp.n_layers: raise ValueError(f"n_layers={n} is outside 1..{hp.n_layers}")
    cos, sin = rope_table(hp, self.max_context)
    self.cos, self.sin = upload(cos, device), upload(sin, device)
    # shared by the blocks: the RoPE tables, and each fused backend's scratch where its row has one
    scratch = {b: K.get(b).scratch(hp.n_heads, hp.kv_lora, self.max_context, device)
               for b in sorted(set(self.cfg.fused.values())) if catalog.get(b).scratch}
    self.token_embd = load("token_embd.weight")
    self.blocks = [Block(f, i, hp, self.cfg, load, self.max_context, device, (self.cos, self.sin), scratch)
                   for i in range(n)]
    self.output_norm = load("output_norm.weight", norm=True)
    self.output = load("output.weight") if "output.weight" in f.tensors else self.token_embd

  def forward(self, tokens: Tensor, start_pos: int | UOp, all_logits: bool = False,
              forced: list[Tensor] | None = None, at: Tensor | None = None) -> Tensor:
    """tokens (1, T) at positions start_pos.. -> float32 logits: (1, T, vocab), or for one token alone (1, 1, vocab):
    the last, or the one at index `at` (1,) (a padded prefill chunk's last real token). forced: per MoE block, the
    expert ids (1, T, K) it uses instead of its own (the correctness check's prefill, which realizes each block's output
    before the next block: a routing that does not come from the activations would let tinygrad schedule every block's
    weight copies at the start, all of them alive at once)."""
    (_, T), pos, x = tokens.shape, self.device_pos(start_pos, tokens.shape[1]), self.embed(tokens)
    ids = iter(forced or ())
    for b in self.blocks:
      x = b(x, start_pos, pos, self.act, Check(next(ids)) if b.moe and forced else None)
      if forced: x = x.realize()
    if all_logits: return self.head(x)
    return self.head(x[:, -1:] if at is None else (Tensor.arange(T) == at).reshape(1, T, 1).where(x, 0).sum(1, True))

  def embed(self, tokens: Tensor) -> Tensor: return K.rows(self.token_embd, tokens).cast(self.act)

  def head(self, x: Tensor) -> Tensor:
    """The final norm and the output head (in one, where the output weight's backend folds the norm: norm_linear)."""
    if (b := K.get(self.output.backend)).offers("norm_linear"):
      return b.norm_linear(x, self.output_norm, self.hp.eps, self.output)
    return K.linear(rms_norm(x, self.output_norm, self.hp.eps), self.output)

  def device_pos(self, start_pos: int | UOp, T: int) -> Tensor | None:
    """The position as a device tensor, for the native kernels: the fused stages' (one token) and the prompt's
    all-heads attention (several); None where no kernel reads it."""
    needed = bool(self.cfg.fused) if T == 1 else self.cfg.prefill_attention == "all_heads"
    return Tensor.full((1,), start_pos, dtype=dtypes.int32, device=self.device).contiguous() if needed else None

  @property
  def kv_cache_bytes(self) -> int: return sum(b.kv.nbytes() for b in self.blocks)

  def reset(self) -> None:
    Tensor.realize(*(t for b in self.blocks for t in b.kv.cleared()))
