"""every measurement of a config (ss_measurement) and the exports to production (ss_export)

Revision ID: 0002_review
Revises: 0001
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0002_review"
down_revision = "0002_trust"
branch_labels = None
depends_on = None


def _id(table: str) -> tuple[sa.Column, sa.PrimaryKeyConstraint]:
  return sa.Column("id", sa.Integer(), nullable=False), sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{table}"))


def _fk(table: str, column: str, target: str) -> sa.ForeignKeyConstraint:
  return sa.ForeignKeyConstraint([column], [f"{target}.id"], name=op.f(f"fk_{table}_{column}_{target}"))


def _ts(name: str) -> sa.Column: return sa.Column(name, sa.DateTime(timezone=True), nullable=False)
def _str(name: str, nullable: bool = False, length: int | None = None) -> sa.Column:
  return sa.Column(name, sa.String(length), nullable=nullable)
def _int(name: str, nullable: bool = False) -> sa.Column: return sa.Column(name, sa.Integer(), nullable=nullable)


def upgrade() -> None:
  op.create_table("ss_measurement", *_id("ss_measurement"), _int("study_id"), _int("trial_id", True),
                  _str("config_hash", length=16), _str("stage"), sa.Column("tok_s", sa.Double(), nullable=False),
                  sa.Column("rounds", sa.JSON(), nullable=True), _str("kind"), _ts("created_at"),
                  _fk("ss_measurement", "study_id", "ss_study"), _fk("ss_measurement", "trial_id", "ss_trial"))
  op.create_index(op.f("ix_ss_measurement_study_id"), "ss_measurement", ["study_id"])
  # the figures of studies made before: each trial's block proxy and full-model tok/s become its measurements
  for stage, col, where in (("'block'", "block_tok_s", "block_tok_s IS NOT NULL AND state != 'reused'"),
                            ("COALESCE(stage, 'full')", "tok_s", "state = 'ok' AND tok_s IS NOT NULL")):
    op.execute(f"INSERT INTO ss_measurement (study_id, trial_id, config_hash, stage, tok_s, kind, created_at) "
               f"SELECT study_id, id, config_hash, {stage}, {col}, 'trial', COALESCE(finished_at, started_at) FROM "
               f"ss_trial WHERE {where}")
  op.create_table("ss_export", *_id("ss_export"), _int("study_id"), _int("trial_id"), _str("path"),
                  _str("commit", True, 64), _str("branch", True), sa.Column("diff", sa.Text(), nullable=True),
                  _ts("created_at"), _fk("ss_export", "study_id", "ss_study"), _fk("ss_export", "trial_id", "ss_trial"))
  op.create_index(op.f("ix_ss_export_study_id"), "ss_export", ["study_id"])


def downgrade() -> None:
  for table in ("ss_export", "ss_measurement"): op.drop_table(table)
