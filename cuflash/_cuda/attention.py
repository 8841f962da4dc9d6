"""FlashAttention-2 planning and launches: which kernel spec, which grid, which arguments.

Arguments arrive validated and normalized from the front door (:mod:`cuflash._api`); only internal
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
from typing import NamedTuple

import numpy as np

from .._variant import Variant
from . import fa1, naive
from .compile import arch_class, check_smem, device_info, launch
from .spec import BLOCK_COMPACT, BWD_HEAD_DIMS, CTYPES, FA1_HEAD_DIMS, HEAD_DIMS, TILES, Tile, extra_params, mask_policy, variant_params, variant_type
from .spec import spec as kernel_spec

__all__ = ["forward", "backward", "check_supported"]

# On sm_90 devices the forward runs flash_fwd_sm90_kernel where TILES has a ("fwd", "sm90a", d) row, and the
# backward flash_bwd_dkdv_sm90_kernel where it has a ("bwd", "sm90a", d) row (switches for benchmarks).
SM90A_FORWARD = True
SM90A_BACKWARD = True
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


def aligned(a):
    """``a`` itself when its tiles can be copied with 16-byte cp.async (base and every stride a multiple
    of 16 bytes); otherwise a contiguous copy (rare: views with odd offsets or strides)."""
    import cupy

    if a.data.ptr % 16 == 0 and all((s % 16 == 0) or n == 1 for s, n in zip(a.strides[:-1], a.shape[:-1])):
        return a
    return cupy.ascontiguousarray(a)


def i32(x) -> np.int32:
    return np.int32(x)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tile(direction: str, d: int, t: Tile) -> None:
    """The constraints each kernel static_asserts, checked before compiling a user-chosen tile."""
    ok = t.block_m % 16 == 0 and t.block_n % 16 == 0 and t.stages >= 1 and 1 <= t.warps <= 16
    if direction == "fwd":
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
    t = TILES.get((direction, arch_class(cc), d))
    assert t is not None, (direction, cc, d)
    if block_q is not None or block_k is not None:
        bm = block_q if block_q is not None else t.block_m
        bn = block_k if block_k is not None else t.block_n
        if direction == "bwd":
            warps = 2 * max(bn // 32, 1)  # two warps per group of 32 key rows
        elif direction == "fwd" and bm % (16 * t.warps) == 0 and bm // (16 * t.warps) in (1, 2):
            warps = t.warps
        else:
            warps = bm // 16
        t = Tile(bm, bn, max(warps, 1), t.stages)
        check_tile(direction, d, t)
    return t


def _hopper_tile(direction: str, d: int, block_q, block_k, enabled: bool) -> Tile | None:
    """The wgmma kernel's tile where it runs: sm_90, the table has a row, the caller chose no block sizes."""
    t = TILES.get((direction, "sm90a", d))
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


def kernel_head_dim(d: int, dv: int, algorithm: str = "fa2") -> int:
    """The instantiated head dim that runs q, k of head dim ``d`` and v of ``dv`` (FA1: FA1_HEAD_DIMS)."""
    return next(x for x in (FA1_HEAD_DIMS if algorithm == "fa1" else HEAD_DIMS) if x >= max(d, dv))


def _needs_padding(q, v, algorithm) -> int:
    """The padded head dim when this call runs on padded copies, else 0 (naive handles any dims)."""
    d, dv = q.shape[-1], v.shape[-1]
    if algorithm == "naive":
        return 0
    kd = kernel_head_dim(d, dv, algorithm)
    return kd if (kd != d or dv != d) else 0


def _reads_in_place(q, v, algorithm) -> bool:
    """Whether the kernels read head dims below their own in place (no padded copies): the 16-bit FA2
    forward, with both head dims multiples of 8 (16-byte rows)."""
    return algorithm == "fa2" and q.dtype.itemsize == 2 and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0


def _pad(a, width: int):
    import cupy

    out = cupy.zeros((*a.shape[:-1], width), dtype=a.dtype)
    out[..., :a.shape[-1]] = a
    return out


def forward(q, k, v, *, scale, variant: Variant, algorithm, block_q, block_k):
    """``(out, lse)`` of one call (FA2 kernels; FA1 and naive are dispatched from here)."""
    import cupy

    kd = _needs_padding(q, v, algorithm)
    head_dims = (0, 0)  # [variant head dim] the arrays' (d, dv) when the kernel reads them in place
    if kd and _reads_in_place(q, v, algorithm):
        head_dims = (q.shape[-1], v.shape[-1])
    elif kd:
        out, lse = forward(_pad(q, kd), _pad(k, kd), _pad(v, kd), scale=scale, variant=variant, algorithm=algorithm,
                           block_q=block_q, block_k=block_k)
        return cupy.ascontiguousarray(out[..., :v.shape[-1]]), lse
    shp = shape_of(q, k, variant)
    causal_offset = causal_offset_of(variant, shp.rows_q, shp.rows_k)
    if algorithm == "fa1":
        return fa1.forward(q, k, v, scale=scale, causal_offset=causal_offset, block_q=block_q, block_k=block_k)
    if algorithm == "naive":
        return naive.forward(q, k, v, scale=scale, causal_offset=causal_offset)
    d = kd or shp.head_dim
    assert shp.heads_q % shp.heads_kv == 0 and d in HEAD_DIMS
    dtype = np.dtype(q.dtype).name
    variant = _kernel_ready(variant)
    vtype = variant_type(variant, pads_head_dim=bool(kd))
    out = cupy.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
    lse = _lse_empty(shp, variant)
    if dtype == "float32":
        spec = kernel_spec("fwd_f32", dtype, d, TILES[("fwd", "f32", d)], vtype)
    else:
        assert dtype in CTYPES, dtype
        q, k, v = aligned(q), aligned(k), aligned(v)
        t = _hopper_tile("fwd", d, block_q, block_k, SM90A_FORWARD and not kd)
        if t is not None:
            spec = kernel_spec("fwd_sm90", dtype, d, t, vtype)
        else:
            spec = kernel_spec("fwd", dtype, d, plan_tile("fwd", d, block_q, block_k), vtype)
    check_smem(spec)
    vp, _keep = launch_params(variant, scale, shp, spec, head_dims=head_dims)
    launch(spec, (cdiv(shp.max_q, spec.tile.block_m), shp.heads_q, shp.batch), (
        q, k, v, out, lse, i32(shp.rows_q), i32(shp.rows_k), i32(shp.heads_q), i32(shp.group),
        *strides(q), *strides(k), *strides(v), *strides(out), np.float32(scale * _LOG2E), vp))
    return out, lse


def launch_params(variant: Variant, scale: float, shp: Shape, spec=None, dbias=None, transposed=False,
                  head_dims=(0, 0)):
    """The ``VariantParams`` of one launch of ``spec``, and the device buffers they point to (keep them
    referenced until the launch is queued). With a mask_mod, the block lists of the spec's tiles: per query
    tile the key tiles to visit, or (``transposed``, the dK/dV pass) per key tile the query tiles."""
    tiles = None  # (the float32 kernels evaluate a mask_mod score by score and read no lists)
    if spec is not None and variant.mods is not None and variant.mods.has_mask_mod and spec.dtype != "float32":
        tiles = block_lists(variant, shp, spec.tile.block_m, spec.tile.block_n, transposed)
    extra = extra_params(variant, dbias, tiles)
    return variant_params(variant, scale, shp.rows_q, shp.rows_k, extra, head_dims), (extra, tiles)


# Block lists of masks that read no array and no per-sequence length are a function of the call's shape
# alone: kept per (policy, shape, tiling), at most this many.
_LISTS_CACHE: dict = {}
_LISTS_CACHE_SIZE = 64


def block_lists(variant: Variant, shp: Shape, block_m: int, block_n: int, transposed: bool):
    """mask_mod's block lists for tiles of ``block_m`` queries x ``block_n`` keys (``block_map.cu``, on the
    GPU): ``(count, list)`` per query tile, or per key tile when ``transposed``, every tile listed holding a
    score visible by the sequence's lengths, the band (causal, window) and mask_mod. Reused from a cache when
    the mask reads no array and the sequences have no lengths of their own (then nothing but the shape and
    the tiling decides them), or kept in the cuflash.BlockMask the mask came in (``variant.block_lists``, whose
    contract is that its arrays and the lengths do not change); otherwise computed on every call, since arrays
    may change in place."""
    import cupy

    mods = variant.mods
    has_lengths = variant.is_varlen or variant.seqused_k is not None
    nb = shp.batch if (mods.mask_uses_b or has_lengths) else 1
    nh = shp.heads_q if mods.mask_uses_h else 1
    rows = cdiv(shp.max_k, block_n) if transposed else cdiv(shp.max_q, block_m)
    cols = cdiv(shp.max_q, block_m) if transposed else cdiv(shp.max_k, block_n)
    policy = mask_policy(variant)
    # What decides the lists besides the mask's arrays and the sequences' lengths.
    tiling = (cupy.cuda.runtime.getDevice(), policy, variant.window_left, variant.right, variant.bottom_right,
              shp.rows_q, shp.rows_k, nb, nh, block_m, block_n, transposed)
    key = store = None
    if variant.block_lists is not None:  # a cuflash.BlockMask's: kept for as long as the user keeps it
        store, key = variant.block_lists, tiling
    elif not has_lengths and not any(mods.uses(name, "mask_mod") for name in mods.array_names):
        # (per stream too: a later call on another stream must not read lists still being written)
        store, key = _LISTS_CACHE, (cupy.cuda.get_current_stream().ptr, *tiling)
    if key is not None:
        hit = store.get(key)
        if hit is not None:
            return hit
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
    spec = kernel_spec(spec_family, dtype, d)
    launch(spec, (cdiv(shp.rows_q, 4), shp.heads_q, shp.ws_batch), (
        do, out, delta, i32(shp.rows_q), i32(shp.heads_q), *strides(do), *strides(out)))
    return delta


def _kernel_ready(variant: Variant) -> Variant:
    """The variant with a bias the kernels can index (float32 with a contiguous last axis; others copied)."""
    import cupy

    bias = variant.bias
    if bias is None:
        return variant
    if bias.shape[2] * max(bias.shape[3], bias.strides[2] // bias.itemsize) >= 2**31:
        raise ValueError(f"bias of shape {tuple(bias.shape)}: the CUDA kernels index one (seqlen_q, seqlen_k) plane "
                         "with 32-bit offsets, so seqlen_q * seqlen_k must stay below 2**31")
    if bias.dtype == cupy.float32 and bias.strides[-1] == 4:
        return variant
    return dataclasses.replace(variant, bias=cupy.ascontiguousarray(bias, dtype=cupy.float32))


def backward(do, q, k, v, out, lse, *, scale, variant: Variant, algorithm, block_q, block_k, order, want_dbias=False):
    """``(dq, dk, dv)`` of one call, and ``dbias`` (float32, (batch, heads_q, seqlen_q, seqlen_k)) when
    ``want_dbias`` and the variant has a bias."""
    import cupy

    if want_dbias and variant.softcap and variant.bias is not None and variant.mods is not None \
            and variant.mods.has_score_mod:
        raise NotImplementedError(
            "the bias gradient with softcap, a bias and a score_mod together does not run on the GPU yet (the "
            "kernels keep one derivative per score); apply the softcap inside score_mod instead, e.g. "
            "score_mod='30.0f * tanhf(score / 30.0f) + ...'")
    kd = _needs_padding(q, v, algorithm)
    head_dims = (0, 0)  # [variant head dim] the arrays' (d, dv) when the kernels read them in place
    if kd and kd in BWD_HEAD_DIMS and _reads_in_place(q, v, algorithm):
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
    if algorithm == "fa1" and (dtype == "float32" or d in BWD_HEAD_DIMS):
        return fa1.backward(do, q, k, v, out, lse, scale=scale,
                            causal_offset=causal_offset_of(variant, shp.rows_q, shp.rows_k),
                            block_q=block_q, block_k=block_k)
    if algorithm == "naive":
        return naive.backward(do, q, k, v, scale=scale, causal_offset=causal_offset_of(variant, shp.rows_q, shp.rows_k))
    if dtype in CTYPES and d not in BWD_HEAD_DIMS:
        # No tensor-core backward at this head dim (dK and dV of 16 key rows would not fit in registers):
        # run the float32 kernels on upcast inputs, cast the gradients back.
        f32 = [a.astype(cupy.float32) for a in (do, q, k, v, out)]
        grads = backward(*f32, lse, scale=scale, variant=variant, algorithm=algorithm, block_q=None, block_k=None,
                         order=order, want_dbias=want_dbias)
        return (*(g.astype(q.dtype) for g in grads[:3]), *grads[3:])

    variant = _kernel_ready(variant)
    dbias = None
    if want_dbias and variant.bias is not None:  # [variant grad]: tiles no query visits stay 0
        dbias = cupy.zeros((shp.batch, shp.heads_q, shp.rows_q, shp.rows_k), dtype=cupy.float32)
    vtype, fscale = variant_type(variant, pads_head_dim=bool(kd)), np.float32(scale)
    def params(spec=None, transposed=False):  # one launch's VariantParams (and what it points to)
        return launch_params(variant, scale, shp, spec, dbias, transposed, head_dims)

    grads = _backward(do, q, k, v, out, lse, shp, d, variant, vtype, params, fscale, order, block_q, block_k, dtype)
    return grads if dbias is None else (*grads, dbias)


def _backward(do, q, k, v, out, lse, shp: Shape, d, variant, vtype, params, fscale, order, block_q, block_k, dtype):
    """The backward's launches at kernel head dim ``d`` (the arrays' own, or above them: [variant head dim])."""
    import cupy

    split = order in ("split", "q_outer")
    lse = cupy.ascontiguousarray(lse)
    if dtype == "float32":
        vp, _keep = params()  # (_keep: the device buffers vp points to, alive until the launches are queued)
        return _backward_f32(do, q, k, v, out, lse, shp, variant, vtype, vp, fscale, split)

    q, k, v, do = aligned(q), aligned(k), aligned(v), aligned(do)
    delta = _preprocess("bwd_pre", dtype, do.shape[-1], do, out, shp)  # (elementwise: at the arrays' own dims)
    dq, dk, dv = _grad_buffers(q, k, v, variant)
    t = _hopper_tile("bwd", d, block_q, block_k, SM90A_BACKWARD and d == q.shape[-1] == v.shape[-1])
    if t is not None:
        spec = kernel_spec("bwd_dkdv_sm90", dtype, d, t, vtype, not split)
    else:
        spec = kernel_spec("bwd_dkdv", dtype, d, plan_tile("bwd", d, block_q, block_k), vtype, not split)
    check_smem(spec)
    dq_accum = None if split else cupy.zeros((shp.ws_batch, shp.heads_q, shp.rows_q, d), dtype=cupy.float32)
    dkv_accum = None
    if shp.group > 1:
        alloc = cupy.zeros if variant.seqused_k is not None else cupy.empty
        dkv_accum = alloc((2, shp.ws_batch, shp.heads_q, shp.rows_k, d), dtype=cupy.float32)
    null = np.uintp(0)
    grid_k = (cdiv(shp.max_k, spec.tile.block_n), shp.heads_q, shp.batch)
    vp, _keep = params(spec, transposed=True)
    launch(spec, grid_k, (
        q, k, v, do, lse, delta,
        dq_accum if dq_accum is not None else null, dk, dv, dkv_accum if dkv_accum is not None else null,
        i32(shp.rows_q), i32(shp.rows_k), i32(shp.heads_q), i32(shp.group),
        *strides(q), *strides(k), *strides(v), *strides(do), *strides(dk), *strides(dv), fscale, vp))

    if split:
        spec_q = kernel_spec("bwd_dq", dtype, d, plan_tile("bwd_dq", d, None, None), vtype)
        check_smem(spec_q)
        vp, _keep_q = params(spec_q)
        launch(spec_q, (cdiv(shp.max_q, spec_q.tile.block_m), shp.heads_q, shp.batch), (
            q, k, v, do, lse, delta, dq, i32(shp.rows_q), i32(shp.rows_k), i32(shp.heads_q), i32(shp.group),
            *strides(q), *strides(k), *strides(v), *strides(do), *strides(dq), fscale, vp))
    else:
        convert_dq(dq_accum, dq, dtype, d, shp, fscale)
    if shp.group > 1:
        reduce_dkv(dkv_accum, dk, dv, dtype, d, shp)
    return dq, dk, dv


def convert_dq(dq_accum, dq, dtype: str, d: int, shp: Shape, fscale) -> None:
    """dQ = scale * dq_accum, cast, written with dq's strides (one batch of all rows when packed); the workspace
    is ``d`` columns wide, dq may have fewer ([variant head dim])."""
    launch(kernel_spec("bwd_convert_dq", dtype, d), (cdiv(shp.rows_q * d // 2, 256), shp.heads_q, shp.ws_batch),
           (dq_accum, dq, i32(shp.rows_q), i32(shp.heads_q), *strides(dq), fscale, i32(dq.shape[-1])))


def reduce_dkv(dkv_accum, dk, dv, dtype: str, d: int, shp: Shape) -> None:
    """GQA/MQA: dK, dV of each key/value head = the sum over its query heads, in a fixed order."""
    launch(kernel_spec("bwd_reduce_dkv", dtype, d), (cdiv(shp.rows_k * d // 2, 256), shp.heads_kv, shp.ws_batch), (
        dkv_accum, dk, dv, i32(shp.rows_k), i32(shp.group), np.int64(dkv_accum[0].size), *strides(dk), *strides(dv),
        i32(dk.shape[-1]), i32(dv.shape[-1])))


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
