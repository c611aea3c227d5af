"""`search delete`: a study removed from its storage, both ledgers of it: Optuna's study and trials, our rows (trials,
measurements, confirmations, profiles, the record of its exports) and its trials' dashboard artifacts. The dashboard
only reads (search/dashboard.py): this is where a study is removed. A study that only one ledger still holds is removed
from that one. Exported production files stay where they are."""
from __future__ import annotations

import argparse
import sys
import warnings

import optuna
from optuna.artifacts import get_all_artifact_meta

from db import store
from db.engine import hide_password, open_db, session
from search.dashboard import artifact_store
from search.formats import console
from search.options import add_storage
from search.study import StudyMismatch, storage


def _remove_artifacts(url: str, name: str, artifacts: str | None) -> int:
  """The study's and its trials' artifact files, removed from the store: how many."""
  st, store_ = storage(url), artifact_store(url, artifacts)
  study = optuna.load_study(study_name=name, storage=st)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    owners = (study, *study.get_trials(deepcopy=False))
    metas = [m for owner in owners for m in get_all_artifact_meta(owner, storage=st)]
    for m in metas:
      try: store_.remove(m.artifact_id)
      except FileNotFoundError: pass  # already gone: nothing to remove
  return len(metas)


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p)
  p.add_argument("--study", required=True, help="the study to remove")
  p.add_argument("--yes", action="store_true", help="remove it without asking (needed where no terminal answers)")
  p.add_argument("--artifacts", help="directory of the trials' dashboard artifacts (default: beside a SQLite database)")


def run(args: argparse.Namespace) -> None:
  url, name = args.storage, args.study
  with session(open_db(url, create=False)) as s:
    ours = store.get_study(s, name)
    n_trials = len(store.trials(s, ours)) if ours else 0
  theirs = name in optuna.get_all_study_names(storage(url))
  if ours is None and not theirs: raise StudyMismatch(f"no study named {name!r} in {hide_password(url)}")
  what = (f"study {name!r} in {hide_password(url)}: {n_trials} trials"
          + ("" if ours and theirs else f" (only {'ours' if ours else 'Optuna'}'s ledger holds it)"))
  if not args.yes:
    if not sys.stdin.isatty(): raise ValueError(f"{what}: add --yes to remove it (nothing was removed)")
    if console.input(f"remove {what}? [y/N] ").strip().lower() not in ("y", "yes"):
      console.print("nothing removed")
      return
  files = _remove_artifacts(url, name, args.artifacts) if theirs else 0
  if theirs: optuna.delete_study(study_name=name, storage=storage(url))
  counts = {}
  if ours is not None:
    with session(open_db(url, create=False)) as s: counts = store.delete_study(s, store.get_study(s, name))
  console.print(f"removed {what}; {sum(counts.values())} rows of ours, {files} artifact files "
                "(exported production files stay)")
