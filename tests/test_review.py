"""Review and ship, on one tiny study made by a real search (CPU, trial processes): the dashboard rendered in headless
Chromium while that search writes to the same SQLite file (screenshot kept in test-artifacts/), then the leaderboard in
four formats, show, compare, the report, the notebook, export to production that `model bench` then uses, and the noise
figures (every measurement stored, baseline repeats, the robust estimate)."""
from __future__ import annotations

import csv
import io
import json
import os
import pathlib
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import git
import nbclient
import nbformat
import optuna
import pytest
from optuna.artifacts import get_all_artifact_meta
from PIL import Image

from db import store
from db.engine import open_db, session
from model.production import production_dir, select, sha_line
from model.structure import StructureConfig
from search.cli import main as search_main
from search.leaderboard import leaderboard
from search.noise import near_best
from search.study import storage

PROJECT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = StructureConfig().hash  # the study's baseline: it pins beam=0, the default
FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--seed", "0"]
CHROMIUM = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--virtual-time-budget=15000"]


def search(*argv: str) -> int:
  try: search_main(list(argv))
  except SystemExit as e: return int(e.code or 0)
  return 0


@dataclass
class Live:
  url: str
  db: pathlib.Path
  model: str
  proc: subprocess.Popen  # `search start`, running while the dashboard serves
  dash: subprocess.Popen
  port: int
  logs: pathlib.Path  # their output (a pipe nobody reads would stall them once full)

  def finished(self) -> str:
    """The search's output once it has ended; it must end well."""
    self.proc.wait(timeout=900)
    out = (self.logs / "search.log").read_text()
    assert self.proc.returncode == 0, out[-3000:]
    return out

  def get(self, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
      assert r.status == 200
      return r.read()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def live(gguf_file, tmp_path_factory):
  """A 3-trial study (full model only), its best config confirmed with two A/B pairs, while optuna-dashboard serves its
  file."""
  d, model = tmp_path_factory.mktemp("review"), gguf_file("tiny", "q4_0")
  url = f"sqlite:///{d / 's.db'}"
  proc = subprocess.Popen([sys.executable, "-m", "search", "start", "--model", model, "--study", "r", "--storage", url,
                           "--trials", "3", *FAST, "--confirm", "1", "--pairs", "2"],
                          stdout=open(d / "search.log", "w"), stderr=subprocess.STDOUT)
  deadline = time.time() + 120
  while time.time() < deadline and not _has_study(d / "s.db"): time.sleep(0.5)
  port = free_port()
  dash = subprocess.Popen([sys.executable, "-m", "search", "dashboard", "--storage", url, "--study", "r", "--port",
                           str(port)],
                          stdout=open(d / "dashboard.log", "w"), stderr=subprocess.STDOUT)
  lv = Live(url, d / "s.db", model, proc, dash, port, d)
  while time.time() < deadline:
    try:
      lv.get("/api/studies")
      break
    except OSError: time.sleep(0.5)
  yield lv
  for p in (dash, proc):
    if p.poll() is None: p.kill()
    p.wait()


def _has_study(db: pathlib.Path) -> bool:
  try:
    with sqlite3.connect(db, timeout=30) as c:
      return bool(c.execute("SELECT 1 FROM studies WHERE study_name='r'").fetchall())
  except sqlite3.Error: return False


def _chromium(*args: str) -> subprocess.CompletedProcess:
  exe = shutil.which("chromium")
  if exe is None:
    if os.environ.get("CI"): pytest.fail("chromium is missing: .ci/run sources .ci/chromium.sh to install it")
    pytest.skip("headless Chromium: `. .ci/chromium.sh` installs Debian's chromium")
  with tempfile.TemporaryDirectory() as profile:
    return subprocess.run([exe, *CHROMIUM, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


def test_dashboard_renders_while_the_search_writes(live, capsys) -> None:
  """optuna-dashboard on the SQLite file the search is writing: the page renders the study and its trials with their
  artifacts, the API answers throughout, the search finishes without "database is locked", and the page's best trial
  is then the leaderboard's first."""
  deadline = time.time() + 300
  while time.time() < deadline and not any(t["state"] == "Complete"
                                           for t in json.loads(live.get("/api/studies/1"))["trials"]):
    time.sleep(1)
  assert live.proc.poll() is None, "the search ended before the dashboard could be tested beside it"
  dom = _chromium("--dump-dom", f"http://127.0.0.1:{live.port}/dashboard/studies/1/trials").stdout
  assert "r (id=1)" in dom and "Trial 0" in dom and "trial-0-metrics.json" in dom, dom[-2000:]
  shot = PROJECT / "test-artifacts" / "dashboard.png"
  shot.parent.mkdir(exist_ok=True)
  _chromium("--window-size=1400,1000", f"--screenshot={shot}", f"http://127.0.0.1:{live.port}/dashboard/studies/1")
  print(f"dashboard screenshot: {shot}")
  assert Image.open(shot).size == (1400, 1000)
  polls = 0
  while live.proc.poll() is None:  # the dashboard keeps reading while the search writes
    for path in ("/api/studies", "/api/studies/1", "/api/studies/1/param_importances"): live.get(path)
    polls += 1
    time.sleep(0.3)
  out, served = live.finished(), (live.logs / "dashboard.log").read_text()
  assert polls > 5 and "database is locked" not in out + served and "Traceback" not in out + served, served[-3000:]
  assert live.dash.poll() is None  # still serving
  # its "Best Trial" is the leaderboard's first, at the figure the leaderboard ranks it by (search/ranked.py)
  capsys.readouterr()
  assert search("leaderboard", "--study", "r", "--storage", live.url, "--format", "json") == 0
  first = json.loads(capsys.readouterr().out)["rows"][0]
  time.sleep(2.5)  # the dashboard keeps the trials it read for 2 s
  text = re.sub(r"<[^>]+>", " ", _chromium("--dump-dom", f"http://127.0.0.1:{live.port}/dashboard/studies/1").stdout)
  assert f"Best Trial (number={first['trial']})" in text, text[-3000:]


def test_leaderboard_in_four_formats(live, capsys) -> None:
  out = live.finished()
  assert "review: `search leaderboard --study r" in out and "search dashboard --study r" in out
  assert search("leaderboard", "--study", "r", "--storage", live.url, "--format", "json") == 0
  doc = json.loads(capsys.readouterr().out)
  # start ends saying who wins, or that none does
  assert doc["schema"] == 2 and doc["study"] == "r" and doc["verdict"] in out
  rows = doc["rows"]
  assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1)) and all(r["state"] == "ok" for r in rows)
  assert doc["baseline"]["measurements"] >= 3  # its trial, a repeat between trials, its side of the A/B pair
  for r in rows: assert r["tok_s_low"] <= r["tok_s"] <= r["tok_s_high"] and r["measurements"] >= 1
  conf = [r for r in rows if r["confirmed"]]
  assert len(conf) == 1 and conf[0]["confirmed"]["pairs"] == 2
  # configs A/B-confirmed faster than the baseline (two pairs at least, the interval's low end above 1) first, then the
  # rest; within each by the lower bound of the speedup (the confirmation's where there is one)
  faster = lambda c: c is not None and c["status"] == "ok" and c["pairs"] >= 2 and c["low"] > 1.0
  order = [(not faster(r["confirmed"]), -r["speedup_low"]) for r in rows]
  assert order == sorted(order) and all(r["below_floor"] is None for r in rows)
  assert search("leaderboard", "--study", "r", "--storage", live.url, "--format", "csv") == 0
  table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
  assert [int(r["trial"]) for r in table] == [r["trial"] for r in rows] and "confirmed_speedup" in table[0]
  assert search("leaderboard", "--study", "r", "--storage", live.url, "--format", "markdown", "--top", "1") == 0
  md = capsys.readouterr().out.splitlines()
  assert (md[2].startswith("| rank | trial |") and md[3].startswith("|---|") and md[4].startswith("| 1 |")
          and not md[5].startswith("|"))
  assert search("leaderboard", "--study", "r", "--storage", live.url, "--where", "topk=nosuch", "--format", "json") == 2
  # not an empty list
  assert "--where topk=nosuch: no trial of this study has it; its trials have topk=" in capsys.readouterr().err
  assert search("leaderboard", "--study", "r", "--storage", live.url, "--where", "kv_dtype=float16", "--state", "all",
                "--format", "json") == 0
  assert BASELINE in [r["config_hash"] for r in json.loads(capsys.readouterr().out)["rows"]]
  assert search("leaderboard", "--study", "r", "--storage", live.url, "--where", "nosuch=1") == 2
  assert "unknown knob" in capsys.readouterr().err
  assert search("status", "--storage", live.url, "--format", "json") == 0
  assert [s["study"] for s in json.loads(capsys.readouterr().out)["studies"]] == ["r"]
  # a reader that closes the pipe early (`| head`) gets no traceback and no failure, from the table (rich) or a document
  # (print)
  for fmt in ("table", "json"):
    p = subprocess.Popen([sys.executable, "-m", "search", "leaderboard", "--study", "r", "--storage", live.url,
                          "--format", fmt],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait() == 0 and err == "", err


def test_show_and_compare(live, capsys) -> None:
  live.finished()
  assert search("show", "--study", "r", "--storage", live.url, "baseline", "--format", "json") == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["trial"] == 0 and doc["changes"] == {} and StructureConfig.from_dict(doc["config"]) == StructureConfig()
  assert ({m["kind"] for m in doc["measurements"]} == {"trial", "repeat", "confirm"}
          and doc["estimate"]["measurements"] == len(doc["measurements"]))
  assert (doc["metrics"]["kernels_per_token"] > 0 and doc["phases"]["compile_s"] > 0
          and doc["environment"]["device"] == "CPU")
  assert doc["git"]["commit"] and "diff" in doc["git"]
  assert search("show", "--study", "r", "--storage", live.url, "1") == 0
  out = capsys.readouterr().out
  assert "config: changes from the baseline" in out and "phases (s)" in out and "git state" in out
  for fmt in ("markdown", "csv"):
    assert search("show", "--study", "r", "--storage", live.url, "2", "--format", fmt) == 0
  assert search("show", "--study", "r", "--storage", live.url, "9") == 2 and "no trial 9" in capsys.readouterr().err
  assert search("compare", "--study", "r", "--storage", live.url, "baseline", "1", "--format", "json") == 0
  cmp = json.loads(capsys.readouterr().out)
  tok = next(m for m in cmp["metrics"] if m["metric"] == "tok_s")
  assert cmp["a"] == 0 and cmp["b"] == 1 and cmp["knobs"] and tok["ratio"] == pytest.approx(tok["b"] / tok["a"])
  assert search("compare", "--study", "r", "--storage", live.url, "0", "2") == 0 and "B/A" in capsys.readouterr().out


def test_profiles_by_stage_and_the_kernel_diff(live, tmp_path, capsys) -> None:
  """The study profiled its baseline itself, each kernel named by the stage and layers that built it; `search profile`
  prints that, or makes and stores one for a trial that has none; compare and the report then show B/A by stage."""
  live.finished()
  db = tmp_path / "p.db"  # a copy: the profile made below must not reach the shared study
  with sqlite3.connect(live.db) as src, sqlite3.connect(db) as dst: src.backup(dst)
  url = f"sqlite:///{db}"
  with session(open_db(url)) as s:
    trials = store.trials(s, store.get_study(s, "r"))
    base = next(t for t in trials if t.config_hash == BASELINE and t.state == "ok")
    rows = {(p.stage, p.name): p for p in base.profile}
    # a trial without a profile: the config to ship where that is not the baseline (the report's kernel diff is its)
    best = leaderboard(s, store.get_study(s, "r"))["best"]["trial"]
    bare = next(t for t in sorted(trials, key=lambda t: t.number != best)
                if t.state == "ok" and t.config_hash != BASELINE and not t.profile)
  # the tiny model: block 0 dense, blocks 1-2 MoE
  assert {st for st, _ in rows} >= {"embed", "attention", "ffn", "head"} and any("moe" in st for st, _ in rows)
  assert {p.layers for p in rows.values() if p.stage == "attention"} == {"0-2"}
  assert all(p.layers == "0" for p in rows.values() if p.stage == "ffn")
  assert sum(p.share for p in rows.values()) == pytest.approx(1) and all(p.bytes for p in rows.values())
  assert search("profile", "--study", "r", "--storage", url, "--format", "json") == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["trial"] == base.number and doc["profiled"] == "stored" and len(doc["kernels"]) == len(rows)
  assert search("profile", "--study", "r", "--storage", url, str(bare.number)) == 0
  out = capsys.readouterr().out
  assert f"trial {bare.number} has no stored profile: profiling it now" in out and "decode step by stage" in out
  with session(open_db(url)) as s:
    made = next(t for t in store.trials(s, store.get_study(s, "r")) if t.number == bare.number).profile
    assert made and all(p.stage for p in made)
  st = storage(url)  # and attached to the trial's dashboard files
  study = optuna.load_study(study_name="r", storage=st)
  assert f"trial-{bare.number}-profile.csv" in {m.filename for m in get_all_artifact_meta(study, storage=st)}
  assert search("compare", "--study", "r", "--storage", url, "baseline", str(bare.number), "--format", "json") == 0
  cmp = json.loads(capsys.readouterr().out)
  att = next(g for g in cmp["stages"] if g["stage"] == "attention")
  assert att["ratio"] == pytest.approx(att["b"]["us_per_token"] / att["a"]["us_per_token"])
  assert all(k["stage"] for k in cmp["kernels"])
  assert search("compare", "--study", "r", "--storage", url, "baseline", str(bare.number)) == 0
  assert "time by stage" in capsys.readouterr().out
  assert search("report", "--study", "r", "--storage", url, "--out", str(tmp_path / "rep")) == 0
  md = (tmp_path / "rep" / "report.md").read_text()
  assert "## Where the speed came from: trial" in md and "| attention |" in md


def test_every_measurement_is_stored_and_estimated(live) -> None:
  out = live.finished()
  with session(open_db(live.url)) as s:
    st = store.get_study(s, "r")
    ms = store.measurements(s, st)
    kinds = {(m.kind, m.config_hash == BASELINE, m.trial_id is None) for m in ms}
    assert ("repeat", True, True) in kinds and ("confirm", True, True) in kinds and ("trial", True, False) in kinds
    est = store.estimates(s, st)
    assert est[BASELINE].n == sum(m.config_hash == BASELINE for m in ms) >= 3
    assert all(e.low <= e.median <= e.high for e in est.values())
    # configs within the noise of the best were measured again before the study ended, within its budget of 2 runs
    again = [m for m in ms if m.kind == "repeat" and m.trial_id is not None]
    assert len(again) == out.count("is within the noise of the best, measured again") <= 2


def test_estimate_pools_the_noise(tmp_path) -> None:
  """Unit: no interval before a config is measured twice; then every config gets one from the pooled spread, narrower
  with n."""
  with session(open_db(f"sqlite:///{tmp_path / 'e.db'}")) as s:
    st = store.create_study(s, name="e", model_name="m", model_path="/m.gguf", model_sha256="0" * 64, model_bytes=1,
                            layers=1, device="CPU", device_name="", space_version=1, objectives="tok_s", sampler="tpe")
    store.add_measurement(s, st.id, "a", "full", 100.0, "trial")
    store.add_measurement(s, st.id, "b", "full", 97.0, "trial")
    store.add_measurement(s, st.id, "c", "full", 80.0, "trial")
    assert store.estimates(s, st)["a"] == store.Estimate(100.0, None, None, 1)
    for x in (101.0, 97.0, 104.0, 95.0, 99.0, 103.0, 98.0, 102.0):
      store.add_measurement(s, st.id, "a", "full", x, "repeat")
    store.add_measurement(s, st.id, "block-only", "block", 50.0, "trial")
    est = store.estimates(s, st)
    a, b = est["a"], est["b"]
    assert set(est) == {"a", "b", "c"} and a.n == 9 and a.median == 100.0 and b.median == 97.0
    assert b.low < 97 < b.high and a.low < 100 < a.high and (b.high - b.low) / 97 > (a.high - a.low) / 100
    assert near_best(est) == ["a", "b"]  # b's interval reaches a's lower bound (within the noise), c's does not
    with pytest.raises(ValueError): store.add_measurement(s, st.id, "a", "full", 1.0, "guess")


def test_report(live, tmp_path, capsys) -> None:
  live.finished()
  assert search("report", "--study", "r", "--storage", live.url, "--out", str(tmp_path / "rep")) == 0
  md, html = (tmp_path / "rep" / "report.md").read_text(), (tmp_path / "rep" / "report.html").read_text()
  pngs = sorted((tmp_path / "rep").glob("*.png"))
  assert {p.stem for p in pngs} >= {"history", "importance", "per_knob", "kernels"}
  for p in pngs:
    with Image.open(p) as im:
      im.verify()
      assert im.format == "PNG" and im.size[0] > 300
  assert "| rank | trial |" in md and all(f"({p.name})" in md for p in pngs) and "Not drawn: proxy" in md
  # each trial's accuracy against the exact reference, beside its precision class: the baseline is the reference
  assert "| exact | top1 100% · err 0 · KL 0 |" in md
  assert "<table>" in html and html.count("data:image/png;base64,") == len(pngs)


def test_notebook_runs(live) -> None:
  live.finished()
  nb = nbformat.read(PROJECT / "notebooks" / "leaderboard.ipynb", as_version=4)
  assert all(c.get("outputs", []) == [] for c in nb.cells)  # committed without outputs
  params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
  params.source = f"storage = {live.url!r}\nstudy = 'r'"
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(PROJECT)}}).execute()
  outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert (sum("image/png" in o.get("data", {}) for o in outs) >= 4
          and any("text/markdown" in o.get("data", {}) for o in outs))
  assert not any(o.output_type == "error" for o in outs)


def test_notebook_runs_as_shipped(live, tmp_path) -> None:
  """Unchanged, from Jupyter's working directory (notebooks/) of a checkout where `make demo` made its study (the live
  study, renamed tiny-CPU, in structsearch.db at the root); where there is no database it says so and creates none."""
  live.finished()
  (root := tmp_path / "checkout").mkdir()
  with sqlite3.connect(live.db) as src, sqlite3.connect(root / "structsearch.db") as dst: src.backup(dst)
  with sqlite3.connect(root / "structsearch.db") as c:
    c.execute("UPDATE ss_study SET name='tiny-CPU'")
    c.execute("UPDATE studies SET study_name='tiny-CPU'")
  (root / "notebooks").mkdir()
  def run(where: pathlib.Path) -> list:
    nb = nbformat.read(PROJECT / "notebooks" / "leaderboard.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(where)}})
    client.execute()
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  outs = run(root / "notebooks")
  assert not any(o.output_type == "error" for o in outs), [o for o in outs if o.output_type == "error"]
  assert sum("image/png" in o.get("data", {}) for o in outs) >= 4
  (bare := tmp_path / "bare" / "notebooks").mkdir(parents=True)
  errors = [o for o in run(bare) if o.output_type == "error"]
  assert errors and "no database at" in errors[0]["evalue"] and not list((tmp_path / "bare").rglob("*.db"))


def test_export_to_production_that_bench_uses(live, tmp_path, capsys) -> None:
  live.finished()
  db = tmp_path / "x.db"  # a copy: the refusals below need trials and confirmations that the shared study must not get
  with sqlite3.connect(live.db) as src, sqlite3.connect(db) as dst: src.backup(dst)
  url = f"sqlite:///{db}"
  with session(open_db(url)) as s:
    st = store.get_study(s, "r")
    trials = store.trials(s, st)
    other = [t for t in trials if t.state == "ok" and t.config_hash != BASELINE]
    confirmed = {c.config_hash for c in store.confirmations(s, st)}
    fresh = next(t for t in other if t.config_hash not in confirmed)
    # confirmed slower than the baseline (the latest confirmation of a config counts)
    slow = next(t for t in other if t is not fresh)
    store.add_confirmation(s, st, slow, pairs=3, rounds=5, tok_s=1.0, baseline_tok_s=1.2, speedup=0.84, speedup_low=0.8,
                           speedup_high=0.9, status="ok")
    for n, state in ((7, "wrong_output"), (8, "pruned"), (9, "interrupted"), (10, "timeout")):
      t = store.start_trial(s, st, n, fresh.config_json, fresh.config_hash, None, "h:1")
      if state != "interrupted":
        store.finish_trial(s, t, state=state, failure_class=state if state in ("wrong_output", "timeout") else None)
      else: store.mark_interrupted(s, st, [n], "stopped by the test")
    # the baseline and fresh measured again, fresh clearly faster: an unconfirmed export may ship it
    base = store.estimates(s, st)[BASELINE]
    for _ in range(8): store.add_measurement(s, st.id, BASELINE, "full", base.median, "repeat")
    for _ in range(6):
      store.add_measurement(s, st.id, fresh.config_hash, "full", 2 * base.median, "repeat", trial=fresh)

  def refused(*args: str, why: str) -> None:
    assert search("export", "--study", "r", "--storage", url, *args) == 2
    assert why in capsys.readouterr().err
  refused(why="no confirmed winner")
  refused("--trial", "0", "--unconfirmed", why="is the baseline")
  refused("--trial", str(slow.number), "--unconfirmed", why="not faster than")
  refused("--trial", str(fresh.number), why="not confirmed")
  for n in (7, 8, 9, 10): refused("--trial", str(n), "--unconfirmed", why="only a config measured ok")

  assert search("export", "--study", "r", "--storage", url, "--trial", str(fresh.number), "--unconfirmed") == 0
  path = production_dir() / f"{pathlib.Path(live.model).stem}.toml"
  assert str(path) in capsys.readouterr().out
  text = path.read_text()
  assert (text.startswith("# structsearch production config: study 'r'") and "UNCONFIRMED: estimated " in text
          and "device: " in text)
  assert "the baseline" in text.splitlines()[0] and "above its interval" in text.splitlines()[0]
  assert StructureConfig.load(str(path)) == StructureConfig.from_json(fresh.config_json)

  # model bench loads it by default and says so; --baseline ignores it; a config for another file is not applied
  r = subprocess.run([sys.executable, "-m", "model", "bench", "--model", live.model, "-n", "2", "--rounds", "1",
                      "--layers", "1", "--json"],
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  assert f"config: production config {path}" in r.stderr
  assert StructureConfig.from_dict(json.loads(r.stdout)["config"]) == StructureConfig.from_json(fresh.config_json)
  assert (select(pathlib.Path(live.model), live.model, None, True)
          == (StructureConfig(), "config: the baseline (--baseline)", None))
  path.write_text(text.replace(sha_line(st.model_sha256), sha_line("f" * 64)))
  cfg, line, _ = select(pathlib.Path(live.model), live.model, None, False)
  assert (cfg == StructureConfig() and line.startswith("warning: ") and "ffffffffffffffff" in line
          and st.model_sha256[:16] in line)

  # --commit: a new branch of the repository holding the file; the user's branch and index untouched; recorded with the
  # study
  repo = git.Repo.init(tmp_path / "repo")
  with repo.config_writer() as c: c.set_value("user", "name", "t").set_value("user", "email", "t@example.com")
  (tmp_path / "repo" / "README").write_text("x\n")
  repo.index.add(["README"])
  head = repo.index.commit("init").hexsha
  to = tmp_path / "repo" / "production" / "tiny.toml"
  assert search("export", "--study", "r", "--storage", url, "--trial", str(fresh.number), "--unconfirmed", "--to",
                str(to), "--commit") == 0
  assert "committed" in capsys.readouterr().out
  branch = repo.heads[f"structsearch/r-trial{fresh.number}"]
  assert repo.head.commit.hexsha == head and branch.commit.parents[0].hexsha == head and not repo.index.diff("HEAD")
  assert branch.commit.tree["production/tiny.toml"].data_stream.read().decode() == to.read_text()
  assert f"trial {fresh.number}" in branch.commit.message and "the baseline, on " in branch.commit.message
  with session(open_db(url)) as s:
    ex = store.exports(s, store.get_study(s, "r"))
    assert (ex[-1].commit == branch.commit.hexsha and ex[-1].branch == branch.name
            and "+++ b/production/tiny.toml" in ex[-1].diff)
