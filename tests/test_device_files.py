"""The native backend's CUDA lives in device files (model/backends/cuda/), not in Python strings: a kernel's source is
its variant's defines, the files and its signature (name and parameters). Measured here: the string literals of
cuda_src.py and native.py that hold C, a literal (a docstring aside, an f-string's literal text) with a brace or a
statement (a `;` after an assignment, a call or an index); only the functions of the gemv family, whose products Python
still unrolls, may hold them."""
from __future__ import annotations

import ast
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from model.backends import cuda_prefill as G
from model.backends import cuda_src as C
from model.presets import PRESETS
from model.quants import F32, Q4_0

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "model" / "backends"
# the generators left to move into device files (the gemv family: its products, their staging and epilogues)
GENERATED = {"_words", "_k_quant", "_k_quant32", "_q6_k32", "_q6_k", "_q_0", "_f16", "unit_loads", "unit_dot",
             "unit_idot", "_unit_values", "q8_code", "quantize_x", "x16_split", "quantize_x16", "unit_idot16",
             "block_rs", "stage_x", "stage_decl", "load_xq", "load_xq16", "load_x", "prefetch_rows", "gemv",
             "group_setup", "expert_id", "kernel", "_tile_body", "product", "rows", "dense", "absorb_rope_kv", "mla_vb",
             "router", "_down_defines", "glu", "lane_sums", "_down_combine", "_down_routing", "_down_slots",
             "_down_units", "_down_handoff", "_gemv_block", "quantize", "<module>"}
LAUNCH = {"device_kernel"}  # the signature's braces around a device file's body


def c_literals(path: Path) -> dict[str, int]:
  """{function (`<module>` outside any): its string literals that hold C}."""
  tree, found = ast.parse(path.read_text()), {}
  docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
          and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
  def visit(node: ast.AST, fn: str) -> None:
    for child in ast.iter_child_nodes(node):
      name = child.name if isinstance(child, ast.FunctionDef) else fn
      if (isinstance(child, ast.Constant) and isinstance(child.value, str) and id(child) not in docs
          and re.search(r"[{}]|[=()\[\]][^;]*;", child.value)):
        found[fn] = found.get(fn, 0) + 1
      visit(child, name)
  visit(tree, "<module>")
  return found


def test_native_c_lives_in_device_files() -> None:
  assert c_literals(BACKENDS / "native.py") == {}
  held = c_literals(BACKENDS / "cuda_src.py")
  assert set(held) <= GENERATED | LAUNCH, f"C in Python strings outside the gemv family: {set(held) - GENERATED}"
  for fn in ("mla_attention", "rank", "weights", "used", "defines", "signature"):
    assert fn not in held, fn


def test_device_files_ship_and_are_used() -> None:
  """Every device file is package data, and every one is in some kernel's source."""
  globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["model.backends"]
  files = sorted(p.name for p in (BACKENDS / "cuda").iterdir())
  assert files and all(any(fnmatch(f"cuda/{f}", g) for g in globs) for f in files), (files, globs)
  hp = PRESETS["tiny"]
  W = lambda inp, p="": C.W(p, Q4_0, inp)
  route = C.Route(hp.n_experts, hp.n_used, 1, False, True, 1.0)
  routed = C.FFN(W(hp.dim), W(hp.dim), W(hp.expert_ffn), hp.expert_ffn, hp.n_experts, hp.expert_ffn)
  srcs = [C.mla_attention(4, 128, 32, 64, 0.1, True).src, C.mla_vb(W(128, "w_"), 4, 128, 32, 64).src,
          C.absorb_rope_kv(W(32, "k_"), 4, 32, 32, 128, 64, 1e-5, True).src, C.router(C.W("g_", F32, hp.dim), 1e-5,
                                                                                       route).src,
          C.glu(routed, None, hp.n_used, hp.dim, 1e-5, route=route).src,
          C.mla_attention_heads(4, 128, 32, 64, 0.1, True, 132).src, C.mla_combine(4, 128, 64, 132).src,
          C.mla_vb(W(128, "w_"), 4, 128, 32, 64, merged=True).src, G.grouped(Q4_0, 4, 64, 128, 16, 2).src,
          *(k.src for k in G.mla_prefill(4, 128, 64, 256, 0.1, True, 4))]
  for f in files:
    first = C.device_file(f).splitlines()[0]
    assert any(first in s for s in srcs), f
    assert "#include" not in "".join(srcs), "includes are inlined: tinygrad compiles a single source"


def test_kernel_defines_are_names_and_numbers() -> None:
  """A device-file kernel's defines carry its variant (numbers, float literals, parameter names), no code."""
  hp = PRESETS["deepseek-v2-lite"]
  route = C.Route(hp.n_experts, hp.n_used, 1, False, True, 1.5, True)
  for k in (C.mla_attention(16, 512, 64, 256, 0.1, False), C.router(C.W("g_", F32, hp.dim), 1e-6, route)):
    defines = re.findall(r"^#define (\w+(?:\(.*?\))?) (.*)$", k.src.split(C.PRELUDE)[0], re.M)
    assert defines, k.name
    for name, value in defines:
      if not name.isupper(): continue
      assert re.fullmatch(r"[\w.+-]+", value), (k.name, name, value)
