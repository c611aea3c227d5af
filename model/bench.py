"""Decode benchmark: sequential, after warm-up, at a fixed prompt and context range, in several rounds."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from tinygrad import Device, GlobalCounters

from model.generate import Generator, jit_stats
from model.structure import StructureConfig


def apply_process_settings(cfg: StructureConfig, device: str | None = None) -> None:
  """tinygrad settings of the whole process; applied once, before the first kernel is built. (BEAM is scoped to decode by Generator.)"""
  if device: Device.DEFAULT = device


def bench_prompt(vocab: int, n: int) -> list[int]:
  """A fixed, deterministic prompt of n token ids spread over the vocabulary."""
  return [(7919 * i + 17) % vocab for i in range(n)]


@dataclass
class BenchResult:
  tok_s: float  # median over rounds
  tok_s_min: float
  tok_s_max: float
  ms_p50: float
  ms_p90: float
  kernels_per_token: int
  graph_batches_per_token: int
  bytes_per_token: int
  prefill_tok_s: float
  compile_s: float  # first prefill + first decode steps (kernel compilation, BEAM search, JIT capture)
  tokens: list[int]

  def to_dict(self) -> dict: return asdict(self)


def bench(gen: Generator, prompt_len: int = 32, n: int = 32, rounds: int = 3, warmup: int = 3) -> BenchResult:
  vocab = gen.model.hp.vocab
  prompt = bench_prompt(vocab, prompt_len)
  t0 = time.perf_counter()
  first = int(gen.prefill(prompt)[-1].argmax())
  tok = first
  for i in range(warmup): tok = gen.step(tok, prompt_len + i)
  gen.prefill(prompt)
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  gen.prefill(prompt)
  Device[Device.DEFAULT].synchronize()
  prefill_tok_s = prompt_len / (time.perf_counter() - t0)
  GlobalCounters.reset()
  gen.step(first, prompt_len)
  nbytes = GlobalCounters.global_mem
  kernels, batches = jit_stats(gen.step_jit)
  per_round, step_ms, tokens = [], [], []
  for _ in range(rounds):
    tok, out = first, [first]
    start = time.perf_counter()
    for i in range(n - 1):
      t = time.perf_counter()
      tok = gen.step(tok, prompt_len + i)
      step_ms.append((time.perf_counter() - t) * 1e3)
      out.append(tok)
    per_round.append((n - 1) / (time.perf_counter() - start))
    tokens = out
  q = statistics.quantiles(step_ms, n=10) if len(step_ms) > 1 else step_ms * 9
  return BenchResult(statistics.median(per_round), min(per_round), max(per_round), statistics.median(step_ms), q[8],
                     kernels, batches, int(nbytes), prefill_tok_s, compile_s, tokens)
