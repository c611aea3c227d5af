"""benchmarks/sidebyside.sh end to end on the CPU: the tiny model, a stand-in for llama-bench (the real one is built on
the device; `bash benchmarks/llama_cpp.sh pack --check` proves the packed source builds it), every figure turned into
results.jsonl lines by benchmarks/record.py, a broken config recorded without stopping the rest, a faulted config
rejected by the correctness gate, and the side-by-side tables of docs/benchmarks.template.md rendered from those
lines. Upstream tinygrad.llm's decoder as a peer (benchmarks/upstream_llm.py) on a tiny file, its JSON made a line."""
import collections
import json
import os
import pathlib
import stat
import statistics
import subprocess
import sys

import pytest

from benchmarks import render
from model.structure import StructureConfig
from model.synth import write_synthetic

ROOT = pathlib.Path(__file__).resolve().parent.parent
# llama-bench -o json of this llama.cpp (llama-cpp-python 0.3.36's), the fields record.py reads and a few beside them
LLAMA = {"build_commit": "llama-cpp-python-0.3.36", "build_number": 0, "cpu_info": "AMD EPYC", "gpu_info": "",
         "backends": "CPU", "model_type": "deepseek2 ?B Q4_0", "n_gpu_layers": 99, "flash_attn": 1, "n_prompt": 0,
         "n_gen": 128, "avg_ns": 2946000, "stddev_ns": 20000, "avg_ts": 339.42, "stddev_ts": 2.31,
         "samples_ns": [2940000] * 5, "samples_ts": [337.1, 338.9, 339.4, 340.2, 341.5]}
STAND_IN = f"""#!{sys.executable}
import json, sys
a = sys.argv[1:]
if a == ["--help"]: sys.exit(0)
assert a[2:] == "-p 0 -n 128 -r 5 -ngl 99 -fa 1 -o json".split() and a[0] == "-m" and a[1].endswith(".gguf"), a
print(json.dumps([{json.dumps(LLAMA)} | {{"model_filename": a[1]}}], indent=2))
"""


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> pathlib.Path:
  tmp = tmp_path_factory.mktemp("sidebyside")
  (bench := tmp / "llama-bench").write_text(STAND_IN)
  bench.chmod(bench.stat().st_mode | stat.S_IEXEC)
  (tmp / "sorted.json").write_text('{"topk": "sort"}')
  (tmp / "broken.json").write_text('{"topk": "no-such-variant"}')
  (tmp / "argmax.toml").write_text('topk = "argmax"\n')  # TOML, as `evaluator run --config` takes it; not in PROFILED
  configs = f"baseline sorted={tmp}/sorted.json broken={tmp}/broken.json argmax={tmp}/argmax.toml"
  env = os.environ | {"MODELS": "tiny", "DEVICE": "CPU", "CONFIGS": configs,
                      "N": "4", "ROUNDS": "1", "WORK": str(tmp), "OUT": str(tmp / "out"), "LLAMA_BENCH": str(bench),
                      "PYTHON": sys.executable, "FAULTS": "scale_off_one_block:sorted", "PROFILED": "sorted"}
  r = subprocess.run(["bash", "benchmarks/sidebyside.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  return tmp / "out"


def test_every_figure_is_a_results_line(out):
  lines = render.load(out / "results.jsonl")
  assert {i: m for i, x in enumerate(lines) if (m := render.missing(x))} == {}
  assert collections.Counter((x["kind"], x["config"]) for x in lines if x["kind"] != "profile") == collections.Counter({
    ("llama_cpp", "llama.cpp"): 1, ("decode", "baseline"): 1, ("trial", "baseline"): 1, ("gate", "baseline"): 1,
    ("decode", "sorted"): 1, ("trial", "sorted"): 1, ("gate", "sorted"): 1, ("trial", "broken"): 1,
    ("decode", "argmax"): 1, ("trial", "argmax"): 1, ("gate", "argmax"): 1,
    ("trial", "sorted + fault scale_off_one_block"): 1, ("gate", "sorted + fault scale_off_one_block"): 1})
  assert {x["device"] for x in lines} == {next(x for x in lines if x["kind"] == "decode")["device"]} and lines[0][
    "device"].endswith(" (CPU)")
  assert {x["model"] for x in lines} == {"tiny (synthetic, exact shapes)"} and {x["layers"] for x in lines} == {3}
  llama, base, fast, _ = lines[0], *[x for x in lines if x["kind"] == "decode"]
  assert (llama["tok_s"], llama["tok_s_stddev"], llama["tok_s_min"], llama["tok_s_max"]) == (339.42, 2.31, 337.1, 341.5)
  assert base["config_hash"] == StructureConfig().hash and base["knobs"] == "baseline" and fast["knobs"] == "topk=sort"
  assert base["llama_cpp_tok_s"] == fast["llama_cpp_tok_s"] == 339.42 and base["llama_cpp_tok_s_stddev"] == 2.31
  assert all(x["tok_s_min"] <= x["tok_s"] <= x["tok_s_max"] and x["kernels_per_token"] > 0 for x in (base, fast))
  gates = {x["config"]: x for x in lines if x["kind"] == "gate"}
  assert all(gates[c]["state"] == "ok" and gates[c]["check_ok"]
             and gates[c]["check_s"] > 0 for c in ("baseline", "sorted", "argmax"))
  # the middle MoE block's down projection reads a wrong scale
  faulted = gates.pop("sorted + fault scale_off_one_block")
  assert faulted["state"] == "wrong_output" and not faulted["check_ok"] and faulted["check_worst_stage"].startswith(
    "block 2 ffn"), faulted
  trials = {x["config"]: x for x in lines if x["kind"] == "trial"}
  assert trials["sorted"]["status"] == "ok" and trials["sorted"]["wall_s"] > trials["sorted"]["compile_s"] > 0
  assert trials["broken"]["status"] == "error" and trials["broken"]["error"] == "the evaluator wrote no result"
  # the configs PROFILED names (by default, all but the baseline)
  profile = [x for x in lines if x["kind"] == "profile"]
  assert profile and {x["config"] for x in profile} == {"sorted"} and [x["rank"] for x in profile] == list(range(1, len(
    profile) + 1))
  # each kernel's stage and the blocks it runs in (profile.places)
  assert {"attention", "moe"} <= {x["stage"] for x in profile} and any(x["in_layers"] == "0-2" for x in profile)


def test_each_result_is_kept_whole(out):
  kept = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
  assert kept[0][0]["model_filename"].endswith("tiny-q4_0.gguf")  # llama-bench's own output
  assert ([r["spec"]["config"]["topk"] for r in kept[1:]] == ["pairwise", "sort", "argmax", "sort"]
          and kept[2]["profile"] and kept[2]["phases"])
  assert kept[3]["status"] == "ok" and not kept[3]["profile"]  # not in PROFILED
  assert kept[2]["timeline"] == {}  # no overlapping native kernels on the CPU: no timeline
  assert kept[4]["status"] == "wrong_output" and not kept[4]["profile"]  # the faulted run: rejected, not profiled


def test_a_timeline_becomes_a_line_per_kernel(out):
  """A profiled trial's step timeline (model/profile.py, GPU only: made here from stamps of two launches) is one
  `timeline` line per kernel name with every field render.py requires, its parts summing to the step."""
  import numpy as np

  from benchmarks.record import trial_lines
  from evaluator.result import TrialResult
  from model.profile import timeline_rows
  kept = TrialResult.from_dict(json.loads((out / "trials.jsonl").read_text().splitlines()[2]))
  w = np.array([[[t + 100, t + 900, t + 1000, t + 2000], [t + 1800, t + 2500, t + 2600, t + 5000]]
                for t in range(10**6, 10**6 + 4 * 5000, 5000)], dtype=np.uint64)
  w[..., :2] = ~w[..., :2]
  rows, spans = timeline_rows(["glu", "down"], [3, 0], [w])
  kept.timeline = {"kernels": rows, "span_us": 5.0, "stamped_us": 5.1, "plain_us": 4.6, "steps": 4, "rounds": 1}
  lines = [x for x in trial_lines(kept, "X (CPU)", "tiny", "Q4_0", "sorted", "cmd") if x["kind"] == "timeline"]
  assert [render.missing(x) for x in lines] == [[], []] and spans == [5.0] * 3
  assert [(x["name"], x["us_per_token"], x["handoff_us"], x["work_us"]) for x in lines] == [
    ("down", 3.0, 0.5, 2.5), ("glu", 2.0, 0.9, 1.1)]
  assert lines[0]["span_us"] == 5.0 and lines[0]["plain_us"] == 4.6 and lines[1]["others_before"] == 3


def test_the_template_renders_the_run(out):
  doc = render.render(render.TEMPLATE.read_text(), render.load() + render.load(out / "results.jsonl"))
  side = doc[doc.index("## Side by side"):doc.index("## Evaluator and search")]
  assert "recorded yet" not in side
  assert "| tiny (synthetic, exact shapes) | 3 | sorted |  |" in side and "± 2.3 (337.1-341.5)" in side


def test_no_llama_cpp_when_told_and_decisive_routing(tmp_path):
  """LLAMA_BENCH=none: no llama.cpp line and no build; UPSTREAM=1: upstream tinygrad.llm's line before the configs'.
  ROUTING=decisive writes the file with decisive routers, where the gate's chained pass decides the check positions, so
  the timed run's tokens are compared."""
  env = os.environ | {"MODELS": "tiny", "DEVICE": "CPU", "CONFIGS": "baseline", "N": "4", "ROUNDS": "1",
                      "WORK": str(tmp_path), "OUT": str(tmp_path / "out"), "LLAMA_BENCH": "none", "ROUTING": "decisive",
                      "UPSTREAM": "1", "UPSTREAM_N": "4", "PYTHON": sys.executable}
  r = subprocess.run(["bash", "benchmarks/sidebyside.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  up, *lines = render.load(tmp_path / "out" / "results.jsonl")
  assert [x["kind"] for x in lines] == ["decode", "trial", "gate"] and "llama_cpp_tok_s" not in lines[0]
  assert (up["kind"], up["n_measured"], up["layers"]) == ("upstream", 1, 3) and render.missing(up) == [], up
  assert not (tmp_path / "llama").exists() and not (tmp_path / "out" / "llama-build.log").exists()
  assert ({x["model"] for x in lines} == {"tiny (synthetic, exact shapes, decisive routing)"}
          and "--routing decisive" in lines[0]["command"])
  assert lines[2]["check_ok"] and lines[2]["check_tokens_compared"] > 0, lines[2]


def test_a_carried_llama_bench_is_unpacked_not_built(tmp_path):
  """`llama_cpp.sh save` packs a build (on the device); sidebyside.sh unpacks pieces carried in $LLAMA_CACHE instead of
  building, when they come from the packed source and run; pieces of another source are refused."""
  built, cache, work = tmp_path / "built", tmp_path / "cache", tmp_path / "work"
  (built / "build/bin").mkdir(parents=True), (built / "llama.cpp").mkdir(), cache.mkdir()
  (built / "llama.cpp/SOURCE").write_text("llama-cpp-python 0.3.36 (PyPI sdist)\n")
  (bench := built / "build/bin/llama-bench").write_text(STAND_IN)
  bench.chmod(bench.stat().st_mode | stat.S_IEXEC)
  (built / "build/bin/libggml.so.0").write_bytes(os.urandom(1 << 20)), (built / "build/bin/libggml.so").symlink_to(
    "libggml.so.0")
  sh = lambda *a, **env: subprocess.run(["bash", "benchmarks/llama_cpp.sh", *a], cwd=ROOT,
                                        env=os.environ | {"LLAMA_CACHE": str(cache)} | env,
                                         capture_output=True, text=True, timeout=300)
  assert sh("save", str(built), str(cache)).returncode == 0 and list(cache.glob("llama-bench.tar.xz.part-*"))
  subprocess.run(["tar", "-czf", cache / "llama.cpp.tar.gz", "-C", built, "llama.cpp/SOURCE"], check=True)
  env = os.environ | {"MODELS": "tiny", "DEVICE": "CPU", "CONFIGS": "baseline", "N": "4", "ROUNDS": "1",
                      "WORK": str(work), "OUT": str(work / "out"), "LLAMA_CACHE": str(cache), "PYTHON": sys.executable}
  r = subprocess.run(["bash", "benchmarks/sidebyside.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0 and "the build carried in" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
  assert (work / "llama/build/bin/libggml.so").is_symlink() and not (work / "out/llama-build.log").exists()
  lines = render.load(work / "out/results.jsonl")
  assert ([x["kind"] for x in lines] == ["llama_cpp", "decode", "trial", "gate"]
          and lines[1]["llama_cpp_tok_s"] == 339.42)
  (built / "llama.cpp/SOURCE").write_text("llama-cpp-python 0.3.1 (PyPI sdist)\n")
  subprocess.run(["tar", "-czf", cache / "llama.cpp.tar.gz", "-C", built, "llama.cpp/SOURCE"], check=True)
  stale = sh("unpack", str(tmp_path / "again"))
  assert stale.returncode == 1 and "the carried llama-bench is of llama-cpp-python 0.3.36" in stale.stderr, stale.stderr


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path, subprocess.CompletedProcess]:
  """benchmarks/upstream_llm.py on a 2-block tiny file (a dense block, an MoE block), the GLM-4.7-Flash layout: q_lora,
  sigmoid routing with a selection bias, a shared expert."""
  tmp = tmp_path_factory.mktemp("upstream")
  f = write_synthetic(tmp / "tiny-q4_0.gguf", "tiny", quant="q4_0", layers=2)
  r = subprocess.run([sys.executable, "-m", "benchmarks.upstream_llm", "--model", str(f), "--tokens", "5", "--warmup",
                      "3", "--json", str(tmp / "up.json")], cwd=ROOT, env=os.environ | {"DEV": "CPU"},
                     capture_output=True, text=True, timeout=300)
  return f, tmp / "up.json", r


def test_upstream_decoder_runs_the_synthetic_file(upstream):
  """Upstream tinygrad.llm (with the stand-in for its missing tinygrad.llm.kernels.amd) decodes the file; the figures
  are those of the tokens its rollout JIT replays, after the prefill, the unjitted rollout call and the capture."""
  f, up, r = upstream
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  doc = json.loads(up.read_text())
  per, rest = doc["tok_s_per_token"], doc["tok_s_per_token"][3:]
  assert len(per) == 5 and doc["warmup_dropped"] == 3 and doc["n_measured"] == 2 and min(rest) > max(per[:3])
  assert (doc["tok_s_min"], doc["tok_s_max"]) == (min(rest), max(rest)) and doc["tok_s"] == round(sum(rest) / 2, 2)
  # the median of the tokens' times: the reciprocal of their rates' median only where the two rates are close
  assert abs(doc["ms_per_token"] - statistics.median(1e3 / t for t in rest)) < 0.01 * doc["ms_per_token"]
  assert doc["launches_per_token"] > 0 and doc["bytes_per_token"] > 0 and doc["gb_s"] >= 0
  assert (doc["device"], doc["tinygrad"], doc["tokenizer_pre_substituted"]) == ("CPU", "0.14.0", None)
  assert doc["upstream_command"] == f"DEV=CPU python -m tinygrad.llm --model {f} --benchmark 5"
  assert r.stdout.count(" tok/s, ") == 5 and '"tiny (synthetic)"' in doc["loaded"]


def test_upstream_json_is_a_results_line(upstream):
  f, up, _ = upstream
  rec = lambda *a: subprocess.run([sys.executable, "-m", "benchmarks.record", *a, "--device", "EPYC (CPU)", "--quant",
                                   "Q4_0", "--model-name", "tiny (synthetic, exact shapes)", "--command", "c"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
  line = json.loads(rec("upstream", str(up), "--model", str(f)))
  assert render.missing(line) == [] and (line["kind"], line["config"], line["layers"]) == (
    "upstream", "tinygrad.llm (upstream)", 2)
  assert {k: line[k] for k in ("tok_s", "launches_per_token", "bytes_per_token")} == {
    k: json.loads(up.read_text())[k] for k in ("tok_s", "launches_per_token", "bytes_per_token")}
  spec = "where: kind=upstream\n| config | tok/s |\n|---|---:|\n| {config} | {tok_s:.1f} |\n"
  assert render.table(spec, [line]).endswith(f"| tinygrad.llm (upstream) | {line['tok_s']:.1f} |\n")
  err = json.loads(rec("error", "--kind", "upstream", "--model", str(f), "--config-name", "tinygrad.llm (upstream)",
                       "--error", "upstream_llm failed"))
  assert render.missing(err) == [] and err["status"] == "error" and err["layers"] == 2


def test_upstream_failure_is_one_line(tmp_path):
  (bad := tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
  r = subprocess.run([sys.executable, "-m", "benchmarks.upstream_llm", "--model", str(bad), "--json",
                      str(tmp_path / "up.json")], cwd=ROOT, env=os.environ | {"DEV": "CPU"}, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 1 and not (tmp_path / "up.json").exists()
  assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(
    f"upstream_llm: error: tinygrad.llm on {bad}: struct.error: unpack requires"), r.stderr


def test_upstream_reads_an_unknown_tokenizer_preset_as_llama3():
  """DeepSeek-V2(-Lite) files say deepseek-llm, which upstream's tokenizer refuses; a decode from BOS needs none."""
  code = """from benchmarks.upstream_llm import install_kernels_stand_in, _lenient_tokenizer
install_kernels_stand_in()
from tinygrad.llm import cli
kv = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1, 1], "tokenizer.ggml.pre": "deepseek-llm"}
try: cli.SimpleTokenizer.from_gguf_kv(kv)
except ValueError as e: print(e)
_lenient_tokenizer(cli, seen := [])
print(cli.SimpleTokenizer.from_gguf_kv(kv).preset, seen)"""
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.stdout.splitlines() == ["Invalid tokenizer preset 'deepseek-llm'", "llama3 ['deepseek-llm']"], r.stderr
