"""The one converter from measurements to benchmarks/results.jsonl lines: an evaluator trial's JSON
(evaluator/result.py's TrialResult, as `evaluator run --json` writes it), llama.cpp's `llama-bench -o json` output and
upstream tinygrad.llm's decode (benchmarks/upstream_llm.py's JSON). Lines go to stdout.

  # decode, trial, gate, profile, timeline
  python benchmarks/record.py trial RESULT.json --device "NVIDIA H100 80GB HBM3 (CUDA)"
         --model-name "glm-4.7-flash (synthetic, exact shapes)" --quant Q4_0 [--config-name best] --command "..."
         [--llama LLAMA.json]
  python benchmarks/record.py llama LLAMA.json --model FILE --device ... --model-name ... --quant Q4_0 --command "..."
  python benchmarks/record.py upstream UPSTREAM.json --model FILE --device ... --model-name ... --quant Q4_0
         --command "..."
  # a study's trials (trial, gate) and its cost (study)
  python benchmarks/record.py study --storage URL --study NAME --device ... --model-name ... --quant Q4_0
         --command "..."
  # a step that left no JSON behind
  python benchmarks/record.py error --kind trial --model FILE --device ... --model-name ... --quant Q4_0
         --config-name best --command "..." --error "what went wrong"

Every figure's line carries its workload (model/workload.py): `context`, the positions in the KV cache when decode
timing began, and `prompt`, the tokens prefilled before it. A trial gives: a `decode` line (the figure, with
`llama_cpp_tok_s` and its stddev from llama-bench's decode test at the same depth (-d) on the same file when --llama is
given), a `prefill` line where it timed the prompt's prefill (`prefill_tok_s`, `ttft_s`, and `llama_cpp_prefill_tok_s`
from llama-bench's -p test of that length), a `trial` line (status, wall and each phase's seconds), a `gate` line (the
correctness check's verdict and figures) when the check ran, one `profile` line per kernel of the per-kernel profile,
and one `timeline` line per native kernel of the step's timeline where the profile took one (each kernel's part of the
step as the kernels overlap, model/profile.py step_timeline). A study gives a `trial` line per measured trial (its
stages' and phases' seconds, search/cost.py; its tok/s), a `gate` line per full-model verdict, a `profile` line per
kernel of each profiled trial (search confirm profiles the winner), a `confirmation` line per A/B confirmation against
the baseline (search confirm), and one `study` line: what its trials cost, the time to a config within 5% of its best,
and the projected wall time of 200. llama-bench's output gives a `llama_cpp` line per decode test (its depth as
`context`) and a `prefill` line per prompt test (config "llama.cpp"), upstream_llm.py's an `upstream` line (config
"tinygrad.llm (upstream)"). benchmarks/render.py holds the fields every kind of line must have (REQUIRED).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from evaluator.result import TrialResult
from model.gguf_file import GGUFFile
from model.structure import StructureConfig
from space.knobs import describe


def _round(x: Any, n: int) -> Any: return round(x, n) if isinstance(x, float) else x


def common(kind: str, device: str, model_name: str, layers: int | None, quant: str, config: str) -> dict[str, Any]:
  return {"date": datetime.datetime.now(datetime.UTC).date().isoformat(), "kind": kind, "device": device,
          "model": model_name, "layers": layers, "quant": quant, "config": config}


def llama_test(bench: list[dict], depth: int = 0, prompt: int = 0) -> dict | None:
  """llama-bench's decode test (-p 0 -n N) at a depth (-d), or with `prompt` its prompt test (-p P -n 0); None where it
  ran none."""
  return next((t for t in bench if (t["n_gen"] == 0 and t["n_prompt"] == prompt if prompt else
                                    t["n_gen"] > 0 and t["n_prompt"] == 0 and t.get("n_depth", 0) == depth)), None)


def llama_figures(t: dict) -> dict[str, Any]:
  """A llama-bench decode test's tok/s with its stddev and spread over the repetitions."""
  return {"context": t.get("n_depth", 0), "tok_s": _round(t["avg_ts"], 2), "tok_s_stddev": _round(t["stddev_ts"], 2),
          "tok_s_min": _round(min(t["samples_ts"]), 2), "tok_s_max": _round(max(t["samples_ts"]), 2),
          "ms_per_token": _round(1e3 / t["avg_ts"], 3), "n_gen": t["n_gen"], "repetitions": len(t["samples_ts"]),
          "n_gpu_layers": t["n_gpu_layers"], "flash_attn": t["flash_attn"], "backends": t["backends"],
          "build": t["build_commit"] + (f" b{t['build_number']}" if t["build_number"] else "")}


def llama_lines(bench: list[dict], model_file: str | None, device: str, model_name: str, quant: str, command: str,
                layers: int | None = None) -> list[dict[str, Any]]:
  """A `llama_cpp` line per decode test, a `prefill` line per prompt test; layers: the file's blocks (default: read from
  model_file, where the file is at hand)."""
  layers = layers or int(GGUFFile(model_file).key("block_count"))
  head = lambda kind: common(kind, device, model_name, layers, quant, "llama.cpp")
  return [head("llama_cpp") | llama_figures(t) | {"command": command} if t["n_gen"] else
          head("prefill") | {"prompt": t["n_prompt"], "prefill_tok_s": _round(t["avg_ts"], 1),
                             "prefill_tok_s_stddev": _round(t["stddev_ts"], 1), "ttft_s": _round(t["avg_ns"] / 1e9, 4),
                             "command": command} for t in bench]


def upstream_line(u: dict[str, Any], model_file: str | None, device: str, model_name: str, quant: str, command: str,
                  layers: int | None = None) -> dict[str, Any]:
  """upstream_llm.py's figures (the tokens after its warm-up) as an `upstream` line; layers as llama_lines'."""
  layers = layers or int(GGUFFile(model_file).key("block_count"))
  keep = ("tok_s", "tok_s_min", "tok_s_max", "ms_per_token", "launches_per_token", "bytes_per_token", "gb_s",
          "n_measured", "warmup_dropped", "tinygrad", "tokenizer_pre_substituted")
  return (common("upstream", device, model_name, layers, quant, "tinygrad.llm (upstream)")
          | {k: u.get(k) for k in keep} | {"command": command})


def check_figures(check: dict[str, Any]) -> dict[str, Any]:
  """The correctness check's scalar figures, as a gate line's `check_*` fields."""
  return {f"check_{k}": _round(v, 6) for k, v in check.items() if isinstance(v, (bool, int, float, str))}


def trial_lines(r: TrialResult, device: str, model_name: str, quant: str, config_name: str | None, command: str,
                llama: list[dict] | None = None) -> list[dict[str, Any]]:
  """config_name: what tables call the config (default: its knob values, or "baseline")."""
  cfg = StructureConfig.from_dict(r.spec["config"])
  config_name = config_name or describe(cfg) or "baseline"
  layers = r.metrics.get("layers") or int(GGUFFile(r.spec["model"]).key("block_count"))
  m, bw, out = r.metrics, r.spec.get("bandwidth_gbs"), []
  # every line of the trial carries its workload: a profile or gate line at depth is told apart from one right after
  # the prompt
  work = {"context": m.get("context", r.spec["prompt_len"]), "prompt": r.spec["prompt_len"]}
  head = common("", device, model_name, layers, quant, config_name) | {"config_hash": cfg.hash, "beam": cfg.beam} | work
  line = lambda kind, **kw: head | {"kind": kind} | kw | {"command": command}
  if r.ok:
    figures = {k: _round(m.get(k), n) for k, n in (("tok_s", 2), ("tok_s_min", 2), ("tok_s_max", 2),
                                                   ("ms_per_token", 3), ("ms_p50", 3),
               ("ms_p90", 3), ("kernels_per_token", 0), ("graph_batches_per_token", 0), ("bytes_per_token", 0),
               ("gb_s", 2), ("bandwidth_share", 4), ("prefill_tok_s", 1), ("peak_device_bytes", 0),
               ("host_peak_rss_bytes", 0), ("kernel_us_per_token", 1))
               if m.get(k) is not None}
    # llama-bench at the same depth: the context the trial was given (none: decode right after the prompt, d = 0)
    t = llama and llama_test(llama, r.spec.get("context", 0))
    vs = {"llama_cpp_tok_s": (f := llama_figures(t))["tok_s"], "llama_cpp_tok_s_stddev": f["tok_s_stddev"]} if t else {}
    out.append(line("decode", knobs=describe(cfg) or "baseline", **figures, bandwidth_gb_s=_round(bw, 1),
                    compile_s=_round(r.phases.get("compile_s"), 2), **vs))
    if m.get("prefill_tok_s"):
      pp = llama and llama_test(llama, prompt=work["prompt"])
      out.append(line("prefill", prefill_tok_s=_round(m["prefill_tok_s"], 1), ttft_s=_round(m["ttft_s"], 4),
                      **{k: _round(m[k], 1) for k in ("prefill_tok_s_min", "prefill_tok_s_max") if k in m},
                      **{k: m[k] for k in ("prefill_runs", "prefill_chunk") if k in m},
                      **({"llama_cpp_prefill_tok_s": _round(pp["avg_ts"], 1)} if pp else {})))
  out.append(line("trial", status=r.status, **{k: _round(v, 2) for k, v in r.phases.items()},
                  **({"phase": r.phase, "error": r.error[-400:]} if not r.ok else {})))
  if r.check:
    out.append(line("gate", name=config_name, state=r.status, **check_figures(r.check),
                    check_s=_round(r.phases.get("check_s"), 2)))
  out += [line("profile", **profile_fields(p, bw)) for p in r.profile]
  # per graph call of a chunk of prefill_chunk tokens at position prefill_at
  out += [line("prefill_profile", **profile_fields(p, bw), tflops=_round(p.get("tflops"), 2),
               prefill_chunk=m.get("prefill_chunk"), prefill_at=m.get("prefill_profile_at")) for p in r.prefill_profile]
  tl = r.timeline
  out += [line("timeline", **{f: _round(v, 3) for f, v in row.items()}, span_us=_round(tl["span_us"], 2),
               stamped_us=_round(tl["stamped_us"], 2), plain_us=_round(tl["plain_us"], 2), steps=tl["steps"],
               rounds=tl["rounds"]) for row in tl.get("kernels", [])]
  return out


def profile_fields(p: dict[str, Any], bw: float | None) -> dict[str, Any]:
  """A `profile` line's fields from one kernel's row of a per-kernel profile (model/profile.py); bw: the device's
  measured GB/s."""
  return {"rank": p["rank"], "name": p["name"], "stage": p.get("stage") or None, "in_layers": p.get("layers") or None,
          "count": p["count"], "us_per_token": _round(p["us_per_token"], 2),
          "us_per_launch": _round(p.get("us_per_launch"), 2), "share": _round(p["share"], 4), "timing": p.get("timing"),
          "gb_s": _round(p["gb_s"], 2), "bandwidth_share": _round(p["gb_s"] / bw, 4) if p["gb_s"] is not None and bw
          else None}


def study_lines(url: str, name: str, device: str, model_name: str, quant: str, command: str,
                project: int = 200) -> list[dict[str, Any]]:
  from db import store
  from db.engine import open_db, session
  from search.cost import study_cost
  from search.study import study_workload
  with session(open_db(url, create=False)) as s:
    st = store.get_study(s, name)
    if st is None: raise SystemExit(f"record.py: error: no study {name!r} in {url}")
    work = study_workload(s, name)
    trials = {t.number: t for t in store.trials(s, st)}
    doc, layers = study_cost(list(trials.values()), project, store.measurements(s, st, stage=None)), st.layers
    confirmed = [(c, c.trial.number) for c in store.confirmations(s, st)]
    profiles = {n: list(t.profile) for n, t in trials.items()}
  out = []
  for r in doc["trials"]:
    t = trials[r["trial"]]
    cfg = StructureConfig.from_json(t.config_json)
    head = common("", device, model_name, layers if t.stage == "full" else (t.metrics or {}).get("layers"), quant,
                  describe(cfg) or "baseline")
    head |= {"config_hash": t.config_hash, "beam": cfg.beam, "study": name, "trial": t.number}
    tok_s = {"tok_s": _round(t.metrics["tok_s"], 2)} if t.state == "ok" and (t.metrics or {}).get("tok_s") else {}
    out.append(head | {"kind": "trial", "status": t.state, "stage": t.stage, "ladder": r["ladder"]} | tok_s
               | {k: _round(v, 2) for k, v in r.items() if k.endswith("_s") and k != "tok_s"} | {"command": command})
    if t.stage == "full" and t.check:
      out.append(head | {"kind": "gate", "name": head["config"], "state": t.state, **check_figures(t.check),
                         "check_s": _round((t.phases or {}).get("check_s"), 2), "command": command})
    m = t.metrics or {}
    bw = m["gb_s"] / m["bandwidth_share"] if m.get("gb_s") and m.get("bandwidth_share") else None
    out += [head | {"kind": "profile"} | profile_fields({k: getattr(p, k) for k in store.PROFILE_COLUMNS}, bw)
            | {"command": command} for p in profiles[t.number]]  # the winner's, profiled by search confirm
  for c, number in confirmed:
    cfg = StructureConfig.from_json(trials[number].config_json)
    out.append(common("confirmation", device, model_name, layers, quant, describe(cfg) or "baseline") | {
      "config_hash": c.config_hash, "study": name, "trial": number, "pairs": c.pairs, "rounds": c.rounds,
      "tok_s": _round(c.tok_s, 2), "baseline_tok_s": _round(c.baseline_tok_s, 2), "speedup": _round(c.speedup, 4),
      "speedup_low": _round(c.speedup_low, 4), "speedup_high": _round(c.speedup_high, 4), "status": c.status,
      "command": command})
  if doc["n"]:
    out.append(common("study", device, model_name, layers, quant, "") | {
      "study": name, "context": work.depth, "prompt": work.prompt, "n": doc["n"], "full_stage": doc["full_stage"],
      "block_stage": doc["block_stage"],
      "setup_s": _round(doc["setup_s"], 1), "repeat_s": _round(doc["repeat_s"], 1),
      "mean_trial_s": _round(doc["mean_trial_s"], 1), "search_share": _round(doc["search_share"], 5),
      "median_phases_s": {k: _round(v, 2) for k, v in doc["median"].items()}, "projected_n": project,
      "projected_s": _round(doc["projected_s"], 0), "projected_h": _round(doc["projected_s"] / 3600, 2),
      "best_trial": doc["best_trial"], "best_tok_s": _round(doc["best_tok_s"], 2),
      "near_best_trial": doc["near_best_trial"], "time_to_best_s": _round(doc["time_to_best_s"], 0),
      "command": command})
  return out


def error_line(kind: str, model_file: str | None, device: str, model_name: str, quant: str, config_name: str,
               command: str, error: str) -> dict[str, Any]:
  layers = int(GGUFFile(model_file).key("block_count")) if model_file else None
  return (common(kind, device, model_name, layers, quant, config_name)
          | {"status": "error", "error": error[-400:], "command": command})


def main() -> None:
  p = argparse.ArgumentParser(prog="record.py", description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  base = argparse.ArgumentParser(add_help=False)
  for a in ("--device", "--model-name", "--quant", "--command"): base.add_argument(a, required=True)
  base.add_argument("--note", help="what tables say about the run (on every line it writes)")
  t = sub.add_parser("trial", parents=[base])
  t.add_argument("result")
  t.add_argument("--config-name", help="what tables call the config (default: its knob values, or baseline)")
  t.add_argument("--llama", help="llama-bench's JSON output for the same file, run in the same call")
  ll = sub.add_parser("llama", parents=[base])
  ll.add_argument("bench")
  up = sub.add_parser("upstream", parents=[base])
  up.add_argument("result")
  for q in (ll, up):
    q.add_argument("--model", help="the GGUF file it ran (its block count is read from it)")
    q.add_argument("--layers", type=int, help="the file's block count, where the file is not at hand")
  st = sub.add_parser("study", parents=[base])
  st.add_argument("--storage", required=True)
  st.add_argument("--study", required=True)
  e = sub.add_parser("error", parents=[base])
  e.add_argument("--kind", required=True, choices=("trial", "llama_cpp", "upstream"))
  e.add_argument("--model", help="the GGUF file, when it exists")
  e.add_argument("--config-name", required=True)
  e.add_argument("--error", required=True)
  a = p.parse_args()
  if a.cmd == "trial":
    r = TrialResult.from_dict(json.load(open(a.result)))
    lines = trial_lines(r, a.device, a.model_name, a.quant, a.config_name, a.command,
                        json.load(open(a.llama)) if a.llama else None)
  elif a.cmd in ("llama", "upstream"):
    if not (a.model or a.layers): p.error(f"{a.cmd} needs --model or --layers")
    lines = (llama_lines(json.load(open(a.bench)), a.model, a.device, a.model_name, a.quant, a.command, a.layers)
             if a.cmd == "llama" else
             [upstream_line(json.load(open(a.result)), a.model, a.device, a.model_name, a.quant, a.command, a.layers)])
  elif a.cmd == "study": lines = study_lines(a.storage, a.study, a.device, a.model_name, a.quant, a.command)
  else: lines = [error_line(a.kind, a.model, a.device, a.model_name, a.quant, a.config_name, a.command, a.error)]
  sys.stdout.write("".join(json.dumps(line | ({"note": a.note} if a.note else {})) + "\n" for line in lines))


if __name__ == "__main__":
  main()
