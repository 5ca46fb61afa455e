#!/usr/bin/env bash
# Compile every CUDA source of src/one_embedding/kernels/cuda with nvcc for each target architecture.
#
# Each <family>.cu is built as a cubin with -DONE_EMBEDDING_INSTANTIATE, which turns its
# ONE_EMBEDDING_KERNEL(name) lines into explicit float and double instantiations, so every template
# body is really compiled (a template nobody instantiates is only parsed). The script then checks
# that the cubin holds exactly 2 kernels per ONE_EMBEDDING_KERNEL line. Prints one line per
# source x arch and exits non-zero on any failure.
#
# Usage: scripts/compile_cuda.sh [arch ...]     (default: sm_80 sm_90; NVCC overrides the compiler)
set -u -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cuda_dir="$root/src/one_embedding/kernels/cuda"
nvcc="${NVCC:-nvcc}"
archs=("$@")
[ "${#archs[@]}" -eq 0 ] && archs=(sm_80 sm_90)
# the options cupy.RawModule compiles with (cuda_module.COMPILE_OPTIONS, and CuPy adds -ftz=true),
# plus warnings as errors
options=(-std=c++17 --fmad=false -ftz=true -Werror all-warnings -DONE_EMBEDDING_INSTANTIATE -I "$cuda_dir")

if ! command -v "$nvcc" >/dev/null 2>&1; then
    echo "compile_cuda.sh: $nvcc not found (set NVCC or put nvcc on PATH)" >&2
    exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

shopt -s nullglob
sources=("$cuda_dir"/*.cu)
if [ "${#sources[@]}" -eq 0 ]; then
    echo "compile_cuda.sh: no .cu files under $cuda_dir" >&2
    exit 2
fi

failed=0
for src in "${sources[@]}"; do
    name="$(basename "$src")"
    expected=$(( 2 * $(grep -cE '^\s*ONE_EMBEDDING_KERNEL\([A-Za-z0-9_]+\)\s*$' "$src") ))
    for arch in "${archs[@]}"; do
        cubin="$work/${name%.cu}.$arch.cubin"
        start=$(date +%s%N)
        if ! "$nvcc" "${options[@]}" -arch="$arch" --cubin -o "$cubin" "$src" >"$work/log" 2>&1; then
            echo "FAIL $name $arch: nvcc error"
            sed 's/^/    /' "$work/log"
            failed=1
            continue
        fi
        # kernel entry points are the .text.<mangled name> sections of the cubin
        found=$(grep -a -o -E '\.text\.[A-Za-z0-9_]+' "$cubin" | sort -u | wc -l)
        ms=$(( ($(date +%s%N) - start) / 1000000 ))
        if [ "$found" -ne "$expected" ] || [ "$expected" -eq 0 ]; then
            echo "FAIL $name $arch: $found kernels in the cubin, expected $expected"
            failed=1
        else
            echo "ok   $name $arch: $found kernels (${ms} ms)"
        fi
    done
done
exit "$failed"
