"""Replay: a finished study's search re-run offline against its recorded measurements, to compare samplers with evidence.

Each replayed trial asks the sampler for a config as the live search would; its value is the one recorded for that config
(no device involved). A config the study never measured is unavailable: the trial fails and the sampler moves on, as after
a crash. The figure is how many trials a sampler needs to reach 95% of the best tok/s the study knows."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import optuna

from db import store
from db.engine import open_db, session
from model.structure import StructureConfig
from search.study import TrialFailed, config_hash, load_setup, sampler
from space.knobs import suggest, to_params


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
  """config hash -> measured tok/s (None for a config that failed or computed the wrong output)."""
  with session(open_db(url)) as s:
    study = store.get_study(s, name)
    if study is None: raise ValueError(f"no study named {name!r}")
    return {t.config_hash: t.tok_s for t in store.trials(s, study) if t.state not in store.UNMEASURED}


def replay(url: str, name: str, samplers: list[str], trials: int, repeats: int, share: float = 0.95) -> list[ReplayResult]:
  setup, info = load_setup(name, url)
  values = recorded(url, name)
  best = max((v for v in values.values() if v), default=None)
  if best is None: raise ValueError(f"study {name!r} has no successful trial to replay against")
  out = []
  for sname in samplers:
    reached, missing, asked = [], 0, 0
    for r in range(repeats):
      study = optuna.create_study(direction="maximize", sampler=sampler(sname, r, min(8, trials // 3 or 1)))
      base = to_params(StructureConfig(), info, setup.device)
      study.enqueue_trial({k: v for k, v in base.items() if k not in setup.fixed})  # as the live search starts from the baseline
      first: list[int] = []
      def objective(trial: optuna.Trial, first: list[int] = first) -> float:
        nonlocal missing, asked
        h = config_hash(suggest(trial, info, setup.device, setup.fixed))
        asked += 1
        if h not in values:
          missing += 1
          raise TrialFailed("unavailable")
        if (v := values[h]) is None: raise TrialFailed("failed")
        if v >= share * best and not first: first.append(trial.number + 1)
        return v
      study.optimize(objective, n_trials=trials, catch=(TrialFailed,))
      reached.append(first[0] if first else None)
    out.append(ReplayResult(sname, trials, share * best, reached, missing / max(asked, 1)))
  return out
