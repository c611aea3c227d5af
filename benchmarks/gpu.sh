#!/usr/bin/env bash
# One device call: install carried wheels, synthesize GLM-4.7-Flash-shaped files, run benchmark sets. Results land in $OUT.
# usage: bash benchmarks/gpu.sh STEP...   steps: env, bw, expert, glm4, knobsA, knobsB, beam4, full, fullbeam
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DEV=CUDA
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
synth() { [ -f "$2" ] || python3 -m model synth --preset glm-4.7-flash --quant q4_0 --layers "$1" --out "$2"; }
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    env) nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 --version; nproc; free -g | head -2; df -h /tmp | tail -1 ;;
    bw) python3 benchmarks/bandwidth.py | tee -a "$OUT/bandwidth.txt" ;;
    glm4) synth 4 /tmp/glm4.gguf && python3 benchmarks/run.py --model /tmp/glm4.gguf --set baseline --out "$OUT/results.jsonl" ;;
    expert) for b in 0 2; do python3 benchmarks/expert_kernel.py --beam $b; done | tee -a "$OUT/expert.txt" ;;
    knobsA) synth 4 /tmp/glm4.gguf && python3 benchmarks/run.py --model /tmp/glm4.gguf --set knobs --limit 18 --out "$OUT/results.jsonl" --timeout 120 ;;
    knobsB) synth 4 /tmp/glm4.gguf && python3 benchmarks/run.py --model /tmp/glm4.gguf --set knobs --skip 18 --out "$OUT/results.jsonl" --timeout 120 ;;
    beam4) synth 4 /tmp/glm4.gguf && python3 benchmarks/run.py --model /tmp/glm4.gguf --set baseline --beam 2 --out "$OUT/results.jsonl" --timeout 560 ;;
    full) synth 47 /tmp/glm47.gguf && python3 benchmarks/run.py --model /tmp/glm47.gguf --set baseline --out "$OUT/results.jsonl" --timeout 500 ;;
    fullbeam) synth 47 /tmp/glm47.gguf && python3 benchmarks/run.py --model /tmp/glm47.gguf --set baseline --beam 2 --out "$OUT/results.jsonl" --timeout 560 ;;
  esac
done
