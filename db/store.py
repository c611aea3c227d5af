"""The queries the search layer, the CLI and the views use. Functions take a Session, flush, and leave committing to the caller
(db.engine.session). Model objects passed in may be detached: only their ids are used."""
from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from db.capture import fingerprint_hash
from db.models import TRIAL_STATES, Base, Confirmation, Environment, GitState, KernelProfile, Study, Trial, utcnow

UNMEASURED = ("running", "interrupted", "pruned", "reused")  # states that say nothing about how a config performs
TRANSIENT = ("killed", "timeout")  # failures that are not a property of the config: it is measured again when proposed again
RETRIES = 2  # ... up to this many times; after that the config's last failure stands


def _get_or_insert(s: Session, cls: type[Base], values: dict) -> Base:
  """The row of cls with the hash of values, inserted when missing. Unknown keys and missing required ones raise ValueError;
  missing nullable ones count as None. Safe against a concurrent insert of the same row."""
  cols = {c.name: c for c in cls.__table__.columns if c.name not in ("id", "hash", "created_at")}
  if unknown := sorted(set(values) - set(cols)): raise ValueError(f"{cls.__tablename__}: unknown fields {', '.join(unknown)}")
  if missing := sorted(n for n, c in cols.items() if not c.nullable and values.get(n) is None):
    raise ValueError(f"{cls.__tablename__}: missing fields {', '.join(missing)}")
  fields = {n: values.get(n) for n in cols}
  h = fingerprint_hash(fields)
  if (row := s.scalar(select(cls).filter_by(hash=h))) is None:
    insert = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
    s.execute(insert(cls).values(hash=h, created_at=utcnow(), **fields).on_conflict_do_nothing(index_elements=["hash"]))
    row = s.scalar(select(cls).filter_by(hash=h))
  return row


def get_or_create_environment(s: Session, env: dict) -> Environment:
  """env: Environment's column names (device, device_name, driver, tinygrad_version, tinygrad_commit, tinygrad_diff, python, host, platform)."""
  return _get_or_insert(s, Environment, env)


def get_or_create_git_state(s: Session, state: dict) -> GitState:
  """state: as db.capture.git_state returns it."""
  return _get_or_insert(s, GitState, state)


def get_study(s: Session, name: str) -> Study | None: return s.scalar(select(Study).filter_by(name=name))
def studies(s: Session) -> list[Study]: return list(s.scalars(select(Study).order_by(Study.id)))


def create_study(s: Session, **fields) -> Study:
  s.add(study := Study(**fields))
  s.flush()
  return study


def start_trial(s: Session, study: Study, number: int, config_json: str, config_hash: str, git_state: GitState | None, worker: str,
                optuna_trial_id: int | None = None) -> Trial:
  s.add(trial := Trial(study_id=study.id, number=number, config_json=config_json, config_hash=config_hash, state="running", worker=worker,
                       git_state_id=git_state and git_state.id, optuna_trial_id=optuna_trial_id))
  s.flush()
  return trial


def finish_trial(s: Session, trial: Trial, *, state: str, stage: str | None = None, tok_s: float | None = None, block_tok_s: float | None = None,
                 metrics: dict | None = None, phases: dict | None = None, check: dict | None = None, failure_class: str | None = None,
                 error_text: str | None = None, reused_from: Trial | None = None, profile: list[dict] | None = None,
                 environment: Environment | None = None) -> Trial:
  """Record the outcome and the environment the trial process ran in; profile rows are dicts with rank, name, count, us_per_token, gb_s, share."""
  if state not in TRIAL_STATES or state == "running": raise ValueError(f"not a final trial state: {state!r}")
  t = s.get(Trial, trial.id)
  t.state, t.stage, t.tok_s, t.block_tok_s, t.metrics, t.phases, t.check = state, stage, tok_s, block_tok_s, metrics, phases, check
  t.failure_class, t.error_text, t.reused_from_id, t.finished_at = failure_class, error_text, reused_from and reused_from.id, utcnow()
  t.environment_id = environment and environment.id
  t.profile = [KernelProfile(**row) for row in profile or ()]
  s.flush()
  return t


def find_measured(s: Session, study: Study, config_hash: str, retries: int = RETRIES) -> Trial | None:
  """The trial of study whose outcome stands for this config: its most recent measurement (ok, wrong_output or a failure;
  not interrupted/pruned/reused) that is not TRANSIENT; a transient one only once the config has failed so more than `retries` times."""
  q = select(Trial).filter_by(study_id=study.id, config_hash=config_hash).where(Trial.state.not_in(UNMEASURED))
  measured = list(s.scalars(q.order_by(Trial.id.desc())))
  if lasting := [t for t in measured if t.state not in TRANSIENT]: return lasting[0]
  return measured[0] if len(measured) > retries else None


def leaderboard(s: Session, study: Study, limit: int = 20) -> list[Trial]:
  """ok trials by tok_s, fastest first; reused trials are left out (they duplicate their source)."""
  q = select(Trial).filter_by(study_id=study.id, state="ok").where(Trial.tok_s.is_not(None))
  return list(s.scalars(q.order_by(Trial.tok_s.desc(), Trial.number).limit(limit)))


def trials(s: Session, study: Study) -> list[Trial]: return list(s.scalars(select(Trial).filter_by(study_id=study.id).order_by(Trial.number)))


def mark_interrupted(s: Session, study: Study, numbers: Iterable[int], why: str) -> int:
  """Set the still-running trials among numbers (their worker died) to interrupted, saying why; returns how many changed."""
  q = update(Trial).filter_by(study_id=study.id, state="running").where(Trial.number.in_(list(numbers)))
  return s.execute(q.values(state="interrupted", error_text=why, finished_at=utcnow()).execution_options(synchronize_session="fetch")).rowcount


def add_confirmation(s: Session, study: Study, trial: Trial, **fields) -> Confirmation:
  """fields: Confirmation's columns; config_hash defaults to the trial's."""
  s.add(c := Confirmation(study_id=study.id, trial_id=trial.id, **{"config_hash": trial.config_hash} | fields))
  s.flush()
  return c


def confirmations(s: Session, study: Study) -> list[Confirmation]:
  return list(s.scalars(select(Confirmation).filter_by(study_id=study.id).order_by(Confirmation.id)))
