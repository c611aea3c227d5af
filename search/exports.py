"""What `search export` put in production (`search exports`): each exported file, from which study and trial, since
when, and whether it holds that config still."""
from __future__ import annotations

import argparse
import os

from sqlalchemy.orm import Session

from db import store
from db.engine import open_db, session
from db.models import Trial
from model.structure import StructureConfig
from search.formats import Section, console, emit
from search.leaderboard import SCHEMA, study_named
from search.options import add_format, add_storage


def exports_doc(s: Session, name: str | None = None) -> dict:
  """What `search export` wrote (`search exports --format json`), newest first: each export's file, study, trial,
  config hash, time, commit and branch, and its status: `in production` (the latest export to its file, which holds its
  config still), `replaced` (a later export wrote the same file), `changed since` (the file holds another config now),
  `missing`, or `unreadable`. `name`: one study's exports (None: every study's)."""
  rows = []
  for st in store.studies(s):
    if name is not None and st.name != name: continue
    for e in store.exports(s, st):
      t = s.get(Trial, e.trial_id)
      rows.append({"path": e.path, "study": st.name, "trial": t.number, "config_hash": t.config_hash,
                   "exported_at": e.created_at.isoformat(), "commit": e.commit, "branch": e.branch,
                   "model": st.model_name, "device": st.device, "device_name": st.device_name})
  rows.sort(key=lambda r: r["exported_at"], reverse=True)
  latest: set[str] = set()
  for r in rows:
    if r["path"] in latest: r["status"] = "replaced"
    else:
      latest.add(r["path"])
      try: same = StructureConfig.load(r["path"]).hash == r["config_hash"]
      except ValueError as e:
        r["status"] = "missing" if not os.path.exists(r["path"]) else f"unreadable: {e}"
        continue
      r["status"] = "in production" if same else "changed since"
  return {"schema": SCHEMA, "study": name, "exports": rows}


def exports_view(doc: dict) -> tuple[list[Section], list[str]]:
  cols = ["status", "since", "study", "trial", "device", "file", "commit"]
  rows = [[r["status"], r["exported_at"][:16].replace("T", " "), r["study"], r["trial"],
           r["device_name"] or r["device"], r["path"], f"{r['commit'][:12]} ({r['branch']})" if r["commit"] else ""]
          for r in doc["exports"]]
  now = [r for r in doc["exports"] if r["status"] == "in production"]
  notes = [f"in production: {len(now)} file{'s' * (len(now) != 1)}" if doc["exports"]
           else "nothing exported yet (`search export`)"]
  return [Section("exports (newest first)", cols, rows, records=doc["exports"], wrap=("file", "status"),
                  drop=("commit", "device"))], notes


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_format(p)
  p.add_argument("--study", help="only this study's exports (default: every study's)")


def run(args: argparse.Namespace) -> None:
  with session(open_db(args.storage, create=False)) as s:
    if args.study: study_named(s, args.storage, args.study)
    doc = exports_doc(s, args.study)
  secs, notes = exports_view(doc)
  emit(args.format, secs, doc, console, notes)
