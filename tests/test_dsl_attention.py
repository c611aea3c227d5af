"""The dsl backend's decode attention in the all_heads layout (model/backends/dsl_attention.py): the context in splits
merged per head. It computes the reference softmax(q . c_kv) @ c_kv at a context of several splits (the last one
partial) under tinygrad's Python emulator of Metal (workgroups, shared memory), where dropping any one split would be
far off; its kernels render for CUDA, METAL and AMD; a model decodes at depth (positions filled by model/bench.py
fill_context) as with per_head. The knob's proof on the tiny file (its logits, other kernels) is tests/test_space.py's.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys

import numpy as np
from test_portable import RENDERERS, kernels, render_source, renderer
from tinygrad import Tensor, UOp

import model.backends.dsl as dsl
from model.backends import dsl_attention, dsl_uops

H, KVL, ROPE, NOPE, CTX, POS = 4, 64, 16, 16, 80, 70  # 16 positions a split: 5 splits hold positions 0..70


def inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  return {"q": f(H * (NOPE + ROPE)), "q_abs": f(H, KVL) * 0.3, "cache": f(1, CTX, KVL + ROPE).astype(np.float16),
          "cos": f(CTX, ROPE // 2), "sin": f(CTX, ROPE // 2)}


def decode(a: dict[str, np.ndarray], layout: str, pos: int | UOp = POS) -> Tensor:
  t = {k: Tensor(v).realize() for k, v in a.items()}
  return dsl._decode(t["q"], t["q_abs"], t["cache"], (t["cos"], t["sin"]), dsl_attention._position(pos), 0.1, NOPE,
                     layout)


def reference(a: dict[str, np.ndarray], keep: np.ndarray) -> np.ndarray:
  """softmax over the kept positions of the scores, @ their rows' compressed values (float64)."""
  c, q = a["cache"][0].astype(np.float64), a["q"].reshape(H, NOPE + ROPE)[:, NOPE:].astype(np.float64)
  cs, sn = a["cos"][POS].astype(np.float64), a["sin"][POS].astype(np.float64)
  pe = np.empty_like(q)
  pe[:, 0::2], pe[:, 1::2] = q[:, 0::2] * cs - q[:, 1::2] * sn, q[:, 0::2] * sn + q[:, 1::2] * cs
  s = 0.1 * (a["q_abs"].astype(np.float64) @ c[keep, :KVL].T + pe @ c[keep, KVL:].T)
  p = np.exp(s - s.max(1, keepdims=True))
  return (p / p.sum(1, keepdims=True)) @ c[keep, :KVL]


EMULATED = """
import sys
sys.path[:0] = ["tests", "."]
import numpy as np
from tinygrad import Device
import model.backends.dsl as dsl
from test_dsl_attention import decode, inputs
assert dsl._local(Device.DEFAULT), Device.DEFAULT
a = inputs(np.random.default_rng(0))
np.save(sys.argv[1], np.stack([decode(a, layout).numpy() for layout in ("all_heads", "per_head")]))
"""


def test_all_heads_computes_the_reference_over_every_split_under_the_metal_emulator(tmp_path) -> None:
  ch = dsl_attention.chunk(CTX)
  assert POS // ch + 1 >= 4 and (POS + 1) % ch, "the context spans 4 splits or more, the last one partial"
  env = {**os.environ, "DEV": "PYTHON::METAL"}
  out = subprocess.run([sys.executable, "-c", EMULATED, str(tmp_path / "o.npy")], env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  got, a = np.load(tmp_path / "o.npy"), inputs(np.random.default_rng(0))
  want = reference(a, np.arange(POS + 1))
  for o in got: np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-5)
  # without any one split's positions the output is far off: the merge reads each of them
  for sp in range(POS // ch + 1):
    assert np.abs(reference(a, np.setdiff1d(np.arange(POS + 1), np.arange(sp * ch, sp * ch + ch))) - want).max() > 1e-2


def test_all_heads_kernels_render_for_cuda_metal_and_amd(monkeypatch) -> None:
  """With the decode position a bound variable, as in the decode step's JIT: the scores' row reduction in shared
  memory, the positions and the splits launched up to the position."""
  monkeypatch.setattr(dsl, "_local", lambda device: True)
  o = decode(inputs(np.random.default_rng(1)), "all_heads", UOp.variable("start_pos", 0, CTX - 1).bind(POS))
  asts = {a.arg.name: a for a in kernels(o) if a.arg.name.startswith("dsl_")}
  assert set(asts) == {"dsl_scores_all", "dsl_split_softmax", "dsl_pv_split", "dsl_merge"}
  for kind in RENDERERS:
    for name, a in asts.items():
      src = render_source(a, renderer(kind))
      assert name in src, (kind, name)
      if name in ("dsl_scores_all", "dsl_split_softmax", "dsl_pv_split"): assert "start_pos" in src, (kind, name)
      if name == "dsl_scores_all":
        assert {"CUDA": "__shared__", "METAL": "threadgroup_barrier", "AMD": "__attribute__((shared"}[kind] in src


def test_attention_kernels_read_no_device_name() -> None:
  """As dsl.py's (tests/test_portable.py): the modules it builds its attention from name no device."""
  names = {"CUDA", "METAL", "AMD", "HIP", "NV", "CPU", "CL", "WEBGPU", "PYTHON"}
  for mod in (dsl_attention, dsl_uops):
    literals = {n.value for n in ast.walk(ast.parse(inspect.getsource(mod)))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not {s for s in literals if s.upper() in names or s.split(":")[0].upper() in names}, mod.__name__


def test_all_heads_decodes_as_per_head_at_depth(tmp_path) -> None:
  """portable.json (every stage on dsl) at 200 positions of a 320-position cache (13 splits of 16 hold them), with an
  fp32 KV cache: the decode step's logits equal per_head's, in the split kernels instead of dsl_pv."""
  from model.bench import fill_context
  from model.deepseek2 import Transformer
  from model.generate import Generator, jit_kernels
  from model.gguf_file import GGUFFile
  from model.structure import StructureConfig
  from model.synth import write_synthetic
  path = write_synthetic(tmp_path / "m.gguf", "tiny", quant="q4_0", layers=2)
  portable = json.loads(open("benchmarks/configs/portable.json").read())
  assert 200 // dsl_attention.chunk(320) + 1 >= 4
  outs, names = [], []
  for layout in ("per_head", "all_heads"):
    m = Transformer(GGUFFile(path), StructureConfig.from_dict({**portable, "kv_dtype": "float32",
                                                               "attn_layout": layout}), max_context=320)
    g = Generator(m, chunk=8)
    g.prefill([1, 2, 3, 4, 5, 6, 7, 8])
    fill_context(m, 8, 200)
    outs.append(np.stack([g.step_logits(t, 200 + i) for i, t in enumerate([9, 10, 11])]).astype(np.float64))
    names.append({n for n, _ in jit_kernels(g.step_logits_jit)})
  assert {"dsl_scores", "dsl_pv"} <= names[0] and not {"dsl_pv", "dsl_scores"} & names[1]
  assert {"dsl_scores_all", "dsl_split_softmax", "dsl_pv_split", "dsl_merge"} <= names[1]
  assert np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max() < 1e-5
