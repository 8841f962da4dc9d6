"""KV-cache decoding on the GPU: rotary, the in-place append, and split-KV attention (``decode.cu``), planned
as :func:`cuflash.reference_decode.forward_kvcache` does it step by step ([decode rotary], [decode append],
[decode split], [decode merge]; ``docs/decoding.md``).

First version, written without device time: not exported by :mod:`cuflash._cuda` (so the front door still
refuses CuPy arrays) until ``tests/test_cuda_decode.py`` passes on a GPU. What it runs: head dims 32, 64, 96
and 128 with ``head_dim_v == head_dim``, float16 and bfloat16, contiguous or paged caches of any page size,
GQA packing, causal (bottom-right) masks, windows, softcap and ALiBi; the splits are merged with CuPy array
operations (:func:`cuflash._merge.merge_stacked`).
"""

from __future__ import annotations

import numpy as np

from .._kvcache import KVCache
from .._merge import merge_stacked
from .._variant import Variant
from ..reference_decode import apply_rotary
from .compile import check_smem, kernel, launch
from .spec import CTYPES, DECODE_HEAD_DIMS, TILES
from .spec import spec as kernel_spec

__all__ = ["forward_kvcache", "DECODE_PARAMS_DTYPE"]

_LOG2E = 1.4426950408889634

# Layout of `struct DecodeParams` (decode.cu), passed by value.
DECODE_PARAMS_DTYPE = np.dtype(
    [("cache_seqlens", np.uint64), ("cache_leftpad", np.uint64), ("cache_batch_idx", np.uint64),
     ("block_table", np.uint64), ("alibi_slopes", np.uint64), ("alibi_sb", np.int64),
     *((name, np.int64) for name in ("q_sb", "q_ss", "q_sh", "k_sb", "k_ss", "k_sh", "v_sb", "v_ss", "v_sh",
                                      "o_sb", "o_ss", "o_sh", "bt_sb")),
     *((name, np.int32) for name in ("seqlen_q", "seqlen_new", "heads_q", "group", "page_size", "num_splits",
                                      "has_left", "window_left", "has_right", "window_right")),
     *((name, np.float32) for name in ("scale_log2", "softcap_a", "softcap_b", "inv_scale"))],
    align=True,
)
assert DECODE_PARAMS_DTYPE.itemsize == 208


def _ptr(a) -> int:
    return 0 if a is None else int(a.data.ptr)


def _el(a, axis: int) -> int:
    return a.strides[axis] // a.itemsize


def check_decode_supported(q, k_cache, v_cache) -> None:
    """What this first version runs; anything else raises NotImplementedError naming it (before the caches
    are touched)."""
    from .compile import device_info

    if device_info()[0] < 80:
        raise NotImplementedError("decoding on the GPU needs compute capability 8.0 or newer (cp.async, mma.sync)")
    d, dv = q.shape[-1], v_cache.shape[-1]
    if dv != d:
        raise NotImplementedError(f"decoding on the GPU with head_dim_v != head_dim (got {d} and {dv}, MLA) comes next")
    if d not in DECODE_HEAD_DIMS:
        raise NotImplementedError(f"decoding on the GPU runs head dims {DECODE_HEAD_DIMS}; got {d}")
    if np.dtype(q.dtype).name not in CTYPES:
        raise NotImplementedError(f"decoding on the GPU runs float16 and bfloat16; got {np.dtype(q.dtype).name}")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.data.ptr % 16 or any(s % 16 for s in a.strides[:-1]) or a.strides[-1] != a.itemsize:
            raise NotImplementedError(f"{name}: the decode kernel reads 16-byte rows; its base and strides must be "
                                      f"multiples of 16 bytes (got strides {a.strides})")


def _append(k_cache, v_cache, k, v, cache: KVCache) -> None:
    """[decode append] new token i of sequence b into slot cache_seqlens[b] + i of both caches, in place (v
    first, then k: MLA's v_cache may be a view of k_cache)."""
    import cupy

    batch, seqlen_new = k.shape[0], k.shape[1]
    slots = cache.cache_seqlens.astype(cupy.int64)[:, None] + cupy.arange(seqlen_new)[None, :]
    if cache.block_table is not None:
        rows = cache.block_table[cupy.arange(batch)[:, None], slots // cache.page_size]
        slots = slots % cache.page_size
    else:
        rows = cupy.arange(batch) if cache.cache_batch_idx is None else cache.cache_batch_idx
        rows = cupy.broadcast_to(rows.astype(cupy.int64)[:, None], slots.shape)
    v_cache[rows, slots] = v
    k_cache[rows, slots] = k


def forward_kvcache(q, k_cache, v_cache, k, v, *, cache: KVCache, scale: float, variant: Variant, out=None):
    """``(out, lse)`` of one decode call (the interface of docs/architecture.md); appends ``k``, ``v`` first."""
    import cupy

    check_decode_supported(q, k_cache, v_cache)
    batch, seqlen_q, heads_q, d = q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    # The kernel first (shared memory, NVRTC): nothing that can fail may come after the append.
    dtype = np.dtype(q.dtype).name
    paged = cache.block_table is not None
    spec = kernel_spec("decode", dtype, d, TILES[("decode", "any", d)], "true" if paged else "false")
    assert spec.tile.block_m == 16 and spec.tile.stages == 2, "decode.cu's packed-row tile and ring"
    check_smem(spec)
    kernel(spec)
    if cache.rotary is not None:
        rot = cache.rotary
        base = cache.cache_seqlens.astype(cupy.int64)[:, None]
        steps = cupy.arange(seqlen_q) if rot.consecutive_q else cupy.zeros(seqlen_q, cupy.int64)
        q = apply_rotary(q, rot.cos, rot.sin, base + steps[None, :], rot.interleaved, xp=cupy)
        if k is not None:
            k = apply_rotary(k, rot.cos, rot.sin, base + cupy.arange(k.shape[1])[None, :], rot.interleaved, xp=cupy)
    if k is not None and k.shape[1]:
        _append(k_cache, v_cache, k, v, cache)
    if out is None:
        out = cupy.empty((batch, seqlen_q, heads_q, d), dtype=q.dtype)
    if 0 in (batch, seqlen_q, heads_q):  # no block to launch: what a row that sees no key keeps
        out[...] = 0
        return out, cupy.full((batch, heads_q, seqlen_q), -cupy.inf, dtype=cupy.float32)

    # Splits past the number of key tiles would be empty: at most one per tile (and grid y's 65535).
    splits = max(1, min(int(cache.num_splits), -(-cache.capacity // spec.tile.block_n), 65535))
    row_tiles = -(-(seqlen_q * group) // spec.tile.block_m)
    lse = cupy.empty((batch, heads_q, seqlen_q), dtype=cupy.float32)
    o_part = lse_part = None
    if splits > 1:
        o_part = cupy.empty((splits, batch, heads_q, seqlen_q, d), dtype=cupy.float32)
        lse_part = cupy.empty((splits, batch, heads_q, seqlen_q), dtype=cupy.float32)
    p = np.zeros((), DECODE_PARAMS_DTYPE)
    slopes = variant.alibi_slopes
    p["cache_seqlens"], p["cache_leftpad"] = _ptr(cache.cache_seqlens), _ptr(cache.cache_leftpad)
    p["cache_batch_idx"], p["block_table"] = _ptr(cache.cache_batch_idx), _ptr(cache.block_table)
    p["alibi_slopes"], p["alibi_sb"] = _ptr(slopes), (0 if slopes is None else _el(slopes, 0))
    for prefix, a in (("q", q), ("k", k_cache), ("v", v_cache), ("o", out)):
        p[f"{prefix}_sb"], p[f"{prefix}_ss"], p[f"{prefix}_sh"] = _el(a, 0), _el(a, 1), _el(a, 2)
    p["bt_sb"] = 0 if cache.block_table is None else _el(cache.block_table, 0)
    p["seqlen_q"], p["seqlen_new"], p["heads_q"], p["group"] = seqlen_q, cache.seqlen_new, heads_q, group
    p["page_size"], p["num_splits"] = cache.page_size or 1, splits
    # A band edge past every key is no edge: clamped so that t + offset +- window stays inside int32.
    reach = cache.capacity + seqlen_q
    left = None if variant.window_left is None else min(variant.window_left, reach)
    right = None if variant.right is None else min(variant.right, reach)
    p["has_left"], p["window_left"] = left is not None, left or 0
    p["has_right"], p["window_right"] = right is not None, right or 0
    p["scale_log2"], p["inv_scale"] = scale * _LOG2E, 1.0 / scale
    if variant.softcap:
        p["softcap_a"], p["softcap_b"] = scale / variant.softcap, variant.softcap / scale
    null = np.uintp(0)
    launch(spec, (heads_kv * row_tiles, splits, batch), (
        q, k_cache, v_cache, o_part if o_part is not None else null, lse_part if lse_part is not None else null,
        out, lse, np.int32(row_tiles), p[()]))
    if splits > 1:  # [decode merge]
        o, lse = merge_stacked(o_part, lse_part, cupy)
        out[...] = o.transpose(0, 2, 1, 3).astype(out.dtype)
    return out, lse
