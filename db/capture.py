"""What a trial ran on: the git state of the code, without what should not leave the machine."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os

import git

# names that look like credentials: their changes and their names stay out of the stored diff (matched case-insensitively
# against each path component, like .gitignore's patterns without a slash)
SECRET_PATTERNS = (".env", ".env.*", "*secret*", "*.pem", "*.key", "*token*", "*credential*", "*password*", "id_rsa*", "id_ed25519*")


def fingerprint_hash(d: dict) -> str:
  """sha256 hex of the canonical JSON of d (sorted keys, no whitespace)."""
  return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def looks_secret(path: str) -> bool:
  return any(fnmatch.fnmatch(part.lower(), p) for part in path.split("/") for p in SECRET_PATTERNS)


def git_state(path: str | os.PathLike = ".") -> dict | None:
  """commit, branch (None when detached), dirty and diff of the repository holding path; None outside a git repository or before its first commit.

  diff is `git diff HEAD` (tracked changes, staged or not), then the untracked files' names as '# untracked: NAME' lines.
  Files that match the repository's ignore rules (tracked ones too) or look like credentials (SECRET_PATTERNS) are left
  out: only their names, as '# left out: NAME' lines, say that the diff is not the whole change."""
  try: repo = git.Repo(path, search_parent_directories=True)
  except (git.InvalidGitRepositoryError, git.NoSuchPathError): return None
  with repo:
    if not repo.head.is_valid(): return None
    changed = repo.git.diff("HEAD", "--name-only", "--no-renames", "-z").split("\0")
    ignored = set(repo.git.ls_files("--cached", "--ignored", "--exclude-standard", "-z").split("\0"))
    left_out = sorted(f for f in changed if f and (f in ignored or looks_secret(f)))
    diff = repo.git.diff("HEAD", "--no-color", "--no-ext-diff", "--no-renames", "--", ".", *(f":(exclude,literal){f}" for f in left_out))
    untracked = [f for f in repo.untracked_files if not looks_secret(f)]
    left_out += sorted(f for f in repo.untracked_files if looks_secret(f))
    tail = "".join(f"\n# untracked: {f}" for f in untracked) + "".join(f"\n# left out: {f}" for f in left_out)
    return {"commit": repo.head.commit.hexsha, "branch": None if repo.head.is_detached else repo.active_branch.name,
            "dirty": bool(diff or untracked or left_out), "diff": (diff + tail).lstrip("\n")}
