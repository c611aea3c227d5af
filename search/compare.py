"""Two trials side by side (`search compare`), knob by knob, metric by metric and kernel by kernel, with B/A, their
estimates and confirmations; B may be a trial of another study in the storage."""
from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy.orm import Session

from db import store
from db.engine import open_db, session
from db.models import Study, Trial
from db.store import interval
from evaluator.gate import accuracy_text
from model.structure import StructureConfig
from search.formats import Section, console, emit, num
from search.leaderboard import SCHEMA, study_named
from search.options import add_format, add_storage
from search.profile import stages
from search.show import find_trial, trial_doc
from space.knobs import flat

COMPARED = (("tok_s", "tok/s"), ("ms_per_token", "ms/token"), ("kernels_per_token", "kernels/token"),
            ("graph_batches_per_token", "graph batches/token"), ("bytes_per_token", "bytes/token"), ("gb_s", "GB/s"),
            ("bandwidth_share", "bandwidth share"), ("peak_device_bytes", "peak device bytes"),
            ("prefill_tok_s", "prefill tok/s"))


def compare_doc(s: Session, study: Study, a: Trial, b: Trial, study_b: Study | None = None) -> dict[str, Any]:
  """Two trials side by side (`search compare --format json`): knobs that differ, each metric with the ratio B/A, and
  their per-kernel profiles by kernel name. B may be a trial of another study (`study_b`: the same model on another
  device, or before and after a change of the code); each side's estimate and confirmation are its own study's."""
  sb = study_b or study
  da, db = trial_doc(s, study, a), trial_doc(s, sb, b)
  fa, fb = flat(StructureConfig.from_json(a.config_json)), flat(StructureConfig.from_json(b.config_json))
  def metric(d: dict, k: str) -> float | None:
    if k == "tok_s": return d["estimate"]["tok_s"] if d["estimate"] else None
    if k == "ms_per_token": return 1e3 / d["estimate"]["tok_s"] if d["estimate"] else None
    return d["metrics"].get(k)
  metrics = [{"metric": k, "a": metric(da, k), "b": metric(db, k)} for k, _ in COMPARED]
  metrics += [{"metric": f"phase {k}", "a": da["phases"].get(k), "b": db["phases"].get(k)}
              for k in ("load_s", "compile_s", "wall_s")]
  for m in metrics: m["ratio"] = (m["b"] / m["a"] if isinstance(m["a"], int | float) and isinstance(m["b"], int | float)
                                  and m["a"] else None)
  return {"schema": SCHEMA, "study": study.name, "study_b": sb.name, "a": a.number, "b": b.number,
          "state": {"a": a.state, "b": b.state},
          "where": {x: f"{st.model_name} on {st.device_name or st.device}" for x, st in (("a", study), ("b", sb))},
          "workload": {"a": da["workload"], "b": db["workload"]},
          "precision": {"a": da["precision"], "b": db["precision"]},
          "accuracy": {"a": da["accuracy"], "b": db["accuracy"]},
          "estimate": {"a": da["estimate"], "b": db["estimate"]},
          "confirmed": {"a": da["confirmed"], "b": db["confirmed"]},
          "knobs": [{"knob": k, "a": fa[k], "b": fb[k]} for k in fa if fa[k] != fb[k]], "metrics": metrics,
          "stages": stage_ratios(da["profile"], db["profile"]), "kernels": kernels(da["profile"], db["profile"])}


def kernels(pa: list[dict[str, Any]], pb: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Two per-kernel profiles side by side by stage and kernel name (B's order, then the kernels A alone runs): each
  side's launches per token, microseconds per token and GB/s (None where that side does not run the kernel), and B/A in
  time."""
  ka, kb = {(p["stage"], p["name"]): p for p in pa}, {(p["stage"], p["name"]): p for p in pb}
  side = lambda p: {"count": p["count"], "us_per_token": p["us_per_token"], "gb_s": p["gb_s"]} if p else None
  out = []
  for key in [*kb, *(k for k in ka if k not in kb)]:
    a, b = ka.get(key), kb.get(key)
    ratio = b["us_per_token"] / a["us_per_token"] if a and b and a["us_per_token"] else None
    out.append({"stage": key[0], "kernel": key[1], "a": side(a), "b": side(b), "ratio": ratio})
  return out


def stage_ratios(pa: list[dict[str, Any]], pb: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Two profiles' time by stage (search/profile.py stages; A's order, then the stages B alone has): each side's
  launches and µs per token (None where that side has no kernel of the stage), B/A, and B's change in µs per token:
  where the speed came from. [] unless both sides have a profile."""
  if not pa or not pb: return []
  ga, gb = {g["stage"]: g for g in stages(pa)}, {g["stage"]: g for g in stages(pb)}
  side = lambda g: {"count": g["count"], "us_per_token": g["us_per_token"], "share": g["share"]} if g else None
  out = []
  for st in [*ga, *(x for x in gb if x not in ga)]:
    a, b = ga.get(st), gb.get(st)
    out.append({"stage": st, "a": side(a), "b": side(b),
                "ratio": b["us_per_token"] / a["us_per_token"] if a and b and a["us_per_token"] else None,
                "delta_us": (b["us_per_token"] if b else 0.0) - (a["us_per_token"] if a else 0.0)})
  return out


def _conf(c: dict[str, Any] | None) -> str:
  if c is None: return "not confirmed"
  failed = "" if c["status"] == "ok" else f" ({c['status']})"
  return f"{c['speedup']:.3f}x [{c['low']:.3f}, {c['high']:.3f}] over {c['pairs']} A/B pairs{failed}"


def compare_view(doc: dict[str, Any]) -> tuple[list[Section], list[str]]:
  names = dict(COMPARED)
  other = doc["study_b"] != doc["study"]
  a, b = f"trial {doc['a']}", f"trial {doc['b']}" if not other else f"{doc['study_b']} trial {doc['b']}"
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else v)
  ea, eb = doc["estimate"]["a"], doc["estimate"]["b"]
  ca, cb = doc["confirmed"]["a"], doc["confirmed"]["b"]
  est = lambda e: (f"{interval(store.Estimate(e['tok_s'], e['low'], e['high'], e['measurements']))} "
                   f"over {e['measurements']}" if e else "")
  rows = [[f"knob {k['knob']}", k["a"], k["b"], ""] for k in doc["knobs"]]
  rows += [["precision", doc["precision"]["a"], doc["precision"]["b"], ""],
           ["accuracy against the exact reference", *(accuracy_text(doc["accuracy"][x]) for x in "ab"), ""],
           ["tok/s estimate [90%] over measurements", est(ea), est(eb), ""],
           ["A/B-confirmed against the baseline", _conf(ca), _conf(cb), ""]]
  rows += [[names.get(m["metric"], m["metric"]), fmt(m["a"]), fmt(m["b"]), num(m["ratio"], ".3f", "x")]
           for m in doc["metrics"]]
  said = lambda c: ("failed" if c["status"] != "ok" else "faster" if c["low"] > 1 else
                    "not faster" if c["speedup"] <= 1 else "inconclusive")
  notes = [f"{side} ({x}) is A/B-confirmed at {_conf(c)} of the baseline: {said(c)}"
           for side, x, c in (("A", a, ca), ("B", b, cb)) if c]
  if ea and eb:
    overlap = None if ea["low"] is None or eb["low"] is None else eb["high"] >= ea["low"] and ea["high"] >= eb["low"]
    noise = ("no run-to-run noise measured yet" if overlap is None else
             "their 90% intervals overlap: within the noise" if overlap else "their 90% intervals do not overlap")
    notes.append(f"B/A is {eb['tok_s'] / ea['tok_s']:.3f}x in estimated tok/s; {noise}")
  if other: notes.append(f"A: {doc['study']}, {doc['where']['a']}; B: {doc['study_b']}, {doc['where']['b']} "
                        "(each against its own study's baseline)")
  heads = ["", f"A: {a} ({doc['state']['a']})", f"B: {b} ({doc['state']['b']})", "B/A"]
  wa, wb = doc["workload"]["a"], doc["workload"]["b"]
  work = wa + ("" if wb == wa else f" (B: {wb})")
  # the names and both sides wrap: B/A keeps its whole figures at any width that fits them
  secs = [Section(f"{doc['study']}: {b} (B) against {a} (A) at {work}", heads, rows,
                  records=[{"name": r[0], "a": r[1], "b": r[2], "ratio": r[3]} for r in rows], wrap=tuple(heads[:3]))]
  return secs + profile_sections(doc, notes), notes


def profile_sections(doc: dict[str, Any], notes: list[str]) -> list[Section]:
  """The kernel diff: time by stage, then kernel by kernel (notes: what is missing)."""
  secs = []
  if st := doc["stages"]:
    srows = [[g["stage"], *(num((g[x] or {}).get("us_per_token"), ".1f") or "-" for x in "ab"),
              num(g["ratio"], ".3f", "x"), f"{g['delta_us']:+.1f}"] for g in st]
    secs.append(Section("time by stage (the kernels' µs per token, B against A; -: no kernel of it on that side)",
                        ["stage", "A us/token", "B us/token", "B/A", "B-A us/token"], srows,
                        records=[{"stage": g["stage"], "a_us_per_token": (g["a"] or {}).get("us_per_token"),
                                  "b_us_per_token": (g["b"] or {}).get("us_per_token"), "ratio": g["ratio"],
                                  "delta_us": g["delta_us"]} for g in st]))
  elif doc["kernels"]:
    notes.append("one side has no per-kernel profile: `search profile --study STUDY TRIAL` makes one")
  if ks := doc["kernels"]:
    side = lambda x, k, spec: num(x.get(k), spec) if x else "-"
    fields = (("count", "d"), ("us_per_token", ".1f"), ("gb_s", ".1f"))
    krows = [[k["stage"] or "?", k["kernel"], *(side(k[x], f, spec) for f, spec in fields[:2] for x in "ab"),
              num(k["ratio"], ".3f", "x"), side(k["a"], "gb_s", ".1f"), side(k["b"], "gb_s", ".1f")] for k in ks]
    records = [{"stage": k["stage"], "kernel": k["kernel"],
                **{f"{x}_{f}": (k[x] or {}).get(f) for x in "ab" for f, _ in fields}, "ratio": k["ratio"]} for k in ks]
    secs.append(Section("per-kernel profile (B against A; -: not run on that side)",
                        ["stage", "kernel", "A count", "B count", "A us/token", "B us/token", "B/A", "A GB/s",
                         "B GB/s"], krows, records=records, wrap=("kernel",),
                        drop=("A GB/s", "B GB/s", "A count", "B count")))
  else: notes.append("no per-kernel profile on either side (a study profiles its baseline, `search confirm` the "
                     "configs it confirms faster; `search profile --study STUDY TRIAL` any trial)")
  return secs


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p); add_format(p)
  p.add_argument("--study", required=True, help="the study of the trials (of A; of B unless B names its own)")
  p.add_argument("a", help="a trial number, or 'baseline'")
  p.add_argument("b", help="a trial number or 'baseline' of --study, or STUDY:N / STUDY:baseline for a trial of "
                 "another study in the storage (the same model on another device, before and after a code change)")


def run(args: argparse.Namespace) -> None:
  with session(open_db(args.storage, create=False)) as s:
    st = study_named(s, args.storage, args.study)
    other, sep, b = args.b.rpartition(":")
    sb = study_named(s, args.storage, other) if sep else st
    doc = compare_doc(s, st, find_trial(s, st, args.a), find_trial(s, sb, b), sb)
  secs, notes = compare_view(doc)
  emit(args.format, secs, doc, console, notes)
