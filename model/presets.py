"""Published hyperparameters of real deepseek2-architecture (MLA, optionally MoE) models, plus tiny test shapes.

The numbers of a real preset are those of its Hugging Face config.json (the parameter counts of Youtu-LLM-2B and
DeepSeek-V2-Lite computed from them match the published ones exactly). The tokenizer fields describe the real tokenizer
(pre-tokenizer name as llama.cpp's converter writes it, special tokens, chat template), so a synthetic file made from a
preset looks like the real GGUF apart from the weights and the ordinary vocabulary; its special tokens sit at the end of
the vocabulary rather than at their real ids.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GLM_SPECIALS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
GLM_ROLES = (("bos", "[gMASK]"), ("eos", "<|endoftext|>"), ("unk", "<|endoftext|>"), ("pad", "<|endoftext|>"),
             ("eot", "<|user|>"), ("eom", "<|observation|>"))
# shortened from llama.cpp's models/templates/GLM-4.7-Flash.jinja (tools and reasoning_content handling dropped)
GLM_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
                "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                "{% elif m['role'] == 'assistant' %}<|assistant|></think>{{ "
                "m['content'].split('</think>')[-1].strip() }}{% elif m['role'] == 'tool' "
                "%}<|observation|><tool_response>{{ m['content'] }}</tool_response>{% endif %}{% endfor %}{% if "
                "add_generation_prompt %}<|assistant|>{{ '</think>' if enable_thinking is defined and not "
                "enable_thinking else '<think>' }}{% endif %}")

DS_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
DS_ROLES = (("bos", DS_SPECIALS[0]), ("eos", DS_SPECIALS[1]), ("pad", DS_SPECIALS[1]))
# deepseek-ai/DeepSeek-V2-Lite-Chat tokenizer_config.json, verbatim
DS_TEMPLATE = ("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ "
               "bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + "
               "message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + "
               "message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['content'] + "
               "'\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

YOUTU_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|User|>", "<|Assistant|>")
YOUTU_ROLES = (("bos", "<|begin_of_text|>"), ("eos", "<|end_of_text|>"), ("pad", "<|end_of_text|>"))
# the real template also renders tool calls and <think> sections; this keeps its role markers and end-of-turn token
YOUTU_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
                  "{% elif m['role'] == 'user' %}<|User|>{{ m['content'] }}"
                  "{% elif m['role'] == 'assistant' %}<|Assistant|>{{ m['content'] }}<|end_of_text|>{% endif %}{% "
                  "endfor %}{% if add_generation_prompt %}<|Assistant|>{% endif %}")


@dataclass(frozen=True)
class ModelShape:
  name: str
  hf_repo: str
  url: str                     # the real GGUF (or HF repo) to point users at
  n_layers: int
  n_dense: int                 # leading dense-FFN blocks (first_k_dense_replace); == n_layers for a dense model
  dim: int
  n_heads: int
  q_lora: int                  # 0: direct q projection (attn_q)
  kv_lora: int
  qk_nope: int
  qk_rope: int
  v_head: int
  dense_ffn: int
  n_experts: int
  n_used: int
  n_shared: int
  expert_ffn: int
  gating: str                  # "softmax" | "sigmoid"
  exp_probs_bias: bool         # sigmoid routers select with a learned bias (noaux_tc)
  routed_scale: float
  norm_topk: bool
  vocab: int
  ctx: int
  rope_theta: float
  rms_eps: float
  tied: bool = False
  yarn_factor: float = 0.0     # 0: no rope scaling
  yarn_orig_ctx: int = 0
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_mscale: float = 1.0
  yarn_mscale_all_dim: float = 0.0
  tokenizer_pre: str = "glm4"
  specials: tuple[str, ...] = GLM_SPECIALS
  special_roles: tuple[tuple[str, str], ...] = GLM_ROLES
  add_bos: bool = False
  chat_template: str = GLM_TEMPLATE
  aliases: tuple[str, ...] = ()

  @property
  def qk_head(self) -> int: return self.qk_nope + self.qk_rope

  def with_layers(self, n: int) -> ModelShape:
    """Same widths, the first n blocks (the leading dense blocks are kept)."""
    if not 1 <= n <= self.n_layers: raise ValueError(f"layers must be in 1..{self.n_layers} for {self.name}, not {n}")
    return dataclasses.replace(self, n_layers=n, n_dense=min(self.n_dense, n))


PRESETS: dict[str, ModelShape] = {
  # zai-org/GLM-4.7-Flash config.json (Glm4MoeLiteForCausalLM, rope_scaling null, untied, topk_method noaux_tc: sigmoid
  # scores selected with e_score_correction_bias); the MTP block (num_nextn_predict_layers=1) is not included
  "glm-4.7-flash": ModelShape(
    name="glm-4.7-flash", hf_repo="zai-org/GLM-4.7-Flash", url="https://huggingface.co/unsloth/GLM-4.7-Flash-GGUF",
    n_layers=47, n_dense=1, dim=2048, n_heads=20, q_lora=768, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256,
    dense_ffn=10240, n_experts=64, n_used=4, n_shared=1, expert_ffn=1536, gating="sigmoid", exp_probs_bias=True,
    routed_scale=1.8, norm_topk=True, vocab=154880, ctx=202752, rope_theta=1e6, rms_eps=1e-5,
    aliases=("glm", "glm-4.7")),
  # deepseek-ai/DeepSeek-V2-Lite config.json (DeepseekV2ForCausalLM, q_lora_rank null, topk_method greedy,
  # scoring_func softmax)
  "deepseek-v2-lite": ModelShape(
    name="deepseek-v2-lite", hf_repo="deepseek-ai/DeepSeek-V2-Lite",
    url="https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite", n_layers=27, n_dense=1, dim=2048, n_heads=16, q_lora=0,
    kv_lora=512, qk_nope=128, qk_rope=64, v_head=128, dense_ffn=10944, n_experts=64, n_used=6, n_shared=2,
    expert_ffn=1408, gating="softmax", exp_probs_bias=False, routed_scale=1.0, norm_topk=False, vocab=102400,
    ctx=163840, rope_theta=10000.0, rms_eps=1e-6, yarn_factor=40.0, yarn_orig_ctx=4096, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0, yarn_mscale=0.707, yarn_mscale_all_dim=0.707, tokenizer_pre="deepseek-llm",
    specials=DS_SPECIALS, special_roles=DS_ROLES, add_bos=True, chat_template=DS_TEMPLATE, aliases=("ds2-lite",)),
  # tencent/Youtu-LLM-2B config.json (YoutuForCausalLM): dense MLA, rope_parameters {rope_type: default, rope_theta:
  # 1600000}, tied embeddings; 1,961,560,064 parameters. llama.cpp's converter writes the dense model as
  # all-leading-dense, expert ffn = ffn.
  "youtu": ModelShape(
    name="youtu", hf_repo="tencent/Youtu-LLM-2B", url="https://huggingface.co/tencent/Youtu-LLM-2B",
    n_layers=32, n_dense=32, dim=2048, n_heads=16, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
    dense_ffn=6144, n_experts=0, n_used=0, n_shared=0, expert_ffn=6144, gating="softmax", exp_probs_bias=False,
    routed_scale=1.0, norm_topk=False, vocab=128256, ctx=131072, rope_theta=1.6e6, rms_eps=1e-6, tied=True,
    tokenizer_pre="youtu", specials=YOUTU_SPECIALS, special_roles=YOUTU_ROLES, add_bos=True,
    chat_template=YOUTU_TEMPLATE, aliases=("youtu-llm-2b",)),
  # CPU test shapes: dim 256 so every K-quant type fits a row
  "tiny": ModelShape(
    name="tiny", hf_repo="", url="", n_layers=3, n_dense=1, dim=256, n_heads=4, q_lora=128, kv_lora=128, qk_nope=32,
    qk_rope=32, v_head=32, dense_ffn=512, n_experts=8, n_used=2, n_shared=1, expert_ffn=256, gating="sigmoid",
    exp_probs_bias=True, routed_scale=1.8, norm_topk=True, vocab=1024, ctx=2048, rope_theta=10000.0, rms_eps=1e-5),
  # the tiny widths at depth: 30 MoE blocks, where a routing near-tie anywhere sends a per-position logit
  # comparison astray
  "tiny-deep": ModelShape(
    name="tiny-deep", hf_repo="", url="", n_layers=32, n_dense=2, dim=256, n_heads=4, q_lora=128, kv_lora=128,
    qk_nope=32, qk_rope=32, v_head=32, dense_ffn=512, n_experts=64, n_used=4, n_shared=1, expert_ffn=64,
    gating="sigmoid", exp_probs_bias=True, routed_scale=1.8, norm_topk=True, vocab=1024, ctx=2048, rope_theta=10000.0,
    rms_eps=1e-5),
  "tiny-lite": ModelShape(
    name="tiny-lite", hf_repo="", url="", n_layers=3, n_dense=1, dim=256, n_heads=4, q_lora=0, kv_lora=128, qk_nope=32,
    qk_rope=32, v_head=32, dense_ffn=512, n_experts=8, n_used=2, n_shared=2, expert_ffn=256, gating="softmax",
    exp_probs_bias=False, routed_scale=1.0, norm_topk=False, vocab=1024, ctx=256, rope_theta=10000.0, rms_eps=1e-6,
    yarn_factor=4.0, yarn_orig_ctx=64, yarn_mscale=0.707, yarn_mscale_all_dim=0.707, tokenizer_pre="deepseek-llm",
    specials=DS_SPECIALS, special_roles=DS_ROLES, add_bos=True, chat_template=DS_TEMPLATE),
}
_ALIASES = {a: s.name for s in PRESETS.values() for a in (s.name, *s.aliases)}


class UnknownPreset(KeyError, ValueError):
  def __str__(self) -> str: return str(self.args[0])


def get_preset(name: str) -> ModelShape:
  if (key := _ALIASES.get(name.lower())) is None:
    known = ", ".join(k + (" (" + "/".join(v.aliases) + ")" if v.aliases else "") for k, v in PRESETS.items())
    raise UnknownPreset(f"unknown preset {name!r}: known presets are {known}")
  return PRESETS[key]
