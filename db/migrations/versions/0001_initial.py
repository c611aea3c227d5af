"""initial: ss_environment, ss_git_state, ss_study, ss_trial, ss_kernel_profile, ss_confirmation

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _id(table: str) -> tuple[sa.Column, sa.PrimaryKeyConstraint]:
  return sa.Column("id", sa.Integer(), nullable=False), sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{table}"))


def _fk(table: str, column: str, target: str) -> sa.ForeignKeyConstraint:
  return sa.ForeignKeyConstraint([column], [f"{target}.id"], name=op.f(f"fk_{table}_{column}_{target}"))


def _ts(name: str, nullable: bool = False) -> sa.Column:
  return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)
def _str(name: str, nullable: bool = False, length: int | None = None) -> sa.Column:
  return sa.Column(name, sa.String(length), nullable=nullable)
def _text(name: str, nullable: bool = False) -> sa.Column: return sa.Column(name, sa.Text(), nullable=nullable)
def _int(name: str, nullable: bool = False) -> sa.Column: return sa.Column(name, sa.Integer(), nullable=nullable)
def _float(name: str, nullable: bool = False) -> sa.Column: return sa.Column(name, sa.Double(), nullable=nullable)
def _json(name: str) -> sa.Column: return sa.Column(name, sa.JSON(), nullable=True)


def upgrade() -> None:
  op.create_table("ss_environment", *_id("ss_environment"), _str("hash", length=64), _str("device"),
                  _str("device_name"), _str("driver"), _str("tinygrad_version"), _str("tinygrad_commit", True),
                  _text("tinygrad_diff", True), _str("python"), _str("host"), _str("platform"), _ts("created_at"),
                  sa.UniqueConstraint("hash", name=op.f("uq_ss_environment_hash")))
  op.create_table("ss_git_state", *_id("ss_git_state"), _str("hash", length=64), _str("commit", length=64),
                  _str("branch", True), sa.Column("dirty", sa.Boolean(), nullable=False), _text("diff"),
                  _ts("created_at"), sa.UniqueConstraint("hash", name=op.f("uq_ss_git_state_hash")))
  op.create_table("ss_study", *_id("ss_study"), _str("name"), _str("model_name"), _str("model_path"),
                  _str("model_sha256", length=64), sa.Column("model_bytes", sa.BigInteger(), nullable=False),
                  _int("layers"), _str("device"), _str("device_name"), _int("environment_id", True),
                  _int("space_version"), _str("objectives"), _str("sampler"), _ts("created_at"),
                  _ts("finished_at", True), _fk("ss_study", "environment_id", "ss_environment"),
                  sa.UniqueConstraint("name", name=op.f("uq_ss_study_name")))
  op.create_table("ss_trial", *_id("ss_trial"), _int("study_id"), _int("number"), _int("optuna_trial_id", True),
                  _text("config_json"), _str("config_hash", length=16), _str("state"), _str("stage", True),
                  _float("tok_s", True), _float("block_tok_s", True), _json("metrics"), _json("phases"), _json("check"),
                  _str("failure_class", True), _text("error_text", True), _int("reused_from_id", True),
                  _int("git_state_id", True), _int("environment_id", True), _str("worker"), _ts("started_at"),
                  _ts("finished_at", True), _fk("ss_trial", "study_id", "ss_study"),
                  _fk("ss_trial", "reused_from_id", "ss_trial"), _fk("ss_trial", "git_state_id", "ss_git_state"),
                  _fk("ss_trial", "environment_id", "ss_environment"),
                  sa.UniqueConstraint("study_id", "number", name=op.f("uq_ss_trial_study_id")))
  op.create_index(op.f("ix_ss_trial_config_hash"), "ss_trial", ["config_hash"])
  op.create_table("ss_kernel_profile", *_id("ss_kernel_profile"), _int("trial_id"), _int("rank"), _str("name"),
                  _int("count"), _float("us_per_token"), _float("gb_s", True), _float("share"),
                  _fk("ss_kernel_profile", "trial_id", "ss_trial"))
  op.create_index(op.f("ix_ss_kernel_profile_trial_id"), "ss_kernel_profile", ["trial_id"])
  op.create_table("ss_confirmation", *_id("ss_confirmation"), _int("study_id"), _int("trial_id"),
                  _str("config_hash", length=16), _int("pairs"), _int("rounds"), _float("tok_s"),
                  _float("baseline_tok_s"), _float("speedup"), _float("speedup_low"), _float("speedup_high"),
                  _str("status"), _ts("created_at"), _fk("ss_confirmation", "study_id", "ss_study"),
                  _fk("ss_confirmation", "trial_id", "ss_trial"))
  op.create_index(op.f("ix_ss_confirmation_study_id"), "ss_confirmation", ["study_id"])


def downgrade() -> None:
  for table in ("ss_confirmation", "ss_kernel_profile", "ss_trial", "ss_study", "ss_git_state", "ss_environment"):
    op.drop_table(table)
