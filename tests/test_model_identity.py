"""A model file swapped under a study is caught: the cached SHA-256 is keyed on the file's identity (size, inode, mtime,
ctime and a sampled content hash), and a worker checks the identity before every trial."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

from sqlalchemy import create_engine, text

from model.filehash import file_sha256

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0", "--heartbeat", "0.5"]


def swap_same_size(path: pathlib.Path) -> None:
  """Rewrite the file in place with other bytes of the same size, its mtime set back: what the old cache key missed."""
  st = path.stat()
  data = bytearray(path.read_bytes())
  data[len(data) // 2 + 3] ^= 0xFF
  path.write_bytes(bytes(data))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_the_cached_hash_sees_a_same_size_file_with_its_mtime_set_back(tmp_path) -> None:
  (p := tmp_path / "m.gguf").write_bytes(bytes(range(256)) * 4096)
  before = file_sha256(p)
  swap_same_size(p)
  assert file_sha256(p) != before


def test_a_model_file_swapped_mid_study_stops_the_worker(gguf_file, tmp_path, inject) -> None:
  shutil.copy(gguf_file("tiny", "q4_0"), model := tmp_path / "m.gguf")
  url = f"sqlite:///{tmp_path / 's.db'}"
  argv = ["start", "--model", str(model), "--study", "s", "--storage", url, "--trials", "8", *FAST]
  p = subprocess.Popen([sys.executable, "-m", "search", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=inject(seconds=1.0))
  engine, running = create_engine(url), []
  deadline = time.time() + 90
  while not running and time.time() < deadline and p.poll() is None:
    try:
      with engine.connect() as c: running = list(c.execute(text("SELECT number FROM ss_trial WHERE state='running' AND "
                                                                "number >= 1")))
    except Exception: pass  # noqa: BLE001 - the tables may not exist yet
    time.sleep(0.1)
  assert running, p.communicate()[0]
  swap_same_size(model)
  out = p.communicate(timeout=120)[0]
  assert p.returncode not in (0, None) and "Traceback" not in out, out
  assert "the model file changed during the study" in out.splitlines()[-1], out
  with engine.connect() as c: numbers = [n for (n,) in c.execute(text("SELECT number FROM ss_trial"))]
  engine.dispose()
  assert max(numbers) == running[0][0], numbers  # no trial of the other file
