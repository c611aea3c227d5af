"""Decode benchmark: sequential, after warm-up, at a fixed prompt and context range, in several rounds."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import tinygrad.helpers as th
from tinygrad import Device, GlobalCounters

from model.generate import Generator, jit_stats
from model.structure import PROCESS_SETTINGS, StructureConfig


def apply_process_settings(cfg: StructureConfig, device: str | None = None, cache: str | None = None) -> None:
  """tinygrad settings of the whole process; applied once, before the first kernel is built. (BEAM is scoped to decode by Generator.)

  tinygrad reads these variables through a cached getenv or at import, so the cache is cleared and the JIT batch size set
  directly. tinygrad's disk cache (CACHEDB: BEAM choices and compiled programs) lives in `cache` when given (a study's
  own, so its trials do not depend on other studies' or runs' BEAM choices), else in tinygrad's directory. Its BEAM
  entries are keyed by kernel, not by the BEAM_* limits, so non-default limits get a cache file of their own."""
  if device: th.DEV.value = device
  os.environ.update(cfg.process_env())
  th.getenv.cache_clear()
  th.JIT_BATCH_SIZE.value = cfg.jit_batch_size
  beam_limits = [getattr(cfg, f) for f in PROCESS_SETTINGS if f.startswith("beam_")]
  default_limits = beam_limits == [getattr(StructureConfig, f) for f in PROCESS_SETTINGS if f.startswith("beam_")]
  if cache is None and default_limits: return
  if th._db_connection is not None: raise RuntimeError("tinygrad's cache is open already: apply process settings before any kernel is built")
  name = "cache.db" if default_limits else "structsearch-beam-" + "-".join(map(str, beam_limits)) + ".db"
  th.CACHEDB = os.path.join(cache or th.cache_dir, name)


def time_beam_search() -> dict[str, float]:
  """Time spent in tinygrad's BEAM search from now on, in this process: {"search_s", "kernels"}, updated in place.

  Its beam_search function is wrapped: the seconds are the search itself (candidate compiles and timing runs), apart from
  the rest of the compile phase; a kernel whose choice is in the cache returns at once and counts as a kernel."""
  import tinygrad.codegen.opt.search as search  # beam_search is looked up in this module at each call
  stats, inner = {"search_s": 0.0, "kernels": 0}, search.beam_search
  def timed(*args, **kwargs):
    t0 = time.perf_counter()
    try: return inner(*args, **kwargs)
    finally: stats["search_s"], stats["kernels"] = round(stats["search_s"] + time.perf_counter() - t0, 4), stats["kernels"] + 1
  search.beam_search = timed
  return stats


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
  deterministic: bool  # every round produced the same tokens

  def to_dict(self) -> dict: return asdict(self)


def sync() -> None: Device[Device.DEFAULT].synchronize()


def prefill(gen: Generator, prompt: list[int]) -> tuple[int, float]:
  """Prefill twice (the JIT captures on its second call), then once timed: (greedy next token, prefill tok/s)."""
  for _ in range(2): gen.prefill(prompt)
  t0 = time.perf_counter()
  first = int(gen.prefill(prompt)[-1].argmax())
  return first, len(prompt) / (time.perf_counter() - t0)


def steps(gen: Generator, tok: int, pos: int, n: int) -> list[int]:
  """n greedy decode steps from token `tok` at position `pos`; the first two build and capture the decode JIT."""
  out = []
  for i in range(n): out.append(tok := gen.step(tok, pos + i))
  return out


def feed(gen: Generator, tokens: list[int], start: int = 0) -> int:
  """Tokens through decode steps at positions start..; returns the greedy token after the last."""
  for i, t in enumerate(tokens): nxt = gen.step(t, start + i)
  return nxt


def traffic(gen: Generator, tok: int, pos: int) -> tuple[int, int, int]:
  """(bytes read + written, kernels, JIT graph batches) of one decode step."""
  GlobalCounters.reset()
  gen.step(tok, pos)
  return int(GlobalCounters.global_mem), *jit_stats(gen.step_jit)


def decode_rounds(gen: Generator, first: int, pos: int, n: int, rounds: int) -> tuple[list[float], list[float], list[list[int]]]:
  """Sequential decode of n tokens from the same start, `rounds` times: (tok/s per round, ms per step, tokens per round)."""
  per_round, step_ms, tokens = [], [], []
  for _ in range(rounds):
    tok, out = first, [first]
    start = time.perf_counter()
    for i in range(n - 1):
      t = time.perf_counter()
      tok = gen.step(tok, pos + i)
      step_ms.append((time.perf_counter() - t) * 1e3)
      out.append(tok)
    per_round.append((n - 1) / (time.perf_counter() - start))
    tokens.append(out)
  return per_round, step_ms, tokens


def percentile(xs: list[float], q: float) -> float:
  return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def bench(gen: Generator, prompt_len: int = 32, n: int = 32, rounds: int = 3, warmup: int = 3) -> BenchResult:
  prompt = bench_prompt(gen.model.hp.vocab, prompt_len)
  t0 = time.perf_counter()
  first, prefill_tok_s = prefill(gen, prompt)
  steps(gen, first, prompt_len, 2 + warmup)
  compile_s = time.perf_counter() - t0
  nbytes, kernels, batches = traffic(gen, first, prompt_len)
  per_round, step_ms, tokens = decode_rounds(gen, first, prompt_len, n, rounds)
  return BenchResult(statistics.median(per_round), min(per_round), max(per_round), statistics.median(step_ms), percentile(step_ms, 90),
                     kernels, batches, nbytes, prefill_tok_s, compile_s, tokens[-1], all(t == tokens[0] for t in tokens))
