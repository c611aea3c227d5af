"""Is the ladder's stage-1 proxy (the leading blocks) worth pruning by? Judged per study from the trials that ran both
stages whatever the proxy said: the first MIN_PAIRS trials and every SAMPLE_EVERY-th trial after (an unbiased sample; a
trial that survived pruning is not). Pruning is on only while the proxy's rank correlation with the full model is high.

The proxy must also pay for itself: pruning stops the bottom PRUNE_SHARE of trials before their full stage, so it saves
at most that share of a full stage per trial, while every trial pays the proxy stage. Once the trials that ran both
stages (the baseline first) show the proxy costing PRUNE_SHARE of a full stage or more (the median ratio), the trials
skip it. At full depth on a GPU, where a trial's load, compile and check hardly shrink with the block count, that is
the usual case (docs/benchmarks.md, session 7).

At full depth the proxy's embedding and output head weigh as much as at 3 blocks while the blocks do not, so how well
the proxy ranks configs is a property of the model and the space, measured, not assumed."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from db.models import Trial

MIN_PAIRS = 8  # sampled trials with both stages before the proxy may prune
RHO_MIN = 0.7  # Spearman rank correlation of proxy and full tok/s from which the proxy prunes
SAMPLE_EVERY = 5  # after that, every 5th trial still runs both stages, so the correlation stays measured
PRUNE_SHARE = 0.25  # pruning stops the bottom quarter of the proxy's figures


def _ranks(v: Sequence[float]) -> np.ndarray:
  a = np.asarray(v, dtype=np.float64)
  r = np.empty(len(a))
  r[a.argsort(kind="stable")] = np.arange(1, len(a) + 1)
  for u in np.unique(a): r[a == u] = r[a == u].mean()  # ties share their mean rank
  return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
  """Spearman's rank correlation of x and y; None for fewer than 3 pairs or a constant side."""
  if len(x) < 3: return None
  rx, ry = _ranks(x), _ranks(y)
  if rx.std() == 0 or ry.std() == 0: return None
  return float(np.corrcoef(rx, ry)[0, 1])


@dataclass(frozen=True)
class ProxyFit:
  pairs: int  # sampled trials with an ok proxy and an ok full model
  rho: float | None  # their Spearman rank correlation
  proxy_s: float  # seconds all trials spent in the proxy stage
  total_s: float  # seconds all trials spent in evaluator processes
  cost_ratio: float | None  # median proxy seconds per full-stage second of the trials that ran both

  @property
  def predicts(self) -> bool: return self.pairs >= MIN_PAIRS and self.rho is not None and self.rho >= RHO_MIN

  @property
  def pays(self) -> bool:
    """Whether pruning could save more than the proxy costs (unmeasured: it may)."""
    return self.cost_ratio is None or self.cost_ratio < PRUNE_SHARE

  def summary(self) -> str:
    rho = f"Spearman rho {self.rho:.2f}" if self.rho is not None else "no rank correlation yet"
    verdict = (f"costs {self.cost_ratio:.0%} of a full stage, more than pruning a quarter can save: skipped"
               if not self.pays else "prunes the bottom quarter" if self.predicts
               else f"validating (pruning needs {MIN_PAIRS} sampled trials)" if self.pairs < MIN_PAIRS
               else f"does not predict (rho < {RHO_MIN}): skipped but for every {SAMPLE_EVERY}th trial")
    share = f"; proxy stage {100 * self.proxy_s / self.total_s:.0f}% of trial time" if self.total_s else ""
    return f"block proxy vs full model: {rho} over {self.pairs} sampled trials, {verdict}{share}"


def proxy_fit(trials: Sequence[Trial]) -> ProxyFit:
  """How the proxy ranks configs against the full model in these trials (one study's), and what it cost."""
  pairs = [(t.block_tok_s, t.tok_s) for t in trials if t.state == "ok" and (t.metrics or {}).get("ladder") == "sample"
           and t.block_tok_s and t.tok_s]
  ran = [(t.state, t.phases or {}) for t in trials if t.state != "reused"]
  proxy = sum(p.get("wall_s", 0) if state == "pruned" else p.get("block_wall_s", 0) for state, p in ran)
  ratios = [p["block_wall_s"] / p["wall_s"] for t in trials if t.stage == "full" and t.state != "reused"
            and (p := t.phases or {}).get("block_wall_s") and p.get("wall_s")]
  return ProxyFit(len(pairs), spearman(*zip(*pairs, strict=True)) if pairs else None, proxy,
                  sum(p.get("wall_s", 0) + p.get("block_wall_s", 0) for _, p in ran),
                  float(np.median(ratios)) if ratios else None)


def ladder(number: int, fit: ProxyFit, baseline: bool) -> str:
  """How trial `number` uses the two-stage ladder: "sample" (both stages, never pruned), "prune" (the proxy may prune
  it), or "full" (the full model only: the proxy does not pay or does not predict). The baseline samples, which
  measures what the proxy costs."""
  if baseline: return "sample"
  if not fit.pays: return "full"
  if fit.pairs < MIN_PAIRS or number % SAMPLE_EVERY == 0: return "sample"
  return "prune" if fit.predicts else "full"
