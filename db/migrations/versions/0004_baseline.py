"""ss_study gains its baseline config (baseline_config, baseline_hash): the one config every view, confirmation and
re-measurement of the study compares with; a study made before holds its first trial's config, the baseline it measured
first

Revision ID: 0004_baseline
Revises: 0003_cost
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0004_baseline"
down_revision = "0003_cost"
branch_labels = None
depends_on = None


def upgrade() -> None:
  with op.batch_alter_table("ss_study") as b:
    b.add_column(sa.Column("baseline_config", sa.Text(), nullable=True))
    b.add_column(sa.Column("baseline_hash", sa.String(16), nullable=True))
  for ours, theirs in (("baseline_config", "config_json"), ("baseline_hash", "config_hash")):
    op.execute(f"UPDATE ss_study SET {ours} = (SELECT {theirs} FROM ss_trial WHERE ss_trial.study_id = ss_study.id AND "
               "ss_trial.number = 0)")


def downgrade() -> None:
  with op.batch_alter_table("ss_study") as b:
    b.drop_column("baseline_hash")
    b.drop_column("baseline_config")
