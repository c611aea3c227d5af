"""The correctness gate: the baseline config's decode logits along its own greedy tokens, cached per model file and
device, and the comparison of a trial's logits against them on the same teacher-forced tokens.

Tolerances are relative to the reference logits' standard deviation at each position. Float32 paths that only reorder
work (fusion, BEAM, barriers, top-k variants) stay within 1e-3; paths that round to fp16 where the baseline does not
(an fp16 weight cache, fp16 activations, the fp16 absorbed q projection, fp16 router input, or a float32 KV cache
against the baseline's fp16 one) within 5e-2. A position fails when its error exceeds the tolerance, or when its top
token differs although the reference's lead over its runner-up exceeds the tolerance (near-ties are not failures). A
trial is wrong when more than a quarter of the positions fail: one position may legitimately differ by a flipped routing
decision (an expert score within rounding of the k-th), a broken code path fails nearly all of them.
"""
from __future__ import annotations

import os

import numpy as np

from model.structure import StructureConfig

FP32_TOL, FP16_TOL = 1e-3, 5e-2


def tolerance(cfg: StructureConfig) -> float:
  base = StructureConfig()
  fp16 = ("fp16_cache" in cfg.backends.values() or cfg.act_dtype != base.act_dtype or cfg.mla_absorb != base.mla_absorb
          or cfg.router_fp32 != base.router_fp32 or cfg.kv_dtype != base.kv_dtype)
  return FP16_TOL if fp16 else FP32_TOL


def write(path: str, gen, first: int, prompt: list[int], positions: int) -> None:
  """Greedy decode from the prompt with the logits of every step (run by the baseline config)."""
  tokens, logits = [*prompt, first], []
  for j in range(positions):
    logits.append(gen.step_logits(tokens[-1], len(prompt) + j))
    tokens.append(int(np.argmax(logits[-1])))
  tmp = path + ".tmp.npz"
  np.savez(tmp, tokens=np.array(tokens, dtype=np.int64), logits=np.stack(logits).astype(np.float32))
  os.replace(tmp, path)


def load(path: str) -> dict[str, np.ndarray]:
  with np.load(path) as z: return {k: z[k] for k in z.files}


def teacher_forced(gen, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
  """The trial's decode logits when fed the reference's tokens (the prompt is in the cache already)."""
  n = len(tokens) - prompt_len - 1
  return np.stack([gen.step_logits(int(tokens[prompt_len + j]), prompt_len + j) for j in range(n)]).astype(np.float32)


def compare(ref: np.ndarray, got: np.ndarray, tol: float) -> dict:
  ref, got = ref.astype(np.float64), got.astype(np.float64)
  std = ref.std(-1)
  err = np.abs(got - ref).max(-1) / std
  top2 = np.sort(ref, -1)[:, -2:]
  lead = (top2[:, 1] - top2[:, 0]) / std
  agree = got.argmax(-1) == ref.argmax(-1)
  bad = (err > tol) | (~agree & (lead > tol))
  return {"ok": bool(bad.sum() <= len(bad) // 4) and bool(np.isfinite(got).all()), "tolerance": tol, "positions": len(err),
          "max_rel_err": float(np.nan_to_num(err.max(), nan=np.inf)), "median_rel_err": float(np.nan_to_num(np.median(err), nan=np.inf)),
          "failed_positions": int(bad.sum()), "top1_checked": int((lead > tol).sum()), "top1_agree": int((agree & (lead > tol)).sum())}


def verdict(check: dict) -> str:
  return (f"logits differ from the reference at {check['failed_positions']} of {check['positions']} positions (max error "
          f"{check['max_rel_err']:.3g} std, tolerance {check['tolerance']:.0e}; top token agrees at {check['top1_agree']} of "
          f"{check['top1_checked']} positions with a clear lead)")

