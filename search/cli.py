"""The `search` command: start or join a study, confirm, replay, and review its results."""
from __future__ import annotations

import argparse
import pathlib
import sys

import optuna
from rich.console import Console
from rich.live import Live
from rich.table import Table

from db import store
from db.engine import DBError, default_url, open_db, session
from evaluator.runner import default_device
from model.gguf_file import GGUFError, GGUFFile
from model.registry import ModelNotFound, resolve
from model.structure import ConfigError, StructureConfig
from search.study import SAMPLERS, Runner, Setup, StudyMismatch, create_or_check, load_setup, model_info
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
  with session(open_db(url)) as s: finished = store.trials(s, store.get_study(s, setup.name))
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
  with session(open_db(url)) as s: console.print(leaderboard_table(s, store.get_study(s, setup.name)))


def cmd_start(args) -> None:
  path = str(resolve(args.model))
  device = args.device or default_device()
  name = args.study or f"{pathlib.Path(args.model).stem if path == args.model else args.model}-{device_kind(device)}"
  info = model_info(path)
  setup = Setup(name, path, args.model, device, args.sampler, args.objectives, args.seed, args.trials, parse_pins(args.fix or [], info, device),
                args.n, args.rounds, not args.no_prefill, args.block_layers)
  if setup.objectives != "tok_s" and setup.sampler == "tpe": setup.sampler = "nsga2"
  enqueue = [StructureConfig.load(f) for f in args.enqueue or ()]
  for cfg in enqueue: to_params(cfg, info, device)  # fail before anything runs
  if args.warm_start_from: enqueue += warm_start(args.storage, args.warm_start_from, info, device)
  ev = setup.evaluator()
  create_or_check(setup, args.storage, info, ev, enqueue)
  _run(setup, args.storage, info, args)
  if args.confirm:
    from search.confirm import confirm
    confirm(args.storage, name, top=args.confirm, pairs=args.pairs, device=device, say=console.print)
    from search.leaderboard import leaderboard_table
    with session(open_db(args.storage)) as s: console.print(leaderboard_table(s, store.get_study(s, name)))


def warm_start(url: str, other: str, info: ModelInfo, device: str, top: int = 5) -> list[StructureConfig]:
  """The best configs of another study that are valid in this space (a knob this model lacks makes a config invalid here)."""
  with session(open_db(url)) as s:
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
  setup, info = load_setup(args.study, args.storage, args.device)
  _run(setup, args.storage, info, args)


def cmd_confirm(args) -> None:
  from search.confirm import confirm
  from search.leaderboard import leaderboard_table
  confirm(args.storage, args.study, top=args.top, pairs=args.pairs, rounds=args.rounds, device=args.device, say=console.print, again=args.again)
  with session(open_db(args.storage)) as s: console.print(leaderboard_table(s, store.get_study(s, args.study)))


def cmd_replay(args) -> None:
  from search.replay import replay
  t = Table(title=f"replay of {args.study}: trials to reach 95% of its best tok/s ({args.trials} trials, {args.repeats} repeats)")
  for col in ("sampler", "median trials", "reached in", "per repeat", "unmeasured proposals"): t.add_column(col)
  for r in replay(args.storage, args.study, args.sampler, args.trials, args.repeats):
    hits = sum(x is not None for x in r.reached_at)
    t.add_row(r.sampler, f"{r.median_trials:g}" if r.median_trials is not None else f"> {r.trials}", f"{hits}/{len(r.reached_at)}",
              " ".join(str(x) if x is not None else "-" for x in r.reached_at), f"{100 * r.unavailable:.0f}%")
  console.print(t)


def cmd_status(args) -> None:
  from search.leaderboard import leaderboard_table, studies_table
  with session(open_db(args.storage)) as s:
    if not args.study:
      console.print(studies_table(s))
      return
    st = store.get_study(s, args.study)
    if st is None: raise StudyMismatch(f"no study named {args.study!r} in {args.storage}")
    console.print(leaderboard_table(s, st, args.top))


def cmd_export(args) -> None:
  from search.leaderboard import export
  with session(open_db(args.storage)) as s:
    st = store.get_study(s, args.study)
    if st is None: raise StudyMismatch(f"no study named {args.study!r} in {args.storage}")
    cfg, head = export(s, st, args.unconfirmed)
  out = pathlib.Path(args.out or f"model/production/{st.model_name}.toml")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(head + cfg.to_toml())
  console.print(f"wrote {out}: " + head.splitlines()[0][2:])


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="search", description="structural optimization search for tinygrad MLA/MoE inference")
  sub = p.add_subparsers(dest="cmd", required=True)
  store_arg = argparse.ArgumentParser(add_help=False)
  store_arg.add_argument("--storage", default=default_url(), help="database URL (default: sqlite file structsearch.db here; "
                                                                  "postgresql+psycopg://... for several workers)")
  run_arg = argparse.ArgumentParser(add_help=False)
  run_arg.add_argument("--device", help="tinygrad device (default: tinygrad's default)")
  run_arg.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
  run_arg.add_argument("--trial-timeout", type=float, default=900, help="wall-clock limit of one trial process (s)")
  run_arg.add_argument("--heartbeat", type=float, default=10, help="seconds between worker heartbeats; a worker silent for 6 is dead")


  s = sub.add_parser("space", help="print the search space of a model (or a random valid config with --sample)")
  s.add_argument("--model", required=True, help="a model name or a .gguf path")
  s.add_argument("--device", help="device kind whose knobs to list (default CPU)")
  s.add_argument("--sample", action="store_true", help="print one random valid StructureConfig as JSON")
  s.add_argument("--seed", type=int, default=0)
  s.set_defaults(fn=cmd_space)

  st = sub.add_parser("start", parents=[store_arg, run_arg], help="create or continue a study and run it")
  st.add_argument("--model", required=True, help="a model name or a .gguf path")
  st.add_argument("--trials", type=int, default=200, help="the study's target number of finished trials")
  st.add_argument("--study", help="study name (default: <model>-<device kind>)")
  st.add_argument("--sampler", choices=SAMPLERS, default="tpe")
  st.add_argument("--objectives", choices=["tok_s", "tok_s,peak_memory"], default="tok_s")
  st.add_argument("--seed", type=int)
  st.add_argument("-n", type=int, default=32, help="tokens per measured round")
  st.add_argument("--rounds", type=int, default=3, help="measured rounds per trial")
  st.add_argument("--block-layers", type=int, help="blocks of the ladder's stage-1 proxy (default: the leading dense blocks + 2)")
  st.add_argument("--no-prefill", action="store_true", help="feed the prompt through decode steps: no prefill graph to build per trial")
  st.add_argument("--fix", action="append", metavar="KNOB=VALUE", help="pin a knob for the whole study (e.g. beam=0); repeatable")
  st.add_argument("--enqueue", action="append", help="a config file (.json/.toml) to measure first; repeatable")
  st.add_argument("--warm-start-from", help="enqueue the best configs of another study that apply to this model")
  st.add_argument("--remeasure", action="store_true", help="measure a config again even when this study has measured it")
  st.add_argument("--confirm", type=int, default=3, help="A/B-confirm the top K configs at the end (0: skip)")
  st.add_argument("--pairs", type=int, default=3, help="A/B pairs per confirmed config")
  st.set_defaults(fn=cmd_start)

  w = sub.add_parser("worker", parents=[store_arg, run_arg], help="join an existing study (PostgreSQL storage)")
  w.add_argument("--study", required=True)
  w.set_defaults(fn=cmd_worker)

  c = sub.add_parser("confirm", parents=[store_arg], help="A/B-confirm a study's top configs against the baseline")
  c.add_argument("--study", required=True)
  c.add_argument("--top", type=int, default=3)
  c.add_argument("--pairs", type=int, default=3)
  c.add_argument("--rounds", type=int, default=5)
  c.add_argument("--device")
  c.add_argument("--again", action="store_true", help="re-measure configs confirmed before")
  c.set_defaults(fn=cmd_confirm)

  r = sub.add_parser("replay", parents=[store_arg], help="re-run a study's search offline against its measurements, per sampler")
  r.add_argument("--study", required=True)
  r.add_argument("--sampler", action="append", choices=SAMPLERS, help="repeatable (default: tpe and random)")
  r.add_argument("--trials", type=int, default=30)
  r.add_argument("--repeats", type=int, default=10)
  r.set_defaults(fn=cmd_replay)

  for name, hlp in (("status", "a study's leaderboard (or all studies)"), ("list", "the studies in a storage")):
    x = sub.add_parser(name, parents=[store_arg], help=hlp)
    x.add_argument("--study", help=None if name == "status" else argparse.SUPPRESS)
    x.add_argument("--top", type=int, default=15, help=None if name == "status" else argparse.SUPPRESS)
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
  except (GGUFError, ModelNotFound, ConfigError, DBError, StudyMismatch, ValueError, RuntimeError) as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(2)
