"""The `evaluator` command: run one trial, compare two configs A/B, or measure a device's bandwidth."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from evaluator.compare import compare
from evaluator.gate import accuracy_text, tolerance_text
from evaluator.result import STAGES, TrialResult
from evaluator.runner import Evaluator, bandwidth, default_device
from model.gguf_file import GGUFError
from model.registry import ModelNotFound, resolve
from model.structure import ConfigError, StructureConfig
from model.workload import PROMPT, Workload

console = Console(stderr=True)


def summary(r: TrialResult) -> Table:
  """The figures of one trial as a two-column table."""
  m, t = r.metrics, Table(show_header=False, box=None, pad_edge=False)
  t.add_column(style="bold")
  t.add_column()
  spec = r.spec
  t.add_row("trial",
            f"{spec['stage']} stage, {m.get('layers', '?')} blocks of {spec['model']} on {spec['device']}: "
            f"[bold]{r.status}[/]")
  t.add_row("workload", f"{Workload(spec['prompt_len'], spec.get('context', 0))}, a KV cache of {spec['max_context']} "
                        "positions")
  if r.error: t.add_row("error", r.error)
  if "tok_s" in m:
    share = f", {100 * m['bandwidth_share']:.1f}% of the device's {spec['bandwidth_gbs']:.0f} GB/s" if m.get(
      "bandwidth_share") else ""
    rounds = f"{spec['rounds']} rounds of {m.get('round_tokens', spec['n'])}"
    t.add_row("decode", f"{m['tok_s']:.2f} tok/s (min {m['tok_s_min']:.2f}, max {m['tok_s_max']:.2f} over {rounds})"
                        f"   {m['ms_p50']:.2f} ms/token p50, {m['ms_p90']:.2f} p90")
    t.add_row("per token", f"{m['kernels_per_token']} kernels in {m['graph_batches_per_token']} graph batches, "
                           f"{m['bytes_per_token'] / 1e6:.1f} MB, {m['gb_s']:.1f} GB/s{share}")
    if "prefill_tok_s" in m:
      spread = f" (min {m['prefill_tok_s_min']:.1f}, max {m['prefill_tok_s_max']:.1f} over {m['prefill_runs']} runs)" \
        if "prefill_runs" in m else ""
      t.add_row("prefill", f"{m['prefill_tok_s']:.1f} tok/s{spread}, {m['ttft_s']:.3f} s to the first token")
    t.add_row("memory",
              f"peak device {m['peak_device_bytes'] / 1e9:.3f} GB, host RSS {m['host_peak_rss_bytes'] / 1e9:.2f} GB")
    t.add_row("determinism",
              "same tokens every round" if m["deterministic"] else "[red]tokens differ between rounds[/]")
  if c := r.check:
    drift = "-" if c["drift"] is None else format(c["drift"], ".2g")
    t.add_row("check",
              f"stages on the reference's inputs: max error {c['max_rel_err']:.2g} std in {c['worst_stage']} "
              "(tolerance "
                       f"{tolerance_text(c)}), failed positions {c['failed_positions']}/{c['positions']}; routing: "
              f"{c['wrong_routing']} wrong, "
                       f"{c['near_tie_flips']} near-tie flips of {c['near_ties']} near-ties in "
              f"{c['routing_decisions']} decisions; chained: "
                       f"drift {drift} std; timed run: {c.get('tokens_compared', 0)} tokens compared, "
              f"{c.get('tokens_differ', 0)} differ")
    t.add_row("accuracy", f"{accuracy_text(c.get('accuracy'))} against the exact reference")
  if (b := m.get("beam")) and b["kernels"] + b.get("unsearched", 0):
    past = f", {b['unsearched']} past the budget at BEAM=0's heuristics" if b.get("unsearched") else ""
    t.add_row("BEAM", f"{b['search_s']:.1f}s searching {b['kernels']} kernels{past}")
  t.add_row("phases", "  ".join(f"{k[:-2]} {v:.1f}s" for k, v in r.phases.items()))
  return t


def profile_table(r: TrialResult) -> Table:
  t = Table(title=f"kernels by time per decode step (each timed alone: {r.profile[0].get('timing', 'host launches')})")
  for col in ("#", "stage", "layers", "kernel", "launches", "µs/token", "share", "GB/s"):
    t.add_column(col, justify="right" if col not in ("stage", "kernel") else "left")
  for p in r.profile:
    t.add_row(str(p["rank"]), p["stage"], p["layers"], p["name"], str(p["count"]), f"{p['us_per_token']:.1f}",
              f"{100 * p['share']:.1f}%", f"{p['gb_s']:.0f}" if p["gb_s"] is not None else "")
  return t


def prefill_profile_table(r: TrialResult) -> Table:
  m, timing = r.metrics, r.prefill_profile[0].get("timing", "host launches")
  t = Table(title=f"prefill kernels by time per graph call ({m['prefill_chunk']} tokens at position "
                  f"{m['prefill_profile_at']}; each timed alone: {timing})")
  for col in ("#", "stage", "layers", "kernel", "launches", "µs/call", "share", "GB/s", "TFLOPS"):
    t.add_column(col, justify="right" if col not in ("stage", "kernel") else "left")
  for p in r.prefill_profile:
    t.add_row(str(p["rank"]), p["stage"], p["layers"], p["name"], str(p["count"]), f"{p['us_per_token']:.1f}",
              f"{100 * p['share']:.1f}%", f"{p['gb_s']:.0f}" if p["gb_s"] is not None else "",
              f"{p['tflops']:.1f}" if p.get("tflops") is not None else "")
  return t


def timeline_table(r: TrialResult) -> Table:
  tl = r.timeline
  t = Table(title=f"the step as its native kernels overlap (stamped: {tl['span_us']:.1f} µs a step; "
                  f"{tl['plain_us']:.1f} unstamped): each one's part, from the one before it ending to its own end")
  for col in ("#", "kernel", "launches", "µs/token", "hand-off", "work", "share"):
    t.add_column(col, justify="right" if col != "kernel" else "left")
  for k in tl["kernels"]:
    t.add_row(str(k["rank"]), k["name"], str(k["count"]), f"{k['us_per_token']:.1f}", f"{k['handoff_us']:.1f}",
              f"{k['work_us']:.1f}", f"{100 * k['share']:.1f}%")
  return t


def at_least(lo: float, kind: type = int) -> Callable[[str], float]:
  """An argparse type: a number of `kind` no smaller than lo (checked when the command line is read, before anything
  runs)."""
  def parse(text: str) -> float:
    try: v = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not v >= lo: raise argparse.ArgumentTypeError(f"{text} is below {lo:g}")
    return v
  return parse


def _evaluator(args) -> Evaluator:
  kw = {k: getattr(args, k) for k in ("n", "rounds", "timeout", "beam_budget") if getattr(args, k, None) is not None}
  work = Workload(args.prompt, args.context)
  return Evaluator.for_model(str(resolve(args.model)), args.device or default_device(), prefill=not args.no_prefill,
                             prompt_len=work.prompt, context=work.context, **kw)


def _config(path: str | None) -> dict:
  return StructureConfig.load(path).to_dict() if path else StructureConfig().to_dict()


def cmd_run(args) -> int:
  ev = _evaluator(args)
  with console.status("starting") as st:
    r = ev.run(_config(args.config), args.stage, profile=args.profile, on_phase=lambda p: st.update(f"trial: {p}"),
               on_wait=console.print)
  console.print(summary(r))
  if r.profile: console.print(profile_table(r))
  if r.timeline: console.print(timeline_table(r))
  if r.prefill_profile: console.print(prefill_profile_table(r))
  if args.json: open(args.json, "w").write(r.to_json() + "\n")
  return 0 if r.ok else 1


def cmd_compare(args) -> int:
  ev = _evaluator(args)
  a, b = _config(args.a), _config(args.b)
  with console.status("starting") as st:
    c = compare(ev, a, b, args.pairs, args.stage, on_run=lambda side,
                i: st.update(f"pair {i + 1}/{args.pairs}: {side.upper()}"), on_phase=lambda p: None,
                on_wait=console.print)
  if (bad := c.failed) is not None:
    console.print(f"[red]a run failed ({bad.status}): {bad.error}[/]")
    return 1
  console.print(f"A {args.a}: {c.tok_s('a'):.2f} tok/s   B {args.b}: {c.tok_s('b'):.2f} tok/s (medians of {args.pairs} "
                "runs each)")
  console.print(f"B/A speedup {c.speedup:.3f} (pairs: {', '.join(f'{x:.3f}' for x in c.ratios)}; lower bound "
                f"{c.low:.3f})")
  if args.json:
    open(args.json, "w").write(json.dumps({"a": [r.to_dict() for r in c.a], "b": [r.to_dict() for r in c.b],
                                           "ratios": c.ratios, "speedup": c.speedup, "low": c.low, "high": c.high})
                               + "\n")
  return 0


def cmd_bandwidth(args) -> int:
  device = args.device or default_device()
  print(f"{device}: {bandwidth(device, remeasure=args.remeasure, on_wait=console.print):.1f} GB/s streaming read")
  return 0


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="evaluator",
                              description="one trustworthy decode benchmark per config, each in its own process")
  sub = p.add_subparsers(dest="cmd", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--model", required=True, help="a model name or a .gguf path")
  common.add_argument("--device", help="tinygrad device (default: tinygrad's default)")
  common.add_argument("--stage", choices=STAGES, default="full",
                      help="block: the first blocks only (the ladder's proxy); full: the model")
  common.add_argument("-n", type=int, help="tokens per measured round (default 32)")
  common.add_argument("--rounds", type=int, help="measured rounds (default 3)")
  common.add_argument("--timeout", type=float, help="wall-clock limit per trial process in seconds (default 900)")
  common.add_argument("--beam-budget", type=at_least(0, float), metavar="SECONDS",
                      help="BEAM search seconds per trial; past them, kernels whose BEAM choice is not cached get "
                      "BEAM=0's heuristics "
                           "(default: no limit)")
  common.add_argument("--context", type=at_least(0), default=0, metavar="N",
                      help="decode timed with N positions in the KV cache: the prompt's, then filled from its rows "
                      "(default: right after the prompt)")
  common.add_argument("--prompt", type=at_least(1), default=PROMPT, metavar="N",
                      help=f"a prompt of N tokens, prefilled and timed (default {PROMPT})")
  common.add_argument("--json", help="write the result as JSON to this file")
  common.add_argument("--no-prefill", action="store_true",
                      help="feed the prompt through decode steps (skips building the prefill graph)")
  r = sub.add_parser("run", parents=[common], help="measure one config")
  r.add_argument("--config", help="a StructureConfig .json or .toml (default: the baseline)")
  r.add_argument("--profile", action="store_true",
                 help="add a per-kernel profile (each kernel timed alone) and, where the step's native kernels"
                 " overlap, its timeline (each one's part of the step)")
  r.set_defaults(fn=cmd_run)
  c = sub.add_parser("compare", parents=[common], help="A/B: two configs measured alternately, the speedup of B over A")
  c.add_argument("a")
  c.add_argument("b")
  c.add_argument("--pairs", type=int, default=3)
  c.set_defaults(fn=cmd_compare)
  b = sub.add_parser("bandwidth", help="the device's streaming read bandwidth (measured once, cached)")
  b.add_argument("--device")
  b.add_argument("--remeasure", action="store_true")
  b.set_defaults(fn=cmd_bandwidth)
  args = p.parse_args(argv)
  try: sys.exit(args.fn(args))
  except (GGUFError, ModelNotFound, ConfigError, RuntimeError, OSError) as e:
    print(f"evaluator: error: {e}", file=sys.stderr)
    sys.exit(2)
