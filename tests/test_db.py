"""db/: migrations, open_db's errors, the query API; on SQLite and on PostgreSQL ($STRUCTSEARCH_TEST_PG, from
.ci/postgres.sh).

Each PostgreSQL test gets a database of its own, made on that server and dropped after, so tests run in any order and in
parallel."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from pathlib import Path

import git
import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

import db
from db import store
from db.capture import fingerprint_hash, git_state
from db.engine import DBError, NoDatabase, alembic_config, default_url, open_db, session
from db.models import VERSION_TABLE, Base, include_name
from model.structure import KNOBS, ConfigError, StructureConfig
from space.knobs import to_config

OURS = {"ss_environment", "ss_git_state", "ss_study", "ss_trial", "ss_kernel_profile", "ss_confirmation",
        "ss_measurement", "ss_export"}
PG = os.environ.get("STRUCTSEARCH_TEST_PG")
ENV = {"device": "CPU", "device_name": "cpu", "driver": "clang 16", "tinygrad_version": "0.14.0", "python": "3.11.7",
       "host": "h1", "platform": "Linux-6-x86_64"}
STUDY = dict(model_name="tiny", model_path="/m/tiny.gguf", model_sha256="0" * 64, model_bytes=5 << 30, layers=2,
             device="CPU", device_name="cpu", space_version=1, objectives="tok_s", sampler="tpe")


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
  if request.param == "sqlite": return f"sqlite:///{tmp_path / 'ss.db'}"
  return request.getfixturevalue("pg_url")


@pytest.fixture
def engine(url):
  engine = open_db(url)
  yield engine
  engine.dispose()


def make_trial(s, study, number, state, tok_s=None, config_hash="c0", **kw):
  t = store.start_trial(s, study, number, "{}", config_hash, None, "host:1")
  return t if state == "running" else store.finish_trial(s, t, state=state, tok_s=tok_s, **kw)


def test_migrations_create_our_tables(engine):
  tables = set(inspect(engine).get_table_names())
  assert tables == OURS | {VERSION_TABLE}
  with engine.connect() as c:
    assert (c.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}"))
            == ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head())
    ctx = MigrationContext.configure(c, opts={"include_name": include_name, "version_table": VERSION_TABLE})
    assert compare_metadata(ctx, Base.metadata) == []  # the migrations make exactly the models' tables


def _old_schema(url: str, revision: str, *statements: str) -> None:
  """A database migrated up to `revision` only, with `statements` run on it (data written by that schema)."""
  from alembic import command
  e = create_engine(url)
  with e.begin() as c:
    cfg = alembic_config(url)
    cfg.attributes["connection"] = c
    command.upgrade(cfg, revision)
    for sql in statements: c.execute(text(sql))
  e.dispose()


def _old_study(name: str) -> str:
  return ("INSERT INTO ss_study (name, model_name, model_path, model_sha256, model_bytes, layers, device, device_name, "
          f"space_version, objectives, sampler, created_at) VALUES ('{name}', 'tiny', '/m', 'ab', 1, 2, 'CPU', 'cpu', "
          "3, 'tok_s', 'tpe', '2026-01-01')")


def test_upgrade_from_the_first_schema_keeps_the_data(url):
  _old_schema(url, "0001", _old_study("old"))
  with session(e := open_db(url)) as s:
    assert [(st.name, st.model_sha256) for st in store.studies(s)] == [("old", "ab")]
  assert "environment_id" not in {c["name"] for c in inspect(e).get_columns("ss_study")}
  e.dispose()


def _trial_sql(study: int, number: int, cfg_json: str, h: str) -> str:
  return ("INSERT INTO ss_trial (study_id, number, config_json, config_hash, state, worker, started_at) "
          f"VALUES ({study}, {number}, '{cfg_json}', '{h}', 'ok', 'h:1', '2026-01-01')")


def test_a_study_made_before_its_baseline_was_stored_takes_its_first_trial(url):
  trials = [_trial_sql(1, 0, '{"beam": 0}', "b0"), _trial_sql(1, 1, '{"topk": "sort"}', "c1")]
  _old_schema(url, "0003_cost", _old_study("ran"), _old_study("new"), *trials)
  with session(e := open_db(url)) as s:
    assert [(st.name, st.baseline_config, st.baseline_hash)  # and 0005 re-keys the first trial's hash
            for st in store.studies(s)] == [("ran", '{"beam": 0}', StructureConfig().hash), ("new", None, None)]
  e.dispose()


def _migration(name: str):
  spec = importlib.util.spec_from_file_location(name, Path(db.__file__).parent / f"migrations/versions/{name}.py")
  spec.loader.exec_module(mod := importlib.util.module_from_spec(spec))
  return mod


def _frozen_configs() -> list[StructureConfig]:
  """A config for each knob value of the fields revision 0005 froze (one knob changed from the defaults, with what it
  needs), and a few with several."""
  out, frozen = [], _migration("0005_config_hash").DEFAULTS
  for name, k in KNOBS.items():
    if k.field not in frozen: continue
    for v in k.valid():
      try: out.append(to_config({name: v}))
      except ConfigError: pass
      try: out.append(to_config({name: v, "fused.attention": "native", "fused.moe": "dsl", "fused.ffn": "native"}))
      except ConfigError: pass
  return out + [StructureConfig(fused={"moe": "dsl"}, dsl_rows={"gate_up": 4}),  # an entry at its default
                StructureConfig(backends={"Q4_0:dense": "tensor"}, barriers={"q_proj": "none"})]


def test_the_migrations_hashes_are_the_configs():
  """0005 re-keys stored configs with a copy of the hash (the db does not import the model): it agrees with
  StructureConfig.hash over every knob value of its fields, and writes back the hash over every field on downgrade."""
  m, configs = _migration("0005_config_hash"), _frozen_configs()
  assert len(configs) > 60 and len({c.hash for c in configs}) > 50
  for c in configs:
    d = json.loads(c.to_json())
    assert m.new_hash(d) == c.hash
    known = {k: v for k, v in c.to_dict().items() if k in m.DEFAULTS}  # the fields 0004's code hashed
    assert m.old_hash(d) == hashlib.sha256(json.dumps(known, sort_keys=True).encode()).hexdigest()[:16]
    if c.attn_act == "float32":  # stored before the knob: its default
      d.pop("attn_act")
      assert m.new_hash(d) == c.hash


def test_a_knob_added_later_leaves_stored_hashes_as_they_were():
  later = dataclasses.make_dataclass("Later", [("new_knob", str, dataclasses.field(default="off"))],
                                     bases=(StructureConfig,), frozen=True)
  for c in _frozen_configs()[:20]:
    assert later(**c.to_dict()).hash == c.hash
    assert later(**c.to_dict(), new_knob="on").hash != c.hash
  assert StructureConfig(backends={"Q4_0:dense": "tensor"}).hash == StructureConfig().hash


def test_upgrade_re_keys_every_stored_hash_and_downgrade_restores_them(url):
  """Trials, measurements, confirmations, the study's baseline and Optuna's trial attribute: each stored hash (over
  every field, as written before 0005) becomes the config's hash, and downgrade writes the former ones back."""
  optuna.logging.set_verbosity(optuna.logging.WARNING)
  storage = optuna.storages.RDBStorage(url)
  cfgs = [StructureConfig(), StructureConfig(fused={"attention": "native"}, attn_act="q8"), StructureConfig(beam=2)]
  frozen = _migration("0005_config_hash").DEFAULTS  # the fields 0004's code wrote
  as_0004 = [json.dumps({k: v for k, v in c.to_dict().items() if k in frozen}, sort_keys=True) for c in cfgs]
  old = [hashlib.sha256(j.encode()).hexdigest()[:16] for j in as_0004]
  ot = optuna.create_study(storage=storage, study_name="s").ask()
  ot.set_user_attr("config_hash", old[1])
  _old_schema(url, "0004_baseline", _old_study("s"),
              *(_trial_sql(1, n, j, h) for n, (j, h) in enumerate(zip(as_0004, old, strict=True))),
              f"UPDATE ss_study SET baseline_config = '{as_0004[0]}', baseline_hash = '{old[0]}'",
              "INSERT INTO ss_measurement (study_id, trial_id, config_hash, stage, tok_s, kind, created_at) VALUES "
              f"(1, NULL, '{old[0]}', 'full', 1.0, 'repeat', '2026-01-01'), (1, 3, '{old[2]}', 'full', 2.0, 'trial', "
              "'2026-01-01')",
              "INSERT INTO ss_confirmation (study_id, trial_id, config_hash, pairs, rounds, tok_s, baseline_tok_s, "
              f"speedup, speedup_low, speedup_high, status, created_at) VALUES (1, 2, '{old[1]}', 2, 3, 2.0, 1.0, 2.0, "
              "1.9, 2.1, 'ok', '2026-01-01')")
  stored = ("SELECT config_hash FROM ss_trial ORDER BY number", "SELECT baseline_hash FROM ss_study",
            "SELECT config_hash FROM ss_measurement ORDER BY tok_s", "SELECT config_hash FROM ss_confirmation")
  open_db(url).dispose()
  with (e := create_engine(url)).connect() as c:
    new = [cf.hash for cf in cfgs]
    assert [[r[0] for r in c.execute(text(q))] for q in stored] == [new, new[:1], [new[0], new[2]], new[1:2]]
    assert storage.get_trial(ot._trial_id).user_attrs["config_hash"] == new[1]
    cfg = alembic_config(url)
    cfg.attributes["connection"] = c
    from alembic import command
    command.downgrade(cfg, "0004_baseline")
    assert [[r[0] for r in c.execute(text(q))] for q in stored] == [old, old[:1], [old[0], old[2]], old[1:2]]
  e.dispose()


def test_reading_commands_never_create_a_database(url, tmp_path):
  if url.startswith("sqlite"):
    with pytest.raises(NoDatabase, match=f"^no database at {tmp_path}/ss.db$"): open_db(url, create=False)
    assert os.listdir(tmp_path) == []
  else:
    with pytest.raises(NoDatabase, match="^no structsearch database at postgresql"): open_db(url, create=False)
    with (e := create_engine(url)).connect() as c: assert inspect(c).get_table_names() == []
    e.dispose()
  open_db(url).dispose()
  open_db(url, create=False).dispose()  # once made, it opens


def test_open_db_is_idempotent(url):
  with session(e := open_db(url)) as s: store.create_study(s, name="a", **STUDY)
  e.dispose()
  with session(e := open_db(url)) as s: assert [st.name for st in store.studies(s)] == ["a"]
  e.dispose()


def test_concurrent_open_db(url):
  with ThreadPoolExecutor(4) as pool: engines = list(pool.map(open_db, [url] * 4))
  for e in engines: e.dispose()
  assert OURS < set(inspect(e := create_engine(url)).get_table_names())
  e.dispose()


def test_concurrent_optuna_storage(url):
  """Processes that open Optuna's storage on a database without its tables at once all get it: one makes the tables."""
  from search.study import storage
  open_db(url).dispose()
  with ThreadPoolExecutor(6) as pool: storages = list(pool.map(lambda _: storage(url), range(6)))
  for st in storages: st.engine.dispose()
  assert {"studies", "study_directions", "version_info"} < set(inspect(e := create_engine(url)).get_table_names())
  e.dispose()


@pytest.mark.parametrize("optuna_first", [False, True])
def test_optuna_tables_beside_ours(url, optuna_first):
  optuna.logging.set_verbosity(optuna.logging.WARNING)
  if not optuna_first: open_db(url).dispose()
  storage = optuna.storages.RDBStorage(url)
  study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
  study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
  engine = open_db(url)
  with session(engine) as s:
    ours = store.create_study(s, name="s", **STUDY)
    for t in study.trials: store.start_trial(s, ours, t.number, "{}", "c0", None, "host:1", optuna_trial_id=t._trial_id)
  with session(engine) as s:
    assert [t.optuna_trial_id for t in store.trials(s, ours)] == [t._trial_id for t in study.trials]
  tables = set(inspect(engine).get_table_names())
  assert OURS | {VERSION_TABLE, "alembic_version", "studies", "trials", "trial_params", "version_info"} <= tables
  assert len(optuna.load_study(study_name="s", storage=storage).trials) == 3
  storage.engine.dispose()
  engine.dispose()


def test_git_state_dedupe(engine, tmp_path):
  repo = git.Repo.init(tmp_path / "repo", initial_branch="main")
  (tmp_path / "repo" / "sub").mkdir()
  (f := tmp_path / "repo" / "sub" / "a.txt").write_text("one\n")
  repo.index.add(["sub/a.txt"])
  who = git.Actor("t", "t@example.com")
  repo.index.commit("init", author=who, committer=who)
  assert git_state(tmp_path) is None
  clean = git_state(f.parent)
  assert clean == {"commit": repo.head.commit.hexsha, "branch": "main", "dirty": False, "diff": ""}
  with session(engine) as s:
    a, b = store.get_or_create_git_state(s, clean), store.get_or_create_git_state(s, git_state(f.parent))
  assert a.id == b.id
  f.write_text("two\n")
  (tmp_path / "repo" / "new.txt").write_text("x")
  dirty = git_state(f.parent)
  assert dirty["dirty"] and "+two" in dirty["diff"] and dirty["diff"].endswith("# untracked: new.txt")
  with session(engine) as s: c = store.get_or_create_git_state(s, dirty)
  assert c.id != a.id and c.diff == dirty["diff"]
  repo.git.checkout(repo.head.commit.hexsha, "--detach")
  assert git_state(f.parent)["branch"] is None


def test_stored_diffs_leave_out_ignored_files_and_secrets(tmp_path):
  root = tmp_path / "repo"
  repo = git.Repo.init(root, initial_branch="main")
  files = {".gitignore": "*.log\n", "code.py": "x = 1\n", ".env": "A=1\n", "conf/db_password.txt": "p\n",
           "keys/server.pem": "k\n", "run.log": "l\n"}
  for name, body in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(body)
  repo.git.add("-f", *files)  # run.log is tracked although .gitignore matches it
  who = git.Actor("t", "t@example.com")
  repo.index.commit("init", author=who, committer=who)
  for name in files: (root / name).write_text({"code.py": "x = 2\n",
                                               ".gitignore": "*.log\nbuild/\n"}.get(name, "SECRET-VALUE changed\n"))
  for name in ("API_TOKEN.txt", "notes.txt", "build.log"): (root / name).write_text("SECRET-VALUE\n")
  d = git_state(root)["diff"]
  assert "+x = 2" in d and "# untracked: notes.txt" in d and "SECRET-VALUE" not in d and "build.log" not in d
  left_out = {line.removeprefix("# left out: ") for line in d.splitlines() if line.startswith("# left out: ")}
  assert left_out == {".env", "conf/db_password.txt", "keys/server.pem", "run.log", "API_TOKEN.txt"}


CREDENTIAL_FILES = (".netrc", "netrc", ".pgpass", "home/.ssh/config", "id_rsa", "id_dsa", "id_ecdsa", "id_ecdsa_sk",
                    "id_ed25519", "id_ed25519.pub", "deploy/ci_rsa", "keys/client.p12", "keys/client.pfx", ".npmrc",
                    ".pypirc", "cfg/.aws/credentials", ".docker/config.json",
                    ".config/gcloud/application_default_credentials.json", ".config/gcloud/credentials.db",
                    "infra/prod.tfvars", "prod.env", "Secrets.yaml")
# (fake) secrets of the forms a scanner finds in any file, one per line of a hunk
SECRET_LINES = ("-----BEGIN OPENSSH " + "PRIVATE KEY-----", "-----BEGIN EC " + "PRIVATE KEY-----", "gh_token = 'ghp_"
                + "a1B2" * 9 + "'", "url = 'https://x-access-token:" + "Zz9" * 7 + "@github.com/o/r'", "aws_key = 'AKIA"
                + "ABCDEFGH23456789" + "'", "slack = 'xoxb-" + "1234567890-abcdefghij" + "'",
                "headers = {'Authorization': 'Bearer " + "eyAbC.dEf-" * 4 + "'}", "PASSWORD = 'hunter22-" + "secret'",
                "github_pat_" + "11ABCDEFG" * 4)


def test_stored_diffs_leave_out_credential_files_and_secret_hunks(tmp_path):
  """Every file a credential scanner flags by name (tracked and modified, newly staged, untracked) and every hunk that
  holds a private key block or a token is left out of the stored diff; the rest of the change stays."""
  root = tmp_path / "repo"
  repo = git.Repo.init(root, initial_branch="main")
  tracked = CREDENTIAL_FILES[:12]
  code = "".join(f"line {i}\n" for i in range(40))
  for name in (*tracked, "code.py", "other.py"):
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(code if name.endswith(".py") else "old\n")
  repo.git.add("-f", "--", *tracked, "code.py", "other.py")
  who = git.Actor("t", "t@example.com")
  repo.index.commit("init", author=who, committer=who)
  for name in tracked: (root / name).write_text("SECRET-VALUE\n")
  staged = CREDENTIAL_FILES[12:17]
  for name in (*staged, *CREDENTIAL_FILES[17:]):
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text("SECRET-VALUE\n")
  repo.git.add("-f", "--", *staged)
  lines = code.splitlines()
  lines[2], lines[30] = "x = 2  # kept", SECRET_LINES[0]  # two hunks of one file: the plain one stays
  (root / "code.py").write_text("\n".join(lines) + "\n")
  (root / "other.py").write_text(code + "".join(f"{s}\n" for s in SECRET_LINES[1:]))
  d = git_state(root)["diff"]
  assert "+x = 2  # kept" in d and "SECRET-VALUE" not in d and "line 30" not in d, d
  for s in SECRET_LINES: assert s not in d, s
  left_out = {line.removeprefix("# left out: ") for line in d.splitlines() if line.startswith("# left out: ")}
  assert {n for n in left_out if not n.startswith("a hunk")} == set(CREDENTIAL_FILES)
  assert sorted(n.split(" (")[0] for n in left_out
                if n.startswith("a hunk")) == ["a hunk of code.py", "a hunk of other.py"]
  for s in SECRET_LINES[1:]:  # each pattern alone is enough
    (root / "other.py").write_text(code + s + "\n")
    assert s not in git_state(root)["diff"], s


def test_environment_dedupe(engine):
  with session(engine) as s:
    a, b = store.get_or_create_environment(s, ENV), store.get_or_create_environment(s, dict(ENV, tinygrad_commit=None))
    c = store.get_or_create_environment(s, ENV | {"tinygrad_diff": "--- a"})
    assert (a.id == b.id != c.id and a.hash
            == fingerprint_hash({k: ENV.get(k) for k in ENV | {"tinygrad_commit": 0, "tinygrad_diff": 0}}))
    with pytest.raises(ValueError, match="unknown fields gpu"): store.get_or_create_environment(s, ENV | {"gpu": "x"})
    with pytest.raises(ValueError, match="missing fields driver"):
      store.get_or_create_environment(s, {k: v for k, v in ENV.items() if k != "driver"})


def test_trial_lifecycle(engine):
  profile = [{"rank": 1, "name": "r_matvec", "count": 40, "us_per_token": 120.5, "gb_s": 850.0, "share": 0.6},
             {"rank": 2, "name": "E_add", "count": 10, "us_per_token": 10.0, "gb_s": None, "share": 0.05}]
  with session(engine) as s:
    study = store.create_study(s, name="s", **STUDY)
  with session(engine) as s:
    gs = store.get_or_create_git_state(s, {"commit": "f" * 40, "branch": None, "dirty": False, "diff": ""})
    t = store.start_trial(s, study, 0, '{"topk": "sort"}', "abcd", gs, "host:42", optuna_trial_id=7)
  assert t.state == "running" and t.finished_at is None and t.started_at.tzinfo is not None
  with session(engine) as s:
    store.finish_trial(s, t, state="ok", stage="full", tok_s=12.5, block_tok_s=99.0, metrics={"ms_p50": 80.0},
                                                phases={"load": 1.5}, check={"max_abs": 1e-3}, profile=profile,
                                                environment=store.get_or_create_environment(s, ENV))
  with session(engine) as s:
    t = store.trials(s, study)[0]
    assert (t.state, t.stage, t.tok_s, t.metrics, t.phases,
            t.check) == ("ok", "full", 12.5, {"ms_p50": 80.0}, {"load": 1.5}, {"max_abs": 1e-3})
    assert [(p.rank, p.name, p.gb_s) for p in t.profile] == [(1, "r_matvec", 850.0), (2, "E_add", None)]
    assert t.git_state.commit == "f" * 40 and t.environment.host == ENV["host"] and t.optuna_trial_id == 7
    assert t.finished_at.tzinfo == UTC and t.finished_at >= t.started_at
    with pytest.raises(ValueError): store.finish_trial(s, t, state="done")
  with pytest.raises(IntegrityError), session(engine) as s:
    store.start_trial(s, study, 0, "{}", "abcd", None, "host:43")


def test_find_measured_and_interrupted(engine):
  with session(engine) as s:
    study, other = store.create_study(s, name="s", **STUDY), store.create_study(s, name="o", **STUDY)
    make_trial(s, other, 0, "ok", 50.0)
    assert store.find_measured(s, study, "c0") is None
    first = make_trial(s, study, 0, "ok", 10.0)
    for n, state in enumerate(("interrupted", "pruned", "running"), 1): make_trial(s, study, n, state)
    make_trial(s, study, 4, "reused", 10.0, reused_from=first)
    assert store.find_measured(s, study, "c0").id == first.id
    make_trial(s, study, 5, "oom", failure_class="oom")
    assert store.find_measured(s, study, "c0").number == 5
    assert store.find_measured(s, study, "c1") is None
    assert store.mark_interrupted(s, study, {0, 3, 9}, "its worker died") == 1
    assert [t.state for t in store.trials(s, study)] == ["ok", "interrupted", "pruned", "interrupted", "reused", "oom"]
    assert store.trials(s, study)[3].error_text == "its worker died"


def test_killed_and_timed_out_configs_are_measured_again_up_to_the_retry_limit(engine):
  with session(engine) as s:
    study = store.create_study(s, name="s", **STUDY)
    make_trial(s, study, 0, "killed", failure_class="killed")
    assert store.find_measured(s, study, "c0") is None  # not a property of the config: measured again
    make_trial(s, study, 1, "timeout", failure_class="timeout")
    assert store.find_measured(s, study, "c0", retries=2) is None
    make_trial(s, study, 2, "killed", failure_class="killed")
    assert store.find_measured(s, study, "c0", retries=2).number == 2  # failed 3 times: the last failure stands
    make_trial(s, study, 3, "ok", 5.0)
    make_trial(s, study, 4, "timeout", failure_class="timeout")
    assert store.find_measured(s, study, "c0").number == 3  # a lasting measurement outranks later transient failures


def test_leaderboard_and_confirmations(engine):
  with session(engine) as s:
    study = store.create_study(s, name="s", **STUDY)
    for n, (state, tok_s) in enumerate([("ok", 10.0), ("ok", 30.0), ("wrong_output", 50.0), ("oom", None), ("ok", 20.0),
                                        ("reused", 30.0)]):
      make_trial(s, study, n, state, tok_s, config_hash=f"c{n}")
    assert [t.tok_s for t in store.leaderboard(s, study)] == [30.0, 20.0, 10.0]
    assert [t.number for t in store.leaderboard(s, study, limit=1)] == [1]
    best = store.leaderboard(s, study)[0]
    store.add_confirmation(s, study, best, pairs=5, rounds=3, tok_s=30.0, baseline_tok_s=10.0, speedup=3.0,
                           speedup_low=2.8, speedup_high=3.2, status="confirmed")
  with session(engine) as s:
    assert [(c.config_hash, c.trial.number, c.speedup) for c in store.confirmations(s, study)] == [("c1", 1, 3.0)]


def test_unreachable_server():
  t0 = time.monotonic()
  with pytest.raises(DBError) as e: open_db("postgresql+psycopg://me:secret@127.0.0.1:1/db?connect_timeout=3")
  assert time.monotonic() - t0 < 5
  msg = str(e.value)
  assert (msg.startswith("cannot reach the database at postgresql+psycopg://me:***@127.0.0.1:1/db")
          and "connection refused" in msg)
  assert "secret" not in msg and "\n" not in msg


def test_not_a_sqlite_file(tmp_path):
  (f := tmp_path / "x.db").write_bytes(junk := os.urandom(8192))
  with pytest.raises(DBError, match=r"x\.db is not a SQLite database$"): open_db(f"sqlite:///{f}")
  assert f.read_bytes() == junk and os.listdir(tmp_path) == ["x.db"]
  with pytest.raises(DBError, match="^cannot open the SQLite database"):
    open_db(f"sqlite:///{tmp_path}/no/such/dir/x.db")


@pytest.mark.parametrize("bad", ["nosuch://host/db", "mysql://u@h/db", "postgresql+nosuchdriver://u@h/db", "not a url"])
def test_unsupported_url(bad):
  with pytest.raises(DBError, match="^unsupported database URL"): open_db(bad)


def test_newer_schema_is_refused(url):
  with session(e := open_db(url)) as s: store.create_study(s, name="kept", **STUDY)
  with e.begin() as c: c.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'"))
  e.dispose()
  with pytest.raises(DBError, match="schema revision 9999_future, unknown to this structsearch"): open_db(url)
  with (e := create_engine(url)).connect() as c:
    assert c.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}")) == "9999_future"
    assert c.scalar(text("SELECT name FROM ss_study")) == "kept"
  e.dispose()


def test_default_url(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert default_url() == f"sqlite:///{tmp_path}/structsearch.db"
