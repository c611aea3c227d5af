"""`search report`: a study for sharing, in one directory: report.md (Markdown beside its PNG plots) and report.html
(the same, self-contained: the plots are embedded), with the leaderboard, the verdict (the confirmed winner, or that no
config beats the baseline), the noise figure, the proxy's rank correlation and the plots of search.plots."""
from __future__ import annotations

import argparse
import base64
import datetime
import pathlib
import re

import markdown as md

from db import store
from db.engine import open_db, session
from search.compare import compare_doc, profile_sections
from search.formats import Section, console, markdown
from search.leaderboard import leaderboard_view
from search.options import add_storage, out_dir
from search.plots import PLOTS, load

CAPTIONS = {"history": "Optimisation history: each config's estimate with its 90% interval (measured once, again, or "
                       "A/B-confirmed), the best so far as the leaderboard ranks, and the baseline's median and 90% "
                       "interval",
            "importance": "Knob importance for tok/s (Optuna's fANOVA over the configs measured ok, each at its "
                          "ranked figure, of the knobs that varied; the title says how many configs and trials)",
            "changes": "Single changes: each config's speedup over its parent, the fastest config measured before it "
                       "one move away (one knob, or `backends`: every stage and weight on one backend), with its 90% "
                       "interval",
            "per_knob": "The estimate of each ok config per value of each knob",
            "kernels": "Kernels per token against tok/s",
            "proxy": "Block proxy tok/s against full-model tok/s",
            "pareto": "tok/s against peak device memory: the Pareto front"}
CSS = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
       "table{border-collapse:collapse;font-size:small}"
       "td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}code,pre{background:#f4f4f4}")


def report(url: str, name: str, out: pathlib.Path) -> pathlib.Path:
  """Write out/report.md, out/report.html and out/<plot>.png; returns the HTML's path."""
  d = load(url, name)
  out.mkdir(parents=True, exist_ok=True)
  b = d.board
  secs, notes = leaderboard_view(b)
  base = (f"the baseline was measured {b['baseline']['measurements']} times: {b['baseline']['tok_s']:.2f} tok/s"
          + (f" [{b['baseline']['tok_s_low']:.2f}, {b['baseline']['tok_s_high']:.2f}]"
             if b["baseline"]["tok_s_low"] is not None else "")
          if b["baseline"] else "the baseline has no ok measurement")
  lines = [f"# structsearch report: {name}", "",
           f"{b['model']} ({b['layers']} blocks, sha256 {b['model_sha256'][:16]}) on "
           f"{b['device_name'] or b['device']}; {b['workload']}; objectives {b['objectives']}; trials: "
           f"{', '.join(f'{k} {v}' for k, v in b['states'].items())}. Written "
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.", "",
           f"**{b['verdict'][:1].upper() + b['verdict'][1:]}.**", "",
           f"The config to ship ({notes[0]}).", "",
           f"Noise: {base}. tok/s is the median of a config's measurements with a 90% interval (db.store.estimates).",
           "", markdown(secs, level=2), "", *_kernel_diff(url, name, b), ""]
  for key, plot in PLOTS.items():
    if (fig := plot(d)) is None: continue
    fig.savefig(out / f"{key}.png", dpi=100)
    lines += [f"## {CAPTIONS[key]}", "", f"![{key}]({key}.png)", ""]
  if d.missing: lines += ["Not drawn: " + "; ".join(f"{k} ({why})" for k, why in d.missing.items()) + ".", ""]
  text = "\n".join(lines)
  (out / "report.md").write_text(text)
  embed = lambda m: f'src="data:image/png;base64,{base64.b64encode((out / m.group(1)).read_bytes()).decode()}"'
  body = re.sub(r'src="([a-z_]+\.png)"', embed, md.markdown(text, extensions=["tables", "fenced_code"]))
  head = f"<meta charset='utf-8'><title>{name}</title><style>{CSS}</style>"
  (html := out / "report.html").write_text(f"<!doctype html><html><head>{head}</head><body>{body}</body></html>")
  return html


def _kernel_diff(url: str, name: str, board: dict) -> list[str]:
  """Markdown: where the speed came from, by stage and kernel: the config to ship against the baseline, or where that is
  the baseline, the highest-ranked other config with a profile; both sides' profiles are needed (said where not)."""
  with session(open_db(url, create=False)) as s:
    st = store.get_study(s, name)
    trials = {t.number: t for t in store.trials(s, st)}
    base = trials.get((board["baseline"] or {}).get("trial"))
    ranked = [trials[r["trial"]] for r in board["rows"] if r["config_hash"] != st.baseline_hash]
    pick = next((t for t in ranked if t.number == (board["best"] or {}).get("trial")), None) or next(
      (t for t in ranked if (t.reused_from or t).profile), None)
    if pick is None: return []
    missing = [w for w, t in (("the baseline", base), (f"trial {pick.number}", pick))
               if t is None or not (t.reused_from or t).profile]
    if missing: return [f"No kernel diff: no per-kernel profile of {' nor '.join(missing)} (`search profile --study "
                        "STUDY TRIAL` makes one)."]
    doc = compare_doc(s, st, base, pick)
  secs: list[Section] = profile_sections(doc, [])
  return [f"## Where the speed came from: trial {pick.number} against the baseline (trial {base.number})", "",
          markdown(secs, level=3)]


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p)
  p.add_argument("--study", required=True, help="the study to report")
  p.add_argument("--out", required=True, type=out_dir,
                 help="directory to write report.md, report.html and the plots into")


def run(args: argparse.Namespace) -> None:
  try: html = report(args.storage, args.study, args.out)
  except OSError as e:  # a file system that takes no files (/proc), or full
    raise ValueError(f"cannot write the report into {args.out}: {e.strerror or e}") from None
  console.print(f"report of {args.study}: {html}")
