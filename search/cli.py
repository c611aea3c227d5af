"""The `search` command. So far: `search space` describes or samples the search space of a model."""
from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from model.gguf_file import GGUFError, GGUFFile
from model.registry import ModelNotFound, resolve
from space.knobs import ModelInfo, knobs, sample, size


def cmd_space(args) -> None:
  f = GGUFFile(resolve(args.model))
  info = ModelInfo.from_gguf(f)
  if args.sample:
    print(sample(info, args.seed).to_json())
    return
  t = Table(title=f"search space of {f.path.name}: {size(info):,} distinct configurations")
  for col in ("knob", "domain", "default", "what it changes"): t.add_column(col)
  for k in knobs(info): t.add_row(k.name, " | ".join(map(str, k.choices)), str(k.default), k.doc)
  Console().print(t)


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="search", description="structural optimization search for tinygrad MLA/MoE inference")
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("space", help="print the search space of a model (or a random valid config with --sample)")
  s.add_argument("--model", required=True, help="a model name or a .gguf path")
  s.add_argument("--sample", action="store_true", help="print one random valid StructureConfig as JSON")
  s.add_argument("--seed", type=int, default=0)
  s.set_defaults(fn=cmd_space)
  args = p.parse_args(argv)
  try: args.fn(args)
  except (GGUFError, ModelNotFound, ValueError) as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(2)
