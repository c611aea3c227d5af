"""The evaluator runs real trials of the tiny model on the CPU, each in its own process: results, repeatability, the
correctness gate, failure classes (faults injected into the trial process from the outside: tests/inject/), the device
lock, A/B comparison and the CLI."""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import shutil
import threading
import time

import numpy as np
import pytest

from evaluator import runner
from evaluator.cli import main as evaluator_main
from evaluator.compare import compare
from evaluator.gate import Reference
from evaluator.lock import DeviceLock
from evaluator.runner import Evaluator, ReferenceFailed, bandwidth, evaluate, memory_limit, oom_kills, sigkill_verdict
from model.structure import StructureConfig
from model.workload import Workload

BASELINE: dict = {}


@pytest.fixture(scope="module")
def ev(gguf_file) -> Evaluator:
  e = Evaluator.for_model(gguf_file("tiny", "q4_0"), "CPU", n=8, rounds=2, prefill=False, timeout=300)
  e.reference("full")  # made once, before any fault is injected
  return e


@pytest.fixture(scope="module")
def baseline(ev) -> tuple:
  return ev.run(BASELINE), ev.run(BASELINE)


def test_trial_reports_every_figure_and_repeats(baseline) -> None:
  a, b = baseline
  for r in (a, b):
    assert r.ok, r.error
    assert r.check["ok"] and r.check["max_rel_err"] < 1e-4 and r.check["positions"] == 16 and r.check[
      "tokens_compared"] >= 0
    # against the exact reference, which is its own
    acc = r.check["accuracy"]
    assert acc["positions"] == 16 and acc["top1"] == 1.0 and acc["max_rel_err"] < 1e-4 and acc["max_kl"] < 1e-9, acc
    assert r.spec["exact_reference"] is None
    m = r.metrics
    assert m["tok_s_min"] <= m["tok_s"] <= m["tok_s_max"] and len(m["tok_s_rounds"]) == 2 and m["deterministic"]
    assert m["kernels_per_token"] > 10 and m["bytes_per_token"] > 1e5 and 0 < m["bandwidth_share"] < 1
    assert m["ms_p50"] <= m["ms_p90"] and m["peak_device_bytes"] > 0 and m["layers"] == 3
    assert {"load_s", "compile_s", "check_s", "warmup_s", "measure_s", "wall_s", "overhead_s"} <= set(r.phases)
    assert "prompt_s" not in r.phases  # the check feeds the prompt through its own graph: no decode steps feed it first
    assert r.env["device"] == "CPU" and r.env["tinygrad_version"]
    assert m["beam"] == {"search_s": 0.0, "kernels": 0, "unsearched": 0}  # BEAM=0: no BEAM search
  # the same config twice: the same tokens and the same work; the speed within the noise of a shared 2-core machine
  assert a.metrics["tokens"] == b.metrics["tokens"]
  assert (a.metrics["kernels_per_token"],
          a.metrics["bytes_per_token"]) == (b.metrics["kernels_per_token"], b.metrics["bytes_per_token"])
  assert 0.5 < a.metrics["tok_s"] / b.metrics["tok_s"] < 2.0


def test_prefill_and_kernel_profile(ev) -> None:
  ev_prefill = Evaluator(ev.model, ev.device, ev.total_layers, ev.block_layers, n=8, rounds=1, prefill=True)
  r = ev_prefill.run({"topk": "sort"}, profile=True)
  assert r.ok, r.error
  assert r.metrics["prefill_tok_s"] > 0 and "prefill_s" in r.phases and "profile_s" in r.phases
  assert r.profile and r.profile[0]["rank"] == 1 and 0 < sum(p["share"] for p in r.profile) <= 1.0001
  # device time without the host's launches: a kernel shorter than the timing noise of this shared CPU may read 0
  assert all(p["us_per_token"] >= 0 and p["count"] >= 1 for p in r.profile) and r.profile[0]["us_per_token"] > 0
  assert {p["timing"] for p in r.profile} == {"host launches"}, "off CUDA the kernels are launched one by one"
  assert 0 < r.metrics["kernel_us_per_token"] == pytest.approx(sum(p["us_per_token"] for p in r.profile))
  # the timed prefill's spread, and its graph's kernels (a prompt of one chunk: profiled at position 0)
  m = r.metrics
  assert 1 <= m["prefill_runs"] <= 3 and m["prefill_tok_s_min"] <= m["prefill_tok_s"] <= m["prefill_tok_s_max"]
  assert r.prefill_profile and m["prefill_profile_at"] == 0 and m["prefill_chunk"] == 32
  assert {p["stage"] for p in r.prefill_profile} >= {"attention", "moe"} and r.prefill_profile[0]["us_per_token"] > 0
  assert all(p["tflops"] is None or p["tflops"] >= 0 for p in r.prefill_profile)
  # each prefill kernel timed as the whole graph runs in its order (replayed alone, one could read another's scratch)
  assert {p["timing"] for p in r.prefill_profile} == {"in order, device timer"}


def test_kernels_take_the_stage_and_layer_of_what_they_read() -> None:
  """Unit (model/profile.py stage_of), launches as (program, runtime, buffers, vars) with buffers that are only
  identities: a block's weight names its stage and layer; a kernel of intermediates takes the place of the launch
  right after it that applies a norm to its output and inputs (a norm's sum of squares), else of the launch before it
  (a top-k); a norm's weight only names the stage of a kernel that reads no other (an MoE kernel that applies the FFN
  norm is the MoE's); a shared RoPE table keeps the layer of the launch before."""
  from model.profile import layers_text, stage_of
  x, sq, rope, attn_norm, q_a, norm, gate_inp, logits, ids, exps, emb = (object() for _ in range(11))
  where = {id(rope): ("attention", None, False), id(attn_norm): ("attention", 1, True),
           id(q_a): ("attention", 1, False), id(norm): ("router", 1, True), id(gate_inp): ("router", 1, False),
           id(exps): ("moe", 1, False), id(emb): ("embed", None, False)}
  launch = lambda *bufs: (None, None, list(bufs), {})
  launches = [launch(x, emb), launch(sq, x), launch(x, sq, x, attn_norm, q_a), launch(x, x, rope),
              launch(logits, x, norm, gate_inp), launch(ids, logits), launch(x, ids, x, norm, exps), launch(x, x, emb)]
  assert stage_of(launches, where) == [("embed", None), ("attention", 1), ("attention", 1), ("attention", 1),
                                       ("router", 1), ("router", 1), ("moe", 1), ("head", None)]
  assert layers_text([3, 0, 1, 2, 5, 5]) == "0-3,5" and layers_text([]) == ""


def test_a_different_config_passes_the_gate_with_its_own_kernels(ev, baseline) -> None:
  base, fp16 = baseline[0], ev.run({"act_dtype": "float16", "merge_gate_up_routed": True})
  assert base.ok and fp16.ok, fp16.error
  assert 0 < fp16.check["max_rel_err"] <= fp16.check["tolerance"] == 5e-2
  assert fp16.metrics["kernels_per_token"] != base.metrics["kernels_per_token"] or fp16.metrics[
    "bytes_per_token"] != base.metrics["bytes_per_token"]


def test_an_8bit_config_is_measured_against_the_exact_reference(ev, baseline) -> None:
  """A q8 config passes the gate against its twin, and its accuracy figures are against the exact reference (the
  baseline's, the one cached reference its trial process is also given): far from it, where the twin is not."""
  q8 = ev.run({"fused": {"moe": "dsl", "ffn": "dsl"}, "ffn_act": "q8"})
  assert q8.ok, q8.error
  exact = baseline[0].spec["reference"]
  assert q8.spec["exact_reference"] == exact and q8.spec["reference"] not in (None, exact)
  acc, base = q8.check["accuracy"], baseline[0].check["accuracy"]
  assert acc["positions"] == 16 and acc["max_rel_err"] > max(100 * base["max_rel_err"], 2 * q8.check["tolerance"])
  assert acc["mean_kl"] > max(100 * base["mean_kl"], 1e-7) and acc["max_kl"] >= acc["mean_kl"], acc
  assert q8.check["drift"] is None or q8.check["drift"] < acc["max_rel_err"] / 10, q8.check  # the twin's


@pytest.fixture
def fresh(gguf_file, tmp_path, monkeypatch) -> tuple[Evaluator, list, list]:
  """An evaluator of the tiny model with a block stage and an empty reference cache (this test's own), and the specs and
  timeouts of the trial processes it starts, in order."""
  bandwidth("CPU")  # measured once per session, into the session's cache
  (cache := tmp_path / "cache").mkdir()
  shutil.copy(pathlib.Path(os.environ["STRUCTSEARCH_CACHE"]) / "bandwidth.json", cache)
  monkeypatch.setenv("STRUCTSEARCH_CACHE", str(cache))
  run_process = runner.run_process
  specs, timeouts = [], []
  monkeypatch.setattr(runner, "run_process", lambda spec, timeout, *a: specs.append(spec) or timeouts.append(timeout)
                      or run_process(spec, timeout, *a))
  e = Evaluator.for_model(gguf_file("tiny", "q4_0"), "CPU", n=8, rounds=1, prefill=False, timeout=300)
  return dataclasses.replace(e, block_layers=e.total_layers - 1), specs, timeouts


def test_the_baseline_makes_its_own_reference_in_its_trial_process(fresh) -> None:
  """With no reference cached, each stage's baseline trial is one process: it makes the reference, then is checked
  against it (the real check: its figures, its tokens against the timed run's) and measured; the next trial of the stage
  loads the file."""
  ev, specs, timeouts = fresh
  assert ev.stages == ["block", "full"]
  for stage in ev.stages:
    path, n = ev.reference_path(stage, StructureConfig()), len(specs)
    assert not os.path.exists(path)
    r = ev.run(BASELINE, stage)
    assert r.ok, r.error
    (spec,) = specs[n:]
    assert spec.write_reference == spec.reference == path and spec.trial_after_reference and os.path.exists(path)
    assert timeouts[-1] == 2 * ev.timeout  # the reference's run and the trial's
    assert r.check["ok"] and r.check["positions"] == spec.check_positions and r.check["tokens_compared"] > 0
    assert r.check["max_rel_err"] == 0 and r.check["accuracy"]["top1"] == 1.0
    # the reference in the trial's own phases, before the trial's; not in the setup paid before the process
    assert list(r.phases)[:6] == ["load_s", "reference_s", "compile_s", "check_s", "warmup_s", "measure_s"]
    assert "prompt_s" not in r.phases and r.phases["setup_s"] < r.phases["reference_s"]
    made = os.stat(path).st_mtime_ns
    other = ev.run({"topk": "sort"}, stage)
    assert other.ok and other.check["ok"], other.error
    (spec,) = specs[n + 1:]
    assert spec.reference == path and spec.write_reference is None and os.stat(path).st_mtime_ns == made
    assert timeouts[-1] == ev.timeout
  assert ev.reference_path("block", StructureConfig()) != ev.reference_path("full", StructureConfig())


def test_a_baseline_that_fails_before_making_its_reference_raises(fresh, inject) -> None:
  """The baseline's trial failing before its reference is saved: ReferenceFailed, as when the reference's own process
  fails (no trial can be checked). Failing after it is an ordinary failed trial, and the saved reference serves the
  next trial."""
  ev, specs, _ = fresh
  path = ev.reference_path("full", StructureConfig())
  inject("check_crash")
  with pytest.raises(ReferenceFailed) as e: ev.run(BASELINE)
  assert str(e.value).startswith("the baseline config failed to make the reference (runtime_error): RuntimeError: "
                                 "injected crash in the check path")
  assert e.value.result.phase == "reference" and len(specs) == 1 and not os.path.exists(path)
  inject("crash")  # on the first decode step, after the reference
  r = ev.run(BASELINE)
  assert r.status == "runtime_error" and r.phase == "compile" and "injected crash" in r.error and len(specs) == 2
  assert Reference.load(path).positions == specs[-1].check_positions
  inject()
  r = ev.run(BASELINE)
  assert r.ok and r.check["ok"], r.error
  assert len(specs) == 3 and specs[-1].write_reference is None and specs[-1].reference == path


def test_another_configs_reference_is_made_in_a_process_of_its_own(fresh, tmp_path, monkeypatch) -> None:
  """A config checked against the baseline's reference, none cached: the reference is made first, alone, and its time is
  the trial's setup. The file is the one the baseline's own trial would make, under the same key."""
  ev, specs, timeouts = fresh
  r = ev.run({"topk": "sort"})
  assert r.ok and r.check["ok"], r.error
  ref, trial = specs
  path = ev.reference_path("full", StructureConfig())
  assert ref.write_reference == trial.reference == path and not ref.trial_after_reference
  assert timeouts == [ev.timeout, ev.timeout]
  assert StructureConfig.from_dict(ref.config) == StructureConfig()
  assert trial.write_reference is None and "reference_s" not in r.phases and r.phases["setup_s"] > r.phases["load_s"]
  (other := tmp_path / "other").mkdir()  # an empty cache again: the baseline makes its own
  shutil.copy(tmp_path / "cache" / "bandwidth.json", other)
  monkeypatch.setenv("STRUCTSEARCH_CACHE", str(other))
  assert ev.run(BASELINE).ok and specs[-1].trial_after_reference
  assert specs[-1].write_reference == path.replace(str(tmp_path / "cache"), str(other))
  own, apart = Reference.load(specs[-1].write_reference), Reference.load(path)
  for f in dataclasses.fields(Reference): assert np.array_equal(getattr(own, f.name), getattr(apart, f.name)), f.name


@pytest.mark.parametrize("fault, config, status", [
  ("", {"topk": "bogus"}, "invalid_config"),
  ("crash", {}, "runtime_error"),
  ("compile_error", {}, "compile_error"),
  ("sigkill", {}, "killed"),
  ("sigterm", {}, "killed"),
  ("device_oom_kill", {}, "oom"),
  ("hang", {}, "timeout"),
  ("broken_argmax_topk", {"topk": "argmax"}, "wrong_output"),
  ("scale_off_one_block", {}, "wrong_output"),
  ("dropped_residual_one_block", {}, "wrong_output"),
  # the fused stage adds the residual itself
  ("dropped_residual_one_block", {"fused": {"attention": "dsl"}}, "wrong_output"),
])
def test_failures_are_classified(ev, monkeypatch, inject, fault, config, status) -> None:
  inject(fault)
  if fault == "hang": monkeypatch.setattr(ev, "timeout", 20)
  t0 = time.perf_counter()
  r = ev.run(config)
  assert r.status == status, (r.status, r.error, r.check)
  assert r.error and not r.ok and r.tok_s is None
  if status == "timeout": assert 20 <= time.perf_counter() - t0 < 60 and "compile" in r.error
  # it picks wrong experts
  if fault == "broken_argmax_topk": assert r.check["wrong_routing"] > 0 and "routing decisions differ" in r.error
  if fault in ("scale_off_one_block", "dropped_residual_one_block"): assert r.check["failed_positions"] > 0, r.check
  if fault == "dropped_residual_one_block":
    assert [s.split()[-1] for s in r.check["failed_stages"]] == ["attention"], r.check
  if status == "invalid_config": assert "topk='bogus'" in r.error
  if status == "killed":
    assert "from outside" in r.error and fault.upper() in r.error and r.metrics["host_peak_rss_bytes"] > 1e7
  if status == "oom": assert "device ran out of memory" in r.error


def test_sigkill_is_oom_only_on_evidence() -> None:
  limit = memory_limit()
  assert sigkill_verdict(1, 10**8, False, "")[0] == "killed"
  assert sigkill_verdict(1, 10**8, True, "")[0] == "oom"  # the cgroup's OOM killer struck during the trial
  assert sigkill_verdict(1, int(0.95 * limit), False, "")[0] == "oom"  # its own high-water mark at the memory limit
  assert sigkill_verdict(1, 10**8, False, "loading\nRuntimeError: CUDA out of memory")[0] == "oom"
  assert 1e9 < limit <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and oom_kills() >= 0


def test_argmax_topk_is_right_without_the_fault(ev) -> None:
  r = ev.run({"topk": "argmax"})
  assert r.ok and r.check["failed_positions"] == 0, r.error


def test_device_lock_serialises_two_callers(ev, inject) -> None:
  # each trial holds the device until its 4 s limit: long past the second caller's start, however busy the host
  inject("hang")
  spec = ev.spec(BASELINE)
  waits, spans = [], []
  def one() -> None:
    t0 = time.perf_counter()
    r = evaluate(spec, 4, on_wait=waits.append)
    spans.append((t0, time.perf_counter(), r.phases["wall_s"]))
  threads = [threading.Thread(target=one) for _ in range(2)]
  for t in threads: t.start()
  for t in threads: t.join()
  assert len(waits) == 1 and "waiting for device CPU" in waits[0] and "pid" in waits[0]
  assert max(e for _, e, _ in spans) - min(s for s, _, _ in spans) >= sum(w for _, _, w in spans)  # one after the other


def test_lock_is_released_by_a_dead_holder(tmp_path, monkeypatch) -> None:
  import subprocess
  import sys
  monkeypatch.setenv("STRUCTSEARCH_CACHE", str(tmp_path))
  holder = subprocess.Popen([sys.executable, "-c", "import time; from evaluator.lock import DeviceLock\n"
                             "with DeviceLock('FAKE'): print('held', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  holder.kill()
  holder.wait()
  with DeviceLock("FAKE", on_wait=lambda m: pytest.fail(m)): pass


def test_ab_compare_of_a_config_with_itself(ev) -> None:
  c = compare(ev, BASELINE, {"topk": "sort"}, pairs=1)
  assert c.failed is None and len(c.ratios) == 1
  # one pair has no spread: its interval claims nothing (0 to infinity), so it never decides
  assert 0.5 < c.speedup < 2.0 and c.low == 0.0 and c.high == math.inf and not c.decided


BEAM_ONE_KERNEL = """
import json, sys
from model.settings import apply_process_settings, time_beam_search
from model.structure import StructureConfig
apply_process_settings(StructureConfig(), "CPU", sys.argv[1])
beam = time_beam_search()
from tinygrad import Context, Tensor
x = Tensor.ones(4, 4).contiguous().realize()
with Context(BEAM=1): (x * 2).sum(1).realize()
print(json.dumps(beam))
"""


def test_beam_search_time_is_recorded_and_cached_per_study(tmp_path) -> None:
  """The BEAM search of a kernel is timed apart; its choice lands in the study's own tinygrad cache, where the next
  trial of the study finds it (and another study's cache does not hold it)."""
  import json
  import subprocess
  import sys
  run = lambda cache: json.loads(subprocess.run([sys.executable, "-c", BEAM_ONE_KERNEL, str(cache)],
                                                capture_output=True, text=True, check=True,
                                                env={**os.environ, "PARALLEL": "0"}).stdout)
  first, again = run(tmp_path / "study-a"), run(tmp_path / "study-a")
  assert first["kernels"] == again["kernels"] == 1 and first["search_s"] > 0.05 and again["search_s"] < first[
    "search_s"] / 10
  assert (tmp_path / "study-a" / "cache.db").stat().st_size > 0 and not (tmp_path / "study-b").exists()


BEAM_TWO_KERNELS = """
import json, sys
from model.settings import apply_process_settings, time_beam_search
from model.structure import StructureConfig
apply_process_settings(StructureConfig(), "CPU", sys.argv[1])
beam = time_beam_search(float(sys.argv[2]))
from tinygrad import Context, Tensor
x = Tensor.ones(4, 4).contiguous().realize()
with Context(BEAM=1): a, b = (x * 2).sum(1).tolist(), (x + 3).max(0).tolist()
print(json.dumps(beam | {"a": a, "b": b}))
"""


def test_a_beam_budget_stops_searching_once_spent(tmp_path) -> None:
  """Past the budget, a kernel not searched before is built with BEAM=0's heuristics (and counted); one searched before
  comes from the cache; without a budget every kernel is searched."""
  import json
  import subprocess
  import sys
  run = lambda cache, budget: json.loads(subprocess.run([sys.executable, "-c", BEAM_TWO_KERNELS, str(cache),
                                                         str(budget)], capture_output=True,
                                                        text=True, check=True,
                                                        env={**os.environ, "PARALLEL": "0"}).stdout)
  spent, again, free = run(tmp_path / "a", 1e-9), run(tmp_path / "a", 1e-9), run(tmp_path / "b", 0)
  for r in (spent, again, free): assert (r["a"], r["b"]) == ([8.0] * 4, [4.0] * 4)
  assert (spent["kernels"], spent["unsearched"]) == (again["kernels"], again["unsearched"]) == (1, 1)
  # the first kernel's choice from the cache; the second still unsearched
  assert again["search_s"] < spent["search_s"] / 10
  assert (free["kernels"], free["unsearched"]) == (2, 0)


def test_a_trial_keeps_to_its_beam_budget(ev, tmp_path) -> None:
  """The budget reaches the trial process: one kernel searched, every later one built at BEAM=0's heuristics, and the
  trial's output still passes the gate."""
  import dataclasses
  r = dataclasses.replace(ev, beam_budget=1e-6, tinygrad_cache=str(tmp_path)).run({"beam": 1})
  assert r.ok, r.error
  assert r.metrics["beam"]["kernels"] == 1 and r.metrics["beam"]["unsearched"] > 5


def test_bandwidth_is_measured_once_and_cached(monkeypatch) -> None:
  first = bandwidth("CPU")
  monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("measured again"))
  assert bandwidth("CPU") == first > 0.1


def test_cli(ev, tmp_path, capsys) -> None:
  bad = tmp_path / "bad.json"
  bad.write_text('{"beam": 3}')
  with pytest.raises(SystemExit) as e:
    evaluator_main(["run", "--model", ev.model, "--device", "CPU", "--config", str(bad)])
  assert e.value.code == 2 and "beam=3 is not allowed" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e: evaluator_main(["run", "--model", "/nonexistent.gguf"])
  assert e.value.code == 2 and "no GGUF file" in capsys.readouterr().err
  out = tmp_path / "r.json"
  with pytest.raises(SystemExit) as e:
    evaluator_main(["run", "--model", ev.model, "--device", "CPU", "-n", "4", "--rounds", "1", "--no-prefill", "--json",
                    str(out)])
  assert e.value.code == 0
  import json
  assert json.loads(out.read_text())["status"] == "ok"


def test_cli_beam_budget(ev, tmp_path, monkeypatch) -> None:
  """`evaluator run --beam-budget` reaches the trial: one kernel searched, the rest at BEAM=0's heuristics."""
  import json
  monkeypatch.setenv("CACHEDB", str(tmp_path / "cache.db"))  # no BEAM choice cached from another run
  cfg, out = tmp_path / "beam.json", tmp_path / "r.json"
  cfg.write_text('{"beam": 1}')
  with pytest.raises(SystemExit) as e:
    evaluator_main(["run", "--model", ev.model, "--device", "CPU", "-n", "4", "--rounds", "1", "--no-prefill",
                    "--config", str(cfg), "--beam-budget", "1e-6", "--json", str(out)])
  r = json.loads(out.read_text())
  assert e.value.code == 0 and r["status"] == "ok", r.get("error")
  assert r["metrics"]["beam"]["kernels"] == 1 and r["metrics"]["beam"]["unsearched"] > 5


def test_slow_configs_measure_shorter_rounds(gguf_file, monkeypatch) -> None:
  """A round has n tokens, or as many as last driver.ROUND_S where n would take longer (at least MIN_ROUND_TOKENS): a
  slow config's trial does not spend most of its time on rounds whose figure its first steps already settle."""
  from model import bench as driver
  from model.deepseek2 import Transformer
  from model.generate import Generator
  from model.gguf_file import GGUFFile
  # 250 tok/s: n; 5 tok/s: rounds of 2 s
  assert driver.round_tokens(0.004, 32) == 32 and driver.round_tokens(0.19, 32) == 12
  assert driver.round_tokens(5.0, 32) == driver.MIN_ROUND_TOKENS and driver.round_tokens(5.0, 4) == 4
  gen = Generator(Transformer(GGUFFile(gguf_file("tiny", "q4_0")), max_context=64))
  first, _ = driver.prepare(gen, Workload(8), prefill=False)
  monkeypatch.setattr(driver, "ROUND_S", 1e-6)  # every step is slow against it
  m = driver.measure(gen, first, 8, 32, 2, 1)
  assert m["round_tokens"] == len(m["tokens"]) == driver.MIN_ROUND_TOKENS and len(m["tok_s_rounds"]) == 2 and m[
    "deterministic"]
