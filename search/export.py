"""Export to production: a study's chosen config written where `model run` and `model bench` load it (model/production.py),
with where it comes from in its header; with --commit, committed by gitpython on a new branch of the repository holding the
file (the user's checkout, index and current branch are left as they are), and that commit recorded with the study."""
from __future__ import annotations

import datetime
import os
import pathlib
import re
import tempfile

import git
from sqlalchemy.orm import Session

from db import store
from db.engine import hide_password
from db.models import Confirmation, Study, Trial
from db.store import interval
from model.production import model_key as production_key
from model.production import production_dir, sha_line
from model.structure import StructureConfig
from search.leaderboard import find_trial, winner


def choose(s: Session, study: Study, which: str | None, unconfirmed: bool) -> tuple[Trial, str]:
  """The trial to export (`which`: a number or "baseline"; None: the confirmed winner, or with `unconfirmed` the best measured
  config) and a line saying why it is trusted. Refused (ValueError): a study with no finished trial; a trial that did not
  measure ok (wrong output, failed, pruned, interrupted); the baseline itself; a config whose confirmation says it is not
  faster than the baseline (whatever `unconfirmed` says); an unconfirmed one without `unconfirmed`."""
  trials = store.trials(s, study)
  if not any(t.state not in ("running", "interrupted") for t in trials): raise ValueError(f"study {study.name!r} has no finished trial")
  conf = {c.config_hash: c for c in store.confirmations(s, study)}
  if which is not None:
    t = find_trial(s, study, which)
    src = t.reused_from or t
    if src.state != "ok":
      raise ValueError(f"trial {t.number} is {src.state}{f' ({src.failure_class})' if src.failure_class and src.failure_class != src.state else ''}: "
                       "only a config measured ok can go to production")
  elif (win := winner(list(conf.values()))) is not None: t = s.get(Trial, win.trial_id)
  elif not unconfirmed:
    raise ValueError(f"study {study.name!r} has no confirmed winner (`search confirm --study {study.name}`; --unconfirmed exports the best "
                     "measured config)")
  else:
    cands = [t for t in store.leaderboard(s, study, None) if t.config_hash != study.baseline_hash and not _slower(conf.get(t.config_hash))]
    if not cands: raise ValueError(f"study {study.name!r} has no measured config but the baseline and those confirmed slower than it")
    t = cands[0]
  if t.config_hash == study.baseline_hash:
    raise ValueError(f"trial {t.number} is the baseline config: production without a config is the baseline already")
  c = conf.get(t.config_hash)
  if _slower(c):
    raise ValueError(f"trial {t.number} was confirmed {'not faster than' if c.status == 'ok' else 'failing against'} the baseline "
                     f"({c.status}: {_ci(c)} over {c.pairs} A/B pairs); not exported")
  if c is not None and c.speedup_low > 1.0: return t, f"confirmed speedup {_ci(c)} over {c.pairs} A/B pairs"
  if not unconfirmed:
    state = "not confirmed" if c is None else f"confirmed at {_ci(c)}, not above 1 in every pair"
    raise ValueError(f"trial {t.number} is {state} (`search confirm --study {study.name}`, or export it with --unconfirmed)")
  return t, "UNCONFIRMED: " + ("best measured config" if c is None else f"inconclusive confirmation {_ci(c)}")


def _slower(c: Confirmation | None) -> bool: return c is not None and (c.status != "ok" or c.speedup <= 1.0)
def _ci(c: Confirmation) -> str: return f"{c.speedup:.3f}x [{c.speedup_low:.3f}, {c.speedup_high:.3f}]"


def default_path(study: Study) -> pathlib.Path: return production_dir() / f"{production_key(study.model_name)}.toml"


def render(s: Session, study: Study, t: Trial, why: str, url: str) -> str:
  """The production file: a header (study, trial, figures, device, environment, code) and the config as TOML."""
  e, base = store.estimates(s, study).get(t.config_hash), store.estimates(s, study).get(study.baseline_hash)
  m, env, code = t.metrics or {}, t.environment, t.git_state
  fig = f"{interval(e)} tok/s over {e.n} measurements" if e else f"{t.tok_s:.2f} tok/s"
  lines = [f"structsearch production config: study {study.name!r}, trial {t.number}, {why}",
           f"model {study.model_name}: {study.model_path} ({study.model_bytes / 1e6:.1f} MB, {study.layers} blocks)", None,
           f"measured: {fig}" + (f", baseline {base.median:.2f} tok/s ({e.median / base.median:.3f}x)" if e and base else "")
           + f", {m.get('kernels_per_token', '?')} kernels/token, {m.get('bytes_per_token', 0) / 1e6:.1f} MB/token",
           f"device: {study.device_name or study.device} ({study.device})"]
  if env: lines.append(f"environment: tinygrad {env.tinygrad_version}, python {env.python}, {env.host}, {env.platform}")
  if code: lines.append(f"code: git {code.commit[:12]} ({code.branch or 'detached'}{', dirty' if code.dirty else ''})")
  lines.append(f"storage {hide_password(url)}; exported {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
  head = "".join(f"{sha_line(study.model_sha256)}\n" if x is None else f"# {x}\n" for x in lines)
  return head + StructureConfig.from_json(t.config_json).to_toml()


def commit(path: pathlib.Path, message: str, branch: str) -> tuple[str, str, str]:
  """Commit the file at path on a new branch (from HEAD) of the repository holding it, through a private index so the user's
  index, working tree and current branch stay as they are; returns (commit, branch, diff)."""
  try: repo = git.Repo(path.parent, search_parent_directories=True)
  except (git.InvalidGitRepositoryError, git.NoSuchPathError): raise ValueError(f"--commit: {path} is not inside a git repository") from None
  with repo, tempfile.TemporaryDirectory() as tmp:
    rel = path.resolve().relative_to(pathlib.Path(repo.working_tree_dir).resolve())
    names = {h.name for h in repo.heads}
    name = next(n for i in range(1, 1000) if (n := branch if i == 1 else f"{branch}-{i}") not in names)
    env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
    try:
      parent = ["-p", repo.head.commit.hexsha] if repo.head.is_valid() else []
      if parent: repo.git.read_tree(parent[1], env=env)
      repo.git.add("--force", str(rel), env=env)
      sha = repo.git.commit_tree(repo.git.write_tree(env=env), *parent, "-m", message, env=env)
      repo.git.branch(name, sha)
      diff = repo.git.show("--format=", "--no-color", sha)
    except git.GitCommandError as e: raise ValueError(f"--commit: git failed: {(e.stderr or str(e)).strip().splitlines()[-1]}") from None
  return sha, name, diff


def export(s: Session, study: Study, url: str, which: str | None, unconfirmed: bool, to: str | None, do_commit: bool) -> tuple[pathlib.Path, str]:
  """Write (and with do_commit commit) the chosen config; returns its path and a line saying what was written."""
  t, why = choose(s, study, which, unconfirmed)
  path = pathlib.Path(to).expanduser() if to else default_path(study)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(render(s, study, t, why, url))
  sha = branch = diff = None
  if do_commit:
    est = store.estimates(s, study)
    e, base = est.get(t.config_hash), est.get(study.baseline_hash)
    measured = f"; measured {e.median / base.median:.3f}x the baseline" if e and base else ""
    message = f"structsearch: export study {study.name}, trial {t.number}: {why}{measured}, on {study.device_name or study.device}"
    sha, branch, diff = commit(path, message, "structsearch/" + re.sub(r"[^A-Za-z0-9._-]+", "-", study.name) + f"-trial{t.number}")
  store.add_export(s, study, t, str(path.resolve()), sha, branch, diff)
  return path, f"wrote {path}: trial {t.number} of {study.name}, {why}" + (f"; committed {sha[:12]} on branch {branch}" if sha else "")
