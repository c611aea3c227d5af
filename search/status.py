"""The studies in a storage (`search status`, `search list`), each with its trials, its best figure and its verdict;
with --study, that study's leaderboard and the ladder's proxy fit."""
from __future__ import annotations

import argparse
import datetime
from typing import Any

from sqlalchemy.orm import Session

from db import store
from db.engine import open_db, session
from evaluator.cli import at_least
from search import leaderboard
from search.formats import Section, console, emit, num
from search.leaderboard import SCHEMA, study_named
from search.options import add_format, add_storage
from search.proxy import proxy_fit


def studies(s: Session) -> dict[str, Any]:
  out = []
  for st in store.studies(s):
    trials, doc = store.trials(s, st), leaderboard.leaderboard(s, st)
    best = doc["best"]
    out.append({"study": st.name, "model": st.model_name, "device": st.device, "device_name": st.device_name,
                "workload": doc["workload"], "trials": len(trials), "ok": sum(t.state == "ok" for t in trials),
                "failed": sum(bool(t.failure_class) for t in trials), "best": best,
                "best_trial": best["trial"] if best else None, "best_tok_s": best["tok_s"] if best else None,
                "speedup": best["speedup"] if best else None, "verdict": doc["verdict"],
                "created": _day(st.created_at), "finished": _day(st.finished_at)})
  return {"schema": SCHEMA, "study": None, "studies": out}


def studies_view(doc: dict[str, Any]) -> list[Section]:
  cols = ["study", "model", "device", "workload", "trials", "ok", "failed", "best trial", "best tok/s", "speedup",
          "verdict", "created", "finished"]
  rows = [[d["study"], d["model"], d["device_name"] or d["device"], d["workload"], d["trials"], d["ok"], d["failed"],
           "" if d["best_trial"] is None else d["best_trial"], num(d["best_tok_s"]), num(d["speedup"], ".3f", "x"),
           d["verdict"], d["created"], d["finished"]] for d in doc["studies"]]
  return [Section("studies", cols, rows, records=[{k: v for k, v in d.items() if k != "best"} for d in doc["studies"]],
                  wrap=("model", "verdict"), drop=("finished", "created", "failed", "ok", "best tok/s", "verdict"))]


def _day(d: datetime.datetime | None) -> str: return d.strftime("%Y-%m-%d %H:%M") if d else ""


def add_arguments(p: argparse.ArgumentParser) -> None:
  listing = p.prog.split()[-1] == "list"  # `search list`: the list of studies, its options undocumented
  add_storage(p); add_format(p)
  p.add_argument("--study",
                 help=argparse.SUPPRESS if listing else "this study's leaderboard instead of the list of studies")
  p.add_argument("--top", type=at_least(1), default=15,
                 help=argparse.SUPPRESS if listing else "rows of the study's leaderboard (default 15)")


def run(args: argparse.Namespace) -> None:
  if args.study:
    leaderboard.show(args.storage, args.study, args.format, args.top)
    with session(open_db(args.storage, create=False)) as s:
      trials = store.trials(s, study_named(s, args.storage, args.study))
    if args.format == "table" and any(t.block_tok_s for t in trials): console.print(proxy_fit(trials).summary())
    return
  with session(open_db(args.storage, create=False)) as s: doc = studies(s)
  emit(args.format, studies_view(doc), doc, console)
