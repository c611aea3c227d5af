#!/usr/bin/env bash
# structsearch next to llama.cpp on the same files, in one device call (under 10 minutes per model at full depth):
#   bash benchmarks/sidebyside.sh        # on the device, carrying .whl (benchmarks/wheels.sh) and .llama (benchmarks/llama_cpp.sh)
#
# Starts building llama-bench in the background first, meanwhile writes the synthetic files (`model synth`) and makes each
# file's correctness reference (nothing is timed while the build runs), then per model: llama-bench, upstream tinygrad's
# own decoder when $UPSTREAM is set, and each config of $CONFIGS through `evaluator run` (then $FAULTS). Every figure goes
# through benchmarks/record.py into $OUT/results.jsonl (append it to benchmarks/results.jsonl, then `python -m
# benchmarks.render`). A failed step is recorded and the rest goes on.
#
# Environment [default]:
#   MODELS    presets, each written as a synthetic file with exact shapes [glm-4.7-flash deepseek-v2-lite]
#   QUANT     [q4_0]   LAYERS  blocks to write [all of them]
#   ROUTING   model synth --routing: random (near-ties everywhere) or decisive (as trained routers) [random]
#   CONFIGS   `baseline` (the config {}) and NAME=FILE ..., in order [baseline best=benchmarks/configs/best.json]
#   PROFILED  the NAMEs of $CONFIGS run with --profile [all but the baseline]
#   FAULTS    FAULT:NAME ...: on the last model, after the configs, config NAME again with a fault of tests/inject
#             (STRUCTSEARCH_FAULT), which the correctness gate must reject [none]
#   DEPTHS    contexts D ...: each config also decodes with D positions in its cache (`evaluator run --context D`) beside
#             llama-bench's decode at the same depth (-d 0,D,...), in the same call [none]
#   PROMPTS   prompts P ...: each config also prefills a P-token prompt, timed (`evaluator run --prompt P`) beside
#             llama-bench -p P -n 0 [none]
#   WORKLOADS each config's runs: default (decode after a 32-token prompt), dD (decode at depth D), pP (a P-token
#             prompt's prefill) [default, then dD for each of $DEPTHS, then pP for each of $PROMPTS]
#   N ROUNDS  evaluator tokens per measured round and rounds [32 3]      LLAMA_N LLAMA_REPS  llama-bench -n and -r [128 5]
#   DEVICE    [CUDA]   LLAMA_BENCH  a llama-bench binary to use instead of building one from .llama/llama.cpp.tar.gz;
#             none: no llama.cpp figures (the configs only)
#   UPSTREAM  1: after llama-bench, upstream tinygrad.llm's decoder on the same file (benchmarks/upstream_llm.py,
#             UPSTREAM_N tokens [20], the first 3 not timed), an `upstream` line [off]
#   WORK      files, references and the build [/tmp/sidebyside]; reused when the machine is still warm
#   DEADLINE  seconds after the start past which no step starts, and by which each step is stopped [570]
#   PYTHON    [python3]
# Out: $OUT/results.jsonl, $OUT/trials.jsonl (each evaluator result and llama-bench output, whole: phases, check, profile),
#      $OUT/sidebyside.log, $OUT/llama-build.log, and after a build $OUT/llama-bench.tar.xz.part-* (copied into .llama/, later
#      calls unpack them instead of building: about 400 s of device time saved; a stale or unrunnable one is built again)
set -uo pipefail
cd "$(dirname "$0")/.."
DEPTHS=${DEPTHS:-} PROMPTS=${PROMPTS:-}
MODELS=${MODELS:-glm-4.7-flash deepseek-v2-lite} QUANT=${QUANT:-q4_0} LAYERS=${LAYERS:-} ROUTING=${ROUTING:-random} CONFIGS=${CONFIGS:-baseline best=benchmarks/configs/best.json}
N=${N:-32} ROUNDS=${ROUNDS:-3} LLAMA_N=${LLAMA_N:-128} LLAMA_REPS=${LLAMA_REPS:-5} UPSTREAM=${UPSTREAM:-} UPSTREAM_N=${UPSTREAM_N:-20} DEVICE=${DEVICE:-CUDA} WORK=${WORK:-/tmp/sidebyside}
DEADLINE=${DEADLINE:-570} PY=${PYTHON:-python3} OUT=${OUT:-$WORK/out} LAST=${MODELS##* }
shopt -s extglob
mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/sidebyside.log") 2>&1
T0=$SECONDS
log() { echo "[$(date -u +%H:%M:%S) +$((SECONDS - T0))s] $*"; }
left() { echo $((DEADLINE - (SECONDS - T0))); }
log "models: $MODELS; configs: $CONFIGS; device $DEVICE${DEPTHS:+; depths $DEPTHS}${PROMPTS:+; prompts $PROMPTS}"
csv() { local IFS=,; echo "$*"; }
LLAMA_D=$( [ -n "$DEPTHS" ] && echo "-d $(csv 0 $DEPTHS)" )  # llama-bench's decode depths, beside d = 0
# each config's runs: the default workload, then each depth and each prompt (evaluator run's options, a name for its files)
WORKLOADS=${WORKLOADS:-default $(for d in $DEPTHS; do echo "d$d"; done) $(for p in $PROMPTS; do echo "p$p"; done)}
workopts() { case $1 in default) echo --no-prefill ;; d*) echo "--no-prefill --context ${1#d}" ;; p*) echo "--prompt ${1#p}" ;; esac; }

BENCH=${LLAMA_BENCH:-$WORK/llama/build/bin/llama-bench} BUILD=
if [ ! -x "$BENCH" ] && [ -z "${LLAMA_BENCH:-}" ] && ls "${LLAMA_CACHE:-.llama}"/llama-bench.tar.xz.part-* > /dev/null 2>&1; then
  if why=$(bash benchmarks/llama_cpp.sh unpack "$WORK/llama" 2>&1); then
    log "llama-bench: the build carried in ${LLAMA_CACHE:-.llama} (benchmarks/llama_cpp.sh save), of $(cat "$WORK/llama/build/bin/SOURCE")"
  else log "the carried llama-bench is not used (${why:-it does not run here}): building one"; rm -rf "$WORK/llama"; fi
fi
if [ ! -x "$BENCH" ] && [ -z "${LLAMA_BENCH:-}" ]; then  # first; stopped (with its compilers) if it would leave 2 minutes or less
  log "building llama-bench in the background (log: llama-build.log)"
  rm -rf "$WORK/llama"
  timeout "$((DEADLINE - 120))" bash benchmarks/llama_cpp.sh build "$WORK/llama" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
    > "$OUT/llama-build.log" 2>&1 &
  BUILD=$!
fi

. benchmarks/device_env.sh
SYNTH="--quant $QUANT${LAYERS:+ --layers $LAYERS}$( [ "$ROUTING" = random ] || echo " --routing $ROUTING")"  # model synth's options
file() { echo "$WORK/$1-$QUANT${LAYERS:+-L$LAYERS}$( [ "$ROUTING" = random ] || echo "-$ROUTING").gguf"; }
name() { echo "$1 (synthetic, exact shapes$( [ "$ROUTING" = random ] || echo ", $ROUTING routing"))"; }
rec() { "$PY" -m benchmarks.record "$@" --device "$LABEL" --quant "${QUANT^^}" >> "$OUT/results.jsonl" || log "record.py failed: $*"; }

for m in $MODELS; do
  [ -f "$(file "$m")" ] && continue
  log "writing $(file "$m")"
  "$PY" -m model synth --preset "$m" $SYNTH --out "$(file "$m")" || log "model synth failed for $m"
done
echo '{}' > "$WORK/baseline.json"
cfgfile() { [ "$1" = baseline ] && echo "$WORK/baseline.json" || echo "${1#*=}"; }
for m in $MODELS; do  # the correctness gate's references (the baseline's, and each config's twin): once per file, by the evaluator's own code
  [ -f "$(file "$m")" ] || continue
  case " $WORKLOADS " in *" default "*) ;; *) continue ;; esac  # at a depth or a prompt, each trial makes its own
  log "references for $m"
  timeout "$(($(left) - 60))" "$PY" -c "import sys; from evaluator.runner import Evaluator; from evaluator.gate import twin
from model.structure import StructureConfig
e = Evaluator.for_model(sys.argv[1], sys.argv[2])
for c in sys.argv[3:]:
  try: cfg = StructureConfig.load(c)
  except ValueError as err: print(f'{c}: {err} (its trial reports it)'); continue
  e.reference('full', twin(cfg))" "$(file "$m")" "$DEVICE" \
    $(for spec in $CONFIGS; do cfgfile "$spec"; done) || log "the references for $m failed (the first trial of each makes it again)"
done
if [ -n "$BUILD" ]; then
  log "waiting for the llama-bench build"
  wait "$BUILD" || log "llama-bench build failed (exit $?; 124: stopped at the deadline): $(grep -i -m3 error "$OUT/llama-build.log")"
fi
log "llama-bench: $( [ -x "$BENCH" ] && echo "$BENCH" || echo "${LLAMA_BENCH:-missing}")"

for m in $MODELS; do
  f=$(file "$m") json=$WORK/$m.llama.json
  if [ ! -f "$f" ]; then
    rec error --kind llama_cpp --model-name "$(name "$m")" --config-name llama.cpp --command "model synth --preset $m" --error "no model file"
    continue
  fi
  cmd="llama-bench -m $(basename "$f") -p 0 -n $LLAMA_N${LLAMA_D:+ $LLAMA_D} -r $LLAMA_REPS -ngl 99 -fa 1 -o json${PROMPTS:+; -p $(csv $PROMPTS) -n 0}  ($(basename "$f"): model synth --preset $m $SYNTH)"
  rm -f "$json"
  if [ "${LLAMA_BENCH:-}" = none ]; then :
  elif [ ! -x "$BENCH" ]; then rec error --kind llama_cpp --model "$f" --model-name "$(name "$m")" --config-name llama.cpp --command "$cmd" \
    --error "no llama-bench: its build failed (llama-build.log)"
  elif [ "$(left)" -lt 30 ]; then rec error --kind llama_cpp --model "$f" --model-name "$(name "$m")" --config-name llama.cpp --command "$cmd" \
    --error "skipped: deadline"
  else
    log "llama-bench $m"
    lb() { LD_LIBRARY_PATH=$(dirname "$BENCH")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} timeout "$(($(left) - 10))" "$BENCH" -m "$f" "$@" -r "$LLAMA_REPS" -ngl 99 -fa 1 -o json 2>> "$WORK/llama-bench.err"; }
    : > "$WORK/llama-bench.err"
    if lb -p 0 -n "$LLAMA_N" $LLAMA_D > "$json.tmp" && { [ -z "$PROMPTS" ] || lb -p "$(csv $PROMPTS)" -n 0 > "$json.pp"; }; then
      "$PY" -c "import json, sys; print(json.dumps(sum((json.load(open(p)) for p in sys.argv[1:]), [])))" "$json.tmp" \
        $( [ -n "$PROMPTS" ] && echo "$json.pp" ) > "$json"
      rec llama "$json" --model "$f" --model-name "$(name "$m")" --command "$cmd"
      "$PY" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$json" >> "$OUT/trials.jsonl"
    else
      rec error --kind llama_cpp --model "$f" --model-name "$(name "$m")" --config-name llama.cpp --command "$cmd" \
        --error "llama-bench failed: $(tail -2 "$WORK/llama-bench.err" | tr '\n' ' ')"
    fi
  fi
  if [ -n "$UPSTREAM" ]; then  # upstream tinygrad's own deepseek2 decoder (python -m tinygrad.llm --benchmark) on the file
    up=$WORK/$m.upstream.json
    cmd="DEV=$DEVICE python -m benchmarks.upstream_llm --model $(basename "$f") --tokens $UPSTREAM_N  ($(basename "$f"): model synth --preset $m $SYNTH; via bash benchmarks/sidebyside.sh)"
    rm -f "$up"
    if [ "$(left)" -lt 30 ]; then
      rec error --kind upstream --model "$f" --model-name "$(name "$m")" --config-name "tinygrad.llm (upstream)" --command "$cmd" --error "skipped: deadline"
    else
      log "upstream tinygrad.llm $m"
      DEV=$DEVICE timeout "$(($(left) - 10))" "$PY" -m benchmarks.upstream_llm --model "$f" --tokens "$UPSTREAM_N" --json "$up" 2> "$WORK/upstream.err"
      rc=$?
      if [ "$rc" = 0 ] && [ -f "$up" ]; then
        rec upstream "$up" --model "$f" --model-name "$(name "$m")" --command "$cmd"
        "$PY" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$up" >> "$OUT/trials.jsonl"
      else
        rec error --kind upstream --model "$f" --model-name "$(name "$m")" --config-name "tinygrad.llm (upstream)" --command "$cmd" \
          --error "upstream_llm failed (exit $rc; 124: stopped at the deadline): $(tail -1 "$WORK/upstream.err")"
      fi
    fi
  fi
  for spec in $CONFIGS $( [ "$m" = "$LAST" ] && echo "${FAULTS:-}" ); do
  for work in $WORKLOADS; do
    fault=
    case $spec in  # FAULT:NAME: config NAME of $CONFIGS with a fault of tests/inject, which the gate must reject
      *:*) [ "$work" = default ] || continue  # a fault: at the default workload only
           fault=${spec%%:*} spec=$(for c in $CONFIGS; do [ "${c%%=*}" = "${spec#*:}" ] && echo "$c"; done); [ -n "$spec" ] || continue ;;
    esac
    [ "$spec" = baseline ] && spec=baseline=$WORK/baseline.json
    cname=${spec%%=*}${fault:+ + fault $fault} cfg=${spec#*=} res=$WORK/$m.${spec%%=*}${fault:+.$fault}.$work.json
    profile=$( [ -z "$fault" ] && case " ${PROFILED:-${CONFIGS//=*([^ ])/}} " in *" ${spec%%=*} "*) [ "$cname" = baseline ] || echo --profile ;; esac )
    wopts=$(workopts "$work")
    cmd="python -m evaluator run --model $(basename "$f") --device $DEVICE $wopts -n $N --rounds $ROUNDS --config $( [ "$cname" = baseline ] && echo '{}' || echo "$cfg") $profile"
    cmd="$cmd  ($(basename "$f"): model synth --preset $m $SYNTH; via bash benchmarks/sidebyside.sh)"
    rm -f "$res"
    if [ "$(left)" -lt 30 ]; then
      rec error --kind trial --model "$f" --model-name "$(name "$m")" --config-name "$cname" --command "$cmd" --error "skipped: deadline"
      continue
    fi
    log "evaluator: $m $cname ($work)"
    ${fault:+env STRUCTSEARCH_FAULT=$fault PYTHONPATH=$PYTHONPATH:$PWD/tests/inject} \
      "$PY" -m evaluator run --model "$f" --device "$DEVICE" $wopts -n "$N" --rounds "$ROUNDS" --config "$cfg" $profile \
      --timeout "$(($(left) - 10))" --json "$res"
    if [ -f "$res" ]; then
      rec trial "$res" --model-name "$(name "$m")" --config-name "$cname" --command "$cmd" $( [ -f "$json" ] && echo --llama "$json" )
      cat "$res" >> "$OUT/trials.jsonl"
    else
      rec error --kind trial --model "$f" --model-name "$(name "$m")" --config-name "$cname" --command "$cmd" --error "the evaluator wrote no result"
    fi
  done
  done
done
if [ -n "$BUILD" ] && [ -x "$BENCH" ]; then  # after every timing: the build, for later calls to carry (copy the pieces into .llama/)
  bash benchmarks/llama_cpp.sh save "$WORK/llama" "$OUT" > /dev/null && log "saved the llama-bench build: $OUT/llama-bench.tar.xz.part-*"
fi
log "done: $(wc -l < "$OUT/results.jsonl") lines in results.jsonl"
"$PY" -c "
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  if r['kind'] in ('decode', 'llama_cpp', 'upstream') or 'error' in r:
    print(f\"{r['model'][:24]:24s} {r['config']:12s} {r.get('tok_s', ''):>8} tok/s  llama.cpp {r.get('llama_cpp_tok_s', '')}  {r.get('error', '')}\")
" "$OUT/results.jsonl"
