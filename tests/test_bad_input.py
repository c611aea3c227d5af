"""Bad input and hostile places get one line and a non-zero exit, leave no stray file and lose no stored data: export to
places it cannot write, --commit outside a repository, the dashboard on a port in use or a host that does not resolve
(and a dashboard that starts quietly and writes nothing into the studies), a password in the storage URL, empty
leaderboards asked for by mistake. Also what the command line says of itself (help, --version), what an export says of
the config it ships, and tables that keep their key columns at 100 columns. Trials are fakes (tests/inject/)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import sqlite3
import subprocess
import sys
import urllib.request

import git
import optuna
import pytest
from inject.trialfakes import install_fake_trials
from sqlalchemy import make_url

from db import store
from db.engine import open_db, session
from search.cli import main as search_main
from search.cli import parser

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0"]


def search(*argv: str) -> int:
  try: search_main(list(argv))
  except SystemExit as e: return int(e.code or 0)
  return 0


@pytest.fixture(scope="module")
def made(gguf_file, tmp_path_factory) -> pathlib.Path:
  """A 4-trial study "x" (fake trials): the baseline; the dsl family move (trial 1), faster, so measured again as the
  leader; then 8-bit activations in its FFN (trial 2) and in its attention (trial 3), each slower than trial 1."""
  d = tmp_path_factory.mktemp("made")
  with pytest.MonkeyPatch.context() as mp:
    install_fake_trials(mp.setattr)
    assert search("start", "--model", gguf_file("tiny", "q4_0"), "--study", "x", "--storage", f"sqlite:///{d / 's.db'}",
                  "--trials", "4", *FAST) == 0
  return d / "s.db"


@pytest.fixture
def url(made, tmp_path) -> str:
  """A copy of the made study's database, this test's own."""
  with sqlite3.connect(made) as src, sqlite3.connect(tmp_path / "s.db") as dst: src.backup(dst)
  return f"sqlite:///{tmp_path / 's.db'}"


def confirm_faster(url: str, number: int, pairs: int = 3) -> None:
  """Record a confirmation of trial `number` that shows it faster than the baseline in every pair."""
  with session(open_db(url)) as s:
    st = store.get_study(s, "x")
    t = next(t for t in store.trials(s, st) if t.number == number)
    store.add_confirmation(s, st, t, pairs=pairs, rounds=5, tok_s=11.0, baseline_tok_s=10.0, speedup=1.1,
                           speedup_low=1.05, speedup_high=1.15, status="ok")


def one_line(capsys, *parts: str) -> str:
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and all(p in err for p in parts), err
  return err


def files(d: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(d)) for p in d.rglob("*") if ".git" not in p.parts)


def test_export_where_it_cannot_write_is_one_line_and_writes_nothing(url, tmp_path, capsys) -> None:
  confirm_faster(url, 1)
  (tmp_path / "a-file").write_text("x")
  (tmp_path / "ro").mkdir()
  os.chmod(tmp_path / "ro", 0o555)
  readonly = "/sys" if os.geteuid() == 0 else str(tmp_path / "ro")  # root writes into any directory but sysfs's
  before = files(tmp_path)
  for to, why in ((f"{readonly}/p.toml", "Permission denied"), (str(tmp_path), "it is a directory"),
                  ("/proc", "it is a directory"),
                  (str(tmp_path / "a-file" / "p.toml"), "a-file is a file, not a directory"),
                  ("/proc/p.toml", "No such file or directory")):
    assert search("export", "--study", "x", "--storage", url, "--to", to) == 2
    one_line(capsys, f"cannot write {to}: ", why)
  assert files(tmp_path) == before and not os.path.exists("/sys/p.toml")
  with session(open_db(url)) as s: assert store.exports(s, store.get_study(s, "x")) == []


def test_export_commit_that_fails_writes_nothing(url, tmp_path, capsys) -> None:
  confirm_faster(url, 1)
  to = tmp_path / "prod" / "p.toml"
  assert search("export", "--study", "x", "--storage", url, "--to", str(to), "--commit") == 2
  one_line(capsys, f"--commit: {to} is not inside a git repository")
  assert not to.parent.exists()
  repo = git.Repo.init(tmp_path / "repo")  # a repository without a commit identity: git fails, after the checks
  with repo.config_writer() as c:
    c.set_value("user", "useConfigOnly", "true").set_value("user", "name", "").set_value("user", "email", "")
  to, before = tmp_path / "repo" / "p.toml", files(tmp_path / "repo")
  env = {"GIT_CONFIG_GLOBAL": str(tmp_path / "none"), "GIT_CONFIG_NOSYSTEM": "1", "EMAIL": "", "GIT_AUTHOR_EMAIL": "",
         "GIT_COMMITTER_EMAIL": ""}
  with pytest.MonkeyPatch.context() as mp:
    for k, v in env.items(): mp.setenv(k, v)
    assert search("export", "--study", "x", "--storage", url, "--to", str(to), "--commit") == 2
  one_line(capsys, "--commit: git failed")
  assert files(tmp_path / "repo") == before
  with repo.config_writer() as c: c.set_value("user", "name", "t").set_value("user", "email", "t@example.com")
  assert search("export", "--study", "x", "--storage", url, "--to", str(to), "--commit") == 0
  assert to.exists() and [p.name for p in to.parent.iterdir() if p.name != ".git"] == ["p.toml"]


def test_what_an_export_says_it_ships(url, tmp_path, capsys) -> None:
  """An unconfirmed config whose estimate is not above the baseline's interval goes out only with --force; the label
  says what was shipped: the confirmed winner, or an unconfirmed config with its estimate against the baseline's."""
  to = str(tmp_path / "p.toml")
  head = lambda: pathlib.Path(to).read_text().splitlines()[0]
  with session(open_db(url)) as s:  # the baseline measured again, faster than every other config
    st = store.get_study(s, "x")
    for _ in range(5): store.add_measurement(s, st.id, st.baseline_hash, "full", 25.0, "repeat")
  assert search("export", "--study", "x", "--storage", url, "--to", to, "--trial", "1", "--unconfirmed") == 2
  one_line(capsys, "trial 1 is not confirmed and its estimate is not above the baseline's interval", "x the baseline",
           "--force")
  for which in (["--best"], []):
    assert search("export", "--study", "x", "--storage", url, "--to", to, "--unconfirmed", *which) == 2
    one_line(capsys, "is not confirmed and its estimate is not above the baseline's interval")
  assert not os.path.exists(to)
  assert search("export", "--study", "x", "--storage", url, "--to", to, "--trial", "1", "--unconfirmed", "--force") == 0
  assert re.search(r"trial 1, UNCONFIRMED, FORCED: estimated 0\.\d{3}x the baseline \(.* tok/s over 3 measurements, "
                   r"the baseline .*\), NOT above its interval$", head()), head()
  with session(open_db(url)) as s:  # the baseline measured again, and trial 2, clearly faster than it
    st = store.get_study(s, "x")
    t2, base = next(t for t in store.trials(s, st) if t.number == 2), store.estimates(s, st)[st.baseline_hash]
    for _ in range(6): store.add_measurement(s, st.id, st.baseline_hash, "full", base.median, "repeat")
    for _ in range(4): store.add_measurement(s, st.id, t2.config_hash, "full", 1.5 * base.median, "repeat", trial=t2)
  # the best measured config
  assert search("export", "--study", "x", "--storage", url, "--to", to, "--unconfirmed") == 0
  assert re.search(r"trial 2, UNCONFIRMED: estimated \d\.\d{3}x the baseline .* above its interval$", head()), head()
  confirm_faster(url, 3, pairs=1)  # one pair proves nothing: neither a winner nor confirmed
  assert search("export", "--study", "x", "--storage", url, "--to", to) == 2
  one_line(capsys, "has no confirmed winner")
  assert search("export", "--study", "x", "--storage", url, "--to", to, "--trial", "3", "--unconfirmed", "--force") == 0
  assert ("UNCONFIRMED, FORCED: inconclusive confirmation 1.100x [1.050, 1.150] over 1 A/B pair; estimated"
          in head()), head()
  confirm_faster(url, 3)
  assert search("export", "--study", "x", "--storage", url, "--to", to) == 0
  assert head().endswith("trial 3, confirmed winner: speedup 1.100x [1.050, 1.150] over 3 A/B pairs"), head()


def test_dashboard_starts_quietly_and_writes_nothing_into_studies(url, tmp_path, capsys) -> None:
  # a study structsearch did not make
  optuna.create_study(study_name="plain", storage=url, directions=["minimize", "maximize"])
  attrs = lambda: {s.study_name: (s.system_attrs, s.user_attrs)
                   for s in optuna.storages.RDBStorage(url).get_all_studies()}
  before = attrs()
  assert before["x"][0]["study:metric_names"] == ["tok/s"]  # named when the study was made
  p = subprocess.Popen([sys.executable, "-m", "search", "dashboard", "--storage", url, "--study", "x", "--port", "0"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    line = ""
    while "Ctrl-C stops it" not in line and (more := p.stdout.readline()): line += more
    port = int((re.search(r"at\s+http://127\.0\.0\.1:(\d+)/dashboard/studies/1\s", line) or pytest.fail(line)).group(1))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=30) as r:
      assert sorted(s["study_name"] for s in json.load(r)["study_summaries"]) == ["plain", "x"]
    with socket.socket() as busy:  # a port in use, a port out of range, a host that does not resolve: one line each
      busy.bind(("127.0.0.1", 0))
      busy.listen()
      for args, why in ((["--port", str(busy.getsockname()[1])], "Address already in use"),
                        (["--host", "nosuch.invalid"], "cannot serve the dashboard on nosuch.invalid:8080")):
        q = subprocess.run([sys.executable, "-m", "search", "dashboard", "--storage", url, *args], capture_output=True,
                           text=True, timeout=120)
        assert q.returncode == 2 and q.stdout == "" and len(
            q.stderr.strip().splitlines()) == 1 and why in q.stderr, q.stderr
  finally:
    p.terminate()
    rest = p.communicate(timeout=30)[0]
  assert "Warning" not in line + rest and "Traceback" not in line + rest, line + rest
  assert attrs() == before


def test_the_start_banner_hides_the_password(gguf_file, pg_url, monkeypatch, capsys) -> None:
  install_fake_trials(monkeypatch.setattr)
  # the test server trusts any password
  url = make_url(pg_url).set(password="pw-in-clear-1234").render_as_string(hide_password=False)
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--study", "p", "--storage", url, "--trials", "1",
                *FAST) == 0
  out = capsys.readouterr()
  assert "pw-in-clear-1234" not in out.out + out.err and ":***@" in out.out


def test_every_option_says_what_it_does() -> None:
  """No empty help; an option with a default says it; --objectives lists tok_s once; --version answers."""
  p = parser()
  subs = next(a for a in p._actions if isinstance(a, type(p._subparsers._group_actions[0]))).choices
  for name, sub in subs.items():
    for a in sub._actions:
      if a.help == "==SUPPRESS==" or a.dest == "help": continue
      assert a.help, f"search {name} {a.option_strings or a.dest}: no help"
      if a.option_strings and a.default not in (None, False):
        assert "default" in a.help, f"search {name} {a.option_strings}"
  text = subs["start"].format_help()
  flat = " ".join(text.split())  # the help as one line, wherever the terminal wrapped it
  sets = "(tok_s,peak_memory, tok_s,prefill_tok_s, tok_s,prefill_tok_s,peak_memory: the Pareto front, nsga2)"
  assert "{tok_s,tok_s" not in flat and flat.count(sets) == 1 and flat.count("peak_memory") == 3
  assert "seconds between a worker's heartbeats (default 10)" in subs["worker"].format_help()
  assert "(default 8080; 0: any free port)" in subs["dashboard"].format_help()
  r = subprocess.run([sys.executable, "-m", "search", "--version"], capture_output=True, text=True)
  assert r.returncode == 0 and re.fullmatch(r"structsearch \S+\n", r.stdout), r.stdout


def test_leaderboards_that_would_list_nothing_by_mistake(url, capsys) -> None:
  assert search("leaderboard", "--study", "x", "--storage", url, "--where", "topk=zzz") == 2
  one_line(capsys, "--where topk=zzz: no trial of this study has it; its trials have topk=")
  family = {f"fused.{st}": "dsl" for st in ("attention", "router", "moe", "ffn")} | {"backend.Q4_0.dense": "dsl"}
  for where, rows in (("fused.attention=DSL", [family, family | {"ffn_act": "q8"}, family | {"attn_act": "q8"}]),
                      ("ffn_act=Q8", [family | {"ffn_act": "q8"}])):
    assert search("leaderboard", "--study", "x", "--storage", url, "--where", where, "--format", "json") == 0
    assert [r["changes"] for r in json.loads(capsys.readouterr().out)["rows"]] == rows, where


def test_a_bogus_device_is_refused_before_anything_is_made(gguf_file, tmp_path, monkeypatch, capsys) -> None:
  monkeypatch.chdir(tmp_path)
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--device", "BOGUS") == 2
  assert "argument --device: 'BOGUS' is not a tinygrad device" in capsys.readouterr().err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("cmd", [["leaderboard", "--state", "all"], ["status", "--study", "x"], ["status"], ["cost"]])
def test_tables_keep_their_key_columns_at_100_columns(url, cmd) -> None:
  """Piped output follows COLUMNS (200 without it); at 100 columns a table leaves out whole columns and says which,
  never cuts a value: the leaderboard keeps rank, state, speedup (3 decimals) and the changes, the studies and the costs
  their key columns."""
  argv = [sys.executable, "-m", "search", *cmd, "--storage", url, *(["--study", "x"] if cmd[0] != "status" else [])]
  env = lambda cols: {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": str(cols)} if cols else {})
  run = lambda cols: subprocess.run(argv, capture_output=True, text=True, env=env(cols), timeout=120).stdout
  narrow, wide = run(100), run(None)  # without COLUMNS, piped output is 200 columns wide
  assert max(map(len, narrow.splitlines())) <= 100 < max(map(len, wide.splitlines())) <= 200, narrow
  assert "left out at 100 columns: " in narrow and "left out" not in wide
  flat = " ".join(re.sub(r"[│┃]", " ", narrow).split())
  keep = {"leaderboard": ("rank", "trial", "state", "speedup", "changes"),
          "status": ("rank", "state", "speedup", "changes"), "cost": ("trial", "state", "wall")}
  if cmd == ["status"]: keep["status"] = ("study", "model", "device", "trials", "speedup")
  for col in keep[cmd[0]]: assert col in flat, (col, narrow)
  if cmd[0] != "cost" and cmd != ["status"]:
    doc = json.loads(subprocess.run([*argv, "--format", "json"], capture_output=True, text=True, timeout=120).stdout)
    for r in doc["rows"] if "rows" in doc else []:
      assert (all(f"{k}={v}" in flat for k, v in r["changes"].items())
              and (r["speedup"] is None or f"{r['speedup']:.3f}x" in flat)), (r, narrow)

