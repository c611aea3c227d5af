"""`search best`: the one config a study would ship, for scripts: the leaderboard's first (the confirmed winner where
there is one), the same config as the dashboard's Best Trial and what `search export` writes by default."""
from __future__ import annotations

import argparse
import json
import sys

from db.engine import open_db, session
from model.structure import StructureConfig
from search.formats import console
from search.leaderboard import SCHEMA, best_line, leaderboard, study_named
from search.options import add_storage
from search.show import find_trial


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p)
  p.add_argument("--study", required=True, help="the study whose best config to name")
  p.add_argument("--format", choices=("table", "json"), default="table",
                 help="table (default: one line, then the verdict) or json (the config too; docs/json.md)")


def run(args: argparse.Namespace) -> None:
  with session(open_db(args.storage, create=False)) as s:
    st = study_named(s, args.storage, args.study)
    doc = leaderboard(s, st, top=1)
    b = doc["best"]
    config = StructureConfig.from_json(find_trial(s, st, str(b["trial"])).config_json).to_dict() if b else None
  if b is None:
    print(f"search: error: study {args.study!r} has no config measured ok yet", file=sys.stderr)
    sys.exit(1)
  if args.format == "json":
    print(json.dumps({"schema": SCHEMA, "study": doc["study"], **b, "winner": doc["winner"] == b["trial"],
                      "verdict": doc["verdict"], "config": config}, indent=1, default=str))
    return
  console.print(best_line(b), highlight=False)
  console.print(doc["verdict"], highlight=False)
