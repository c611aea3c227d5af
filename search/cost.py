"""What a study's trials cost: each phase's seconds per trial, the search's own share of the wall time, and the
projected wall time of a study of N trials on one device.

A trial's wall time is its trial processes' (the ladder's block stage, when it ran, and the full stage) plus the
one-time setup some of them paid (the file's hash, the correctness references, the bandwidth figure; the baseline's
reference is made in its own trial process, and that phase counts as setup, not as the stage's) plus the search's
re-measurements before it (the baseline repeated between trials, near-best configs measured again: trial processes too)
plus the waits for the device lock (another process benchmarking on the device: recorded with each run,
evaluator/runner.py evaluate) plus the search's own time around them (sampling, storage: the rest of what is outside
every trial process). The projection is setup once plus N times the mean trial without its setup: it assumes the next
trials mix stages, pruning and BEAM widths as the measured ones did. The ladder prunes only after its first trials ran
both stages, so early trials make it an upper bound.

Time to best: the study's wall time (the same sums, in trial order) up to the end of the first trial whose full-model
tok/s is within NEAR_BEST of the fastest the study measured, which is when a user watching it had a config that good."""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Sequence
from typing import Any

from db import store
from db.engine import open_db, session
from db.models import Measurement, Trial
from evaluator.cli import at_least
from search.formats import Section, console, emit
from search.leaderboard import SCHEMA, best_line, leaderboard, study_named
from search.options import add_format, add_storage

PHASES = ("load_s", "compile_s", "prefill_s", "prompt_s", "check_s", "warmup_s", "measure_s", "profile_s", "overhead_s")
MEASURED = ("ok", "wrong_output", "pruned", "runtime_error", "compile_error", "timeout", "oom", "killed",
            "invalid_config")
NEAR_BEST = 0.05


def trial_cost(t: Trial, gap_s: float = 0.0, repeat_s: float = 0.0, repeat_lock_s: float = 0.0) -> dict[str, Any]:
  """One trial's seconds: wall, setup, repeats (re-measurement processes run in the `gap_s` before it), lock (waits for
  the device lock: its stages' and its repeats'), search (in the trial outside its processes, plus the rest of that gap:
  sampling and storage since the worker's previous trial, without the lock waits), the block stage's wall, each
  full-stage phase."""
  p, m, full_stage = t.phases or {}, t.metrics or {}, t.stage == "full"
  # a reference made in the trial's own process (the baseline's) is one-time setup too, not the stage's own time
  ref, block_ref = p.get("reference_s", 0.0), p.get("block_reference_s", 0.0)
  setup = p.get("setup_s", 0.0) + p.get("block_setup_s", 0.0) + ref + block_ref
  block = p.get("block_wall_s", 0.0) - block_ref if full_stage else p.get("wall_s", 0.0) - ref
  full = p.get("wall_s", 0.0) - ref if full_stage else 0.0
  repeat = min(repeat_s, gap_s)
  own_lock = p.get("lock_wait_s", 0.0) + (p.get("block_lock_wait_s", 0.0) if full_stage else 0.0)
  lock = min(own_lock, m.get("search_overhead_s", 0.0)) + min(repeat_lock_s, gap_s - repeat)
  search = m.get("search_overhead_s", 0.0) + gap_s - repeat - lock
  return {"trial": t.number, "state": t.state, "stage": t.stage, "beam": json.loads(t.config_json).get("beam", 0),
          "tok_s": t.tok_s if t.state == "ok" and full_stage else None,
          "ladder": m.get("ladder"), "wall_s": block + full + setup + repeat + lock + search, "setup_s": setup,
          "repeat_s": repeat, "lock_s": lock, "search_s": search, "block_s": block, "full_s": full,
          **{k: p[k] for k in PHASES if k in p and full_stage}}


def _gaps(trials: Sequence[Trial], measurements: Sequence[Measurement]) -> dict[int, tuple[float, float, float]]:
  """By trial number: seconds between the worker's previous trial's end and this trial's start, and the wall seconds of
  the re-measurements that ended in that interval and their waits for the device lock."""
  out = {}
  for _, ts in itertools.groupby(sorted(trials, key=lambda t: (t.worker, t.started_at)), key=lambda t: t.worker):
    prev = None
    for t in ts:
      if prev is None: out[t.number] = (0.0, 0.0, 0.0)
      else:
        inside = [m for m in measurements if m.kind == "repeat" and prev <= m.created_at <= t.started_at]
        out[t.number] = (max(0.0, (t.started_at - prev).total_seconds()), sum(m.wall_s or 0.0 for m in inside),
                         sum(m.lock_wait_s or 0.0 for m in inside))
      prev = t.finished_at or t.started_at
  return out


def study_cost(trials: Sequence[Trial], n: int = 200, measurements: Sequence[Measurement] = ()) -> dict[str, Any]:
  """Per-trial costs of the measured trials (reused ones cost nothing), their medians, the search's share of the time
  the trials took, and the projected wall time of `n` trials."""
  gaps = _gaps(trials, measurements)
  rows = [trial_cost(t, *gaps.get(t.number, (0.0, 0.0, 0.0))) for t in sorted(trials, key=lambda t: t.number)
          if t.state in MEASURED]
  if not rows: return {"trials": [], "n": 0}
  walls = [r["wall_s"] for r in rows]
  setup, search, repeats = sum(r["setup_s"]
                               for r in rows), sum(r["search_s"] for r in rows), sum(r["repeat_s"] for r in rows)
  lock = sum(r["lock_s"] for r in rows)
  per_trial = (sum(walls) - setup) / len(rows)
  full = [r for r in rows if r["stage"] == "full"]
  medians = {k: statistics.median(r[k] for r in full if k in r) for k in ("full_s", *PHASES)
             if any(k in r for r in full)}
  blocks = [r["block_s"] for r in rows if r["block_s"]]
  return {**_time_to_best(rows), "trials": rows, "n": len(rows), "full_stage": len(full), "block_stage": len(blocks),
          "median_block_s": statistics.median(blocks) if blocks else None, "median": medians,
          "setup_s": setup, "repeat_s": repeats, "lock_s": lock, "mean_trial_s": per_trial,
          "search_share": search / sum(walls) if sum(walls) else 0.0, "lock_share": lock / sum(walls) if sum(walls)
          else 0.0, "projected_n": n, "projected_s": setup + n * per_trial}


def _time_to_best(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The fastest measured trial, and the wall seconds (summed in trial order) to the first within NEAR_BEST of it."""
  ok = [r for r in rows if r["tok_s"]]
  if not ok: return {"best_trial": None, "best_tok_s": None, "near_best_trial": None, "time_to_best_s": None}
  best = max(ok, key=lambda r: r["tok_s"])
  near = next(r for r in ok if r["tok_s"] >= (1 - NEAR_BEST) * best["tok_s"])
  elapsed = dict(zip((r["trial"] for r in rows), itertools.accumulate(r["wall_s"] for r in rows), strict=True))
  return {"best_trial": best["trial"], "best_tok_s": best["tok_s"], "near_best_trial": near["trial"],
          "time_to_best_s": elapsed[near["trial"]]}


def cost_doc(study: str, trials: Sequence[Trial], n: int = 200, measurements: Sequence[Measurement] = (),
             workload: str = "", best: dict[str, Any] | None = None) -> dict[str, Any]:
  """The `search cost --format json` document (docs/json.md): study_cost's figures with the document's `schema`,
  `study`, the study's workload and its best (the leaderboard's first, leaderboard.best_of)."""
  return {"schema": SCHEMA, "study": study, "workload": workload, "best": best, **study_cost(trials, n, measurements)}


def _s(v: float | None) -> str: return "" if v is None else f"{v:.1f}"


def cost_view(doc: dict[str, Any]) -> tuple[list[Section], list[str]]:
  """The per-trial table (seconds per phase; block and full: the stages' walls) and what it projects."""
  cols = ["trial", "state", "stage", "beam", "ladder", "tok/s", "wall", "setup", "repeats", "lock", "search",
          "block", "full", *(p[:-2] for p in PHASES)]
  rows = [[r["trial"], r["state"], r["stage"], r["beam"], r["ladder"], _s(r["tok_s"]), _s(r["wall_s"]),
           _s(r["setup_s"]), _s(r["repeat_s"] or None), _s(r["lock_s"] or None), _s(r["search_s"]),
           _s(r["block_s"] or None),
           _s(r["full_s"] or None), *(_s(r.get(p)) for p in PHASES)] for r in doc["trials"]]
  if not doc["n"]: return [Section("trial cost (s)", cols, rows, records=[])], ["no measured trial yet"]
  h = doc["projected_s"] / 3600
  notes = [f"{doc['n']} measured trials at {doc['workload']} ({doc['full_stage']} reached the full model, "
           f"{doc['block_stage']} ran the "
           f"block proxy): {doc['mean_trial_s']:.1f} s per trial without setup, setup {doc['setup_s']:.1f} s once, "
           f"{doc['repeat_s']:.1f} s of re-measurements; waits for the device lock (another process benchmarking on "
           f"it) {doc['lock_s']:.1f} s, {100 * doc['lock_share']:.2f}%; the search's own share (outside every trial "
           f"process, without the lock waits) {100 * doc['search_share']:.2f}%.",
           f"projected wall time of {doc['projected_n']} trials on one device: {h:.2f} h (setup once + the mean trial "
           "as measured)."]
  if doc["best_trial"] is not None:
    notes.append(f"time to best: {doc['time_to_best_s']:.0f} s of study wall time to trial {doc['near_best_trial']}, "
                 f"the first within {NEAR_BEST:.0%} of the fastest single figure (trial {doc['best_trial']}, "
                 f"{doc['best_tok_s']:.2f} tok/s as first measured).")
  notes.append(f"the study's {best_line(doc.get('best'))} (the leaderboard's first: what `search export` ships)")
  drop = ("profile", "overhead", "prompt", "prefill", "warmup", "check", "load", "measure", "compile", "repeats",
          "setup", "lock", "search", "ladder", "beam", "stage", "block", "full")
  return [Section("trial cost (s)", cols, rows, records=doc["trials"], drop=drop)], notes


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_format(p)
  p.add_argument("--study", required=True, help="the study whose trials to account for")
  p.add_argument("--project", type=at_least(1), default=200, help="trials to project the wall time of (default 200)")


def run(args: argparse.Namespace) -> None:
  with session(open_db(args.storage, create=False)) as s:
    st = study_named(s, args.storage, args.study)
    board = leaderboard(s, st, top=1)
    doc = cost_doc(st.name, store.trials(s, st), args.project, store.measurements(s, st, stage=None),
                   board["workload"], board["best"])
  sections, notes = cost_view(doc)
  emit(args.format, sections, doc, console, notes)
