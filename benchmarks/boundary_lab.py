"""What a dependency between two decode steps costs, by how the second learns that the first is done: CUDA graph edges
(ordinary, or programmatic as OverlapGraph makes them) against hand-offs inside one kernel (a ticket per block, a
grid-wide count, a flag per block). benchmarks/boundary_lab.cu holds the kernels and says what each variant does; this
builds it with nvcc, runs it and writes its lines as results.jsonl lines (kind `boundary`).

  python benchmarks/boundary_lab.py [--steps 400] [--reps 20] [--json out.jsonl]
$LABEL (benchmarks/device_env.sh) names the device in the JSON lines.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).with_name("boundary_lab.cu")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--arch", default="sm_90")
  p.add_argument("--json", help="append one JSON line per width, block count and variant")
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as d:
    exe = Path(d) / "boundary_lab"
    subprocess.run(["nvcc", "-O3", f"-arch={args.arch}", "-o", str(exe), str(SRC)], check=True)
    out = subprocess.run([str(exe), str(args.steps), str(args.reps)], check=True, capture_output=True, text=True).stdout
  command, rows = "python " + " ".join(sys.argv), [json.loads(line) for line in out.splitlines()]
  for r in rows:
    print(f"{r['variant']:>10} {r['width']:5d} wide, {r['blocks']:4d} blocks: {r['us']:.3f} us a step "
          f"({r['us_min']:.3f}-{r['us_max']:.3f})"
          f"{'' if r['equal'] is not False else '  DIFFERS from graph-full'}", flush=True)
  if args.json:
    with open(args.json, "a") as fh:
      for r in rows:
        fh.write(json.dumps({"date": datetime.date.today().isoformat(), "kind": "boundary",
                             "device": os.environ.get("LABEL", f"{r['gpu']} (CUDA)"),
                             "model": "none (a chain of dependent steps)", "quant": "-",
                             **{k: v for k, v in r.items() if k != "gpu"}, "command": command}) + "\n")


if __name__ == "__main__":
  main()
