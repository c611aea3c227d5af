"""Every bad input issue 60 names, tried as a user would: `python tests/probe_bad_input.py MODEL.gguf` (a synthetic tiny
model; tests/test_probe.py runs it). Each must end with no traceback, a non-zero exit code and one error line, having
created nothing and lost nothing: no new file in the working folder, the cache or the storage, and an existing study's
database byte for byte as it was. Prints one line per probe and exits 1 when any fails."""
from __future__ import annotations

import hashlib
import os
import pathlib
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


def main(model: str) -> int:
  work = pathlib.Path(tempfile.mkdtemp(prefix="probe-"))
  cache, home, run = work / "cache", work / "home", work / "run"
  for d in (cache, home, run): d.mkdir()
  env = {**os.environ, "STRUCTSEARCH_CACHE": str(cache), "STRUCTSEARCH_HOME": str(home), "COLUMNS": "200"}
  bad = work / "bad"
  bad.mkdir()
  models = {name: patched(model, bad / f"{name}.gguf", change) for name, change in
            (("arch", wrong_arch), ("heads", set_field("deepseek2.attention.head_count", 0)), ("dim", zero_dim))}
  (afile := work / "afile").write_text("x")
  url = f"sqlite:///{run / 'existing.db'}"
  fast = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0"]
  # an existing study, made with fake trials where the tests inject them, to report on and not to lose
  ok = subprocess.run([sys.executable, "-m", "search", "start", "--model", model, "--study", "e", "--storage", url,
                       "--trials", "1", *fast], cwd=run, env=env, capture_output=True, text=True)
  if ok.returncode: raise SystemExit(f"probe: the study to probe could not be made: {ok.stdout}{ok.stderr}")
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
  failed = 0
  for what, argv in probes.items():
    for f in ("sha256.json", "bandwidth.json"): (cache / f).unlink(missing_ok=True)
    if what.startswith("a corrupt"): (cache / what.split()[-1]).write_text("{not json" if "sha" in what else '{"x": 1}')
    before = snapshot(run, cache, home)
    p = subprocess.run([sys.executable, "-m", "search", *argv], cwd=run, env=env, capture_output=True, text=True)
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
