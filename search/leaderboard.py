"""The views of stored studies: the leaderboard with measured and confirmed figures, the list of studies, the export of a
study's winner as a production config."""
from __future__ import annotations

import collections
import datetime

from rich.table import Table
from sqlalchemy.orm import Session

from db import store
from db.models import Confirmation, Study, Trial
from model.structure import StructureConfig
from search.view import baseline_tok_s, label


def winner(confirmed: list[Confirmation]) -> Confirmation | None:
  """The confirmed config with the best lower bound of its speedup over the baseline, if that bound is above 1."""
  best = max(confirmed, key=lambda c: c.speedup_low, default=None)
  return best if best is not None and best.speedup_low > 1.0 else None


def leaderboard_table(s: Session, study: Study, limit: int = 15) -> Table:
  trials = store.trials(s, study)
  base = baseline_tok_s(trials)
  conf = {c.config_hash: c for c in store.confirmations(s, study)}
  win = winner(list(conf.values()))
  states = collections.Counter(t.state for t in trials)
  t = Table(title=f"{study.name}: {study.model_name} ({study.layers} blocks) on {study.device_name or study.device}  "
                  f"[{', '.join(f'{k} {v}' for k, v in states.most_common())}]")
  for col in ("rank", "trial", "tok/s", "speedup", "block tok/s", "kernels", "MB/token", "confirmed speedup [low, high]"):
    t.add_column(col, justify="left" if col == "confirmed speedup [low, high]" else "right", no_wrap=True, min_width=min(len(col), 12))
  t.add_column("config (changes from the baseline)", overflow="fold", max_width=90)
  for i, r in enumerate(store.leaderboard(s, study, limit)):
    c = conf.get(r.config_hash)
    mark = " *" if win is not None and c is win else ""
    t.add_row(str(i + 1), str(r.number), f"{r.tok_s:.2f}", f"{r.tok_s / base:.3f}x" if base else "",
              f"{r.block_tok_s:.2f}" if r.block_tok_s else "", str(r.metrics.get("kernels_per_token", "")),
              f"{r.metrics.get('bytes_per_token', 0) / 1e6:.1f}",
              f"{c.speedup:.3f}x [{c.speedup_low:.3f}, {c.speedup_high:.3f}]{mark}" if c else "", label(r.config_json))
  return t


def studies_table(s: Session) -> Table:
  t = Table(title="studies")
  for col in ("study", "model", "device", "trials", "ok", "failed", "best tok/s", "speedup", "created", "finished"): t.add_column(col)
  for st in store.studies(s):
    trials = store.trials(s, st)
    base, ok = baseline_tok_s(trials), [x for x in trials if x.state == "ok"]
    best = max((x.tok_s for x in ok), default=None)
    t.add_row(st.name, st.model_name, st.device_name or st.device, str(len(trials)), str(len(ok)),
              str(sum(1 for x in trials if x.failure_class)), f"{best:.2f}" if best else "", f"{best / base:.3f}x" if best and base else "",
              _day(st.created_at), _day(st.finished_at))
  return t


def _day(d: datetime.datetime | None) -> str: return d.strftime("%Y-%m-%d %H:%M") if d else ""


def export(s: Session, study: Study, allow_unconfirmed: bool = False) -> tuple[StructureConfig, str]:
  """The study's winner (confirmed by A/B against the baseline) as a config, and a TOML header saying where it comes from."""
  win = winner(store.confirmations(s, study))
  if win is not None:
    trial = s.get(Trial, win.trial_id)
    why = f"confirmed speedup {win.speedup:.3f}x [{win.speedup_low:.3f}, {win.speedup_high:.3f}] over {win.pairs} A/B pairs"
  elif allow_unconfirmed and (top := store.leaderboard(s, study, 1)):
    trial, why = top[0], "UNCONFIRMED: best measured trial"
  else: raise ValueError(f"study {study.name!r} has no confirmed winner (run `search confirm --study {study.name}`, or export --unconfirmed)")
  cfg = StructureConfig.from_json(trial.config_json)
  head = (f"# structsearch export of study {study.name!r}, trial {trial.number}: {trial.tok_s:.2f} tok/s on {study.device_name or study.device}\n"
          f"# model {study.model_name} ({study.model_path}, sha256 {study.model_sha256[:16]}), {why}\n")
  return cfg, head
