"""One view, four formats: a rich table for people, JSON for scripts (the view's own document), CSV and Markdown. A view is a
list of sections (a table or a code block) and its JSON document; notes are sentences said after the tables."""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

FORMATS = ("table", "json", "csv", "markdown")


@dataclass
class Section:
  title: str
  columns: list[str] = field(default_factory=list)
  rows: list[list[Any]] = field(default_factory=list)  # display values
  code: str | None = None  # a code block instead of a table (e.g. a git diff)
  lang: str = "diff"
  records: list[dict[str, Any]] | None = None  # CSV rows with machine values (default: the display rows)
  wrap: tuple[str, ...] = ()  # columns that may fold in the rich table


def _cell(v: Any) -> str: return "" if v is None else str(v)


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
  """Print the view in fmt: JSON is `data` alone; CSV is the sections' rows (a multi-section view's rows start with their
  section's title); table and Markdown add the notes."""
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
      t = Table(title=sec.title)
      for c in sec.columns: t.add_column(c, overflow="fold", no_wrap=c not in sec.wrap, max_width=90 if c in sec.wrap else None)
      for r in sec.rows: t.add_row(*map(_cell, r))
      console.print(t)
    for n in notes: console.print(n)
  else: raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
