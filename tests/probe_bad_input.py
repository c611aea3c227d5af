"""Every bad input issue 60 names, tried as a user would: `python tests/probe_bad_input.py MODEL.gguf` (a synthetic tiny
model; tests/test_probe.py runs it). Each must end with no traceback, a non-zero exit code and one error line, having
created nothing and lost nothing: no new file in the working folder, the cache or the storage, and an existing study's
database byte for byte as it was. Prints one line per probe and exits 1 when any fails.

Each probe is `python -m search ...` in a process of its own, forked from this one with search's modules imported
already (search_process): an interpreter's start and those imports, a second or two, paid once instead of per probe.
Importing them here creates nothing (checked); the probe runs the module `python -m search` runs, in its own folder and
environment, and its end is the interpreter's own."""
from __future__ import annotations

import gc
import hashlib
import importlib
import os
import pathlib
import runpy
import shutil
import subprocess
import sys
import tempfile

import gguf


def patched(src: str, dst: pathlib.Path, change) -> str:
  """A copy of the GGUF file src with change(reader) applied to its header in place."""
  shutil.copy(src, dst)
  change(gguf.GGUFReader(dst, "r+"))
  return str(dst)


def set_field(key: str, value: int):
  def change(r: gguf.GGUFReader) -> None:
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
  return change


def wrong_arch(r: gguf.GGUFReader) -> None:
  f = r.fields["general.architecture"]
  f.parts[f.data[0]][:] = list(b"deepseek3")


def zero_dim(r: gguf.GGUFReader) -> None:
  t = r.tensors[0]
  t.field.parts[3][0] = 0  # the tensor's first dimension (parts: name length, name, n_dims, dims, type, offset)


def snapshot(*dirs: pathlib.Path) -> dict[str, str]:
  return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


def search_process(argv: list[str], cwd: pathlib.Path, env: dict[str, str], logs: pathlib.Path
                   ) -> subprocess.CompletedProcess:
  """`python -m search ARGV` in cwd with env, as a process of its own: a fork of this one (where search's modules may be
  imported already) that runs search's __main__ as `python -m` does (sys.argv, sys.path[0] the folder it runs in), its
  stdout and stderr in files in logs (outside the folders the probes watch). Whatever ends it (SystemExit, an exception
  left uncaught, the module's end) ends the interpreter as it ends `python -m search`: nothing of this script catches it
  on the way up (main() has no handler), and the interpreter's own end prints the traceback, joins the threads, runs the
  exit functions and closes what is still open (a SQLite connection removes its -wal file)."""
  out, err = logs / "stdout", logs / "stderr"
  # this process's objects out of the child's garbage collections: they would touch (and so copy) every page of it, at
  # its end too, for objects it cannot free anyway (held by the modules it ends with)
  gc.freeze()
  sys.stdout.flush(), sys.stderr.flush()
  if (pid := os.fork()) == 0:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
      f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
      os.dup2(f, fd)
      os.close(f)
    sys.argv, sys.path[0] = ["search", *argv], os.getcwd()
    runpy.run_module("search", run_name="__main__", alter_sys=True)
    sys.exit(0)  # its __main__ ended: exit code 0, as the interpreter's
  code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
  return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def main(model: str) -> int:
  work = pathlib.Path(tempfile.mkdtemp(prefix="probe-"))
  cache, home, run, logs = work / "cache", work / "home", work / "run", work / "logs"
  for d in (cache, home, run, logs): d.mkdir()
  env = {**os.environ, "STRUCTSEARCH_CACHE": str(cache), "STRUCTSEARCH_HOME": str(home), "COLUMNS": "200"}
  bad = work / "bad"
  bad.mkdir()
  models = {name: patched(model, bad / f"{name}.gguf", change) for name, change in
            (("arch", wrong_arch), ("heads", set_field("deepseek2.attention.head_count", 0)), ("dim", zero_dim))}
  (afile := work / "afile").write_text("x")
  url = f"sqlite:///{run / 'existing.db'}"
  fast = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0"]
  new = ["start", "--model", model, "--study", "n", "--storage", f"sqlite:///{run / 'new.db'}", "--trials", "1"]
  probes = {
    "report --out a file": ["report", "--study", "e", "--storage", url, "--out", str(afile)],
    "report --out /proc": ["report", "--study", "e", "--storage", url, "--out", "/proc"],
    "report --out under /proc": ["report", "--study", "e", "--storage", url, "--out", "/proc/report"],
    "a GGUF of another architecture": [*new[:2], models["arch"], *new[3:], *fast],
    "a GGUF with 0 heads": [*new[:2], models["heads"], *new[3:], *fast],
    "a GGUF with a zero dimension": [*new[:2], models["dim"], *new[3:], *fast],
    "--device CPU:7": [*new, *fast[2:], "--device", "CPU:7"],
    "--heartbeat inf": [*new, *fast, "--heartbeat", "inf"],
    "--heartbeat nan": [*new, *fast, "--heartbeat", "nan"],
    "--rounds 1000000": [*new, *fast[:5], "--rounds", "1000000"],
    "a corrupt sha256.json": [*new, *fast],
    "a corrupt bandwidth.json": [*new, *fast],
  }
  (ro := work / "ro").mkdir()  # a read-only folder, where root may mount one (root writes into any other)
  if os.geteuid() == 0 and not subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)],
                                              capture_output=True).returncode:
    probes["report --out a read-only folder"] = ["report", "--study", "e", "--storage", url, "--out", str(ro / "r")]
  # the probes' processes are forks of this one: it imports the modules of their subcommands once, in their environment
  # (what a module reads from it at import, such as the console's width, is theirs), and that creates nothing
  os.environ.update(env)
  from search.cli import COMMANDS
  for name, _, module in COMMANDS:
    if any(argv[0] == name for argv in probes.values()): importlib.import_module(module)
  if made := snapshot(run, cache, home): raise SystemExit(f"probe: importing search's modules created {sorted(made)}")
  # an existing study, made with fake trials where the tests inject them, to report on and not to lose
  ok = subprocess.run([sys.executable, "-m", "search", "start", "--model", model, "--study", "e", "--storage", url,
                       "--trials", "1", *fast], cwd=run, env=env, capture_output=True, text=True)
  if ok.returncode: raise SystemExit(f"probe: the study to probe could not be made: {ok.stdout}{ok.stderr}")
  failed = 0
  for what, argv in probes.items():
    for f in ("sha256.json", "bandwidth.json"): (cache / f).unlink(missing_ok=True)
    if what.startswith("a corrupt"): (cache / what.split()[-1]).write_text("{not json" if "sha" in what else '{"x": 1}')
    before = snapshot(run, cache, home)
    p = search_process(argv, run, env, logs)
    out, errors = p.stdout + p.stderr, [ln for ln in p.stderr.splitlines() if "error:" in ln]
    wrong = ("a traceback" if "Traceback" in out else "exit code 0" if p.returncode == 0
             else f"{len(errors)} error lines" if len(errors) != 1
             else "something created or changed" if snapshot(run, cache, home) != before else "")
    failed += bool(wrong)
    print(f"{'FAIL' if wrong else 'ok  '} {what}: {wrong or errors[0]}", flush=True)
    if wrong: print(out, flush=True)
  if ro.is_mount(): subprocess.run(["umount", str(ro)])
  shutil.rmtree(work, ignore_errors=True)
  return 1 if failed else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1]))
