#!/usr/bin/env bash
# Two installs of verispec in two virtual environments do not rebuild each other's CPU kernel.
# Install "a" is this checkout's source; install "b" is a copy whose kernel source differs by
# one comment (as two versions of verispec would). Each loads its kernel four times, a and b in
# turn: each must compile once (its first load) and never again.
# Usage: bash benchmarks/two_installs.sh   (about 3 minutes on 2 cores; prints one line per load)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export VERISPEC_CACHE="$work/cache"   # a fresh kernel cache, shared by both installs (as ~/.cache is)
for name in a b; do
    mkdir -p "$work/src-$name"
    cp -r "$repo/verispec" "$repo/pyproject.toml" "$repo/README.md" "$work/src-$name/"
    find "$work/src-$name" -name "__pycache__" -prune -exec rm -rf {} +
    python -m venv --system-site-packages "$work/venv-$name"
    "$work/venv-$name/bin/pip" install --quiet --no-deps -e "$work/src-$name" 2>/dev/null
done
echo "// install b" >> "$work/src-b/verispec/csrc/skinny_linear.cpp"
compiles=0
for round in 1 2 3 4; do
    for name in a b; do
        log=$(cd "$work" && "$work/venv-$name/bin/python" -c "
import time
start = time.perf_counter()
from verispec.models import kernels
status = kernels.kernel_status()
print(f'{status} from {kernels.__file__}; build directory {kernels._build_dir.name}; {time.perf_counter() - start:.1f} s')" 2>&1)
        if grep -q "compiling" <<<"$log"; then compiles=$((compiles + 1)); fi
        echo "round $round, install $name: $(tr '\n' ' ' <<<"$log")"
    done
done
echo "compilations: $compiles (expected 2: one per install)"
test "$compiles" -eq 2
