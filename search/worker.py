"""A worker of a study: Optuna proposes configs, the evaluator measures them (block proxy, then the full model), and
every trial is recorded with the code that produced it beside Optuna's own tables. The worker also measures the noise:
the baseline again at intervals, and the configs within the noise of the best before the study ends (search/noise.py).

Several workers (`search worker`, or `search start --devices`) may join one study on PostgreSQL; the evaluator's device
lock keeps the benchmarks of one device sequential. A worker that dies stops beating: after the grace period any worker
fails its trial (Optuna's heartbeat) and its config is queued again; a worker does not end while trials of other workers
are running, so a dead one's trial is always failed and measured again, whichever worker is left. A worker that was only
stalled and comes back stores its late figure as a measurement of the config; its trial stays failed. A trial process
killed from outside (a signal, the OOM killer) has its config queued again too, up to store.RETRIES times, whichever
sampler runs; such trials do not count toward the target. The worker tells its
listeners what happens (search/events.py); it knows no view.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import shlex
import socket
import time
import warnings
from collections.abc import Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from db import store
from db.capture import git_state
from db.engine import failure, open_db, session
from db.models import GitState, Study, Trial
from evaluator.result import TrialResult
from evaluator.runner import Evaluator, ReferenceFailed
from model.filehash import file_identity
from model.structure import StructureConfig
from search import noise
from search.events import Event, Listener
from search.proxy import ladder, proxy_fit
from search.study import HEARTBEAT_S, Setup, StudyMismatch, bind_device, check_model, sampler, storage, stored_baseline
from space.knobs import ModelInfo, suggest

PROJECT = pathlib.Path(__file__).resolve().parents[1]


class TrialFailed(Exception):
  """A trial the evaluator classified as failed (Optuna marks it FAIL; the study goes on)."""


class LateResult(TrialFailed):
  """A trial's result came after its trial was failed (its worker stalled past the grace period): recorded as a
  measurement of its config, while the trial stays failed and its config is measured again as another trial."""


class BaselineFailed(RuntimeError):
  """The baseline config failed: nothing of the study can be compared with it, so the study stops."""


class ListenerFailed(RuntimeError):
  """A listener could not write its files (the dashboard's artifacts: a full or read-only disk): the trial it heard of
  is stored in both ledgers first, then the worker stops."""


class Runner:
  """One worker of a study: proposes configs through Optuna, measures them with the evaluator, records everything, and
  tells its listeners (search/events.py) as it goes."""

  def __init__(self, setup: Setup, url: str, ev: Evaluator, info: ModelInfo, remeasure: bool = False,
               listeners: Sequence[Listener] = (), heartbeat: float = HEARTBEAT_S):
    self.setup, self.ev, self.info, self.remeasure, self.listeners, self.heartbeat = (setup, ev, info, remeasure,
                                                                                      listeners, heartbeat)
    self.engine, self.url = open_db(url, create=False), url
    self.multi = "," in setup.objectives
    self.storage = storage(url, heartbeat)
    self.study = optuna.load_study(study_name=setup.name, storage=self.storage)
    self.study_id = self.storage.get_study_id_from_name(setup.name)
    # a resumed or second worker must not replay the proposals of the first: its sampler's seed moves with the
    # study's size
    seed = None if setup.seed is None else setup.seed + len(self.study.trials)
    self.study.sampler = sampler(setup.sampler, seed, 8, setup.knobs(info), setup.fixed)
    if not self.multi: self.study.pruner = optuna.pruners.PercentilePruner(25.0, n_startup_trials=5, n_warmup_steps=0)
    self.baseline = stored_baseline(url, setup, info)
    self.late: int | None = None  # the trial whose result came late (its Optuna trial was failed meanwhile)
    self.broken: OSError | None = None  # a listener's failure, raised once the trial it heard of is told to Optuna
    with session(self.engine) as s: self.row = bind_device(s, store.get_study(s, setup.name), setup.device)
    self.identity = file_identity(setup.model)  # the file measuring_setup checked by SHA-256

  def emit(self, e: Event) -> None:
    for listen in self.listeners:
      try: listen(e)
      except OSError as err: self.broken = self.broken or err

  def _listeners_ok(self) -> None:
    if self.broken is not None:
      raise ListenerFailed(f"cannot write the dashboard's artifacts ({self.broken.strerror or self.broken}: "
                           f"{self.broken.filename or ''}); the trials so far are stored, and `search start --study "
                           f"{shlex.quote(self.setup.name)}` continues once they can be written")

  def say(self, text: str) -> None: self.emit(Event("note", -1, text))

  def optimize(self, timeout: float | None = None) -> None:
    """Run trials until the study has its target number of finished trials (all workers together) and no trial is left
    running or queued again after a dead worker; or until the timeout passes (no new trial starts after it). The
    baseline is measured again every noise.repeat_every(target) finished trials, and the configs within the noise of the
    best before the end."""
    t0, said = time.monotonic(), ""
    self._baseline_first()
    while timeout is None or time.monotonic() - t0 < timeout:
      self._listeners_ok()
      self.reap()
      trials = self.study.get_trials(deepcopy=False)
      running = [t for t in trials if t.state == TrialState.RUNNING]  # between trials, none of them is this worker's
      retries = [t for t in trials
                 if t.state == TrialState.WAITING and ("failed_trial" in t.system_attrs or "retry_of" in t.user_attrs)]
      done = self.finished(trials)
      if done >= self.setup.trials and not running and not retries:
        if not self.multi and noise.settle(self.ev, self.engine, self.row, self.baseline.hash,
                                           max(2, self.setup.trials // 10), self.say):
          self.emit(Event("measured", -1, "the configs within the noise of the best"))
        return self._listeners_ok()
      if done + len(running) >= self.setup.trials and not retries:
        waiting = ", ".join(str(t.number) for t in running)
        if said != (said := f"waiting for trial{'s' * (len(running) > 1)} {waiting} of other workers to finish, or to "
                            "fail when their worker stops beating"): self.emit(Event("wait", -1, said))
        time.sleep(self.heartbeat)
        continue
      self._same_model()
      try: self.study.optimize(self.objective, n_trials=1, catch=(TrialFailed,), gc_after_trial=False)
      except ValueError:  # Optuna cannot tell a trial it failed already: the late result is recorded (objective), go on
        if self.late is None: raise
      self.late = None
      if (done := self.finished()) and done % noise.repeat_every(self.setup.trials) == 0 and done < self.setup.trials \
          and noise.measure(self.ev, self.engine, self.row, self.baseline, self.baseline.hash, None,
                            f"baseline re-measured after {done} trials", self.say):
        self.emit(Event("measured", -1, "the baseline"))

  def _same_model(self) -> None:
    """Before every trial, the model file is the study's: a file whose identity changed (replaced, rewritten, even at
    its size with its mtime set back) is hashed again, and one that is not the study's stops the worker before a trial
    of another file is ranked with the study's."""
    try: now = file_identity(self.setup.model)
    except OSError: now = None  # gone: check_model says so
    if now == self.identity: return
    try: check_model(self.row, self.setup.model)
    except StudyMismatch as e: raise StudyMismatch(f"the model file changed during the study: {e}") from None
    self.identity = now

  def finished(self, trials: list[FrozenTrial] | None = None) -> int:
    """Trials with an outcome: completed, pruned, or failed by the evaluator (not interrupted, not lost with a dead
    worker, not killed from outside while the config has retries left: those configs are enqueued again)."""
    if trials is None: trials = self.study.get_trials(deepcopy=False)
    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and "failure" in t.user_attrs) for t in trials)

  def _fail_unclaimed(self) -> None:
    """Fail the RUNNING trials that no worker took up, once the grace period has passed since they started: a trial a
    worker takes up has its ss_trial row, written after Optuna's heartbeat thread started beating for it, so Optuna's
    heartbeat fails it when its worker dies; a worker that died before that leaves a trial that never beat, which
    Optuna's fail_stale_trials does not see."""
    now = datetime.datetime.now()
    old = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
           if t.datetime_start is not None and (now - t.datetime_start).total_seconds() > self.storage.grace_period]
    if not old: return
    with session(self.engine) as s: taken = {t.number for t in store.trials(s, self.row)}
    retry = self.storage.get_heartbeat_stale_trial_callback()
    for t in old:
      if t.number in taken: continue
      trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, t.number)
      try:
        if self.storage.set_trial_state_values(trial_id, state=TrialState.FAIL) and retry is not None:
          retry(self.study, self.storage.get_trial(trial_id))
      except optuna.exceptions.UpdateFinishedTrialError: pass  # another worker failed it first

  def reap(self) -> None:
    """Fail the trials whose worker stopped beating (Optuna's heartbeat; its retry callback queues their configs again)
    and mark them interrupted in our table."""
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
      optuna.storages.fail_stale_trials(self.study)
      self._fail_unclaimed()
    failed = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    if not failed: return
    why = "its worker stopped beating (killed or cut off): Optuna failed the trial and queued its config again"
    with session(self.engine) as s:
      for t in store.trials(s, self.row):
        if t.state == "running" and t.number in failed and store.mark_interrupted(s, self.row, [t.number], why):
          self.emit(Event("note", t.number, f"trial {t.number} of worker {t.worker}: {why}"))

  def _baseline_first(self) -> None:
    """Queue the baseline again when the study has no ok measurement of it and none is queued or running (it failed
    before)."""
    params = self.setup.params(self.baseline, self.info)
    with session(self.engine) as s: rows = [t for t in store.trials(s, self.row) if t.config_hash == self.baseline.hash]
    if any(t.state in ("ok", "running") for t in rows): return
    if any(t.system_attrs.get("fixed_params") == params
           for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))): return
    self.study.enqueue_trial(params)

  def objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
    cfg = suggest(trial, self.setup.knobs(self.info), self.setup.fixed)
    h, is_base = cfg.hash, cfg == self.baseline
    trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)
    with session(self.engine) as s:
      row = store.start_trial(s, self.row, trial.number, cfg.to_json(), h, _git(s),
                              f"{socket.gethostname()}:{os.getpid()}", optuna_trial_id=trial_id)
      prior = None if self.remeasure else store.find_measured(s, self.row, h)
      mode = ladder(trial.number, proxy_fit(store.trials(s, self.row)), is_base) if len(self.ev.stages) > 1 else "full"
    # a failed baseline is measured again, never reused
    if is_base and prior is not None and prior.state != "ok": prior = None
    trial.set_user_attr("config_hash", h)
    self.emit(Event("start", trial.number, cfg.to_json(), row))
    try:
      if prior is not None: return self._reuse(trial, row, prior, is_base)
      return self._measure(trial, row, cfg, mode, is_base)
    except LateResult: raise  # even the baseline's: its retry is measured
    except TrialFailed as e:
      if is_base:
        raise BaselineFailed(f"the baseline config failed in trial {trial.number} ({e}): the study stops") from None
      raise
    # the baseline run that makes the correctness reference failed: this trial cannot be checked
    except ReferenceFailed as e:
      r = e.result
      with session(self.engine) as s:
        row = store.finish_trial(s, row, state=r.status if is_base else "interrupted", failure_class=r.status if is_base
                                 else None, error_text=str(e))
      if is_base: self.emit(Event("end", trial.number, r.status, row))
      raise BaselineFailed(f"the baseline config failed to make the reference in trial {trial.number} ({r.status}: "
                           f"{r.error}): the study stops") from None
    except optuna.TrialPruned: raise  # recorded as pruned, its proxy figure kept (_measure)
    except (KeyboardInterrupt, SystemExit):
      with session(self.engine) as s: store.finish_trial(s, row, state="interrupted", error_text="stopped by the user")
      self.study.enqueue_trial(trial.params)  # measured first when the study continues
      raise
    except Exception as e:  # Optuna fails the trial as it stops the worker (a corrupt cache file): ours says so too
      if failure(e, self.url) is None:
        with session(self.engine) as s: store.finish_trial(s, row, state="interrupted", error_text=str(e))
      raise

  def _reuse(self, trial: optuna.Trial, row: Trial, prior: Trial, is_base: bool) -> float | tuple[float, float]:
    with session(self.engine) as s:
      row = store.finish_trial(s, row, state="reused", stage=prior.stage, tok_s=prior.tok_s,
                               block_tok_s=prior.block_tok_s, metrics=prior.metrics, check=prior.check,
                               failure_class=prior.failure_class, error_text=prior.error_text, reused_from=prior)
      # all its measurements so far, not the first figure alone
      est = store.estimates(s, self.row).get(prior.config_hash)
    self.emit(Event("end", trial.number, f"config already measured in trial {prior.number}: its result is reused", row))
    return self._value(trial, prior.state, est.median if est else prior.tok_s, prior.metrics or {}, prior.error_text,
                       is_base)

  def _measure(self, trial: optuna.Trial, row: Trial, cfg: StructureConfig, mode: str,
               is_base: bool) -> float | tuple[float, float]:
    t0, spent, block = time.perf_counter(), 0.0, None
    phase = lambda stage: lambda p: self.emit(Event("phase", trial.number, f"{stage}: {p}"))
    wait = lambda msg: self.emit(Event("wait", trial.number, msg))
    stages, res = (["full"] if mode == "full" else self.ev.stages), None
    for stage in stages:
      # the baseline's per-kernel profile, which every config's kernel diff is read against
      res = self.ev.run(cfg.to_dict(), stage, profile=is_base and stage == "full", on_phase=phase(stage), on_wait=wait)
      spent += res.cost_s
      self._check_late(trial, row, res)
      if stage == "block" and len(stages) > 1:
        block = res
        if not res.ok: break
        trial.report(res.metrics["tok_s"], 0)
        if mode == "prune" and trial.should_prune():
          self._record(row, "pruned", res, res, time.perf_counter() - t0 - spent, mode)  # keeps its proxy tok/s
          raise optuna.TrialPruned(f"block proxy {res.metrics['tok_s']:.2f} tok/s is in the bottom quarter")
    assert res is not None
    self._record(row, res.status, res, block, time.perf_counter() - t0 - spent, mode)
    again = res.status == "killed" and not is_base and self._again(trial, row)
    return self._value(trial, res.status, res.tok_s, res.metrics, res.error, is_base, again)

  def _again(self, trial: optuna.Trial, row: Trial) -> bool:
    """Queue a config killed from outside (a signal, the kernel's OOM killer) again, whichever sampler runs, while it
    has been killed at most store.RETRIES times; True when queued (the trial then does not count toward the target)."""
    with session(self.engine) as s:
      kills = sum(t.config_hash == row.config_hash and t.state == "killed" for t in store.trials(s, self.row))
    if kills > store.RETRIES: return False
    self.study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    self.say(f"trial {trial.number} was killed from outside: its config is measured again "
             f"({kills} of {store.RETRIES + 1} tries)")
    return True

  def _check_late(self, trial: optuna.Trial, row: Trial, res: TrialResult) -> None:
    """Raise LateResult when another worker failed this trial while it ran (this worker stalled past the grace period):
    its figure is stored as a measurement of its config, and the trial stays interrupted, never a second verdict."""
    trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)
    if not self.storage.get_trial(trial_id).state.is_finished(): return
    why = "its result came after its trial was failed (its worker stalled): stored as a measurement of its config"
    with session(self.engine) as s:
      store.mark_interrupted(s, self.row, [trial.number], "its worker stopped beating (killed or cut off)")
      if res.ok and res.tok_s is not None:
        store.add_measurement(s, self.row.id, row.config_hash, res.spec["stage"], res.tok_s, "trial", trial=row,
                              rounds=res.metrics.get("tok_s_rounds"), wall_s=res.cost_s,
                              **store.conditions(res.metrics, res.phases))
      t = s.get(Trial, row.id)
      t.error_text = f"{t.error_text or ''}; {why}" if res.ok else t.error_text
    self.late = trial.number
    self.emit(Event("note", trial.number, f"trial {trial.number}: {why if res.ok else 'failed meanwhile'}"))
    raise LateResult(f"trial {trial.number} was failed while it ran")

  def _value(self, trial: optuna.Trial, state: str, tok_s: float | None, metrics: dict, error: str | None,
             is_base: bool, again: bool = False) -> float | tuple[float, float]:
    """The trial's value for Optuna; a failure raises TrialFailed, and counts toward the target unless `again` (its
    config is queued again)."""
    if state not in ("ok", "wrong_output") or (is_base and state != "ok"):
      trial.set_user_attr("retried" if again else "failure", state)
      raise TrialFailed(f"{state}: {(error or '').splitlines()[0][:300]}" if error else state)
    trial.set_constraint("wrong_output", 1.0 if state == "wrong_output" else 0.0)  # infeasible: never best
    value = tok_s if state == "ok" else 0.0
    if not self.multi: return value
    figure = {"tok_s": value, "peak_memory": float(metrics.get("peak_device_bytes") or 0),
              "prefill_tok_s": float(metrics.get("prefill_tok_s") or 0) if state == "ok" else 0.0}
    return tuple(figure[o] for o in self.setup.objectives.split(","))

  def _record(self, row: Trial, state: str, res: TrialResult, block: TrialResult | None, overhead: float,
              mode: str) -> None:
    with session(self.engine) as s:
      env = store.get_or_create_environment(s, _environment(res.env)) if res.env else None
      metrics = {k: v for k, v in res.metrics.items() if k not in ("traceback", "log_tail")}
      metrics["search_overhead_s"], metrics["ladder"] = round(overhead, 3), mode
      if block is not None:
        metrics["block"] = {k: block.metrics.get(k)
                            for k in ("tok_s", "tok_s_min", "tok_s_max", "layers", "kernels_per_token", "beam",
                                      "host_load")}
      phases = {**res.phases, **({f"block_{k}": v for k, v in block.phases.items()} if block is not None
                                 and block is not res else {})}
      row = store.finish_trial(
        s, row, state=state, stage=res.spec["stage"], tok_s=res.tok_s if state == "ok" else None,
        block_tok_s=block.metrics.get("tok_s") if block is not None and block.ok
        else None, metrics=metrics, phases=phases, check=res.check, failure_class=state if state not in ("ok", "pruned")
        else None, error_text=(res.error or "")
        + ("\n" + res.metrics.get("traceback", "") if res.metrics.get("traceback") else "") or None, profile=res.profile
        or None, environment=env)
      if self.row.device_name in ("", None) and res.env:
        s.get(Study, self.row.id).device_name = self.row.device_name = res.env.get("device_name", "")
    self.emit(Event("end", row.number, state, row))


def _git(s) -> GitState | None:
  state = git_state(PROJECT)
  return store.get_or_create_git_state(s, state) if state else None


def _environment(env: dict) -> dict:
  """The trial process's environment as an ss_environment row: tinygrad's commit and diff when it runs from a git
  checkout."""
  tg = pathlib.Path(env.get("tinygrad_path", ""))
  state = git_state(tg) if (tg / ".git").exists() else None
  return {"device": env["device"], "device_name": env.get("device_name", ""), "driver": env.get("driver", ""),
          "tinygrad_version": env.get("tinygrad_version", ""), "tinygrad_commit": state["commit"] if state else None,
          "tinygrad_diff": state["diff"] if state
          else None, "python": env["python"], "host": env["host"], "platform": env["platform"]}
