#!/usr/bin/env bash
# What is built and not yet run on a GPU, in one call on the GPU machine (run from the repository root with
# PYTHONPATH set as tools/device_all.sh sets it; about 8 minutes):
#   bash tools/pending_ab.sh SIDE_TREE D256_TREE
# each a checkout of a branch (on the development machine `git archive BRANCH | tar -x -C DIR`, carried over):
#   SIDE_TREE: bwd-side-launches. D's launch zeroes dQ's float32 workspace (no memset) with 16-byte loads, dQ's
#     conversion stores 16 bytes a thread (docs/performance.md, "The backward's side launches"). Its first form lost
#     one pytest-xdist worker (most likely the FA1 launcher's stale arguments, fixed since): test_jax runs alone first.
#   D256_TREE: bwd-d256. d 256's backward on the wgmma kernel ([bwd shared keys], docs/kernel-notes.md), off unless
#     CUFLASH_DEFINES=CUFLASH_BWD_SM90_D256=1: its GPU tests, the sanitizers on a d 256 case, then against the mma.sync
#     kernel.
# Session 23 (H200) measured the earlier contents of this script: the decode occupancy / L2 builds and d 128's 64-row
# forward tiles lose (kept off), [bwd rows 128] gains 3-21 % (on).
set -uo pipefail
here=$PWD
side=${1:?SIDE_TREE}
d256=${2:?D256_TREE}
cd "$side" || exit 1
export PYTHONPATH=$PWD:/tmp/site  # this tree's cuflash, not the caller's
logs=${OUT:-/tmp}
echo "== [side] test_jax alone"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short tests/test_jax.py 2>&1 | tail -6
echo "== [side] the backward's GPU files, 8 workers"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short -n 8 tests/test_cuda_attention.py \
    tests/test_backward_head_dims.py tests/test_cuda_variants.py tests/test_head_dim_v.py tests/test_bias.py \
    tests/test_tensor_map.py tests/test_dropout.py tests/test_torch_cuda_graphs.py > "$logs/pending_side.log" 2>&1
grep -n "node down\|Fatal Python\|FAILED\|passed\|failed" "$logs/pending_side.log" | head -20
echo "== [side] memcheck"
timeout 60 compute-sanitizer --tool memcheck python3 tools/gpu_check.py --sanitize --planned-only 2>&1 | tail -2
echo "== [side] the backward's launches"
timeout 40 python3 tools/bwd_parts.py --n 1024 8192 2>&1 | grep -v Warn
cd "$here" && cd "$d256" || exit 1
export PYTHONPATH=$PWD:/tmp/site
echo "== [d256] GPU tests with the switch"
CUFLASH_DEFINES=CUFLASH_BWD_SM90_D256=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short \
    -n 8 tests/test_cuda_attention.py tests/test_head_dim_v.py tests/test_cuda_variants.py -k "256 or 200 or 192" \
    > "$logs/pending_d256.log" 2>&1
grep -n "node down\|Fatal Python\|FAILED\|passed\|failed" "$logs/pending_d256.log" | head -20
echo "== [d256] memcheck and racecheck, bf16 causal GQA 2:1, 200 queries x 333 keys"
cat > /tmp/d256_case.py <<'PY'
import cupy, ml_dtypes, numpy as np, cuflash
rng = np.random.default_rng(1)
def a(n, h): return cupy.asarray(rng.standard_normal((2, n, h, 256)).astype(ml_dtypes.bfloat16))
q, k, v, do = a(200, 4), a(333, 2), a(333, 2), a(200, 4)
out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
print("finite:", all(bool(cupy.isfinite(x.astype(cupy.float32)).all()) for x in (dq, dk, dv)))
PY
for tool in memcheck racecheck; do
    CUFLASH_DEFINES=CUFLASH_BWD_SM90_D256=1 timeout 60 compute-sanitizer --tool $tool python3 /tmp/d256_case.py 2>&1 | tail -2
done
echo "== [d256] against the mma.sync kernel, backward alone"
timeout 90 python3 tools/bwd_ab.py --builds "" "CUFLASH_BWD_SM90_D256=1" --dims 256 --n 1024 4096 --rounds 1 2>&1 | tail -3
