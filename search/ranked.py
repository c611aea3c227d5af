"""Optuna's storage of a study database, read as the study ranks its configs: what optuna-dashboard and the report's
Optuna plots read, so that their best trial, history and importance agree with the leaderboard.

A complete trial's first value is the figure its config ranks by on the leaderboard, in tok/s (leaderboard.figure: the
lower bound of its speedup, from its A/B confirmation where one exists, else from its estimate, times the baseline's
estimate), whatever the trial's own first figure was; its user attributes carry the estimate with its 90% interval and
count, the speedup and its lower bound, the confirmation, the rank, the precision class and the accuracy figures (with
the accuracy floor's verdict); the best trial is the leaderboard's first; the study's user attributes say what its knob
importance rests on (search/effects.py, the dashboard's importance). The storage is read at every call, so
re-measurements and confirmations show as soon as they are stored. Nothing is written: the values the workers told
Optuna stay as they were (the samplers learn from them).
"""
from __future__ import annotations

import copy
from collections.abc import Container
from typing import Any

from optuna.storages import BaseStorage, RDBStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import select

from db import store
from db.engine import engine_kwargs, open_db, session
from db.models import Trial
from evaluator.gate import accuracy_text
from search import effects
from search.leaderboard import figure, leaderboard


class ReadOnlyStorage(PermissionError):
  """A write asked of RankedStorage."""


class RankedStorage(BaseStorage):
  """Optuna's RDBStorage of an existing database (nothing is created), its trials carrying the study's estimates (module
  docstring); every other read goes to that storage as it is, and every write is refused (ReadOnlyStorage). Not an
  RDBStorage itself: Optuna wraps one in a cache of finished trials, which would keep their first figures."""

  def __init__(self, url: str):
    self.ours = open_db(url, create=False)
    self.rdb = RDBStorage(url, engine_kwargs=engine_kwargs(url), skip_table_creation=True)

  def get_all_trials(self, study_id: int, deepcopy: bool = True,
                     states: Container[TrialState] | None = None) -> list[FrozenTrial]:
    return self._ranked(study_id, self.rdb.get_all_trials(study_id, deepcopy, states))

  def get_trial(self, trial_id: int) -> FrozenTrial:
    t = self.rdb.get_trial(trial_id)
    with session(self.ours) as s:
      row = s.scalar(select(Trial).filter_by(optuna_trial_id=trial_id).limit(1))
      name = row.study.name if row is not None else None
    return t if name is None else self._ranked(self.rdb.get_study_id_from_name(name), [t])[0]

  def get_best_trial(self, study_id: int) -> FrozenTrial:
    """The leaderboard's first (of its config's trials, the first); ValueError where no trial is complete."""
    if len(self.get_study_directions(study_id)) > 1:
      raise RuntimeError("Best trial can be obtained only for single-objective optimization.")
    done = [t for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    if not done: raise ValueError("No trials are completed yet.")
    return min(done, key=lambda t: (t.user_attrs.get("rank") or len(done) + 1, t.number))

  def _ranked(self, study_id: int, trials: list[FrozenTrial]) -> list[FrozenTrial]:
    with session(self.ours) as s:
      if (st := store.get_study(s, self.rdb.get_study_name_from_id(study_id))) is None: return trials
      doc = leaderboard(s, st)
      hashes = {t.number: t.config_hash for t in store.trials(s, st)}
    base = doc["baseline"]["tok_s"] if doc["baseline"] else None
    rows = {r["config_hash"]: r for r in doc["rows"]}
    out = []
    for t in trials:
      r = rows.get(hashes.get(t.number, ""))
      if t.state != TrialState.COMPLETE or not t.values or r is None:
        out.append(t)
        continue
      t = copy.copy(t)
      t.values = [figure(r, base), *t.values[1:]]
      c = r["confirmed"]
      conf = f"{c['speedup']:.3f}x [{c['low']:.3f}, {c['high']:.3f}] over {c['pairs']} A/B pairs ({c['status']})" \
        if c else None
      t.user_attrs = {**t.user_attrs, "rank": r["rank"], "estimate_tok_s": r["tok_s"], "estimate_low": r["tok_s_low"],
                      "estimate_high": r["tok_s_high"], "measurements": r["measurements"], "speedup": r["speedup"],
                      "speedup_low": r["speedup_low"], "confirmed": conf, "precision": r["precision"],
                      "accuracy": accuracy_text(r["accuracy"]),
                      "accuracy floor": f"below: {r['below_floor']}" if r["below_floor"] else "met"}
      out.append(t)
    return out

  # the rest as Optuna's RDBStorage does it
  def get_study_id_from_name(self, study_name: str) -> int: return self.rdb.get_study_id_from_name(study_name)
  def get_study_name_from_id(self, study_id: int) -> str: return self.rdb.get_study_name_from_id(study_id)
  def get_study_directions(self, study_id: int) -> list[StudyDirection]: return self.rdb.get_study_directions(study_id)
  def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
    """The stored ones, and what the knob importance rests on ("knob importance")."""
    attrs = self.rdb.get_study_user_attrs(study_id)
    with session(self.ours) as s:
      if (st := store.get_study(s, self.rdb.get_study_name_from_id(study_id))) is None: return attrs
      return {**attrs, "knob importance": effects.points(s, st).basis()}
  def get_study_system_attrs(self, study_id: int) -> dict[str, Any]: return self.rdb.get_study_system_attrs(study_id)
  def get_all_studies(self) -> list: return self.rdb.get_all_studies()  # of Optuna's FrozenStudy (not exported)
  def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
    return self.rdb.get_trial_id_from_study_id_trial_number(study_id, trial_number)

  def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
    raise ReadOnlyStorage("this view of the study database is read-only: studies are managed from the command line "
                          "(`search delete`, `search rename`)")
  # every write of Optuna's storage API: what the dashboard's UI would do to a study (delete, rename, notes, trials)
  create_new_study = delete_study = set_study_user_attr = set_study_system_attr = _refuse
  create_new_trial = set_trial_param = set_trial_state_values = set_trial_intermediate_value = _refuse
  set_trial_user_attr = set_trial_system_attr = _refuse
  def remove_session(self) -> None: self.rdb.remove_session()
