"""Shared fixtures: synthetic GGUF files, written once per test session."""
from __future__ import annotations

import fcntl
import importlib.util
import os
import pathlib
import uuid

import pytest

# tinygrad checks every graph it schedules and every kernel it lowers against its own UOp spec (SPEC=1, its default,
# which trials keep): a check of tinygrad, not of this project, that costs a sixth of the CPU time of the tests' model
# builds; off for this process and the trial processes it starts
os.environ.setdefault("SPEC", "0")
# tinygrad lowers the kernels a realize needs in a pool of processes (PARALLEL, one per core): with two test workers
# on two cores the pool only adds its start and the pickling of every program (an eighth of the wall time of
# tests/test_space.py and tests/test_evaluator.py); lowered in the process itself here and in the processes it starts
# (tests/test_programs.py runs the pool)
os.environ.setdefault("PARALLEL", "0")
import tinygrad.helpers  # noqa: E402
from sqlalchemy import create_engine, make_url

from model import programs
from model.registry import cache_dir
from model.synth import write_synthetic

# tinygrad's allocators keep freed buffers for reuse (LRU): in a trial process that builds one model it is what we want,
# in a test worker that builds hundreds of models of many sizes the cache grows until the machine runs out of memory
os.environ["LRU"] = "0"  # for the trial processes tests start
tinygrad.helpers.LRU.value = 0
# the tests read the commands' tables and sentences piped, where they follow COLUMNS: wide, as without it (xdist's
# workers get COLUMNS=80), in this process and those it starts; tests of narrow output set their own
os.environ["COLUMNS"] = "200"

# NVIDIA's runtime compiler from the nvidia-cuda-nvrtc-cu12 wheel (a dev dependency), for tests/test_native.py's compile
# check; tinygrad looks for it once, when its CUDA support is first imported, so this comes before any test module
if not os.environ.get("NVRTC_PATH") and (spec := importlib.util.find_spec(
  "nvidia.cuda_nvrtc")) and spec.submodule_search_locations:
  if lib := next(pathlib.Path(*spec.submodule_search_locations).glob("lib/libnvrtc.so*"), None):
    os.environ["NVRTC_PATH"] = str(lib)


def _run_dir(tmp_path_factory) -> pathlib.Path:
  """This run's directory, which its xdist workers share (each has a base temp of its own inside it)."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory) -> None:
  """References, bandwidth figures, device locks, synthesised models and production configs of this test worker only;
  the programs tinygrad generates, of the whole run."""
  os.environ["STRUCTSEARCH_CACHE"] = str(cache := tmp_path_factory.mktemp("cache"))
  os.environ["STRUCTSEARCH_HOME"] = str(tmp_path_factory.mktemp("home"))
  # the kernels both workers generate and those of the trial processes they start, in one file (as a study's trials)
  (cache / "programs.db").symlink_to(_run_dir(tmp_path_factory) / "programs.db")
  programs.use(str(cache_dir() / "programs.db"))


def _synthetic(tmp_path_factory, name: str, *args, **kw) -> str:
  """write_synthetic(path, *args, **kw) once per run: the first worker to ask writes the file, the other one waits for
  it (the GLM-width files take minutes and gigabytes)."""
  path = _run_dir(tmp_path_factory) / "synth" / name
  path.parent.mkdir(exist_ok=True)
  with open(f"{path}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists(): os.replace(write_synthetic(path.with_suffix(".part"), *args, **kw), path)
  return str(path)


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory):
  cache: dict[tuple[str, str, bool], str] = {}
  def get(preset: str, quant: str, legacy: bool = False) -> str:
    if (key := (preset, quant, legacy)) not in cache:
      name = f"{preset}-{quant}{'-legacy' if legacy else ''}.gguf"
      cache[key] = _synthetic(tmp_path_factory, name, preset, quant=quant, legacy_kv_b=legacy)
    return cache[key]
  return get


@pytest.fixture(scope="session")
def glm_file(tmp_path_factory):
  """mix -> a 2-layer GLM-4.7-Flash-shaped file in that quant mix, written on first use."""
  paths: dict[str, str] = {}
  def get(mix: str) -> str:
    if mix not in paths: paths[mix] = _synthetic(tmp_path_factory, f"glm2-{mix}.gguf", "glm", layers=2, quant=mix)
    return paths[mix]
  return get


@pytest.fixture
def inject(monkeypatch):
  """inject(fault="", **fake): the faults and fake trials of tests/inject/trialfakes.py in the processes this test
  starts (trial processes, `search` processes), through tests/inject/sitecustomize.py on their PYTHONPATH."""
  from inject.trialfakes import env
  def set_env(fault: str = "", **fake) -> dict[str, str]:
    for k in ("STRUCTSEARCH_FAULT", "STRUCTSEARCH_FAKE_TRIALS"): monkeypatch.delenv(k, raising=False)
    new = env(fault, **fake)
    for k in ("PYTHONPATH", "STRUCTSEARCH_FAULT", "STRUCTSEARCH_FAKE_TRIALS"):
      if k in new: monkeypatch.setenv(k, new[k])
    return new
  return set_env


@pytest.fixture
def pg_url():
  """A fresh database on the test PostgreSQL server ($STRUCTSEARCH_TEST_PG, started by .ci/postgres.sh), dropped
  afterwards."""
  pg = os.environ.get("STRUCTSEARCH_TEST_PG")
  if not pg:
    if os.environ.get("CI"):
      pytest.fail("STRUCTSEARCH_TEST_PG is not set: .ci/run sources .ci/postgres.sh to start PostgreSQL")
    pytest.skip("PostgreSQL: set STRUCTSEARCH_TEST_PG (`. .ci/postgres.sh` starts a server and sets it)")
  name = f"ss_test_{uuid.uuid4().hex[:12]}"
  admin = create_engine(pg, isolation_level="AUTOCOMMIT")
  with admin.connect() as c: c.exec_driver_sql(f'CREATE DATABASE "{name}"')
  yield make_url(pg).set(database=name).render_as_string(hide_password=False)
  with admin.connect() as c: c.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
  admin.dispose()


# the test files by their time in a full run, longest first (2 cores, session 37: 2114 s of tests over 2 workers),
# those of 10 s or more: with --no-loadscope-reorder (Makefile) xdist hands whole files to its workers in this order,
# so the longest start first and the short ones fill in at the end (its own order, by number of tests, started some
# of the longest last)
LONGEST = ("test_space.py", "test_evaluator.py", "test_native_model.py", "test_space_glm.py", "test_portable.py",
           "test_gate.py", "test_faults.py", "test_dsl.py", "test_space_glm_mixes.py", "test_sidebyside.py",
           "test_model.py", "test_search.py", "test_truth.py", "test_verdict.py", "test_review.py", "test_native.py",
           "test_faults_db.py", "test_prefill.py", "test_grouped_native.py", "test_synth.py", "test_programs.py",
           "test_architecture.py", "test_sidebyside_workload.py", "test_dsl_kquant.py", "test_scaleout.py",
           "test_bad_input.py", "test_workload.py", "test_ladder.py", "test_study_script.py",
           "test_prefill_attention.py", "test_kv_cache.py", "test_dsl_attention.py", "test_cli.py",
           "test_reference.py", "test_db.py", "test_delete.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  rank = {name: i for i, name in enumerate(LONGEST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST)))
