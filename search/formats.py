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


def fitting(sec: Section, width: int) -> list[int]:
  """The indices of the columns the rich table shows at this console width: all of them where every value fits whole (a
  wrapping column at its longest word, folded past WRAP_MIN), else without the `drop` columns, in their order, until it
  does."""
  def need(i: int) -> int:  # the column's width with its padding and border
    cells = [sec.columns[i], *(_cell(r[i]) for r in sec.rows)]
    if sec.columns[i] in sec.wrap:
      return 3 + min(WRAP_MIN, max((cell_len(w) for c in cells for w in c.split()), default=0))
    return 3 + max((cell_len(line) for c in cells for line in c.splitlines()), default=0)
  cols, gone = list(range(len(sec.columns))), iter(sec.drop)
  while 1 + sum(map(need, cols)) > width and (c := next(gone, None)) is not None:
    if c in sec.columns: cols.remove(sec.columns.index(c))
  return cols


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
      # at least as wide as its title, which rich would otherwise wrap to a narrow table's width
      t = Table(title=sec.title, min_width=min(len(sec.title) + 4, console.width))
      cols = fitting(sec, console.width)
      for c in (sec.columns[i] for i in cols):
        t.add_column(c, overflow="fold", no_wrap=c not in sec.wrap, max_width=90 if c in sec.wrap else None)
      for r in sec.rows: t.add_row(*(_cell(r[i]) for i in cols))
      console.print(t)
      if left := [c for i, c in enumerate(sec.columns) if i not in cols]:
        console.print(f"left out at {console.width} columns: {', '.join(left)} (a wider terminal, COLUMNS=N or "
                      "--format csv shows them)")
    for n in notes: console.print(n)
  else: raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
