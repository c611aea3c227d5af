"""Test-only faults and fakes, injected from the outside: production code carries no hook for them.

- Faults of the trial process ($STRUCTSEARCH_FAULT): `crash`, `compile_error`, `hang`, `sigkill` and `sigterm` (killed
  from outside), `device_oom_kill` (the device says it is out of memory, then the process is killed) act on the first
  decode step; `check_crash` raises on the first step of the check path (making a reference, or the check);
  `broken_argmax_topk` makes the `argmax` top-k variant pick the wrong experts (a knob that computes the
  wrong output); `scale_off_one_block` makes the routed down projection of the middle MoE block read each row's first
  block scale from its second block (a dequantization bug in one layer, whatever backend computes it);
  `dropped_residual_one_block` drops the attention residual of the middle block (in the per-op attention path and in
  every fused attention stage); `attention_split_dropped` makes the per-op attention give no weight to the cache
  positions 64..127 (a split of the context past position 64 dropped: right at a shallow context, wrong at depth).
  They patch model code as it is imported, so the trial process is the production one up
  to the fault. A fault of a `search` process: `slow_study_creation` (2 s between finding no study and creating it).
- Fake trials ($STRUCTSEARCH_FAKE_TRIALS, JSON: {"seconds": S, "proxy": "predicts" | "random", "status": STATUS})
  replace the evaluator's trial process in a `search` process: no tinygrad, a tok/s that is a fixed function of the
  config (its block-proxy figure three times that, or unrelated to it), under the real device lock. Search-level
  behaviour (workers, kills, resumes, the ladder) is then tested in seconds.
"""
from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import inspect
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import ModuleType


class AfterImport(importlib.abc.MetaPathFinder):
  """Applies patch(module) right after the named module is first executed."""

  def __init__(self, patches: dict[str, Callable[[ModuleType], None]]): self.patches = patches

  def find_spec(self, name, path, target=None):
    if name not in self.patches: return None
    sys.meta_path.remove(self)
    try: spec = importlib.util.find_spec(name)
    finally: sys.meta_path.insert(0, self)
    if spec is None or spec.loader is None: return spec
    run, patch = spec.loader.exec_module, self.patches.pop(name)
    def exec_module(module: ModuleType) -> None:
      run(module)
      patch(module)
    spec.loader.exec_module = exec_module
    return spec


def _on_first_step(act: Callable[[], None], method: str = "step") -> Callable[[ModuleType], None]:
  def patch(m: ModuleType) -> None:
    step = getattr(m.Generator, method)
    def faulty(self, *args, **kwargs):
      act()
      return step(self, *args, **kwargs)
    setattr(m.Generator, method, faulty)
  return patch


def _raise(e: BaseException) -> Callable[[], None]:
  def act() -> None: raise e
  return act


def _compile_error() -> None:
  from tinygrad.device import CompileError
  raise CompileError("injected compile error")


def _kill(message: str = "", sig: int = signal.SIGKILL) -> Callable[[], None]:
  def act() -> None:
    if message: print(message, flush=True)
    os.kill(os.getpid(), sig)
  return act


def _slow_study_creation(m: ModuleType) -> None:
  """`search start` takes 2 s from finding no study to creating it: two started together both set out to create it."""
  sha = m.file_sha256
  def slow(path):
    time.sleep(2)
    return sha(path)
  m.file_sha256 = slow


def _broken_argmax(m: ModuleType) -> None:
  right = m.topk_indices
  m.topk_indices = lambda scores, k, variant: right(-scores if variant == "argmax" else scores, k, variant)


def _middle(transformer) -> int:
  hp = transformer.hp
  return hp.n_dense_lead + (len(transformer.blocks) - hp.n_dense_lead) // 2


def _scale_off(m: ModuleType) -> None:
  init = m.Transformer.__init__
  def faulty(self, *args, **kwargs) -> None:
    init(self, *args, **kwargs)
    w = self.blocks[_middle(self)].down_exps
    d = w.planes["d"].numpy().copy()
    d[:, 0] = d[:, 1]
    w.planes["d"].assign(m.Tensor(d, device=w.planes["d"].device)).realize()
  m.Transformer.__init__ = faulty


def _dropped_residual(m: ModuleType) -> None:
  """The middle block's attention stage returns its attention output without the residual x: in the per-op path
  (Block.attention, whose output __call__ adds to x) and in every fused attention stage (which adds x itself). Patched
  into every block, acting where a block's marker (per-block data, 1 in the middle block) is set."""
  call, attention, running = m.Block.__call__, m.Block.attention, {}
  def keep_x(self, x, *args, **kwargs):
    self._x, running["block"] = x, self
    return call(self, x, *args, **kwargs)
  def faulty(self, xn, start_pos, pos):
    return attention(self, xn, start_pos, pos) - self._x * self._faulty.reshape(1, 1, 1)
  def fused(stage):  # a backend's stage receives the stage's inputs, not the block: the block running it has the marker
    def faulty_stage(backend, st, x, *args):  # the stage as the class holds it: a method or a static function
      got = stage.__get__(backend, type(backend))(st, x, *args)
      return got - x * running["block"]._faulty.reshape(1, 1, 1).cast(x.dtype)
    return faulty_stage
  for b in {type(m.K.get(n)) for n in m.catalog.names() if "attention" in m.catalog.get(n).stages}:
    b.attention = fused(inspect.getattr_static(b, "attention"))
  init = m.Transformer.__init__
  def mark(self, *args, **kwargs) -> None:
    init(self, *args, **kwargs)
    for b in self.blocks: b._faulty = m.Tensor([float(b.i == _middle(self))], device=b.kv.planes[0].device).realize()
  m.Block.__call__, m.Block.attention, m.Transformer.__init__ = keep_x, faulty, mark


DROPPED = (64, 128)  # the cache positions attention_split_dropped leaves out


def _split_dropped(m: ModuleType) -> None:
  """Block.attend's softmax over the cache positions (its last axis: start_pos + T of them, a symbolic length) adds
  -inf at DROPPED: each block's row of the cache's length, shrunk to the positions attended, as the cache is."""
  attend, softmax, init = m.Block.attend, m.Tensor.softmax, m.Transformer.__init__
  def faulty(self, q_abs, q_pe, kv, start_pos, pos):
    m.Tensor.softmax = lambda x, *a, **kw: softmax(x + self._drop[:x.shape[-1]].cast(x.dtype), *a, **kw)
    try: return attend(self, q_abs, q_pe, kv, start_pos, pos)
    finally: m.Tensor.softmax = softmax
  def mark(self, *args, **kwargs) -> None:
    init(self, *args, **kwargs)
    drop = m.np.zeros(self.max_context, m.np.float32)
    drop[DROPPED[0]:DROPPED[1]] = -m.np.inf
    for b in self.blocks: b._drop = m.Tensor(drop, device=b.kv.planes[0].device).realize()
  m.Block.attend, m.Transformer.__init__ = faulty, mark


FAULTS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
  "crash": ("model.generate", _on_first_step(_raise(RuntimeError("injected crash")))),
  "compile_error": ("model.generate", _on_first_step(_compile_error)),
  "check_crash": ("model.generate", _on_first_step(_raise(RuntimeError("injected crash in the check path")),
                                                   "check_step")),
  "hang": ("model.generate", _on_first_step(lambda: time.sleep(3600))),
  "sigkill": ("model.generate", _on_first_step(_kill())),
  "sigterm": ("model.generate", _on_first_step(_kill(sig=signal.SIGTERM))),
  "device_oom_kill": ("model.generate", _on_first_step(_kill("CUDA error: out of memory (injected)"))),
  "broken_argmax_topk": ("model.deepseek2", _broken_argmax),
  "scale_off_one_block": ("model.deepseek2", _scale_off),
  "dropped_residual_one_block": ("model.deepseek2", _dropped_residual),
  "attention_split_dropped": ("model.deepseek2", _split_dropped),
  "slow_study_creation": ("search.study", _slow_study_creation),
}


def fake_tok_s(config: dict, stage: str, proxy: str = "predicts") -> float:
  """The fake figure of a config: full-model tok/s from its hash; the block proxy's 3x that, or from another part of the
  hash."""
  from model.structure import StructureConfig
  h = bytes.fromhex(StructureConfig.from_dict(config).hash)
  full = 10 + h[0] / 16
  return full if stage == "full" else 3 * full if proxy == "predicts" else 10 + h[1] / 16


def fake_run_process(seconds: float = 0.0, proxy: str = "predicts", status: str = "ok", proxy_cost: float = 0.1):
  """A stand-in for evaluator.runner.run_process: waits `seconds` (the block stage `proxy_cost` of that), then reports
  fake_tok_s with status `status`. Its wall time is the wait it was given, not the clock's: on a loaded machine a
  millisecond's sleep takes several, and the ladder's cost ratio would follow the load."""
  from evaluator.result import TrialResult
  def run_process(spec, timeout: float, on_phase=None) -> TrialResult:
    t0, wait = time.time(), seconds * (proxy_cost if spec.stage == "block" else 1.0)
    if on_phase: on_phase("measure")
    time.sleep(wait)
    tok_s = fake_tok_s(spec.config, spec.stage, proxy)
    metrics = {"tok_s": tok_s, "tok_s_min": tok_s, "tok_s_max": tok_s, "layers": spec.layers or 0,
               "kernels_per_token": 100, "bytes_per_token": 1_000_000, "peak_device_bytes": 1 << 20,
               "span": [t0, time.time()], "pid": os.getpid()}
    env = {"device": spec.device, "device_name": "fake device", "python": "3", "host": socket.gethostname(),
           "platform": "test"}
    return TrialResult(status, dataclasses.asdict(spec), metrics if status == "ok" else {"span": [t0, time.time()]},
                       {"wall_s": wait}, env=env,
                       error="" if status == "ok" else f"injected {status}")
  return run_process


def install_fake_trials(setattr_: Callable[[object, str, object], None], **settings) -> None:
  """Fake trials in this process (setattr_: pytest's monkeypatch.setattr in-process, plain setattr in a started
  process)."""
  import evaluator.runner as runner
  setattr_(runner, "run_process", fake_run_process(**settings))
  setattr_(runner, "bandwidth", lambda device, remeasure=False, on_wait=None: 100.0)


def install_from_env() -> None:
  patches = {}
  if fault := os.environ.get("STRUCTSEARCH_FAULT"):
    module, patch = FAULTS[fault]
    patches[module] = patch
  if fake := os.environ.get("STRUCTSEARCH_FAKE_TRIALS"):
    settings = json.loads(fake)
    patches["evaluator.runner"] = lambda m: install_fake_trials(setattr, **settings)
  sys.meta_path.insert(0, AfterImport(patches))


def env(fault: str = "", **fake) -> dict[str, str]:
  """The environment of a process the tests start with this directory on its path and these faults or fakes."""
  here = os.path.dirname(os.path.abspath(__file__))
  out = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
  if fault: out["STRUCTSEARCH_FAULT"] = fault
  if fake: out["STRUCTSEARCH_FAKE_TRIALS"] = json.dumps(fake)
  return out
