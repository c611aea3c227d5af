"""The tinygrad model against the float64 numpy reference and against llama.cpp, on synthetic deepseek2 files.

Logits are compared per position as max_v |ours - theirs| / std_v(theirs).
- Against the reference, with an f32 KV cache, the only difference is float32 vs float64 arithmetic: bound 1e-4.
- Against llama.cpp (also with an f32 cache) the bound is the activation-rounding bound derived in
  `reference.llamacpp_logits` (llama.cpp rounds every matmul input to 8-bit blocks for quantized weights, to fp16/bf16
  for float weights) plus ours. Token sequences avoid routing near-ties, where a legitimate expert flip would exceed any
  rounding bound.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from reference import _weights, llamacpp_error_bound, llamacpp_logits, reference_logits, robust_tokens
from tinygrad import Tensor, TinyJit

from evaluator.gate import rel_err
from model.deepseek2 import Transformer
from model.generate import Generator, argmax_first
from model.gguf_file import GGUFFile
from model.structure import StructureConfig

N = 32
F32_KV = StructureConfig(kv_dtype="float32")
CASES = [("tiny", q, False) for q in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m")] + \
        [("tiny-lite", "q4_k", False), ("tiny", "q8_0", True)]
IDS = [f"{p}-{q}{'-legacy' if lg else ''}" for p, q, lg in CASES]


@functools.cache
def generator(path: str, f32_kv: bool = True) -> Generator:
  return Generator(Transformer(GGUFFile(path), F32_KV if f32_kv else StructureConfig(), max_context=2 * N), chunk=N)


def ours(path: str, tokens: list[int]) -> np.ndarray: return generator(path).prefill(tokens).astype(np.float64)


@pytest.mark.parametrize("preset,quant,legacy", CASES, ids=IDS)
def test_matches_reference(gguf_file, preset: str, quant: str, legacy: bool) -> None:
  path = gguf_file(preset, quant, legacy)
  tokens = np.random.default_rng(3).integers(0, 1000, N).tolist()
  ref = reference_logits(path, tokens)
  err = rel_err(ours(path, tokens), ref)
  assert err.max() < 1e-4, f"max |dlogit|/std {err.max():.3g} at position {err.argmax()}"
  np.testing.assert_array_equal(ours(path, tokens).argmax(1), ref.argmax(1))


def check_llama_cpp(path: str, tokens: list[int]) -> None:
  mine, lcpp = ours(path, tokens), llamacpp_logits(path, tokens, kv_cache="f32")
  bound = llamacpp_error_bound(path, tokens, kv_cache="f32") + 1e-4
  err = rel_err(mine, lcpp)
  assert err.max() <= bound, (f"positions {np.flatnonzero(err > bound).tolist()}: max |dlogit|/std {err.max():.3g} > "
                              f"bound {bound:.3g}")
  top2 = np.sort(lcpp, axis=1)[:, -2:]
  decisive = top2[:, 1] - top2[:, 0] > 2 * bound * lcpp.std(axis=1)
  np.testing.assert_array_equal(mine.argmax(1)[decisive], lcpp.argmax(1)[decisive])


@pytest.mark.parametrize("preset,quant,legacy", CASES, ids=IDS)
def test_matches_llama_cpp(gguf_file, preset: str, quant: str, legacy: bool) -> None:
  pytest.importorskip("llama_cpp")
  path = gguf_file(preset, quant, legacy)
  check_llama_cpp(path, robust_tokens(path, "f32", N))


@pytest.mark.slow  # about 15 CPU minutes and 10 GB: `make test-slow`
@pytest.mark.parametrize("preset,quant", [("glm-4.7-flash", "q4_k_m"), ("deepseek-v2-lite", "q4_0")])
def test_full_width_two_layers_match_llama_cpp(tmp_path_factory, preset: str, quant: str, record_property) -> None:
  """2-layer files with the real models' exact widths, vocabularies and routing; plus a free-running greedy
  comparison."""
  llama_cpp = pytest.importorskip("llama_cpp")
  from model.synth import write_synthetic
  path = str(write_synthetic(tmp_path_factory.mktemp("wide") / f"{preset}.gguf", preset, layers=2, quant=quant))
  check_llama_cpp(path, robust_tokens(path, "f32", N))
  prompt = robust_tokens(path, "f32", 4, seed=1)
  gen = Generator(Transformer(GGUFFile(path), F32_KV, max_context=64), chunk=8)
  mine = list(gen.generate(prompt, N))
  llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, type_k=0, type_v=0)
  theirs = [t for _, t in zip(range(N), llm.generate(prompt, temp=0.0, top_k=1), strict=False)]
  llm.close()
  same = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), N)
  record_property("greedy_prefix_agreement", f"{same}/{N}")
  print(f"{preset} {quant}: free-running greedy generations agree on the first {same} of {N} tokens")
  _weights.cache_clear()  # the reference's dequantized copy of a full-width file is several GB


def test_decode_matches_prefill(gguf_file) -> None:
  path = gguf_file("tiny", "q4_0")
  tokens = np.random.default_rng(5).integers(0, 1000, 12).tolist()
  gen = generator(path, f32_kv=False)
  full = gen.prefill(tokens)
  gen.model.reset()
  steps = np.stack([gen.step_logits(t, i) for i, t in enumerate(tokens)])
  assert rel_err(steps, full).max() < 1e-5


def test_generation_is_deterministic(gguf_file) -> None:
  gen = generator(gguf_file("tiny", "q4_0"), f32_kv=False)
  a, b = list(gen.generate([1, 2, 3], 8)), list(gen.generate([1, 2, 3], 8))
  assert a == b and len(a) == 8
  s1, s2 = (list(gen.generate([1, 2, 3], 8, temperature=1.0, seed=7)),
            list(gen.generate([1, 2, 3], 8, temperature=1.0, seed=7)))
  assert s1 == s2


@pytest.mark.parametrize("n", [5, 128, 129, 1000, 154880])
def test_argmax_first_is_numpys(n: int) -> None:
  rng = np.random.default_rng(n)
  # many ties; every value below -2 (keys below the half of int64's range); infinities
  for x in (rng.standard_normal(n).astype(np.float32), np.round(rng.standard_normal(n), 1).astype(np.float32),
            (rng.standard_normal(n) - 1e6).astype(np.float32), np.full(n, -np.inf, np.float32)):
    x[rng.integers(0, n, 3)] = x.max()  # the maximum three more times, in different groups
    assert int(argmax_first(Tensor(x)).item()) == int(np.argmax(x))


def test_argmax_first_counts_signed_zeros_alike() -> None:
  """-0.0 equals 0.0 (np.argmax takes the first of them), and every negative value is below both."""
  for vals in ([-1.0, -0.0, 0.0, -2.0], [-1.0, 0.0, -0.0], [-3.0, -np.finfo(np.float32).tiny, -0.0]):
    x = np.array(vals, np.float32)
    assert int(argmax_first(Tensor(x)).item()) == int(np.argmax(x)), vals


def test_argmax_rows_are_padded_to_a_multiple_of_align() -> None:
  """argmax_first's row reductions run over a row count padded to a multiple of `align` (tinygrad's heuristics split
  only such a count over workgroups on a GPU; benchmarks/argmax_lab.py): GLM-4.7-Flash's 154880 logits in rows of 256
  make 605 rows, 608 aligned to 32. The CPU kernel names carry the row count."""
  from model.generate import jit_kernels
  x = Tensor(np.random.default_rng(0).standard_normal(154880).astype(np.float32)).realize()
  for kw, rows in (({}, 608), ({"align": 1}, 605)):  # the defaults, then unaligned
    jit = TinyJit(lambda kw=kw: argmax_first(x, **kw).realize())
    for _ in range(3): jit()
    assert any(name.startswith(f"r_{rows}_") for name, _ in jit_kernels(jit)), (kw, jit_kernels(jit))


def test_host_copies_round_trip_and_refuse_another_size() -> None:
  from model.weights import read, write
  t = Tensor.empty(2, 3)
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  write(t, x)
  assert np.array_equal(read(t), x) and np.array_equal(t.numpy(), x)  # tinygrad's own copy-out sees the same bytes
  with pytest.raises(ValueError, match="copy size mismatch"): write(t, np.zeros(5, np.float32))
  assert np.array_equal(read(t), x)


def test_a_decode_step_schedules_nothing(gguf_file, monkeypatch) -> None:
  """The first step captures the graph (capture_first); from the second on, a step copies its token in and its output
  out: no graph is scheduled, and the tokens are the greedy ones."""
  gen = generator(gguf_file("tiny", "q4_0"), f32_kv=False)
  gen.model.reset()
  want = [int(np.argmax(gen.step_logits(t, i))) for i, t in enumerate([4, 9, 2, 7])]
  got = [gen.step(4, 0)]
  scheduled = []
  monkeypatch.setattr(Tensor, "linear_with_vars", lambda *a,
                      **k: scheduled.append(a) or pytest.fail("a step scheduled a graph"))
  got += [gen.step(t, i) for i, t in enumerate([9, 2, 7], start=1)]
  assert got == want and not scheduled


def test_greedy_steps_run_back_to_back_on_the_device(gguf_file, monkeypatch) -> None:
  """Generator.steps: n greedy tokens, each step reading its token from the device's sequence buffer, with one host
  read at the end and no host write after the first token: the tokens of n single steps, and again from a new start
  token at an earlier position."""
  import model.generate as generate
  gen = generator(gguf_file("tiny", "q4_0"), f32_kv=False)
  gen.model.reset()
  want = [gen.step(4, 0)]
  for i in range(5): want.append(gen.step(want[-1], i + 1))
  calls = {"read": 0, "write": 0}
  def counted(fn: str):
    inner = getattr(generate, fn)
    def call(*a):
      calls[fn] += 1
      return inner(*a)
    return call
  for fn in calls: monkeypatch.setattr(generate, fn, counted(fn))
  gen.model.reset()
  assert gen.steps(4, 0, 6) == want and calls == {"read": 1, "write": 0}
  assert gen.steps(9, 2, 3) == [gen.step(9, 2), *gen.steps(gen.step(9, 2), 3, 2)] and calls["write"] == 1


def test_device_memory_within_file_plus_kv(gguf_file) -> None:
  """No hidden fp16 copies of quantized weights: device memory stays within file size + KV cache + 10%."""
  from tinygrad import GlobalCounters
  path = gguf_file("tiny", "q4_k_m")
  before = GlobalCounters.mem_used
  m = Transformer(GGUFFile(path), max_context=256)
  used = GlobalCounters.mem_used - before
  budget = GGUFFile(path).path.stat().st_size + m.kv_cache_bytes
  assert used <= 1.1 * budget, f"{used} bytes on the device for a {budget}-byte budget"


def test_router_fp32_off_rounds_the_router_input_to_fp16(gguf_file) -> None:
  """router_fp32=False: the router's matmul reads its input rounded to fp16 (tinygrad folds a bare cast there away)."""
  path = gguf_file("tiny", "q4_0")
  fp32, fp16 = (Transformer(GGUFFile(path), StructureConfig(router_fp32=r), max_context=16) for r in (True, False))
  b32, b16 = (next(b for b in m.blocks if b.moe) for m in (fp32, fp16))
  xn = np.random.default_rng(0).standard_normal((1, 1, fp32.hp.dim)).astype(np.float32)
  got, exact = b16.router_logits(Tensor(xn)).numpy(), b32.router_logits(Tensor(xn)).numpy()
  rounded = b32.router_logits(Tensor(xn.astype(np.float16).astype(np.float32))).numpy()
  assert np.abs(got - rounded).max() <= 1e-5 * np.abs(rounded).max() < np.abs(got - exact).max(), (got, rounded, exact)
