"""A study as it is defined: one model file on one device model, its measurement protocol and its one baseline config,
fixed when it is created and read back by every worker that joins it (search/worker.py) and every command that reads it.

Optuna's RDB storage and our ss_ tables share one database URL. Optuna's study keeps the protocol (its user attributes:
Setup's fields) and the trials' parameters and states; ss_study keeps what the views read: the model file, the device
model and the baseline (docs/architecture.md says which ledger owns which fact).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import time
import uuid
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

from db import store
from db.engine import DBError, NoDatabase, engine_kwargs, hide_password, open_db, reconnecting, session
from db.models import Study
from evaluator.devices import physical
from evaluator.runner import Evaluator
from model.filehash import file_sha256
from model.gguf_file import GGUFFile
from model.registry import cache_dir
from model.structure import KNOBS, ConfigError, StructureConfig
from model.workload import PROMPT, Workload
from search.coordinate import CoordinateSampler
from space.knobs import SPACE_VERSION, Knob, ModelInfo, defaults, device_kind, knobs, to_config, to_params

# Optuna's INFO lines (a study created, each trial's value) would repeat what the live view and the views say
optuna.logging.set_verbosity(optuna.logging.ERROR)

SAMPLERS = ("coordinate", "tpe", "random", "gp", "nsga2")
# the objectives a study may have (--objectives: tok_s first, then any of the others), each Optuna's direction and the
# dashboard's axis title; prefill_tok_s is the timed prefill of the workload's prompt (model/bench.py prepare)
OBJECTIVES = {"tok_s": ("maximize", "tok/s"), "prefill_tok_s": ("maximize", "prefill tok/s"),
              "peak_memory": ("minimize", "peak device bytes")}
# a worker that stops beating for 6 heartbeats is dead: its trial fails and its config is enqueued again
HEARTBEAT_S = 10
# the measurement protocol: Setup fields fixed when a study is created, and the `search start` option that sets each
PROTOCOL = {"n": "-n", "rounds": "--rounds", "prefill": "--no-prefill", "block_layers": "--block-layers",
            "sampler": "--sampler", "seed": "--seed", "objectives": "--objectives", "fixed": "--fix",
            "beam_budget": "--beam-budget", "family": "--family", "exact": "--exact", "context": "--context",
            "prompt": "--prompt", "min_top1": "--min-top1", "max_kl": "--max-kl"}


class StudyMismatch(ValueError):
  """A study used against what it is: another model file, device model, space version or measurement protocol."""


class _Storage(RDBStorage):
  """Optuna's storage, where a heartbeat that cannot be written (the database full, read-only, away) is a missed beat,
  as the grace period allows, not an exception in Optuna's heartbeat thread."""

  def record_heartbeat(self, trial_id: int) -> None:
    try: super().record_heartbeat(trial_id)
    except optuna.exceptions.StorageInternalError: pass


def storage(url: str, heartbeat: float = HEARTBEAT_S, create: bool = False) -> RDBStorage:
  """Optuna's storage on our database (our schema migrated first, so an unreachable or foreign database fails with one
  line; without `create`, a database that does not exist is an error)."""
  open_db(url, create).dispose()
  for attempt in range(3):  # two processes creating Optuna's tables at once: the one that finds them made tries again
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        st = _Storage(url, heartbeat_interval=max(1, round(heartbeat)), grace_period=max(3, round(6 * heartbeat)),
                      heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=store.RETRIES),
                      engine_kwargs=engine_kwargs(url))
      reconnecting(st.engine, reached=True)  # a server that goes away later is waited for
      return st
    except Exception as e:  # noqa: BLE001 - Optuna raises bare SQLAlchemy or RuntimeErrors here
      raced = (isinstance(e, sqlalchemy.exc.IntegrityError) or isinstance(e, sqlalchemy.exc.SQLAlchemyError)
               and "already exists" in str(e))
      if attempt == 2 or not raced: raise DBError(f"Optuna cannot use the database: {str(e).splitlines()[0]}") from None
    time.sleep(0.2)


def sampler(name: str, seed: int | None, n_startup: int, ks: list[Knob],
            fixed: dict[str, Any]) -> optuna.samplers.BaseSampler:
  """A study's sampler over its knobs `ks` and pins."""
  warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # TPE's group option
  tpe = lambda: optuna.samplers.TPESampler(multivariate=True, group=True, constant_liar=True, seed=seed,
                                           n_startup_trials=n_startup)
  if name == "coordinate": return CoordinateSampler(ks, fixed, tpe())
  if name == "tpe": return tpe()
  if name == "random": return optuna.samplers.RandomSampler(seed=seed)
  if name == "nsga2": return optuna.samplers.NSGAIISampler(seed=seed)
  if name == "gp":
    if missing := [m for m in ("torch", "scipy") if importlib.util.find_spec(m) is None]:
      raise ConfigError(f"the gp sampler needs {' and '.join(missing)}, which are not installed: pip install "
                        f"{' '.join(missing)}")
    return optuna.samplers.GPSampler(seed=seed)
  raise ConfigError(f"unknown sampler {name!r}; choose one of: {', '.join(SAMPLERS)}")


def tinygrad_cache(name: str, key: str) -> str:
  """A study's own tinygrad cache directory on this host: its BEAM choices and compiled programs depend on no other
  study or run, so a trial's compile time and BEAM choice are reproducible within the study."""
  return str(cache_dir() / "tinygrad" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key}")


@dataclass
class Setup:
  """What a study is: fixed when it is created (but the target `trials`), read back by every worker that joins it."""
  name: str
  model: str  # GGUF path (absolute)
  model_name: str
  device: str  # this worker's device (another worker may use another device of the same model)
  sampler: str = "coordinate"
  objectives: str = "tok_s"  # or tok_s and others of OBJECTIVES, comma-separated (NSGA-II)
  seed: int | None = None
  trials: int = 200  # the study's target number of finished trials
  fixed: dict[str, Any] = field(default_factory=dict)  # knobs pinned for the whole study (not searched)
  n: int = 32  # the evaluator's settings, the same for every trial of the study
  rounds: int = 3
  prefill: bool = True
  block_layers: int | None = None  # the ladder's stage-1 proxy size (default: the leading dense blocks + 2)
  # BEAM search seconds per trial (past them, kernels not searched before get BEAM=0's heuristics); 0: no limit
  beam_budget: float = 0.0
  exact: bool = False  # held to exact configs (--exact): exact_pins are among `fixed`
  # the backends the study searches (model/backends/catalog.py FAMILIES): all that run on its device, or the
  # portable ones
  family: str = "all"
  # the workload (model/workload.py): the prompt prefilled before decoding, the cache's positions when decode is timed
  prompt: int = PROMPT
  context: int = 0
  # the accuracy floor (search/leaderboard.py Floor): configs below it are never the best nor exported; None: none
  min_top1: float | None = None
  max_kl: float | None = None
  cache_key: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names the study's own tinygrad cache

  @property
  def workload(self) -> Workload: return Workload(self.prompt, self.context)

  @property
  def tinygrad_cache(self) -> str: return tinygrad_cache(self.name, self.cache_key)

  def evaluator(self, timeout: float = 900, rounds: int | None = None) -> Evaluator:
    ev = Evaluator.for_model(self.model, self.device, n=self.n, rounds=rounds
                             or self.rounds, prefill=self.prefill, timeout=timeout, tinygrad_cache=self.tinygrad_cache,
                             beam_budget=self.beam_budget, prompt_len=self.prompt, context=self.context)
    if self.block_layers: ev.block_layers = min(self.block_layers, ev.total_layers)
    # two objectives: no pruning, so no proxy stage to pay for
    if "," in self.objectives: ev.block_layers = ev.total_layers
    return ev

  def knobs(self, info: ModelInfo) -> list[Knob]:
    """The study's space: the knobs of its model on its device kind with its backend family; how the prompt is
    prefilled only where the prompt's speed is an objective (elsewhere those knobs change nothing it measures)."""
    timed = self.prefill and "prefill_tok_s" in self.objectives.split(",")
    return [k for k in knobs(info, self.device, self.family) if timed or not k.name.startswith("prefill_")]

  def baseline(self, info: ModelInfo) -> StructureConfig:
    """The baseline a new study stores: every knob at its default but the pinned ones."""
    return to_config(defaults(self.knobs(info), self.fixed))

  def params(self, cfg: StructureConfig, info: ModelInfo) -> dict[str, Any]:
    """A config as this study's Optuna parameters (the pinned knobs are not parameters)."""
    return {k: v for k, v in to_params(cfg, info, self.device, self.family).items() if k not in self.fixed}


def bind_device(s, row: Study, device: str) -> Study:
  """A study belongs to one device model: the first worker's binds it; a worker on a device of another model is
  refused."""
  name = physical(device).name
  if row.device_name and name and row.device_name != name:
    raise StudyMismatch(f"study {row.name!r} is measured on {row.device_name}; {device} here is {name}: results of two "
                        "device models never share a ranking (start a study of its own with --study NEW_NAME)")
  if name and not row.device_name: s.get(Study, row.id).device_name = row.device_name = name
  return row


def check_model(row: Study, path: str) -> None:
  """Every command that measures checks that its model file is the study's, by SHA-256 (cached by the file's identity:
  model.filehash.file_identity)."""
  if not os.path.isfile(path):
    raise StudyMismatch(f"study {row.name!r} measures {row.model_path}, which is not on this host: pass --model with "
                        "the path of that file here")
  if (sha := file_sha256(path)) != row.model_sha256:
    raise StudyMismatch(f"{path} (sha256 {sha[:12]}) is not the model file of study {row.name!r} ({row.model_path}, "
                        f"sha256 {row.model_sha256[:12]})")


def study_exists(url: str, name: str) -> bool:
  """Whether the storage holds a study of this name (a storage that does not exist yet holds none; nothing is created);
  one that another process is creating at this moment is waited for."""
  try: engine = open_db(url, create=False)
  except NoDatabase: return False
  with session(engine) as s: found = store.get_study(s, name) is not None
  engine.dispose()
  if found: _wait_created(url, name)
  return found


def _wait_created(url: str, name: str, wait_s: float = 60) -> None:
  """Wait, up to wait_s, until the study has its last setting (create writes our row first, Optuna's study and its
  settings after)."""
  st, deadline = storage(url), time.monotonic() + wait_s
  while True:
    try:
      if "model_info" in st.get_study_user_attrs(st.get_study_id_from_name(name)): return
    except KeyError: pass
    if time.monotonic() > deadline:
      raise StudyMismatch(f"study {name!r} in {hide_password(url)} is incomplete: the process creating it stopped "
                          "before it set up Optuna's study")
    time.sleep(0.2)


def create(setup: Setup, url: str, info: ModelInfo, ev: Evaluator) -> bool:
  """Create the study, ours and Optuna's, with its measurement protocol and its baseline (fixed from now on); False when
  another process created it first (once that one has finished: the caller joins it). Checks what can be checked before
  anything is written: the sampler can be built."""
  if setup.sampler == "coordinate" and "," in setup.objectives:
    raise ConfigError("the coordinate sampler climbs one objective (tok/s): with two, use nsga2 (their default) or tpe")
  if "prefill_tok_s" in setup.objectives and not setup.prefill:
    raise ConfigError("the prefill_tok_s objective times the prompt's prefill: leave out --no-prefill")
  sampler(setup.sampler, setup.seed, 8, setup.knobs(info), setup.fixed)
  sha, base = file_sha256(setup.model), setup.baseline(info)
  try:
    with session(open_db(url)) as s:
      store.create_study(s, name=setup.name, model_name=setup.model_name, model_path=setup.model, model_sha256=sha,
                         model_bytes=os.path.getsize(setup.model), layers=ev.total_layers, device=setup.device,
                         device_name="", space_version=SPACE_VERSION, objectives=setup.objectives,
                         sampler=setup.sampler, baseline_config=base.to_json(), baseline_hash=base.hash)
  except sqlalchemy.exc.IntegrityError:  # our row is the claim: another `search start` made it first
    _wait_created(url, setup.name)
    return False
  directions = [OBJECTIVES[o][0] for o in setup.objectives.split(",")]
  study = optuna.create_study(study_name=setup.name, storage=storage(url), directions=directions)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    study.set_metric_names([OBJECTIVES[o][1] for o in setup.objectives.split(",")])  # the dashboard's axis titles
  for f in fields(setup):
    if f.name != "name": study.set_user_attr(f.name, getattr(setup, f.name))
  study.set_user_attr("model_info", info_to_json(info))  # the last: a study with it is complete (study_exists)
  return True


def exact_pins(info: ModelInfo, device: str, family: str = "all") -> dict[str, Any]:
  """The pins that hold a study to exact configs (`search start --exact`): every knob of the space with a value of
  precision class q8 (8-bit activations), at its default."""
  return {k.name: k.default for k in knobs(info, device, family)
          if any(KNOBS[k.name].precision_of(c) == "q8" for c in k.choices)}


def check_protocol(setup: Setup, given: dict[str, Any]) -> None:
  """A later run may not change how the study measures: any given setting that differs from the stored one is
  refused."""
  for name, value in given.items():
    if value is None or value == getattr(setup, name): continue
    flag, was = PROTOCOL[name], getattr(setup, name)
    show = lambda v, flag=flag: (("--no-prefill" if not v else "the prefill graph timed (no --no-prefill)")
                                 if flag == "--no-prefill" else
                                 ("--exact" if v else "8-bit activations allowed (no --exact)")
                                 if flag == "--exact" else
                                 f"{flag} {v}" + (" (decode right after the prompt)" if not v else "")
                                 if flag == "--context" else
                                 (" ".join(f"--fix {k}={x}" for k, x in v.items()) or "no --fix") if flag == "--fix"
                                 else
                                 f"{flag} {v}" if v is not None else f"no {flag}")
    raise StudyMismatch(f"study {setup.name!r} measures with {show(was)}, not {show(value)}: a study's measurement "
                        f"protocol is fixed when it is created; leave {flag} out to continue it, or start a new study "
                        "with --study NEW_NAME")


def study_attrs(s: sqlalchemy.orm.Session, name: str) -> dict[str, Any]:
  """A study's protocol as its creator stored it (Optuna's user attributes, through Optuna's public storage on the
  session's database, read only: a caller inside a writing transaction is not blocked by a schema check)."""
  url = s.get_bind().url.render_as_string(hide_password=False)
  st = RDBStorage(url, engine_kwargs=engine_kwargs(url), skip_compatibility_check=True, skip_table_creation=True)
  try: return st.get_study_user_attrs(st.get_study_id_from_name(name))
  finally: st.engine.dispose()


def workload_of(attrs: dict[str, Any]) -> Workload:
  """The workload in a study's stored protocol; the default for a study made before workloads."""
  return Workload(attrs.get("prompt", PROMPT), attrs.get("context", 0))


def study_workload(s: sqlalchemy.orm.Session, name: str) -> Workload:
  """A study's workload: what every view shows."""
  return workload_of(study_attrs(s, name))


def set_target(setup: Setup, url: str, trials: int) -> None:
  """The target number of trials is the one setting a later run may change."""
  optuna.load_study(study_name=setup.name, storage=storage(url)).set_user_attr("trials", trials)
  setup.trials = trials


def stored_baseline(url: str, setup: Setup, info: ModelInfo) -> StructureConfig:
  """The study's one baseline, as it was stored at creation (a study made before baselines were stored, with no trial to
  take it from, stores its defaults and pins now)."""
  with session(open_db(url, create=False)) as s:
    row = s.get(Study, store.get_study(s, setup.name).id)
    if row.baseline_config is None:
      row.baseline_config, row.baseline_hash = (base := setup.baseline(info)).to_json(), base.hash
    return StructureConfig.from_json(row.baseline_config)


def check_configs(setup: Setup, info: ModelInfo, configs: list[StructureConfig]) -> None:
  """Configs to enqueue must lie in the study's space and agree with its pinned knobs (checked before anything runs)."""
  for cfg in configs:
    params = to_params(cfg, info, setup.device, setup.family)
    if any(params.get(k, v) != v for k, v in setup.fixed.items()):
      raise ConfigError(f"an enqueued config contradicts the pinned knobs {setup.fixed}")


def enqueue(setup: Setup, url: str, info: ModelInfo, configs: list[StructureConfig]) -> None:
  """Queue the baseline and the given configs, each once per study."""
  check_configs(setup, info, configs)
  study = optuna.load_study(study_name=setup.name, storage=storage(url))
  for cfg in [stored_baseline(url, setup, info), *configs]:
    study.enqueue_trial(setup.params(cfg, info), skip_if_exists=True)


def load_setup(name: str, url: str, device: str | None = None) -> tuple[Setup, ModelInfo]:
  """A study's setup as its creator stored it; the device may be another of the same kind (a worker checks its
  model)."""
  try: study = optuna.load_study(study_name=name, storage=storage(url))
  except KeyError: raise StudyMismatch(f"no study named {name!r} in {hide_password(url)}") from None
  attrs = study.user_attrs
  # a study made before
  if "cache_key" not in attrs: study.set_user_attr("cache_key", attrs.setdefault("cache_key", uuid.uuid4().hex[:12]))
  # a later field: its default
  setup = Setup(name, **{f.name: attrs[f.name] for f in fields(Setup) if f.name != "name" and f.name in attrs})
  if device is not None:
    if device_kind(device) != device_kind(setup.device):
      raise StudyMismatch(f"study {name!r} runs on {device_kind(setup.device)}, not {device}")
    setup.device = device
  return setup, info_from_json(attrs["model_info"])


def measuring_setup(name: str, url: str, device: str | None = None,
                    model: str | None = None) -> tuple[Setup, ModelInfo]:
  """The setup of a study about to be measured on this host: its model file (the stored path, or `model`, this host's
  copy) checked against the study's by SHA-256 first."""
  setup, info = load_setup(name, url, device)
  setup.model = model or setup.model
  with session(open_db(url, create=False)) as s: check_model(store.get_study(s, name), setup.model)
  return setup, info


def info_to_json(info: ModelInfo) -> str:
  """Every field of the model's ModelInfo: a worker that joins or continues the study sees the space its creator saw."""
  return json.dumps({f.name: sorted(v) if isinstance(v := getattr(info, f.name), frozenset) else v
                     for f in fields(ModelInfo)})


def info_from_json(text: str) -> ModelInfo:
  """A stored ModelInfo; a field an older study did not store keeps its default."""
  d = json.loads(text)
  tuples = (lambda v: {k: tuple(x) for k, x in v.items()} if isinstance(v, dict) else tuple(v) if isinstance(v, list)
            else v)
  return ModelInfo(**{f.name: frozenset(d[f.name]) if f.name == "mergeable" else tuples(d[f.name])
                      for f in fields(ModelInfo) if f.name in d})


def model_info(path: str) -> ModelInfo: return ModelInfo.from_gguf(GGUFFile(path))
