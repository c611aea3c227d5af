"""The correctness gate at depth (evaluator/gate.py) on a deep narrow model (tiny-deep: 30 MoE blocks of 64 experts at
the tiny widths): a position-by-position comparison of free-running logits fails legitimate configs there (a
kernel-boundary knob among them: it flips routing near-ties), the gate passes them (8-bit FFN activations too, against
their dsl twin), and it fails deliberately broken ones (faults patched into the model by the test), each touching a
single position, and names the stage they touch."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

import evaluator.gate as gate
import model.backends.dsl as dsl
from model.deepseek2 import Block, Transformer, topk_indices
from model.generate import Generator
from model.gguf_file import GGUFFile
from model.structure import StructureConfig

PROMPT = [(7919 * i + 17) % 1000 for i in range(8)]
POSITIONS = 8


@pytest.fixture(scope="module")
def deep(gguf_file) -> str: return gguf_file("tiny-deep", "q4_0")


@functools.cache
def model(path: str, cfg_json: str = "{}") -> Transformer:
  return Transformer(GGUFFile(path), StructureConfig.from_json(cfg_json), max_context=32)


@pytest.fixture(scope="module")
def ref(deep) -> gate.Reference: return gate.make_reference(Generator(model(deep)), PROMPT, POSITIONS)


def free_logits(m: Transformer, tokens: np.ndarray) -> np.ndarray:
  """The trial's logits at the check positions when it routes by itself (what the gate compared before)."""
  g = Generator(m)
  out = [g.check_step(int(t), j)[0] for j, t in enumerate(tokens[:len(PROMPT) + POSITIONS])]
  return np.stack(out[len(PROMPT):])


Q8 = '{"fused": {"moe": "dsl", "ffn": "dsl"}, "ffn_act": "q8"}'
QA8 = '{"fused": {"attention": "dsl"}, "attn_act": "q8"}'  # the attention's dense products with 8-bit input
KV8 = '{"kv_dtype": "q8_0"}'  # the per-op attention over an 8-bit KV cache


@functools.cache
def reference(path: str, cfg_json: str = "{}") -> gate.Reference:
  return gate.make_reference(Generator(model(path, cfg_json)), PROMPT, POSITIONS)


@pytest.mark.parametrize("cfg", ['{"barriers": {"moe_out": "contiguous"}}', '{"kv_dtype": "float32"}', Q8, QA8, KV8])
def test_legitimate_configs_pass_the_gate(deep, ref, cfg: str) -> None:
  """A kernel boundary (float32 reorderings), an fp32 KV cache against the baseline's fp16 one (the fp16 class), and
  8-bit FFN activations against their dsl twin's reference (and an 8-bit KV cache against its twin's); the boundary
  also fails a position-by-position comparison of free-running logits, the gate of before."""
  m = model(deep, cfg)
  twin, (tol, part_tol) = gate.twin(m.cfg), gate.tolerance(m.cfg, m.hp.dim)
  # tiny-deep's width is 256: one 8-bit step moves a stage sqrt(2048 / 256) times more than at GLM-4.7-Flash's
  if cfg in (Q8, QA8, KV8):
    assert twin == StructureConfig.from_json(cfg)
    part = "ffn" if cfg == Q8 else "attention"
    assert (tol, part_tol) == (gate.FP32_TOL, {part: pytest.approx(gate.Q8_TOL * 8**0.5)})
  else: assert part_tol == {}
  if "barriers" in cfg:
    assert (gate.rel_err(free_logits(m, ref.tokens), ref.logits)
            > tol).any(), "depth no longer breaks the free-running comparison here"
  c = gate.check(Generator(m), reference(deep, twin.to_json()) if twin != StructureConfig() else ref, tol, part_tol,
                 ref if twin != StructureConfig() else None)
  assert c["ok"] and c["failed_positions"] == 0 and c["wrong_routing"] == 0, c
  assert c["max_rel_err"] <= tol and c["max_router_err"] <= tol and c["routing_decisions"] == POSITIONS * 30
  assert c["positions"] == POSITIONS and c["stages"] == 2 * 32 + 2
  acc = c["accuracy"]
  assert acc["positions"] == POSITIONS and acc["top1"] == 1.0, acc
  if "barriers" in cfg:  # a float32 reordering: the exact reference's logits, up to rounding
    assert acc["median_rel_err"] <= acc["max_rel_err"] < gate.FP32_TOL / 5 and acc["max_kl"] < 1e-7, acc
  if cfg == Q8:
    # against the exact reference, not the twin (from which it does not move at all: the twin computes alike)
    assert acc["max_rel_err"] > 10 * gate.FP32_TOL and acc["mean_kl"] > 1e-5, acc
    twin_acc = gate.accuracy(gate.chained(Generator(m), reference(deep, twin.to_json()), tol)[0],
                             reference(deep, twin.to_json()).logits)
    assert twin_acc["max_rel_err"] < acc["max_rel_err"] / 100, twin_acc


def test_accuracy_figures() -> None:
  """top-1 agreement, the error as the gate measures it and KL(p_exact || p_trial) in float64, on logits whose softmax
  overflows when taken naively (1e4 added to each): one position surer of the same top token, one whose top token is the
  other one, one alike; then one not finite."""
  softmax = lambda x: np.exp(x) / np.exp(x).sum()
  kl = lambda a, b: float((softmax(a) * np.log(softmax(a) / softmax(b))).sum())
  exact, trial = (np.array([[0.0, 1.0], [1.0, 0.0], [0.0, 2.0]]),
                  np.array([[0.0, 1.0 + np.log(3.0)], [0.0, 1.0], [0.0, 2.0]]))
  assert gate.accuracy(exact + 1e4, exact + 1e4) == {"positions": 3, "top1": 1.0, "max_rel_err": 0.0,
                                                     "median_rel_err": 0.0, "mean_kl": 0.0, "max_kl": 0.0}
  acc = gate.accuracy(trial + 1e4, exact + 1e4)
  kls = [kl(e, t) for e, t in zip(exact, trial, strict=True)]
  assert acc["top1"] == pytest.approx(2 / 3) and acc["mean_kl"] == pytest.approx(np.mean(kls)) and acc[
    "max_kl"] == pytest.approx(max(kls))
  # max |diff| over the exact row's std (0.5, 0.5, 1)
  assert acc["max_rel_err"] == pytest.approx(2 * np.log(3.0)) and acc["median_rel_err"] == pytest.approx(2.0)
  assert gate.accuracy_text(acc) == "top1 67% · err 2.2e0 · KL 2e-1" and gate.accuracy_text(None) == "-"
  trial[2, 1] = np.nan
  bad = gate.accuracy(trial + 1e4, exact + 1e4)
  assert bad["top1"] == pytest.approx(1 / 3) and bad["max_rel_err"] == bad["max_kl"] == np.inf


def test_8bit_activations_are_as_far_from_float32_as_a_fault(deep, ref) -> None:
  """Why 8-bit activations have a twin: against the float32 reference their FFN stages move by far more than float32
  reorderings do, which is what a subtle fault does too; against the twin, no further than a reordering."""
  m, twin = model(deep, Q8), gate.twin(StructureConfig.from_json(Q8))
  far, near = (gate.check(Generator(m), ref, gate.FP32_TOL),
               gate.check(Generator(m), reference(deep, twin.to_json()), gate.FP32_TOL))
  assert not far["ok"] and far["max_rel_err"] > 10 * gate.FP32_TOL and all(s.endswith("ffn") for s in far[
    "failed_stages"]), far
  assert near["ok"] and near["max_rel_err"] < gate.FP32_TOL / 5, near


@pytest.mark.parametrize("cfg,part", [(Q8, "ffn"), (QA8, "attention")])
def test_8bit_rounding_one_step_apart_passes_only_where_it_is_read(deep, monkeypatch, cfg: str, part: str) -> None:
  """Two implementations of the same 8-bit rounding (the native kernels and their dsl twin) differ where a value sits
  within a float rounding of a rounding boundary: it lands one 8-bit step apart. Here every 8-bit input of the trial
  (the FFN's with ffn_act, the attention's dense products' with attn_act) has its first value one step up, in every
  block at every position: the stages that read them pass it at Q8_TOL and fail at FP32_TOL, the others are
  untouched."""
  right = dsl.q8_round
  def q8_round(x: Tensor) -> Tensor:
    step = x.float().reshape(-1)[:32].abs().max() / 127
    return right(x) + (Tensor.arange(x.numel()) == 0).reshape(x.shape).where(step, 0)
  m = Transformer(GGUFFile(deep), StructureConfig.from_json(cfg), max_context=32)
  twin, (tol, part_tol) = gate.twin(m.cfg), gate.tolerance(m.cfg, m.hp.dim)
  r = reference(deep, twin.to_json())  # made before the patch
  monkeypatch.setattr(dsl, "q8_round", q8_round)
  c = gate.check(Generator(m), r, tol, part_tol)
  assert c["ok"] and gate.FP32_TOL < c["max_rel_err"] <= part_tol[part] and c["worst_stage"].split(" at ")[
    0].endswith(f" {part}"), c
  strict = gate.check(Generator(m), r, tol)
  assert not strict["ok"] and all(s.endswith(f" {part}") for s in strict["failed_stages"]), strict


def test_the_reference_records_routing_and_margins(ref) -> None:
  n = POSITIONS
  assert (ref.sel.shape == (n, 30, 4) and ref.scores.shape == ref.router.shape == (n, 30, 64)
          and ref.logits.shape == (POSITIONS, 1024))
  assert (ref.states.shape == (n, 2 * 32 + 1, 256) and ref.cache.shape == (32, len(PROMPT), 128 + 32)
          and np.abs(ref.cache).min(-1).max() > 0)
  assert (np.sort(ref.sel, -1) == np.sort(np.argsort(-ref.scores, -1, kind="stable")[..., :4], -1)).all()
  m = ref.margins()
  assert m.shape == (n, 30) and (m >= 0).all() and (m < 0.01).any(), "a random-weight model of this depth has near-ties"


def _pos(start_pos) -> Tensor: return Tensor.zeros(1, dtype=dtypes.int32) + start_pos


def _marked(deep: str, block: int) -> Transformer:
  """A fresh model whose blocks carry a marker (1 in `block`, else 0). A fault patched into every block acts where the
  marker is set: per-block data, as the check reads it (one graph per kind of block, on each block's own buffers)."""
  m = Transformer(GGUFFile(deep), StructureConfig(), max_context=32)
  for b in m.blocks: b.marker = Tensor([b.i == block]).realize()
  return m


def _single_position(ref: gate.Reference, block: int) -> tuple[int, int]:
  """(expert, position) such that the reference selects `expert` in MoE block `block` at that one check position
  only."""
  sel = ref.sel[:, block]
  for e in range(ref.scores.shape[-1]):
    where = np.flatnonzero((sel == e).any(-1))
    if len(where) == 1: return e, ref.prompt_len + int(where[0])
  pytest.skip("no expert of this block is used at exactly one check position")


def test_a_wrong_expert_at_one_position_fails(deep, ref, monkeypatch) -> None:
  """One MoE block's router swaps its second choice for the fifth at one position where its choice is clear: the routing
  check sees it (the logits, under the reference's routing, do not)."""
  m, b = _marked(deep, 2 + 20), 20
  p = ref.prompt_len + int(np.argmax(ref.margins()[:, b]))
  right = Block.route
  def route(self, logits, forced=None):
    sel, w, own = right(self, logits, forced)
    fifth = topk_indices(self.scores(logits), 5, "pairwise")[..., 4:5]
    wrong = own[..., :1].cat(fifth, own[..., 2:], dim=-1)
    return sel, w, ((_pos(self._pos) == p) & self.marker).reshape(1, 1, 1).where(wrong, own)
  call = Block.__call__
  def tracked(self, x, start_pos, *a, **kw):
    self._pos = start_pos
    return call(self, x, start_pos, *a, **kw)
  monkeypatch.setattr(Block, "route", route)
  monkeypatch.setattr(Block, "__call__", tracked)
  c = gate.check(Generator(m), ref, gate.FP32_TOL)
  assert not c["ok"] and c["wrong_routing"] == 1 and c["wrong_routing_at"] == [p] and c["failed_positions"] == 0, c
  assert "routing decisions differ" in gate.verdict(c)


@pytest.mark.parametrize("cfg", ["{}", Q8])
def test_a_scale_off_by_one_block_fails(deep, cfg: str) -> None:
  """In one MoE block, one expert's down projection reads each row's first block scale from its second block: the one
  position that uses that expert fails, in that block's FFN stage alone; with 8-bit activations too."""
  m = Transformer(GGUFFile(deep), StructureConfig.from_json(cfg), max_context=32)
  twin, (tol, part_tol) = gate.twin(m.cfg), gate.tolerance(m.cfg, m.hp.dim)
  b, r = 10, reference(deep, twin.to_json())
  e, p = _single_position(r, b)
  w = m.blocks[2 + b].down_exps
  d = w.planes["d"].numpy()
  rows = slice(e * w.shape[1], (e + 1) * w.shape[1])
  d[rows, 0] = d[rows, 1]
  w.planes["d"].assign(Tensor(d)).realize()
  c = gate.check(Generator(m), r, tol, part_tol)
  assert not c["ok"] and c["failed_at"] == [p] and c["failed_stages"] == [f"block {2 + b} ffn"] and c[
    "max_rel_err"] > part_tol.get("ffn", tol), c
  assert f"block {2 + b} ffn at position {p}" in gate.verdict(c)
  assert ("tolerance 5e-03, FFN stages 8.5e-02;" if cfg == Q8 else "tolerance 5e-03;") in gate.verdict(c)


def test_a_dropped_residual_at_one_position_fails(deep, ref, monkeypatch) -> None:
  m, p = _marked(deep, 15), ref.prompt_len + 5
  right = Block.attention
  def attention(self, xn, start_pos, pos):
    return right(self, xn, start_pos, pos) - ((_pos(start_pos) == p) & self.marker).reshape(1, 1, 1).where(self._x, 0)
  call = Block.__call__
  def keep_x(self, x, *a, **kw):
    self._x = x
    return call(self, x, *a, **kw)
  monkeypatch.setattr(Block, "attention", attention)
  monkeypatch.setattr(Block, "__call__", keep_x)
  c = gate.check(Generator(m), ref, gate.FP32_TOL)
  assert not c["ok"] and c["failed_at"] == [p] and c["failed_stages"] == ["block 15 attention"] and c[
    "max_rel_err"] > 10 * gate.FP32_TOL, c


def test_the_timed_run_is_checked_against_the_chained_run() -> None:
  """The timed run's tokens are compared with the chained check run's greedy tokens: a timed run that computes something
  else (every token one id off) fails; one that reproduces the chained run passes, also where the chained run itself
  parts from the reference (legitimate drift), and the comparison stops once the timed run's input is no longer the
  reference's, or where the chained run does not decide clearly."""
  P, n = 4, 6
  given = [7, 11, 12, 13, 14, 15, 16]
  ref = gate.Reference(np.array([1] * P + given), *(np.zeros((n, 0, 0)) for _ in range(3)), np.zeros((n, 5)),
                       np.zeros((n, 3, 2)), np.zeros((1, P, 2)), P, P, np.zeros((P, 0, 0)), np.zeros((P, 5)))
  own, none = given[1:], {"tokens_differ": 0, "first_differing": None}
  check = lambda own_tokens, decided, timed: gate.check_tokens(ref, {"own_tokens": own_tokens,
                                                                     "own_decided": decided}, timed)
  assert check(own, n, [7] + own) == {"tokens_compared": n} | none
  bad = check(own, n, [7] + [t + 1 for t in own])
  # its input parts from the reference's after it
  assert bad == {"tokens_compared": 1, "tokens_differ": 1, "first_differing": 1}
  drift = own[:2] + [99] + own[3:]  # the chained run predicts another token at check position 2: the timed run must too
  assert check(drift, n, [7] + drift) == {"tokens_compared": 3} | none
  assert check(drift, n, [7] + own)["first_differing"] == 3
  assert check(own, 2, [7] + own[:2] + [0] * 4)["tokens_compared"] == 2


def test_reference_key_follows_code_and_tinygrad(tmp_path, monkeypatch) -> None:
  key = gate.reference_key("ab" * 32, "CUDA:0", 47, 32, 16, 32)
  assert "CUDA_0" in key and "L47" in key and "tinygrad0.14" in key
  assert gate.reference_key("ab" * 32, "CUDA:0", 47, 32, 16, 4096) != key  # the depth its check positions start at
  (tmp_path / "deepseek2.py").write_text("# other code\n")
  monkeypatch.setattr(gate, "CODE", tmp_path)
  assert gate.reference_key("ab" * 32, "CUDA:0", 47, 32, 16, 32) != key


def test_decisive_synthetic_routing_has_clear_margins(tmp_path) -> None:
  """`model synth --routing decisive` makes each token's experts lead by a clear margin in every MoE block, where random
  router weights sit near ties (the k-th minus the (k+1)-th score, in std of the scores), so the timed run's tokens are
  compared further (until the first position where the chained run's top two logits themselves are close)."""
  from model.synth import write_synthetic
  margins = {}
  for routing in ("random", "decisive"):
    path = write_synthetic(tmp_path / f"{routing}.gguf", "tiny-deep", quant="q4_0", routing=routing, layers=10)
    m = Transformer(GGUFFile(path), StructureConfig(), max_context=32)
    ref = gate.make_reference(Generator(m), PROMPT, POSITIONS)
    margins[routing] = (ref.margins(), gate.check(Generator(m), ref, gate.FP32_TOL)["own_decided"])
  (rnd, rnd_tokens), (dec, dec_tokens) = margins["random"], margins["decisive"]
  assert np.quantile(dec, 0.01) > 0.3 > np.quantile(rnd, 0.5) and dec_tokens > rnd_tokens
  assert (rnd <= 2 * gate.FP16_TOL).mean() > 0.5 > (dec <= 2 * gate.FP16_TOL).mean() * 100


def test_the_check_builds_one_graph_per_kind_of_block(tmp_path) -> None:
  """The check runs the blocks one by one, one captured graph per kind of block (dense, MoE) replayed on each block's
  own buffers: what it builds does not grow with the depth."""
  from model.generate import jit_kernels
  from model.synth import write_synthetic
  built = {}
  for layers in (4, 8):
    path = write_synthetic(tmp_path / f"d{layers}.gguf", "tiny-deep", quant="q4_0", layers=layers)
    m = Transformer(GGUFFile(path), StructureConfig(), max_context=32)
    n_moe, g = sum(b.moe for b in m.blocks), Generator(m)
    g.check_step(1, 0, np.tile(np.arange(4, dtype=np.int32), (n_moe, 1)),
                 np.zeros((2 * layers + 1, m.hp.dim), np.float32), per_stage=True)
    built[layers] = sorted(len(jit_kernels(j)) for j in g.block_jits.values())
  assert built[4] == built[8] and len(built[8]) == 2, built


@pytest.mark.parametrize("cfg, legacy",
                         [("{}", False), ("{}", True),
                          ('{"merge_gate_up_routed": true, "merge_gate_up_shared": true}', False),
                          ('{"fused": {"attention": "dsl", "router": "dsl", "moe": "dsl", "ffn": "dsl"}}', False),
                          ('{"backends": {"Q4_0:expert": "fp16_cache"}, "mla_absorb": "load"}', False),
                          (KV8, False)])
def test_each_block_of_the_check_reads_its_own_weights_and_cache(tmp_path, cfg: str, legacy: bool) -> None:
  """The check's chained run (its own routing) computes what the decode graph computes, position after position: every
  block of a kind runs the kind's graph on its own weights, views of them (merged gate+up, the legacy kv_b split) and
  its own KV cache (two blocks of each kind here; decisive routing, so no near-tie flips between the two graphs)."""
  from model.synth import write_synthetic
  path = write_synthetic(tmp_path / "d.gguf", "tiny-deep", quant="q4_0", layers=4, legacy_kv_b=legacy,
                         routing="decisive")
  check, decode = (Generator(Transformer(GGUFFile(path), StructureConfig.from_json(cfg),
                                         max_context=32)) for _ in range(2))
  for j, t in enumerate(PROMPT):
    got, want = check.check_step(t, j)[0], decode.step_logits(t, j)
    assert gate.rel_err(got[None], want[None])[0] < gate.FP32_TOL, (j, gate.rel_err(got[None], want[None]))
  assert len(check.block_jits) == 2
