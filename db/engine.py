"""Opening the database: connect, check, bring our schema to head with Alembic. Every failure is one line in a
DBError."""
from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import URL, Engine, create_engine, event, make_url, text
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session

from db.models import VERSION_TABLE

MIGRATIONS = Path(__file__).parent / "migrations"
PG_LOCK_KEY = 0x5353_4442  # any constant: the pg_advisory_xact_lock that serialises concurrent migrations
OUTAGE_S = 90  # how long a server database that was reached may stay unreachable before the command gives up on it


class DBError(RuntimeError):
  """The database cannot be used: unreachable, not a database, unsupported URL, or a schema newer than this code."""


class NoDatabase(DBError):
  """A command that only reads or joins found no structsearch database at the URL (and made none)."""


def default_url() -> str: return f"sqlite:///{Path.cwd() / 'structsearch.db'}"


def hide_password(url: str) -> str:
  """The URL as it may be printed: the password after the user name and a `password=` query value masked."""
  return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url))


def alembic_config(url: str) -> Config:
  """Alembic's configuration without an alembic.ini, so migrations run from an installed package and any cwd."""
  cfg = Config()
  cfg.set_main_option("script_location", str(MIGRATIONS))
  cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
  return cfg


def _line(e: BaseException) -> str:
  msg = str(getattr(e, "orig", None) or e).strip()
  return msg.splitlines()[0] if msg else type(e).__name__


def _reason(e: DBAPIError) -> str:
  """The driver's first line less its 'connection to server at ... failed:' preamble: 'connection refused', 'database
  "x" does not exist', ..."""
  reason = re.sub(r"^.*failed: (FATAL: +)?", "", _line(e)).strip()
  return reason[:1].lower() + reason[1:]


def failure(e: BaseException, url: str) -> str | None:
  """One line for a database that failed under a running command (the driver's error anywhere in e's chain: Optuna
  wraps it), None when e is no database error."""
  while e is not None and not isinstance(e, DBAPIError): e = e.__cause__ or e.__context__
  if e is None: return None
  u, msg = make_url(url), str(e.orig or e).lower()
  sqlite = u.get_backend_name() == "sqlite"
  where = f"the SQLite database {u.database}" if sqlite else f"the database at {hide_password(url)}"
  if "disk is full" in msg or "no space left" in msg: return f"the disk of {where} is full"
  if "readonly database" in msg or "read-only file system" in msg or sqlite and not os.access(
      Path(u.database or ".").parent, os.W_OK): return f"{where} is read-only"
  if "malformed" in msg or "not a database" in msg: return f"{where} is corrupt ({_line(e)})"
  return f"cannot use {where}: {_line(e)}" if sqlite else f"lost {where}: {_reason(e)}"


def engine_kwargs(url: str) -> dict:
  """Engine options of every connection to url, ours and Optuna's: SQLite waits up to 30 s for a lock (its default is 5
  s); a server's pooled connections are checked before use (a restarted server left them dead), and a connection
  attempt gives up after 10 s."""
  u = make_url(url)
  if u.get_backend_name() == "sqlite": return {"connect_args": {"timeout": 30}}
  return {"pool_pre_ping": True, "connect_args": {} if "connect_timeout" in u.query else {"connect_timeout": 10}}


def reconnecting(engine: Engine, reached: bool = False, outage_s: float = OUTAGE_S) -> Engine:
  """A server database that was reached once (by this engine, or `reached` already) and then goes away (restarted,
  failed over, the network cut) is waited for: each new connection is tried again with backoff for up to outage_s. A
  server never reached fails at once."""
  if engine.dialect.name != "postgresql": return engine
  reached = [True] if reached else []
  @event.listens_for(engine, "do_connect")
  def connect(dialect, conn_rec, cargs, cparams):
    deadline, wait = time.monotonic() + outage_s, 0.25
    while True:
      try: conn = dialect.connect(*cargs, **cparams)
      except dialect.loaded_dbapi.OperationalError:
        if not reached or time.monotonic() + wait > deadline: raise
        time.sleep(wait)
        wait = min(2 * wait, 5.0)
        continue
      reached.append(True)
      return conn
  return engine


def _create_engine(u: URL) -> Engine:
  if u.get_backend_name() == "sqlite":
    engine = create_engine(u, **engine_kwargs(u.render_as_string(hide_password=False)))
    event.listen(engine, "connect", lambda dbapi_conn, _: dbapi_conn.execute("PRAGMA foreign_keys = ON"))
    return engine
  if u.get_backend_name() == "postgresql":
    return reconnecting(create_engine(u, **engine_kwargs(u.render_as_string(hide_password=False))))
  raise ArgumentError(f"backend {u.get_backend_name()!r} is not supported (use sqlite:///FILE or "
                      "postgresql+psycopg://USER@HOST:PORT/DB)")


def _upgrade(conn, url: str, safe: str, create: bool) -> None:
  cfg = alembic_config(url)
  cfg.attributes["connection"] = conn
  known = {r.revision for r in ScriptDirectory.from_config(cfg).walk_revisions()}
  current = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_heads()
  if not current and not create: raise NoDatabase(f"no structsearch database at {safe}")
  if unknown := sorted(set(current) - known):
    raise DBError(f"the database at {safe} has schema revision {', '.join(unknown)}, unknown to this structsearch: a "
                  "newer version made it")
  command.upgrade(cfg, "head")


def open_db(url: str, create: bool = True) -> Engine:
  """Connect to url and upgrade our tables to head (idempotent; concurrent callers wait for each other). Never drops
  data. Without `create` (the commands that only read or join), a database that does not exist yet is an error, and none
  is made."""
  safe = hide_password(url)
  try: u = make_url(url); engine = _create_engine(u)
  except (ArgumentError, NoSuchModuleError, ImportError) as e:
    raise DBError(f"unsupported database URL {safe}: {_line(e)}") from None
  sqlite = u.get_backend_name() == "sqlite"
  if sqlite and not create and not (u.database and u.database != ":memory:" and Path(u.database).is_file()):
    engine.dispose()
    raise NoDatabase(f"no database at {u.database}")
  try: conn = engine.connect()
  except DBAPIError as e:
    engine.dispose()
    where = f"the SQLite database {u.database}" if sqlite else f"the database at {safe}"
    raise DBError(f"cannot {'open' if sqlite else 'reach'} {where}: {_reason(e)}") from None
  try:
    with conn:
      # write-ahead log: readers (the dashboard, `search status`) never block the writing search, nor it them
      if sqlite:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        conn.commit()
      with conn.begin():
        if sqlite: conn.exec_driver_sql("BEGIN IMMEDIATE")  # take the write lock before reading the schema version
        else: conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
        _upgrade(conn, u.render_as_string(hide_password=False), safe, create)
  except (SQLAlchemyError, CommandError, DBError) as e:
    engine.dispose()
    if isinstance(e, DBError): raise
    if sqlite and "file is not a database" in str(e): raise DBError(f"{u.database} is not a SQLite database") from None
    if sqlite and isinstance(e, DBAPIError): raise DBError(failure(e, url)) from None
    raise DBError(f"cannot set up the schema of the database at {safe}: {_line(e)}") from None
  return engine


@contextmanager
def session(engine: Engine) -> Iterator[Session]:
  """One transaction: commit on success, roll back on error. Objects stay readable after it (no expiry on commit)."""
  with Session(engine, expire_on_commit=False) as s, s.begin(): yield s
