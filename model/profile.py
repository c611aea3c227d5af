"""Per-kernel profile of one decode step: the captured JIT's own kernels (the compiled programs and buffers the timed
graph runs), each launched again and timed on the device, without the host's launch time.

A kernel of a decode step runs for a few µs, less than a launch from Python takes, so timing launches from the host
measures the host. Instead the device is kept busy first: a *sweep* (a reduction over a buffer as large as the bytes one
step reads, up to 256 MiB) is launched m times, long enough on the device for the host to queue everything after it.
Then, per repetition, one sweep (it also evicts the caches, as the rest of a step does between two uses of a weight) and
the launches of one kernel name, in the step's order over the layers. The same sequence without the kernel's launches is
timed too; the difference, divided by the launches, is the kernel's device time. The two are interleaved `rounds` times
and the median difference is kept.

On CUDA the sequence is one CUDA graph, as the decode step runs its kernels: launched one by one from the host, a kernel
costs more on the device than as a graph node, a large share of a few-µs kernel. Elsewhere the kernels are launched one
by one (`timing` says which).

What a name costs per token is its time per launch times its launches per step. The graph's own scheduling, the
dependencies between kernels and the host's share are what the timed step costs beyond the sum of these (the evaluator
reports both).

Each launch is given the model's stage (embed, attention, router, moe, ffn, head) and block that built it, from the
buffers it reads: a block's weights and KV cache name their stage and layer (`places`); a launch that reads none of them
(a softmax, a top-k, a residual add over intermediates) belongs where the launch before it does. A row is one kernel
name in one stage, with the layers it ran in.
"""
from __future__ import annotations

import collections
import ctypes
import math
import statistics
import time
import weakref
from collections.abc import Callable

import numpy as np
from tinygrad import Device, Tensor, TinyJit, dtypes
from tinygrad.engine.realize import get_graph_runtime, get_runtime, resolve_params, unwrap_multi
from tinygrad.helpers import ansistrip
from tinygrad.uop.ops import Ops, UOp, sym_infer

from model.deepseek2 import Transformer
from model.generate import capture_first

STAGES = ("embed", "attention", "router", "moe", "ffn", "head")  # in a step's order
# a block's attributes by the stage that reads them (ffn_norm: the router's in an MoE block, the FFN's in a dense one)
BLOCK_STAGES = {"attention": ("attn_norm", "q_a", "q_a_norm", "q_b", "q_abs", "q_pe", "kv_a", "kv_a_norm", "k_b",
                              "k_b_t", "v_b", "wo", "cache"),
                "router": ("gate_inp", "probs_b"),
                "moe": ("gate_exps", "up_exps", "down_exps", "gate_up_exps", "gate_sh", "up_sh", "down_sh",
                        "gate_up_sh"),
                "ffn": ("gate", "up", "down", "gate_up")}
NORMS = ("attn_norm", "q_a_norm", "kv_a_norm")  # the attention's RMSNorm weights (the FFN's: ffn_norm)
Place = tuple[str, int | None]  # (stage, layer); layer None: shared by the blocks, or outside them
# a buffer's place, and whether it is a norm's weight: it names the stage of a kernel that reads no other weight (an MoE
# block's FFN norm: the router's, which a fused MoE stage reads again)
Owner = tuple[str, int | None, bool]


def _launches(jit) -> list[tuple]:
  """(program, runtime, buffers, device vars) of every kernel one replay of a captured JIT runs, in order. Kernels that
  read the JIT's inputs directly (outside a graph) are left out: their buffers exist only during a call."""
  out = []
  for call in jit.captured.linear.src:
    ast = call.src[0]
    if ast.op is Ops.CUSTOM_FUNCTION and ast.arg == "graph":
      if (rt := get_graph_runtime(ast)) is None: continue
      out += [(prg, runtime, bufs, dv) for (_, prg, bufs, dv), runtime in zip(rt.calls, rt.runtimes, strict=True)
              if prg.op is Ops.PROGRAM]
    elif ast.op is Ops.PROGRAM:
      try: resolved = resolve_params(call, ())
      except (IndexError, KeyError, AttributeError): continue
      for bufs, dv in unwrap_multi(call, [resolved[i] for i in ast.arg.globals]):
        out.append((ast, get_runtime(bufs[0].device, ast), [b.ensure_allocated() for b in bufs], dv))
  return out


def _buffers(v) -> list:
  """The device buffers of a model attribute: a tensor's, a weight's planes and cache, those of a dict or list."""
  from model.weights import QWeight
  if isinstance(v, Tensor): return [v.uop.base.buffer]
  if isinstance(v, QWeight): return _buffers(v.planes) + _buffers(v.cache)
  if isinstance(v, dict): return [b for x in v.values() for b in _buffers(x)]
  if isinstance(v, (list, tuple)): return [b for x in v for b in _buffers(x)]
  return []


def places(model: Transformer) -> dict[int, Owner]:
  """The place of each buffer the model's stages read, by the buffer's id: the blocks' weights, norms and KV caches;
  the RoPE tables (the attention's, shared by the blocks); the embedding, the final norm and the output head."""
  out: dict[int, Owner] = {id(b): ("attention", None, False) for b in _buffers([model.cos, model.sin])}
  for blk in model.blocks:
    for stage, names in BLOCK_STAGES.items():
      for n in names:
        for b in _buffers(getattr(blk, n, None)): out[id(b)] = (stage, blk.i, n in NORMS)
    for b in _buffers(blk.ffn_norm): out[id(b)] = ("router" if blk.moe else "ffn", blk.i, True)
  out |= {id(b): ("head", None, True) for b in _buffers(model.output_norm)}
  out |= {id(b): ("head", None, False) for b in _buffers(model.output)}
  # tied to the output: the head's too
  for b in _buffers(model.token_embd): out.setdefault(id(b), ("embed", None, False))
  return out


def stage_of(launches: list[tuple], where: dict[int, Owner]) -> list[Place]:
  """Each launch's stage and layer. Of the buffers it reads that `where` places, a block's own weights come first, its
  norms' only where it reads no other (several stages of one block: joined by "+", a fused kernel of both); a shared
  one (the RoPE tables) names the stage, in the layer of the launch before it. A launch that reads none of them belongs
  to the launch after it where that one reads its output, its inputs and a norm's weight (the norm's sum of squares, fed
  to the kernel that applies the norm), else where the launch before it does (a softmax, a top-k, a residual add). The
  embedding's buffer read after the blocks is the (tied) head's."""
  def own(bufs: list) -> Place | None:
    found = [where[id(b)] for b in bufs if id(b) in where]
    if mine := [p for p in found if p[1] is not None and not p[2]] or [p for p in found if p[1] is not None]:
      return "+".join(s for s in STAGES if any(p[0] == s for p in mine)), mine[0][1]
    return found[0][:2] if found else None
  placed = [own(bufs) for _, _, bufs, _ in launches]
  def applies(mine: list, then: list) -> bool:  # `then` normalizes by `mine`'s sum of squares
    ids = {id(b) for b in then[1:]}
    return any(id(b) in where and where[id(b)][2] for b in then) and all(id(b) in ids for b in mine)
  for i in reversed(range(len(launches) - 1)):
    if placed[i] is None and placed[i + 1] is not None and applies(launches[i][2], launches[i + 1][2]):
      placed[i] = placed[i + 1]
  out, prev, blocks = [], ("embed", None), False
  for p in placed:
    if p is not None and p[1] is None:  # shared, or outside the blocks
      p = ("head", None) if p[0] == "embed" and blocks else (p[0], prev[1] if p[0] == prev[0].split("+")[-1] else None)
    prev = p or prev
    blocks = blocks or prev[1] is not None
    out.append(prev)
  return out


def layers_text(layers: list[int]) -> str:
  """Layer numbers as runs: [0, 1, 2, 5] -> "0-2,5"."""
  runs: list[list[int]] = []
  for i in sorted(set(layers)):
    if runs and i == runs[-1][1] + 1: runs[-1][1] = i
    else: runs.append([i, i])
  return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _calls(launches: list[tuple], var_vals: dict[str, int]) -> list:
  """Each launch as a function that queues it on the device."""
  def call(runtime, bufs: list, vals, gs, ls):
    return lambda wait=False: runtime(*bufs, global_size=gs, local_size=ls, vals=vals, wait=wait)
  out = []
  for prg, runtime, bufs, dv in launches:
    vv = {**var_vals, **dv}
    out.append(call(runtime, [x.get_buf(x.device) for x in bufs], prg.arg.vals(vv), *prg.arg.launch_dims(vv)))
  return out


def _on_cuda(launches: list[tuple]) -> bool:
  return bool(launches) and all(type(rt).__module__ == "tinygrad.runtime.ops_cuda" for _, rt, _, _ in launches)


def _cuda_graph(launches: list[tuple], var_vals: dict[str, int], programmatic: bool = False,
                slots: list[int | None] | None = None) -> Callable[[], None] | None:
  """A function that runs the launches as one CUDA graph, each after the one before; None off CUDA. programmatic: the
  edges into kernels that wait for the kernels before them themselves (cuda_graph.waits) are programmatic, as the
  decode step's graph makes them (OverlapGraph). slots: per launch, a device address passed as one more argument after
  its own (a stamped kernel's stamp_slot), or None."""
  if not _on_cuda(launches): return None
  import tinygrad.runtime.autogen.cuda as cuda
  from tinygrad.runtime.ops_cuda import check, encode_args
  from tinygrad.runtime.support.c import init_c_var

  from model.backends.cuda_graph import make_programmatic, waits
  graph = init_c_var(cuda.CUgraph, lambda x: check(cuda.cuGraphCreate(ctypes.byref(x), 0)))
  keep, prev, late = [], None, []
  for i, (prg, runtime, bufs, dv) in enumerate(launches):
    vv = {**var_vals, **dv}
    gs, ls = prg.arg.launch_dims(vv)
    c_args, vargs = encode_args([x.get_buf(x.device) for x in bufs], prg.arg.vals(vv), runtime.signature)
    if slots is not None and slots[i] is not None:
      raw = bytes(c_args)
      raw += bytes(-len(raw) % 8) + slots[i].to_bytes(8, "little")
      c_args, size = ctypes.create_string_buffer(raw, len(raw)), ctypes.c_size_t(len(raw))
      vargs = (ctypes.c_void_p * 5)(1, ctypes.addressof(c_args), 2, ctypes.addressof(size), 0)
      keep.append(size)
    params = cuda.CUDA_KERNEL_NODE_PARAMS_v1(runtime.prg, *gs, *ls, runtime.smem,
                                             ctypes.cast(0, ctypes.POINTER(ctypes.c_void_p)), vargs)
    node = cuda.CUgraphNode()
    deps = (cuda.CUgraphNode * 1)(prev) if prev is not None else None
    check(cuda.cuGraphAddKernelNode(ctypes.byref(node), graph, deps, 0 if deps is None else 1, ctypes.byref(params)))
    if programmatic and prev is not None and waits(prg): late.append((prev, node))
    keep += [c_args, vargs, params]
    prev = node
  if late: make_programmatic(graph, late)
  instance = init_c_var(cuda.CUgraphExec,
                        lambda x: check(cuda.cuGraphInstantiate_v2(ctypes.byref(x), graph, None, None, 0)))
  check(cuda.cuGraphDestroy(graph))
  def run(keep=keep) -> None: check(cuda.cuGraphLaunch(instance, None))
  # with the function, the graph's device resources go
  weakref.finalize(run, lambda: check(cuda.cuGraphExecDestroy(instance)))
  return run


def _sweep(nbytes: int) -> tuple[list, TinyJit]:
  """The sweep's launches (a sum over nbytes of float32) and the JIT holding its buffers."""
  buf = Tensor.ones(max(1, nbytes // 4), dtype=dtypes.float32).contiguous().realize()
  (jit := capture_first(lambda: buf.sum().contiguous()))()
  return _calls(_launches(jit), {}), jit


def _timed(dev, before: list, per_rep: list, reps: int) -> float:
  dev.synchronize()
  t0 = time.perf_counter()
  for c in before: c()
  for _ in range(reps):
    for c in per_rep: c()
  dev.synchronize()
  return time.perf_counter() - t0


def kernel_profile(jit, var_vals: dict[str, int], bandwidth_gbs: float | None = None, step_bytes: int = 256 << 20,
                   where: dict[int, Owner] | None = None, launches: int = 64, rounds: int = 3,
                   in_order: bool = False) -> list[dict]:
  """Kernels of the step by device time per token, a row per kernel name and stage: name, stage and layers (from
  `where`: places(model); without it, none), launches per step, µs per token, µs per launch, bytes per token, GB/s and
  TFLOPS (tinygrad's byte and operation estimates over the time), share of the summed kernel time, and of the measured
  bandwidth where it is given. step_bytes: what one step reads (the sweep reads as much, up to 256 MiB); launches: how
  many launches of a row are timed together (its launches per step, repeated). in_order: each launch timed alone while
  the whole graph runs in its order, `rounds` times (the device's own timer; for kernels far longer than a launch), so
  every kernel reads what the graph gives it: after the graph, a scratch buffer the planner shares holds another
  kernel's output, and an index read from there sends a kernel run out of order out of bounds."""
  groups: dict[tuple[str, str], list[tuple]] = collections.defaultdict(list)
  layers: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
  found = _launches(jit)
  for launch, (stage, layer) in zip(found, stage_of(found, where or {}), strict=True):
    key = (ansistrip(launch[0].arg.name), stage if where else "")
    groups[key].append(launch)
    if layer is not None: layers[key].append(layer)
  dev = Device[Device.DEFAULT]
  if in_order:
    each = _in_order(found, var_vals, rounds)
    timed = {key: (statistics.fmean(each[id(launch)] for launch in ls), "in order, device timer")
             for key, ls in groups.items()}
  else:
    sweep, sweep_jit = _sweep(min(step_bytes, 256 << 20))
    sweep_launches = _launches(sweep_jit)
    for c in sweep * 2: c()  # warm
    dev.synchronize()
    sweep_s = _timed(dev, [], sweep, 8) / 8  # the sweep's device time (its launches are far shorter than its run)
    timed = {key: _time_launches(dev, ls, var_vals, sweep, sweep_launches, sweep_s, launches, rounds)
             for key, ls in groups.items()}
  rows = []
  for (name, stage), ls in groups.items():
    per_launch, timing = timed[(name, stage)]
    sink = ls[0][0].src[0]
    est = sink.arg.estimates if sink.op is Ops.SINK and sink.arg is not None else None
    mem = float(sym_infer(est.mem, {**var_vals, **ls[0][3]})) if est is not None else None
    ops = float(sym_infer(est.ops, {**var_vals, **ls[0][3]})) if est is not None else None
    rows.append({"name": name, "stage": stage, "layers": layers_text(layers[(name, stage)]), "count": len(ls),
                 "us_per_token": per_launch * len(ls), "us_per_launch": per_launch,
                 "bytes": int(mem * len(ls)) if mem is not None else None,
                 "gb_s": mem / per_launch / 1e3 if mem and per_launch > 0 else None,
                 "tflops": ops / per_launch / 1e6 if ops and per_launch > 0 else None, "timing": timing})
  total = sum(r["us_per_token"] for r in rows) or 1.0
  rows.sort(key=lambda r: -r["us_per_token"])
  for i, r in enumerate(rows):
    r |= {"rank": i + 1, "share": r["us_per_token"] / total,
          "bandwidth_share": r["gb_s"] / bandwidth_gbs if r["gb_s"] and bandwidth_gbs else None}
  return rows


def _in_order(launches: list[tuple], var_vals: dict[str, int], rounds: int) -> dict[int, float]:
  """µs of each launch (by id), the median over `rounds` runs of all of them in their order, each waited for and timed
  by the device (a first run warms, untimed)."""
  calls = _calls(launches, var_vals)
  for c in calls: c()
  times = [[c(wait=True) for c in calls] for _ in range(rounds)]
  return {id(launch): statistics.median(t[i] for t in times) * 1e6 for i, launch in enumerate(launches)}


def _time_launches(dev, ls: list[tuple], var_vals: dict[str, int], sweep: list, sweep_launches: list, sweep_s: float,
                   launches: int, rounds: int) -> tuple[float, str]:
  """(µs per launch of one row's launches, how they were timed): the median difference of the sweeps with and without
  them, over `rounds`."""
  calls = _calls(ls, var_vals)
  t0 = time.perf_counter()
  for c in calls: c()  # warm: compiled, resident; and the host's time to queue them
  host_s = (time.perf_counter() - t0) / len(calls)
  dev.synchronize()
  reps = math.ceil(launches / len(calls))
  # queue time covered twice over
  busy = sweep * (math.ceil(1.5 * reps * (len(calls) * host_s + len(sweep) * 20e-6) / sweep_s) + 1)
  with_k, without = _cuda_graph((sweep_launches + ls) * reps, var_vals), _cuda_graph(sweep_launches * reps, var_vals)
  if graph := with_k is not None and without is not None:
    diffs = [_timed(dev, busy, [with_k], 1) - _timed(dev, busy, [without], 1) for _ in range(rounds)]
  else: diffs = [_timed(dev, busy, sweep + calls, reps) - _timed(dev, busy, sweep, reps) for _ in range(rounds)]
  return max(statistics.median(diffs), 0.0) / (reps * len(calls)) * 1e6, "cuda graph" if graph else "host launches"


STAMP_WORDS = 4  # a stamped launch's words (cuda_src PRELUDE's Stamp): ~first entry, ~first wait, last wait, last exit


def timeline_rows(names: list[str], others: list[int], words: list[np.ndarray]) -> tuple[list[dict], list[float]]:
  """The step timeline from the stamps of consecutive steps: words, per run of the graph, (steps, launches, 4) as the
  stamped kernels wrote them; names and others (the unstamped launches just before each, folded into its hand-off) per
  launch of a step. Each launch's part of the step is the time from the previous stamped launch's last block exit to
  its own: the hand-off until its first block returns from its wait, then its work until its last block exits. Steps
  after the first of each run count (the first has no predecessor in the graph). -> (rows by name, largest part first:
  launches a step, µs per step (median over steps, min, max), of which hand-off and work, µs a launch, how early its
  first block started before the previous one ended (lead), the spread of its blocks' returns from the wait (skew), and
  the share of the step; the step spans in µs)."""
  parts, spans = collections.defaultdict(list), []
  for run in words:
    if not run.all(): raise RuntimeError("a stamped launch left no stamp: " + names[int(np.argwhere(run == 0)[0][1])])
    entry, wait0, wait1, end = (run[..., j].astype(np.int64) for j in range(STAMP_WORDS))
    entry, wait0 = ~entry, ~wait0
    flat = end.reshape(-1)
    for s in range(1, run.shape[0]):
      prev = np.concatenate([[flat[s * len(names) - 1]], end[s, :-1]])
      step = collections.defaultdict(lambda: np.zeros(5))
      for i, name in enumerate(names):
        step[name] += (end[s, i] - prev[i], wait0[s, i] - prev[i], end[s, i] - wait0[s, i], prev[i] - entry[s, i],
                       wait1[s, i] - wait0[s, i])
      for name, v in step.items(): parts[name].append(v / 1e3)
      spans.append(float(end[s, -1] - flat[s * len(names) - 1]) / 1e3)
  span = statistics.median(spans)
  count, before = collections.Counter(names), collections.Counter()
  for name, o in zip(names, others, strict=True): before[name] += o
  rows = []
  for name, p in parts.items():
    v, n = np.array(p), count[name]
    part, handoff, work, lead, skew = (float(m) for m in np.median(v, axis=0))
    rows.append({"name": name, "count": n, "us_per_token": part, "us_min": float(v[:, 0].min()),
                 "us_max": float(v[:, 0].max()), "handoff_us": handoff, "work_us": work, "us_per_launch": part / n,
                 "lead_us_per_launch": lead / n, "skew_us_per_launch": skew / n,
                 "others_before": before[name]})
  rows.sort(key=lambda r: -r["us_per_token"])
  for i, r in enumerate(rows): r |= {"rank": i + 1, "share": r["us_per_token"] / span}
  return rows, spans


def step_timeline(jit, var_vals: dict[str, int], steps: int = 16, rounds: int = 5) -> dict:
  """Where a decode step's time goes while its kernels overlap as they do in the step (programmatic launch: each
  native kernel starts while the one before it ends, and waits in GRID_WAIT). The step's launches run as one CUDA graph
  of `steps` steps, with the decode graph's edges (programmatic into the native kernels where the device's graph makes
  them so: model/backends/cuda_graph.py), once with the native kernels built again to stamp themselves (cuda_src
  PRELUDE's Stamp: -DSTAMP) and once as they are, `rounds` times interleaved. -> {"kernels": timeline_rows' rows,
  "span_us": the stamped steps' median span, "stamped_us" and "plain_us": each graph's median time a step,
  host-timed, "programmatic": whether the edges were}; {} off CUDA or where no kernel of the step waits (no native
  kernel). Each part is the step's time from the end of the native launch before it to its own end (not
  what the step would save without it: the next launch's own reads overlap it); the unstamped (tinygrad's own)
  kernels are folded into the hand-off of the stamped launch after them."""
  launches = _launches(jit)
  if not _on_cuda(launches): return {}
  from tinygrad.device import Buffer

  from model.backends.cuda_graph import OverlapGraph, waits
  from model.backends.cuda_src import stamped
  marked = [i for i, (prg, *_) in enumerate(launches) if waits(prg)]
  if not marked: return {}
  device = launches[0][2][0].device
  dev, built = Device[device], {}
  pdl = dev.graph is OverlapGraph
  def stamp(launch: tuple) -> tuple:
    prg, _, bufs, dv = launch
    src = stamped(prg.src[2].arg)
    if src not in built:
      ast = prg.replace(src=prg.src[:2] + (UOp(Ops.SOURCE, arg=src), UOp(Ops.BINARY, arg=dev.compiler.compile(src))))
      built[src] = dev.runtime(ast.to_elf())
    return prg, built[src], bufs, dv
  n = len(marked)
  buf = Buffer(device, steps * n * STAMP_WORDS, dtypes.uint64).ensure_allocated()
  base, at = buf._buf.value, {i: j for j, i in enumerate(marked)}
  names = [ansistrip(launches[i][0].arg.name) for i in marked]
  others = [i - p - 1 for p, i in zip([marked[-1] - len(launches)] + marked[:-1], marked, strict=True)]
  stamped_launches = [stamp(lc) if i in at else lc for i, lc in enumerate(launches)]
  slots = [base + (s * n + at[i]) * STAMP_WORDS * 8 if i in at else None
           for s in range(steps) for i in range(len(launches))]
  plain = _cuda_graph(launches * steps, var_vals, programmatic=pdl)
  timed = _cuda_graph(stamped_launches * steps, var_vals, programmatic=pdl, slots=slots)
  zero = memoryview(bytearray(buf.nbytes))
  words, times = [], collections.defaultdict(list)
  for g in (plain, timed): g()  # warm
  dev.synchronize()
  for _ in range(rounds):
    for name, g in (("plain", plain), ("stamped", timed)):
      if g is timed: dev.allocator._copyin(buf._buf, zero)
      dev.synchronize()
      t0 = time.perf_counter()
      g()
      dev.synchronize()
      times[name].append((time.perf_counter() - t0) / steps * 1e6)
    words.append(buf.numpy().reshape(steps, n, STAMP_WORDS).copy())
  rows, spans = timeline_rows(names, others, words)
  return {"kernels": rows, "span_us": statistics.median(spans), "stamped_us": statistics.median(times["stamped"]),
          "plain_us": statistics.median(times["plain"]), "steps": steps, "rounds": rounds, "programmatic": pdl}
