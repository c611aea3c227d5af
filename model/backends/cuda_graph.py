"""tinygrad's CUDA graph with programmatic dependent launch into the native kernels.

In a CUDA graph a kernel starts only once the kernels it depends on have finished: between a decode step's hundreds of
dependent launches the GPU idles, and each kernel's first weight reads wait for its launch. Every native kernel
(model/backends/cuda_src.py) calls GRID_WAIT (griddepcontrol.wait, then launch_dependents) before it touches a buffer
an earlier kernel writes; the reads of weights whose rows are fixed go out before it. So the edges into a native kernel
from the kernels it depends on can be programmatic: it launches as soon as every block of those kernels has passed its
own wait, issues its weight reads while they finish, and waits for their results (completed and flushed) at GRID_WAIT.
Edges into tinygrad's own kernels, and from or to copies, stay full (docs/benchmarks.md measures the decode step with
and without).
"""
from __future__ import annotations

import ctypes

import tinygrad.runtime.autogen.cuda as cuda
from tinygrad import Device
from tinygrad.runtime.graph.cuda import CUDAGraph
from tinygrad.runtime.ops_cuda import check
from tinygrad.runtime.support.c import init_c_var
from tinygrad.uop.ops import Ops, UOp

from model.backends.cuda_src import WAIT


class EdgeData(ctypes.Structure):
  """CUDA's CUgraphEdgeData (12.3+)."""
  _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
              ("reserved", ctypes.c_ubyte * 5)]


PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC from CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC


def waits(ast: UOp) -> bool:
  """Whether a graph call is a kernel whose source waits for its dependencies itself."""
  return ast.op is Ops.PROGRAM and WAIT in ast.src[2].arg


def _ptr(node) -> int | None: return ctypes.cast(node, ctypes.c_void_p).value


def make_programmatic(graph, pairs: list[tuple]) -> None:
  """Turn the full edges (from node, to node) of a CUDA graph not yet instantiated into programmatic ones."""
  frm, to = ((cuda.CUgraphNode * len(pairs))(*(p[i] for p in pairs)) for i in (0, 1))
  data = (EdgeData * len(pairs))(*(EdgeData(PROGRAMMATIC, 0, PROGRAMMATIC) for _ in pairs))
  check(cuda.dll.cuGraphRemoveDependencies_v2(graph, frm, to, None, ctypes.c_size_t(len(pairs))))
  check(cuda.dll.cuGraphAddDependencies_v2(graph, frm, to, data, ctypes.c_size_t(len(pairs))))


class OverlapGraph(CUDAGraph):
  """CUDAGraph whose kernel-to-kernel edges into waiting kernels (`waits`) are programmatic."""
  def __init__(self, linear, input_uops=()):
    self.edges: list[tuple[list, object]] = []  # (dependencies, node) of each node, in tinygrad's order
    super().__init__(linear, input_uops)
    kernels = {_ptr(n) for n, _, _, copy in self.nodes if not copy}
    pairs = [(d, node) for (deps, node), (_, ast, _, _) in zip(self.edges, self.calls, strict=True) if waits(ast)
             for d in deps if _ptr(d) in kernels]
    if not pairs: return
    make_programmatic(self.graph, pairs)
    check(cuda.cuGraphExecDestroy(self.instance))
    self.instance = init_c_var(cuda.CUgraphExec, lambda x: check(cuda.cuGraphInstantiate_v2(ctypes.byref(x), self.graph,
                                                                                            None, None, 0)))

  def new_node(self, bufs, write):
    c_deps, node = super().new_node(bufs, write)
    self.edges.append((list(c_deps) if c_deps else [], node))
    return c_deps, node


def install(device: str) -> bool:
  """Make OverlapGraph the graph of this CUDA device where it supports programmatic launch (compute capability 9.0 and a
  driver with CUDA 12.3's edge API) and graphs are on; -> whether it is."""
  dev = Device[device]
  if dev.graph not in (CUDAGraph, OverlapGraph) or int(dev.arch.removeprefix("sm_")[:2]) < 90: return False
  if not hasattr(cuda.dll, "cuGraphAddDependencies_v2"): return False
  dev.graph = OverlapGraph
  return True
