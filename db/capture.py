"""What a trial ran on: the git state of the code, without what should not leave the machine."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

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


# a secret's name assigned a value (detect-secrets' KeywordDetector's classes): quoted in any file, bare in the files
# CONFIG_SUFFIXES name (and dotfiles, files without a suffix)
KEYWORD = (r"[A-Za-z0-9_.-]*(?:password|passwd|pwd|passphrase|secret|token|api_?key|auth_?key|access_?key|private_?key"
           r"|client_?key|credential)[A-Za-z0-9_.-]*")
QUOTED = re.compile(rf"(?i){KEYWORD}[\"']?\s*(?::=|=>|[:=])\s*[\"'][^\"'\s]+[\"']")
BARE = re.compile(rf"(?i)^\s*(?:export\s+)?{KEYWORD}\s*[:=]\s*[^\s\"'#]")
CONFIG_SUFFIXES = (".envrc", ".sh", ".bash", ".zsh", ".fish", ".yaml", ".yml", ".ini", ".cfg", ".conf", ".toml",
                   ".properties", ".txt", ".json")
# a private key block: its whole body is left out, wherever a hunk cuts it
PEM_BEGIN = re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")
PEM_END = re.compile(r"-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")
BODY = re.compile(r"^\s*[A-Za-z0-9+/=]{16,}\s*$")  # a line that may belong to one


def fingerprint_hash(d: dict) -> str:
  """sha256 hex of the canonical JSON of d (sorted keys, no whitespace)."""
  return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def looks_secret(path: str) -> bool:
  """Whether a credential scanner would flag this repository path by its name (SECRET_PATTERNS)."""
  low = path.lower()
  return any(fnmatch.fnmatch(low, p) or fnmatch.fnmatch(low, f"*/{p}") if "/" in p
             else any(fnmatch.fnmatch(part, p) for part in low.split("/"))
             for p in SECRET_PATTERNS)


def keyword_secret(name: str, line: str) -> bool:
  """Whether a line assigns a value to a secret's name, as detect-secrets' KeywordDetector reads it: a quoted value in
  any file, a bare one in a shell, dotenv or config file (`export API_TOKEN=x`, YAML `password: x`, INI
  `aws_secret_access_key = x`)."""
  if QUOTED.search(line): return True
  base = name.rsplit("/", 1)[-1].lower()
  return (base.startswith(".") or "." not in base or base.endswith(CONFIG_SUFFIXES)) and BARE.search(line) is not None


def pem_blocks(text: str) -> list[range]:
  """The line numbers (from 1) of each private key block in text, its BEGIN line to its END line (or the text's end)."""
  blocks, start, i = [], None, 0
  for i, line in enumerate(text.splitlines(), 1):
    if start is None and PEM_BEGIN.search(line): start = i
    elif start is not None and PEM_END.search(line): blocks.append(range(start, i + 1)); start = None
  return blocks + ([range(start, i + 1)] if start is not None else [])


def _in_pem(header: str, old: list[range], new: list[range]) -> bool:
  """Whether a hunk (`@@ -a,b +c,d @@`) touches a private key block of the file before (old) or after (new) the
  change."""
  m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", header)
  if m is None: return False
  a, b, c, d = (int(x) if x is not None else 1 for x in m.groups())
  return any(range(a, a + max(b, 1)).start < r.stop and r.start < a + max(b, 1) for r in old) or \
    any(c < r.stop and r.start < c + max(d, 1) for r in new)


def without_secret_hunks(diff: str, sources: Callable[[str], tuple[str, str]] | None = None) -> tuple[str, list[str]]:
  """The diff without the hunks that hold a secret: a token of a known form or a private key line (SECRET_TEXT), a value
  assigned to a secret's name (keyword_secret), or any line of a private key block, found in the whole file before and
  after the change (`sources(name)`: its two texts), so a body line far from its BEGIN line is found too. A '# left
  out: ...' line for each hunk left out."""
  kept, notes, name, blocks = [], [], "?", None
  for block in re.split(r"(?m)^(?=diff --git |@@ )", diff):
    if block.startswith("diff --git "):
      name = block.split("\n", 1)[0].removeprefix("diff --git a/").rpartition(" b/")[0] or block.split("\n", 1)[0]
      blocks = None  # the file's key blocks, found once one of its hunks has a line that may be a key's
    lines = block.splitlines()[1:]
    if block.startswith("@@ ") and sources is not None and blocks is None and any(BODY.match(ln[1:]) for ln in lines):
      blocks = tuple(pem_blocks(t) for t in sources(name))
    if block.startswith("@@ ") and (SECRET_TEXT.search(block) or (blocks and _in_pem(block, *blocks))
                                    or any(keyword_secret(name, ln[1:]) for ln in lines)):
      notes.append(f"# left out: a hunk of {name} ({block.split(' @@', 1)[0]} @@) that holds a private key, a token or "
                   "a password")
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
    tree = Path(repo.working_tree_dir)
    diff, hunks = without_secret_hunks(diff, lambda name: (_committed(repo, name), _text(tree / name)))
    untracked = [f for f in repo.untracked_files if not looks_secret(f)]
    left_out += sorted(f for f in repo.untracked_files if looks_secret(f))
    tail = ("".join(f"\n# untracked: {f}" for f in untracked) + "".join(f"\n# left out: {f}" for f in left_out)
            + "".join(f"\n{n}" for n in hunks))
    return {"commit": repo.head.commit.hexsha, "branch": None if repo.head.is_detached else repo.active_branch.name,
            "dirty": bool(diff or untracked or left_out or hunks), "diff": (diff + tail).lstrip("\n")}



def _committed(repo: git.Repo, name: str) -> str:
  try: return repo.git.show(f"HEAD:{name}")
  except git.GitCommandError: return ""  # new in the work tree


def _text(path: Path) -> str:
  try: return path.read_text(errors="replace")
  except OSError: return ""  # deleted
