"""The leaderboard of a stored study (`search leaderboard`), as a JSON-able document first and then as sections for
search.formats, and what the other views share: the study's baseline, its winner, each config's precision class. Every
figure comes from db.store (the robust estimate of each config, its confirmations), so all views agree. The documents
(`--format json`) are described in docs/json.md.
"""
from __future__ import annotations

import argparse
import collections
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from db import store
from db.engine import hide_password, open_db, session
from db.models import TRIAL_STATES, Confirmation, Measurement, Study, Trial
from db.store import interval
from evaluator.cli import at_least
from evaluator.gate import accuracy_text
from model.structure import ConfigError, StructureConfig, knob_named
from search.formats import Section, console, emit, num
from search.options import add_format, add_storage
from search.study import study_attrs, workload_of
from space.knobs import changes, flat

SCHEMA = 2  # of every JSON document (docs/json.md)
MIN_PAIRS = 2  # a confirmation needs this many A/B pairs: one pair has no spread
NOISY = 0.05  # a host is noisy where a single measurement of the baseline has a 90% interval wider than this, each side


# the accuracy figures (evaluator/gate.py accuracy), as the CSV's accuracy_* columns
ACCURACY = ("positions", "top1", "max_rel_err", "median_rel_err", "mean_kl", "max_kl")
PRECISION = {"exact": "float arithmetic, checked against the exact reference at float tolerances",
             "x16": "16-bit activations (two 8-bit planes per 32) with integer dot products, checked against the exact "
                    "reference at float tolerances",
             "q8": "8-bit activations with integer dot products, like llama.cpp's"}


def precision(cfg: StructureConfig) -> str:
  """A config's precision class (PRECISION): "q8" where a knob rounds activations or the KV cache to 8 bits, else "x16"
  where one holds them in two 8-bit planes, else "exact"."""
  classes = cfg.precision()
  return next((c for c in ("q8", "x16") if c in classes), "exact")


def accuracy(t: Trial) -> dict[str, Any] | None:
  """A trial's accuracy figures against the exact reference (evaluator/gate.py accuracy); None for a result stored
  before they were recorded, or one that was not checked."""
  return ((t.reused_from or t).check or {}).get("accuracy")


def baseline(study: Study) -> StructureConfig:
  """The study's one baseline config (stored when it was created)."""
  return StructureConfig.from_json(study.baseline_config) if study.baseline_config else StructureConfig()


@dataclass(frozen=True)
class Floor:
  """A study's accuracy policy (`--min-top1`, `--max-kl`): the least top-1 agreement with the exact reference and the
  most mean KL divergence from it (over the checked positions) a config may have to be shipped. A config below it is
  infeasible: ranked after every feasible one, never the best, never exported. A config without accuracy figures
  (stored before they were recorded) meets it only when it is exact."""
  min_top1: float | None = None
  max_kl: float | None = None

  def __bool__(self) -> bool: return self.min_top1 is not None or self.max_kl is not None

  def text(self) -> str:
    parts = [f"top1 >= {self.min_top1:.1%}" if self.min_top1 is not None else "",
             f"KL <= {self.max_kl:.1e}" if self.max_kl is not None else ""]
    return ", ".join(p for p in parts if p) or "none"

  def fails(self, acc: dict[str, Any] | None, prec: str) -> str | None:
    """Why a config of these accuracy figures and precision class is below the floor; None where it meets it."""
    if not self: return None
    if not acc: return None if prec == "exact" else "no accuracy figures"
    why = []
    if self.min_top1 is not None and acc["top1"] < self.min_top1:
      why.append(f"top1 {acc['top1']:.1%} < {self.min_top1:.1%}")
    if self.max_kl is not None and acc["mean_kl"] > self.max_kl:
      why.append(f"KL {acc['mean_kl']:.1e} > {self.max_kl:.1e}")
    return "; ".join(why) or None

  def tighter(self, min_top1: float | None, max_kl: float | None) -> Floor:
    """This floor raised by another's bounds (`search export --min-top1/--max-kl`): the stricter of each."""
    pick = lambda a, b, f: b if a is None else a if b is None else f(a, b)
    return Floor(pick(self.min_top1, min_top1, max), pick(self.max_kl, max_kl, min))


def fraction(text: str) -> float:
  """An argparse type: a share between 0 and 1, or a percentage (`0.99`, `99%`)."""
  try: v = float(text[:-1]) / 100 if text.endswith("%") else float(text)
  except ValueError: v = -1.0
  if not 0 <= v <= 1: raise argparse.ArgumentTypeError(f"{text!r} is not a share between 0 and 1 (or 0% to 100%)")
  return v


def add_floor(p: argparse.ArgumentParser, what: str) -> None:
  """The accuracy floor's options (Floor): `search start` (the study's, fixed at its creation) and `search export`."""
  p.add_argument("--min-top1", type=fraction, metavar="SHARE",
                 help=f"the least top-1 agreement with the exact reference, e.g. 0.99 or 99%% ({what})")
  p.add_argument("--max-kl", type=at_least(0, float), metavar="NATS",
                 help=f"the most mean KL divergence from the exact reference, e.g. 1e-3 ({what})")


def floor(s: Session, study: Study) -> Floor:
  """The accuracy floor the study was created with (none for a study made before floors)."""
  attrs = study_attrs(s, study.name)
  return Floor(attrs.get("min_top1"), attrs.get("max_kl"))


def confirmed_faster(c: dict[str, Any] | None) -> bool:
  """A leaderboard row's confirmation shows its config faster than the baseline: over at least MIN_PAIRS A/B pairs,
  the lower bound of its speedup above 1."""
  return c is not None and c["status"] == "ok" and c["pairs"] >= MIN_PAIRS and c["low"] > 1.0


def lower_bound(row: dict[str, Any], base: store.Estimate | None, baseline_hash: str | None) -> float | None:
  """The lower confidence bound of a config's speedup over the baseline, which the leaderboard ranks by: its A/B
  confirmation's (which takes precedence over its estimate; 0 for a failed one), else from the two estimates: their
  ratio lowered by their log half-widths added in quadrature (each interval's low end is a one-sided 95% bound, so
  this is one too), the ratio alone while the study has no noise figure. The baseline is 1 by definition; None
  without a baseline estimate."""
  c = row["confirmed"]
  if c is not None: return c["low"] if c["status"] == "ok" else 0.0
  if row["config_hash"] == baseline_hash: return 1.0
  if base is None or not row["tok_s"]: return None
  ratio = row["tok_s"] / base.median
  if row["tok_s_low"] is None or base.low is None: return ratio
  return ratio * math.exp(-math.hypot(math.log(row["tok_s"] / row["tok_s_low"]), math.log(base.median / base.low)))


def _order(r: dict[str, Any]) -> tuple:
  """The leaderboard's order: configs confirmed faster than the baseline first (a confirmation outweighs an estimate,
  which the selection of the best of many noisy figures biases up), then the other feasible ones, then those below
  the accuracy floor; within each, by the lower bound of the speedup (tok/s where there is no baseline)."""
  tier = 2 if r["below_floor"] else 0 if confirmed_faster(r["confirmed"]) else 1
  return tier, -(r["speedup_low"] if r["speedup_low"] is not None else r["tok_s"] or 0.0), r["trial"]


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


def noise(ms: list[Measurement]) -> dict[str, Any] | None:
  """The baseline's own spread, from its measurements (ms): the half-width of a single measurement's 90% interval (1.645
  robust standard deviations of its log figures, from their median absolute deviation: one outlier does not make a host
  noisy), `noisy` past NOISY, and the highest host load its measurements saw; None with fewer than 3 measurements."""
  if len(ms) < 3: return None
  logs = np.log([m.tok_s for m in ms])
  half = math.expm1(1.645 * 1.4826 * float(np.median(np.abs(logs - np.median(logs)))))
  loads = [x for m in ms for x in (m.load_start, m.load_end) if x is not None]
  return {"spread": half, "noisy": half > NOISY, "measurements": len(ms), "max_load": max(loads, default=None)}


def _noisy(n: dict[str, Any] | None) -> str:
  """The verdict's warning where the host is noisy."""
  if n is None or not n["noisy"]: return ""
  return f"; noisy host: baseline spread ±{n['spread']:.1%} (90%) > ±{NOISY:.0%}"


def noise_line(n: dict[str, Any] | None) -> str | None:
  """What a noisy host means for the figures, said under the verdict; None where the host is not noisy."""
  if n is None or not n["noisy"]: return None
  load = f", host load up to {n['max_load']:.1f}" if n["max_load"] is not None else ""
  return (f"noisy host ({n['measurements']} measurements of the baseline{load}): figures may move; measure on a quiet "
          "machine, or confirm with more A/B pairs (`search confirm --max-pairs`)")


def verdict(ranked: list[dict[str, Any]], baseline_hash: str | None, name: str,
            host: dict[str, Any] | None = None) -> str:
  """One sentence on the ranked rows: the confirmed winner (the first row), or plainly that no config beats the
  baseline, or that nothing is confirmed yet (naming the first config that is not the baseline); with `host` (noise),
  "noisy host" where the baseline's own spread is wide."""
  return _verdict(ranked, baseline_hash, name) + _noisy(host)


def _verdict(ranked: list[dict[str, Any]], baseline_hash: str | None, name: str) -> str:
  if ranked and ranked[0]["winner"]:
    w, c = ranked[0], ranked[0]["confirmed"]
    return (f"trial {w['trial']} beats the baseline: confirmed speedup {c['speedup']:.3f}x [{c['low']:.3f}, "
            f"{c['high']:.3f}] over {c['pairs']} A/B pairs")
  others = [r for r in ranked if r["config_hash"] != baseline_hash]
  if not (cand := next((r for r in others if not r["below_floor"]), None)):
    return "no config beats the baseline: no other config finished ok" + (" above the accuracy floor" if others else "")
  n, c = cand["trial"], cand["confirmed"]
  if c is not None and c["status"] != "ok":
    return (f"no config beats the baseline: the best other config, trial {n}, failed its A/B confirmation "
            f"({c['status']})")
  if c is not None:
    return (f"no config beats the baseline: the best confirmed, trial {n}, runs at {c['speedup']:.3f}x "
            f"[{c['low']:.3f}, {c['high']:.3f}] of it; keep the baseline")
  if cand["speedup"] is None:
    return f"nothing confirmed yet: the best measured config, trial {n}, has no baseline to compare with"
  if cand["speedup"] <= 1:
    return (f"no config beats the baseline: the best other config, trial {n}, measures {cand['speedup']:.3f}x of it "
            "(unconfirmed)")
  return (f"nothing confirmed yet: the best measured config, trial {n}, measures {cand['speedup']:.3f}x the baseline "
          f"(lower bound {cand['speedup_low']:.3f}x) (`search confirm --study {name}`)")


def _row(t: Trial, est: store.Estimate | None, base: store.Estimate | None, c: Confirmation | None,
         base_cfg: StructureConfig, fl: Floor, baseline_hash: str | None) -> dict[str, Any]:
  m = t.metrics or {}
  tok = est.median if est is not None and t.state == "ok" else None
  prec, acc = precision(cfg := StructureConfig.from_json(t.config_json)), accuracy(t)
  row = {"rank": None, "trial": t.number, "trials": [t.number], "config_hash": t.config_hash, "state": t.state,
         "tok_s": tok, "tok_s_low": est.low if tok else None, "tok_s_high": est.high if tok
         else None, "measurements": est.n if tok else 0, "speedup": tok / base.median if tok and base else None,
         "confirmed": {"speedup": c.speedup, "low": c.speedup_low, "high": c.speedup_high, "pairs": c.pairs,
                       "status": c.status} if c else None,
         "winner": False, "block_tok_s": t.block_tok_s, "ms_per_token": 1e3 / tok if tok
         else None, "kernels_per_token": m.get("kernels_per_token"), "mb_per_token": m["bytes_per_token"] / 1e6
         if m.get("bytes_per_token") else None, "bandwidth_share": m.get("bandwidth_share"),
         "peak_memory_mb": m["peak_device_bytes"] / 1e6 if m.get("peak_device_bytes") else None,
         "failure": (t.error_text or t.failure_class or "").strip().splitlines()[0][:200] if t.failure_class else None,
         "precision": prec, "accuracy": acc, "below_floor": fl.fails(acc, prec) if t.state == "ok" else None,
         "changes": changes(cfg, base_cfg)}
  row["speedup_low"] = lower_bound(row, base, baseline_hash) if t.state == "ok" else None
  return row


def figure(row: dict[str, Any], base: float | None) -> float:
  """The figure a leaderboard row ranks by, in tok/s (`base`: the baseline's estimate): the lower bound of its speedup
  (lower_bound) times the baseline's estimate, its estimate where there is no baseline."""
  if base is None or row["speedup_low"] is None: return row["tok_s"] or 0.0
  return row["speedup_low"] * base


def leaderboard(s: Session, study: Study, states: tuple[str, ...] = ("ok",), where: dict[str, str] | None = None,
                top: int | None = None) -> dict[str, Any]:
  """The leaderboard document (see the module's docstring)."""
  trials = store.trials(s, study)
  est, conf, attrs = store.estimates(s, study), latest(s, study), study_attrs(s, study.name)
  base, base_cfg, fl = est.get(study.baseline_hash), baseline(study), Floor(attrs.get("min_top1"), attrs.get("max_kl"))
  ok: dict[str, dict] = {}
  rest = []
  for t in trials:
    if t.state == "reused": continue
    if t.state == "ok" and t.config_hash in ok: ok[t.config_hash]["trials"].append(t.number)
    elif t.state == "ok":
      ok[t.config_hash] = _row(t, est.get(t.config_hash), base, conf.get(t.config_hash), base_cfg, fl,
                               study.baseline_hash)
    else: rest.append(_row(t, None, base, None, base_cfg, fl, study.baseline_hash))
  ranked = sorted(ok.values(), key=_order)
  for i, r in enumerate(ranked): r["rank"] = i + 1
  if ranked and _order(ranked[0])[0] == 0: ranked[0]["winner"] = True
  flats = {t.number: flat(StructureConfig.from_json(t.config_json)) for t in trials}
  rows = [r for r in ranked + rest if r["state"] in states
          and all(str(flats[r["trial"]][k]).lower() == v.lower() for k, v in (where or {}).items())]
  bt = next((t for t in trials if t.config_hash == study.baseline_hash and t.state == "ok"), None)
  host = noise([m for m in store.measurements(s, study) if m.config_hash == study.baseline_hash])
  return {"schema": SCHEMA, "study": study.name, "model": study.model_name, "model_sha256": study.model_sha256,
          "device": study.device, "device_name": study.device_name, "layers": study.layers,
          "objectives": study.objectives, "workload": str(workload_of(attrs)),
          "baseline_hash": study.baseline_hash, "floor": {"min_top1": fl.min_top1, "max_kl": fl.max_kl},
          "states": dict(collections.Counter(t.state for t in trials).most_common()),
          "baseline": {"trial": bt.number if bt
                       else None, "tok_s": base.median, "tok_s_low": base.low, "tok_s_high": base.high,
                       "measurements": base.n} if base else None,
          "winner": ranked[0]["trial"] if ranked and ranked[0]["winner"] else None,
          "best": best_of(ranked[0], study.baseline_hash) if ranked else None,
          "noise": host, "verdict": verdict(ranked, study.baseline_hash, study.name, host), "rows": rows[:top]}


def best_of(r: dict[str, Any], baseline_hash: str | None) -> dict[str, Any]:
  """The leaderboard's first row as `search best` and every view name it: the one config to ship (the baseline: keep
  it)."""
  c = r["confirmed"]
  return {"trial": r["trial"], "config_hash": r["config_hash"], "baseline": r["config_hash"] == baseline_hash,
          "confirmed": r["winner"], "speedup": c["speedup"] if c and c["status"] == "ok" else r["speedup"],
          "speedup_low": r["speedup_low"], "tok_s": r["tok_s"], "precision": r["precision"], "accuracy": r["accuracy"],
          "below_floor": r["below_floor"], "changes": r["changes"]}


def best_line(b: dict[str, Any] | None) -> str:
  """The leaderboard's first as one line: `best: trial N (...)`."""
  if b is None: return "best: none (no config finished ok)"
  if b["baseline"]: return f"best: trial {b['trial']}, the baseline (no config ranks above it: keep it)"
  how = ("A/B-confirmed" if b["confirmed"] else "estimated, unconfirmed") + (
    f"; lower bound {b['speedup_low']:.3f}x" if b["speedup_low"] is not None else "")
  speed = f"{b['speedup']:.3f}x the baseline" if b["speedup"] is not None else f"{b['tok_s']:.2f} tok/s"
  return (f"best: trial {b['trial']}, {speed} ({how}), {b['precision']}, {accuracy_text(b['accuracy'])}: "
          + (" ".join(f"{k}={v}" for k, v in b["changes"].items()) or "baseline"))


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
                 r["state"] if not r["failure"] else f"{r['state']}: {r['failure'][:60]}"
                 if not r["below_floor"] else f"{r['state']}, below the accuracy floor: {r['below_floor']}",
                 " ".join(f"{k}={v}" for k, v in r["changes"].items()) or "baseline"])
  records = [{**{k: v for k, v in r.items() if k not in ("confirmed", "accuracy", "changes", "trials")},
              "trials": " ".join(map(str, r["trials"])),
              **{f"confirmed_{k}": (r["confirmed"] or {}).get(k)
                 for k in ("speedup", "low", "high", "pairs", "status")},
              **{f"accuracy_{k}": (r["accuracy"] or {}).get(k) for k in ACCURACY},
              "changes": " ".join(f"{k}={v}" for k, v in r["changes"].items())} for r in doc["rows"]]
  fl = Floor(**doc["floor"])
  title = (f"{doc['study']}: {doc['model']} ({doc['layers']} blocks) on {doc['device_name'] or doc['device']}, "
           f"{doc['workload']}{f', accuracy floor {fl.text()}' if fl else ''}  "
           f"[{', '.join(f'{k} {v}' for k, v in doc['states'].items())}]")
  # precision and accuracy are never left out: a config's speed means nothing without them
  drop = ("peak MB", "BW share", "MB/token", "kernels/token", "ms/token", "tok/s [90%] n", "confirmed [low, high]")
  wrap = ("state", "changes from the baseline", "accuracy")
  notes = [best_line(doc["best"]), doc["verdict"], *filter(None, [noise_line(doc["noise"])])]
  return [Section(title, cols, rows, records=records, wrap=wrap, drop=drop)], notes




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
