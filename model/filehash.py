"""The SHA-256 of a model file, the identity a study and the reference cache hold it by. A reference's cache key also
holds a hash of every model/**/*.py (evaluator.gate.code_hash): editing any of them invalidates every cached correctness
reference, and the next trial of each study makes its reference again."""
from __future__ import annotations

import hashlib
import json
import os

from model.registry import cache_dir


def file_sha256(path: str | os.PathLike) -> str:
  """SHA-256 of a (possibly 20 GB) file, remembered in the cache by absolute path, size and mtime, so it is read
  once."""
  st = os.stat(path)
  memo = cache_dir() / "sha256.json"
  key = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"
  known = json.loads(memo.read_text()) if memo.exists() else {}
  if key not in known:
    h = hashlib.sha256()
    with open(path, "rb") as f:
      while chunk := f.read(1 << 24): h.update(chunk)
    known = json.loads(memo.read_text()) if memo.exists() else {}  # another process may have added its own meanwhile
    known[key] = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    tmp.replace(memo)
  return known[key]
