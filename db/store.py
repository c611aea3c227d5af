"""The queries the search layer, the CLI and the views use. Functions take a Session, flush, and leave committing to the
caller (db.engine.session). Model objects passed in may be detached: only their ids are used."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from sqlalchemy import delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from db.capture import fingerprint_hash
from db.models import (
  TRIAL_STATES,
  Base,
  Confirmation,
  Environment,
  Export,
  GitState,
  KernelProfile,
  Measurement,
  Study,
  Trial,
  utcnow,
)

# of a kernel profile row, as ss_kernel_profile stores it
PROFILE_COLUMNS = ("rank", "name", "count", "us_per_token", "gb_s", "share", "stage", "layers", "bytes",
                   "bandwidth_share")
UNMEASURED = ("running", "interrupted", "pruned", "reused")  # states that say nothing about how a config performs
# failures that are not a property of the config: it is measured again when proposed again
TRANSIENT = ("killed", "timeout")
RETRIES = 2  # ... up to this many times; after that the config's last failure stands


def _get_or_insert(s: Session, cls: type[Base], values: dict) -> Base:
  """The row of cls with the hash of values, inserted when missing. Unknown keys and missing required ones raise
  ValueError; missing nullable ones count as None. Safe against a concurrent insert of the same row."""
  cols = {c.name: c for c in cls.__table__.columns if c.name not in ("id", "hash", "created_at")}
  if unknown := sorted(set(values) - set(cols)):
    raise ValueError(f"{cls.__tablename__}: unknown fields {', '.join(unknown)}")
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
  """env: Environment's column names (device, device_name, driver, tinygrad_version, tinygrad_commit, tinygrad_diff,
  python, host, platform)."""
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


def start_trial(s: Session, study: Study, number: int, config_json: str, config_hash: str, git_state: GitState | None,
                worker: str, optuna_trial_id: int | None = None) -> Trial:
  s.add(trial := Trial(study_id=study.id, number=number, config_json=config_json, config_hash=config_hash,
                       state="running", worker=worker, git_state_id=git_state
                       and git_state.id, optuna_trial_id=optuna_trial_id))
  s.flush()
  return trial


def finish_trial(s: Session, trial: Trial, *, state: str, stage: str | None = None, tok_s: float | None = None,
                 block_tok_s: float | None = None, metrics: dict | None = None, phases: dict | None = None, check: dict
                 | None = None, failure_class: str | None = None, error_text: str | None = None, reused_from: Trial
                 | None = None, profile: list[dict] | None = None, environment: Environment | None = None) -> Trial:
  """Record the outcome and the environment the trial process ran in; profile rows are model/profile.py's (the keys of
  PROFILE_COLUMNS). A measured figure (the block proxy's, the full model's when ok) is also stored as one of
  the config's measurements; a reused trial measured nothing."""
  if state not in TRIAL_STATES or state == "running": raise ValueError(f"not a final trial state: {state!r}")
  t = s.get(Trial, trial.id)
  t.state, t.stage, t.tok_s, t.block_tok_s, t.metrics, t.phases, t.check = (state, stage, tok_s, block_tok_s, metrics,
                                                                            phases, check)
  t.failure_class, t.error_text, t.reused_from_id, t.finished_at = (failure_class, error_text, reused_from
                                                                    and reused_from.id, utcnow())
  t.environment_id = environment and environment.id
  t.profile = profile_rows(profile or [])
  if state != "reused":
    full = stage == "full" and (metrics or {}).get("block") is not None  # both stages ran: the block's under block_
    if block_tok_s is not None:
      add_measurement(s, t.study_id, t.config_hash, "block", block_tok_s, "trial", trial=t,
                      **conditions((metrics or {}).get("block") if full else metrics, phases, "block_" if full else ""))
    if state == "ok" and tok_s is not None:
      add_measurement(s, t.study_id, t.config_hash, stage
                      or "full", tok_s, "trial", trial=t, rounds=(metrics or {}).get("tok_s_rounds"),
                      **conditions(metrics, phases))
  s.flush()
  return t


def profile_rows(profile: list[dict]) -> list[KernelProfile]:
  """A trial's per-kernel profile (model/profile.py rows) as ss_kernel_profile rows."""
  return [KernelProfile(**{k: row.get(k) for k in PROFILE_COLUMNS}) for row in profile]


def find_measured(s: Session, study: Study, config_hash: str, retries: int = RETRIES) -> Trial | None:
  """The trial of study whose outcome stands for this config: its most recent measurement (ok, wrong_output or a
  failure; not interrupted/pruned/reused) that is not TRANSIENT; a transient one only once the config has failed so more
  than `retries` times."""
  q = select(Trial).filter_by(study_id=study.id, config_hash=config_hash).where(Trial.state.not_in(UNMEASURED))
  measured = list(s.scalars(q.order_by(Trial.id.desc())))
  if lasting := [t for t in measured if t.state not in TRANSIENT]: return lasting[0]
  return measured[0] if len(measured) > retries else None


def leaderboard(s: Session, study: Study, limit: int | None = 20) -> list[Trial]:
  """One ok trial per config (its first), fastest first by the config's robust estimate (see estimates); reused trials
  are left out (they duplicate their source)."""
  q = select(Trial).filter_by(study_id=study.id, state="ok").where(Trial.tok_s.is_not(None)).order_by(Trial.number)
  first: dict[str, Trial] = {}
  for t in s.scalars(q): first.setdefault(t.config_hash, t)
  est = estimates(s, study)
  ranked = sorted(first.values(), key=lambda t: (-(est[t.config_hash].median if t.config_hash in est else t.tok_s),
                                                 t.number))
  return ranked[:limit]


def trials(s: Session, study: Study) -> list[Trial]:
  return list(s.scalars(select(Trial).filter_by(study_id=study.id).order_by(Trial.number)))


def mark_interrupted(s: Session, study: Study, numbers: Iterable[int], why: str) -> int:
  """Set the still-running trials among numbers (their worker died) to interrupted, saying why; returns how many
  changed."""
  q = update(Trial).filter_by(study_id=study.id, state="running").where(Trial.number.in_(list(numbers)))
  return s.execute(q.values(state="interrupted", error_text=why,
                            finished_at=utcnow()).execution_options(synchronize_session="fetch")).rowcount


def add_confirmation(s: Session, study: Study, trial: Trial, **fields) -> Confirmation:
  """fields: Confirmation's columns; config_hash defaults to the trial's."""
  s.add(c := Confirmation(study_id=study.id, trial_id=trial.id, **{"config_hash": trial.config_hash} | fields))
  s.flush()
  return c


def confirmations(s: Session, study: Study) -> list[Confirmation]:
  return list(s.scalars(select(Confirmation).filter_by(study_id=study.id).order_by(Confirmation.id)))


def add_measurement(s: Session, study_id: int, config_hash: str, stage: str, tok_s: float, kind: str, trial: Trial
                    | None = None, rounds: list[float] | None = None, wall_s: float | None = None,
                    **conditions: float | None) -> Measurement:
  """conditions: as `conditions` reads them from a run (load_start, load_end, lock_wait_s)."""
  if kind not in Measurement.KINDS: raise ValueError(f"not a measurement kind: {kind!r}")
  s.add(m := Measurement(study_id=study_id, trial_id=trial
                         and trial.id, config_hash=config_hash, stage=stage, tok_s=tok_s, rounds=rounds, kind=kind,
                         wall_s=wall_s, **conditions))
  s.flush()
  return m


def conditions(metrics: dict | None, phases: dict | None, prefix: str = "") -> dict[str, float | None]:
  """The conditions of a measurement as a trial's run records them (evaluator/runner.py evaluate): the host's load
  average at its process's start and end (metrics `host_load`) and its wait for the device lock (phases
  `lock_wait_s`); `prefix`: the block stage's, where a trial stores both stages ("block_")."""
  load = (metrics or {}).get("host_load") or (None, None)
  return {"load_start": load[0], "load_end": load[1], "lock_wait_s": (phases or {}).get(f"{prefix}lock_wait_s")}


def measurements(s: Session, study: Study, stage: str | None = "full") -> list[Measurement]:
  q = select(Measurement).filter_by(study_id=study.id)
  return list(s.scalars((q if stage is None else q.filter_by(stage=stage)).order_by(Measurement.id)))


@dataclass(frozen=True)
class Estimate:
  """A config's tok/s: the median of its measurements, and a 90% interval for it (None until some config is measured
  twice)."""
  median: float
  low: float | None
  high: float | None
  n: int  # measurements


LEVEL, BOOT = 0.90, 2000


def estimates(s: Session, study: Study, stage: str = "full") -> dict[str, Estimate]:
  """The robust estimate of every measured config of study (by config_hash), from all its measurements at stage.

  Run-to-run noise is a property of the machine and the protocol, not of one config, and most configs are measured once
  or twice: an interval from a config's own figures alone would be empty (n=1) or cover little (n=2 brackets the median
  half the time). So the spread is pooled: every config measured at least twice (the baseline above all, repeated
  through the study) contributes its log-deviations from its own median (scaled by sqrt(n/(n-1)) for the degree of
  freedom the median takes); a config's interval is then a residual bootstrap of the median of n such deviations around
  its median, so it narrows as the config is measured again. Before any config has been measured twice there is no noise
  figure, and no interval."""
  by: dict[str, list[float]] = defaultdict(list)
  for m in measurements(s, study, stage): by[m.config_hash].append(m.tok_s)
  pool = [(math.log(x) - float(np.median(np.log(xs)))) * math.sqrt(len(xs) / (len(xs) - 1)) for xs in by.values()
          if len(xs) > 1 for x in xs]
  rng, spread = np.random.default_rng(0), {}
  def bounds(n: int) -> tuple[float, float]:  # quantiles of the median of n pooled deviations
    if n not in spread:
      meds = np.median(rng.choice(pool, size=(BOOT, n)), axis=1)
      spread[n] = (float(np.quantile(meds, (1 - LEVEL) / 2)), float(np.quantile(meds, (1 + LEVEL) / 2)))
    return spread[n]
  out = {}
  for h, xs in by.items():
    med = float(np.median(xs))
    if not pool: out[h] = Estimate(med, None, None, len(xs))
    else:
      lo, hi = bounds(len(xs))
      out[h] = Estimate(med, med * math.exp(-hi), med * math.exp(-lo), len(xs))
  return out


def add_export(s: Session, study: Study, trial: Trial, path: str, commit: str | None = None, branch: str | None = None,
               diff: str | None = None) -> Export:
  s.add(e := Export(study_id=study.id, trial_id=trial.id, path=path, commit=commit, branch=branch, diff=diff))
  s.flush()
  return e


def exports(s: Session, study: Study) -> list[Export]:
  return list(s.scalars(select(Export).filter_by(study_id=study.id).order_by(Export.id)))


def interval(e: Estimate) -> str:
  """`median [low, high]`, or the median alone while the study has no noise figure."""
  return (f"{e.median:.2f} [{e.low:.2f}, {e.high:.2f}]" if e.low is not None
          else f"{e.median:.2f} [noise not measured yet]")


def delete_study(s: Session, study: Study) -> dict[str, int]:
  """Every row of the study in our tables, and the study: the counts removed, by table."""
  trial_ids = select(Trial.id).where(Trial.study_id == study.id).scalar_subquery()
  counts = {}
  for cls, where in ((KernelProfile, KernelProfile.trial_id.in_(trial_ids)),
                     (Measurement, Measurement.study_id == study.id), (Confirmation, Confirmation.study_id == study.id),
                     (Export, Export.study_id == study.id), (Trial, Trial.study_id == study.id)):
    counts[cls.__tablename__] = s.execute(delete(cls).where(where)).rowcount
  s.delete(study)
  s.flush()
  return counts
