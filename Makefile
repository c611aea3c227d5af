# make demo: set up and run the main job on the embedded default (synthetic tiny model)
# make test: set up and run the test suite
VENV ?= .venv
# more pytest options for make test (.ci/run: --durations=20)
TEST_ARGS ?=
BIN := $(VENV)/bin

.PHONY: deps setup demo test test-slow lint
deps:  # system packages: clang for tinygrad's CPU backend, a C++ toolchain for llama-cpp-python and tests/cuda_cpu.py
	@command -v clang >/dev/null && command -v cmake >/dev/null && command -v g++ >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang cmake g++ make >/dev/null; }

setup: deps $(VENV)/.installed
# llama-cpp-python builds llama.cpp from source: here without its multimodal library (mtmd), which nothing loads
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: setup  # 8 trials of the tiny model on the CPU at BEAM=0 (BEAM on the CPU costs minutes per trial), the best one confirmed, its report
	$(BIN)/search start --model tiny --trials 8 --fix beam=0 --no-prefill -n 16 --confirm 1 --pairs 2
	$(BIN)/search report --study tiny-CPU --out report-tiny-CPU

lint: setup
	$(BIN)/ruff check .

test: lint  # a crashed worker ends the run with its test named (xdist's file scheduling can stall replacing one)
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 $(TEST_ARGS)

# depth beyond make test, each covered there at a smaller size: the full-width GLM-4.7-Flash and DeepSeek-V2-Lite 2-layer
# files against llama.cpp (about 15 CPU minutes, 10 GB), the GLM-width F16 and Q8_0 knob proofs (F16: a 2.7 GB file;
# Q8_0's weights are in the Q4_K_M proof too), the tiny Q4_K_M file decoded with every type on dsl at once (each type's
# dsl backend is proved alone), the K-quants' portable kernels rendered for every target, Q8_0 and Q6_K in the Metal
# emulator, native's 8-bit attention input on the all-Q8_0 file (the Q4_K_M mix's attention reads Q8_0 too)
test-slow: setup
	$(BIN)/pytest -q -m slow
