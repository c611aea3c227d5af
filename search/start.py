"""`search start`: create a study and run it, or continue one with its stored settings: this host's worker under the
live view (search/join.py), one more per device with --devices, and the top configs A/B-confirmed at the end."""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys

from db import store
from db.engine import DBError, default_url, hide_password, open_db, session
from evaluator.cli import at_least
from evaluator.runner import bandwidths, default_device
from model.backends.catalog import FAMILIES
from model.registry import cache_dir, resolve
from model.structure import ConfigError, StructureConfig
from model.workload import PROMPT, Workload
from search import leaderboard
from search.confirm import confirm
from search.dashboard import refresh
from search.formats import console
from search.join import work
from search.leaderboard import MIN_PAIRS
from search.options import add_running, add_storage, between, device_list, device_name
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
  study_exists,
)
from space.knobs import ModelInfo, device_kind, parse_pins, to_params


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_running(p)
  p.add_argument("--model", help="a model name or a .gguf path (to create a study; a study continued knows its own)")
  p.add_argument("--study", help="study name (default: <model>-<device kind>)")
  where = p.add_mutually_exclusive_group()
  where.add_argument("--device", type=device_name,
                     help="tinygrad device, e.g. CUDA or CUDA:1 (default: tinygrad's default)")
  where.add_argument("--devices", type=device_list,
                     help="several devices of this host (CUDA:0,CUDA:1): one worker process each (PostgreSQL)")
  p.add_argument("--trials", type=at_least(1),
                 help="the study's target number of finished trials (default 200; may change later)")
  # the measurement protocol: fixed when the study is created (defaults in search.study.Setup); a later run may
  # only repeat it
  p.add_argument("--sampler", choices=SAMPLERS, help="default coordinate: from the baseline one knob at a time, then "
                 "tpe (search/coordinate.py); nsga2 with two objectives")
  p.add_argument("--objectives", choices=OBJECTIVE_SETS, metavar="OBJECTIVES",
                 help="tok_s (the default: one objective), or tok_s with prefill_tok_s and/or peak_memory "
                 f"({', '.join(OBJECTIVE_SETS[1:])}: the Pareto front, nsga2)")
  p.add_argument("--context", type=at_least(0), metavar="N",
                 help="decode timed with N positions in the KV cache: the prompt's, then filled from its rows "
                 "(model/bench.py fill_context; default: right after the prompt)")
  p.add_argument("--prompt", type=at_least(1), metavar="N",
                 help=f"a prompt of N tokens, prefilled and timed: prefill_tok_s, ttft_s (default {PROMPT})")
  p.add_argument("--seed", type=int, help="the sampler's random seed (default: none, a different search each run)")
  p.add_argument("-n", type=at_least(2), help="tokens per measured round (default 32)")
  p.add_argument("--rounds", type=between(1, MAX_ROUNDS), help=f"measured rounds per trial (default 3, at most "
                 f"{MAX_ROUNDS})")
  p.add_argument("--block-layers", type=at_least(1),
                 help="blocks of the ladder's stage-1 proxy (default: the leading dense blocks + 2)")
  p.add_argument("--no-prefill", action="store_true", default=None,
                 help="feed the prompt through decode steps: no prefill graph to build per trial")
  p.add_argument("--beam-budget", type=at_least(0, float), metavar="SECONDS",
                 help="BEAM search seconds per trial; past them, kernels whose BEAM choice the study has not cached "
                 "get BEAM=0's heuristics (default 0: no limit)")
  p.add_argument("--fix", action="append", metavar="KNOB=VALUE",
                 help="pin a knob for the whole study (e.g. beam=0); repeatable")
  p.add_argument("--exact", action="store_true", help="hold the study to exact configs: float arithmetic only, "
                 "no 8-bit activations (pins every knob that has an 8-bit value, e.g. ffn_act=float32)")
  p.add_argument("--family", choices=FAMILIES,
                 help="the kernel backends the study searches: all that run on its device (default), or "
                 "portable: only those that render for every device (tensor, fp16_cache, dsl), whatever the device")
  p.add_argument("--enqueue", action="append", help="a config file (.json/.toml) to measure first; repeatable")
  p.add_argument("--warm-start-from", help="enqueue the best configs of another study that apply to this model")
  p.add_argument("--remeasure", action="store_true",
                 help="measure a config again even when this study has measured it")
  p.add_argument("--confirm", type=at_least(0), default=3, metavar="K",
                 help="A/B-confirm the top K configs at the end (default 3; 0: skip)")
  p.add_argument("--pairs", type=at_least(MIN_PAIRS), default=3,
                 help=f"A/B pairs per confirmed config (default 3, at least {MIN_PAIRS})")


def _protocol(args: argparse.Namespace, info: ModelInfo, device: str, family: str) -> dict:
  """The measurement settings this command line gives (None: not given); pins are read in the space of `family`, with
  --exact's (exact_pins) among those --fix gives (a study created with --exact stores them: run)."""
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
          "exact": True if args.exact else None, "context": args.context, "prompt": args.prompt}


MAX_ROUNDS = 100  # measured rounds per trial: more only lengthens every trial of the study

# --objectives: tok_s alone, or with the others of search.study.OBJECTIVES
OBJECTIVE_SETS = ["tok_s", "tok_s,peak_memory", "tok_s,prefill_tok_s", "tok_s,prefill_tok_s,peak_memory"]


def memory(setup: Setup) -> None:
  """The workload's device memory, said before a new study is made; a workload that cannot run on its device (past the
  model's context length, or its memory) is refused in one line, exit code 1, before anything is created."""
  Workload(setup.prompt, setup.context)  # a context shorter than the prompt: ValueError, one line
  mem, refusal = setup.evaluator().memory()
  if refusal:
    print(f"search: error: {refusal}", file=sys.stderr)
    sys.exit(1)
  console.print(f"workload: {setup.workload}: {mem.text()} on {setup.device}", highlight=False)


def run(args: argparse.Namespace) -> None:
  devices = args.devices or [args.device or default_device()]
  if len(devices) > 1 and args.storage.startswith("sqlite"):
    raise DBError("--devices runs a worker per device: they need a server database (SQLite locks under concurrent "
                  "writers); use --storage postgresql+psycopg://...")
  if args.study is None and args.model is None:
    raise ConfigError("search start needs --model (a new study) or --study (one to continue)")
  bandwidths()  # the caches a trial reads, checked before anything is made
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
    memory(setup)
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
  try: work(setup, args.storage, info, args)
  except BaseException:
    # they stop with this one (from a terminal, Ctrl-C reaches them too)
    for _, p, _ in workers: p.send_signal(signal.SIGINT)
    for _, p, _ in workers: p.wait()
    raise
  if failed := [(d, p, log) for d, p, log in workers if p.wait() != 0]:
    for d, p, log in failed: console.print(f"the worker on {d} failed (exit code {p.returncode}): see {log}")
    sys.exit(1)
  if args.confirm:
    confirm(args.storage, name, top=args.confirm, pairs=args.pairs, device=setup.device, say=console.print,
            model=setup.model)
    refresh(args.storage, name, args.artifacts)
    leaderboard.show(args.storage, name, top=15)
  where = "" if args.storage == default_url() else f" --storage {shlex.quote(hide_password(args.storage))}"
  q = shlex.quote(name)  # a name pasted into a shell runs nothing
  console.print(f"review: `search leaderboard --study {q}{where}`; `search report --study {q}{where} --out "
                f"{shlex.quote(f'report-{name}')}` (Markdown, HTML, plots); `search dashboard --study {q}{where}` (web "
                "dashboard on 127.0.0.1:8080)", highlight=False, markup=False)


def _spawn_worker(setup: Setup, args: argparse.Namespace, device: str) -> tuple[str, subprocess.Popen, pathlib.Path]:
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
