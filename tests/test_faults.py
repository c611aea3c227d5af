"""Faults leave nothing stuck: a worker killed with SIGKILL in every order of events (the study resumed at once, resumed
later at its target, another worker finishing first), on SQLite and PostgreSQL; a failing baseline stops the study; a
killed trial's config is measured again, up to the retry limit. Trials are fakes (tests/inject/trialfakes.py): what is
tested is the search around them, in real `search` processes killed for real."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from inject.trialfakes import install_fake_trials
from sqlalchemy import create_engine, text

from search.cli import main as search_main

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0", "--heartbeat", "0.5"]


def search(*argv: str) -> int:
  try: search_main(list(argv))
  except SystemExit as e: return int(e.code or 0)
  return 0


def rows(url: str, sql: str, **params) -> list:
  e = create_engine(url)
  try:
    with e.connect() as c: return list(c.execute(text(sql), params))
  finally: e.dispose()


def started(inject, *argv: str, seconds: float = 1.0) -> subprocess.Popen:
  """`search ARGV` in its own process (and process group) with fake trials of `seconds` each."""
  return subprocess.Popen([sys.executable, "-m", "search", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=inject(seconds=seconds), start_new_session=True)


def running_trial(url: str, proc: subprocess.Popen, timeout: float = 60) -> int:
  """The number of the trial `proc` is running, once it runs one."""
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    try: mine = rows(url, "SELECT number FROM ss_trial WHERE state='running' AND worker LIKE :w", w=f"%:{proc.pid}")
    except Exception: mine = []  # noqa: BLE001 - the tables may not exist yet
    if mine: return mine[0][0]
    time.sleep(0.2)
  raise AssertionError(f"no running trial of pid {proc.pid}: "
                       f"{proc.communicate()[0] if proc.poll() is not None else 'still starting'}")


def kill(proc: subprocess.Popen) -> None:
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()


def assert_nothing_stuck(url: str, study: str, killed: int, target: int) -> None:
  """No trial RUNNING in Optuna or ours; the killed one interrupted, its config measured again by a later trial."""
  states = [t.state for t in optuna.load_study(study_name=study, storage=url).trials]
  assert optuna.trial.TrialState.RUNNING not in states
  ours = {n: (s, h) for n, s, h in rows(url, "SELECT number, state, config_hash FROM ss_trial")}
  assert "running" not in [s for s, _ in ours.values()] and ours[killed][0] == "interrupted"
  assert [n for n, (s, h) in ours.items() if n > killed and h == ours[killed][1] and s in ("ok", "reused")], ours
  assert len([s for s, _ in ours.values() if s != "interrupted"]) >= target


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
  return f"sqlite:///{tmp_path / 's.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")


@pytest.fixture(scope="module")
def model(gguf_file) -> str: return gguf_file("tiny", "q4_0")


def test_killed_worker_resumed_at_once(model, url, inject, monkeypatch) -> None:
  p = started(inject, "start", "--model", model, "--study", "k", "--storage", url, "--trials", "3", *FAST)
  killed = running_trial(url, p)
  kill(p)
  install_fake_trials(monkeypatch.setattr, seconds=0.2)
  # at once: the killed trial's heartbeat is fresh
  assert search("start", "--study", "k", "--storage", url, "--heartbeat", "0.5") == 0
  assert_nothing_stuck(url, "k", killed, 3)


def test_killed_worker_resumed_later_at_its_target(model, url, inject, monkeypatch) -> None:
  p = started(inject, "start", "--model", model, "--study", "k", "--storage", url, "--trials", "2", *FAST)
  running_trial(url, p)
  while not rows(url, "SELECT 1 FROM ss_trial WHERE state = 'ok'"): time.sleep(0.2)
  killed = running_trial(url, p)  # the second trial
  kill(p)
  time.sleep(4)  # past the grace period (3 s at --heartbeat 0.5)
  install_fake_trials(monkeypatch.setattr, seconds=0.2)
  # at its target, a trial RUNNING
  assert search("start", "--study", "k", "--storage", url, "--trials", "1", "--heartbeat", "0.5") == 0
  assert_nothing_stuck(url, "k", killed, 1)


def test_a_worker_killed_before_its_first_heartbeat(model, url, inject, monkeypatch) -> None:
  """A worker killed between starting a trial and its first heartbeat leaves a RUNNING trial that Optuna never fails (it
  has no heartbeat to go stale); the next run fails it once the grace period has passed and reaches its target."""
  install_fake_trials(monkeypatch.setattr, seconds=0.2)
  assert search("start", "--model", model, "--study", "k", "--storage", url, "--trials", "2", *FAST) == 0
  optuna.load_study(study_name="k", storage=url).ask()  # started by a worker that died before it beat: no heartbeat
  time.sleep(4)  # past the grace period (3 s at --heartbeat 0.5)
  assert search("start", "--study", "k", "--storage", url, "--trials", "3", "--heartbeat", "0.5") == 0
  trials = optuna.load_study(study_name="k", storage=url).trials
  assert optuna.trial.TrialState.RUNNING not in [t.state for t in trials] and len([
    t for t in trials if t.state.is_finished()]) >= 3


def test_killed_worker_while_another_finishes_first(model, pg_url, inject) -> None:
  args = ["--storage", pg_url, "--heartbeat", "0.5"]
  first = started(inject, "start", "--model", model, "--study", "pg", "--trials", "3", *FAST, *args)
  running_trial(pg_url, first)
  second = started(inject, "worker", "--study", "pg", *args, seconds=30)
  killed = running_trial(pg_url, second)
  kill(second)
  out, _ = first.communicate(timeout=120)
  assert first.returncode == 0 and f"trial {killed} of worker" in out and "stopped beating" in out, out
  assert_nothing_stuck(pg_url, "pg", killed, 3)


def test_two_starts_creating_one_study_at_once(model, url, inject) -> None:
  """Two `search start` that both find no study and set out to create it: one creates it, the other joins it (before: on
  SQLite KeyError 'model_info' or "table study_directions already exists", on PostgreSQL an IntegrityError on
  uq_ss_study_name)."""
  env = inject("slow_study_creation", seconds=0.2)
  argv = [sys.executable, "-m", "search", "start", "--model", model, "--study", "two", "--storage", url, "--trials",
          "3", *FAST]
  procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
           for _ in range(2)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0] and "Traceback" not in "".join(outs), outs
  assert (rows(url, "SELECT name FROM ss_study") == [("two",)]
          and [s.study_name for s in optuna.get_all_study_summaries(url)] == ["two"])
  trials = optuna.load_study(study_name="two", storage=url).trials
  assert (len([t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]) >= 3
          and "model_info" in optuna.load_study(study_name="two", storage=url).user_attrs)


def test_failing_baseline_stops_the_study(model, tmp_path, monkeypatch, capsys) -> None:
  url = f"sqlite:///{tmp_path / 's.db'}"
  # no reference of this file yet: the baseline's run makes it
  monkeypatch.setenv("STRUCTSEARCH_CACHE", str(tmp_path / "cache"))
  install_fake_trials(monkeypatch.setattr, status="runtime_error")
  assert search("start", "--model", model, "--study", "b", "--storage", url, "--trials", "4", *FAST) == 1
  err = capsys.readouterr().err.strip()
  assert err == ("search: error: the baseline config failed to make the reference in trial 0 (runtime_error: injected "
                 "runtime_error): the study stops")
  assert rows(url, "SELECT number, state FROM ss_trial") == [(0, "runtime_error")]
  # the cause fixed: the baseline is measured again, first, and the study goes on
  install_fake_trials(monkeypatch.setattr)
  assert search("start", "--study", "b", "--storage", url) == 0
  assert rows(url, "SELECT number, state FROM ss_trial ORDER BY number")[:2] == [(0, "runtime_error"), (1, "ok")]


def test_killed_config_is_measured_again_up_to_the_retry_limit(model, tmp_path, monkeypatch) -> None:
  """A tiny sub-space (topk alone, 3 configs) sampled at random 12 times: the config that is always killed is measured
  again each time it is proposed, 3 times in all (store.RETRIES = 2), then its last failure stands."""
  from inject.trialfakes import fake_run_process
  url = f"sqlite:///{tmp_path / 's.db'}"
  ok, sigkill = fake_run_process(), fake_run_process(status="killed")
  install_fake_trials(monkeypatch.setattr)
  monkeypatch.setattr("evaluator.runner.run_process", lambda spec,
                      *a: (sigkill if spec.config["topk"] == "sort" else ok)(spec, *a))
  from search.study import model_info
  from space.knobs import knobs
  pins = [f"--fix={k.name}={k.default}" for k in knobs(model_info(model), "CPU") if k.name != "topk"]
  args = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--confirm", "0", "--seed", "3", "--sampler",
          "random"]
  assert search("start", "--model", model, "--study", "r", "--storage", url, "--trials", "12", *args, *pins) == 0
  sort = [s for s, c in rows(url, "SELECT state, config_json FROM ss_trial ORDER BY number") if '"topk": "sort"' in c]
  assert len(sort) > 3 and sort[:3] == ["killed"] * 3 and set(sort[3:]) == {"reused"}, sort


def test_a_killed_config_is_measured_again_under_the_default_sampler(model, tmp_path, monkeypatch) -> None:
  """The coordinate sampler never proposes a config twice: the worker queues a config killed from outside again itself,
  up to the retry limit, and those kills do not count toward the target (3 trials: the baseline, topk=sort killed 3
  times, topk=argmax)."""
  from inject.trialfakes import fake_run_process

  from search.study import model_info
  from space.knobs import knobs
  url = f"sqlite:///{tmp_path / 's.db'}"
  ok, sigkill = fake_run_process(), fake_run_process(status="killed")
  install_fake_trials(monkeypatch.setattr)
  monkeypatch.setattr("evaluator.runner.run_process",
                      lambda spec, *a: (sigkill if spec.config["topk"] == "sort" else ok)(spec, *a))
  pins = [f"--fix={k.name}={k.default}" for k in knobs(model_info(model), "CPU") if k.name != "topk"]
  args = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--confirm", "0", "--seed", "0"]
  assert search("start", "--model", model, "--study", "k", "--storage", url, "--trials", "3", *args, *pins) == 0
  states = [(s, '"topk": "sort"' in c) for s, c in rows(url, "SELECT state, config_json FROM ss_trial ORDER BY number")]
  assert [s for s, sort in states if sort] == ["killed"] * 3, states
  assert [s for s, sort in states if not sort] == ["ok", "ok"], states
  attrs = [t.user_attrs for t in optuna.load_study(study_name="k", storage=url).trials]
  assert sum(a.get("retried") == "killed" for a in attrs) == 2 and sum(a.get("failure") == "killed" for a in attrs) == 1


def test_a_late_result_is_a_measurement_not_a_verdict(model, url, monkeypatch) -> None:
  """A worker stalled past the grace period while its trial ran: another worker failed the trial and queued its config
  again. When the stalled worker comes back, its figure is stored as a measurement of the config, the trial stays
  interrupted, the worker goes on (no "Cannot tell a FAIL trial"), and the leaderboard lists the config's retry."""
  from inject.trialfakes import fake_run_process

  from db import store
  from db.engine import open_db, session
  from db.models import Trial
  from search.leaderboard import leaderboard
  from search.study import storage
  ok, stalled = fake_run_process(), []
  def run_process(spec, *a):
    if spec.config["topk"] != "pairwise" and not stalled:  # the baseline's first change: failed by "another worker"
      st = storage(url)
      study = optuna.load_study(study_name="l", storage=st)
      t = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))[0]
      st.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
      st.get_heartbeat_stale_trial_callback()(study, st.get_trial(t._trial_id))
      stalled.append(t.number)
    return ok(spec, *a)
  install_fake_trials(monkeypatch.setattr)
  monkeypatch.setattr("evaluator.runner.run_process", run_process)
  from search.study import model_info
  from space.knobs import knobs
  pins = [f"--fix={k.name}={k.default}" for k in knobs(model_info(model), "CPU") if k.name != "topk"]
  assert search("start", "--model", model, "--study", "l", "--storage", url, "--trials", "3", *FAST, *pins) == 0
  (n,) = stalled
  ours = {number: (state, h) for number, state, h in rows(url, "SELECT number, state, config_hash FROM ss_trial")}
  assert ours[n][0] == "interrupted"
  assert "came after its trial was failed" in rows(url, f"SELECT error_text FROM ss_trial WHERE number={n}")[0][0]
  again = [m for m, (s, h) in ours.items() if m > n and h == ours[n][1]]
  assert again and ours[again[0]][0] in ("ok", "reused")
  with session(open_db(url)) as s:
    st = store.get_study(s, "l")
    late = [m for m in store.measurements(s, st) if m.trial_id is not None and s.get(Trial, m.trial_id).number == n]
    board = leaderboard(s, st)
  assert len(late) == 1 and late[0].kind == "trial"
  assert ours[n][1] in [r["config_hash"] for r in board["rows"]] and n not in [r["trial"] for r in board["rows"]]
