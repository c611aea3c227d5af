"""Our tables, all prefixed ss_. Optuna's RDB storage keeps its own tables (studies, trials, alembic_version, ...) in
the same database."""
from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, DateTime, ForeignKey, MetaData, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

VERSION_TABLE = "ss_alembic_version"  # Optuna's migrations own alembic_version
TRIAL_STATES = ("running", "ok", "wrong_output", "invalid_config", "compile_error", "runtime_error", "oom", "killed",
                "timeout", "pruned", "reused", "interrupted")


def include_name(name: str | None, type_: str, parent_names: dict) -> bool:
  """Alembic's filter: only ss_ tables are ours; Optuna's share the database and are never ours to touch."""
  return type_ != "table" or (name or "").startswith("ss_")


def utcnow() -> datetime: return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
  """Aware UTC datetimes in and out: SQLite stores no offset, so what it gives back is UTC by construction."""
  impl = DateTime(timezone=True)
  cache_ok = True

  def process_bind_param(self, value, dialect): return value.astimezone(UTC) if value is not None else None
  def process_result_value(self, value, dialect):
    if value is None: return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
  metadata = MetaData(naming_convention={"ix": "ix_%(table_name)s_%(column_0_name)s",
                                         "uq": "uq_%(table_name)s_%(column_0_name)s",
                                         "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
                                         "pk": "pk_%(table_name)s"})
  type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class Environment(Base):
  __tablename__ = "ss_environment"
  id: Mapped[int] = mapped_column(primary_key=True)
  hash: Mapped[str] = mapped_column(String(64), unique=True)  # fingerprint_hash of the other columns but created_at
  device: Mapped[str]
  device_name: Mapped[str]
  driver: Mapped[str]
  tinygrad_version: Mapped[str]
  tinygrad_commit: Mapped[str | None]
  tinygrad_diff: Mapped[str | None] = mapped_column(Text)
  python: Mapped[str]
  host: Mapped[str]
  platform: Mapped[str]
  created_at: Mapped[datetime] = mapped_column(default=utcnow)


class GitState(Base):
  __tablename__ = "ss_git_state"
  id: Mapped[int] = mapped_column(primary_key=True)
  hash: Mapped[str] = mapped_column(String(64), unique=True)
  commit: Mapped[str] = mapped_column(String(64))
  branch: Mapped[str | None]  # None: detached HEAD
  dirty: Mapped[bool]
  diff: Mapped[str] = mapped_column(Text)
  created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Study(Base):
  __tablename__ = "ss_study"
  id: Mapped[int] = mapped_column(primary_key=True)
  name: Mapped[str] = mapped_column(unique=True)
  model_name: Mapped[str]
  model_path: Mapped[str]
  model_sha256: Mapped[str] = mapped_column(String(64))
  model_bytes: Mapped[int] = mapped_column(BigInteger)
  layers: Mapped[int]
  device: Mapped[str]
  # the device model every trial of the study runs on (results of two models never share a ranking)
  device_name: Mapped[str]
  space_version: Mapped[int]
  objectives: Mapped[str]  # "tok_s" or "tok_s,peak_memory"
  sampler: Mapped[str]
  # the study's one baseline (JSON): the defaults and its pinned knobs
  baseline_config: Mapped[str | None] = mapped_column(Text)
  baseline_hash: Mapped[str | None] = mapped_column(String(16))
  created_at: Mapped[datetime] = mapped_column(default=utcnow)
  finished_at: Mapped[datetime | None]


class Trial(Base):
  __tablename__ = "ss_trial"
  __table_args__ = (UniqueConstraint("study_id", "number"),)
  id: Mapped[int] = mapped_column(primary_key=True)
  study_id: Mapped[int] = mapped_column(ForeignKey("ss_study.id"))
  number: Mapped[int]  # Optuna's trial number
  optuna_trial_id: Mapped[int | None]
  config_json: Mapped[str] = mapped_column(Text)
  config_hash: Mapped[str] = mapped_column(String(16), index=True)
  state: Mapped[str]  # one of TRIAL_STATES
  stage: Mapped[str | None]  # "block" | "full"
  tok_s: Mapped[float | None]  # full-model tok/s when ok
  block_tok_s: Mapped[float | None]  # stage-1 value
  metrics: Mapped[dict[str, Any] | None]
  phases: Mapped[dict[str, Any] | None]  # seconds per phase
  check: Mapped[dict[str, Any] | None]  # correctness numbers
  failure_class: Mapped[str | None]
  error_text: Mapped[str | None] = mapped_column(Text)
  reused_from_id: Mapped[int | None] = mapped_column(ForeignKey("ss_trial.id"))
  git_state_id: Mapped[int | None] = mapped_column(ForeignKey("ss_git_state.id"))  # None: not run from a git checkout
  environment_id: Mapped[int | None] = mapped_column(ForeignKey("ss_environment.id"))
  worker: Mapped[str]  # host:pid
  started_at: Mapped[datetime] = mapped_column(default=utcnow)
  finished_at: Mapped[datetime | None]
  study: Mapped[Study] = relationship()
  git_state: Mapped[GitState | None] = relationship()
  environment: Mapped[Environment | None] = relationship()
  reused_from: Mapped[Trial | None] = relationship(remote_side=[id])
  profile: Mapped[list[KernelProfile]] = relationship(order_by="KernelProfile.rank", cascade="all, delete-orphan")


class KernelProfile(Base):
  __tablename__ = "ss_kernel_profile"
  id: Mapped[int] = mapped_column(primary_key=True)
  trial_id: Mapped[int] = mapped_column(ForeignKey("ss_trial.id"), index=True)
  rank: Mapped[int]
  name: Mapped[str]
  # the model's stage that built the kernel (model/profile.py STAGES, "a+b" for a kernel of two) and the layers it ran
  # in ("1-3,5"; "" outside the blocks); None before revision 0007
  stage: Mapped[str | None]
  layers: Mapped[str | None]
  count: Mapped[int]
  us_per_token: Mapped[float]
  bytes: Mapped[int | None] = mapped_column(BigInteger)  # read and written per token (tinygrad's estimate)
  gb_s: Mapped[float | None]
  bandwidth_share: Mapped[float | None]  # of the device's measured bandwidth
  share: Mapped[float]


class Confirmation(Base):
  __tablename__ = "ss_confirmation"
  id: Mapped[int] = mapped_column(primary_key=True)
  study_id: Mapped[int] = mapped_column(ForeignKey("ss_study.id"), index=True)
  trial_id: Mapped[int] = mapped_column(ForeignKey("ss_trial.id"))  # the candidate
  config_hash: Mapped[str] = mapped_column(String(16))
  pairs: Mapped[int]
  rounds: Mapped[int]
  tok_s: Mapped[float]  # median
  baseline_tok_s: Mapped[float]  # median
  speedup: Mapped[float]  # median ratio
  speedup_low: Mapped[float]
  speedup_high: Mapped[float]
  status: Mapped[str]
  created_at: Mapped[datetime] = mapped_column(default=utcnow)
  trial: Mapped[Trial] = relationship()


class Measurement(Base):
  """One decode figure of one config: a trial's own stage, a baseline repeat, a near-best re-measurement or an A/B
  run."""
  __tablename__ = "ss_measurement"
  # a trial's own figure, a re-measurement by the search, an A/B run
  KINDS: ClassVar[tuple[str, ...]] = ("trial", "repeat", "confirm")
  id: Mapped[int] = mapped_column(primary_key=True)
  study_id: Mapped[int] = mapped_column(ForeignKey("ss_study.id"), index=True)
  trial_id: Mapped[int | None] = mapped_column(ForeignKey("ss_trial.id"))  # None: a baseline repeat between trials
  config_hash: Mapped[str] = mapped_column(String(16))
  stage: Mapped[str]  # "block" | "full"
  tok_s: Mapped[float]  # median over its rounds
  rounds: Mapped[list[float] | None] = mapped_column(JSON)  # tok/s of each measured round
  kind: Mapped[str]  # one of KINDS
  wall_s: Mapped[float | None]  # seconds of the process that measured it (setup included); None before revision 0003
  # the conditions it was made under (None before revision 0006): the host's 1-minute load average when its process
  # started and ended, the seconds it waited for the device lock (another process benchmarking on the device)
  load_start: Mapped[float | None]
  load_end: Mapped[float | None]
  lock_wait_s: Mapped[float | None]
  created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Export(Base):
  """A config written to production by `search export`, and the git commit that holds it (--commit)."""
  __tablename__ = "ss_export"
  id: Mapped[int] = mapped_column(primary_key=True)
  study_id: Mapped[int] = mapped_column(ForeignKey("ss_study.id"), index=True)
  trial_id: Mapped[int] = mapped_column(ForeignKey("ss_trial.id"))
  path: Mapped[str]
  commit: Mapped[str | None] = mapped_column(String(64))
  branch: Mapped[str | None]
  diff: Mapped[str | None] = mapped_column(Text)
  created_at: Mapped[datetime] = mapped_column(default=utcnow)
