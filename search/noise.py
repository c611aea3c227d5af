"""Run-to-run noise, measured rather than ignored: the worker (search/worker.py) measures the study's baseline again at
intervals through a study (interleaved with the trials, so drift of the machine shows in it), and before a study ends
the configs whose interval reaches the best one's until each has SETTLE_N figures. Every figure is an ss_measurement;
db.store.estimates turns them into the robust estimate that ranks configs everywhere (leaderboard, confirmation, export,
the sampler on reuse)."""
from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Engine

from db import store
from db.engine import session
from db.models import Study, Trial
from db.store import interval
from evaluator.runner import Evaluator
from model.structure import StructureConfig

SETTLE_N = 3  # figures of each near-best config before a study ends


def repeat_every(trials: int) -> int:
  """Finished trials between two measurements of the baseline: a quarter of a short study's target (2 at least), 10 in a
  long one."""
  return max(2, min(10, trials // 4))


def near_best(est: dict[str, store.Estimate]) -> list[str]:
  """Configs within the noise of the best: their interval reaches the best one's lower bound (the best included), best
  first."""
  if not est: return []
  best = max(est.values(), key=lambda e: e.median)
  floor = best.low if best.low is not None else best.median
  return sorted((h for h, e in est.items() if (e.high if e.high is not None else e.median) >= floor),
                key=lambda h: -est[h].median)


def measure(ev: Evaluator, engine: Engine, study: Study, cfg: StructureConfig, h: str, trial: Trial | None, why: str,
            say: Callable[[str], None]) -> bool:
  """One more figure of a config of this study (h: its hash as the study stores it), stored as a repeat. It passed the
  gate as a trial of this study (the baseline is the reference), so its check is not run again: on a full-depth per-op
  config it costs more than the measurement itself."""
  res = ev.run(cfg.to_dict(), ev.stages[-1], check=False, on_wait=say)
  if not res.ok:
    say(f"{why}: {res.status} ({res.error[:200]})")
    return False
  with session(engine) as s:
    store.add_measurement(s, study.id, h, ev.stages[-1], res.tok_s, "repeat", trial=trial,
                          rounds=res.metrics.get("tok_s_rounds"), wall_s=res.cost_s)
    e = store.estimates(s, study)[h]
  say(f"{why}: {res.tok_s:.2f} tok/s; estimate {interval(e)} over {e.n} measurements")
  return True


def settle(ev: Evaluator, engine: Engine, study: Study, baseline: str, budget: int, say: Callable[[str], None]) -> int:
  """Measure the configs within the noise of the best again (fewest figures first) until each has SETTLE_N, within
  `budget` runs; returns how many figures it stored. The baseline (its hash) is left out: it is repeated through the
  study."""
  failed: set[str] = set()
  stored = 0
  while budget > 0:
    with session(engine) as s:
      est = store.estimates(s, study)
      first = {t.config_hash: t for t in store.leaderboard(s, study, None)}
    todo = [h for h in near_best(est) if h != baseline and h in first and h not in failed and est[h].n < SETTLE_N]
    if not todo: return stored
    h = min(todo, key=lambda h: est[h].n)
    t = first[h]
    if measure(ev, engine, study, StructureConfig.from_json(t.config_json), h, t,
               f"trial {t.number} is within the noise of the best, measured again", say): stored += 1
    else: failed.add(h)
    budget -= 1
  return stored
