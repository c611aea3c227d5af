#!/usr/bin/env bash
# End to end A/B of versions of the code: `model bench` of configs under the working tree (new) and under earlier commits
# (old, or other packed trees), interleaved, on full-depth synthetic files, with the native decode kernels of the working
# tree and old timed alone first.
#
#   bash benchmarks/code_ab.sh pack REV [TREE]   # here: REV's tracked code into .ab/TREE [old] (ignored; carry .ab with .whl)
#   bash benchmarks/code_ab.sh run          # on the device: one call, nothing else running
#
# Environment [default]:
#   MODELS    presets written as full-depth synthetic files [glm-4.7-flash deepseek-v2-lite]    QUANT [q4_0]
#   VARIANTS  TREE:NAME=CONFIG ..., TREE new (the working tree) or a packed tree; run in this order in each repetition;
#             CONFIG is the working tree's file, which every tree runs (its hash is the line's config_hash)
#             [new:fused-native=benchmarks/configs/fused-native.json old:fused-native=benchmarks/configs/fused-native.json]
#   REPS [2]  N ROUNDS: tokens per round and rounds of each model bench [32 3]   KERNELS [1]: time the kernels alone first
#   KINDS     the kernel kinds to time (benchmarks/kernel_lab.py --kinds) [all]
# Out: $OUT/ab.jsonl (one benchmarks/results.jsonl `decode` line per model bench run, with its tree, repetition and the sha1 of
# its last round's tokens: trees that compute the same decode the same tokens), $OUT/kernels.jsonl
# (benchmarks/kernel_lab.py), $OUT/ab.log
set -uo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  pack) [ -n "${2:-}" ] || { echo "usage: code_ab.sh pack REV [TREE]" >&2; exit 2; }
        t=.ab/${3:-old}; rm -rf "$t" && mkdir -p "$t" && git archive "$2" model evaluator space search db benchmarks | tar -x -C "$t"
        git rev-parse "$2" > "$t/REV"; echo "$t: $(cat "$t/REV")"; exit 0 ;;
  run) ;;
  *) echo "usage: code_ab.sh pack REV [TREE] | run" >&2; exit 2 ;;
esac
[ -d .ab/old ] || { echo "no .ab/old: run 'bash benchmarks/code_ab.sh pack REV' here and carry .ab" >&2; exit 2; }
MODELS=${MODELS:-glm-4.7-flash deepseek-v2-lite} QUANT=${QUANT:-q4_0} REPS=${REPS:-2} N=${N:-32} ROUNDS=${ROUNDS:-3}
VARIANTS=${VARIANTS:-new:fused-native=benchmarks/configs/fused-native.json old:fused-native=benchmarks/configs/fused-native.json}
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/ab.log") 2>&1
export DEV=${DEV:-CUDA}
PY=python3 DEVICE=$DEV; . benchmarks/device_env.sh  # the carried wheels, this checkout on PYTHONPATH, $LABEL
T0=$SECONDS; log() { echo "[+$((SECONDS - T0))s] $*"; }
file() { echo "/tmp/$1-$QUANT.gguf"; }
pids=()  # waited for by pid: a bare wait would also wait for the log's tee
for m in $MODELS; do [ -f "$(file "$m")" ] || { python3 -m model synth --preset "$m" --quant "$QUANT" --out "$(file "$m")" & pids+=($!); }; done
[ ${#pids[@]} = 0 ] || wait "${pids[@]}"; log "files written"
if [ "${KERNELS:-1}" = 1 ]; then
  timeout 240 python3 benchmarks/kernel_lab.py --against .ab/old/model/backends/cuda_src.py \
    --label "new (working tree)" --models $MODELS ${KINDS:+--kinds $KINDS} --json "$OUT/kernels.jsonl"
fi
for rep in $(seq "$REPS"); do for m in $MODELS; do for v in $VARIANTS; do
  tree=${v%%:*} rest=${v#*:}; name=${rest%%=*} cfg=${rest#*=}
  root=$PWD dir=$PWD; [ "$tree" = new ] || dir=$PWD/.ab/$tree
  res=$( (cd "$dir" && PYTHONPATH=$dir:${PYTHONPATH:-} timeout 200 python3 -m model bench --model "$(file "$m")" --config "$root/$cfg" -n "$N" \
          --rounds "$ROUNDS" --json) 2> "$OUT/err-$m-$tree-$name-$rep.log" | tail -1)
  python3 - "$m" "$tree" "$name" "$rep" "$res" "$cfg" "$OUT/ab.jsonl" "$LABEL" "$QUANT" "$(cat "$dir/REV" 2>/dev/null)" <<'EOF'
import datetime, hashlib, json, sys
from model.structure import StructureConfig
m, tree, name, rep, res, cfg, out, device, quant, rev = sys.argv[1:]
c = StructureConfig.load(cfg)
row = {"date": datetime.datetime.now(datetime.UTC).date().isoformat(), "kind": "decode", "device": device, "model": f"{m} (synthetic, exact shapes)",
       "quant": quant.upper(), "config": name if tree == "new" else f"{name} ({tree} code {rev[:7]})", "config_hash": c.hash, "beam": c.beam,
       "tree": tree, "rep": int(rep), "command": f"bash benchmarks/code_ab.sh run (model bench -n N --rounds R --config {cfg}, {tree} tree)"}
try: d = json.loads(res)
except json.JSONDecodeError: d = {"error": "no result (see err-*.log)"}
if "tok_s" in d:
  row |= {"layers": d["layers"], "ms_per_token": d["ms_p50"]} | {k: d[k] for k in ("tok_s", "tok_s_min", "tok_s_max", "kernels_per_token", "bytes_per_token")}
  row["tokens_sha1"] = hashlib.sha1(json.dumps(d["tokens"]).encode()).hexdigest()[:12]
else: row["error"] = d.get("error", "no figures")
open(out, "a").write(json.dumps(row) + "\n")
print(f"{m:18s} {tree}:{name:16s} rep {rep}: " + (f"{d['tok_s']:.2f} tok/s ({d['tok_s_min']:.2f}-{d['tok_s_max']:.2f}), {d['kernels_per_token']} kernels, tokens {row['tokens_sha1']}"
      if "tok_s" in d else row["error"]))
EOF
done; done; done
log "done"
