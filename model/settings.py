"""tinygrad's process settings of a config (applied once, at the start of a trial or `model` process), and the timing of
its BEAM search."""
from __future__ import annotations

import os
import time

import tinygrad.helpers as th

from model import programs
from model.registry import cache_dir
from model.structure import PROCESS_SETTINGS, StructureConfig


def apply_process_settings(cfg: StructureConfig, device: str | None = None, cache: str | None = None) -> None:
  """tinygrad settings of the whole process; applied once, before the first kernel is built. (BEAM is scoped to decode
  by Generator.)

  tinygrad reads these variables through a cached getenv or at import, so the cache is cleared and the JIT batch size
  set directly. tinygrad's disk cache (CACHEDB: BEAM choices and the compiler's output) lives in `cache` when given (a
  study's own, so its trials do not depend on other studies' or runs' BEAM choices), else in tinygrad's directory. Its
  BEAM entries are keyed by kernel, not by the BEAM_* limits, so non-default limits get a cache file of their own. The
  programs tinygrad generates without BEAM are kept for every process in one file of structsearch's cache
  (model.programs)."""
  if device: th.DEV.value = device
  os.environ.update(cfg.process_env())
  th.getenv.cache_clear()
  th.JIT_BATCH_SIZE.value = cfg.jit_batch_size
  programs.use(str(cache_dir() / "programs.db"))
  beam_limits = [getattr(cfg, f) for f in PROCESS_SETTINGS if f.startswith("beam_")]
  default_limits = beam_limits == [getattr(StructureConfig, f) for f in PROCESS_SETTINGS if f.startswith("beam_")]
  if cache is None and default_limits: return
  if th._db_connection is not None:
    raise RuntimeError("tinygrad's cache is open already: apply process settings before any kernel is built")
  name = "cache.db" if default_limits else "structsearch-beam-" + "-".join(map(str, beam_limits)) + ".db"
  th.CACHEDB = os.path.join(cache or th.cache_dir, name)


def time_beam_search(budget_s: float = 0.0) -> dict[str, float]:
  """Time spent in tinygrad's BEAM search from now on, in this process: {"search_s", "kernels", "unsearched"}, updated
  in place.

  Its beam_search function is wrapped: the seconds are the search itself (candidate compiles and timing runs), apart
  from the rest of the compile phase; a kernel whose choice is in the cache returns at once and counts as a kernel.
  budget_s > 0: once the searches have taken that long, a kernel whose choice is not in the cache is optimised as at
  BEAM=0 (tinygrad's hand-coded heuristics) and counted as unsearched, so a trial's BEAM costs at most the budget and
  one kernel's search."""
  import tinygrad.codegen.opt.search as search  # beam_search is looked up in this module at each call
  stats, inner = {"search_s": 0.0, "kernels": 0, "unsearched": 0}, search.beam_search
  def timed(s, rawbufs, var_vals, amt, allow_test_size=True, *args, **kwargs):
    if budget_s and stats["search_s"] >= budget_s and not _beam_cached(s, amt, allow_test_size):
      stats["unsearched"] += 1
      return _heuristic(s)
    t0 = time.perf_counter()
    try: return inner(s, rawbufs, var_vals, amt, allow_test_size, *args, **kwargs)
    finally:
      stats["search_s"], stats["kernels"] = round(stats["search_s"] + time.perf_counter() - t0, 4), stats["kernels"] + 1
  search.beam_search = timed
  return stats


def _beam_cached(s, amt: int, allow_test_size: bool) -> bool:
  """Whether tinygrad's cache holds the BEAM choice of this kernel (the key of tinygrad 0.14's beam_search)."""
  key = {"ast": s.ast.key, "amt": amt, "allow_test_size": allow_test_size, "device": s.ren.target.device,
         "suffix": s.ren.suffix}
  return not th.IGNORE_BEAM_CACHE and th.CACHELEVEL >= 1 and th.diskcache_get("beam_search", key) is not None


def _heuristic(s):
  """A kernel optimised as tinygrad 0.14 optimises it at BEAM=0 (codegen.opt.postrange.apply_opts)."""
  from tinygrad.codegen.opt.heuristic import hand_coded_optimizations
  from tinygrad.uop.ops import Ops
  if th.NOOPT or (s.ast.arg is not None and s.ast.arg.applied_opts): return s
  if any(u.op is Ops.STAGE for u in s.ast.backward_slice): return s
  return hand_coded_optimizations(s)
