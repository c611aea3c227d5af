"""`search rename OLD NEW`: a study renamed in place, both ledgers in one transaction of their one database (Optuna's
study and ours), and its tinygrad cache on this host moved to the new name. Its trials, measurements, confirmations,
exports and dashboard artifacts are keyed by ids, which stay; every view and the dashboard list it by the new name."""
from __future__ import annotations

import argparse
import os
import unicodedata

import sqlalchemy as sa

from db.engine import hide_password, open_db, session
from db.models import Study
from search.formats import console
from search.options import add_storage
from search.study import StudyMismatch, study_attrs, tinygrad_cache

# Optuna's table of studies (its RDB schema, stable since Optuna 1.0): its public API renames nothing
STUDIES = sa.table("studies", sa.column("study_name"))
MAX_NAME = 512  # Optuna's study_name column


def check_name(name: str) -> str:
  """A new study name: printable, not blank, without surrounding spaces, within Optuna's column."""
  if not name.strip(): raise ValueError("the new name is empty")
  if name != name.strip(): raise ValueError(f"the new name {name!r} starts or ends with a space")
  if any(unicodedata.category(c).startswith("C") for c in name):
    raise ValueError(f"the new name {name!r} holds a control character")
  if len(name) > MAX_NAME: raise ValueError(f"the new name is {len(name)} characters long, past {MAX_NAME}")
  return name


def rename(url: str, old: str, new: str) -> None:
  """Rename study `old` to `new` in both ledgers (one that only one of them holds, in that one); nothing changes where
  `old` is not there or `new` is taken."""
  engine = open_db(url, create=False)
  optuna_tables = sa.inspect(engine).has_table("studies")
  with session(engine) as s:
    theirs = {n for n in (s.scalars(sa.select(STUDIES.c.study_name).where(STUDIES.c.study_name.in_([old, new])))
                          if optuna_tables else [])}
    ours = {n for n in s.scalars(sa.select(Study.name).where(Study.name.in_([old, new])))}
    if old not in theirs | ours: raise StudyMismatch(f"no study named {old!r} in {hide_password(url)}")
    if new in theirs | ours: raise StudyMismatch(f"a study named {new!r} is in {hide_password(url)} already")
    key = study_attrs(s, old).get("cache_key") if old in theirs else None
    if old in theirs: s.execute(sa.update(STUDIES).where(STUDIES.c.study_name == old).values(study_name=new))
    if old in ours: s.execute(sa.update(Study).where(Study.name == old).values(name=new))
  if key and os.path.isdir(was := tinygrad_cache(old, key)) and not os.path.exists(now := tinygrad_cache(new, key)):
    os.replace(was, now)


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p)
  p.add_argument("old", help="the study's name")
  p.add_argument("new", help="its new name")


def run(args: argparse.Namespace) -> None:
  rename(args.storage, args.old, check_name(args.new))
  console.print(f"study {args.old!r} is now {args.new!r} in {hide_password(args.storage)}", highlight=False)
