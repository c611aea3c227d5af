"""Independent float64 numpy reference of llama.cpp's `deepseek2` forward pass (DeepSeek-V2 MLA + MoE), and llama.cpp's
own logits.

The reference reads the GGUF with `gguf.GGUFReader`, dequantizes every tensor with `gguf.quants.dequantize` and follows
llama.cpp's `src/models/deepseek2.cpp` graph (plus the hparam defaults of `llama-model.cpp` / `llama-context.cpp` and
the CPU kernels of `ggml-cpu/ops.cpp`) but computes everything in float64. Attention is evaluated in the plain
decompressed multi-head form (per-head k_nope and v expanded from the compressed c_kv), not the absorbed MQA form
llama.cpp and the project's model use, so that the two formulations check each other. Nothing here imports the project's
`model` package.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

ARCH = "deepseek2"
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT, GATING_SQRT_SOFTPLUS = 1, 2, 3, 4
ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2, "longrope": 3}
NONE, YARN = 0, 2
WEIGHTS_SUM_MIN = 6.103515625e-5  # build_moe_ffn clamps the expert weight sum to the smallest normal fp16


def _field_value(field: Any) -> Any:
  kind = field.types[0]
  if kind == GGUFValueType.ARRAY:
    if field.types[-1] == GGUFValueType.STRING: return [bytes(field.parts[i]).decode() for i in field.data]
    return [field.parts[i][0].item() for i in field.data]
  if kind == GGUFValueType.STRING: return bytes(field.parts[field.data[0]]).decode()
  return field.parts[field.data[0]][0].item()


def _per_layer(value: Any, il: int) -> int:
  return int(value[il] if isinstance(value, list) else value)


@dataclass(frozen=True)
class Hparams:
  """The subset of llama.cpp's llama_hparams / llama_cparams the deepseek2 graph uses, with llama.cpp's defaults."""
  n_embd: int
  n_layer: int  # trunk layers: block_count minus nextn_predict_layers (the MTP blocks are never run)
  n_head: list[int]
  n_expert: int
  n_expert_used: list[int]
  n_expert_shared: int
  n_expert_groups: int
  n_group_used: int
  n_layer_dense_lead: int
  n_lora_q: int
  n_lora_kv: int
  is_mla: bool  # split attn_k_b / attn_v_b tensors (key_length_mla and value_length_mla set); else the legacy attn_kv_b
  head_k: int  # per-head q/k size after decompression: qk_nope + qk_rope
  head_v: int
  n_rot: int
  rms_eps: float
  gating: int
  weights_norm: bool
  weights_scale: float
  freq_base: float
  freq_scale: float
  n_ctx_orig: int
  ext_factor: float
  attn_factor: float  # cparams.yarn_attn_factor, passed to ggml_rope_ext
  beta_fast: float
  beta_slow: float
  yarn_log_mul: float
  attn_temp_scale: float
  attn_temp_length: int

  @property
  def qk_nope(self) -> int: return self.head_k - self.n_rot

  @property
  def kq_scale(self) -> float:
    """deepseek2.cpp pre-scales kq_scale with the YaRN mscale (TAG_DEEPSEEK2_YARN_LOG_MUL_FIX)."""
    attn_factor_org = self.attn_factor * (1 + 0.1 * math.log(1 / self.freq_scale))
    mscale = attn_factor_org * (1 + 0.1 * self.yarn_log_mul * math.log(1 / self.freq_scale))
    return mscale * mscale / math.sqrt(self.head_k)


def read_hparams(meta: dict[str, Any]) -> Hparams:
  """Mirror of llama_model::load_hparams + deepseek2 load_arch_hparams + the llama_context constructor (default context
  params)."""
  if meta.get("general.architecture") != ARCH:
    raise ValueError(f"not a {ARCH} GGUF: {meta.get('general.architecture')}")
  kv = lambda key, default=None: meta.get(f"{ARCH}.{key}", default)
  def need(key: str) -> Any:
    if f"{ARCH}.{key}" not in meta: raise KeyError(f"key not found in model: {ARCH}.{key}")
    return meta[f"{ARCH}.{key}"]

  n_layer_all, n_embd = int(need("block_count")), int(need("embedding_length"))
  n_layer = n_layer_all - int(kv("nextn_predict_layers", 0))
  head_count = need("attention.head_count")
  n_head = [_per_layer(head_count, il) for il in range(n_layer_all)]
  n_expert_used = [_per_layer(kv("expert_used_count", 0), il) for il in range(n_layer_all)]
  n_vocab = int(kv("vocab_size", 0)) or len(meta.get("tokenizer.ggml.tokens", []))
  # "lite" variants (DeepSeek-V2-Lite and friends) are recognised by layer count and have no q_lora_rank key; all others
  # must have it
  is_lite = n_layer in (26, 27) or (n_layer == 48 and n_vocab == 128256)
  n_lora_q = 0 if is_lite else int(need("attention.q_lora_rank"))

  head_k_full = int(kv("attention.key_length", n_embd // n_head[0]))
  head_v_full = int(kv("attention.value_length", n_embd // n_head[0]))
  head_k_mla, head_v_mla = int(kv("attention.key_length_mla", 0)), int(kv("attention.value_length_mla", 0))
  is_mla = head_k_mla != 0 and head_v_mla != 0

  gating = int(kv("expert_gating_func", 0))
  if gating == 0:  # old DeepSeek V2/V2.5 GGUFs have no gating key; GLM-4.7-Flash is recognised by shape
    gating = GATING_SIGMOID if n_layer in (47, 48) and n_vocab == 154880 else GATING_SOFTMAX
  # cancels the 0.1 the convert script multiplied in
  yarn_log_mul = float(kv("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1

  scaling = ROPE_SCALING[kv("rope.scaling.type", "linear")]
  factor = float(kv("rope.scaling.factor", kv("rope.scale_linear", 0.0)))
  freq_scale = 1.0 if factor == 0 or scaling == NONE else 1 / factor
  ext_factor = 1.0 if scaling == YARN else 0.0
  attn_factor = 1.0
  if ext_factor != 0:
    get_mscale = lambda scale, m: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1
    s = 1 / freq_scale
    # llama_context: with a log-mul, deepseek2 sets mscale = mscale_all_dims, so get_mscale(s, mscale) / get_mscale(s,
    # mscale_all_dims) is 1; then it cancels the (1 + 0.1 ln s) that ggml's rope_yarn multiplies in
    attn_factor = (1.0 if yarn_log_mul != 0 else get_mscale(s, 1.0)) / (1 + 0.1 * math.log(s))
  attn_factor *= float(kv("rope.scaling.attn_factor", 1.0))

  return Hparams(
    n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_expert=int(kv("expert_count", 0)), n_expert_used=n_expert_used,
    n_expert_shared=int(need("expert_shared_count")), n_expert_groups=int(kv("expert_group_count", 0)),
    n_group_used=int(kv("expert_group_used_count", 0)), n_layer_dense_lead=int(kv("leading_dense_block_count", 0)),
    n_lora_q=n_lora_q, n_lora_kv=int(need("attention.kv_lora_rank")), is_mla=is_mla,
    head_k=head_k_mla if is_mla else head_k_full, head_v=head_v_mla if is_mla else head_v_full,
    n_rot=int(kv("rope.dimension_count", head_k_full)), rms_eps=float(need("attention.layer_norm_rms_epsilon")),
    gating=gating, weights_norm=bool(kv("expert_weights_norm", False)),
    weights_scale=float(kv("expert_weights_scale", 0.0)), freq_base=float(kv("rope.freq_base", 10000.0)),
    freq_scale=freq_scale, n_ctx_orig=int(kv("rope.scaling.original_context_length", 0)) or int(need("context_length")),
    ext_factor=ext_factor, attn_factor=attn_factor, beta_fast=32.0, beta_slow=1.0, yarn_log_mul=yarn_log_mul,
    attn_temp_scale=float(kv("attention.temperature_scale", 0.0)),
    attn_temp_length=int(kv("attention.temperature_length", 0)))


class Weights:
  """Tensors of one GGUF, dequantized on first use and kept (numpy shape = ggml ne reversed).

  Kept as float32, which holds every dequantized value exactly (gguf.quants computes them in float32); products are
  taken in float64, in row chunks for large matrices so no float64 copy of a whole vocabulary matrix is ever made."""

  def __init__(self, path: Path):
    reader = GGUFReader(path)
    self.meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    self.hp = read_hparams(self.meta)
    self._raw = {t.name: t for t in reader.tensors}
    self._cache: dict[tuple[str, int | None], np.ndarray] = {}
    # sees every matmul's activation operand (reference_forward)
    self.observer: Callable[[np.ndarray, str], None] | None = None

  def __contains__(self, name: str) -> bool: return name in self._raw

  def type(self, name: str) -> T: return T(int(self._raw[name].tensor_type))

  def shape(self, name: str) -> tuple[int, ...]: return tuple(int(d) for d in reversed(self._raw[name].shape.tolist()))

  def get(self, name: str, expert: int | None = None) -> np.ndarray:
    """A whole tensor, or one expert's matrix of a 3-D `*_exps` tensor (so only the experts actually routed to get
    dequantized)."""
    if (name, expert) not in self._cache:
      shape, data = self.shape(name), self._raw[name].data
      w = dequantize(np.asarray(data if expert is None else data[expert]), self.type(name)).astype(np.float32)
      self._cache[name, expert] = w.reshape(shape if expert is None else shape[1:])
    return self._cache[name, expert]

  def mm(self, x: np.ndarray, name: str, expert: int | None = None) -> np.ndarray:
    """ggml_mul_mat(weight, x): x (..., in) times the (out, in) weight, transposed."""
    if self.observer is not None: self.observer(x, name)
    w, rows = self.get(name, expert), 16384
    return np.concatenate([x @ w[i:i + rows].T.astype(np.float64) for i in range(0, w.shape[0], rows)], axis=-1)


@lru_cache(maxsize=8)
def _weights(path: str, mtime_ns: int, size: int) -> Weights:
  return Weights(Path(path))


def load_weights(path: str | Path) -> Weights:
  """Per-file cache keyed on (path, mtime, size), so a rewritten file is re-read."""
  st = Path(path).stat()
  return _weights(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray: return x / (1 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
  e = np.exp(x - np.max(x, axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def rope(x: np.ndarray, pos: np.ndarray, hp: Hparams) -> np.ndarray:
  """ggml_rope_ext in GGML_ROPE_TYPE_NORMAL mode: rotates adjacent pairs (x[2i], x[2i+1]) of the last axis (n_rot wide)
  with YaRN.

  x: (T, ..., n_rot); pos: (T,). Follows rope_yarn / rope_yarn_ramp / ggml_rope_yarn_corr_dims, including the magnitude
  scale attn_factor * (1 + 0.1 ln(1/freq_scale)) that multiplies cos and sin when ext_factor != 0.
  """
  n_dims = hp.n_rot
  corr = lambda beta: n_dims * math.log(hp.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(hp.freq_base))
  low, high = max(0.0, math.floor(corr(hp.beta_fast))), min(n_dims - 1.0, math.ceil(corr(hp.beta_slow)))
  i = np.arange(n_dims // 2)
  theta_extrap = pos[:, None].astype(np.float64) * hp.freq_base ** (-2.0 * i / n_dims)
  theta = hp.freq_scale * theta_extrap
  mscale = hp.attn_factor
  if hp.ext_factor != 0:
    ramp_mix = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * hp.ext_factor
    theta = theta * (1 - ramp_mix) + theta_extrap * ramp_mix
    mscale *= 1 + 0.1 * math.log(1 / hp.freq_scale)
  shape = (len(pos),) + (1,) * (x.ndim - 2) + (n_dims // 2,)
  cos, sin = (mscale * np.cos(theta)).reshape(shape), (mscale * np.sin(theta)).reshape(shape)
  x0, x1 = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
  return out


def attention(w: Weights, il: int, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
  """MLA in its decompressed multi-head form: q·[k_nope_h ; k_pe] over heads, with k_pe shared by all heads."""
  hp, p = w.hp, f"blk.{il}."
  n_tok, H, nope, kv_lora = len(h), hp.n_head[il], hp.qk_nope, hp.n_lora_kv
  if hp.n_lora_q > 0:
    q = w.mm(rms_norm(w.mm(h, p + "attn_q_a.weight"), w.get(p + "attn_q_a_norm.weight"), hp.rms_eps),
             p + "attn_q_b.weight")
  else:
    q = w.mm(h, p + "attn_q.weight")
  q = q.reshape(n_tok, H, hp.head_k)
  kv_pe = w.mm(h, p + "attn_kv_a_mqa.weight")
  c_kv = rms_norm(kv_pe[:, :kv_lora], w.get(p + "attn_kv_a_norm.weight"), hp.rms_eps)
  q_nope, q_pe = q[..., :nope], rope(q[..., nope:], pos, hp)
  k_pe = rope(kv_pe[:, kv_lora:], pos, hp)
  if not hp.is_mla:  # legacy: one (n_head*(nope+v), kv_lora) matrix, per head [k_nope ; v]
    kv = w.mm(c_kv, p + "attn_kv_b.weight").reshape(n_tok, H, nope + hp.head_v)
    k_nope, v = kv[..., :nope], kv[..., nope:]
  else:  # split: k_b (H, kv_lora, nope), v_b (H, v, kv_lora)
    k_nope = np.einsum("hcn,tc->thn", w.get(p + "attn_k_b.weight"), c_kv)
    v = np.einsum("hdc,tc->thd", w.get(p + "attn_v_b.weight"), c_kv)
  if hp.attn_temp_scale != 0:  # llama 4 style temperature tuning (mistral-large), applied to the whole of Qcur
    scale = np.log(np.floor(pos / hp.attn_temp_length) + 1) * hp.attn_temp_scale + 1
    q_nope, q_pe = q_nope * scale[:, None, None], q_pe * scale[:, None, None]
  scores = (np.einsum("thn,shn->hts", q_nope, k_nope) + np.einsum("thr,sr->hts", q_pe, k_pe)) * hp.kq_scale
  scores = np.where(np.tril(np.ones((n_tok, n_tok), dtype=bool)), scores, -np.inf)
  out = np.einsum("hts,shd->thd", softmax(scores), v).reshape(n_tok, H * hp.head_v)
  return w.mm(out, p + "attn_output.weight")


def ffn(w: Weights, h: np.ndarray, prefix: str, kind: str, expert: int | None = None) -> np.ndarray:
  """SiLU-gated FFN (LLM_FFN_SILU, LLM_FFN_PAR): down(silu(gate(h)) * up(h)), e.g. kind "" / "_shexp" / "_exps"."""
  if f"{prefix}ffn_gate_up{kind}.weight" in w:  # fused gate+up experts: the first half of the rows is the gate
    gate, up = np.split(w.mm(h, f"{prefix}ffn_gate_up{kind}.weight", expert), 2, axis=-1)
  else:
    gate, up = w.mm(h, f"{prefix}ffn_gate{kind}.weight", expert), w.mm(h, f"{prefix}ffn_up{kind}.weight", expert)
  return w.mm(silu(gate) * up, f"{prefix}ffn_down{kind}.weight", expert)


GATING = {GATING_SOFTMAX: softmax, GATING_SIGMOID: lambda z: 1 / (1 + np.exp(-z)), GATING_SOFTMAX_WEIGHT: lambda z: z,
          GATING_SQRT_SOFTPLUS: lambda z: np.sqrt(np.logaddexp(0, z))}
# d(prob_e)/d(logit_e), the sensitivity of a selection score to its own router logit
GATING_SLOPE = {GATING_SOFTMAX: lambda z, p: p * (1 - p), GATING_SIGMOID: lambda z, p: p * (1 - p),
                GATING_SOFTMAX_WEIGHT: lambda z, p: np.ones_like(z), GATING_SQRT_SOFTPLUS: lambda z,
                p: 1 / (1 + np.exp(-z)) / (2 * p)}


def top_k(x: np.ndarray, k: int) -> np.ndarray:
  """Indices of the k largest of each row, largest first; ties go to the lower index (ggml uses an unstable
  std::sort)."""
  return np.argsort(-x, axis=-1, kind="stable")[..., :k]


def route_margin(logits: np.ndarray, probs: np.ndarray, selection: np.ndarray, k: int, gating: int) -> np.ndarray:
  """Per token: the relative change of the router logits (in units of their rms) that could swap the k-th and (k+1)-th
  expert.

  The selection gap s_k - s_k+1 closes when the two scores move apart by slope * dz each, so the margin is
  gap / (2 * max slope * rms(z)): an input perturbed by a relative amount below this cannot change which experts are
  used (among the kept expert groups, when the selection is group-limited).
  """
  order = top_k(selection, k + 1)
  s, z, p = (np.take_along_axis(a, order[:, k - 1:], axis=-1) for a in (selection, logits, probs))
  slope = GATING_SLOPE[gating](z, p).max(-1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.nan_to_num((s[:, 0] - s[:, 1]) / (2 * slope * np.sqrt(np.mean(logits ** 2, axis=-1))), nan=np.inf,
                         posinf=np.inf)


def moe(w: Weights, il: int, h: np.ndarray, margins: list[np.ndarray]) -> np.ndarray:
  """build_moe_ffn: gating, optional selection bias (selection only), group-limited top-k, weight norm/scale, routed +
  shared experts."""
  hp, p = w.hp, f"blk.{il}."
  n_tok, n_expert, k = len(h), hp.n_expert, hp.n_expert_used[il]
  logits = w.mm(h, p + "ffn_gate_inp.weight")
  probs = GATING[hp.gating](logits)
  selection = probs + w.get(p + "exp_probs_b.bias") if p + "exp_probs_b.bias" in w else probs
  if hp.n_expert_groups > 1:  # keep the n_group_used groups whose two best experts sum highest, mask the rest
    groups = selection.reshape(n_tok, hp.n_expert_groups, n_expert // hp.n_expert_groups)
    group_scores = np.take_along_axis(groups, top_k(groups, 2), axis=-1).sum(-1)
    keep = np.zeros((n_tok, hp.n_expert_groups), dtype=bool)
    np.put_along_axis(keep, top_k(group_scores, hp.n_group_used), True, axis=-1)
    selection = np.where(keep[..., None], groups, -np.inf).reshape(n_tok, n_expert)
  selected = top_k(selection, k)
  if k < n_expert: margins.append(route_margin(logits, probs, selection, k, hp.gating))
  weights = np.take_along_axis(probs, selected, axis=-1)
  if hp.gating == GATING_SOFTMAX_WEIGHT: weights = softmax(weights)
  if hp.weights_norm: weights = weights / np.maximum(weights.sum(-1, keepdims=True), WEIGHTS_SUM_MIN)
  if hp.weights_scale not in (0.0, 1.0): weights = weights * hp.weights_scale
  out = ffn(w, h, p, "_shexp")
  for e in np.unique(selected):
    rows, slot = np.nonzero(selected == e)
    out[rows] += weights[rows, slot, None] * ffn(w, h[rows], p, "_exps", int(e))
  return out


@dataclass(frozen=True)
class Forward:
  logits: np.ndarray  # (T, n_vocab) float64
  route_margin: np.ndarray  # (T,) smallest `route_margin` over the MoE layers (inf without routing)


def reference_logits(path: str | Path, tokens: list[int]) -> np.ndarray:
  """float64 logits (len(tokens), n_vocab) of one causal pass over tokens at positions 0..T-1."""
  return reference_forward(path, tokens).logits


@lru_cache(maxsize=1)
def _openblas() -> ctypes.CDLL | None:
  libs = sorted(Path(np.__file__).parent.parent.glob("numpy.libs/libscipy_openblas64_*.so"))
  lib = ctypes.CDLL(str(libs[0])) if libs else None
  return lib if lib is not None and hasattr(lib, "scipy_openblas_set_num_threads64_") else None


@contextmanager
def single_threaded_blas() -> Iterator[None]:
  """On the tiny presets the reference's matmuls are small: OpenBLAS threads gain little on them and, spinning while the
  cores are shared (with llama.cpp, other tests), slow a forward pass down ~5x. Only numpy's bundled scipy-openblas is
  known how to tell; any other BLAS is left alone."""
  if (lib := _openblas()) is None:
    yield
    return
  n = lib.scipy_openblas_get_num_threads64_()
  lib.scipy_openblas_set_num_threads64_(1)
  try: yield
  finally: lib.scipy_openblas_set_num_threads64_(n)


def reference_forward(path: str | Path, tokens: list[int],
                      observer: Callable[[np.ndarray, str], None] | None = None) -> Forward:
  """`reference_logits` plus how close each token came to a different expert choice; `observer(x, weight_name)` sees
  every matmul."""
  w = load_weights(path)
  w.observer = observer
  try:
    with single_threaded_blas(): return _forward(w, tokens)
  finally: w.observer = None


def _forward(w: Weights, tokens: list[int]) -> Forward:
  margins: list[np.ndarray] = [np.full(len(tokens), np.inf)]
  hp = w.hp
  pos = np.arange(len(tokens))
  x = w.get("token_embd.weight")[np.asarray(tokens)].astype(np.float64)
  for il in range(hp.n_layer):
    p = f"blk.{il}."
    x = x + attention(w, il, rms_norm(x, w.get(p + "attn_norm.weight"), hp.rms_eps), pos)
    h = rms_norm(x, w.get(p + "ffn_norm.weight"), hp.rms_eps)
    if il < hp.n_layer_dense_lead:
      x = x + ffn(w, h, p, "")
    else:
      x = x + moe(w, il, h, margins)
  logits = w.mm(rms_norm(x, w.get("output_norm.weight"), hp.rms_eps),
                "output.weight" if "output.weight" in w else "token_embd.weight")
  return Forward(logits, np.min(margins, axis=0))


# *** llama.cpp's arithmetic, as far as it differs from the reference

# ggml-cpu's type_traits_cpu[weight type].vec_dot_type: the format ggml_mul_mat converts the activation operand to
VEC_DOT = {T.F16: T.F16, T.BF16: T.BF16, T.Q4_0: T.Q8_0, T.Q5_0: T.Q8_0, T.Q8_0: T.Q8_0,
           T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K}
# unit roundoff of fp16, which the KV cache (and so q, k, v and the softmax probabilities) is stored in
F16_EPS = 2.0 ** -11
F32_FLOOR = 1e-4  # f32 arithmetic alone: observed ~2e-6 of the logit std on the tiny presets
# a routing decision whose route_margin is below ROUTE_MARGIN * delta may legitimately differ in llama.cpp. delta
# overestimates the noise at a router: emulating llama.cpp's rounding (round_activation on every matmul input) moves the
# tiny presets' router logits by 0.3-0.45 delta (rms, relative), and a margin by 1/sqrt(2) of that, so 1.5 delta is >4.5
# sigma
ROUTE_MARGIN = 1.5
SAFETY = 2.0  # covers what activation_noise does not measure: the amplification of noise down the network, and the
#              roundings of the absorbed q_nope·k_b and kqv·v_b products, which this decompressed reference does not
# form


def round_activation(x: np.ndarray, fmt: T) -> np.ndarray:
  """x (rows of a multiple of the block size) after ggml's from_float to `fmt` and back (quantize_row_q8_0 / q8_K / fp16
  / bf16)."""
  if fmt == T.F16: return x.astype(np.float16).astype(np.float64)
  if fmt == T.BF16:  # ggml_compute_fp32_to_bf16: round to nearest even on the f32 bits
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
  blocks = x.reshape(-1, 32 if fmt == T.Q8_0 else 256)
  if fmt == T.Q8_0:  # d = amax/127 stored as fp16, q = round(x/d)
    d = np.abs(blocks).max(-1, keepdims=True) / 127
    q = np.round(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0))
    return (q * d.astype(np.float16)).reshape(x.shape)
  # Q8_K: iscale = -127/max, d = 1/iscale (f32)
  signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[:, None], axis=-1)
  iscale = np.divide(-127.0, signed_max, out=np.zeros_like(signed_max), where=signed_max != 0)
  d = np.divide(1.0, iscale, out=np.zeros_like(iscale), where=iscale != 0)
  return (np.minimum(127, np.round(iscale * blocks)) * d).reshape(x.shape)


def activation_noise(path: str | Path, tokens: list[int], kv_cache: str = "f16") -> float:
  """delta: the relative rms perturbation llama.cpp's rounding of activations adds to a forward pass over `tokens`.

  Every matmul input x of the reference is rounded as llama.cpp would round it for that weight's type; its relative
  error
  ||dx||/||x|| (rms over the rows reaching that tensor) is the relative noise that matmul adds to its output. Those add
  in quadrature: delta = sqrt(sum over weight tensors of mean ||dx||^2/||x||^2), plus 4 fp16 roundings (q, k, v, softmax
  probabilities) of uniform relative error F16_EPS/sqrt(3) per layer for the fp16 KV cache.
  """
  w = load_weights(path)
  sq: dict[str, list[np.ndarray]] = {}
  def observe(x: np.ndarray, name: str) -> None:
    if (fmt := VEC_DOT.get(w.type(name))) is not None:
      dx = round_activation(x, fmt) - x
      sq.setdefault(name, []).append(np.sum(dx * dx, axis=-1) / np.maximum(np.sum(x * x, axis=-1), 1e-300))
  reference_forward(path, tokens, observe)
  var = sum(float(np.mean(np.concatenate(v))) for v in sq.values())
  if kv_cache == "f16": var += 4 * w.hp.n_layer * F16_EPS ** 2 / 3
  return math.sqrt(var)


def llamacpp_error_bound(path: str | Path, tokens: list[int], kv_cache: str = "f16") -> float:
  """Bound on max_v |llama.cpp logit - reference logit| / std_v(logits) at each position whose routing is not within
  ROUTE_MARGIN * delta of a tie (`Forward.route_margin`). Derivation in `llamacpp_logits`."""
  w = load_weights(path)
  n_vocab = w.shape("output.weight" if "output.weight" in w else "token_embd.weight")[0]
  return SAFETY * math.sqrt(2 * math.log(n_vocab)) * activation_noise(path, tokens, kv_cache) + F32_FLOOR


def llamacpp_logits(path: str | Path, tokens: list[int], kv_cache: str = "f16") -> np.ndarray:
  """llama.cpp's logits (CPU backend via llama-cpp-python, one causal pass at positions 0..T-1) as float64 (T, n_vocab).

  kv_cache "f16" is llama.cpp's default; "f32" removes the fp16 rounding of attention. The reference dequantizes weights
  exactly as ggml does, so every difference comes from what llama.cpp does to activations:

  * ggml_mul_mat converts its activation operand to the weight type's vec_dot_type (`VEC_DOT`) before the dot products:
    Q8_0 for Q4_0/Q5_0/Q8_0 weights (blocks of 32, d = amax/127 stored as fp16, q = round(x/d)), Q8_K for the k-quants
    (blocks of 256, d = amax/127 in f32), fp16 / bf16 for F16 / BF16 weights; only F32 weights see f32 activations.
    Per element |dx| <= d/2 = amax/254 (Q8_0 adds |q|·|d - fp16(d)| <= 127·d·2^-11 = amax/2048), i.e. about 2^-8 of the
    block's largest magnitude, or a relative 2^-11 (fp16) / 2^-8 (bf16) of the element itself.
  * The KV cache is fp16 (for MLA it holds the normalised c_kv and the roped k_pe), so q (converted for the f16 K·q
    dot), k, v and the softmax probabilities (converted for the f16 V matmul) are rounded to fp16 even for an F32 model.
  * Everything else (norms, rope, softmax, routing, dequantization) is f32: ~1e-6 of the logit scale on the tiny
    presets.

  Why that bounds the logits: the rounding errors of one matmul input are zero-mean and independent of the weights, so
  the output y = W·x moves by W·dx, a relative ||dx||/||x|| of y for weights with no structure aligned to the rounding
  (random or trained); with amax/rms ~ 2-3 within a block that is ~0.5-0.8% per Q8 matmul, 2^-11/sqrt(3) per fp16 one.
  RMSNorm before every matmul and the residual stream keep relative errors from growing, and independent errors add in
  quadrature, so the final hidden state, and with it each logit, carries a relative error of about delta =
  sqrt(sum of the per-matmul squares) (`activation_noise`, measured on the reference's own activations). The largest of
  n_vocab such deviations is ~sqrt(2 ln n_vocab) times that, in units of the logits' standard deviation over the
  vocabulary; SAFETY = 2 covers the unmeasured rest (`llamacpp_error_bound`). Routing is the exception: where two
  experts' selection scores are closer than the noise (`Forward.route_margin` < ROUTE_MARGIN * delta), llama.cpp may
  pick the other expert, a discrete and legitimate divergence that no bound on rounding covers, and one that later
  positions inherit through attention when it happens before the last MoE layer.
  """
  import llama_cpp

  n, kv_type = len(tokens), {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[kv_cache]
  llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(n, 16), n_batch=max(n, 16), n_ubatch=max(n, 16),
                        logits_all=True, n_threads=2, n_threads_batch=2, type_k=kv_type, type_v=kv_type, verbose=False)
  try:
    llm.eval(list(tokens))
    return np.array(llm.scores[:n], dtype=np.float64)
  finally:
    llm.close()


def robust_tokens(path: str, kv_cache: str, n: int = 32, seed: int = 0, max_draws: int = 1000) -> list[int]:
  """n random ids, each redrawn until no routing decision at its position lies within ROUTE_MARGIN * delta of a tie.

  A near-tie may legitimately route differently in llama.cpp, and before the last MoE layer that divergence reaches
  every later position through attention. Position t only depends on tokens[:t+1], so from the first fragile position on
  the sequence is grown one robust token at a time.
  """
  rng = np.random.default_rng(seed)
  n_vocab = reference_logits(path, [0]).shape[1]
  tokens = rng.integers(0, n_vocab, n).tolist()
  threshold = ROUTE_MARGIN * activation_noise(path, tokens, kv_cache)
  fragile = np.flatnonzero(reference_forward(path, tokens).route_margin < threshold)
  tokens = tokens[:fragile[0]] if len(fragile) else tokens
  for _ in range(max_draws):
    if len(tokens) == n: return tokens
    candidate = tokens + [int(rng.integers(0, n_vocab))]
    if reference_forward(path, candidate).route_margin[-1] >= threshold: tokens = candidate
  raise AssertionError(f"only {len(tokens)} robustly routed tokens after {max_draws} draws")
