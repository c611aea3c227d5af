"""The views of stored studies, as JSON-able documents first and then as sections for search.formats: the leaderboard,
the list of studies, one trial in full, two trials side by side. Every figure comes from db.store (the robust estimate
of each config, its confirmations), so all views agree. The documents (`--format json`) are described in docs/json.md.
"""
from __future__ import annotations

import collections
import datetime
from typing import Any

from sqlalchemy.orm import Session

from db import store
from db.models import Confirmation, Study, Trial
from db.store import interval
from evaluator.gate import accuracy_text
from model.structure import StructureConfig
from search.formats import Section
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
  """--where knob=value filters (knob names as in the leaderboard's changes; `backend.Q4_0:expert` is read as
  `backend.Q4_0.expert`)."""
  known, out = flat(StructureConfig()), {}
  for p in pins:
    k, eq, v = p.partition("=")
    if not eq: raise ValueError(f"--where {p!r}: expected KNOB=VALUE")
    if (name := k.replace(":", ".")) not in known:
      raise ValueError(f"--where: unknown knob {k!r}; knobs: {', '.join(known)}")
    out[name] = v
  return out


def _latest(s: Session, study: Study) -> dict[str, Confirmation]:
  # in id order: the latest confirmation of each config wins
  return {c.config_hash: c for c in store.confirmations(s, study)}


def verdict(s: Session, study: Study) -> str:
  """One sentence: the confirmed winner, or plainly that no config beats the baseline (or that nothing is confirmed
  yet)."""
  conf, trials = _latest(s, study), {t.id: t for t in store.trials(s, study)}
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
    return (
        f"no config beats the baseline: the best other config, trial {cand.number}, measures "
            f"{e.median / base.median:.3f}x of it (unconfirmed)")
  return (f"nothing confirmed yet: the best measured config, trial {cand.number}, "
          f"{f'measures {e.median / base.median:.3f}x the baseline' if base else 'has no baseline to compare with'} "
          f"(`search confirm --study {study.name}`)")


def _row(t: Trial, est: store.Estimate | None, base: store.Estimate | None, c: Confirmation | None, win: Confirmation
         | None, base_cfg: StructureConfig) -> dict[str, Any]:
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
  est, conf = store.estimates(s, study), _latest(s, study)
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
          "objectives": study.objectives, "baseline_hash": study.baseline_hash,
          "states": dict(collections.Counter(t.state for t in trials).most_common()),
          "baseline": {"trial": bt.number if bt
                       else None, "tok_s": base.median, "tok_s_low": base.low, "tok_s_high": base.high,
                       "measurements": base.n} if base else None,
          "winner": next((r["trial"] for r in ranked if r["winner"]), None), "verdict": verdict(s, study),
          "rows": rows[:top]}


def _f(v: float | None, spec: str = ".2f", suffix: str = "") -> str: return "" if v is None else f"{v:{spec}}{suffix}"


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
           _f(r["block_tok_s"], ".2f", " (block)"))
    rows.append([r["rank"] or "", r["trial"], tok, _f(r["speedup"], ".3f", "x"), conf, _f(r["ms_per_token"]),
                 _f(r["kernels_per_token"], "d"), _f(r["mb_per_token"], ".1f"), _f(r["bandwidth_share"], ".1%"),
                 _f(r["peak_memory_mb"], ".1f"), r["precision"], accuracy_text(r["accuracy"]),
                 r["state"] if not r["failure"] else f"{r['state']}: {r['failure'][:60]}",
                 " ".join(f"{k}={v}" for k, v in r["changes"].items()) or "baseline"])
  records = [{**{k: v for k, v in r.items() if k not in ("confirmed", "accuracy", "changes", "trials")},
              "trials": " ".join(map(str, r["trials"])),
              **{f"confirmed_{k}": (r["confirmed"] or {}).get(k)
                 for k in ("speedup", "low", "high", "pairs", "status")},
              **{f"accuracy_{k}": (r["accuracy"] or {}).get(k) for k in ACCURACY},
              "changes": " ".join(f"{k}={v}" for k, v in r["changes"].items())} for r in doc["rows"]]
  title = (f"{doc['study']}: {doc['model']} ({doc['layers']} blocks) on {doc['device_name'] or doc['device']}  "
           f"[{', '.join(f'{k} {v}' for k, v in doc['states'].items())}]")
  drop = ("peak MB", "BW share", "MB/token", "kernels/token", "ms/token", "accuracy", "precision", "tok/s [90%] n",
          "confirmed [low, high]")
  wrap = ("state", "changes from the baseline")
  return [Section(title, cols, rows, records=records, wrap=wrap, drop=drop)], [doc["verdict"]]


def studies(s: Session) -> dict[str, Any]:
  out = []
  for st in store.studies(s):
    trials, est = store.trials(s, st), store.estimates(s, st)
    base = est.get(st.baseline_hash)
    best = max((e for h, e in est.items() if any(t.config_hash == h and t.state == "ok" for t in trials)),
               key=lambda e: e.median, default=None)
    out.append({"study": st.name, "model": st.model_name, "device": st.device, "device_name": st.device_name,
                "trials": len(trials), "ok": sum(t.state == "ok" for t in trials),
                "failed": sum(bool(t.failure_class) for t in trials),
                "best_tok_s": best.median if best else None, "speedup": best.median / base.median if best and base
                else None, "verdict": verdict(s, st), "created": _day(st.created_at), "finished": _day(st.finished_at)})
  return {"schema": SCHEMA, "study": None, "studies": out}


def studies_view(doc: dict[str, Any]) -> list[Section]:
  cols = ["study", "model", "device", "trials", "ok", "failed", "best tok/s", "speedup", "created", "finished"]
  rows = [[d["study"], d["model"], d["device_name"] or d["device"], d["trials"], d["ok"], d["failed"],
           _f(d["best_tok_s"]), _f(d["speedup"], ".3f", "x"), d["created"], d["finished"]] for d in doc["studies"]]
  return [Section("studies", cols, rows, records=[{k: v for k, v in d.items()} for d in doc["studies"]],
                  wrap=("model",), drop=("finished", "created", "failed", "ok", "best tok/s"))]


def _day(d: datetime.datetime | None) -> str: return d.strftime("%Y-%m-%d %H:%M") if d else ""


def find_trial(s: Session, study: Study, which: str) -> Trial:
  """A trial by number, or "baseline": the baseline config's first ok trial."""
  trials = store.trials(s, study)
  if which == "baseline":
    t = next((t for t in trials if t.config_hash == study.baseline_hash and t.state == "ok"), None)
    if t is None: raise ValueError(f"study {study.name!r} has no ok trial of the baseline config")
    return t
  try: n = int(which)
  except ValueError: raise ValueError(f"not a trial number: {which!r} (a number, or 'baseline')") from None
  t = next((t for t in trials if t.number == n), None)
  if t is None: raise ValueError(f"study {study.name!r} has no trial {n} (trials 0..{len(trials) - 1})")
  return t


def trial_doc(s: Session, study: Study, t: Trial) -> dict[str, Any]:
  """Everything about one trial (`search show --format json`)."""
  src = t.reused_from or t
  est, conf = store.estimates(s, study), _latest(s, study)
  e, base, c = est.get(t.config_hash), est.get(study.baseline_hash), conf.get(t.config_hash)
  cfg = StructureConfig.from_json(t.config_json)
  env, git = src.environment, src.git_state
  numbers = {x.id: x.number for x in store.trials(s, study)}
  return {"schema": SCHEMA, "study": study.name, "trial": t.number, "state": t.state, "stage": t.stage,
          "config_hash": t.config_hash, "config": cfg.to_dict(), "precision": precision(cfg), "accuracy": accuracy(t),
          "changes": changes(cfg, baseline(study)), "baseline": baseline(study).to_dict(),
          "reused_from": t.reused_from.number if t.reused_from else None,
          "estimate": {"tok_s": e.median, "low": e.low, "high": e.high, "measurements": e.n} if e else None,
          "speedup": e.median / base.median if e and base and t.state in ("ok", "reused") and src.state == "ok"
          else None, "confirmed": {"speedup": c.speedup, "low": c.speedup_low, "high": c.speedup_high, "pairs": c.pairs,
                                   "status": c.status} if c else None,
          "tok_s": src.tok_s, "block_tok_s": src.block_tok_s, "metrics": src.metrics or {}, "phases": src.phases
          or {}, "check": src.check or {}, "failure_class": src.failure_class, "error_text": src.error_text,
          "measurements": [{"kind": m.kind, "stage": m.stage, "tok_s": m.tok_s, "rounds": m.rounds,
                            "trial": numbers.get(m.trial_id), "at": m.created_at.isoformat()}
                           for m in store.measurements(s, study, None) if m.config_hash == t.config_hash],
          "profile": [{"rank": p.rank, "name": p.name, "count": p.count, "us_per_token": p.us_per_token, "gb_s": p.gb_s,
                       "share": p.share}
                      for p in src.profile],
          "environment": {k: getattr(env, k) for k in ("device", "device_name", "driver", "tinygrad_version",
                                                       "tinygrad_commit", "python", "host", "platform")} if env
          else None, "git":
            {"commit": git.commit, "branch": git.branch, "dirty": git.dirty, "diff": git.diff} if git else None,
          "worker": t.worker, "started_at": t.started_at.isoformat(), "finished_at": t.finished_at.isoformat()
          if t.finished_at else None}


def _kv(d: dict[str, Any], prefix: str = "") -> list[list[Any]]:
  rows = []
  for k, v in d.items():
    if isinstance(v, dict): rows += _kv(v, f"{prefix}{k}.")
    else: rows.append([prefix + k, f"{v:.6g}" if isinstance(v, float) else v])
  return rows


def trial_view(doc: dict[str, Any]) -> list[Section]:
  e, c = doc["estimate"], doc["confirmed"]
  head = [["state", doc["state"] + (f" (result of trial {doc['reused_from']})" if doc["reused_from"] is not None
                                    else "")],
          ["stage", doc["stage"]], ["config hash", doc["config_hash"]],
          ["precision", f"{doc['precision']}: {PRECISION[doc['precision']]}"],
          ["accuracy", accuracy_text(a := doc["accuracy"]) + (f" (against the exact reference over {a['positions']} "
                                                             "positions)" if a else "")],
          ["tok/s",
           f"{interval(store.Estimate(e['tok_s'], e['low'], e['high'], e['measurements']))} ({e['measurements']} "
           "measurements)"
           if e else ""],
          ["speedup", _f(doc["speedup"], ".3f", "x")],
          ["confirmed",
           f"{c['speedup']:.3f}x [{c['low']:.3f}, {c['high']:.3f}] over {c['pairs']} A/B pairs ({c['status']})" if c
           else ""],
          ["failure", doc["failure_class"] or ""], ["worker", doc["worker"]], ["started", doc["started_at"]],
          ["finished", doc["finished_at"]]]
  base = flat(StructureConfig.from_dict(doc["baseline"]))
  secs = [Section(f"trial {doc['trial']} of {doc['study']}", ["", ""], head),
          Section("config: changes from the baseline", ["knob", "value", "baseline"],
                  [[k, v, base[k]] for k, v in doc["changes"].items()]),
          Section("config (TOML)", code=StructureConfig.from_dict(doc["config"]).to_toml(), lang="toml"),
          Section("metrics", ["metric", "value"], _kv(doc["metrics"])),
          Section("phases (s)", ["phase", "seconds"], _kv(doc["phases"])),
          Section("correctness check", ["", ""], _kv(doc["check"])),
          Section("measurements", ["kind", "stage", "tok/s", "rounds", "at"],
                  [[m["kind"], m["stage"], f"{m['tok_s']:.2f}", " ".join(f"{x:.2f}" for x in m["rounds"] or ()),
                    m["at"][:19]]
                   for m in doc["measurements"]])]
  if doc["error_text"]: secs.append(Section("failure text", code=doc["error_text"], lang="text"))
  if doc["profile"]:
    secs.append(Section("per-kernel profile", ["rank", "kernel", "count", "us/token", "GB/s", "share"],
                        [[p["rank"], p["name"], p["count"], f"{p['us_per_token']:.1f}", _f(p["gb_s"], ".1f"),
                          f"{p['share']:.1%}"]
                         for p in doc["profile"]]))
  if doc["environment"]: secs.append(Section("environment", ["", ""], _kv(doc["environment"])))
  if g := doc["git"]:
    secs.append(Section("git state", ["", ""],
                        [["commit", g["commit"]], ["branch", g["branch"] or "(detached)"], ["dirty", g["dirty"]]]))
    if g["diff"]: secs.append(Section("git diff", code=g["diff"], lang="diff"))
  return secs


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
          "precision": {"a": da["precision"], "b": db["precision"]},
          "accuracy": {"a": da["accuracy"], "b": db["accuracy"]},
          "estimate": {"a": da["estimate"], "b": db["estimate"]},
          "confirmed": {"a": da["confirmed"], "b": db["confirmed"]},
          "knobs": [{"knob": k, "a": fa[k], "b": fb[k]} for k in fa if fa[k] != fb[k]], "metrics": metrics,
          "kernels": kernels(da["profile"], db["profile"])}


def kernels(pa: list[dict[str, Any]], pb: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Two per-kernel profiles side by side by kernel name (B's order, then the kernels A alone runs): each side's
  launches per token, microseconds per token and GB/s (None where that side does not run the kernel), and B/A in
  time."""
  ka, kb = {p["name"]: p for p in pa}, {p["name"]: p for p in pb}
  side = lambda p: {"count": p["count"], "us_per_token": p["us_per_token"], "gb_s": p["gb_s"]} if p else None
  out = []
  for name in [*kb, *(n for n in ka if n not in kb)]:
    a, b = ka.get(name), kb.get(name)
    ratio = b["us_per_token"] / a["us_per_token"] if a and b and a["us_per_token"] else None
    out.append({"kernel": name, "a": side(a), "b": side(b), "ratio": ratio})
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
  rows += [[names.get(m["metric"], m["metric"]), fmt(m["a"]), fmt(m["b"]), _f(m["ratio"], ".3f", "x")]
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
  secs = [Section(f"{doc['study']}: {b} (B) against {a} (A)", heads, rows,
                  records=[{"name": r[0], "a": r[1], "b": r[2], "ratio": r[3]} for r in rows])]
  if ks := doc["kernels"]:
    num = lambda x, k, spec: _f(x.get(k), spec) if x else "-"
    fields = (("count", "d"), ("us_per_token", ".1f"), ("gb_s", ".1f"))
    krows = [[k["kernel"], *(num(k[x], f, spec) for f, spec in fields[:2] for x in "ab"), _f(k["ratio"], ".3f", "x"),
              num(k["a"], "gb_s", ".1f"), num(k["b"], "gb_s", ".1f")] for k in ks]
    records = [{"kernel": k["kernel"], **{f"{x}_{f}": (k[x] or {}).get(f) for x in "ab" for f, _ in fields},
                "ratio": k["ratio"]} for k in ks]
    secs.append(Section("per-kernel profile (B against A; -: not run on that side)",
                        ["kernel", "A count", "B count", "A us/token", "B us/token", "B/A", "A GB/s", "B GB/s"], krows,
                        records=records, wrap=("kernel",), drop=("A GB/s", "B GB/s", "A count", "B count")))
  else: notes.append("no per-kernel profile on either side (`search confirm` profiles the winner; "
                     "`model bench --profile`)")
  return secs, notes
