"""One trial in full (`search show`): its config and its changes from the baseline, figures, metrics, phases,
correctness check, measurements, failure, per-kernel profile, environment and the git state of the code that ran it."""
from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy.orm import Session

from db import store
from db.engine import open_db, session
from db.models import KernelProfile, Study, Trial
from db.store import interval
from evaluator.gate import accuracy_text
from model.structure import StructureConfig
from search.formats import Section, console, emit, num
from search.leaderboard import PRECISION, SCHEMA, accuracy, baseline, latest, precision, study_named
from search.options import add_format, add_storage
from search.study import study_workload
from space.knobs import changes, flat

ENVIRONMENT = ("device", "device_name", "driver", "tinygrad_version", "tinygrad_commit", "python", "host", "platform")


def find_trial(s: Session, study: Study, which: str) -> Trial:
  """A trial by number, or "baseline": the baseline config's first ok trial."""
  trials = store.trials(s, study)
  if which == "baseline":
    t = next((t for t in trials if t.config_hash == study.baseline_hash and t.state == "ok"), None)
    if t is None: raise ValueError(f"study {study.name!r} has no ok trial of the baseline config")
    return t
  try: n = int(which)
  except ValueError: raise ValueError(f"not a trial number: {which!r} (a number, or 'baseline')") from None
  t = next((t for t in trials if t.number == n), None)
  if t is None: raise ValueError(f"study {study.name!r} has no trial {n} (trials 0..{len(trials) - 1})")
  return t


def kernel_rows(profile: list[KernelProfile] | list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per-kernel profile rows (stored, or model/profile.py's) as the views' documents hold them: the columns
  ss_kernel_profile stores."""
  get = lambda p, k: p.get(k) if isinstance(p, dict) else getattr(p, k)
  return [{k: get(p, k) for k in store.PROFILE_COLUMNS} for p in profile]


def trial_doc(s: Session, study: Study, t: Trial) -> dict[str, Any]:
  """Everything about one trial (`search show --format json`)."""
  src = t.reused_from or t
  est, conf = store.estimates(s, study), latest(s, study)
  e, base, c = est.get(t.config_hash), est.get(study.baseline_hash), conf.get(t.config_hash)
  cfg = StructureConfig.from_json(t.config_json)
  env, git = src.environment, src.git_state
  numbers = {x.id: x.number for x in store.trials(s, study)}
  return {"schema": SCHEMA, "study": study.name, "workload": str(study_workload(s, study.name)), "trial": t.number,
          "state": t.state, "stage": t.stage,
          "config_hash": t.config_hash, "config": cfg.to_dict(), "precision": precision(cfg), "accuracy": accuracy(t),
          "changes": changes(cfg, baseline(study)), "baseline": baseline(study).to_dict(),
          "reused_from": t.reused_from.number if t.reused_from else None,
          "estimate": {"tok_s": e.median, "low": e.low, "high": e.high, "measurements": e.n} if e else None,
          "speedup": e.median / base.median if e and base and t.state in ("ok", "reused") and src.state == "ok"
          else None,
          "confirmed": {"speedup": c.speedup, "low": c.speedup_low, "high": c.speedup_high, "pairs": c.pairs,
                        "status": c.status} if c else None,
          "tok_s": src.tok_s, "block_tok_s": src.block_tok_s, "metrics": src.metrics or {}, "phases": src.phases or {},
          "check": src.check or {}, "failure_class": src.failure_class, "error_text": src.error_text,
          "measurements": [{"kind": m.kind, "stage": m.stage, "tok_s": m.tok_s, "rounds": m.rounds,
                            "trial": numbers.get(m.trial_id), "at": m.created_at.isoformat()}
                           for m in store.measurements(s, study, None) if m.config_hash == t.config_hash],
          "profile": kernel_rows(src.profile),
          "environment": {k: getattr(env, k) for k in ENVIRONMENT} if env else None,
          "git": {"commit": git.commit, "branch": git.branch, "dirty": git.dirty, "diff": git.diff} if git else None,
          "worker": t.worker, "started_at": t.started_at.isoformat(),
          "finished_at": t.finished_at.isoformat() if t.finished_at else None}


def _kv(d: dict[str, Any], prefix: str = "") -> list[list[Any]]:
  rows = []
  for k, v in d.items():
    if isinstance(v, dict): rows += _kv(v, f"{prefix}{k}.")
    else: rows.append([prefix + k, f"{v:.6g}" if isinstance(v, float) else v])
  return rows


def trial_view(doc: dict[str, Any]) -> list[Section]:
  e, c = doc["estimate"], doc["confirmed"]
  reused = f" (result of trial {doc['reused_from']})" if doc["reused_from"] is not None else ""
  head = [["state", doc["state"] + reused], ["workload", doc["workload"]],
          ["stage", doc["stage"]], ["config hash", doc["config_hash"]],
          ["precision", f"{doc['precision']}: {PRECISION[doc['precision']]}"],
          ["accuracy", accuracy_text(a := doc["accuracy"]) + (f" (against the exact reference over {a['positions']} "
                                                             "positions)" if a else "")],
          ["tok/s", f"{interval(store.Estimate(e['tok_s'], e['low'], e['high'], e['measurements']))} "
                    f"({e['measurements']} measurements)" if e else ""],
          ["speedup", num(doc["speedup"], ".3f", "x")],
          ["confirmed", f"{c['speedup']:.3f}x [{c['low']:.3f}, {c['high']:.3f}] over {c['pairs']} A/B pairs "
                        f"({c['status']})" if c else ""],
          ["failure", doc["failure_class"] or ""], ["worker", doc["worker"]], ["started", doc["started_at"]],
          ["finished", doc["finished_at"]]]
  base = flat(StructureConfig.from_dict(doc["baseline"]))
  secs = [Section(f"trial {doc['trial']} of {doc['study']}", ["", ""], head, wrap=("",)),
          Section("config: changes from the baseline", ["knob", "value", "baseline"],
                  [[k, v, base[k]] for k, v in doc["changes"].items()], wrap=("value", "baseline")),
          Section("config (TOML)", code=StructureConfig.from_dict(doc["config"]).to_toml(), lang="toml"),
          Section("metrics", ["metric", "value"], _kv(doc["metrics"]), wrap=("metric", "value")),
          Section("phases (s)", ["phase", "seconds"], _kv(doc["phases"])),
          Section("correctness check", ["", ""], _kv(doc["check"]), wrap=("",)),
          Section("measurements", ["kind", "stage", "tok/s", "rounds", "at"],
                  [[m["kind"], m["stage"], f"{m['tok_s']:.2f}", " ".join(f"{x:.2f}" for x in m["rounds"] or ()),
                    m["at"][:19]] for m in doc["measurements"]], wrap=("rounds",), drop=("at",))]
  if doc["error_text"]: secs.append(Section("failure text", code=doc["error_text"], lang="text"))
  if doc["profile"]:
    secs.append(Section("per-kernel profile",
                        ["rank", "stage", "layers", "kernel", "count", "us/token", "GB/s", "share"],
                        [[p["rank"], p["stage"] or "?", p["layers"] or "", p["name"], p["count"],
                          f"{p['us_per_token']:.1f}", num(p["gb_s"], ".1f"), f"{p['share']:.1%}"]
                         for p in doc["profile"]], wrap=("kernel",), drop=("GB/s", "count", "layers")))
  if doc["environment"]: secs.append(Section("environment", ["", ""], _kv(doc["environment"]), wrap=("",)))
  if g := doc["git"]:
    secs.append(Section("git state", ["", ""],
                        [["commit", g["commit"]], ["branch", g["branch"] or "(detached)"], ["dirty", g["dirty"]]]))
    if g["diff"]: secs.append(Section("git diff", code=g["diff"], lang="diff"))
  return secs


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_format(p)
  p.add_argument("--study", required=True, help="the study of the trial")
  p.add_argument("trial", help="a trial number, or 'baseline'")


def run(args: argparse.Namespace) -> None:
  with session(open_db(args.storage, create=False)) as s:
    st = study_named(s, args.storage, args.study)
    doc = trial_doc(s, st, find_trial(s, st, args.trial))
  emit(args.format, trial_view(doc), doc, console)
