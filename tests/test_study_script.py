"""benchmarks/study.sh end to end on the CPU with fake trials (tests/inject): a study created in one call and continued
in the next (the same name in the same database), every call's commands kept, and the whole study so far recorded as
results.jsonl lines with its time to best."""
import os
import pathlib
import subprocess
import sys

from inject.trialfakes import env as fake_env

from benchmarks import render

ROOT = pathlib.Path(__file__).resolve().parent.parent


def call(tmp: pathlib.Path, out: str, **extra: str) -> subprocess.CompletedProcess:
  env = fake_env(seconds=0.01) | {"MODEL": "tiny", "STUDY": "t", "DEVICE": "CPU", "WORK": str(tmp),
                                  "OUT": str(tmp / out), "PYTHON": sys.executable, "TRIAL_TIMEOUT": "30",
                                  "DEADLINE": "300"} | extra
  return subprocess.run(["bash", "benchmarks/study.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_study_created_then_continued_and_recorded(tmp_path) -> None:
  r = call(tmp_path, "a", ARGS="--no-prefill --fix beam=0 --seed 0", TRIALS="2")
  assert r.returncode == 0 and "creating t: search start --model" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
  first = render.load(tmp_path / "a" / "results.jsonl")
  assert [x["trial"] for x in first if x["kind"] == "trial"] == [0, 1]
  r = call(tmp_path, "b", TRIALS="4", CONFIRM="2")
  assert r.returncode == 0 and "continuing t" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
  lines = render.load(tmp_path / "b" / "results.jsonl")
  assert {i: m for i, x in enumerate(lines) if (m := render.missing(x))} == {}
  assert [x["trial"] for x in lines if x["kind"] == "trial"] == [0, 1, 2, 3]
  assert [x["kind"] for x in lines].count("confirmation") == 1 and lines[-1]["kind"] == "study"
  study = lines[-1]
  assert study["n"] == 4 and study["time_to_best_s"] is not None and study["best_tok_s"] > 0
  # the recorded command names both calls' search start lines (the first with its options) and the confirmation
  cmd = study["command"]
  assert cmd.count("search start") == 2 and "--fix beam=0" in cmd
  assert "search confirm --study t --top 1 --pairs 2" in cmd
  assert (tmp_path / "b" / "structsearch.db").exists() and (tmp_path / "b" / "t.commands").exists()
  assert os.path.getsize(tmp_path / "b" / "study.log") > 0
