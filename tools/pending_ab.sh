#!/usr/bin/env bash
# What is built and not yet run on a GPU, in two calls on the GPU machine (run from the repository root with
# PYTHONPATH set as tools/device_all.sh sets it; each under 10 minutes):
#   bash tools/pending_ab.sh v4 V4_TREE     the branch's tests, sanitizers and A/B
#   bash tools/pending_ab.sh main           main's experiments: d 256's 80-key forward tile, the ncu survey
# V4_TREE: a checkout of the branch bwd-share-v4 (on the development machine `git archive bwd-share-v4 | tar -x -C DIR`,
#   carried over): [bwd share v4], d 256's dQ added in its fragments' order by 16-byte reductions (off unless
#   CUFLASH_DEFINES=CUFLASH_BWD_SHARE_V4=1), and dQ's tile conversion restructured for two 32 KiB halves at d 256 (every
#   head dim's conversion runs the new loop: the backward's GPU files run without the switch too).
# Session 24 (H200) measured the earlier contents of this script: bwd-side-launches merged (+4.5-12 % at d 64, N <= 2048),
# bwd-d256 merged and on (1.37-1.50x the mma.sync kernel).
set -uo pipefail
part=${1:?v4 or main}
logs=${OUT:-/tmp}
if [ "$part" = v4 ]; then
tree=${2:?V4_TREE}
cd "$tree" || exit 1
export PYTHONPATH=$PWD:/tmp/site  # this tree's cuflash, not the caller's
echo "== [v4] the backward's GPU files, shipped build, 8 workers"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short -n 8 tests/test_cuda_attention.py \
    tests/test_backward_head_dims.py tests/test_tensor_map.py > "$logs/pending_v4_shipped.log" 2>&1
grep -n "node down\|Fatal Python\|FAILED\|passed\|failed" "$logs/pending_v4_shipped.log" | head -20
echo "== [v4] d 256 / 200 GPU tests with the switch"
CUFLASH_DEFINES=CUFLASH_BWD_SHARE_V4=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short \
    -n 8 tests/test_cuda_attention.py tests/test_head_dim_v.py tests/test_cuda_variants.py -k "256 or 200" \
    > "$logs/pending_v4_on.log" 2>&1
grep -n "node down\|Fatal Python\|FAILED\|passed\|failed" "$logs/pending_v4_on.log" | head -20
echo "== [v4] memcheck and racecheck, bf16 causal GQA 2:1, 200 queries x 333 keys, d 256"
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
    CUFLASH_DEFINES=CUFLASH_BWD_SHARE_V4=1 timeout 50 compute-sanitizer --tool $tool python3 /tmp/d256_case.py 2>&1 | tail -2
done
echo "== [v4] against the shipped d 256 backward, backward alone"
timeout 150 python3 tools/bwd_ab.py --builds "" "CUFLASH_BWD_SHARE_V4=1" --dims 256 --n 1024 4096 --rounds 2 2>&1 | tail -4
exit 0
fi
export PYTHONPATH=$PWD:/tmp/site
echo "== d 256's forward on 80-key tiles (main's tree; outputs checked against cuDNN's)"
timeout 150 python3 tools/tile_trial.py --dim 256 --seqlens 1024 4096 16384 --tiles 128,64,12 128,80,12 2>&1 | tail -12
echo "== the two backward orders' launches at d 128 and 256 (split: dK / dV without dQ's atomics, then dQ by query tiles)"
for order in kv_outer split; do
    timeout 60 python3 tools/bwd_parts.py --dims 128 256 --n 1024 4096 --order $order 2>&1 | grep "^d"
done
echo "== ncu survey (main's tree): forward / backward at d 128 N 1024, d 256 N 4096"
timeout 200 python3 tools/ncu_survey.py --cases fwd:128:1024 bwd:128:1024 fwd:256:4096 bwd:256:4096 --out "$logs/ncu" 2>&1 | tail -30
