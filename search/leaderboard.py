"""The leaderboard of a stored study (`search leaderboard`), as a JSON-able document first and then as sections for
search.formats, and what the other views share: the study's baseline, its winner, each config's precision class. Every
figure comes from db.store (the robust estimate of each config, its confirmations), so all views agree. The documents
(`--format json`) are described in docs/json.md.
"""
from __future__ import annotations

import argparse
import collections
from typing import Any

from sqlalchemy.orm import Session

from db import store
from db.engine import hide_password, open_db, session
from db.models import TRIAL_STATES, Confirmation, Study, Trial
from db.store import interval
from evaluator.cli import at_least
from evaluator.gate import accuracy_text
from model.structure import ConfigError, StructureConfig, knob_named
from search.formats import Section, console, emit, num
from search.options import add_format, add_storage
from search.study import study_workload
from space.knobs import changes, flat

SCHEMA = 2  # of every JSON document (docs/json.md)
MIN_PAIRS = 2  # a confirmation needs this many A/B pairs: one pair has no spread


# the accuracy figures (evaluator/gate.py accuracy), as the CSV's accuracy_* columns
ACCURACY = ("positions", "top1", "max_rel_err", "median_rel_err", "mean_kl", "max_kl")
PRECISION = {"exact": "float arithmetic, checked against the exact reference at float tolerances",
             "x16": "16-bit activations (two 8-bit planes per 32) with integer dot products, checked against the exact "
                    "reference at float tolerances",
             "q8": "8-bit activations with integer dot products, like llama.cpp's"}


def precision(cfg: StructureConfig) -> str:
  """A config's precision class (PRECISION): "q8" where a knob rounds activations to 8 bits, else "x16" where one
  holds them in two 8-bit planes, else "exact"."""
  classes = cfg.precision()
  return next((c for c in ("q8", "x16") if c in classes), "exact")


def accuracy(t: Trial) -> dict[str, Any] | None:
  """A trial's accuracy figures against the exact reference (evaluator/gate.py accuracy); None for a result stored
  before they were recorded, or one that was not checked."""
  return ((t.reused_from or t).check or {}).get("accuracy")


def baseline(study: Study) -> StructureConfig:
  """The study's one baseline config (stored when it was created)."""
  return StructureConfig.from_json(study.baseline_config) if study.baseline_config else StructureConfig()


def winner(confirmed: list[Confirmation]) -> Confirmation | None:
  """The confirmed config (over at least MIN_PAIRS A/B pairs) with the best lower bound of its speedup over the
  baseline, if that bound is above 1."""
  best = max((c for c in confirmed if c.status == "ok" and c.pairs >= MIN_PAIRS), key=lambda c: c.speedup_low,
             default=None)
  return best if best is not None and best.speedup_low > 1.0 else None


def parse_where(pins: list[str]) -> dict[str, str]:
  """--where knob=value filters, by knob name (model.structure knob_named)."""
  out = {}
  for p in pins:
    k, eq, v = p.partition("=")
    if not eq: raise ValueError(f"--where {p!r}: expected KNOB=VALUE")
    try: out[knob_named(k).name] = v
    except ConfigError as e: raise ValueError(f"--where: {e}") from None
  return out


def check_where(trials: list[Trial], where: dict[str, str]) -> None:
  """Each --where value must be one that some trial of the study has (ValueError naming those it has): a typo would list
  nothing."""
  values = [flat(StructureConfig.from_json(t.config_json)) for t in trials]
  for k, v in where.items():
    if not any(str(f[k]).lower() == v.lower() for f in values):
      have = " or ".join(sorted({str(f[k]) for f in values}))
      raise ValueError(f"--where {k}={v}: no trial of this study has it"
                       + (f"; its trials have {k}={have}" if have else ""))


def study_named(s: Session, url: str, name: str) -> Study:
  """The stored study of that name; ValueError where the storage has none."""
  if (st := store.get_study(s, name)) is None: raise ValueError(f"no study named {name!r} in {hide_password(url)}")
  return st


def latest(s: Session, study: Study) -> dict[str, Confirmation]:
  """The latest confirmation of each config, by config hash."""
  return {c.config_hash: c for c in store.confirmations(s, study)}  # in id order: the latest wins


def verdict(s: Session, study: Study) -> str:
  """One sentence: the confirmed winner, or plainly that no config beats the baseline (or that nothing is confirmed
  yet)."""
  conf, trials = latest(s, study), {t.id: t for t in store.trials(s, study)}
  if (win := winner(list(conf.values()))) is not None:
    return (f"trial {trials[win.trial_id].number} beats the baseline: confirmed speedup {win.speedup:.3f}x "
            f"[{win.speedup_low:.3f}, {win.speedup_high:.3f}] over {win.pairs} A/B pairs")
  ok = [c for c in conf.values() if c.status == "ok" and c.config_hash != study.baseline_hash]
  if ok:
    best = max(ok, key=lambda c: c.speedup_low)
    return (f"no config beats the baseline: the best confirmed, trial {trials[best.trial_id].number}, runs at "
            f"{best.speedup:.3f}x [{best.speedup_low:.3f}, {best.speedup_high:.3f}] of it; keep the baseline")
  cand = next((t for t in store.leaderboard(s, study, 2) if t.config_hash != study.baseline_hash), None)
  if cand is None: return "no config beats the baseline: no other config finished ok"
  est = store.estimates(s, study)
  e, base = est[cand.config_hash], est.get(study.baseline_hash)
  if base is not None and e.median <= base.median:
    return (f"no config beats the baseline: the best other config, trial {cand.number}, measures "
            f"{e.median / base.median:.3f}x of it (unconfirmed)")
  return (f"nothing confirmed yet: the best measured config, trial {cand.number}, "
          f"{f'measures {e.median / base.median:.3f}x the baseline' if base else 'has no baseline to compare with'} "
          f"(`search confirm --study {study.name}`)")


def _row(t: Trial, est: store.Estimate | None, base: store.Estimate | None, c: Confirmation | None,
         win: Confirmation | None, base_cfg: StructureConfig) -> dict[str, Any]:
  m = t.metrics or {}
  tok = est.median if est is not None and t.state == "ok" else None
  return {"rank": None, "trial": t.number, "trials": [t.number], "config_hash": t.config_hash, "state": t.state,
          "tok_s": tok, "tok_s_low": est.low if tok else None, "tok_s_high": est.high if tok
          else None, "measurements": est.n if tok else 0, "speedup": tok / base.median if tok and base else None,
          "confirmed": {"speedup": c.speedup, "low": c.speedup_low, "high": c.speedup_high, "pairs": c.pairs,
                        "status": c.status} if c else None,
          "winner": win is not None and c is win, "block_tok_s": t.block_tok_s, "ms_per_token": 1e3 / tok if tok
          else None, "kernels_per_token": m.get("kernels_per_token"), "mb_per_token": m["bytes_per_token"] / 1e6
          if m.get("bytes_per_token") else None, "bandwidth_share": m.get("bandwidth_share"),
          "peak_memory_mb": m["peak_device_bytes"] / 1e6 if m.get("peak_device_bytes") else None,
          "failure": (t.error_text or t.failure_class or "").strip().splitlines()[0][:200] if t.failure_class else None,
          "precision": precision(cfg := StructureConfig.from_json(t.config_json)), "accuracy": accuracy(t),
          "changes": changes(cfg, base_cfg)}


def figure(row: dict[str, Any], base: float | None) -> float:
  """The figure a leaderboard row ranks by, in tok/s (`base`: the baseline's estimate): its confirmed speedup times the
  baseline's estimate where an A/B confirmation exists (0 where that confirmation failed), else its estimate."""
  c = row["confirmed"]
  if base is None or c is None: return row["tok_s"] or 0.0
  return c["speedup"] * base if c["status"] == "ok" else 0.0


def leaderboard(s: Session, study: Study, states: tuple[str, ...] = ("ok",), where: dict[str, str] | None = None,
                top: int | None = None) -> dict[str, Any]:
  """The leaderboard document (see the module's docstring)."""
  trials = store.trials(s, study)
  est, conf = store.estimates(s, study), latest(s, study)
  base, win, base_cfg = est.get(study.baseline_hash), winner(list(conf.values())), baseline(study)
  ok: dict[str, dict] = {}
  rest = []
  for t in trials:
    if t.state == "reused": continue
    if t.state == "ok" and t.config_hash in ok: ok[t.config_hash]["trials"].append(t.number)
    elif t.state == "ok":
      ok[t.config_hash] = _row(t, est.get(t.config_hash), base, conf.get(t.config_hash), win, base_cfg)
    else: rest.append(_row(t, None, base, None, None, base_cfg))
  ranked = sorted(ok.values(), key=lambda r: (-figure(r, base.median if base else None), r["trial"]))
  for i, r in enumerate(ranked): r["rank"] = i + 1
  flats = {t.number: flat(StructureConfig.from_json(t.config_json)) for t in trials}
  rows = [r for r in ranked + rest if r["state"] in states
          and all(str(flats[r["trial"]][k]).lower() == v.lower() for k, v in (where or {}).items())]
  bt = next((t for t in trials if t.config_hash == study.baseline_hash and t.state == "ok"), None)
  return {"schema": SCHEMA, "study": study.name, "model": study.model_name, "model_sha256": study.model_sha256,
          "device": study.device, "device_name": study.device_name, "layers": study.layers,
          "objectives": study.objectives, "workload": str(study_workload(s, study.name)),
          "baseline_hash": study.baseline_hash,
          "states": dict(collections.Counter(t.state for t in trials).most_common()),
          "baseline": {"trial": bt.number if bt
                       else None, "tok_s": base.median, "tok_s_low": base.low, "tok_s_high": base.high,
                       "measurements": base.n} if base else None,
          "winner": next((r["trial"] for r in ranked if r["winner"]), None), "verdict": verdict(s, study),
          "rows": rows[:top]}


def leaderboard_view(doc: dict[str, Any]) -> tuple[list[Section], list[str]]:
  cols = ["rank", "trial", "tok/s [90%] n", "speedup", "confirmed [low, high]", "ms/token", "kernels/token", "MB/token",
          "BW share", "peak MB", "precision", "accuracy", "state", "changes from the baseline"]
  rows = []
  for r in doc["rows"]:
    c = r["confirmed"]
    conf = (f"{c['speedup']:.3f}x [{c['low']:.3f}, {c['high']:.3f}]{' *' if r['winner'] else ''}" if c
            and c["status"] == "ok" else
            c["status"] if c else "")
    tok = (f"{interval(store.Estimate(r['tok_s'], r['tok_s_low'], r['tok_s_high'], r['measurements']))} "
           f"{r['measurements']}" if r["tok_s"] else
           num(r["block_tok_s"], ".2f", " (block)"))
    rows.append([r["rank"] or "", r["trial"], tok, num(r["speedup"], ".3f", "x"), conf, num(r["ms_per_token"]),
                 num(r["kernels_per_token"], "d"), num(r["mb_per_token"], ".1f"), num(r["bandwidth_share"], ".1%"),
                 num(r["peak_memory_mb"], ".1f"), r["precision"], accuracy_text(r["accuracy"]),
                 r["state"] if not r["failure"] else f"{r['state']}: {r['failure'][:60]}",
                 " ".join(f"{k}={v}" for k, v in r["changes"].items()) or "baseline"])
  records = [{**{k: v for k, v in r.items() if k not in ("confirmed", "accuracy", "changes", "trials")},
              "trials": " ".join(map(str, r["trials"])),
              **{f"confirmed_{k}": (r["confirmed"] or {}).get(k)
                 for k in ("speedup", "low", "high", "pairs", "status")},
              **{f"accuracy_{k}": (r["accuracy"] or {}).get(k) for k in ACCURACY},
              "changes": " ".join(f"{k}={v}" for k, v in r["changes"].items())} for r in doc["rows"]]
  title = (f"{doc['study']}: {doc['model']} ({doc['layers']} blocks) on {doc['device_name'] or doc['device']}, "
           f"{doc['workload']}  "
           f"[{', '.join(f'{k} {v}' for k, v in doc['states'].items())}]")
  drop = ("peak MB", "BW share", "MB/token", "kernels/token", "ms/token", "accuracy", "precision", "tok/s [90%] n",
          "confirmed [low, high]")
  wrap = ("state", "changes from the baseline")
  return [Section(title, cols, rows, records=records, wrap=wrap, drop=drop)], [doc["verdict"]]




def show(url: str, name: str, fmt: str = "table", top: int | None = None, states: tuple[str, ...] = ("ok",),
         where: dict[str, str] | None = None) -> None:
  """Print the study's leaderboard in `fmt`, its verdict below the table."""
  with session(open_db(url, create=False)) as s:
    st = study_named(s, url, name)
    check_where(store.trials(s, st), where or {})
    doc = leaderboard(s, st, states, where, top)
  secs, notes = leaderboard_view(doc)
  emit(fmt, secs, doc, console, notes)


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_format(p)
  p.add_argument("--study", required=True, help="the study to rank")
  p.add_argument("--top", type=at_least(1), metavar="N", help="the first N rows (default: all)")
  p.add_argument("--state", action="append", choices=(*TRIAL_STATES, "all"),
                 help="trial states to list (default ok); repeatable")
  p.add_argument("--where", action="append", metavar="KNOB=VALUE",
                 help="only configs with this knob value (e.g. topk=sort); repeatable")


def run(args: argparse.Namespace) -> None:
  states = TRIAL_STATES if "all" in (args.state or ()) else tuple(args.state or ("ok",))
  show(args.storage, args.study, args.format, args.top, states, parse_where(args.where or []))
