"""The `search` command: start or join a study, confirm, replay, and review its results."""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import subprocess
import sys
from collections.abc import Callable

import optuna
from rich.console import Console
from rich.live import Live
from rich.table import Table

from db import store
from db.engine import DBError, default_url, open_db, session
from evaluator.runner import default_device
from model.gguf_file import GGUFError, GGUFFile
from model.registry import ModelNotFound, cache_dir, resolve
from model.structure import ConfigError, StructureConfig
from search.study import (
  SAMPLERS,
  BaselineFailed,
  Runner,
  Setup,
  StudyMismatch,
  check_configs,
  check_protocol,
  create,
  enqueue,
  measuring_setup,
  model_info,
  set_target,
  study_exists,
)
from space.knobs import ModelInfo, device_kind, knobs, parse_pins, sample, size, to_params

console = Console() if sys.stdout.isatty() else Console(width=200)


def cmd_space(args) -> None:
  f = GGUFFile(resolve(args.model))
  info, device = ModelInfo.from_gguf(f), args.device or "CPU"
  if args.sample:
    print(sample(info, args.seed, device).to_json())
    return
  t = Table(title=f"search space of {f.path.name} on {device_kind(device)}: {size(info, device):,} distinct configurations")
  for col in ("knob", "domain", "default", "what it changes"): t.add_column(col)
  for k in knobs(info, device): t.add_row(k.name, " | ".join(map(str, k.choices)), str(k.default), k.doc)
  console.print(t)


def _run(setup: Setup, url: str, info: ModelInfo, args) -> None:
  """Run this worker's share of the study under the live view; the leaderboard at the end."""
  from search.leaderboard import leaderboard_table
  from search.view import LiveView
  ev = setup.evaluator(args.trial_timeout)
  with session(open_db(url, create=False)) as s: finished = store.trials(s, store.get_study(s, setup.name))
  view = LiveView(console, setup.name, setup.trials, finished)
  runner = Runner(setup, url, ev, info, remeasure=getattr(args, "remeasure", False), on_event=view.handle, heartbeat=args.heartbeat)
  console.print(f"study {setup.name}: {setup.model_name} on {setup.device}, {len(finished)} trials so far, target {setup.trials}"
                f" ({setup.sampler} sampler, stages: {' then '.join(ev.stages)}; storage {url})")
  try:
    if console.is_terminal:
      with Live(view, console=console, refresh_per_second=4): runner.optimize(args.timeout)
    else: runner.optimize(args.timeout)
  except KeyboardInterrupt:
    console.print(f"stopped: the running trial is marked interrupted; `search start --study {setup.name} --storage {url}` continues")
    sys.exit(130)
  with session(open_db(url, create=False)) as s: console.print(leaderboard_table(s, store.get_study(s, setup.name)))


def _protocol(args, info: ModelInfo, device: str) -> dict:
  """The measurement settings this command line gives (None: not given)."""
  fixed = parse_pins(args.fix, info, device) if args.fix is not None else None
  return {"n": args.n, "rounds": args.rounds, "prefill": False if args.no_prefill else None, "block_layers": args.block_layers,
          "sampler": args.sampler, "seed": args.seed, "objectives": args.objectives, "fixed": fixed}


def cmd_start(args) -> None:
  devices = args.devices or [args.device or default_device()]
  if len(devices) > 1 and args.storage.startswith("sqlite"):
    raise DBError("--devices runs a worker per device: they need a server database (SQLite locks under concurrent writers); "
                  "use --storage postgresql+psycopg://...")
  if args.study is None and args.model is None: raise ConfigError("search start needs --model (a new study) or --study (one to continue)")
  path = str(resolve(args.model).resolve()) if args.model else None
  stem = args.model and (pathlib.Path(args.model).stem if args.model.endswith(".gguf") or os.sep in args.model else args.model)
  name = args.study or f"{stem}-{device_kind(devices[0])}"
  configs = [StructureConfig.load(f) for f in args.enqueue or ()]
  if study_exists(args.storage, name):
    setup, info = measuring_setup(name, args.storage, devices[0], path)
    check_protocol(setup, _protocol(args, info, setup.device))
    if args.warm_start_from: configs += warm_start(args.storage, args.warm_start_from, info, setup.device)
    check_configs(setup, info, configs)
    if args.trials is not None and args.trials != setup.trials: set_target(setup, args.storage, args.trials)
  else:
    if path is None: raise StudyMismatch(f"no study named {name!r} in {args.storage}: pass --model to create it")
    info = model_info(path)
    given = {k: v for k, v in _protocol(args, info, devices[0]).items() if v is not None}
    setup = Setup(name, path, args.model, devices[0], **given, **({"trials": args.trials} if args.trials else {}))
    if setup.objectives != "tok_s" and setup.sampler == "tpe": setup.sampler = "nsga2"
    if args.warm_start_from: configs += warm_start(args.storage, args.warm_start_from, info, setup.device)
    check_configs(setup, info, configs)
    create(setup, args.storage, info, setup.evaluator())
  enqueue(setup, args.storage, info, configs)
  workers = [_spawn_worker(setup, args, d) for d in devices[1:]]
  try: _run(setup, args.storage, info, args)
  except BaseException:
    for _, p, _ in workers: p.send_signal(signal.SIGINT)  # they stop with this one (from a terminal, Ctrl-C reaches them too)
    for _, p, _ in workers: p.wait()
    raise
  if failed := [(d, p, log) for d, p, log in workers if p.wait() != 0]:
    for d, p, log in failed: console.print(f"the worker on {d} failed (exit code {p.returncode}): see {log}")
    sys.exit(1)
  if args.confirm:
    from search.confirm import confirm
    confirm(args.storage, name, top=args.confirm, pairs=args.pairs, device=setup.device, say=console.print, model=setup.model)
    from search.leaderboard import leaderboard_table
    with session(open_db(args.storage, create=False)) as s: console.print(leaderboard_table(s, store.get_study(s, name)))


def _spawn_worker(setup: Setup, args, device: str) -> tuple[str, subprocess.Popen, pathlib.Path]:
  """`search worker` on one more device of this host, its output in a log file."""
  log = cache_dir() / "workers" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', setup.name)}-{device.replace(':', '')}.log"
  log.parent.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "search", "worker", "--study", setup.name, "--storage", args.storage, "--device", device, "--model", setup.model,
         "--trial-timeout", str(args.trial_timeout), "--heartbeat", str(args.heartbeat), *(["--timeout", str(args.timeout)] if args.timeout else [])]
  with open(log, "w") as out: p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
  console.print(f"worker on {device}: pid {p.pid}, output in {log}")
  return device, p, log


def warm_start(url: str, other: str, info: ModelInfo, device: str, top: int = 5) -> list[StructureConfig]:
  """The best configs of another study that are valid in this space (a knob this model lacks makes a config invalid here)."""
  with session(open_db(url, create=False)) as s:
    st = store.get_study(s, other)
    if st is None: raise StudyMismatch(f"no study named {other!r} to warm-start from")
    rows = store.leaderboard(s, st, limit=4 * top)
  out = []
  for r in rows:
    cfg = StructureConfig.from_json(r.config_json)
    try: to_params(cfg, info, device)
    except ConfigError as e:
      console.print(f"warm start: trial {r.number} of {other} does not apply here ({e})", style="dim")
      continue
    if cfg not in out: out.append(cfg)
  return out[:top]


def cmd_worker(args) -> None:
  if args.storage.startswith("sqlite"):
    raise DBError("several workers need a server database: SQLite locks under concurrent writers; use --storage postgresql+psycopg://...")
  setup, info = measuring_setup(args.study, args.storage, args.device, str(resolve(args.model).resolve()) if args.model else None)
  _run(setup, args.storage, info, args)


def cmd_confirm(args) -> None:
  from search.confirm import confirm
  from search.leaderboard import leaderboard_table
  confirm(args.storage, args.study, top=args.top, pairs=args.pairs, rounds=args.rounds, device=args.device, say=console.print, again=args.again,
          model=str(resolve(args.model).resolve()) if args.model else None)
  with session(open_db(args.storage, create=False)) as s: console.print(leaderboard_table(s, store.get_study(s, args.study)))


def cmd_replay(args) -> None:
  from search.replay import coverage, replay
  results = replay(args.storage, args.study, args.sampler, args.trials, args.repeats)
  measured, space = coverage(args.storage, args.study)
  t = Table(title=f"replay of {args.study} (measured {measured} of {space} configs): trials to reach 95% of its best tok/s "
                  f"({args.trials} trials, {args.repeats} repeats)")
  for col in ("sampler", "median trials", "reached in", "per repeat", "unmeasured proposals"): t.add_column(col)
  for r in results:
    hits = sum(x is not None for x in r.reached_at)
    t.add_row(r.sampler, f"{r.median_trials:g}" if r.median_trials is not None else f"> {r.trials}", f"{hits}/{len(r.reached_at)}",
              " ".join(str(x) if x is not None else "-" for x in r.reached_at), f"{100 * r.unavailable:.0f}%")
  console.print(t)


def cmd_status(args) -> None:
  from search.leaderboard import leaderboard_table, studies_table
  from search.proxy import proxy_fit
  with session(open_db(args.storage, create=False)) as s:
    if not args.study:
      console.print(studies_table(s))
      return
    st = store.get_study(s, args.study)
    if st is None: raise StudyMismatch(f"no study named {args.study!r} in {args.storage}")
    console.print(leaderboard_table(s, st, args.top))
    trials = store.trials(s, st)
    if any(t.block_tok_s for t in trials): console.print(proxy_fit(trials).summary())


def cmd_export(args) -> None:
  from search.leaderboard import export
  with session(open_db(args.storage, create=False)) as s:
    st = store.get_study(s, args.study)
    if st is None: raise StudyMismatch(f"no study named {args.study!r} in {args.storage}")
    cfg, head = export(s, st, args.unconfirmed)
  out = pathlib.Path(args.out or f"model/production/{st.model_name}.toml")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(head + cfg.to_toml())
  console.print(f"wrote {out}: " + head.splitlines()[0][2:])


def at_least(lo: float, kind: type = int) -> Callable[[str], float]:
  """An argparse type: a number of `kind` no smaller than lo (checked when the command line is read, before anything runs)."""
  def parse(text: str) -> float:
    try: v = kind(text)
    except ValueError: raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not v >= lo: raise argparse.ArgumentTypeError(f"{text} is below {lo:g}")
    return v
  return parse


def positive(text: str) -> float:
  v = at_least(0, float)(text)
  if v == 0: raise argparse.ArgumentTypeError("0 is not a positive number of seconds")
  return v


def device_list(text: str) -> list[str]:
  devices = [d.strip() for d in text.split(",") if d.strip()]
  if len(set(devices)) != len(devices) or not devices: raise argparse.ArgumentTypeError(f"{text!r}: name each device once, comma-separated")
  return devices


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="search", description="structural optimization search for tinygrad MLA/MoE inference")
  sub = p.add_subparsers(dest="cmd", required=True)
  store_arg = argparse.ArgumentParser(add_help=False)
  store_arg.add_argument("--storage", default=default_url(), help="database URL (default: sqlite file structsearch.db here; "
                                                                  "postgresql+psycopg://... for several workers)")
  run_arg = argparse.ArgumentParser(add_help=False)
  run_arg.add_argument("--timeout", type=positive, help="stop starting trials after this many seconds")
  run_arg.add_argument("--trial-timeout", type=positive, default=900, help="wall-clock limit of one trial process (s)")
  run_arg.add_argument("--heartbeat", type=positive, default=10, help="seconds between worker heartbeats; a worker silent for 6 is dead")

  s = sub.add_parser("space", help="print the search space of a model (or a random valid config with --sample)")
  s.add_argument("--model", required=True, help="a model name or a .gguf path")
  s.add_argument("--device", help="device kind whose knobs to list (default CPU)")
  s.add_argument("--sample", action="store_true", help="print one random valid StructureConfig as JSON")
  s.add_argument("--seed", type=int, default=0)
  s.set_defaults(fn=cmd_space)

  st = sub.add_parser("start", parents=[store_arg, run_arg], help="create a study and run it, or continue one (--study NAME alone)")
  st.add_argument("--model", help="a model name or a .gguf path (to create a study; a study continued knows its own)")
  st.add_argument("--study", help="study name (default: <model>-<device kind>)")
  where = st.add_mutually_exclusive_group()
  where.add_argument("--device", help="tinygrad device (default: tinygrad's default)")
  where.add_argument("--devices", type=device_list, help="several devices of this host (CUDA:0,CUDA:1): one worker process each (PostgreSQL)")
  st.add_argument("--trials", type=at_least(1), help="the study's target number of finished trials (default 200; may change later)")
  # the measurement protocol: fixed when the study is created (defaults in search.study.Setup); a later run may only repeat it
  st.add_argument("--sampler", choices=SAMPLERS, help="default tpe (nsga2 with two objectives)")
  st.add_argument("--objectives", choices=["tok_s", "tok_s,peak_memory"], help="default tok_s")
  st.add_argument("--seed", type=int)
  st.add_argument("-n", type=at_least(2), help="tokens per measured round (default 32)")
  st.add_argument("--rounds", type=at_least(1), help="measured rounds per trial (default 3)")
  st.add_argument("--block-layers", type=at_least(1), help="blocks of the ladder's stage-1 proxy (default: the leading dense blocks + 2)")
  st.add_argument("--no-prefill", action="store_true", default=None,
                  help="feed the prompt through decode steps: no prefill graph to build per trial")
  st.add_argument("--fix", action="append", metavar="KNOB=VALUE", help="pin a knob for the whole study (e.g. beam=0); repeatable")
  st.add_argument("--enqueue", action="append", help="a config file (.json/.toml) to measure first; repeatable")
  st.add_argument("--warm-start-from", help="enqueue the best configs of another study that apply to this model")
  st.add_argument("--remeasure", action="store_true", help="measure a config again even when this study has measured it")
  st.add_argument("--confirm", type=at_least(0), default=3, help="A/B-confirm the top K configs at the end (0: skip)")
  st.add_argument("--pairs", type=at_least(1), default=3, help="A/B pairs per confirmed config")
  st.set_defaults(fn=cmd_start)

  w = sub.add_parser("worker", parents=[store_arg, run_arg], help="join an existing study (PostgreSQL storage)")
  w.add_argument("--study", required=True)
  w.add_argument("--device", help="tinygrad device (default: the study's)")
  w.add_argument("--model", help="where the study's model file is on this host (default: the study's path; checked by SHA-256)")
  w.set_defaults(fn=cmd_worker)

  c = sub.add_parser("confirm", parents=[store_arg], help="A/B-confirm a study's top configs against the baseline")
  c.add_argument("--study", required=True)
  c.add_argument("--top", type=at_least(1), default=3)
  c.add_argument("--pairs", type=at_least(1), default=3)
  c.add_argument("--rounds", type=at_least(1), default=5)
  c.add_argument("--device")
  c.add_argument("--model", help="where the study's model file is on this host (default: the study's path; checked by SHA-256)")
  c.add_argument("--again", action="store_true", help="re-measure configs confirmed before")
  c.set_defaults(fn=cmd_confirm)

  r = sub.add_parser("replay", parents=[store_arg], help="re-run a study's search offline against its measurements, per sampler")
  r.add_argument("--study", required=True)
  r.add_argument("--sampler", action="append", choices=SAMPLERS, help="repeatable (default: tpe and random)")
  r.add_argument("--trials", type=at_least(1), default=30)
  r.add_argument("--repeats", type=at_least(1), default=10)
  r.set_defaults(fn=cmd_replay)

  for name, hlp in (("status", "a study's leaderboard (or all studies)"), ("list", "the studies in a storage")):
    x = sub.add_parser(name, parents=[store_arg], help=hlp)
    x.add_argument("--study", help=None if name == "status" else argparse.SUPPRESS)
    x.add_argument("--top", type=at_least(1), default=15, help=None if name == "status" else argparse.SUPPRESS)
    x.set_defaults(fn=cmd_status)

  e = sub.add_parser("export", parents=[store_arg], help="write a study's confirmed winner as a production config (TOML)")
  e.add_argument("--study", required=True)
  e.add_argument("--out", help="default: model/production/<model>.toml")
  e.add_argument("--unconfirmed", action="store_true", help="export the best measured config when none is confirmed")
  e.set_defaults(fn=cmd_export)

  args = p.parse_args(argv)
  if getattr(args, "sampler", None) is None and args.cmd == "replay": args.sampler = ["tpe", "random"]
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  try: args.fn(args)
  except BaselineFailed as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(1)
  except (GGUFError, ModelNotFound, ConfigError, DBError, StudyMismatch, ValueError, RuntimeError) as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(2)
