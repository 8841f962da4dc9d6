#!/usr/bin/env bash
# One device call that checks and measures everything that needs a GPU: the GPU tests, the demo, and the
# side-by-side benchmark with its plots. Run from the repository root on the device machine:
#   TESTS_S=600 SANITIZE=1 [TESTS="tests/test_x.py ..."] [JOBS=8] [SPECIAL=1] bash tools/device_all.sh [REP_MS [bench_gpu options...]]
# (writes logs, bench.json and plots/ under $OUT; TESTS_S bounds the test run in seconds; JOBS: pytest-xdist workers
# where it is installed (XLA's preallocation is off, so JAX's tests share the GPU); SANITIZE=1 adds compute-sanitizer
# memcheck and racecheck on tools/gpu_check.py's small cases; SPECIAL=1 adds the FP8 and float32 tables and plots)
# The device has no package index: wheels of missing pure-Python dependencies (array-api-compat) travel
# in .whl/ (git-ignored; name it in the call's carry) and are installed to /tmp/site first.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=.:/tmp/site
fi
out=${OUT:-/tmp/cuflash-device}
mkdir -p "$out"
rep=${1:-60}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
tests_s=${TESTS_S:-600}
# Every GPU test (TESTS="tests/..." narrows it); the log is written as the tests run, so a run cut by the time box
# still comes back (under $OUT) with every result it reached.
jobs=()
if python3 -c "import xdist" 2>/dev/null; then jobs=(-n "${JOBS:-8}"); fi
timeout -s INT "$tests_s" python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" -m gpu -rfE --tb=short ${TESTS:-tests/} 2>&1 \
    | tee "$out/pytest-gpu.log" | tail -15
if [ "${SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" python3 tools/gpu_check.py --sanitize > "$out/sanitize-$tool.log" 2>&1
        echo "compute-sanitizer $tool: rc $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize-$tool.log")"
    done
fi
python3 -m cuflash demo 2>&1 | tee "$out/demo.log" | tail -12
special=()
if [ "${SPECIAL:-0}" = 1 ]; then special=(--all); fi
python3 -m cuflash bench-gpu --rep-ms "$rep" --json "$out/bench.json" --plot "$out/plots" "${special[@]}" "${@:2}" 2>&1 \
    | tee "$out/bench.log" | grep -v '^{'
