"""The native backend's grouped prompt products (prefill_weights=quantised, cuda/grouped_mma.cu) in the CUDA emulator:
every quant type a K-quant mix holds, both tile heights, experts in any order, outputs past a whole block."""
from __future__ import annotations

import numpy as np
import pytest
from knobcheck import mix_info
from native_cpu import launch_kernel, native_on_cpu
from products import TYPES, kernel_weight
from test_prefill import routing
from tinygrad import Tensor, dtypes

import model.prefill as prefill
from evaluator.gate import rel_err
from model.backends import cuda_prefill, native
from model.backends import registry as K
from model.deepseek2 import Transformer
from model.gguf_file import GGUFFile
from model.stages import Glu
from model.structure import ConfigError, StructureConfig
from space.knobs import knobs


@pytest.mark.parametrize("quant, out, inp, tile", [("Q4_0", 80, 256, 16), ("Q8_0", 64, 96, 64), ("Q4_K", 72, 256, 32),
                                                   ("Q5_K", 64, 256, 16), ("Q6_K", 64, 512, 16),
                                                   ("F16", 64, 64, 16), ("F32", 64, 128, 16)])
def test_grouped_product_matches_the_dequantised_weights(quant: str, out: int, inp: int, tile: int) -> None:
  """Each tile's rows by its expert's matrix, against gguf's dequantisation in float64 with the activations rounded to
  float16 as the kernel reads them: float16 weights in the tensor cores' products, held to 2e-3 of the output. 80 and
  72 outputs: a block past the last row (zeros, not stored); the last tile past the ones in use: zeros."""
  E, tiles, t = 3, 4, TYPES[quant]
  planes, w = kernel_weight(t, (E, out, inp), 7)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((tiles * tile, inp)).astype(np.float16)
  te = np.array([2, 0, 0, 1], np.int32)  # the fourth tile not in use
  k = cuda_prefill.grouped(t, E, out, inp, tile, tiles)
  y = np.full((tiles * tile, out), np.nan, np.float32)
  launch_kernel(k.src, k.name, k.grid, (k.threads, 1, 1), [y, x.view(np.uint16), te, np.array([3], np.int32), *planes])
  xr = x.astype(np.float64).reshape(tiles, tile, inp)
  want = np.einsum("nti,noi->nto", xr, w[te]).reshape(tiles * tile, out)
  want[3 * tile:] = 0
  np.testing.assert_allclose(y, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_stage_k_follows_the_units_span() -> None:
  """A stage holds whole units: 128 inputs where the row holds whole stages, else 64 (DeepSeek-V2-Lite's dense FFN
  rows, 10944; GLM-4.7-Flash's k_b, 192), else 32; Q6_K's units spread over 128 of a row, so a 64-input stage cannot
  hold one."""
  assert cuda_prefill.stage_k(TYPES["Q4_0"], 2048) == 128
  assert cuda_prefill.stage_k(TYPES["Q4_0"], 10944) == 64
  assert cuda_prefill.stage_k(TYPES["Q8_0"], 96) == 32
  assert cuda_prefill.stage_k(TYPES["Q6_K"], 256) == 128
  assert cuda_prefill.span(cuda_prefill.UNITS[TYPES["Q6_K"]]) == 128
  assert cuda_prefill.stage_k(TYPES["Q6_K"], 320) is None
  assert cuda_prefill.stage_k(TYPES["Q4_0"], 48) is None


def test_native_prefill_matches_the_per_token_path(gguf_file, monkeypatch) -> None:
  """prefill_weights=quantised in a model (the kernels in the CUDA emulator) on a Q4_K file (the kernel's own test
  covers every type and tile height alone): the MoE block's routed experts in tiles of 32 and 64, its shared expert and
  the dense block's FFN over a chunk of 24 rows (a partial tile of 16), against the per-token products, within float16's
  rounding."""
  quant = "q4_k"
  rng, kernels = np.random.default_rng(0), set()
  with native_on_cpu(monkeypatch):
    run = native.launch
    monkeypatch.setattr(native, "launch", lambda k, *a: kernels.add(k.name) or run(k, *a))
    m = Transformer(GGUFFile(gguf_file("tiny", quant)), max_context=8, n_layers=2)
    (dense, moe), hp, T = m.blocks, m.hp, 24
    xn = Tensor(rng.standard_normal((1, T, hp.dim)).astype(np.float32)).realize()
    sel = Tensor(routing(T, hp.n_experts, hp.n_used), dtype=dtypes.int32)
    w = Tensor(rng.random((1, T, hp.n_used)).astype(np.float32))
    experts = Glu(moe.gate_exps, moe.up_exps, moe.gate_up_exps, moe.down_exps)
    shared = Glu(moe.gate_sh, moe.up_sh, moe.gate_up_sh, moe.down_sh)
    for tile in (32, 64):
      cfg = StructureConfig(prefill_ffn="grouped", prefill_weights="quantised", prefill_tile=tile)
      got = prefill.moe(xn, sel, w, experts, shared, hp.n_experts, cfg).numpy()[0]
      assert (rel_err(got, moe.experts(xn, sel, w).numpy()[0]) <= 1e-2).all(), (quant, tile)
    got = prefill.glu(xn, Glu(dense.gate, dense.up, dense.gate_up, dense.down), cfg).numpy()[0]
    want = dense._ffn(xn, dense.gate, dense.up, dense.down, dense.gate_up, "dense_gate_up").numpy()[0]
    assert (rel_err(got, want) <= 1e-2).all(), quant
  # the routed experts' tiles of 32 and 64, the shared expert's and the dense FFN's rows in tiles of 16
  assert {k.split("_t")[-1].split("x")[0] for k in kernels if k.startswith("native_grouped")} == {"16", "32", "64"}


def test_per_head_products_over_the_chunk(gguf_file, monkeypatch) -> None:
  """prefill_dense=batched's per-head products (k_b's absorption, v_b) of a chunk of 20 tokens: native's tiles with the
  heads as experts (prefill_weights=quantised, a partial tile, CUDA emulator) and the dequantised batched matmul, each
  against the weight's own per-token product. The tiles' heads and the tiles in use are constants made once (k_b's and
  v_b's products of a chunk read the same buffers), not a kernel in every product."""
  m = Transformer(GGUFFile(gguf_file("tiny", "q4_0")), max_context=8, n_layers=1)
  rng, blk, kernels, inputs = np.random.default_rng(0), m.blocks[0], set(), []
  with native_on_cpu(monkeypatch):
    run = native.launch
    def record(k, params, *a):
      kernels.add(k.name)
      if k.name.startswith("native_grouped"): inputs.append((params[2], params[3]))
      return run(k, params, *a)
    monkeypatch.setattr(native, "launch", record)
    for w in (blk.k_b, blk.v_b):
      H, _, inp = w.shape
      x = Tensor(rng.standard_normal((1, 20, H, inp)).astype(np.float32)).realize()
      want = K.per_head(x, w).numpy()
      got = prefill.per_head(x, w, StructureConfig(prefill_ffn="grouped")).numpy()
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
      got = prefill.per_head(x, w, StructureConfig(prefill_ffn="grouped", prefill_weights="quantised")).numpy()
      assert (rel_err(got, want) <= 1e-2).all(), w.shape
  assert len([k for k in kernels if k.startswith(f"native_grouped_q4_0_e{H}_")]) == 2, kernels
  (te, used), (te2, used2) = inputs
  assert te is te2 and used is used2 and te.uop.is_realized and used.uop.is_realized
  heads = te.tolist()  # the tiles in the heads' order, len(heads) // H each
  assert heads == [t // (len(heads) // H) for t in range(len(heads))] and used.tolist() == [len(heads)]


def test_native_prefill_is_a_config_of_its_own() -> None:
  """quantised reads the weights quantised: prefill_dtype, which the tinygrad forms dequantise into, is refused beside
  it; the space offers native only where the family's native backend runs (CUDA), and prefill_dtype only off it. The
  same for the attention: prefill_attn_dtype and the 8-bit cache are refused beside prefill_attention=all_heads."""
  with pytest.raises(ConfigError, match="prefill_dtype"):
    StructureConfig(prefill_ffn="grouped", prefill_weights="quantised", prefill_dtype="float16")
  info = mix_info("q4_0")
  on = {k.name: k for k in knobs(info, "CUDA")}
  assert "quantised" in on["prefill_weights"].choices
  assert "quantised" not in {k.name: k for k in knobs(info, "CUDA", "portable")}["prefill_weights"].choices
  assert "quantised" not in {k.name: k for k in knobs(info, "CPU")}["prefill_weights"].choices
  assert not on["prefill_dtype"].when({"prefill_ffn": "grouped", "prefill_weights": "quantised"})
  assert on["prefill_dtype"].when({"prefill_ffn": "grouped", "prefill_weights": "copied"})
  # the attention likewise: native stages float16 itself and reads a float cache
  for bad in ({"prefill_attn_dtype": "float16"}, {"kv_dtype": "q8_0"}):
    with pytest.raises(ConfigError, match="prefill_attention=all_heads"):
      StructureConfig(prefill_attention="all_heads", **bad)
  assert "all_heads" in on["prefill_attention"].choices
  assert "all_heads" not in {k.name: k for k in knobs(info, "CPU")}["prefill_attention"].choices
  assert not on["prefill_attn_dtype"].when({"prefill_attention": "all_heads"})
  # the tokens a block of it holds: a setting of all_heads, and nowhere else
  assert on["prefill_attn_tokens"].when({"prefill_attention": "all_heads"})
  assert not on["prefill_attn_tokens"].when({"prefill_attention": "absorbed"})
  assert "prefill_attn_tokens" not in {k.name for k in knobs(info, "CPU")}
  assert not on["kv_dtype"].when({"prefill_attention": "all_heads"})


@pytest.mark.parametrize("half, tt, start, ctx", ((True, 1, 70, 2048), (False, 1, 70, 2048), (True, 2, 319, 5120)))
def test_prefill_attention_kernels_are_causal_per_token(half: bool, tt: int, start: int, ctx: int) -> None:
  """prefill_attention=all_heads's kernels (the all-heads attention with `tt` tokens a block, then each token's splits
  merged): 5 tokens at positions start.. of a cache of ctx positions, each token's heads over the positions up to its
  own; stale NaN partials of an unused split are not read. Two tokens a block from position 319 of 5 splits: a block's
  splits are sized by its last token's 321 positions, 4 splits of 80, where the first token's 320 alone would make 5 of
  64 (the merge must size them alike), and the last block holds one token. Query and weights go through float16: held
  to 3e-3 of the output."""
  H, kvl, rope, T, scale = 3, 64, 32, 5, 0.11
  rng = np.random.default_rng(4)
  cache = rng.standard_normal((ctx, kvl + rope)).astype(np.float16 if half else np.float32)
  qc = rng.standard_normal((T, H, kvl + rope)).astype(np.float32)
  ka, km = cuda_prefill.mla_prefill(H, kvl, rope, ctx, scale, half, T, tt)
  S = cuda_prefill.prefill_splits(ctx)
  assert S == ctx // 1024 and ka.grid == (S, -(-T // tt), 1)
  part, o, pos = np.full(T * H * S * (kvl + 2), np.nan, np.float32), np.zeros((T, H, kvl), np.float32), np.array(
    [start], np.int32)
  launch_kernel(ka.src, ka.name, ka.grid, (ka.threads, 1, 1), [part, qc, cache.view(np.uint16) if half else cache, pos])
  launch_kernel(km.src, km.name, km.grid, (km.threads, 1, 1), [o, part, pos])
  c = cache.astype(np.float64)
  for t in range(T):
    s = qc[t].astype(np.float64) @ c[:start + t + 1].T * scale
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ c[:start + t + 1, :kvl]
    np.testing.assert_allclose(o[t], want, rtol=3e-3, atol=3e-3 * np.abs(want).max(), err_msg=f"token {t}")


def test_prefill_attention_work_follows_the_chunks_position() -> None:
  """The prompt attention's work estimates (the profile's TFLOPS and GB/s): each token's causal positions, and each
  block's rows read once, at the chunk's position, a symbolic one (the prefill graph's bound variable) inferred per
  launch as a number is."""
  from tinygrad import UOp
  from tinygrad.uop.ops import sym_infer
  T, H, D, kvl, at = 40, 20, 576, 512, 3584
  v = UOp.variable("start_pos", 0, 8191)
  for tt in (1, 2, 3):
    want_ops = sum(2 * H * (D + kvl) * (at + t + 1) for t in range(T))
    want_mem = sum(at + min((b + 1) * tt, T) for b in range(-(-T // tt))) * D * 2
    assert native.prefill_work(T, H, D, kvl, tt, at, 2) == (want_ops, want_mem)
    ops, mem = native.prefill_work(T, H, D, kvl, tt, v.bind(at), 2)
    assert (sym_infer(ops, {"start_pos": at}), sym_infer(mem, {"start_pos": at})) == (want_ops, want_mem)


def test_native_prefill_attention_in_the_model(gguf_file, monkeypatch) -> None:
  """prefill_attention=all_heads in a model (CUDA emulator): a prompt of 12 tokens in chunks of 8 and 4 (the second at
  position 8, reading the first chunk's rows), against the absorbed form in tinygrad's kernels, within float16's
  rounding; the native kernels ran."""
  from tinygrad import Tensor as T_
  path, kernels = gguf_file("tiny", "q4_0"), set()
  tokens = [(7919 * i + 17) % 1000 for i in range(12)]
  def logits(cfg: StructureConfig) -> np.ndarray:
    m = Transformer(GGUFFile(path), cfg, max_context=32)
    return np.concatenate([m.forward(T_([tokens[a:b]], dtype=dtypes.int32), a, all_logits=True)[0].numpy()
                           for a, b in ((0, 8), (8, 12))])
  want = logits(StructureConfig())
  with native_on_cpu(monkeypatch):
    run = native.launch
    monkeypatch.setattr(native, "launch", lambda k, *a: kernels.add(k.name) or run(k, *a))
    for tt in (1, 2):
      got = logits(StructureConfig(prefill_attention="all_heads", prefill_attn_tokens=tt))
      assert (rel_err(got, want) <= 1e-2).all(), tt
  assert {k.split("_h")[0] for k in kernels} == {"native_mla_prefill", "native_mla_prefill_merge"}
  assert {k.endswith(("_t8x2", "_t4x2")) for k in kernels} == {True, False}, kernels
