"""tinygrad's generated programs kept on disk, so that a process generates only the kernels no earlier one did.

tinygrad keeps a kernel's code generation (its UOps rewritten down to source, then compiled) in memory,
codegen.to_program_cache, and only the C or CUDA compiler's output on disk. A trial is a fresh process, and code
generation is most of its compile phase: a portable (dsl) kernel takes seconds on a CPU, and the configs of a study
share most of their kernels (a trial changes a knob or two). Here that in-memory cache is backed by an SQLite file.

A program is kept under tinygrad's own key (the kernel's AST, the renderer and its target, tinygrad's code-generation
settings) with tinygrad's version and the environment variables its settings are read from: what it generates is a
function of these. Only kernels built without BEAM are kept: a BEAM-searched program is the outcome of timing runs on
one device, a study's own choice, which tinygrad's BEAM cache keeps per study (model.settings). A CPU program built for
`native` suits this machine, as in tinygrad's own compiler cache. Deleting the file is always safe; one that cannot be
opened leaves the process generating its kernels itself."""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import sqlite3
import sys
from importlib.metadata import version
from typing import Any

import tinygrad.codegen as codegen
import tinygrad.engine.realize as realize
from tinygrad.helpers import BEAM, ContextVar

TINYGRAD = version("tinygrad")
# environment variables that tinygrad 0.14's code generation reads with getenv rather than through a ContextVar
CODEGEN_ENV = ("TC", "TC_OPT", "NOLOCALS", "MV", "MV_THREADS_PER_ROW", "MV_ROWS_PER_THREAD", "MV_BLOCKSIZE",
               "OCCUPANCY_FLOOR", "ALLOW_HALF8", "ALIGNED", "EXPAND_SSA", "THREADS", "UPAT_COMPILE")
# tinygrad settings that change how a process runs or reports, not the programs it generates (the device is in the
# renderer's target; BEAM's kernels are not kept)
RUNTIME_ENV = ("DEV", "PARALLEL", "DEBUG", "SPEC", "CACHELEVEL", "CACHEDB", "JIT", "JIT_BATCH_SIZE", "LRU", "VIZ",
               "PROFILE")


class DiskPrograms(dict):
  """tinygrad's to_program_cache (key -> compiled PROGRAM UOp) with a disk copy of what it generates without BEAM."""

  def __init__(self, path: str, programs: dict):
    super().__init__(programs)
    self.path, self._db = path, None

  def db(self) -> sqlite3.Connection | None:
    if self._db is None:
      try:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        with contextlib.suppress(sqlite3.OperationalError): self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS program (key TEXT PRIMARY KEY, val BLOB NOT NULL)")
      except (OSError, sqlite3.Error) as e:
        print(f"program cache {self.path} unusable ({e}): kernels are generated in this process", file=sys.stderr)
        self.path, self._db = "", None
    return self._db if self.path else None

  @staticmethod
  def disk_key(key: tuple) -> str:
    """tinygrad's key (AST hash, renderer class, target with its arch, settings), tinygrad's version and the environment
    its settings are read from, as its pool of compiling processes sees it."""
    env = sorted((k, v) for k, v in os.environ.items()
                 if (k in ContextVar._cache or k in CODEGEN_ENV) and k not in RUNTIME_ENV)
    text = repr((TINYGRAD, key[0].hex(), key[1].__module__, key[1].__qualname__, key[2:], env))
    return hashlib.sha256(text.encode()).hexdigest()

  def _load(self, key: tuple) -> Any:
    if BEAM.value or (db := self.db()) is None: return None
    try: row = db.execute("SELECT val FROM program WHERE key = ?", (self.disk_key(key),)).fetchone()
    except sqlite3.Error: return None
    if row is None: return None
    try: prg = pickle.loads(row[0])
    except Exception: return None  # noqa: BLE001 - a program that cannot be rebuilt here is generated again
    super().__setitem__(key, prg)
    return prg

  def __contains__(self, key: object) -> bool:
    return super().__contains__(key) or (isinstance(key, tuple) and self._load(key) is not None)

  def get(self, key: Any, default: Any = None) -> Any:
    if super().__contains__(key): return super().__getitem__(key)
    prg = self._load(key)
    return default if prg is None else prg

  def __setitem__(self, key: Any, prg: Any) -> None:
    new = not super().__contains__(key)
    super().__setitem__(key, prg)
    if not new or BEAM.value or (db := self.db()) is None: return
    with contextlib.suppress(sqlite3.Error):
      db.execute("INSERT OR IGNORE INTO program VALUES (?, ?)", (self.disk_key(key), pickle.dumps(prg)))


def use(path: str) -> None:
  """Back tinygrad's program cache with the SQLite file at `path` for the rest of this process (once: a second call
  for the same file keeps the cache and connection it has)."""
  if isinstance(codegen.to_program_cache, DiskPrograms) and codegen.to_program_cache.path == path: return
  cache = DiskPrograms(path, codegen.to_program_cache)
  codegen.to_program_cache = realize.to_program_cache = cache
