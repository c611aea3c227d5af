"""ss_kernel_profile gains where each kernel ran and what it moved: the model's stage that built it, the layers it ran
in, its bytes per token and its share of the measured bandwidth (rows stored before have none of them)

Revision ID: 0007_profile_stages
Revises: 0006_conditions
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

revision = "0007_profile_stages"
down_revision = "0006_conditions"
branch_labels = None
depends_on = None

COLUMNS = (("stage", sa.String()), ("layers", sa.String()), ("bytes", sa.BigInteger()),
           ("bandwidth_share", sa.Double()))


def upgrade() -> None:
  with op.batch_alter_table("ss_kernel_profile") as b:
    for name, kind in COLUMNS: b.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
  with op.batch_alter_table("ss_kernel_profile") as b:
    for name, _ in COLUMNS: b.drop_column(name)
