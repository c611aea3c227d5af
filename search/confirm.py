"""Confirmation: the top configs of a study re-measured against the study's baseline in the evaluator's A/B mode (fresh
processes, alternating, more rounds), pair after pair from a minimum until the speedup's interval leaves 1 on one side
or a budget of pairs is spent (evaluator/compare.py). The winner is the config with the best lower bound of its speedup,
not one lucky run."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from db import store
from db.engine import open_db, session
from db.models import Confirmation, Study, Trial, utcnow
from evaluator.cli import at_least
from evaluator.compare import compare
from evaluator.runner import Evaluator
from model.registry import resolve
from model.structure import StructureConfig
from search import leaderboard
from search.dashboard import refresh
from search.formats import console, errors
from search.leaderboard import MIN_PAIRS, baseline
from search.options import add_format, add_storage, device_name
from search.profile import profile_trial
from search.show import find_trial
from search.study import measuring_setup
from search.view import label

MAX_PAIRS = 8  # the default budget of A/B pairs per config (search confirm --max-pairs)


def confirm(url: str, name: str, top: int = 3, pairs: int = 3, rounds: int = 5, device: str | None = None,
            say: Callable[[str], None] = print, again: bool = False, model: str | None = None,
            max_pairs: int | None = None) -> list[Confirmation]:
  """A/B-confirm the study's top configs, each over `pairs` to `max_pairs` pairs (None: `pairs` exactly, as `search
  start` confirms); a config confirmed before keeps its figures unless `again`. `model`: this host's copy of the
  study's file (checked by SHA-256, as the stored path is)."""
  max_pairs = max(pairs, max_pairs or pairs)
  setup, _ = measuring_setup(name, url, device, model)
  ev = setup.evaluator(rounds=rounds)
  engine = open_db(url, create=False)
  with session(engine) as s:
    study = store.get_study(s, name)
    base, rows = baseline(study), leaderboard.leaderboard(s, study)["rows"]
    todo = [find_trial(s, study, str(r["trial"])) for r in rows
            if r["config_hash"] != study.baseline_hash and not r["below_floor"]][:top]
    done = {c.config_hash for c in store.confirmations(s, study) if c.status == "ok"}
  if not again and (skip := [t for t in todo if t.config_hash in done]):
    say(f"already confirmed (--again re-measures): trials {', '.join(str(t.number) for t in skip)}")
    todo = [t for t in todo if t.config_hash not in done]
  out = []
  for i, t in enumerate(todo):
    say(f"confirming {i + 1}/{len(todo)}: trial {t.number} ({label(t.config_json, base)}), {pairs} to {max_pairs} A/B "
        "pairs against the baseline (until the interval leaves 1)")
    c = compare(ev, base.to_dict(), StructureConfig.from_json(t.config_json).to_dict(), pairs, max_pairs=max_pairs,
                on_run=lambda side, j: say(f"  pair {j + 1}: {'baseline' if side == 'a' else 'candidate'}"))
    fields = {"pairs": len(c.ratios), "rounds": rounds, "status": "ok"}
    if c.failed is not None:
      fields |= {"status": c.failed.status, "tok_s": 0.0, "baseline_tok_s": 0.0, "speedup": 0.0, "speedup_low": 0.0,
                                        "speedup_high": 0.0}
    else: fields |= {"tok_s": c.tok_s("b"), "baseline_tok_s": c.tok_s("a"), "speedup": c.speedup, "speedup_low": c.low,
                     "speedup_high": c.high}
    with session(engine) as s:
      out.append(store.add_confirmation(s, study, t, **fields))
      for side, h, trial in (("a", study.baseline_hash, None), ("b", t.config_hash, t)):
        for r in getattr(c, side):
          if r.ok: store.add_measurement(s, study.id, h, r.spec["stage"], r.tok_s, "confirm", trial=trial,
                                         rounds=r.metrics.get("tok_s_rounds"), wall_s=r.cost_s,
                                         **store.conditions(r.metrics, r.phases))
    verdict = ("failed" if fields["status"] != "ok" else "faster than the baseline (its interval is above 1)"
               if fields["speedup_low"] > 1 else "slower than the baseline (its interval is below 1)"
               if fields["speedup_high"] < 1 else
               "not shown faster: inconclusive (its interval holds 1)" if fields["speedup"] > 1 else
               "not faster than the baseline")
    say(f"  {fields['status']}: speedup {fields['speedup']:.3f}x [{fields['speedup_low']:.3f}, "
        f"{fields['speedup_high']:.3f}] ({c.level:.1%} interval) over {fields['pairs']} pairs: {verdict}")
  with session(engine) as s:
    win = leaderboard.leaderboard(s, study)["winner"]
    s.get(Study, study.id).finished_at = utcnow()
  _profile(ev, url, study, [t for t in todo if t.number == win or any(c.trial_id == t.id and c.status == "ok"
                                                                     and c.speedup_low > 1 for c in out)], say)
  return out


def _profile(ev: Evaluator, url: str, study: Study, confirmed: list[Trial], say: Callable[[str], None]) -> None:
  """The per-kernel profiles a kernel diff reads: of the configs just confirmed faster and the winner (made anew: the
  code may have changed since), and of the baseline where its trial has none (a study made before the baseline was
  profiled)."""
  with session(open_db(url, create=False)) as s:
    base = next((t for t in store.trials(s, study) if t.config_hash == study.baseline_hash and t.state == "ok"), None)
    todo = confirmed + ([base] if base is not None and not (base.reused_from or base).profile else [])
  for t in todo:
    say(f"profiling trial {t.number}{' (the baseline)' if t is base else ''}: its step's kernels, each name of each "
        "stage timed alone")
    profile_trial(ev, url, t, say)


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_format(p)
  p.add_argument("--study", required=True, help="the study whose leaderboard to confirm")
  p.add_argument("--top", type=at_least(1), default=3,
                 help="how many configs from the top of the leaderboard (default 3)")
  p.add_argument("--pairs", type=at_least(MIN_PAIRS), default=3,
                 help=f"the least A/B pairs per config, baseline and config alternating in fresh processes (default 3, "
                 f"at least {MIN_PAIRS})")
  p.add_argument("--max-pairs", type=at_least(MIN_PAIRS), default=MAX_PAIRS,
                 help=f"the most A/B pairs per config: past --pairs, pairs go on until the speedup's interval leaves 1 "
                 f"on one side (default {MAX_PAIRS})")
  p.add_argument("--rounds", type=at_least(1), default=5, help="measured rounds per A/B run (default 5)")
  p.add_argument("--device", type=device_name, help="tinygrad device (default: the study's)")
  p.add_argument("--model",
                 help="where the study's model file is on this host (default: the study's path; checked by SHA-256)")
  p.add_argument("--again", action="store_true", help="re-measure configs confirmed before")
  p.add_argument("--artifacts", help="directory of the trials' dashboard artifacts, rewritten with the confirmations "
                 "(default: beside a SQLite database)")


def run(args: argparse.Namespace) -> None:
  say = console.print if args.format == "table" else errors.print  # the progress; stdout keeps the document alone
  confirm(args.storage, args.study, top=args.top, pairs=args.pairs, rounds=args.rounds, device=args.device, say=say,
          again=args.again, model=str(resolve(args.model).resolve()) if args.model else None, max_pairs=args.max_pairs)
  refresh(args.storage, args.study, args.artifacts)
  leaderboard.show(args.storage, args.study, args.format, top=15)
