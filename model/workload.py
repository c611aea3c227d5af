"""What a decode benchmark runs, the same for a trial, `model bench` and the production config chosen under it: the
prompt prefilled (and timed) before decoding and the context, the positions in the KV cache when decode timing begins;
and the device memory that takes. Loads no tinygrad: the search parent and the views read it."""
from __future__ import annotations

import re
from dataclasses import dataclass

from model.gguf_file import GGUFFile

PROMPT = 32  # tokens prefilled before decoding, unless a workload says otherwise
# the smallest KV cache a benchmark allocates, in positions: what every study measured with before workloads (a
# native attention kernel's splits follow the cache's size, so a short workload keeps their kernels)
MIN_CACHE = 256
# a KV cache dtype's bytes per value (StructureConfig.kv_dtype): q8_0 holds 32 int8 codes and a float16 scale in 34
KV_BYTES = {"float16": 2.0, "float32": 4.0, "q8_0": 34 / 32}
LINE = re.compile(r"^# workload: context=(\d+) prompt=(\d+)$", re.M)


@dataclass(frozen=True)
class Workload:
  prompt: int = PROMPT
  context: int = 0  # positions in the cache when decode timing begins; 0: right after the prompt

  def __post_init__(self) -> None:
    if self.prompt < 1: raise ValueError(f"a prompt of {self.prompt} tokens: it needs one at least")
    if 0 < self.context < self.prompt:
      raise ValueError(f"a context of {self.context} positions is shorter than the prompt of {self.prompt} tokens, "
                       "which the cache holds when decoding begins")

  @property
  def depth(self) -> int:
    """The position of the first timed decode step: the positions in the cache before it."""
    return max(self.context, self.prompt)

  def cache_positions(self, decoded: int) -> int:
    """The KV cache a benchmark allocates for it, with `decoded` positions after the depth (the steps of a round, of the
    correctness check)."""
    return max(MIN_CACHE, self.depth + decoded)

  def kv_cache_bytes(self, blocks: int, width: int, kv_dtype: str, decoded: int) -> int:
    """Every block's KV cache: blocks x positions x width (kv_lora + rope) x the dtype's bytes."""
    return round(blocks * self.cache_positions(decoded) * width * KV_BYTES[kv_dtype])

  def __str__(self) -> str:
    return f"context {self.depth}, prompt {self.prompt}" + ("" if self.context else " (decode right after it)")

  def line(self) -> str:
    """Its header line in an exported config (`read` parses it back)."""
    return f"# workload: context={self.depth} prompt={self.prompt}"

  @classmethod
  def read(cls, text: str) -> Workload | None:
    """The workload a config's header names (line()); None where it names none (exported before workloads: the
    default's)."""
    return cls(int(m.group(2)), int(m.group(1))) if (m := LINE.search(text)) else None


@dataclass(frozen=True)
class Memory:
  """The device memory a workload takes on a model file, before anything runs: the weights (the file's tensors) and the
  KV cache in each dtype (KV_BYTES)."""
  weights: int
  kv_cache: dict[str, int]
  context_length: int  # the model's own

  @classmethod
  def of(cls, path: str, work: Workload, decoded: int, layers: int | None = None) -> Memory:
    f = GGUFFile(path)
    key = lambda k: int(f.key(k))
    blocks = layers or key("block_count") - int(f.key("nextn_predict_layers", 0))
    width = key("attention.kv_lora_rank") + key("rope.dimension_count")
    return cls(sum(t.nbytes for t in f.tensors.values()),
               {d: work.kv_cache_bytes(blocks, width, d, decoded) for d in KV_BYTES}, key("context_length"))

  def peak(self, kv_dtype: str = "float16") -> int: return self.weights + self.kv_cache[kv_dtype]

  def text(self) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"
    others = ", ".join(f"{gb(self.peak(d))} with {d}" for d in KV_BYTES if d != "float16")
    return (f"weights {gb(self.weights)} + KV cache {gb(self.kv_cache['float16'])} in float16 = {gb(self.peak())} "
            f"({others})")

  def refusal(self, work: Workload, decoded: int, device: str, device_bytes: int | None) -> str | None:
    """Why the workload cannot run on this device (one line), or None: its cache past the model's context length, or
    the baseline's footprint (a float16 cache: a study measures the baseline first) past the device's memory."""
    if (need := work.depth + decoded) > self.context_length:
      return (f"{work} needs {need} positions, past the model's context length of {self.context_length}")
    if device_bytes is not None and self.peak() > device_bytes:
      return f"{work} needs {self.text()}, more than the {device_bytes / 1e9:.2f} GB of {device}"
    return None
