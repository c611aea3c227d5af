"""ss_measurement gains wall_s: the seconds of the process that made a measurement (a study's cost counts its repeats)

Revision ID: 0003_cost
Revises: 0002_review
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0003_cost"
down_revision = "0002_review"
branch_labels = None
depends_on = None


def upgrade() -> None:
  with op.batch_alter_table("ss_measurement") as b: b.add_column(sa.Column("wall_s", sa.Double(), nullable=True))


def downgrade() -> None:
  with op.batch_alter_table("ss_measurement") as b: b.drop_column("wall_s")
