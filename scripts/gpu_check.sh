#!/usr/bin/env bash
# The GPU check: one command on a GPU machine, inside 10 minutes. Installs the package (no network:
# no dependencies, no build isolation; falls back to PYTHONPATH), runs every GPU test (pytest -m
# gpu), a representative subset of them under compute-sanitizer (memcheck, racecheck, synccheck,
# initcheck) and the GPU benchmarks (benchmarks/bench_gpu.py), and writes into the results folder
# ($1, else $OUT, else ./gpu_check_out):
#
#   summary.txt        one line: PASSED or FAILED with every reason, device, tests, sanitizers,
#                      the benchmarks' summary, time
#   gpu_check.log      what ran, in order, with the machine (nvidia-smi, CuPy, torch, packages)
#   gpu_tests.log      pytest's output (-rfEs: every failure, error and skip, 25 slowest tests);
#                      gpu_tests.xml its JUnit results, which the verdict reads
#   sanitizer_<tool>.log   compute-sanitizer's output and the subset's pytest output, per tool
#   bench_gpu.txt      the benchmarks' tables; bench_gpu.json their results
#   install.log        pip's output
#
# It cannot pass by skipping: pytest exits 0 when every test skips, so the verdict
# (scripts/gpu_check_report.py) reads the JUnit results and fails unless GPU tests passed, none
# failed and none was skipped (GPU_CHECK_ALLOW_SKIP: a regex of skip reasons that may pass). A
# sanitizer fails on any report, on a missing summary and on a failing test under it.
#
# Order: tests (GPU_CHECK_TESTS_TIMEOUT, 240 s), benchmarks (GPU_CHECK_BENCH_TIMEOUT, 150 s), then
# the four sanitizers side by side, in what is left of GPU_CHECK_BUDGET (570 s).
#
# Usage: bash scripts/gpu_check.sh [RESULTS_DIR]
# Environment: PYTHON (the interpreter), GPU_CHECK_NO_INSTALL=1 (use PYTHONPATH, leave the
# environment alone), GPU_CHECK_TESTS (pytest paths, default tests), GPU_CHECK_WORKERS (pytest-xdist
# processes, default 8), GPU_CHECK_SANITIZE (pytest paths run under each sanitizer) and
# GPU_CHECK_SANITIZE_K (their -k filter), GPU_CHECK_SANITIZERS (default "memcheck racecheck
# synccheck initcheck"), GPU_CHECK_BENCH=0 (skip the benchmarks), GPU_CHECK_ALLOW_SKIP,
# GPU_CHECK_BUDGET.
# Exit status: 0 when every GPU test ran and passed, every sanitizer reported nothing and the
# benchmarks ran; else 1, with the reasons in summary.txt.
set -u -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-${OUT:-$root/gpu_check_out}}"
python="${PYTHON:-python3}"
mkdir -p "$out"
start=$(date +%s)
budget="${GPU_CHECK_BUDGET:-570}"   # seconds for the whole check; the sanitizers share what is left
tests_timeout="${GPU_CHECK_TESTS_TIMEOUT:-240}"
bench_timeout="${GPU_CHECK_BENCH_TIMEOUT:-150}"
left() { echo $(( budget - ($(date +%s) - start) )); }
log() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*" | tee -a "$out/gpu_check.log"; }
: > "$out/gpu_check.log"
cd "$root" || exit 1

# --- the machine
log "root $root, results $out, python $(command -v "$python")"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
    >> "$out/gpu_check.log" 2>&1 || log "nvidia-smi failed"
device="$("$python" - <<'EOF' 2>>"$out/gpu_check.log"
import cupy
p = cupy.cuda.runtime.getDeviceProperties(0)
print(p["name"].decode())
EOF
)"
[ -n "$device" ] || device="no CUDA device visible to CuPy"
log "device: $device"
"$python" - >> "$out/gpu_check.log" 2>&1 <<'EOF'
import importlib
for name in ("numpy", "cupy", "numba", "torch", "pyarrow", "xxhash", "mpi4py", "tqdm", "pytest",
             "matplotlib", "threadpoolctl", "rocksdict"):
    try:
        print(f"  {name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:
        print(f"  {name}: absent ({type(e).__name__})" + (" - the RocksDB engine is not tested here"
                                                           if name == "rocksdict" else ""))
EOF

# --- install (no network on the GPU machines)
if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
    log "not installed (GPU_CHECK_NO_INSTALL=1): using PYTHONPATH=$root"
elif "$python" -m pip install --no-deps --no-build-isolation -e "$root" > "$out/install.log" 2>&1; then
    log "installed (pip install --no-deps --no-build-isolation -e .)"
else
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
    log "pip install failed (see install.log): using PYTHONPATH=$root"
fi
report() { "$python" "$root/scripts/gpu_check_report.py" "$@"; }
failures=()

# --- the GPU tests, on GPU_CHECK_WORKERS processes (pytest-xdist, where installed: the kernels'
# first compiles and the CPU twins' numba compiles run side by side) sharing the one GPU
log "pytest -m gpu ${GPU_CHECK_TESTS:-tests} ..."
tests_start=$(date +%s)
parallel=()
if "$python" -c "import xdist" 2> /dev/null && [ "${GPU_CHECK_WORKERS:-8}" -gt 1 ]; then
    parallel=(-n "${GPU_CHECK_WORKERS:-8}" --dist load)
fi
# shellcheck disable=SC2086
timeout "$tests_timeout" "$python" -m pytest -m gpu -q -rfEs -p no:cacheprovider --durations=25 "${parallel[@]}" \
    --junitxml="$out/gpu_tests.xml" ${GPU_CHECK_TESTS:-tests} > "$out/gpu_tests.log" 2>&1
tests_rc=$?
[ "$tests_rc" -eq 124 ] && echo "gpu_check: pytest timed out after $tests_timeout s" >> "$out/gpu_tests.log"
# the serving tests' client (tritonclient) is not on the GPU image (they hold no GPU test); two
# ranks on the one GPU need an mpiexec (the mpi extra), which the image may lack; NcclComm's
# one-rank test needs CuPy to find NCCL (an nvidia-nccl wheel) and mpi4py, its two-rank one two GPUs
allow_skip="${GPU_CHECK_ALLOW_SKIP-could not import .tritonclient|mpiexec not found|CuPy cannot load NCCL|mpi4py absent|needs two GPUs}"
tests_line="$(report tests "$out/gpu_tests.xml" ${allow_skip:+--allow-skip "$allow_skip"})"
tests_ok=$?
if [ "$tests_ok" -eq 0 ] && [ "$tests_rc" -ne 0 ]; then
    tests_line="FAILED: pytest exit $tests_rc ($tests_line)"; tests_ok=1
fi
[ "$tests_rc" -eq 124 ] && tests_line="timed out after $tests_timeout s; $tests_line"
[ "$tests_ok" -eq 0 ] || failures+=("tests")
log "tests (rc $tests_rc, $(( $(date +%s) - tests_start ))s): $tests_line"

# --- the GPU benchmarks
if [ "${GPU_CHECK_BENCH:-1}" = 0 ]; then
    bench_line="benchmarks FAILED: not run (GPU_CHECK_BENCH=0)"
    failures+=("benchmarks")
else
    log "python -m benchmarks.bench_gpu ..."
    bench_start=$(date +%s)
    PYTHONUNBUFFERED=1 ONE_EMBEDDING_BENCH_RESULTS="$out" timeout "$bench_timeout" "$python" -m benchmarks.bench_gpu ${GPU_CHECK_BENCH_ARGS:-} \
        > "$out/bench_gpu.txt" 2>&1
    bench_rc=$?
    bench_line="$(grep '^summary (' "$out/bench_gpu.txt" | tail -1 | sed 's/^summary ([^)]*): //')"
    if [ "$bench_rc" -ne 0 ] || [ -z "$bench_line" ]; then
        bench_line="benchmarks FAILED (rc $bench_rc): $(tail -1 "$out/bench_gpu.txt")"
        failures+=("benchmarks")
    fi
    log "benchmarks (rc ${bench_rc}, $(( $(date +%s) - bench_start ))s): $bench_line"
fi

# --- the sanitizers, over a representative subset (every kernel family against its reference,
# the device hash index and caches; the largest sizes left out), the four tools side by side,
# each in its own process, sharing what is left of the budget. CuPy's pools are off, so that
# every array is its own allocation and an access past its end is one memcheck sees. First the
# trainer's whole step at its smallest shapes (dedup, find, gather, dense, update; captured and
# replayed as a graph): racecheck is slow on cuBLAS's products.
read -r -a sanitize <<< "${GPU_CHECK_SANITIZE:-tests/gpu/test_step_sanitized_gpu.py tests/gpu/test_kernels_gpu.py tests/gpu/test_device_gpu.py tests/gpu/test_dense_amp_gpu.py tests/gpu/test_interaction_layout_gpu.py tests/gpu/test_fused_update_gpu.py::test_fused_update_is_the_two_kernel_update_on_the_gpu}"
sanitize_k="${GPU_CHECK_SANITIZE_K-not 1000000 and not 300000 and not 200000 and not 100000 and not 50000 and not 20000 and not 10000 and not dlrm_training}"
sanitizer_lines=()
if ! command -v compute-sanitizer > /dev/null 2>&1; then
    failures+=("sanitizers")
    sanitizer_lines+=("FAILED: compute-sanitizer not on PATH")
    log "compute-sanitizer not on PATH: the sanitizers did not run"
else
    read -r -a tools <<< "${GPU_CHECK_SANITIZERS:-memcheck racecheck synccheck initcheck}"
    limit=$(( $(left) - 5 ))
    san_start=$(date +%s)
    if [ "$limit" -lt 30 ]; then
        for tool in "${tools[@]}"; do
            failures+=("$tool"); sanitizer_lines+=("$tool FAILED: not run, the check's $budget s budget is spent")
        done
    else
        log "compute-sanitizer ${tools[*]} (side by side, $limit s at most): ${sanitize[*]} -k '$sanitize_k'"
        pids=()
        for tool in "${tools[@]}"; do
            extra=()
            [ "$tool" = memcheck ] && extra=(--leak-check no)
            ( ONE_EMBEDDING_CUPY_POOL=0 timeout "$limit" compute-sanitizer --tool "$tool" "${extra[@]}" \
                --error-exitcode 86 --print-limit 20 --target-processes all \
                "$python" -m pytest -m gpu -q -x -p no:cacheprovider -k "$sanitize_k" "${sanitize[@]}" \
                > "$out/sanitizer_$tool.log" 2>&1; echo $? > "$out/.sanitizer_$tool.rc" ) &
            pids+=($!)
        done
        wait "${pids[@]}"
        for tool in "${tools[@]}"; do
            san_rc="$(cat "$out/.sanitizer_$tool.rc" 2> /dev/null || echo 1)"
            rm -f "$out/.sanitizer_$tool.rc"
            line="$(report sanitizer "$tool" "$out/sanitizer_$tool.log" "$san_rc")"
            san_ok=$?
            [ "$san_rc" -eq 124 ] && { line="$tool FAILED: timed out after $limit s"; san_ok=1; }
            [ "$san_ok" -eq 0 ] || failures+=("$tool")
            sanitizer_lines+=("$line")
            log "sanitizer (rc $san_rc): $line"
        done
        log "sanitizers took $(( $(date +%s) - san_start )) s"
    fi
fi

# --- the summary line
joined() { local IFS=';'; echo "$*" | sed 's/;/; /g'; }
if [ "${#failures[@]}" -eq 0 ]; then verdict="PASSED"; else verdict="FAILED (${failures[*]})"; fi
summary="gpu_check $verdict on $device in $(( $(date +%s) - start )) s: tests $tests_line; \
sanitizers: $(joined "${sanitizer_lines[@]}"); $bench_line"
echo "$summary" > "$out/summary.txt"
log "$summary"
[ "${#failures[@]}" -eq 0 ]
