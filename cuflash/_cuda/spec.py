"""Kernel specs: one value per kernel instantiation, from which everything about it derives.

A :class:`KernelSpec` names a kernel family (its source file, C++ template and shared-memory formula: one
:class:`Family` row each, in :data:`FAMILIES`), a dtype, a head dim, a tile (:data:`TILES`, the tuned table)
and a variant (the C++ policy type of ``cuflash_kernels/variants.cuh``, spelled by :func:`variant_type`
from a :class:`cuflash._ops.variant.Variant`). Its NVRTC name expression, NVRTC options, dynamic shared memory
and thread count are properties of the spec, and :func:`instantiations` lists the representative set that
CI compiles from the same specs. The launcher (:mod:`.attention`, :mod:`.fa1`) only plans: which spec, which
grid, which arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from .._ops.philox import THRESHOLD_ONE, keep_threshold
from .._ops.variant import Variant

__all__ = [
    "Tile", "TILES", "HEAD_DIMS", "BWD_HEAD_DIMS", "Family", "FAMILIES", "KernelSpec", "NVRTC_OPTIONS",
    "SM90A_OPTIONS", "FA1_HEAD_DIMS", "FA1_BWD_HEAD_DIMS", "VARIANT_PARAMS_DTYPE", "EXTRA_PARAMS_DTYPE",
    "variant_type", "has_dropout", "extra_params", "extra_record", "device_record",
    "VARIANT_POINTER_FIELDS", "EXTRA_POINTER_FIELDS", "prelude_of", "mask_policy", "variant_params", "instantiations", "spec", "DENSE", "CTYPES",
    "TF32_FAMILIES", "TF32_HEAD_DIMS", "BIAS_CTYPES", "NO_BIAS", "bias_policy", "policy_args", "staged_bias_bytes",
    "PERSISTENT_HEAD_DIMS",
]

# Options given to NVRTC (CuPy appends the -arch of the current device).
NVRTC_OPTIONS = ("-std=c++17",)
# The Hopper kernels (wgmma, sm_90a only) name their target; CuPy still appends the device's -arch=sm_90,
# and NVRTC keeps the architecture-specific sm_90a (hopper_tiles.cuh #errors otherwise).
SM90A_OPTIONS = NVRTC_OPTIONS + ("-arch=sm_90a",)

# MLA decoding on sm_90 runs the wgmma kernel (decode_sm90.cu); False: the mma.sync one, for comparisons (read when a
# decode launch is planned: clear cuflash._cuda.decode._LAUNCHES and the front door's memory after changing it).
SM90A_DECODE = True
# ... and copies its key tiles with the tensor memory accelerator (cp.async.bulk.tensor: one thread issues a 64 x 64
# box, no per-thread copies) where every tile lies whole in one page or in the contiguous cache's row (no appended
# tokens, no left padding, pages of a multiple of 64); cp.async otherwise, or everywhere with this off.
TMA_DECODE = True

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
FA1_HEAD_DIMS = (32, 64, 96, 128, 256)  # (the FA1 forward's per-warp query stages spill at 160..224)
# The 16-bit FA2 backward's head dims (a head dim between two runs in place on the next one's kernel: 160 on 192's,
# 224 on 256's; dK and dV of 160 or 224 columns split over a warp group's 4 warps are not multiples of 16). Above 128
# only where the arch class has a ("bwd", arch, d) row (sm_90: 192 and 256; sm_80: 192), elsewhere the float32
# kernels on upcast inputs. The FA1 backward's: FA1_BWD_HEAD_DIMS.
BWD_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
FA1_BWD_HEAD_DIMS = (32, 64, 96, 128)
DECODE_HEAD_DIMS = (32, 64, 96, 128, 256)  # head_dim == head_dim_v (256: flash_decode_wide_kernel)
# MLA's absorbed decoding (DeepSeek-V2/V3): head_dim 576 = a 512-dim latent (V: v_cache = k_cache[..., :512]) and 64
# rope dims, one key/value head (flash_decode_wide_kernel with V read from the K tile).
DECODE_MLA_DIMS = (576, 512)
CTYPES = {"float16": "cuflash::fp16", "bfloat16": "cuflash::bf16"}
# FP8 inputs (e4m3, ml_dtypes' float8_e4m3fn) of the forward's FP8 entry point, and its head dims; its output is bf16.
FP8_CTYPES = {"float8_e4m3fn": "cuflash::e4m3"}
FP8_HEAD_DIMS = (128, 256)
# The element types of the Hopper forward's V^T entry point (forward_sm90.cu's [fp8] and [tf32]: V read as V^T) by
# input dtype, and the head dims of its [tf32] path (float32 inputs, fp32_precision="tf32" on sm_90).
VT_CTYPES = {**FP8_CTYPES, "float32": "cuflash::tf32"}
# Keys of V per block of transpose_v_kernel, per dtype (its template argument kKeys and the launch's grid): e4m3's
# 128 keys make each row of V^T a tile writes one whole 128-byte line.
TRANSPOSE_V_KEYS = {"float8_e4m3fn": 128, "float32": 64}
TF32_SM90_HEAD_DIMS = (64, 128)
# [f16x2] float32 inputs with fp32_precision="fp16x3" on sm_90: the same entry point with each operand split in two fp16
# parts (three fp16 wgmma products a matrix product), at these head dims.
F16X2_CTYPES = {"float32": "cuflash::f16x2"}
F16X2_HEAD_DIMS = (64, 128)
# [fwd persistent] The TMA forward's head dims whose tile leaves room for O's own staging tile (d 256's takes 193 KiB
# without it).
PERSISTENT_HEAD_DIMS = (64, 128, 192)
# float32 on the tensor cores (flash_fwd_kernel on TF32 fragments, tf32_tiles.cuh): fp32_precision -> the family and
# its element tag. Head dims up to 128 (float32 tiles are twice the 16-bit ones; above, the SIMT kernel runs).
TF32_FAMILIES = {"tf32x3": "fwd_tf32x3", "tf32": "fwd_tf32"}
TF32_TAGS = {"fwd_tf32x3": "cuflash::tf32x3", "fwd_tf32": "cuflash::tf32"}
TF32_HEAD_DIMS = (32, 64, 96, 128)


class Tile(NamedTuple):
    """Template arguments of one kernel: tile rows (block_m queries, block_n keys), warps, stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int


# flash_fwd_kernel on float32 inputs (3xTF32 and one TF32 product alike), (arch class, head dim) -> Tile: block_m = 16
# query rows per warp; float32 tiles, 4 * d * (block_m + 2 * stages * block_n) bytes of shared memory. First version,
# not yet tuned on a GPU (at 32 rows per warp the 3xTF32 fragments, and even one product's, spill).
_TF32_TILES: dict[tuple[str, int], Tile] = {
    ("sm90", 32): Tile(128, 128, 8, 2),
    ("sm90", 64): Tile(128, 64, 8, 2),
    ("sm90", 96): Tile(128, 32, 8, 2),
    ("sm90", 128): Tile(128, 32, 8, 2),   # 128 KiB
    ("sm80", 32): Tile(128, 128, 8, 2),
    ("sm80", 64): Tile(128, 64, 8, 2),
    ("sm80", 96): Tile(128, 32, 8, 2),    # 96 KiB
    ("sm80", 128): Tile(128, 32, 8, 2),   # 128 KiB
    ("sm86", 32): Tile(128, 64, 8, 2),
    ("sm86", 64): Tile(64, 64, 4, 2),
    ("sm86", 96): Tile(64, 32, 4, 2),
    ("sm86", 128): Tile(64, 32, 4, 2),    # 96 KiB
}

# The tile table: (direction, arch class, head dim) -> Tile, shared by float16 and bfloat16.
# direction "fwd": flash_fwd_kernel (block_m = 16 or 32 query rows per warp).
# direction "bwd": flash_bwd_dkdv_kernel (block_n key rows in groups of 32, warps / (block_n / 32) warps per
# group splitting the query columns and the head dim; block_m streamed query rows; stages >= 2).
# direction "bwd_dq": flash_bwd_dq_kernel of the split order (block_m = 16 * warps query rows).
# Arch classes: "sm90" (H100/H200: 227 KiB shared memory per block), "sm80" (A100: 163 KiB),
# "sm86" (sm_86/87/89 consumer and workstation parts: 99 KiB).
TILES: dict[tuple[str, str, int], Tile] = {
    ("fwd", "sm90", 32): Tile(128, 128, 4, 2),
    ("fwd", "sm90", 64): Tile(128, 64, 4, 2),
    ("fwd", "sm90", 96): Tile(128, 64, 4, 2),
    ("fwd", "sm90", 128): Tile(128, 128, 8, 2),
    **{("fwd", "sm90", d): Tile(128, 64, 8, 2) for d in (160, 192, 224, 256)},
    ("fwd", "sm80", 32): Tile(128, 128, 4, 2),
    ("fwd", "sm80", 64): Tile(128, 64, 4, 2),
    ("fwd", "sm80", 96): Tile(128, 64, 4, 2),
    ("fwd", "sm80", 128): Tile(128, 32, 4, 2),
    **{("fwd", "sm80", d): Tile(64, 32, 4, 2) for d in (160, 192, 224, 256)},
    ("fwd", "sm86", 32): Tile(128, 128, 8, 2),
    ("fwd", "sm86", 64): Tile(128, 128, 8, 2),
    ("fwd", "sm86", 96): Tile(64, 64, 4, 2),
    ("fwd", "sm86", 128): Tile(64, 64, 4, 2),
    **{("fwd", "sm86", d): Tile(64, 32, 4, 1) for d in (160, 192, 224, 256)},
    # ("fwd", "sm90a", d): flash_fwd_sm90_kernel (wgmma; block_m = 64 query rows per warpgroup of 4 warps).
    ("fwd", "sm90a", 64): Tile(128, 64, 8, 2),
    ("fwd", "sm90a", 128): Tile(128, 128, 8, 2),
    # d 192 and 256: warp-specialized (two computing warpgroups and a loading one, 12 warps; O 64 x d a warpgroup
    # in registers under setmaxnreg's 240): 145 and 193 KiB of shared memory
    ("fwd", "sm90a", 192): Tile(128, 64, 12, 2),
    ("fwd", "sm90a", 256): Tile(128, 64, 12, 2),
    # ("fwd", "sm90a_tma", d): the same kernel from its TMA entry point (flash_fwd_sm90_tma_kernel: warp-specialized,
    # the producer's one thread copying tiles through tensor maps), where a call allows it (attention._tma_forward).
    # H100, 2026-11-28 (bf16, ANCHORS grid): d 128 at 128 x 128 539-660 TFLOP/s against 285-399 by the cp.async
    # kernel; d 64 at 192 x 128 (three computing warpgroups) 384-469 from N 4096 against 341-383, but not at N 1024
    # (causal 239 against 268); d 256 at 128 x 64 415-667 against 210-296.
    ("fwd", "sm90a_tma", 64): Tile(192, 128, 16, 2),
    ("fwd", "sm90a_tma", 128): Tile(128, 128, 12, 2),
    ("fwd", "sm90a_tma", 192): Tile(128, 64, 12, 2),
    ("fwd", "sm90a_tma", 256): Tile(128, 64, 12, 2),
    # ("fwd", "sm90a_tma_short", d): the TMA entry point's tile up to attention.TMA_SHORT_MAX_ROWS_Q query rows: d 64
    # with one computing warpgroup, two blocks per SM (Sm90Config), 217-439 TFLOP/s at N 512-2048 against 169-425 by
    # the 192-row tile (H100, 2026-11-28).
    ("fwd", "sm90a_tma_short", 64): Tile(64, 128, 8, 2),
    # ("fwd", "sm90a_fp8", d): the V^T entry point with e4m3 q, k, v (flash_fwd_sm90_vt_kernel; forward_sm90.cu's [fp8]):
    # the TMA tile shape, key tiles of whole 128-key boxes of V^T. First version, not yet tuned.
    ("fwd", "sm90a_fp8", 128): Tile(128, 128, 12, 2),
    ("fwd", "sm90a_fp8", 256): Tile(128, 128, 12, 2),
    # ("fwd", "sm90a_tf32", d): the same entry point on float32 inputs, one TF32 product ([tf32], attention.TF32_WGMMA);
    # key tiles of whole 32-key boxes of V^T. Built, not yet run on a GPU.
    ("fwd", "sm90a_tf32", 64): Tile(128, 128, 12, 2),
    ("fwd", "sm90a_tf32", 128): Tile(128, 64, 12, 2),
    # ("fwd", "sm90a_f16x2", d): the same entry point with q, k and v split in fp16 parts ([f16x2]): the tiles (and shared
    # memory) of [tf32]'s, whose 4-byte elements the pairs of parts are. First version, not yet tuned.
    ("fwd", "sm90a_f16x2", 64): Tile(128, 128, 12, 2),
    ("fwd", "sm90a_f16x2", 128): Tile(128, 64, 12, 2),
    # ("bwd", "sm90a", d): flash_bwd_dkdv_sm90_kernel (wgmma; block_n = 64 key rows per warpgroup of 4 warps,
    # block_m = 64 streamed query rows, 2 query buffers).
    ("bwd", "sm90a", 64): Tile(64, 128, 8, 2),
    ("bwd", "sm90a", 128): Tile(64, 128, 8, 2),
    # d 256: [bwd shared keys] (backward_sm90.cu's Sm90BwdConfig::kShareKeys): both warpgroups on the block's 64 keys,
    # S^T and dP^T split by queries, dK and dV by head-dim columns, P^T and dS^T through shared memory (210 / 226 KiB).
    # H200: 1.37-1.50x the mma.sync kernel (attention.BWD_SM90_D256; CUFLASH_DEFINES=CUFLASH_BWD_SM90_D256=0 turns it off).
    ("bwd", "sm90a", 256): Tile(64, 64, 8, 2),
    # ("bwd", "sm90a_tma", d): the TMA entry point's tile where dQ is in the launch with the whole-tile dQ
    # (attention.BWD_ROWS128, [bwd rows 128]): d 64 on 128-row query tiles, FlashAttention-3's d 64 tile, each
    # warpgroup its own 64 rows of dQ (218-249 registers, no spills, 200 KiB; H200: 1.03-1.21x the 64-row tile).
    ("bwd", "sm90a_tma", 64): Tile(128, 128, 8, 2),
    ("bwd", "sm90", 32): Tile(64, 128, 8, 2),
    ("bwd", "sm90", 64): Tile(64, 64, 4, 2),
    ("bwd", "sm90", 96): Tile(64, 64, 4, 2),
    ("bwd", "sm90", 128): Tile(64, 128, 8, 2),
    # d 192 and 256: two groups of 32 key rows, 4 warps each on 48 or 64 columns of dK and dV (245-255 registers,
    # 20-40 bytes spilled with dQ's atomics; 161 and 209 KiB of shared memory)
    ("bwd", "sm90", 192): Tile(64, 64, 8, 2),
    ("bwd", "sm90", 256): Tile(64, 64, 8, 2),
    ("bwd", "sm80", 32): Tile(64, 128, 8, 2),
    ("bwd", "sm80", 64): Tile(64, 64, 4, 2),
    ("bwd", "sm80", 96): Tile(64, 64, 4, 2),
    ("bwd", "sm80", 128): Tile(64, 128, 8, 2),
    ("bwd", "sm80", 192): Tile(64, 64, 8, 2),  # (161 of the A100's 163 KiB; d 256 has no tile that fits unspilled)
    ("bwd", "sm86", 32): Tile(64, 128, 8, 2),
    ("bwd", "sm86", 64): Tile(64, 64, 4, 2),
    ("bwd", "sm86", 96): Tile(64, 64, 4, 2),
    ("bwd", "sm86", 128): Tile(32, 64, 4, 2),
    ("bwd_dq", "sm90", 32): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm90", 64): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm90", 96): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm90", 128): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm90", 192): Tile(64, 32, 4, 2),
    ("bwd_dq", "sm90", 256): Tile(64, 32, 4, 2),
    ("bwd_dq", "sm80", 32): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm80", 64): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm80", 96): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm80", 128): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm80", 192): Tile(64, 32, 4, 2),
    ("bwd_dq", "sm86", 32): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm86", 64): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm86", 96): Tile(64, 64, 4, 1),
    ("bwd_dq", "sm86", 128): Tile(64, 64, 4, 1),
    # direction "fa1_fwd": fa1_fwd_kernel (block_m = 16 query rows per warp tile, block_n key rows held by
    # the block, warps taking query tiles in turn, stages = query buffers per warp).
    # direction "fa1_bwd": fa1_bwd_kernel (block_n = 16 * warps key rows outer, block_m query rows inner).
    ("fa1_fwd", "sm90", 32): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm90", 64): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm90", 96): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm90", 128): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm90", 256): Tile(16, 32, 4, 2),
    ("fa1_fwd", "sm80", 32): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm80", 64): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm80", 96): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm80", 128): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm80", 256): Tile(16, 32, 4, 2),
    ("fa1_fwd", "sm86", 32): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm86", 64): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm86", 96): Tile(16, 64, 8, 1),
    ("fa1_fwd", "sm86", 128): Tile(16, 64, 8, 1),
    ("fa1_fwd", "sm86", 256): Tile(16, 32, 4, 1),
    ("fa1_bwd", "sm90", 32): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm90", 64): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm90", 96): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm90", 128): Tile(32, 128, 8, 2),
    ("fa1_bwd", "sm80", 32): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm80", 64): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm80", 96): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm80", 128): Tile(32, 128, 8, 2),
    ("fa1_bwd", "sm86", 32): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm86", 64): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm86", 96): Tile(64, 64, 4, 1),
    ("fa1_bwd", "sm86", 128): Tile(32, 64, 4, 2),
    # direction "decode": flash_decode_kernel (any arch): 16 packed query rows, block_n keys per tile in a ring of
    # `stages` tiles, the warps taking block_n / warps keys each. d 128 tried on the H200 (2026-11-29,
    # tools/decode_tile_trial.py, docs/decoding.md): 64 / 4 / 2 best but in one cell of nine (3 stages 2-5 % slower).
    **{("decode", "any", d): Tile(16, 64, 4, 2) for d in DECODE_HEAD_DIMS},
    # d 256 and MLA (flash_decode_wide_kernel): block_m packed rows in 16-row groups; the warps of a group split
    # the keys of S and the columns of O (d 256: one group of 4 warps, 64 columns each; MLA: 4 groups of 2
    # warps, 256 of V's 512 columns each; 225 KiB of shared memory, so sm_90 only).
    ("decode_mla", "sm90", 576): Tile(64, 64, 8, 2),
    # direction "fwd_tf32x3" / "fwd_tf32": flash_fwd_kernel on float32 inputs with TF32 fragments (_TF32_TILES).
    **{(fam, arch, d): t for fam in TF32_FAMILIES.values() for (arch, d), t in _TF32_TILES.items()},
    # Arch class "f32": the FA1 float32 kernels (fa1_fwd_f32_kernel, fa1_bwd_f32_kernel; any GPU), 4 warps,
    # block_m = 1 query row per warp step; block_n key rows (forward: one lane per key, at most 32;
    # backward: block_n / 4 key rows per warp, their dK and dV in registers).
    **{("fa1_fwd", "f32", d): Tile(1, 32, 4, 1) for d in FA1_HEAD_DIMS},
    # ("fwd", "f32", d): FA2's float32 forward (flash_fwd_f32_kernel): block_m query rows, 4 warps of
    # block_m / 4 rows each, block_n <= 32 key rows (one lane per key).
    **{("fwd", "f32", d): Tile(16, 32, 4, 1) for d in HEAD_DIMS},
    # ("bwd", "f32", d): FA2's float32 dK/dV(+dQ) kernel (flash_bwd_dkdv_f32_kernel), one key tile of block_n
    # rows per block, as the FA1 float32 backward's tiles.
    **{("bwd", "f32", d): Tile(1, 32 if d <= 128 else 16, 4, 1) for d in HEAD_DIMS},
    **{("fa1_bwd", "f32", d): Tile(1, 32 if d <= 128 else 16, 4, 1) for d in FA1_HEAD_DIMS},
}


def _b(x: bool) -> str:
    return "true" if x else "false"


# ---------------------------------------------------------------------------------------------------
# Variants: the C++ policy type and its runtime values (cuflash_kernels/variants.cuh).

# Layout of `struct VariantParams` (variants.cuh): passed by value as a NumPy structured scalar.
VARIANT_PARAMS_DTYPE = np.dtype(
    [("cu_seqlens_q", np.uint64), ("cu_seqlens_k", np.uint64), ("seqused_k", np.uint64), ("alibi_slopes", np.uint64),
     ("alibi_sb", np.int64), ("bottom_right", np.int32), ("window_left", np.int32), ("window_right", np.int32),
     ("band_lo", np.int32), ("band_hi", np.int32), ("softcap_a", np.float32), ("softcap_b", np.float32),
     ("inv_scale", np.float32), ("qk_chunks", np.int32), ("v_chunks", np.int32), ("extra", np.uint64)],
    align=True,
)
assert VARIANT_PARAMS_DTYPE.itemsize == 88

# Layout of `struct ExtraParams` (variants.cuh): the values a block reads once, in device memory.
EXTRA_PARAMS_DTYPE = np.dtype(
    [("bias", np.uint64), ("sb", np.int64), ("sh", np.int64), ("sm", np.int64),
     ("dbias", np.uint64), ("dsb", np.int64), ("dsh", np.int64), ("dsm", np.int64),
     ("dropout_seed", np.uint64), ("dropout_offset", np.uint64), ("keep_threshold", np.uint32),
     ("keep_scale", np.float32), ("mod_ptr", np.uint64, (4,)), ("mod_len", np.int32, (4,)),
     ("tile_count", np.uint64), ("tile_list", np.uint64), ("tiles_sb", np.int64), ("tiles_sh", np.int64),
     ("tile_cols", np.int32), ("pad_", np.int32)],
    align=True,
)
assert EXTRA_PARAMS_DTYPE.itemsize == 176

# Layout of `struct PrefillAppend` (forward_sm90.cu, [prefill append]): passed by value after VariantParams.
PREFILL_APPEND_DTYPE = np.dtype(
    [("cache_seqlens", np.uint64), ("k_new", np.uint64), ("v_new", np.uint64), ("kn_sb", np.int64),
     ("kn_ss", np.int64), ("kn_sh", np.int64), ("vn_sb", np.int64), ("vn_ss", np.int64), ("vn_sh", np.int64),
     ("seqlen_new", np.int32), ("capacity", np.int32), ("k_cache", np.uint64), ("v_cache", np.uint64)],
    align=True,
)
assert PREFILL_APPEND_DTYPE.itemsize == 96
# The pointer fields of each record that a planned launch rewrites at every run, as byte offsets: VariantParams'
# arrays and its ExtraParams; ExtraParams' bias, dbias, the user mods' four arrays and the block lists.
VARIANT_POINTER_FIELDS = tuple(VARIANT_PARAMS_DTYPE.fields[name][1]
                               for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "alibi_slopes", "extra"))
EXTRA_POINTER_FIELDS = (EXTRA_PARAMS_DTYPE.fields["bias"][1], EXTRA_PARAMS_DTYPE.fields["dbias"][1],
                        *(EXTRA_PARAMS_DTYPE.fields["mod_ptr"][1] + 8 * i for i in range(4)),
                        EXTRA_PARAMS_DTYPE.fields["tile_count"][1], EXTRA_PARAMS_DTYPE.fields["tile_list"][1])

# The C++ source of each user-mod policy type in use (name -> source), appended to the kernel source of
# any instantiation whose name expression names it (cuflash/_ops/mods.py generates them; the name is a hash of
# the expressions, so one name is one source).
PRELUDES: dict[str, str] = {}


def has_dropout(variant: Variant) -> bool:
    """Whether the kernels apply dropout: p > 0 with a keep threshold below 2**8 (for p < ~1e-16, 1 - p
    rounds to 1: every score is kept and scaled by 1, which is no dropout)."""
    return bool(variant.dropout_p) and keep_threshold(variant.dropout_p) < THRESHOLD_ONE


# [variant mod] The C++ element types of a bias and of its gradient (variants.cuh: BiasElem).
BIAS_CTYPES = {"float32": "float", "float16": "cuflash::fp16", "bfloat16": "cuflash::bf16"}
NO_BIAS = "cuflash::NoBias"


def bias_policy(dtype: str, staged: bool = False, grad_dtype: str | None = None) -> str:
    """The bias policy ``cuflash::BiasArray<Elem, kStaged, Grad>`` (variants.cuh) of a bias of ``dtype`` whose
    gradient is written in ``grad_dtype`` (default: ``dtype``); ``staged``: the kernel copies each score tile's bias
    into shared memory with its K/V or Q/dO tiles ([variant bias tile]) instead of reading it from global memory."""
    elem = BIAS_CTYPES[dtype]
    grad = "" if grad_dtype in (None, dtype) else f", {BIAS_CTYPES[grad_dtype]}"
    return f"cuflash::BiasArray<{elem}, {_b(staged)}{grad}>"


def variant_type(variant: Variant, pads_head_dim: bool = False, staged_bias: bool = False,
                 dbias_dtype: str | None = None) -> str:
    """The C++ policy type ``cuflash::Variant<Has_left, Has_right, Is_varlen, Has_seqused, Has_softcap,
    Has_alibi, Bias, Has_dropout, Mod, Pads_head_dim>`` of a variant: only what changes the compiled code
    (values travel in VariantParams and ExtraParams). ``pads_head_dim``: the arrays' head dims are below the
    kernel's (``[variant head dim]``; their column counts travel in VariantParams). ``Bias``: NoBias, or
    :func:`bias_policy` of the variant's bias with ``staged_bias`` and the gradient's dtype ``dbias_dtype``."""
    bias = variant.bias
    flags = (variant.window_left is not None, variant.right is not None, variant.is_varlen,
             variant.seqused_k is not None, bool(variant.softcap), variant.alibi_slopes is not None,
             NO_BIAS if bias is None else bias_policy(np.dtype(bias.dtype).name, staged_bias, dbias_dtype),
             has_dropout(variant))
    return _policy(flags, variant.mods, pads_head_dim)


def _bias_arg(x) -> str:
    """A policy's bias argument: a policy string, or a flag (True: a float32 bias read from global memory)."""
    return x if isinstance(x, str) else (bias_policy("float32") if x else NO_BIAS)


@functools.lru_cache(maxsize=1024)  # (every launch names its policy: the string once per flags and mods)
def _policy(flags, mods=None, pads_head_dim: bool = False) -> str:
    """``cuflash::Variant<...>`` of 8 flags (the seventh, the bias, a flag or a :func:`bias_policy` string)."""
    args = ", ".join(_bias_arg(x) if i == 6 else _b(x) for i, x in enumerate(flags))
    if mods is not None:
        PRELUDES.setdefault(mods.type_name, mods.source)
        args += f", cuflash::{mods.type_name}"
    if pads_head_dim:
        args += f"{'' if mods is not None else ', cuflash::NoMod'}, true"
    return f"cuflash::Variant<{args}>"


def mask_policy(variant: Variant) -> str:
    """The policy type of ``variant``'s block lists: only what decides visibility (band, lengths, mask_mod)."""
    flags = (variant.window_left is not None, variant.right is not None, variant.is_varlen,
             variant.seqused_k is not None, False, False, False, False)
    return _policy(flags, variant.mods)


def policy_args(policy: str) -> list[str]:
    """The template arguments of a ``cuflash::Variant<...>`` policy string, split at its top-level commas."""
    inner = policy[policy.index("<") + 1:policy.rindex(">")]
    args, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            args.append(inner[start:i].strip())
            start = i + 1
    args.append(inner[start:].strip())
    return args


@functools.lru_cache(maxsize=1024)
def staged_bias_bytes(policy: str) -> int:
    """The element size of a staged bias in a ``cuflash::Variant<...>`` policy string ([variant bias tile]: the
    shared memory of its tiles), 0 where the policy stages none."""
    if not policy.startswith("cuflash::Variant<"):
        return 0
    bias = policy_args(policy)[6]
    if not bias.startswith("cuflash::BiasArray<") or policy_args(bias)[1] != "true":
        return 0
    return 4 if policy_args(bias)[0] == "float" else 2


def prelude_of(*names: str) -> str:
    """The generated user-mod sources (each once) that the name expressions ``names`` refer to."""
    return "".join(f"\n{src}" for type_name, src in PRELUDES.items() if any(type_name in n for n in names))


DENSE = variant_type(Variant())


def _ptr(a) -> int:
    return 0 if a is None else int(a.data.ptr)


def _strides_of(a, n: int) -> tuple[int, ...]:
    return (0,) * n if a is None else tuple(s // a.itemsize for s in a.strides[:n])


def extra_record(variant: Variant, dbias=None, tiles=None) -> np.ndarray | None:
    """``struct ExtraParams`` (variants.cuh) on the host, or None when the variant needs none: the bias
    ((batch, heads_q, seqlen_q, seqlen_k) float16, bfloat16 or float32, the policy's BiasArray element, with a
    contiguous last axis) and its gradient buffer ``dbias`` (or None; the policy's BiasArray gradient type), the dropout seed, offset, keep threshold and 1 / (1 - p), the user mods' arrays,
    and ``tiles``, mask_mod's compacted block lists for one launch: ``(count, list)``, int32 arrays
    ``(Bm, Hm, rows)`` and ``(Bm, Hm, rows, cols)`` (Bm, Hm: 1 where the map broadcasts). A 0-d record; its
    pointer fields are :data:`EXTRA_POINTER_FIELDS`."""
    drop = has_dropout(variant)
    if variant.bias is None and not drop and variant.mods is None:
        return None
    e = np.zeros((), EXTRA_PARAMS_DTYPE)
    bias = variant.bias
    e["bias"], (e["sb"], e["sh"], e["sm"]) = _ptr(bias), _strides_of(bias, 3)
    e["dbias"], (e["dsb"], e["dsh"], e["dsm"]) = _ptr(dbias), _strides_of(dbias, 3)
    if drop:
        e["dropout_seed"], e["dropout_offset"] = variant.dropout_seed, variant.dropout_offset
        e["keep_threshold"] = keep_threshold(variant.dropout_p)
        e["keep_scale"] = 1.0 / (1.0 - variant.dropout_p)
    for slot, a in enumerate(variant.mod_arrays or ()):
        e["mod_ptr"][slot], e["mod_len"][slot] = _ptr(a), a.size
    if tiles is not None:
        count, lists = tiles
        bm, hm, rows, cols = lists.shape
        e["tile_count"], e["tile_list"], e["tile_cols"] = _ptr(count), _ptr(lists), cols
        e["tiles_sb"], e["tiles_sh"] = (hm * rows if bm > 1 else 0), (rows if hm > 1 else 0)
    return e


def device_record(e: np.ndarray, *, cached: bool = True):
    """The device copy of an ExtraParams record. ``cached``: kept by content (and stream: a later call on another
    stream must not read a copy still in flight), so that a call that repeats its arrays (a BlockMask, a bias
    reused across layers) costs no host copy; not for a record that points to a dbias buffer, new at every
    backward (the copy would only hold memory)."""
    import cupy

    if not cached:
        return cupy.asarray(e.reshape(1).view(np.uint8))
    key = (cupy.cuda.get_current_stream().ptr, cupy.cuda.runtime.getDevice(), e.tobytes())
    device = _EXTRA_CACHE.get(key)
    if device is None:
        if len(_EXTRA_CACHE) >= _EXTRA_CACHE_SIZE:
            _EXTRA_CACHE.pop(next(iter(_EXTRA_CACHE)))
        device = _EXTRA_CACHE[key] = cupy.asarray(e.reshape(1).view(np.uint8))
    return device


def extra_params(variant: Variant, dbias=None, tiles=None):
    """:func:`extra_record` in device memory (None when the variant needs none)."""
    e = extra_record(variant, dbias, tiles)
    return None if e is None else device_record(e, cached=dbias is None)


_EXTRA_CACHE: dict = {}
_EXTRA_CACHE_SIZE = 256


def variant_params(variant: Variant, scale: float, seqlen_q: int, seqlen_k: int, extra=None,
                   head_dims: tuple[int, int] = (0, 0)) -> np.void:
    """The kernels' VariantParams for ``variant`` (device pointers of its arrays, edges, softcap constants);
    ``seqlen_q``, ``seqlen_k``: a padded batch's lengths (they place the band of every sequence);
    ``extra``: :func:`extra_params` of the variant; ``head_dims``: the arrays' (d, dv) where they are below the
    kernel's head dim (``Pads_head_dim``; multiples of 8)."""
    slopes = variant.alibi_slopes
    left, right = variant.window_left or 0, variant.right or 0
    offset = variant.offset(seqlen_q, seqlen_k)
    cap = variant.softcap
    return np.array((
        _ptr(variant.cu_seqlens_q), _ptr(variant.cu_seqlens_k), _ptr(variant.seqused_k), _ptr(slopes),
        0 if slopes is None else slopes.strides[0] // slopes.itemsize,
        int(variant.bottom_right), left, right, offset - left, offset + right,
        scale / cap if cap else 0.0, cap / scale if cap else 0.0, 1.0 / scale,
        head_dims[0] // 8, head_dims[1] // 8, _ptr(extra),
    ), VARIANT_PARAMS_DTYPE)[()]


# ---------------------------------------------------------------------------------------------------
# Kernel families and specs.


@dataclass(frozen=True)
class Family:
    """One C++ kernel template: where it lives, how its template arguments are spelled, its shared memory."""

    source: str
    kernel: str
    template: Callable[["KernelSpec"], str]
    smem: Callable[[int, Tile], int]
    options: tuple[str, ...] = NVRTC_OPTIONS
    threads: int = 0  # a fixed block size (the small elementwise kernels); 0: 32 x the tile's warps
    bias_tiles: int = 0  # [variant bias tile] block_m x block_n bias tiles it stages for a staged bias (0: none)
    # blocks per SM the kernel is built for (its __launch_bounds__), where a staged bias must leave them room
    min_blocks: Callable[[int, Tile], int] = lambda d, t: 1
    # the kernel's flat entry point (its VariantParams' fields as separate parameters: launchers that pass only
    # pointers and scalars, cuflash.jax's kernel calls), or "" where it has none
    flat_kernel: str = ""
    # [pdl] its instantiations with key counts (seqused_k) wait for the kernel launched before them (griddepcontrol.wait)
    # before reading: a launcher may start them with programmatic stream serialization (chunked prefill's forward)
    waits_for_prior_grid: bool = False


def _t16(s: "KernelSpec", ctypes: dict = CTYPES) -> str:  # <T, d, block_m, block_n, warps, stages, V>
    t = s.tile
    return f"{ctypes[s.dtype]}, {s.head_dim}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, {s.variant}"


def _t32(s: "KernelSpec") -> str:  # flash_fwd_kernel on float32: <tf32 or tf32x3, d, block_m, block_n, warps, stages, V>
    t = s.tile
    return f"{TF32_TAGS[s.family]}, {s.head_dim}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, {s.variant}"


def _tf32_smem(d: int, t: Tile) -> int:  # float32 Q, stages x (K, V), rows of d floats (a multiple of 32)
    return 4 * d * (t.block_m + 2 * t.stages * t.block_n)


def _fwd_sm90_smem(d: int, t: Tile) -> int:
    # Q, stages x (K, V); + 1024: the kernel aligns its base to 1024 bytes; + 128: the mbarriers of the
    # warp-specialized variant
    return 2 * d * (t.block_m + 2 * t.stages * t.block_n) + 1024 + 128


def _fwd_sm90_vt_smem(element_bytes: int):
    """[fp8], [tf32] The V^T entry point's shared memory for elements of this many bytes: Q's tile (where a 16-bit O
    is staged: at least 2 bytes an element), stages x (K, V^T); + 1024 alignment and 128 of mbarriers."""
    return lambda d, t: (max(element_bytes, 2) * d * t.block_m + 2 * t.stages * t.block_n * d * element_bytes + 1024
                         + 128)


def bwd_sm90_shares_keys(t: Tile) -> bool:
    """[bwd shared keys] Whether the wgmma dK/dV kernel's two warpgroups share the tile's keys (Sm90BwdConfig::
    kShareKeys: 64 keys, eight warps; d 256's row) instead of owning 64 each."""
    return t.block_n == 8 * t.warps and t.warps == 8


def _bwd_sm90_smem(d: int, t: Tile) -> int:
    # Sm90BwdConfig::kSmemBytes: K, V; 2 x (Q, dO); dS^T (16-bit; [bwd shared keys] and P^T); 2 x (lse, D) float32;
    # + 1024 alignment
    pt = 2 if bwd_sm90_shares_keys(t) else 1
    return 2 * (2 * t.block_n * d + 4 * t.block_m * d + pt * t.block_n * t.block_m) + 16 * t.block_m + 1024


def _bwd_sm90_tma_smem(d: int, t: Tile) -> int:
    """The TMA dK/dV entry point's (Sm90BwdConfig::kTmaSmemBytes): the cp.async kernel's + 64 bytes of mbarriers + its
    float32 dQ tile of block_m rows of d + 8 + a second dS^T, 1024-byte aligned; [bwd shared keys]: no dQ tile, a
    second dS^T and P^T."""
    if bwd_sm90_shares_keys(t):
        return _bwd_sm90_smem(d, t) + 64 + 4 * t.block_n * t.block_m
    return _bwd_sm90_smem(d, t) + 64 + 4 * t.block_m * (d + 8) + 2 * t.block_n * t.block_m + 1024


def _dkdv_smem(d: int, t: Tile) -> int:
    tiles = 2 * t.block_n * d + 2 * t.stages * t.block_m * d + 2 * t.block_n * t.block_m  # K, V; Q, dO; P^T, dS^T
    return 2 * tiles + 4 * 2 * t.stages * t.block_m  # 16-bit tiles + float32 lse and D per stage


def _bwd_f32_smem(d: int, t: Tile) -> int:
    # bwd_f32_key_tile (f32_tiles.cuh): K, V; one Q and dO row; a dQ row per warp
    return 4 * d * (2 * t.block_n + 2 + t.warps)


def _fa1_bwd_smem(d: int, t: Tile) -> int:
    tiles = 2 * t.block_n * d + 2 * t.stages * t.block_m * d + t.block_n * t.block_m  # K, V; Q, dO; dS^T
    return 2 * tiles + 4 * 2 * t.stages * t.block_m


def _no_smem(d: int, t: Tile) -> int:
    return 0


def _wide_decode_args(s: "KernelSpec", dv: int, shared: str) -> str:
    t = s.tile
    return (f"{CTYPES[s.dtype]}, {s.head_dim}, {t.block_m}, {t.block_n}, {t.warps}, "
            f"cuflash::DecodeCache<{dv}, {shared}, {s.variant}>")


def _wide_decode_smem(d: int, dv: int, shared_kv: bool, t: Tile) -> int:
    """WideDecodeConfig::kSmemBytes (decode.cu): Q, 2 stages of K (and V unless it is read from K), P (16-bit),
    and the row maxima and sums of the column parts (float32)."""
    col_split = t.warps // (t.block_m // 16)
    tiles = t.block_m * d + 2 * t.block_n * (d + (0 if shared_kv else dv)) + t.block_m * t.block_n
    return 2 * tiles + 2 * 4 * t.block_m * col_split


def _mla_sm90_smem(d: int, t: Tile) -> int:
    """flash_decode_mla_sm90_kernel's shared memory (decode_sm90.cu): Q and two key tiles (16-bit), four float32 rows
    of the block (m0, m1, exp2(m0 - m1), and the two warpgroups' row sums: 5 x block_m floats) and 19 mbarriers."""
    return 2 * (t.block_m * d + 2 * t.block_n * d) + 4 * 5 * t.block_m + 8 * 19


def decode_family(head_dim: int, head_dim_v: int, cc: int = 0) -> tuple[str, Tile, str]:
    """The split kernel's family, tile and arch class for decoding at these head dims on a GPU of compute capability
    ``cc`` (0: any; the launcher and :func:`instantiations` both ask here). MLA runs the wgmma kernel on sm_90 (unless
    :data:`SM90A_DECODE` is off), the mma.sync one elsewhere."""
    if (head_dim, head_dim_v) == DECODE_MLA_DIMS:
        family = "decode_mla_sm90" if cc == 90 and SM90A_DECODE else "decode_mla"
        return family, TILES[("decode_mla", "sm90", head_dim)], "sm90"
    return ("decode_wide" if head_dim > 128 else "decode"), TILES[("decode", "any", head_dim)], "any"


FAMILIES: dict[str, Family] = {
    # FlashAttention-2 order, every variant.
    # (shared-memory rows of a multiple of 32 elements: a head dim of 16 * odd, [variant head dim], pads them)
    "fwd": Family("forward.cu", "flash_fwd_kernel", _t16,
                  lambda d, t: 2 * (-(-d // 32) * 32) * (t.block_m + 2 * t.stages * t.block_n),
                  flat_kernel="flash_fwd_flat_kernel"),
    "fwd_sm90": Family(
        "forward_sm90.cu", "flash_fwd_sm90_kernel", _t16, _fwd_sm90_smem, SM90A_OPTIONS, bias_tiles=2,
        # Sm90Config::kMinBlocks: two 8-warp blocks where S, O and P fit 128 registers (no producer warpgroup)
        min_blocks=lambda d, t: 2 if t.warps == 8 and t.block_m == 16 * t.warps and t.block_n + d <= 128 else 1,
        flat_kernel="flash_fwd_sm90_flat_kernel", waits_for_prior_grid=True),
    # Its TMA entry point (the tensor maps of q, k and v after the launcher's parameters; no flat entry point and no
    # staged bias: cuflash.jax's kernel calls and a staged bias take "fwd_sm90").
    "fwd_sm90_tma": Family(
        "forward_sm90.cu", "flash_fwd_sm90_tma_kernel", _t16, _fwd_sm90_smem, SM90A_OPTIONS, waits_for_prior_grid=True),
    # ... with chunked prefill's append fused in ([prefill append]: the append's parameters and the new keys' and
    # values' maps after VariantParams; one tile a block, key counts)
    "fwd_sm90_tma_append": Family(
        "forward_sm90.cu", "flash_fwd_sm90_tma_append_kernel", _t16, _fwd_sm90_smem, SM90A_OPTIONS),
    # ... run persistent ([fwd persistent]: a block per SM walks the query tiles; + O's staging tile of its own, 16-bit
    # padded batches without key counts: attention._persistent_forward)
    "fwd_sm90_tma_persistent": Family(
        "forward_sm90.cu", "flash_fwd_sm90_tma_kernel", lambda s: f"{_t16(s)}, true",
        lambda d, t: _fwd_sm90_smem(d, t) + 2 * d * t.block_m, SM90A_OPTIONS,
        # Sm90Config::kMinBlocks of the warp-specialized tiles: two blocks an SM of one computing warpgroup (the grid)
        min_blocks=lambda d, t: 2 if t.block_m == 64 else 1),
    # Its V^T entry point (V^T's map, the descale factors' pointer before VariantParams): [fp8] e4m3 inputs, and [tf32]
    # float32 ones with one TF32 product.
    "fwd_sm90_fp8": Family(
        "forward_sm90.cu", "flash_fwd_sm90_vt_kernel", lambda s: _t16(s, VT_CTYPES), _fwd_sm90_vt_smem(1),
        SM90A_OPTIONS),
    "fwd_sm90_tf32": Family(
        "forward_sm90.cu", "flash_fwd_sm90_vt_kernel", lambda s: _t16(s, VT_CTYPES), _fwd_sm90_vt_smem(4),
        SM90A_OPTIONS),
    # ... and [f16x2] float32 ones split in two fp16 parts each (V read as it is, not as V^T: fp16 wgmma reads it
    # MN-major), with the largest magnitudes' bits of q, k and v in the descale factors' place
    "fwd_sm90_f16x2": Family(
        "forward_sm90.cu", "flash_fwd_sm90_vt_kernel", lambda s: _t16(s, F16X2_CTYPES), _fwd_sm90_vt_smem(4),
        SM90A_OPTIONS),
    # ... and the split itself: a tensor's largest magnitude, then its parts (256 float4 a block)
    "absmax_f32": Family("forward_sm90.cu", "absmax_f32_kernel", lambda s: f"{s.head_dim}", _no_smem, SM90A_OPTIONS,
                         threads=256),
    "split_f16x2": Family("forward_sm90.cu", "split_f16x2_kernel", lambda s: f"{s.head_dim}", _no_smem, SM90A_OPTIONS,
                          threads=256),
    # ... and V^T for them ([fp8 v]: one tile of TRANSPOSE_V_KEYS keys of one head a block; the element type by dtype)
    "transpose_v": Family("forward_sm90.cu", "transpose_v_kernel",
                          lambda s: f"{VT_CTYPES[s.dtype]}, {s.head_dim}, {TRANSPOSE_V_KEYS[s.dtype]}",
                          _no_smem, SM90A_OPTIONS, threads=256),
    # ... and [tf32]'s q and k rounded to TF32 ([tf32 qk]: 256 float4 a block)
    "round_tf32": Family("forward_sm90.cu", "round_tf32_kernel", lambda s: f"{s.head_dim}", _no_smem, SM90A_OPTIONS,
                         threads=256),
    # The same kernel on float32 inputs, TF32 fragments (tf32_tiles.cuh): 3xTF32, or one TF32 product.
    "fwd_tf32x3": Family("forward.cu", "flash_fwd_kernel", _t32, _tf32_smem, flat_kernel="flash_fwd_flat_kernel"),
    "fwd_tf32": Family("forward.cu", "flash_fwd_kernel", _t32, _tf32_smem, flat_kernel="flash_fwd_flat_kernel"),
    "fwd_f32": Family(
        "forward.cu", "flash_fwd_f32_kernel", lambda s: f"{s.head_dim}, {s.tile.block_m}, {s.tile.block_n}, {s.variant}",
        lambda d, t: 4 * (t.block_n * (2 * d + 1) + t.block_m * d)),  # K (rows padded by one float), V; queries
    "bwd_dkdv": Family("backward.cu", "flash_bwd_dkdv_kernel", lambda s: f"{_t16(s)}, {_b(s.has_dq)}", _dkdv_smem,
                       flat_kernel="flash_bwd_dkdv_flat_kernel"),
    "bwd_dkdv_sm90": Family(
        "backward_sm90.cu", "flash_bwd_dkdv_sm90_kernel", lambda s: f"{_t16(s)}, {_b(s.has_dq)}", _bwd_sm90_smem,
        SM90A_OPTIONS, bias_tiles=2, flat_kernel="flash_bwd_dkdv_sm90_flat_kernel"),
    # Its TMA entry point (the tile counter of [bwd persistent] and the tensor maps of q, k, v and dO after the
    # launcher's parameters; _bwd_sm90_tma_smem, reserved whether or not a build uses it all ([bwd dq bulk], [bwd
    # flow]: compile-time options; one block per SM either way); no flat entry point and no staged bias: cuflash.jax's
    # kernel calls and a staged bias take "bwd_dkdv_sm90")
    "bwd_dkdv_sm90_tma": Family(
        "backward_sm90.cu", "flash_bwd_dkdv_sm90_tma_kernel", lambda s: f"{_t16(s)}, {_b(s.has_dq)}",
        _bwd_sm90_tma_smem, SM90A_OPTIONS),
    # ... run persistent ([bwd persistent]: a block per SM taking key tiles from a counter; the same shared memory
    # and two int32 of its own: attention.BWD_PERSISTENT_DIMS)
    "bwd_dkdv_sm90_tma_persistent": Family(
        "backward_sm90.cu", "flash_bwd_dkdv_sm90_tma_kernel", lambda s: f"{_t16(s)}, {_b(s.has_dq)}, true",
        _bwd_sm90_tma_smem, SM90A_OPTIONS),
    "bwd_dkdv_f32": Family(
        "backward.cu", "flash_bwd_dkdv_f32_kernel",
        lambda s: f"{s.head_dim}, {s.tile.block_n}, {s.variant}, {_b(s.has_dq)}", _bwd_f32_smem),
    "bwd_dq": Family("backward.cu", "flash_bwd_dq_kernel", _t16, lambda d, t: 2 * d * (2 * t.block_m + 2 * t.stages * t.block_n),
                     flat_kernel="flash_bwd_dq_flat_kernel"),
    "bwd_dq_f32": Family(
        "backward.cu", "flash_bwd_dq_f32_kernel", lambda s: f"{s.head_dim}, {s.variant}", _no_smem, threads=128),
    # Small kernels of the backward (no variant: they see rows only).
    "bwd_pre": Family(
        "backward.cu", "flash_bwd_preprocess_kernel", lambda s: f"{CTYPES[s.dtype]}, {s.head_dim}", _no_smem, threads=256),
    "bwd_pre_f32": Family(
        "backward.cu", "flash_bwd_preprocess_f32_kernel", lambda s: f"{s.head_dim}", _no_smem, threads=128),
    "bwd_convert_dq": Family(
        "backward.cu", "flash_bwd_convert_dq_kernel", lambda s: f"{CTYPES[s.dtype]}, {s.head_dim}", _no_smem,
        threads=256),
    # [bwd dq tile] ... from the workspace that the TMA dK/dV entry point fills in fragment order (backward_sm90.cu)
    "bwd_convert_dq_tiles": Family(
        "backward_sm90.cu", "flash_bwd_convert_dq_tiles_kernel",
        lambda s: f"{CTYPES[s.dtype]}, {s.head_dim}, {s.tile.block_m}",  # (block_m: the tiles' rows)
        _no_smem, SM90A_OPTIONS, threads=256),
    "bwd_reduce_dkv": Family(
        "backward.cu", "flash_bwd_reduce_dkv_kernel", lambda s: f"{CTYPES[s.dtype]}, {s.head_dim}", _no_smem,
        threads=256),
    # mask_mod's block lists for one launch's tiling (block_map.cu): tile = (block_m, block_n) of that launch;
    # each tile's status, then the lists compacted from it (no template arguments).
    "block_lists": Family(
        "block_map.cu", "block_status_kernel", lambda s: f"{s.variant}, {s.tile.block_m}, {s.tile.block_n}, false",
        _no_smem, threads=128),
    "block_lists_t": Family(
        "block_map.cu", "block_status_kernel", lambda s: f"{s.variant}, {s.tile.block_m}, {s.tile.block_n}, true",
        _no_smem, threads=128),
    "block_compact": Family("block_map.cu", "block_compact_kernel", lambda s: "", _no_smem, threads=32),
    # KV-cache decoding, split-KV (decode.cu): the variant slot holds kPaged ("true" / "false"); tile block_m =
    # 16 packed query rows, block_n keys per tile, warps splitting each tile's keys.
    "decode": Family(
        "decode.cu", "flash_decode_kernel",
        lambda s: f"{CTYPES[s.dtype]}, {s.head_dim}, {s.tile.block_n}, {s.tile.warps}, {s.tile.stages}, {s.variant}",
        lambda d, t: 2 * (t.block_m * d + 2 * t.stages * t.block_n * d)),  # Q + stages x (K + V), 16-bit
    # Head dims whose O does not fit a warp at 16 rows: flash_decode_wide_kernel, with the cache policy
    # cuflash::DecodeCache<dv, kSharedKV, kPaged> (the variant slot holds kPaged). "decode_wide": V its own
    # cache of head dim d; "decode_mla": V the first d - 64 columns of the K tile (MLA's latent; 64 rope dims).
    "decode_wide": Family(
        "decode.cu", "flash_decode_wide_kernel", lambda s: _wide_decode_args(s, s.head_dim, "false"),
        lambda d, t: _wide_decode_smem(d, d, False, t)),
    "decode_mla": Family(
        "decode.cu", "flash_decode_wide_kernel", lambda s: _wide_decode_args(s, s.head_dim - 64, "true"),
        lambda d, t: _wide_decode_smem(d, d - 64, True, t)),
    # The same on Hopper's wgmma (decode_sm90.cu: 2 warpgroups out of phase over pairs of key tiles, O by column
    # halves; the tile of "decode_mla", its own shared memory; the variant slot holds kPaged).
    "decode_mla_sm90": Family(
        "decode_sm90.cu", "flash_decode_mla_sm90_kernel", lambda s: f"{CTYPES[s.dtype]}, {s.variant}",
        lambda d, t: _mla_sm90_smem(d, t), SM90A_OPTIONS),
    # Its [decode append] (before it; the variant slot holds kPaged; the elements are copied as 16-bit words, so
    # the name has no dtype) and [decode merge] of the splits (after it; head_dim = v's head dim).
    "decode_append": Family("decode.cu", "decode_append_kernel", lambda s: s.variant, _no_smem, threads=128),
    "decode_merge": Family(
        "decode.cu", "decode_merge_kernel", lambda s: f"{CTYPES[s.dtype]}, {s.head_dim}", _no_smem, threads=128),
    # [decode rotary] q and the new k rotated into the launch's contiguous copies, before the append (the variant slot
    # holds the tables' element type: "float", or q's cuflash::fp16 / cuflash::bf16; any head dim: no dim in the name)
    "decode_rotary": Family(
        "decode.cu", "decode_rotary_kernel", lambda s: f"{CTYPES[s.dtype]}, {s.variant}", _no_smem, threads=128),
    # Cascade attention's [cascade prefix] packing of q (16-bit words: no dtype in the name) and [cascade merge] of
    # the prefix chunks and the suffix (head_dim = v's head dim).
    "cascade_pack": Family("decode.cu", "cascade_pack_kernel", lambda s: "", _no_smem, threads=128),
    "cascade_merge": Family(
        "decode.cu", "cascade_merge_kernel", lambda s: f"{CTYPES[s.dtype]}, {s.head_dim}", _no_smem, threads=128),
    # FlashAttention-1 order: dense or causal only (the variant slot holds Is_causal).
    "fa1_fwd": Family(
        "fa1.cu", "fa1_fwd_kernel", _t16,
        lambda d, t: 2 * d * (2 * t.block_n + t.block_m * t.warps * t.stages)),  # K, V + per warp stages x Q
    "fa1_bwd": Family("fa1.cu", "fa1_bwd_kernel", _t16, _fa1_bwd_smem),
    "fa1_fwd_f32": Family(
        "fa1.cu", "fa1_fwd_f32_kernel", lambda s: f"{s.head_dim}, {s.tile.block_n}, {s.variant}",
        lambda d, t: 4 * (t.block_n * (d + 1) + t.block_n * d + t.warps * d)),  # K (padded rows), V, a row per warp
    "fa1_bwd_f32": Family(
        "fa1.cu", "fa1_bwd_f32_kernel", lambda s: f"{s.head_dim}, {s.tile.block_n}, {s.variant}", _bwd_f32_smem),
}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel instantiation. ``variant`` is the C++ policy type (FA1 families: "true"/"false", causal)."""

    family: str
    dtype: str
    head_dim: int
    tile: Tile = Tile(0, 0, 4, 1)
    variant: str = DENSE
    has_dq: bool = False
    arch: str = ""  # the tile's arch class in TILES ("sm80", "sm90a", "f32", ...): which GPUs run it

    @property
    def targets(self) -> tuple[str, ...]:
        """The NVRTC targets this instantiation runs on (what CI compiles it for)."""
        if self.options != NVRTC_OPTIONS or self.arch in ("sm90", "sm90a"):
            return ("sm_90a",)
        if self.arch in ("sm80", "sm86"):
            return ("sm_80",)
        return ("sm_80", "sm_90a")

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def source(self) -> str:
        return self.fam.source

    @property
    def name(self) -> str:
        """The NVRTC name expression."""
        args = self.fam.template(self)
        return f"cuflash::{self.fam.kernel}<{args}>" if args else f"cuflash::{self.fam.kernel}"

    @property
    def flat_name(self) -> str | None:
        """The NVRTC name expression of the kernel's flat entry point (:attr:`Family.flat_kernel`), or None."""
        args = self.fam.template(self)
        return f"cuflash::{self.fam.flat_kernel}<{args}>" if self.fam.flat_kernel else None

    @property
    def options(self) -> tuple[str, ...]:
        return self.fam.options

    @property
    def smem(self) -> int:
        """Dynamic shared memory in bytes."""
        t = self.tile
        return self.fam.smem(self.head_dim, t) + self.fam.bias_tiles * t.block_m * t.block_n * staged_bias_bytes(self.variant)

    @property
    def threads(self) -> int:
        return self.fam.threads or 32 * self.tile.warps

    @property
    def reads_block_lists(self) -> bool:
        """Whether a mask_mod reaches this kernel as block lists of its tiles (the tensor-core FA2 kernels, 16-bit and
        TF32), not score by score (the SIMT float32 kernels, which read no lists)."""
        return not self.family.endswith("_f32")


# The block lists' compaction (block_map.cu): one kernel for every mask and tiling.
BLOCK_COMPACT = KernelSpec("block_compact", "float32", 0, arch="f32")


@functools.lru_cache(maxsize=None)
def spec(family: str, dtype: str, head_dim: int, tile: Tile = Tile(0, 0, 4, 1), variant: str = DENSE,
         has_dq: bool = False) -> KernelSpec:
    """The one (interned) KernelSpec of these arguments: the launcher's per-call lookups hash a few strings
    and ints instead of building and hashing a new dataclass."""
    return KernelSpec(family, dtype, head_dim, tile, variant, has_dq)


# ---------------------------------------------------------------------------------------------------
# What CI compiles: every tile-table row with the dense and causal variants (both dtypes), plus one
# representative instantiation of every other policy flag in every FA2 family (not the cross product),
# each for the targets whose GPUs run it (KernelSpec.targets).

# Each row a policy's flags: (Has_left, Has_right, Is_varlen, Has_seqused, Has_softcap, Has_alibi, Has_bias,
# Has_dropout).
_SHOWCASE = (
    (True, True, False, False, False, False, False, False),   # a sliding window
    (False, True, True, False, False, False, False, False),   # packed sequences, causal
    (False, False, False, True, False, False, False, False),  # key padding
    (False, True, False, False, True, False, False, False),   # softcap, causal
    (True, True, False, False, False, True, False, False),    # ALiBi in a causal window
    (False, True, False, False, False, False, True, False),   # a bias (and masks), causal
    (False, False, False, False, False, False, False, True),  # dropout
    (True, True, False, True, True, True, True, True),        # every flag of padded batches
    (True, True, True, True, True, True, False, True),        # every flag of packed batches
)

_FA2_FAMILIES = {  # tile direction, arch class -> families that take that row
    ("fwd", "sm90a"): ("fwd_sm90",), ("fwd", "sm90a_tma"): ("fwd_sm90_tma",),
    ("fwd", "sm90a_tma_short"): ("fwd_sm90_tma",), ("fwd", "f32"): ("fwd_f32",), ("fwd", "sm90a_fp8"): ("fwd_sm90_fp8",),
    ("fwd", "sm90a_tf32"): ("fwd_sm90_tf32",), ("fwd", "sm90a_f16x2"): ("fwd_sm90_f16x2",),
    ("bwd", "sm90a"): ("bwd_dkdv_sm90", "bwd_dkdv_sm90_tma"),
    ("bwd", "sm90a_tma"): ("bwd_dkdv_sm90_tma", "bwd_dkdv_sm90_tma_persistent"),
    ("fwd_tf32x3", None): ("fwd_tf32x3",), ("fwd_tf32", None): ("fwd_tf32",),
    ("bwd", "f32"): ("bwd_dkdv_f32",), ("fwd", None): ("fwd",), ("bwd", None): ("bwd_dkdv",),
    ("bwd_dq", None): ("bwd_dq",),
}


_SHOWCASE_ROWS = {  # FA2 family -> the tile-table row (direction, arch class) it is shown at
    "fwd": ("fwd", "sm80"), "fwd_sm90": ("fwd", "sm90a"), "fwd_f32": ("fwd", "f32"), "bwd_dkdv": ("bwd", "sm80"),
    "bwd_dkdv_sm90": ("bwd", "sm90a"), "bwd_dkdv_f32": ("bwd", "f32"), "bwd_dq": ("bwd_dq", "sm80"),
    "fwd_tf32x3": ("fwd_tf32x3", "sm90"), "fwd_tf32": ("fwd_tf32", "sm90"),
}


def _float32_only(family: str, arch: str) -> bool:
    """Whether a family's instantiations are float32 only (the SIMT and the TF32 kernels)."""
    return arch == "f32" or family in TF32_TAGS



def _row_families(direction: str, arch: str) -> tuple[str, ...]:
    if direction.startswith("fa1"):
        return (direction + ("_f32" if arch == "f32" else ""),)
    return _FA2_FAMILIES.get((direction, arch)) or _FA2_FAMILIES[(direction, None)]


def instantiations() -> list[KernelSpec]:
    """The instantiations CI compiles (and a GPU machine could precompile): every tile-table row with the
    dense and causal variants, each variant flag once in every FA2 family, and the small backward kernels."""
    out: dict[tuple[str, str], KernelSpec] = {}

    def add(spec: KernelSpec) -> None:
        out.setdefault((spec.source, spec.name), spec)

    for (direction, arch, d), t in TILES.items():
        if direction.startswith("decode"):  # below, with its paged / contiguous variants
            continue
        for fam in _row_families(direction, arch):
            dtypes = (("float32",) if _float32_only(fam, arch) or fam in ("fwd_sm90_tf32", "fwd_sm90_f16x2")
                      else tuple(FP8_CTYPES if fam == "fwd_sm90_fp8" else CTYPES))
            is_fa1 = fam.startswith("fa1")
            variants = ("false", "true") if is_fa1 else (DENSE, variant_type(Variant(causal=True)))
            for dtype in dtypes:
                for var in variants:
                    # (the TMA dK/dV row: only where dQ is in the launch)
                    for has_dq in ((True,) if arch == "sm90a_tma" else (True, False) if fam.startswith("bwd_dkdv")
                                   else (False,)):
                        add(KernelSpec(fam, dtype, d, t, var, has_dq, "sm90a" if arch == "sm90a_tma" else arch))
    # Every variant flag in every FA2 family, once each, at the H100's head-dim-128 tile (bf16; float32 for
    # the SIMT kernels), the register-heaviest common case.
    for fam, row in _SHOWCASE_ROWS.items():
        dtype = "float32" if _float32_only(fam, row[1]) else "bfloat16"
        for v in _SHOWCASE:
            add(KernelSpec(fam, dtype, 128, TILES[(*row, 128)], _policy(v), fam.startswith("bwd_dkdv"), row[1]))
    for d in HEAD_DIMS:
        add(KernelSpec("bwd_dq_f32", "float32", d, variant=DENSE))
        add(KernelSpec("bwd_dq_f32", "float32", d, variant=variant_type(Variant(causal=True))))
        add(KernelSpec("bwd_pre_f32", "float32", d))
        for dtype in CTYPES:
            for fam in ("bwd_pre", "bwd_convert_dq", "bwd_reduce_dkv"):
                add(KernelSpec(fam, dtype, d))
    for v in _SHOWCASE:
        add(KernelSpec("bwd_dq_f32", "float32", 128, variant=_policy(v)))
    # [variant mod] 16-bit biases read as such (from global memory in every family), and [variant bias tile] biases
    # staged in shared memory by the wgmma kernels, in each dtype, at the tiles the launcher runs them with
    # (attention._staged_bias_spec: a float32 bias halves the forward's key tile at d 128), not causal (issue 11's
    # benchmark) and with every flag of padded batches.
    plain, every = (False,) * 6, (True, True, False, True, True, True)

    def biased(flags, bias, dropout=False):
        return _policy((*flags, bias, dropout))

    for fam, row in _SHOWCASE_ROWS.items():
        dtype = "float32" if row[1] == "f32" else "bfloat16"
        for bias in (bias_policy("bfloat16"), bias_policy("float16", grad_dtype="float32")):
            add(KernelSpec(fam, dtype, 128, TILES[(*row, 128)], biased(plain, bias), fam.startswith("bwd_dkdv"), row[1]))
    for bias in (bias_policy("bfloat16"), bias_policy("float16", grad_dtype="float32")):
        add(KernelSpec("bwd_dq_f32", "float32", 128, variant=biased(plain, bias)))
    for fam, direction in (("fwd_sm90", "fwd"), ("bwd_dkdv_sm90", "bwd")):
        for d in (64, 128):
            t = TILES[(direction, "sm90a", d)]
            for bias in (bias_policy("bfloat16", True), bias_policy("float16", True, "float32"),
                         bias_policy("float32", True)):
                if bias == bias_policy("float32", True) and (fam, d) != ("fwd_sm90", 128):
                    continue  # (read from global memory: attention._staged_bias_spec)
                tile = t._replace(block_n=64) if (fam, d, bias) == ("fwd_sm90", 128, bias_policy("float32", True)) else t
                for flags, dropout in ((plain, False), (every, True)):
                    for has_dq in ((True, False) if fam.startswith("bwd") and flags is plain else (fam.startswith("bwd"),)):
                        add(KernelSpec(fam, "bfloat16", d, tile, biased(flags, bias, dropout), has_dq, "sm90a"))
    # A user score_mod and mask_mod reading an array (the generated policy type), causal, in every FA2 family.
    from .._ops.mods import user_mods

    mods = user_mods("score * 0.5f + (q_idx - kv_idx) * 0.01f", "kv_idx < prefix[b] || doc[q_idx] == doc[kv_idx]",
                     {"prefix": np.zeros(1, np.int32), "doc": np.zeros(1, np.int32)})
    causal_mod = _policy((False, True, False, False, False, False, False, False), mods)
    for fam, row in _SHOWCASE_ROWS.items():
        dtype = "float32" if _float32_only(fam, row[1]) else "bfloat16"
        add(KernelSpec(fam, dtype, 128, TILES[(*row, 128)], causal_mod, fam.startswith("bwd_dkdv"), row[1]))
    add(KernelSpec("bwd_dq_f32", "float32", 128, variant=causal_mod))
    # The TMA entry point takes every flag (a bias read from global memory: its producer stages none), but not a bias
    # with dropout (attention._tma_forward)
    tma_tile = TILES[("fwd", "sm90a_tma", 128)]
    for v in _SHOWCASE:
        add(KernelSpec("fwd_sm90_tma", "bfloat16", 128, tma_tile, _policy(v[:6] + (v[6] and not v[7], v[7])),
                       arch="sm90a"))
    add(KernelSpec("fwd_sm90_tma", "bfloat16", 128, tma_tile, causal_mod, arch="sm90a"))
    # [fwd persistent] every row it takes (attention._persistent_forward), dense and causal, and the flags of padded
    # batches without key counts (not a bias with dropout, as above)
    for (direction, arch, d), t in TILES.items():
        if (direction, arch) in (("fwd", "sm90a_tma"), ("fwd", "sm90a_tma_short")) and d in PERSISTENT_HEAD_DIMS:
            for dtype in CTYPES:
                for var in (DENSE, variant_type(Variant(causal=True))):
                    add(KernelSpec("fwd_sm90_tma_persistent", dtype, d, t, var, arch="sm90a"))
    for v in _SHOWCASE:
        if not v[2] and not v[3]:
            add(KernelSpec("fwd_sm90_tma_persistent", "bfloat16", 128, tma_tile,
                           _policy(v[:6] + (v[6] and not v[7], v[7])), arch="sm90a"))
    add(KernelSpec("fwd_sm90_tma_persistent", "bfloat16", 128, tma_tile, causal_mod, arch="sm90a"))
    # [prefill append] chunked prefill's variants (key counts, bottom-right causal; and with a window, softcap and
    # ALiBi) at the tiles the launcher runs it with (d 64: the short tile up to 2048 or 4096 query rows, the row's
    # above)
    prefill = variant_type(Variant(causal=True, seqused_k=np.zeros(1, np.int32)))
    prefill_all = _policy((True, True, False, True, True, True, False, False))
    for (direction, arch, d), t in TILES.items():
        if (direction, arch) in (("fwd", "sm90a_tma"), ("fwd", "sm90a_tma_short")) and d in (64, 128):
            for dtype in CTYPES:
                add(KernelSpec("fwd_sm90_tma_append", dtype, d, t, prefill, arch="sm90a"))
    add(KernelSpec("fwd_sm90_tma_append", "bfloat16", 128, tma_tile, prefill_all, arch="sm90a"))
    # The V^T entry point's element types ([fp8], [tf32], [f16x2]): every flag of padded batches but a staged bias and
    # dropout (a bias read from global memory), at d 128; [fp8] also a user's mods
    for fam, dtype, row in (("fwd_sm90_fp8", "float8_e4m3fn", "sm90a_fp8"), ("fwd_sm90_tf32", "float32", "sm90a_tf32"),
                            ("fwd_sm90_f16x2", "float32", "sm90a_f16x2")):
        for v in _SHOWCASE:
            if not v[2] and not v[3] and not v[7]:
                add(KernelSpec(fam, dtype, 128, TILES[("fwd", row, 128)], _policy(v), arch="sm90a"))
    add(KernelSpec("fwd_sm90_fp8", "float8_e4m3fn", 128, TILES[("fwd", "sm90a_fp8", 128)], causal_mod, arch="sm90a"))
    # ... and their copies: V^T, q and k rounded to TF32 ([tf32 qk]), the split into fp16 parts
    for d in FP8_HEAD_DIMS:
        add(KernelSpec("transpose_v", "float8_e4m3fn", d, arch="sm90a"))
    for d in TF32_SM90_HEAD_DIMS:
        add(KernelSpec("transpose_v", "float32", d, arch="sm90a"))
        add(KernelSpec("round_tf32", "float32", d, arch="sm90a"))
    for d in F16X2_HEAD_DIMS:
        add(KernelSpec("absmax_f32", "float32", d, arch="sm90a"))
        add(KernelSpec("split_f16x2", "float32", d, arch="sm90a"))
    # ... and the backward's: every flag but packed sequences and key counts (attention._tma_backward)
    bwd_tile = TILES[("bwd", "sm90a", 128)]
    for v in (*(v for v in _SHOWCASE if not v[2] and not v[3]), (True, True, False, False, True, True, True, True)):
        add(KernelSpec("bwd_dkdv_sm90_tma", "bfloat16", 128, bwd_tile, _policy(v), True, "sm90a"))
    add(KernelSpec("bwd_dkdv_sm90_tma", "bfloat16", 128, bwd_tile, causal_mod, True, "sm90a"))
    # [bwd shared keys] d 256's TMA entry point with the flags it takes at its most (window, softcap, ALiBi, dropout)
    add(KernelSpec("bwd_dkdv_sm90_tma", "bfloat16", 256, TILES[("bwd", "sm90a", 256)],
                   _policy((True, True, False, False, True, True, False, True)), True, "sm90a"))
    for d in (64, 128):  # [bwd dq tile] (the TMA dK/dV entry point's head dims)
        for dtype in CTYPES:
            for row in ("sm90a", "sm90a_tma"):  # ([bwd rows 128]'s tiles too)
                if ("bwd", row, d) in TILES:
                    add(KernelSpec("bwd_convert_dq_tiles", dtype, d, Tile(TILES[("bwd", row, d)].block_m, 0, 8, 1),
                                   arch="sm90a"))
            for var in (DENSE, variant_type(Variant(causal=True))) if d == 64 else ():  # [bwd persistent]'s head dim
                for has_dq in (True, False):
                    add(KernelSpec("bwd_dkdv_sm90_tma_persistent", dtype, d, TILES[("bwd", "sm90a", d)], var, has_dq,
                                   "sm90a"))
    # [variant head dim] head dims read in place below the kernel's (d 80 on the 96 kernel; 200 on 224), causal.
    causal_pads = _policy((False, True, False, False, False, False, False, False), None, True)
    # (d 80: its own instantiation, rows padded to 96 in shared memory; 200: the 208 one with zero-filled chunks)
    add(KernelSpec("fwd", "bfloat16", 80, TILES[("fwd", "sm90", 96)], variant_type(Variant(causal=True)), arch="sm90"))
    add(KernelSpec("fwd", "bfloat16", 208, TILES[("fwd", "sm90", 224)], causal_pads, arch="sm90"))
    for has_dq in (True, False):
        add(KernelSpec("bwd_dkdv", "bfloat16", 96, TILES[("bwd", "sm90", 96)], causal_pads, has_dq, "sm90"))
    add(KernelSpec("bwd_dq", "bfloat16", 96, TILES[("bwd_dq", "sm90", 96)], causal_pads, arch="sm90"))
    add(KernelSpec("bwd_pre", "bfloat16", 80))
    # ... and from the forward's TMA entry point (d 96 on the 128 kernel, 32 on the 64 one: attention._tma_forward)
    for d in (64, 128):
        add(KernelSpec("fwd_sm90_tma", "bfloat16", d, TILES[("fwd", "sm90a_tma", d)], causal_pads, arch="sm90a"))
        add(KernelSpec("fwd_sm90_tma_persistent", "bfloat16", d, TILES[("fwd", "sm90a_tma", d)], causal_pads,
                       arch="sm90a"))
        # ... and from the backward's ([bwd tma pad]: attention._tma_padded_backward)
        for has_dq in (True, False):
            for fam in ("bwd_dkdv_sm90_tma", "bwd_dkdv_sm90_tma_persistent") if d == 64 else ("bwd_dkdv_sm90_tma",):
                add(KernelSpec(fam, "bfloat16", d, TILES[("bwd", "sm90a", d)], causal_pads, has_dq, "sm90a"))
    for d, dv, cc in [(d, d, 0) for d in DECODE_HEAD_DIMS] + [(*DECODE_MLA_DIMS, 0), (*DECODE_MLA_DIMS, 90)]:
        fam, tile, arch = decode_family(d, dv, cc)
        for dtype in CTYPES:
            for paged in ("false", "true"):
                add(KernelSpec(fam, dtype, d, tile, paged, arch=arch))
                if fam == "decode_mla_sm90":  # (its TMA loads, decode_sm90.cu's kTma)
                    add(KernelSpec(fam, dtype, d, tile, f"{paged}, true", arch=arch))
            add(KernelSpec("decode_merge", dtype, dv, arch="any"))
    for paged in ("false", "true"):
        add(KernelSpec("decode_append", "bfloat16", 0, variant=paged, arch="any"))
    for dtype, ctype in CTYPES.items():
        for table in ("float", ctype):
            add(KernelSpec("decode_rotary", dtype, 0, variant=table, arch="any"))
    for dtype in CTYPES:
        for d in DECODE_HEAD_DIMS:
            add(KernelSpec("cascade_merge", dtype, d, arch="any"))
    add(KernelSpec("cascade_pack", "bfloat16", 0, arch="any"))
    for fam, t in (("block_lists", TILES[("fwd", "sm90a", 128)]), ("block_lists_t", TILES[("bwd", "sm90a", 128)])):
        add(KernelSpec(fam, "float32", 0, t, causal_mod, arch="f32"))
    add(BLOCK_COMPACT)
    return list(out.values())
