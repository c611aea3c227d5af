"""What a trial ran on: the git state of the code, without what should not leave the machine."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re

import git

# files a credential scanner flags by name: their changes stay out of the stored diff, their names are listed as left
# out.
# Patterns without a slash match any path component, those with one the end of the path; both case-insensitively.
SECRET_PATTERNS = (
  # dotenv files; names that say it
  ".env", ".env.*", "*.env", "*secret*", "*token*", "*credential*", "*password*", "*passwd*",
  "netrc", ".netrc", "_netrc", ".pgpass", ".my.cnf", ".npmrc", ".yarnrc", ".yarnrc.yml", ".pypirc", ".gem/credentials",
  ".git-credentials", ".dockercfg", ".docker/config.json", ".htpasswd", ".s3cfg", ".boto", ".aws/config",
  # package registries, containers, clouds (their credential files), Terraform
  ".kube/config", "kubeconfig", ".config/gcloud/*", ".azure/*", "*.tfvars", "*.tfstate", "*.tfstate.*",
  "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "id_xmss*", "*_rsa", "*_dsa", "*_ecdsa", "*_ed25519",
  "ssh_host_*key*", ".ssh/*", ".gnupg/*", "*.ppk",  # ssh and gpg keys of every type
  # key stores, certificates
  "*.pem", "*.key", "*.p12", "*.pfx", "*.pkcs12", "*.jks", "*.keystore", "*.kdb", "*.kdbx", "*.asc", "*.ovpn",
  "*_history",  # shell and database client histories
)

# a private key block, or a token of a known form: a diff hunk that holds one stays out of the stored diff
SECRET_TEXT = re.compile("|".join((
  r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----",
  r"\bgh[pousr]_[A-Za-z0-9]{36,}", r"\bgithub_pat_[A-Za-z0-9_]{22,}", r"\bglpat-[A-Za-z0-9_-]{20,}",  # GitHub, GitLab
  r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|A3T[A-Z0-9])[A-Z0-9]{16}\b",  # AWS access key ids
  r"\bxox[abposr]-[A-Za-z0-9-]{10,}", r"hooks\.slack\.com/services/[A-Za-z0-9/]+",  # Slack tokens and webhooks
  # Google, OpenAI
  r"\bAIza[0-9A-Za-z_-]{35}", r"\bsk-[A-Za-z0-9_-]{20,}", r"\b[sr]k_live_[0-9A-Za-z]{20,}", r"\bhf_[A-Za-z0-9]{30,}",
  r"\bnpm_[A-Za-z0-9]{36}", r"\bpypi-[A-Za-z0-9_-]{50,}",  # and Anthropic, Stripe, Hugging Face, npm, PyPI
  r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}",  # JSON web tokens
  # HTTP authorization
  r"(?i:\bbearer\s+[A-Za-z0-9._~+/=-]{20,})", r"(?i:authorization[\"']?\s*[:=]\s*[\"']?(?:basic|token)\s+\S{16,})",
  r"(?i:\b[a-z][a-z0-9+.-]*://[^\s:/@]+:[^\s/@]+@)",  # a password in a URL
  # a quoted assignment
  r"(?i:(?:password|passwd|secret|token|api_?key|access_?key|private_?key)[\"']?\s*[:=]\s*[\"'][^\"'\s]{8,}[\"'])",
)))


def fingerprint_hash(d: dict) -> str:
  """sha256 hex of the canonical JSON of d (sorted keys, no whitespace)."""
  return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def looks_secret(path: str) -> bool:
  """Whether a credential scanner would flag this repository path by its name (SECRET_PATTERNS)."""
  low = path.lower()
  return any(fnmatch.fnmatch(low, p) or fnmatch.fnmatch(low, f"*/{p}") if "/" in p
             else any(fnmatch.fnmatch(part, p) for part in low.split("/"))
             for p in SECRET_PATTERNS)


def without_secret_hunks(diff: str) -> tuple[str, list[str]]:
  """The diff without the hunks whose lines match SECRET_TEXT, and a '# left out: ...' line for each hunk left out."""
  kept, notes, name = [], [], "?"
  for block in re.split(r"(?m)^(?=diff --git |@@ )", diff):
    if block.startswith("diff --git "):
      name = block.split("\n", 1)[0].removeprefix("diff --git a/").rpartition(" b/")[0] or block.split("\n", 1)[0]
    elif block.startswith("@@ ") and SECRET_TEXT.search(block):
      notes.append(f"# left out: a hunk of {name} ({block.split(' @@', 1)[0]} @@) that matches a private key or token "
                   "pattern")
      continue
    kept.append(block)
  return "".join(kept), notes


def git_state(path: str | os.PathLike = ".") -> dict | None:
  """commit, branch (None when detached), dirty and diff of the repository holding path; None outside a git repository
  or before its first commit.

  diff is `git diff HEAD` (tracked changes, staged or not), then the untracked files' names as '# untracked: NAME'
  lines. Files that match the repository's ignore rules (tracked ones too) or that a credential scanner flags by name
  (SECRET_PATTERNS), modified, staged or untracked, are left out, and so is every hunk that matches a private key or
  token (SECRET_TEXT): '# left out: ...' lines say that the diff is not the whole change."""
  try: repo = git.Repo(path, search_parent_directories=True)
  except (git.InvalidGitRepositoryError, git.NoSuchPathError): return None
  with repo:
    if not repo.head.is_valid(): return None
    changed = repo.git.diff("HEAD", "--name-only", "--no-renames", "-z").split("\0")
    ignored = set(repo.git.ls_files("--cached", "--ignored", "--exclude-standard", "-z").split("\0"))
    left_out = sorted(f for f in changed if f and (f in ignored or looks_secret(f)))
    diff = repo.git.diff("HEAD", "--no-color", "--no-ext-diff", "--no-renames", "--", ".",
                         *(f":(exclude,literal){f}" for f in left_out))
    diff, hunks = without_secret_hunks(diff)
    untracked = [f for f in repo.untracked_files if not looks_secret(f)]
    left_out += sorted(f for f in repo.untracked_files if looks_secret(f))
    tail = ("".join(f"\n# untracked: {f}" for f in untracked) + "".join(f"\n# left out: {f}" for f in left_out)
            + "".join(f"\n{n}" for n in hunks))
    return {"commit": repo.head.commit.hexsha, "branch": None if repo.head.is_detached else repo.active_branch.name,
            "dirty": bool(diff or untracked or left_out or hunks), "diff": (diff + tail).lstrip("\n")}
