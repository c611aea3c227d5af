"""Replay: a finished study's search re-run offline against its recorded measurements, to compare samplers with
evidence.

Each replayed trial asks the sampler for a config as the live search would; its value is the one recorded for that
config (no device involved). A config the study never measured is unavailable: the trial fails and the sampler moves on,
as after a crash. The figure is how many trials a sampler needs to reach 95% of the best tok/s the study knows.

A study's own sampler proposes what it measured; any other sampler meets unavailable configs, counted against it. So
replay compares samplers only on a study measured densely (MIN_COVERAGE of its space, e.g. a random study of a small
sub-space made for the purpose), and reports each sampler's share of unavailable proposals beside its figure."""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import optuna
from rich.table import Table

from db import store
from db.engine import open_db, session
from evaluator.cli import at_least
from search.formats import console
from search.options import add_storage
from search.study import SAMPLERS, load_setup, sampler, stored_baseline
from space.knobs import size, suggest

MIN_COVERAGE = 0.9  # share of the study's space it must have measured for a sampler comparison


class Unmeasured(Exception):
  """A replayed trial whose config the study has no figure of (Optuna marks it FAIL; the replay goes on)."""


@dataclass
class ReplayResult:
  sampler: str
  trials: int
  target: float  # tok/s to reach
  reached_at: list[int | None]  # per repeat: the 1-based trial that first reached the target, None if it never did
  unavailable: float  # share of proposals the study never measured

  @property
  def median_trials(self) -> float | None:
    hits = [r for r in self.reached_at if r is not None]
    return statistics.median(hits) if len(hits) * 2 > len(self.reached_at) else None


def recorded(url: str, name: str) -> dict[str, float | None]:
  """config hash -> measured tok/s (None for a config that failed or computed the wrong output; a config that was only
  killed or timed out counts as unmeasured: that says nothing lasting about it)."""
  with session(open_db(url, create=False)) as s:
    study = store.get_study(s, name)
    if study is None: raise ValueError(f"no study named {name!r}")
    return {t.config_hash: t.tok_s for t in store.trials(s, study) if t.state not in store.UNMEASURED + store.TRANSIENT}


def coverage(url: str, name: str) -> tuple[int, int]:
  """(distinct configs the study measured, configs in its space)."""
  setup, info = load_setup(name, url)
  return len(recorded(url, name)), size(info, setup.device, setup.fixed, setup.family)


def replay(url: str, name: str, samplers: list[str], trials: int, repeats: int,
           share: float = 0.95) -> list[ReplayResult]:
  setup, info = load_setup(name, url)
  measured, space = coverage(url, name)
  if measured < MIN_COVERAGE * space:
    raise ValueError(f"study {name!r} measured {measured} of the {space:,} configs of its space "
                     f"({100 * measured / space:.2g}%): replay compares samplers only on a study that measured at "
                     f"least {100 * MIN_COVERAGE:.0f}% of its space, or the configs its own sampler "
                     "never proposed count against the others; make one of a small sub-space, e.g. `search start "
                     "--sampler random` with --fix on all but a few knobs and --trials about three times the "
                     "sub-space's size")
  values, base = recorded(url, name), stored_baseline(url, setup, info)
  best = max((v for v in values.values() if v), default=None)
  if best is None: raise ValueError(f"study {name!r} has no successful trial to replay against")
  out = []
  for sname in samplers:
    reached, missing, asked = [], 0, 0
    for r in range(repeats):
      study = optuna.create_study(direction="maximize",
                                  sampler=sampler(sname, r, min(8, trials // 3 or 1), setup.knobs(info), setup.fixed))
      study.enqueue_trial(setup.params(base, info))  # as the live search starts from the baseline
      first: list[int] = []
      def objective(trial: optuna.Trial, first: list[int] = first) -> float:
        nonlocal missing, asked
        h = suggest(trial, setup.knobs(info), setup.fixed).hash
        asked += 1
        if h not in values:
          missing += 1
          raise Unmeasured("unavailable")
        if (v := values[h]) is None: raise Unmeasured("failed")
        if v >= share * best and not first: first.append(trial.number + 1)
        return v
      study.optimize(objective, n_trials=trials, catch=(Unmeasured,))
      reached.append(first[0] if first else None)
    out.append(ReplayResult(sname, trials, share * best, reached, missing / max(asked, 1)))
  return out


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p)
  p.add_argument("--study", required=True, help="the study whose measurements to replay")
  p.add_argument("--sampler", action="append", choices=SAMPLERS,
                 help="a sampler to replay; repeatable (default: coordinate, tpe and random)")
  p.add_argument("--trials", type=at_least(1), default=30, help="trials per replayed search (default 30)")
  p.add_argument("--repeats", type=at_least(1), default=10,
                 help="replayed searches per sampler, each with its own seed (default 10)")


def run(args: argparse.Namespace) -> None:
  results = replay(args.storage, args.study, args.sampler or ["coordinate", "tpe", "random"], args.trials, args.repeats)
  measured, space = coverage(args.storage, args.study)
  t = Table(title=f"replay of {args.study} (measured {measured} of {space} configs): trials to reach 95% of its best "
            f"tok/s ({args.trials} trials, {args.repeats} repeats)")
  for col in ("sampler", "median trials", "reached in", "per repeat", "unmeasured proposals"): t.add_column(col)
  for r in results:
    hits = sum(x is not None for x in r.reached_at)
    t.add_row(r.sampler, f"{r.median_trials:g}" if r.median_trials is not None else f"> {r.trials}",
              f"{hits}/{len(r.reached_at)}", " ".join(str(x) if x is not None else "-" for x in r.reached_at),
              f"{100 * r.unavailable:.0f}%")
  console.print(t)
