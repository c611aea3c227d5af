"""`search worker`: one more worker joins a study (PostgreSQL storage: from another device or host); and the run of a
worker that `search start` shares: its trials under the live view, the dashboard's files uploaded, the leaderboard at
the end."""
from __future__ import annotations

import argparse
import shlex
import sys

from rich.live import Live

from db import store
from db.engine import DBError, failure, hide_password, open_db, session
from model.registry import resolve
from search import leaderboard
from search.dashboard import Uploader, artifact_dir, artifact_store
from search.formats import console
from search.options import add_running, add_storage, device_name
from search.study import Setup, measuring_setup, stored_baseline
from search.view import LiveView
from search.worker import BaselineFailed, Runner
from space.knobs import ModelInfo


def work(setup: Setup, url: str, info: ModelInfo, args: argparse.Namespace) -> None:
  """Run this worker's share of the study under the live view; the leaderboard at the end. A failed baseline stops the
  study with exit code 1, Ctrl-C this worker with 130."""
  ev = setup.evaluator(args.trial_timeout)
  with session(open_db(url, create=False)) as s: finished = store.trials(s, store.get_study(s, setup.name))
  view = LiveView(console, setup.name, setup.trials, finished, stored_baseline(url, setup, info), url)
  uploader = Uploader(url, setup.name, artifact_store(url, args.artifacts))
  runner = Runner(setup, url, ev, info, remeasure=getattr(args, "remeasure", False), listeners=[view.handle, uploader],
                  heartbeat=args.heartbeat)
  console.print(f"study {setup.name}: {setup.model_name} on {setup.device}, {len(finished)} trials so far, target "
                f"{setup.trials} ({setup.sampler} sampler, stages: {' then '.join(ev.stages)}; storage "
                f"{hide_password(url)}; artifacts {artifact_dir(url, args.artifacts)})")
  try:
    if console.is_terminal:
      with Live(view, console=console, refresh_per_second=4): runner.optimize(args.timeout)
    else: runner.optimize(args.timeout)
  except BaselineFailed as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(1)
  except KeyboardInterrupt:
    console.print(f"stopped: the running trial is marked interrupted; `search start --study {shlex.quote(setup.name)} "
                  f"--storage {shlex.quote(hide_password(url))}` continues")
    sys.exit(130)
  except Exception as e:
    if (line := failure(e, url)) is None: raise
    # Optuna's trial and ours stay running alike: the next run fails both once its heartbeat is stale, and measures the
    # config again
    print(f"search: error: {line}; the trials measured so far are stored", file=sys.stderr)
    sys.exit(1)
  uploader.refresh()  # other workers' measurements since each trial ended changed their figures too
  leaderboard.show(url, setup.name, top=15)


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_running(p)
  p.add_argument("--study", required=True, help="the study to join")
  p.add_argument("--device", type=device_name, help="tinygrad device (default: the study's)")
  p.add_argument("--model",
                 help="where the study's model file is on this host (default: the study's path; checked by SHA-256)")


def run(args: argparse.Namespace) -> None:
  if args.storage.startswith("sqlite"):
    raise DBError("several workers need a server database: SQLite locks under concurrent writers; use --storage "
                  "postgresql+psycopg://...")
  model = str(resolve(args.model).resolve()) if args.model else None
  setup, info = measuring_setup(args.study, args.storage, args.device, model)
  work(setup, args.storage, info, args)
