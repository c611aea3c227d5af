"""The correctness gate: a trial computes what the baseline computes, up to its arithmetic's rounding, in every stage.

Logits compared position by position fail legitimate configs at depth (a reordered float sum flips a near-tied expert
and the blocks carry it on; 8-bit activations compound over the blocks), so each stage is checked on its own inputs:

- The reference (the baseline config, or an 8-bit config's twin: `twin`) feeds the prompt and its greedy continuation
  through the check path (model.deepseek2.Check) and records every block's KV cache rows of the prompt and, at each
  check position, the residual stream after every stage, each MoE block's selected experts, scores and router logits,
  and the logits (`make_reference`; cached under `reference_key`). At a workload's depth (a context past the prompt),
  the check positions start there: the cache between the prompt and the depth is filled by model/bench.py's rule
  (fill_context) from the prompt's rows, in the reference and again in the trial, so a reference keeps the prompt's rows
  alone, and at most GATE_PROMPT of them: its size and its making do not grow with the workload.
- `check`: the trial starts from the reference's cache rows (filled to its depth) and runs each check position with
  every stage reading the
  reference's stream and every MoE block the reference's experts. Each stage's update (output minus input) and the
  logits must stay within the tolerance of the reference's; its own top-k must equal the reference's where the
  reference's margin exceeds twice the tolerance (nearer ones are near-ties, counted); its router logits must stay
  within the tolerance.
- `prefill_check` (the trial runs it before `check`): the prompt through the trial's prefill (chunks of many tokens,
  which run per op whatever the fused stages, with the prefill knobs' paths) under the exact reference's routing of each
  prompt token: its logits over the prompt and the KV cache rows it writes must stay within the tolerance of the exact
  reference's (its decode steps), and the first check position decoded from that cache within the tolerance of the
  same step decoded from the reference's cache (decode reads what prefill wrote).
- `chained`: a second pass chains the stages under the reference's routing, at every check position; while its own
  routing is the reference's with clear margins, its greedy tokens are what the timed run must produce
  (`check_tokens`), and its distance from the reference's logits is the trial's drift, a figure.
- `accuracy` (the check's `accuracy`, which every view shows beside the precision class): how far the trial's output is
  from the EXACT reference, the baseline's, whatever its twin. It is the chained pass against the exact reference (for
  a config whose twin is the baseline, the pass above; for a q8 config, a pass of its own): from the exact reference's
  prompt cache, its tokens fed and its routing forced, so it covers every check position, wherever the trial's own
  routing would part. Over those positions, its logits against the exact reference's: `top1`, the share of positions
  whose argmax is the reference's; `max_rel_err` and `median_rel_err`, the per-position error as the gate measures it
  (rel_err: max |diff| over the reference's std); `mean_kl` and `max_kl`, KL(p_exact || p_trial) of the softmax
  distributions in nats (float64, log-softmax). A position whose logits are not finite counts as wrong, at infinite
  error and divergence.

Tolerances are of the reference's standard deviation at each position, errors the maximum over the elements. The
config's precision class (StructureConfig.precision) picks them: FP32_TOL where it reorders float32 work (or holds
activations to 16 bits, x16: within 1/64516 of a unit's largest value), FP16_TOL where it rounds to fp16 where its
reference does not; the stages that read 8-bit values (ffn_act's and attn_act's activations, kv_dtype=q8_0's cache) get
Q8_TOL at width 2048, scaled by sqrt(2048 / width), as one value one 8-bit step apart moves a stage by about step /
sqrt(width). The blocks run one by one, one captured graph per kind of block (model/generate.py), so a fault in one
block's data is checked in that block. The figures behind the constants: docs/benchmarks.md.
"""
from __future__ import annotations

import hashlib
import math
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from model.backends import catalog
from model.structure import KNOBS, Knob, StructureConfig

FP32_TOL, FP16_TOL, Q8_TOL = 5e-3, 5e-2, 3e-2
# the reference's prompt, at most: a longer workload prompt's positions past it are filled (model/bench.py fill_context)
GATE_PROMPT = 32
# what a reference's numbers depend on, besides the file, tinygrad and this module
CODE = pathlib.Path(__file__).resolve().parents[1] / "model"


def q8_knobs(cfg: StructureConfig) -> list[Knob]:
  """The knobs whose value in cfg reads 8-bit activations (precision class q8)."""
  return [k for k in KNOBS.values() if k.precision_of(k.value(cfg)) == "q8"]


def twin(cfg: StructureConfig) -> StructureConfig:
  """The config whose reference a trial is checked against: the baseline, or for 8-bit activations (precision class q8)
  their twin: the baseline with those knob values and the stages they are read in fused on the portable backends that
  round alike (catalog twin), since against float32 the rounding alone moves a stage as much as a subtle fault does."""
  q8 = q8_knobs(cfg)
  if not q8: return StructureConfig()
  fused = {s: catalog.twin(cfg.fused[s]) for k in q8 for s in k.fused_in if s in cfg.fused}
  return StructureConfig(fused=fused, **{k.field: k.value(cfg) for k in q8})


# the stages (the last word of their names: stage_names) that read a fused stage's activations
PARTS = {"attention": "attention", "router": "ffn", "moe": "ffn", "ffn": "ffn"}


def tolerance(cfg: StructureConfig, dim: int) -> tuple[float, dict[str, float]]:
  """(the tolerance of the config's precision class, {stage part: its own} for the parts that read 8-bit values) for a
  model of width dim: FP16_TOL where it rounds to fp16 where its reference does not, else FP32_TOL; the stages that
  read 8-bit values (the FFN's with ffn_act=q8, the attention's with attn_act=q8 or kv_dtype=q8_0: the stages a knob is
  fused in, or those whose per-op code it changes) Q8_TOL at width 2048, scaled by sqrt(2048 / dim): one value one
  8-bit step apart moves a stage by about step / sqrt(width)."""
  tol = FP16_TOL if "fp16" in cfg.precision() else FP32_TOL
  parts = {PARTS[s] for k in q8_knobs(cfg) for s in k.fused_in or k.stages}
  return tol, dict.fromkeys(sorted(parts), max(tol, Q8_TOL * math.sqrt(2048 / dim)))


def rel_err(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
  """Per row: max |got - ref| / std(ref), float64 (nan or inf where got is not finite)."""
  ref, got = ref.astype(np.float64), got.astype(np.float64)
  return np.abs(got - ref).max(-1) / ref.std(-1)


def code_hash() -> str:
  """SHA-256 of the model code (model/**/*.py) and of this module (what a reference records, and how): a reference made
  by other code is not used."""
  h = hashlib.sha256()
  for p in sorted(CODE.rglob("*.py")): h.update(p.relative_to(CODE).as_posix().encode() + b"\0" + p.read_bytes())
  h.update(b"gate\0" + pathlib.Path(__file__).read_bytes())
  return h.hexdigest()


def reference_key(file_sha: str, device: str, layers: int, prompt_len: int, positions: int, depth: int,
                  config: StructureConfig | None = None) -> str:
  """The cache key of a reference: everything its numbers depend on (the config where it is not the baseline)."""
  import tinygrad
  tg = getattr(tinygrad, "__version__", "") or _dist_version("tinygrad")
  cfg = "" if config is None or config == StructureConfig() else f"-cfg{config.hash[:12]}"
  return (f"{file_sha[:16]}-{device.replace(':', '_')}-L{layers}-p{prompt_len}-d{depth}-c{positions}"
          f"-code{code_hash()[:12]}-tinygrad{tg}{cfg}")


def _dist_version(name: str) -> str:
  from importlib.metadata import PackageNotFoundError, version
  try: return version(name)
  except PackageNotFoundError: return ""


def margins(scores: np.ndarray, k: int) -> np.ndarray:
  """(…): the k-th minus the (k+1)-th score of each row over its experts, relative to the scores' std (inf where all are
  selected)."""
  if scores.size == 0 or scores.shape[-1] <= k: return np.full(scores.shape[:-1], np.inf)
  top = np.sort(scores.astype(np.float64), -1)
  return (top[..., -k] - top[..., -k - 1]) / scores.std(-1)


def leads(logits: np.ndarray) -> np.ndarray:
  """Per row: the top logit minus the second, relative to the row's std."""
  top = np.sort(logits.astype(np.float64), -1)
  return (top[:, -1] - top[:, -2]) / logits.std(-1)


def stage_names(layers: int) -> list[str]:
  """The stages of a step in the order check_step returns their outputs, then the output head."""
  return ["embedding", *(f"block {i} {part}" for i in range(layers) for part in ("attention", "ffn")), "output"]


@dataclass
class Reference:
  tokens: np.ndarray  # (prompt + positions + 1,) the prompt, then the greedy continuation
  sel: np.ndarray  # (positions, n_moe, K) selected experts per check position (depth + j)
  scores: np.ndarray  # (positions, n_moe, E) selection scores
  router: np.ndarray  # (positions, n_moe, E) the router logits the scores are computed from
  logits: np.ndarray  # (positions, vocab) after each check position
  states: np.ndarray  # (positions, 2 * blocks + 1, D) the residual stream after each stage
  cache: np.ndarray  # (blocks, prompt, kv_lora + rope) every block's KV cache rows of the prompt
  prompt_len: int
  depth: int  # the first check position: the prompt's length, or past it where the cache is filled to a context
  prompt_sel: np.ndarray  # (prompt, n_moe, K) the experts each MoE block selected for each prompt token
  prompt_logits: np.ndarray  # (prompt, vocab) after each prompt token

  @property
  def positions(self) -> int: return len(self.logits)

  def save(self, path: str) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, tokens=self.tokens, sel=self.sel, scores=self.scores, router=self.router, logits=self.logits,
             states=self.states, cache=self.cache, prompt_len=self.prompt_len, depth=self.depth,
             prompt_sel=self.prompt_sel, prompt_logits=self.prompt_logits)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str) -> Reference:
    with np.load(path) as z:
      return cls(z["tokens"], z["sel"], z["scores"], z["router"], z["logits"], z["states"], z["cache"],
                 int(z["prompt_len"]), int(z["depth"]), z["prompt_sel"], z["prompt_logits"])

  def start(self, gen) -> None:
    """The trial's cache as the reference's was at its first check position: the prompt's rows, filled to the depth."""
    from model.bench import fill_context
    gen.set_cache(self.cache)
    fill_context(gen.model, self.prompt_len, self.depth)

  def margins(self) -> np.ndarray:
    """(positions, n_moe): the reference's routing margins."""
    return margins(self.scores, self.sel.shape[-1]) if self.sel.size else np.full(self.sel.shape[:2], np.inf)


def _split(n: int, *per_block: np.ndarray) -> tuple[np.ndarray, ...]:
  """The check step's per-block arrays, without their one-token axis: (n_moe, K) or (n_moe, E)."""
  return tuple(a.reshape(n, -1) if n else a[:0] for a in per_block)


def make_reference(gen, prompt: list[int], positions: int, depth: int = 0) -> Reference:
  """The reference config's run: the prompt fed one token at a time, the cache filled from its rows up to `depth`
  (model/bench.py fill_context), then `positions` greedy steps from there, the first of them fed the prompt's greedy
  token, through the check path."""
  from model.bench import fill_context
  n_moe, P = sum(b.moe for b in gen.model.blocks), len(prompt)
  tokens, sel, scores, router, logits, states, depth = list(prompt), [], [], [], [], [], max(depth, P)
  prompt_sel, prompt_logits = [], []
  for j in range(P + positions):
    if j == P: fill_context(gen.model, P, depth)
    lg, *per_block, outs = gen.check_step(tokens[j], j if j < P else depth + j - P)
    if j == P - 1: tokens.append(int(np.argmax(lg)))
    o, s, r = _split(n_moe, *per_block)
    if j < P:
      prompt_sel.append(o), prompt_logits.append(lg)
      continue
    sel.append(o), scores.append(s), router.append(r), states.append(outs), logits.append(lg)
    tokens.append(int(np.argmax(lg)))
  return Reference(np.array(tokens[:P + positions + 1]), np.stack(sel), np.stack(scores).astype(np.float32),
                   np.stack(router).astype(np.float32), np.stack(logits).astype(np.float32),
                   np.stack(states).astype(np.float32), gen.cache_rows(P), P, depth, np.stack(prompt_sel),
                   np.stack(prompt_logits).astype(np.float32))


def stage_errors(outs: np.ndarray, states: np.ndarray, base: np.ndarray | None = None) -> np.ndarray:
  """(S,): each stage's update (its output minus the reference's input to it) against the reference's update, max |diff|
  over std(reference update); the embedding against the reference's embedding. base: other outputs of the same stages
  to hold outs to instead of the reference's (the update's std still the reference's)."""
  states, outs = states.astype(np.float64), outs.astype(np.float64)
  update = np.concatenate([states[:1], states[1:] - states[:-1]])
  diff = np.abs(outs - (states if base is None else base.astype(np.float64))).max(-1)
  with np.errstate(divide="ignore", invalid="ignore"): err = diff / update.std(-1)
  return np.where(diff == 0, 0.0, np.nan_to_num(err, nan=np.inf))


def prefill_basis(cfg: StructureConfig, ref: Reference, exact: Reference | None, tol: float,
                  part_tol: dict[str, float]) -> tuple[Reference, float]:
  """What a trial's prefill is checked against, and within what. Prefill runs per op: the exact reference at the
  config's tolerance, unless an 8-bit knob of the config acts in the per-op code (kv_dtype=q8_0, the cache prefill
  writes): then its twin's, which rounds alike, within that part's tolerance (prefill's sums, in another order than the
  twin's decode steps, may round a cache value one 8-bit step apart)."""
  if all(k.fused_in for k in q8_knobs(cfg)): return exact or ref, tol
  return ref, max([tol, *part_tol.values()])


def prefill_check(gen, ref: Reference, tol: float, part_tol: dict[str, float] | None = None) -> dict:
  """The prompt through the config's prefill (its chunks of T > 1 tokens, which run per op whatever the fused stages)
  with every MoE block routed as the reference routed each prompt token: its logits over the prompt and the KV cache
  rows it writes against the reference's (its decode steps), and the first check position decoded from the cache that
  prefill wrote (filled to the depth), each stage on the reference's inputs under its routing, against the same stages
  decoded from the reference's cache: the same decode arithmetic on both sides, so what differs is what the attention
  stages read of the two caches (chained, a deep config's 8-bit rounding would amplify a cache difference into noise of
  its own). Errors as rel_err's and stage_errors, within tol; the decode step within the largest of part_tol too
  (`check`'s), as its stages that read 8-bit activations may round a value of the two caches one step apart. ref: the
  exact reference (the baseline's, whose arithmetic a q8 config's prefill keeps)."""
  n_moe, P = ref.sel.shape[1], ref.prompt_len
  worst = lambda got, want: float(np.nan_to_num(rel_err(got, want), nan=np.inf).max())
  logits = gen.prefill_forced(ref.tokens[:P].tolist(), ref.prompt_sel if n_moe else None)
  err, cache = worst(logits, ref.prompt_logits), worst(gen.cache_rows(P), ref.cache)
  from model.bench import fill_context
  fill_context(gen.model, P, ref.depth)
  step = lambda: gen.check_step(int(ref.tokens[P]), ref.depth, ref.sel[0] if n_moe else None, ref.states[0],
                                per_stage=True)[-1]
  after = step()
  ref.start(gen)
  after = float(np.nan_to_num(stage_errors(after, ref.states[0], step()), nan=np.inf).max())
  step_tol = max([tol, *(part_tol or {}).values()])
  return {"prefill_ok": max(err, cache) <= tol and after <= step_tol, "prefill_tolerance": tol,
          "prefill_decode_tolerance": step_tol, "prefill_max_rel_err": err, "prefill_cache_err": cache,
          "prefill_decode_err": after}


def check(gen, ref: Reference, tol: float, part_tol: dict[str, float] | None = None,
          exact: Reference | None = None) -> dict:
  """The trial's arithmetic stage by stage, its routing, its own chained run and its accuracy (see the module
  docstring): figures, `ok`, and what the timed run must produce (check_tokens). part_tol: the tolerance of the stages
  of a part ("attention", "ffn") that differs from tol (tolerance's second value). exact: the exact reference where
  `ref` is a twin's (None: `ref` is the exact one). Positions are reported as positions in the sequence (depth + j)."""
  part_tol = part_tol or {}
  n_moe, C, P, D = ref.sel.shape[1], ref.positions, ref.prompt_len, ref.depth
  forced = lambda j: ref.sel[j] if n_moe else None
  errs, own, rerr = [], [], []
  ref.start(gen)
  for j in range(C):
    lg, *per_block, outs = gen.check_step(int(ref.tokens[P + j]), D + j, forced(j), ref.states[j], per_stage=True)
    o, _, r = _split(n_moe, *per_block)
    own.append(o)
    if n_moe: rerr.append(rel_err(r, ref.router[j]))
    errs.append(np.append(stage_errors(outs, ref.states[j]), rel_err(lg[None], ref.logits[j][None])[0]))
  err = np.stack(errs)  # (C, S + 1): every stage and the output head
  names = stage_names((err.shape[1] - 2) // 2)
  tols = np.array([part_tol.get(n.split()[-1], tol) for n in names])
  flipped = (np.sort(np.stack(own), -1) != np.sort(ref.sel, -1)).any(-1) if n_moe else np.zeros((C, 0), bool)
  near = ref.margins() <= 2 * tol
  wrong_route = flipped & ~near
  router_err = float(np.max(rerr)) if rerr else 0.0
  bad = ~(err <= tols)
  worst = np.unravel_index(int(np.argmax(np.nan_to_num(err / tols, nan=np.inf))), err.shape)
  ok = bool(np.isfinite(err).all()) and not bad.any() and not wrong_route.any() and router_err <= tol
  at = lambda mask: (D + np.flatnonzero(mask)).tolist()
  figures = {"ok": ok, "tolerance": tol, "ffn_tolerance": part_tol.get("ffn", tol),
             "attention_tolerance": part_tol.get("attention", tol), "positions": C, "stages": len(names),
             "failed_positions": int(bad.any(-1).sum()), "failed_at": at(bad.any(-1)),
             "failed_stages": [names[s] for s in np.flatnonzero(bad.any(0))][:8],
             "wrong_routing_at": at(wrong_route.any(-1)), "max_rel_err": float(err[worst]),
             "median_rel_err": float(np.median(err)), "worst_stage": f"{names[worst[1]]} at position {D + worst[0]}",
             "routing_decisions": int(flipped.size), "near_ties": int(near.sum()),
             "near_tie_flips": int((flipped & near).sum()), "wrong_routing": int(wrong_route.sum()),
             "max_router_err": router_err}
  # the exact reference's pass first: the timed run continues from the cache the last pass leaves, the reference's
  exact_logits = None if exact is None else chained(gen, exact, tol)[0]
  logits, agreed = chained(gen, ref, tol)
  exact_logits = logits if exact is None else exact_logits
  return figures | _drift(ref, logits[:agreed], tol) | {"accuracy": accuracy(exact_logits, (exact or ref).logits)}


def chained(gen, ref: Reference, tol: float) -> tuple[np.ndarray, int]:
  """The chained pass: stages chained under the reference's routing from the reference's prompt cache (filled to its
  depth), its tokens fed, at every check position. Its logits (positions, vocab), and for how many positions, from the
  first, its own routing is the reference's with margins above twice tol (past that point the timed run may route
  otherwise)."""
  n_moe, P, logits, agree = ref.sel.shape[1], ref.prompt_len, [], []
  ref.start(gen)
  for j in range(ref.positions):
    lg, *per_block, _ = gen.check_step(int(ref.tokens[P + j]), ref.depth + j, ref.sel[j] if n_moe else None,
                                       ref.states[j], per_stage=False)
    o, s, _ = _split(n_moe, *per_block)
    logits.append(lg)
    agree.append(not n_moe or bool((np.sort(o, -1) == np.sort(ref.sel[j], -1)).all()
                                   and (margins(s, o.shape[-1]) > 2 * tol).all()))
  return np.stack(logits), (agree + [False]).index(False)


def _drift(ref: Reference, logits: np.ndarray, tol: float) -> dict:
  """From the chained pass's logits while its routing agreed with the reference's: its greedy tokens, how many of them,
  from the first, it decides clearly (what the timed run must reproduce), and its end-to-end drift from the reference's
  logits where it got that far."""
  if not len(logits): return {"drift": None, "own_tokens": [], "own_decided": 0}
  decided = [lead > tol for lead in leads(logits)] + [False]
  return {"drift": float(np.nan_to_num(rel_err(logits, ref.logits[:len(logits)]).max(), nan=np.inf)),
          "own_tokens": logits.argmax(-1).tolist(), "own_decided": decided.index(False)}


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """Per row, in float64: logits minus their log-sum-exp, shifted by the row's maximum so that nothing overflows."""
  x = logits.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def accuracy(logits: np.ndarray, exact: np.ndarray) -> dict:
  """The accuracy figures (see the module docstring) of a trial's chained logits (positions, vocab) against the exact
  reference's at the same positions; a position whose logits are not finite counts as wrong, at infinite error."""
  finite = np.isfinite(logits).all(-1)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    err = np.where(finite, np.nan_to_num(rel_err(logits, exact), nan=np.inf), np.inf)
    lp, lq = log_softmax(exact), log_softmax(np.where(finite[:, None], logits, 0))
    # a sum of float64 roundings may come out a hair below zero where the distributions are one
    kl = np.where(finite, np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0), np.inf)
  top1 = (logits.argmax(-1) == exact.argmax(-1)) & finite
  return {"positions": len(exact), "top1": float(top1.mean()), "max_rel_err": float(err.max()),
          "median_rel_err": float(np.median(err)), "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def check_tokens(ref: Reference, chk: dict, tokens: list[int]) -> dict:
  """The timed run's tokens (tokens[0] is the reference's token at its depth, fed first) against the chained check
  run's greedy tokens, while the timed run's inputs are the reference's and the chained run decides clearly."""
  want, given = chk["own_tokens"], ref.tokens[ref.prompt_len:]
  n = 0
  while n < min(chk["own_decided"], len(tokens) - 1) and (n == 0 or int(tokens[n]) == int(given[n])): n += 1
  bad = [k for k in range(1, n + 1) if int(tokens[k]) != int(want[k - 1])]
  return {"tokens_compared": n, "tokens_differ": len(bad), "first_differing": bad[0] if bad else None}


def tolerance_text(check: dict) -> str:
  """The check's tolerances, as its verdict and the evaluator's report print them."""
  tol = check["tolerance"]
  parts = [(what, check.get(f"{part}_tolerance", tol)) for part, what in (("attention", "attention"), ("ffn", "FFN"))]
  return f"{tol:.0e}" + "".join(f", {what} stages {t:.1e}" for what, t in parts if t != tol)


def accuracy_text(acc: dict | None) -> str:
  """The accuracy figures as every view prints them beside the precision class, compactly: the top-1 agreement, the
  largest error and the mean KL divergence ("top1 100% · err 2.1e-3 · KL 4e-6"); "-" for a result without them (stored
  before they were recorded, or not checked)."""
  if not acc: return "-"
  top1 = "100%" if acc["top1"] == 1 else f"{min(acc['top1'], 0.99):.0%}"  # never rounded up to all of them
  return f"top1 {top1} · err {_short(acc['max_rel_err'], 1)} · KL {_short(acc['mean_kl'], 0)}"


def _short(v: float, decimals: int) -> str:
  """v in scientific notation without the exponent's padding (2.1e-3); 0 and inf as such."""
  if v == 0 or not math.isfinite(v): return "0" if v == 0 else str(v)
  mant, exp = f"{v:.{decimals}e}".split("e")
  return f"{mant}e{int(exp)}"


def verdict(check: dict) -> str:
  """One line saying why a trial failed the gate."""
  parts = []
  if check["failed_positions"]:
    parts.append(f"stages on the reference's inputs differ at {check['failed_positions']} of {check['positions']} "
                 f"positions (max error {check['max_rel_err']:.3g} std in {check['worst_stage']}, tolerance "
                 f"{tolerance_text(check)}; failing: {', '.join(check['failed_stages'])})")
  if check["wrong_routing"]:
    parts.append(f"{check['wrong_routing']} routing decisions differ where the reference's margin is decisive")
  if check["max_router_err"] > check["tolerance"]:
    parts.append(f"router logits differ by {check['max_router_err']:.3g} std")
  if check.get("prefill_ok") is False:
    parts.append(f"prefill differs from the reference's decode steps (prompt logits {check['prefill_max_rel_err']:.3g}"
                 f" std, KV cache rows {check['prefill_cache_err']:.3g}, the decode step after it "
                 f"{check['prefill_decode_err']:.3g}; tolerance {check['prefill_tolerance']:.0e}, the decode step "
                 f"{check['prefill_decode_tolerance']:.1e})")
  if check.get("tokens_differ"):
    parts.append(f"the timed run's token {check['first_differing']} differs from the checked run's "
                 f"({check['tokens_differ']} of {check['tokens_compared']} compared)")
  return "; ".join(parts) or "output not finite"
