"""KV-cache decoding on the GPU: rotary, the in-place append, split-KV attention and the merge (``decode.cu``),
planned as :func:`cuflash.reference.decode.forward_kvcache` does it step by step ([decode rotary], [decode
append], [decode split], [decode merge]; ``docs/decoding.md``).

Plan once, run every step. A :class:`DecodeLaunch` is everything about a call that its shapes, strides, dtype and
options decide, worked out once: the kernels (compiled, their function handles), the grids, the split count, the
float32 workspace of the splits' partial results, and the ``DecodeParams`` record with every planned field filled.
Its :meth:`DecodeLaunch.run` writes the step's array pointers into that record and launches the kernels straight
through the driver (``cuLaunchKernel`` with the record's address as the one argument): no allocation given ``out``
and ``lse``, no host synchronization, nothing else on the host, so a step can be captured in a CUDA graph. A step
is one launch: the split kernel merges its splits itself and, when the step appends, appends the new tokens too
([decode append] fused: it reads them from ``k``, ``v`` and writes them into their slots); two, the append kernel
first, where the fused append does not apply (``DecodeLaunch._can_fuse``, and a step's ``k``, ``v`` addresses). A step given the same array
objects as the step before finds their addresses in the record already and only launches.
:func:`forward_kvcache` (the backend interface of ``docs/architecture.md``) keeps the launches of recent calls,
keyed by everything they depend on, so the front door pays the planning once per batch shape too;
:func:`plan_kvcache` hands one to :class:`cuflash.DecodePlan`.

What runs: head dims 32, 64, 96, 128 and 256 with ``head_dim_v == head_dim``, and MLA's absorbed decoding (head dim
576, ``v_cache = k_cache[..., :512]``, on sm_90); float16 and bfloat16, contiguous or paged caches of any page size,
GQA packing, causal (bottom-right) masks, windows, softcap and ALiBi. Rotary embedding runs as CuPy array
operations (:func:`cuflash.reference.decode.apply_rotary`) before the kernels.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import weakref
from collections import OrderedDict
from typing import Callable

import numpy as np

from .._ops import chunked_prefill as _chunked_prefill
from .._ops.blocks import decode_block_sizes
from .._ops.kvcache import KVCache
from .._ops.variant import Variant
from ..reference.decode import apply_rotary
from .compile import check_smem, device_info, kernel, launch, launch_kernel_ex
from . import spec as _spec
from .spec import CTYPES, DECODE_HEAD_DIMS, DECODE_MLA_DIMS, decode_family
from .spec import spec as kernel_spec
from . import tensor_map
from .tensor_map import TensorMap

__all__ = ["forward_kvcache", "plan_kvcache", "merge_partials", "DecodeLaunch", "ChunkedPrefillLaunch", "CupyRuntime",
           "DECODE_PARAMS_DTYPE", "ROTARY_PARAMS_DTYPE", "check_decode_supported"]

_LOG2E = 1.4426950408889634

# The arrays of one step: the pointer fields of DecodeParams that DecodeLaunch.run rewrites, in the order of its
# arguments' identity check.
_STEP_POINTERS = ("q", "k_cache", "v_cache", "k_new", "v_new", "out", "lse", "cache_seqlens", "cache_leftpad",
                  "cache_batch_idx", "block_table", "alibi_slopes")
# The pointer fields in struct order (the workspace's, planned, among them).
_POINTERS = ("q", "k_cache", "v_cache", "k_new", "v_new", "out", "lse", "o_part", "lse_part", "split_count",
             "seqused_k", "cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table", "alibi_slopes")

# Layout of `struct DecodeParams` (decode.cu), passed by value to every decode kernel.
DECODE_PARAMS_DTYPE = np.dtype(
    [*((name, np.uint64) for name in _POINTERS), ("alibi_sb", np.int64),
     *((name, np.int64) for name in ("q_sb", "q_ss", "q_sh", "k_sb", "k_ss", "k_sh", "v_sb", "v_ss", "v_sh",
                                      "kn_sb", "kn_ss", "kn_sh", "vn_sb", "vn_ss", "vn_sh", "o_sb", "o_ss", "o_sh",
                                      "bt_sb")),
     *((name, np.int32) for name in ("capacity", "cache_rows", "batch", "seqlen_q", "seqlen_new", "heads_q", "heads_kv", "group", "head_dim",
                                      "head_dim_v", "page_size", "num_splits", "row_tiles", "has_left", "window_left",
                                      "has_right", "window_right")),
     *((name, np.float32) for name in ("scale_log2", "softcap_a", "softcap_b", "inv_scale")), ("page_shift", np.int32),
     ("fuse_new", np.int32)],
    align=True,
)
assert DECODE_PARAMS_DTYPE.itemsize == 384
_FUSE_WORD = DECODE_PARAMS_DTYPE.fields["fuse_new"][1] // 4  # its index among the record's 32-bit words
# Layout of `struct RotaryParams` (decode.cu: decode_rotary_kernel's, [decode rotary]).
ROTARY_PARAMS_DTYPE = np.dtype(
    [*((name, np.uint64) for name in ("q", "k_new", "cos", "sin", "cache_seqlens", "q_rot", "k_rot", "seqlens_out")),
     *((name, np.int64) for name in ("q_sb", "q_ss", "q_sh", "kn_sb", "kn_ss", "kn_sh", "cos_s0", "cos_s1", "sin_s0",
                                      "sin_s1")),
     *((name, np.int32) for name in ("seqlen_q", "seqlen_new", "heads_q", "heads_kv", "head_dim", "half", "seqlen_ro",
                                      "interleaved", "consecutive_q", "pad_"))],
    align=True,
)
assert ROTARY_PARAMS_DTYPE.itemsize == 184
# Each step pointer's byte offset in the record, in _STEP_POINTERS order, and its index among the record's 64-bit words.
_STEP_OFFSETS = tuple(DECODE_PARAMS_DTYPE.fields[name][1] for name in _STEP_POINTERS)
_WORD_INDEX = tuple(off // 8 for off in _STEP_OFFSETS)

# [decode append] fused into the split kernel (one launch a step) where it applies; False: the append kernel first
# at every step (two launches), for comparison. Read when a DecodeLaunch is planned (the front door keeps its
# launches: clear _LAUNCHES after changing it).
FUSE_APPEND = True
# [decode rotary] in one kernel (decode_rotary_kernel) into copies the launch owns, where the tables are float32 or of
# q's dtype: a rotary step then allocates nothing and can be captured in a CUDA graph. False (CUFLASH_ROTARY_KERNEL=0)
# or other tables: CuPy array operations (_rotated), new copies at every step. Read when a launch is planned.
ROTARY_KERNEL = os.environ.get("CUFLASH_ROTARY_KERNEL", "1") != "0"

# The front door's launches: (everything a launch depends on) -> DecodeLaunch, least recently used first. A
# launch holds its workspace (a few MB at most: splits are chosen only for grids that do not fill the GPU).
_LAUNCHES: OrderedDict = OrderedDict()
MAX_CACHED_LAUNCHES = 64
_lock = threading.Lock()


def _none():  # the "weak reference" of an argument that was None
    return None


def _el(a, axis: int) -> int:
    return a.strides[axis] // a.itemsize


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _kv_shared(k_cache, v_cache) -> bool:
    """Whether v_cache is the leading columns of k_cache (MLA's ``v_cache = k_cache[..., :dv]``): same address and
    strides, so that the kernels read V from the K tiles."""
    return (v_cache.data.ptr == k_cache.data.ptr and v_cache.strides == k_cache.strides
            and v_cache.shape[:3] == k_cache.shape[:3])


def _rows_of_16(a) -> bool:
    """Whether ``a`` (None: nothing to read) has a contiguous last axis and other strides of multiples of 16
    bytes: rows that a kernel copies in 16-byte chunks, given a base address of a multiple of 16 bytes."""
    return a is None or a.size == 0 or (a.strides[-1] == a.itemsize and not any(s % 16 for s in a.strides[:-1]))


def check_decode_supported(q, k_cache, v_cache) -> None:
    """What the decode kernels run; anything else raises NotImplementedError naming it (before the caches are
    touched)."""
    cc, smem_optin = device_info()
    if cc < 80:
        raise NotImplementedError("decoding on the GPU needs compute capability 8.0 or newer (cp.async, mma.sync)")
    d, dv = q.shape[-1], v_cache.shape[-1]
    if (d, dv) == DECODE_MLA_DIMS:
        if not _kv_shared(k_cache, v_cache):
            raise NotImplementedError(f"MLA decoding on the GPU (head dims {d} and {dv}) reads V from the K cache: "
                                      f"pass v_cache = k_cache[..., :{dv}] (a view); got a v_cache of its own")
        if k_cache.shape[2] != 1:
            raise NotImplementedError(f"MLA decoding on the GPU runs one latent key/value head; got {k_cache.shape[2]}")
    elif dv != d:
        raise NotImplementedError(f"decoding on the GPU runs head_dim_v == head_dim, or MLA's {DECODE_MLA_DIMS}; "
                                  f"got {d} and {dv}")
    elif d not in DECODE_HEAD_DIMS:
        raise NotImplementedError(f"decoding on the GPU runs head dims {DECODE_HEAD_DIMS} (and MLA's "
                                  f"{DECODE_MLA_DIMS}); got {d}")
    if np.dtype(q.dtype).name not in CTYPES:
        raise NotImplementedError(f"decoding on the GPU runs float16 and bfloat16; got {np.dtype(q.dtype).name}")
    family, tile, _ = decode_family(d, dv, cc)
    need = kernel_spec(family, "bfloat16", d, tile, "false").smem
    if need > smem_optin:
        raise NotImplementedError(f"decoding at head dims {d} / {dv} needs {need} bytes of shared memory per block; "
                                  f"this GPU allows {smem_optin}")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.size == 0:  # nothing is read from an empty array (its strides may be anything, even 0)
            continue
        if a.data.ptr % 16 or any(s % 16 for s in a.strides[:-1]) or a.strides[-1] != a.itemsize:
            raise NotImplementedError(f"{name}: the decode kernel reads 16-byte rows; its base and strides must be "
                                      f"multiples of 16 bytes (got strides {a.strides})")


def decode_record(q, k_cache, v_cache, k, v, *, out, cache: KVCache, scale: float, variant: Variant, rotary: bool,
                  num_splits: int = 1, row_tiles: int = 0) -> np.ndarray:
    """A ``DecodeParams`` record (one element of :data:`DECODE_PARAMS_DTYPE`) with every field that a call's shapes,
    strides and options decide; the pointers 0 (a step writes its arrays', a plan its workspace's). ``out``: the
    output array a step writes into, or None for a C-contiguous one. Arrays that the rotary step replaces by rotated
    copies (q, k) are read at the copies' (contiguous) strides."""
    batch, seqlen_q, heads_q, d = q.shape
    heads_kv, dv = k_cache.shape[2], v_cache.shape[3]
    rec = np.zeros(1, DECODE_PARAMS_DTYPE)
    r = rec[0]  # a structured scalar: a view of the record
    planned = {"q": q, "k": k_cache, "v": v_cache, "kn": k, "vn": v}
    for prefix, a in planned.items():
        if a is None:
            continue
        strides = _contiguous_strides(a.shape) if rotary and prefix in ("q", "kn") else \
            tuple(s // a.itemsize for s in a.strides)
        r[f"{prefix}_sb"], r[f"{prefix}_ss"], r[f"{prefix}_sh"] = strides[:3]
    r["o_sb"], r["o_ss"], r["o_sh"] = (_contiguous_strides((batch, seqlen_q, heads_q, dv)) if out is None else
                                       tuple(s // out.itemsize for s in out.strides))[:3]
    slopes = variant.alibi_slopes
    r["alibi_sb"] = 0 if slopes is None or slopes.ndim == 1 else _el(slopes, 0)
    r["bt_sb"] = 0 if cache.block_table is None else _el(cache.block_table, 0)
    # [decode guard] the bounds the kernels check the device's index values against
    r["capacity"], r["cache_rows"] = cache.capacity, k_cache.shape[0]
    r["batch"], r["seqlen_q"], r["seqlen_new"], r["heads_q"] = batch, seqlen_q, cache.seqlen_new, heads_q
    r["heads_kv"], r["group"], r["head_dim"], r["head_dim_v"] = heads_kv, heads_q // max(heads_kv, 1), d, dv
    r["page_size"], r["num_splits"], r["row_tiles"] = cache.page_size or 1, num_splits, row_tiles
    page = cache.page_size or 1
    r["page_shift"] = page.bit_length() - 1 if page & (page - 1) == 0 else -1  # [decode page]
    # A band edge past every key is no edge: clamped so that t + offset +- window stays inside int32.
    reach = cache.capacity + seqlen_q
    left = None if variant.window_left is None else min(variant.window_left, reach)
    right = None if variant.right is None else min(variant.right, reach)
    r["has_left"], r["window_left"] = left is not None, left or 0
    r["has_right"], r["window_right"] = right is not None, right or 0
    r["scale_log2"], r["inv_scale"] = scale * _LOG2E, 1.0 / scale
    if variant.softcap:
        r["softcap_a"], r["softcap_b"] = scale / variant.softcap, variant.softcap / scale
    return rec


def record_argv(rec: np.ndarray, *more: int) -> tuple[np.ndarray, int]:
    """``(argv, its address)``: cuLaunchKernel's argument array for a kernel whose first argument is the record
    ``rec`` (``void* args[] = {&record, ...}``; ``more``: the addresses of further arguments, e.g. a TensorMap's),
    kept with the record by its launch. (A kernel of fewer arguments reads only its own.)"""
    argv = np.array([rec.ctypes.data, *more], dtype=np.uint64)
    return argv, int(argv.ctypes.data)


def _tma_tiles(cache: KVCache, k_cache, paged: bool) -> bool:
    """Whether the MLA kernel may copy its key tiles with TMA: every 64-key tile whole in one page (pages of a
    multiple of 64 slots) or in the contiguous cache's row, from slot 0 (no left padding), none of it appended in
    the same launch (the new rows come from k_new); and a driver that encodes tensor maps."""
    return (_spec.TMA_DECODE and not cache.seqlen_new and cache.cache_leftpad is None
            and (not paged or k_cache.shape[1] % 64 == 0) and tensor_map.available())


def _tensor_map(k_cache, tma: bool) -> TensorMap:
    """The MLA kernel's second argument: the map of the latent cache (576 columns x slots x pages or rows; 64 x 64
    boxes), or an unused one."""
    if not tma:
        return TensorMap(None)
    n, slots, _, d = k_cache.shape
    return TensorMap((d, slots, n), (k_cache.strides[1], k_cache.strides[0]), (64, 64, 1))


# The memory pool of own_memory (a cupy.cuda.MemoryPool of cuflash's own, made at its first use).
_OWN_POOL = None


def own_memory(shape, dtype, device: int | None = None):
    """An array of ``shape`` in device memory of cuflash's own (on ``device``, else the current one): from a memory
    pool that is neither CuPy's default pool nor any allocator set around the call (cuflash.torch's: torch's caching
    allocator, whose CUDA graph trees refuse a warm-up run that leaves a buffer alive in the graph's pool that is not
    an output). The pool grows by cudaMalloc; a buffer freed with its array goes back to it, without the device
    synchronization a cudaFree makes (a launch the front door forgets frees its buffers at some later call)."""
    global _OWN_POOL
    import cupy

    if device is not None:
        with cupy.cuda.Device(device):
            return own_memory(shape, dtype)
    if _OWN_POOL is None:
        _OWN_POOL = cupy.cuda.MemoryPool()
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(1, math.prod(shape)) * np.dtype(dtype).itemsize
    return cupy.ndarray(shape, dtype=dtype, memptr=_OWN_POOL.malloc(nbytes))


class CupyRuntime:
    """What a :class:`DecodeLaunch` takes from CuPy, bound once (an attribute lookup through CuPy's modules costs
    as much as a pointer write): allocation, the current device and stream, the compiled kernels and
    ``cuLaunchKernel``. ``bench-decode`` gives a launch a stand-in with the same attributes to time the host path
    of a step without a GPU (or without the driver's share)."""

    def __init__(self):
        import cupy

        # (empty: the ndarray constructor itself, which cupy.empty calls from Python: 0.4 us less a call, H200)
        self.empty, self.zeros, self.float32 = cupy.ndarray, cupy.zeros, cupy.float32
        self.current_stream = cupy.cuda.get_current_stream
        self.get_device = cupy.cuda.runtime.getDevice
        self.launch = cupy.cuda.driver.launchKernel
        self._mem_get_info = cupy.cuda.runtime.memGetInfo

    def check_supported(self, q, k_cache, v_cache) -> None:
        check_decode_supported(q, k_cache, v_cache)

    def compute_capability(self) -> int:
        """The current device's, as an int (90: H100 / H200): which MLA kernel runs (spec.decode_family)."""
        return device_info()[0]

    def function(self, spec):
        """(function handle, the object that keeps its module loaded) of ``spec`` on the current device."""
        check_smem(spec)
        fn = kernel(spec).kernel  # the cupy.cuda.Function of the current device
        return fn.ptr, fn

    def make_context_current(self) -> None:
        """cuLaunchKernel, unlike CuPy's own launches, does not establish the device's context on a thread: a
        runtime call that needs it does."""
        self._mem_get_info()

    @staticmethod
    def raw_zeros(count: int, dtype):
        """A zeroed array of ``count`` elements in device memory of its own (:func:`own_memory`): for what is kept
        for the process's life (the tile counters' chunks). Never called under a capture (cudaMalloc is not allowed
        there)."""
        array = own_memory((count,), dtype)
        array.fill(0)
        return array

    def kept(self, shape, dtype, zero: bool = False):
        """An array a launch keeps from call to call (split workspace, rotated copies, lse sinks; zeroed with
        ``zero``): device memory of cuflash's own (:func:`own_memory`, back to its pool with the array), so that under
        torch's CUDA graph trees a warm-up run leaves nothing alive in the graph's pool; under a capture, where
        cudaMalloc is not allowed, the call's allocator's (a graph's pool keeps it for the graph)."""
        if self.capturing():
            return (self.zeros if zero else self.empty)(shape, dtype=dtype)
        array = own_memory(shape, dtype)
        if zero:
            array.fill(0)
        return array

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (a stream that cannot tell: as if it were)."""
        try:
            return bool(self.current_stream().is_capturing())
        except Exception:
            return True

    def synchronize(self) -> None:
        """Wait for the current stream."""
        self.current_stream().synchronize()

    def prepare_programmatic(self) -> None:
        """[pdl] Bind the driver's ``cuLaunchKernelEx`` (raises where the driver has none)."""
        launch_kernel_ex()

    def launch_programmatic(self, config: int, function: int, argv: int) -> None:
        """[pdl] ``cuLaunchKernelEx`` of a CUlaunchConfig at host address ``config`` (:func:`.compile.programmatic_config`);
        raises RuntimeError where the driver refuses it."""
        launch_kernel_ex()(config, function, argv)


class DecodeLaunch:
    """The launches of one decode call's shapes, strides, dtype and options, planned once.

    Built from example arrays (the first step's) and the normalized options; :meth:`run` then takes any arrays of
    the same shapes and strides. What it holds: the compiled kernels of the steps the call needs (the split kernel,
    merging its own splits and appending the new tokens, unless q is empty; the [decode append] kernel for the
    steps where the fused append does not apply, ``fuse_append=False`` or :data:`FUSE_APPEND` off among them),
    their grids, the float32
    workspace of the splits' partials with their per-block counters, and the DecodeParams record with every
    field that the shapes and options decide. One launch's workspace serves one step at a time: run it on one
    stream (or order the streams), as the front door does by keeping one launch per stream.

    :meth:`expect` (:class:`cuflash.DecodePlan`) gives the layouts every step must have: a step compares those of
    its arrays that are not the very objects of the step before (and ``validate``, the plan's full check, names a
    mismatch); without it the caller guarantees them (the front door). ``runtime``: :class:`CupyRuntime` or a
    stand-in.
    """

    def __init__(self, q, k_cache, v_cache, k, v, *, cache: KVCache, scale: float, variant: Variant, out=None,
                 runtime=None, fuse_append: bool | None = None, splits_for: Callable[[int], int] | None = None):
        rt = runtime if runtime is not None else CupyRuntime()
        rt.check_supported(q, k_cache, v_cache)
        self.device = rt.get_device()
        batch, seqlen_q, heads_q, d = q.shape
        heads_kv, dv = k_cache.shape[2], v_cache.shape[3]
        group = heads_q // heads_kv
        dtype = np.dtype(q.dtype).name
        paged = cache.block_table is not None
        self.dtype = q.dtype
        self.out_shape = (batch, seqlen_q, heads_q, dv)
        self.lse_shape = (batch, heads_q, seqlen_q)
        self._lse_sink = None  # (lse_sink: made at its first use)
        self.rotary = None if cache.rotary is None else (cache.rotary.interleaved, cache.rotary.consecutive_q)
        self.num_splits = 1
        self.o_part = self.lse_part = self.split_count = None
        self.validate = None
        self._layouts = None  # per record slot, what expect() was given (None: the caller guarantees the layouts)

        # The kernels first (NVRTC, shared memory): nothing that can fail may come after a step's append.
        steps, keep = [], []
        self._map = None  # the MLA kernel's TensorMap of the latent cache (pointed again when the cache moves)

        def step(spec, grid):
            fn, obj = rt.function(spec)
            keep.append(obj)
            steps.append((fn, *grid, spec.threads, spec.smem))

        appends = bool(cache.seqlen_new and batch)
        if appends:
            step(kernel_spec("decode_append", dtype, 0, variant="true" if paged else "false"),
                 (batch * cache.seqlen_new, 1, 1))
        row_tiles = tile_n = 0
        if batch and seqlen_q and heads_q:
            family, tile, _ = decode_family(d, dv, rt.compute_capability() if (d, dv) == DECODE_MLA_DIMS else 0)
            tma = family == "decode_mla_sm90" and _tma_tiles(cache, k_cache, paged)
            if family == "decode_mla_sm90":  # (the kernel takes the map as its second argument, used or not)
                self._map = _tensor_map(k_cache, tma)
            spec = kernel_spec(family, dtype, d, tile, ("true" if paged else "false") + (", true" if tma else ""))
            # (flash_decode_kernel takes its ring's stage count from the tile; the wide and MLA kernels have two)
            assert spec.tile.block_m % 16 == 0 and (family == "decode" or spec.tile.stages == 2), "decode.cu's tiles"
            # Splits past the number of key tiles would be empty: at most one per tile (and grid y's 65535).
            self.num_splits = max(1, min(int(cache.num_splits), -(-cache.capacity // spec.tile.block_n), 65535))
            row_tiles, tile_n = -(-(seqlen_q * group) // spec.tile.block_m), spec.tile.block_n
            step(spec, (heads_kv * row_tiles, self.num_splits, batch))
            # [decode merge] in the split kernel (partials, and a counter per block column), but for MLA: its rows
            # of 512 floats from many splits are merged by decode_merge_kernel, a launch of many blocks, not by the
            # last split's block alone (no counters: the split kernel leaves the merge to it)
            merge_apart = self.num_splits > 1 and (d, dv) == DECODE_MLA_DIMS
            if self.num_splits > 1:
                self.o_part = rt.kept((self.num_splits, batch, heads_q, seqlen_q, dv), np.float32)
                self.lse_part = rt.kept((self.num_splits, batch, heads_q, seqlen_q), np.float32)
            if (self.num_splits > 1 and not merge_apart) or splits_for is not None:  # (growing: may split later)
                self.split_count = rt.kept((batch, heads_kv * row_tiles), np.int32, zero=True)
            if merge_apart:
                step(kernel_spec("decode_merge", dtype, dv), (-(-(batch * heads_q * seqlen_q) // 4), 1, 1))
        self._kernels = tuple(keep)
        # [decode rotary] its kernel and copies (None: CuPy array operations at each step)
        self._rotary_step = _RotaryStep.make(rt, q, k, cache) if steps else None
        self._reads_rows = row_tiles > 0  # the split kernel runs: it reads q and the caches in 16-byte chunks
        self._shared_kv = (d, dv) == DECODE_MLA_DIMS  # the MLA kernel reads V from the K tiles
        # [decode append] fused into the split kernel (one launch a step; decode.cu: append_head, NewRows) where
        # it reads the new rows in 16-byte chunks: k and v of such layouts (rotary's copies of k are contiguous),
        # and caches that are not one array (but MLA's view, whose V the kernel takes from K). Else, or at a step
        # whose k or v address is not a multiple of 16 bytes, the append kernel first (two launches).
        self._two_launches = tuple(steps)
        fuse_append = FUSE_APPEND if fuse_append is None else fuse_append
        self._can_fuse = bool(fuse_append and appends and row_tiles and _rows_of_16(v)
                              and (self.rotary is not None or _rows_of_16(k))
                              and (self._shared_kv or not _kv_shared(k_cache, v_cache)))
        self._fused = self._two_launches[1:] if self._can_fuse else self._two_launches
        self._steps = self._fused

        # The record: every field but the step's pointers.
        rec = self._record = decode_record(q, k_cache, v_cache, k, v, out=out, cache=cache, scale=scale,
                                           variant=variant, rotary=self.rotary is not None,
                                           num_splits=self.num_splits, row_tiles=row_tiles)
        self.out_strides = None if out is None else tuple(out.strides)
        self._argv, self._argv_ptr = record_argv(rec, *(() if self._map is None else (self._map.address,)))
        self._lock = threading.Lock()  # one step at a time writes the record and launches from it
        r = rec[0]  # a structured scalar: a view of the record
        if self.o_part is not None:
            r["o_part"], r["lse_part"] = self.o_part.data.ptr, self.lse_part.data.ptr
        if self.split_count is not None:
            r["split_count"] = self.split_count.data.ptr
        r["fuse_new"] = int(self._can_fuse)
        # The step's pointers as 64-bit words of the record (a memoryview: the cheapest item assignment there is).
        self._words = memoryview(rec.view(np.uint8)).cast("Q")
        self._ints = memoryview(rec.view(np.uint8)).cast("i")  # (fuse_new: _select; a growing launch's _fit)
        self._longs = memoryview(rec.view(np.uint8)).cast("q")  # (a growing launch's _fit: the caches' strides)
        self._word_index = _WORD_INDEX
        # Weak references to the last step's arrays (_none for None): a step with the same objects finds their
        # addresses in the record already. Weak: a launch kept by the front door must not keep a cache alive. (A
        # dead reference reads as None: a None argument is the same only where the reference is _none.)
        self._last = _FORGOTTEN

        # What run calls, bound once.
        self._empty, self._kept, self._float32 = rt.empty, rt.kept, rt.float32
        self._current_stream = rt.current_stream
        self._get_device = rt.get_device
        self._launch = rt.launch
        self._runtime = rt
        self._threads: set = set()  # threads that have made this device's context current

        # A growing launch (splits_for, the front door's for calls over a cache that grows from call to call, as a
        # transformers DynamicCache, which concatenates each new token into a new tensor): a step over caches of
        # another slot count or other strides than the last writes what they decide (_fit) before it launches.
        self._splits_for = splits_for
        self._fit_key = (cache.capacity, k_cache.strides, v_cache.strides)
        if splits_for is not None:
            assert not (appends or paged or self.rotary or self._shared_kv) and self._steps == self._two_launches
            self._tile_n, self._window, self._seqlen_q = tile_n, (variant.window_left, variant.right), seqlen_q
            self._split_step = self._steps[-1] if self._steps else None
            self._fit_words = None  # (_fit_layout's record words, found at its first call)
            # the kernel's key tiles -> split count (splits_for's, clamped): one count per tile count, since the
            # rule counts tiles of a multiple of the kernel's (every slot count of one kernel tile count has one of
            # the rule's)
            self._split_counts: dict = {}
            assert not tile_n or decode_block_sizes(d, dv)[1] % tile_n == 0, (d, dv, tile_n)

    def _select(self, fused: bool) -> None:
        """[decode append] fused or not (the step's k and v at multiples of 16 bytes: the fused kernel copies their
        rows in 16-byte chunks): the launches and the record's fuse_new. Called with the lock held, before the
        launches."""
        self._steps = self._fused if fused else self._two_launches
        self._ints[_FUSE_WORD] = int(fused)

    def _fit(self, k_cache, v_cache) -> None:
        """A growing launch's parameters for caches of this slot count and these strides, written when they changed
        (called with the lock held, before the launch): the caches' strides, the capacity ([decode guard]), the
        window's edges clamped to it, the split count (``splits_for``'s, at most one per key tile) with the split
        kernel's grid, and a larger workspace for the partials when the count outgrows it. The front door checked
        the rest (``cuflash._ops.api._fits``); everything else the launch holds is the same for every slot count."""
        self._fit_layout(k_cache.shape[1], k_cache.strides, v_cache.strides, k_cache.itemsize)

    def _fit_layout(self, slots: int, k_strides: tuple, v_strides: tuple, itemsize: int) -> None:
        """:meth:`_fit` for caches of ``slots`` slots and these byte strides. (A transformers cache changes both at
        every step: the words written are found once per launch, and the split count once per key-tile count.)"""
        fit = (slots, k_strides, v_strides)
        if fit == self._fit_key:
            return
        longs, ints = self._longs, self._ints
        if self._fit_words is None:
            fields = DECODE_PARAMS_DTYPE.fields
            self._fit_words = (
                tuple(fields[f"{prefix}_{name}"][1] // 8 for prefix in "kv" for name in ("sb", "ss", "sh")),
                fields["capacity"][1] // 4,
                tuple((fields[name][1] // 4, edge) for name, edge in zip(("window_left", "window_right"), self._window)
                      if edge is not None))
        strides_at, capacity_at, edges = self._fit_words
        for at, stride in zip(strides_at, (*k_strides[:3], *v_strides[:3])):
            longs[at] = stride // itemsize
        ints[capacity_at] = slots
        reach = slots + self._seqlen_q  # (as when planning: a band edge past every key is no edge)
        for at, edge in edges:
            ints[at] = min(edge, reach)
        if self._split_step is not None:
            tiles = -(-slots // self._tile_n)
            splits = self._split_counts.get(tiles)
            if splits is None:
                splits = self._split_counts[tiles] = max(1, min(int(self._splits_for(slots)), tiles, 65535))
            if splits != self.num_splits:
                self._set_splits(splits)
        self._fit_key = fit

    def _set_splits(self, splits: int) -> None:
        """A growing launch's split count (its grid, the record's count, a larger workspace for the partials when
        the count outgrows it)."""
        words, fields = self._words, DECODE_PARAMS_DTYPE.fields
        if splits > 1 and (self.o_part is None or self.o_part.shape[0] < splits):
            batch, seqlen_q, heads_q, dv = self.out_shape
            self.o_part = self._kept((splits, batch, heads_q, seqlen_q, dv), np.float32)
            self.lse_part = self._kept((splits, batch, heads_q, seqlen_q), np.float32)
            words[fields["o_part"][1] // 8] = self.o_part.data.ptr
            words[fields["lse_part"][1] // 8] = self.lse_part.data.ptr
        fn, gx, _, gz, threads, smem = self._split_step
        self._split_step = (fn, gx, splits, gz, threads, smem)
        self._steps = self._fused = self._two_launches = (self._split_step,)
        self._ints[fields["num_splits"][1] // 4] = self.num_splits = splits

    @property
    def grows(self) -> bool:
        """Whether this launch follows its caches' slot count and strides from step to step (``splits_for``)."""
        return self._splits_for is not None

    @property
    def launches_per_step(self) -> int:
        """Kernel launches of a step as the last one was planned or run: 1 with the append fused into the split
        kernel (or nothing to append), 2 with the append kernel first, 0 for an empty call; one more for MLA's
        merge of several splits, and one more for the rotary kernel ([decode rotary])."""
        return len(self._steps) + (self._rotary_step is not None and bool(self._steps))

    def expect(self, layouts: tuple, out_layout, lse_layout, validate) -> None:
        """Every step's arrays must have these layouts (``(type, shape, strides, dtype)`` or None for an array not
        given, as :mod:`cuflash._ops.decode_plan` spells them): ``layouts`` in the order of :meth:`run`'s arguments from
        ``q`` to ``alibi_slopes``, then ``out``'s and ``lse``'s. A step compares only the arrays that are not the
        objects of the step before with them (an ``out`` or ``lse`` it allocates too), and calls ``validate``
        (:class:`cuflash.DecodePlan`'s check, which names the array and both layouts) with all its arguments when
        one differs, and at every rotary step."""
        self._layouts = (*layouts[:5], out_layout, lse_layout, *layouts[5:10])
        self.validate = validate

    def _ensure_context(self) -> None:
        """The plan's device current, with its context."""
        dev = self._get_device()
        if dev != self.device:
            raise ValueError(f"this decode plan was made on cuda:{self.device}; the current device is cuda:{dev} "
                             f"(use `with cupy.cuda.Device({self.device}):`)")
        self._runtime.make_context_current()
        self._threads.add(threading.get_ident())

    @property
    def lse_sink(self):
        """A float32 array of :attr:`lse_shape` the launch keeps for steps whose lse nobody reads (the front door's
        calls without ``return_lse``): no allocation at those steps, and the same object at every one."""
        sink = self._lse_sink
        if sink is None:
            sink = self._lse_sink = self._kept(self.lse_shape, np.float32)
        return sink

    def run(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad=None, cache_batch_idx=None,
            block_table=None, alibi_slopes=None, rotary_cos=None, rotary_sin=None, out=None, lse=None):
        """One step: ``(out, lse)``, appending ``k``, ``v`` first. The arrays must have the planned shapes, strides
        and dtype and lie on the plan's device (compared here after :meth:`expect`, else the caller's guarantee:
        the front door's). ``out`` and ``lse`` are allocated when not given; with both given the step allocates
        nothing (rotary too, where its kernel runs: :class:`_RotaryStep`) and does no host synchronization: the work
        is the launches, enqueued on the current stream."""
        if self._get_device() != self.device or threading.get_ident() not in self._threads:
            self._ensure_context()
        last = self._last
        # The hot path of a decode loop: the very arrays of the last step, so the record holds their addresses.
        # (A CuPy array's memory, strides and dtype never change; its shape only by an in-place reshape of the
        # same memory, `a.shape = ...`, which reads the same bytes.)
        # (An argument that may be None is the same as the last step's only where that one was None too, not where
        # the last one's reference died.)
        if (last[0]() is not q or last[1]() is not k_cache or last[2]() is not v_cache
                or (last[3] is not _none if k is None else last[3]() is not k)
                or (last[4] is not _none if v is None else last[4]() is not v)
                or (last[5] is not _none if out is None else last[5]() is not out)
                or (last[6] is not _none if lse is None else last[6]() is not lse)
                or last[7]() is not cache_seqlens
                or (last[8] is not _none if cache_leftpad is None else last[8]() is not cache_leftpad)
                or (last[9] is not _none if cache_batch_idx is None else last[9]() is not cache_batch_idx)
                or (last[10] is not _none if block_table is None else last[10]() is not block_table)
                or (last[11] is not _none if alibi_slopes is None else last[11]() is not alibi_slopes)
                or (self._splits_for is not None
                    and self._fit_key != (k_cache.shape[1], k_cache.strides, v_cache.strides))):
            # (with rotary, never: q and k are new rotated copies)
            if self.rotary is not None or rotary_cos is not None or rotary_sin is not None:
                return self._new_arrays(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx,
                                        block_table, alibi_slopes, rotary_cos, rotary_sin, out, lse)
            # A model's decode loop (new q, k, v objects: its projections; the same caches and lengths), or the
            # front door's call (a new lse): the arrays that changed
            given = out, lse
            if out is None:
                out = self._empty(self.out_shape, dtype=self.dtype)
            if lse is None:
                lse = self._empty(self.lse_shape, dtype=self._float32)
            return self._changed_arrays(last, (q, k_cache, v_cache, k, v, out, lse, cache_seqlens, cache_leftpad,
                                               cache_batch_idx, block_table, alibi_slopes), given)
        stream, launch, argv = self._current_stream().ptr, self._launch, self._argv_ptr
        with self._lock:
            if self._last is last and (self._splits_for is None or self._fit_key == (
                    k_cache.shape[1], k_cache.strides, v_cache.strides)):  # (not rewritten by another thread meanwhile)
                for fn, gx, gy, gz, threads, smem in self._steps:
                    launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
                return out, lse
        return self._new_arrays(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx,
                                block_table, alibi_slopes, rotary_cos, rotary_sin, out, lse)

    def run_addresses(self, ptrs: tuple, slots: int, k_strides: tuple, v_strides: tuple, itemsize: int,
                      stream: int) -> None:
        """One step of a launch without rotary from addresses alone (``cuflash.torch``'s direct path): ``ptrs`` the
        step's 12 addresses in record slot order (``_STEP_POINTERS``, 0 for an array not given; out and lse given),
        ``slots`` and the byte strides of the caches (a growing launch follows them), launched on ``stream``. The
        caller guarantees the layouts this launch was planned for (its key of the call); the addresses of q and the
        caches are checked as :meth:`run` checks them."""
        if self._get_device() != self.device or threading.get_ident() not in self._threads:
            self._ensure_context()
        if (self._reads_rows and (ptrs[0] | ptrs[1] | ptrs[2]) & 15) or self._shared_kv:
            self._check_addresses({0: ptrs[0], 1: ptrs[1], 2: ptrs[2]})
        launch, argv, words = self._launch, self._argv_ptr, self._words
        with self._lock:
            if self._splits_for is not None:
                self._fit_layout(slots, k_strides, v_strides, itemsize)
            if self._map is not None:  # (no direct MLA step today; kept right should one come)
                self._map.point(ptrs[1])
            for word, ptr in zip(self._word_index, ptrs):
                words[word] = ptr
            for fn, gx, gy, gz, threads, smem in self._steps:
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
            self._last = _FORGOTTEN

    def _changed_arrays(self, last, arrays, given):
        """A step without rotary some of whose arrays (``arrays``, in record slot order, ``out`` and ``lse``
        allocated where ``given`` has None) are not the last step's objects: only those are compared with the
        expected layouts, checked for alignment and written into the record. Where one differs from its layout,
        the full check (``validate``) runs on the arguments as given, and raises."""
        stale = [i for i, ref, a in zip(_SLOTS, last, arrays) if (ref is not _none if a is None else ref() is not a)]
        layouts, index = self._layouts, self._word_index
        refs, writes = list(last), []
        for i in stale:
            a = arrays[i]
            if a is None:
                if layouts is not None and layouts[i] is not None:
                    return self._new_arrays(*_run_order(arrays, given))  # validate names it, raising
                refs[i] = _none
                writes.append((index[i], 0))
                continue
            if layouts is not None and (type(a), a.shape, a.strides, a.dtype) != layouts[i]:
                return self._new_arrays(*_run_order(arrays, given))  # validate names it, raising
            ptr = a.data.ptr
            if i < 3 and ptr & 15 and self._reads_rows:  # q and the caches (layouts were checked when planning)
                self._check_addresses({i: ptr})
            refs[i] = _weak(a)
            writes.append((index[i], ptr))
        if self._shared_kv and stale and stale[0] <= 2:
            self._check_addresses({i: p for i, (_, p) in zip(stale, writes) if i in (1, 2)})
        refs = tuple(refs)
        stream, launch, argv = self._current_stream().ptr, self._launch, self._argv_ptr
        words = self._words
        with self._lock:
            if self._last is not last:  # another thread's step wrote the record meanwhile: write every address
                return self._new_arrays(*_run_order(arrays, arrays[5:7]))
            if self._splits_for is not None:
                self._fit(arrays[1], arrays[2])
            if self._map is not None and 1 in stale:  # (encoded first: a failure leaves the record as it was)
                self._map.point(arrays[1].data.ptr)
            for word, ptr in writes:
                words[word] = ptr
            if self._can_fuse and (3 in stale or 4 in stale):
                fused = not ((words[index[3]] | words[index[4]]) & 15)
                if fused is not (self._steps is self._fused):
                    self._select(fused)
            for fn, gx, gy, gz, threads, smem in self._steps:
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
            self._last = refs
        return arrays[5], arrays[6]

    def _check_addresses(self, ptrs: dict) -> None:
        """The addresses of a step's new arrays (record slot -> address) that the kernels constrain: q and the
        caches at multiples of 16 bytes (read in 16-byte rows; layouts were checked when planning), and, for MLA,
        v_cache at k_cache's address."""
        if self._reads_rows:
            _check_row_addresses(ptrs)
        if self._shared_kv and (1 in ptrs or 2 in ptrs):
            k_ptr = ptrs[1] if 1 in ptrs else self._words[self._word_index[1]]
            v_ptr = ptrs[2] if 2 in ptrs else self._words[self._word_index[2]]
            if k_ptr != v_ptr:
                raise NotImplementedError(f"MLA decoding on the GPU reads V from the K cache: v_cache must be "
                                          f"k_cache[..., :{self.out_shape[3]}] (a view), as when the launch was "
                                          f"planned; got a v_cache at another address")

    def _new_arrays(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                    alibi_slopes, rotary_cos, rotary_sin, out, lse):
        """A step whose arrays are not (all) the last step's: validated, rotated, allocated, their addresses
        written into the record, then launched."""
        if self.validate is not None:
            self.validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                          alibi_slopes, rotary_cos, rotary_sin, out, lse)
        given = (q, k_cache, v_cache, k, v)
        rotating = None
        if self.rotary is not None:
            q, k, cache_seqlens, rotating = _rotate(self._rotary_step, self.rotary, q, k, cache_seqlens, rotary_cos,
                                                    rotary_sin)
        if out is None:
            out = self._empty(self.out_shape, dtype=self.dtype)
        if lse is None:
            lse = self._empty(self.lse_shape, dtype=self._float32)
        if not self._steps:  # no sequence or no query row: nothing to append or compute
            return out, lse
        arrays = (q, k_cache, v_cache, k, v, out, lse, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                  alibi_slopes)
        ptrs = tuple(0 if a is None else a.data.ptr for a in arrays)
        self._check_addresses(dict(enumerate(ptrs)))
        refs = (*(_none if a is None else _weak(a) for a in given), *(_none if a is None else _weak(a)
                                                                       for a in arrays[5:]))
        stream, launch, argv = self._current_stream().ptr, self._launch, self._argv_ptr
        words = self._words
        with self._lock:
            if self._splits_for is not None:
                self._fit(k_cache, v_cache)
            if self._map is not None:  # (encoded first: a failure leaves the record as it was)
                self._map.point(ptrs[1])
            for index, ptr in zip(self._word_index, ptrs):
                words[index] = ptr
            if self._can_fuse:
                self._select(not ((ptrs[3] | ptrs[4]) & 15))
            if rotating is not None:
                self._rotary_step.launch(launch, stream, *rotating)
            # cuLaunchKernel copies the record (and the map) when it is called: the next step may rewrite it at once.
            for fn, gx, gy, gz, threads, smem in self._steps:
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
            # The fast path may skip the pointers only for the arrays the user gave (a rotary step writes them all).
            self._last = refs if self.rotary is None else _FORGOTTEN
        return out, lse


# [pdl] Chunked prefill's forward launched with programmatic stream serialization where its kernel waits for the append
# in-kernel (the Hopper forward kernels): its blocks start, set up their barriers and wait while the append runs,
# instead of starting after it. False: two ordinary launches (for comparison).
PROGRAMMATIC_PREFILL = os.environ.get("CUFLASH_PROGRAMMATIC_PREFILL", "1") != "0"
# [prefill append] Chunked prefill in one launch, the append fused into the TMA forward (forward_sm90.cu's
# flash_fwd_sm90_tma_append_kernel), where the forward runs from its TMA entry point at the arrays' head dim with one
# new key per query token. On by default (CUFLASH_FUSED_PREFILL_APPEND=0: the append kernel, then the forward): H200
# 2026-11-28, bench-decode --prefill, per call / back to back against the dense call, fused 0.94-0.97x / 0.96-0.99x,
# two launches 0.82-0.99x / 0.93-0.99x; bit for bit the two launches' output, lse and caches (test_cuda_decode.py).
FUSED_PREFILL_APPEND = os.environ.get("CUFLASH_FUSED_PREFILL_APPEND", "1") != "0"


class ChunkedPrefillLaunch:
    """A decode call with many query tokens over a contiguous cache (chunked prefill), planned once and run as
    two launches on the current stream (:mod:`cuflash._ops.chunked_prefill`; ``decode.cu``):

    1. ``decode_append_kernel`` ([decode append] and [prefill lengths]): the new keys and values into their slots,
       and each sequence's key count ``cache_seqlens[b] + seqlen_new`` (-1 out of range) into the launch's
       ``seqused_k`` workspace;
    2. the FlashAttention-2 forward over the cache arrays (its :class:`.attention.ForwardPlan`, with ``seqused_k``,
       bottom-right causal masks, windows, softcap, ALiBi): the forward kernels' large tiles where the decode
       kernels' small ones would be compute-bound. A negative count reads no key and makes the sequence's rows
       NaN ([decode guard]: the forward's void_rows, variants.cuh).

    Where the forward takes the TMA entry point with one new key per query token, both in one launch
    ([prefill append], :data:`FUSED_PREFILL_APPEND`): the forward appends as it goes, bit for bit the same results.

    The interface of :class:`DecodeLaunch` (``run``, ``num_splits``, ``expect``, ``out_shape``, ``lse_shape``), so
    that the front door's memory and :class:`cuflash.DecodePlan` take either. A step writes its arrays' addresses
    into the two launches' records and launches: with ``out`` and ``lse`` given (C-contiguous) it allocates nothing
    and can be captured in a CUDA graph. Rotary embedding rotates q and the new k first, as :class:`DecodeLaunch`
    does (:class:`_RotaryStep`'s kernel into copies the launch owns; other tables: CuPy array operations, which
    allocate); an ``out`` that is not C-contiguous receives a copy. Holds no
    array of the planned call (the ALiBi slopes and rotary tables come with each step).
    """

    def __init__(self, q, k_cache, v_cache, k, v, *, cache: KVCache, scale: float, variant: Variant, out=None,
                 runtime=None):
        from . import attention
        from .._ops.validate import Problem
        from .._ops.variant import VariantArrays

        rt = runtime if runtime is not None else CupyRuntime()
        rt.check_supported(q, k_cache, v_cache)
        batch, seqlen_q, heads_q, d = q.shape
        attention.check_supported(Problem(batch, seqlen_q, cache.capacity, heads_q, k_cache.shape[2], d, q.dtype),
                                  "fa2", variant)
        dtype = np.dtype(q.dtype).name
        self.device = rt.get_device()
        self.dtype = q.dtype
        self.out_shape = (batch, seqlen_q, heads_q, v_cache.shape[3])
        self.lse_shape = (batch, heads_q, seqlen_q)
        self._lse_sink = None  # (lse_sink: made at its first use)
        self.num_splits = 1
        self.validate = None
        self._rotary = None if cache.rotary is None else (cache.rotary.interleaved, cache.rotary.consecutive_q)
        # [prefill lengths] the forward's key counts, written by the append kernel at every step
        self._seqused = rt.kept((batch,), np.int32)
        # The forward, planned over the caches' first batch rows: ALiBi slopes of one row per head read at batch
        # stride 0; q and k at the rotated copies' contiguous strides under rotary.
        slopes = variant.alibi_slopes
        if slopes is not None and slopes.ndim == 1:
            import cupy

            slopes = cupy.broadcast_to(slopes, (batch, heads_q))
        forward_variant = dataclasses.replace(variant, alibi_slopes=slopes, seqused_k=self._seqused)
        # [decode rotary] its kernel's copies, where it applies: q's is the array the forward is planned over
        self._rotary_step = _RotaryStep.make(rt, q, k, cache) if batch else None
        rotated = self._rotary_step
        q_planned = q if self._rotary is None else rotated.q_rot if rotated else rt.empty(q.shape, dtype=q.dtype)
        # [prefill append] the new keys (the rotated copy under rotary) and values, for the fused form
        append = None
        if FUSED_PREFILL_APPEND and k is not None and cache.seqlen_new == seqlen_q:
            append = (k if self._rotary is None else rotated.k_rot if rotated else rt.empty(k.shape, dtype=k.dtype),
                      v)
        self._forward = attention.ForwardPlan(q_planned, k_cache[:batch], v_cache[:batch], scale=scale,
                                              variant=forward_variant, block_q=None, block_k=None, append=append)
        self._fused_append = self._forward.appends  # (one launch a step: the forward, appending first)
        self._append = None if self._fused_append else rt.function(
            kernel_spec("decode_append", dtype, 0, variant="false"))
        self._append_grid = batch * max(cache.seqlen_new, 1)
        # [pdl] the forward launched to start while the append runs (its blocks set up, then wait for the append);
        # the driver's entry point bound now, so that nothing new can fail after a step's append
        self._after_append = PROGRAMMATIC_PREFILL and self._forward.waits_for_prior_grid and not self._fused_append
        if self._after_append:
            try:
                self._forward.prepare_after_prior()
            except (OSError, AttributeError):  # a driver without cuLaunchKernelEx: the ordinary launch
                self._after_append = False
        self._arrays = VariantArrays
        self._plain_arrays = VariantArrays(seqused_k=self._seqused)
        rec = self._record = decode_record(q, k_cache, v_cache, k, v, out=None, cache=cache, scale=scale,
                                           variant=variant, rotary=self._rotary is not None)
        rec[0]["seqused_k"] = self._seqused.data.ptr
        self._argv, self._argv_ptr = record_argv(rec)
        self._words = memoryview(rec.view(np.uint8)).cast("Q")
        self._word_index = _WORD_INDEX
        self._lock = threading.Lock()  # one step at a time writes the records and launches
        self._empty, self._kept, self._float32 = rt.empty, rt.kept, rt.float32
        self._current_stream, self._get_device, self._launch = rt.current_stream, rt.get_device, rt.launch
        self._runtime = rt
        self._threads: set = set()

    expect = DecodeLaunch.expect
    _ensure_context = DecodeLaunch._ensure_context
    lse_sink = DecodeLaunch.lse_sink

    def run(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad=None, cache_batch_idx=None,
            block_table=None, alibi_slopes=None, rotary_cos=None, rotary_sin=None, out=None, lse=None):
        """One step: ``(out, lse)``, appending ``k``, ``v`` first. The arrays must have the planned layouts (the
        caller's guarantee, or ``validate``'s after :meth:`expect`); ``out`` and ``lse`` are allocated when not
        given."""
        if self.validate is not None:
            self.validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                          alibi_slopes, rotary_cos, rotary_sin, out, lse)
        if self._get_device() != self.device or threading.get_ident() not in self._threads:
            self._ensure_context()
        if (q.data.ptr | k_cache.data.ptr | v_cache.data.ptr) & 15:
            _check_row_addresses({0: q.data.ptr, 1: k_cache.data.ptr, 2: v_cache.data.ptr})
        rotating = None
        if self._rotary is not None:
            q, k, cache_seqlens, rotating = _rotate(self._rotary_step, self._rotary, q, k, cache_seqlens, rotary_cos,
                                                    rotary_sin)
        given = out
        if out is not None and not out.flags.c_contiguous:
            out = None
        # (allocated before the append's launch: nothing that can fail comes after a step's append)
        if out is None:
            out = self._empty(self.out_shape, dtype=self.dtype)
        if lse is None:
            lse = self._empty(self.lse_shape, dtype=self._float32)
        pq, pk, pv, pout, plse = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, out.data.ptr, lse.data.ptr
        stream, launch, argv, words, index = (self._current_stream().ptr, self._launch, self._argv_ptr, self._words,
                                              self._word_index)
        forward = self._forward
        if self._fused_append:  # [prefill append] one launch: the forward reads cache_seqlens as its key counts' base
            if (k.data.ptr | v.data.ptr) & 15:
                _check_row_addresses({3: k.data.ptr, 4: v.data.ptr})
            pseqlens = cache_seqlens.data.ptr
            with forward._lock:
                if forward.stages_pointers:  # (no VariantArrays built: VariantParams' pointers, as stage writes them)
                    forward.stage_pointers(pq, pk, pv, pout, plse,
                                           (0, 0, pseqlens, 0 if alibi_slopes is None else alibi_slopes.data.ptr, 0))
                else:
                    forward.stage(pq, pk, pv, pout, plse,
                                  self._arrays(seqused_k=cache_seqlens, alibi_slopes=alibi_slopes))
                forward.stage_append(pseqlens, k.data.ptr, v.data.ptr, pk, pv)
                if rotating is not None:
                    self._rotary_step.launch(self._launch, stream, *rotating)
                forward.launch_staged(stream)
        else:
            arrays = self._plain_arrays if alibi_slopes is None else self._arrays(seqused_k=self._seqused,
                                                                                  alibi_slopes=alibi_slopes)
            with self._lock, forward._lock:
                # Both records written first, then the two launches back to back: the GPU does not wait for the host
                # between them (the append takes a few microseconds).
                forward.stage(pq, pk, pv, pout, plse, arrays)
                for i, ptr in enumerate((pq, pk, pv, 0 if k is None else k.data.ptr, 0 if v is None else v.data.ptr)):
                    words[index[i]] = ptr
                words[index[7]] = cache_seqlens.data.ptr
                if rotating is not None:
                    self._rotary_step.launch(launch, stream, *rotating)
                launch(self._append[0], self._append_grid, 1, 1, 128, 1, 1, 0, stream, argv, 0)  # (record copied now)
                if not forward.launch_staged(stream, self._after_append):
                    self._after_append = False  # (a refused programmatic launch: the ordinary one from now on)
        if given is not None and given is not out:  # an out= of other strides: a copy of the result
            _chunked_prefill.bits(given)[...] = _chunked_prefill.bits(out)
            out = given
        return out, lse


def _check_row_addresses(ptrs: dict) -> None:
    """q and the caches (record slots 0, 1, 2 -> address), and chunked prefill's new keys and values where its forward
    appends them (3, 4: their maps), at multiples of 16 bytes: the decode kernels and the forward read them in 16-byte
    rows (their layouts were checked when planning)."""
    for slot, name in ((0, "q"), (1, "k_cache"), (2, "v_cache"), (3, "k"), (4, "v")):
        ptr = ptrs.get(slot, 0)
        if ptr & 15:
            raise NotImplementedError(f"{name}: the kernels read 16-byte rows; its base address must "
                                      f"be a multiple of 16 bytes (got one {ptr % 16} bytes past a multiple)")


_ROTARY_WORDS = {name: ROTARY_PARAMS_DTYPE.fields[name][1] // 8 for name in
                 ("q", "k_new", "cos", "sin", "cache_seqlens", "cos_s0", "cos_s1", "sin_s0", "sin_s1")}
_ROTARY_INTS = {name: ROTARY_PARAMS_DTYPE.fields[name][1] // 4 for name in ("half", "seqlen_ro")}


class _RotaryStep:
    """[decode rotary] in one launch: ``decode_rotary_kernel`` rotates a step's q and new k into contiguous copies that
    this object owns (:attr:`q_rot`, :attr:`k_rot`: the arrays its launch's other kernels are planned over), and the
    step's lengths into :attr:`seqlens` (the lengths they read: -1 for a sequence with a position outside the tables,
    [decode guard]), so that a rotary step allocates nothing and can be captured in a CUDA graph. :meth:`make`
    returns None where it does not apply (:data:`ROTARY_KERNEL` off, tables neither float32 nor of q's dtype): the
    launch rotates with CuPy array operations then (:func:`_rotated`)."""

    @classmethod
    def make(cls, rt, q, k, cache: KVCache) -> "_RotaryStep | None":
        rotary = cache.rotary
        if rotary is None or not ROTARY_KERNEL:
            return None
        dtype = np.dtype(q.dtype)
        table = np.dtype(rotary.cos.dtype)
        if np.dtype(rotary.sin.dtype) != table or table not in (np.dtype(np.float32), dtype):
            return None
        return cls(rt, q, k, cache, table)

    def __init__(self, rt, q, k, cache: KVCache, table):
        dtype = np.dtype(q.dtype)
        batch, seqlen_q, heads_q, d = q.shape
        self.table = table
        fn, self._kernel = rt.function(kernel_spec(
            "decode_rotary", dtype.name, 0, variant="float" if table == np.float32 else CTYPES[dtype.name]))
        self.q_rot = rt.kept(q.shape, q.dtype)
        self.k_rot = None if k is None else rt.kept(k.shape, k.dtype)
        self.seqlens = rt.kept((batch,), np.int32)
        rec = self._record = np.zeros(1, ROTARY_PARAMS_DTYPE)
        r = rec[0]
        r["q_rot"], r["k_rot"] = self.q_rot.data.ptr, 0 if k is None else self.k_rot.data.ptr
        r["seqlens_out"] = self.seqlens.data.ptr
        r["q_sb"], r["q_ss"], r["q_sh"] = (st // q.itemsize for st in q.strides[:3])
        if k is not None:
            r["kn_sb"], r["kn_ss"], r["kn_sh"] = (st // k.itemsize for st in k.strides[:3])
        r["seqlen_q"], r["seqlen_new"], r["heads_q"] = seqlen_q, 0 if k is None else k.shape[1], heads_q
        r["heads_kv"], r["head_dim"] = 1 if k is None else k.shape[2], d
        r["interleaved"], r["consecutive_q"] = cache.rotary.interleaved, cache.rotary.consecutive_q
        self._argv, self._argv_ptr = record_argv(rec)
        self._words = memoryview(rec.view(np.uint8)).cast("Q")
        self._longs = memoryview(rec.view(np.uint8)).cast("q")
        self._ints = memoryview(rec.view(np.uint8)).cast("i")
        rows = batch * (seqlen_q + int(r["seqlen_new"]))
        self._step = (fn, rows, 1, 1, 128, 0)

    def takes(self, rotary_cos, rotary_sin) -> bool:
        """Whether a step's tables are of the planned element type (another step's: CuPy array operations)."""
        return rotary_cos.dtype == self.table and rotary_sin.dtype == self.table

    def launch(self, launch, stream: int, q, k, rotary_cos, rotary_sin, cache_seqlens) -> None:
        """The step's arrays into the record (the tables' strides and shape too), then the kernel on ``stream``
        (called with the launch's lock held, before its other kernels)."""
        words, longs, ints, at = self._words, self._longs, self._ints, _ROTARY_WORDS
        words[at["q"]], words[at["k_new"]] = q.data.ptr, 0 if k is None else k.data.ptr
        words[at["cos"]], words[at["sin"]] = rotary_cos.data.ptr, rotary_sin.data.ptr
        words[at["cache_seqlens"]] = cache_seqlens.data.ptr
        size = rotary_cos.itemsize
        longs[at["cos_s0"]], longs[at["cos_s1"]] = rotary_cos.strides[0] // size, rotary_cos.strides[1] // size
        longs[at["sin_s0"]], longs[at["sin_s1"]] = rotary_sin.strides[0] // size, rotary_sin.strides[1] // size
        ints[_ROTARY_INTS["half"]], ints[_ROTARY_INTS["seqlen_ro"]] = rotary_cos.shape[1], rotary_cos.shape[0]
        fn, gx, gy, gz, threads, smem = self._step
        if gx:
            launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, self._argv_ptr, 0)


def _rotate(rotary_step, rotary, q, k, cache_seqlens, rotary_cos, rotary_sin):
    """[decode rotary] ``(q, k, cache_seqlens, rotating)`` as a step's launches read them: the rotary kernel's copies
    and guarded lengths, with ``rotating`` the arguments of its launch (made with the launch's lock held, first), or
    the copies of CuPy array operations (``rotary_step`` None, or tables of another type) and None."""
    if rotary_step is not None and rotary_step.takes(rotary_cos, rotary_sin):
        return rotary_step.q_rot, rotary_step.k_rot, rotary_step.seqlens, (q, k, rotary_cos, rotary_sin, cache_seqlens)
    q, k = _rotated(q, k, cache_seqlens, rotary_cos, rotary_sin, *rotary)
    return q, k, cache_seqlens, None


def _rotated(q, k, cache_seqlens, rotary_cos, rotary_sin, interleaved: bool, consecutive_q: bool):
    """[decode rotary]: contiguous rotated copies of q (query token i at ``cache_seqlens[b] + i``, or every token at
    ``cache_seqlens[b]``) and of the new k (new key i at ``cache_seqlens[b] + i``), in CuPy array operations."""
    import cupy

    base = cache_seqlens.astype(cupy.int64)[:, None]
    seqlen_q = q.shape[1]
    steps = cupy.arange(seqlen_q) if consecutive_q else cupy.zeros(seqlen_q, cupy.int64)
    q = cupy.ascontiguousarray(apply_rotary(q, rotary_cos, rotary_sin, base + steps[None, :], interleaved, xp=cupy))
    if k is not None:
        positions = base + cupy.arange(k.shape[1])[None, :]
        k = cupy.ascontiguousarray(apply_rotary(k, rotary_cos, rotary_sin, positions, interleaved, xp=cupy))
    return q, k


def _runs_as_prefill(q, k_cache, v_cache, cache: KVCache) -> bool:
    """Whether a call runs as the forward over the cache (:func:`cuflash._ops.chunked_prefill.eligible`, and a
    batch)."""
    return q.shape[0] > 0 and q.shape[2] > 0 and _chunked_prefill.eligible(q.shape[1], cache, q.shape[3],
                                                                            v_cache.shape[3])


def _launch_of(q, k_cache, v_cache, k, v, *, cache: KVCache, scale: float, variant: Variant, out):
    kind = ChunkedPrefillLaunch if _runs_as_prefill(q, k_cache, v_cache, cache) else DecodeLaunch
    return kind(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out)


_SLOTS = range(len(_STEP_POINTERS))


def _run_order(arrays, out_lse):
    """A step's arrays in record slot order back in the order of DecodeLaunch.run's arguments (no rotary), with
    ``out_lse`` for out and lse."""
    q, k_cache, v_cache, k, v, _, _, cache_seqlens, cache_leftpad, cache_batch_idx, block_table, slopes = arrays
    return (q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table, slopes, None, None,
            *out_lse)


def _weak(a):
    try:
        return weakref.ref(a)
    except TypeError:  # an object without weak references: never the same as the last step's
        return _never


class _Never:
    """What a forgotten slot's reference returns: an object no argument is."""


def _never():
    return _Never


_FORGOTTEN = (_never,) * len(_STEP_POINTERS)  # a record whose every address the next step writes



def _layout(a):
    return None if a is None else (a.shape, a.strides)


def _launch_key(q, k_cache, v_cache, k, v, cache: KVCache, scale: float, variant: Variant, out):
    """Everything a DecodeLaunch depends on: device, stream (its workspace serves one step at a time), dtype,
    every array's shape and strides, the options."""
    import cupy

    rotary = cache.rotary
    stream = cupy.cuda.get_current_stream().ptr
    # cudaStreamPerThread (2) is one stream per thread under one handle: one launch (workspace) per thread
    owner = threading.get_ident() if stream == 2 else None
    return (cupy.cuda.runtime.getDevice(), stream, owner, q.dtype, _layout(q),
            _layout(k_cache), _layout(v_cache), _layout(k), _layout(v), None if out is None else out.strides,
            _layout(cache.block_table), cache.cache_leftpad is None, cache.cache_batch_idx is None,
            cache.capacity, cache.seqlen_new, cache.num_splits,
            None if rotary is None else (rotary.interleaved, rotary.consecutive_q),
            _layout(variant.alibi_slopes), scale, variant.window_left, variant.right, variant.softcap)


def merge_partials(o_part, lse_part, out, lse) -> None:
    """[decode merge] alone, on the current stream: ``out`` (``(batch, seqlen_q, heads_q, dv)``, float16 or bfloat16,
    any strides with a contiguous last axis) and ``lse`` (``(batch, heads_q, seqlen_q)``, contiguous float32) from
    the splits' partials ``o_part`` ``(splits, batch, heads_q, seqlen_q, dv)`` and ``lse_part`` ``(splits, batch,
    heads_q, seqlen_q)`` (contiguous float32), as the split kernel leaves them: the kernel that
    :func:`cuflash._ops.merge.merge_stacked` mirrors, launched by itself (its GPU test)."""
    splits, batch, heads_q, seqlen_q, dv = o_part.shape
    assert lse_part.shape == o_part.shape[:-1] and out.shape == (batch, seqlen_q, heads_q, dv)
    assert lse.shape == (batch, heads_q, seqlen_q) and o_part.flags.c_contiguous and lse_part.flags.c_contiguous
    assert lse.flags.c_contiguous and out.strides[-1] == out.itemsize
    rec = np.zeros(1, DECODE_PARAMS_DTYPE)
    r = rec[0]
    r["out"], r["lse"], r["o_part"], r["lse_part"] = out.data.ptr, lse.data.ptr, o_part.data.ptr, lse_part.data.ptr
    r["o_sb"], r["o_ss"], r["o_sh"] = (_el(out, axis) for axis in range(3))
    r["batch"], r["seqlen_q"], r["heads_q"], r["head_dim_v"], r["num_splits"] = batch, seqlen_q, heads_q, dv, splits
    rows = batch * heads_q * seqlen_q
    if rows:
        launch(kernel_spec("decode_merge", np.dtype(out.dtype).name, dv), (-(-rows // 4),), (rec[0],))


def plan_kvcache(q, k_cache, v_cache, k, v, *, cache: KVCache, scale: float, variant: Variant, out=None,
                 shared: bool = False, splits_for: Callable[[int], int] | None = None) -> DecodeLaunch:
    """The launches of a decode call with these arrays' shapes and strides and these options: compiles the kernels
    and allocates the workspace now. ``shared=False`` (:func:`cuflash.plan_kvcache`): a launch of the caller's
    own; True: the one that :func:`forward_kvcache` keeps for these arguments on the current stream (the front
    door's repeated calls). A call of at least ``cuflash._ops.chunked_prefill.MIN_SEQLEN_Q`` query tokens over a
    contiguous cache without ``cache_leftpad`` or ``cache_batch_idx`` gets a :class:`ChunkedPrefillLaunch` (the
    forward kernels over the cache), any other a :class:`DecodeLaunch`. ``splits_for`` (the front door's calls over
    a cache that grows, which append nothing and run the decode kernels over a contiguous cache: ``cuflash._ops.api.
    _grows``): a :class:`DecodeLaunch` of the caller's own that takes caches of any slot count and strides, with the
    split count ``splits_for(slots)`` (before the launch's limit of one split per key tile)."""
    if splits_for is not None:
        return DecodeLaunch(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out,
                            splits_for=splits_for)
    if not shared:
        return _launch_of(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out)
    key = _launch_key(q, k_cache, v_cache, k, v, cache, scale, variant, out)
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _launch_of(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out)
        with _lock:
            _LAUNCHES[key] = launch
            while len(_LAUNCHES) > MAX_CACHED_LAUNCHES:
                _LAUNCHES.popitem(last=False)
    else:
        with _lock:
            if key in _LAUNCHES:
                _LAUNCHES.move_to_end(key)
    return launch


def forward_kvcache(q, k_cache, v_cache, k, v, *, cache: KVCache, scale: float, variant: Variant, out=None):
    """``(out, lse)`` of one decode call (the interface of docs/architecture.md); appends ``k``, ``v`` first. The
    launch is planned at the first call of its shapes and options and reused by the next ones."""
    launch = plan_kvcache(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out, shared=True)
    rotary = cache.rotary
    return launch.run(q, k_cache, v_cache, k, v, cache.cache_seqlens, cache.cache_leftpad, cache.cache_batch_idx,
                      cache.block_table, variant.alibi_slopes, None if rotary is None else rotary.cos,
                      None if rotary is None else rotary.sin, out, None)
