"""Alembic environment: db.engine.open_db passes its connection (already in a locked transaction) in
config.attributes["connection"]; otherwise (e.g. `alembic.command.revision(alembic_config(url), autogenerate=True)`) it
connects to sqlalchemy.url itself."""
from alembic import context
from sqlalchemy import create_engine

from db.models import VERSION_TABLE, Base, include_name


def run(connection) -> None:
  context.configure(connection=connection, target_metadata=Base.metadata, version_table=VERSION_TABLE,
                    include_name=include_name, compare_type=True, render_as_batch=connection.dialect.name == "sqlite")
  with context.begin_transaction(): context.run_migrations()


if (conn := context.config.attributes.get("connection")) is not None: run(conn)
else:
  engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
  with engine.begin() as conn: run(conn)
  engine.dispose()
