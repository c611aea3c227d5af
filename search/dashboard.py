"""The web dashboard: optuna-dashboard on a study's storage (history, parameter importance, parallel coordinates, the
Pareto front of two-objective studies), read as the study ranks its configs (search/ranked.py: a trial's value is its
config's ranked figure, its user attributes the estimate and confirmation, so its "Best Trial" is the leaderboard's
first), its parameter importance the report's (search/effects.py, what it rests on as the study's user attribute), and
the per-trial artifacts it shows beside Optuna's figures: the trial's metrics (the `search show` document), the git diff
of the code that ran it, its per-kernel profile when it has one.

It only reads: optuna-dashboard's UI offers to create, rename and delete studies, write notes and upload artifacts, and
any page a browser opens could send those requests to a local port. So the server answers GET and HEAD alone, only for
the address it is bound to and pages of its own origin (`read_only`), and its storage refuses every write
(`RankedStorage`). Studies are managed from the command line.

Artifacts live in an Optuna file-system artifact store: beside a SQLite database (`structsearch.db` ->
`structsearch.db-artifacts/`), under $STRUCTSEARCH_HOME/artifacts/<host>-<port>-<database>/ for a server database, or
where --artifacts says (name a shared directory when workers on several machines write to one PostgreSQL study)."""
from __future__ import annotations

import argparse
import csv
import io
import json
import pathlib
import socket
import tempfile
import warnings
from collections.abc import Callable

import optuna
from bottle import Bottle, response
from optuna.artifacts import FileSystemArtifactStore, get_all_artifact_meta, upload_artifact
from optuna.trial import FrozenTrial
from sqlalchemy import make_url

from db import store
from db.engine import hide_password, open_db, session
from db.models import Trial
from model.production import home
from search import effects
from search.events import Event
from search.formats import console
from search.options import add_storage, port_number
from search.ranked import RankedStorage
from search.show import trial_doc
from search.study import StudyMismatch, storage


def artifact_dir(url: str, given: str | None = None) -> pathlib.Path:
  if given: return pathlib.Path(given).expanduser()
  u = make_url(url)
  if u.get_backend_name() == "sqlite": return pathlib.Path(f"{u.database}-artifacts")
  return home() / "artifacts" / f"{u.host}-{u.port or 5432}-{u.database}"


def artifact_store(url: str, given: str | None = None) -> FileSystemArtifactStore:
  (d := artifact_dir(url, given)).mkdir(parents=True, exist_ok=True)
  return FileSystemArtifactStore(str(d))


class Uploader:
  """Listens to a worker (search/events.py): each finished trial's metrics (the `search show` document), git diff and
  profile uploaded to the artifact store, while Optuna still lets the trial change (a worker tells of a trial's end
  before it returns the trial's value); `refresh` rewrites them once their figures have changed: when the worker has
  measured configs again (the baseline between trials changes every speedup), at the end of a run, after a
  confirmation."""

  def __init__(self, url: str, study: str, artifacts: FileSystemArtifactStore):
    self.engine, self.storage, self.study, self.artifacts = open_db(url, create=False), storage(url), study, artifacts
    self.study_id = self.storage.get_study_id_from_name(study)

  def __call__(self, e: Event) -> None:
    if e.kind == "measured":
      self.refresh()
      return
    if e.kind != "end" or e.row is None or e.row.state in ("running", "interrupted"): return
    with session(self.engine) as s:
      t = s.get(Trial, e.row.id)
      files = _files(trial_doc(s, store.get_study(s, self.study), t))
    trial = self.storage.get_trial(self.storage.get_trial_id_from_study_id_trial_number(self.study_id, t.number))
    for name, text in files.items(): self._upload(trial, name, text)

  def refresh(self) -> None:
    """Rewrite the files of every trial that has some with its current figures (estimate, confirmation, profile), in
    place: the same artifact, so the dashboard's links stay. A file a trial did not have (a profile made by a
    confirmation) is attached to the study, as Optuna lets a finished trial change no more."""
    with session(self.engine) as s:
      st = store.get_study(s, self.study)
      done = [t for t in store.trials(s, st) if t.state not in ("running", "interrupted")]
      files = {t.number: _files(trial_doc(s, st, t)) for t in done}
    study = optuna.load_study(study_name=self.study, storage=self.storage)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
      on_study = {m.filename: m for m in get_all_artifact_meta(study, storage=self.storage)}
      for number, texts in files.items():
        trial = self.storage.get_trial(self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number))
        if not (metas := {m.filename: m for m in get_all_artifact_meta(trial, storage=self.storage)}): continue
        for name, text in texts.items():
          if (m := metas.get(name) or on_study.get(name)) is not None:
            self.artifacts.write(m.artifact_id, io.BytesIO(text.encode()))
          else: self._upload(study, name, text)

  def _upload(self, to: optuna.Study | FrozenTrial, name: str, text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
      warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
      (p := pathlib.Path(tmp) / name).write_text(text)
      upload_artifact(artifact_store=self.artifacts, file_path=str(p), study_or_trial=to, storage=self.storage)


def _files(doc: dict) -> dict[str, str]:
  """A trial's artifact files by name, from its `search show` document: its metrics (the document but the git state),
  its git diff, its per-kernel profile (CSV) where it has one."""
  n, git = doc["trial"], doc.pop("git")
  files = {f"trial-{n}-metrics.json": json.dumps(doc, indent=1, default=str)}
  if git:
    head = f"# commit {git['commit']} ({git['branch'] or 'detached'}{', dirty' if git['dirty'] else ''})"
    files[f"trial-{n}-git.diff"] = f"{head}\n{git['diff']}"
  if doc["profile"]:
    buf = io.StringIO()
    (w := csv.DictWriter(buf, list(doc["profile"][0]))).writeheader()
    w.writerows(doc["profile"])
    files[f"trial-{n}-profile.csv"] = buf.getvalue()
  return files


def app(url: str, artifacts: str | None = None) -> Bottle:
  """optuna-dashboard's WSGI application on the study's ranked storage and artifact store, its parameter importance
  search/effects.py's (optuna-dashboard's own ranks knobs that never varied and another figure than the report's)."""
  from optuna_dashboard import wsgi
  st = RankedStorage(url)
  web = wsgi(st, artifact_store=artifact_store(url, artifacts))

  def importances(study_id: int) -> dict:
    try: name, n = st.get_study_name_from_id(study_id), len(st.get_study_directions(study_id))
    except KeyError:
      response.status = 404
      return {"reason": f"study_id={study_id} is not found"}
    with session(st.ours) as s:
      if (study := store.get_study(s, name)) is None: return {"param_importances": [[] for _ in range(n)]}
      imp = [effects.importance(effects.points(s, study, i)) for i in range(n)]
    return {"param_importances": [[{"name": k, "importance": v, "distribution": "CategoricalDistribution"}
                                   for k, v in by.items()] for by in imp]}
  web.route("/api/studies/<study_id:int>/param_importances", "GET", importances)  # in place of optuna-dashboard's
  return web


READS = ("GET", "HEAD")
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def _host_names(host: str) -> set[str] | None:
  """The names a request's Host may give for a server bound to `host`: None (any) for a wildcard address."""
  if host in ("", "0.0.0.0", "::"): return None
  name = f"[{host}]" if ":" in host else host
  return {name, *LOOPBACK} if name in LOOPBACK else {name}


def read_only(web: Callable, host: str, port: int) -> Callable:
  """The WSGI application `web` answering reads alone: a method other than GET or HEAD gets 405, a Host header that is
  not the bound address (a DNS-rebinding page's) or an Origin other than the server's own gets 403."""
  names = _host_names(host)
  def refuse(start_response: Callable, status: str, why: str) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Allow", ", ".join(READS))])
    return [f"{why}\n".encode()]
  def guarded(environ: dict, start_response: Callable):
    method, given = environ.get("REQUEST_METHOD", ""), environ.get("HTTP_HOST", "")
    if method not in READS:
      return refuse(start_response, "405 Method Not Allowed", f"the dashboard is read-only: {method} is refused; "
                    "manage studies with `search delete` and `search rename`")
    name, _, given_port = given.rpartition(":") if given.rpartition(":")[2].isdigit() else (given, "", "")
    if names is not None and (name.lower() not in names or (given_port and int(given_port) != port)):
      return refuse(start_response, "403 Forbidden", f"host {given!r} is not this dashboard's address")
    origin = environ.get("HTTP_ORIGIN")
    if origin is not None and origin.split("://", 1)[-1].lower() != given.lower():
      return refuse(start_response, "403 Forbidden", f"origin {origin!r} is not this dashboard's")
    return web(environ, start_response)
  return guarded


def serve(url: str, study: str | None, host: str, port: int, artifacts: str | None, say=print) -> None:
  """Serve optuna-dashboard on url, read-only (`read_only`), until interrupted, printing the address (of the study's
  page when one is named) once the address is bound; a port in use or a host that does not resolve is one line
  (RuntimeError)."""
  from wsgiref.simple_server import WSGIServer, make_server

  st = RankedStorage(url)
  path = ""
  if study is not None:
    try: path = f"dashboard/studies/{st.get_study_id_from_name(study)}"
    except KeyError: raise StudyMismatch(f"no study named {study!r} in {hide_password(url)}") from None
  server_class = type("Server6", (WSGIServer,), {"address_family": socket.AF_INET6}) if ":" in host else WSGIServer
  try: server = make_server(host, port, app(url, artifacts), server_class=server_class)
  except OSError as e: raise RuntimeError(f"cannot serve the dashboard on {host}:{port}: {e.strerror or e}") from None
  server.set_app(read_only(server.get_app(), host, server.server_port))
  say(f"dashboard of {hide_password(url)} at http://{host}:{server.server_port}/{path} (artifacts in "
      f"{artifact_dir(url, artifacts)}); Ctrl-C stops it")
  with server:
    try: server.serve_forever()
    except KeyboardInterrupt: pass


def refresh(url: str, name: str, artifacts: str | None) -> None:
  """Rewrite the files of the study's trials with their figures (after a confirmation, or other workers'
  measurements)."""
  Uploader(url, name, artifact_store(url, artifacts)).refresh()


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_storage(p)
  p.add_argument("--study", help="print the address of this study's page")
  p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
  p.add_argument("--port", type=port_number, default=8080, help="port to serve on (default 8080; 0: any free port)")
  p.add_argument("--artifacts", help="the artifact directory the workers wrote (default: beside a SQLite database)")


def run(args: argparse.Namespace) -> None:
  serve(args.storage, args.study, args.host, args.port, args.artifacts, say=console.print)
