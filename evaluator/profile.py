"""Per-kernel profile of one decode step, from a pass separate from the timed rounds: the step's kernels are run one by one
(no JIT graph, so each is synchronised and timed by tinygrad's DEBUG=2 report) and aggregated by name."""
from __future__ import annotations

import collections
import contextlib
import io
import re

from tinygrad import Tensor, dtypes
from tinygrad.helpers import Context

_LINE = re.compile(r"\*\*\*\s+\S+\s+\d+\s+(\S+)\s+arg.*?tm\s+([\d.]+)(us|ms|s)\s*/.*?\(\s*[\d.]+\s+[GT]FLOPS\s+([\d.]+)\|\s*[\d.]+\s*([GT])B/s")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def kernel_profile(gen, token: int, pos: int, top: int = 30, passes: int = 3) -> list[dict]:
  """Top kernels by time per decode step: name, launches per step, µs per step, achieved GB/s, share of the step."""
  step = lambda: gen.model.forward(Tensor([[token]], dtype=dtypes.int32), gen.pos.bind(pos))[0, -1].realize()
  with Context(BEAM=gen.beam):
    step()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), Context(DEBUG=2):
      for _ in range(passes): step()
  agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
  for m in map(_LINE.search, _ANSI.sub("", buf.getvalue()).splitlines()):
    if m is None: continue
    us = float(m.group(2)) * {"us": 1, "ms": 1e3, "s": 1e6}[m.group(3)]
    a = agg[m.group(1)]
    a[0], a[1], a[2] = a[0] + 1, a[1] + us, a[2] + float(m.group(4)) * (1e3 if m.group(5) == "T" else 1) * us  # GB/s weighted by time
  total = sum(a[1] for a in agg.values()) or 1.0
  rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
  return [{"rank": i + 1, "name": name, "count": round(c / passes), "us_per_token": us / passes, "gb_s": gbus / us if us else None,
           "share": us / total} for i, (name, (c, us, gbus)) in enumerate(rows)]
