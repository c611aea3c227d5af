"""The contract between the model and its kernel backends: what each fused decode stage reads.

A fused stage replaces the per-op path of a part of a block for one token (model/backends/catalog.py STAGES) with a
backend's kernels. The model (model/deepseek2.py Block) builds the inputs of each stage its config fuses once, at load,
as one frozen dataclass below: the stage's weights (each QWeight names its quant type), norms, hyperparameters, KV
cache, RoPE tables, its backend's scratch and the config knobs its kernels read. A backend's stage method
(model/backends/registry.py Backend) receives that and the call's dynamic inputs, never the block. The RMSNorm and the
gating functions' codes live here too: the per-op path and every backend compute the same ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from tinygrad import Tensor

  from model.weights import QWeight

# the router's gating function (GGUF expert_gating_func): softmax over all experts, sigmoid, the logits themselves with
# a softmax over the K selected ones for their weights, sqrt(softplus)
SOFTMAX, SIGMOID, SOFTMAX_WEIGHT, SQRT_SOFTPLUS = 1, 2, 3, 4


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
  """x normalised by its root mean square over the last axis, times gamma w: float32."""
  xf = x.float()
  return xf * (xf.square().mean(-1, keepdim=True) + eps).rsqrt() * w


@dataclass(frozen=True, eq=False)
class Glu:
  """A SiLU-gated FFN's weights, of one FFN (gate and up (hidden, dim), down (dim, hidden)) or of a stack of experts (a
  leading expert axis): gate and up, or the two merged (gate_up: gate's rows, then up's; per expert in a stack)."""
  gate: QWeight | None
  up: QWeight | None
  gate_up: QWeight | None
  down: QWeight

  @property
  def hidden(self) -> int: return self.down.shape[-1]


@dataclass(frozen=True, eq=False)
class Routing:
  """How the router picks and weighs experts: the n_used of n_experts of highest score (the gating function of the
  logits plus the selection bias), weighted by their gating values (softmax over the selected where gating is
  SOFTMAX_WEIGHT), normalised to sum 1 where norm_w, times w_scale (1 or 0: no scale)."""
  n_experts: int
  n_used: int
  gating: int
  norm_w: bool
  w_scale: float


@dataclass(frozen=True, eq=False)
class AttentionStage:
  """h = x + attention(x): the norm, q_a with its norm and q_b (or q_b alone, the whole q projection, where q_a is
  None), kv_a with kv_a_norm over its first kv_lora values, RoPE over the last qk_rope values of q and kv, the KV cache
  row's write, MLA attention over the compressed cache with k_b absorbed into q, v_b and the output projection wo."""
  dim: int
  n_heads: int
  qk_nope: int
  qk_rope: int
  kv_lora: int
  v_head: int
  eps: float
  kq_scale: float
  attn_norm: Tensor
  q_a: QWeight | None
  q_a_norm: Tensor | None
  q_b: QWeight
  kv_a: QWeight
  kv_a_norm: Tensor
  k_b: QWeight  # (heads, kv_lora, qk_nope)
  v_b: QWeight  # (heads, v_head, kv_lora)
  wo: QWeight
  cache: Tensor  # (1, context, kv_lora + qk_rope), in the config's KV dtype
  cos: Tensor  # (context, qk_rope / 2)
  sin: Tensor
  scratch: dict[str, Tensor]  # its backend's (Backend.scratch)
  act: str  # StructureConfig.attn_act: the dense products' input
  qkv_a_rows: int  # StructureConfig.rows: output rows per thread of the dsl products
  attn_out_rows: int
  layout: str  # StructureConfig.attn_layout: per_head or all_heads


@dataclass(frozen=True, eq=False)
class RouterStage:
  """The router of one token: the logits gate_inp . rmsnorm(h) * ffn_norm, the experts they pick and weigh (routing,
  with the selection bias probs_b where the file has one)."""
  dim: int
  eps: float
  ffn_norm: Tensor
  gate_inp: QWeight
  probs_b: Tensor | None
  routing: Routing
  scratch: dict[str, Tensor]  # its backend's (Backend.scratch)


@dataclass(frozen=True, eq=False)
class MoeStage:
  """h + MoE FFN(h): the selected experts of the stack `experts` on rmsnorm(h) * ffn_norm, weighted by their routing
  weights (`routing`: how a backend computes them from the logits), plus the shared expert where the file has one."""
  dim: int
  eps: float
  ffn_norm: Tensor
  routing: Routing
  experts: Glu
  shared: Glu | None
  act: str  # StructureConfig.ffn_act: the activations' form
  gate_up_rows: int  # StructureConfig.rows: output rows per thread of the dsl products
  down_rows: int


@dataclass(frozen=True, eq=False)
class FfnStage:
  """h + FFN(h) of a dense block, on rmsnorm(h) * ffn_norm."""
  dim: int
  eps: float
  ffn_norm: Tensor
  ffn: Glu
  act: str  # StructureConfig.ffn_act: the activations' form
  gate_up_rows: int  # StructureConfig.rows: output rows per thread of the dsl products
  down_rows: int
