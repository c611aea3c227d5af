# Sourced by the device scripts (sidebyside.sh, study.sh, code_ab.sh, gpu.sh) from the checkout's root, with $PY and $DEVICE set: installs the
# carried wheels (.whl, benchmarks/wheels.sh) where the image lacks the project's packages, puts this checkout first on
# PYTHONPATH, and names the device in $LABEL as results.jsonl lines do.
if [ -d .whl ] && ! "$PY" -c "import tinygrad" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "$DEVICE" = CUDA ]; then LABEL="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) (CUDA)"
else LABEL="$("$PY" -c 'import platform; print(platform.processor() or platform.machine())') ($DEVICE)"; fi
