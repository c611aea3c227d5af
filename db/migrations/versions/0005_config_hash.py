"""Config hashes over the non-default fields only (model.structure.StructureConfig.hash), so that a knob added later
leaves stored configs' hashes as they were: every stored hash (trials, measurements, confirmations, study baselines
and Optuna's `config_hash` trial attribute) is re-keyed from its trial's stored config; downgrade writes the hashes over
every field back.

The defaults are frozen here as of this revision (the db package does not import the model's): a config stored before
holds at most these fields, and one missing a field held its default.

Revision ID: 0005_config_hash
Revises: 0004_baseline
Create Date: 2026-11-28
"""
import hashlib
import json

import sqlalchemy as sa
from alembic import op

revision = "0005_config_hash"
down_revision = "0004_baseline"
branch_labels = None
depends_on = None

DEFAULTS = {
  "act_dtype": "float32", "attention": "explicit", "attn_act": "float32", "backends": {},
  "barriers": {"attn_out": "none", "block_out": "contiguous", "dense_gate_up": "contiguous", "expert_down": "none",
               "kv_a": "none", "kv_write": "none", "moe_gate_up": "contiguous", "moe_out": "none", "q_proj": "none",
               "router_logits": "none", "shexp_gate_up": "contiguous"},
  "beam": 0, "beam_local_max": 1024, "beam_min_progress": 0.01, "beam_upcast_max": 256, "dsl_rows": {},
  "ffn_act": "float32", "fused": {}, "jit_batch_size": 32, "kv_dtype": "float16", "merge_gate_up_dense": False,
  "merge_gate_up_routed": False, "merge_gate_up_shared": False, "mla_absorb": "runtime", "router_fp32": True,
  "schema_version": 3, "topk": "pairwise"}
ENTRY_DEFAULT = {"fused": lambda k: "off", "backends": lambda k: "tensor",
                 "dsl_rows": lambda k: 4 if k == "gate_up" else 1, "barriers": lambda k: DEFAULTS["barriers"][k]}


def _digest(d: dict) -> str: return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def new_hash(d: dict) -> str:
  """The hash of a stored config (its JSON as a dict) over its non-default fields."""
  out = {}
  for k, v in d.items():
    if k == "schema_version" or k not in DEFAULTS: continue  # a field removed since held no meaning any more
    if k in ENTRY_DEFAULT: v = {e: x for e, x in v.items() if x != ENTRY_DEFAULT[k](e)}
    if v != ({} if k in ENTRY_DEFAULT else DEFAULTS[k]): out[k] = v
  return _digest(out)


def old_hash(d: dict) -> str:
  """The hash over every field, as revision 0004's code wrote it."""
  full = DEFAULTS | {k: v for k, v in d.items() if k in DEFAULTS}
  full["barriers"] = DEFAULTS["barriers"] | full["barriers"]
  return _digest(full)


def _rekey(rehash) -> None:
  conn = op.get_bind()
  configs = conn.execute(sa.text(
    "SELECT config_json, config_hash FROM ss_trial UNION "
    "SELECT baseline_config, baseline_hash FROM ss_study WHERE baseline_config IS NOT NULL"))
  keys = {}
  for text, h in configs:
    try: d = json.loads(text)
    except ValueError: continue
    if isinstance(d, dict) and (k := rehash(d)) != h: keys[h] = k
  optuna = sa.inspect(conn).has_table("trial_user_attributes")
  for old, new in keys.items():
    for table, col in (("ss_trial", "config_hash"), ("ss_measurement", "config_hash"),
                       ("ss_confirmation", "config_hash"), ("ss_study", "baseline_hash")):
      conn.execute(sa.text(f"UPDATE {table} SET {col} = :new WHERE {col} = :old"), {"new": new, "old": old})
    if optuna:
      conn.execute(sa.text("UPDATE trial_user_attributes SET value_json = :new WHERE key = 'config_hash' AND "
                           "value_json = :old"), {"new": json.dumps(new), "old": json.dumps(old)})


def upgrade() -> None: _rekey(new_hash)


def downgrade() -> None: _rekey(old_hash)
