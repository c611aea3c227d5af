"""StructureConfig: the structural build options of the model, as data, each declared once as a knob beside its field.

The default is the baseline. Every field changes real code paths in `model/`. A field's declaration (`knob(...)`, or a
`Table` of knobs for a dict field) holds everything else derives from: the space's knob rows and Optuna names
(space/knobs.py), the CLI's `--fix`/`--where` spellings, the views' columns and the gate's precision class. Adding a
knob is its field here and the model code that reads it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tomli_w

from model.backends import catalog
from model.backends.catalog import QUANT_NAMES, ROLES, STAGES
from model.errors import ConfigError

SCHEMA_VERSION = 3
# fields removed since an earlier schema version, dropped when a stored config of that version is read
REMOVED_FIELDS = {1: ("mv_blocksize", "mv_threads_per_row", "mv_rows_per_thread")}
GPU_DEVICES = ("CUDA", "NV", "AMD", "METAL", "CL", "QCOM", "WEBGPU")  # renderers with local (workgroup) dims
GRAPH_DEVICES = ("CUDA", "NV", "AMD", "METAL")  # devices whose JIT batches kernels into graphs
Info = Any  # what `applies` reads of a model file: space.knobs.ModelInfo


@dataclass(frozen=True)
class Knob:
  """One knob: its default, the values the search tries (`choices`: a tuple, or a function of the device and the backend
  family), what it changes (`doc`), when it applies, and the precision class of its values other than the default
  (`fp32`: float32 work reordered; `fp16`: rounded to fp16 where the baseline is not; `x16`: activations held to 16 bits
  in two 8-bit planes, checked as fp32; `q8`: 8-bit activations or KV cache, checked against their twin; or a function
  of the value). When it applies: `applies(info)` on the model file; `stages`: the fused stages that replace the per-op
  code it changes (it applies while one of them runs per op, or on a backend that `keeps` it); `fused_in`: it applies
  only while one of these stages is fused (by backend `on`, where given: a name, or a function of the model file that
  gives one or None); `needs`: (knob, condition on its value, a value that meets it) for each knob whose value it needs
  (all of them); `devices`: the device kinds it applies on. `allowed`: what a config may hold where that is more than
  the choices; `env`: the tinygrad variable it sets in a trial process. `name`, `field` and `key` come from where it is
  declared."""
  default: Any
  choices: tuple | Callable[[str, str], tuple]
  doc: str
  applies: Callable[[Info], bool] = lambda m: True
  stages: tuple[str, ...] = ()
  fused_in: tuple[str, ...] = ()
  on: str | Callable[[Info], str | None] | None = None
  needs: tuple[tuple[str, Callable[[Any], bool], Any], ...] = ()
  devices: tuple[str, ...] | None = None
  precision: str | Callable[[Any], str] = "fp32"
  allowed: tuple | Callable[[], tuple] | None = None
  env: str | None = None
  name: str = ""
  field: str = ""
  key: str | None = None

  def domain(self, device: str = "CPU", family: str = "all") -> tuple:
    """The values the search tries on this device with this backend family."""
    return self.choices(device, family) if callable(self.choices) else self.choices

  def valid(self) -> tuple:
    """The values a config may hold."""
    allowed = self.allowed if self.allowed is not None else self.choices
    return allowed() if callable(allowed) else allowed

  def value(self, cfg: StructureConfig) -> Any:
    v = getattr(cfg, self.field)
    return v if self.key is None else v.get(self.key, self.default)

  def precision_of(self, value: Any) -> str:
    if value == self.default: return "fp32"
    return self.precision(value) if callable(self.precision) else self.precision


@dataclass(frozen=True)
class Table:
  """The knobs of a dict field, one per key, named `<prefix>.<key>` (a `:` in the key written `.`). `sparse`: the dict
  holds only the keys off their default (else every key, the unnamed ones at their defaults); `what` names a key in
  errors."""
  prefix: str
  knobs: dict[str, Knob]
  what: str
  sparse: bool = True


def knob(default: Any, choices: tuple | Callable[[str, str], tuple], doc: str, **kw) -> Any:
  """A field declared as a knob (see Knob)."""
  return field(default=default, metadata={"knob": Knob(default, choices, doc, **kw)})


def table(t: Table) -> Any:
  """A dict field declared as a table of knobs."""
  full = {k: v.default for k, v in t.knobs.items()}
  return field(default_factory=lambda: {} if t.sparse else dict(full), metadata={"table": t})


def _backend_precision(name: str) -> str: return catalog.get(name).precision


_moe = lambda m: m.moe
_dense_ffn = lambda m: m.dense_blocks or not m.moe


def _ffn_acts(device: str, family: str) -> tuple[str, ...]:
  """ffn_act's values, the faster first (a climb tries them in this order): x16 only where a device-specific backend can
  run the fused FFN (its integer dot products are what x16 is for; a portable backend rounds its input the same way, but
  its products stay float32: none faster)."""
  native = any(not catalog.get(n).portable for n in catalog.stage_choices("moe", device, family))
  return ("float32", "q8", "x16") if native else ("float32", "q8")


def _q8_on(quants: Callable[[Info], tuple[str, ...]]) -> Callable[[Info], str | None]:
  """The backend an 8-bit activation knob runs on for a model file: any that fuses its stages (None) where all of them
  dot the weights' types with 8-bit activations, else the first that does (catalog q8_quants)."""
  def on(m: Info) -> str | None:
    run = catalog.q8_backends(quants(m))
    return None if set(run) >= {n for n in catalog.names() if catalog.get(n).stages} else run[0]
  return on


# a split point: nothing, a kernel boundary (.contiguous()), an execution barrier (.realize())
BARRIER_MODES = ("none", "contiguous", "realize")


def _point(p: str, default: str, stages: tuple[str, ...], applies: Callable[[Info], bool] = lambda m: True,
           choices: tuple[str, ...] = BARRIER_MODES) -> tuple[str, Knob]:
  return p, Knob(default, choices, f"kernel boundary (contiguous) or execution barrier (realize) at {p}", applies,
                 stages, allowed=BARRIER_MODES)


# split points where the model may place a kernel boundary or an execution barrier; where tinygrad's scheduler already
# ends a kernel, "none" and "contiguous" build identical kernels (tests/test_space.py compares kernel sources), so those
# points offer one of the two
BARRIERS = dict((
  _point("q_proj", "none", ("attention",), choices=("none", "realize")),
  _point("kv_a", "none", ("attention",), choices=("none", "realize")),
  _point("attn_out", "none", ("attention",)),
  _point("router_logits", "none", ("router",), _moe),
  _point("moe_gate_up", "contiguous", ("moe",), _moe),
  _point("expert_down", "none", ("moe",), _moe),
  _point("moe_out", "none", ("moe",), _moe),
  _point("shexp_gate_up", "contiguous", ("moe",), lambda m: m.shared_experts),
  _point("dense_gate_up", "contiguous", ("ffn",), _dense_ffn, ("contiguous", "realize")),
  # bounds the per-op FFN's output
  _point("block_out", "contiguous", ("moe", "ffn"), choices=("contiguous", "realize")),
  _point("kv_write", "none", ("attention",), choices=("none", "realize")),
))
DEFAULT_BARRIERS = {p: k.default for p, k in BARRIERS.items()}
# the fused stages a model has, and what each needs of the file: attention the split k_b/v_b tensors, moe and ffn one
# type for gate and up (their kernels read both rows in one pass)
FUSED_APPLIES: dict[str, Callable[[Info], bool]] = {
  "attention": lambda m: m.split_kv_b, "router": _moe,
  "moe": lambda m: m.moe and "routed" in m.mergeable and (not m.shared_experts or "shared" in m.mergeable),
  "ffn": lambda m: _dense_ffn(m) and "dense" in m.mergeable}
FUSED = {st: Knob("off", lambda d, f, st=st: ("off", *catalog.stage_choices(st, d, f)),
                  f"decode {st} as fused kernels of a backend (model/backends/catalog.py STAGES), or per op",
                  FUSED_APPLIES[st], precision=_backend_precision,
                  allowed=lambda st=st: tuple(n for n in catalog.names() if st in catalog.get(n).stages))
         for st in STAGES}
# per-weight kernel backends, keyed "<QUANT>:<role>"; the expert weights are read by the fused moe stage itself where
# it runs
BACKENDS = {f"{q}:{r}": Knob(catalog.DEFAULT, lambda d, f, q=q, r=r: catalog.choices(q, r, d, f),
                             f"kernel backend for {q} {r} weights", lambda m, q=q, r=r: q in m.quants.get(r, ()),
                             stages=("moe",) if r == "expert" else (), precision=_backend_precision,
                             allowed=lambda r=r: tuple(n for n in catalog.names() if r in catalog.get(n).roles))
            for r in ROLES for q in sorted(QUANT_NAMES)}
# output rows per thread of the dsl backend's products in its fused stages, keyed by product: one read of the input
# serves a thread's rows, and fewer threads share the launch (model/backends/dsl.py `_rows`)
DSL_PRODUCTS = {"qkv_a": ("attention",), "attn_out": ("attention",), "gate_up": ("moe", "ffn"), "down": ("moe", "ffn")}
DSL_ROWS = {p: Knob(4 if p == "gate_up" else 1, (1, 2, 4),
                    f"output rows per thread of the dsl {p} product (its UPCAST)", fused_in=st, on="dsl")
            for p, st in DSL_PRODUCTS.items()}
_beam = ("beam", lambda b: b > 0, 2)  # BEAM's settings apply when BEAM searches (a width of 2 shows them)
_grouped = ("prefill_ffn", lambda v: v == "grouped", "grouped")  # grouped prefill's settings apply with it
_runtime = ("mla_absorb", lambda v: v == "runtime", "runtime")  # q's nope rows as projected, not folded into k_b
# grouped prefill's tinygrad forms, which dequantise the weights into prefill_dtype (quantised: CUDA kernels read them)
_dequantised = ("prefill_weights", lambda v: v != "quantised", "indexed")


# the prompt's attention in tinygrad's kernels, whose dtype prefill_attn_dtype sets (all_heads stages float16 itself)
_tinygrad_attention = ("prefill_attention", lambda v: v != "all_heads", "absorbed")


def _with_native(stage: str, values: tuple[str, ...], native: str) -> Callable[[str, str], tuple[str, ...]]:
  """A prefill knob's values on a device and backend family: `values`, and `native` (a value the native backend's
  kernels run) where the family's native backend runs `stage` on that device."""
  return lambda device, family: ((*values, native) if "native" in catalog.stage_choices(stage, device, family)
                                 else values)


@dataclass(frozen=True)
class StructureConfig:
  fused: dict[str, str] = table(Table("fused", FUSED, "stage"))  # decode stage -> backend; absent: the per-op path
  ffn_act: str = knob("float32", _ffn_acts,
                      "the fused FFN stages' activations: float32; q8, rounded to 8 bits per 32 with integer dot "
                      "products (llama.cpp's mmvq); or x16, held to 16 bits as two 8-bit planes per 32 with integer "
                      "dot products at twice q8's count (offered where a device-specific backend runs the FFN)",
                      applies=lambda m: bool(catalog.q8_backends(m.ffn_quants)), fused_in=("moe", "ffn"),
                      on=_q8_on(lambda m: m.ffn_quants), precision=lambda v: "q8" if v == "q8" else "x16",
                      allowed=("float32", "q8", "x16"))
  attn_act: str = knob("float32", ("float32", "q8"),
                       "the fused attention's dense products' input (q_a and kv_a, q_b, the output projection): "
                       "float32, or q8, rounded to 8 bits per 32 with integer dot products (llama.cpp's mmvq)",
                       applies=lambda m: bool(catalog.q8_backends(m.attn_quants)), fused_in=("attention",),
                       on=_q8_on(lambda m: m.attn_quants), precision="q8")
  backends: dict[str, str] = table(Table("backend", BACKENDS, "<QUANT>:<role>"))  # absent: catalog.DEFAULT
  dsl_rows: dict[str, int] = table(Table("dsl_rows", DSL_ROWS, "product"))  # absent: its default
  barriers: dict[str, str] = table(Table("barrier", BARRIERS, "point", sparse=False))
  merge_gate_up_routed: bool = knob(False, (False, True), "routed FFN gate and up as one matrix",
                                    applies=lambda m: "routed" in m.mergeable, stages=("moe",))
  merge_gate_up_shared: bool = knob(False, (False, True), "shared FFN gate and up as one matrix",
                                    applies=lambda m: "shared" in m.mergeable, stages=("moe",))
  merge_gate_up_dense: bool = knob(False, (False, True), "dense FFN gate and up as one matrix",
                                   applies=lambda m: "dense" in m.mergeable, stages=("ffn",))
  topk: str = knob("pairwise", ("pairwise", "sort", "argmax"),
                   "top-k routing: pairwise comparison matrix, sort-based, or k argmax passes", applies=_moe,
                   stages=("router",))
  mla_absorb: str = knob("runtime", ("runtime", "load"),
                         "apply k_b per token, or absorb it into the q projection at load (fp16)",
                         stages=("attention",), precision="fp16")
  attn_layout: str = knob("per_head", ("per_head", "all_heads"),
                          "the fused attention's decode over the compressed cache: per_head, its workgroups a head "
                          "each; or all_heads, a workgroup per split of the context reads each position once for all "
                          "heads (on tensor cores where the backend has them), its splits merged once",
                          fused_in=("attention",), precision="fp16")
  prefill_ffn: str = knob("per_token", ("per_token", "grouped"),
                          "the prompt's FFN products over a chunk of tokens: per_token, each token's own, its experts "
                          "gathered and dequantised inside the product as in decode; or grouped, the chunk's (token, "
                          "expert) pairs grouped by expert in tiles, each product a batched matmul of dequantised "
                          "weights, the shared expert's and the dense FFN's plain matmuls (model/prefill.py)")
  prefill_weights: str = knob("indexed", _with_native("moe", ("indexed", "copied"), "quantised"),
                              "how grouped prefill's products read the weights: indexed, every expert dequantised "
                              "once per chunk (into prefill_dtype) and read per row by its tile's expert; copied, "
                              "each tile's expert dequantised into a matrix of its own, read by a plain batched "
                              "matmul; or quantised (offered where a device-specific backend runs the MoE stage), "
                              "CUDA kernels that read the quantised weights a stage at "
                              "a time, dequantise them into shared memory as float16 and multiply on the tensor cores "
                              "(model/backends/cuda_prefill.py; the shared expert's and the dense FFN's products too)",
                              applies=_moe, needs=(_grouped,), allowed=("indexed", "copied", "quantised"),
                              precision=lambda v: "fp16" if v == "quantised" else "fp32")
  prefill_dtype: str = knob("float32", ("float32", "float16"),
                            "the dtype grouped prefill dequantises the FFN weights to and multiplies in (float16: "
                            "tensor cores where the device has them; sums in float32)", needs=(_grouped, _dequantised),
                            precision="fp16")
  prefill_tile: int = knob(16, (16, 32, 64), "rows of a tile of grouped prefill's expert products: each expert's pairs "
                           "padded to whole tiles (more rows: fewer tiles and weight reads, more padding)",
                           applies=_moe, needs=(_grouped,))
  prefill_chunk: int = knob(32, (32, 512),
                            "prompt tokens per grouped prefill graph call (the last chunk padded): a chunk dequantises "
                            "its weights once for all its tokens (per token, a token reads its experts on its own and "
                            "a larger chunk only pads a short prompt more)", needs=(_grouped,))
  prefill_dense: str = knob("per_token", ("per_token", "batched"),
                            "the prompt's attention products over a chunk (q_a, q_b, kv_a, the output projection, and "
                            "per head k_b's absorption and v_b): "
                            "per_token, the weight's backend's products as in decode; or batched, one product for the "
                            "chunk's tokens as grouped prefill's dense FFN (prefill_weights' form and prefill_dtype)",
                            needs=(_grouped,))
  prefill_attention: str = knob("absorbed", _with_native("attention", ("absorbed", "decompressed"), "all_heads"),
                                "the prompt's MLA attention over a chunk: absorbed, as decode, each query absorbed "
                                "into kv_lora dims scoring the compressed cache rows; decompressed, each head's "
                                "keys and values decompressed from those rows once per chunk, then attention at "
                                "qk_nope + rope and v_head dims (model/prefill.py); or all_heads (offered where a "
                                "device-specific backend runs the attention stage), the absorbed form in the all-heads "
                                "decode kernels, each position read once for all the heads of a token on the tensor "
                                "cores, a token a grid row (model/backends/cuda_prefill.py)",
                                needs=(_runtime,), allowed=("absorbed", "decompressed", "all_heads"),
                                precision=lambda v: "fp16" if v == "all_heads" else "fp32")
  prefill_attn_tokens: int = knob(1, (1, 2), "the tokens of a chunk whose queries one block of the all-heads prompt "
                                  "attention holds: their heads are its rows, so each staged piece of the cache serves "
                                  "them all (MMA rows: GLM-4.7-Flash's 20 heads fill 20 of 32, two tokens' 40 of 48)",
                                  needs=(("prefill_attention", lambda v: v == "all_heads", "all_heads"),))
  prefill_attn_dtype: str = knob("float32", ("float32", "float16"),
                                 "the dtype the prompt's attention over a chunk multiplies in, either tinygrad form "
                                 "(float16: tensor cores where the device has them, the decompressed keys and values "
                                 "held in it; sums and the softmax in float32)", needs=(_tinygrad_attention,),
                                 precision="fp16")
  kv_dtype: str = knob("float16", ("float16", "float32", "q8_0"),
                       "KV cache dtype: float16, float32, or q8_0, llama.cpp's -ctk q8_0 (blocks of 32 int8 codes "
                       "and a float16 scale: 34 bytes per 32 values), which only the per-op attention reads",
                       stages=("attention",), needs=(("prefill_attention", lambda v: v != "all_heads", "absorbed"),),
                       precision=lambda v: "q8" if v == "q8_0" else "fp16")
  attention: str = knob("explicit", ("explicit", "sdpa"), "explicit matmul+softmax or scaled_dot_product_attention",
                        stages=("attention",))
  act_dtype: str = knob("float32", ("float16", "float32"), "residual stream dtype", precision="fp16")
  router_fp32: bool = knob(True, (True, False), "router matmul input in float32", applies=_moe, stages=("router",),
                           precision="fp16")
  beam: int = knob(0, (0, 1, 2, 4, 8), "BEAM width for the decode kernels")
  beam_upcast_max: int = knob(256, (64, 128, 256),
                              "tinygrad BEAM_UPCAST_MAX: largest upcast a BEAM candidate may apply", needs=(_beam,),
                              env="BEAM_UPCAST_MAX")
  beam_local_max: int = knob(1024, (256, 512, 1024), "tinygrad BEAM_LOCAL_MAX: largest local (workgroup) size",
                             needs=(_beam,), devices=GPU_DEVICES, env="BEAM_LOCAL_MAX")
  beam_min_progress: float = knob(0.01, (0.01, 1.0, 5.0),
                                  "tinygrad BEAM_MIN_PROGRESS: BEAM stops when the best candidate gains less (µs)",
                                  needs=(_beam,), env="BEAM_MIN_PROGRESS")
  jit_batch_size: int = knob(32, (0, 8, 32, 128),
                             "tinygrad JIT_BATCH_SIZE: kernels in the first JIT graph batch, doubling after (0: one "
                             "graph)", devices=GRAPH_DEVICES, env="JIT_BATCH_SIZE")
  schema_version: int = SCHEMA_VERSION

  def __post_init__(self):
    if self.schema_version != SCHEMA_VERSION:
      raise ConfigError(f"schema_version={self.schema_version} is not supported (expected {SCHEMA_VERSION})")
    # JSON/TOML may write 1.0 as 1
    if isinstance(self.beam_min_progress, int) and not isinstance(self.beam_min_progress, bool):
      object.__setattr__(self, "beam_min_progress", float(self.beam_min_progress))
    for f in dataclasses.fields(self):
      if "table" in f.metadata: self._check_table(f.name, f.metadata["table"])
    for k in KNOBS.values():
      if k.key is None: _check(k.name, getattr(self, k.name), k.valid())
    if "attention" in self.fused and self.mla_absorb != "runtime":
      raise ConfigError("fused.attention absorbs k_b per token: it needs mla_absorb=runtime")
    if self.prefill_attention == "decompressed" and self.mla_absorb != "runtime":
      raise ConfigError("prefill_attention=decompressed reads q's nope rows, which mla_absorb=load folds into k_b: it "
                        "needs mla_absorb=runtime")
    if "moe" in self.fused and (k := next((k for k in self.backends if k.endswith(":expert")), None)):
      raise ConfigError(f"backends.{k} does not apply with fused.moe: the fused stage reads the expert weights itself")
    for key in self.dsl_rows:
      if not any(self.fused.get(st) == "dsl" for st in DSL_PRODUCTS[key]):
        raise ConfigError(f"dsl_rows.{key} is read by the dsl backend's {' or '.join(DSL_PRODUCTS[key])} stage only: "
                          f"set fused.{DSL_PRODUCTS[key][0]}=dsl")
    if self.ffn_act != "float32" and not {"moe", "ffn"} & set(self.fused):
      raise ConfigError(f"ffn_act={self.ffn_act} is read by the fused FFN stages only: set fused.moe or fused.ffn")
    if self.prefill_weights == "quantised" and self.prefill_dtype != "float32":
      raise ConfigError("prefill_dtype is read by grouped prefill's tinygrad forms; prefill_weights=quantised always "
                        "multiplies in float16 (unset prefill_dtype)")
    if self.prefill_attention == "all_heads" and self.prefill_attn_dtype != "float32":
      raise ConfigError("prefill_attn_dtype is read by the prompt's attention in tinygrad's kernels; "
                        "prefill_attention=all_heads stages float16 itself (unset prefill_attn_dtype)")
    if self.prefill_attention == "all_heads" and self.kv_dtype == "q8_0":
      raise ConfigError("prefill_attention=all_heads reads a float cache: choose kv_dtype float16 or float32")
    if self.kv_dtype == "q8_0" and "attention" in self.fused:
      raise ConfigError("kv_dtype=q8_0 is read by the per-op attention only: the fused attention stages read a float "
                        "cache (unset fused.attention, or choose kv_dtype float16 or float32)")
    if self.attn_act != "float32" and "attention" not in self.fused:
      raise ConfigError(f"attn_act={self.attn_act} is read by the fused attention stage only: set fused.attention")

  def _check_table(self, name: str, t: Table) -> None:
    d = getattr(self, name)
    for key, v in d.items():
      _check(f"{name} {t.what}", key, tuple(t.knobs))
      _check(f"{name}.{key}", v, t.knobs[key].valid())
    # unnamed keys keep their default
    if not t.sparse: object.__setattr__(self, name, {k: d.get(k, knob.default) for k, knob in t.knobs.items()})

  def backend(self, quant: str, role: str) -> str: return self.backends.get(f"{quant}:{role}", catalog.DEFAULT)
  def stage(self, name: str) -> str | None: return self.fused.get(name)
  def rows(self, product: str) -> int: return self.dsl_rows.get(product, DSL_ROWS[product].default)

  def non_defaults(self) -> dict[str, Any]:
    """The fields that differ from their defaults (of a table, the entries that do), schema_version aside."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(self):
      if f.name == "schema_version": continue
      v = getattr(self, f.name)
      if "table" in f.metadata: v = {k: x for k, x in v.items() if x != f.metadata["table"].knobs[k].default}
      if v != ({} if "table" in f.metadata else f.default): out[f.name] = v
    return out

  @property
  def hash(self) -> str:
    """The config's identity in a study: the first 16 hex digits of the SHA-256 of its non-default fields as JSON, so a
    knob added later (at its default) leaves every stored config's hash as it was (db migration 0005 re-keyed the
    rows hashed before over every field)."""
    return hashlib.sha256(json.dumps(self.non_defaults(), sort_keys=True).encode()).hexdigest()[:16]

  def precision(self) -> set[str]:
    """The precision classes of its knob values (see Knob): {"fp32"} where it only reorders float32 work."""
    return {k.precision_of(k.value(self)) for k in KNOBS.values()}

  def process_env(self) -> dict[str, str]:
    """The tinygrad environment variables of a trial process (BEAM itself is scoped to decode by model.generate)."""
    return {var: str(getattr(self, f)) for f, (var, _) in PROCESS_SETTINGS.items()}

  def to_dict(self) -> dict[str, Any]: return dataclasses.asdict(self)
  def to_json(self) -> str: return json.dumps(self.to_dict(), sort_keys=True)
  def to_toml(self) -> str: return tomli_w.dumps(self.to_dict())

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> StructureConfig:
    if isinstance(v := d.get("schema_version"), int) and v < SCHEMA_VERSION:  # a stored config of an earlier schema
      d = {k: x for k, x in d.items() if k not in {f for old in range(v, SCHEMA_VERSION)
                                                   for f in REMOVED_FIELDS.get(old, ())}}
      d["schema_version"] = SCHEMA_VERSION
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown: raise ConfigError(f"unknown field(s) {', '.join(sorted(unknown))}; known: "
                                  f"{', '.join(f.name for f in dataclasses.fields(cls))}")
    return cls(**d)

  @classmethod
  def from_json(cls, text: str) -> StructureConfig:
    try: d = json.loads(text)
    except json.JSONDecodeError as e: raise ConfigError(f"config is not valid JSON: {e}") from None
    if not isinstance(d, dict): raise ConfigError("config must be a JSON object")
    return cls.from_dict(d)

  @classmethod
  def from_toml(cls, text: str) -> StructureConfig:
    try: return cls.from_dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e: raise ConfigError(f"config is not valid TOML: {e}") from None

  @classmethod
  def load(cls, path: str) -> StructureConfig:
    try: text = open(path).read()
    except OSError as e: raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    return cls.from_toml(text) if path.endswith(".toml") else cls.from_json(text)


def _check(name: str, value: Any, allowed: tuple) -> None:
  ok = value in allowed and (isinstance(value, bool) or not any(isinstance(a, bool) for a in allowed))
  if not ok: raise ConfigError(f"{name}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def _declared() -> dict[str, Knob]:
  """Every knob of StructureConfig by its name, in the order of the fields (a table's knobs in its keys' order)."""
  out = {}
  for f in dataclasses.fields(StructureConfig):
    if "knob" in f.metadata: out[f.name] = dataclasses.replace(f.metadata["knob"], name=f.name, field=f.name)
    elif "table" in f.metadata:
      t = f.metadata["table"]
      for key, k in t.knobs.items():
        name = f"{t.prefix}.{key.replace(':', '.')}"
        out[name] = dataclasses.replace(k, name=name, field=f.name, key=key)
  return out


KNOBS = _declared()
K = TypeVar("K")
# field -> (tinygrad variable, allowed values)
PROCESS_SETTINGS = {k.field: (k.env, k.valid()) for k in KNOBS.values() if k.env}


def knob_named(text: str, among: dict[str, K] = KNOBS) -> K:
  """The knob a user names (`--fix`, `--where`) among `among` (default: every declared knob; space.knobs: a space's
  rows), with `backend.Q4_0:expert`, as configs key their backends, read as `backend.Q4_0.expert`."""
  name = text.replace(":", ".")
  if name not in among: raise ConfigError(f"unknown knob {text!r}; knobs: {', '.join(among)}")
  return among[name]
