"""The `model` command and the loading errors: one clear line and a non-zero exit for bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from model.gguf_file import GGUFError, GGUFFile
from model.registry import ModelNotFound, resolve
from model.structure import DEFAULT_BARRIERS, ConfigError, StructureConfig


def run_model(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "model", *args], capture_output=True, text=True, timeout=600, env=env)


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("model: error: "), r.stderr
  for n in needles: assert n in lines[0], lines[0]


def test_missing_file(tmp_path) -> None:
  one_line_error(run_model("bench", "--model", str(tmp_path / "nope.gguf")), "no GGUF file")


def test_corrupt_file(tmp_path) -> None:
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"not a gguf at all" * 100)
  one_line_error(run_model("info", "--model", str(bad)), "not a readable GGUF")


def test_truncated_file_names_the_tensor(gguf_file, tmp_path) -> None:
  src = open(gguf_file("tiny", "q4_0"), "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(src[:len(src) - 5000])
  with pytest.raises(GGUFError,
                     match=r"tensor \S+ \(\w+\) ends at byte \d+ but the file has \d+ bytes: the file is truncated"):
    GGUFFile(cut)


def test_unsupported_type_names_tensor_and_type(tmp_path) -> None:
  path = tmp_path / "q5_0.gguf"
  w = GGUFWriter(str(path), "deepseek2")
  w.add_tensor("blk.0.attn_q_a.weight", np.zeros((2, 22), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q5_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(GGUFError, match="blk.0.attn_q_a.weight has type Q5_0, which is not supported"):
    GGUFFile(path)


def test_unknown_model_and_missing_real_file(tmp_path, monkeypatch) -> None:
  monkeypatch.setenv("STRUCTSEARCH_MODELS", str(tmp_path / "models.toml"))
  with pytest.raises(ModelNotFound, match="unknown model 'llama-9000'"): resolve("llama-9000")
  no_file = r"model 'glm-4.7-flash' has no file: download the real GGUF \(https://.*model synth --preset glm-4.7-flash"
  with pytest.raises(ModelNotFound, match=no_file): resolve("glm")
  (tmp_path / "models.toml").write_text(f'[models]\nglm = "{tmp_path / "missing.gguf"}"\n')
  with pytest.raises(ModelNotFound, match="maps glm to .*missing.gguf, which does not exist"): resolve("glm-4.7-flash")


def test_configured_model_resolves(gguf_file, tmp_path, monkeypatch) -> None:
  path = gguf_file("tiny", "q4_0")
  monkeypatch.setenv("STRUCTSEARCH_MODELS", str(tmp_path / "models.toml"))
  (tmp_path / "models.toml").write_text(f'[models]\ndeepseek-v2-lite = "{path}"\n')
  assert str(resolve("ds2-lite")) == path


def test_config_validation(tmp_path) -> None:
  with pytest.raises(ConfigError, match="topk='bubble' is not allowed; choose one of: pairwise, sort, argmax"):
    StructureConfig(topk="bubble")
  with pytest.raises(ConfigError, match="unknown field"): StructureConfig.from_json('{"topkk": "sort"}')
  with pytest.raises(ConfigError, match="barriers point"): StructureConfig(barriers={"nowhere": "contiguous"})
  cfg = StructureConfig(topk="sort", backends={"Q4_0:expert": "fp16_cache"}, barriers={"kv_a": "realize"})
  assert StructureConfig.from_json(cfg.to_json()) == cfg == StructureConfig.from_toml(cfg.to_toml())
  assert cfg.barriers == DEFAULT_BARRIERS | {"kv_a": "realize"}  # the points a config does not name keep their defaults
  bad = tmp_path / "bad.json"
  bad.write_text('{"beam": 3}')
  one_line_error(run_model("bench", "--model", "tiny", "--config", str(bad)), "beam=3 is not allowed")


def test_synth_run_and_bench(tmp_path) -> None:
  out = tmp_path / "tiny2.gguf"
  r = run_model("synth", "--preset", "tiny", "--layers", "2", "--quant", "q4_k_m", "--out", str(out))
  assert r.returncode == 0, r.stderr
  r = run_model("run", "--model", str(out), "--prompt", "Hello world", "-n", "6", "--max-context", "64")
  assert r.returncode == 0, r.stderr
  assert "[6 tokens in" in r.stderr or "tokens in" in r.stderr
  r = run_model("bench", "--model", str(out), "-n", "4", "--rounds", "1", "--prompt", "8", "--json")
  assert r.returncode == 0, r.stderr
  d = json.loads(r.stdout.strip().splitlines()[-1])
  assert d["tok_s"] > 0 and d["kernels_per_token"] > 0 and d["layers"] == 2 and len(d["tokens"]) == 4
