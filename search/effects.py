"""What the knobs are worth, computed once for every view (the report and the notebook through search.plots, the
dashboard through search.dashboard).

Importance: Optuna's fANOVA over the configs measured ok, one point per config at the figure the leaderboard ranks it
by (leaderboard.figure; a two-objective study's second objective: its peak device memory), over the knobs that took
more than one value among those configs. A knob is read from each config whole (space.knobs.flat: a knob that does not
apply there is at its default), so a knob that applies to only some configs (a barrier, a fused stage's setting) counts
when it varied, and one that never varied is not ranked at all. `Points.basis` says what the ranking rests on.

Single changes, the chart of a one-move-at-a-time climb: each config measured ok next to its parent, the fastest config
(as ranked) measured before it that differs from it in one move (one knob of those that apply to both, or a family
move: several backend knobs put on one backend, named space.knobs.FAMILY, its old values joined by "/"), and its speedup
over that parent from the two estimates, with a 90% interval that combines theirs.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import optuna
from sqlalchemy.orm import Session

from db import store
from db.models import Study
from model.structure import StructureConfig
from search.leaderboard import figure, leaderboard
from space.knobs import FAMILY, differ, family_move, flat


@dataclass(frozen=True)
class Points:
  """The configs measured ok that an importance rests on: their values of the knobs that varied, their figures."""
  knobs: list[dict[str, str]]  # per config: knob -> value (as text), the knobs that took more than one value
  values: list[float]  # per config: the figure ranked (tok/s) or its peak device memory (MB)
  objective: str
  trials: int  # ok trials of these configs
  measurements: int

  def basis(self) -> str:
    varied = len(self.knobs[0]) if self.knobs else 0
    return (f"fANOVA of {self.objective} over {len(self.values)} configs measured ok ({self.trials} trials, "
            f"{self.measurements} measurements), the {varied} knobs that took more than one value among them")


def points(s: Session, study: Study, objective: int = 0) -> Points:
  """The configs measured ok, at the figure the leaderboard ranks them by (objective 0) or at their peak device memory
  (objective 1, where they recorded one)."""
  board = leaderboard(s, study)
  base = board["baseline"]["tok_s"] if board["baseline"] else None
  value = (lambda r: figure(r, base)) if objective == 0 else (lambda r: r["peak_memory_mb"])
  rows = [r for r in board["rows"] if value(r) is not None]
  configs = {t.config_hash: t.config_json for t in store.trials(s, study)}
  flats = [flat(StructureConfig.from_json(configs[r["config_hash"]])) for r in rows]
  varied = [k for k in (flats[0] if flats else {}) if len({str(f[k]) for f in flats}) > 1]
  return Points([{k: str(f[k]) for k in varied} for f in flats], [value(r) for r in rows],
                "the ranked tok/s" if objective == 0 else "the peak device memory",
                sum(len(r["trials"]) for r in rows), sum(r["measurements"] for r in rows))


def importance(p: Points) -> dict[str, float]:
  """fANOVA importance of each knob that varied, highest first (they sum to 1); empty with fewer than 2 configs, no
  knob that varied, or one figure for all (nothing to explain)."""
  if len(p.values) < 2 or not p.knobs[0] or len(set(p.values)) < 2: return {}
  dists = {k: optuna.distributions.CategoricalDistribution(sorted({c[k] for c in p.knobs})) for k in p.knobs[0]}
  was = optuna.logging.get_verbosity()
  optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "a new study created in memory"
  try:
    study = optuna.create_study()
    study.add_trials([optuna.trial.create_trial(params=c, distributions=dists, value=v)
                      for c, v in zip(p.knobs, p.values, strict=True)])
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      imp = optuna.importance.get_param_importances(study,
                                                    evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
    return {k: float(v) for k, v in imp.items()}
  finally: optuna.logging.set_verbosity(was)


@dataclass(frozen=True)
class Change:
  """One config measured against its parent: the knob it changed (FAMILY for a family move), and its speedup over the
  parent with a 90% interval (None until the study has a noise figure)."""
  trial: int
  parent: int
  knob: str
  old: Any
  new: Any
  speedup: float
  low: float | None
  high: float | None


def single_changes(s: Session, study: Study, params: dict[int, dict[str, Any]]) -> list[Change]:
  """The single changes of the study's configs measured ok (module docstring), in trial order. params: each trial's
  knob values that apply to its config (Optuna's parameters, by trial number). The interval combines the two
  estimates' as independent errors (their log-widths in quadrature)."""
  board = leaderboard(s, study)
  base = board["baseline"]["tok_s"] if board["baseline"] else None
  rows = sorted((r for r in board["rows"] if r["trial"] in params), key=lambda r: r["trial"])
  out = []
  for i, r in enumerate(rows):
    a = params[r["trial"]]
    near = [q for q in rows[:i] if _move(params[q["trial"]], a)]
    if not (parent := max(near, key=lambda q: (figure(q, base), -q["trial"]), default=None)): continue
    knob, old, new = _move(params[parent["trial"]], a)
    ratio = r["tok_s"] / parent["tok_s"]
    low = high = None
    if r["tok_s_low"] is not None and parent["tok_s_low"] is not None:
      w = lambda x, lo, hi: (math.log(x / lo), math.log(hi / x))
      (cl, ch), (pl, ph) = w(r["tok_s"], r["tok_s_low"], r["tok_s_high"]), \
        w(parent["tok_s"], parent["tok_s_low"], parent["tok_s_high"])
      low, high = ratio * math.exp(-math.hypot(cl, ph)), ratio * math.exp(math.hypot(ch, pl))
    out.append(Change(r["trial"], parent["trial"], knob, old, new, ratio, low, high))
  return out


def _move(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, Any, Any] | None:
  """(knob, old value, new value) of the one move from config a to config b, or None where they are not one move
  apart."""
  ks = differ(a, b)
  if len(ks) == 1: return ks[0], a[ks[0]], b[ks[0]]
  if to := family_move(a, b): return FAMILY, "/".join(sorted({str(a[k]) for k in ks})), to
  return None
