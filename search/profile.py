"""`search profile`: a trial's per-kernel profile, each kernel named by the model's stage and the layers it ran in, and
its time by stage. A study profiles its baseline (its trial) and its confirmed configs (`search confirm`) itself; for
any other trial the profile is made here, in a trial process on this host's device, stored with the trial and attached
to its dashboard files."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from db import store
from db.engine import open_db, session
from db.models import Study, Trial
from evaluator.runner import Evaluator
from model.registry import resolve
from model.structure import StructureConfig
from search.dashboard import refresh
from search.formats import Section, console, emit, errors, num
from search.leaderboard import SCHEMA, leaderboard, study_named
from search.options import add_format, add_storage, device_name
from search.show import find_trial, kernel_rows
from search.study import measuring_setup


def stages(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """A profile's time by stage, the largest first: launches, µs per token, share of the kernels' time, bytes per token
  (None where a kernel's are unknown). Rows stored before kernels had stages are one stage, "?"."""
  out: dict[str, dict[str, Any]] = {}
  for r in rows:
    st = out.setdefault(r.get("stage") or "?", {"stage": r.get("stage") or "?", "count": 0, "us_per_token": 0.0,
                                                "share": 0.0, "bytes": 0})
    st["count"] += r["count"]
    st["us_per_token"] += r["us_per_token"]
    st["share"] += r["share"]
    st["bytes"] = None if st["bytes"] is None or r.get("bytes") is None else st["bytes"] + r["bytes"]
  return sorted(out.values(), key=lambda g: -g["us_per_token"])


def profile_trial(ev: Evaluator, url: str, trial: Trial, say: Callable[[str], None]) -> list[dict[str, Any]]:
  """Profile a trial's config in a trial process and store the rows with the trial whose result it is (replacing those
  it had); [] where the run failed (said)."""
  r = ev.run(StructureConfig.from_json(trial.config_json).to_dict(), profile=True)
  if not r.profile:
    say(f"  trial {trial.number}: no profile ({r.status}: {(r.error or '').splitlines()[0][:200] if r.error else ''})")
    return []
  with session(open_db(url, create=False)) as s:
    t = s.get(Trial, (trial.reused_from_id or trial.id))
    t.profile = store.profile_rows(r.profile)
  return r.profile


def pick(s: Session, study: Study, which: str) -> Trial:
  """A trial by number, 'baseline', 'best' (the leaderboard's first) or a config's hash (its first trial)."""
  if which == "best":
    b = leaderboard(s, study, top=1)["best"]
    if b is None: raise ValueError(f"study {study.name!r} has no config measured ok yet")
    which = str(b["trial"])
  if which.isdigit() or which == "baseline": return find_trial(s, study, which)
  t = next((t for t in store.trials(s, study) if t.config_hash == which), None)
  if t is None: raise ValueError(f"study {study.name!r} has no trial {which!r} (a trial number, 'baseline', 'best' or "
                                 "a config hash)")
  return t


def profile_view(doc: dict[str, Any]) -> list[Section]:
  by_stage = [[g["stage"], g["count"], f"{g['us_per_token']:.1f}", f"{g['share']:.1%}", num(g["bytes"], "d")]
              for g in doc["stages"]]
  kernels = [[r["rank"], r["stage"] or "?", r["layers"] or "", r["name"], r["count"], f"{r['us_per_token']:.1f}",
              f"{r['share']:.1%}", num(r["bytes"], "d"), num(r["gb_s"], ".1f"), num(r["bandwidth_share"], ".1%")]
             for r in doc["kernels"]]
  return [Section(f"{doc['study']}: trial {doc['trial']}'s decode step by stage",
                  ["stage", "launches", "us/token", "share", "bytes/token"], by_stage, records=doc["stages"]),
          Section("per-kernel profile (each kernel name of each stage timed alone)",
                  ["rank", "stage", "layers", "kernel", "count", "us/token", "share", "bytes/token", "GB/s",
                   "bandwidth"], kernels, records=doc["kernels"], wrap=("kernel",),
                  drop=("bandwidth", "bytes/token", "count", "GB/s"))]


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_format(p)
  p.add_argument("--study", required=True, help="the study of the trial")
  p.add_argument("trial", nargs="?", default="baseline",
                 help="a trial number, 'baseline' (default), 'best' (the leaderboard's first) or a config hash")
  p.add_argument("--again", action="store_true", help="profile again where a profile is stored")
  p.add_argument("--device", type=device_name, help="tinygrad device to profile on (default: the study's)")
  p.add_argument("--model",
                 help="where the study's model file is on this host (default: the study's path; checked by SHA-256)")
  p.add_argument("--artifacts", help="directory of the trials' dashboard artifacts, where a profile made here is "
                 "attached to its trial (default: beside a SQLite database)")


def run(args: argparse.Namespace) -> None:
  url, say = args.storage, console.print if args.format == "table" else errors.print
  with session(open_db(url, create=False)) as s:
    st = study_named(s, url, args.study)
    t = pick(s, st, args.trial)
    src = t.reused_from or t
    rows, number, h = kernel_rows(src.profile), t.number, t.config_hash
  made = not rows or args.again
  if made:
    say(f"trial {number} has no stored profile: profiling it now (a trial process; its step's kernels timed one at a "
        "time)" if not rows else f"profiling trial {number} again (a trial process)")
    setup, _ = measuring_setup(args.study, url, args.device, str(resolve(args.model).resolve()) if args.model else None)
    rows = kernel_rows(profile_trial(setup.evaluator(), url, t, say))
    if not rows: raise RuntimeError(f"trial {number} could not be profiled")
    refresh(url, args.study, args.artifacts)  # the dashboard's files of the trial, its profile now among them
  doc = {"schema": SCHEMA, "study": args.study, "trial": number, "config_hash": h,
         "profiled": "now" if made else "stored", "stages": stages(rows), "kernels": rows}
  notes = [] if made else [f"the profile stored with trial {number} (--again profiles it anew)"]
  emit(args.format, profile_view(doc), doc, console, notes)
