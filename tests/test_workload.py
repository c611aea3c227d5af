"""The workload a trial measures (model/workload.py): decode at a context, the cache filled from the prompt's rows
(model/bench.py fill_context) and checked there by the gate against a reference at the same depth, whose size does not
grow with it; a timed prompt's prefill figures; the memory a workload takes and the refusal of one that cannot run; the
note of a production config chosen under another workload. Trials of the tiny model on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from evaluator.gate import Reference
from evaluator.runner import Evaluator
from model.production import read, workload_note
from model.structure import StructureConfig
from model.workload import Memory, Workload

DEPTH = 128  # past the positions attention_split_dropped leaves out (tests/inject/trialfakes.py DROPPED: 64..127)


@pytest.fixture(scope="module")
def evs(gguf_file) -> dict[int, Evaluator]:
  """Evaluators of the tiny model at the default workload (decode right after the 32-token prompt) and at DEPTH, their
  references made before any fault is injected."""
  out = {c: Evaluator.for_model(gguf_file("tiny", "q4_0"), "CPU", n=8, rounds=1, prefill=False, timeout=300, context=c)
         for c in (0, DEPTH)}
  for e in out.values(): e.reference("full")
  return out


def test_the_fill_is_what_the_model_writes_for_the_prompt_again(gguf_file) -> None:
  """Block 0's key of a token depends on no earlier token: filled from an 8-token prompt to 24 positions, its cache is
  the one a prefill of the prompt three times writes, up to the cache's fp16 rounding (on a YaRN-scaled file: the RoPE
  part is rotated to each position, its magnitude kept); no two filled rows of a deeper block are alike."""
  from model.bench import bench_prompt, fill_context
  from model.deepseek2 import Transformer
  from model.generate import Generator
  from model.gguf_file import GGUFFile
  m = Transformer(GGUFFile(gguf_file("tiny-lite", "q4_0")), max_context=64)
  gen, prompt = Generator(m), bench_prompt(m.hp.vocab, 8)
  gen.prefill(prompt * 3)
  real = gen.cache_rows(24)
  m.reset()
  gen.prefill(prompt)
  fill_context(m, 8, 24)
  filled = gen.cache_rows(24)
  assert np.abs(filled[0] - real[0]).max() <= 2e-3 * np.abs(real[0]).max()
  assert np.array_equal(filled[:, :8], real[:, :8]) and not np.abs(filled[1] - real[1]).max() < 1e-2
  rows = filled[1].round(3)
  assert len({r.tobytes() for r in rows}) == 24


def test_the_context_changes_what_is_measured(evs) -> None:
  """At a context of DEPTH, decode starts at position DEPTH over a cache filled to it: more bytes a step read, a larger
  KV cache, the check's positions there; the reference keeps the prompt's 32 rows either way."""
  shallow, deep = (evs[c].run({}) for c in (0, DEPTH))
  assert shallow.ok and deep.ok, (shallow.error, deep.error)
  assert (shallow.metrics["context"], deep.metrics["context"]) == (32, DEPTH)
  assert deep.metrics["bytes_per_token"] > shallow.metrics["bytes_per_token"]
  assert deep.spec["max_context"] == 256 and deep.spec["context"] == DEPTH and shallow.spec["context"] == 0
  assert deep.check["ok"] and int(deep.check["worst_stage"].rsplit(" ", 1)[1]) >= DEPTH
  paths = [evs[c].reference_path("full", StructureConfig()) for c in (0, DEPTH)]
  refs = [Reference.load(p) for p in paths]
  assert [(r.depth, r.cache.shape[1]) for r in refs] == [(32, 32), (DEPTH, 32)] and "-d128-" in paths[1]
  assert refs[0].cache.nbytes == refs[1].cache.nbytes


def test_the_gate_catches_a_wrong_attention_at_depth(evs, inject) -> None:
  """An attention that leaves out the cache positions 64..127 computes the shallow workload right (it never reaches
  them) and is rejected at DEPTH, in every block's attention, at the check's positions there."""
  inject("attention_split_dropped")
  shallow, deep = (evs[c].run({}) for c in (0, DEPTH))
  assert shallow.ok, shallow.error
  assert deep.status == "wrong_output" and deep.check["failed_at"][0] >= DEPTH, (deep.status, deep.error)
  assert {s.split()[-1] for s in deep.check["failed_stages"]} == {"attention"} and "attention" in deep.error


def test_an_8bit_cache_passes_the_gate_at_depth(evs) -> None:
  """kv_dtype=q8_0 at DEPTH: checked against its twin (the baseline with the same cache), the attention at the q8
  class's tolerance; the timed run continues from the twin's cache, filled to the depth, so its tokens are the checked
  run's; its distance from the exact reference (a float16 cache) is measured, not zero and within that tolerance."""
  r = evs[DEPTH].run({"kv_dtype": "q8_0"})
  assert r.ok, r.error
  c = r.check
  assert c["attention_tolerance"] > c["tolerance"] and c["tokens_compared"] >= 1 and c["tokens_differ"] == 0
  assert 0 < c["accuracy"]["max_rel_err"] < c["attention_tolerance"] and r.metrics["context"] == DEPTH


def test_a_prompt_is_prefilled_and_timed(gguf_file) -> None:
  ev = Evaluator.for_model(gguf_file("tiny", "q4_0"), "CPU", n=8, rounds=1, prefill=True, timeout=300, prompt_len=48)
  r = ev.run({}, check=False)
  assert r.ok, r.error
  m = r.metrics
  assert (m["prompt"], m["context"]) == (48, 48) and m["ttft_s"] > 0
  assert m["prefill_tok_s"] == pytest.approx(48 / m["ttft_s"]) and "prefill_s" in r.phases


def test_memory_and_refusals(gguf_file) -> None:
  path = gguf_file("tiny", "q4_0")
  work = Workload(context=1024)
  mem = Memory.of(path, work, 32)
  # q8_0: 160 values a position in 5 blocks of 32, each 32 int8 codes and a float16 scale
  assert mem.kv_cache == {"float16": 3 * 1056 * 160 * 2, "float32": 3 * 1056 * 160 * 4, "q8_0": 3 * 1056 * 5 * 34}
  assert mem.peak() == mem.weights + mem.kv_cache["float16"] and mem.weights > 1e6
  assert mem.refusal(work, 32, "CPU", 10**12) is None
  assert mem.refusal(work, 32, "CPU", mem.peak() - 1).startswith("context 1024, prompt 32 needs weights")
  long = Workload(context=2040)
  assert Memory.of(path, long, 32).refusal(long, 32, "CPU", None) == (
    "context 2040, prompt 32 needs 2072 positions, past the model's context length of 2048")
  with pytest.raises(ValueError, match="shorter than the prompt of 32 tokens"): Workload(context=16)


def test_a_production_config_records_its_workload(tmp_path) -> None:
  p = tmp_path / "x.toml"
  p.write_text("# structsearch production config: study 's'\n# workload: context=4096 prompt=32\ntopk = \"sort\"\n")
  chosen = read(p).workload
  assert chosen == Workload(32, 4096) and Workload.read(Workload(32, 4096).line()) == chosen
  assert workload_note(chosen, chosen) is None and workload_note(None, Workload()) is None
  assert workload_note(chosen, Workload()) == (
    "note: this config was chosen at context 4096, prompt 32; this run is at context 32, prompt 32 (decode right after "
    "it): its speed there was not what chose it (search start --context/--prompt measures a study at this workload)")
  (q := tmp_path / "old.toml").write_text("# exported before workloads\ntopk = \"sort\"\n")
  assert read(q).workload == Workload()
