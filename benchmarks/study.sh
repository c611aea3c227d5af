#!/usr/bin/env bash
# A full-depth study on the device, as a user starts it, created in one call and continued in the next ones, then recorded:
#   MODEL=deepseek-v2-lite STUDY=ds-portable ARGS="--family portable --fix beam=0" bash benchmarks/study.sh
# carrying .whl (benchmarks/wheels.sh) and, to continue a study begun in an earlier call, .study (the $OUT/structsearch.db
# of that call, copied to .study/structsearch.db).
#
# Writes the synthetic file (reused while the machine is warm), then `search start` creates the study (or continues it:
# the same name in the carried database) and runs trials until $DEADLINE leaves no room for another, then `search confirm`
# when $CONFIRM is set. Every trial, gate, confirmation and the study's cost (phases, time to best, projection) go through
# benchmarks/record.py into $OUT/results.jsonl, for the whole study so far: append the last call's lines.
#
# Environment [default]:
#   MODEL     a model synth preset, written with exact shapes [deepseek-v2-lite]     QUANT [q4_0]
#   STUDY     the study's name [$MODEL-$QUANT]
#   ARGS      search start's options when the study is created; the model, device, storage and name are given [none]
#   TRIALS    the study's target number of trials [60]     TRIAL_TIMEOUT  one trial's limit in seconds [200]
#   DEADLINE  seconds after the start by which everything has ended [570]
#   CONFIRM   PAIRS: after the trials, `search confirm --top 1 --pairs PAIRS` of the study's best (0: none) [0]
#   DEVICE    [CUDA]   WORK  files and the database [/tmp/sidebyside]   PYTHON [python3]
# Out: $OUT/structsearch.db and $OUT/$STUDY.commands (every call's commands: the lines' `command`), $OUT/study.log (search
#      start's output, then status and cost), $OUT/results.jsonl
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-deepseek-v2-lite} QUANT=${QUANT:-q4_0} ARGS=${ARGS:-} TRIALS=${TRIALS:-60} TRIAL_TIMEOUT=${TRIAL_TIMEOUT:-200}
DEADLINE=${DEADLINE:-570} CONFIRM=${CONFIRM:-0} DEVICE=${DEVICE:-CUDA} WORK=${WORK:-/tmp/sidebyside} PY=${PYTHON:-python3}
STUDY=${STUDY:-$MODEL-$QUANT} OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/study.log") 2>&1
T0=$SECONDS
log() { echo "[$(date -u +%H:%M:%S) +$((SECONDS - T0))s] $*"; }
left() { echo $((DEADLINE - (SECONDS - T0))); }

. benchmarks/device_env.sh

F="$WORK/$MODEL-$QUANT.gguf" DB="$WORK/structsearch.db" CMDS="$WORK/$STUDY.commands"
URL="sqlite:///$DB"
for f in structsearch.db "$STUDY.commands"; do  # the study of an earlier call
  [ -f ".study/$f" ] && [ ! -f "$WORK/$f" ] && cp ".study/$f" "$WORK/$f" && chmod u+w "$WORK/$f"
done
[ -f "$F" ] || { log "writing $F"; "$PY" -m model synth --preset "$MODEL" --quant "$QUANT" --out "$F" || exit 1; }
if "$PY" -m search status --study "$STUDY" --storage "$URL" > /dev/null 2>&1; then how=(--study "$STUDY"); log "continuing $STUDY"
else how=(--model "$F" --study "$STUDY" --device "$DEVICE" $ARGS); log "creating $STUDY: search start ${how[*]}"; fi
# a trial that starts before --timeout may first make its precision's reference in a process of its own, then run
# TRIAL_TIMEOUT; each confirmation pair is a per-op baseline run and a candidate run, each a trial's load and build
reserve=$((2 * TRIAL_TIMEOUT + 15 + (CONFIRM > 0 ? 60 + (TRIAL_TIMEOUT + 30) * CONFIRM : 0)))
if [ "$(left)" -gt "$reserve" ]; then
  limit=$(($(left) - reserve))
  echo "search start ${how[*]} --trials $TRIALS --timeout $limit --trial-timeout $TRIAL_TIMEOUT" >> "$CMDS"
  timeout "$(($(left) - 10))" "$PY" -m search start "${how[@]}" --storage "$URL" --trials "$TRIALS" \
    --timeout "$limit" --trial-timeout "$TRIAL_TIMEOUT" --confirm 0
  log "search start exit $?"
fi
if [ "$CONFIRM" -gt 0 ] && [ "$(left)" -gt 30 ]; then
  echo "search confirm --study $STUDY --top 1 --pairs $CONFIRM" >> "$CMDS"
  timeout "$(($(left) - 10))" "$PY" -m search confirm --study "$STUDY" --storage "$URL" --top 1 --pairs "$CONFIRM"
  log "search confirm exit $?"
fi
"$PY" -m search status --study "$STUDY" --storage "$URL"
"$PY" -m search cost --study "$STUDY" --storage "$URL"
cp "$DB" "$OUT/structsearch.db"; [ -f "$CMDS" ] && cp "$CMDS" "$OUT/"
"$PY" -m benchmarks.record study --storage "$URL" --study "$STUDY" --device "$LABEL" --quant "${QUANT^^}" \
  --model-name "$MODEL (synthetic, exact shapes)" --command "bash benchmarks/study.sh: $(paste -sd ';' "$CMDS" 2>/dev/null)" \
  >> "$OUT/results.jsonl" || log "record.py failed"
log "done"
