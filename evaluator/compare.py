"""A/B comparison: two configs measured alternately (A B A B ...), each run in a fresh trial process, so drift of the
machine (clocks, temperature, other load) falls on both alike. The speedup is the ratio B/A within each pair."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from evaluator.result import TrialResult
from evaluator.runner import Evaluator


@dataclass
class Comparison:
  a: list[TrialResult] = field(default_factory=list)
  b: list[TrialResult] = field(default_factory=list)

  @property
  def failed(self) -> TrialResult | None: return next((r for r in self.a + self.b if not r.ok), None)

  @property
  def ratios(self) -> list[float]:
    return [rb.metrics["tok_s"] / ra.metrics["tok_s"] for ra, rb in zip(self.a, self.b, strict=False) if ra.ok
            and rb.ok]

  @property
  def speedup(self) -> float: return statistics.median(self.ratios)

  @property
  def low(self) -> float:
    """The lower bound of the speedup: the worst pair (a winner must hold in every pair)."""
    return min(self.ratios)

  @property
  def high(self) -> float: return max(self.ratios)

  def tok_s(self, side: str) -> float: return statistics.median(r.metrics["tok_s"] for r in getattr(self, side) if r.ok)


def compare(ev: Evaluator, a: dict, b: dict, pairs: int = 3, stage: str = "full",
            on_run: Callable[[str, int], None] | None = None, **kw) -> Comparison:
  """Measure a and b alternately `pairs` times; stops at the first failed run (Comparison.failed says which)."""
  c = Comparison()
  for i in range(pairs):
    for side, cfg in (("a", a), ("b", b)):
      if on_run: on_run(side, i)
      getattr(c, side).append(res := ev.run(cfg, stage, **kw))
      if not res.ok: return c
  return c
