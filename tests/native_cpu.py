"""The native backend on the CPU, for tests: its kernels run in the CUDA emulator (tests/cuda_cpu.py) in place of
tinygrad's CUDA device, so the backend's Python side (parameters, shapes, grids, scratch buffers) and its kernels run in
a model on a machine without a GPU. Eager only: each launch realizes its inputs (no TinyJit around it)."""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import cuda_cpu
import numpy as np
from knobcheck import gguf
from tinygrad import Tensor, dtypes

from model.backends import cuda_src, native
from model.backends.catalog import STAGES
from model.deepseek2 import Transformer
from model.quants import LAYOUTS
from model.structure import StructureConfig

_VIEW = {np.dtype(np.float16): np.uint16}  # fp16 buffers are `unsigned short*` in the kernels
_PLANES = tuple(f"_{p}" for p in sorted({p for layout in LAYOUTS.values() for p in layout}))


def guarded(src: str) -> tuple[int, ...]:
  """The parameters of a native kernel that it may touch only after GRID_WAIT: every one but its weights' planes
  (cuda_src.W params, `<prefix><plane>`), whose reads go out before it, and cuda_src.EARLY. None for a kernel that does
  not wait."""
  if cuda_src.WAIT not in src: return ()
  sig = re.search(r"__global__ void __launch_bounds__\([\d, ]+\) \w+\((.*?)(?: STAMP_PARAM)?\) \{", src, re.S)
  params = sig.group(1).split(", ")
  return tuple(i for i, p in enumerate(params)
               if not p.split()[-1].endswith(_PLANES) and p.split()[-1] not in cuda_src.EARLY)


def launch_kernel(src: str, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
                  **kw) -> None:
  """cuda_cpu.launch with the kernel's `guarded` arguments guarded: one it touches before its GRID_WAIT faults."""
  cuda_cpu.launch(src, name, grid, block, args, guard=guarded(src), **kw)


def launch(k: cuda_src.Kernel, params: list[Tensor], mem: int, ops: int = 0) -> list[Tensor]:
  arrays = [np.ascontiguousarray(p.numpy()) for p in params]
  views = [a.view(_VIEW.get(a.dtype, a.dtype)) for a in arrays]
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), views)
  out = []
  for i, (p, a) in enumerate(zip(params, arrays, strict=True)):
    if i in k.outs:
      p.assign(Tensor(a.reshape(p.shape), dtype=p.dtype, device=p.device)).realize()
    out.append(p)
  return out


@contextlib.contextmanager
def native_on_cpu(monkeypatch) -> Iterator[None]:
  """Within: the native backend accepts the CPU device and runs its kernels in the emulator."""
  monkeypatch.setattr(native, "launch", launch)
  monkeypatch.setattr(native.NativeBackend, "check", lambda self, device: None)
  # an H100's: the emulator runs the kernels a GPU of that size would
  monkeypatch.setattr(native, "sm_count", lambda device: 132)
  yield


ALL_NATIVE = {"fused": dict.fromkeys(STAGES, "native")}


def model_kernels(path: str, cfg: StructureConfig, monkeypatch, positions: int = 1) -> list[cuda_src.Kernel]:
  """The native kernels one eager decode step of a model builds (recorded, not run: the CPU stands in for the GPU)."""
  seen: list[cuda_src.Kernel] = []
  def record(k, params, mem, ops=0):
    seen.append(k)
    return params
  monkeypatch.setattr(native, "launch", record)
  monkeypatch.setattr(native.NativeBackend, "check", lambda self, device: None)
  monkeypatch.setattr(native, "sm_count", lambda device: 132)
  m = Transformer(gguf(path), cfg, max_context=64)
  for i in range(positions): m.forward(Tensor([[1]], dtype=dtypes.int32), i)
  return list({k.name: k for k in seen}.values())


# 10 positions: the attention's splits of 8 (context 16) both hold some
TOKENS_EMU = tuple((7919 * i + 17) % 1000 for i in range(10))


def launch_nothing(k: cuda_src.Kernel, params: list[Tensor], mem: int, ops: int = 0) -> list[Tensor]:
  """A stand-in for native.launch that keeps the graph's structure (one custom kernel with the same inputs and outputs,
  named after the native one) but computes nothing (its outputs are zeroed): for counting a JIT step's kernels on the
  CPU."""
  from tinygrad.uop.ops import KernelInfo, UOp
  def fxn(*ps: UOp) -> UOp:
    stores = []
    for i in k.outs:
      p = ps[i].reshape(-1) if len(ps[i].shape) != 1 else ps[i]
      r = UOp.range(p.shape[0], i)
      stores.append(p[r].store(p[r].const_like(0)).end(r))
    return UOp.sink(*stores, arg=KernelInfo(name=k.name))
  return params[0].custom_kernel(*params[1:], fxn=fxn)
