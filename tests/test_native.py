"""The native backend (model/native.py). Where it runs (tinygrad's CUDA device: DEV=CUDA on an NVIDIA GPU): each kernel
computes the tensor backend's product, at small shapes and at GLM-4.7-Flash's widths, and every native knob value passes
tests/knobcheck.py's proof on the tiny preset and on the 2-layer GLM-4.7-Flash file in each quant mix; the JIT batch
size of a CUDA study changes the decode step's graphs, and the BEAM limits its kernels. Everywhere: the space offers native only on
CUDA, and a model asked to build it elsewhere refuses with a message.
"""
from __future__ import annotations

import os
import platform
import sys

import pytest
from knobcheck import check_knob, check_process_setting, gguf, mix_info
from products import TYPES, check_products
from tinygrad.uop.ops import Ops

from model.backends import native
from model.deepseek2 import Transformer
from model.generate import Generator, jit_kernels
from model.gguf_file import GGUFFile
from model.structure import ConfigError, StructureConfig
from space.knobs import ModelInfo, knobs, single_knob_changes

needs_cuda = pytest.mark.skipif(not native.available(), reason="native kernels run on tinygrad's CUDA device: DEV=CUDA on an NVIDIA GPU")
TOKENS = tuple((7919 * i + 17) % 1000 for i in range(16))
MIXES = ("q4_0", "q8_0", "q4_k_m", "f16")  # every type the issue names: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (q4_k_m) and F16


def native_changes(info: ModelInfo) -> list[tuple[str, StructureConfig]]:
  return [(label, cfg) for label, cfg in single_knob_changes(info, "CUDA") if label.endswith("=native")]


def test_space_offers_native_only_on_cuda() -> None:
  info = mix_info("q4_k_m")
  for device, offered in (("CPU", False), ("METAL", False), ("CUDA", True), ("CUDA:1", True)):
    domains = [k.choices for k in knobs(info, device) if k.name.startswith("backend.")]
    assert domains and all(("native" in c) == offered for c in domains), device
  assert native.BACKEND.quants >= {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16"}


def nvrtc(arch: str):
  """tinygrad's NVRTC compiler for `arch`, from the system's CUDA or the nvidia-cuda-nvrtc-cu12 wheel (tests/conftest.py)."""
  try:
    from tinygrad.runtime.support.compiler_cuda import NVRTCCompiler
    return NVRTCCompiler(arch)
  except Exception as e:  # noqa: BLE001 - no NVRTC here: what is missing is reported
    why = f"NVRTC is not available ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc-cu12"
    if os.environ.get("CI") and sys.platform == "linux" and platform.machine() == "x86_64": pytest.fail(why + " (a dev dependency here)")
    pytest.skip(why)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_native_sources_compile_for_ampere_and_hopper(arch: str) -> None:
  """Every native kernel (each type, each role, decode and prefill tiles) compiles with NVIDIA's runtime compiler, as
  tinygrad compiles it on the GPU; this runs on any Linux machine, the GPU tests below only where CUDA is."""
  compiler = nvrtc(arch)
  for name, t in TYPES.items():
    if name not in native.BACKEND.quants: continue
    for role, shape, dims in (("dense", (1536, 2048), {"tn": 8, "n": 13}), ("dense", (1536, 2048), {"tn": 1, "n": 1}),
                              ("per_head", (20, 512, 256), {"tn": 8, "n": 11, "heads": 20}),
                              ("expert", (64, 1536, 2048), {"experts": 64, "xk": 1, "k": 4}),
                              ("expert", (64, 2048, 1536), {"experts": 64, "xk": 4, "k": 4})):
      fname, src = native.source(role, t, shape, **dims)
      assert f"void __launch_bounds__(128) {fname}(" in src
      assert compiler.compile(src), f"{name} {role}"


@pytest.mark.skipif(native.available(), reason="checks the refusal where native cannot run")
def test_model_refuses_native_where_it_cannot_run(gguf_file) -> None:
  with pytest.raises(ConfigError, match="backend native needs tinygrad's CUDA device"):
    Transformer(GGUFFile(gguf_file("tiny", "q4_0")), StructureConfig(backends={"Q4_0:dense": "native"}), max_context=16)


@needs_cuda
@pytest.mark.parametrize("quant", sorted(native.BACKEND.quants))
@pytest.mark.parametrize("shape", ["small", "glm"])
def test_products_equal_the_tensor_backend(quant: str, shape: str) -> None:
  check_products("native", quant, shape)


@needs_cuda
@pytest.mark.parametrize("mix", ["q4_0", "q4_k_m"])
def test_decode_runs_native_kernels_in_the_graph(gguf_file, mix: str) -> None:
  """All weights on native: every product of the decode step is a native kernel, batched into the JIT's CUDA graph."""
  path = gguf_file("tiny", mix)
  info = ModelInfo.from_gguf(GGUFFile(path))
  cfg = StructureConfig(backends={f"{q}:{role}": "native" for role, qs in info.quants.items() for q in qs})
  gen = Generator(Transformer(GGUFFile(path), cfg, max_context=32), chunk=4)
  gen.prefill(list(TOKENS[:4]))
  for i in range(3): gen.step(1, 4 + i)
  names = [n for n, _ in jit_kernels(gen.step_jit)]
  n_moe = sum(n.endswith(".ffn_gate_exps.weight") for n in GGUFFile(path).tensors)
  assert sum(n.startswith("native_expert_") for n in names) == 3 * n_moe and any(n.startswith("native_dense_") for n in names)
  assert not any(c.src[0].op is Ops.PROGRAM for c in gen.step_jit.captured.linear.src), "a kernel runs outside the JIT's graphs"


@needs_cuda
@pytest.mark.parametrize("mix,label", [(m, lbl) for m in MIXES for lbl, _ in native_changes(mix_info(m))])
def test_tiny_native_knob(gguf_file, mix: str, label: str) -> None:
  path = gguf_file("tiny", mix)
  check_knob(path, label, dict(native_changes(ModelInfo.from_gguf(GGUFFile(path))))[label], TOKENS)


@needs_cuda
@pytest.mark.parametrize("mix", MIXES)
def test_glm_native_knobs(glm_file, mix: str) -> None:
  path = glm_file(mix)
  for label, cfg in native_changes(ModelInfo.from_gguf(gguf(path))):
    check_knob(path, label, cfg, TOKENS[:8], steps=2)


CUDA_SETTINGS = [(lbl, cfg) for lbl, cfg in single_knob_changes(mix_info("q4_0"), "CUDA") if lbl.startswith(("jit_batch_size", "beam_"))]


@needs_cuda
@pytest.mark.parametrize("label", [lbl for lbl, _ in CUDA_SETTINGS])
def test_cuda_process_setting_changes_the_decode_step(gguf_file, label: str) -> None:
  """The JIT batch size at BEAM=0; the BEAM limits at BEAM=2, against the baseline at BEAM=2 (minutes of search each)."""
  check_process_setting(gguf_file("tiny", "q4_0"), label, dict(CUDA_SETTINGS)[label], TOKENS)
