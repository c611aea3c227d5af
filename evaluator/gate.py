"""The correctness gate: a trial computes what the baseline computes, up to its arithmetic's rounding, at every position.

Why not compare logits position by position: at depth, MoE routing sits close to ties at many positions, a legitimate
float reordering flips one expert somewhere, attention carries it on, and tens of MoE blocks turn 1e-6 into O(1). So the
gate separates arithmetic from routing:

- The reference (the baseline config, once per model file, device, depth, model code and tinygrad version) records, for
  the prompt and the greedy continuation after it, every MoE block's selected experts and selection scores, and the
  logits of the check positions.
- Arithmetic: the trial runs the same tokens with each MoE block's selection forced to the reference's (the model's check
  path, model.deepseek2.Check), so only rounding differs; its logits must stay within the tolerance of its class (below)
  at every check position, with no position excused.
- Routing: the same run reports each block's own top-k (computed from its own scores); it must equal the reference's
  wherever the reference's margin (k-th minus (k+1)-th score) exceeds twice the tolerance (the two scores can each move by
  it). Decisions inside that margin are near-ties: recorded and counted, never failures. The trial's router logits (what
  the scores are computed from) must also stay within the tolerance of the reference's: a softmax over them turns a
  rounding-size difference of the logits into a larger one of the scores, so the scores are compared only by their top-k.
- The timed run: the tokens of the measured decode (the production graph, free routing) must equal the reference's
  greedy tokens at every position until the first one where the reference is not decisive (its top-two logit lead is
  within the tolerance, or any of its routing decisions at this or an earlier position is a near-tie); after that the two
  runs may legitimately part.

Tolerances are relative to the reference's standard deviation at each position (logits over the vocabulary, scores over
the experts). FP32_TOL holds configs that reorder float32 work (fusion, kernels, barriers, BEAM): measured at 1e-3 or less
on a 32-block model (tests/test_gate.py), the baseline's fp16 KV cache being what moves (a reordered sum that lands on the
other side of an fp16 rounding boundary). FP16_TOL holds configs that round to fp16 where the baseline does not (fp16
weight caches, activations, absorbed q projection, router input), round the FFN's activations to 8 bits (ffn_act=q8, as
llama.cpp does), or keep the KV cache in float32 against the baseline's fp16: measured up to 1.3e-2. A wrong expert, a
dropped residual or a dequantization scale off by one block moves the logits of the positions they touch by 1e-1 to O(1).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from model.structure import StructureConfig

FP32_TOL, FP16_TOL = 5e-3, 5e-2
CODE = pathlib.Path(__file__).resolve().parents[1] / "model"  # what a reference's logits depend on, besides the file and tinygrad


def tolerance(cfg: StructureConfig) -> float:
  """The tolerance class of a config: FP16_TOL where it rounds below float32 where the baseline does not, else FP32_TOL."""
  base = StructureConfig()
  fp16 = ("fp16_cache" in cfg.backends.values() or cfg.act_dtype != base.act_dtype or cfg.mla_absorb != base.mla_absorb
          or cfg.router_fp32 != base.router_fp32 or cfg.kv_dtype != base.kv_dtype or cfg.ffn_act != base.ffn_act)
  return FP16_TOL if fp16 else FP32_TOL


def rel_err(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
  """Per row: max |got - ref| / std(ref), float64 (nan or inf where got is not finite)."""
  ref, got = ref.astype(np.float64), got.astype(np.float64)
  return np.abs(got - ref).max(-1) / ref.std(-1)


def code_hash() -> str:
  """SHA-256 of the model code (model/**/*.py): a reference made by other code is not used."""
  h = hashlib.sha256()
  for p in sorted(CODE.rglob("*.py")): h.update(p.relative_to(CODE).as_posix().encode() + b"\0" + p.read_bytes())
  return h.hexdigest()


def reference_key(file_sha: str, device: str, layers: int, prompt_len: int, positions: int) -> str:
  """The cache key of a reference: everything its numbers depend on."""
  import tinygrad
  tg = getattr(tinygrad, "__version__", "") or _dist_version("tinygrad")
  return (f"{file_sha[:16]}-{device.replace(':', '_')}-L{layers}-p{prompt_len}-c{positions}-code{code_hash()[:12]}"
          f"-tinygrad{tg}")


def _dist_version(name: str) -> str:
  from importlib.metadata import PackageNotFoundError, version
  try: return version(name)
  except PackageNotFoundError: return ""


@dataclass
class Reference:
  tokens: np.ndarray  # (prompt + positions + 1,) the prompt, then the greedy continuation
  sel: np.ndarray  # (prompt + positions, n_moe, K) selected experts per fed position
  scores: np.ndarray  # (prompt + positions, n_moe, E) selection scores per fed position
  router: np.ndarray  # (prompt + positions, n_moe, E) the router logits the scores are computed from
  logits: np.ndarray  # (positions, vocab) after each check position (prompt_len + j)
  prompt_len: int

  @property
  def positions(self) -> int: return len(self.logits)

  def save(self, path: str) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, tokens=self.tokens, sel=self.sel, scores=self.scores, router=self.router, logits=self.logits, prompt_len=self.prompt_len)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str) -> Reference:
    with np.load(path) as z: return cls(z["tokens"], z["sel"], z["scores"], z["router"], z["logits"], int(z["prompt_len"]))

  def margins(self) -> np.ndarray:
    """(fed positions, n_moe): the k-th minus the (k+1)-th score relative to the scores' std (inf where all are selected)."""
    if self.scores.size == 0 or self.scores.shape[-1] <= self.sel.shape[-1]: return np.full(self.sel.shape[:2], np.inf)
    top = np.sort(self.scores.astype(np.float64), -1)
    k = self.sel.shape[-1]
    return (top[..., -k] - top[..., -k - 1]) / self.scores.std(-1)

  def decisive_tokens(self, tol: float) -> int:
    """How many check positions, from the first, the reference decides clearly: its top-two logit lead exceeds tol and no
    routing decision at this or an earlier fed position is within 2 tol."""
    top = np.sort(self.logits.astype(np.float64), -1)
    lead = (top[:, -1] - top[:, -2]) / self.logits.std(-1)
    routing = self.margins().min(-1) if self.sel.size else np.full(len(self.tokens) - 1, np.inf)
    for j in range(self.positions):
      if lead[j] <= tol or routing[:self.prompt_len + j + 1].min() <= 2 * tol: return j
    return self.positions


def _split(n: int, *per_block: np.ndarray) -> tuple[np.ndarray, ...]:
  """The check step's per-block arrays, without their one-token axis: (n_moe, K) or (n_moe, E)."""
  return tuple(a.reshape(n, -1) if n else a[:0] for a in per_block)


def make_reference(gen, prompt: list[int], positions: int) -> Reference:
  """The baseline's run: the prompt fed one token at a time, then `positions` greedy steps, through the check path."""
  n_moe = sum(b.moe for b in gen.model.blocks)
  tokens, sel, scores, router, logits = list(prompt), [], [], [], []
  for j in range(len(prompt) + positions):
    lg, *per_block = gen.check_step(tokens[j], j)
    o, s, r = _split(n_moe, *per_block)
    sel.append(o), scores.append(s), router.append(r)
    if j >= len(prompt) - 1:
      if j >= len(prompt): logits.append(lg)
      tokens.append(int(np.argmax(lg)))
  logits = logits[:positions]
  return Reference(np.array(tokens[:len(prompt) + positions + 1]), np.stack(sel), np.stack(scores).astype(np.float32),
                   np.stack(router).astype(np.float32), np.stack(logits).astype(np.float32), len(prompt))


def check(gen, ref: Reference, tol: float) -> dict:
  """The trial's arithmetic and routing against the reference (see the module docstring): figures and `ok`."""
  n_moe = ref.sel.shape[1]
  logits, own, rerr = [], [], []
  for j in range(len(ref.sel)):
    lg, *per_block = gen.check_step(int(ref.tokens[j]), j, ref.sel[j] if n_moe else None)
    o, _, r = _split(n_moe, *per_block)
    own.append(o)
    if n_moe: rerr.append(rel_err(r, ref.router[j]))
    if j >= ref.prompt_len: logits.append(lg)
  err = rel_err(np.stack(logits), ref.logits)
  margins = ref.margins()
  flipped = (np.sort(np.stack(own), -1) != np.sort(ref.sel, -1)).any(-1) if n_moe else np.zeros((len(ref.sel), 0), bool)
  near = margins <= 2 * tol
  wrong_route = flipped & ~near
  router_err = float(np.max(rerr)) if rerr else 0.0
  finite = bool(np.isfinite(err).all())
  ok = finite and bool((err <= tol).all()) and not wrong_route.any() and router_err <= tol
  return {"ok": ok, "tolerance": tol, "positions": int(len(err)), "failed_positions": int((~(err <= tol)).sum()),
          "failed_at": np.flatnonzero(~(err <= tol)).tolist(), "wrong_routing_at": np.flatnonzero(wrong_route.any(-1)).tolist(),
          "max_rel_err": float(np.nan_to_num(err.max(), nan=np.inf)), "median_rel_err": float(np.nan_to_num(np.median(err), nan=np.inf)),
          "routing_decisions": int(flipped.size), "near_ties": int(near.sum()), "near_tie_flips": int((flipped & near).sum()),
          "wrong_routing": int(wrong_route.sum()), "max_router_err": router_err}


def check_tokens(ref: Reference, tokens: list[int], tol: float) -> dict:
  """The timed run's tokens (from the reference's first generated token at prompt_len) against the reference's greedy
  tokens, at every position the reference decides clearly."""
  want = ref.tokens[ref.prompt_len:ref.prompt_len + ref.positions + 1]
  n = min(ref.decisive_tokens(tol) + 1, len(tokens), len(want))  # the token after a decisive position is decided too
  bad = [j for j in range(1, n) if int(tokens[j]) != int(want[j])]
  return {"tokens_compared": max(0, n - 1), "tokens_differ": len(bad), "first_differing": bad[0] if bad else None}


def verdict(check: dict) -> str:
  """One line saying why a trial failed the gate."""
  parts = []
  if check["failed_positions"]:
    parts.append(f"logits under the reference's routing differ at {check['failed_positions']} of {check['positions']} positions (max error "
                 f"{check['max_rel_err']:.3g} std, tolerance {check['tolerance']:.0e})")
  if check["wrong_routing"]: parts.append(f"{check['wrong_routing']} routing decisions differ where the reference's margin is decisive")
  if check["max_router_err"] > check["tolerance"]: parts.append(f"router logits differ by {check['max_router_err']:.3g} std")
  if check.get("tokens_differ"):
    parts.append(f"the timed run's token {check['first_differing']} differs where the reference is decisive "
                 f"({check['tokens_differ']} of {check['tokens_compared']} compared)")
  return "; ".join(parts) or "output not finite"
