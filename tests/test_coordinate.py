"""The coordinate sampler (search/coordinate.py): from the baseline one knob at a time, each trial the first untried
one-knob change of the fastest config so far, then the fallback sampler."""
from __future__ import annotations

import optuna
from knobcheck import mix_info

from search.coordinate import CoordinateSampler, changed_knob
from space.knobs import FAMILY, defaults, family_move, knobs, suggest

INFO, DEVICE = mix_info("q4_0"), "CUDA"  # GLM-4.7-Flash's space on CUDA
FAST = {"fused.attention": "native", "fused.router": "native", "fused.moe": "native", "fused.ffn": "native",
        "ffn_act": "q8"}


def noise(cfg) -> float:
  """A fixed factor within +-0.1% of 1 from the config's identity (StructureConfig.hash)."""
  return 1 + 0.002 * (int(cfg.hash[:4], 16) / 65535 - 0.5)


def speed(trial: optuna.Trial, fixed: dict | None = None) -> float:
  """A landscape where each fused stage pays on its own (native more than dsl), 8-bit activations pay once an FFN stage
  is fused, BEAM costs, and every other knob moves the figure by noise alone (noise: a spread of 0.2%)."""
  cfg = suggest(trial, knobs(INFO, DEVICE), fixed)
  v = 10.0
  for stage in ("attention", "router", "moe", "ffn"):
    v *= {"off": 1.0, "dsl": 1.2, "native": 1.5}[cfg.fused.get(stage, "off")]
  v *= 1.2 if cfg.ffn_act == "q8" else 1.0
  v *= 0.9 if cfg.beam else 1.0
  return v * noise(cfg)


class Fallback(optuna.samplers.RandomSampler):
  """The climb's fallback, noting the trials it sampled."""

  def __init__(self) -> None:
    super().__init__(seed=0)
    self.sampled: set[int] = set()

  def sample_independent(self, study, trial, param_name, param_distribution):
    self.sampled.add(trial.number)
    return super().sample_independent(study, trial, param_name, param_distribution)


def climb(n: int, fixed: dict | None = None) -> optuna.Study:
  ks, fixed = knobs(INFO, DEVICE), fixed or {}
  study = optuna.create_study(direction="maximize", sampler=CoordinateSampler(ks, fixed, Fallback()))
  # the study measures the baseline first
  study.enqueue_trial({k: v for k, v in defaults(ks, fixed).items() if k not in fixed})
  study.optimize(lambda t: speed(t, fixed), n_trials=n)
  return study


def test_the_climb_takes_each_paying_change_and_reaches_their_combination() -> None:
  study = climb(16)
  trials = study.trials
  first = next(t.number for t in trials if all(t.params.get(k) == v for k, v in FAST.items()))
  assert first <= 12, [t.params for t in trials[:first + 1]]  # four stages (dsl, then native) and q8: a dozen trials
  params = [tuple(sorted(t.params.items())) for t in trials]
  assert len(set(params)) == len(params), "a config was proposed twice"
  assert [family_move(trials[0].params, t.params) for t in trials[1:3]] == ["dsl", "native"]  # the families first
  best = trials[0]
  # every trial is the incumbent of its time with one knob changed (and what that change makes apply), or a family move
  for t in trials[1:]:
    changed = {k for k in set(t.params) | set(best.params) if t.params.get(k) != best.params.get(k)}
    # of the knobs both configs hold, one changed; the others changed only by applying in one of them
    assert len(changed) == 1 or family_move(best.params, t.params) or (
      len({k for k in changed if k in best.params and k in t.params}) == 1), (best.params, t.params)
    if t.value > best.value: best = t


def test_the_climb_moves_a_whole_backend_family_where_only_the_family_pays() -> None:
  """A landscape where a backend pays only as a whole (Youtu-LLM-2B on CUDA, session 9): every stage on dsl is faster
  than the per-op path, every stage and weight on native faster still, and a native stage or weight beside dsl ones
  costs. Single changes from all dsl never reach all native; the family move proposes it as the second trial."""
  stages = ("attention", "router", "moe", "ffn")
  def on(cfg) -> set[str]: return {*(cfg.fused.get(st, "off") for st in stages), cfg.backend("Q4_0", "dense")}
  def speed(trial: optuna.Trial) -> float:
    cfg = suggest(trial, knobs(INFO, DEVICE))
    used = on(cfg)
    v = 70.0 if used == {"native"} else 40.0 if used == {"dsl"} else 30.0 if {"dsl", "native"} <= used else \
      10.0 + 5 * sum(cfg.fused.get(st, "off") != "off" for st in stages)
    v *= 1.1 if cfg.ffn_act == "q8" else 1.0
    return v * noise(cfg)
  ks = knobs(INFO, DEVICE)
  study = optuna.create_study(direction="maximize", sampler=CoordinateSampler(ks, {}, Fallback()))
  study.enqueue_trial(defaults(ks, {}))
  study.optimize(speed, n_trials=4)
  native = [t.number for t in study.trials
            if on(suggest(optuna.trial.FixedTrial(t.params), knobs(INFO, DEVICE))) == {"native"}]
  assert native[0] == 2, [t.params for t in study.trials]
  # then what the family leaves before its own knobs' single changes: 8-bit activations next
  assert study.best_trial.number == 3 and study.best_value > 70 * 1.05 and study.best_trial.params["ffn_act"] == "q8"


def test_once_every_change_is_tried_the_fallback_samples() -> None:
  """A space pinned down to the four stages' knobs: the climb takes them to native, tries every other change of that
  incumbent once, then leaves the trials to the fallback (random here); the pinned knobs stay pinned."""
  keep = {"fused.attention", "fused.router", "fused.moe", "fused.ffn"}
  fixed = {k.name: k.default for k in knobs(INFO, DEVICE) if k.name not in keep}
  study = climb(40, fixed)
  assert all(set(t.params) <= keep for t in study.trials)
  sampled = study.sampler.fallback.sampled
  climbed = [t for t in study.trials[1:] if t.number not in sampled]
  rest = [t for t in study.trials[1:] if t.number in sampled]
  assert climbed and rest and max(t.number for t in climbed) < min(t.number for t in rest)
  path = [tuple(sorted(t.params.items())) for t in [study.trials[0], *climbed]]
  assert len(set(path)) == len(path) and max(t.value for t in climbed) >= 10 * 1.5**4 * 0.998
  native = next(t for t in climbed if all(t.params[k] == "native" for k in keep))
  assert len(climbed) - climbed.index(native) - 1 <= 8  # after it, only its own 8 one-knob changes not tried before


def test_the_climb_writes_nothing_into_optuna() -> None:
  """The sampler reads the study's trials and stores nothing (no private storage call): the knob a trial changed is
  found again from the trials, the one knob that applies in both configs with another value."""
  study = climb(6)
  assert all(not t.system_attrs or set(t.system_attrs) == {"fixed_params"} for t in study.trials)
  ks, done = knobs(INFO, DEVICE), study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
  names, start = [k.name for k in ks], defaults(ks, {})
  assert changed_knob(study.trials[0], done, start, names, {}) is None  # the baseline changed nothing
  assert changed_knob(study.trials[1], done, start, names, {}) == changed_knob(study.trials[2], done, start, names,
                                                                                {}) == FAMILY  # all dsl, all native
  # after a family move, the first knob it left: 8-bit activations (the stages' own changes come last)
  assert changed_knob(study.trials[3], done, start, names, {}) == "ffn_act"
