"""A/B comparison: two configs measured alternately (A B A B ...), each run in a fresh trial process, so drift of the
machine (clocks, temperature, other load) falls on both alike. The speedup is the ratio B/A within each pair; its
interval is Student's t on the pairs' log ratios (a ratio's noise is multiplicative), and pairs go on, past a minimum,
until that interval leaves 1 on one side or a budget of pairs is spent.

Stopping when the interval first excludes 1 would look at the data several times: each look at the usual level would
add its own chance of a false "faster". So the level of every look (and of the interval reported) is Bonferroni's over
the looks the budget allows: with one look it is LEVEL, and the reported interval keeps at least LEVEL's coverage
however early the pairs stopped."""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from scipy import stats

from evaluator.result import TrialResult
from evaluator.runner import Evaluator

LEVEL = 0.90  # two-sided: the low end is a one-sided 95% bound


@dataclass
class Comparison:
  a: list[TrialResult] = field(default_factory=list)
  b: list[TrialResult] = field(default_factory=list)
  looks: int = 1  # how many times the pairs may be looked at (compare's sequential stopping): the interval's Bonferroni

  @property
  def failed(self) -> TrialResult | None: return next((r for r in self.a + self.b if not r.ok), None)

  @property
  def ratios(self) -> list[float]:
    return [rb.metrics["tok_s"] / ra.metrics["tok_s"] for ra, rb in zip(self.a, self.b, strict=False) if ra.ok
            and rb.ok]

  @property
  def level(self) -> float: return 1 - (1 - LEVEL) / self.looks

  @property
  def speedup(self) -> float:
    """The geometric mean of the pair ratios (the centre of the interval)."""
    return math.exp(statistics.fmean(map(math.log, self.ratios)))

  def _half(self) -> float:
    """The interval's half-width in log ratio: t at the level over n-1 degrees of freedom times the standard error;
    infinite with one pair (no spread)."""
    logs = [math.log(r) for r in self.ratios]
    if len(logs) < 2: return math.inf
    return float(stats.t.ppf((1 + self.level) / 2, len(logs) - 1)) * statistics.stdev(logs) / math.sqrt(len(logs))

  @property
  def low(self) -> float: return self.speedup * math.exp(-self._half())

  @property
  def high(self) -> float: return self.speedup * math.exp(self._half())

  @property
  def decided(self) -> bool:
    """The interval leaves 1 on one side: faster, or slower."""
    return self.low > 1 or self.high < 1

  def tok_s(self, side: str) -> float: return statistics.median(r.metrics["tok_s"] for r in getattr(self, side) if r.ok)


def compare(ev: Evaluator, a: dict, b: dict, pairs: int = 3, stage: str = "full",
            on_run: Callable[[str, int], None] | None = None, max_pairs: int | None = None, **kw) -> Comparison:
  """Measure a and b alternately: `pairs` pairs, then more until the interval leaves 1 on one side, up to `max_pairs`
  (default: `pairs`, no sequential stopping); stops at the first failed run (Comparison.failed says which)."""
  top = max(pairs, max_pairs or pairs)
  c = Comparison(looks=top - pairs + 1)
  for i in range(top):
    for side, cfg in (("a", a), ("b", b)):
      if on_run: on_run(side, i)
      getattr(c, side).append(res := ev.run(cfg, stage, **kw))
      if not res.ok: return c
    if i + 1 >= pairs and c.decided: return c
  return c
