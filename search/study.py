"""A study: Optuna explores the space of one model file on one device model; every trial is measured by the evaluator
(block proxy, then the full model) and recorded, with the code that produced it, beside Optuna's own tables.

Optuna's RDB storage and our ss_ tables share one database URL. Several workers (`search worker`, or `search start
--devices`) may join one study on PostgreSQL; the evaluator's device lock keeps the benchmarks of one device sequential.
A worker that dies stops beating: after the grace period any worker fails its trial (Optuna's heartbeat) and its config
is queued again; a worker does not end while trials of other workers are running, so a dead one's trial is always
failed and measured again, whichever worker is left.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import socket
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from db import store
from db.capture import git_state
from db.engine import DBError, NoDatabase, engine_kwargs, hide_password, open_db, session
from db.models import GitState, Study, Trial
from evaluator.devices import physical
from evaluator.result import TrialResult
from evaluator.runner import Evaluator, ReferenceFailed
from model.filehash import file_sha256
from model.gguf_file import GGUFFile
from model.registry import cache_dir
from model.structure import ConfigError, StructureConfig
from search.coordinate import CoordinateSampler
from search.proxy import ladder, proxy_fit
from space.knobs import SPACE_VERSION, ModelInfo, device_kind, knobs, suggest, to_params

SAMPLERS = ("coordinate", "tpe", "random", "gp", "nsga2")
PROJECT = pathlib.Path(__file__).resolve().parents[1]
METRICS = ("tok/s", "peak device bytes")  # the objectives of a study, in Optuna's order
HEARTBEAT_S = 10  # a worker that stops beating for 6 heartbeats is dead: its trial fails and its config is enqueued again
# the measurement protocol: Setup fields fixed when a study is created, and the `search start` option that sets each
PROTOCOL = {"n": "-n", "rounds": "--rounds", "prefill": "--no-prefill", "block_layers": "--block-layers", "sampler": "--sampler",
            "seed": "--seed", "objectives": "--objectives", "fixed": "--fix", "beam_budget": "--beam-budget"}


class TrialFailed(Exception):
  """A trial the evaluator classified as failed (Optuna marks it FAIL; the study goes on)."""


class StudyMismatch(ValueError):
  """A study used against what it is: another model file, device model, space version or measurement protocol."""


class BaselineFailed(RuntimeError):
  """The baseline config failed: nothing of the study can be compared with it, so the study stops."""


def config_hash(cfg: StructureConfig) -> str: return hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]


def storage(url: str, heartbeat: float = HEARTBEAT_S, create: bool = False) -> RDBStorage:
  """Optuna's storage on our database (our schema migrated first, so an unreachable or foreign database fails with one line;
  without `create`, a database that does not exist is an error)."""
  open_db(url, create).dispose()
  for attempt in range(3):  # two processes creating Optuna's tables at once: the one that finds them made tries again
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(url, heartbeat_interval=max(1, round(heartbeat)), grace_period=max(3, round(6 * heartbeat)),
                          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=store.RETRIES), engine_kwargs=engine_kwargs(url))
    except Exception as e:  # noqa: BLE001 - Optuna raises bare SQLAlchemy or RuntimeErrors here
      raced = isinstance(e, sqlalchemy.exc.IntegrityError) or isinstance(e, sqlalchemy.exc.SQLAlchemyError) and "already exists" in str(e)
      if attempt == 2 or not raced: raise DBError(f"Optuna cannot use the database: {str(e).splitlines()[0]}") from None
    time.sleep(0.2)


def sampler(name: str, seed: int | None, n_startup: int, info: ModelInfo, device: str, fixed: dict[str, Any]) -> optuna.samplers.BaseSampler:
  """The study's sampler over the space of this model, device kind and pins."""
  warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # TPE's group option
  tpe = lambda: optuna.samplers.TPESampler(multivariate=True, group=True, constant_liar=True, seed=seed, n_startup_trials=n_startup)
  if name == "coordinate": return CoordinateSampler(knobs(info, device), fixed, tpe())
  if name == "tpe": return tpe()
  if name == "random": return optuna.samplers.RandomSampler(seed=seed)
  if name == "nsga2": return optuna.samplers.NSGAIISampler(seed=seed)
  if name == "gp":
    if missing := [m for m in ("torch", "scipy") if importlib.util.find_spec(m) is None]:
      raise ConfigError(f"the gp sampler needs {' and '.join(missing)}, which are not installed: pip install {' '.join(missing)}")
    return optuna.samplers.GPSampler(seed=seed)
  raise ConfigError(f"unknown sampler {name!r}; choose one of: {', '.join(SAMPLERS)}")


@dataclass
class Setup:
  """What a study is: fixed when it is created (but the target `trials`), read back by every worker that joins it."""
  name: str
  model: str  # GGUF path (absolute)
  model_name: str
  device: str  # this worker's device (another worker may use another device of the same model)
  sampler: str = "coordinate"
  objectives: str = "tok_s"  # or "tok_s,peak_memory" (NSGA-II)
  seed: int | None = None
  trials: int = 200  # the study's target number of finished trials
  fixed: dict[str, Any] = field(default_factory=dict)  # knobs pinned for the whole study (not searched)
  n: int = 32  # the evaluator's settings, the same for every trial of the study
  rounds: int = 3
  prefill: bool = True
  block_layers: int | None = None  # the ladder's stage-1 proxy size (default: the leading dense blocks + 2)
  beam_budget: float = 0.0  # BEAM search seconds per trial (past them, kernels not searched before get BEAM=0's heuristics); 0: no limit
  cache_key: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names the study's own tinygrad cache

  @property
  def tinygrad_cache(self) -> str:
    """The study's own tinygrad cache directory on this host: its BEAM choices and compiled programs depend on no other
    study or run, so a trial's compile time and BEAM choice are reproducible within the study."""
    return str(cache_dir() / "tinygrad" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.name)}-{self.cache_key}")

  def evaluator(self, timeout: float = 900, rounds: int | None = None) -> Evaluator:
    ev = Evaluator.for_model(self.model, self.device, n=self.n, rounds=rounds or self.rounds, prefill=self.prefill, timeout=timeout,
                             tinygrad_cache=self.tinygrad_cache, beam_budget=self.beam_budget)
    if self.block_layers: ev.block_layers = min(self.block_layers, ev.total_layers)
    if "," in self.objectives: ev.block_layers = ev.total_layers  # two objectives: no pruning, so no proxy stage to pay for
    return ev

  def baseline(self, info: ModelInfo) -> StructureConfig:
    """The study's first config: every knob at its default but the pinned ones, as the search builds it."""
    defaults = {k.name: k.default for k in knobs(info, self.device) if k.name not in self.fixed}
    return suggest(optuna.trial.FixedTrial(defaults), info, self.device, self.fixed)

  def params(self, cfg: StructureConfig, info: ModelInfo) -> dict[str, Any]:
    """A config as this study's Optuna parameters (the pinned knobs are not parameters)."""
    return {k: v for k, v in to_params(cfg, info, self.device).items() if k not in self.fixed}


@dataclass
class Event:
  """What the live view hears: a trial started, changed phase, waits for a device or other workers, ended; or a note."""
  kind: str  # start | phase | wait | end | note
  number: int
  text: str = ""
  row: Trial | None = None


class Runner:
  """One worker of a study: proposes configs through Optuna, measures them with the evaluator, records everything."""

  def __init__(self, setup: Setup, url: str, ev: Evaluator, info: ModelInfo, remeasure: bool = False,
               on_event: Callable[[Event], None] = lambda e: None, heartbeat: float = HEARTBEAT_S, artifacts=None):
    self.setup, self.ev, self.info, self.remeasure, self.on_event, self.heartbeat = setup, ev, info, remeasure, on_event, heartbeat
    self.artifacts = artifacts  # an Optuna artifact store: each finished trial's metrics, diff and profile for the dashboard
    self.engine = open_db(url, create=False)
    self.multi = "," in setup.objectives
    self.study = optuna.load_study(study_name=setup.name, storage=storage(url, heartbeat))
    # a resumed or second worker must not replay the proposals of the first: its sampler's seed moves with the study's size
    seed = None if setup.seed is None else setup.seed + len(self.study.trials)
    self.study.sampler = sampler(setup.sampler, seed, 8, info, setup.device, setup.fixed)
    if not self.multi: self.study.pruner = optuna.pruners.PercentilePruner(25.0, n_startup_trials=5, n_warmup_steps=0)
    self.baseline = setup.baseline(info)
    with session(self.engine) as s: self.row = bind_device(s, store.get_study(s, setup.name), setup.device)

  def optimize(self, timeout: float | None = None) -> None:
    """Run trials until the study has its target number of finished trials (all workers together) and no trial is left
    running or queued again after a dead worker; or until the timeout passes (no new trial starts after it). The baseline
    is measured again at intervals on the way, and the configs within the noise of the best before the end (search/noise.py)."""
    from search import noise
    t0, said, between = time.monotonic(), "", noise.between_trials(self)
    self._baseline_first()
    while timeout is None or time.monotonic() - t0 < timeout:
      self.reap()
      trials = self.study.get_trials(deepcopy=False)
      running = [t for t in trials if t.state == TrialState.RUNNING]  # between trials, none of them is this worker's
      retries = [t for t in trials if t.state == TrialState.WAITING and "failed_trial" in t.system_attrs]
      done = self.finished(trials)
      if done >= self.setup.trials and not running and not retries:
        if not self.multi: noise.settle(self)
        return
      if done + len(running) >= self.setup.trials and not retries:
        if said != (said := f"waiting for trial{'s' * (len(running) > 1)} {', '.join(str(t.number) for t in running)} of other workers "
                            "to finish, or to fail when their worker stops beating"): self.on_event(Event("wait", -1, said))
        time.sleep(self.heartbeat)
        continue
      self.study.optimize(self.objective, n_trials=1, catch=(TrialFailed,), callbacks=[between], gc_after_trial=False)

  def finished(self, trials: list[FrozenTrial] | None = None) -> int:
    """Trials with an outcome: completed, pruned, or failed by the evaluator (not interrupted, not lost with a dead worker:
    those configs are enqueued again)."""
    if trials is None: trials = self.study.get_trials(deepcopy=False)
    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (t.state == TrialState.FAIL and "failure" in t.user_attrs) for t in trials)

  def _fail_silent(self) -> None:
    """Fail the RUNNING trials that never beat, once the grace period has passed since they started: their worker died
    between starting the trial and its first heartbeat (Optuna's fail_stale_trials only sees trials with a heartbeat, so
    such a trial would stay RUNNING for good). Heartbeats are read from Optuna's own table, in the database we share."""
    storage = self.study._storage
    rdb = getattr(storage, "_backend", storage)  # Optuna wraps its RDB storage in a cache
    grace = rdb.grace_period or 2 * rdb.heartbeat_interval
    now = datetime.datetime.now()
    old = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
           if t.datetime_start is not None and (now - t.datetime_start).total_seconds() > grace]
    if not old: return
    ask = sqlalchemy.text("SELECT trial_id FROM trial_heartbeats WHERE trial_id IN :ids").bindparams(sqlalchemy.bindparam("ids", expanding=True))
    with self.engine.connect() as c: beating = {tid for (tid,) in c.execute(ask, {"ids": [t._trial_id for t in old]})}
    callback = storage.get_heartbeat_stale_trial_callback()
    for t in old:
      if t._trial_id in beating: continue
      try:
        if storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL) and callback is not None:
          callback(self.study, copy.deepcopy(storage.get_trial(t._trial_id)))
      except optuna.exceptions.UpdateFinishedTrialError: pass  # another worker failed it first

  def reap(self) -> None:
    """Fail the trials whose worker stopped beating (Optuna's heartbeat; its retry callback queues their configs again) and
    mark them interrupted in our table."""
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
      optuna.storages.fail_stale_trials(self.study)
      self._fail_silent()
    failed = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    if not failed: return
    why = "its worker stopped beating (killed or cut off): Optuna failed the trial and queued its config again"
    with session(self.engine) as s:
      for t in store.trials(s, self.row):
        if t.state == "running" and t.number in failed and store.mark_interrupted(s, self.row, [t.number], why):
          self.on_event(Event("note", t.number, f"trial {t.number} of worker {t.worker}: {why}"))

  def _baseline_first(self) -> None:
    """Queue the baseline again when the study has no ok measurement of it and none is queued or running (it failed before)."""
    h, params = config_hash(self.baseline), self.setup.params(self.baseline, self.info)
    with session(self.engine) as s: rows = [t for t in store.trials(s, self.row) if t.config_hash == h]
    if any(t.state in ("ok", "running") for t in rows): return
    if any(t.system_attrs.get("fixed_params") == params for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))): return
    self.study.enqueue_trial(params)

  def objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
    cfg = suggest(trial, self.info, self.setup.device, self.setup.fixed)
    h, is_base = config_hash(cfg), cfg == self.baseline
    with session(self.engine) as s:
      row = store.start_trial(s, self.row, trial.number, cfg.to_json(), h, _git(s), f"{socket.gethostname()}:{os.getpid()}",
                              optuna_trial_id=trial._trial_id)
      prior = None if self.remeasure else store.find_measured(s, self.row, h)
      mode = ladder(trial.number, proxy_fit(store.trials(s, self.row)), is_base) if len(self.ev.stages) > 1 else "full"
    if is_base and prior is not None and prior.state != "ok": prior = None  # a failed baseline is measured again, never reused
    trial.set_user_attr("config_hash", h)
    self.on_event(Event("start", trial.number, cfg.to_json(), row))
    try:
      if prior is not None: return self._reuse(trial, row, prior, is_base)
      return self._measure(trial, row, cfg, mode, is_base)
    except TrialFailed as e:
      if is_base: raise BaselineFailed(f"the baseline config failed in trial {trial.number} ({e}): the study stops") from None
      raise
    except ReferenceFailed as e:  # the baseline run that makes the correctness reference failed: this trial cannot be checked
      r = e.result
      with session(self.engine) as s:
        store.finish_trial(s, row, state=r.status if is_base else "interrupted", failure_class=r.status if is_base else None, error_text=str(e))
      raise BaselineFailed(f"the baseline config failed to make the reference in trial {trial.number} ({r.status}: {r.error}): "
                           "the study stops") from None
    except (KeyboardInterrupt, SystemExit):
      with session(self.engine) as s: store.finish_trial(s, row, state="interrupted", error_text="stopped by the user")
      self.study.enqueue_trial(trial.params)  # measured first when the study continues
      raise
    finally:
      if self.artifacts is not None:
        from search.dashboard import attach
        attach(self.artifacts, trial, self.engine, self.row, row)

  def _reuse(self, trial: optuna.Trial, row: Trial, prior: Trial, is_base: bool) -> float | tuple[float, float]:
    with session(self.engine) as s:
      row = store.finish_trial(s, row, state="reused", stage=prior.stage, tok_s=prior.tok_s, block_tok_s=prior.block_tok_s,
                               metrics=prior.metrics, check=prior.check, failure_class=prior.failure_class, error_text=prior.error_text,
                               reused_from=prior)
      est = store.estimates(s, self.row).get(prior.config_hash)  # all its measurements so far, not the first figure alone
    self.on_event(Event("end", trial.number, f"config already measured in trial {prior.number}: its result is reused", row))
    return self._value(trial, prior.state, est.median if est else prior.tok_s, (prior.metrics or {}).get("peak_device_bytes"), prior.error_text,
                       is_base)

  def _measure(self, trial: optuna.Trial, row: Trial, cfg: StructureConfig, mode: str, is_base: bool) -> float | tuple[float, float]:
    t0, spent, block = time.perf_counter(), 0.0, None
    phase = lambda stage: lambda p: self.on_event(Event("phase", trial.number, f"{stage}: {p}"))
    wait = lambda msg: self.on_event(Event("wait", trial.number, msg))
    stages, res = (["full"] if mode == "full" else self.ev.stages), None
    for stage in stages:
      res = self.ev.run(cfg.to_dict(), stage, on_phase=phase(stage), on_wait=wait)
      spent += res.cost_s
      if stage == "block" and len(stages) > 1:
        block = res
        if not res.ok: break
        trial.report(res.metrics["tok_s"], 0)
        if mode == "prune" and trial.should_prune():
          self._record(row, "pruned", res, res, time.perf_counter() - t0 - spent, mode)  # keeps its proxy tok/s
          raise optuna.TrialPruned(f"block proxy {res.metrics['tok_s']:.2f} tok/s is in the bottom quarter")
    assert res is not None
    self._record(row, res.status, res, block, time.perf_counter() - t0 - spent, mode)
    return self._value(trial, res.status, res.tok_s, res.metrics.get("peak_device_bytes"), res.error, is_base)

  def _value(self, trial: optuna.Trial, state: str, tok_s: float | None, peak: int | None, error: str | None,
             is_base: bool) -> float | tuple[float, float]:
    if state not in ("ok", "wrong_output") or (is_base and state != "ok"):
      trial.set_user_attr("failure", state)
      raise TrialFailed(f"{state}: {(error or '').splitlines()[0][:300]}" if error else state)
    trial.set_constraint("wrong_output", 1.0 if state == "wrong_output" else 0.0)  # infeasible: never best
    value = tok_s if state == "ok" else 0.0
    return (value, float(peak or 0)) if self.multi else value

  def _record(self, row: Trial, state: str, res: TrialResult, block: TrialResult | None, overhead: float, mode: str) -> None:
    with session(self.engine) as s:
      env = store.get_or_create_environment(s, _environment(res.env)) if res.env else None
      metrics = {k: v for k, v in res.metrics.items() if k not in ("traceback", "log_tail")}
      metrics["search_overhead_s"], metrics["ladder"] = round(overhead, 3), mode
      if block is not None:
        metrics["block"] = {k: block.metrics.get(k) for k in ("tok_s", "tok_s_min", "tok_s_max", "layers", "kernels_per_token", "beam")}
      phases = {**res.phases, **({f"block_{k}": v for k, v in block.phases.items()} if block is not None and block is not res else {})}
      row = store.finish_trial(
        s, row, state=state, stage=res.spec["stage"], tok_s=res.tok_s if state == "ok" else None,
        block_tok_s=block.metrics.get("tok_s") if block is not None and block.ok else None, metrics=metrics, phases=phases, check=res.check,
        failure_class=state if state not in ("ok", "pruned") else None,
        error_text=(res.error or "") + ("\n" + res.metrics.get("traceback", "") if res.metrics.get("traceback") else "") or None,
        profile=res.profile or None, environment=env)
      if self.row.device_name in ("", None) and res.env: s.get(Study, self.row.id).device_name = self.row.device_name = res.env.get("device_name", "")
    self.on_event(Event("end", row.number, state, row))


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


def bind_device(s, row: Study, device: str) -> Study:
  """A study belongs to one device model: the first worker's binds it; a worker on a device of another model is refused."""
  name = physical(device).name
  if row.device_name and name and row.device_name != name:
    raise StudyMismatch(f"study {row.name!r} is measured on {row.device_name}; {device} here is {name}: results of two device models never "
                        "share a ranking (start a study of its own with --study NEW_NAME)")
  if name and not row.device_name: s.get(Study, row.id).device_name = row.device_name = name
  return row


def check_model(row: Study, path: str) -> None:
  """Every command that measures checks that its model file is the study's, by SHA-256 (cached by path, size and mtime)."""
  if not os.path.isfile(path):
    raise StudyMismatch(f"study {row.name!r} measures {row.model_path}, which is not on this host: pass --model with the path of that file here")
  if (sha := file_sha256(path)) != row.model_sha256:
    raise StudyMismatch(f"{path} (sha256 {sha[:12]}) is not the model file of study {row.name!r} ({row.model_path}, sha256 {row.model_sha256[:12]})")


def study_exists(url: str, name: str) -> bool:
  """Whether the storage holds a study of this name (a storage that does not exist yet holds none; nothing is created); one
  that another process is creating at this moment is waited for."""
  try: engine = open_db(url, create=False)
  except NoDatabase: return False
  with session(engine) as s: found = store.get_study(s, name) is not None
  engine.dispose()
  if found: _wait_created(url, name)
  return found


def _wait_created(url: str, name: str, wait_s: float = 60) -> None:
  """Wait, up to wait_s, until the study has its last setting (create writes our row first, Optuna's study and its settings after)."""
  st, deadline = storage(url), time.monotonic() + wait_s
  while True:
    try:
      if "model_info" in st.get_study_user_attrs(st.get_study_id_from_name(name)): return
    except KeyError: pass
    if time.monotonic() > deadline:
      raise StudyMismatch(f"study {name!r} in {hide_password(url)} is incomplete: the process creating it stopped before it set up Optuna's study")
    time.sleep(0.2)


def create(setup: Setup, url: str, info: ModelInfo, ev: Evaluator) -> bool:
  """Create the study, ours and Optuna's, with its measurement protocol (fixed from now on); False when another process
  created it first (once that one has finished: the caller joins it). Checks what can be checked before anything is
  written: the sampler can be built."""
  if setup.sampler == "coordinate" and "," in setup.objectives:
    raise ConfigError("the coordinate sampler climbs one objective (tok/s): with two, use nsga2 (their default) or tpe")
  sampler(setup.sampler, setup.seed, 8, info, setup.device, setup.fixed)
  sha = file_sha256(setup.model)
  try:
    with session(open_db(url)) as s:
      store.create_study(s, name=setup.name, model_name=setup.model_name, model_path=setup.model, model_sha256=sha,
                         model_bytes=os.path.getsize(setup.model), layers=ev.total_layers, device=setup.device, device_name="",
                         space_version=SPACE_VERSION, objectives=setup.objectives, sampler=setup.sampler)
  except sqlalchemy.exc.IntegrityError:  # our row is the claim: another `search start` made it first
    _wait_created(url, setup.name)
    return False
  directions = ["maximize", "minimize"] if "," in setup.objectives else ["maximize"]
  study = optuna.create_study(study_name=setup.name, storage=storage(url), directions=directions)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    study.set_metric_names(list(METRICS[: len(directions)]))  # the dashboard's axis titles
  for f in fields(setup):
    if f.name != "name": study.set_user_attr(f.name, getattr(setup, f.name))
  study.set_user_attr("model_info", info_to_json(info))  # the last: a study with it is complete (study_exists)
  return True


def check_protocol(setup: Setup, given: dict[str, Any]) -> None:
  """A later run may not change how the study measures: any given setting that differs from the stored one is refused."""
  for name, value in given.items():
    if value is None or value == getattr(setup, name): continue
    flag, was = PROTOCOL[name], getattr(setup, name)
    show = lambda v, flag=flag: (("--no-prefill" if not v else "the prefill graph timed (no --no-prefill)") if flag == "--no-prefill" else
                                 (" ".join(f"--fix {k}={x}" for k, x in v.items()) or "no --fix") if flag == "--fix" else
                                 f"{flag} {v}" if v is not None else f"no {flag}")
    raise StudyMismatch(f"study {setup.name!r} measures with {show(was)}, not {show(value)}: a study's measurement protocol is fixed when "
                        f"it is created; leave {flag} out to continue it, or start a new study with --study NEW_NAME")


def set_target(setup: Setup, url: str, trials: int) -> None:
  """The target number of trials is the one setting a later run may change."""
  optuna.load_study(study_name=setup.name, storage=storage(url)).set_user_attr("trials", trials)
  setup.trials = trials


def check_configs(setup: Setup, info: ModelInfo, configs: list[StructureConfig]) -> None:
  """Configs to enqueue must lie in the study's space and agree with its pinned knobs (checked before anything runs)."""
  for cfg in configs:
    params = to_params(cfg, info, setup.device)
    if any(params.get(k, v) != v for k, v in setup.fixed.items()): raise ConfigError(f"an enqueued config contradicts the pinned knobs {setup.fixed}")


def enqueue(setup: Setup, url: str, info: ModelInfo, configs: list[StructureConfig]) -> None:
  """Queue the baseline and the given configs, each once per study."""
  check_configs(setup, info, configs)
  study = optuna.load_study(study_name=setup.name, storage=storage(url))
  for cfg in [setup.baseline(info), *configs]: study.enqueue_trial(setup.params(cfg, info), skip_if_exists=True)


def load_setup(name: str, url: str, device: str | None = None) -> tuple[Setup, ModelInfo]:
  """A study's setup as its creator stored it; the device may be another of the same kind (a worker checks its model)."""
  try: study = optuna.load_study(study_name=name, storage=storage(url))
  except KeyError: raise StudyMismatch(f"no study named {name!r} in {hide_password(url)}") from None
  attrs = study.user_attrs
  if "cache_key" not in attrs: study.set_user_attr("cache_key", attrs.setdefault("cache_key", uuid.uuid4().hex[:12]))  # a study made before
  setup = Setup(name, **{f.name: attrs[f.name] for f in fields(Setup) if f.name != "name" and f.name in attrs})  # a later field: its default
  if device is not None:
    if device_kind(device) != device_kind(setup.device): raise StudyMismatch(f"study {name!r} runs on {device_kind(setup.device)}, not {device}")
    setup.device = device
  return setup, info_from_json(attrs["model_info"])


def measuring_setup(name: str, url: str, device: str | None = None, model: str | None = None) -> tuple[Setup, ModelInfo]:
  """The setup of a study about to be measured on this host: its model file (the stored path, or `model`, this host's copy)
  checked against the study's by SHA-256 first."""
  setup, info = load_setup(name, url, device)
  setup.model = model or setup.model
  with session(open_db(url, create=False)) as s: check_model(store.get_study(s, name), setup.model)
  return setup, info


def info_to_json(info: ModelInfo) -> str:
  """Every field of the model's ModelInfo: a worker that joins or continues the study sees the space its creator saw."""
  return json.dumps({f.name: sorted(v) if isinstance(v := getattr(info, f.name), frozenset) else v for f in fields(ModelInfo)})


def info_from_json(text: str) -> ModelInfo:
  """A stored ModelInfo; a field an older study did not store keeps its default."""
  d = json.loads(text)
  tuples = lambda v: {k: tuple(x) for k, x in v.items()} if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v
  return ModelInfo(**{f.name: frozenset(d[f.name]) if f.name == "mergeable" else tuples(d[f.name]) for f in fields(ModelInfo) if f.name in d})


def model_info(path: str) -> ModelInfo: return ModelInfo.from_gguf(GGUFFile(path))
