"""The plots of a study (matplotlib), shared by `search report` and notebooks/leaderboard.ipynb: optimisation history
with the baseline's noise band, knob importance and the single moves of a one-move-at-a-time climb
(search/effects.py), tok/s per value of each knob, kernels/token against tok/s, block proxy against full model (with
Spearman's rank correlation), and the Pareto front of a two-objective study. Each returns a Figure, or None where the
study cannot show it (say why with `missing`)."""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from matplotlib.figure import Figure
from scipy.stats import spearmanr

from db import store
from db.engine import open_db, session
from model.structure import StructureConfig
from search import effects
from search.leaderboard import figure, leaderboard, study_named
from search.ranked import RankedStorage
from space.knobs import flat


@dataclass
class StudyData:
  """What the plots read: the leaderboard document, every trial that measured ok (its own figures and its config's
  estimate), Optuna's study as the study ranks it (search/ranked.py), what the knobs are worth (search/effects.py)."""
  name: str
  board: dict[str, Any]
  ok: list[dict[str, Any]]  # number, tok_s (its own), estimate (its config's), block_tok_s, kernels, knobs (flat)
  optuna: optuna.Study
  points: effects.Points  # what the importance rests on
  changes: list[effects.Change]
  missing: dict[str, str]  # plot -> why it is not drawn


def load(url: str, name: str) -> StudyData:
  with session(open_db(url, create=False)) as s:
    st = study_named(s, url, name)
    board = leaderboard(s, st, states=("ok",))
    est = store.estimates(s, st)
    ok = [{"number": t.number, "tok_s": t.tok_s, "estimate": est[t.config_hash].median, "block_tok_s": t.block_tok_s,
           "kernels": (t.metrics or {}).get("kernels_per_token"),
           "knobs": flat(StructureConfig.from_json(t.config_json))} for t in store.trials(s, st) if t.state == "ok"]
    ranked = optuna.load_study(study_name=name, storage=RankedStorage(url))
    params = {t.number: t.params for t in ranked.get_trials(deepcopy=False)}
    return StudyData(name, board, ok, ranked, effects.points(s, st), effects.single_changes(s, st, params), {})


def _skip(d: StudyData, plot: str, why: str) -> None: d.missing[plot] = why


def _fig(w: float = 7, h: float = 4) -> tuple[Figure, Any]:
  fig = Figure(figsize=(w, h), layout="constrained")
  return fig, fig.add_subplot()


def history(d: StudyData) -> Figure | None:
  """Each config at its first trial: its estimate (the median of its measurements) with its 90% interval, marked by how
  it was measured (once, again, A/B-confirmed); the best so far by the figure the leaderboard ranks by (a confirmation's
  speedup times the baseline's estimate, else the estimate); the baseline's median and interval."""
  rows = [r for r in d.board["rows"] if r["tok_s"] is not None]
  if not rows: return _skip(d, "history", "no trial finished ok")
  fig, ax = _fig()
  b = d.board["baseline"]
  base = b["tok_s"] if b else None
  for kind, style, pick in (("measured once", "o", lambda r: r["measurements"] == 1 and not r["confirmed"]),
                            ("measured again", "s", lambda r: r["measurements"] > 1 and not r["confirmed"]),
                            ("A/B-confirmed", "*", lambda r: bool(r["confirmed"]))):
    if not (pts := sorted((r for r in rows if pick(r)), key=lambda r: r["trial"])): continue
    err = [[r["tok_s"] - (r["tok_s_low"] or r["tok_s"]) for r in pts],
           [(r["tok_s_high"] or r["tok_s"]) - r["tok_s"] for r in pts]]
    ax.errorbar([r["trial"] for r in pts], [r["tok_s"] for r in pts], yerr=err, fmt=style, ms=10 if style == "*" else 6,
                capsize=3, label=f"config's estimate, {kind}")
    for r in pts:
      if (c := r["confirmed"]) is not None:
        ax.annotate(f"{c['speedup']:.3f}x" if c["status"] == "ok" else c["status"], (r["trial"], r["tok_s"]),
                    textcoords="offset points", xytext=(4, 6), fontsize="x-small")
  order = sorted(rows, key=lambda r: r["trial"])
  ax.step([r["trial"] for r in order], np.maximum.accumulate([figure(r, base) for r in order]), where="post",
          label="best so far (as ranked)")
  if b is not None:
    ax.axhline(b["tok_s"], color="gray", ls="--", label=f"baseline, median of {b['measurements']}")
    if b["tok_s_low"] is not None:
      ax.axhspan(b["tok_s_low"], b["tok_s_high"], color="gray", alpha=0.2, label="baseline 90% interval")
  ax.set(xlabel="trial (a config's first)", ylabel="decode tok/s", title=f"{d.name}: optimisation history")
  ax.legend(fontsize="small")
  return fig


def importance(d: StudyData) -> Figure | None:
  """The importance of each knob that varied for the ranked tok/s, the top 15 (search/effects.py), titled with what
  it rests on."""
  if len(d.points.values) < 2: return _skip(d, "importance", "fewer than 2 configs measured ok")
  if not (imp := effects.importance(d.points)):
    return _skip(d, "importance", "no knob varied among the configs measured ok, or they all rank at one figure")
  names = list(imp)[:15][::-1]
  fig, ax = _fig(7, 0.3 * len(names) + 1.5)
  ax.barh(names, [imp[n] for n in names])
  ax.set(xlabel="importance for tok/s (share of its variance)", title=f"{d.name}: knob importance")
  fig.suptitle(d.points.basis(), fontsize="x-small", wrap=True)
  return fig


def changes(d: StudyData) -> Figure | None:
  """Each single change (search/effects.py), in trial order: its speedup over its parent with its 90% interval, green
  where the interval is above 1, red where below."""
  if not d.changes: return _skip(d, "changes", "no config measured ok is one move away from one measured before it")
  fig, ax = _fig(7, 0.3 * len(d.changes) + 1.5)
  for i, c in enumerate(reversed(d.changes)):
    color = "gray" if c.low is None or c.low <= 1 <= c.high else "tab:green" if c.low > 1 else "tab:red"
    err = None if c.low is None else [[c.speedup - c.low], [c.high - c.speedup]]
    ax.errorbar([c.speedup], [i], xerr=err, fmt="o", color=color, capsize=3)
  ax.set_yticks(range(len(d.changes)), [f"trial {c.trial}: {c.knob} {c.old} -> {c.new} (of {c.parent})"
                                       for c in reversed(d.changes)], fontsize="x-small")
  ax.axvline(1, color="gray", ls="--")
  ax.set(xlabel="speedup over its parent (estimates, 90% interval)", title=f"{d.name}: single changes")
  return fig


def per_knob(d: StudyData) -> Figure | None:
  """The estimate of each ok trial's config per value of each knob that took more than one value."""
  values = collections.defaultdict(lambda: collections.defaultdict(list))
  for t in d.ok:
    for k, v in t["knobs"].items(): values[k][str(v)].append(t["estimate"])
  knobs = [k for k, by in values.items() if len(by) > 1]
  if not knobs: return _skip(d, "per_knob", "no knob took two values among the ok trials")
  cols = min(4, len(knobs))
  rows = -(-len(knobs) // cols)
  fig = Figure(figsize=(3.2 * cols, 2.4 * rows), layout="constrained")
  for i, k in enumerate(knobs):
    ax = fig.add_subplot(rows, cols, i + 1)
    for j, (_, ys) in enumerate(sorted(values[k].items())):
      ax.plot([j] * len(ys), ys, "o", alpha=0.7)
    ax.set_xticks(range(len(values[k])), sorted(values[k]), fontsize="x-small", rotation=20)
    ax.set_title(k, fontsize="small")
  fig.supylabel("decode tok/s")
  return fig


def kernels(d: StudyData) -> Figure | None:
  pts = [(t["kernels"], t["estimate"]) for t in d.ok if t["kernels"] is not None]
  if not pts: return _skip(d, "kernels", "no trial recorded kernels per token")
  fig, ax = _fig()
  ax.plot(*zip(*pts, strict=True), "o")
  ax.set(xlabel="kernels per token", ylabel="decode tok/s", title=f"{d.name}: kernels per token against tok/s")
  return fig


def proxy(d: StudyData) -> Figure | None:
  pts = [(t["block_tok_s"], t["tok_s"]) for t in d.ok if t["block_tok_s"] is not None]
  if len(pts) < 2: return _skip(d, "proxy", "fewer than 2 trials ran both the block proxy and the full model")
  fig, ax = _fig()
  ax.plot(*zip(*pts, strict=True), "o")
  rho = spearmanr(*zip(*pts, strict=True)).statistic if len(pts) > 2 else float("nan")
  ax.set(xlabel="block proxy tok/s", ylabel="full model tok/s",
         title=f"{d.name}: proxy against full model (Spearman {rho:.2f}, {len(pts)} trials)")
  return fig


def pareto(d: StudyData) -> Figure | None:
  if len(d.optuna.directions) < 2: return _skip(d, "pareto", "one objective")
  done = d.optuna.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
  if not done: return _skip(d, "pareto", "no completed trial")
  front = {t.number for t in d.optuna.best_trials}
  fig, ax = _fig()
  for on, style, lbl in ((False, "o", "trial"), (True, "*", "Pareto front")):
    pts = [(t.values[1] / 1e6, t.values[0]) for t in done if (t.number in front) == on]
    if pts: ax.plot(*zip(*pts, strict=True), style, ms=10 if on else 6, label=lbl)
  ax.set(xlabel="peak device memory (MB)", ylabel="decode tok/s", title=f"{d.name}: tok/s against peak memory")
  ax.legend(fontsize="small")
  return fig


PLOTS = {"history": history, "importance": importance, "changes": changes, "per_knob": per_knob, "kernels": kernels,
         "proxy": proxy, "pareto": pareto}

