"""ss_measurement gains the conditions it was made under: the host's load average when its process started and ended,
and the seconds it waited for the device lock before it could start

Revision ID: 0006_conditions
Revises: 0005_config_hash
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0006_conditions"
down_revision = "0005_config_hash"
branch_labels = None
depends_on = None

COLUMNS = ("load_start", "load_end", "lock_wait_s")


def upgrade() -> None:
  with op.batch_alter_table("ss_measurement") as b:
    for name in COLUMNS: b.add_column(sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
  with op.batch_alter_table("ss_measurement") as b:
    for name in COLUMNS: b.drop_column(name)
