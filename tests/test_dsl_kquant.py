"""The dsl backend on K-quant weights (model/backends/dsl.py): their code and scale planes read as 32-bit words, split
over a block's lanes like Q4_0's, and 8-bit activations (ffn_act, attn_act = q8) against Q4_K, Q5_K and Q6_K weights,
which a K-quant mix offers on dsl where native has no kernel for them.

Each K-quant product against the reference at every role: tests/test_dsl.py (CPU) and tests/test_portable.py (the Metal
emulator, workgroups and lanes)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from knobcheck import assert_close, gguf, mix_info, routed
from products import TYPES, random_weight
from test_portable import kernels, render_source, renderer
from tinygrad import Tensor
from tinygrad.codegen import full_rewrite_to_sink, line_rewrite, linearize, pm_linearize_cleanups
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import Ops

import model.backends.dsl as dsl
from evaluator.gate import FP16_TOL, Q8_TOL
from model.backends import catalog
from model.deepseek2 import Transformer
from model.structure import StructureConfig
from space.knobs import knobs

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("quant", K_QUANTS)
def test_k_quant_products_read_words(quant: str, monkeypatch) -> None:
  """With workgroups (as on a GPU), the one-token product of a K-quant weight reads its codes and scales as 32-bit
  words: a thread's loads of a 256-element block are its lane's share of the code words (a quarter), the scale words
  and the input's float4s, where byte planes took one load per byte. Every byte of the weight is read once
  (Estimates.mem)."""
  monkeypatch.setattr(dsl, "_local", lambda device: True)
  rng, t = np.random.default_rng(1), TYPES[quant]
  w = dsl.to_words(random_weight(rng, t, (64, 512), "dsl"))
  assert all(v.dtype.itemsize == 4 for k, v in w.planes.items() if k not in ("d", "dmin"))
  ast = next(a for a in kernels(dsl._vec(Tensor(rng.standard_normal(512).astype(np.float32)), (w,), rows=1))
             if a.arg.name.startswith("dsl_"))
  ren = renderer("CUDA")
  lin = line_rewrite(linearize(full_rewrite_to_sink(ast, ren)), pm_linearize_cleanups)
  loads = sum(u.op is Ops.LOAD for u in lin)
  assert loads <= 36, f"{quant}: {loads} loads a thread"  # byte planes: 209 (Q4_K), 241 (Q5_K), 81 (Q6_K; no lanes)
  src = render_source(ast, ren)
  assert "unsigned char" not in src and "uchar" not in src and "uint*" in src
  weight = sum(v.nbytes() for v in w.planes.values())
  assert Estimates.from_uops(tuple(lin), ignore_indexing=True).mem == weight + 512 * 4 + 64 * 4


@pytest.mark.parametrize("quant", K_QUANTS)
def test_q8_input_against_k_quant_weights(gguf_file, quant: str) -> None:
  """A model of one K type loads with every stage fused on dsl and 8-bit activations, and its experts' down product of
  an input rounded to 8 bits per 32 (q8_round, as ffn_act=q8 rounds it) equals the reference (gguf's dequantisation of
  the file's bytes, float64) of the rounded input, and moves the float input's product by no more than the q8 class."""
  path, t = gguf_file("tiny", quant.lower()), TYPES[quant]
  cfg = StructureConfig(fused=dict.fromkeys(catalog.STAGES, "dsl"), ffn_act="q8", attn_act="q8")
  blocks, f = Transformer(gguf(path), cfg, max_context=16).blocks, gguf(path)
  w, name = blocks[-1].down_exps, f"blk.{len(blocks) - 1}.ffn_down_exps.weight"
  assert w.ggml_type == f.tensors[name].ggml_type == t and w.backend == "dsl"
  ref = dequantize(np.asarray(f.read(name)), GGMLQuantizationType(t)).astype(np.float64).reshape(w.shape)
  rng, (E, _, inp) = np.random.default_rng(t), w.shape
  x = rng.standard_normal((2, inp)).astype(np.float32) * np.linspace(0.1, 3, inp, dtype=np.float32)
  xq, sel = dsl.q8_round(Tensor(x)), np.array([E - 1, 0], dtype=np.int32)
  got = dsl.expert(xq.reshape(1, 1, 2, inp), Tensor(sel.reshape(1, 1, 2)), w).numpy()[0, 0]
  want = np.einsum("koi,ki->ko", ref[sel], xq.numpy().astype(np.float64))
  exact = np.einsum("koi,ki->ko", ref[sel], x.astype(np.float64))
  assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
  assert 1e-4 < np.abs(got - exact).max() / np.abs(exact).max() < Q8_TOL


def test_a_k_quant_mix_offers_q8_activations_on_dsl() -> None:
  """A Q4_K_M mix (FFN weights Q4_K, Q5_K, Q6_K; the attention's dense ones Q5_K and Q8_0) offers ffn_act=q8 and
  attn_act=q8 with their stages on dsl where native does not run, and on native where it does, as a Q4_0 file's
  (native's integer units of the K-quants: tests/test_native.py)."""
  for device, b in (("CPU", "dsl"), ("CUDA", "native"), ("METAL", "dsl")):
    on = {k.name: k.enable for k in knobs(mix_info("q4_k_m"), device) if k.name in ("ffn_act", "attn_act")}
    assert on == {"ffn_act": (("fused.moe", b),), "attn_act": (("fused.attention", b),)}, device


def test_q8_activations_on_a_k_quant_mix(gguf_file) -> None:
  """Every stage fused on dsl with ffn_act=q8 and attn_act=q8 on the Q4_K_M mix decodes near the baseline, every MoE
  block routed as the baseline routes (as tests/knobcheck.py check_knob compares 8-bit knobs): within twice the gate's
  FP16_TOL, the bound of the Q4_0 files' q8 decode (tests/test_native_model.py; attn_act=q8 alone moves the tiny Q4_0
  file's logits by up to 5.5e-2 of their std), and away from it by more than a float reordering."""
  path, tokens = gguf_file("tiny", "q4_k_m"), tuple((7919 * i + 17) % 1000 for i in range(16))
  base, sel = routed(path, StructureConfig().to_json(), tokens)
  cfg = StructureConfig(fused=dict.fromkeys(catalog.STAGES, "dsl"), ffn_act="q8", attn_act="q8")
  got = routed(path, cfg.to_json(), tokens, sel)[0]
  assert_close("dsl, 8-bit activations on K-quant weights", got, base, 2 * FP16_TOL)
  assert (np.abs(got - base).max(1) / base.std(1)).max() > 1e-2
