"""algorithm="fa1" (fa1.cu): one thread block per (batch, query head), key/value tiles outer.

FA1 runs dense and causal attention only (the variants run in FA2 order; :func:`.attention.check_supported`
says so before any launch). The kernels' variant slot is FA1's ``Is_causal``.
"""

from __future__ import annotations

import numpy as np

from .compile import arch_class, check_smem, device_info, launch
from .spec import TILES, Tile, _b
from .spec import spec as kernel_spec

__all__ = ["forward", "backward"]



def _fa1_tile(direction: str, d: int, block_q, block_k, f32: bool = False) -> Tile:
    """The table's FA1 tile, or one with the user's block sizes (forward: block_q must be 16, the rows of
    a warp's query tile; backward: block_k = 16 * warps key rows, block_q a multiple of 32). The float32
    kernels step one query row per warp, so only block_k applies to them (forward: up to 32 keys, one per
    lane; backward: a multiple of 4, block_k / 4 * head_dim / 32 <= 32 registers of dK and of dV)."""
    cc, _ = device_info()
    t = TILES[(direction, "f32" if f32 else arch_class(cc), d)]
    if block_k is None and (block_q is None or f32):
        return t
    if f32:
        bn = block_k
        if direction == "fa1_fwd":
            ok, rule = 1 <= bn <= 32, "the float32 forward needs 1 <= block_k <= 32 (one lane per key)"
        else:
            ok = bn % 4 == 0 and (bn // 4) * (d // 32) <= 32
            rule = (f"the float32 backward needs block_k a multiple of 4 with block_k / 4 * head_dim / 32 <= 32 "
                    f"(at most {32 * 4 // (d // 32)} at head_dim {d})")
        if not ok:
            raise ValueError(f"block_k={bn} is not a valid CUDA tile for algorithm='fa1' on float32 inputs: {rule}")
        return Tile(t.block_m, bn, t.warps, t.stages)
    bm = block_q if block_q is not None else t.block_m
    bn = block_k if block_k is not None else t.block_n
    if direction == "fa1_fwd":
        t = Tile(bm, bn, t.warps, t.stages)
        ok = bm == 16 and bn % 16 == 0 and 16 <= bn <= 128
    else:
        t = Tile(bm, bn, max(bn // 16, 1), t.stages)
        mt = bm // 16
        ok = bn % 16 == 0 and 1 <= t.warps <= 16 and bm % 32 == 0 and t.warps % mt == 0
        ok = ok and (d // (t.warps // mt)) % 16 == 0
    if not ok:
        raise ValueError(
            f"block sizes block_q={bm}, block_k={bn} are not a valid CUDA tile for algorithm='fa1' at head_dim "
            f"{d}: the forward needs block_q = 16 and block_k a multiple of 16 up to 128; the backward "
            "block_k = 16 * warps (up to 256) and block_q a multiple of 32"
        )
    return t


def forward(q, k, v, *, scale, causal_offset, block_q, block_k):
    """FA1 forward (fa1_fwd_kernel, or fa1_fwd_f32_kernel for float32): grid (heads_q, batch). The running
    output (normalized, float32), row max m (log2 units) and row sum l live in global memory between
    key/value tiles, as in reference.fa1_forward; nothing is read from them on the first key tile, so they
    need no zeroing."""
    import cupy

    from .attention import _LOG2E, aligned, strides

    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    causal = causal_offset is not None
    dtype = np.dtype(q.dtype).name
    f32 = dtype == "float32"
    if not f32:
        q, k, v = aligned(q), aligned(k), aligned(v)
    out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    o_run = cupy.empty((B, Hq, Nq, d), dtype=cupy.float32)
    ml_run = cupy.empty((2, B, Hq, Nq), dtype=cupy.float32)
    spec = kernel_spec("fa1_fwd_f32" if f32 else "fa1_fwd", dtype, d, _fa1_tile("fa1_fwd", d, block_q, block_k, f32),
                      _b(causal))
    check_smem(spec)
    launch(spec, (Hq, B), (
        q, k, v, out, lse, o_run, ml_run[0], ml_run[1], np.int32(Nq), np.int32(Nk), np.int32(Hq), np.int32(Hq // Hkv),
        *strides(q), *strides(k), *strides(v), *strides(out), np.float32(scale * _LOG2E),
        np.int32(causal_offset if causal else 0)))
    return out, lse


def backward(do, q, k, v, out, lse, *, scale, causal_offset, block_q, block_k):
    """FA1 backward (fa1_bwd_kernel, fa1_bwd_f32_kernel): grid (heads_q, batch), key/value tiles outer, dQ
    read-modify-written in a zeroed float32 workspace without atomics (one block owns a (batch, head)). D,
    the dQ scale/cast and the GQA dK/dV group sum are backward.cu's small kernels, shared with FA2."""
    import cupy

    from .attention import Shape, _preprocess_launch, aligned, convert_dq, reduce_dkv, strides

    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    shp = Shape(B, Nq, Nk, Hq, Hkv, d, Nq, Nk, B)
    causal = causal_offset is not None
    off, fscale = np.int32(causal_offset if causal else 0), np.float32(scale)
    dtype = np.dtype(q.dtype).name
    f32 = dtype == "float32"
    lse = cupy.ascontiguousarray(lse)
    delta = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    if not f32:
        q, k, v, do = aligned(q), aligned(k), aligned(v), aligned(do)
    # [bwd 0] D = rowsum(dO * O)
    launch(*_preprocess_launch("bwd_pre_f32" if f32 else "bwd_pre", dtype, d, do, out, delta, (Nq, Hq, B)))
    if f32:
        spec = kernel_spec("fa1_bwd_f32", dtype, d, _fa1_tile("fa1_bwd", d, None, block_k, f32=True), _b(causal))
        check_smem(spec)
        dq = cupy.zeros(q.shape, dtype=cupy.float32)
        dkv = cupy.empty((2, B, Hq, Nk, d), dtype=cupy.float32)
        launch(spec, (Hq, B), (
            q, k, v, do, lse, delta, dq, dkv, np.int32(Nq), np.int32(Nk), np.int32(Hq), np.int32(group),
            *strides(q), *strides(k), *strides(v), *strides(do), *strides(dq), fscale, off))
        dkv = dkv.reshape(2, B, Hkv, group, Nk, d).sum(axis=3).transpose(0, 1, 3, 2, 4)  # (2, B, Nk, Hkv, d)
        return dq, cupy.ascontiguousarray(dkv[0]), cupy.ascontiguousarray(dkv[1])

    dq = cupy.empty(q.shape, dtype=q.dtype)
    dk = cupy.empty(k.shape, dtype=k.dtype)
    dv = cupy.empty(v.shape, dtype=v.dtype)
    spec = kernel_spec("fa1_bwd", dtype, d, _fa1_tile("fa1_bwd", d, block_q, block_k), _b(causal))
    check_smem(spec)
    dq_accum = cupy.zeros((B, Hq, Nq, d), dtype=cupy.float32)
    dkv_accum = cupy.empty((2, B, Hq, Nk, d), dtype=cupy.float32) if group > 1 else None
    launch(spec, (Hq, B), (
        q, k, v, do, lse, delta, dq_accum, dk, dv, dkv_accum if dkv_accum is not None else np.uintp(0),
        np.int32(Nq), np.int32(Nk), np.int32(Hq), np.int32(group),
        *strides(q), *strides(k), *strides(v), *strides(do), *strides(dk), *strides(dv), fscale, off))
    convert_dq(dq_accum, dq, dtype, d, shp, fscale)
    if group > 1:
        reduce_dkv(dkv_accum, dk, dv, dtype, d, shp)
    return dq, dk, dv



