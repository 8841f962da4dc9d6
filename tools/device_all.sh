#!/usr/bin/env bash
# One device call that checks and measures everything that needs a GPU: the GPU tests, the demo, and the
# side-by-side benchmark with its plots. Run from the repository root on the device machine:
#   bash tools/device_all.sh [REP_MS]          (writes logs, bench.json and plots/ under $OUT)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/cuflash-device}
mkdir -p "$out"
rep=${1:-60}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_attention.py tests/test_cuda_fa1.py \
    tests/test_torch.py tests/test_jax.py tests/test_mha.py 2>&1 | tee "$out/pytest-gpu.log" | tail -15
python3 -m cuflash demo 2>&1 | tee "$out/demo.log" | tail -12
python3 -m cuflash.bench_gpu --rep-ms "$rep" --json "$out/bench.json" --plot "$out/plots" 2>&1 \
    | tee "$out/bench.log" | grep -v '^{'
