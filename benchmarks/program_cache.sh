#!/usr/bin/env bash
# What model/programs.py saves a trial on the device: trials (`evaluator run`, a fresh process each, gated) of the same
# configs on one file, three rounds over: `cold` with nothing generated yet, `warm` with every program kept in
# $STRUCTSEARCH_CACHE/programs.db by the cold round, and `compiler` with that file deleted but tinygrad's own cache of
# the compiler's output kept (what a trial had before). Each trial's phases go to $OUT/results.jsonl as `trial` lines
# (its tok/s as `decode`, its verdict as `gate`), and $OUT/tokens.txt says whether each round decoded the cold round's
# tokens. Carries .whl (benchmarks/wheels.sh).
#   MODEL=glm-4.7-flash CONFIGS="baseline=benchmarks/configs/baseline.json portable=benchmarks/configs/portable.json" \
#     bash benchmarks/program_cache.sh
# Environment [default]: MODEL, a model synth preset written with exact shapes [glm-4.7-flash]; LAYERS [the preset's];
# QUANT [q4_0]; CONFIGS, NAME=FILE pairs [baseline and portable]; ROUNDS [cold warm compiler]; DEVICE [CUDA];
# WORK [/tmp/programs]; NOTE, added to each line.
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-glm-4.7-flash} QUANT=${QUANT:-q4_0} LAYERS=${LAYERS:-} DEVICE=${DEVICE:-CUDA} WORK=${WORK:-/tmp/programs}
CONFIGS=${CONFIGS:-baseline=benchmarks/configs/baseline.json portable=benchmarks/configs/portable.json}
ROUNDS=${ROUNDS:-cold warm compiler} PY=${PYTHON:-python3} OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
. benchmarks/device_env.sh
export STRUCTSEARCH_CACHE=$WORK/cache CACHEDB=$WORK/tinygrad.db DEV=$DEVICE  # both caches empty at the start
rm -rf "$STRUCTSEARCH_CACHE" "$CACHEDB"*
F="$WORK/$MODEL-$QUANT${LAYERS:+-$LAYERS}.gguf"
[ -f "$F" ] || "$PY" -m model synth --preset "$MODEL" --quant "$QUANT" ${LAYERS:+--layers "$LAYERS"} --out "$F" || exit 1
for round in $ROUNDS; do
  [ "$round" = compiler ] && rm -f "$STRUCTSEARCH_CACHE"/programs.db*
  for pair in $CONFIGS; do
    name=${pair%%=*} cfg=${pair#*=}
    res="$OUT/$round-$name.json"
    args=(--model "$F" --device "$DEVICE" --no-prefill -n 32 --rounds 3 --config "$cfg")
    echo "=== $round $name $(date -u +%H:%M:%S)"
    "$PY" -m evaluator run "${args[@]}" --json "$res" | tail -3
    "$PY" benchmarks/record.py trial "$res" --device "$LABEL" --model-name "$MODEL (synthetic, exact shapes)" \
      --quant "${QUANT^^}" --config-name "$name" --command "python -m evaluator run ${args[*]}  ($round round of \
benchmarks/program_cache.sh)" ${NOTE:+--note "$NOTE: $round round"} >> "$OUT/results.jsonl"
  done
done
"$PY" - "$OUT" $ROUNDS <<'EOF' | tee "$OUT/tokens.txt"
import json, pathlib, sys
out, rounds = pathlib.Path(sys.argv[1]), sys.argv[2:]
for cold in sorted(out.glob(f"{rounds[0]}-*.json")):
  name = cold.name.split("-", 1)[1]
  tok = lambda r: json.loads((out / f"{r}-{name}").read_text()).get("metrics", {}).get("tokens")
  print(name.removesuffix(".json"), *(f"{r}: {'same tokens' if tok(r) == tok(rounds[0]) else 'OTHER TOKENS'}"
                                      for r in rounds[1:]), "as", rounds[0])
EOF
