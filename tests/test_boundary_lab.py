"""benchmarks/boundary_lab.py without a GPU: nvcc and the lab's executable stood in for by canned runs. Its options
reach the commands, and its lines are results.jsonl lines of kind `boundary` (every field the kind needs)."""
import json
import subprocess
import sys

from benchmarks import boundary_lab, render

LAB = [{"variant": "graph-full", "width": 768, "blocks": 16, "steps": 7, "reps": 3, "us": 1.4, "us_min": 1.3,
        "us_max": 1.5, "equal": True, "gpu": "NVIDIA H200"},
       {"variant": "flags", "width": 768, "blocks": 16, "steps": 7, "reps": 3, "us": 1.5, "us_min": 1.4,
        "us_max": 1.6, "equal": False, "gpu": "NVIDIA H200"}]


def test_options_reach_the_build_and_the_run_and_lines_are_results_lines(tmp_path, monkeypatch, capsys):
  calls = []
  def run(cmd, **kw):
    calls.append(cmd)
    return subprocess.CompletedProcess(cmd, 0, stdout="".join(json.dumps(r) + "\n" for r in LAB) if kw else "")
  monkeypatch.setattr(boundary_lab.subprocess, "run", run)
  monkeypatch.delenv("LABEL", raising=False)
  out = tmp_path / "lab.jsonl"
  argv = ["boundary_lab.py", "--steps", "7", "--reps", "3", "--arch", "sm_100", "--json", str(out)]
  monkeypatch.setattr(sys, "argv", argv)
  boundary_lab.main()
  nvcc, lab = calls
  assert nvcc[0] == "nvcc" and "-arch=sm_100" in nvcc and nvcc[-1] == str(boundary_lab.SRC)
  assert lab[1:] == ["7", "3"] and lab[0] == nvcc[nvcc.index("-o") + 1]
  lines = [json.loads(x) for x in out.read_text().splitlines()]
  assert [render.missing(x) for x in lines] == [[], []]
  assert {x["kind"] for x in lines} == {"boundary"} and {x["device"] for x in lines} == {"NVIDIA H200 (CUDA)"}
  assert [x["variant"] for x in lines] == ["graph-full", "flags"] and "gpu" not in lines[0]
  assert lines[0]["command"] == "python " + " ".join(argv)
  printed = capsys.readouterr().out.splitlines()
  assert "DIFFERS" not in printed[0] and "DIFFERS from graph-full" in printed[1]
