#!/usr/bin/env bash
# The experiments built and switched off, each measured against the shipped build, in one call on the GPU machine
# (run from the repository root with PYTHONPATH set as tools/device_all.sh sets it; about 3 minutes):
#   bash tools/pending_ab.sh
# [decode occupancy] and [decode l2] (docs/decoding.md): the decode step's bandwidth beside cuDNN's, a process a build.
# Then the forward's d 128 at N <= 2048 (0.88-0.91x cuDNN on the H200, 2026-11-29) on 64-row tiles of one computing
# warpgroup, as d 64's short tile (they compile, 128 registers, no spills; 64 x 64: 83-99 KiB, two blocks an SM;
# 64 x 128: 149-165 KiB, one). Then [bwd rows 128] (on since session 23) against its 64-row tile (CUFLASH_BWD_ROWS128=0).
# Session 23 (H200) measured all of them: the decode and tile experiments lose, [bwd rows 128] gains 3-21 %.
set -uo pipefail
# First the decode GPU tests: flash_decode_kernel's ring took its stage count from the tile after this suite last ran
# (its contiguous path then ran on the H200 beside cuDNN in tools/decode_tile_trial.py; paged, append and guards not).
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -x -rfE --tb=short tests/test_cuda_decode.py 2>&1 | tail -4
for defines in "" "CUFLASH_DECODE_MIN_BLOCKS=3" "CUFLASH_DECODE_L2=1" "CUFLASH_DECODE_L2=2"; do
    CUFLASH_DEFINES="$defines" timeout 120 python3 tools/decode_tile_trial.py --tiles 2>&1 | grep -v Warning | tail -11
done
timeout 240 python3 tools/tile_trial.py --dim 128 --seqlens 512 1024 2048 --tiles 64,64,8 64,64,8,p 64,128,8 64,128,8,p
timeout 150 python3 tools/bwd_ab.py --builds "" "CUFLASH_BWD_ROWS128=0" --dims 64 --n 1000 2048 8192 --rounds 2 2>&1 | tail -3
