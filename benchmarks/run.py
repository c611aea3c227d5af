"""Run `model bench` for a list of StructureConfigs, each in a fresh process, sequentially; one JSON line per run.

  python benchmarks/run.py --model /tmp/glm4.gguf --set knobs --out results.jsonl
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
import tempfile
import time

from model.gguf_file import GGUFFile
from space.knobs import ModelInfo, single_knob_changes


def configs(model: str, which: str, device: str, named: list[str]) -> list[tuple[str, dict]]:
  """baseline, or the baseline plus every single-knob change of this model's search space on this device (BEAM and its
  limits apart: --beam sets it), or the named configs (NAME=FILE)."""
  if which == "named": return [(n, json.loads(open(f).read())) for n, f in (c.split("=", 1) for c in named)]
  if which == "baseline": return [("baseline", {})]
  info = ModelInfo.from_gguf(GGUFFile(model))
  changes = single_knob_changes(info, device)
  return [("baseline", {})] + [(label, json.loads(cfg.to_json())) for label, cfg in changes
                               if not label.startswith("beam")]


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--model", required=True)
  p.add_argument("--device")
  p.add_argument("--set", default="baseline", choices=["baseline", "knobs", "named"])
  p.add_argument("--config", action="append", default=[], metavar="NAME=FILE",
                 help="with --set named: a config file to run; repeatable")
  p.add_argument("--profile", action="store_true", help="add each run's per-kernel profile")
  p.add_argument("--only", nargs="*", help="run only these labels of the set")
  p.add_argument("--skip", type=int, default=0, help="skip the first N configs of the set (to split a set over calls)")
  p.add_argument("--limit", type=int, help="run at most N configs")
  p.add_argument("--beam", type=int, default=0)
  p.add_argument("-n", type=int, default=32)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--layers", type=int)
  p.add_argument("--timeout", type=int, default=300)
  p.add_argument("--out", required=True)
  args = p.parse_args()
  rows = []
  todo = [(n, c) for n, c in configs(args.model, args.set, args.device or "CPU", args.config) if not args.only
          or n in args.only][args.skip:]
  for name, cfg in todo[:args.limit]:
    cfg = {**cfg, "beam": args.beam}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f: json.dump(cfg, f)
    cmd = [sys.executable, "-m", "model", "bench", "--model", args.model, "--config", f.name, "--json", "-n",
           str(args.n), "--rounds", str(args.rounds)] + (["--profile"] if args.profile else [])
    if args.device: cmd += ["--device", args.device]
    if args.layers: cmd += ["--layers", str(args.layers)]
    t0 = time.perf_counter()
    try: r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired: r = None
    wall = time.perf_counter() - t0
    row = {"date": datetime.date.today().isoformat(), "name": name, "config": cfg,
           "config_hash": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12], "beam": args.beam,
           "wall_s": round(wall, 1), "command": " ".join(cmd[1:]).replace(f.name, f"<{name}>")}
    if r is not None and r.returncode == 0: row |= json.loads(r.stdout.strip().splitlines()[-1])
    else: row["error"] = "timeout" if r is None else (r.stderr.strip().splitlines() or ["?"])[-1][:400]
    rows.append(row)
    with open(args.out, "a") as fo: fo.write(json.dumps(row) + "\n")
    print(f"{name:32s} " + (f"{row['tok_s']:8.2f} tok/s  {row['kernels_per_token']:5d} kernels  "
                            f"{row['bytes_per_token'] / 1e6:8.1f} MB/tok  compile {row['compile_s']:6.1f}s  wall "
                            f"{wall:6.1f}s" if "tok_s" in row else f"FAILED {row['error']}"), flush=True)
    for k in row.get("profile", [])[:25]:
      gb = f" {k['gb_s']:7.1f} GB/s" if k["gb_s"] else ""
      print(f"    {k['name'][:56]:56s} x{k['count']:<4d} {k['us_per_token']:9.1f} us {k['share']:6.1%}{gb}")


if __name__ == "__main__":
  main()
