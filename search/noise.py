"""Run-to-run noise, measured rather than ignored: the baseline is measured again at intervals through a study (interleaved
with the trials, so drift of the machine shows in it), and before a study ends the configs whose interval reaches the best
one's are measured again until each has SETTLE_N figures. Every figure is an ss_measurement; db.store.estimates turns
them into the robust estimate that ranks configs everywhere (leaderboard, confirmation, export, the sampler on reuse)."""
from __future__ import annotations

import optuna

from db import store
from db.engine import session
from db.store import interval
from model.structure import StructureConfig
from search.study import Event, Runner
from search.view import BASELINE

SETTLE_N = 3  # figures of each near-best config before a study ends


def repeat_every(trials: int) -> int:
  """Finished trials between two measurements of the baseline: a quarter of a short study's target (2 at least), 10 in a long one."""
  return max(2, min(10, trials // 4))


def near_best(est: dict[str, store.Estimate]) -> list[str]:
  """Configs within the noise of the best: their interval reaches the best one's lower bound (the best included), best first."""
  if not est: return []
  best = max(est.values(), key=lambda e: e.median)
  floor = best.low if best.low is not None else best.median
  return sorted((h for h, e in est.items() if (e.high if e.high is not None else e.median) >= floor), key=lambda h: -est[h].median)


def _measure(runner: Runner, h: str, cfg: StructureConfig, trial: store.Trial | None, why: str) -> bool:
  say = lambda text: runner.on_event(Event("note", -1, text))
  # the config passed the gate as a trial of this study (the baseline is the reference): its check is not run again (on a
  # full-depth per-op config it costs more than the measurement itself)
  res = runner.ev.run(cfg.to_dict(), runner.ev.stages[-1], check=False, on_wait=say)
  if not res.ok:
    say(f"{why}: {res.status} ({res.error[:200]})")
    return False
  with session(runner.engine) as s:
    store.add_measurement(s, runner.row.id, h, runner.ev.stages[-1], res.tok_s, "repeat", trial=trial, rounds=res.metrics.get("tok_s_rounds"),
                          wall_s=res.cost_s)
    e = store.estimates(s, runner.row)[h]
  say(f"{why}: {res.tok_s:.2f} tok/s; estimate {interval(e)} over {e.n} measurements")
  return True


def between_trials(runner: Runner):
  """An Optuna callback: after every repeat_every(target) finished trials of the study, the baseline is measured again."""
  def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    done = runner.finished()
    if done and done % repeat_every(runner.setup.trials) == 0 and done < runner.setup.trials:
      _measure(runner, BASELINE, StructureConfig(), None, f"baseline re-measured after {done} trials")
  return callback


def settle(runner: Runner) -> None:
  """Measure the configs within the noise of the best again (fewest figures first) until each has SETTLE_N, within a budget
  of a tenth of the study's target (at least 2 runs). The baseline is left out: it is repeated through the study."""
  budget, failed = max(2, runner.setup.trials // 10), set()
  while budget > 0:
    with session(runner.engine) as s:
      est = store.estimates(s, runner.row)
      first = {t.config_hash: t for t in store.leaderboard(s, runner.row, None)}
    todo = [h for h in near_best(est) if h != BASELINE and h in first and h not in failed and est[h].n < SETTLE_N]
    if not todo: return
    h = min(todo, key=lambda h: est[h].n)
    t = first[h]
    if not _measure(runner, h, StructureConfig.from_json(t.config_json), t, f"trial {t.number} is within the noise of the best, measured again"):
      failed.add(h)
    budget -= 1
