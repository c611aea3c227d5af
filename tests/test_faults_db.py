"""Faults of the database and the files beside it never kill a study with a traceback: a PostgreSQL server stopped and
started again mid-trial is waited for and no measurement is lost (a private server of this test, so no other test's
database goes away); a full disk, a read-only or corrupt SQLite file and an unwritable artifacts folder end the worker
with one line, Optuna and ss_trial in agreement. Trials are fakes (tests/inject/trialfakes.py)."""
from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

import optuna
import pytest
from test_faults import FAST, rows, started

PG_BIN = next(iter(sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin"))[-1:]), None)


@pytest.fixture(scope="module")
def model(gguf_file) -> str: return gguf_file("tiny", "q4_0")




def running_trial(url: str, proc: subprocess.Popen, after: int = 0, timeout: float = 90) -> int:
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    try: mine = rows(url, "SELECT number FROM ss_trial WHERE state='running' AND number >= :n", n=after)
    except Exception: mine = []  # noqa: BLE001 - the tables may not exist yet
    if mine: return mine[0][0]
    time.sleep(0.1)
  raise AssertionError(f"no running trial: {proc.communicate()[0] if proc.poll() is not None else 'still starting'}")


class Postgres:
  """A PostgreSQL server of this test alone (initdb into a fresh folder: a second or two), stopped and started at
  will."""

  def __init__(self):
    self.dir = pathlib.Path(tempfile.mkdtemp(prefix="ss-pg-"))
    shutil.chown(self.dir, "postgres")
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.as_pg(["initdb", "-D", str(self.dir / "data"), "-U", "postgres", "--auth=trust"])
    self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

  def as_pg(self, argv: list[str]) -> None:
    subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / argv[0]), *argv[1:]], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

  def start(self) -> None:
    self.as_pg(["pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "start", "-o",
                f"-h 127.0.0.1 -p {self.port} -k {self.dir}"])

  def stop(self) -> None: self.as_pg(["pg_ctl", "-D", str(self.dir / "data"), "-w", "stop", "-m", "fast"])


@pytest.fixture
def private_pg():
  if PG_BIN is None or os.geteuid() != 0 or shutil.which("runuser") is None:
    pytest.skip("a private PostgreSQL needs Debian's server (.ci/postgres.sh installs it) and root (runuser)")
  pg = Postgres()
  pg.start()
  yield pg
  try: pg.stop()
  finally: shutil.rmtree(pg.dir, ignore_errors=True)


def test_a_postgresql_outage_is_ridden_out_and_no_measurement_is_lost(model, private_pg, inject) -> None:
  url = private_pg.url
  p = started(inject, "start", "--model", model, "--study", "pg", "--storage", url, "--trials", "4", *FAST,
              seconds=2.0)
  down = running_trial(url, p, after=1)  # a trial past the baseline is running: the server goes away under it
  private_pg.stop()
  time.sleep(8)
  private_pg.start()
  out = p.communicate(timeout=180)[0]
  assert p.returncode == 0 and "Traceback" not in out, out
  ours = {n: (s, tok) for n, s, tok in rows(url, "SELECT number, state, tok_s FROM ss_trial")}
  assert ours[down][0] == "ok" and ours[down][1] > 0, ours  # measured while the server was down, stored after
  assert all(s == "ok" for s, _ in ours.values()) and len(ours) == 4, ours
  trials = optuna.load_study(study_name="pg", storage=url).trials
  assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 4


@pytest.fixture
def tmpfs(tmp_path):
  """A small filesystem of this test's own (tmpfs, 4 MiB): filled up or made read-only mid-study."""
  (d := tmp_path / "fs").mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True).returncode:
    pytest.skip("mounting a tmpfs is not permitted here")
  yield d
  subprocess.run(["umount", "-l", str(d)], check=True)


def fill(d: pathlib.Path) -> None:
  with open(d / "filler", "wb") as f:
    try:
      while True: f.write(b"\0" * 65536); f.flush()
    except OSError: pass


def read_only(d: pathlib.Path) -> None: subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)


def assert_one_line(p: subprocess.Popen, out: str) -> None:
  assert p.returncode not in (0, None) and "Traceback" not in out and "Exception" not in out, out
  assert len([ln for ln in out.splitlines() if ln.startswith("search: error:")]) == 1, out


def assert_ledgers_agree(url: str, study: str) -> None:
  """No trial RUNNING in one ledger and finished in the other; every trial ours says ok is complete in Optuna's."""
  optuna_states = {t.number: t.state for t in optuna.load_study(study_name=study, storage=url).trials}
  TS = optuna.trial.TrialState
  for n, state in rows(url, "SELECT number, state FROM ss_trial"):
    assert (state == "running") == (optuna_states[n] == TS.RUNNING), (n, state, optuna_states)
    if state == "ok": assert optuna_states[n] == TS.COMPLETE, (n, state, optuna_states)


def test_a_database_disk_full_mid_study_is_one_line(model, tmpfs, inject) -> None:
  url = f"sqlite:///{tmpfs / 's.db'}"
  p = started(inject, "start", "--model", model, "--study", "s", "--storage", url, "--trials", "20", *FAST,
              "--artifacts", str(tmpfs.parent / "artifacts"), seconds=1.5)
  running_trial(url, p, after=1)
  fill(tmpfs)
  out = p.communicate(timeout=120)[0]
  assert_one_line(p, out)
  assert "is full" in out.splitlines()[-1], out
  (tmpfs / "filler").unlink()
  assert_ledgers_agree(url, "s")


def test_a_read_only_database_is_one_line_and_untouched(model, tmpfs, inject) -> None:
  """A file system remounted read-only under a study (SQLite holds its files open for writing: the remount waits for
  the worker to end, so the study continued is the one refused)."""
  url = f"sqlite:///{tmpfs / 's.db'}"
  p = started(inject, "start", "--model", model, "--study", "s", "--storage", url, "--trials", "2", *FAST, seconds=0.2)
  assert p.communicate(timeout=120)[0] and p.returncode == 0
  before = {f.name: f.read_bytes() for f in tmpfs.iterdir() if f.is_file()}
  read_only(tmpfs)
  for argv in (["start", "--study", "s", "--trials", "4", *FAST], ["status"], ["leaderboard", "--study", "s"]):
    p = started(inject, *argv, "--storage", url)
    out = p.communicate(timeout=120)[0]
    assert_one_line(p, out)
    assert "read-only" in out, out
  assert {f.name: f.read_bytes() for f in tmpfs.iterdir() if f.is_file()} == before


def test_unwritable_artifacts_store_the_result_and_stop_in_one_line(model, tmpfs, tmp_path, inject) -> None:
  url = f"sqlite:///{tmp_path / 's.db'}"
  p = started(inject, "start", "--model", model, "--study", "s", "--storage", url, "--trials", "20", *FAST,
              "--artifacts", str(tmpfs), seconds=1.5)
  down = running_trial(url, p, after=1)
  read_only(tmpfs)
  out = p.communicate(timeout=120)[0]
  assert_one_line(p, out)
  assert "artifact" in out.splitlines()[-1], out
  assert_ledgers_agree(url, "s")
  assert rows(url, "SELECT state FROM ss_trial WHERE number = :n", n=down) == [("ok",)]


def test_a_corrupt_database_is_one_line(model, tmp_path, inject) -> None:
  url = f"sqlite:///{(db := tmp_path / 's.db')}"
  p = started(inject, "start", "--model", model, "--study", "s", "--storage", url, "--trials", "2", *FAST, seconds=0.2)
  assert p.communicate(timeout=120)[0] and p.returncode == 0
  data = bytearray(db.read_bytes())
  data[4096:] = b"\x5a" * (len(data) - 4096)  # every page past the first overwritten: the schema stays readable
  db.write_bytes(bytes(data))
  for argv in (["start", "--study", "s", "--trials", "4", *FAST], ["status"], ["leaderboard", "--study", "s"]):
    p = started(inject, *argv, "--storage", url)
    out = p.communicate(timeout=120)[0]
    assert_one_line(p, out)
    assert "is corrupt" in out, out
