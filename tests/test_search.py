"""The search agent end to end on the tiny model (CPU, real trial processes): SQLite study with the ladder, resume,
reuse of measured configs, the study's own tinygrad cache, confirmation, views and export; Ctrl-C; bad storage. (Killed
workers, protocol checks, the proxy's validation, replay and scaling out: tests/test_faults.py, test_protocol.py,
test_ladder.py, test_scaleout.py, with fake trials.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from sqlalchemy import create_engine, text

from model.registry import cache_dir
from model.structure import StructureConfig
from search.cli import main as search_main

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0"]


def search(*argv: str) -> int:
  try: search_main(list(argv))
  except SystemExit as e: return int(e.code or 0)
  return 0


def rows(url: str, sql: str) -> list:
  with create_engine(url).connect() as c: return list(c.execute(text(sql)))


def cli(*argv: str) -> subprocess.Popen:
  """`search` in a process of its own, with Ctrl-C's default action (a pytest-xdist worker ignores SIGINT, and a process
  started with a signal ignored keeps it ignored)."""
  return subprocess.Popen([sys.executable, "-m", "search", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.fixture(scope="module")
def model(gguf_file) -> str: return gguf_file("tiny", "q4_0")


def test_sqlite_study_end_to_end(model, tmp_path, capsys) -> None:
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", model, "--study", "t", "--storage", url, "--trials", "2", "--block-layers", "2",
                *FAST) == 0
  out = capsys.readouterr().out
  assert "trial   0" in out and "baseline" in out and "tiny" in out
  trials = rows(url,
                "SELECT number, state, stage, tok_s, block_tok_s, git_state_id, environment_id, config_json FROM "
                "ss_trial ORDER BY number")
  assert [t[0] for t in trials] == [0, 1] and all(t[1] in ("ok", "wrong_output", "pruned") or t[1] in
                                                        ("compile_error", "runtime_error", "oom", "timeout")
                                                     for t in trials)
  assert StructureConfig.from_json(trials[0][7]) == StructureConfig()  # the baseline is measured first
  ok = [t for t in trials if t[1] == "ok"]
  assert ok and all(t[2] == "full" and t[3] > 0 and t[5] and t[6] for t in ok)
  # the ladder: the baseline ran the proxy (2 of the 3 blocks), then the full model; the proxy costs most of a full
  # stage here, more than pruning can save, so the other trials run the full model only (search/proxy.py)
  assert trials[0][4] > 0 and all(t[4] is None for t in trials[1:] if t[1] != "pruned")
  assert (rows(url, "SELECT count(*) FROM ss_git_state")[0][0] == 1
          and rows(url, "SELECT count(*) FROM ss_environment")[0][0] >= 1)
  study = optuna.load_study(study_name="t", storage=url)
  # the proxy's figure is the trial's step 0 in Optuna, where the proxy ran
  assert [0 in t.intermediate_values for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE] == [
    t[4] is not None for t in trials if t[1] == "ok"]

  # resume: the same study goes on numbering; a config measured before is reused, not benchmarked again
  study.enqueue_trial(study.trials[0].params)
  assert search("start", "--model", model, "--study", "t", "--storage", url, "--trials", "4", "--block-layers", "2",
                *FAST) == 0
  assert "config already measured in trial 0" in capsys.readouterr().out
  trials = rows(url, "SELECT number, state, reused_from_id, tok_s FROM ss_trial ORDER BY number")
  assert [t[0] for t in trials] == list(range(4))
  reused = [t for t in trials if t[1] == "reused"]
  # a reused row points at its source (and is left out of the leaderboard)
  assert len(reused) == 1 and reused[0][2] == 1
  # a pruned trial keeps its proxy figure
  assert all(b for (b,) in rows(url, "SELECT block_tok_s FROM ss_trial WHERE state='pruned'"))

  # a changed space is refused for an existing study; the leaderboard, list and export
  assert search("start", "--model", model, "--study", "t", "--storage", url, "--trials", "5", *FAST[:-4], "--fix",
                "topk=sort") == 2
  assert "measures with --fix beam=0, not --fix beam=0 --fix topk=sort" in capsys.readouterr().err
  # its own tinygrad cache (BEAM choices, compiled programs)
  attrs = optuna.load_study(study_name="t", storage=url).user_attrs
  assert (cache_dir() / "tinygrad" / f"t-{attrs['cache_key']}" / "cache.db").stat().st_size > 0
  assert search("status", "--study", "t", "--storage", url) == 0 and "baseline" in capsys.readouterr().out
  assert search("list", "--storage", url) == 0 and "t" in capsys.readouterr().out
  assert search("export", "--study", "t", "--storage", url, "--out", str(tmp_path / "x.toml")) == 2
  assert "no confirmed winner" in capsys.readouterr().err

  # confirmation: A/B against the baseline, recorded and shown; two pairs at most (past --pairs, pairs go on while the
  # interval holds 1, up to 8 by default: on a loaded machine 16 trial processes; the sequential test itself is
  # tests/test_verdict.py's)
  assert search("confirm", "--study", "t", "--storage", url, "--top", "1", "--pairs", "2", "--max-pairs", "2",
                "--rounds", "1") == 0
  conf = rows(url, "SELECT status, pairs, speedup, speedup_low FROM ss_confirmation")
  assert len(conf) == 1 and conf[0][0] == "ok" and conf[0][1] == 2 and conf[0][2] > 0
  assert search("export", "--study", "t", "--storage", url, "--out", str(tmp_path / "x.toml"), "--unconfirmed",
                "--force") == 0
  measured = [StructureConfig.from_json(c) for (c,) in rows(url, "SELECT config_json FROM ss_trial WHERE state='ok'")]
  assert StructureConfig.load(str(tmp_path / "x.toml")) in measured

  # another study warm-started from this one: the baseline first, then this study's best configs, enqueued
  assert search("start", "--model", model, "--study", "w", "--storage", url, "--trials", "1", "--warm-start-from", "t",
                *FAST) == 0
  waiting = optuna.load_study(study_name="w", storage=url).get_trials(states=(optuna.trial.TrialState.WAITING,))
  best = rows(url, "SELECT config_json FROM ss_trial WHERE state='ok' AND study_id=1 ORDER BY tok_s DESC")
  assert waiting and len(waiting) <= len(best)
  assert search("start", "--model", model, "--study", "x", "--storage", url, "--warm-start-from", "nosuch", *FAST) == 2


def test_two_objectives_with_nsga2(model, tmp_path) -> None:
  url = f"sqlite:///{tmp_path / 'm.db'}"
  assert search("start", "--model", model, "--study", "m", "--storage", url, "--trials", "2", "--objectives",
                "tok_s,peak_memory", *FAST) == 0
  study = optuna.load_study(study_name="m", storage=url)
  assert study.user_attrs["sampler"] == "nsga2" and len(study.directions) == 2
  done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
  assert done and all(len(t.values) == 2 and t.values[1] > 0 for t in done)


def test_ctrl_c_stops_cleanly_and_the_study_continues(model, tmp_path) -> None:
  url = f"sqlite:///{tmp_path / 's.db'}"
  p = cli("start", "--model", model, "--study", "c", "--storage", url, "--trials", "2", *FAST)
  deadline = time.time() + 120
  while time.time() < deadline and not (os.path.exists(tmp_path / "s.db") and _has_running(url)): time.sleep(0.5)
  time.sleep(2)
  p.send_signal(signal.SIGINT)
  out, _ = p.communicate(timeout=60)
  assert p.returncode == 130 and "continues" in out, out
  assert rows(url, "SELECT number, state FROM ss_trial") == [(0, "interrupted")]
  assert search("start", "--study", "c", "--storage", url, "--confirm", "0") == 0  # the command the stop message gives
  trials = rows(url, "SELECT number, state, config_json FROM ss_trial ORDER BY number")
  assert ([(n, s) for n, s, _ in trials][0] == (0, "interrupted")
          and len([t for t in trials if t[1] != "interrupted"]) == 2)
  assert StructureConfig.from_json(trials[1][2]) == StructureConfig()  # the interrupted config runs first on resume


def _has_running(url: str) -> bool:
  try: return bool(rows(url, "SELECT 1 FROM ss_trial WHERE state='running'"))
  except Exception: return False  # noqa: BLE001 - the tables may not exist yet


@pytest.mark.parametrize("url, message", [
  ("postgresql+psycopg://nobody@127.0.0.1:1/none", "cannot reach the database"),
  ("mysql://x@y/z", "not supported"),
])
def test_bad_storage_is_one_line(url, message, capsys) -> None:
  assert search("list", "--storage", url) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1


def test_corrupt_sqlite_is_refused_and_kept(tmp_path, capsys) -> None:
  bad = tmp_path / "bad.db"
  bad.write_bytes(os.urandom(4096))
  before = bad.read_bytes()
  assert search("status", "--storage", f"sqlite:///{bad}") == 2
  assert "not a SQLite database" in capsys.readouterr().err and bad.read_bytes() == before


def test_worker_refuses_sqlite(capsys, tmp_path) -> None:
  assert search("worker", "--study", "x", "--storage", f"sqlite:///{tmp_path / 'a.db'}") == 2
  assert "postgresql+psycopg://" in capsys.readouterr().err


def test_a_joining_worker_sees_the_creators_space() -> None:
  """The ModelInfo stored with a study round-trips every field (a worker that lost ffn_quants saw no ffn_act knob, so a
  killed trial's config came back from Optuna's retry queue with a knob sampled anew: another config)."""
  from dataclasses import fields

  from search.study import info_from_json, info_to_json
  from space.knobs import ModelInfo
  info = ModelInfo(moe=True, dense_blocks=True, shared_experts=True,
                   quants={"dense": ("Q4_0", "Q8_0"), "expert": ("Q4_0",)}, mergeable=frozenset({"routed", "dense"}),
                   split_kv_b=False, ffn_quants=("Q4_0", "Q8_0"), attn_quants=("Q8_0",),
                   stage_order=("moe", "ffn", "attention", "router"))
  # no field at its default: each one is tested
  assert all(getattr(info, f.name) != f.default for f in fields(ModelInfo))
  assert info_from_json(info_to_json(info)) == info
  old = '{"moe": true, "dense_blocks": false, "shared_experts": false, "quants": {"expert": ["Q4_0"]}, "mergeable": []}'
  assert info_from_json(old) == ModelInfo(True, False, False, {"expert": ("Q4_0",)})
