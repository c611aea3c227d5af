"""The coordinate sampler: hill climbing from the baseline, one knob at a time, as the seeds' journal tunes by hand.

Each trial is the fastest config measured so far (the incumbent; the baseline before that) with one move made: first
the family moves (every backend knob on one backend at once: all dsl, all native), then one knob changed, the knobs in
the space's order (the fused stages first, then the kernel backends, BEAM and its settings last), each knob's other
values in order, skipping every config the study has proposed before. A change that measures faster becomes the
incumbent and the next trial is the first untried change of it, so the changes that pay are taken one after another,
each then tried against the knobs that apply under it. Once every move of the incumbent has been proposed, trials
come from the fallback sampler (TPE), which has the study's measurements to learn from by then.

Why: what pays in this space comes mostly one knob at a time (each fused stage pays on its own, 8-bit activations once
an FFN stage is fused), and only together do those changes make the fast config, one combination of several knobs that
random starting trials rarely meet, where the climb reaches it in about a dozen trials on a landscape that pays that way
(tests/test_coordinate.py). The backends are the exception: they pay as a family (a native stage beside a dsl one can
run no faster than all dsl), so a climb of single changes that took dsl first never reaches all native; the family moves
put each whole family to one trial at the start of every pass.
"""
from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from space.knobs import FAMILY, Knob, backend_knob, defaults, differ, family_move, family_moves, one_knob_away


def changed_knob(trial: FrozenTrial, done: list[FrozenTrial], start: dict[str, Any], names: list[str],
                 fixed: dict[str, Any]) -> str | None:
  """The knob whose change made `trial`'s config from the incumbent of its time (the fastest of the `done` trials
  numbered before it, or `start`): the one knob that applies in both configs with another value (a change leaves every
  other knob that applies in both as it was); FAMILY where it is a family move (space.knobs.family_move).
  None where neither holds (a trial of the fallback or an enqueued config)."""
  prev = max((t for t in done if t.number < trial.number), key=lambda t: t.values[0], default=None)
  a, b = start if prev is None else prev.params | fixed, trial.params | fixed
  if family_move(a, b): return FAMILY
  ks = [k for k in differ(a, b) if k in names]
  return ks[0] if len(ks) == 1 else None


class CoordinateSampler(optuna.samplers.BaseSampler):
  """Proposes the first untried one-knob change of the incumbent (see the module docstring); `fallback` samples once
  none is left. ks: the study's knobs; fixed: its pinned knob values (not Optuna parameters)."""

  def __init__(self, ks: list[Knob], fixed: dict[str, Any], fallback: optuna.samplers.BaseSampler):
    self.ks, self.fixed, self.fallback = ks, fixed, fallback
    self._plans: dict[int, dict[str, Any] | None] = {}

  def plan(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any] | None:
    """The parameters of this trial's config, or None when every move of the incumbent has been proposed. The moves
    start at the knob whose change made the incumbent (its other values, then the knobs after it, then the family moves
    and the knobs before it, which the change may have made worth another try), so a pass over the knobs goes on where
    it was. Where a family move made it, the other families come first, then the knobs it left (the precision and rows
    its backend reads), and the single changes of its own backend knobs, each a stage or weight off the family, last."""
    others = [t for t in study.get_trials(deepcopy=False) if t.number != trial.number]
    seen = [t.params for t in others] + [t.system_attrs["fixed_params"] for t in others
                                         if "fixed_params" in t.system_attrs]
    done = [t for t in others if t.state == TrialState.COMPLETE and t.values]
    best = max(done, key=lambda t: t.values[0], default=None)
    start, names = defaults(self.ks, self.fixed), [k.name for k in self.ks]
    here = start if best is None else best.params | self.fixed
    knob = None if best is None else changed_knob(best, done, start, names, self.fixed)
    order = [FAMILY, *names]
    at = order.index(knob) if knob is not None else 0
    moves = [(FAMILY, v) for _, v in family_moves(here, self.ks, self.fixed)] + one_knob_away(here, self.ks, self.fixed)
    if knob == FAMILY: key = lambda c: (0 if c[0] == FAMILY else 2 if backend_knob(c[0]) else 1, order.index(c[0]))
    else: key = lambda c: (0, (order.index(c[0]) - at) % len(order))
    for _, values in sorted(moves, key=key):
      if (params := {k: v for k, v in values.items() if k not in self.fixed}) not in seen: return params
    return None

  def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
    self._plans[trial.number] = plan = self.plan(study, trial)
    return self.fallback.infer_relative_search_space(study, trial) if plan is None else {}

  def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                      search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
    return self.fallback.sample_relative(study, trial, search_space) if self._plans.get(trial.number) is None else {}

  def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                         param_distribution: BaseDistribution) -> Any:
    plan = self._plans.get(trial.number)
    if plan is not None and param_name in plan: return plan[param_name]
    return self.fallback.sample_independent(study, trial, param_name, param_distribution)

  def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None: self.fallback.before_trial(study, trial)

  def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: list[float] | None) -> None:
    self._plans.pop(trial.number, None)
    self.fallback.after_trial(study, trial, state, values)

  def reseed_rng(self) -> None: self.fallback.reseed_rng()
