"""The `search` command: start or join a study, confirm, replay, and review its results."""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import re
import signal
import subprocess
import sys

import optuna
from rich.console import Console
from rich.live import Live
from rich.table import Table

from db import store
from db.engine import DBError, default_url, hide_password, open_db, session
from db.models import TRIAL_STATES
from evaluator.cli import at_least
from evaluator.devices import check_device
from evaluator.runner import default_device
from model.backends.catalog import FAMILIES
from model.gguf_file import GGUFError, GGUFFile
from model.registry import ModelNotFound, cache_dir, resolve
from model.structure import ConfigError, StructureConfig
from search.formats import FORMATS, emit
from search.leaderboard import MIN_PAIRS, SCHEMA
from search.study import (
  SAMPLERS,
  Setup,
  StudyMismatch,
  check_configs,
  check_protocol,
  create,
  enqueue,
  exact_pins,
  measuring_setup,
  model_info,
  set_target,
  stored_baseline,
  study_exists,
)
from search.worker import BaselineFailed, Runner
from space.knobs import ModelInfo, device_kind, knobs, parse_pins, sample, size, to_params


class Out(Console):
  """rich's console, but a reader that stops early (`| head`) ends the command quietly with exit code 0 (main), not
  1."""

  def on_broken_pipe(self) -> None:
    self.quiet = True
    raise BrokenPipeError


# piped: COLUMNS, else 200
console = Out(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 200)
errors = Console(stderr=True)


def cmd_space(args) -> None:
  f = GGUFFile(resolve(args.model))
  info, device, family = ModelInfo.from_gguf(f), args.device or "CPU", args.family or "all"
  if args.sample:
    print(sample(info, args.seed, device, family).to_json())
    return
  backends = "" if family == "all" else f" ({family} backends)"
  t = Table(title=f"search space of {f.path.name} on {device_kind(device)}{backends}: "
            f"{size(info, device, family=family):,} distinct configurations")
  for col in ("knob", "domain", "default", "what it changes"): t.add_column(col)
  for k in knobs(info, device, family): t.add_row(k.name, " | ".join(map(str, k.choices)), str(k.default), k.doc)
  console.print(t)


def _run(setup: Setup, url: str, info: ModelInfo, args) -> None:
  """Run this worker's share of the study under the live view; the leaderboard at the end."""
  from search.dashboard import Uploader, artifact_dir, artifact_store
  from search.view import LiveView
  ev = setup.evaluator(args.trial_timeout)
  with session(open_db(url, create=False)) as s: finished = store.trials(s, store.get_study(s, setup.name))
  view = LiveView(console, setup.name, setup.trials, finished, stored_baseline(url, setup, info), url)
  uploader = Uploader(url, setup.name, artifact_store(url, args.artifacts))
  listeners = [view.handle, uploader]
  runner = Runner(setup, url, ev, info, remeasure=getattr(args, "remeasure", False), listeners=listeners,
                  heartbeat=args.heartbeat)
  console.print(f"study {setup.name}: {setup.model_name} on {setup.device}, {len(finished)} trials so far, target "
                f"{setup.trials} ({setup.sampler} sampler, stages: {' then '.join(ev.stages)}; storage "
                f"{hide_password(url)}; artifacts {artifact_dir(url, args.artifacts)})")
  try:
    if console.is_terminal:
      with Live(view, console=console, refresh_per_second=4): runner.optimize(args.timeout)
    else: runner.optimize(args.timeout)
  except KeyboardInterrupt:
    console.print(f"stopped: the running trial is marked interrupted; `search start --study {setup.name} --storage "
                  f"{hide_password(url)}` continues")
    sys.exit(130)
  uploader.refresh()  # other workers' measurements since each trial ended changed their figures too
  show_leaderboard(url, setup.name, top=15)


def _protocol(args, info: ModelInfo, device: str, family: str) -> dict:
  """The measurement settings this command line gives (None: not given); pins are read in the space of `family`, with
  --exact's (exact_pins) among those --fix gives (a study created with --exact stores them: cmd_start)."""
  fixed = parse_pins(args.fix, info, device, family) if args.fix is not None else None
  if args.exact and fixed is not None:
    pins = exact_pins(info, device, family)
    if clash := {k: v for k, v in fixed.items() if k in pins and v != pins[k]}:
      want, given = (", ".join(f"{k}={d[k]}" for k in clash) for d in (pins, clash))
      raise ConfigError(f"--exact holds the study to exact configs: it pins {want}, not {given}")
    fixed |= pins
  return {"n": args.n, "rounds": args.rounds, "prefill": False if args.no_prefill
          else None, "block_layers": args.block_layers, "sampler": args.sampler, "seed": args.seed,
          "objectives": args.objectives, "fixed": fixed, "beam_budget": args.beam_budget, "family": args.family,
          "exact": True if args.exact else None}


def cmd_start(args) -> None:
  devices = args.devices or [args.device or default_device()]
  if len(devices) > 1 and args.storage.startswith("sqlite"):
    raise DBError("--devices runs a worker per device: they need a server database (SQLite locks under concurrent "
                  "writers); use --storage postgresql+psycopg://...")
  if args.study is None and args.model is None:
    raise ConfigError("search start needs --model (a new study) or --study (one to continue)")
  path = str(resolve(args.model).resolve()) if args.model else None
  stem = args.model and (pathlib.Path(args.model).stem if args.model.endswith(".gguf") or os.sep in args.model
                         else args.model)
  name = args.study or f"{stem}-{device_kind(devices[0])}"
  given = [StructureConfig.load(f) for f in args.enqueue or ()]
  setup = None
  if not study_exists(args.storage, name):
    if path is None:
      raise StudyMismatch(f"no study named {name!r} in {hide_password(args.storage)}: pass --model to create it")
    info = model_info(path)
    protocol = {k: v for k, v in _protocol(args, info, devices[0], args.family or "all").items() if v is not None}
    setup = Setup(name, path, args.model, devices[0], **protocol, **({"trials": args.trials} if args.trials else {}))
    if setup.exact: setup.fixed = exact_pins(info, devices[0], setup.family) | setup.fixed
    if setup.objectives != "tok_s" and args.sampler in (None, "tpe"): setup.sampler = "nsga2"
    configs = given + (warm_start(args.storage, args.warm_start_from, info, setup) if args.warm_start_from else [])
    check_configs(setup, info, configs)
    # another `search start` created it at the same moment: join it
    if not create(setup, args.storage, info, setup.evaluator()): setup = None
  if setup is None:
    setup, info = measuring_setup(name, args.storage, devices[0], path)
    check_protocol(setup, _protocol(args, info, setup.device, args.family or setup.family))
    configs = given + (warm_start(args.storage, args.warm_start_from, info, setup) if args.warm_start_from else [])
    check_configs(setup, info, configs)
    if args.trials is not None and args.trials != setup.trials: set_target(setup, args.storage, args.trials)
  enqueue(setup, args.storage, info, configs)
  workers = [_spawn_worker(setup, args, d) for d in devices[1:]]
  try: _run(setup, args.storage, info, args)
  except BaseException:
    # they stop with this one (from a terminal, Ctrl-C reaches them too)
    for _, p, _ in workers: p.send_signal(signal.SIGINT)
    for _, p, _ in workers: p.wait()
    raise
  if failed := [(d, p, log) for d, p, log in workers if p.wait() != 0]:
    for d, p, log in failed: console.print(f"the worker on {d} failed (exit code {p.returncode}): see {log}")
    sys.exit(1)
  if args.confirm:
    from search.confirm import confirm
    confirm(args.storage, name, top=args.confirm, pairs=args.pairs, device=setup.device, say=console.print,
            model=setup.model)
    _refresh(args.storage, name, args.artifacts)
    show_leaderboard(args.storage, name, top=15)
  where = "" if args.storage == default_url() else f" --storage {hide_password(args.storage)}"
  console.print(f"review: `search leaderboard --study {name}{where}`; `search report --study {name}{where} --out "
                f"report-{name}` (Markdown, HTML, plots); `search dashboard --study {name}{where}` (web dashboard on "
                "127.0.0.1:8080)")


def _spawn_worker(setup: Setup, args, device: str) -> tuple[str, subprocess.Popen, pathlib.Path]:
  """`search worker` on one more device of this host, its output in a log file."""
  log = cache_dir() / "workers" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', setup.name)}-{device.replace(':', '')}.log"
  log.parent.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "search", "worker", "--study", setup.name, "--storage", args.storage, "--device", device,
         "--model", setup.model, "--trial-timeout", str(args.trial_timeout), "--heartbeat", str(args.heartbeat),
         *(["--timeout", str(args.timeout)] if args.timeout else [])]
  with open(log, "w") as out: p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
  console.print(f"worker on {device}: pid {p.pid}, output in {log}")
  return device, p, log


def warm_start(url: str, other: str, info: ModelInfo, setup: Setup, top: int = 5) -> list[StructureConfig]:
  """The best configs of another study that are valid in this space (a knob this model lacks makes a config invalid
  here)."""
  with session(open_db(url, create=False)) as s:
    st = store.get_study(s, other)
    if st is None: raise StudyMismatch(f"no study named {other!r} to warm-start from")
    rows = store.leaderboard(s, st, limit=4 * top)
  out = []
  for r in rows:
    cfg = StructureConfig.from_json(r.config_json)
    try: to_params(cfg, info, setup.device, setup.family)
    except ConfigError as e:
      console.print(f"warm start: trial {r.number} of {other} does not apply here ({e})", style="dim")
      continue
    if cfg not in out: out.append(cfg)
  return out[:top]


def cmd_worker(args) -> None:
  if args.storage.startswith("sqlite"):
    raise DBError("several workers need a server database: SQLite locks under concurrent writers; use --storage "
                  "postgresql+psycopg://...")
  setup, info = measuring_setup(args.study, args.storage, args.device, str(resolve(args.model).resolve()) if args.model
                                else None)
  _run(setup, args.storage, info, args)


def cmd_confirm(args) -> None:
  from search.confirm import confirm
  say = console.print if args.format == "table" else errors.print  # the progress; stdout keeps the document alone
  confirm(args.storage, args.study, top=args.top, pairs=args.pairs, rounds=args.rounds, device=args.device, say=say,
          again=args.again, model=str(resolve(args.model).resolve()) if args.model else None)
  _refresh(args.storage, args.study, args.artifacts)
  show_leaderboard(args.storage, args.study, args.format, top=15)


def _refresh(url: str, name: str, artifacts: str | None) -> None:
  """The dashboard's files of the study's trials, rewritten with their figures after a confirmation."""
  from search.dashboard import Uploader, artifact_store
  Uploader(url, name, artifact_store(url, artifacts)).refresh()


def cmd_replay(args) -> None:
  from search.replay import coverage, replay
  results = replay(args.storage, args.study, args.sampler, args.trials, args.repeats)
  measured, space = coverage(args.storage, args.study)
  t = Table(title=f"replay of {args.study} (measured {measured} of {space} configs): trials to reach 95% of its best "
            "tok/s "
                  f"({args.trials} trials, {args.repeats} repeats)")
  for col in ("sampler", "median trials", "reached in", "per repeat", "unmeasured proposals"): t.add_column(col)
  for r in results:
    hits = sum(x is not None for x in r.reached_at)
    t.add_row(r.sampler, f"{r.median_trials:g}" if r.median_trials is not None
              else f"> {r.trials}", f"{hits}/{len(r.reached_at)}",
              " ".join(str(x) if x is not None else "-" for x in r.reached_at), f"{100 * r.unavailable:.0f}%")
  console.print(t)


def _study(s, url: str, name: str):
  if (st := store.get_study(s, name)) is None: raise StudyMismatch(f"no study named {name!r} in {hide_password(url)}")
  return st


def show_leaderboard(url: str, name: str, fmt: str = "table", top: int | None = None, states: tuple[str, ...] = ("ok",),
                     where: dict[str, str] | None = None) -> None:
  from search.leaderboard import leaderboard, leaderboard_view
  with session(open_db(url, create=False)) as s:
    st = _study(s, url, name)
    _check_where(store.trials(s, st), where or {})
    doc = leaderboard(s, st, states, where, top)
  secs, notes = leaderboard_view(doc)
  emit(fmt, secs, doc, console, notes)


def _check_where(trials: list, where: dict[str, str]) -> None:
  """Each --where value must be one that some trial of the study has (ValueError naming those it has): a typo would list
  nothing."""
  from search.leaderboard import flat
  values = [flat(StructureConfig.from_json(t.config_json)) for t in trials]
  for k, v in where.items():
    if not any(str(f[k]).lower() == v.lower() for f in values):
      have = " or ".join(sorted({str(f[k]) for f in values}))
      raise ValueError(f"--where {k}={v}: no trial of this study has it"
                       + (f"; its trials have {k}={have}" if have else ""))


def cmd_leaderboard(args) -> None:
  from search.leaderboard import parse_where
  states = TRIAL_STATES if "all" in (args.state or ()) else tuple(args.state or ("ok",))
  show_leaderboard(args.storage, args.study, args.format, args.top, states, parse_where(args.where or []))


def cmd_status(args) -> None:
  from search.leaderboard import studies, studies_view
  from search.proxy import proxy_fit
  if args.study:
    show_leaderboard(args.storage, args.study, args.format, args.top)
    with session(open_db(args.storage, create=False)) as s:
      trials = store.trials(s, _study(s, args.storage, args.study))
    if args.format == "table" and any(t.block_tok_s for t in trials): console.print(proxy_fit(trials).summary())
    return
  with session(open_db(args.storage, create=False)) as s: doc = studies(s)
  emit(args.format, studies_view(doc), doc, console)


def cmd_show(args) -> None:
  from search.leaderboard import find_trial, trial_doc, trial_view
  with session(open_db(args.storage, create=False)) as s:
    st = _study(s, args.storage, args.study)
    doc = trial_doc(s, st, find_trial(s, st, args.trial))
  emit(args.format, trial_view(doc), doc, console)


def cmd_cost(args) -> None:
  from search.cost import cost_doc, cost_view
  with session(open_db(args.storage, create=False)) as s:
    st = _study(s, args.storage, args.study)
    doc = cost_doc(st.name, SCHEMA, store.trials(s, st), args.project, store.measurements(s, st, stage=None))
  sections, notes = cost_view(doc)
  emit(args.format, sections, doc, console, notes)


def cmd_compare(args) -> None:
  from search.leaderboard import compare_doc, compare_view, find_trial
  with session(open_db(args.storage, create=False)) as s:
    st = _study(s, args.storage, args.study)
    other, sep, b = args.b.rpartition(":")
    sb = _study(s, args.storage, other) if sep else st
    doc = compare_doc(s, st, find_trial(s, st, args.a), find_trial(s, sb, b), sb)
  secs, notes = compare_view(doc)
  emit(args.format, secs, doc, console, notes)


def cmd_exports(args) -> None:
  from search.export import exports_doc, exports_view
  with session(open_db(args.storage, create=False)) as s:
    if args.study: _study(s, args.storage, args.study)
    doc = exports_doc(s, args.study)
  secs, notes = exports_view(doc)
  emit(args.format, secs, doc, console, notes)


def cmd_export(args) -> None:
  from search.export import export
  with session(open_db(args.storage, create=False)) as s:
    _, line = export(s, _study(s, args.storage, args.study), args.storage, None if args.best
                     else args.trial, args.unconfirmed, args.to, args.commit, args.force)
  console.print(line)


def cmd_dashboard(args) -> None:
  from search.dashboard import serve
  serve(args.storage, args.study, args.host, args.port, args.artifacts, say=console.print)


def cmd_report(args) -> None:
  from search.report import report
  console.print(f"report of {args.study}: {report(args.storage, args.study, pathlib.Path(args.out))}")


def port_number(text: str) -> int:
  v = at_least(0)(text)
  if v > 65535: raise argparse.ArgumentTypeError(f"{v} is not a port number (0 to 65535)")
  return v


def device_name(text: str) -> str:
  try: return check_device(text)
  except ValueError as e: raise argparse.ArgumentTypeError(str(e)) from None


def version() -> str:
  """This package's version, as installed."""
  try: return importlib.metadata.version("structsearch")
  except importlib.metadata.PackageNotFoundError: return "(not installed)"


def positive(text: str) -> float:
  v = at_least(0, float)(text)
  if v == 0: raise argparse.ArgumentTypeError("0 is not a positive number of seconds")
  return v


def device_list(text: str) -> list[str]:
  devices = [device_name(d.strip()) for d in text.split(",") if d.strip()]
  if len(set(devices)) != len(devices) or not devices:
    raise argparse.ArgumentTypeError(f"{text!r}: name each device once, comma-separated")
  return devices


def parser() -> argparse.ArgumentParser:
  """The command line of `search`: its subcommands and their options."""
  p = argparse.ArgumentParser(prog="search",
                              description="structural optimization search for tinygrad MLA/MoE inference")
  p.add_argument("--version", action="version", version=f"structsearch {version()}")
  sub = p.add_subparsers(dest="cmd", required=True)
  store_arg = argparse.ArgumentParser(add_help=False)
  store_arg.add_argument("--storage", default=default_url(),
                         help="database URL (default: sqlite file structsearch.db here; "
                                                                  "postgresql+psycopg://... for several workers)")
  run_arg = argparse.ArgumentParser(add_help=False)
  run_arg.add_argument("--timeout", type=positive, metavar="SECONDS",
                       help="stop starting trials after this many seconds (default: no limit)")
  run_arg.add_argument("--trial-timeout", type=positive, default=900, metavar="SECONDS",
                       help="wall-clock limit of one trial process, in seconds (default 900)")
  run_arg.add_argument("--heartbeat", type=positive, default=10, metavar="SECONDS",
                       help="seconds between a worker's heartbeats (default 10); a worker silent for 6 heartbeats is "
                       "dead")
  run_arg.add_argument("--artifacts",
                       help="directory of the trials' dashboard artifacts (default: beside a SQLite database)")
  fmt_arg = argparse.ArgumentParser(add_help=False)
  fmt_arg.add_argument("--format", choices=FORMATS, default="table",
                       help="table (default), json (described in docs/json.md), csv, markdown")

  s = sub.add_parser("space", help="print the search space of a model (or a random valid config with --sample)")
  s.add_argument("--model", required=True, help="a model name or a .gguf path")
  s.add_argument("--device", type=device_name,
                 help="device kind whose knobs to list (default CPU): only the values that run there")
  s.add_argument("--family", choices=FAMILIES,
                 help="the backends to list: all that run on the device (default), or portable ones")
  s.add_argument("--sample", action="store_true", help="print one random valid StructureConfig as JSON")
  s.add_argument("--seed", type=int, default=0, help="the random seed of --sample (default 0)")
  s.set_defaults(fn=cmd_space)

  st = sub.add_parser("start", parents=[store_arg, run_arg],
                      help="create a study and run it, or continue one (--study NAME alone)")
  st.add_argument("--model", help="a model name or a .gguf path (to create a study; a study continued knows its own)")
  st.add_argument("--study", help="study name (default: <model>-<device kind>)")
  where = st.add_mutually_exclusive_group()
  where.add_argument("--device", type=device_name,
                     help="tinygrad device, e.g. CUDA or CUDA:1 (default: tinygrad's default)")
  where.add_argument("--devices", type=device_list,
                     help="several devices of this host (CUDA:0,CUDA:1): one worker process each (PostgreSQL)")
  st.add_argument("--trials", type=at_least(1),
                  help="the study's target number of finished trials (default 200; may change later)")
  # the measurement protocol: fixed when the study is created (defaults in search.study.Setup); a later run may only
  # repeat it
  st.add_argument("--sampler", choices=SAMPLERS,
                  help="default coordinate: from the baseline one knob at a time, then tpe (search/coordinate.py); "
                  "nsga2 with two objectives")
  st.add_argument("--objectives", choices=["tok_s", "tok_s,peak_memory"], metavar="OBJECTIVES",
                  help="tok_s (the default: one objective) or tok_s,peak_memory (two: the Pareto front, nsga2)")
  st.add_argument("--seed", type=int, help="the sampler's random seed (default: none, a different search each run)")
  st.add_argument("-n", type=at_least(2), help="tokens per measured round (default 32)")
  st.add_argument("--rounds", type=at_least(1), help="measured rounds per trial (default 3)")
  st.add_argument("--block-layers", type=at_least(1),
                  help="blocks of the ladder's stage-1 proxy (default: the leading dense blocks + 2)")
  st.add_argument("--no-prefill", action="store_true", default=None,
                  help="feed the prompt through decode steps: no prefill graph to build per trial")
  st.add_argument("--beam-budget", type=at_least(0, float), metavar="SECONDS",
                  help="BEAM search seconds per trial; past them, kernels whose BEAM choice the study has not cached "
                  "get BEAM=0's heuristics "
                       "(default 0: no limit)")
  st.add_argument("--fix", action="append", metavar="KNOB=VALUE",
                  help="pin a knob for the whole study (e.g. beam=0); repeatable")
  st.add_argument("--exact", action="store_true", help="hold the study to exact configs: float arithmetic only, "
                  "no 8-bit activations (pins every knob that has an 8-bit value, e.g. ffn_act=float32)")
  st.add_argument("--family", choices=FAMILIES,
                  help="the kernel backends the study searches: all that run on its device (default), or "
                  "portable: only those that render for every device (tensor, fp16_cache, dsl), whatever the device")
  st.add_argument("--enqueue", action="append", help="a config file (.json/.toml) to measure first; repeatable")
  st.add_argument("--warm-start-from", help="enqueue the best configs of another study that apply to this model")
  st.add_argument("--remeasure", action="store_true",
                  help="measure a config again even when this study has measured it")
  st.add_argument("--confirm", type=at_least(0), default=3, metavar="K",
                  help="A/B-confirm the top K configs at the end (default 3; 0: skip)")
  st.add_argument("--pairs", type=at_least(MIN_PAIRS), default=3,
                  help=f"A/B pairs per confirmed config (default 3, at least {MIN_PAIRS})")
  st.set_defaults(fn=cmd_start)

  w = sub.add_parser("worker", parents=[store_arg, run_arg], help="join an existing study (PostgreSQL storage)")
  w.add_argument("--study", required=True, help="the study to join")
  w.add_argument("--device", type=device_name, help="tinygrad device (default: the study's)")
  w.add_argument("--model",
                 help="where the study's model file is on this host (default: the study's path; checked by SHA-256)")
  w.set_defaults(fn=cmd_worker)

  c = sub.add_parser("confirm", parents=[store_arg, fmt_arg],
                     help="A/B-confirm a study's top configs against the baseline")
  c.add_argument("--study", required=True, help="the study whose leaderboard to confirm")
  c.add_argument("--top", type=at_least(1), default=3,
                 help="how many configs from the top of the leaderboard (default 3)")
  c.add_argument("--pairs", type=at_least(MIN_PAIRS), default=3,
                 help="A/B pairs per config, baseline and config alternating in fresh processes (default 3, at least "
                 f"{MIN_PAIRS})")
  c.add_argument("--rounds", type=at_least(1), default=5, help="measured rounds per A/B run (default 5)")
  c.add_argument("--device", type=device_name, help="tinygrad device (default: the study's)")
  c.add_argument("--model",
                 help="where the study's model file is on this host (default: the study's path; checked by SHA-256)")
  c.add_argument("--again", action="store_true", help="re-measure configs confirmed before")
  c.add_argument("--artifacts", help="directory of the trials' dashboard artifacts, rewritten with the confirmations "
                 "(default: beside a SQLite database)")
  c.set_defaults(fn=cmd_confirm)

  r = sub.add_parser("replay", parents=[store_arg],
                     help="re-run a study's search offline against its measurements, per sampler")
  r.add_argument("--study", required=True, help="the study whose measurements to replay")
  r.add_argument("--sampler", action="append", choices=SAMPLERS,
                 help="a sampler to replay; repeatable (default: coordinate, tpe and random)")
  r.add_argument("--trials", type=at_least(1), default=30, help="trials per replayed search (default 30)")
  r.add_argument("--repeats", type=at_least(1), default=10,
                 help="replayed searches per sampler, each with its own seed (default 10)")
  r.set_defaults(fn=cmd_replay)

  for name, hlp in (("status", "the studies in a storage (with --study: its leaderboard)"),
                    ("list", "the studies in a storage")):
    x = sub.add_parser(name, parents=[store_arg, fmt_arg], help=hlp)
    x.add_argument("--study", help="this study's leaderboard instead of the list of studies" if name == "status"
                   else argparse.SUPPRESS)
    x.add_argument("--top", type=at_least(1), default=15,
                   help="rows of the study's leaderboard (default 15)" if name == "status" else argparse.SUPPRESS)
    x.set_defaults(fn=cmd_status)

  lb = sub.add_parser("leaderboard", parents=[store_arg, fmt_arg],
                      help="a study's configs ranked (confirmed speedup, else estimated)")
  lb.add_argument("--study", required=True, help="the study to rank")
  lb.add_argument("--top", type=at_least(1), metavar="N", help="the first N rows (default: all)")
  lb.add_argument("--state", action="append", choices=(*TRIAL_STATES, "all"),
                  help="trial states to list (default ok); repeatable")
  lb.add_argument("--where", action="append", metavar="KNOB=VALUE",
                  help="only configs with this knob value (e.g. topk=sort); repeatable")
  lb.set_defaults(fn=cmd_leaderboard)

  sh = sub.add_parser("show", parents=[store_arg, fmt_arg], help="everything about one trial")
  sh.add_argument("--study", required=True, help="the study of the trial")
  sh.add_argument("trial", help="a trial number, or 'baseline'")
  sh.set_defaults(fn=cmd_show)

  cp = sub.add_parser("compare", parents=[store_arg, fmt_arg],
                      help="two trials side by side, knob by knob, metric by metric and kernel by kernel")
  cp.add_argument("--study", required=True, help="the study of the trials (of A; of B unless B names its own)")
  cp.add_argument("a", help="a trial number, or 'baseline'")
  cp.add_argument("b", help="a trial number or 'baseline' of --study, or STUDY:N / STUDY:baseline for a trial of "
                  "another study in the storage (the same model on another device, before and after a code change)")
  cp.set_defaults(fn=cmd_compare)

  co = sub.add_parser("cost", parents=[store_arg, fmt_arg],
                      help="what a study's trials cost, phase by phase, and the wall time of N trials")
  co.add_argument("--study", required=True, help="the study whose trials to account for")
  co.add_argument("--project", type=at_least(1), default=200, help="trials to project the wall time of (default 200)")
  co.set_defaults(fn=cmd_cost)

  ex = sub.add_parser("exports", parents=[store_arg, fmt_arg],
                      help="what `search export` put in production: each file, from which study and trial, since when, "
                           "and whether it holds it still")
  ex.add_argument("--study", help="only this study's exports (default: every study's)")
  ex.set_defaults(fn=cmd_exports)

  d = sub.add_parser("dashboard", parents=[store_arg],
                     help="serve optuna-dashboard on the storage (with the trials' artifacts)")
  d.add_argument("--study", help="print the address of this study's page")
  d.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
  d.add_argument("--port", type=port_number, default=8080, help="port to serve on (default 8080; 0: any free port)")
  d.add_argument("--artifacts", help="the artifact directory the workers wrote (default: beside a SQLite database)")
  d.set_defaults(fn=cmd_dashboard)

  rp = sub.add_parser("report", parents=[store_arg],
                      help="a study's report: Markdown and HTML with PNG plots, in one directory")
  rp.add_argument("--study", required=True, help="the study to report")
  rp.add_argument("--out", required=True, help="directory to write report.md, report.html and the plots into")
  rp.set_defaults(fn=cmd_report)

  e = sub.add_parser("export", parents=[store_arg],
                     help="write a study's config to the model's production config (TOML)")
  e.add_argument("--study", required=True, help="the study whose config to export")
  which = e.add_mutually_exclusive_group()
  which.add_argument("--trial", help="this trial's config (a number)")
  which.add_argument("--best", action="store_true", help="the confirmed winner (the default)")
  e.add_argument("--to", "--out", dest="to",
                 help="default: $STRUCTSEARCH_HOME/production/<model>.toml, where `model run`/`model bench` look")
  e.add_argument("--unconfirmed", action="store_true",
                 help="allow a config that no A/B confirmation has shown faster than the baseline")
  e.add_argument("--force", action="store_true",
                 help="with --unconfirmed: export a config whose estimate is not above the baseline's interval")
  e.add_argument("--commit", action="store_true",
                 help="commit the file on a new branch of the git repository it lives in")
  e.set_defaults(fn=cmd_export)
  return p


def main(argv: list[str] | None = None) -> None:
  args = parser().parse_args(argv)
  if getattr(args, "sampler", None) is None and args.cmd == "replay": args.sampler = ["coordinate", "tpe", "random"]
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  try: args.fn(args)
  except BaselineFailed as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(1)
  except (GGUFError, ModelNotFound, ConfigError, DBError, StudyMismatch, ValueError, RuntimeError) as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(2)
  # the reader (`| head`) stopped reading, as it may: no traceback, none when Python flushes stdout at exit
  except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)
