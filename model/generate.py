"""Generation: chunked prefill and decode, each under one TinyJit with a symbolic position, and sampling."""
from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
from tinygrad import Tensor, TinyJit, UOp, dtypes
from tinygrad.dtype import DType, _to_np_dtype
from tinygrad.engine.jit import _prepare_jit_inputs
from tinygrad.helpers import Context, ansistrip
from tinygrad.uop.ops import Ops

from model.deepseek2 import Block, Check, KVCache, Transformer
from model.weights import QWeight, read, write


class Slot:
  """One JIT input kept in one device buffer. A call copies its host value in, unless the buffer holds it already: a
  realized buffer is all the JIT wants, so no graph is scheduled per step (a Tensor made from Python values costs the
  scheduler over a millisecond per input and step, growing with the model's tensor count)."""

  def __init__(self, shape: tuple[int, ...], dtype: DType, device: str | None = None):
    self.tensor = Tensor.empty(*shape, dtype=dtype, device=device)
    self.np_dtype, self.held = _to_np_dtype(dtype), None

  def __call__(self, value) -> Tensor:
    arr = np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype=self.np_dtype), self.tensor.shape))
    if self.held is not None and np.array_equal(arr, self.held): return self.tensor
    self.held = arr
    write(self.tensor, arr)
    return self.tensor


def capture_first(fn) -> TinyJit:
  """A TinyJit that captures its graph on the first call. tinygrad's JIT runs a function's first call unjitted, for
  one-time work such as realizing state made lazily; a Transformer's weights and caches, and every JIT input here
  (Slot), are realized buffers before the first call, so that run would only schedule and lower the whole graph once
  more."""
  jit = TinyJit(fn)
  jit.cnt = 1
  return jit


def argmax_first(x: Tensor, group: int = 256, align: int = 32) -> Tensor:
  """Index of the first maximum of a 1-D float32 tensor, as np.argmax gives it, in two reductions: each value becomes
  one int64 key, its order-preserving integer (bits, with -0.0 as +0.0) above the complement of its index, so the
  largest key holds the maximum and, among equal values, the first index. Each row of `group` keys finds its largest,
  then the rows' largest is the answer (benchmarks/argmax_lab.py times it). The rows are padded to a multiple of
  `align`: tinygrad's heuristics then split them over workgroups, where a count that 16 does not divide leaves one
  thread per row looping alone."""
  n, low = x.shape[0], (1 << 32) - 1
  b = x.float().bitcast(dtypes.int32)
  ordered = (b < 0).where((b ^ 0x7FFFFFFF) + 1, b).cast(dtypes.int64)
  key = ordered * (1 << 32) + (low - Tensor.arange(n, dtype=dtypes.int64))
  rows = -(-n // (group * align)) * align
  # padded below every key (the smallest is -2**63 + 2**32); int64's own minimum renders as an unsigned C literal
  m = key.pad((0, rows * group - n), value=dtypes.int64.min + 1).reshape(rows, group).max(1).contiguous()
  return low - (m.max() & low)


def block_inputs(blk: Block) -> tuple[list[Tensor], tuple]:
  """The device tensors a block reads (its weights' planes and caches, norms, KV cache, the shared scratch: each buffer
  once) and its kind: what else decides its code (quant types, backends, flags, shapes). Blocks of one kind run the same
  code on buffers of the same shapes, so one captured graph serves them all with these as its inputs."""
  bufs, kind, seen = [], [], set()
  def walk(path: str, v) -> None:
    if isinstance(v, Tensor):
      kind.append((path, v.shape, v.dtype))
      if v.uop.base not in seen: seen.add(v.uop.base), bufs.append(v)
    elif isinstance(v, QWeight):
      kind.append((path, v.quant, v.backend, v.shape))
      walk(path + ".planes", v.planes), walk(path + ".cache", v.cache)
    elif isinstance(v, KVCache): walk(path + ".planes", v.planes)
    elif isinstance(v, dict):
      for k in sorted(v): walk(f"{path}.{k}", v[k])
    elif isinstance(v, (list, tuple)):
      for k, x in enumerate(v): walk(f"{path}.{k}", x)
    elif v is None or isinstance(v, (bool, int, float, str)): kind.append((path, v))
  for name, v in sorted(vars(blk).items()):
    if name != "i": walk(name, v)  # hp, cfg and dtypes are the model's, the same in every block
  return bufs, tuple(kind)


class Generator:
  """Runs a Transformer over one sequence. One JIT graph serves every decode step and one every prefill chunk.

  Decode kernels are built with the config's BEAM width; prefill kernels at BEAM=0 (the search measures decode, and BEAM
  over the prefill kernels of a full model costs minutes)."""

  def __init__(self, model: Transformer, chunk: int | None = None):
    """chunk: the prompt's tokens per prefill graph call (None: the config's prefill_chunk)."""
    chunk = model.cfg.prefill_chunk if chunk is None else chunk
    self.model, self.chunk, self.beam = model, min(chunk, model.max_context), model.cfg.beam
    self.pos = UOp.variable("start_pos", 0, model.max_context - 1)
    # the prompt's graph takes a chunk's index, its position that times the chunk: the keys a chunk attends then number
    # a known multiple of the chunk, which tinygrad's tensor cores and upcasts need (a free position is no multiple)
    self.chunk_at = UOp.variable("chunk_at", 0, max(0, model.max_context // self.chunk - 1))
    self.prefill_jit, self.step_jit, self.step_logits_jit = capture_first(self._prefill), capture_first(
      self._step), capture_first(self._step_logits)
    self.prefill_last_jit = capture_first(self._prefill_last)
    self.sample_jit = capture_first(self._sample)  # temperature > 0: the greedy graph computes no noise
    # the correctness check (check_step): the embedding, the head, and one graph per kind of block (block_inputs)
    self.embed_jit, self.head_jit, self.block_jits = capture_first(self._embed), capture_first(self._head), {}
    # the input UOps of each block's graph calls, by block and whether its experts are its own (the same every step:
    # the JIT's checks of its inputs, a graph rewrite per input, cost more than a block's kernels on the host, and a
    # step runs every block)
    self.block_uops: dict[tuple[int, bool], list[UOp]] = {}
    dev, D = model.device, model.hp.dim
    self.token, self.temperature, self.seed = (Slot((1, 1), dtypes.int32, dev), Slot((1,), dtypes.float, dev),
                                               Slot((1,), dtypes.float, dev))
    self.chunk_tokens, self.chunk_last = Slot((1, self.chunk), dtypes.int32, dev), Slot((1,), dtypes.int32, dev)
    # the sequence's tokens, which greedy steps read and write on the device (steps), and its last read on the host
    self.seq = Tensor.zeros(model.max_context + 1, dtype=dtypes.int32, device=dev).contiguous().realize()
    self.seq_held = np.zeros(model.max_context + 1, np.int32)
    self.x, self.h, self.last = (Slot((1, 1, D), dtypes.float, dev) for _ in range(3))
    self.per_stage, self.forced = Slot((1,), dtypes.bool, dev), Slot((1, 1, model.hp.n_used), dtypes.int32, dev)

  @functools.cached_property
  def block_inputs(self) -> list[tuple[list[Tensor], tuple]]:
    """Each block's buffers and kind (block_inputs), found on the check's first step."""
    return [block_inputs(b) for b in self.model.blocks]

  def _prefill(self, tokens: Tensor, chunk_at: UOp) -> Tensor:
    return self.model.forward(tokens, chunk_at * self.chunk, all_logits=True)[0].contiguous()

  def _prefill_last(self, tokens: Tensor, chunk_at: UOp, last: Tensor) -> Tensor:
    return self.model.forward(tokens, chunk_at * self.chunk, at=last)[0, -1].contiguous()

  def _step_logits(self, token: Tensor, start_pos: UOp) -> Tensor:
    return self.model.forward(token, start_pos)[0, -1].contiguous()

  def _embed(self, token: Tensor) -> Tensor: return self.model.embed(token).float().contiguous()

  def _head(self, last: Tensor) -> Tensor: return self.model.head(last.cast(self.model.act))[0, -1].contiguous()

  def _block(self, blk: Block, x: Tensor, h: Tensor, per_stage: Tensor, start_pos: UOp, forced: Tensor | None,
             bufs: list[Tensor]) -> tuple[Tensor, ...]:
    """One block of the check: x its input; h the attention's output that a reference recorded, which the FFN reads
    instead of the block's own where per_stage is true; forced: an MoE block's expert ids. Captured with the first block
    of its kind: bufs (block_inputs) are the graph's inputs, so every other block of the kind runs it on its own
    buffers."""
    chk = Check(forced, h, per_stage)
    m = self.model
    out = blk(x.cast(m.act), start_pos, m.device_pos(start_pos, x.shape[1]), m.act, chk).float().contiguous()
    if not blk.moe: return chk.att, out
    return (chk.att, out, chk.own.cast(dtypes.int32).contiguous(), chk.scores.float().contiguous(),
            chk.logits.contiguous())

  def _step(self, start_pos: UOp) -> Tensor:
    """A greedy step on the sequence buffer: its token at start_pos in, the next token written at start_pos + 1."""
    tok = self.seq.shrink(((start_pos, start_pos + 1),)).reshape(1, 1)
    nxt = argmax_first(self.model.forward(tok, start_pos)[0, -1]).cast(dtypes.int32)
    return self.seq.shrink(((start_pos + 1, start_pos + 2),)).assign(nxt.reshape(1))

  def _sample(self, token: Tensor, start_pos: UOp, temperature: Tensor, seed: Tensor) -> Tensor:
    logits = self.model.forward(token, start_pos)[0, -1]
    # uniform noise from a stateless hash of (index, seed): a seed drawn on the host per step makes sampling
    # reproducible without random state on the device
    h = ((Tensor.arange(logits.shape[-1]).float() * 12.9898 + seed * 78.233).sin() * 43758.5453)
    gumbel = -(-(h - h.floor()).maximum(1e-12).log()).log()
    return argmax_first(logits / temperature + gumbel).cast(dtypes.int32).reshape(1, 1).contiguous()

  def _check_room(self, end: int) -> None:
    if end > self.model.max_context:
      raise ValueError(f"sequence of {end} tokens exceeds the context of {self.model.max_context}")

  def in_graph(self, pos: int) -> bool:
    """Whether the chunk at position pos runs in the prefill graph: at a multiple of the chunk, and padded to a whole
    chunk, it fits the cache (else it runs at its exact size outside the graph)."""
    return pos % self.chunk == 0 and pos + self.chunk <= self.model.max_context

  def prefill(self, tokens: list[int], start: int = 0, last: bool = False) -> np.ndarray:
    """Feed tokens at positions start.. in chunks; returns float32 logits (len(tokens), vocab) for every position, or
    with `last` the last token's alone (vocab,), what a generation reads: then each chunk computes the output head for
    one token (its last) instead of all its positions, and the host reads one row, after the last chunk."""
    self._check_room(start + len(tokens))
    out = []
    for i in range(0, len(tokens), self.chunk):
      part = tokens[i:i + self.chunk]
      pos = start + i
      if not self.in_graph(pos):
        logits = self.model.forward(Tensor([part], dtype=dtypes.int32), self.pos.bind(pos), all_logits=True)[0].numpy()
        out.append(logits[-1] if last else logits)
        continue
      # padding past the prompt writes cache rows that later steps overwrite before they read them
      args = self.chunk_tokens([part + [0] * (self.chunk - len(part))]), self.chunk_at.bind(pos // self.chunk)
      if last: out.append(self.prefill_last_jit(*args, self.chunk_last(len(part) - 1)))
      else: out.append(read(self.prefill_jit(*args))[:len(part)])
    if last: return out[-1] if isinstance(out[-1], np.ndarray) else read(out[-1])
    return np.concatenate(out)

  def prefill_forced(self, tokens: list[int], forced: np.ndarray | None) -> np.ndarray:
    """prefill's logits (len(tokens), vocab) from position 0, in its chunks (at their exact sizes, outside the JIT),
    every MoE block using the expert ids of forced (len(tokens), n_moe, K) instead of its own: the correctness check's
    prefill, which routes as its reference did."""
    self._check_room(len(tokens))
    out = []
    for i in range(0, len(tokens), self.chunk):
      part = tokens[i:i + self.chunk]
      ids = None if forced is None else [Tensor(np.ascontiguousarray(forced[i:i + len(part), b]).astype(np.int32),
                                                device=self.model.device).reshape(1, len(part), -1)
                                         for b in range(forced.shape[1])]
      tok = Tensor([part], dtype=dtypes.int32, device=self.model.device)
      out.append(self.model.forward(tok, self.pos.bind(i), all_logits=True, forced=ids)[0].numpy())
    return np.concatenate(out)

  def step_logits(self, token: int, pos: int) -> np.ndarray:
    self._check_room(pos + 1)
    with Context(BEAM=self.beam): return read(self.step_logits_jit(self.token(token), self.pos.bind(pos)))

  def check_step(self, token: int, pos: int, forced: np.ndarray | None = None, states: np.ndarray | None = None,
                 per_stage: bool = False) -> tuple[np.ndarray, ...]:
    """One decode step for the correctness check, block by block: (logits (vocab,), each MoE block's own top-k ids
    (n_moe, K), its selection scores (n_moe, E), its router logits (n_moe, E), the residual stream after each stage
    (S = 2 * blocks + 1, D)). forced (n_moe, K): the expert ids every MoE block uses instead of its own. states (S, D):
    a reference's stream, which each stage reads instead of its predecessor's output where per_stage is true, so that
    every stage is checked on its own inputs (else the stages chain, as in the timed graph). The blocks run one graph
    per kind (block_inputs), beside the embedding's and the head's: the check builds no second graph of the whole
    model."""
    self._check_room(pos + 1)
    per_stage = per_stage and states is not None
    with Context(BEAM=self.beam):
      start, flag, routed = self.pos.bind(pos), self.per_stage(per_stage), []
      outs = [read(self.embed_jit(self.token(token))).reshape(-1)]
      for i, (blk, (bufs, kind)) in enumerate(zip(self.model.blocks, self.block_inputs, strict=True)):
        f = self.forced(forced[len(routed)]) if blk.moe and forced is not None else None
        # read where per_stage is true only (a constant is not copied again)
        h = self.h(states[2 * i + 1] if per_stage else 0)
        # its own experts (a reference's run) or forced ones (the check): a graph each, both run in one process where a
        # trial makes its own reference
        own = f is None
        jit = self.block_jits.setdefault((kind, own), capture_first(self._block))
        args = (blk, self.x(states[2 * i] if per_stage else outs[-1]), h, flag, start, f, bufs)
        # inputs known: skip the JIT's preparation
        if (i, own) in self.block_uops: res = jit.captured(self.block_uops[i, own], {self.pos.expr: pos})
        else: res, self.block_uops[i, own] = jit(*args), _prepare_jit_inputs(args, {})[0]
        res = [read(t) for t in res]
        outs += [res[0].reshape(-1), res[1].reshape(-1)]
        if blk.moe: routed.append([r.reshape(-1) for r in res[2:]])
      logits = read(self.head_jit(self.last(states[-1] if per_stage else outs[-1])))
    own, scores, router = (np.stack(r) for r in zip(*routed, strict=True)) if routed else (np.zeros(1),) * 3
    return logits, own, scores, router, np.stack(outs)

  def cache_rows(self, n: int) -> np.ndarray:
    """The KV cache rows of positions 0..n-1 of every block, as float32: (blocks, n, kv_lora + rope)."""
    Tensor.realize(*(rows := [b.kv.rows(n).contiguous() for b in self.model.blocks]))
    return np.stack([read(r)[0] for r in rows])

  def set_cache(self, rows: np.ndarray) -> None:
    """Every block's KV cache holding `rows` (blocks, n, kv_lora + rope) at positions 0..n-1 (in its own dtype), zeros
    after."""
    self.model.reset()
    Tensor.realize(*(t for b, r in zip(self.model.blocks, rows, strict=True)
                     for t in b.kv.store(0, Tensor(r[None].astype(np.float32), device=self.model.device))))

  def step(self, token: int, pos: int, temperature: float = 0.0, seed: float = 0.0) -> int:
    """The next token after `token` at `pos`: greedy at temperature 0, else a Gumbel-max draw seeded by `seed`."""
    if temperature <= 0: return self.steps(token, pos, 1)[0]
    self._check_room(pos + 1)
    with Context(BEAM=self.beam):
      out = self.sample_jit(self.token(token), self.pos.bind(pos), self.temperature(temperature), self.seed(seed))
    return int(read(out)[0, 0])

  def steps(self, token: int, pos: int, n: int) -> list[int]:
    """The n greedy tokens after `token` at `pos`, decoded back to back on the device: each step reads its token from
    the sequence buffer and writes the next there, and the host reads them once at the end, so the GPU does not wait
    on the host between tokens."""
    self._check_room(pos + n)
    if self.seq_held[pos] != token:
      self.seq_held[pos] = token
      write(self.seq, self.seq_held)
    with Context(BEAM=self.beam):
      for i in range(n): self.step_jit(self.pos.bind(pos + i))
    self.seq_held = read(self.seq)
    return self.seq_held[pos + 1:pos + n + 1].tolist()

  def generate(self, prompt: list[int], n: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
               stop: set[int] = frozenset()) -> Iterator[int]:
    """Yields up to n new tokens after the prompt; stops after a token in `stop`."""
    rng = np.random.default_rng(seed)
    tok = sample(self.prefill(prompt, last=True), temperature, top_p, rng)
    pos = len(prompt)
    for i in range(n):
      yield tok
      if tok in stop or i == n - 1: return
      if top_p < 1.0 and temperature > 0: tok = sample(self.step_logits(tok, pos), temperature, top_p, rng)
      else: tok = self.step(tok, pos, temperature, float(rng.random() * 1000))
      pos += 1


def jit_kernels(jit: TinyJit) -> list[tuple[str, str]]:
  """(name, source) of the kernels one replay of a captured JIT runs, in order."""
  progs = []
  for call in jit.captured.linear.src:
    if (ast := call.src[0]).op is Ops.CUSTOM_FUNCTION and ast.arg == "graph":
      progs += [c.src[0] for c in ast.src[0].src if c.src[0].op is Ops.PROGRAM]
    elif ast.op is Ops.PROGRAM: progs.append(ast)
  return [(ansistrip(p.arg.name), next(s.arg for s in p.src if s.op is Ops.SOURCE)) for p in progs]


def jit_stats(jit: TinyJit) -> tuple[int, int]:
  """(kernels, graph batches) of one replay of a captured JIT."""
  kernels = batches = 0
  for call in jit.captured.linear.src:
    if (ast := call.src[0]).op is Ops.CUSTOM_FUNCTION and ast.arg == "graph":
      kernels, batches = kernels + len(ast.src[0].src), batches + 1
    elif ast.op is Ops.PROGRAM: kernels += 1
  return kernels, batches


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
  """Greedy at temperature 0, else softmax(logits / temperature) restricted to the smallest set of tokens with mass >=
  top_p."""
  if temperature <= 0: return int(np.argmax(logits))
  z = logits.astype(np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  order = np.argsort(-p)
  keep = order[:int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
  return int(rng.choice(keep, p=p[keep] / p[keep].sum()))
