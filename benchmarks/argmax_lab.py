"""model.generate.argmax_first (the greedy decode's two reductions) over vocabulary sizes, at its default rows and
alignment and at others (128 unaligned: its form before session 10), each timed on the device per kernel
(model.profile.kernel_profile, one CUDA graph per kernel name) in a TinyJit that reads a fixed buffer.

  DEV=CUDA PYTHONPATH=. python benchmarks/argmax_lab.py [--vocab 154880 102400 ...] [--json out.jsonl]
$LABEL (benchmarks/device_env.sh) names the device in the JSON lines.
"""
import argparse
import datetime
import json
import os
import sys

import numpy as np
from tinygrad import Device, Tensor, TinyJit

from model.generate import argmax_first
from model.profile import kernel_profile

FORMS = [(256, 32), (128, 1), (256, 16), (128, 32), (128, 16), (64, 16)]  # (values a row, rows a multiple of)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--vocab", nargs="+", type=int, default=[154880, 102400, 128256, 151552, 32000])
  p.add_argument("--json", help="append one JSON line per vocabulary and form")
  args = p.parse_args()
  for n in args.vocab:
    x = Tensor(np.random.default_rng(n).standard_normal(n).astype(np.float32)).realize()
    want, rows = int(np.argmax(x.numpy())), []
    for group, align in FORMS:
      jit = TinyJit(lambda x=x, group=group, align=align: argmax_first(x, group, align).realize())
      for _ in range(3): r = jit()
      assert int(r.item()) == want, (n, group, align)
      ks = kernel_profile(jit, {}, launches=64, rounds=5)
      rows.append((sum(k["us_per_token"] for k in ks), group, align, ks))
    for us, group, align, ks in sorted(rows, key=lambda r: r[0]):
      names = " ".join(f"{k['name']}:{k['us_per_launch']:.1f}" for k in ks)
      print(f"vocab {n:6d} rows of {group:3d}, a multiple of {align:2d}: {us:6.2f} us  {names}", flush=True)
      if args.json:
        with open(args.json, "a") as fh:
          fh.write(json.dumps({"date": datetime.date.today().isoformat(), "kind": "argmax",
                               "device": os.environ.get("LABEL", Device.DEFAULT), "model": f"logits of {n} tokens",
                               "quant": "F32", "vocab": n, "group": group, "align": align,
                               "default": (group, align) == FORMS[0],
                               "us": round(us, 2), "kernels": names,
                               "command": "python benchmarks/argmax_lab.py " + " ".join(sys.argv[1:])}) + "\n")


if __name__ == "__main__":
  main()
