"""Per-kernel profile of one decode step: the captured JIT's own kernels (the compiled programs and buffers the timed graph
runs), each launched again outside the graph and timed on the device.

The launches of one kernel name run back to back, in the step's order over the layers, `reps` times, between two
synchronisations: no launch waits for the host, and a kernel that reads a different weight in every layer reads it from
memory as the step does, not from a cache warmed by repeating one launch. What a name costs per token is its mean launch
time times its launches per step. The graph's own scheduling, the dependencies between kernels and the host's share are
what the timed step costs beyond the sum of these (the evaluator reports both). A kernel shorter than the host's launch
time (a few µs in Python) shows that launch time instead: those rows are marked `host_bound`.
"""
from __future__ import annotations

import collections
import time

from tinygrad import Device
from tinygrad.engine.realize import get_graph_runtime, get_runtime, resolve_params, unwrap_multi
from tinygrad.helpers import ansistrip
from tinygrad.uop.ops import Ops, sym_infer


def _launches(jit) -> list[tuple]:
  """(program, runtime, buffers, device vars) of every kernel one replay of a captured JIT runs, in order. Kernels that read
  the JIT's inputs directly (outside a graph) are left out: their buffers exist only during a call."""
  out = []
  for call in jit.captured.linear.src:
    ast = call.src[0]
    if ast.op is Ops.CUSTOM_FUNCTION and ast.arg == "graph":
      if (rt := get_graph_runtime(ast)) is None: continue
      out += [(prg, runtime, bufs, dv) for (_, prg, bufs, dv), runtime in zip(rt.calls, rt.runtimes, strict=True) if prg.op is Ops.PROGRAM]
    elif ast.op is Ops.PROGRAM:
      try: resolved = resolve_params(call, ())
      except (IndexError, KeyError, AttributeError): continue
      for bufs, dv in unwrap_multi(call, [resolved[i] for i in ast.arg.globals]):
        out.append((ast, get_runtime(bufs[0].device, ast), [b.ensure_allocated() for b in bufs], dv))
  return out


def kernel_profile(jit, var_vals: dict[str, int], bandwidth_gbs: float | None = None, reps: int = 3, host_us: float = 6.0) -> list[dict]:
  """Kernels of the step by device time per token: name, launches per step, µs per token, µs per launch, GB/s (tinygrad's
  byte estimate over the time), share of the summed kernel time, and of the measured bandwidth where it is given."""
  groups: dict[str, list[tuple]] = collections.defaultdict(list)
  for launch in _launches(jit): groups[ansistrip(launch[0].arg.name)].append(launch)
  dev = Device[Device.DEFAULT]
  rows = []
  for name, ls in groups.items():
    args = [(runtime, [b.get_buf(b.device) for b in bufs], *prg.arg.launch_dims({**var_vals, **dv}), prg.arg.vals({**var_vals, **dv}))
            for prg, runtime, bufs, dv in ls]
    for runtime, bufs, gs, lsz, vals in args: runtime(*bufs, global_size=gs, local_size=lsz, vals=vals)  # warm: compiled, resident
    dev.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
      for runtime, bufs, gs, lsz, vals in args: runtime(*bufs, global_size=gs, local_size=lsz, vals=vals)
    dev.synchronize()
    per_launch = (time.perf_counter() - t0) / (reps * len(ls)) * 1e6
    sink = ls[0][0].src[0]
    est = sink.arg.estimates if sink.op is Ops.SINK and sink.arg is not None else None
    mem = float(sym_infer(est.mem, {**var_vals, **ls[0][3]})) if est is not None else None
    rows.append({"name": name, "count": len(ls), "us_per_token": per_launch * len(ls), "us_per_launch": per_launch,
                 "gb_s": mem / per_launch / 1e3 if mem else None, "host_bound": per_launch < host_us})
  total = sum(r["us_per_token"] for r in rows) or 1.0
  rows.sort(key=lambda r: -r["us_per_token"])
  for i, r in enumerate(rows):
    r |= {"rank": i + 1, "share": r["us_per_token"] / total,
          "bandwidth_share": r["gb_s"] / bandwidth_gbs if r["gb_s"] and bandwidth_gbs else None}
  return rows
