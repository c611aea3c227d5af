"""`search space`: the knobs of a model's space on a device kind (and backend family), their domains and defaults, and
the number of distinct configurations; or one random valid config (--sample)."""
from __future__ import annotations

import argparse

from rich.table import Table

from model.backends.catalog import FAMILIES
from model.gguf_file import GGUFFile
from model.registry import resolve
from search.formats import console
from search.options import device_name
from space.knobs import ModelInfo, device_kind, knobs, sample, size


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", required=True, help="a model name or a .gguf path")
  p.add_argument("--device", type=device_name,
                 help="device kind whose knobs to list (default CPU): only the values that run there")
  p.add_argument("--family", choices=FAMILIES,
                 help="the backends to list: all that run on the device (default), or portable ones")
  p.add_argument("--sample", action="store_true", help="print one random valid StructureConfig as JSON")
  p.add_argument("--seed", type=int, default=0, help="the random seed of --sample (default 0)")


def run(args: argparse.Namespace) -> None:
  f = GGUFFile(resolve(args.model))
  info, device, family = ModelInfo.from_gguf(f), args.device or "CPU", args.family or "all"
  if args.sample:
    print(sample(info, args.seed, device, family).to_json())
    return
  backends = "" if family == "all" else f" ({family} backends)"
  t = Table(title=f"search space of {f.path.name} on {device_kind(device)}{backends}: "
            f"{size(info, device, family=family):,} distinct configurations")
  for col in ("knob", "domain", "default", "what it changes"): t.add_column(col)
  for k in knobs(info, device, family): t.add_row(k.name, " | ".join(map(str, k.choices)), str(k.default), k.doc)
  console.print(t)
