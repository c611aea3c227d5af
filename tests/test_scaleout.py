"""Scaling out on the CPU: device names mapped to physical devices (the lock's key and the model a study is bound to),
one lock per card, a worker on a card of another model refused, and three workers of one study on PostgreSQL started by
`search start --devices`. nvidia-smi is a script of the test's; trials are fakes (tests/inject/)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from inject.trialfakes import install_fake_trials
from sqlalchemy import create_engine, text

from evaluator import devices
from evaluator.devices import physical
from evaluator.lock import DeviceLock
from search.cli import main as search_main

FAST = ["--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed", "0"]


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
  """gpus: model names by index -> an nvidia-smi on PATH that lists them, UUIDs GPU-0000..."""
  def make(*gpus: str) -> None:
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir(exist_ok=True)
    script.write_text("#!/bin/sh\n" + "".join(f"echo '{name}, GPU-000{i}-aaaa'\n" for i, name in enumerate(gpus)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    devices.nvidia_gpus.cache_clear()
  yield make
  devices.nvidia_gpus.cache_clear()


def test_device_names_map_to_physical_devices(nvidia_smi, monkeypatch) -> None:
  nvidia_smi("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  h100, a100 = devices.PhysicalDevice("nvidia-GPU-0000-aaaa", "NVIDIA H100 80GB HBM3"), devices.PhysicalDevice(
    "nvidia-GPU-0001-aaaa", "NVIDIA A100-SXM4-40GB")
  assert physical("CUDA") == physical("CUDA:0") == physical("NV") == physical("nv:0") == h100
  assert physical("CUDA:1") == physical("NV:1") == a100
  # CUDA sees one card: its CUDA:0 is the host's second (NV counts them all)
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
  assert physical("CUDA").key == physical("NV:1").key == "nvidia-GPU-0001-aaaa" and physical(
    "NV:0").key == "nvidia-GPU-0000-aaaa"
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0000")
  assert physical("CUDA:0").name == "NVIDIA H100 80GB HBM3"
  nvidia_smi()  # no nvidia-smi answer: the index is the key
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  assert (physical("CUDA:1") == devices.PhysicalDevice("nvidia-1", "")
          and physical("CUDA").key == physical("NV:0").key == "nvidia-0")
  assert physical("CPU").key == physical("CPU:1").key == "CPU" and physical("AMD:1").key == "AMD-1"


def test_one_lock_per_card(nvidia_smi, tmp_path, monkeypatch) -> None:
  nvidia_smi("NVIDIA H100", "NVIDIA H100")
  monkeypatch.setenv("STRUCTSEARCH_CACHE", str(tmp_path))
  waited, entered = [], threading.Event()
  def other(name: str) -> None:
    with DeviceLock(name, on_wait=waited.append): entered.set()
  with DeviceLock("CUDA"):
    with DeviceLock("CUDA:1", on_wait=lambda m: pytest.fail(m)): pass  # another card: no wait
    t = threading.Thread(target=other, args=("NV",))
    t.start()
    time.sleep(0.5)
    assert not entered.is_set() and len(waited) == 1 and "waiting for device NV: pid" in waited[
      0] and "on CUDA" in waited[0]
  t.join(10)
  assert entered.is_set()


def test_a_worker_on_another_device_model_is_refused(nvidia_smi, gguf_file, tmp_path, monkeypatch, capsys) -> None:
  nvidia_smi("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")
  install_fake_trials(monkeypatch.setattr)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", gguf_file("tiny", "q4_0"), "--study", "g", "--storage", url, "--device", "CUDA:0",
                "--trials", "1", *FAST) == 0
  assert search("start", "--study", "g", "--storage", url, "--device", "CUDA:1", "--trials", "2") == 2
  err = capsys.readouterr().err
  assert "study 'g' is measured on NVIDIA H100 80GB HBM3; CUDA:1 here is NVIDIA A100-SXM4-40GB" in err
  # another device kind, another space
  assert search("start", "--study", "g", "--storage", url, "--device", "NV", "--trials", "2") == 2
  # the same card by another name
  assert search("start", "--study", "g", "--storage", url, "--device", "CUDA", "--trials", "2") == 0


def test_three_workers_of_one_study_on_postgresql(gguf_file, pg_url, inject, tmp_path) -> None:
  env = inject(seconds=1.5)
  p = subprocess.run([sys.executable, "-m", "search", "start", "--model", gguf_file("tiny", "q4_0"), "--study", "three",
                      "--storage", pg_url, "--devices", "CUDA:0,CUDA:1,CUDA:2", "--trials", "9", "--heartbeat", "1",
                      *FAST], env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stdout + p.stderr
  e = create_engine(pg_url)
  with e.connect() as c: trials = list(c.execute(text("SELECT worker, state, metrics FROM ss_trial ORDER BY number")))
  e.dispose()
  assert len(trials) >= 9 and {s for _, s, _ in trials} <= {"ok", "reused"}
  by_worker: dict[str, list] = {}
  for w, _, m in trials: by_worker.setdefault(w, []).append(m.get("span"))
  assert len(by_worker) == 3, by_worker.keys()
  spans = sorted(s for ss in by_worker.values() for s in ss if s)
  # trials on different cards ran at the same time
  assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))


def search(*argv: str) -> int:
  try: search_main(list(argv))
  except SystemExit as e: return int(e.code or 0)
  return 0
