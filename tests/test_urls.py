"""A database URL as it is printed: no password, wherever the URL holds it."""
from __future__ import annotations

from db.engine import hide_password


def test_hide_password_masks_the_user_part_and_the_query() -> None:
  for url in ("postgresql+psycopg://u:pw-1234@h:5432/db", "postgresql+psycopg://u@h/db?password=pw-1234",
              "postgresql+psycopg://u@h/db?sslmode=require&PASSWORD=pw-1234&application_name=x"):
    shown = hide_password(url)
    assert "pw-1234" not in shown and "***" in shown, shown
  assert hide_password("postgresql+psycopg://u@h/db?sslmode=require") == "postgresql+psycopg://u@h/db?sslmode=require"
  assert hide_password("sqlite:////tmp/s.db") == "sqlite:////tmp/s.db"
