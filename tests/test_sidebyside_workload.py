"""benchmarks/sidebyside.sh's workloads on the CPU: DEPTHS runs each config at each context beside llama-bench's decode
at that depth (-d), PROMPTS each prompt's timed prefill beside llama-bench -p P -n 0, in the same call; every figure a
results.jsonl line that carries its workload (a stand-in for llama-bench, as tests/test_sidebyside.py's)."""
import json
import os
import pathlib
import stat
import subprocess
import sys

from benchmarks import render

ROOT = pathlib.Path(__file__).resolve().parent.parent
# one llama-bench test per depth of -d (decode) or per length of -p (prompt: -n 0), its tok/s made from them
STAND_IN = f"""#!{sys.executable}
import json, sys
a = sys.argv[1:]
if a == ["--help"]: sys.exit(0)
opt = dict(zip(a[::2], a[1::2]))
assert a[0] == "-m" and a[-8:] == "-r 5 -ngl 99 -fa 1 -o json".split(), a
test = lambda p, n, d, ts: {{"build_commit": "x", "build_number": 0, "backends": "CPU", "n_gpu_layers": 99,
                             "flash_attn": 1, "n_prompt": p, "n_gen": n, "n_depth": d,
                             "avg_ns": 10**9 * max(p, 1) // ts, "stddev_ns": 0, "avg_ts": ts, "stddev_ts": 1.0,
                             "samples_ts": [ts] * 5}}
if opt["-n"] == "0": out = [test(int(p), 0, 0, 1000.0 + int(p)) for p in opt["-p"].split(",")]
else: out = [test(0, int(opt["-n"]), int(d), 300.0 - int(d)) for d in opt.get("-d", "0").split(",")]
print(json.dumps(out))
"""


def sidebyside(tmp_path, **env: str) -> subprocess.CompletedProcess:
  """benchmarks/sidebyside.sh on the tiny model's baseline on the CPU, beside the llama-bench stand-in, with `env`."""
  (bench := tmp_path / "llama-bench").write_text(STAND_IN)
  bench.chmod(bench.stat().st_mode | stat.S_IEXEC)
  env = os.environ | {"MODELS": "tiny", "DEVICE": "CPU", "CONFIGS": "baseline", "N": "4", "ROUNDS": "1",
                      "WORK": str(tmp_path), "OUT": str(tmp_path / "out"), "LLAMA_BENCH": str(bench),
                      "PYTHON": sys.executable} | env
  r = subprocess.run(["bash", "benchmarks/sidebyside.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  return r


def test_depths_and_prompts_beside_llama_cpp(tmp_path):
  sidebyside(tmp_path, DEPTHS="96", PROMPTS="40")
  lines = render.load(tmp_path / "out" / "results.jsonl")
  assert {i: m for i, x in enumerate(lines) if (m := render.missing(x))} == {}
  llama = [(x["kind"], x.get("context"), x.get("prompt")) for x in lines if x["config"] == "llama.cpp"]
  assert llama == [("llama_cpp", 0, None), ("llama_cpp", 96, None), ("prefill", None, 40)]
  decode = {x["context"]: x for x in lines if x["kind"] == "decode"}
  assert set(decode) == {32, 96, 40} and all(x["quant"] == "Q4_0" for x in decode.values())
  # llama-bench at the same depth: d = 0 beside decode right after the prompt, d = 96 beside --context 96
  assert (decode[32]["llama_cpp_tok_s"], decode[96]["llama_cpp_tok_s"]) == (300.0, 204.0)
  assert decode[96]["bytes_per_token"] > decode[32]["bytes_per_token"] and decode[96]["prompt"] == 32
  assert "--context 96" in decode[96]["command"] and "-d 0,96" in llama_cmd(lines)
  (pre,) = [x for x in lines if x["kind"] == "prefill" and x["config"] == "baseline"]
  assert pre["prompt"] == 40 and pre["prefill_tok_s"] > 0 and pre["ttft_s"] > 0
  assert pre["llama_cpp_prefill_tok_s"] == 1040
  gates = [x for x in lines if x["kind"] == "gate"]
  assert len(gates) == 3 and all(g["check_ok"] for g in gates)
  assert json.loads((tmp_path / "out" / "trials.jsonl").read_text().splitlines()[0])[2]["n_prompt"] == 40


def llama_cmd(lines) -> str: return next(x["command"] for x in lines if x["kind"] == "llama_cpp")


def test_workloads_picks_each_configs_runs(tmp_path):
  """WORKLOADS names the runs of each config: a prompt alone runs only its prefill (no decode after a 32-token prompt),
  and with no default run the default workload's references are not made (each trial makes its own at its depth)."""
  r = sidebyside(tmp_path, PROMPTS="40", WORKLOADS="p40")
  assert "references for" not in r.stdout
  lines = render.load(tmp_path / "out" / "results.jsonl")
  runs = [(x["kind"], x["context"]) for x in lines if x["kind"] in ("decode", "trial")]
  assert runs == [("decode", 40), ("trial", 40)]
  assert [x["prompt"] for x in lines if x["kind"] == "prefill" and x["config"] == "baseline"] == [40]
