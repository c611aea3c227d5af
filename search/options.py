"""The options several `search` subcommands share, and the checks of their values: made when the command line is read,
before anything runs (a bad value is one line and exit code 2)."""
from __future__ import annotations

import argparse
import math
import os
import pathlib

from db.engine import default_url
from evaluator.cli import at_least
from evaluator.devices import check_device
from search.formats import FORMATS


def add_storage(p: argparse.ArgumentParser) -> None:
  p.add_argument("--storage", default=default_url(), help="database URL (default: sqlite file structsearch.db here; "
                 "postgresql+psycopg://... for several workers)")


def add_format(p: argparse.ArgumentParser) -> None:
  p.add_argument("--format", choices=FORMATS, default="table",
                 help="table (default), json (described in docs/json.md), csv, markdown")


def add_running(p: argparse.ArgumentParser) -> None:
  """The options of a command that runs a worker (`start`, `worker`)."""
  p.add_argument("--timeout", type=positive, metavar="SECONDS",
                 help="stop starting trials after this many seconds (default: no limit)")
  p.add_argument("--trial-timeout", type=positive, default=900, metavar="SECONDS",
                 help="wall-clock limit of one trial process, in seconds (default 900)")
  p.add_argument("--heartbeat", type=positive, default=10, metavar="SECONDS",
                 help="seconds between a worker's heartbeats (default 10); a worker silent for 6 heartbeats is dead")
  p.add_argument("--artifacts", help="directory of the trials' dashboard artifacts (default: beside a SQLite database)")


def positive(text: str) -> float:
  v = at_least(0, float)(text)
  if v == 0 or not math.isfinite(v): raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
  return v


def between(lo: int, hi: int):
  """An argparse type: an integer from lo to hi."""
  def parse(text: str) -> int:
    if (v := at_least(lo)(text)) > hi: raise argparse.ArgumentTypeError(f"{text} is above {hi}")
    return v
  return parse


def port_number(text: str) -> int:
  v = at_least(0)(text)
  if v > 65535: raise argparse.ArgumentTypeError(f"{v} is not a port number (0 to 65535)")
  return v


def device_name(text: str) -> str:
  try: return check_device(text)
  except ValueError as e: raise argparse.ArgumentTypeError(str(e)) from None


def device_list(text: str) -> list[str]:
  devices = [device_name(d.strip()) for d in text.split(",") if d.strip()]
  if len(set(devices)) != len(devices) or not devices:
    raise argparse.ArgumentTypeError(f"{text!r}: name each device once, comma-separated")
  return devices


def out_dir(text: str) -> pathlib.Path:
  """A directory to write into (nothing is made here): an existing one that can be written, or a new one under a
  directory that can be."""
  p = pathlib.Path(text).expanduser()
  if p.exists() and not p.is_dir(): raise argparse.ArgumentTypeError(f"{text} is a file, not a directory")
  parent = next(a for a in (p.absolute(), *p.absolute().parents) if a.exists())
  if not parent.is_dir(): raise argparse.ArgumentTypeError(f"{parent} is a file, not a directory")
  if not os.access(parent, os.W_OK | os.X_OK): raise argparse.ArgumentTypeError(f"{parent} cannot be written")
  return p
