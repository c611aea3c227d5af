"""One view, four formats: a rich table for people, JSON for scripts (the view's own document), CSV and Markdown. A view
is a list of sections (a table or a code block) and its JSON document; notes are sentences said after the tables."""
from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

FORMATS = ("table", "json", "csv", "markdown")
WRAP_MIN = 24  # a wrapping column of the rich table is at least this wide (or its longest word); longer words fold


class Out(Console):
  """rich's console, but a reader that stops early (`| head`) ends the command quietly with exit code 0 (search.cli
  main), not 1."""

  def on_broken_pipe(self) -> None:
    self.quiet = True
    raise BrokenPipeError


# piped: COLUMNS, else 200
console = Out(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 200)
errors = Console(stderr=True)


def num(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
  """A figure as a table shows it; "" for none."""
  return "" if v is None else f"{v:{spec}}{suffix}"


@dataclass
class Section:
  title: str
  columns: list[str] = field(default_factory=list)
  rows: list[list[Any]] = field(default_factory=list)  # display values
  code: str | None = None  # a code block instead of a table (e.g. a git diff)
  lang: str = "diff"
  records: list[dict[str, Any]] | None = None  # CSV rows with machine values (default: the display rows)
  wrap: tuple[str, ...] = ()  # columns that may wrap in the rich table
  drop: tuple[str, ...] = ()  # columns the rich table may leave out where the console is too narrow, the first first


def _cell(v: Any) -> str: return "" if v is None else str(v)


def _need(sec: Section, i: int) -> int:
  """Column i's least width with its padding and border: its longest line, or a wrapping column's longest word (folded
  past WRAP_MIN)."""
  cells = [sec.columns[i], *(_cell(r[i]) for r in sec.rows)]
  if sec.columns[i] in sec.wrap:
    return 3 + min(WRAP_MIN, max((cell_len(w) for c in cells for w in c.split()), default=0))
  return 3 + max((cell_len(line) for c in cells for line in c.splitlines()), default=0)


def fitting(sec: Section, width: int) -> list[int]:
  """The indices of the columns the rich table shows at this console width: all of them where every value fits whole (a
  wrapping column at its longest word, folded past WRAP_MIN), else without the `drop` columns, in their order, until it
  does; where that is not enough, without more whole columns from the right (the first kept)."""
  cols = list(range(len(sec.columns)))
  gone = iter([*(sec.columns.index(c) for c in sec.drop if c in sec.columns), *range(len(sec.columns) - 1, 0, -1)])
  while 1 + sum(_need(sec, i) for i in cols) > width and (c := next(gone, None)) is not None:
    if c in cols: cols.remove(c)
  return cols


def _wrap_widths(sec: Section, cols: list[int], width: int) -> dict[int, int]:
  """The widths of the wrapping columns among cols (every column, where even the fitting ones are too wide): their
  whole lines (at most 90) where the table fits so, else the widest level that fits, none below its least width. Rich
  then never narrows a column that may not wrap, which would cut its values."""
  wrap, fold = [i for i in cols if sec.columns[i] in sec.wrap], 1 + sum(_need(sec, i) for i in cols) > width
  if fold: wrap = cols  # nothing fits whole: every column folds
  room = width - 1 - sum(_need(sec, i) for i in cols if i not in wrap) - 3 * len(wrap)
  full = {i: min(90, max(cell_len(line) for c in [sec.columns[i], *(_cell(r[i]) for r in sec.rows)]
                         for line in c.splitlines() or [""])) for i in wrap}
  least = {i: 1 if fold else min(full[i], max(1, _need(sec, i) - 3)) for i in wrap}
  fit = lambda level: {i: max(least[i], min(full[i], level)) for i in wrap}
  level = max(full.values(), default=0)
  while level > 1 and sum(fit(level).values()) > room: level -= 1
  return fit(level)


def table(sec: Section, width: int) -> tuple[Table, str | None]:
  """The section as a rich table that fits `width` with every value whole (fitting, _wrap_widths), and the line that
  names the columns it leaves out (None where it shows them all)."""
  # at least as wide as its title, which rich would otherwise wrap to a narrow table's width
  t = Table(title=sec.title, min_width=min(len(sec.title) + 4, width))
  cols = fitting(sec, width)
  widths = _wrap_widths(sec, cols, width)
  for i in cols:
    t.add_column(sec.columns[i], overflow="fold", no_wrap=i not in widths, max_width=widths.get(i))
  for r in sec.rows: t.add_row(*(_cell(r[i]) for i in cols))
  left = [c for i, c in enumerate(sec.columns) if i not in cols]
  return t, (f"left out at {width} columns: {', '.join(left)} (a wider terminal, COLUMNS=N or --format csv shows them)"
             if left else None)


def markdown(sections: list[Section], notes: list[str] = (), level: int = 3) -> str:
  out = []
  for sec in sections:
    out.append(f"{'#' * level} {sec.title}\n")
    if sec.code is not None: out.append(f"```{sec.lang}\n{sec.code.rstrip()}\n```\n")
    elif sec.rows:
      esc = lambda v: _cell(v).replace("|", "\\|").replace("\n", " ")
      out += ["| " + " | ".join(map(esc, sec.columns)) + " |", "|" + "---|" * len(sec.columns)]
      out += ["| " + " | ".join(map(esc, r)) + " |" for r in sec.rows] + [""]
  return "\n".join(out + [f"{n}\n" for n in notes]).rstrip()


def emit(fmt: str, sections: list[Section], data: Any, console: Console, notes: list[str] = ()) -> None:
  """Print the view in fmt: JSON is `data` alone; CSV is the sections' rows (a multi-section view's rows start with
  their section's title); table and Markdown add the notes."""
  if fmt == "json": print(json.dumps(data, indent=1, default=str))
  elif fmt == "csv":
    w = csv.writer(sys.stdout, lineterminator="\n")
    if len(sections) == 1 and sections[0].records is not None:
      cols = list(sections[0].records[0]) if sections[0].records else sections[0].columns
      w.writerow(cols)
      w.writerows([_cell(r.get(c)) for c in cols] for r in sections[0].records)
    elif len(sections) == 1:
      w.writerow(sections[0].columns)
      w.writerows([_cell(v) for v in r] for r in sections[0].rows)
    else:
      w.writerow(["section", "name", "value"])
      for sec in sections:
        if sec.code is not None: w.writerow([sec.title, "text", sec.code])
        w.writerows([sec.title, *map(_cell, r)] for r in sec.rows)
  elif fmt == "markdown": print(markdown(sections, notes))
  elif fmt == "table":
    for sec in sections:
      if sec.code is not None:
        console.print(f"[bold]{sec.title}[/]")
        console.print(Syntax(sec.code, sec.lang, word_wrap=True) if sec.code else "(empty)")
        continue
      t, left = table(sec, console.width)
      console.print(t)
      if left: console.print(left)
    for n in notes: console.print(n)
  else: raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
