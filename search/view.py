"""The live view of a running study (rich): progress, the current trial's phase, the study's leader (the leaderboard's
first: its estimate with its interval and count, its speedup over the baseline's estimate, confirmed or not), recent
results, failures, ETA. On a terminal it redraws in place; elsewhere (logs, CI) it prints one line per finished
trial. Nothing is cut: the current trial's config wraps, the recent trials' table follows the views' fitting rule
(search/formats.py table: whole columns left out and named), and the phase's progress is rich's own, on its line."""
from __future__ import annotations

import collections
import statistics
import time

from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn
from rich.text import Text

from db import store
from db.engine import open_db, session
from db.models import Trial
from model.structure import StructureConfig
from search.events import Event
from search.formats import Section, table
from search.leaderboard import leaderboard
from space.knobs import describe


def label(config_json: str, base: StructureConfig) -> str:
  """A config as its knob values that differ from the study's baseline, or "baseline"."""
  return describe(StructureConfig.from_json(config_json), base) or "baseline"


def wall(t: Trial) -> float | None:
  """A trial's seconds in evaluator processes, both ladder stages."""
  return t.phases["wall_s"] + t.phases.get("block_wall_s", 0) if t.phases and "wall_s" in t.phases else None


class LiveView:
  """Listens to a worker's events (search/events.py); starts from the study's trials so far and its baseline, and reads
  the study's leader from its database (url) at each trial's end and each re-measurement."""

  def __init__(self, console: Console, study: str, total: int, finished: list[Trial], baseline: StructureConfig,
               url: str):
    self.console, self.study, self.total, self.base = console, study, total, baseline
    self.engine = open_db(url, create=False)
    self.done = len([t for t in finished if t.state not in ("running", "interrupted")])
    self.recent: collections.deque[Trial] = collections.deque(maxlen=6)
    self.failures: collections.Counter[str] = collections.Counter(t.failure_class for t in finished if t.failure_class)
    self.walls = [w for t in finished if (w := wall(t)) is not None]
    self.best: dict | None = None  # the leaderboard's first row
    self.baseline: float | None = None  # the baseline's estimate
    self.current: tuple[int, str, str, float] | None = None  # number, label, phase, start
    self.notes: collections.deque[str] = collections.deque(maxlen=3)
    self.rank()

  def rank(self) -> None:
    """The study's leader and the baseline's estimate, as the leaderboard has them now."""
    with session(self.engine) as s: doc = leaderboard(s, store.get_study(s, self.study), top=1)
    self.best = doc["rows"][0] if doc["rows"] else None
    self.baseline = doc["baseline"]["tok_s"] if doc["baseline"] else None

  def handle(self, e: Event) -> None:
    if e.kind == "start": self.current = (e.number, label(e.text, self.base), "starting", time.perf_counter())
    elif e.kind == "phase" and self.current: self.current = (*self.current[:2], e.text, self.current[3])
    elif e.kind == "measured": self.rank()
    elif e.kind in ("wait", "note"):
      self.notes.append(e.text)
      if not self.console.is_terminal: self.console.print(e.text)
    elif e.kind == "end" and e.row is not None:
      t, self.current = e.row, None
      self.done += 1
      self.recent.appendleft(t)
      if t.failure_class and t.state != "reused": self.failures[t.failure_class] += 1
      if (w := wall(t)) is not None: self.walls.append(w)
      self.rank()
      if e.text.startswith("config already measured"): self.notes.append(f"trial {t.number}: {e.text}")
      if not self.console.is_terminal: self.console.print(self.line(t, e.text))

  def line(self, t: Trial, text: str) -> str:
    fig = f"{t.tok_s:8.2f} tok/s" if t.tok_s is not None else f"{t.state:>14s}"
    extra = f" ({text})" if t.state == "reused" else ""
    return f"[{self.done}/{self.total}] trial {t.number:3d} {fig}  {label(t.config_json, self.base)}{extra}"

  def speedup(self, tok_s: float | None) -> str:
    return f" ({tok_s / self.baseline:.2f}x baseline)" if tok_s and self.baseline else ""

  def eta(self) -> str:
    if not self.walls: return "?"
    s = statistics.median(self.walls) * max(0, self.total - self.done)
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"

  def leader(self) -> str:
    """The leaderboard's first: `trial N: median [low, high] tok/s over n (speedup)`, its A/B confirmation where it has
    one."""
    if (r := self.best) is None: return "-"
    est = store.interval(store.Estimate(r["tok_s"], r["tok_s_low"], r["tok_s_high"], r["measurements"]))
    c = r["confirmed"]
    how = (f"{c['speedup']:.3f}x A/B-confirmed" if c and c["status"] == "ok" else
           f"{r['speedup']:.3f}x estimated" if r["speedup"] is not None else "no baseline yet")
    return f"trial {r['trial']}: {est} tok/s over {r['measurements']} ({how})"

  def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
    best = self.leader()
    yield Text.from_markup(f"[bold]{escape(self.study)}[/]  trials {self.done}/{self.total}   best {escape(best)}   "
                           f"ETA {self.eta()}")
    if self.current:
      n, lbl, phase, t0 = self.current
      elapsed = time.perf_counter() - t0
      expect = statistics.median(self.walls) if self.walls else max(elapsed * 2, 1.0)
      bar = Progress(TextColumn("  {task.description}"), BarColumn(bar_width=50), console=console,
                     auto_refresh=False)
      bar.add_task(f"{phase}  {elapsed:.0f} s", total=expect, completed=min(elapsed, expect))
      yield Text(f"trial {n}: {lbl}")
      yield bar.get_renderable()
    rows = [[str(r.number), r.state, f"{r.tok_s:.2f}{self.speedup(r.tok_s)}" if r.tok_s else "",
             f"{r.block_tok_s:.2f}" if r.block_tok_s else "", label(r.config_json, self.base)] for r in self.recent]
    t, left = table(Section("", ["#", "state", "tok/s", "block", "config"], rows, wrap=("config",),
                            drop=("block", "tok/s")), options.max_width)
    t.title, t.box, t.pad_edge = None, None, False
    yield t
    if left: yield Text(left, style="dim")
    if self.failures: yield Text("failures: " + ", ".join(f"{k} {v}" for k, v in self.failures.most_common()))
    yield from (Text(n, style="dim") for n in self.notes)
