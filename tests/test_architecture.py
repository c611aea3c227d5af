"""The architecture's numbers (docs/architecture.md): the project's import graph has no cycle and no upward arrow, no
backend imports the model, the config type loads no tinygrad, a backend (with fused stages or without) is one new file
and one catalog row, a knob is one declaration beside its field."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from knobcheck import assert_close, mix_info

from model.backends import catalog, registry
from model.structure import ConfigError, StructureConfig
from space.knobs import ModelInfo, knobs

PROJECT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("model", "space", "search", "evaluator", "db")
LOWER = {"model": ("search", "evaluator", "space", "db"), "space": ("search", "evaluator", "db"),
         "db": ("search", "evaluator", "model", "space"),
         "evaluator": ("search", "space")}  # what each layer may not import


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PROJECT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
  """Every project module -> the project modules it imports, anywhere in it (a function's import counts, and so does one
  under TYPE_CHECKING): `from a import b` imports a.b where that is a module, else a."""
  files = {module_name(p): p for pkg in PACKAGES for p in (PROJECT / pkg).rglob("*.py") if "migrations" not in p.parts}
  graph: dict[str, set[str]] = {}
  for name, path in files.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import): deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names}
    graph[name] = {d for d in deps if d in files and d != name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
  def visit(v: str) -> None:
    index[v] = low[v] = n[0]
    n[0] += 1
    stack.append(v), on.add(v)
    for w in graph[v]:
      if w not in index: visit(w); low[v] = min(low[v], low[w])
      elif w in on: low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while (w := stack.pop()) != v: comp.append(w); on.discard(w)
      on.discard(v)
      if comp: out.append(sorted([v, *comp]))
  for v in graph:
    if v not in index: visit(v)
  return out


def test_no_import_cycles_and_no_upward_arrows() -> None:
  graph = import_graph()
  assert len(graph) > 60 and cycles(graph) == []
  upward = [(m, d) for m, deps in graph.items() for d in deps if d.split(".")[0] in LOWER.get(m.split(".")[0], ())]
  assert upward == []
  # the views read the database, never the worker
  views = ("search.view", "search.leaderboard", "search.dashboard", "search.report", "search.plots", "search.cost",
           "search.export")
  assert not [(v, d) for v in views for d in graph[v] if d in ("search.worker", "search.noise", "search.cli")]
  assert "search.worker" not in {m for m, deps in graph.items() for d in deps if d == "search.worker"} - {"search.cli"}


def test_no_backend_imports_the_model() -> None:
  """The backends see the model through the stage contract (model/stages.py) alone: no module of model/backends imports
  model.deepseek2, which calls the registry that imports them."""
  graph = import_graph()
  backends = [m for m in graph if m.startswith("model.backends.")]
  assert len(backends) >= 7 and [m for m in backends if "model.deepseek2" in graph[m]] == []


def test_the_config_loads_no_tinygrad() -> None:
  code = "import sys, model.structure; print(sorted(m for m in sys.modules if m.split('.')[0] == 'tinygrad'))"
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT, check=True)
  assert r.stdout.strip() == "[]"


DEQUANT = '''
"""A test backend: every product against the weight dequantized to float32 where it is used."""
from model.backends.registry import Backend, register


class Dequant(Backend):
  name = "dequant"
  def linear(self, x, w): return x.float() @ w.to_float().T
  def per_head(self, x, w): return (x.float().unsqueeze(-2) * w.to_float()).sum(-1)
  def expert(self, x, sel, w): return (x.float().unsqueeze(-2) * w.to_float()[sel]).sum(-1)


register(Dequant())
'''


def test_a_new_backend_is_one_file_and_one_catalog_row(gguf_file, tmp_path, monkeypatch) -> None:
  """A backend written here (the file) and its catalog row: the config accepts it, the space offers it on every device
  (portable) for the types it serves, the registry loads its module when a model first asks for it, and the model
  computes the baseline's logits with it."""
  (tmp_path / "dequant_backend.py").write_text(DEQUANT)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(catalog.CATALOG, "dequant",
                      catalog.Row("dequant", "dequant_backend", "a test backend", quants=frozenset({"Q4_0"})))
  info = mix_info("q4_0")
  for device in ("CPU", "METAL", "CUDA"):
    domains = {k.name: k.choices for k in knobs(info, device) if k.name.startswith("backend.")}
    assert all("dequant" in c for n, c in domains.items() if ".Q4_0." in n), domains
    assert all("dequant" not in c for n, c in domains.items() if ".Q4_0." not in n)
  assert "dequant" not in knobs(info, "CPU", "all")[0].choices  # no fused stage
  cfg = StructureConfig(kv_dtype="float32", backends={"Q4_0:dense": "dequant", "Q4_0:expert": "dequant"})
  with pytest.raises(ConfigError, match="fused.moe"): StructureConfig(fused={"moe": "dequant"})
  assert "dequant_backend" not in sys.modules
  from model.deepseek2 import Transformer
  from model.generate import Generator
  from model.gguf_file import GGUFFile
  path, tokens = gguf_file("tiny", "q4_0"), [(7919 * i + 17) % 1000 for i in range(8)]
  logits = [Generator(Transformer(GGUFFile(path), c, max_context=16),
                      chunk=len(tokens)).prefill(tokens).astype(np.float64)
            for c in (StructureConfig(kv_dtype="float32"), cfg)]
  assert "dequant_backend" in sys.modules and isinstance(registry.get("dequant"), registry.Backend)
  assert_close("a test backend", logits[1], logits[0], 1e-4)


PLAIN = '''
"""A test fused backend: its FFN stages as tinygrad ops over the stage's inputs (model/stages.py), its products against
the weight dequantized where it is used."""
from model.backends.registry import Backend, register
from model.stages import rms_norm

CALLS = []  # the stages the model called


class Plain(Backend):
  name = "plain"
  def linear(self, x, w): return x.float() @ w.to_float().T
  def per_head(self, x, w): return (x.float().unsqueeze(-2) * w.to_float()).sum(-1)
  def expert(self, x, sel, w): return (x.float().unsqueeze(-2) * w.to_float()[sel]).sum(-1)

  def glu(self, x, g): return self.linear(self.linear(x, g.gate).silu() * self.linear(x, g.up), g.down)

  def ffn(self, st, h):
    CALLS.append("ffn")
    return h + self.glu(rms_norm(h, st.ffn_norm, st.eps), st.ffn)

  def moe(self, st, h, sel, wts, logits):
    CALLS.append("moe")
    xn, e = rms_norm(h, st.ffn_norm, st.eps), st.experts
    xe = xn.unsqueeze(2)  # (1, 1, 1, dim): the K selected experts' one input
    y = self.expert(self.expert(xe, sel, e.gate).silu() * self.expert(xe, sel, e.up), sel, e.down)
    out = (y * wts.unsqueeze(-1)).sum(2)
    return h + (out if st.shared is None else out + self.glu(xn, st.shared))


register(Plain())
'''


def test_a_fused_backend_is_written_against_the_stage_contract(gguf_file, tmp_path, monkeypatch) -> None:
  """A backend whose ffn and moe stages are written here from their inputs (model/stages.py) alone, and its catalog row
  listing them: a tiny model decodes the baseline's logits with both stages on it. A stage it lacks raises ConfigError
  naming both; a row that lists a stage its backend lacks is refused when the backend registers."""
  (tmp_path / "plain_backend.py").write_text(PLAIN)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
  row = catalog.Row("plain", "plain_backend", "a test fused backend", stages=frozenset({"ffn", "moe"}))
  monkeypatch.setitem(catalog.CATALOG, "plain", row)
  from model.deepseek2 import Transformer
  from model.generate import Generator
  from model.gguf_file import GGUFFile
  path, tokens = gguf_file("tiny", "q4_0"), [(7919 * i + 17) % 1000 for i in range(8)]
  def decode(cfg: StructureConfig) -> np.ndarray:
    gen = Generator(Transformer(GGUFFile(path), cfg, max_context=16), chunk=len(tokens))
    gen.prefill(tokens)
    return np.stack([gen.step_logits(t, len(tokens) + i) for i, t in enumerate((5, 7, 11))]).astype(np.float64)
  base = decode(StructureConfig(kv_dtype="float32"))
  got = decode(StructureConfig(kv_dtype="float32", fused={"ffn": "plain", "moe": "plain"}))
  assert set(sys.modules["plain_backend"].CALLS) == {"ffn", "moe"}
  assert_close("a fused test backend", got, base, 1e-4)
  plain = registry.get("plain")
  assert plain.offers("moe") and not plain.offers("attention") and not plain.offers("routed_moe")
  with pytest.raises(ConfigError, match="backend plain has no attention stage"): plain.attention(None, None, 0, None)
  monkeypatch.setitem(catalog.CATALOG, "plain", dataclasses.replace(row, stages=frozenset({"ffn", "moe", "router"})))
  with pytest.raises(ConfigError, match="backend plain implements no router stage"): registry.register(type(plain)())


def test_backend_traits_come_from_the_catalog(monkeypatch) -> None:
  """The space's single changes, the gate's twin and precision class ask the catalog for traits, not names: a
  device-specific backend renamed is still preferred for 8-bit activations and checked against its twin."""
  from evaluator.gate import FP16_TOL, FP32_TOL, tolerance, twin
  row = catalog.get("native")
  monkeypatch.delitem(catalog.CATALOG, "native")
  monkeypatch.setitem(catalog.CATALOG, "cuda_c", dataclasses.replace(row, name="cuda_c"))
  info = mix_info("q4_0")
  q8 = next(k for k in knobs(info, "CUDA") if k.name == "ffn_act")
  assert (q8.enable == (("fused.moe", "cuda_c"),)
          and next(k for k in knobs(info, "CPU") if k.name == "ffn_act").enable == (("fused.moe", "dsl"),))
  cfg = StructureConfig(fused={"moe": "cuda_c", "attention": "cuda_c"}, ffn_act="q8")
  assert twin(cfg) == StructureConfig(fused={"moe": "dsl"}, ffn_act="q8")
  assert tolerance(StructureConfig(backends={"Q4_0:dense": "fp16_cache"}), 2048) == (FP16_TOL, {})
  tol, per_stage = tolerance(cfg, 2048)
  assert tol == FP32_TOL < per_stage["ffn"] and "attention" not in per_stage


KNOB = ('  probe: str = knob("plain", ("plain", "wide"), "a test knob", applies=lambda m: m.moe, stages=("router",), '
        'precision="fp16")\n')


def test_a_new_knob_is_one_declaration(tmp_path) -> None:
  """A knob declared beside a new StructureConfig field, and nothing else changed: the space offers it where it applies
  (a condition of its stage included), Optuna's name, --fix, --where and the views spell it one way, configs round-trip
  through the space and JSON, and the gate holds it to its precision class. The model code that reads the field is the
  one other file a real knob changes."""
  for pkg in ("model", "space", "evaluator", "search", "db"): shutil.copytree(PROJECT / pkg, tmp_path / pkg)
  path = tmp_path / "model" / "structure.py"
  src = path.read_text()
  anchor = next(line for line in src.splitlines(keepends=True) if line.startswith("  kv_dtype: str = knob("))
  path.write_text(src.replace(anchor, KNOB + anchor))
  probe = textwrap.dedent('''
    import dataclasses
    from evaluator.gate import FP16_TOL, tolerance
    from search.leaderboard import parse_where
    from space.knobs import ModelInfo, describe, flat, knobs, parse_pins, single_knob_changes, to_config, to_params
    from model.structure import StructureConfig
    quants = {"dense": ("Q4_0",), "expert": ("Q4_0",)}
    info = ModelInfo(True, True, True, quants, frozenset({"routed", "shared", "dense"}))
    k = next(k for k in knobs(info, "CPU") if k.name == "probe")
    assert k.choices == ("plain", "wide") and k.default == "plain"
    assert k.when({"fused.router": "off"}) and not k.when({"fused.router": "dsl"})
    assert "probe" not in {k.name for k in knobs(dataclasses.replace(info, moe=False))}
    cfg = to_config(parse_pins(["probe=WIDE"], info))
    assert cfg == StructureConfig(probe="wide") and describe(cfg) == "probe=wide" and flat(cfg)["probe"] == "wide"
    assert to_params(cfg, info)["probe"] == "wide" and StructureConfig.from_json(cfg.to_json()) == cfg
    assert parse_where(["probe=wide"]) == {"probe": "wide"} and ("probe=wide", cfg) in single_knob_changes(info)
    assert tolerance(cfg, 256)[0] == FP16_TOL
    try: StructureConfig(probe="narrow")
    except ValueError as e: assert "probe='narrow' is not allowed" in str(e)
    else: raise AssertionError("a value outside the domain passed")
    print("ok")
  ''')
  env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
  r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
  assert r.stdout.strip() == "ok", r.stderr[-3000:]


def test_every_device_kind_lists_only_what_runs_there_and_portable_holds_a_study_to_portable_backends() -> None:
  info = mix_info("q4_0")
  for device in ("CPU", "METAL", "AMD", "CL", "CUDA"):
    values = {v for k in knobs(info, device) if k.name.startswith(("backend.", "fused.")) for v in k.choices} - {"off"}
    assert values == ({"tensor", "fp16_cache", "dsl", "native"} if device == "CUDA"
                      else {"tensor", "fp16_cache", "dsl"}), device
    assert all(catalog.get(v).runs_on(device) for v in values)
    portable = {v for k in knobs(info, device, "portable") if k.name.startswith(("backend.", "fused."))
                for v in k.choices} - {"off"}
    assert portable == {"tensor", "fp16_cache", "dsl"} and all(catalog.get(v).portable for v in portable)
  with pytest.raises(ConfigError, match="unknown backend family"): knobs(info, "CUDA", "fast")


def test_model_info_fields_are_what_knobs_read() -> None:
  """A knob's `applies` reads a ModelInfo (space/knobs.py): every declaration runs on one."""
  from model.structure import KNOBS
  info = ModelInfo(moe=True, dense_blocks=True, shared_experts=True, quants={"dense": ("Q8_0",)})
  assert all(isinstance(k.applies(info), bool) for k in KNOBS.values())


def test_the_space_and_the_views_load_no_tinygrad() -> None:
  """The search parent reads model files, lists the space and shows its views without the kernels' library: the GGML
  type table (model/quant_types.py) is apart from its decoding (model/quants.py)."""
  views = ("space.knobs", "model.gguf_file", "search.leaderboard", "search.status", "search.show", "search.compare",
           "search.cost", "search.export", "search.exports", "search.report", "search.dashboard", "search.replay",
           "search.confirm", "search.cli")
  code = f"import sys, {', '.join(views)}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'tinygrad'))"
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT, check=True)
  assert r.stdout.strip() == "[]"
