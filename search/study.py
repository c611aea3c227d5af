"""A study: Optuna explores the space of one model file on one device kind; every trial is measured by the evaluator
(block proxy, then the full model) and recorded, with the code that produced it, beside Optuna's own tables.

Optuna's RDB storage and our ss_ tables share one database URL. Several workers (`search worker`) may join one study on
PostgreSQL; the evaluator's device lock keeps the benchmarks of one machine sequential, and Optuna's heartbeat fails the
trial of a worker that died, re-enqueueing its config once.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from db import store
from db.capture import git_state
from db.engine import DBError, engine_kwargs, open_db, session
from db.models import GitState, Study, Trial
from evaluator.result import TrialResult
from evaluator.runner import Evaluator
from model.gguf_file import GGUFFile
from model.structure import ConfigError, StructureConfig
from space.knobs import SPACE_VERSION, ModelInfo, device_kind, suggest, to_params

SAMPLERS = ("tpe", "random", "gp", "nsga2")
PROJECT = pathlib.Path(__file__).resolve().parents[1]
HEARTBEAT_S = 10  # a worker that stops beating for 6 heartbeats is dead: its trial fails and its config is enqueued again


class TrialFailed(Exception):
  """A trial the evaluator classified as failed (Optuna marks it FAIL; the study goes on)."""


class StudyMismatch(ValueError):
  """`search start` on an existing study with another model file, device kind or space version."""


def config_hash(cfg: StructureConfig) -> str: return hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]


def storage(url: str, heartbeat: float = HEARTBEAT_S) -> RDBStorage:
  """Optuna's storage on our database (our schema migrated first, so an unreachable or foreign database fails with one line)."""
  open_db(url)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
      return RDBStorage(url, heartbeat_interval=max(1, round(heartbeat)), grace_period=max(3, round(6 * heartbeat)),
                        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1), engine_kwargs=engine_kwargs(url))
  except Exception as e:  # noqa: BLE001 - Optuna raises bare SQLAlchemy or RuntimeErrors here
    raise DBError(f"Optuna cannot use the database: {str(e).splitlines()[0]}") from None


def sampler(name: str, seed: int | None, n_startup: int) -> optuna.samplers.BaseSampler:
  warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # TPE's group option
  if name == "tpe":
    return optuna.samplers.TPESampler(multivariate=True, group=True, constant_liar=True, seed=seed, n_startup_trials=n_startup)
  if name == "random": return optuna.samplers.RandomSampler(seed=seed)
  if name == "nsga2": return optuna.samplers.NSGAIISampler(seed=seed)
  if name == "gp":
    import importlib.util
    if importlib.util.find_spec("torch") is None: raise ConfigError("the gp sampler needs PyTorch: pip install torch")
    return optuna.samplers.GPSampler(seed=seed)
  raise ConfigError(f"unknown sampler {name!r}; choose one of: {', '.join(SAMPLERS)}")


@dataclass
class Setup:
  """What a study is: fixed when it is created, read back by every worker that joins it."""
  name: str
  model: str  # GGUF path
  model_name: str
  device: str
  sampler: str = "tpe"
  objectives: str = "tok_s"  # or "tok_s,peak_memory" (NSGA-II)
  seed: int | None = None
  trials: int = 200  # the study's target number of finished trials
  fixed: dict[str, Any] = field(default_factory=dict)  # knobs pinned for the whole study (not searched)
  n: int = 32  # the evaluator's settings, the same for every trial of the study
  rounds: int = 3
  prefill: bool = True
  block_layers: int | None = None  # the ladder's stage-1 proxy size (default: the leading dense blocks + 2)

  def evaluator(self, timeout: float = 900, rounds: int | None = None) -> Evaluator:
    ev = Evaluator.for_model(self.model, self.device, n=self.n, rounds=rounds or self.rounds, prefill=self.prefill, timeout=timeout)
    if self.block_layers: ev.block_layers = min(self.block_layers, ev.total_layers)
    return ev


@dataclass
class Event:
  """What the live view hears: a trial started, changed phase, or ended."""
  kind: str  # start | phase | wait | end | note
  number: int
  text: str = ""
  row: Trial | None = None


class Runner:
  """One worker of a study: proposes configs through Optuna, measures them with the evaluator, records everything."""

  def __init__(self, setup: Setup, url: str, ev: Evaluator, info: ModelInfo, remeasure: bool = False,
               on_event: Callable[[Event], None] = lambda e: None, heartbeat: float = HEARTBEAT_S, artifacts=None):
    self.setup, self.ev, self.info, self.remeasure, self.on_event = setup, ev, info, remeasure, on_event
    self.artifacts = artifacts  # an Optuna artifact store: each finished trial's metrics, diff and profile for the dashboard
    self.engine = open_db(url)
    self.multi = "," in setup.objectives
    self.study = optuna.load_study(study_name=setup.name, storage=storage(url, heartbeat))
    # a resumed or second worker must not replay the proposals of the first: its sampler's seed moves with the study's size
    seed = None if setup.seed is None else setup.seed + len(self.study.trials)
    self.study.sampler = sampler(setup.sampler, seed, 8)
    if not self.multi: self.study.pruner = optuna.pruners.PercentilePruner(25.0, n_startup_trials=5, n_warmup_steps=0)
    with session(self.engine) as s: self.row = store.get_study(s, setup.name)

  def optimize(self, timeout: float | None = None) -> None:
    """Run trials until the study has its target number of finished trials (all workers together) or the timeout passes."""
    def stop(study: optuna.Study, _=None) -> None:
      if self.finished() >= self.setup.trials: study.stop()
    from search import noise
    if self.finished() < self.setup.trials:
      self.study.optimize(self.objective, timeout=timeout, catch=(TrialFailed,), callbacks=[stop, noise.between_trials(self)], gc_after_trial=False)
    if self.finished() >= self.setup.trials and not self.multi: noise.settle(self)

  def finished(self) -> int:
    """Trials with an outcome: completed, pruned, or failed by the evaluator (not interrupted, not lost with a dead worker:
    those configs are enqueued again)."""
    ts = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
    return sum(t.state != TrialState.FAIL or "failure" in t.user_attrs for t in ts)

  def objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
    self._sync_stale()
    cfg = suggest(trial, self.info, self.setup.device, self.setup.fixed)
    h = config_hash(cfg)
    with session(self.engine) as s:
      row = store.start_trial(s, self.row, trial.number, cfg.to_json(), h, _git(s), None, f"{socket.gethostname()}:{os.getpid()}",
                              optuna_trial_id=trial._trial_id)
      prior = None if self.remeasure else store.find_measured(s, self.row, h)
    trial.set_user_attr("config_hash", h)
    self.on_event(Event("start", trial.number, cfg.to_json(), row))
    try:
      if prior is not None: return self._reuse(trial, row, prior)
      return self._measure(trial, row, cfg)
    except (KeyboardInterrupt, SystemExit):
      with session(self.engine) as s: store.finish_trial(s, row, state="interrupted", error_text="stopped by the user")
      self.study.enqueue_trial(trial.params)  # measured first when the study continues
      raise
    finally:
      if self.artifacts is not None:
        from search.dashboard import attach
        attach(self.artifacts, trial, self.engine, self.row, row)

  def _reuse(self, trial: optuna.Trial, row: Trial, prior: Trial) -> float | tuple[float, float]:
    with session(self.engine) as s:
      row = store.finish_trial(s, row, state="reused", stage=prior.stage, tok_s=prior.tok_s, block_tok_s=prior.block_tok_s,
                               metrics=prior.metrics, check=prior.check, failure_class=prior.failure_class, error_text=prior.error_text,
                               reused_from=prior)
      est = store.estimates(s, self.row).get(prior.config_hash)  # all its measurements so far, not the first figure alone
    self.on_event(Event("end", trial.number, f"config already measured in trial {prior.number}: its result is reused", row))
    return self._value(trial, prior.state, est.median if est else prior.tok_s, (prior.metrics or {}).get("peak_device_bytes"))

  def _measure(self, trial: optuna.Trial, row: Trial, cfg: StructureConfig) -> float | tuple[float, float]:
    t0, spent, block = time.perf_counter(), 0.0, None
    phase = lambda stage: lambda p: self.on_event(Event("phase", trial.number, f"{stage}: {p}"))
    wait = lambda msg: self.on_event(Event("wait", trial.number, msg))
    res = None
    for stage in self.ev.stages:
      res = self.ev.run(cfg.to_dict(), stage, on_phase=phase(stage), on_wait=wait)
      spent += res.phases.get("wall_s", 0.0) + res.phases.get("setup_s", 0.0)
      if stage == "block" and len(self.ev.stages) > 1:
        block = res
        if not res.ok: break
        if not self.multi:
          trial.report(res.metrics["tok_s"], 0)
          if trial.should_prune():
            self._record(row, "pruned", res, res, time.perf_counter() - t0 - spent)  # keeps its proxy tok/s
            raise optuna.TrialPruned(f"block proxy {res.metrics['tok_s']:.2f} tok/s is in the bottom quarter")
    assert res is not None
    self._record(row, res.status, res, block, time.perf_counter() - t0 - spent)
    return self._value(trial, res.status, res.tok_s, res.metrics.get("peak_device_bytes"))

  def _value(self, trial: optuna.Trial, state: str, tok_s: float | None, peak: int | None) -> float | tuple[float, float]:
    if state not in ("ok", "wrong_output"):
      trial.set_user_attr("failure", state)
      raise TrialFailed(state)
    trial.set_constraint("wrong_output", 1.0 if state == "wrong_output" else 0.0)  # infeasible: never best
    value = tok_s if state == "ok" else 0.0
    return (value, float(peak or 0)) if self.multi else value

  def _record(self, row: Trial, state: str, res: TrialResult, block: TrialResult | None, overhead: float) -> None:
    with session(self.engine) as s:
      env = store.get_or_create_environment(s, _environment(res.env)) if res.env else None
      if env is not None: s.get(Trial, row.id).environment_id = env.id
      metrics = {k: v for k, v in res.metrics.items() if k not in ("traceback", "log_tail")}
      metrics["search_overhead_s"] = round(overhead, 3)
      if block is not None: metrics["block"] = {k: block.metrics.get(k) for k in ("tok_s", "tok_s_min", "tok_s_max", "layers", "kernels_per_token")}
      phases = {**res.phases, **({f"block_{k}": v for k, v in block.phases.items()} if block is not None and block is not res else {})}
      row = store.finish_trial(
        s, row, state=state, stage=res.spec["stage"], tok_s=res.tok_s if state == "ok" else None,
        block_tok_s=block.metrics.get("tok_s") if block is not None and block.ok else None, metrics=metrics, phases=phases, check=res.check,
        failure_class=state if state not in ("ok", "pruned") else None,
        error_text=(res.error or "") + ("\n" + res.metrics.get("traceback", "") if res.metrics.get("traceback") else "") or None,
        profile=res.profile or None)
      if self.row.device_name in ("", None) and res.env: s.get(Study, self.row.id).device_name = self.row.device_name = res.env.get("device_name", "")
    self.on_event(Event("end", row.number, state, row))

  def _sync_stale(self) -> None:
    """Trials that Optuna failed because their worker stopped beating (killed) are interrupted in our table too."""
    failed = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    if failed:
      with session(self.engine) as s: store.mark_interrupted(s, self.row, failed)


def _git(s) -> GitState | None:
  state = git_state(PROJECT)
  return store.get_or_create_git_state(s, state) if state else None


def _environment(env: dict) -> dict:
  """The trial process's environment as an ss_environment row: tinygrad's commit and diff when it runs from a git checkout."""
  tg = pathlib.Path(env.get("tinygrad_path", ""))
  state = git_state(tg) if (tg / ".git").exists() else None
  return {"device": env["device"], "device_name": env.get("device_name", ""), "driver": env.get("driver", ""),
          "tinygrad_version": env.get("tinygrad_version", ""), "tinygrad_commit": state["commit"] if state else None,
          "tinygrad_diff": state["diff"] if state else None, "python": env["python"], "host": env["host"], "platform": env["platform"]}


def create_or_check(setup: Setup, url: str, info: ModelInfo, ev: Evaluator, enqueue: list[StructureConfig]) -> None:
  """Create the study (ours and Optuna's) or check that an existing one is this model file, device kind and space; then
  enqueue the baseline and the given configs (each once per study)."""
  from evaluator.reference import file_sha256
  from model.registry import cache_dir
  sha = file_sha256(setup.model, cache_dir())
  engine = open_db(url)
  with session(engine) as s:
    row = store.get_study(s, setup.name)
    if row is None:
      store.create_study(s, name=setup.name, model_name=setup.model_name, model_path=setup.model, model_sha256=sha,
                         model_bytes=os.path.getsize(setup.model), layers=ev.total_layers, device=setup.device, device_name="",
                         space_version=SPACE_VERSION, objectives=setup.objectives, sampler=setup.sampler)
    else:
      mismatch = (f"belongs to {row.model_path} (sha256 {row.model_sha256[:12]}), not this file" if row.model_sha256 != sha else
                  f"runs on {row.device}, not {setup.device}" if device_kind(row.device) != device_kind(setup.device) else
                  f"was made with space version {row.space_version}, this is {SPACE_VERSION}" if row.space_version != SPACE_VERSION else "")
      if mismatch: raise StudyMismatch(f"study {setup.name!r} {mismatch}")
  directions = ["maximize", "minimize"] if "," in setup.objectives else ["maximize"]
  study = optuna.create_study(study_name=setup.name, storage=storage(url), directions=directions, load_if_exists=True)
  attrs = {"model": setup.model, "model_name": setup.model_name, "device": setup.device, "sampler": setup.sampler,
           "objectives": setup.objectives, "seed": setup.seed, "trials": setup.trials, "fixed": setup.fixed, "model_info": info_to_json(info),
           "n": setup.n, "rounds": setup.rounds, "prefill": setup.prefill,
           "block_layers": setup.block_layers}
  if "fixed" in study.user_attrs and study.user_attrs["fixed"] != setup.fixed:
    raise StudyMismatch(f"study {setup.name!r} pins {study.user_attrs['fixed'] or 'no knobs'}; a study keeps one space (use another --study)")
  for k, v in attrs.items(): study.set_user_attr(k, v)
  for i, cfg in enumerate([StructureConfig(), *enqueue]):  # pins override the baseline's values (then no trial is the pure baseline)
    params = to_params(cfg, info, setup.device)
    if i and any(params.get(k, v) != v for k, v in setup.fixed.items()):
      raise ConfigError(f"an enqueued config contradicts the pinned knobs {setup.fixed}")
    study.enqueue_trial({k: v for k, v in params.items() if k not in setup.fixed}, skip_if_exists=True)


def load_setup(name: str, url: str, device: str | None = None) -> tuple[Setup, ModelInfo]:
  """A study's setup as its creator stored it (for `search worker` and the views); the device may be overridden (same kind)."""
  try: attrs = optuna.load_study(study_name=name, storage=storage(url)).user_attrs
  except KeyError: raise StudyMismatch(f"no study named {name!r} in {url}") from None
  setup = Setup(name, attrs["model"], attrs["model_name"], device or attrs["device"], attrs["sampler"], attrs["objectives"], attrs["seed"],
                attrs["trials"], attrs["fixed"], attrs["n"], attrs["rounds"], attrs["prefill"], attrs["block_layers"])
  if device_kind(setup.device) != device_kind(attrs["device"]): raise StudyMismatch(f"study {name!r} runs on {attrs['device']}, not {device}")
  return setup, info_from_json(attrs["model_info"])


def info_to_json(info: ModelInfo) -> str:
  return json.dumps({"moe": info.moe, "dense_blocks": info.dense_blocks, "shared_experts": info.shared_experts,
                     "quants": {k: list(v) for k, v in info.quants.items()}, "mergeable": sorted(info.mergeable)})


def info_from_json(text: str) -> ModelInfo:
  d = json.loads(text)
  return ModelInfo(d["moe"], d["dense_blocks"], d["shared_experts"], {k: tuple(v) for k, v in d["quants"].items()}, frozenset(d["mergeable"]))


def model_info(path: str) -> ModelInfo: return ModelInfo.from_gguf(GGUFFile(path))
