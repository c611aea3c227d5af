"""The parent side of a trial: spawn the trial process under the device lock, watch its phases, enforce the wall-clock
limit, and turn whatever happened (a result, a crash, a kill) into a classified TrialResult. Also the benchmark ladder
(block proxy, then full model), the per-device bandwidth cache and the per-model reference cache."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from evaluator.lock import DeviceLock
from evaluator.result import TrialResult, TrialSpec
from model.filehash import cached_json, file_sha256
from model.registry import cache_dir
from model.structure import StructureConfig
from model.workload import PROMPT, Memory, Workload

Phase = Callable[[str], None]
# signals only something outside the trial process sends: `killed`, transient
OUTSIDE = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ReferenceFailed(RuntimeError):
  """The baseline config failed to make the correctness reference: no trial of this file, device and depth can be
  checked."""

  def __init__(self, result: TrialResult, what: str = "the baseline config"):
    super().__init__(f"{what} failed to make the reference ({result.status}): {result.error}")
    self.result = result


@functools.cache
def default_device() -> str:
  """tinygrad's default device, asked of a throwaway process (the parent never opens a device)."""
  if os.environ.get("DEV"): return os.environ["DEV"]
  out = subprocess.run([sys.executable, "-c", "from tinygrad import Device; print(Device.DEFAULT)"],
                       capture_output=True, text=True)
  return out.stdout.strip() or "CPU"


def _child_env() -> dict[str, str]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
          "PYTHONUNBUFFERED": "1"}


def run_process(spec: TrialSpec, timeout: float, on_phase: Phase | None = None) -> TrialResult:
  """One trial in a fresh process (no lock: see evaluate). Never raises for anything the trial does."""
  with tempfile.TemporaryDirectory(prefix="structsearch-trial-") as tmp:
    spec_path, out_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "result.json", "log.txt"))
    with open(spec_path, "w") as f: f.write(spec.to_json())
    t0, seen, killed, ooms = time.perf_counter(), "", False, oom_kills()
    with open(log_path, "w") as log:
      proc = subprocess.Popen([sys.executable, "-m", "evaluator.child", spec_path, out_path], stdout=log,
                              stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
      try:
        while not (done := os.wait4(proc.pid, os.WNOHANG))[0]:
          time.sleep(0.05)
          if on_phase and (phase := _phase(out_path)) != seen and phase: on_phase(seen := phase)
          if time.perf_counter() - t0 > timeout and not killed:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
      except BaseException:  # Ctrl-C or the caller's own failure: never leave a benchmark running
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
      _, status, usage = done
      # reaped here, with its resource usage: Popen must not wait again
      proc.returncode = os.waitstatus_to_exitcode(status)
      peak_rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    wall = time.perf_counter() - t0
    res = (TrialResult.from_dict(json.load(open(out_path))) if os.path.exists(out_path)
           else TrialResult("running", spec.__dict__))
    tail = open(log_path, errors="replace").read()[-3000:].strip()
  if killed: res.status, res.error = "timeout", f"no result after {timeout:.0f} s (in phase {res.phase or 'start'})"
  elif res.status == "running":
    rc = proc.returncode
    if rc == -signal.SIGKILL: res.status, res.error = sigkill_verdict(proc.pid, peak_rss, oom_kills() > ooms, tail)
    elif -rc in OUTSIDE:
      res.status, res.error = "killed", f"killed by {_signal_name(rc)} from outside: says nothing about the config"
    else:
      res.status = "runtime_error"
      res.error = (f"trial process died ({_signal_name(rc) if rc < 0 else f'exit code {rc}'}): "
                   + (tail.splitlines() or [""])[-1][-500:])
  if tail and not res.ok: res.metrics.setdefault("log_tail", tail)
  res.metrics.setdefault("host_peak_rss_bytes", peak_rss)
  res.phases["wall_s"] = round(wall, 3)
  res.phases["overhead_s"] = round(wall - sum(v for k, v in res.phases.items() if k not in ("wall_s", "overhead_s")), 3)
  return res


def sigkill_verdict(pid: int, peak_rss: int, cgroup_oom: bool, tail: str) -> tuple[str, str]:
  """Why a trial process died of SIGKILL, from the evidence: the kernel's OOM record (the cgroup's oom_kill count rose
  during the trial, or the kernel log names the process), the process's own memory high-water mark near the memory
  limit, or the device's out-of-memory error in its output. Without any, it was killed from outside: `killed`."""
  limit = memory_limit()
  gb = lambda b: f"{b / 1e9:.1f} GB"
  if cgroup_oom:
    return "oom", ("killed by SIGKILL: the kernel's out-of-memory killer (the cgroup's oom_kill count rose during the "
                   "trial)")
  if f"Killed process {pid} " in _kernel_log():
    return "oom", f"killed by SIGKILL: the kernel's out-of-memory killer (its log names process {pid})"
  if peak_rss >= 0.9 * limit:
    return "oom", f"killed by SIGKILL with {gb(peak_rss)} resident of the {gb(limit)} memory limit: out of memory"
  if "out of memory" in tail.lower():
    return "oom", "killed by SIGKILL after the device ran out of memory: " + tail.splitlines()[-1][-300:]
  return "killed", (f"killed by SIGKILL from outside (no sign of running out of memory: {gb(peak_rss)} resident of "
                    f"{gb(limit)})")


def _cgroup_file(v2: str, v1: str) -> str | None:
  """The path of a memory controller file of this process's cgroup (v2 name, v1 name), None when there is none."""
  try: lines = open("/proc/self/cgroup").read().splitlines()
  except OSError: return None
  for line in lines:
    _, ctrl, path = line.split(":", 2)
    for cand in ([f"/sys/fs/cgroup{path}/{v2}"] if ctrl == ""
                 else [f"/sys/fs/cgroup/memory{path}/{v1}", f"/sys/fs/cgroup/memory/{v1}"]
                 if "memory" in ctrl.split(",") else []):
      if os.path.exists(cand): return cand
  return None


def oom_kills() -> int:
  """How many processes the kernel's OOM killer has ended in this process's cgroup (0 where unreadable)."""
  if (path := _cgroup_file("memory.events", "memory.oom_control")) is None: return 0
  try: return next((int(line.split()[1]) for line in open(path) if line.startswith("oom_kill ")), 0)
  except (OSError, ValueError): return 0


def memory_limit() -> int:
  """Bytes of memory a process here may use: the machine's, or its cgroup's limit where lower."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    text = open(_cgroup_file("memory.max", "memory.limit_in_bytes") or "/dev/null").read().strip()
    return min(total, int(text)) if text.isdigit() else total
  except OSError: return total


def memory_bytes(device: str) -> int | None:
  """The memory a device holds, in bytes: the card's (nvidia-smi) or, for the CPU, the host's (memory_limit); None
  where unknown (a workload is then refused for the model's context length alone)."""
  from evaluator.devices import kind, nvidia_memory, physical
  if kind(device) == "CPU": return memory_limit()
  key = physical(device).key
  return nvidia_memory().get(key.removeprefix("nvidia-")) if key.startswith("nvidia-GPU-") else None


def _kernel_log() -> str:
  try: return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
  except (OSError, subprocess.TimeoutExpired): return ""


def _phase(path: str) -> str:
  try:
    with open(path) as f: return json.load(f).get("phase", "")
  except (OSError, ValueError): return ""


def _signal_name(rc: int) -> str:
  try: return signal.Signals(-rc).name
  except ValueError: return f"signal {-rc}"


def evaluate(spec: TrialSpec, timeout: float = 900, on_phase: Phase | None = None,
             on_wait: Phase | None = None) -> TrialResult:
  """One trial under the device's lock: concurrent callers on one host wait (and say so through on_wait)."""
  with DeviceLock(spec.device, on_wait, what=f"trial of {os.path.basename(spec.model)}"):
    return run_process(spec, timeout, on_phase)


def bandwidths() -> dict:
  """The cached bandwidth figures by host and device; a corrupt cache file is an error that names it (checked before a
  study is made, not in its first trial)."""
  known = cached_json(path := cache_dir() / "bandwidth.json")
  for key, entry in known.items():
    if not (isinstance(entry, dict) and isinstance(entry.get("gb_s"), (int, float))):
      raise ValueError(f"the cache file {path} is corrupt ({key}: {entry!r}): remove it, and it is made again")
  return known


def bandwidth(device: str, remeasure: bool = False, on_wait: Phase | None = None) -> float:
  """The device's streaming read bandwidth in GB/s, measured once per device and host and cached."""
  path, known, key = cache_dir() / "bandwidth.json", bandwidths(), f"{os.uname().nodename}:{device}"
  if remeasure or key not in known:
    with DeviceLock(device, on_wait, what="bandwidth probe"):
      out = subprocess.run([sys.executable, "-m", "evaluator.bandwidth", device], capture_output=True, text=True,
                           env=_child_env())
    if out.returncode != 0:
      raise RuntimeError(f"bandwidth probe on {device} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    known[key] = json.loads(out.stdout.strip().splitlines()[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1))
  return known[key]["gb_s"]


@dataclass
class Evaluator:
  """Trials of one model file on one device: the ladder's stages, the shared reference and bandwidth figures."""
  model: str
  device: str
  total_layers: int
  # the stage-1 proxy: the leading dense blocks and two MoE blocks (the same kernels as the full model)
  block_layers: int
  n: int = 32
  rounds: int = 3
  warmup: int = 3
  prompt_len: int = PROMPT  # the workload (model/workload.py): the prompt and the context decode is timed at
  context: int = 0
  timeout: float = 900
  # time the prefill graph too (the prompt otherwise goes through decode steps: no prefill kernels to build)
  prefill: bool = True
  # tinygrad's cache directory for these trials (a study's own); None: tinygrad's default
  tinygrad_cache: str | None = None
  beam_budget: float = 0.0  # BEAM search seconds per trial (model.settings.time_beam_search); 0: no limit

  @classmethod
  def for_model(cls, model: str, device: str, **kw) -> Evaluator:
    from model.gguf_file import GGUFFile
    f = GGUFFile(model)
    total = int(f.key("block_count"))
    return cls(str(f.path), device, total, min(total, int(f.key("leading_dense_block_count", 0)) + 2), **kw)

  @property
  def workload(self) -> Workload: return Workload(self.prompt_len, self.context)

  def memory(self) -> tuple[Memory, str | None]:
    """The device memory of a full-model trial at this workload before anything runs, and why it cannot run on this
    device (one line; None where it can)."""
    probe = self.spec({})
    mem = Memory.of(self.model, probe.workload, probe.decoded)
    return mem, mem.refusal(probe.workload, probe.decoded, self.device, memory_bytes(self.device))

  @property
  def stages(self) -> list[str]: return ["block", "full"] if self.block_layers < self.total_layers else ["full"]

  def layers(self, stage: str) -> int | None:
    return self.block_layers if stage == "block" and self.block_layers < self.total_layers else None

  def spec(self, config: dict, stage: str = "full", **kw) -> TrialSpec:
    """A trial's spec, its KV cache the workload's (Workload.cache_positions)."""
    spec = TrialSpec(self.model, config, self.device, stage, self.layers(stage), self.prompt_len, self.n, self.rounds,
                     self.warmup, prefill=self.prefill, tinygrad_cache=self.tinygrad_cache,
                     beam_budget_s=self.beam_budget, context=self.context, **kw)
    return replace(spec, max_context=spec.workload.cache_positions(spec.decoded))

  def reference_path(self, stage: str, config: StructureConfig) -> str:
    """Where the reference of `config` for this file, device and stage is cached (evaluator/gate.py reference_key),
    its directory made: whichever process makes it saves it there."""
    from evaluator.gate import GATE_PROMPT, reference_key
    probe = self.spec(config.to_dict(), stage)
    key = reference_key(file_sha256(self.model), self.device, probe.layers or self.total_layers,
                        min(probe.prompt_len, GATE_PROMPT), probe.check_positions, probe.workload.depth, config)
    (path := cache_dir() / "references" / f"{key}.npz").parent.mkdir(parents=True, exist_ok=True)
    return str(path)

  def reference(self, stage: str, config: StructureConfig | None = None, on_phase: Phase | None = None,
                on_wait: Phase | None = None) -> str:
    """The reference of a config (evaluator/gate.py twin: the baseline, or a twin) for this file, device and stage, made
    on first use in a trial process of its own (where a trial's config is its own twin, `run` has the trial's process
    make it instead)."""
    config = config or StructureConfig()
    if not os.path.exists(path := self.reference_path(stage, config)):
      res = evaluate(replace(self.spec(config.to_dict(), stage), write_reference=path), self.timeout, on_phase, on_wait)
      if not res.ok: raise ReferenceFailed(res, _reference_config(config))
    return path

  def run(self, config: dict, stage: str = "full", profile: bool = False, check: bool = True,
          on_phase: Phase | None = None, on_wait: Phase | None = None) -> TrialResult:
    """One trial of `config` at `stage`, checked against its reference unless `check` is false; a config checked
    against a twin is also given the baseline's (exact) reference, for its accuracy figures. A config that is its own
    twin (the baseline) and finds no reference makes it in its own trial process, then is checked against it and
    measured there: one process start, weight load and build of the check's kernels for both (under twice the trial
    timeout: the reference's run is about another trial's check and measure). A failed baseline
    reference raises ReferenceFailed (no trial can be checked); a failed twin reference fails this trial alone."""
    from evaluator.gate import twin
    t0, ref, exact, make = time.perf_counter(), None, None, False
    if check:
      try: ref_cfg = twin(cfg := StructureConfig.from_dict(config))
      # the trial process reports the config as invalid
      except (ValueError, TypeError, KeyError): cfg, ref_cfg = None, StructureConfig()
      if ref_cfg != StructureConfig(): exact = self.reference(stage, None, on_phase, on_wait)
      if ref_cfg == cfg and not os.path.exists(ref := self.reference_path(stage, ref_cfg)): make = True
      else:
        try: ref = self.reference(stage, ref_cfg, on_phase, on_wait)
        except ReferenceFailed as e:
          if ref_cfg == StructureConfig(): raise
          return TrialResult(e.result.status, self.spec(config, stage).__dict__,
                             phases={"setup_s": round(time.perf_counter() - t0, 3)}, error=str(e))
    bw = bandwidth(self.device, on_wait=on_wait)
    setup = time.perf_counter() - t0
    res = evaluate(self.spec(config, stage, reference=ref, exact_reference=exact, bandwidth_gbs=bw, profile=profile,
                             write_reference=ref if make else None, trial_after_reference=make),
                   2 * self.timeout if make else self.timeout, on_phase, on_wait)
    # no reference made: as when it fails in a process of its own (one made before a later failure stays usable)
    if make and not res.ok and not os.path.exists(ref):
      failed = ReferenceFailed(res, _reference_config(ref_cfg))
      if ref_cfg == StructureConfig(): raise failed
      res.error = str(failed)
    # the references made in processes of their own and the bandwidth figure: made on first use, cached after
    res.phases["setup_s"] = round(setup, 3)
    return res


def _reference_config(config: StructureConfig) -> str:
  """A reference's config as ReferenceFailed names it."""
  return "the baseline config" if config == StructureConfig() else f"the reference config {config.to_json()}"
