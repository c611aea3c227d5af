"""The `model` command: synth, info, run, bench."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from model.gguf_file import GGUFError, GGUFFile
from model.memory import peak_rss_bytes
from model.registry import ModelNotFound, resolve
from model.structure import ConfigError
from model.workload import PROMPT, Memory, Workload


def _load(args, max_context: int) -> tuple:
  """(the file, a Generator of its model under the selected config, load seconds, the config, the workload it was chosen
  under or None: model.production.select)."""
  from model.deepseek2 import Transformer
  from model.generate import Generator
  from model.production import select
  from model.settings import apply_process_settings
  path = resolve(args.model)
  cfg, which, chosen = select(path, args.model, args.config, args.baseline)
  print(which, file=sys.stderr)
  apply_process_settings(cfg, args.device)
  f = GGUFFile(path)
  t0 = time.perf_counter()
  m = Transformer(f, cfg, max_context=max_context, n_layers=args.layers)
  return f, Generator(m), time.perf_counter() - t0, cfg, chosen


def _note(chosen: Workload | None, run: Workload) -> None:
  from model.production import workload_note
  if note := workload_note(chosen, run): print(note, file=sys.stderr)


def cmd_synth(args) -> None:
  from model.synth import write_synthetic
  t0 = time.perf_counter()
  path = write_synthetic(args.out, args.preset, layers=args.layers, quant=args.quant, seed=args.seed,
                         legacy_kv_b=args.legacy_kv_b, routing=args.routing)
  print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")


def cmd_info(args) -> None:
  from model.deepseek2 import Hparams
  f = GGUFFile(resolve(args.model))
  print(f"{f.path}  ({f.path.stat().st_size / 1e9:.2f} GB, {len(f.tensors)} tensors)")
  for k, v in vars(Hparams.from_gguf(f)).items(): print(f"  {k:16s} {v}")
  types = Counter(t.type_name for t in f.tensors.values()).most_common()
  print("  types           " + ", ".join(f"{n}: {c}" for n, c in types))


def cmd_run(args) -> None:
  from model.tokenizer import Tokenizer
  f, gen, _, _, chosen = _load(args, args.max_context)
  tok = Tokenizer.from_metadata(f.metadata)
  text = tok.format_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
  ids = tok.encode(text)
  _note(chosen, Workload(max(1, len(ids))))
  stream = tok.streamer()
  t0, n = time.perf_counter(), 0
  for t in gen.generate(ids, args.n, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=tok.stop_ids):
    if t in tok.stop_ids: break
    sys.stdout.write(stream.feed(t))
    sys.stdout.flush()
    n += 1
  sys.stdout.write(stream.flush() + "\n")
  print(f"[{n} tokens in {time.perf_counter() - t0:.2f} s]", file=sys.stderr)


def cmd_bench(args) -> None:
  from tinygrad import Device, GlobalCounters

  from model.bench import measure, prepare  # the one decode benchmark: the same steps as a trial's
  work = Workload(args.prompt, args.context)
  # the KV cache of a trial of the same -n (evaluator/result.py TrialSpec.decoded: its 16 check positions, 3 warm-up
  # steps), so that the same kernels run
  decoded = max(args.n, 16, 3, 2)
  if refusal := Memory.of(str(resolve(args.model)), work, decoded, args.layers).refusal(work, decoded, "", None):
    print(f"model: error: {refusal}", file=sys.stderr)
    sys.exit(1)
  f, gen, load_s, cfg, chosen = _load(args, work.cache_positions(decoded))
  _note(chosen, work)
  t0 = time.perf_counter()
  first, figures = prepare(gen, work, prefill=True)
  # the prefill graph's build, the fill to the context and the first decode steps (kernels, BEAM, JIT capture)
  compile_s = time.perf_counter() - t0
  r = figures | measure(gen, first, work.depth, args.n, args.rounds, warmup=3) | {"compile_s": compile_s}
  m = gen.model
  d = {"model": str(f.path), "device": Device.DEFAULT, "layers": len(m.blocks), "load_s": load_s,
       "file_bytes": f.path.stat().st_size, "kv_cache_bytes": m.kv_cache_bytes, "device_bytes": GlobalCounters.mem_used,
       "load_peak_device_bytes": m.load_peak_bytes, "host_peak_rss_bytes": peak_rss_bytes(), **r,
       "config": cfg.to_dict()}
  if args.profile:
    from model.profile import kernel_profile, places, step_timeline
    d["profile"] = kernel_profile(gen.step_jit, {"start_pos": work.depth}, step_bytes=r["bytes_per_token"],
                                  where=places(gen.model))
    d["timeline"] = step_timeline(gen.step_jit, {"start_pos": work.depth})
  if args.json: print(json.dumps(d))
  else:
    print(f"{f.path.name}: {len(gen.model.blocks)} blocks, {work}, {r['round_tokens']} tokens x {args.rounds} rounds")
    print(f"  decode   {r['tok_s']:8.2f} tok/s (min {r['tok_s_min']:.2f}, max {r['tok_s_max']:.2f})   "
          f"{r['ms_p50']:.2f} ms/token p50, {r['ms_p90']:.2f} p90")
    print(f"  kernels  {r['kernels_per_token']} per token, {r['bytes_per_token'] / 1e6:.1f} MB read+written per token")
    print(f"  prefill  {r['prefill_tok_s']:8.2f} tok/s, {r['ttft_s']:.3f} s to the first token    load {load_s:.1f} "
          f"s, compile {r['compile_s']:.1f} s")
    print(f"  memory   device {d['device_bytes'] / 1e9:.2f} GB (file {d['file_bytes'] / 1e9:.2f} GB, KV cache "
          f"{d['kv_cache_bytes'] / 1e9:.3f} GB), host peak {d['host_peak_rss_bytes'] / 1e9:.2f} GB")
    for k in d.get("profile", []):
      print(f"  {k['rank']:3d} {k['stage']:10s} {k['layers'] or '-':6s} {k['name'][:50]:50s} x{k['count']:<4d} "
            f"{k['us_per_token']:9.1f} us/token "
            f"{k['us_per_launch']:7.1f} us {k['share']:6.1%}" + (f" {k['gb_s']:8.1f} GB/s" if k["gb_s"] else ""))
    if d.get("profile"):
      print(f"  kernels' device time {sum(k['us_per_token'] for k in d['profile']):.1f} us/token (a step takes "
            f"{1e6 / r['tok_s']:.1f} us)")
    if tl := d.get("timeline"):
      print(f"  the step as its native kernels overlap, stamped: {tl['span_us']:.1f} us a step ({tl['plain_us']:.1f} "
            "unstamped); each kernel's part, from the one before it ending to its own end: hand-off + work")
      for k in tl["kernels"]:
        print(f"  {k['rank']:3d} {k['name'][:60]:60s} x{k['count']:<4d} {k['us_per_token']:9.1f} us/token = "
              f"{k['handoff_us']:7.1f} + {k['work_us']:7.1f} {k['share']:6.1%}")


def main(argv: list[str] | None = None) -> None:
  from model.presets import PRESETS
  from model.synth import QUANT_CHOICES, ROUTING
  p = argparse.ArgumentParser(prog="model", description="deepseek2 (MLA/MoE) models in tinygrad")
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("synth", help="write a synthetic GGUF with a real model's exact shapes and random weights")
  s.add_argument("--preset", required=True, choices=sorted(PRESETS))
  s.add_argument("--layers", type=int)
  s.add_argument("--quant", default="q4_0", choices=QUANT_CHOICES)
  s.add_argument("--seed", type=int, default=0)
  s.add_argument("--legacy-kv-b", action="store_true",
                 help="write the older single attn_kv_b tensor instead of attn_k_b/attn_v_b")
  s.add_argument("--routing", choices=ROUTING, default="random",
                 help="decisive: each token's experts lead its router's scores by a clear margin, as in trained models "
                 "(random: near-ties)")
  s.add_argument("--out", required=True)
  s.set_defaults(fn=cmd_synth)
  i = sub.add_parser("info", help="print a model's hyperparameters and tensor types")
  i.add_argument("--model", required=True)
  i.set_defaults(fn=cmd_info)
  for name, fn, hlp in (("run", cmd_run, "generate text"), ("bench", cmd_bench, "measure decode speed")):
    c = sub.add_parser(name, help=hlp)
    c.add_argument("--model", required=True, help="a name (tiny, glm, deepseek-v2-lite, youtu, ...) or a .gguf path")
    c.add_argument("-n", type=int, default=64 if name == "run" else 32, help="tokens to generate")
    c.add_argument("--config", help="a StructureConfig as .json or .toml (default: the production config exported for "
                   "this model file, else the baseline)")
    c.add_argument("--baseline", action="store_true", help="the baseline config, ignoring any production config")
    c.add_argument("--device", help="tinygrad device, e.g. CPU, CUDA, METAL (default: tinygrad's default)")
    c.add_argument("--layers", type=int, help="run only the first N blocks")
    c.set_defaults(fn=fn)
    if name == "run":
      c.add_argument("--max-context", type=int, default=512)
      c.add_argument("--prompt", required=True)
      c.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
      c.add_argument("--temperature", type=float, default=0.0)
      c.add_argument("--top-p", type=float, default=1.0)
      c.add_argument("--seed", type=int)
    else:
      c.add_argument("--prompt", type=int, default=PROMPT, metavar="N",
                     help=f"a prompt of N tokens, prefilled and timed (default {PROMPT})")
      c.add_argument("--context", type=int, default=0, metavar="N",
                     help="decode timed with N positions in the KV cache: the prompt's, then filled from its rows "
                     "(model/bench.py fill_context; default: right after the prompt)")
      c.add_argument("--rounds", type=int, default=3)
      c.add_argument("--json", action="store_true", help="print one JSON object")
      c.add_argument("--profile", action="store_true",
                     help="add a per-kernel profile of one decode step (each kernel timed alone) and, where native "
                     "kernels overlap, the step's timeline (each one's part of the step)")
  args = p.parse_args(argv)
  try: args.fn(args)
  except (GGUFError, ModelNotFound, ConfigError, ValueError) as e:
    print(f"model: error: {e}", file=sys.stderr)
    sys.exit(2)
