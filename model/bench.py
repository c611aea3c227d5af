"""The one decode benchmark, in the same steps wherever a decode figure is measured: the evaluator's trial process and
`model bench` both run `prepare` then `measure` (the trial process checks the output between the two).

prepare: the workload's fixed prompt through the prefill graph (built, captured, then timed once: prefill tok/s and the
time to the first token) or, without prefill, through decode steps alone (the first builds and captures the decode
graph); then the cache filled to the workload's context (fill_context) and the first decode steps there. measure:
warm-up steps, one step counted for kernels and bytes (and timed, for the round length), then `rounds` rounds of greedy
steps from the same start, each step timed."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

from tinygrad import Device, GlobalCounters, Tensor

from model.deepseek2 import Block, Transformer, apply_rope, rope_table
from model.generate import Generator, jit_stats
from model.workload import Workload

Phase = Callable[[str], None]
# A round lasts at least ROUND_S where n tokens would take longer, and has at least MIN_ROUND_TOKENS: host jitter per
# step stays a small share of a round's time, and a slow config's rounds do not cost a trial more than its figure needs.
ROUND_S, MIN_ROUND_TOKENS = 2.0, 8
# timed prefills of the prompt (a figure's spread), fewer where they would take longer than the budget together
PREFILL_RUNS, PREFILL_BUDGET_S = 3, 20.0


def round_tokens(step_s: float, n: int) -> int:
  """Tokens per measured round for a config whose step takes step_s: n, or as many as make a round of ROUND_S when that
  is fewer (at least MIN_ROUND_TOKENS)."""
  return min(n, max(MIN_ROUND_TOKENS, math.ceil(ROUND_S / step_s) + 1)) if step_s > 0 else n


def bench_prompt(vocab: int, n: int) -> list[int]:
  """A fixed, deterministic prompt of n token ids spread over the vocabulary."""
  return [(7919 * i + 17) % vocab for i in range(n)]


def _feed(gen: Generator, tokens: list[int], start: int = 0) -> int:
  """Tokens through decode steps at positions start..; returns the greedy token after the last."""
  for i, t in enumerate(tokens): nxt = gen.step(t, start + i)
  return nxt


def fill_context(model: Transformer, prompt_len: int, depth: int) -> None:
  """Positions [prompt_len, depth) of every block's KV cache hold the prompt's rows again, one copy after another: each
  row's compressed part as it is (it depends on no position) and its RoPE part rotated on to its new position, as the
  model writes the same key there. Decode at depth then reads `depth` real-valued positions, no two alike (a copy
  without the rotation would score as its original, and an attention that dropped whole copies would compute the same
  output), without waiting on a prefill of depth tokens: one graph of a copy kernel per block and cache plane, on the
  device."""
  if depth <= prompt_len: return
  hp, P, n = model.hp, prompt_len, depth - prompt_len
  copies, kvl = -(-n // P), hp.kv_lora
  cos, sin = rope_table(hp, (copies + 1) * P)
  # the rotation by k * P positions (k = 1..copies), without the tables' magnitude (mscale: their value at position 0)
  shift = lambda t: Tensor(t[P::P][:copies] / cos[0, 0], device=model.device)
  def filled(b: Block) -> tuple[Tensor, ...]:
    rows = b.kv.rows(P)[0].unsqueeze(0).expand(copies, P, -1)
    pe = apply_rope(rows[..., kvl:].unsqueeze(0), shift(cos), shift(sin))[0]
    return b.kv.store(P, rows[..., :kvl].cat(pe, dim=-1).reshape(1, copies * P, -1)[:, :n])
  Tensor.realize(*(t for b in model.blocks for t in filled(b)))
  Device[model.device or Device.DEFAULT].synchronize()


def percentile(xs: list[float], q: float) -> float:
  return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def prepare(gen: Generator, work: Workload, prefill: bool, phase: Phase = lambda name: None,
            feed: bool = True) -> tuple[int, dict]:
  """The workload's prompt in the model's cache, the cache filled to its context and the decode graph built: (the greedy
  token after the prompt, which decode at the context's depth starts from; {context, prompt, and with prefill
  prefill_tok_s (median, min, max over prefill_runs), ttft_s}). ttft_s: the median timed prefill, from the prompt's
  tokens to the first token on the host; after the run that builds the graph, up to PREFILL_RUNS runs while their sum
  stays under PREFILL_BUDGET_S.

  feed=False (without prefill): only the decode graph is built; the caller puts the prompt and the fill into the cache
  itself (the correctness check feeds its own, block by block, writing the same cache), and the token returned is not
  the prompt's."""
  prompt, out = bench_prompt(gen.model.hp.vocab, work.prompt), {"context": work.depth, "prompt": work.prompt}
  if prefill:
    phase("prefill")
    gen.prefill(prompt, last=True)  # builds and captures the prefill graph
    runs: list[float] = []  # each rewrites the same cache rows
    while len(runs) < PREFILL_RUNS and sum(runs) < PREFILL_BUDGET_S:
      t0 = time.perf_counter()
      first = int(gen.prefill(prompt, last=True).argmax())
      runs.append(time.perf_counter() - t0)
    out |= {"ttft_s": statistics.median(runs), "prefill_tok_s": work.prompt / statistics.median(runs),
            "prefill_tok_s_min": work.prompt / max(runs), "prefill_tok_s_max": work.prompt / min(runs),
            "prefill_runs": len(runs)}
    fill(gen, work, phase)
    phase("compile")  # the first decode step builds the kernels (with the config's BEAM) and captures the JIT
    gen.steps(first, work.depth, 2)
  else:
    phase("compile")
    first = _feed(gen, prompt[:1])
    if feed:
      phase("prompt")
      first = _feed(gen, prompt[1:], start=1)
      fill(gen, work, phase)
  Device[Device.DEFAULT].synchronize()
  return first, out


def fill(gen: Generator, work: Workload, phase: Phase) -> None:
  """The cache filled from the prompt to the workload's depth, in a phase of its own where there is one to fill."""
  if work.depth > work.prompt:
    phase("fill")
    fill_context(gen.model, work.prompt, work.depth)


def measure(gen: Generator, first: int, pos: int, n: int, rounds: int, warmup: int,
            phase: Phase = lambda name: None) -> dict:
  """Decode figures from token `first` at position `pos`: tok/s (median round, min, max, each round), ms per step (p50,
  p90 of the rounds' mean step), kernels, graph batches and bytes of one step, the tokens of the last round and whether
  every round made the same. A round decodes its tokens back to back on the device (Generator.steps), as a greedy
  generation would; rounds of at most n tokens (round_tokens: fewer where a step is slow)."""
  phase("warmup")
  if warmup: gen.steps(first, pos, warmup)
  GlobalCounters.reset()
  t = time.perf_counter()
  gen.step(first, pos)
  step_s, nbytes, (kernels, batches) = time.perf_counter() - t, int(GlobalCounters.global_mem), jit_stats(gen.step_jit)
  n = round_tokens(step_s, n)
  phase("measure")
  per_round, step_ms, tokens = [], [], []
  for _ in range(rounds):
    start = time.perf_counter()
    out = [first, *gen.steps(first, pos, n - 1)]
    secs = time.perf_counter() - start
    per_round.append((n - 1) / secs)
    step_ms.append(secs * 1e3 / (n - 1))
    tokens.append(out)
  tok_s = statistics.median(per_round)
  return {"tok_s": tok_s, "tok_s_min": min(per_round), "tok_s_max": max(per_round), "tok_s_rounds": per_round,
          "ms_per_token": 1e3 / tok_s, "ms_p50": percentile(step_ms, 50), "ms_p90": percentile(step_ms, 90),
          "kernels_per_token": kernels, "graph_batches_per_token": batches, "bytes_per_token": nbytes,
          "round_tokens": n, "tokens": tokens[-1], "deterministic": all(t == tokens[0] for t in tokens)}
