#!/usr/bin/env bash
# What is built and not yet run on a GPU, in one call on the GPU machine (run from the repository root with
# PYTHONPATH set as tools/device_all.sh sets it; about 5 minutes):
#   bash tools/pending_ab.sh [BRANCH_TREE]
# BRANCH_TREE: a checkout of the branch bwd-side-launches (e.g. `git archive bwd-side-launches | tar -x -C DIR` on the
# development machine, carried to the GPU machine): D's launch zeroes dQ's float32 workspace (no memset) with 16-byte
# loads, dQ's conversion stores 16 bytes a thread (docs/performance.md, "The backward's side launches"). Its first form
# lost one pytest-xdist worker in a run that also held test_jax: test_jax runs in a process of its own first here.
# Session 23 (H200) measured the earlier experiments of this script: the decode occupancy / L2 builds and d 128's
# 64-row forward tiles lose (kept off), [bwd rows 128] gains 3-21 % (on).
set -uo pipefail
tree=${1:-.}
cd "$tree" || exit 1
echo "== test_jax alone"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short tests/test_jax.py 2>&1 | tail -15
echo "== the backward's GPU files, 8 workers"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short -n 8 tests/test_cuda_attention.py \
    tests/test_backward_head_dims.py tests/test_cuda_variants.py tests/test_head_dim_v.py tests/test_bias.py \
    tests/test_tensor_map.py tests/test_dropout.py tests/test_torch_cuda_graphs.py > /tmp/pending_tests.log 2>&1
grep -n "node down\|Fatal Python\|FAILED\|passed\|failed" /tmp/pending_tests.log | head -20
echo "== memcheck"
timeout 70 compute-sanitizer --tool memcheck python3 tools/gpu_check.py --sanitize --planned-only 2>&1 | tail -2
echo "== the backward's launches"
timeout 60 python3 tools/bwd_parts.py 2>&1 | grep -v Warn
