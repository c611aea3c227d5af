"""The ladder's proxy is judged, not assumed: both stages recorded for a sample of trials, their rank correlation
reported by `search status`, pruning only where the proxy predicts, no proxy stage with two objectives. Replay compares
samplers only on a densely measured study. Trials are fakes (tests/inject/) whose proxy predicts the full figure, or
does not."""
from __future__ import annotations

import optuna
import pytest
from inject.trialfakes import install_fake_trials

from db import store
from db.engine import open_db, session
from search.cli import main as search_main
from search.proxy import MIN_PAIRS, proxy_fit, spearman
from search.study import model_info
from space.knobs import knobs

FAST = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--fix", "beam=0", "--confirm", "0", "--seed",
        "0"]


def search(*argv: str) -> int:
  try: search_main(list(argv))
  except SystemExit as e: return int(e.code or 0)
  return 0


def trials(url: str, name: str) -> list:
  with session(open_db(url)) as s: return store.trials(s, store.get_study(s, name))


@pytest.fixture(scope="module")
def model(gguf_file) -> str: return gguf_file("tiny", "q4_0")


def test_spearman() -> None:
  assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == 1.0 and spearman([1, 2, 3], [3, 2, 1]) == -1.0
  # scipy.stats.spearmanr's figure and spearman([1, 1, 1], [1, 2, 3]) is None
  assert spearman([1, 2, 2, 3], [1, 3, 3, 2]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("proxy", ["predicts", "random"])
def test_the_proxy_prunes_only_where_it_predicts(model, tmp_path, monkeypatch, capsys, proxy) -> None:
  install_fake_trials(monkeypatch.setattr, seconds=0.01, proxy=proxy)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", model, "--study", "l", "--storage", url, "--trials", "16", "--block-layers", "2",
                *FAST) == 0
  ts = trials(url, "l")
  ladder = [(t.metrics or {}).get("ladder") for t in ts if t.state != "reused"]
  assert ladder[:MIN_PAIRS] == ["sample"] * MIN_PAIRS  # both stages, never pruned, until the proxy has been judged
  fit = proxy_fit(ts)
  assert fit.pairs >= MIN_PAIRS and 0 < fit.proxy_s < fit.total_s and fit.pays
  assert search("status", "--study", "l", "--storage", url) == 0
  out = capsys.readouterr().out
  assert f"Spearman rho {fit.rho:.2f} over {fit.pairs} sampled trials" in out and "of trial time" in out
  later = [t for t in ts[MIN_PAIRS:] if t.state != "reused" and t.metrics["ladder"] != "sample"]
  assert later
  if proxy == "predicts":
    assert fit.rho == pytest.approx(1.0) and fit.predicts and "prunes the bottom quarter" in out
    assert {t.metrics["ladder"] for t in later} == {"prune"} and all(t.block_tok_s for t in later)
  else:
    assert fit.rho < 0.7 and not fit.predicts and "does not predict" in out
    assert ({t.metrics["ladder"] for t in later} == {"full"}
            and not any(t.block_tok_s or t.state == "pruned" for t in later))


def test_a_proxy_that_cannot_pay_for_itself_is_skipped(model, tmp_path, monkeypatch, capsys) -> None:
  # the proxy stage costs half a full stage: pruning a quarter of the trials cannot pay for it
  install_fake_trials(monkeypatch.setattr, seconds=0.04, proxy_cost=0.5)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", model, "--study", "p", "--storage", url, "--trials", "6", "--block-layers", "2",
                *FAST) == 0
  ts = [t for t in trials(url, "p") if t.state != "reused"]
  # the baseline measures both stages, which shows the proxy's cost; the others run the full model only
  assert [t.metrics["ladder"] for t in ts] == ["sample"] + ["full"] * (len(ts) - 1) and len(ts) > 1
  assert ts[0].block_tok_s and not any(t.block_tok_s or "block_wall_s" in t.phases for t in ts[1:])
  fit = proxy_fit(ts)
  assert 0.25 <= fit.cost_ratio < 1 and not fit.pays
  assert search("status", "--study", "p", "--storage", url) == 0
  assert f"costs {fit.cost_ratio:.0%} of a full stage" in capsys.readouterr().out


def test_two_objectives_skip_the_proxy(model, tmp_path, monkeypatch) -> None:
  install_fake_trials(monkeypatch.setattr)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", model, "--study", "m", "--storage", url, "--trials", "3", "--block-layers", "2",
                "--objectives", "tok_s,peak_memory", *FAST) == 0
  ts = trials(url, "m")
  assert len(ts) == 3 and all(t.stage == "full" and t.block_tok_s is None
                              and "block_wall_s" not in t.phases for t in ts)


def test_replay_compares_samplers_only_on_a_dense_study(model, tmp_path, monkeypatch, capsys) -> None:
  install_fake_trials(monkeypatch.setattr)
  url = f"sqlite:///{tmp_path / 's.db'}"
  free = ("topk", "router_fp32")  # a 6-config sub-space, measured at random 18 times
  pins = [f"--fix={k.name}={k.default}" for k in knobs(model_info(model), "CPU") if k.name not in free]
  args = ["--device", "CPU", "--no-prefill", "-n", "6", "--rounds", "1", "--confirm", "0", "--seed", "0", "--sampler",
          "random"]
  assert search("start", "--model", model, "--study", "dense", "--storage", url, "--trials", "18", *args, *pins) == 0
  assert search("start", "--model", model, "--study", "sparse", "--storage", url, "--trials", "4", *FAST) == 0
  capsys.readouterr()
  assert search("replay", "--study", "sparse", "--storage", url, "--trials", "3", "--repeats", "1") == 2
  err = capsys.readouterr().err
  assert "study 'sparse' measured 4 of the" in err and "only on a study that measured at least 90% of its space" in err
  assert search("replay", "--study", "dense", "--storage", url, "--trials", "6", "--repeats", "2", "--sampler", "tpe",
                "--sampler", "random") == 0
  out = capsys.readouterr().out
  assert "replay of dense (measured 6 of 6 configs)" in out and "unmeasured proposals" in out
  study = optuna.load_study(study_name="dense", storage=url)
  assert {tuple(sorted(t.params)) for t in study.trials} == {tuple(sorted(free))}


def _trial(number: int, stage: str, phases: dict, start: float, end: float, search_s: float, worker: str = "h:1",
           state: str = "ok"):
  from datetime import UTC, datetime

  from db.models import Trial
  at = lambda s: datetime.fromtimestamp(1.7e9 + s, UTC)
  return Trial(number=number, state=state, stage=stage, phases=phases,
               metrics={"search_overhead_s": search_s, "ladder": "sample"}, config_json='{"beam": 2}', worker=worker,
               started_at=at(start), finished_at=at(end))


def test_cost_adds_phases_setup_search_and_projects() -> None:
  from search.cost import study_cost
  ts = [_trial(0, "full", {"wall_s": 50.0, "setup_s": 100.0, "load_s": 20.0, "check_s": 5.0, "block_wall_s": 10.0}, 0,
               161, 1.0),
        # 2 s after trial 0
        _trial(1, "full", {"wall_s": 40.0, "load_s": 10.0, "check_s": 4.0, "block_wall_s": 8.0}, 163, 212, 1.0),
        _trial(2, "block", {"wall_s": 9.0}, 212.5, 222, 0.5, state="pruned"),
        # reused: costs nothing, not counted
        _trial(3, "full", {"wall_s": 30.0}, 0, 31, 1.0, worker="h:2", state="reused")]
  from datetime import UTC, datetime

  from db.models import Measurement
  # a baseline repeat between 0 and 1
  repeat = Measurement(kind="repeat", wall_s=1.5, created_at=datetime.fromtimestamp(1.7e9 + 162, UTC))
  doc = study_cost(ts, n=100, measurements=[repeat])
  walls = [r["wall_s"] for r in doc["trials"]]
  assert [r["trial"] for r in doc["trials"]] == [0, 1, 2]  # `trial` as in every document (docs/json.md)
  assert (doc["n"] == 3 and walls == [161.0, 40.0 + 8 + 1 + 2, 9.0 + 0.5 + 0.5] and doc["setup_s"] == 100.0
          and doc["repeat_s"] == 1.5)
  assert doc["mean_trial_s"] == pytest.approx((sum(walls) - 100) / 3) and doc["projected_s"] == pytest.approx(
    100 + 100 * doc["mean_trial_s"])
  # in the trial, and the gap's rest after the repeat's 1.5 s
  assert doc["trials"][1]["search_s"] == pytest.approx(1 + 0.5)
  assert doc["search_share"] == pytest.approx((1 + 1.5 + 1) / sum(walls))
  assert doc["median"]["load_s"] == 15.0 and doc["block_stage"] == 3 and doc["full_stage"] == 2 and doc["trials"][0][
    "beam"] == 2


def test_cost_counts_a_reference_made_in_the_trial_as_setup() -> None:
  """A baseline trial makes its stages' references in its own processes (their reference phase): one-time setup, as a
  reference made in a process of its own is, not the stages' time; the trial's wall is still the sum of it all."""
  from search.cost import study_cost
  ts = [_trial(0, "full", {"wall_s": 50.0, "reference_s": 20.0, "setup_s": 1.0, "block_wall_s": 10.0,
                           "block_reference_s": 4.0, "block_setup_s": 2.0}, 0, 61, 0.0),
        _trial(1, "block", {"wall_s": 9.0, "reference_s": 3.0}, 61, 70, 0.0, state="pruned")]
  doc = study_cost(ts, n=10)
  a, b = doc["trials"]
  assert (a["setup_s"], a["block_s"], a["full_s"], a["wall_s"]) == (27.0, 6.0, 30.0, 63.0)
  assert (b["setup_s"], b["block_s"], b["full_s"], b["wall_s"]) == (3.0, 6.0, 0.0, 9.0)
  assert doc["setup_s"] == 30.0 and doc["mean_trial_s"] == pytest.approx((63 + 9 - 30) / 2)


def test_time_to_best_is_the_wall_time_to_the_first_trial_near_the_fastest() -> None:
  from search.cost import study_cost
  ts = [_trial(0, "full", {"wall_s": 50.0, "setup_s": 30.0}, 0, 80, 0.0),
        _trial(1, "full", {"wall_s": 20.0}, 80, 100, 0.0),
        _trial(2, "block", {"wall_s": 5.0}, 100, 105, 0.0, state="pruned"),
        _trial(3, "full", {"wall_s": 10.0}, 105, 115, 0.0),
        _trial(4, "full", {"wall_s": 10.0}, 115, 125, 0.0)]
  for t, v in zip(ts, (5.0, 90.0, None, 96.0, 100.0), strict=True): t.tok_s = v
  doc = study_cost(ts)
  # trial 3 is within 5% of trial 4's 100 tok/s; trial 1's 90 is not
  assert (doc["best_trial"], doc["best_tok_s"], doc["near_best_trial"]) == (4, 100.0, 3)
  assert doc["time_to_best_s"] == pytest.approx(80 + 20 + 5 + 10)
  ts[3].tok_s = 94.0
  assert study_cost(ts)["near_best_trial"] == 4 and study_cost(ts)["time_to_best_s"] == pytest.approx(125)
  assert study_cost(ts[2:3])["time_to_best_s"] is None


def test_search_cost_reads_a_study(model, tmp_path, monkeypatch, capsys) -> None:
  import json
  install_fake_trials(monkeypatch.setattr, seconds=0.05)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", model, "--study", "c", "--storage", url, "--trials", "4", "--block-layers", "2",
                *FAST) == 0
  capsys.readouterr()
  assert search("cost", "--study", "c", "--storage", url, "--format", "json", "--project", "50") == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["n"] == len([t for t in trials(url, "c") if t.state != "reused"]) and doc["projected_n"] == 50
  assert all(r["wall_s"] >= r["full_s"] >= 0.05 for r in doc["trials"] if r["stage"] == "full") and 0 <= doc[
    "search_share"] < 1
  assert search("cost", "--study", "c", "--storage", url) == 0
  out = capsys.readouterr().out
  assert "projected wall time of 200 trials" in out and f"time to best: {doc['time_to_best_s']:.0f} s" in out
  assert search("cost", "--study", "nope", "--storage", url) == 2


def test_record_study_lines_have_their_fields(model, tmp_path, monkeypatch) -> None:
  import json
  import subprocess
  import sys

  from benchmarks.record import study_lines
  from benchmarks.render import missing
  install_fake_trials(monkeypatch.setattr, seconds=0.02)
  url = f"sqlite:///{tmp_path / 's.db'}"
  assert search("start", "--model", model, "--study", "r", "--storage", url, "--trials", "3", "--block-layers", "2",
                *FAST) == 0
  assert search("confirm", "--study", "r", "--storage", url, "--top", "1", "--pairs", "2") == 0
  with session(open_db(url)) as s:  # as search confirm leaves a winner's profile (fake trials profile nothing)
    t = store.trials(s, store.get_study(s, "r"))[0]
    t.metrics = (t.metrics or {}) | {"gb_s": 50.0, "bandwidth_share": 0.5}
    t.profile = store.profile_rows([{"rank": 1, "name": "k1", "count": 3, "us_per_token": 30.0, "gb_s": 40.0,
                                     "share": 0.75}, {"rank": 2, "name": "k2", "count": 1, "us_per_token": 10.0,
                                                      "gb_s": None, "share": 0.25}])
  lines = study_lines(url, "r", "cpu", "tiny", "Q4_0", "test")
  prof = [x for x in lines if x["kind"] == "profile"]
  assert [(x["name"], x["bandwidth_share"]) for x in prof] == [("k1", 0.4), ("k2", None)] and prof[0]["study"] == "r"
  kinds = [x["kind"] for x in lines]
  assert kinds.count("trial") == len([t for t in trials(url, "r") if t.state != "reused"]) and kinds[-1] == "study"
  assert kinds.count("confirmation") == 1 and all(x["tok_s"] > 0 for x in lines if x["kind"] == "trial"
                                                  and x["status"] == "ok")
  assert all(not missing(x) for x in lines), [missing(x) for x in lines]
  assert lines[-1]["projected_n"] == 200 and lines[-1]["projected_s"] > 0
  assert 0 <= lines[-1]["time_to_best_s"] <= sum(x["wall_s"] for x in lines if x["kind"] == "trial") + 1
  assert lines[-1]["best_tok_s"] == max(x["tok_s"] for x in lines if x["kind"] == "trial" and "tok_s" in x)
  record = lambda study, *extra: subprocess.run([sys.executable, "benchmarks/record.py", "study", "--storage", url,
                                                 "--study", study, "--device", "d", "--model-name", "m", "--quant",
                                                 "Q4_0", "--command", "c", *extra], capture_output=True, text=True)
  noted = [json.loads(x) for x in record("r", "--note", "a first study").stdout.splitlines()]
  assert len(noted) == len(lines) and all(x["note"] == "a first study" for x in noted)
  assert not any("note" in x for x in map(json.loads, record("r").stdout.splitlines()))
  bad = record("nope")
  assert bad.returncode != 0 and "no study 'nope'" in bad.stderr


def test_a_re_measurement_runs_no_correctness_check() -> None:
  """A config measured again (the baseline between trials, a near-best one before the end) passed the gate already."""
  from types import SimpleNamespace

  from evaluator.result import TrialResult
  from model.structure import StructureConfig
  from search import noise
  calls = []
  def run(config, stage, check=True, on_wait=None):
    calls.append((stage, check))
    return TrialResult("killed", {}, error="stopped")
  ev = SimpleNamespace(stages=("block", "full"), run=run)
  assert (noise.measure(ev, None, None, StructureConfig(), "h", None, "again", lambda text: None) is False
          and calls == [("full", False)])
