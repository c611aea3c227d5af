#!/usr/bin/env bash
# One device call: install the carried wheels, synthesize GLM-4.7-Flash-shaped files, run the named steps. Results land in $OUT;
# the evaluator runs of the trial, knobs and full steps also as benchmarks/record.py lines in $OUT/results.jsonl.
# usage: bash benchmarks/gpu.sh STEP...
#   steps: env bw trial repeat knobs study confirm status (evaluator and search on the 4-layer GLM-4.7-Flash Q4_0 shape),
#          full (baseline at 47 layers); STUDY_TRIALS, STUDY_TIMEOUT set the study step's target and time limit;
#          native (tests/test_native.py on the GPU), expert (the mul_mat_id product per backend, BEAM 0 and 2),
#          cudaknobs (model bench rows of the knob values added since the H200 table: dsl/native backends, JIT batch size),
#          fusedcheck (the native products, decode graph and knob proofs on the GPU), fused47 (model bench of the best known and
#          the all-fused native configs at 47 layers, with per-kernel profiles), side and final (the side-by-side table),
#          speed (llama-bench built while the full-depth files are written, then llama-bench and a gated, profiled trial of
#          $SPEED_CONFIG on each), broken (deliberately broken configs at full depth: faults of tests/inject, which the gate must
#          reject), study47 (a full-depth GLM-4.7-Flash study, created with the issue configs enqueued or continued; BEAM
#          pinned by $STUDY_FIX, the configs enqueued by $STUDY_ENQUEUE, its name $STUDY), cost47 (its cost table), truth (model bench of $SPEED_CONFIG on both full-depth files with the
#          per-kernel profile of device time)
set -uo pipefail
PY=python3 DEVICE=CUDA; . benchmarks/device_env.sh  # the carried wheels, this checkout on PYTHONPATH, $LABEL
export DEV=CUDA STRUCTSEARCH_CACHE=/tmp/sscache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DB=sqlite:////tmp/structsearch.db STUDY=${STUDY:-glm47-q4_0}
[ -f /tmp/structsearch.db ] || [ ! -f .gpu/structsearch.db ] || cp .gpu/structsearch.db /tmp/  # a study carried from an earlier machine
synth() { [ -f "$2" ] || python3 -m model synth --preset glm-4.7-flash --quant q4_0 --layers "$1" --out "$2"; }
timed() { local t0=$SECONDS; "$@"; echo "[wall $((SECONDS - t0)) s: $*]" >&2; }  # on stderr: a step may send stdout to a file
ev() { timed python3 -m evaluator "$@"; }
rec() {  # RESULT.json COMMAND...: an evaluator result's lines into $OUT/results.jsonl
  local res=$1; shift
  [ -f "$res" ] && python3 -m benchmarks.record trial "$res" --device "$LABEL" --model-name "glm-4.7-flash (synthetic, exact shapes)" \
    --quant Q4_0 --command "DEV=CUDA python -m evaluator $*  (via bash benchmarks/gpu.sh)" >> "$OUT/results.jsonl"
}
llama_build() {  # TIMEOUT: llama-bench from the carried llama-cpp-python source, CUDA sm_90, its log in $OUT/llama-build.log
  timeout "$1" bash benchmarks/llama_cpp.sh build /tmp/llama -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
    > "$OUT/llama-build.log" 2>&1; echo "llama build exit $?" >> "$OUT/llama-build.log"
}
llama_bench() {  # NAME...: llama-bench on /tmp/NAME.gguf, its JSON in $OUT/llama-NAME.json
  for m in "$@"; do
    timed timeout 60 /tmp/llama/build/bin/llama-bench -m /tmp/$m.gguf -p 0 -n 128 -r 5 -ngl 99 -fa 1 -o json > "$OUT/llama-$m.json" \
      2> "$OUT/llama-bench.err"; grep -o '"avg_ts": [0-9.]*' "$OUT/llama-$m.json"; done
}
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    env) nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 --version; nproc ;;
    bw) synth 4 /tmp/glm4.gguf && ev bandwidth --device CUDA --remeasure ;;
    trial) echo '{}' > /tmp/base.json
           ev run --model /tmp/glm4.gguf --device CUDA --profile --json "$OUT/trial_baseline.json"  # includes making the reference
           rec "$OUT/trial_baseline.json" run --model glm4.gguf --device CUDA --profile
           ev run --model /tmp/glm4.gguf --device CUDA --json "$OUT/trial_baseline2.json"
           rec "$OUT/trial_baseline2.json" run --model glm4.gguf --device CUDA ;;
    repeat) ev compare --model /tmp/glm4.gguf --device CUDA --no-prefill /tmp/base.json /tmp/base.json --pairs 3 --json "$OUT/ab_same.json" ;;
    knobs) for c in '{"backends": {"Q4_0:expert": "native", "Q4_0:dense": "native"}}' '{"jit_batch_size": 0}' '{"backends": {"Q4_0:expert": "dsl", "Q4_0:dense": "dsl"}}' \
                    '{"merge_gate_up_routed": true, "backends": {"Q4_0:expert": "fp16_cache"}}'; do
             echo "$c" > /tmp/k.json; echo "--- $c"; res="$OUT/knob_$(echo "$c" | md5sum | cut -c1-8).json"
             ev run --model /tmp/glm4.gguf --device CUDA --no-prefill --config /tmp/k.json --json "$res"
             rec "$res" run --model glm4.gguf --device CUDA --no-prefill --config "'$c'"
           done ;;
    study) timed python3 -m search start --model /tmp/glm4.gguf --study glm4-q4_0-L4 --storage $DB --device CUDA --fix beam=0 --no-prefill \
             --trials "${STUDY_TRIALS:-30}" --timeout "${STUDY_TIMEOUT:-480}" --confirm 0 --seed 0; cp /tmp/structsearch.db "$OUT/" ;;
    confirm) timed python3 -m search confirm --study glm4-q4_0-L4 --storage $DB --top "${CONFIRM_TOP:-1}" --pairs "${CONFIRM_PAIRS:-3}"
             cp /tmp/structsearch.db "$OUT/" ;;
    status) python3 -m search status --study glm4-q4_0-L4 --storage $DB
            python3 -m search export --study glm4-q4_0-L4 --storage $DB --out "$OUT/glm4-q4_0-L4.toml" ;;
    native) timed python3 -m pytest -q -p no:cacheprovider -rs --tb=short ${NATIVE_TESTS:-tests/test_native.py} 2>&1 | tee "$OUT/native.log" | tail -60 ;;
    expert) for b in ${EXPERT_BEAMS:-0 2}; do PYTHONPATH=$PYTHONPATH:tests timed python3 benchmarks/expert_kernel.py --beam $b --json "$OUT/expert.jsonl"; done ;;
    cudaknobs) synth 4 /tmp/glm4.gguf && timed python3 benchmarks/run.py --model /tmp/glm4.gguf --device CUDA --set knobs --out "$OUT/cudaknobs.jsonl" \
                 --only baseline backend.Q4_0.dense=dsl backend.Q4_0.expert=dsl backend.Q4_0.dense=native backend.Q4_0.expert=native \
                        jit_batch_size=0 jit_batch_size=8 jit_batch_size=128 ;;
    fusedcheck) timed timeout "${CHECK_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs --tb=short -x tests/test_native.py \
                  -k "products_equal or decode_runs or tiny_native_knob" 2>&1 | tee "$OUT/fusedcheck.log" | tail -40 ;;
    fused47) synth 47 /tmp/glm47.gguf && timed python3 benchmarks/run.py --model /tmp/glm47.gguf --device CUDA --set named --profile \
               --config "best=benchmarks/configs/best.json" --config "fused-native=benchmarks/configs/fused-native.json" ${FUSED_EXTRA:-} \
               --timeout 280 --out "$OUT/fused47.jsonl" ;;
    side) # model bench of the named configs (no correctness gate) and llama-bench, on full-depth GLM-4.7-Flash and DeepSeek-V2-Lite Q4_0
          llama_build 400 &
          LB=$!
          synth 47 /tmp/glm47.gguf
          timed python3 benchmarks/run.py --model /tmp/glm47.gguf --device CUDA --set named --profile ${SIDE_CONFIGS:---config fused-native=benchmarks/configs/fused-native.json} \
            --timeout 200 --out "$OUT/side.jsonl"
          [ -f /tmp/ds.gguf ] || timed python3 -m model synth --preset deepseek-v2-lite --quant q4_0 --out /tmp/ds.gguf
          timed python3 benchmarks/run.py --model /tmp/ds.gguf --device CUDA --set named ${SIDE_CONFIGS:---config fused-native=benchmarks/configs/fused-native.json} \
            --timeout 150 --out "$OUT/side.jsonl"
          wait $LB; tail -3 "$OUT/llama-build.log"
          for f in /tmp/glm47.gguf /tmp/ds.gguf; do
            timed timeout 90 /tmp/llama/build/bin/llama-bench -m $f -p 0 -n 128 -r 5 -ngl 99 -fa 1 -o json > "$OUT/llama-$(basename $f .gguf).json" 2> "$OUT/llama-bench.err"
            tail -c 600 "$OUT/llama-$(basename $f .gguf).json"; done ;;
    final) # one call: llama-bench built in the background; on full-depth GLM-4.7-Flash and DeepSeek-V2-Lite Q4_0, a gated evaluator
           # trial of the fused native config (its reference made first, profile after), model bench if the gate refuses it; llama-bench
           T0=$SECONDS; left() { echo $((${DEADLINE:-540} - (SECONDS - T0))); }
           llama_build 420 &
           LB=$!
           synth 47 /tmp/glm47.gguf
           [ -f /tmp/ds.gguf ] || timed python3 -m model synth --preset deepseek-v2-lite --quant q4_0 --out /tmp/ds.gguf
           for m in glm47 ds; do
             cfg=${FINAL_CONFIG:-benchmarks/configs/fused-native.json}
             timed timeout $(( $(left) - 40 )) python3 -m evaluator run --model /tmp/$m.gguf --device CUDA --no-prefill --config "$cfg" --profile \
               --json "$OUT/$m-gated.json"
             grep -q '"status": "ok"' "$OUT/$m-gated.json" 2>/dev/null || timed timeout $(( $(left) - 30 )) python3 benchmarks/run.py \
               --model /tmp/$m.gguf --device CUDA --set named --config "fused-native=$cfg" --timeout 150 --out "$OUT/$m-bench.jsonl"
           done
           wait $LB; tail -2 "$OUT/llama-build.log"
           llama_bench glm47 ds ;;
    speed) [ -x /tmp/llama/build/bin/llama-bench ] || llama_build 420 &
           LB=$!
           synth 47 /tmp/glm47.gguf & S1=$!
           [ -f /tmp/ds.gguf ] || timed python3 -m model synth --preset deepseek-v2-lite --quant q4_0 --out /tmp/ds.gguf
           wait $S1 $LB; tail -2 "$OUT/llama-build.log"  # nothing is timed before the build has finished
           llama_bench glm47 ds
           for m in glm47 ds; do
             ev run --model /tmp/$m.gguf --device CUDA --no-prefill --config "${SPEED_CONFIG:-benchmarks/configs/fused-native.json}" --profile \
               --json "$OUT/$m-gated.json"; done ;;
    truth) synth 47 /tmp/glm47.gguf & S1=$!
           [ -f /tmp/ds.gguf ] || timed python3 -m model synth --preset deepseek-v2-lite --quant q4_0 --out /tmp/ds.gguf
           wait $S1
           for m in glm47 ds; do
             timed python3 -m model bench --model /tmp/$m.gguf --config "${SPEED_CONFIG:-benchmarks/configs/fused-native.json}" -n 32 --rounds 3 \
               --profile | tee "$OUT/truth-$m.txt"; done ;;
    broken) echo '{"topk": "argmax"}' > /tmp/argmax.json
            for fc in broken_argmax_topk:/tmp/argmax.json scale_off_one_block:benchmarks/configs/fused-native.json \
                      dropped_residual_one_block:benchmarks/configs/baseline.json; do
              PYTHONPATH=$PYTHONPATH:$PWD/tests/inject STRUCTSEARCH_FAULT=${fc%%:*} ev run --model /tmp/glm47.gguf --device CUDA --no-prefill \
                --config "${fc#*:}" --json "$OUT/broken-${fc%%:*}.json"; done ;;
    study47) synth 47 /tmp/glm47.gguf
             if python3 -m search status --study "$STUDY" --storage $DB > /dev/null 2>&1; then how=(--study "$STUDY")
             else how=(--model /tmp/glm47.gguf --study "$STUDY" --device CUDA --no-prefill --seed 0 ${STUDY_FIX---fix beam=0}
                       ${STUDY_ENQUEUE---enqueue benchmarks/configs/fused-native.json --enqueue benchmarks/configs/best.json
                       --enqueue benchmarks/configs/moe-out-contiguous.json --enqueue benchmarks/configs/native-dense.json
                       --enqueue benchmarks/configs/native-expert.json}); fi
             timed python3 -m search start "${how[@]}" --storage $DB --trials "${STUDY_TRIALS:-12}" --timeout "${STUDY_TIMEOUT:-420}" \
               --trial-timeout "${TRIAL_TIMEOUT:-300}" --confirm 0
             cp /tmp/structsearch.db "$OUT/" ;;
    cost47) python3 -m search cost --study "$STUDY" --storage $DB
            python3 -m search status --study glm47-q4_0 --storage $DB ;;
    full) synth 47 /tmp/glm47.gguf && ev run --model /tmp/glm47.gguf --device CUDA --json "$OUT/trial_full.json"
          rec "$OUT/trial_full.json" run --model glm47.gguf --device CUDA ;;
  esac
done
