"""Per-kernel profile of one decode step: each kernel run alone (no JIT graph) and timed; top kernels by time.

  python benchmarks/profile.py MODEL.gguf [config.json] [--top 25]
"""
import collections
import contextlib
import io
import re
import sys

from tinygrad import Tensor, dtypes
from tinygrad.helpers import Context

from model.deepseek2 import Transformer
from model.generate import Generator
from model.gguf_file import GGUFFile
from model.structure import StructureConfig

top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 25
args = [a for a in sys.argv[1:] if not a.startswith("--") and a != str(top)]
cfg = StructureConfig.load(args[1]) if len(args) > 1 else StructureConfig()
gen = Generator(Transformer(GGUFFile(args[0]), cfg, max_context=512))
gen.prefill(list(range(32)))
step = lambda: gen.model.forward(Tensor([[1]], dtype=dtypes.int32), gen.pos.bind(32))[0, -1].realize()
with Context(BEAM=cfg.beam):
  for _ in range(2): step()
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf), Context(DEBUG=2): step()
line = re.compile(r"\*\*\*\s+\S+\s+\d+\s+(\S+)\s+arg.*?tm\s+([\d.]+)(us|ms|s)")
agg = collections.defaultdict(lambda: [0, 0.0])
for m in map(line.search, re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue()).splitlines()):
  if m: agg[m.group(1)][0] += 1; agg[m.group(1)][1] += float(m.group(2)) * {"us": 1, "ms": 1e3, "s": 1e6}[m.group(3)]
total = sum(t for _, t in agg.values())
print(f"{len(agg)} distinct kernels, {sum(c for c, _ in agg.values())} launches, {total / 1e3:.2f} ms per decode step run kernel by kernel")
for name, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]: print(f"{t / 1e3:9.3f} ms {100 * t / total:5.1f}%  x{c:<4d} {name}")
