"""A study's workload (search start --context/--prompt): fixed at creation and given to its trials, shown by every view
and in the exported production config, whose workload `model bench` compares with its own; a workload that cannot run is
refused before anything is made; prefill_tok_s as an objective. Trials are fakes (tests/inject/) but model bench's."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import optuna
from inject.trialfakes import install_fake_trials
from test_protocol import FAST, search

from model.gguf_file import GGUFFile
from search.study import Setup, load_setup
from space.knobs import ModelInfo


def test_a_studys_workload_reaches_its_trials_views_and_export(gguf_file, tmp_path, monkeypatch, capsys) -> None:
  install_fake_trials(monkeypatch.setattr)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--study", "w", "--storage", url, "--trials", "2", *FAST,
                "--context", "128", "--prompt", "16") == 0
  out = capsys.readouterr().out
  assert "workload: context 128, prompt 16: weights " in out and "GB in float16" in out
  setup = load_setup("w", url)[0]
  ev = setup.evaluator()
  assert (setup.context, setup.prompt, ev.context, ev.prompt_len) == (128, 16, 128, 16)
  spec = ev.spec({})
  assert spec.context == 128 and spec.prompt_len == 16 and spec.max_context == 256
  for view in (["leaderboard"], ["status"], ["show", "0"], ["cost"], ["compare", "0", "1"]):
    assert search(*view[:1], "--study", "w", "--storage", url, *view[1:]) == 0, view
    assert "context 128, prompt 16" in capsys.readouterr().out, view
  assert search("status", "--storage", url, "--format", "json") == 0 and '"workload": "context 128, prompt 16"' in (
    capsys.readouterr().out)
  to = tmp_path / "prod.toml"
  assert search("export", "--study", "w", "--storage", url, "--trial", "1", "--unconfirmed", "--force", "--to",
                str(to)) == 0, capsys.readouterr()
  assert "# workload: context=128 prompt=16\n" in to.read_text()


def test_a_workload_that_cannot_run_is_refused_before_anything_is_made(gguf_file, tmp_path, capsys) -> None:
  db = tmp_path / "s.db"
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--storage", f"sqlite:///{db}", *FAST,
                "--context", "4000") == 1
  err = capsys.readouterr().err.strip()
  assert err == ("search: error: context 4000, prompt 32 needs 4016 positions, past the model's context length of "
                 "2048") and not db.exists()
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--storage", f"sqlite:///{db}", *FAST,
                "--context", "16") == 2
  assert "shorter than the prompt of 32 tokens" in capsys.readouterr().err and not db.exists()


def test_prefill_is_an_objective(gguf_file, tmp_path, monkeypatch, capsys) -> None:
  install_fake_trials(monkeypatch.setattr)
  url = f"sqlite:///{tmp_path / 's.db'}"
  argv = ["start", "--model", gguf_file("tiny", "q4_0"), "--study", "pp", "--storage", url, "--trials", "1",
          *[a for a in FAST if a != "--no-prefill"], "--objectives", "tok_s,prefill_tok_s"]
  assert search(*argv) == 0
  study = optuna.load_study(study_name="pp", storage=url)
  assert [d.name for d in study.directions] == ["MAXIMIZE", "MAXIMIZE"]
  assert study.metric_names == ["tok/s", "prefill tok/s"]
  assert search(*argv[:4], "pq", *argv[5:], "--no-prefill") == 2
  assert "the prefill_tok_s objective times the prompt's prefill" in capsys.readouterr().err


def test_model_bench_takes_the_workload_and_names_a_mismatch(gguf_file, tmp_path) -> None:
  cfg = tmp_path / "chosen.toml"
  cfg.write_text("# structsearch production config: study 's'\n# workload: context=96 prompt=32\ntopk = \"sort\"\n")
  run = lambda *a: subprocess.run([sys.executable, "-m", "model", "bench", "--model", gguf_file("tiny", "q4_0"),
                                   "--layers", "1", "-n", "2", "--rounds", "1", "--config", str(cfg), "--json", *a],
                                  capture_output=True, text=True, timeout=600, cwd=pathlib.Path(__file__).parent.parent)
  r = run()
  assert r.returncode == 0, r.stderr
  assert ("note: this config was chosen at context 96, prompt 32; this run is at context 32, prompt 32 (decode right "
          "after it)") in r.stderr
  deep = run("--context", "96")
  assert deep.returncode == 0 and "note:" not in deep.stderr, deep.stderr
  import json
  a, b = (json.loads(x.stdout.splitlines()[-1]) for x in (r, deep))
  assert (a["context"], b["context"]) == (32, 96) and b["bytes_per_token"] > a["bytes_per_token"] and b["ttft_s"] > 0
  refused = run("--context", "4000")
  assert refused.returncode == 1 and refused.stderr.strip().endswith("past the model's context length of 2048")


def test_prefill_knobs_are_searched_only_where_the_prompt_is_timed(gguf_file) -> None:
  """How the prompt is prefilled is part of a study's space only when prefill_tok_s is one of its objectives and it
  prefills: elsewhere those knobs change nothing the study measures."""
  info = ModelInfo.from_gguf(GGUFFile(gguf_file("tiny", "q4_0")))
  names = lambda **kw: {k.name for k in Setup("s", "m", "m", "CPU", **kw).knobs(info)}
  assert {"prefill_ffn", "prefill_attention"} <= names(objectives="tok_s,prefill_tok_s")
  for kw in ({}, {"objectives": "tok_s,peak_memory"}, {"objectives": "tok_s,prefill_tok_s", "prefill": False}):
    got = names(**kw)
    assert got and not any(n.startswith("prefill_") for n in got), kw
