"""ss_study loses environment_id (never set: each trial records its own environment)

Revision ID: 0002_trust
Revises: 0001
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0002_trust"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
  with op.batch_alter_table("ss_study") as b:
    b.drop_constraint("fk_ss_study_environment_id_ss_environment", type_="foreignkey")
    b.drop_column("environment_id")


def downgrade() -> None:
  with op.batch_alter_table("ss_study") as b:
    b.add_column(sa.Column("environment_id", sa.Integer(), nullable=True))
    b.create_foreign_key("fk_ss_study_environment_id_ss_environment", "ss_environment", ["environment_id"], ["id"])
