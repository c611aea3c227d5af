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
import sys
import tempfile
import time

import optuna
import pytest
from sqlalchemy import create_engine, text

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0", "--heartbeat", "0.5"]
PG_BIN = next(iter(sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin"))[-1:]), None)


@pytest.fixture(scope="module")
def model(gguf_file) -> str: return gguf_file("tiny", "q4_0")


def rows(url: str, sql: str, **params) -> list:
  e = create_engine(url)
  try:
    with e.connect() as c: return list(c.execute(text(sql), params))
  finally: e.dispose()


def started(inject, *argv: str, seconds: float = 1.0) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "search", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=inject(seconds=seconds), start_new_session=True)


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
