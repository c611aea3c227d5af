"""The SHA-256 of a model file, the identity a study and the reference cache hold it by. A reference's cache key also
holds a hash of every model/**/*.py (evaluator.gate.code_hash): editing any of them invalidates every cached correctness
reference, and the next trial of each study makes its reference again."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

from model.registry import cache_dir

SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # the sampled content hash: 16 pieces of 64 KiB, spread over the file


def file_identity(path: str | os.PathLike) -> str:
  """What a file is without reading it all: its absolute path, size, inode, mtime and ctime, and a hash of 16 pieces
  spread over it. A file replaced, rewritten in place or copied over changes it, even at the same size with its mtime
  set back (its ctime and inode cannot be set back)."""
  h, st = hashlib.sha256(), os.stat(path)
  with open(path, "rb") as f:
    for i in range(SAMPLES):
      f.seek(max(0, st.st_size - SAMPLE_BYTES) * i // (SAMPLES - 1))
      h.update(f.read(SAMPLE_BYTES))
  return f"{os.path.abspath(path)}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}:{h.hexdigest()[:16]}"


def cached_json(path: pathlib.Path) -> dict:
  """A JSON cache file's contents ({} when there is none); a corrupt one is an error that names it."""
  try: known = json.loads(path.read_text()) if path.exists() else {}
  except (ValueError, OSError) as e:
    raise ValueError(f"the cache file {path} is corrupt ({e}): remove it, and it is made again") from None
  if not isinstance(known, dict): raise ValueError(f"the cache file {path} is corrupt (not a JSON object): remove it, "
                                                   "and it is made again")
  return known


def file_sha256(path: str | os.PathLike) -> str:
  """SHA-256 of a (possibly 20 GB) file, remembered in the cache by its file_identity, so it is read once."""
  memo, key = cache_dir() / "sha256.json", file_identity(path)
  known = cached_json(memo)
  if key not in known:
    h = hashlib.sha256()
    with open(path, "rb") as f:
      while chunk := f.read(1 << 24): h.update(chunk)
    known = cached_json(memo)  # another process may have added its own meanwhile
    known[key] = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    tmp.replace(memo)
  return known[key]
