"""Synthetic deepseek2 GGUFs: exact preset shapes and metadata, zero-mean random weights, loadable by llama.cpp."""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from model.gguf_file import GGUFFile
from model.presets import PRESETS, get_preset
from model.synth import GENERATORS, QUANT_CHOICES, tensor_plan, write_synthetic

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKENS = [1, 5, 300, 700, 42, 900, 17, 256]
PURE = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K,
        "q6_k": T.Q6_K}
KEYS = ["general.architecture", "general.name", "general.file_type"] + [f"deepseek2.{k}" for k in (
  "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
  "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.key_length_mla",
  "attention.value_length_mla", "attention.layer_norm_rms_epsilon", "attention.q_lora_rank", "attention.kv_lora_rank",
  "rope.dimension_count", "rope.freq_base", "rope.scaling.type", "leading_dense_block_count",
  "expert_feed_forward_length", "expert_count", "expert_used_count", "expert_shared_count", "expert_weights_scale",
  "expert_weights_norm", "expert_gating_func", "vocab_size", "nextn_predict_layers")] + [
  f"tokenizer.ggml.{k}" for k in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
                                  "padding_token_id", "add_bos_token")] + ["tokenizer.chat_template"]
YARN_KEYS = [f"deepseek2.rope.scaling.{k}" for k in ("factor", "original_context_length", "yarn_log_multiplier",
                                                     "yarn_beta_fast", "yarn_beta_slow")]
# (preset, layers, quant): the two ~1 GB files and a tied dense one, written once per module in a subprocess
BIG = {"glm": ("glm-4.7-flash", 2, "q4_k_m"), "ds2-lite": ("deepseek-v2-lite", 2, "q4_0"),
       "youtu": ("youtu", 1, "q4_0")}


def meta(r: GGUFReader) -> dict:
  """The scalar and string metadata (arrays are slow to decode: read them from r.fields)."""
  return {k: f.contents() for k, f in r.fields.items() if f.types[0] != gguf.GGUFValueType.ARRAY}


def expected_type(name: str, ne0: int, quant: str) -> T:
  if name.endswith(("_norm.weight", "ffn_gate_inp.weight", ".bias")): return T.F32
  return next(t for t in (PURE[quant], T.Q8_0, T.F16) if ne0 % gguf.GGML_QUANT_SIZES[t][0] == 0)


def expected_std(name: str, ne0: int) -> float:
  return 1.0 if name == "token_embd.weight" else 2 / math.sqrt(ne0) if "ffn_gate_inp" in name else 1 / math.sqrt(ne0)


def _write_in_subprocess(out: pathlib.Path, preset: str, layers: int, quant: str) -> dict:
  code = ("import json, sys, time\nfrom model.memory import peak_rss_bytes\nfrom model.synth import write_synthetic\n"
          "t = time.perf_counter()\n"
          "write_synthetic(sys.argv[1], sys.argv[2], layers=int(sys.argv[3]), quant=sys.argv[4])\n"
          "print(json.dumps({'s': time.perf_counter() - t, 'maxrss_mb': peak_rss_bytes() / 2**20}))")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  r = subprocess.run([sys.executable, "-c", code, str(out), preset, str(layers), quant], cwd=ROOT, env=env,
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, tuple[pathlib.Path, dict]]:
  d = tmp_path_factory.mktemp("synth")
  return {k: (d / f"{k}.gguf", _write_in_subprocess(d / f"{k}.gguf", *v)) for k, v in BIG.items()}


def llama_logits(path: pathlib.Path) -> np.ndarray:
  llama_cpp = pytest.importorskip("llama_cpp")
  llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
  try:
    llm.eval(TOKENS)
    return np.array(llm.scores[:len(TOKENS)], dtype=np.float64)
  finally: llm.close()


def check_logits(lg: np.ndarray, vocab: int) -> None:
  assert lg.shape == (len(TOKENS), vocab) and np.isfinite(lg).all()
  assert (lg.std(axis=1) > 0.1).all() and len(set(lg.argmax(axis=1))) > 1


# *** presets

def test_presets() -> None:
  assert get_preset("glm") is get_preset("GLM-4.7") is PRESETS["glm-4.7-flash"]
  assert get_preset("ds2-lite") is PRESETS["deepseek-v2-lite"] and get_preset("youtu-llm-2b") is PRESETS["youtu"]
  for name in ("nope", "glm5"):
    with pytest.raises(ValueError, match="known presets are glm-4.7-flash"): get_preset(name)
    with pytest.raises(KeyError): get_preset(name)
  glm, ds, yt = PRESETS["glm-4.7-flash"], PRESETS["deepseek-v2-lite"], PRESETS["youtu"]
  assert (glm.n_layers, glm.n_dense, glm.dim, glm.n_heads, glm.q_lora, glm.kv_lora, glm.qk_nope, glm.qk_rope,
          glm.v_head) == \
    (47, 1, 2048, 20, 768, 512, 192, 64, 256)
  assert (glm.n_experts, glm.n_used, glm.n_shared, glm.expert_ffn, glm.dense_ffn, glm.vocab,
          glm.gating) == (64, 4, 1, 1536, 10240, 154880, "sigmoid")
  assert (ds.q_lora, ds.n_experts, ds.n_used, ds.n_shared, ds.expert_ffn, ds.dense_ffn, ds.yarn_factor,
          ds.yarn_orig_ctx) == \
    (0, 64, 6, 2, 1408, 10944, 40.0, 4096)
  # parameter counts from the plan against the published checkpoints
  count = lambda s: sum(math.prod(t.ne) for t in tensor_plan(s))
  assert count(yt) == 1_961_560_064 and count(ds) == 15_706_484_224
  assert 29.9e9 < count(glm) < 30.0e9   # the hub's "31B" also counts the MTP block, which is not written
  assert yt.with_layers(2).n_dense == 2 and glm.with_layers(1).n_dense == 1 and glm.with_layers(3).n_dense == 1


def test_bad_arguments(tmp_path: pathlib.Path) -> None:
  for kw, msg in (({"preset": "gpt5"}, "unknown preset"), ({"quant": "q3_k"}, "unknown quant"),
                  ({"layers": 0}, "layers must be in 1..3"), ({"layers": 4}, "layers must be in 1..3")):
    with pytest.raises(ValueError, match=msg): write_synthetic(tmp_path / "x.gguf", **{"preset": "tiny", **kw})


# *** file structure and weight statistics

@pytest.mark.parametrize("quant", QUANT_CHOICES)
def test_tiny_file(tmp_path: pathlib.Path, quant: str) -> None:
  s = PRESETS["tiny"]
  r = GGUFReader(write_synthetic(tmp_path / "tiny.gguf", "tiny", quant=quant))
  m = meta(r)
  assert all(k in r.fields for k in KEYS), [k for k in KEYS if k not in r.fields]
  assert m["general.architecture"] == "deepseek2" and m["deepseek2.expert_gating_func"] == 2 and m[
    "deepseek2.attention.q_lora_rank"] == 128
  assert (m["deepseek2.attention.head_count_kv"], m["deepseek2.attention.key_length"],
          m["deepseek2.attention.key_length_mla"]) == (1, 160, 64)
  tensors = {t.name: t for t in r.tensors}
  assert {"token_embd.weight", "output.weight", "blk.0.ffn_down.weight", "blk.1.exp_probs_b.bias",
          "blk.2.attn_k_b.weight"} <= set(tensors)
  assert (not any(".ffn_gate_exps" in n for n in tensors if n.startswith("blk.0."))
          and "blk.1.ffn_gate.weight" not in tensors)
  assert [int(x) for x in tensors["blk.1.ffn_down_exps.weight"].shape] == [s.expert_ffn, s.dim, s.n_experts]
  assert [int(x) for x in tensors["blk.0.attn_k_b.weight"].shape] == [s.qk_nope, s.kv_lora, s.n_heads]
  assert [int(x) for x in tensors["blk.0.attn_v_b.weight"].shape] == [s.kv_lora, s.v_head, s.n_heads]
  assert [int(x) for x in tensors["blk.0.attn_q_b.weight"].shape] == [s.q_lora, s.n_heads * (s.qk_nope + s.qk_rope)]
  if quant != "q4_k_m":
    assert ({t.name: t.tensor_type for t in r.tensors}
            == {t.name: expected_type(t.name, int(t.shape[0]), quant) for t in r.tensors})
  else:   # use_more_bits of 3 layers: only layer 2
    want = {"token_embd.weight": T.Q4_K, "output.weight": T.Q6_K, "blk.2.ffn_down_exps.weight": T.Q6_K,
            "blk.1.ffn_down_exps.weight": T.Q4_K, "blk.0.ffn_down.weight": T.Q4_K, "blk.1.ffn_up_shexp.weight": T.Q5_K,
            "blk.2.ffn_down_shexp.weight": T.Q6_K, "blk.1.attn_q_a.weight": T.Q5_K, "blk.1.attn_k_b.weight": T.Q8_0,
            "blk.1.ffn_gate_exps.weight": T.Q4_K, "blk.1.ffn_gate_inp.weight": T.F32, "blk.1.exp_probs_b.bias": T.F32,
            "blk.1.attn_kv_a_norm.weight": T.F32}
    assert {n: tensors[n].tensor_type for n in want} == want
  for t in r.tensors:   # dequantized weights: finite, zero-mean, the intended scale
    ne, x = [int(v) for v in t.shape], dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    assert np.isfinite(x).all(), t.name
    if t.tensor_type == T.F32 and len(ne) == 1 and not t.name.endswith(".bias"): assert abs(x.mean() - 1) < 0.02, t.name
    elif not t.name.endswith(".bias"):
      assert abs(x.mean()) < 5 * x.std() / math.sqrt(x.size), t.name
      assert x.std() == pytest.approx(expected_std(t.name, ne[0]), rel=0.1), t.name


@pytest.mark.parametrize("qtype", list(GENERATORS))
def test_generated_blocks(qtype: T) -> None:
  bs, ts = gguf.GGML_QUANT_SIZES[qtype]
  raw = GENERATORS[qtype](np.random.default_rng(3), (1 << 20) // bs, 0.02)
  assert raw.nbytes == (1 << 20) // bs * ts
  x = dequantize(raw.view(np.uint8).reshape(-1), qtype).astype(np.float64).reshape(-1)
  assert np.isfinite(x).all() and abs(x.mean()) < 0.005 * x.std() and x.std() == pytest.approx(0.02, rel=0.01)


def test_legacy_and_lite_metadata(tmp_path: pathlib.Path) -> None:
  leg = GGUFReader(write_synthetic(tmp_path / "leg.gguf", "tiny", quant="q8_0", legacy_kv_b=True))
  m, names = meta(leg), {t.name for t in leg.tensors}
  assert "blk.0.attn_kv_b.weight" in names and not any("attn_k_b" in n or "attn_v_b" in n for n in names)
  assert "deepseek2.attention.key_length_mla" not in m and "deepseek2.attention.value_length_mla" not in m
  assert (m["deepseek2.attention.head_count_kv"], m["deepseek2.attention.key_length"],
          m["deepseek2.attention.value_length"]) == (4, 64, 32)
  assert ([int(x) for x in next(t for t in leg.tensors if t.name == "blk.0.attn_kv_b.weight").shape]
          == [128, 4 * (32 + 32)])
  lite = GGUFReader(write_synthetic(tmp_path / "lite.gguf", "tiny-lite", quant="q4_0"))
  m, names = meta(lite), {t.name for t in lite.tensors}
  assert "blk.0.attn_q.weight" in names and "blk.0.attn_q_a.weight" not in names and not any(
    "exp_probs_b" in n for n in names)
  assert m["deepseek2.attention.q_lora_rank"] == 0 and m["deepseek2.expert_gating_func"] == 1 and not m[
    "deepseek2.expert_weights_norm"]
  assert m["deepseek2.rope.scaling.type"] == "yarn" and all(k in m for k in YARN_KEYS)
  assert m["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707) and m[
    "tokenizer.ggml.pre"] == "deepseek-llm"


def test_shortened_file_is_a_prefix(tmp_path: pathlib.Path) -> None:
  full = {t.name: t for t in GGUFReader(write_synthetic(tmp_path / "a.gguf", "tiny", quant="q4_k_m", seed=5)).tensors}
  short = GGUFReader(write_synthetic(tmp_path / "b.gguf", "tiny", layers=2, quant="q4_k_m", seed=5))
  assert meta(short)["deepseek2.block_count"] == 2 and not any(t.name.startswith("blk.2.") for t in short.tensors)
  for t in short.tensors:
    if t.tensor_type == full[t.name].tensor_type:
      np.testing.assert_array_equal(t.data, full[t.name].data, err_msg=t.name)


# *** tokenizer

@pytest.mark.parametrize("preset", ["tiny", "tiny-lite"])
def test_tokenizer(tmp_path: pathlib.Path, preset: str) -> None:
  s = PRESETS[preset]
  path = write_synthetic(tmp_path / "t.gguf", preset, quant="q8_0")
  r = GGUFReader(path)
  m, types, tokens = meta(r), r.fields["tokenizer.ggml.token_type"].contents(), r.fields[
    "tokenizer.ggml.tokens"].contents()
  n = len(s.specials)
  assert len(tokens) == len(types) == s.vocab and len(set(tokens)) == s.vocab and tokens[-n:] == list(s.specials)
  assert types[-n:] == [gguf.TokenType.CONTROL] * n and types[-n - 1] == gguf.TokenType.UNUSED and tokens[
    -n - 1] == f"[PAD{s.vocab - n - 1}]"
  assert len(r.fields["tokenizer.ggml.merges"].data) == 300 and m["tokenizer.chat_template"] == s.chat_template
  roles = dict(s.special_roles)
  assert tokens[m["tokenizer.ggml.bos_token_id"]] == roles["bos"] and tokens[m["tokenizer.ggml.eos_token_id"]] == roles[
    "eos"]
  assert m["tokenizer.ggml.add_bos_token"] == s.add_bos
  llama_cpp = pytest.importorskip("llama_cpp")
  llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
  try:
    text = b"The keeper climbed the old stairs of the lighthouse every evening."
    ids = llm.tokenize(text, add_bos=False)
    assert len(ids) < len(text) // 3 and llm.detokenize(ids) == text
    assert llm.tokenize(s.specials[-1].encode(), add_bos=False, special=True) == [s.vocab - 1]
  finally: llm.close()


# *** llama.cpp loads and evaluates the files

@pytest.mark.parametrize("quant", QUANT_CHOICES)
def test_llama_cpp_tiny(tmp_path: pathlib.Path, quant: str) -> None:
  check_logits(llama_logits(write_synthetic(tmp_path / "tiny.gguf", "tiny", quant=quant)), 1024)


@pytest.mark.parametrize("preset, kw",
                         [("tiny-lite", {}), ("tiny-lite", {"quant": "q4_k_m"}), ("tiny", {"legacy_kv_b": True}),
                                        ("tiny-lite", {"legacy_kv_b": True, "quant": "q6_k"})])
def test_llama_cpp_variants(tmp_path: pathlib.Path, preset: str, kw: dict) -> None:
  check_logits(llama_logits(write_synthetic(tmp_path / "v.gguf", preset, **kw)), 1024)


@pytest.mark.parametrize("name", list(BIG))
def test_llama_cpp_real_shapes(big: dict, name: str) -> None:
  path, _ = big[name]
  s = get_preset(BIG[name][0]).with_layers(BIG[name][1])
  r = GGUFReader(path)
  m = meta(r)
  assert all(k in r.fields for k in KEYS) and m["deepseek2.block_count"] == s.n_layers and m[
    "tokenizer.ggml.pre"] == s.tokenizer_pre
  assert {t.name for t in r.tensors} == {t.name for t in tensor_plan(s, BIG[name][2])}
  assert any(t.name == "output.weight" for t in r.tensors) is not s.tied
  del r
  check_logits(llama_logits(path), s.vocab)


def test_streaming_memory(big: dict) -> None:
  path, stats = big["glm"]
  assert path.stat().st_size > 0.8e9
  assert stats["maxrss_mb"] < 1500, stats


def test_peak_memory_is_the_process_own() -> None:
  """A process started from a large one reports its own peak (getrusage's maxrss would report the parent's)."""
  ballast = np.ones(600 << 20, dtype=np.uint8)  # 600 MB resident in this process
  code = "from model.memory import peak_rss_bytes; print(peak_rss_bytes())"
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
  assert int(r.stdout) < 300 << 20 < ballast.nbytes


def test_the_header_reads_as_gguf_reads_it(big: dict, gguf_file) -> None:
  """model.gguf_file's own header parser against the gguf package's reader: every metadata value (type included) and
  every tensor's type, shape, offset and size, on the real shapes and on tiny files of every quant type."""
  from reference import _field_value  # the reference model's metadata, through gguf.GGUFReader
  paths = ([p for p, _ in big.values()] + [gguf_file("tiny", q) for q in QUANT_CHOICES]
           + [gguf_file("tiny-lite", "q6_k", True)])
  for path in paths:
    ours, r = GGUFFile(path), GGUFReader(path)
    theirs = {k: _field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert [(k, v, type(v)) for k, v in ours.metadata.items()] == [(k, v, type(v)) for k, v in theirs.items()], path
    assert [(t.name, t.tensor_type.value, tuple(reversed(t.shape.tolist())), t.data_offset,
             t.n_bytes) for t in r.tensors] == \
           [(i.name, i.ggml_type, i.shape, i.offset, i.nbytes) for i in ours.tensors.values()], path
