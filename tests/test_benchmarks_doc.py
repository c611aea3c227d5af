"""docs/benchmarks.md is the rendering of its template and benchmarks/results.jsonl (nobody edits it by hand), every
line of results.jsonl has the fields of its kind, and the template's table language selects, orders and formats as
documented."""
import pytest

from benchmarks import render


def test_doc_is_the_rendering_of_results_jsonl():
  assert render.DOC.read_text() == render.render(render.TEMPLATE.read_text(), render.load()), \
    "docs/benchmarks.md differs from its rendering: edit docs/benchmarks.template.md or benchmarks/results.jsonl, " \
    "then run `python -m benchmarks.render`"


def test_every_line_has_the_fields_of_its_kind():
  lines = render.load()
  assert {x["kind"] for x in lines} <= set(render.REQUIRED)
  assert {i + 1: m for i, x in enumerate(lines) if (m := render.missing(x))} == {}


LINES = [
  {"kind": "decode", "config": "baseline", "layers": 4, "tok_s": 50.0, "bytes_per_token": 400e6, "device_bytes": 1.5e9},
  {"kind": "decode", "config": "fast", "layers": 4, "tok_s": 75.0, "bytes_per_token": 500e6, "note": "a|b",
   "llama_cpp_tok_s": 150.0},
  {"kind": "decode", "config": "deep", "layers": 47, "tok_s": 5.0, "bytes_per_token": 3e9},
  {"kind": "trial", "config": "baseline", "layers": 4, "wall_s": 30.0},
]
ROWS = ("| # | config | vs | MB | GB | note | vs llama |\n|---|---|---:|---:|---:|---|---:|\n"
        "| {rank} | {config} | {vs_baseline:.2f}x | {mb_per_token:.0f} | {device_gb:.1f} | {note} | {vs_llama:.1f} |\n")
BASE, FAST = "| 1 | baseline | 1.00x | 400 | 1.5 |  |  |", "| 2 | fast | 1.50x | 500 |  | a\\|b | 0.5 |"
DEEP = "| 3 | deep | 0.10x | 3000 |  |  |  |"


@pytest.mark.parametrize("opts, want", [
  # a cell whose fields a line lacks is empty; pipes in values are escaped
  ("where: kind=decode layers=4", [BASE, FAST]),
  ("where: kind=decode\nsort: -tok_s", [FAST.replace("2", "1", 1), BASE.replace("1", "2", 1), DEEP]),
  # no baseline line among those selected: no vs_baseline
  ("where: kind=decode\nsort: layers -tok_s\nfirst: layers",
   ["| 1 | fast |  | 500 |  | a\\|b | 0.5 |", "| 2 | deep |  | 3000 |  |  |  |"]),
  ('where: "config~a" kind!=trial note? layers!~7', ["| 1 | fast |  | 500 |  | a\\|b | 0.5 |"]),
  # the first N after the sort (a baseline left out: no vs_baseline)
  ("where: kind=decode\nsort: -tok_s\ntop: 1", ["| 1 | fast |  | 500 |  | a\\|b | 0.5 |"]),
])
def test_table_selects_orders_and_formats(opts, want):
  assert render.table(f"{opts}\n{ROWS}", LINES).splitlines() == ROWS.splitlines()[:2] + want


def test_prefill_lines_compare_with_llama_cpp_s_prompt():
  lines = [{"kind": "prefill", "config": "ours", "prefill_tok_s": 1500.0, "llama_cpp_prefill_tok_s": 6000.0},
           {"kind": "prefill", "config": "llama.cpp", "prefill_tok_s": 6000.0}]
  spec = "where: kind=prefill\n| config | vs |\n|---|---:|\n| {config} | {vs_llama_prefill:.2f}x |\n"
  assert render.table(spec, lines).splitlines()[2:] == ["| ours | 0.25x |", "| llama.cpp |  |"]


def test_a_table_that_selects_nothing_is_an_error_unless_it_says_what_to_print():
  with pytest.raises(ValueError, match="selects no line"): render.table(f"where: kind=gate\n{ROWS}", LINES)
  assert render.table(f"where: kind=gate\nempty: *none yet*\n{ROWS}", LINES) == "*none yet*\n"
  with pytest.raises(ValueError, match="bad"): render.table(f"where: kind=gate\nsrot: x\n{ROWS}", LINES)
  with pytest.raises(ValueError, match="top needs a count"): render.table(f"where: kind=decode\ntop: x\n{ROWS}", LINES)


def test_missing_names_the_absent_fields():
  ok = {f: 1 for f in render.COMMON + render.REQUIRED["trial"]} | {"kind": "trial"}
  assert render.missing(ok) == []
  assert render.missing({k: v for k, v in ok.items() if k != "wall_s"}) == ["wall_s"]
  # a failed step has the common fields only
  failed = {f: 1 for f in render.COMMON} | {"kind": "trial", "error": "no result"}
  assert render.missing(failed) == []
