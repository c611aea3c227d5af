"""The native backend (model/backends/native.py) in a model on the CPU, its kernels run by the CUDA emulator
(tests/native_cpu.py): the fused stages, the embedding and the output head, 8- and 16-bit activations decode the
baseline's logits within their bounds; the step timeline's build of every kernel computes the same and stamps in order;
a decode step's graph holds native kernels only in its blocks. tests/test_native.py checks the kernels alone and their
sources.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from knobcheck import assert_close, decode, gguf, mix_info
from native_cpu import ALL_NATIVE, TOKENS_EMU, launch_kernel, model_kernels, native_on_cpu
from tinygrad import Tensor, dtypes

from evaluator.gate import FP16_TOL, FP32_TOL
from model.backends import cuda_src, native
from model.deepseek2 import Transformer
from model.generate import Generator
from model.gguf_file import GGUFFile
from model.structure import StructureConfig
from space.knobs import knobs


def eager_logits(path: str, cfg: StructureConfig) -> np.ndarray:
  """Decode logits (positions, vocab) of eager forward passes (no JIT), with the native kernels in the CPU emulator."""
  m = Transformer(gguf(path), cfg, max_context=16)
  return np.stack([m.forward(Tensor([[t]], dtype=dtypes.int32), i).numpy()[0, -1]
                   for i, t in enumerate(TOKENS_EMU)]).astype(np.float64)


@functools.cache
def jit_logits(path: str, cfg_json: str) -> np.ndarray:
  """eager_logits of a config that runs on tinygrad's own kernels (the baseline, dsl), through the decode step's JIT:
  one schedule, where eager passes schedule every position; once per file and config in a worker."""
  return decode(Transformer(gguf(path), StructureConfig.from_json(cfg_json), max_context=16), TOKENS_EMU, 0)[0]


def base_logits(path: str) -> np.ndarray: return jit_logits(path, StructureConfig().to_json())


@pytest.mark.parametrize("preset,mix", [("tiny", "q4_0"), ("tiny-lite", "q4_0"), ("tiny", "q4_k_m")])
def test_fused_stages_in_the_cpu_emulator(gguf_file, monkeypatch, preset: str, mix: str) -> None:
  """All four stages fused on native kernels, run by the CUDA emulator: decode logits equal the baseline's within the
  fp16 bound (the baseline's fp16 KV cache; tests/knobcheck.py), the top token kept where the lead is decisive."""
  path = gguf_file(preset, mix)
  base = base_logits(path)
  with native_on_cpu(monkeypatch): got = eager_logits(path, StructureConfig.from_dict(ALL_NATIVE))
  assert_close("all stages native", got, base, 2e-2)


def test_all_heads_attention_in_the_cpu_emulator(gguf_file, monkeypatch) -> None:
  """attn_layout=all_heads on native (the tensor-core attention over all heads, run by the CUDA emulator): decode
  logits equal the baseline's within the fp16 bound."""
  path = gguf_file("tiny", "q4_0")
  base = base_logits(path)
  cfg = StructureConfig.from_dict(ALL_NATIVE | {"attn_layout": "all_heads"})
  assert any(k.name.startswith("native_mla_attention_heads_h4_") for k in model_kernels(path, cfg, monkeypatch))
  monkeypatch.undo()
  with native_on_cpu(monkeypatch): got = eager_logits(path, cfg)
  assert_close("all stages native, all-heads attention", got, base, 2e-2)


@pytest.mark.parametrize("mix,quant", [("q4_0", "Q4_0"), ("q4_k_m", "Q4_K")])
def test_the_embedding_is_its_backends_in_the_cpu_emulator(gguf_file, monkeypatch, mix: str, quant: str) -> None:
  """The embedding lookup is the token table's backend's (registry.rows): with its type's dense products on the native
  backend a decode step looks the token up in one native kernel (cuda_src.rows), and the output head folds the final
  norm into its product where it is of that type too (the q4_0 mix: Backend.norm_linear, cuda_src.head); run by the
  CUDA emulator the logits equal the baseline's within the fp16 bound."""
  path, cfg = gguf_file("tiny", mix), StructureConfig(backends={f"{quant}:dense": "native"})
  names = [k.name for k in model_kernels(path, cfg, monkeypatch)]
  assert any(n.startswith(f"native_rows_{quant.lower()}_") for n in names), names
  assert any(n.startswith(f"native_dense_norm_{quant.lower()}x1024x") for n in names) == (mix == "q4_0"), names
  monkeypatch.undo()
  base = base_logits(path)
  with native_on_cpu(monkeypatch): got = eager_logits(path, cfg)
  assert_close("native dense products and embedding", got, base, 2e-2)


@pytest.mark.parametrize("mix", ["q4_0", "q8_0", "q4_k_m"])
def test_q8_activations_in_the_cpu_emulator(gguf_file, monkeypatch, mix: str) -> None:
  """ffn_act=q8 on the fused FFN stages, native (emulated) and dsl, in a model: decode logits near the baseline's and
  its top token where decisive. 8-bit activations are llama.cpp's arithmetic, not a float reordering: on this 3-block
  file they move the logits by up to 5.2e-2 of their std (free routing), so the bound is twice the gate's FP16_TOL; the
  exact check of the arithmetic is the kernel test above."""
  path = gguf_file("tiny", mix)
  base = base_logits(path)
  cfg = lambda b: StructureConfig(fused={"moe": b, "ffn": b}, ffn_act="q8")
  with native_on_cpu(monkeypatch): assert_close("native, q8", eager_logits(path, cfg("native")), base, 2 * FP16_TOL)
  assert_close("dsl, q8", jit_logits(path, cfg("dsl").to_json()), base, 2 * FP16_TOL)


@pytest.mark.parametrize("mix", ["q4_0", "q8_0", "q4_k_m"])
def test_x16_activations_in_the_cpu_emulator(gguf_file, monkeypatch, mix: str) -> None:
  """ffn_act=x16 on the fused FFN stages, native (emulated) and dsl (x16_round), in a model: decode logits within the
  float tolerance of the baseline's (the gate checks x16 configs against the baseline at FP32_TOL), where q8 moves them
  ten times as far (test above). x16 is offered where a device-specific backend runs the FFN."""
  path = gguf_file("tiny", mix)
  base = base_logits(path)
  cfg = lambda b: StructureConfig(fused={"moe": b, "ffn": b}, ffn_act="x16")
  with native_on_cpu(monkeypatch): assert_close("native, x16", eager_logits(path, cfg("native")), base, FP32_TOL)
  assert_close("dsl, x16", jit_logits(path, cfg("dsl").to_json()), base, FP32_TOL)
  acts = lambda dev: next(k for k in knobs(mix_info(mix), dev) if k.name == "ffn_act").choices
  assert acts("CUDA") == ("float32", "q8", "x16") and acts("CPU") == acts("METAL") == ("float32", "q8")


@pytest.mark.parametrize("preset", ["tiny", "tiny-lite"])
def test_stamped_kernels_compute_the_same_and_stamp_in_order(gguf_file, monkeypatch, preset: str) -> None:
  """The step timeline's build of every native kernel of a decode step with all stages native (cuda_src.stamped: what
  model/profile.py step_timeline launches), run in the emulator beside the kernel itself on the same inputs, writes the
  same outputs and stamps its launch's 4 words in order: first entry <= first return from GRID_WAIT <= last return <=
  last exit, none left zero."""
  import native_cpu
  path, checked = gguf_file(preset, "q4_0"), set()
  def both(k: cuda_src.Kernel, params: list[Tensor], mem: int, ops: int = 0) -> list[Tensor]:
    if k.name not in checked:
      arrays = [np.ascontiguousarray(p.numpy()) for p in params]
      views = lambda arrs: [a.view(native_cpu._VIEW.get(a.dtype, a.dtype)) for a in arrs]
      plain, stamp, slot = [a.copy() for a in arrays], [a.copy() for a in arrays], np.zeros(4, np.uint64)
      launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), views(plain))
      launch_kernel(cuda_src.stamped(k.src), k.name, k.grid, (k.threads, 1, 1), views(stamp) + [slot])
      for i in k.outs: np.testing.assert_allclose(stamp[i], plain[i], rtol=1e-6, atol=1e-7, err_msg=k.name)
      entry, wait0, wait1, end = ~slot[0], ~slot[1], slot[2], slot[3]
      assert 0 < entry <= wait0 <= wait1 <= end and slot.all(), (k.name, slot)
      checked.add(k.name)
    return native_cpu.launch(k, params, mem, ops)
  with native_on_cpu(monkeypatch):
    monkeypatch.setattr(native, "launch", both)
    m = Transformer(gguf(path), StructureConfig.from_dict(ALL_NATIVE | {"ffn_act": "q8"}), max_context=16)
    for i in range(2): m.forward(Tensor([[7 + i]], dtype=dtypes.int32), i)
  assert {n.split("_")[1] for n in checked} >= {"dense", "mla", "router", "glu", "down"}, checked


def test_fused_stages_leave_no_per_op_kernel_in_a_block(gguf_file, tmp_path, monkeypatch) -> None:
  """With all four stages native, a decode step's blocks run native kernels only: 8 per dense block, 9 per MoE block,
  and the step's own few kernels are the same at any depth: the position, the token read from the sequence buffer, its
  embedding row (native), the head with the final norm folded in (native), the greedy argmax's two reductions and the
  next token's write into the sequence buffer
  (counted in the JIT's captured graph on the CPU device, whatever the default device, the native kernels standing in
  as custom kernels that compute nothing)."""
  from native_cpu import launch_nothing

  from model.generate import jit_kernels
  from model.synth import write_synthetic
  monkeypatch.setattr(native, "launch", launch_nothing)
  monkeypatch.setattr(native.NativeBackend, "check", lambda self, device: None)
  monkeypatch.setattr(native, "sm_count", lambda device: 132)
  cfg = StructureConfig.from_dict({**ALL_NATIVE, "backends": {"Q4_0:dense": "native"}})
  counts = {}
  for path, dense, moe in ((gguf_file("tiny", "q4_0"), 1, 2),
                           (write_synthetic(tmp_path / "deep5.gguf", "tiny-deep", layers=5), 2, 3)):
    gen = Generator(Transformer(GGUFFile(path), cfg, max_context=16, device="CPU"))
    for i in range(3): gen.step(1, i)
    names = [n for n, _ in jit_kernels(gen.step_jit)]
    # all but the embedding and the head
    per_block = [n for n in names if n.startswith("native_") and not n.startswith(("native_dense_norm_q4_0x1024x",
                                                                                    "native_rows_q4_0_1024_"))]
    assert len(per_block) == 8 * dense + 9 * moe, names
    counts[path] = len(names) - len(per_block)
  assert len(set(counts.values())) == 1 and next(iter(counts.values())) == 7, counts
