"""`search delete`: a study leaves both ledgers and its artifact files, only when asked with --yes (or a terminal's
yes), and a study that only Optuna's ledger holds is removed too."""
from __future__ import annotations

import subprocess
import sys

import optuna
from sqlalchemy import create_engine, text

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0"]


def search(*argv: str, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "search", *argv], capture_output=True, text=True, env=env,
                        stdin=subprocess.DEVNULL)


def count(url: str, table: str) -> int:
  e = create_engine(url)
  try:
    with e.connect() as c: return c.execute(text(f"SELECT count(*) FROM {table}")).scalar()
  finally: e.dispose()


def test_delete_removes_both_ledgers_and_the_artifacts(gguf_file, tmp_path) -> None:
  from inject.trialfakes import env
  # the artifacts in a folder of their own (--artifacts): delete finds them only where it is told
  url, arts = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "arts"
  r = search("start", "--model", gguf_file("tiny", "q4_0"), "--study", "gone", "--storage", url, "--trials", "2", *FAST,
             "--artifacts", str(arts), env=env(seconds=0.05))
  assert r.returncode == 0, r.stderr
  assert count(url, "ss_trial") >= 2 and any(p.is_file() for p in arts.rglob("*"))
  r = search("delete", "--study", "gone", "--storage", url)  # no terminal to ask: refused, nothing removed
  assert r.returncode == 2 and "add --yes" in r.stderr and "gone" in optuna.get_all_study_names(url)
  r = search("delete", "--study", "gone", "--storage", url, "--yes", "--artifacts", str(arts))
  assert r.returncode == 0 and "removed study 'gone'" in r.stdout, r.stderr
  assert optuna.get_all_study_names(url) == []
  assert [count(url, t) for t in ("ss_study", "ss_trial", "ss_measurement")] == [0, 0, 0]
  assert not [p for p in arts.rglob("*") if p.is_file()]
  r = search("delete", "--study", "gone", "--storage", url, "--yes")
  assert r.returncode == 2 and "no study named 'gone'" in r.stderr


def test_delete_removes_a_study_only_optuna_holds(tmp_path) -> None:
  from db.engine import open_db
  url = f"sqlite:///{tmp_path / 's.db'}"
  r = search("delete", "--study", "x", "--storage", url, "--yes")
  assert r.returncode == 2 and "no database at" in r.stderr  # nothing is created
  open_db(url).dispose()
  optuna.create_study(study_name="broken", storage=url)  # in Optuna's tables alone, as another tool leaves one
  r = search("delete", "--study", "broken", "--storage", url, "--yes")
  assert r.returncode == 0 and "only Optuna's ledger holds it" in r.stdout, r.stdout + r.stderr
  assert optuna.get_all_study_names(url) == []
