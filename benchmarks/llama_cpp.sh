#!/usr/bin/env bash
# llama.cpp's llama-bench for the side-by-side benchmark, from the llama-cpp-python source package (its vendor/llama.cpp).
#
#   bash benchmarks/llama_cpp.sh pack [--check]   # here, once (needs PyPI): .llama/llama.cpp.tar.gz, trimmed to what llama-bench
#                                                  # needs; --check also configures and builds llama-bench from it on this CPU
#                                                  # (in $CHECK_DIR, default /tmp/structsearch-llama-cpu)
#   bash benchmarks/llama_cpp.sh build DIR [CMAKE_ARG...]   # unpack the tarball into DIR and build DIR/build/bin/llama-bench
#   bash benchmarks/llama_cpp.sh save DIR OUTDIR   # on the device, after a build: llama-bench and its libraries, with the
#                                                  # source stamp, as OUTDIR/llama-bench.tar.xz.part-* (15 MiB pieces, what the
#                                                  # device tool hands back); copied into .llama/, later device calls carry them
#   bash benchmarks/llama_cpp.sh unpack DIR        # those pieces of .llama/ into DIR/build/bin, if they were built from the
#                                                  # packed source and run here (exit 1 otherwise: build instead)
# $LLAMA_CACHE: the folder of the packed source and of the pieces [.llama]
#
# The version is the venv's llama-cpp-python (the one the CPU conformance tests compare against), or $LLAMA_CPP_PYTHON.
# On the device, benchmarks/sidebyside.sh runs `build` with -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${LLAMA_CACHE:-.llama}  # the packed source (and a carried build)
TARBALL=$CACHE/llama.cpp.tar.gz
# the parts of CMakeLists.txt's standalone build that llama-bench does not need (their folders are not packed)
OPTS=(-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF)

build() {  # DIR [CMAKE_ARG...]
  local dir=$1; shift
  command -v nvcc >/dev/null || [ ! -x /usr/local/cuda/bin/nvcc ] || export PATH=/usr/local/cuda/bin:$PATH  # CMake finds CUDA by nvcc
  mkdir -p "$dir" && tar -xzf "$TARBALL" -C "$dir"
  # no git here: llama-bench's build_commit names the source package instead ("llama-cpp-python-0.3.36")
  cmake -S "$dir/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release "${OPTS[@]}" -DLLAMA_BUILD_COMMIT="$(cut -d' ' -f1-2 --output-delimiter=- "$dir/llama.cpp/SOURCE")" "$@"
  cmake --build "$dir/build" --target llama-bench -j "$(nproc)"
  "$dir/build/bin/llama-bench" --help >/dev/null
}

pack() {
  local py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  local version=${LLAMA_CPP_PYTHON:-$("$py" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')}
  local tmp; tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$tmp"
  local src=$tmp/llama_cpp_python-$version/vendor/llama.cpp dst=$tmp/llama.cpp
  mkdir -p "$dst/ggml/src" "$dst/tools"
  # the library, its CMake, the common library and its vendored headers, llama-bench; licenses
  cp -r "$src"/{CMakeLists.txt,LICENSE,licenses,cmake,include,src,common,vendor} "$dst"/
  cp -r "$src"/ggml/{CMakeLists.txt,cmake,include} "$dst/ggml"/
  # ggml itself and the CPU and CUDA backends (the other backends are only added when enabled)
  find "$src/ggml/src" -maxdepth 1 -type f -exec cp {} "$dst/ggml/src"/ \;
  cp -r "$src"/ggml/src/{ggml-cpu,ggml-cuda} "$dst/ggml/src"/
  cp -r "$src/tools/llama-bench" "$dst/tools"/
  printf 'llama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' > "$dst/tools/CMakeLists.txt"
  echo "llama-cpp-python $version (PyPI sdist), vendor/llama.cpp trimmed by benchmarks/llama_cpp.sh" > "$dst/SOURCE"
  mkdir -p .llama
  tar -czf "$TARBALL" -C "$tmp" llama.cpp
  echo "$TARBALL: llama.cpp of llama-cpp-python $version, $(du -h "$TARBALL" | cut -f1)"
}

save() {  # DIR OUTDIR
  local bin=$1/build/bin
  cp "$1/llama.cpp/SOURCE" "$bin/SOURCE"
  tar -cf - -C "$bin" SOURCE llama-bench $(cd "$bin" && ls ./*.so* 2>/dev/null) | xz -T0 | split -b 15M - "$2/llama-bench.tar.xz.part-"
  ls -la "$2"/llama-bench.tar.xz.part-*
}

unpack() {  # DIR
  local bin=$1/build/bin parts=("$CACHE"/llama-bench.tar.xz.part-*)
  [ -f "${parts[0]}" ] || return 1
  mkdir -p "$bin" && cat "${parts[@]}" | tar -xJf - -C "$bin" || return 1
  [ "$(cat "$bin/SOURCE")" = "$(tar -xzOf "$TARBALL" llama.cpp/SOURCE)" ] || { echo "the carried llama-bench is of $(cat "$bin/SOURCE")" >&2; return 1; }
  LD_LIBRARY_PATH=$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bin/llama-bench" --help > /dev/null
}

case ${1:-} in
  pack) pack
        if [ "${2:-}" = --check ]; then
          rm -rf "${CHECK_DIR:=/tmp/structsearch-llama-cpu}" && build "$CHECK_DIR" -DGGML_CUDA=OFF -DGGML_NATIVE=OFF
          echo "built $CHECK_DIR/build/bin/llama-bench"
        fi ;;
  build) shift; build "$@" ;;
  save) [ $# -eq 3 ] || { echo "usage: bash benchmarks/llama_cpp.sh save DIR OUTDIR" >&2; exit 2; }; save "$2" "$3" ;;
  unpack) [ $# -eq 2 ] || { echo "usage: bash benchmarks/llama_cpp.sh unpack DIR" >&2; exit 2; }; unpack "$2" ;;
  *) echo "usage: bash benchmarks/llama_cpp.sh pack [--check] | build DIR [CMAKE_ARG...] | save DIR OUTDIR | unpack DIR" >&2; exit 2 ;;
esac
