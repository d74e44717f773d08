#!/usr/bin/env bash
# Build llama.cpp's own `llama-speculative-simple` and `llama-server` from the very llama.cpp that
# the installed llama-cpp-python vendors (same version), for
#   verispec bench --peer llamacpp --llama-cpp-bin OUT/build/bin ...
#   verispec bench-serve --peer llama-server --llama-cpp-bin OUT/build/bin ...
# The first also runs llama.cpp's n-gram drafters (--spec-type ngram-mod, ...: `--peer-ngram all`).
# Usage: bash benchmarks/build_llama_speculative.sh [OUT]   (default OUT: runs/llama-bin; ~10 min on 2 cores)
# The build uses llama.cpp's defaults (GGML_NATIVE: this CPU's instruction sets), as pip's build of
# llama-cpp-python does, so both run the same kernels.
set -euo pipefail
out=$(realpath -m "${1:-runs/llama-bin}")
version=$(python -c "import llama_cpp; print(llama_cpp.__version__)")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
mkdir -p "$out"
rm -rf "$out/src" && cp -r "$src" "$out/src"   # the build's shared libraries stay next to the program
cmake -S "$out/src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$out/build" --target llama-speculative-simple llama-server -j "$(nproc)" >/dev/null
"$out/build/bin/llama-speculative-simple" --version 2>&1 | head -n 2
echo "built $out/build/bin/llama-speculative-simple and llama-server (llama-cpp-python $version's llama.cpp):" \
    "pass --llama-cpp-bin $out/build/bin"
