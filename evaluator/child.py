"""The trial process: `python -m evaluator.child SPEC.json RESULT.json`.

Everything tinygrad happens here, in a fresh process per trial: the device and the config's process settings are set
before tinygrad is imported, so no cache, JIT or setting leaks from one trial into the next. The result file is
rewritten (atomically) after every phase, so the parent knows how far a trial got even when the process dies.
"""
from __future__ import annotations

import os
import platform
import socket
import sys
import time
import traceback

from evaluator.result import TrialResult, TrialSpec
from model.memory import peak_rss_bytes
from model.structure import ConfigError, StructureConfig


class Recorder:
  """Times phases into a TrialResult and writes it to disk after each one."""

  def __init__(self, result: TrialResult, path: str):
    self.result, self.path, self.t0 = result, path, time.perf_counter()

  def write(self) -> None:
    with open(self.path + ".tmp", "w") as f: f.write(self.result.to_json())
    os.replace(self.path + ".tmp", self.path)

  def phase(self, name: str) -> None:
    """Close the running phase and start `name`."""
    now = time.perf_counter()
    if self.result.phase: self.result.phases[f"{self.result.phase}_s"] = round(now - self.t0, 4)
    self.result.phase, self.t0 = name, now
    self.write()


def classify(e: BaseException) -> str:
  if isinstance(e, ConfigError): return "invalid_config"
  from tinygrad.device import CompileError
  text = f"{type(e).__name__}: {e}".lower()
  if isinstance(e, MemoryError) or "out of memory" in text or "outofmemory" in text: return "oom"
  if isinstance(e, CompileError): return "compile_error"
  return "runtime_error"


def environment(device: str) -> dict:
  import tinygrad
  from tinygrad import Device
  env = {"device": device, "device_name": platform.processor() or platform.machine(), "driver": "",
         "tinygrad_version": getattr(tinygrad, "__version__", "") or _dist_version("tinygrad"),
         "tinygrad_path": os.path.dirname(os.path.dirname(tinygrad.__file__)), "python": platform.python_version(),
         "host": socket.gethostname(), "platform": platform.platform()}
  dev = Device[device]
  if device.startswith(("CUDA", "NV")):
    import subprocess
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                       text=True)
    if q.returncode == 0 and q.stdout.strip():
      env["device_name"], env["driver"] = (x.strip() for x in q.stdout.splitlines()[0].split(",", 1))
  elif hasattr(dev, "sysdevice"): env["device_name"] = str(dev.sysdevice.name())  # Metal
  return env


def _dist_version(name: str) -> str:
  from importlib.metadata import PackageNotFoundError, version
  try: return version(name)
  except PackageNotFoundError: return ""


def run(spec: TrialSpec, rec: Recorder) -> None:
  res = rec.result
  rec.phase("load")
  cfg = StructureConfig.from_dict(spec.config)
  os.environ["DEV"] = spec.device
  os.environ.update(cfg.process_env())
  from tinygrad import GlobalCounters

  from evaluator import gate
  from model.bench import bench_prompt, measure, prepare
  from model.deepseek2 import Transformer
  from model.generate import Generator
  from model.gguf_file import GGUFFile
  from model.settings import apply_process_settings, time_beam_search
  apply_process_settings(cfg, spec.device, spec.tinygrad_cache)
  # BEAM search seconds, apart from the rest of compiling (updated as kernels are built)
  res.metrics["beam"] = time_beam_search(spec.beam_budget_s)
  res.env = environment(spec.device)
  peak = lambda: max(res.metrics.get("peak_device_bytes", 0), GlobalCounters.mem_used)
  model = Transformer(GGUFFile(spec.model), cfg, max_context=spec.max_context, n_layers=spec.layers)
  gen, hp = Generator(model), model.hp
  res.metrics |= {"layers": len(model.blocks), "load_peak_device_bytes": model.load_peak_bytes,
                  "peak_device_bytes": peak()}
  work = spec.workload
  pos = work.depth
  # the reference config's run through the check path: it feeds the prompt itself (at most GATE_PROMPT tokens of it),
  # from position 0, and fills the cache to the depth
  if spec.write_reference:
    rec.phase("reference")
    prompt = bench_prompt(hp.vocab, min(spec.prompt_len, gate.GATE_PROMPT))
    gate.make_reference(gen, prompt, spec.check_positions, pos).save(spec.write_reference)
    if not spec.trial_after_reference: return

  # the check feeds the prompt and fills the cache (a trial after its own reference: checked against the saved file as
  # any other trial)
  first, figures = prepare(gen, work, spec.prefill, rec.phase, feed=spec.reference is None)
  res.metrics |= figures | {"peak_device_bytes": peak()}

  ref, (tol, part_tol) = None, gate.tolerance(cfg, gen.model.hp.dim)
  if spec.reference:
    rec.phase("check")
    ref = gate.Reference.load(spec.reference)
    exact = gate.Reference.load(spec.exact_reference) if spec.exact_reference else None
    # a trial that prefills checks its prefill, first: check starts from the reference's cache, which the timed run
    # continues
    pre = gate.prefill_check(gen, *gate.prefill_basis(cfg, ref, exact, tol, part_tol), part_tol) if spec.prefill else {}
    res.check = gate.check(gen, ref, tol, part_tol, exact) | pre
    res.check["ok"] = res.check["ok"] and pre.get("prefill_ok", True)
    if not res.check["ok"]:
      res.status, res.error = "wrong_output", gate.verdict(res.check)
      return
    # the timed run continues the reference's sequence, so its tokens are checked too
    first = int(ref.tokens[ref.prompt_len])

  m = measure(gen, first, pos, spec.n, spec.rounds, spec.warmup, rec.phase)
  gb_s = m["bytes_per_token"] * m["tok_s"] / 1e9
  res.metrics |= m | {"gb_s": gb_s, "bandwidth_share": gb_s / spec.bandwidth_gbs if spec.bandwidth_gbs else None,
                      "peak_device_bytes": peak(), "host_peak_rss_bytes": peak_rss_bytes()}
  if ref is not None:
    res.check |= gate.check_tokens(ref, res.check, m["tokens"])
    if res.check["tokens_differ"]:
      res.status, res.error = "wrong_output", gate.verdict(res.check)
      return
  if spec.profile:
    rec.phase("profile")
    from model.profile import kernel_profile, places, step_timeline
    res.profile = kernel_profile(gen.step_jit, {"start_pos": pos}, spec.bandwidth_gbs, m["bytes_per_token"],
                                 where=places(gen.model))
    res.timeline = step_timeline(gen.step_jit, {"start_pos": pos})
    # against ms_per_token: the graph's own cost
    res.metrics["kernel_us_per_token"] = sum(p["us_per_token"] for p in res.profile)
    if spec.prefill:  # the prefill graph's kernels at its last captured chunk (the longest attention)
      at = max(i for i in range(0, work.prompt, gen.chunk) if gen.in_graph(i))
      # a prefill kernel runs long enough to be timed alone, in the graph's order
      res.prefill_profile = kernel_profile(gen.prefill_last_jit, {"chunk_at": at // gen.chunk}, spec.bandwidth_gbs,
                                           where=places(gen.model), in_order=True)
      res.metrics |= {"prefill_chunk": gen.chunk, "prefill_profile_at": at}


def orphan_watch() -> None:
  """End this process when its parent dies (a killed worker must not leave a benchmark running beside the next one)."""
  import threading
  parent = os.getppid()
  def watch() -> None:
    while os.getppid() == parent: time.sleep(0.2)
    os._exit(1)
  threading.Thread(target=watch, daemon=True).start()


def main() -> None:
  orphan_watch()
  spec_path, out_path = sys.argv[1:3]
  spec = TrialSpec.from_json(open(spec_path).read())
  rec = Recorder(TrialResult("running", spec.__dict__), out_path)
  try:
    run(spec, rec)
    if rec.result.status == "running": rec.result.status = "ok"
  except BaseException as e:  # noqa: BLE001 - every failure becomes a classified result
    rec.result.status = classify(e) if not isinstance(e, KeyboardInterrupt) else "runtime_error"
    rec.result.error = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
    rec.result.metrics["traceback"] = traceback.format_exc()[-6000:]
  finally:
    phase = rec.result.phase
    rec.phase("")
    rec.result.phase = phase
    rec.write()


if __name__ == "__main__":
  main()
