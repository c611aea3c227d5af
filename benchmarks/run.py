"""Run `model bench` for a list of StructureConfigs, each in a fresh process, sequentially; one JSON line per run.

  python benchmarks/run.py --model /tmp/glm4.gguf --device CUDA --set knobs --out results.jsonl
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

# single-knob changes from the baseline (the default StructureConfig)
KNOBS: dict[str, dict] = {
  "baseline": {},
  "merge_gate_up_routed": {"merge_gate_up_routed": True},
  "merge_gate_up_shared": {"merge_gate_up_shared": True},
  "merge_gate_up_dense": {"merge_gate_up_dense": True},
  "topk=sort": {"topk": "sort"},
  "topk=argmax": {"topk": "argmax"},
  "moe_combine=matmul": {"moe_combine": "matmul"},
  "mla_absorb=load": {"mla_absorb": "load"},
  "attention=sdpa": {"attention": "sdpa"},
  "kv_dtype=float32": {"kv_dtype": "float32"},
  "act_dtype=float16": {"act_dtype": "float16"},
  "router_fp32=false": {"router_fp32": False},
  "Q4_0:expert=fp16_cache": {"backends": {"Q4_0:expert": "fp16_cache"}},
  "Q4_0:dense=fp16_cache": {"backends": {"Q4_0:dense": "fp16_cache"}},
  "barriers:none": {"barriers": {}},
  "barrier:expert_down=contiguous": {"barriers": {"moe_gate_up": "contiguous", "dense_gate_up": "contiguous", "shexp_gate_up": "contiguous",
                                                   "block_out": "contiguous", "expert_down": "contiguous"}},
  "barrier:q_proj=contiguous": {"barriers": {"moe_gate_up": "contiguous", "dense_gate_up": "contiguous", "shexp_gate_up": "contiguous",
                                              "block_out": "contiguous", "q_proj": "contiguous"}},
}
SETS = {"baseline": ["baseline"], "knobs": list(KNOBS)}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--model", required=True)
  p.add_argument("--device")
  p.add_argument("--set", default="baseline", choices=sorted(SETS))
  p.add_argument("--only", nargs="*", help="names from KNOBS instead of a set")
  p.add_argument("--beam", type=int, default=0)
  p.add_argument("-n", type=int, default=32)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--layers", type=int)
  p.add_argument("--timeout", type=int, default=300)
  p.add_argument("--out", required=True)
  args = p.parse_args()
  rows = []
  for name in args.only or SETS[args.set]:
    cfg = {**KNOBS[name], "beam": args.beam}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f: json.dump(cfg, f)
    cmd = [sys.executable, "-m", "model", "bench", "--model", args.model, "--config", f.name, "--json",
           "-n", str(args.n), "--rounds", str(args.rounds)]
    if args.device: cmd += ["--device", args.device]
    if args.layers: cmd += ["--layers", str(args.layers)]
    t0 = time.perf_counter()
    try: r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired: r = None
    wall = time.perf_counter() - t0
    row = {"date": datetime.date.today().isoformat(), "name": name, "config": cfg,
           "config_hash": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12], "beam": args.beam, "wall_s": round(wall, 1),
           "command": " ".join(cmd[1:]).replace(f.name, f"<{name}>")}
    if r is not None and r.returncode == 0: row |= json.loads(r.stdout.strip().splitlines()[-1])
    else: row["error"] = "timeout" if r is None else (r.stderr.strip().splitlines() or ["?"])[-1][:400]
    rows.append(row)
    with open(args.out, "a") as fo: fo.write(json.dumps(row) + "\n")
    print(f"{name:32s} " + (f"{row['tok_s']:8.2f} tok/s  {row['kernels_per_token']:5d} kernels  {row['bytes_per_token'] / 1e6:8.1f} MB/tok  "
                            f"compile {row['compile_s']:6.1f}s  wall {wall:6.1f}s" if "tok_s" in row else f"FAILED {row['error']}"), flush=True)


if __name__ == "__main__":
  main()
