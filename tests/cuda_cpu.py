"""CUDA C kernels run on the CPU, for tests: `launch(src, name, grid, block, args)` as a GPU would run it.

The source (the exact string tinygrad would compile with NVRTC) is compiled as C++20 by g++ with tests/cuda_cpu.h, which
provides CUDA's built-ins and runs each block's threads as fibers of one OS thread, switched at barriers (see its first
comment for the execution model and what is not emulated). Float code is compiled without contraction or fast-math, so
each thread performs the same float operations in the same order as on a GPU; and unoptimised (x86-64's float operations
are the same scalar IEEE ones at any level), as a kernel is compiled once and run for a few blocks, from a precompiled
header. Libraries are cached by a hash of their source in a temporary directory.

Each launch runs in a forked process, on copies of the arrays in shared memory that end at an inaccessible page: a
kernel that deadlocks is killed after `timeout` seconds (the message says where each thread waits), a read or write past
the end of an array faults and names the argument and the thread, and the caller's process survives both.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HEADER = Path(__file__).with_name("cuda_cpu.h")
FLAGS = ("-std=c++20", "-O0", "-ffp-contract=off", "-fno-strict-aliasing", "-fwrapv", "-fPIC", "-pthread", "-w")
ENTRY = """
extern "C" int cuda_cpu_entry(const unsigned* grid, const unsigned* block, void** args, const int* kinds,
                              const int* sizes, int nargs, cuda_cpu::Report* report, void** guard_addrs,
                              const size_t* guard_lens, int nguards) {{
  return cuda_cpu::launch(&{name}, grid, block, args, kinds, sizes, nargs, report, guard_addrs, guard_lens, nguards);
}}
"""
ALIGN = 16  # the largest vector type's alignment: each array starts at a multiple of it
STATES = ("running", "at __syncthreads", "at a warp call", "exited", "at GRID_WAIT")


class CompileError(RuntimeError):
  """g++ rejected the kernel source."""


class KernelError(RuntimeError):
  """The kernel failed: misuse the emulator detects, a fault, or a deadlock."""


class Report(ctypes.Structure):
  """tests/cuda_cpu.h's cuda_cpu::Report."""
  _fields_ = [("error", ctypes.c_char * 1024), ("signal", ctypes.c_int), ("addr", ctypes.c_ulonglong),
              ("thread", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("nthreads", ctypes.c_int),
              ("state", ctypes.c_int * 1024)]


def available() -> bool:
  return shutil.which("g++") is not None


@functools.cache
def _cache_dir() -> Path:
  path = Path(tempfile.gettempdir()) / f"cuda-cpu-{os.getuid()}"
  path.mkdir(exist_ok=True)
  return path


def _key(*parts: str) -> str:
  version = subprocess.run(["g++", "-dumpfullversion"], capture_output=True, text=True, check=True).stdout
  return hashlib.sha256("\0".join((HEADER.read_text(), version, *FLAGS, *parts)).encode()).hexdigest()[:32]


def _gxx(out: Path, args: list[str], what: str, code: str | None = None) -> Path:
  """out, built by g++ (into a temporary file first: processes and threads may build it at once)."""
  if not out.exists():
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    r = subprocess.run(["g++", *FLAGS, *args, "-o", str(tmp)], input=code, capture_output=True, text=True)
    if r.returncode: raise CompileError(f"g++ cannot compile {what}:\n" + "\n".join(r.stderr.splitlines()[:25]))
    os.replace(tmp, out)
  return out


@functools.cache
def _pch_dir() -> Path:
  """A directory holding only the header, precompiled: searched before the header's own, so each kernel's compile
  reads it in place of parsing the header (g++ falls back to the header where it does not match)."""
  (d := _cache_dir() / f"pch-{_key()}").mkdir(exist_ok=True)
  return _gxx(d / f"{HEADER.name}.gch", ["-x", "c++-header", str(HEADER)], HEADER.name).parent


@functools.cache
def _entry(src: str, name: str):
  """The compiled kernel's entry point (compiled once per source; the library is reused across processes)."""
  if not available(): raise CompileError("g++ is not installed (`make deps` installs it)")
  code = f'#include "cuda_cpu.h"\n#line 1 "{name}.cu"\n{src}\n{ENTRY.format(name=name)}'
  lib = _gxx(_cache_dir() / f"{_key(code)}.so", ["-shared", "-I", str(_pch_dir()), "-I", str(HEADER.parent), "-x",
                                                 "c++", "-"], name, code)
  fn = ctypes.CDLL(str(lib)).cuda_cpu_entry
  fn.restype = ctypes.c_int
  return fn


class _Array:
  """A copy of an array argument in memory the kernel's process shares, ending ALIGN-aligned at an inaccessible page."""
  def __init__(self, a: np.ndarray):
    self.a, self.nbytes = a, a.nbytes
    span = -(-max(a.nbytes, 1) // ALIGN) * ALIGN
    size = -(-span // mmap.PAGESIZE) * mmap.PAGESIZE
    self.mem = mmap.mmap(-1, size + mmap.PAGESIZE)
    raw = np.frombuffer(self.mem, np.uint8)
    self.guard = raw.ctypes.data + size
    if _libc().mprotect(ctypes.c_void_p(self.guard), ctypes.c_size_t(mmap.PAGESIZE), 0):
      raise OSError(ctypes.get_errno(), "mprotect failed")
    self.view = raw[size - span:size - span + a.nbytes].view(a.dtype).reshape(a.shape)
    self.pages = (self.guard - size, size)  # the pages holding the array
    self.addr = self.guard - span
    np.copyto(self.view, a)

  def copy_back(self) -> None:
    if self.view.tobytes() != self.a.tobytes(): np.copyto(self.a, self.view)


@functools.cache
def _libc() -> ctypes.CDLL: return ctypes.CDLL(None, use_errno=True)


def _arg(i: int, a) -> tuple[int, int, int, object]:
  """(kind, item size, address, owner) of argument i as tests/cuda_cpu.h's check_arg takes it: kind 0 an array (the
  address of its copy, the _Array owning it), 1 a signed, 2 an unsigned integer, 3 a float (the address of its
  value)."""
  if isinstance(a, np.ndarray): return 0, a.itemsize, (copy := _Array(a)).addr, copy
  if not isinstance(a, np.integer | np.floating):
    raise TypeError(f"argument {i}: pass arrays and numpy scalars (np.int32, np.uint32, np.float32, ...) so the C type "
                    f"is explicit, got {a!r}")
  value = ctypes.create_string_buffer(a.tobytes(), a.itemsize)
  return (1 if isinstance(a, np.signedinteger) else 2 if isinstance(a, np.unsignedinteger)
          else 3, a.itemsize, ctypes.addressof(value), value)


def _where(rep: Report) -> str:
  """Each thread's state in the running block, in runs: 'thread 0 at __syncthreads; threads 1-31 at a warp call;
  ...'."""
  runs: list[list[int]] = []
  for t in range(rep.nthreads):
    if runs and rep.state[t] == rep.state[runs[-1][0]]: runs[-1][1] = t
    else: runs.append([t, t])
  return "; ".join((f"thread {a}" if a == b else f"threads {a}-{b}") + f" {STATES[rep.state[a]]}" for a, b in runs)


def _fault(rep: Report, arrays: dict[int, _Array], guard: tuple[int, ...]) -> str:
  if rep.signal == signal.SIGABRT: return "SIGABRT (an abort, or a failed assert)"
  where = next((f" ({rep.addr - (b.addr + b.nbytes)} bytes past the end of argument {i}, {b.nbytes} bytes)"
                for i, b in arrays.items() if b.addr + b.nbytes <= rep.addr < b.guard + mmap.PAGESIZE), "")
  where = where or next((f" (argument {i}, which it may touch only after GRID_WAIT)" for i in guard
                         if arrays[i].pages[0] <= rep.addr < arrays[i].guard), "")
  return f"{signal.Signals(rep.signal).name} at address {rep.addr:#x}{where}"


def launch(src: str, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
           timeout: float = 60.0, guard: tuple[int, ...] = ()) -> None:
  """Run kernel `name` of CUDA C source `src` on `grid` blocks of `block` threads. args: numpy arrays (passed as
  pointers to C-contiguous copies; what the kernel writes is copied back) and numpy scalars (passed by value as their
  exact C type). guard: the indices of array args that earlier kernels write, which a block may read or write only
  after all its threads have called GRID_WAIT (or exited)."""
  fn = _entry(src, name)
  if len(grid) != 3 or len(block) != 3 or min(*grid, *block) < 1:
    raise ValueError(f"grid {grid} and block {block}: three positive sizes each")
  parsed = [_arg(i, a) for i, a in enumerate(args)]
  kinds, sizes, argv = ((t * len(args))(*(p[k] for p in parsed))
                        for k, t in enumerate((ctypes.c_int, ctypes.c_int, ctypes.c_void_p)))
  arrays = {i: p[3] for i, p in enumerate(parsed) if p[0] == 0}
  if any(i not in arrays for i in guard): raise ValueError(f"guard {guard}: indices of array arguments")
  gaddrs, glens = (ctypes.c_void_p * len(guard))(*(arrays[i].pages[0] for i in guard)), (
    ctypes.c_size_t * len(guard))(*(arrays[i].pages[1] for i in guard))
  rep_mem = mmap.mmap(-1, ctypes.sizeof(Report))
  rep = Report.from_buffer(rep_mem)
  dims = [(ctypes.c_uint * 3)(*d) for d in (grid, block)]
  if (pid := os.fork()) == 0:
    rc = 70
    try: rc = fn(*dims, argv, kinds, sizes, len(args), ctypes.byref(rep), gaddrs, glens, len(guard))
    finally: os._exit(rc)
  deadline, delay = time.monotonic() + timeout, 1e-4
  while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      raise KernelError(f"{name} did not finish in {timeout:g} s (a deadlock?); in block {tuple(rep.block)}: "
                        f"{_where(rep)}")
    time.sleep(delay)
    delay = min(2 * delay, 0.02)
  at = f" in thread {tuple(rep.thread)} of block {tuple(rep.block)}" if rep.nthreads else ""
  if rep.signal: raise KernelError(f"{name}: {_fault(rep, arrays, guard)}{at}")
  if rep.error: raise KernelError(f"{name}: {rep.error.decode()}{at}")
  if code := os.waitstatus_to_exitcode(done[1]):
    raise KernelError(f"{name}: the kernel's process ended with " + (
      f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"))
  for a in arrays.values(): a.copy_back()
