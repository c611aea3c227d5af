"""Upstream tinygrad's own decoder (`python -m tinygrad.llm --benchmark`) on a GGUF file, as a peer of structsearch's:
its per-token timing lines turned into one JSON object for benchmarks/record.py (`record.py upstream`).

  DEV=CUDA python -m benchmarks.upstream_llm --model F.gguf [--tokens 20] [--warmup 3] --json OUT.json

The tinygrad 0.14.0 wheel ships tinygrad/llm without tinygrad.llm.kernels.amd, which model.py imports; a stand-in takes
its place (Linear is tinygrad.nn.Linear; amd_custom_kernels_supported is False, so its RDNA3 kernels are never reached).
The first --warmup tokens (3) are left out of the figures: token 0 is the prompt (BOS) through the prefill JIT's first,
unjitted call, token 1 the rollout JIT's first call (unjitted: every decode kernel compiled), token 2 its capture; only
from token 3 on does the rollout JIT replay, which is what decode speed means. A tokenizer preset upstream does not know
(deepseek-llm: DeepSeek-V2(-Lite) files) is read as llama3's, recorded as `tokenizer_pre_substituted`: the benchmark
decodes from BOS, so the preset only changes the text it prints. launches_per_token and bytes_per_token are the
last token's (tinygrad's GlobalCounters: its launches, which count a whole graph once where the JIT batches kernels into
graphs, as on CUDA, and the bytes its kernels' estimates move).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import re
import shlex
import statistics
import sys
import types
from collections.abc import Callable
from typing import Any

from tinygrad import Device, GlobalCounters

# "  12.34 ms,  81.00 tok/s,   12.34 GB/s, 123/456 MB  --  text": helpers.Timing with cli.py's on_exit
LINE = re.compile(r"^\s*([\d.]+) ms,\s*([\d.]+) tok/s,\s*([\d.]+) GB/s, \d+/\d+ MB  --  ", re.M)


def _amd_only(name: str) -> Callable[..., Any]:
  def f(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"{name} is an RDNA3 kernel of tinygrad.llm.kernels.amd, which the tinygrad wheel lacks "
                              "(benchmarks/upstream_llm.py's stand-in has none)")
  return f


def install_kernels_stand_in() -> None:
  """Put tinygrad.llm.kernels(.amd) in sys.modules so tinygrad.llm.model imports; a real module is left alone."""
  try:
    import tinygrad.llm.kernels.amd  # noqa: F401
    return
  except ImportError: pass
  from tinygrad import nn
  pkg, amd = types.ModuleType("tinygrad.llm.kernels"), types.ModuleType("tinygrad.llm.kernels.amd")
  pkg.__path__, pkg.amd = [], amd
  amd.Linear, amd.amd_custom_kernels_supported = nn.Linear, lambda device: False
  amd.gated_delta_prefill, amd.flash_attention = _amd_only("gated_delta_prefill"), _amd_only("flash_attention")
  sys.modules |= {"tinygrad.llm.kernels": pkg, "tinygrad.llm.kernels.amd": amd}


def _lenient_tokenizer(cli: types.ModuleType, substituted: list[str]) -> None:
  """Let cli.main read a file whose tokenizer preset upstream refuses, as llama3's; the preset goes to `substituted`."""
  strict = cli.SimpleTokenizer.from_gguf_kv
  def from_gguf_kv(kv: dict) -> Any:
    try: return strict(kv)
    except ValueError as e:
      if "tokenizer preset" not in str(e): raise
      substituted.append(kv["tokenizer.ggml.pre"])
      return strict(kv | {"tokenizer.ggml.pre": "llama3"})
  cli.SimpleTokenizer.from_gguf_kv = staticmethod(from_gguf_kv)


def parse(text: str) -> list[tuple[float, float, float]]:
  """(ms, tok/s, GB/s) of each decoded token, in order."""
  return [(float(ms), float(ts), float(gbs)) for ms, ts, gbs in LINE.findall(text)]


def summary(rows: list[tuple[float, float, float]], warmup: int) -> dict[str, Any]:
  """The figures of the tokens after the first `warmup`."""
  if len(rows) <= warmup: raise ValueError(f"{len(rows)} token lines, not more than the {warmup} warm-up tokens")
  rest = rows[warmup:]
  tok_s = [r[1] for r in rest]
  return {"tok_s_per_token": [r[1] for r in rows], "warmup_dropped": warmup, "n_measured": len(rest),
          "tok_s": round(statistics.median(tok_s), 2), "tok_s_min": min(tok_s), "tok_s_max": max(tok_s),
          "ms_per_token": round(statistics.median(r[0] for r in rest), 3),
          "gb_s": round(statistics.median(r[2] for r in rest), 2)}


def run(model: str, tokens: int) -> tuple[str, str | None, dict[str, int]]:
  """Upstream's CLI benchmark in this process (its output echoed): what it printed, the tokenizer preset read as
  llama3's (if any), and the last token's launches and bytes (cli.main resets GlobalCounters before each token and exits
  after the last; its printed GB/s has two decimals)."""
  install_kernels_stand_in()
  from tinygrad.llm import cli
  _lenient_tokenizer(cli, substituted := [])
  out, argv = io.StringIO(), sys.argv
  sys.argv = ["tinygrad.llm", "--model", model, "--benchmark", str(tokens)]
  try:
    with contextlib.redirect_stdout(out): cli.main()
  except SystemExit as e:  # cli.main ends its benchmark with exit(0)
    if e.code not in (0, None): raise RuntimeError(f"tinygrad.llm exited with {e.code}") from None
  finally:
    sys.argv = argv
    sys.stdout.write(out.getvalue())
  last = {"launches_per_token": GlobalCounters.kernel_count, "bytes_per_token": int(GlobalCounters.global_mem)}
  return out.getvalue(), next(iter(substituted), None), last


def main() -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.upstream_llm", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", required=True, help="a GGUF file")
  p.add_argument("--tokens", type=int, default=20, help="tokens decoded (upstream's --benchmark COUNT)")
  p.add_argument("--warmup", type=int, default=3, help="first tokens left out of the figures (JIT capture, compiles)")
  p.add_argument("--json", required=True, help="where the JSON object goes")
  a = p.parse_args()
  try:
    text, pre, last = run(a.model, a.tokens)
    doc = summary(parse(text), a.warmup) | last
  except Exception as e:  # noqa: BLE001 -- any failure of upstream's code is this step's one-line verdict
    kind = type(e).__name__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__name__}"
    sys.exit(f"upstream_llm: error: tinygrad.llm on {a.model}: {kind}: {next(iter(str(e).splitlines()), '')}")
  head = next((x for x in text.splitlines() if x.startswith("using model")), "")
  doc |= {"command": "python -m benchmarks.upstream_llm " + shlex.join(sys.argv[1:]),
          "upstream_command": f"DEV={Device.DEFAULT} python -m tinygrad.llm --model {a.model} --benchmark {a.tokens}",
          "tokens": a.tokens, "tinygrad": importlib.metadata.version("tinygrad"), "device": Device.DEFAULT,
          "loaded": head, "tokenizer_pre_substituted": pre}
  with open(a.json, "w") as f: json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()
