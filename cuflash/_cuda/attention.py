"""FlashAttention-2 planning and launches: which kernel spec, which grid, which arguments.

Arguments arrive validated and normalized from the front door (:mod:`cuflash._ops.api`); only internal
assertions live here. Every kernel is described by a :class:`~.spec.KernelSpec` and compiled on first use
(:mod:`.compile`); every FA2 kernel takes the call's variant as its policy type and one ``VariantParams``
argument (``cuflash_kernels/variants.cuh``).

Layouts. Padded batches are ``(batch, seqlen, heads, d)`` with any strides; packed variable-length batches
(``variant.is_varlen``) are ``(total, heads, d)``, passed to the kernels as batch stride 0 with the
sequence's first row (``cu_seqlens``) added in the kernel; their lse is ``(heads, total)``, which the
kernels index as one batch of ``total`` rows, as they do D and the float32 dQ and GQA workspaces.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from typing import Any, NamedTuple

import numpy as np

from .._ops.gpu_memory import CounterArena, StreamSinks, stream_owner
from .._ops.variant import Variant, VariantArrays
from . import fa1, naive, tensor_map, tuning
from .compile import PackedLaunch, arch_class, check_smem, define, device_info, launch, sm_count
from .spec import (BIAS_CTYPES, BLOCK_COMPACT, BWD_HEAD_DIMS, CTYPES, EXTRA_POINTER_FIELDS, F16X2_HEAD_DIMS,
                   FA1_BWD_HEAD_DIMS, FA1_HEAD_DIMS, FAMILIES, HEAD_DIMS, PERSISTENT_HEAD_DIMS, PREFILL_APPEND_DTYPE,
                   TF32_FAMILIES, TF32_HEAD_DIMS, TF32_SM90_HEAD_DIMS, TILES, VARIANT_POINTER_FIELDS, Tile,
                   bwd_sm90_shares_keys, device_record, extra_params, extra_record, has_dropout, mask_policy,
                   staged_bias_bytes, variant_params, variant_type)
from .spec import spec as kernel_spec

__all__ = ["forward", "backward", "check_supported", "plan_forward", "ForwardPlan", "plan_backward", "BackwardPlan",
           "CheckedBackward", "call_context"]

# On sm_90 devices the forward runs flash_fwd_sm90_kernel where TILES has a ("fwd", "sm90a", d) row, and the
# backward flash_bwd_dkdv_sm90_kernel where it has a ("bwd", "sm90a", d) row (switches for benchmarks).
SM90A_FORWARD = True
SM90A_BACKWARD = True
# The 16-bit backward's block order (interleaved_block, cuflash_tiles.cuh): how many (batch, head) pairs have their
# key tiles interleaved, longest first, when the tiles' work differs (causal masks, windows); None: from the shape.
BWD_INTERLEAVE: int | None = None
_LOG2E = 1.4426950408889634


class Shape(NamedTuple):
    """Sizes of one call as the kernels see them."""

    batch: int      # sequences
    rows_q: int     # rows of the q arrays along the sequence axis (total rows when packed)
    rows_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    max_q: int      # longest query sequence: sizes the grid
    max_k: int
    ws_batch: int   # batch axis of lse, D and the float32 workspaces (1 when packed)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def shape_of(q, k, variant: Variant) -> Shape:
    if variant.is_varlen:
        total_q, hq, d = q.shape
        total_k, hkv = k.shape[0], k.shape[1]
        return Shape(len(variant.cu_seqlens_q) - 1, total_q, total_k, hq, hkv, d, variant.max_seqlen_q,
                     variant.max_seqlen_k, 1)
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    return Shape(b, nq, nk, hq, hkv, d, nq, nk, b)


def _lse_empty(shape: Shape, variant: Variant):
    import cupy

    if variant.is_varlen:
        return cupy.empty((shape.heads_q, shape.rows_q), dtype=cupy.float32)
    return cupy.empty((shape.batch, shape.heads_q, shape.rows_q), dtype=cupy.float32)


# ---------------------------------------------------------------------------------------------------
# Checks and small helpers.


def check_supported(problem, algorithm: str, variant: Variant = Variant()) -> None:
    """Refuse, before any launch, what the CUDA backend cannot run."""
    dtype = np.dtype(problem.dtype).name
    causal_only = dataclasses.replace(variant, causal=False).is_dense
    if algorithm in ("naive", "fa1") and not causal_only:
        raise NotImplementedError(
            f"algorithm='{algorithm}' on CuPy arrays runs dense or causal attention only; window_size, softcap, "
            "alibi_slopes, bias, attn_mask, cu_seqlens, seqused_k, dropout, score_mod and mask_mod run with "
            "algorithm='fa2' (the default)"
        )
    if algorithm == "naive":
        return
    if dtype == "float64":
        raise TypeError(
            f"float64 is not supported by the CUDA kernels (algorithm='{algorithm}'); use float32, "
            "algorithm='naive', or NumPy arrays"
        )
    dims = {"head_dim": problem.head_dim, "head_dim_v": getattr(problem, "head_dim_v", problem.head_dim)}
    for name, dim in dims.items():
        if dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name} {dim} is not supported by the CUDA kernels (algorithm='{algorithm}'): at most "
                f"{MAX_HEAD_DIM}; use algorithm='naive' or NumPy arrays"
            )
    if dtype in CTYPES:
        cc, _ = device_info()
        if cc < 80:
            raise RuntimeError(
                f"the float16/bfloat16 CUDA kernels need compute capability 8.0 or newer (mma.sync bf16, "
                f"cp.async); this GPU is sm_{cc}"
            )


def causal_offset_of(variant: Variant, seqlen_q: int, seqlen_k: int) -> int | None:
    """The FA1 and naive paths' diagonal: None when not causal."""
    return variant.offset(seqlen_q, seqlen_k) if variant.causal else None


def strides(a) -> tuple[np.int64, np.int64, np.int64]:
    """(batch, seq, head) strides in elements; a packed (total, heads, d) array has batch stride 0."""
    it = a.itemsize
    s = a.strides[:-1]
    if len(s) == 2:
        s = (0, *s)
    return tuple(np.int64(x // it) for x in s)


def _is_aligned(a) -> bool:
    """Whether ``a``'s tiles can be copied with 16-byte cp.async: base and every stride a multiple of 16 bytes."""
    return a.data.ptr % 16 == 0 and _strides_aligned(a)


def _strides_aligned(a) -> bool:
    return all((s % 16 == 0) or n == 1 for s, n in zip(a.strides[:-1], a.shape[:-1]))


def aligned(a):
    """``a`` itself when its tiles can be copied with 16-byte cp.async (:func:`_is_aligned`); otherwise a
    contiguous copy in a new allocation (rare: views with odd offsets or strides; a contiguous view at an odd offset
    too, which ``ascontiguousarray`` would return as it is)."""
    import cupy

    return a if _is_aligned(a) else cupy.array(a, copy=True, order="C")


def i32(x) -> np.int32:
    return np.int32(x)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tile(direction: str, d: int, t: Tile) -> None:
    """The constraints each kernel static_asserts, checked before compiling a user-chosen tile."""
    ok = t.block_m % 16 == 0 and t.block_n % 16 == 0 and t.stages >= 1 and 1 <= t.warps <= 16
    if direction.startswith("fwd"):  # (and the TF32 forward's "fwd_tf32x3", "fwd_tf32")
        ok = ok and t.block_m % (16 * t.warps) == 0 and t.block_m // (16 * t.warps) in (1, 2)
    elif direction == "bwd_dq":
        ok = ok and t.block_m == 16 * t.warps
    else:
        ok = ok and _dkdv_ok(d, t)
    if not ok:
        raise ValueError(
            f"block sizes block_q={t.block_m}, block_k={t.block_n} are not a valid CUDA tile for the {direction} "
            f"kernel at head_dim {d}: the CUDA kernels need multiples of 16 with 16 rows per warp (forward: "
            "block_q = 16 * warps, up to 256; backward: block_k and block_q multiples of 32, head_dim / 2 a "
            "multiple of 16 for two warps per 32 key rows)"
        )


def _dkdv_ok(d: int, t: Tile) -> bool:
    """The shape constraints flash_bwd_dkdv_kernel static_asserts (warp grid of S^T, dK/dV and dQ)."""
    if t.block_n % 32 or t.block_m % 32 or t.stages < 2 or t.warps % (t.block_n // 32 or 1):
        return False
    wm = t.warps // (t.block_n // 32)
    if wm < 1 or (t.block_m // wm) % 16 or (d // wm) % 16 or t.block_m % wm or d % wm:
        return False
    wqm = t.block_m // 32
    rows = 32 if t.warps % wqm == 0 and d % (16 * (t.warps // wqm)) == 0 else 16
    wqm = t.block_m // rows
    return t.warps % wqm == 0 and (d // (t.warps // wqm)) % 16 == 0 and d % (t.warps // wqm) == 0


def plan_tile(direction: str, d: int, block_q, block_k) -> Tile:
    """The table's tile for this device, or one with the user's block sizes."""
    cc, _ = device_info()
    # (a head dim between the table's rows, the in-place forward's: the next row's tile)
    row_d = next((x for x in HEAD_DIMS if x >= d), d)
    # this device's tuned table first (python -m cuflash tune), then the packaged one
    t = tuning.tile_for(direction, row_d) if direction in tuning.TUNABLE else None
    if t is None:
        t = TILES.get((direction, arch_class(cc), row_d))
    assert t is not None, (direction, cc, d)
    if block_q is not None or block_k is not None:
        bm = block_q if block_q is not None else t.block_m
        bn = block_k if block_k is not None else t.block_n
        if direction == "bwd":
            warps = 2 * max(bn // 32, 1)  # two warps per group of 32 key rows
        elif direction.startswith("fwd") and bm % (16 * t.warps) == 0 and bm // (16 * t.warps) in (1, 2):
            warps = t.warps
        else:
            warps = bm // 16
        t = Tile(bm, bn, max(warps, 1), t.stages)
        check_tile(direction, d, t)
    return t


# The wgmma forward from its TMA entry point (flash_fwd_sm90_tma_kernel) where a call allows it (_tma_forward); False:
# the cp.async kernel everywhere (for comparisons; read when a forward is planned).
TMA_FORWARD = True
# Packed batches and key counts from the TMA entry point too (forward_sm90.cu's [tma tail]; H100 2026-11-28: bit for
# bit the cp.async kernel's output with NaN / inf past the keys, 1.4-1.5x its speed; CUFLASH_TMA_SEQUENCE_LENGTHS=0
# turns it off).
TMA_SEQUENCE_LENGTHS = os.environ.get("CUFLASH_TMA_SEQUENCE_LENGTHS", "1") == "1"
# The wgmma dK/dV kernel from its TMA entry point (flash_bwd_dkdv_sm90_tma_kernel) where a planned backward allows it
# (_tma_backward; H100 2026-11-28: dK and dV bit for bit the cp.async kernel's, 1.01-1.07x its speed;
# CUFLASH_TMA_BACKWARD=0 turns it off).
TMA_BACKWARD = os.environ.get("CUFLASH_TMA_BACKWARD", "1") == "1"
# [bwd dq tile] the TMA dK/dV kernel's dQ added a whole query tile at a time, in its fragments' order (the kernels'
# compile-time switch CUFLASH_BWD_DQ_TILE, read here too): the workspace's planes padded to whole 64-row tiles and
# converted by flash_bwd_convert_dq_tiles_kernel. On (CUFLASH_DEFINES=CUFLASH_BWD_DQ_TILE=0 turns it off).
BWD_DQ_TILE = bool(define("CUFLASH_BWD_DQ_TILE", 1))
# [bwd rows 128] the TMA dK/dV launch at d 64 with query tiles of 128 rows (FlashAttention-3's d 64 tile: half the
# per-tile copies, barriers and dQ reductions; each warpgroup its own 64 rows of dQ), where the whole-tile dQ is on.
# H200 2026-11-29, backward alone, TFLOP/s against the 64-row tile: dense N 1000 / 2048 / 8192 302 / 383 / 465 against
# 265 / 333 / 385, causal 210 / 304 / 441 against 205 / 292 / 386. On (CUFLASH_DEFINES=CUFLASH_BWD_ROWS128=0 turns it
# off; read here only).
BWD_ROWS128 = bool(define("CUFLASH_BWD_ROWS128", 1)) and BWD_DQ_TILE  # (the tile: TILES' ("bwd", "sm90a_tma", d) row)
# [bwd persistent] The head dims whose TMA dK/dV launch runs persistent (flash_bwd_dkdv_sm90_tma_kernel<..., true>: a
# block per SM taking the key tiles from a counter). H200 2026-11-29 (tools/bwd_ab.py, backward alone, bf16, two
# rounds): d 64 +3-6 % (N 8192 dense 420 against 396 TFLOP/s, causal 386 against 371; GQA 4:1 at N 2048 +3-6 %), d 128
# -2..+2 %, N 1000 within the noise. CUFLASH_BWD_PERSISTENT=0 turns it off, =1 on at every TMA head dim.
BWD_PERSISTENT_DIMS = {"0": (), "1": (64, 128)}.get(os.environ.get("CUFLASH_BWD_PERSISTENT", ""), (64,))
# [bwd shared keys] d 256's backward on the wgmma kernel (TILES' ("bwd", "sm90a", 256) row: both warpgroups on 64 keys,
# P^T and dS^T through shared memory; docs/kernel-notes.md). H200 2026-11-29 (tools/bwd_ab.py, backward alone, bf16):
# 1.37-1.50x the mma.sync kernel (dense N 1024 / 4096: 252 / 300 TFLOP/s against 184 / 205; causal 204 / 283 against
# 150 / 189). On; CUFLASH_DEFINES=CUFLASH_BWD_SM90_D256=0 runs the mma.sync kernel (read here only, so that
# tools/bwd_ab.py's builds compare them; d 193-255 run it padded from the TMA entry point too).
BWD_SM90_D256 = bool(define("CUFLASH_BWD_SM90_D256", 1))


def _sm90_row(direction: str, d: int) -> bool:
    """Whether the wgmma kernel's row of ``direction`` at head dim ``d`` is in use (d 256's backward: the switch)."""
    return BWD_SM90_D256 or not (direction == "bwd" and d == 256)


# The longest query sequence that runs a head dim's ("fwd", "sm90a_tma_short", d) tile instead of its row's (d 64: one
# computing warpgroup of 64 rows, two blocks per SM: 1.03-1.31x the 192-row tile and 1.05-1.20x the cp.async kernel
# at N 512-2048, H100 2026-11-28).
TMA_SHORT_MAX_ROWS_Q = 2048
# ... and for causal calls (d 64's short tile persistent: N 4096 causal 417-419 TFLOP/s against the 192-row tile's
# 382-398, cuDNN 415-426; N 8192 both 446; H200 2026-11-28, tools/tile_trial.py, two runs)
TMA_SHORT_MAX_ROWS_Q_CAUSAL = 4096
# Head dims below a TMA row's (d 32 on the d 64 kernel, 96 on 128, ...) from the TMA entry point too (the maps read
# zeros in the missing columns; H100 2026-11-28: d 96 1.4-1.8x its own mma.sync kernel, 160 and 224 2.0-2.3x, d 32
# 1.0-1.2x); off (CUFLASH_TMA_PADDED=0): the kernel of their own head dim.
TMA_PADDED = os.environ.get("CUFLASH_TMA_PADDED", "1") == "1"
# The planned backward at head dims below a wgmma dK/dV row's (d 32 on the d 64 kernel, 96 on 128's, ...) from the
# kernel's TMA entry point ([bwd tma pad]: the maps read zeros past the arrays' columns; H100 2026-11-28, bf16, backward
# alone: d 80 1.3-1.6x and d 96 1.4-1.5x the mma.sync kernels of their own head dims, d 32 1.0-1.1x; dK, dV bit for
# bit); off (CUFLASH_TMA_PADDED_BACKWARD=0): those kernels.
TMA_PADDED_BACKWARD = os.environ.get("CUFLASH_TMA_PADDED_BACKWARD", "1") == "1"
# float32 with fp32_precision="tf32" on sm_90 from the Hopper forward's V^T entry point ([tf32]: one TF32 product on
# wgmma, q and k rounded to TF32 and V transposed first; .vt) instead of flash_fwd_kernel on TF32 fragments (mma.sync),
# at head dims 64 and 128. H200 2026-11-28 (batch 2, 16 heads, N 1k-16k): d 128 91-314 TFLOP/s against 47-95 by the
# mma.sync kernel, within the same error budget (2x naive attention on TF32-rounded operands); off
# (CUFLASH_TF32_WGMMA=0): the mma.sync kernel.
TF32_WGMMA = os.environ.get("CUFLASH_TF32_WGMMA", "1") == "1"
# float32 with fp32_precision="fp16x3" on sm_90 from the same entry point with q, k and v split in two fp16 parts each
# ([f16x2]: three fp16 wgmma products a matrix product, .vt.split_f16x2), at head dims 64 and 128: H200 2026-11-28 (batch
# 2, 16 heads, N 1k-16k) 44-199 TFLOP/s against 19-35 by 3xTF32 on mma.sync, within 4x naive float32 attention's error
# (the tensor core truncates each fp16 product to the group's largest one: kernel notes); off (CUFLASH_F16X2_WGMMA=0),
# elsewhere, or at other head dims: the 3xTF32 mma.sync kernel ("tf32x3", more accurate).
F16X2_WGMMA = os.environ.get("CUFLASH_F16X2_WGMMA", "1") == "1"
# [fwd persistent] The TMA forward as a persistent kernel (a block per SM taking query tiles from a counter, the next
# tile's Q and K_0 loaded under this one's last products and output): None (CUFLASH_PERSISTENT_FORWARD unset) where it
# measured faster (_PERSISTENT_ROWS), True (=1) wherever _persistent_forward takes the call, False (=0) nowhere. Read
# when a forward is planned. H200 2026-11-28, bf16, TFLOP/s, one-tile blocks / persistent (kernel notes, session 17):
# d 128 N 512-2048 dense 448-623 / 513-647, causal 290-509 / 332-537 (cuDNN 334-505), N 4096-16384 within noise to
# +5 %; d 64's 192-row tile N 4096-16384 dense 423-474 / 468-494, causal 386-446 / 405-448; d 64's 64-row tile
# (N <= 2048) 220-444 / 173-312 (two blocks an SM of one computing warpgroup: each tile's Q waits for its last S).
# With the tile counter (session 18) d 64's 64-row tile turned: H200 2026-11-28 (session 19, tools/tile_trial.py, bf16,
# batch x N = 16384, 32 heads), N 512 / 1024 / 2048, one-tile / persistent, dense 333 / 387 / 427 against 372 / 418 /
# 447, causal 215 / 301 / 359 against 238 / 315 / 373 (cuDNN 390 / 433 / 434 and 262 / 339 / 394): persistent there too.
PERSISTENT_FORWARD = {"1": True, "0": False}.get(os.environ.get("CUFLASH_PERSISTENT_FORWARD", ""))
_PERSISTENT_ROWS = {(64, Tile(192, 128, 16, 2)), (64, Tile(64, 128, 8, 2)),
                    (128, Tile(128, 128, 12, 2))}  # (head dim, tile) persistent by default


def _persistent_forward(dtype: str, d: int, tile: Tile, variant: Variant) -> bool:
    """Whether a TMA forward of this kernel head dim and tile runs persistent (:data:`PERSISTENT_FORWARD`): 16-bit
    inputs, a head dim of PERSISTENT_HEAD_DIMS, padded batches without key counts (the kernel zeroes no tail)."""
    if PERSISTENT_FORWARD is False or (PERSISTENT_FORWARD is None and (d, tile) not in _PERSISTENT_ROWS):
        return False
    return dtype in CTYPES and d in PERSISTENT_HEAD_DIMS and not variant.is_varlen and variant.seqused_k is None


def _persistent_grid(spec, tiles: int) -> tuple[int, int, int]:
    """[fwd persistent] The grid of ``spec``: as many blocks as the GPU holds at once (its family's blocks per SM),
    at most one per query tile."""
    return (min(tiles, sm_count() * spec.fam.min_blocks(spec.head_dim, spec.tile)), 1, 1)


def _sm90_float32(q, k, v, variant: Variant, fp32_precision: str, block_q, block_k) -> str | None:
    """The kind of the V^T entry point's plan (.vt.plan) that runs a float32 forward, or None: "float32" for [tf32]
    (one TF32 product asked for, :data:`TF32_WGMMA`), "f16x2" for [f16x2] ("fp16x3", :data:`F16X2_WGMMA`); with no
    block sizes of the caller's, a head dim of TF32_SM90_HEAD_DIMS (F16X2_HEAD_DIMS; v's the same), no bias,
    dropout or user mods, and a call the entry point takes (.vt.takes: sm_90, padded batches, mappable strides)."""
    kind = ("float32" if fp32_precision == "tf32" and TF32_WGMMA else
            "f16x2" if fp32_precision == "fp16x3" and F16X2_WGMMA else None)
    if (kind is None or np.dtype(q.dtype) != np.float32 or block_q is not None or block_k is not None
            or q.shape[-1] not in (TF32_SM90_HEAD_DIMS if kind == "float32" else F16X2_HEAD_DIMS)
            or v.shape[-1] != q.shape[-1] or variant.bias is not None or has_dropout(variant)
            or variant.mods is not None):
        return None
    from . import vt

    return kind if vt.takes(q, k, v, variant) else None


def _tma_forward(spec, variant: Variant, arrays, max_q: int, block_q, block_k) -> tuple[int, Tile] | None:
    """``(kernel head dim, tile)`` of the TMA entry point for a 16-bit forward the launcher planned as ``spec`` (the
    wgmma kernel's or the mma.sync one's), or None. Its head dim: the arrays' (q and k's, v's) rounded up to a
    multiple of 64 with a ("fwd", "sm90a_tma", d) row; below it ([variant head dim], :data:`TMA_PADDED`) the maps
    read zeros in the missing columns; its tile the row's, or the ("fwd", "sm90a_tma_short", d) row's where there is
    one and the query sequence has at most :data:`TMA_SHORT_MAX_ROWS_Q` rows (causal:
    :data:`TMA_SHORT_MAX_ROWS_Q_CAUSAL`). Also: an sm_90 device and no block sizes of the caller's, no staged bias
    (the producer stages none) and not a bias with dropout (with both, a window and key counts, its computing
    warpgroups spill at their 240 registers), strides of q, k and v that are non-zero multiples of 16 bytes with
    contiguous rows (the tensor maps'), and a driver that encodes maps. Packed
    batches and key counts with :data:`TMA_SEQUENCE_LENGTHS` (the kernel zeroes the rows past a sequence's keys that
    a box reads, forward_sm90.cu's [tma tail])."""
    if (not TMA_FORWARD or not SM90A_FORWARD or spec.family not in ("fwd_sm90", "fwd")
            or staged_bias_bytes(spec.variant) or block_q is not None or block_k is not None or device_info()[0] != 90
            or (variant.bias is not None and has_dropout(variant))
            or (not TMA_SEQUENCE_LENGTHS and (variant.is_varlen or variant.seqused_k is not None))
            or not tensor_map.available()):
        return None
    q, _, v = arrays
    d = -(-max(q.shape[-1], v.shape[-1]) // 64) * 64
    padded = d != q.shape[-1] or d != v.shape[-1]
    short_rows = TMA_SHORT_MAX_ROWS_Q_CAUSAL if variant.causal else TMA_SHORT_MAX_ROWS_Q
    tile = TILES.get(("fwd", "sm90a_tma_short", d)) if max_q <= short_rows else None
    tile = tile or TILES.get(("fwd", "sm90a_tma", d))
    # (the mma.sync kernel's spec only for head dims below a row's: at a row's own, it is the caller's choice of the
    # Hopper kernels being off, SM90A_FORWARD)
    if (tile is None or (padded and not TMA_PADDED)
            or (spec.family == "fwd" and not padded) or not _mappable(arrays)):
        return None
    return d, tile


def _tma_backward(spec, variant: Variant, arrays):
    """Whether a planned backward whose dK/dV launch is ``spec`` (the wgmma kernel's, no staged bias) runs it from its
    TMA entry point: :func:`_tma_backward_takes` the call."""
    return spec.family == "bwd_dkdv_sm90" and not staged_bias_bytes(spec.variant) and _tma_backward_takes(variant,
                                                                                                          arrays)


def _rows128_takes(variant: Variant) -> bool:
    """[bwd rows 128] Whether a variant's dK/dV kernel fits 128-row query tiles without spills: not with d mod / d s
    (softcap, a score_mod: 8-420 bytes of spills at d 64) or a bias's gradient (48 bytes)."""
    return not variant.softcap and variant.bias is None and not (variant.mods is not None and variant.mods.has_score_mod)


def _tma_backward_takes(variant: Variant, arrays) -> bool:
    """Whether the dK/dV kernel's TMA entry point takes a call of these arrays (q, k, v, dO): sequences that end with
    their tensors (no packed batch, no key counts: the kernel zeroes no tail), strides as :func:`_tma_forward`'s, and
    a driver that encodes maps."""
    if not TMA_BACKWARD or variant.is_varlen or variant.seqused_k is not None or not tensor_map.available():
        return False
    return all(a.ndim == 4 for a in arrays) and _mappable(arrays)


def _tma_padded_backward(variant: Variant, arrays, algorithm, block_q, block_k) -> int:
    """[bwd tma pad] The head dim of the wgmma dK/dV kernel that a planned 16-bit backward runs from its TMA entry
    point at head dims below its own (q's and k's, v's: the next row of ("bwd", "sm90a", d) above them, read through
    maps of the arrays' head dims), or 0: :data:`TMA_PADDED_BACKWARD` off, not sm_90, block sizes of the caller's,
    head dims of a row or above every row, or a call :func:`_tma_backward_takes` refuses."""
    q, _, v, _ = arrays
    d, dv = q.shape[-1], v.shape[-1]
    if (not TMA_PADDED_BACKWARD or not SM90A_BACKWARD or algorithm != "fa2" or block_q is not None
            or block_k is not None or np.dtype(q.dtype).name not in CTYPES or device_info()[0] != 90):
        return 0
    kd = next((x for x in BWD_HEAD_DIMS if x >= max(d, dv) and ("bwd", "sm90a", x) in TILES and _sm90_row("bwd", x)),
              0)
    if not kd or (kd == d == dv) or not _tma_backward_takes(variant, arrays):
        return 0
    if kd == 256 and max(d, dv) <= 192:
        return 0  # ([bwd shared keys] not below d 193: the mma.sync kernels of d 192 and under, until measured)
    return kd


def _mappable(arrays) -> bool:
    """Whether :func:`_tensor_map` can map each array: contiguous rows, and the stride of every axis of more than one
    element a non-zero multiple of 16 bytes."""
    return all(a.strides[-1] == a.itemsize
               and not any(n > 1 and (s <= 0 or s % 16) for n, s in zip(a.shape[:-1], a.strides)) for a in arrays)


def _tensor_map(a, box_rows: int):
    """The TMA entry point's map of q, k or v ((batch,) rows, heads, d; a packed batch's without its batch axis):
    :func:`rows_map` of the array (a packed batch's with a batch axis of one), boxes of ``box_rows`` rows (the tile's:
    Q block_m, K and V block_n)."""
    shape, strides = (a.shape, a.strides) if a.ndim == 4 else ((1, *a.shape), (16, *a.strides))
    return rows_map(shape, strides, box_rows, a.itemsize)


def rows_map(shape, strides, box_rows: int, element_bytes: int):
    """A 4-d tensor map of a (batch, rows, heads, columns) array of ``element_bytes`` elements (``strides`` its byte
    strides): columns innermost, then rows, heads, batch, boxes of 128 bytes of columns by ``box_rows`` rows. An axis
    of one element is never stepped along: its stride, whatever the array says, is given as 16 bytes (the map's
    strides must be multiples of 16)."""
    batch, rows, heads, cols = shape
    sb, ss, sh = (s if n > 1 else 16 for n, s in zip(shape[:3], strides[:3]))
    return tensor_map.TensorMap((cols, rows, heads, batch), (ss, sh, sb), (128 // element_bytes, box_rows, 1, 1),
                                element_bytes=element_bytes)


def _hopper_tile(direction: str, d: int, block_q, block_k, enabled: bool) -> Tile | None:
    """The wgmma kernel's tile where it runs: sm_90, the table has a row, the caller chose no block sizes (d 256's
    backward row only with :data:`BWD_SM90_D256`)."""
    t = TILES.get((direction, "sm90a", d)) if _sm90_row(direction, d) else None
    if enabled and t is not None and block_q is None and block_k is None and device_info()[0] == 90:
        return t
    return None


# ---------------------------------------------------------------------------------------------------
# Forward.


# ---------------------------------------------------------------------------------------------------
# Head dims. The kernels are instantiated at HEAD_DIMS; any other head dim (1..256), and a v head dim that
# differs from q's and k's, runs the kernel of the next instantiated dim. The 16-bit FA2 forward reads arrays
# whose head dims are multiples of 8 in place ([variant head dim], Pads_head_dim: loads zero-fill the columns
# past the array's, the matrix products skip the 16-column steps that hold only zeros, stores write the
# array's columns); the other cases run on copies with the last axes zero-padded to the kernel's dim: zero
# columns add nothing to q.k, and v's zero columns give output (and dV) columns that are cut off.

MAX_HEAD_DIM = HEAD_DIMS[-1]


def kernel_head_dim(d: int, dv: int, algorithm: str = "fa2", in_place: bool = False) -> int:
    """The instantiated head dim that runs q, k of head dim ``d`` and v of ``dv`` (FA1: FA1_HEAD_DIMS).
    ``in_place``: the 16-bit FA2 forward reading the arrays as they are (:func:`_reads_in_place`), which is
    instantiated at any multiple of 16 (its loops run over the head dim, its shared-memory rows are padded)."""
    if in_place:
        return -(-max(d, dv) // 16) * 16
    return next(x for x in (FA1_HEAD_DIMS if algorithm == "fa1" else HEAD_DIMS) if x >= max(d, dv))


def _needs_padding(q, v, algorithm) -> int:
    """The padded head dim when this call runs on padded copies, else 0 (naive handles any dims)."""
    d, dv = q.shape[-1], v.shape[-1]
    if algorithm == "naive":
        return 0
    kd = kernel_head_dim(d, dv, algorithm)
    return kd if (kd != d or dv != d) else 0


def bwd_head_dims(cc: int, smem: int) -> tuple[int, ...]:
    """The 16-bit FA2 backward's head dims on a GPU of compute capability ``cc`` and ``smem`` bytes of opt-in shared
    memory per block (:func:`device_info`): BWD_HEAD_DIMS up to 128, above it those with a dK/dV tile and a dQ tile
    for this GPU that fit its shared memory (its arch class's rows, or its tuned table's: ``python -m cuflash
    tune``)."""
    arch = arch_class(cc)

    def fits(direction: str, d: int) -> bool:
        t = tuning.tile_for(direction, d) or TILES.get((direction, arch, d))
        family = "bwd_dkdv" if direction == "bwd" else "bwd_dq"
        return t is not None and FAMILIES[family].smem(d, t) <= smem

    return tuple(d for d in BWD_HEAD_DIMS if d <= 128 or (fits("bwd", d) and fits("bwd_dq", d)))


def _bwd_padding(q, v, algorithm) -> int:
    """:func:`_needs_padding` for the backward: for the 16-bit FA2 backward, the next of :func:`bwd_head_dims` where
    it differs from the arrays' head dims (read in place, or padded copies), 0 at one of them; with none as large, the
    forward's (the float32 kernels on upcast inputs run the call)."""
    kd = _needs_padding(q, v, algorithm)
    if algorithm != "fa2" or q.dtype.itemsize != 2:
        return kd
    d, dv = q.shape[-1], v.shape[-1]
    bd = next((x for x in bwd_head_dims(*device_info()) if x >= max(d, dv)), 0)
    if not bd:
        return kd
    return bd if bd != d or bd != dv else 0


def _reads_in_place(q, v, algorithm) -> bool:
    """Whether the kernels read head dims below their own in place (no padded copies): the 16-bit FA2
    forward, with both head dims multiples of 8 (16-byte rows)."""
    return algorithm == "fa2" and q.dtype.itemsize == 2 and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0


def _pad(a, width: int):
    import cupy

    out = cupy.zeros((*a.shape[:-1], width), dtype=a.dtype)
    out[..., :a.shape[-1]] = a
    return out


def _copies_16_bytes(dtype: str, fp32_precision: str) -> bool:
    """Whether the FA2 forward copies tiles with 16-byte cp.async (16-bit inputs, float32 on TF32 fragments), so
    that its inputs' base and strides must be multiples of 16 bytes (:func:`aligned`)."""
    return dtype in CTYPES or fp32_precision != "ieee"


def _f32_forward_spec(d: int, vtype: str, fp32_precision: str, block_q, block_k):
    """The float32 forward's kernel: flash_fwd_kernel on TF32 fragments (3xTF32 or one product, ``fp32_precision``) on
    sm_80 or newer at head dims up to 128; else (``"ieee"``, older GPUs, larger head dims) the SIMT kernel."""
    family = TF32_FAMILIES.get("tf32x3" if fp32_precision == "fp16x3" else fp32_precision)  # (fp16x3: the 3xTF32)
    if family is not None and d in TF32_HEAD_DIMS and device_info()[0] >= 80:
        return kernel_spec(family, "float32", d, plan_tile(family, d, block_q, block_k), vtype)
    return kernel_spec("fwd_f32", "float32", d, TILES[("fwd", "f32", d)], vtype)


def forward(q, k, v, *, scale, variant: Variant, algorithm, block_q, block_k, fp32_precision="tf32x3"):
    """``(out, lse)`` of one call (FA2 kernels; FA1 and naive are dispatched from here). ``fp32_precision``: how the
    FA2 forward multiplies float32 inputs ("tf32x3", "tf32" or "ieee"; see cuflash.attention)."""
    import cupy

    kd = _needs_padding(q, v, algorithm)
    if kd and not _reads_in_place(q, v, algorithm):
        out, lse = forward(_pad(q, kd), _pad(k, kd), _pad(v, kd), scale=scale, variant=variant, algorithm=algorithm,
                           block_q=block_q, block_k=block_k, fp32_precision=fp32_precision)
        return cupy.ascontiguousarray(out[..., :v.shape[-1]]), lse
    shp = shape_of(q, k, variant)
    causal_offset = causal_offset_of(variant, shp.rows_q, shp.rows_k)
    if algorithm == "fa1":
        return fa1.forward(q, k, v, scale=scale, causal_offset=causal_offset, block_q=block_q, block_k=block_k)
    if algorithm == "naive":
        return naive.forward(q, k, v, scale=scale, causal_offset=causal_offset)
    variant = _kernel_ready(variant)
    if _copies_16_bytes(np.dtype(q.dtype).name, fp32_precision):
        q, k, v = aligned(q), aligned(k), aligned(v)
    kind = _sm90_float32(q, k, v, variant, fp32_precision, block_q, block_k)
    if kind is not None:
        from . import vt

        done = vt.plan(q, k, v, scale, variant, kind).run(q, k, v, variant.arrays)
        if done is not None:
            return done
    return ForwardPlan(q, k, v, scale=scale, variant=variant, block_q=block_q, block_k=block_k,
                       fp32_precision=fp32_precision, kept=False).run(q, k, v, variant.arrays)


def plan_forward(q, k, v, *, scale, variant: Variant, algorithm, block_q, block_k,
                 fp32_precision="tf32x3") -> ForwardPlan | None:
    """A :class:`ForwardPlan` for repeated calls with these layouts and options (the front door keeps it), or None
    where the call does not run as one FA2 launch on the arrays as given: FA1 and naive, head dims that run on
    padded copies, a bias (converted at every call), 16-bit inputs whose base or strides need an aligned copy."""
    if algorithm != "fa2" or variant.bias is not None or (_needs_padding(q, v, algorithm)
                                                          and not _reads_in_place(q, v, algorithm)):
        return None
    if _copies_16_bytes(np.dtype(q.dtype).name, fp32_precision) and not (_is_aligned(q) and _is_aligned(k)
                                                                         and _is_aligned(v)):
        return None
    kind = _sm90_float32(q, k, v, variant, fp32_precision, block_q, block_k)
    if kind is not None:
        from . import vt

        return vt.plan(q, k, v, scale, variant, kind)
    return ForwardPlan(q, k, v, scale=scale, variant=variant, block_q=block_q, block_k=block_k,
                       fp32_precision=fp32_precision)


# ---------------------------------------------------------------------------------------------------
# Plans: the launches of one call's layouts and options, worked out once, then run with any arrays of those
# layouts. What a plan holds: the kernels (compiled, their function handles), grids and shared memory, each
# launch's arguments packed for cuLaunchKernel (compile.PackedLaunch) with every value the layouts and options
# decide, and the variant's records. A run allocates the outputs, writes the arrays' addresses into the packed
# arguments and launches on the current stream. Every FA2 call runs through one (made for the call, or kept by
# the front door for calls that repeat: it keys them by everything the plan depends on, cuflash._ops.api).

_RUNTIME = None


def runtime():
    """What plans take from CuPy (:class:`.decode.CupyRuntime`), bound once; a tool may set a stand-in."""
    global _RUNTIME
    if _RUNTIME is None:
        from .decode import CupyRuntime

        _RUNTIME = CupyRuntime()
    return _RUNTIME


def call_context() -> tuple:
    """What decides a plan besides the call's arguments: the current device and stream's pointer (a plan's
    ExtraParams copy and block lists are made on one; its run takes the pointer), the thread where that stream is
    CUDA's per-thread default stream (:func:`stream_owner`: the persistent forward's tile counter serves one launch
    at a time, so each thread gets plans of its own), and the benchmarks' switches of the Hopper kernels."""
    rt = runtime()
    stream = rt.current_stream().ptr
    return (rt.get_device(), stream, stream_owner(stream), *switches())


def switches() -> tuple:
    """The launcher's switches of the Hopper kernels and their TMA entry points, which decide a plan too (benchmarks
    flip them; plans are kept per value)."""
    return (SM90A_FORWARD, SM90A_BACKWARD, TMA_FORWARD, TMA_SEQUENCE_LENGTHS, TMA_PADDED, TMA_BACKWARD,
            TMA_PADDED_BACKWARD, TF32_WGMMA, PERSISTENT_FORWARD, F16X2_WGMMA)


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _element_strides(shape) -> tuple[np.int64, np.int64, np.int64]:
    """:func:`strides` of a C-contiguous array of ``shape`` (the outputs a run allocates)."""
    s = _c_strides(shape)[:-1]
    if len(s) == 2:
        s = [0, *s]
    return tuple(np.int64(x) for x in s)


class _VariantArgs:
    """One planned launch's variant arguments across runs: ``VariantParams`` (passed by value; :meth:`pointers`
    gives its pointer fields for a run), the ``ExtraParams`` record (in device memory: a new copy only when an
    address in it changes, through :func:`.spec.device_record`'s cache) and, with a mask_mod on the 16-bit
    kernels, the block lists of the launch's tiles (looked up in their store at each run: a BlockMask may have
    been cleared; or built at each run for masks whose arrays may change in place)."""

    def __init__(self, variant: Variant, scale: float, shp: Shape, spec=None, transposed: bool = False,
                 head_dims=(0, 0)):
        # (its pointers: written at each run; head_dims: [variant head dim], the arrays' (d, dv) below the kernel's)
        self.params = variant_params(variant, scale, shp.rows_q, shp.rows_k, head_dims=head_dims)
        self._shp, self._transposed = shp, transposed
        # The variant without its arrays (a plan must not keep the caller's arrays alive): a run's arrays re-form it.
        # Variant fields that test for an array (is_varlen, variant_type) are read before this, not after.
        self._template = variant.with_arrays(VariantArrays())
        self._has_mods = variant.mods is not None
        self._has_extra = variant.bias is not None or has_dropout(variant) or self._has_mods
        self._tiles = None
        if spec is not None and self._has_mods and variant.mods.has_mask_mod and spec.reads_block_lists:
            store, key = lists_store(variant, shp, spec.tile.block_m, spec.tile.block_n, transposed)
            # (a BlockMask's store is the run's: VariantArrays.block_lists)
            self._tiles = (None if store is variant.block_lists else store, key, spec.tile.block_m, spec.tile.block_n)
        self._record = self._record_words = self._device = None
        self._last = None
        # No pointer in VariantParams to write at a run: the planned record's zeros serve every run.
        self.constant = not self._has_extra and variant.arrays.empty

    def variant(self, arrays: VariantArrays) -> Variant:
        """The planned variant with a run's arrays."""
        return self._template.with_arrays(arrays)

    def _lists(self, arrays: VariantArrays):
        store, key, block_m, block_n = self._tiles
        if store is None:
            store = arrays.block_lists
        hit = store.get(key) if key is not None else None
        if hit is None:
            hit = block_lists(self.variant(arrays), self._shp, block_m, block_n, self._transposed)
        return hit

    def pointers(self, arrays: VariantArrays, dbias=None) -> tuple[int, int, int, int, int]:
        """VariantParams' pointer fields of a run (:data:`.spec.VARIANT_POINTER_FIELDS`): the arrays' addresses
        and the ExtraParams copy's. Keeps the copy and the lists it points to until the next run."""
        extra = 0
        if self._has_extra:
            tiles = self._lists(arrays) if self._tiles is not None else None
            mods = arrays.mod_arrays
            ptrs = (_ptr(arrays.bias), _ptr(dbias), *(_ptr(a) for a in mods), *(0,) * (4 - len(mods)),
                    *((0, 0) if tiles is None else (tiles[0].data.ptr, tiles[1].data.ptr)))
            if ptrs != self._last:
                if self._record is None:
                    self._record = extra_record(self.variant(arrays), dbias, tiles)
                    self._record_words = memoryview(self._record.reshape(1).view(np.uint8)).cast("Q")
                else:
                    for offset, ptr in zip(EXTRA_POINTER_FIELDS, ptrs):
                        self._record_words[offset // 8] = ptr
                self._device = device_record(self._record, cached=dbias is None)
                self._keep, self._last = tiles, ptrs
            extra = self._device.data.ptr
        return (_ptr(arrays.cu_seqlens_q), _ptr(arrays.cu_seqlens_k), _ptr(arrays.seqused_k),
                _ptr(arrays.alibi_slopes), extra)


class _Plan:
    """What every plan does at a run: one run at a time writes the packed arguments and launches (threads may share
    a plan: the front door keys plans by stream, and threads may share one); the device's context current on each
    thread (cuLaunchKernel, unlike CuPy's launches, does not establish it)."""

    def __init__(self):
        rt = runtime()
        self._rt = rt
        self._empty, self._zeros, self._stream = rt.empty, rt.zeros, rt.current_stream
        self._device = rt.get_device()
        self._lock = threading.Lock()
        self._threads: set = set()

    # The tensor maps of a launch from a TMA entry point (pointed at each run's arrays); none elsewhere.
    _maps: tuple = ()

    @property
    def tma(self) -> bool:
        """Whether the plan launches a TMA entry point (which the flat calls do not name: it has no flat twin, so a
        flat launcher runs the cp.async kernel)."""
        return bool(self._maps)

    def _enter(self) -> None:
        """On a thread's first run (a run tests ``threading.get_ident() in self._threads`` first)."""
        self._rt.make_context_current()
        self._threads.add(threading.get_ident())

    def _kept_counters(self, count: int) -> int | None:
        """The address of ``count`` zeroed 32-bit words of :data:`_COUNTERS` (never freed: a graph that captured a
        launch of the plan keeps writing them after the plan is dropped), or None under a CUDA graph capture where no
        chunk has room (none can be made and zeroed then). A chunk is device memory of its own (``raw_zeros``), not
        the allocator's of the call: under torch's CUDA graph trees a chunk made in a warm-up run would otherwise sit
        in the graph's pool, alive and not an output, which the trees refuse."""
        return _COUNTERS.take(self._device, count, lambda n: self._rt.raw_zeros(n, np.int32), self._rt.synchronize,
                              grow=not self._rt.capturing())

    def _lse_target(self, lse: bool, lse_out, stream: int):
        """``(lse array or None, its address)`` a run writes its lse into: the caller's ``lse_out``, a new array of
        :attr:`lse_shape` when ``lse`` is asked for, else the stream's sink (:data:`_LSE_SINKS`: no allocation).
        (A plan sets ``lse_shape`` and ``_lse_size``, its element count.)"""
        if lse_out is not None:
            return lse_out, lse_out.data.ptr
        if lse:
            array = self._empty(self.lse_shape, dtype=np.float32)
            return array, array.data.ptr
        return None, _LSE_SINKS.address((self._device, stream), self._lse_size, self._new_sink)

    def _new_sink(self, key, count: int):
        """A new lse sink of ``count`` float32 on the current device (:data:`_LSE_SINKS`, ``key``'s) and its
        address: memory of its own outside a capture (``kept``: never in a pool torch's CUDA graph trees check)."""
        sink = self._rt.kept((count,), np.float32)
        return sink, sink.data.ptr


# A forward called without return_lse writes its lse into a buffer of its device and stream (device memory of its
# own), grown to the largest asked for and never read: no allocation per call.
_LSE_SINKS = StreamSinks()
# The persistent forward's tile counters (two int32 a plan), in chunks never freed.
_COUNTERS = CounterArena()


class ForwardPlan(_Plan):
    """The FA2 forward of one call's layouts and options: the kernel (the wgmma kernel on sm_90 where the tile table
    has a row, the mma.sync one otherwise; for float32 the mma.sync one on TF32 fragments, or the SIMT one:
    :func:`_f32_forward_spec`), its grid and packed arguments. :meth:`run`
    takes q, k, v and :class:`VariantArrays` of the planned layouts (the caller checks them: the front door keys its
    plans by layout) and returns ``(out, lse)``. ``kept=False``: a plan made for one call (the persistent forward's
    tile counter its own, freed with it, not one of :data:`_COUNTERS`, which are never freed)."""

    def __init__(self, q, k, v, *, scale: float, variant: Variant, block_q, block_k, fp32_precision="tf32x3",
                 kept: bool = True, append=None):
        super().__init__()
        shp = shape_of(q, k, variant)
        dtype, dv = np.dtype(q.dtype).name, v.shape[-1]
        d = kernel_head_dim(shp.head_dim, dv, in_place=dtype in CTYPES)
        # [variant head dim] head dims below the kernel's (multiples of 8, 16-bit: _reads_in_place), read in place
        pads = d != shp.head_dim or d != dv
        vtype = variant_type(variant, pads_head_dim=pads)
        assert shp.heads_q % shp.heads_kv == 0 and (d in HEAD_DIMS or dtype in CTYPES) and (not pads or dtype in CTYPES)
        if dtype == "float32":
            spec = _f32_forward_spec(d, vtype, fp32_precision, block_q, block_k)
        else:
            assert dtype in CTYPES, dtype
            t = _hopper_tile("fwd", d, block_q, block_k, SM90A_FORWARD and not pads)
            if t is not None:
                spec = _staged_bias_spec("fwd_sm90", dtype, d, t, variant, pads) or kernel_spec("fwd_sm90", dtype, d, t,
                                                                                               vtype)
            else:
                spec = kernel_spec("fwd", dtype, d, plan_tile("fwd", d, block_q, block_k), vtype)
        flat_spec = spec  # (the kernel of flat_call: the TMA entry point has no flat twin)
        tma = None if dtype not in CTYPES else _tma_forward(spec, variant, (q, k, v), shp.max_q, block_q, block_k)
        # [prefill append] the new keys and values appended by the forward itself, where the TMA entry point runs it
        # at the arrays' own head dim, one new key per query row, and their maps can be made
        self.appends = (append is not None and tma is not None and tma[0] == shp.head_dim == dv
                        and variant.seqused_k is not None and not variant.is_varlen
                        and append[0].shape[:2] == q.shape[:2] and _mappable(append))
        if tma is not None:
            d, tma_tile = tma
            pads = d != shp.head_dim or d != dv
            persistent = _persistent_forward(dtype, d, tma_tile, variant) and not self.appends
            counter = 0
            if persistent and kept:
                taken = self._kept_counters(2)
                persistent, counter = taken is not None, taken or 0
            elif persistent:  # (a plan for one call: a counter of its own, freed with it)
                persistent = not self._rt.capturing()
                if persistent:
                    self._counter = self._zeros((2,), dtype=np.int32)
                    counter = self._counter.data.ptr
            family = ("fwd_sm90_tma_append" if self.appends else
                      "fwd_sm90_tma_persistent" if persistent else "fwd_sm90_tma")
            spec = kernel_spec(family, dtype, d, tma_tile, variant_type(variant, pads_head_dim=pads))
            self._maps = (_tensor_map(q, tma_tile.block_m), _tensor_map(k, tma_tile.block_n),
                          _tensor_map(v, tma_tile.block_n))
            if self.appends:
                self._maps += tuple(_tensor_map(a, tma_tile.block_n) for a in append)
        check_smem(spec)
        self._aligned = spec.family != "fwd_f32"  # the tensor-core kernels copy tiles with 16-byte cp.async
        self.dtype, self.out_shape = q.dtype, (*q.shape[:-1], dv)
        self.lse_shape = (shp.heads_q, shp.rows_q) if variant.is_varlen else (shp.batch, shp.heads_q, shp.rows_q)
        self._variant = _VariantArgs(variant, scale, shp, spec, head_dims=(shp.head_dim, dv) if pads else (0, 0))
        args = (None, None, None, None, None, i32(shp.rows_q), i32(shp.rows_k), i32(shp.heads_q), i32(shp.group),
                *strides(q), *strides(k), *strides(v), *_element_strides(self.out_shape), np.float32(scale * _LOG2E),
                self._variant.params)
        grid = (cdiv(shp.max_q, spec.tile.block_m), shp.heads_q, shp.batch)
        if spec.family == "fwd_sm90_tma_persistent":
            grid = _persistent_grid(spec, grid[0] * grid[1] * grid[2])
        # (the TMA entry point takes the batch size after VariantParams, and the tile counter: the persistent kernel
        # counts its tiles by them; the counter is the plan's, from _COUNTERS (never freed: a graph that captured the
        # launch keeps its address), zero between launches: each launch sets it back)
        tma_args = ()
        if self.appends:  # (PrefillAppend: its pointers written at each run, :meth:`stage_append`)
            record = np.zeros((), PREFILL_APPEND_DTYPE)
            for prefix, a in zip(("kn", "vn"), append):
                record[f"{prefix}_sb"], record[f"{prefix}_ss"], record[f"{prefix}_sh"] = (
                    s // a.itemsize for s in a.strides[:3])
            record["seqlen_new"], record["capacity"] = append[0].shape[1], k.shape[1]
            tma_args = (record[()],)
        elif tma is not None:
            tma_args = (i32(shp.batch), np.uint64(counter))
        self._launch = PackedLaunch(self._rt, spec, grid, args + tma_args, tuple(m.address for m in self._maps))
        self._flat = (flat_spec, (cdiv(shp.max_q, flat_spec.tile.block_m), shp.heads_q, shp.batch), args[5:])
        vp = len(args) - 1
        self._write = self._launch.writer(tuple(self._launch.word(i) for i in range(5)))  # q, k, v, out, lse
        self._write_variant = None if self._variant.constant else self._launch.writer(
            tuple(self._launch.word(vp, offset) for offset in VARIANT_POINTER_FIELDS))
        self._write_append = None if not self.appends else self._launch.writer(tuple(
            self._launch.word(vp + 1, PREFILL_APPEND_DTYPE.fields[name][1])
            for name in ("cache_seqlens", "k_new", "v_new", "k_cache", "v_cache")))
        self._lse_size = int(np.prod(self.lse_shape))
        self._has_seqused = variant.seqused_k is not None

    def flat_call(self):
        """The planned launch for launchers that load the kernel themselves and pass its parameters one by one
        (:mod:`cuflash.jax`'s kernel calls): ``(spec, grid, scalars)``, ``scalars`` the parameters after the five
        arrays (q, k, v, out, lse) of the kernel's flat entry point as ``(dtype, value)`` pairs, dtype one of
        ``"i32"``, ``"i64"``, ``"u64"``, ``"fp32"`` (VariantParams' fields one by one); None where a run writes
        more than those five addresses (variant arrays, a device record) or the kernel has no flat entry point."""
        spec, grid, rest = self._flat
        if not self._variant.constant or spec.flat_name is None:
            return None
        return spec, grid, tuple(p for value in rest for p in _scalar_params(value))

    def run(self, q, k, v, arrays: VariantArrays = VariantArrays(), stream: int | None = None, lse: bool = True,
            out=None, lse_out=None):
        """``(out, lse)`` (``lse`` False: ``(out, None)``, the lse written into a buffer of the stream's), or None when
        a 16-bit input's base address is not a multiple of 16 bytes (the caller runs it unplanned, on an aligned
        copy). ``stream``: the current stream's pointer, when the caller has it (:func:`call_context`). ``out``,
        ``lse_out``: C-contiguous arrays of :attr:`out_shape` (q's dtype) and :attr:`lse_shape` (float32) to write
        into instead of new ones (the caller checks them; JAX's buffers)."""
        if self.appends:
            raise RuntimeError("a plan that appends ([prefill append]) runs through its ChunkedPrefillLaunch "
                               "(stage, stage_append, launch_staged), not run()")
        pq, pk, pv = q.data.ptr, k.data.ptr, v.data.ptr
        if self._aligned and (pq | pk | pv) & 15:
            return None
        if threading.get_ident() not in self._threads:
            self._enter()
        if stream is None:
            stream = self._stream().ptr
        if out is None:
            out = self._empty(self.out_shape, dtype=self.dtype)
        lse, lse_ptr = self._lse_target(lse, lse_out, stream)
        with self._lock:
            self.stage_pointers(pq, pk, pv, out.data.ptr, lse_ptr,
                                None if self._write_variant is None else self._variant.pointers(arrays))
            self._launch.run(stream)
        return out, lse

    def stage(self, pq: int, pk: int, pv: int, pout: int, plse: int, arrays: VariantArrays) -> None:
        """Write one run's addresses into the packed arguments, for :meth:`launch_staged`: the caller holds
        ``self._lock`` and has entered the plan's context (a step of several launches stages its forward before its
        first launch, so that its launches follow each other with no host work between them)."""
        self.stage_pointers(pq, pk, pv, pout, plse,
                            None if self._write_variant is None else self._variant.pointers(arrays))

    @property
    def stages_pointers(self) -> bool:
        """Whether :meth:`stage_pointers` may stage a run (a variant with no ExtraParams record: bias, dropout or
        mods)."""
        return not self._variant._has_extra

    def stage_pointers(self, pq: int, pk: int, pv: int, pout: int, plse: int, variant_pointers: tuple | None) -> None:
        """:meth:`stage` with VariantParams' pointer fields given as addresses (cu_seqlens_q, cu_seqlens_k, seqused_k,
        alibi_slopes, extra: 0 for none; None for a plan that writes none), where :attr:`stages_pointers`: no
        VariantArrays to build (chunked prefill's fused step, whose key counts' base is a new array at every step)."""
        self._write(pq, pk, pv, pout, plse)
        if self._maps:
            q_map, k_map, v_map = self._maps[:3]
            q_map.point(pq)
            k_map.point(pk)
            v_map.point(pv)
        if self._write_variant is not None:
            self._write_variant(*variant_pointers)

    def stage_append(self, pcache_seqlens: int, pk_new: int, pv_new: int, pk_cache: int, pv_cache: int) -> None:
        """[prefill append] A run's cache_seqlens, new keys' and values' and caches' addresses (the caches: the staged
        k and v, which the kernel writes through these), after :meth:`stage` (the same hold of ``self._lock``): the
        maps of k_new and v_new pointed at them. (The run's seqused_k, staged through the VariantArrays, is
        cache_seqlens too.)"""
        self._write_append(pcache_seqlens, pk_new, pv_new, pk_cache, pv_cache)
        self._maps[3].point(pk_new)
        self._maps[4].point(pv_new)

    def launch_staged(self, stream: int, after_prior: bool = False) -> bool:
        """Launch with the packed arguments :meth:`stage` wrote (under the same hold of ``self._lock``); ``after_prior``
        ([pdl], where :attr:`waits_for_prior_grid`): with programmatic stream serialization. Returns whether it was
        launched so (False: the ordinary launch, asked for or in place of a refused one)."""
        if after_prior:
            return self._launch.run_after_prior(stream)
        self._launch.run(stream)
        return False

    def prepare_after_prior(self) -> None:
        """[pdl] What :meth:`launch_staged` with ``after_prior`` needs, made now (when planning)."""
        self._launch.prepare_after_prior()

    @property
    def waits_for_prior_grid(self) -> bool:
        """[pdl] Whether the planned kernel waits for the kernel launched before it (it reads key counts that one may
        write: :attr:`.spec.Family.waits_for_prior_grid`)."""
        return self._launch.spec.fam.waits_for_prior_grid and self._has_seqused


_SCALAR_KINDS = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64", np.dtype(np.uint64): "u64",
                 np.dtype(np.float32): "fp32"}


def _scalar_params(value) -> list[tuple[str, int | float]]:
    """A packed launch argument as flat-entry-point scalars ``(dtype, value)``: a NumPy scalar as itself, a
    VariantParams field by field (:data:`.spec.VARIANT_PARAMS_DTYPE`'s order: CUFLASH_VARIANT_FLAT_PARAMS)."""
    fields = [value[name] for name in value.dtype.names] if isinstance(value, np.void) else [value]
    return [(_SCALAR_KINDS[f.dtype], f.item()) for f in fields]


def launch_params(variant: Variant, scale: float, shp: Shape, spec=None, dbias=None, transposed=False,
                  head_dims=(0, 0)):
    """The ``VariantParams`` of one launch of ``spec``, and the device buffers they point to (keep them
    referenced until the launch is queued). With a mask_mod, the block lists of the spec's tiles: per query
    tile the key tiles to visit, or (``transposed``, the dK/dV pass) per key tile the query tiles."""
    tiles = None  # (the float32 kernels evaluate a mask_mod score by score and read no lists)
    if spec is not None and variant.mods is not None and variant.mods.has_mask_mod and spec.reads_block_lists:
        tiles = block_lists(variant, shp, spec.tile.block_m, spec.tile.block_n, transposed)
    extra = extra_params(variant, dbias, tiles)
    return variant_params(variant, scale, shp.rows_q, shp.rows_k, extra, head_dims), (extra, tiles)


# Block lists of masks that read no array and no per-sequence length are a function of the call's shape
# alone: kept per (policy, shape, tiling), at most this many.
_LISTS_CACHE: dict = {}
_LISTS_CACHE_SIZE = 64


def lists_store(variant: Variant, shp: Shape, block_m: int, block_n: int, transposed: bool):
    """``(store, key)``: where :func:`block_lists` keeps the lists of this launch's tiling, or ``(None, None)`` for
    lists computed on every call. A cuflash.BlockMask's store is ``variant.block_lists``; the shape cache is
    :data:`_LISTS_CACHE`."""
    import cupy

    mods = variant.mods
    has_lengths = variant.is_varlen or variant.seqused_k is not None
    # What decides the lists besides the mask's arrays and the sequences' lengths.
    tiling = (cupy.cuda.runtime.getDevice(), mask_policy(variant), variant.window_left, variant.right,
              variant.bottom_right, shp.rows_q, shp.rows_k, *_lists_shape(variant, shp, block_m, block_n, transposed),
              block_m, block_n, transposed)
    if variant.block_lists is not None:  # a cuflash.BlockMask's: kept for as long as the user keeps it
        return variant.block_lists, tiling
    if not has_lengths and not any(mods.uses(name, "mask_mod") for name in mods.array_names):
        # (per stream too: a later call on another stream must not read lists still being written)
        return _LISTS_CACHE, (cupy.cuda.get_current_stream().ptr, *tiling)
    return None, None


def _lists_shape(variant: Variant, shp: Shape, block_m: int, block_n: int, transposed: bool):
    """``(nb, nh, rows, cols)`` of a launch's block lists: the batch and head axes 1 where the map broadcasts."""
    mods = variant.mods
    has_lengths = variant.is_varlen or variant.seqused_k is not None
    nb = shp.batch if (mods.mask_uses_b or has_lengths) else 1
    nh = shp.heads_q if mods.mask_uses_h else 1
    rows = cdiv(shp.max_k, block_n) if transposed else cdiv(shp.max_q, block_m)
    cols = cdiv(shp.max_q, block_m) if transposed else cdiv(shp.max_k, block_n)
    return nb, nh, rows, cols


def block_lists(variant: Variant, shp: Shape, block_m: int, block_n: int, transposed: bool):
    """mask_mod's block lists for tiles of ``block_m`` queries x ``block_n`` keys (``block_map.cu``, on the
    GPU): ``(count, list)`` per query tile, or per key tile when ``transposed``, every tile listed holding a
    score visible by the sequence's lengths, the band (causal, window) and mask_mod. Reused from a cache when
    the mask reads no array and the sequences have no lengths of their own (then nothing but the shape and
    the tiling decides them), or kept in the cuflash.BlockMask the mask came in (``variant.block_lists``, whose
    contract is that its arrays and the lengths do not change); otherwise computed on every call, since arrays
    may change in place (:func:`lists_store`)."""
    import cupy

    store, key = lists_store(variant, shp, block_m, block_n, transposed)
    if key is not None:
        hit = store.get(key)
        if hit is not None:
            return hit
    nb, nh, rows, cols = _lists_shape(variant, shp, block_m, block_n, transposed)
    policy = mask_policy(variant)
    count = cupy.empty((nb, nh, rows), dtype=cupy.int32)
    lists = cupy.empty((nb, nh, rows, cols), dtype=cupy.int32)
    spec = kernel_spec("block_lists_t" if transposed else "block_lists", "float32", 0, Tile(block_m, block_n, 4, 1),
                       policy)
    extra = extra_params(variant)
    vp = variant_params(variant, 1.0, shp.rows_q, shp.rows_k, extra)
    if rows and cols and nb and nh:
        if rows > 65535 or nb * nh > 65535:
            raise ValueError(f"mask_mod's block map has {rows} row tiles and {nb * nh} (batch x head) maps; the grid "
                             "allows 65535 of each: use fewer sequences or heads per call")
        status = cupy.empty((nb, nh, rows, cols), dtype=cupy.int8)  # each tile: 0 skip, 1 partial, 2 full
        launch(spec, (cols, rows, nh * nb), (status, i32(rows), i32(cols), i32(nh), i32(shp.rows_q), i32(shp.rows_k), vp))
        launch(BLOCK_COMPACT, (1, rows, nh * nb), (status, count, lists, i32(cols)))
    elif rows and nb and nh:
        count.fill(0)
    if key is not None:
        if store is _LISTS_CACHE and len(_LISTS_CACHE) >= _LISTS_CACHE_SIZE:
            _LISTS_CACHE.pop(next(iter(_LISTS_CACHE)))
        store[key] = (count, lists)
    return count, lists


def plan_backward(do, q, k, v, out, lse, *, scale, variant: Variant, algorithm, block_q, block_k, order):
    """A plan for repeated backward calls with these layouts and options (the front door keeps it), or None for a
    bias (converted at every call, and its gradient): a :class:`BackwardPlan` (its launches packed once) where the
    call runs the 16-bit FA2 backward on the arrays as given, else a :class:`CheckedBackward` (float32, FA1, naive,
    head dims run on padded or upcast copies, inputs that need an aligned or contiguous copy)."""
    if variant.bias is not None:
        return None
    options = dict(scale=scale, algorithm=algorithm, block_q=block_q, block_k=block_k, order=order)
    if not _packs_backward(do, q, k, v, lse, algorithm):
        return CheckedBackward(variant=variant, **options)
    if any(a.data.ptr % 16 for a in (q, k, v, do)):  # (this call's addresses need an aligned copy; a later one's may not)
        return None
    return BackwardPlan(do, q, k, v, out, lse, variant=variant, **options)


def _packs_backward(do, q, k, v, lse, algorithm) -> bool:
    """Whether :func:`backward` runs calls of these layouts as the 16-bit FA2 launches on the arrays as given: a
    head dim of :func:`bwd_head_dims` (or below one, read in place), q's, k's, v's and do's strides aligned for
    cp.async (their addresses are a run's), lse contiguous."""
    if algorithm != "fa2" or np.dtype(q.dtype).name not in CTYPES:
        return False
    kd = _bwd_padding(q, v, algorithm)
    if (kd or q.shape[-1]) not in bwd_head_dims(*device_info()) or (kd and not _reads_in_place(q, v, algorithm)):
        return False
    return all(_strides_aligned(a) for a in (q, k, v, do)) and lse.flags.c_contiguous


class CheckedBackward:
    """A backward call's checked options, without its arrays: :meth:`run` runs :func:`backward` with a run's arrays
    (its launches worked out at each call and launched through CuPy)."""

    def __init__(self, *, variant: Variant, **options):
        self._variant = variant.with_arrays(VariantArrays())  # (keeps none of the caller's arrays alive)
        self._options = options

    def run(self, do, q, k, v, out, lse, arrays: VariantArrays = VariantArrays(), stream: int | None = None):
        return backward(do, q, k, v, out, lse, variant=self._variant.with_arrays(arrays), **self._options)


class _Layout(NamedTuple):
    """A buffer of a planned launch as :func:`strides` reads it (shape, byte strides, item size), and its index in
    a run's addresses (written into the packed arguments at each run)."""

    shape: tuple
    strides: tuple
    itemsize: int
    slot: int

    @staticmethod
    def of(a, slot: int) -> _Layout:
        return _Layout(tuple(a.shape), tuple(a.strides), a.itemsize, slot)

    @staticmethod
    def contiguous(shape, itemsize: int, slot: int) -> _Layout:
        return _Layout(tuple(shape), tuple(int(s) * itemsize for s in _c_strides(shape)), itemsize, slot)


def _c_strides(shape) -> list[int]:
    """Element strides of a C-contiguous array of ``shape``, every axis."""
    steps, step = [], 1
    for n in reversed(shape):
        steps.append(step)
        step *= max(int(n), 1)
    return steps[::-1]


class BackwardPlan(_Plan):
    """The 16-bit FA2 backward of one call's layouts and options (:func:`_backward_launches`: D, dK/dV with dQ, or
    dQ's own pass for the split order, dQ's conversion, GQA's sum), each launch packed once. :meth:`run` takes the
    arrays of the planned layouts (the caller checks them: the front door keys its plans by layout) and returns
    ``(dq, dk, dv)``. A run allocates the gradients and one workspace (D, the float32 dQ and GQA accumulators,
    zeroed where the kernels accumulate: dQ's by D's launch, others by a memset on the stream), writes the addresses
    and launches."""

    # A run's addresses, in this order: the inputs, the gradients, the workspace's parts.
    _SLOTS = ("q", "k", "v", "do", "out", "lse", "dq", "dk", "dv", "delta", "dq_accum", "dkv_accum")

    def __init__(self, do, q, k, v, out, lse, *, scale: float, variant: Variant, algorithm, block_q, block_k,
                 order):
        super().__init__()
        import cupy

        self._memset = cupy.cuda.runtime.memsetAsync
        shp = shape_of(q, k, variant)
        tma_pad = _tma_padded_backward(variant, (q, k, v, do), algorithm, block_q, block_k)  # [bwd tma pad]
        kd = tma_pad or _bwd_padding(q, v, algorithm)
        head_dims = (q.shape[-1], v.shape[-1]) if kd else (0, 0)  # [variant head dim] read in place
        d, dtype = kd or shp.head_dim, np.dtype(q.dtype).name
        assert d in bwd_head_dims(*device_info()) and dtype in CTYPES and variant.bias is None, (d, dtype)
        split = order in ("split", "q_outer")
        vtype = variant_type(variant, pads_head_dim=bool(kd))
        spec, spec_q = _backward_specs(dtype, d, q, v, vtype, split, block_q, block_k, tma_pad=bool(tma_pad))
        slot = self._SLOTS.index
        # [bwd tma] the dK/dV launch from its TMA entry point where allowed (flat_calls keep the cp.async one): its
        # maps of q, k, v and dO, each pointed at a run's array ((map, slot) pairs)
        flat_spec = spec
        if _tma_backward(spec, variant, (q, k, v, do)):
            tile = (TILES.get(("bwd", "sm90a_tma", d), spec.tile) if BWD_ROWS128 and spec.has_dq
                    and _rows128_takes(variant) else spec.tile)
            spec = kernel_spec("bwd_dkdv_sm90_tma", dtype, d, tile, spec.variant, spec.has_dq)
            check_smem(spec)
            t = spec.tile
            self._maps = tuple((_tensor_map(a, rows), slot(name)) for a, name, rows in
                               ((q, "q", t.block_m), (k, "k", t.block_n), (v, "v", t.block_n), (do, "do", t.block_m)))
        # (the cp.async entry point reads whole rows of the kernel's head dim: never a padded one's)
        assert not tma_pad or spec.family == "bwd_dkdv_sm90_tma", spec.name
        # [bwd dq tile] dQ's planes of whole tiles (64 or 128 rows), in fragment order (the flat twin keeps rows in order)
        dq_tile = (BWD_DQ_TILE and spec.family == "bwd_dkdv_sm90_tma" and spec.has_dq
                   and not bwd_sm90_shares_keys(spec.tile))  # ([bwd shared keys]: dQ by red.global.add)
        dq_rows = cdiv(shp.rows_q, spec.tile.block_m) * spec.tile.block_m if dq_tile else shp.rows_q
        f32 = np.dtype(np.float32).itemsize
        # The workspace: the accumulators the kernels add into first (zeroed), then D. 256-byte aligned parts.
        parts = {"dq_accum": None if split else (shp.ws_batch, shp.heads_q, dq_rows, d),
                 "dkv_accum": (2, shp.ws_batch, shp.heads_q, shp.rows_k, d) if shp.group > 1 else None,
                 "delta": (shp.ws_batch, shp.heads_q, shp.rows_q)}
        zeroed = {"dq_accum": True, "dkv_accum": variant.seqused_k is not None, "delta": False}
        zero_dq = _zero_dq_in_d(split, shp, variant)
        offsets, size, self._zero_bytes = {}, 0, 0
        for name, shape in sorted(parts.items(), key=lambda item: not zeroed[item[0]]):
            if shape is None:
                continue
            offsets[name] = size
            size += -(-int(np.prod(shape)) * f32 // 256) * 256
            if zeroed[name] and not zero_dq:
                self._zero_bytes = size
        self._ws_bytes, self._offsets = max(size, 256), tuple(offsets.get(name) for name in self._SLOTS[9:])
        itemsize = q.dtype.itemsize
        buffers = _BackwardBuffers(
            *(_Layout.of(a, slot(name)) for a, name in zip((q, k, v, do, out, lse), self._SLOTS)),
            *(_Layout.contiguous(a.shape, itemsize, slot(name)) for a, name in zip((q, k, v), ("dq", "dk", "dv"))),
            *(None if parts[name] is None else _Layout.contiguous(parts[name], f32, slot(name))
              for name in ("delta", "dq_accum", "dkv_accum")))
        variants = []

        def params(launch_spec, transposed=False):
            variants.append(_VariantArgs(variant, scale, shp, launch_spec, transposed, head_dims))
            return variants[-1].params

        self._steps = []
        interleave = backward_interleave(variant, shp)
        # [bwd persistent] its tile counter (None under a capture with no chunk to spare: one block a tile then)
        counter = (self._kept_counters(2) if spec.family == "bwd_dkdv_sm90_tma" and d in BWD_PERSISTENT_DIMS
                   else None)
        if counter is not None:
            spec = kernel_spec("bwd_dkdv_sm90_tma_persistent", dtype, d, spec.tile, spec.variant, spec.has_dq)
        launches = _backward_launches(buffers, shp, d, dtype, spec, spec_q, np.float32(scale), params, interleave,
                                      dq_tile, counter is not None, counter or 0, zero_dq)
        # (the flat twin: the cp.async kernel, a block a key tile, dQ's rows in order; launches of their own where the
        # dK/dV launch is the TMA entry point's, whose arguments end with the tile counter)
        flat = ([(flat_spec if launch_spec is spec else launch_spec, grid, args) for launch_spec, grid, args in launches]
                if spec is flat_spec else _backward_launches(
                    buffers, shp, d, dtype, flat_spec, spec_q, np.float32(scale),
                    lambda s, transposed=False: _VariantArgs(variant, scale, shp, s, transposed, head_dims).params,
                    interleave))  # (no zeroing there: flat_calls' caller zeroes its workspace, dQ's unpadded)
        for launch_spec, grid, args in launches:
            more = tuple(m.address for m, _ in self._maps) if launch_spec is spec else ()
            launch = PackedLaunch(self._rt, launch_spec, grid,
                                  tuple(None if isinstance(a, _Layout) else a for a in args), more)
            words = tuple(launch.word(i) for i, a in enumerate(args) if isinstance(a, _Layout))
            slots = tuple(a.slot for a in args if isinstance(a, _Layout))
            variant_args = None
            vp = next((i for i, a in enumerate(args) if isinstance(a, np.void)), None)
            if vp is not None:  # its VariantParams: the launch's _VariantArgs
                variant_args = variants.pop(0)
                if variant_args.constant:  # (no pointer in it to write)
                    variant_args = None
                else:
                    words += tuple(launch.word(vp, offset) for offset in VARIANT_POINTER_FIELDS)
            self._steps.append((launch, launch.writer(words), slots, variant_args))
        assert not variants
        self.dtypes = (q.dtype, k.dtype, v.dtype)
        self.shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        self._zero_grads = variant.seqused_k is not None  # (dk, dv past a sequence's used keys: never written)
        # (flat_calls: the launches, and the workspace's parts as buffers of their own)
        # [bwd tma pad] no flat twin: the cp.async entry point cannot read head dims below its own
        constant = all(step[3] is None for step in self._steps) and not self._zero_grads and not tma_pad
        flat_parts = {**parts, "dq_accum": (shp.ws_batch, shp.heads_q, shp.rows_q, d)} if dq_tile else parts
        self._flat = (flat, {name: flat_parts[name] for name in ("delta", "dq_accum", "dkv_accum") if flat_parts[name]}
                      ) if constant else None

    def flat_calls(self):
        """The planned launches for launchers that load each kernel themselves and pass its parameters one by one
        (:mod:`cuflash.jax`'s kernel calls): ``(calls, workspace)``, or None where a run writes more than
        buffer addresses (variant arrays, a device record), zeroes the gradients, or a kernel that takes a
        VariantParams has no flat entry point. ``calls``: per launch, in order, ``(spec, name, grid, params)``, with
        ``name`` the NVRTC name expression (the flat entry point where the kernel takes a VariantParams) and
        ``params`` its parameters in order: ``("buffer", slot)`` (a name of :attr:`_SLOTS`) or ``(dtype, value)``
        as :meth:`ForwardPlan.flat_call`'s (a null pointer ``("u64", 0)``). ``workspace``: the float32 buffers the
        launches share besides the inputs and the gradients, ``{slot: shape}``, to be zeroed before the first launch
        (the accumulators must be; D is written whole)."""
        if self._flat is None:
            return None
        steps, workspace = self._flat
        calls = []
        for launch_spec, grid, args in steps:
            has_vp = isinstance(args[-1], np.void)
            name = launch_spec.flat_name if has_vp else launch_spec.name
            if name is None:
                return None
            params = []
            for a in args:
                if isinstance(a, _Layout):
                    params.append(("buffer", self._SLOTS[a.slot]))
                else:
                    params += _scalar_params(a)
            calls.append((launch_spec, name, grid, tuple(params)))
        return tuple(calls), workspace

    def run(self, do, q, k, v, out, lse, arrays: VariantArrays = VariantArrays(), stream: int | None = None):
        """``(dq, dk, dv)``, or None when a 16-bit input's base address is not a multiple of 16 bytes (the caller
        runs it unplanned, on an aligned copy). ``stream``: the current stream's pointer, when the caller has it."""
        pq, pk, pv, pdo = q.data.ptr, k.data.ptr, v.data.ptr, do.data.ptr
        if (pq | pk | pv | pdo) & 15:
            return None
        if threading.get_ident() not in self._threads:
            self._enter()
        empty = self._empty
        (sq, sk, sv), (tq, tk, tv) = self.shapes, self.dtypes
        dq, dk, dv = empty(sq, dtype=tq), empty(sk, dtype=tk), empty(sv, dtype=tv)
        ws = empty((self._ws_bytes,), dtype=np.uint8)
        if stream is None:
            stream = self._stream().ptr
        base = ws.data.ptr
        if self._zero_bytes:
            self._memset(base, 0, self._zero_bytes, stream)
        if self._zero_grads:
            self._memset(dk.data.ptr, 0, dk.nbytes, stream)
            self._memset(dv.data.ptr, 0, dv.nbytes, stream)
        addresses = (pq, pk, pv, pdo, out.data.ptr, lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr,
                     *(None if offset is None else base + offset for offset in self._offsets))
        with self._lock:
            for tmap, s in self._maps:
                tmap.point(addresses[s])
            for launch, write, slots, variant_args in self._steps:
                ptrs = [addresses[s] for s in slots]
                if variant_args is not None:
                    ptrs += variant_args.pointers(arrays)
                write(*ptrs)
                launch.run(stream)
        return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# Backward.


def _grad_buffers(q, k, v, variant: Variant, dtype=None):
    """dq, dk, dv: keys past a sequence's used ones (seqused_k) get no kernel writes, so start at zero."""
    import cupy

    alloc = cupy.zeros if variant.seqused_k is not None else cupy.empty
    return (cupy.empty(q.shape, dtype=dtype or q.dtype), alloc(k.shape, dtype=dtype or k.dtype),
            alloc(v.shape, dtype=dtype or v.dtype))


def _preprocess(spec_family, dtype, d, do, out, shp: Shape):
    """[bwd 0] D = rowsum(dO * O), one float32 per (row, head), laid out like lse."""
    import cupy

    delta = cupy.empty((shp.ws_batch, shp.heads_q, shp.rows_q), dtype=cupy.float32)
    launch(*_preprocess_launch(spec_family, dtype, d, do, out, delta, shp))
    return delta


def _preprocess_launch(spec_family, dtype, d, do, out, delta, shp, zero=None):
    """[bwd 0]'s launch; ``zero``: ``(buffer, count)``, the float32 accumulator whose first ``count`` float4 the launch
    zeroes too (a planned backward's dQ workspace: no memset of its own), or None. The 16-bit kernel strides over
    the rows (:func:`_preprocess_rows` a block), the float32 one takes 4 a block. ``shp``: a :class:`Shape`, or
    ``(rows_q, heads_q, batch)`` (the FA1 launcher's)."""
    rows_q, heads_q, batch = (shp.rows_q, shp.heads_q, shp.ws_batch) if isinstance(shp, Shape) else shp
    rows = 4 if spec_family == "bwd_pre_f32" else _preprocess_rows(d)
    buffer, count = zero or (np.uintp(0), 0)
    return (kernel_spec(spec_family, dtype, d), (cdiv(rows_q, rows), heads_q, batch), (
        do, out, delta, i32(rows_q), i32(heads_q), *strides(do), *strides(out), buffer, np.int64(count)))


def _preprocess_rows(d: int) -> int:
    """The rows one block of flash_bwd_preprocess_kernel covers a step at head dim ``d`` (its 8 warps' kSteps x
    kPerWarp rows, backward.cu; its blocks stride over the rows, so a grid of another size is slower, not wrong):
    256 at d <= 32, 128 at 64, 64 at 128, 32 at 256."""
    lanes = min(32, max(4, 1 << (cdiv(d, 8) - 1).bit_length()))
    steps = 4 if cdiv(d, 8) <= lanes else 2
    return 8 * steps * (32 // lanes)


def _kernel_ready(variant: Variant) -> Variant:
    """The variant with a bias the kernels can index: float16, bfloat16 or float32 (read in its own dtype, the
    policy's BiasArray element) with a contiguous last axis, as it is; others copied to float32."""
    import cupy

    bias = variant.bias
    if bias is None:
        return variant
    if bias.shape[2] * max(bias.shape[3], bias.strides[2] // bias.itemsize) >= 2**31:
        raise ValueError(f"bias of shape {tuple(bias.shape)}: the CUDA kernels index one (seqlen_q, seqlen_k) plane "
                         "with 32-bit offsets, so seqlen_q * seqlen_k must stay below 2**31")
    if np.dtype(bias.dtype).name in BIAS_CTYPES and bias.strides[-1] == bias.itemsize:
        return variant
    return dataclasses.replace(variant, bias=cupy.ascontiguousarray(bias, dtype=cupy.float32))


def _bias_aligned(bias) -> bool:
    """[variant bias tile] Whether a bias's tiles can be staged with 16-byte cp.async: its base address and the
    start of every row a multiple of 16 bytes (the strides of the axes with more than one entry; a broadcast axis
    has stride 0), each row (seqlen_k entries) a whole number of 16-byte chunks. Otherwise the kernels read it
    from global memory (a 16-bit bias with seqlen_k not a multiple of 8, say)."""
    return (bias.data.ptr % 16 == 0 and bias.shape[3] * bias.itemsize % 16 == 0
            and all(s % 16 == 0 for s, n in zip(bias.strides[:3], bias.shape[:3]) if n > 1))


def _staged_bias_spec(family: str, dtype: str, d: int, t: Tile, variant: Variant, pads: bool = False,
                      dbias_dtype: str | None = None):
    """[variant bias tile] The spec of the wgmma kernel ``family`` that stages the bias in shared memory, at tile
    ``t`` or, where its two bias tiles do not fit the device's shared memory (a float32 bias beside the forward's
    128 x 128 tile at d 128), at ``t`` with half the keys (not below 64; the backward's key tile is its
    warpgroups' rows and stays); None where the bias is not staged (none, rows not aligned, or no tile fits the
    blocks per SM the kernel is built for: a float32 bias beside the forward's two d 64 blocks)."""
    if variant.bias is None or not _bias_aligned(variant.bias):
        return None
    if family == "fwd_sm90" and t.block_m == 16 * (t.warps - 4):
        return None  # (the warp-specialized forward: its loading warpgroup does not stage a bias; Sm90Config::kWS)
    if family == "bwd_dkdv_sm90" and bwd_sm90_shares_keys(t):
        return None  # ([bwd shared keys] d 256: no staged bias yet, its shared memory is full)
    if family == "bwd_dkdv_sm90" and variant.bias.itemsize == 4:
        # (a float32 bias in the backward's transposed layout is one 4-byte read per score: beside dK, dV and dQ at
        # d 128, ptxas spills 28 bytes where the global-memory reads spill 4: those stay)
        return None
    vtype = variant_type(variant, pads_head_dim=pads, staged_bias=True, dbias_dtype=dbias_dtype)
    _, optin = device_info()
    while t.block_n >= 64:
        spec = kernel_spec(family, dtype, d, t, vtype)
        blocks = spec.fam.min_blocks(d, t)  # (each block also holds 1 KiB the system reserves; an SM, optin + 1 KiB)
        if spec.smem <= optin and blocks * (spec.smem + 1024) <= optin + 1024:
            return spec
        if family != "fwd_sm90":
            break
        t = t._replace(block_n=t.block_n // 2)
    return None


def _dbias_dtype(bias) -> np.dtype:
    """The dtype of the backend's dbias (docs/architecture.md): the bias's own, written once per element as PyTorch's
    SDPA does, or float32 where the bias broadcasts over batch or heads (stride 0), whose gradient the front door sums
    over those axes (in float32, then rounded once)."""
    broadcast = any(s == 0 and n > 1 for s, n in zip(bias.strides[:2], bias.shape[:2]))
    return np.dtype(np.float32) if broadcast else np.dtype(bias.dtype)


def _writes_every_score(variant: Variant) -> bool:
    """Whether the 16-bit backward writes every dbias element of the sequences' (len_q, len_k) grid: no band, no
    used keys, no mask_mod's block lists, padded batches (every key tile visits every query tile once), so its
    dbias needs no zeroing."""
    return (variant.window_left is None and variant.right is None and variant.seqused_k is None
            and not variant.is_varlen and (variant.mods is None or not variant.mods.has_mask_mod))


def backward(do, q, k, v, out, lse, *, scale, variant: Variant, algorithm, block_q, block_k, order, want_dbias=False):
    """``(dq, dk, dv)`` of one call, and ``dbias`` ((batch, heads_q, seqlen_q, seqlen_k), :func:`_dbias_dtype`:
    the bias's dtype, float32 where it broadcasts) when ``want_dbias`` and the variant has a bias."""
    import cupy

    if want_dbias and variant.softcap and variant.bias is not None and variant.mods is not None \
            and variant.mods.has_score_mod:
        raise NotImplementedError(
            "the bias gradient with softcap, a bias and a score_mod together does not run on the GPU yet (the "
            "kernels keep one derivative per score); apply the softcap inside score_mod instead, e.g. "
            "score_mod='30.0f * tanhf(score / 30.0f) + ...'")
    kd = _bwd_padding(q, v, algorithm)
    own = FA1_BWD_HEAD_DIMS if algorithm == "fa1" else bwd_head_dims(*device_info())  # (16-bit kernels' head dims)
    head_dims = (0, 0)  # [variant head dim] the arrays' (d, dv) when the kernels read them in place
    if kd and kd in own and _reads_in_place(q, v, algorithm):
        head_dims = (q.shape[-1], v.shape[-1])
    elif kd:
        d, dv = q.shape[-1], v.shape[-1]
        grads = backward(_pad(do, kd), _pad(q, kd), _pad(k, kd), _pad(v, kd), _pad(out, kd), lse, scale=scale,
                         variant=variant, algorithm=algorithm, block_q=block_q, block_k=block_k, order=order,
                         want_dbias=want_dbias)
        cut = [cupy.ascontiguousarray(g[..., :w]) for g, w in zip(grads[:3], (d, d, dv))]
        return (*cut, *grads[3:])
    shp = shape_of(q, k, variant)
    d, dtype = kd or shp.head_dim, np.dtype(q.dtype).name
    if algorithm == "fa1" and (dtype == "float32" or d in FA1_BWD_HEAD_DIMS):
        return fa1.backward(do, q, k, v, out, lse, scale=scale,
                            causal_offset=causal_offset_of(variant, shp.rows_q, shp.rows_k),
                            block_q=block_q, block_k=block_k)
    if algorithm == "naive":
        return naive.backward(do, q, k, v, scale=scale, causal_offset=causal_offset_of(variant, shp.rows_q, shp.rows_k))
    if dtype in CTYPES and d not in own:
        # No tensor-core backward at this head dim on this GPU (dK and dV would not fit its registers or its shared
        # memory; FA1: above 128):
        # run the float32 kernels on upcast inputs, cast the gradients back.
        f32 = [a.astype(cupy.float32) for a in (do, q, k, v, out)]
        grads = backward(*f32, lse, scale=scale, variant=variant, algorithm=algorithm, block_q=None, block_k=None,
                         order=order, want_dbias=want_dbias)
        return (*(g.astype(q.dtype) for g in grads[:3]), *grads[3:])

    variant = _kernel_ready(variant)
    dbias = dbias_dtype = None
    if want_dbias and variant.bias is not None:  # [variant grad]: tiles no query visits stay 0
        alloc = cupy.empty if dtype in CTYPES and _writes_every_score(variant) else cupy.zeros
        dbias = alloc((shp.batch, shp.heads_q, shp.rows_q, shp.rows_k), dtype=_dbias_dtype(variant.bias))
        dbias_dtype = dbias.dtype.name
    vtype = variant_type(variant, pads_head_dim=bool(kd), dbias_dtype=dbias_dtype)
    fscale = np.float32(scale)
    def params(spec=None, transposed=False):  # one launch's VariantParams (and what it points to)
        return launch_params(variant, scale, shp, spec, dbias, transposed, head_dims)

    grads = _backward(do, q, k, v, out, lse, shp, d, variant, vtype, params, fscale, order, block_q, block_k, dtype,
                      dbias_dtype)
    return grads if dbias is None else (*grads, dbias)


def _backward(do, q, k, v, out, lse, shp: Shape, d, variant, vtype, params, fscale, order, block_q, block_k, dtype,
              dbias_dtype=None):
    """The backward's launches at kernel head dim ``d`` (the arrays' own, or above them: [variant head dim]);
    ``dbias_dtype``: the dtype of the dbias its launches write, where they write one."""
    import cupy

    split = order in ("split", "q_outer")
    lse = cupy.ascontiguousarray(lse)
    if dtype == "float32":
        vp, _keep = params()  # (_keep: the device buffers vp points to, alive until the launches are queued)
        return _backward_f32(do, q, k, v, out, lse, shp, variant, vtype, vp, fscale, split)

    q, k, v, do = aligned(q), aligned(k), aligned(v), aligned(do)
    # (the wgmma kernel runs only the arrays' own head dims: its policy never pads them)
    spec, spec_q = _backward_specs(dtype, d, q, v, vtype, split, block_q, block_k,
                                   staged=lambda t: _staged_bias_spec("bwd_dkdv_sm90", dtype, d, t, variant,
                                                                      dbias_dtype=dbias_dtype))
    delta = cupy.empty((shp.ws_batch, shp.heads_q, shp.rows_q), dtype=cupy.float32)
    dq, dk, dv = _grad_buffers(q, k, v, variant)
    zero_dq = _zero_dq_in_d(split, shp, variant)
    dq_accum = None if split else (cupy.empty if zero_dq else cupy.zeros)((shp.ws_batch, shp.heads_q, shp.rows_q, d),
                                                                         dtype=cupy.float32)
    dkv_accum = None
    if shp.group > 1:
        alloc = cupy.zeros if variant.seqused_k is not None else cupy.empty
        dkv_accum = alloc((2, shp.ws_batch, shp.heads_q, shp.rows_k, d), dtype=cupy.float32)
    keep = []  # the device buffers each VariantParams points to, alive until the launches are queued

    def launch_vp(launch_spec, transposed=False):
        vp, kept = params(launch_spec, transposed)
        keep.append(kept)
        return vp

    buffers = _BackwardBuffers(q, k, v, do, out, lse, dq, dk, dv, delta, dq_accum, dkv_accum)
    for launch_spec, grid, args in _backward_launches(buffers, shp, d, dtype, spec, spec_q, fscale, launch_vp,
                                                      backward_interleave(variant, shp), zero_dq=zero_dq):
        launch(launch_spec, grid, args)
    return dq, dk, dv


class _BackwardBuffers(NamedTuple):
    """The arrays of the 16-bit backward's launches (or a plan's :class:`_Layout` of each); the accumulators None
    where the call has none (dq_accum: the split order; dkv_accum: no GQA)."""

    q: Any
    k: Any
    v: Any
    do: Any
    out: Any
    lse: Any
    dq: Any
    dk: Any
    dv: Any
    delta: Any
    dq_accum: Any
    dkv_accum: Any


def _backward_specs(dtype: str, d: int, q, v, vtype: str, split: bool, block_q, block_k, staged=None,
                    tma_pad: bool = False):
    """The dK/dV (+ dQ) kernel's spec (the wgmma one on sm_90 where the table has a row and the arrays have the
    kernel's head dims, or ``tma_pad``: fewer, read by its TMA entry point, :func:`_tma_padded_backward`), and the dQ
    pass's for the split order (else None). ``staged(tile)``: the wgmma kernel's spec with a staged bias ([variant
    bias tile], :func:`_staged_bias_spec`), or None."""
    t = _hopper_tile("bwd", d, block_q, block_k, SM90A_BACKWARD and (tma_pad or d == q.shape[-1] == v.shape[-1]))
    if t is not None:
        spec = staged(t) if staged is not None else None
        spec = (kernel_spec(spec.family, dtype, d, spec.tile, spec.variant, not split) if spec is not None
                else kernel_spec("bwd_dkdv_sm90", dtype, d, t, vtype, not split))
    else:
        spec = kernel_spec("bwd_dkdv", dtype, d, plan_tile("bwd", d, block_q, block_k), vtype, not split)
    check_smem(spec)
    spec_q = None
    if split:
        spec_q = kernel_spec("bwd_dq", dtype, d, plan_tile("bwd_dq", d, None, None), vtype)
        check_smem(spec_q)
    return spec, spec_q


def backward_interleave(variant: Variant, shp: Shape) -> int:
    """The (batch, head) pairs whose key tiles the wgmma dK/dV kernel interleaves (``interleave`` of
    interleaved_block): 1 (each pair's tiles in turn) where every key tile sees the same queries; 4 under a causal
    mask, whose first key tiles see the most queries. Measured with ``tools/bwd_order.py`` (H100 and H200, bf16,
    16 heads x 16384 tokens): 4 takes 2-6 % off the causal backward at N 4096-8192 and moves N 2048 and 16384, the
    windows and dense attention by less than the noise (1-2 %); interleaving more pairs spreads the blocks in flight
    over more heads' Q, dO and dQ in L2 (64: slower than 1)."""
    if BWD_INTERLEAVE is not None:
        return BWD_INTERLEAVE
    return 4 if variant.causal else 1


def _backward_launches(a: _BackwardBuffers, shp: Shape, d: int, dtype: str, spec, spec_q, fscale, params,
                       interleave: int = 1, dq_tile: bool = False, persistent: bool = False, counter: int = 0,
                       zero_dq: bool = False) -> list:
    """The 16-bit backward's launches at kernel head dim ``d``, in order, as ``(spec, grid, args)``: [bwd 0] D; dK,
    dV (and dQ into the float32 dq_accum, atomically) by key tiles; dQ by query tiles (split order) or dq_accum's
    conversion (``dq_tile``: from [bwd dq tile]'s fragment order); GQA's sum of dK, dV over each group.
    ``params(spec, transposed)``: a launch's VariantParams. ``persistent`` ([bwd persistent]): the dK/dV launch a
    block per SM (at most one per key tile), its ``interleave`` argument the order's pairs plus the batch times 256,
    taking its tiles from ``counter`` (the address of two zeroed int32; the TMA entry point takes it after
    VariantParams, used or not). ``zero_dq``: D's launch zeroes dq_accum first (in place of a memset).
    The one description of these launches: :func:`_backward` launches it through CuPy, :class:`BackwardPlan`
    packs it once."""
    null = np.uintp(0)
    zero = (a.dq_accum, _quads(a.dq_accum.shape)) if zero_dq else None
    launches = [_preprocess_launch("bwd_pre", dtype, a.do.shape[-1], a.do, a.out, a.delta, shp, zero)]
    grid = (cdiv(shp.max_k, spec.tile.block_n), shp.heads_q, shp.batch)
    if persistent:
        assert interleave < 256 and shp.max_k == shp.rows_k, (interleave, shp)  # (the TMA kernel: no packed rows)
        grid, interleave = (min(math.prod(grid), sm_count()), 1, 1), interleave + 256 * shp.batch
    launches.append((spec, grid, (
        a.q, a.k, a.v, a.do, a.lse, a.delta,
        a.dq_accum if a.dq_accum is not None else null, a.dk, a.dv, a.dkv_accum if a.dkv_accum is not None else null,
        i32(shp.rows_q), i32(shp.rows_k), i32(shp.heads_q), i32(shp.group), i32(interleave),
        *strides(a.q), *strides(a.k), *strides(a.v), *strides(a.do), *strides(a.dk), *strides(a.dv), fscale,
        params(spec, True), *((np.uint64(counter),) if spec.family.startswith("bwd_dkdv_sm90_tma") else ()))))
    if spec_q is not None:
        launches.append((spec_q, (cdiv(shp.max_q, spec_q.tile.block_m), shp.heads_q, shp.batch), (
            a.q, a.k, a.v, a.do, a.lse, a.delta, a.dq, i32(shp.rows_q), i32(shp.rows_k), i32(shp.heads_q),
            i32(shp.group), *strides(a.q), *strides(a.k), *strides(a.v), *strides(a.do), *strides(a.dq), fscale,
            params(spec_q))))
    else:
        launches.append(_convert_dq_launch(a.dq_accum, a.dq, dtype, d, shp, fscale,
                                           spec.tile.block_m if dq_tile else 0))
    if shp.group > 1:
        launches.append(_reduce_dkv_launch(a.dkv_accum, a.dk, a.dv, dtype, d, shp))
    return launches


def _zero_dq_in_d(split: bool, shp: Shape, variant: Variant) -> bool:
    """Whether D's launch zeroes the float32 dQ accumulator (no memset, no cupy.zeros): where there is one and it is
    the only buffer of the backward to start at zero (GQA's accumulator does too under seqused_k: a memset of both)."""
    return not split and not (shp.group > 1 and variant.seqused_k is not None)


def _quads(shape) -> int:
    """The float4 of a float32 buffer of ``shape`` (the accumulators' last axis is a head dim, a multiple of 8)."""
    n = math.prod(int(x) for x in shape)
    assert n % 4 == 0, shape
    return n // 4


def convert_dq(dq_accum, dq, dtype: str, d: int, shp: Shape, fscale) -> None:
    """dQ = scale * dq_accum, cast, written with dq's strides (one batch of all rows when packed); the workspace
    is ``d`` columns wide, dq may have fewer ([variant head dim])."""
    launch(*_convert_dq_launch(dq_accum, dq, dtype, d, shp, fscale))


def _convert_dq_launch(dq_accum, dq, dtype: str, d: int, shp: Shape, fscale, tile_rows: int = 0):
    """dQ's conversion launch; ``tile_rows``: from [bwd dq tile]'s workspace of tiles of that many rows (a block a
    tile), else rows in order."""
    spec = (kernel_spec("bwd_convert_dq_tiles", dtype, d, Tile(tile_rows, 0, 8, 1)) if tile_rows
            else kernel_spec("bwd_convert_dq", dtype, d))
    blocks = cdiv(shp.rows_q, tile_rows) if tile_rows else cdiv(shp.rows_q * d // 2, 256)
    return spec, (blocks, shp.heads_q, shp.ws_batch), (dq_accum, dq, i32(shp.rows_q), i32(shp.heads_q), *strides(dq),
                                                      fscale, i32(dq.shape[-1]))


def reduce_dkv(dkv_accum, dk, dv, dtype: str, d: int, shp: Shape) -> None:
    """GQA/MQA: dK, dV of each key/value head = the sum over its query heads, in a fixed order."""
    launch(*_reduce_dkv_launch(dkv_accum, dk, dv, dtype, d, shp))


def _reduce_dkv_launch(dkv_accum, dk, dv, dtype: str, d: int, shp: Shape):
    half = np.int64(shp.ws_batch * shp.heads_q * shp.rows_k * d)  # (the elements of dkv_accum[0])
    return (kernel_spec("bwd_reduce_dkv", dtype, d), (cdiv(shp.rows_k * d // 2, 256), shp.heads_kv, shp.ws_batch), (
        dkv_accum, dk, dv, i32(shp.rows_k), i32(shp.group), half, *strides(dk), *strides(dv), i32(dk.shape[-1]),
        i32(dv.shape[-1])))


def _backward_f32(do, q, k, v, out, lse, shp: Shape, variant, vtype, vp, fscale, split):
    """The float32 backward (SIMT): D; then dK, dV (+ dQ by atomicAdd) by key/value tiles through shared
    memory (flash_bwd_dkdv_f32_kernel), or for the split order without dQ, then the row-wise
    flash_bwd_dq_f32_kernel, no atomics. dQ accumulates in the zeroed float32 output itself; dK and dV per
    query head into a float32 workspace, summed over each GQA group here (a fixed order)."""
    import cupy

    d = shp.head_dim
    delta = _preprocess("bwd_pre_f32", "float32", d, do, out, shp)
    dq = cupy.zeros(q.shape, dtype=cupy.float32)
    alloc = cupy.zeros if variant.seqused_k is not None else cupy.empty
    dkv = alloc((2, shp.ws_batch, shp.heads_q, shp.rows_k, d), dtype=cupy.float32)
    spec = kernel_spec("bwd_dkdv_f32", "float32", d, TILES[("bwd", "f32", d)], vtype, not split)
    check_smem(spec)
    args = (q, k, v, do, lse, delta, dq, dkv, i32(shp.rows_q), i32(shp.rows_k), i32(shp.heads_q), i32(shp.group),
            *strides(q), *strides(k), *strides(v), *strides(do), *strides(dq), fscale, vp)
    launch(spec, (cdiv(shp.max_k, spec.tile.block_n), shp.heads_q, shp.batch), args)
    if split:
        args = (*args[:7], *args[8:])  # no workspace argument
        launch(kernel_spec("bwd_dq_f32", "float32", d, variant=vtype), (cdiv(shp.max_q, 4), shp.heads_q, shp.batch),
               args)
    # (2, ws_batch, Hkv, group, rows_k, d) -> sum over the group -> (2, ws_batch, rows_k, Hkv, d)
    dkv = dkv.reshape(2, shp.ws_batch, shp.heads_kv, shp.group, shp.rows_k, d).sum(axis=3).transpose(0, 1, 3, 2, 4)
    if variant.is_varlen:
        return dq, cupy.ascontiguousarray(dkv[0, 0]), cupy.ascontiguousarray(dkv[1, 0])
    return dq, cupy.ascontiguousarray(dkv[0]), cupy.ascontiguousarray(dkv[1])
