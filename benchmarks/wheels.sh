#!/usr/bin/env bash
# Here, once (needs PyPI): the wheels the device machine's image lacks, into .whl/ (ignored; carried to the device, where
# benchmarks/gpu.sh, sidebyside.sh and study.sh install them with pip --no-index). Python 3.12, manylinux x86_64 (the device's
# python3), each at the version of the venv the CPU suite runs ($PYTHON, default .venv/bin/python). The image has numpy, rich,
# PyYAML, tqdm, packaging, MarkupSafe and typing-extensions; psycopg is left out (the device runs SQLite studies only).
#   bash benchmarks/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
NAMES=(tinygrad gguf optuna sqlalchemy alembic mako tomli-w gitpython gitdb smmap colorlog optuna-dashboard bottle)
rm -rf .whl && mkdir -p .whl
for name in "${NAMES[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$name==$version"
done
ls .whl
du -ch .whl/*.whl | tail -1
