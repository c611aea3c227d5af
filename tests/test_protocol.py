"""Settings never drift: a study keeps the protocol it was created with and continues from its name alone; every command
that measures checks the model file's hash; numbers are checked when the command line is read; reading commands never
create a database; a sampler that cannot run is refused before anything is made. Trials are fakes (tests/inject/)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import optuna
import pytest
from inject.trialfakes import install_fake_trials
from sqlalchemy import create_engine, text

from model.backends import catalog
from model.structure import StructureConfig
from search.cli import main as search_main

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0"]


def search(*argv: str) -> int:
  try: search_main(list(argv))
  except SystemExit as e: return int(e.code or 0)
  return 0


def rows(url: str, sql: str) -> list:
  e = create_engine(url)
  try:
    with e.connect() as c: return list(c.execute(text(sql)))
  finally: e.dispose()


def make_study(gguf_file, tmp_path) -> tuple[str, str]:
  """A 2-trial study "p" of a copy of the tiny model, created from a relative path; (storage URL, model path)."""
  model = tmp_path / "m" / "tiny.gguf"
  model.parent.mkdir()
  shutil.copy(gguf_file("tiny", "q4_0"), model)
  url = f"sqlite:///{tmp_path / 's.db'}"
  with pytest.MonkeyPatch.context() as mp:
    install_fake_trials(mp.setattr)
    mp.chdir(tmp_path)
    assert search("start", "--model", "m/tiny.gguf", "--study", "p", "--storage", url, "--trials", "2", *FAST) == 0
  return url, str(model)


@pytest.fixture
def study(gguf_file, tmp_path, monkeypatch) -> tuple[str, str]:
  install_fake_trials(monkeypatch.setattr)
  return make_study(gguf_file, tmp_path)


@pytest.fixture(scope="module")
def kept_study(gguf_file, tmp_path_factory) -> tuple[str, str]:
  """The same, shared by the tests that must leave it as it is."""
  return make_study(gguf_file, tmp_path_factory.mktemp("kept"))


def test_a_study_continues_from_its_name_with_its_stored_settings(study) -> None:
  url, model = study
  assert rows(url, "SELECT model_path FROM ss_study") == [(model,)]  # stored absolute, though given relative
  assert search("start", "--study", "p", "--storage", url, "--trials", "3") == 0
  assert len(rows(url, "SELECT 1 FROM ss_trial")) == 3
  attrs = optuna.load_study(study_name="p", storage=url).user_attrs
  assert (attrs["n"], attrs["rounds"], attrs["prefill"], attrs["seed"], attrs["fixed"],
          attrs["trials"]) == (6, 1, False, 0, {"beam": 0}, 3)
  # a study made before a setting existed continues with that setting's default
  e = create_engine(url)
  with e.begin() as c:
    c.execute(text("DELETE FROM study_user_attributes WHERE key = 'beam_budget'"))
    # and before its baseline was stored
    c.execute(text("UPDATE ss_study SET baseline_config = NULL, baseline_hash = NULL"))
  e.dispose()
  assert search("start", "--study", "p", "--storage", url, "--trials", "4") == 0
  assert len(rows(url, "SELECT 1 FROM ss_trial")) == 4
  # the defaults and its pin beam=0
  assert rows(url, "SELECT baseline_hash FROM ss_study") == [(StructureConfig().hash,)]


@pytest.mark.parametrize("change, message", [
  (["-n", "8"], "measures with -n 6, not -n 8"),
  (["--rounds", "3"], "measures with --rounds 1, not --rounds 3"),
  (["--block-layers", "2"], "measures with no --block-layers, not --block-layers 2"),
  (["--sampler", "random"], "measures with --sampler coordinate, not --sampler random"),
  (["--seed", "1"], "measures with --seed 0, not --seed 1"),
  (["--objectives", "tok_s,peak_memory"], "measures with --objectives tok_s, not --objectives tok_s,peak_memory"),
  (["--fix", "topk=sort"], "measures with --fix beam=0, not --fix topk=sort"),
  (["--beam-budget", "60"], "measures with --beam-budget 0.0, not --beam-budget 60.0"),
  (["--family", "portable"], "measures with --family all, not --family portable"),
  (["--context", "128"], "measures with --context 0 (decode right after the prompt), not --context 128"),
  (["--prompt", "64"], "measures with --prompt 32, not --prompt 64"),
])
def test_a_later_run_cannot_change_the_protocol(kept_study, capsys, change, message) -> None:
  url, _ = kept_study
  before = (optuna.load_study(study_name="p", storage=url).user_attrs, rows(url, "SELECT number, state FROM ss_trial"))
  assert search("start", "--study", "p", "--storage", url, *change) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and "start a new study with --study NEW_NAME" in err and len(err.splitlines()) == 1, err
  assert ((optuna.load_study(study_name="p", storage=url).user_attrs, rows(url, "SELECT number, state FROM ss_trial"))
          == before)


def test_a_studys_beam_budget_reaches_its_trials(gguf_file, tmp_path, monkeypatch) -> None:
  from search.study import load_setup
  install_fake_trials(monkeypatch.setattr)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--study", "b", "--storage", url, "--trials", "1", *FAST,
                "--beam-budget", "60") == 0
  ev = load_setup("b", url)[0].evaluator()
  assert ev.beam_budget == 60.0 and ev.spec({}).beam_budget_s == 60.0


def test_one_baseline_with_the_pins_and_a_portable_study_on_cuda(gguf_file, tmp_path, monkeypatch, capsys) -> None:
  """The study stores one baseline, the defaults with its pins (topk=sort here, not the default): the worker measures it
  first and again between trials, the confirmation A/B-tests against it, and the views compare with it. --family
  portable holds a CUDA study to the portable backends (the coordinate sampler's first changes would be native)."""
  install_fake_trials(monkeypatch.setattr)
  url, model = f"sqlite:///{tmp_path / 's.db'}", gguf_file("tiny", "q4_0")
  argv = ["--device", "CUDA", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--fix", "topk=sort",
          "--seed", "0", "--family", "portable", "--confirm", "1", "--pairs", "2"]
  assert search("start", "--model", model, "--study", "b", "--storage", url, "--trials", "6", *argv) == 0
  capsys.readouterr()
  base = StructureConfig(topk="sort")
  assert rows(url, "SELECT baseline_hash, baseline_config FROM ss_study") == [(base.hash, base.to_json())]
  trials = rows(url, "SELECT number, config_json, config_hash FROM ss_trial ORDER BY number")
  assert trials[0][2] == base.hash and len({h for _, _, h in trials}) == len(trials) >= 6
  used = {b for _, c, _ in trials for b in (*StructureConfig.from_json(c).fused.values(),
                                            *StructureConfig.from_json(c).backends.values())}
  assert "dsl" in used and all(catalog.get(b).portable for b in used)
  untried = {kind: {h for k, h, t in rows(url, "SELECT kind, config_hash, trial_id FROM ss_measurement") if k == kind
                    and t is None}
             for kind in ("repeat", "confirm")}
  assert untried == {"repeat": {base.hash}, "confirm": {base.hash}}  # the baseline's repeats and A/B runs
  assert search("leaderboard", "--study", "b", "--storage", url, "--state", "all", "--format", "json") == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["baseline_hash"] == base.hash and doc["baseline"]["trial"] == 0
  assert all((r["changes"] == {}) == (r["config_hash"] == base.hash) and "topk" not in r["changes"]
             for r in doc["rows"])
  assert search("show", "--study", "b", "--storage", url, "baseline", "--format", "json") == 0
  assert json.loads(capsys.readouterr().out)["trial"] == 0
  assert search("start", "--study", "b", "--storage", url, "--device", "CUDA", "--family", "all") == 2
  assert "measures with --family portable, not --family all" in capsys.readouterr().err


@pytest.mark.parametrize("device, native", [("CPU", False), ("METAL", False), ("AMD", False), ("CUDA", True)])
def test_search_space_lists_what_runs_on_the_device(gguf_file, capsys, device: str, native: bool) -> None:
  assert search("space", "--model", gguf_file("tiny", "q4_0"), "--device", device) == 0
  out = capsys.readouterr().out
  assert ("native" in out) == native and "dsl" in out
  assert search("space", "--model", gguf_file("tiny", "q4_0"), "--device", device, "--family", "portable") == 0
  out = capsys.readouterr().out
  assert "native" not in out and "dsl" in out and "portable backends" in out


def test_prefill_is_part_of_the_protocol(gguf_file, tmp_path, monkeypatch, capsys) -> None:
  install_fake_trials(monkeypatch.setattr)
  url, model = f"sqlite:///{tmp_path / 's.db'}", gguf_file("tiny", "q4_0")
  assert search("start", "--model", model, "--study", "q", "--storage", url, "--trials", "1", *FAST[:2], "--confirm",
                "0") == 0
  assert search("start", "--study", "q", "--storage", url, "--no-prefill") == 2
  assert "measures with the prefill graph timed (no --no-prefill), not --no-prefill" in capsys.readouterr().err


def test_every_measuring_command_checks_the_model_file(study, tmp_path, capsys) -> None:
  url, model = study
  copy = shutil.copy(model, tmp_path / "copy.gguf")
  with open(model, "ab") as f: f.write(b"\0" * 64)  # the same path, another file
  for cmd in (["start", "--study", "p"], ["confirm", "--study", "p", "--top", "1", "--pairs", "2"]):
    assert search(*cmd, "--storage", url) == 2
    err = capsys.readouterr().err
    assert f"{model} (sha256 " in err and "is not the model file of study 'p'" in err, err
  os.remove(model)
  assert search("start", "--study", "p", "--storage", url) == 2
  assert "which is not on this host: pass --model" in capsys.readouterr().err
  assert len(rows(url, "SELECT 1 FROM ss_trial")) == 2  # nothing measured
  # this host's copy of the file
  assert search("start", "--study", "p", "--storage", url, "--model", str(copy), "--trials", "3") == 0
  assert len(rows(url, "SELECT 1 FROM ss_trial")) == 3


@pytest.mark.parametrize("argv, message", [
  (["start", "--model", "tiny", "--trials", "0"], "--trials: 0 is below 1"),
  (["start", "--model", "tiny", "--trials", "-3"], "--trials: -3 is below 1"),
  (["start", "--model", "tiny", "-n", "0"], "-n: 0 is below 2"),
  (["start", "--model", "tiny", "--rounds", "0"], "--rounds: 0 is below 1"),
  (["start", "--model", "tiny", "--trial-timeout", "-5"], "--trial-timeout: -5 is below 0"),
  (["start", "--model", "tiny", "--beam-budget", "-1"], "--beam-budget: -1 is below 0"),
  (["start", "--model", "tiny", "--timeout", "0"], "--timeout: 0 is not a positive number of seconds"),
  (["worker", "--study", "x", "--heartbeat", "0"], "--heartbeat: 0 is not a positive number of seconds"),
  # one A/B pair has no spread: its interval is a point
  (["confirm", "--study", "x", "--pairs", "1"], "--pairs: 1 is below 2"),
  (["start", "--model", "tiny", "--pairs", "1"], "--pairs: 1 is below 2"),
  (["leaderboard", "--study", "x", "--top", "0"], "--top: 0 is below 1"),
  (["leaderboard", "--study", "x", "--top", "-1"], "--top: -1 is below 1"),
  (["dashboard", "--port", "99999"], "--port: 99999 is not a port number"),
  (["start", "--model", "tiny", "--device", "BOGUS"], "--device: 'BOGUS' is not a tinygrad device"),
  (["start", "--model", "tiny", "--devices", "CPU,CUDA:x"], "--devices: 'CUDA:x' is not a tinygrad device"),
  (["replay", "--study", "x", "--trials", "2.5"], "--trials: '2.5' is not an integer"),
])
def test_numbers_are_checked_when_the_command_line_is_read(argv, message, tmp_path, monkeypatch, capsys) -> None:
  monkeypatch.chdir(tmp_path)
  assert search(*argv) == 2
  assert message in capsys.readouterr().err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [["status"], ["status", "--study", "x"], ["list"], ["export", "--study", "x"],
                                  ["replay", "--study", "x"], ["confirm", "--study", "x"], ["start", "--study", "x"],
                                  ["report", "--study", "x", "--out", "rep"], ["dashboard"],
                                  ["leaderboard", "--study", "x"], ["show", "--study", "x", "0"],
                                  ["cost", "--study", "x"]])
def test_reading_commands_never_create_a_database(argv, tmp_path, capsys, monkeypatch) -> None:
  monkeypatch.chdir(tmp_path)
  path = tmp_path / "typo.db"
  assert search(*argv, "--storage", f"sqlite:///{path}") == 2
  err = capsys.readouterr().err.strip()
  assert err in (f"search: error: no database at {path}",
                 f"search: error: no study named 'x' in sqlite:///{path}: pass --model to create it")
  assert os.listdir(tmp_path) == []


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="PyTorch is installed: the gp sampler can run")
def test_a_sampler_that_cannot_run_is_refused_before_anything_is_made(gguf_file, tmp_path, capsys) -> None:
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--storage", url, "--sampler", "gp", *FAST) == 2
  assert "the gp sampler needs torch" in capsys.readouterr().err and not (tmp_path / "s.db").exists()
