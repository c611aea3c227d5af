"""What one trial asks for (TrialSpec) and what it returns (TrialResult), as JSON-able data shared by both processes."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from model.workload import Workload

STAGES = ("block", "full")


@dataclass(frozen=True)
class TrialSpec:
  """One decode benchmark of one config on one model file and device."""
  model: str  # GGUF path
  # a StructureConfig as a dict (validated in the trial process: a bad one is an invalid_config result)
  config: dict[str, Any]
  device: str
  stage: str = "full"
  layers: int | None = None  # blocks to build; None: all of them (set by the ladder for stage "block")
  prompt_len: int = 32  # the workload's prompt (model/workload.py)
  n: int = 32  # tokens per measured round
  rounds: int = 3
  warmup: int = 3
  check_positions: int = 16  # teacher-forced decode positions compared against the reference
  reference: str | None = None  # the reference .npz to check against; None: no correctness gate
  # the exact (baseline) reference .npz for the accuracy figures, where `reference` is a twin's; None: it is exact
  exact_reference: str | None = None
  # make the reference of this config (the baseline, or a twin) and save it here: its check path's run along its greedy
  # tokens (evaluator/gate.py make_reference)
  write_reference: str | None = None
  # with write_reference: then go on as a trial checked against it (`reference`, the same file) and measured, in this
  # process (a config that is its own twin: one process start and weight load for both); False: make it and stop
  trial_after_reference: bool = False
  bandwidth_gbs: float | None = None  # the device's measured streaming bandwidth, for the share figure
  profile: bool = False  # add a per-kernel profile from a separate, unjitted pass
  # build and time the prefill graph (prefill tok/s); without it the prompt goes through decode steps
  prefill: bool = True
  max_context: int = 256  # the KV cache's positions (an Evaluator's spec: its workload's, Workload.cache_positions)
  # the workload's context: positions in the cache when decode timing begins (0: right after the prompt)
  context: int = 0
  # directory of tinygrad's cache (CACHEDB: BEAM choices, compiled programs); None: tinygrad's own
  tinygrad_cache: str | None = None
  # BEAM search seconds per trial, past which kernels not in the cache get BEAM=0's heuristics; 0: no limit
  beam_budget_s: float = 0.0

  def to_json(self) -> str: return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> TrialSpec: return cls(**json.loads(text))

  @property
  def workload(self) -> Workload: return Workload(self.prompt_len, self.context)

  @property
  def decoded(self) -> int:
    """Positions a trial decodes past the workload's depth: the check's, a round's, the warm-up's and the compile's."""
    return max(self.check_positions, self.n, self.warmup, 2)


@dataclass
class TrialResult:
  # "ok", or why the trial did not produce a trustworthy figure: invalid_config, compile_error, runtime_error, oom,
  # killed (SIGKILL from outside with no sign of running out of memory), timeout, wrong_output; killed and timeout say
  # nothing lasting about the config
  status: str
  spec: dict[str, Any]
  # tok_s (median) and its spread, ms/token, kernels, bytes, GB/s, memory, ...
  metrics: dict[str, Any] = field(default_factory=dict)
  # seconds: process, load, reference (where the trial makes its own), prefill, compile, check, warmup, measure,
  # profile
  phases: dict[str, float] = field(default_factory=dict)
  check: dict[str, Any] = field(default_factory=dict)  # correctness numbers against the reference
  env: dict[str, Any] = field(default_factory=dict)  # device name, tinygrad version and git state, python, host
  profile: list[dict[str, Any]] = field(default_factory=list)  # top kernels by time per token
  # with the profile, where the step's native kernels overlap (programmatic launch): each one's part of the step, as
  # they ran stamped (model/profile.py step_timeline)
  timeline: dict[str, Any] = field(default_factory=dict)
  # with the profile and a timed prefill: the prefill graph's kernels, a row's time per graph call (a chunk of
  # metrics["prefill_chunk"] tokens at position metrics["prefill_profile_at"])
  prefill_profile: list[dict[str, Any]] = field(default_factory=list)
  error: str = ""  # error text of a failure (last lines of the traceback or of stderr)
  phase: str = ""  # the phase the trial was in when it ended

  @property
  def ok(self) -> bool: return self.status == "ok"

  @property
  def tok_s(self) -> float | None: return self.metrics.get("tok_s") if self.ok else None

  @property
  def cost_s(self) -> float:
    """What the run cost: its process's wall seconds plus the setup paid before it (references made in processes of
    their own, the bandwidth figure)."""
    return self.phases.get("wall_s", 0.0) + self.phases.get("setup_s", 0.0)

  def to_dict(self) -> dict[str, Any]: return dataclasses.asdict(self)
  def to_json(self) -> str: return json.dumps(self.to_dict())

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> TrialResult: return cls(**d)
