"""The `search` command: start or join a study, confirm, replay, and review its results. Each subcommand's options and
what it runs live beside its code (the module's `add_arguments` and `run`); this assembles them, and imports only the
module of the subcommand named."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

# name, help, the module with its add_arguments(parser) and run(args)
COMMANDS = (
  ("space", "print the search space of a model (or a random valid config with --sample)", "search.space_view"),
  ("start", "create a study and run it, or continue one (--study NAME alone)", "search.start"),
  ("worker", "join an existing study (PostgreSQL storage)", "search.join"),
  ("confirm", "A/B-confirm a study's top configs against the baseline", "search.confirm"),
  ("replay", "re-run a study's search offline against its measurements, per sampler", "search.replay"),
  ("status", "the studies in a storage (with --study: its leaderboard)", "search.status"),
  ("list", "the studies in a storage", "search.status"),
  ("leaderboard", "a study's configs ranked (confirmed speedup, else estimated)", "search.leaderboard"),
  ("best", "the one config a study would ship (the leaderboard's first), for scripts", "search.best"),
  ("show", "everything about one trial", "search.show"),
  ("profile", "a trial's per-kernel profile by stage and layer (made and stored where it has none)", "search.profile"),
  ("compare", "two trials side by side, knob by knob, metric by metric and kernel by kernel", "search.compare"),
  ("cost", "what a study's trials cost, phase by phase, and the wall time of N trials", "search.cost"),
  ("exports", "what `search export` put in production: each file, from which study and trial, since when, and whether "
              "it holds it still", "search.exports"),
  ("dashboard", "serve optuna-dashboard on the storage (with the trials' artifacts)", "search.dashboard"),
  ("report", "a study's report: Markdown and HTML with PNG plots, in one directory", "search.report"),
  ("export", "write a study's config to the model's production config (TOML)", "search.export"),
  ("rename", "rename a study in place, in Optuna's ledger and ours", "search.rename"),
  ("delete", "remove a study from its storage: Optuna's trials, ours and its dashboard artifacts", "search.delete"),
)


def version() -> str:
  """This package's version, as installed."""
  try: return importlib.metadata.version("structsearch")
  except importlib.metadata.PackageNotFoundError: return "(not installed)"


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
  """The command line of `search`: every subcommand, with the options of the one argv names (of all of them without
  argv)."""
  p = argparse.ArgumentParser(prog="search",
                              description="structural optimization search for tinygrad MLA/MoE inference")
  p.add_argument("--version", action="version", version=f"structsearch {version()}")
  sub = p.add_subparsers(dest="cmd", required=True)
  # the top level's options take no value: the first other word names the subcommand
  named = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
  for name, hlp, module in COMMANDS:
    s = sub.add_parser(name, help=hlp)
    if argv is None or name == named:
      m = importlib.import_module(module)
      m.add_arguments(s)
      s.set_defaults(run=m.run)
  return p


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = parser(argv).parse_args(argv)
  try: args.run(args)
  # bad input, a model file or a storage that cannot be used: one line, exit code 2 (ConfigError, GGUFError,
  # ModelNotFound and StudyMismatch are ValueErrors, DBError a RuntimeError; a failed baseline exits with 1: join.work)
  except (ValueError, RuntimeError) as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(2)
  # the reader (`| head`) stopped reading, as it may: no traceback, none when Python flushes stdout at exit
  except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)
