"""Export to production: a study's chosen config written where `model run` and `model bench` load it
(model/production.py), with where it comes from in its header; with --commit, committed by gitpython on a new branch of
the repository holding the file (the user's checkout, index and current branch are left as they are), and that commit
recorded with the study."""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import sys
import tempfile
from dataclasses import astuple

import git
from sqlalchemy.orm import Session

from db import store
from db.engine import hide_password, open_db, session
from db.models import Confirmation, Study, Trial
from db.store import interval
from evaluator.gate import accuracy_text
from model.production import model_key as production_key
from model.production import production_dir, sha_line
from model.structure import StructureConfig
from search.formats import console
from search.leaderboard import (
  MIN_PAIRS,
  PRECISION,
  Floor,
  accuracy,
  add_floor,
  floor,
  leaderboard,
  precision,
  study_named,
)
from search.options import add_storage
from search.show import find_trial
from search.study import study_workload


def choose(s: Session, study: Study, which: str | None, unconfirmed: bool, force: bool = False,
           fl: Floor | None = None) -> tuple[Trial, str]:
  """The trial to export (`which`: a number or "baseline"; None: the leaderboard's first where it is the confirmed
  winner, or with `unconfirmed` the first config of the leaderboard that is not the baseline nor confirmed slower than
  it) and a label saying what it is. Refused (ValueError): a study with no finished trial; a trial that did not measure
  ok (wrong output, failed, pruned, interrupted); the baseline itself; a config whose confirmation says it is not faster
  than the baseline (whatever `unconfirmed` says); an unconfirmed one without `unconfirmed`, and with it one whose
  estimate is not above the baseline's interval, unless `force`; one below the accuracy floor (BelowFloor: the study's,
  raised by `fl`). A confirmation counts with at least MIN_PAIRS A/B pairs."""
  trials = store.trials(s, study)
  if not any(t.state not in ("running", "interrupted") for t in trials):
    raise ValueError(f"study {study.name!r} has no finished trial")
  doc, conf = leaderboard(s, study), {c.config_hash: c for c in store.confirmations(s, study)}
  rows = {r["config_hash"]: r for r in doc["rows"]}
  if which is not None:
    t = find_trial(s, study, which)
    src = t.reused_from or t
    if src.state != "ok":
      why = f" ({src.failure_class})" if src.failure_class and src.failure_class != src.state else ""
      raise ValueError(f"trial {t.number} is {src.state}{why}: only a config measured ok can go to production")
  elif doc["winner"] is not None: t = find_trial(s, study, str(doc["winner"]))
  elif not unconfirmed:
    raise ValueError(f"study {study.name!r} has no confirmed winner (`search confirm --study {study.name}`; "
                     "--unconfirmed exports the best measured config)")
  else:
    cands = [r for r in doc["rows"] if r["config_hash"] != study.baseline_hash and not r["below_floor"]
             and not _slower(conf.get(r["config_hash"]))]
    if not cands: raise ValueError(f"study {study.name!r} has no measured config but the baseline and those confirmed "
                                   "slower than it or below its accuracy floor")
    t = find_trial(s, study, str(cands[0]["trial"]))  # the leaderboard's first
  if t.config_hash == study.baseline_hash:
    raise ValueError(f"trial {t.number} is the baseline config: production without a config is the baseline already")
  r, fl = rows[t.config_hash], floor(s, study).tighter(*(astuple(fl) if fl else (None, None)))
  if why := fl.fails(r["accuracy"], r["precision"]):
    raise BelowFloor(f"trial {t.number} ({r['precision']}, {accuracy_text(r['accuracy'])}) is below the accuracy floor "
                     f"({fl.text()}: {why}); not exported")
  c = conf.get(t.config_hash)
  if _slower(c):
    raise ValueError(f"trial {t.number} was confirmed {'not faster than' if c.status == 'ok' else 'failing against'} "
                     f"the baseline ({c.status}: {_ci(c)} over {c.pairs} A/B pairs); not exported")
  if c is not None and c.pairs >= MIN_PAIRS and c.speedup_low > 1.0:
    return (t,
            f"{'confirmed winner' if doc['winner'] == t.number else 'confirmed faster than the baseline'}: speedup "
            f"{_ci(c)} over {c.pairs} A/B pairs")
  if not unconfirmed:
    state = ("not confirmed" if c is None
             else f"confirmed at {_ci(c)} over {c.pairs} A/B pairs, which does not show it faster")
    raise ValueError(f"trial {t.number} is {state} (`search confirm --study {study.name}`, or export it with "
                     "--unconfirmed)")
  return t, _unconfirmed(s, study, t, c, force)


class BelowFloor(ValueError):
  """A config below the accuracy floor asked to go to production: refused, exit code 1."""


def _unconfirmed(s: Session, study: Study, t: Trial, c: Confirmation | None, force: bool) -> str:
  """The label of a config exported without a confirmation that shows it faster: its estimate against the baseline's.
  Refused (ValueError) where that estimate is not above the baseline's interval (its median where the study has no noise
  figure yet), unless `force`."""
  est = store.estimates(s, study)
  e, base = est.get(t.config_hash), est.get(study.baseline_hash)
  weak = f"inconclusive confirmation {_ci(c)} over {c.pairs} A/B pair{'s' * (c.pairs != 1)}; " if c is not None else ""
  if e is None or base is None: figures, above = "the baseline has no measurement to compare with", False
  else:
    figures = (f"estimated {e.median / base.median:.3f}x the baseline ({interval(e)} tok/s over {e.n} measurements, "
               f"the baseline {interval(base)} over {base.n})")
    above = e.median > (base.high if base.high is not None else base.median)
  if not above and not force:
    raise ValueError(f"trial {t.number} is not confirmed and its estimate is not above the baseline's interval "
                     f"({weak}{figures}): it may be slower; `search confirm --study {study.name}` measures it, --force "
                     "exports it anyway")
  return (
      f"UNCONFIRMED{'' if above else ', FORCED'}: "
          f"{weak}{figures}{', above its interval' if above else ', NOT above its interval'}")


def _slower(c: Confirmation | None) -> bool: return c is not None and (c.status != "ok" or c.speedup <= 1.0)
def _ci(c: Confirmation) -> str: return f"{c.speedup:.3f}x [{c.speedup_low:.3f}, {c.speedup_high:.3f}]"


def default_path(study: Study) -> pathlib.Path: return production_dir() / f"{production_key(study.model_name)}.toml"


def render(s: Session, study: Study, t: Trial, why: str, url: str) -> str:
  """The production file: a header (study, trial, the model file's hash, the workload it was chosen under, figures,
  device, environment, code) and the config as TOML."""
  e, base = store.estimates(s, study).get(t.config_hash), store.estimates(s, study).get(study.baseline_hash)
  m, env, code = t.metrics or {}, t.environment, t.git_state
  fig = f"{interval(e)} tok/s over {e.n} measurements" if e else f"{t.tok_s:.2f} tok/s"
  lines = [f"structsearch production config: study {study.name!r}, trial {t.number}, {why}",
           f"model {study.model_name}: {study.model_path} ({study.model_bytes / 1e6:.1f} MB, {study.layers} blocks)",
           None, study_workload(s, study.name).line().removeprefix("# "),
           f"measured: {fig}" + (f", baseline {base.median:.2f} tok/s ({e.median / base.median:.3f}x)" if e
                                       and base else "")
           + f", {m.get('kernels_per_token', '?')} kernels/token, {m.get('bytes_per_token', 0) / 1e6:.1f} MB/token",
           f"device: {study.device_name or study.device} ({study.device})",
           f"precision: {(p := precision(StructureConfig.from_json(t.config_json)))} ({PRECISION[p]})",
           f"accuracy against the exact reference: {accuracy_text(accuracy(t))}"]
  if env: lines.append(f"environment: tinygrad {env.tinygrad_version}, python {env.python}, {env.host}, {env.platform}")
  if code: lines.append(f"code: git {code.commit[:12]} ({code.branch or 'detached'}{', dirty' if code.dirty else ''})")
  lines.append(f"storage {hide_password(url)}; exported {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
  head = "".join(f"{sha_line(study.model_sha256)}\n" if x is None else f"# {x}\n" for x in lines)
  return head + StructureConfig.from_json(t.config_json).to_toml()


def repository(path: pathlib.Path) -> pathlib.Path:
  """The working tree of the git repository that holds path (which need not exist yet); ValueError outside every one."""
  start = next(p for p in path.absolute().parents if p.is_dir())
  try:
    with git.Repo(start, search_parent_directories=True) as repo: root = repo.working_tree_dir
  except (git.InvalidGitRepositoryError, git.NoSuchPathError): root = None
  if root is None or not path.resolve().is_relative_to(pathlib.Path(root).resolve()):
    raise ValueError(f"--commit: {path} is not inside a git repository")
  return pathlib.Path(root).resolve()


def commit(root: pathlib.Path, rel: pathlib.Path, source: pathlib.Path, message: str,
           branch: str) -> tuple[str, str, str]:
  """Commit the content of `source` as the file `rel` on a new branch (from HEAD) of the repository at root, through a
  private index, touching no file: the user's index, working tree and current branch stay as they are; returns (commit,
  branch, diff)."""
  with git.Repo(root) as repo, tempfile.TemporaryDirectory() as tmp:
    names = {h.name for h in repo.heads}
    name = next(n for i in range(1, 1000) if (n := branch if i == 1 else f"{branch}-{i}") not in names)
    env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
    try:
      parent = ["-p", repo.head.commit.hexsha] if repo.head.is_valid() else []
      if parent: repo.git.read_tree(parent[1], env=env)
      blob = repo.git.hash_object("-w", f"--path={rel.as_posix()}", str(source))
      repo.git.update_index("--add", "--cacheinfo", f"100644,{blob},{rel.as_posix()}", env=env)
      sha = repo.git.commit_tree(repo.git.write_tree(env=env), *parent, "-m", message, env=env)
      repo.git.branch(name, sha)
      diff = repo.git.show("--format=", "--no-color", sha)
    except git.GitCommandError as e:
      raise ValueError(f"--commit: git failed: {(e.stderr or str(e)).strip().splitlines()[-1]}") from None
  return sha, name, diff


def _staged(path: pathlib.Path, text: str) -> pathlib.Path:
  """text in a new temporary file beside path (its directories made), to be renamed onto path: every reason path cannot
  be written (a directory, a directory that is a file, no permission, a read-only or special file system) is one line
  here."""
  if path.is_dir(): raise ValueError(f"cannot write {path}: it is a directory (name the .toml file to write)")
  if (up := next((p for p in path.parents if p.exists()), None)) is not None and not up.is_dir():
    raise ValueError(f"cannot write {path}: {up} is a file, not a directory")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False) as f:
      tmp = pathlib.Path(f.name)
      try: f.write(text)
      except OSError:
        tmp.unlink()
        raise
  except OSError as e: raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
  return tmp


def export(s: Session, study: Study, url: str, which: str | None, unconfirmed: bool, to: str | None, do_commit: bool,
           force: bool = False, fl: Floor | None = None) -> tuple[pathlib.Path, str]:
  """Write (and with do_commit commit) the chosen config; returns its path and a line saying what was written (its
  precision class and accuracy among it). Nothing is written where anything fails: the file appears once it is
  committed."""
  t, why = choose(s, study, which, unconfirmed, force, fl)
  path = pathlib.Path(to).expanduser() if to else default_path(study)
  text, root = render(s, study, t, why, url), repository(path) if do_commit else None
  tmp = _staged(path, text)
  sha = branch = diff = None
  try:
    if root is not None:
      est = store.estimates(s, study)
      e, base = est.get(t.config_hash), est.get(study.baseline_hash)
      measured = f"; measured {e.median / base.median:.3f}x the baseline" if e and base else ""
      message = (f"structsearch: export study {study.name}, trial {t.number}: {why}{measured}, on "
                 f"{study.device_name or study.device}")
      branch_name = "structsearch/" + re.sub(r"[^A-Za-z0-9._-]+", "-", study.name) + f"-trial{t.number}"
      sha, branch, diff = commit(root, path.resolve().relative_to(root), tmp, message, branch_name)
    os.replace(tmp, path)
  finally: tmp.unlink(missing_ok=True)
  store.add_export(s, study, t, str(path.resolve()), sha, branch, diff)
  acc = f"precision {precision(StructureConfig.from_json(t.config_json))}, accuracy {accuracy_text(accuracy(t))}"
  return (path, f"wrote {path}: trial {t.number} of {study.name}, {why}; {acc}"
          + (f"; committed {sha[:12]} on branch {branch}" if sha else ""))


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p)
  p.add_argument("--study", required=True, help="the study whose config to export")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--trial", help="this trial's config (a number)")
  which.add_argument("--best", action="store_true", help="the confirmed winner (the default)")
  p.add_argument("--to", "--out", dest="to",
                 help="default: $STRUCTSEARCH_HOME/production/<model>.toml, where `model run`/`model bench` look")
  p.add_argument("--unconfirmed", action="store_true",
                 help="allow a config that no A/B confirmation has shown faster than the baseline")
  p.add_argument("--force", action="store_true",
                 help="with --unconfirmed: export a config whose estimate is not above the baseline's interval")
  p.add_argument("--commit", action="store_true",
                 help="commit the file on a new branch of the git repository it lives in")
  add_floor(p, "refuse a config below it, on top of the study's own floor")


def run(args: argparse.Namespace) -> None:
  try:
    with session(open_db(args.storage, create=False)) as s:
      _, line = export(s, study_named(s, args.storage, args.study), args.storage, None if args.best else args.trial,
                       args.unconfirmed, args.to, args.commit, args.force, Floor(args.min_top1, args.max_kl))
  except BelowFloor as e:
    print(f"search: error: {e}", file=sys.stderr)
    sys.exit(1)
  console.print(line, highlight=False)
