"""What a trial ran on: the git state of the code and a fingerprint of the host."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket

import git


def fingerprint_hash(d: dict) -> str:
  """sha256 hex of the canonical JSON of d (sorted keys, no whitespace)."""
  return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def git_state(path: str | os.PathLike = ".") -> dict | None:
  """commit, branch (None when detached), dirty and diff of the repository holding path; None outside a git repository or before its first commit.

  diff is `git diff HEAD` (tracked changes, staged or not); untracked files are not diffed, their names follow as '# untracked: NAME' lines."""
  try: repo = git.Repo(path, search_parent_directories=True)
  except (git.InvalidGitRepositoryError, git.NoSuchPathError): return None
  with repo:
    if not repo.head.is_valid(): return None
    diff = repo.git.diff("HEAD", "--no-color", "--no-ext-diff")
    untracked = "".join(f"\n# untracked: {f}" for f in repo.untracked_files)
    return {"commit": repo.head.commit.hexsha, "branch": None if repo.head.is_detached else repo.active_branch.name,
            "dirty": bool(diff or untracked), "diff": (diff + untracked).lstrip("\n")}


def host_fingerprint() -> dict:
  return {"python": platform.python_version(), "host": socket.gethostname(), "platform": platform.platform()}
