"""`search rename OLD NEW`: both ledgers renamed at once (Optuna's study and ours), on SQLite and PostgreSQL; every
view, the dashboard's storage and a worker's setup find it by its new name; bad input changes nothing."""
from __future__ import annotations

import subprocess
import sys

import optuna
import pytest
from sqlalchemy import create_engine, text

from model.structure import StructureConfig
from search.cli import main as search_main
from search.ranked import RankedStorage
from search.study import load_setup, stored_baseline

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0"]


def start(*argv: str) -> None:
  """`search start` of fake trials (tests/inject/trialfakes.py: no tinygrad), in a process of its own."""
  from inject.trialfakes import env
  r = subprocess.run([sys.executable, "-m", "search", "start", *argv], capture_output=True, text=True,
                     env=env(seconds=0.02), stdin=subprocess.DEVNULL)
  assert r.returncode == 0, r.stderr


def search(capsys, *argv: str) -> tuple[int, str, str]:
  """A `search` command in this process: (exit code, stdout, stderr)."""
  try: search_main(list(argv)); rc = 0
  except SystemExit as e: rc = int(e.code or 0)
  out = capsys.readouterr()
  return rc, out.out, out.err


def names(url: str) -> tuple[list[str], list[str]]:
  """(Optuna's study names, ours)."""
  e = create_engine(url)
  try:
    with e.connect() as c:
      return (sorted(c.execute(text("SELECT study_name FROM studies")).scalars()),
              sorted(c.execute(text("SELECT name FROM ss_study")).scalars()))
  finally: e.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
  return f"sqlite:///{tmp_path / 's.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")


def test_rename_moves_both_ledgers_and_every_view_follows(gguf_file, url, capsys) -> None:
  start("--model", gguf_file("tiny", "q4_0"), "--study", "old", "--storage", url, "--trials", "2", *FAST)
  optuna.create_study(study_name="taken", storage=url)  # a name Optuna's ledger alone holds is taken too
  before = names(url)
  for argv, why in ((("nope", "new"), "no study named 'nope'"), (("old", "taken"), "named 'taken' is in"),
                    (("old", ""), "the new name is empty"), (("old", "  "), "the new name is empty"),
                    (("old", " x"), "starts or ends with a space"), (("old", "a\nb"), "control character")):
    rc, _, err = search(capsys, "rename", *argv, "--storage", url)
    assert rc == 2 and why in err and err.count("\n") == 1, (argv, err)
    assert names(url) == before  # nothing changed
  rc, out, err = search(capsys, "rename", "old", "new", "--storage", url)
  assert rc == 0 and "study 'old' is now 'new'" in out, err
  assert names(url) == (["new", "taken"], ["new"])
  for view in (("status",), ("list",), ("leaderboard", "--study", "new"), ("best", "--study", "new")):
    rc, out, err = search(capsys, *view, "--storage", url)
    assert rc == 0 and "new" in out and "old" not in out, (view, err)
  rc, _, err = search(capsys, "leaderboard", "--study", "old", "--storage", url)
  assert rc == 2 and "no study named 'old'" in err
  dash = RankedStorage(url)  # the dashboard's storage
  assert sorted(s.study_name for s in dash.get_all_studies()) == ["new", "taken"]
  # what a worker that continues the study reads: its protocol (Optuna's) and its baseline (ours) under the new name
  setup, info = load_setup("new", url)
  assert setup.name == "new" and stored_baseline(url, setup, info).hash == StructureConfig().hash
