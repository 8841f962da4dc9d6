"""Shared-prefix (cascade) attention on the GPU, planned: :mod:`cuflash._ops.cascade`'s steps as four launches.

A :class:`CascadeLaunch` holds everything a call's shapes, strides, dtype and options decide, as
:class:`.decode.DecodeLaunch` does for one decode call; :meth:`CascadeLaunch.run` writes the call's addresses and
launches, on the current stream:

1. ``cascade_pack_kernel`` (``[cascade prefix]``): q into GQA-packed rows (the launch's workspace);
2. the FlashAttention-2 forward of those rows against the prefix chunks (a :class:`.attention.ForwardPlan`: the
   chunks are the batch axis, the packed rows the same for every chunk, read at batch stride 0), non-causal, with
   softcap, writing each chunk's output and lse into the workspace;
3. ``[cascade suffix]`` the decode call over each sequence's own keys (its own :class:`.decode.DecodeLaunch`, or
   :class:`.decode.ChunkedPrefillLaunch` for many query tokens), appending ``k``, ``v`` first, its output and lse
   into the workspace;
4. ``cascade_merge_kernel`` (``[cascade merge]``): the chunks' and the suffix's parts of every row merged exactly
   (``merge_stacked``'s steps), in the input dtype with its lse.

No host work beyond the launches and no allocation but the result's; the reference (:func:`cuflash._ops.cascade.
cascade`) composes the same steps of public operations, which the CuPy arrays also run where this plan does not
apply (:func:`eligible`).
"""

from __future__ import annotations

import threading

import numpy as np

from .._ops.variant import Variant, VariantArrays
from . import attention, decode
from .spec import CTYPES, DECODE_HEAD_DIMS, HEAD_DIMS
from .spec import spec as kernel_spec

__all__ = ["CascadeLaunch", "CASCADE_PARAMS_DTYPE", "eligible"]

_ARRAY_FIELDS = ("q", "q_rows", "o_prefix", "lse_prefix", "o_suffix", "lse_suffix", "out", "lse")

# Layout of `struct CascadeParams` (decode.cu), passed by value to the pack and merge kernels.
CASCADE_PARAMS_DTYPE = np.dtype(
    [*((name, np.uint64) for name in _ARRAY_FIELDS),
     *((name, np.int64) for name in ("q_sb", "q_ss", "q_sh", "o_sb", "o_ss", "o_sh")),
     *((name, np.int32) for name in ("batch", "seqlen_q", "heads_q", "heads_kv", "group", "head_dim", "head_dim_v",
                                      "chunks"))],
    align=True,
)
_WORD = {name: CASCADE_PARAMS_DTYPE.fields[name][1] // 8 for name in _ARRAY_FIELDS}


def _rows_of_16(a) -> bool:
    """A contiguous last axis and the other strides at multiples of 16 bytes: the forward copies 16-byte rows (the
    base address is a call's, checked by :meth:`CascadeLaunch.run`)."""
    return a.strides[-1] == a.itemsize and attention._strides_aligned(a)


def eligible(q, k_prefix, v_prefix, k_cache, v_cache) -> bool:
    """Whether a checked cascade call on CuPy arrays of these layouts runs as a :class:`CascadeLaunch`: a prefix of at
    least one key whose head dims are equal and run by the forward kernels and the decode kernels alike (not MLA's
    576 / 512), 16-bit inputs, a non-empty batch, the prefix's rows at multiples of 16 bytes. Otherwise the
    composition of public operations runs it."""
    d, dv = q.shape[3], v_prefix.shape[2]
    return (k_prefix.shape[0] > 0 and d == dv and d in HEAD_DIMS and d in DECODE_HEAD_DIMS
            and np.dtype(q.dtype).name in CTYPES and q.size > 0 and _rows_of_16(k_prefix) and _rows_of_16(v_prefix))


class CascadeLaunch:
    """One cascade call's launches, planned from the first call's arrays (checked by the front door) and the
    normalized options of its decode part (``cache``, ``scale``, ``variant``: bottom-right causal or not, softcap);
    ``chunks`` the prefix's split. :meth:`run` takes arrays of the same layouts and returns ``(out, lse)``. The
    workspaces serve one call at a time: the front door keeps one launch per stream."""

    def __init__(self, q, k_prefix, v_prefix, k_cache, v_cache, k, v, *, cache, scale: float, variant: Variant,
                 chunks: int, runtime=None):
        import cupy

        rt = runtime if runtime is not None else decode.CupyRuntime()
        batch, seqlen_q, heads_q, d = q.shape
        prefix_len, heads_kv, dv = k_prefix.shape[0], k_prefix.shape[1], v_prefix.shape[2]
        group = heads_q // heads_kv
        rows = batch * seqlen_q * group
        dtype = np.dtype(q.dtype).name
        self.device = rt.get_device()
        self.dtype = q.dtype
        self.out_shape, self.lse_shape = (batch, seqlen_q, heads_q, dv), (batch, heads_q, seqlen_q)
        # [cascade suffix] the decode call's own launch, into the workspace
        self._suffix = decode._launch_of(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant,
                                         out=None)
        self._o_suffix = rt.empty(self.out_shape, dtype=q.dtype)
        self._lse_suffix = rt.empty(self.lse_shape, dtype=np.float32)
        # [cascade prefix] the packed rows against the chunks (views of the prefix), every chunk reading the same rows
        self._q_rows = rt.empty((rows, heads_kv, d), dtype=q.dtype)
        self._o_prefix = rt.empty((chunks, rows, heads_kv, dv), dtype=q.dtype)
        self._lse_prefix = rt.empty((chunks, heads_kv, rows), dtype=np.float32)
        chunk = prefix_len // chunks
        self._chunks = (chunks, chunk)
        self._prefix = attention.ForwardPlan(
            cupy.broadcast_to(self._q_rows[None], (chunks, rows, heads_kv, d)),
            k_prefix.reshape(chunks, chunk, heads_kv, d), v_prefix.reshape(chunks, chunk, heads_kv, dv),
            scale=scale, variant=Variant(softcap=variant.softcap), block_q=None, block_k=None)
        self._pack = rt.function(kernel_spec("cascade_pack", "bfloat16", 0))
        self._merge = rt.function(kernel_spec("cascade_merge", dtype, dv))
        self._grids = (rows, -(-(batch * seqlen_q * heads_q) // 4))
        rec = self._record = np.zeros(1, CASCADE_PARAMS_DTYPE)
        r = rec[0]
        for name, a in (("q_rows", self._q_rows), ("o_prefix", self._o_prefix), ("lse_prefix", self._lse_prefix),
                        ("o_suffix", self._o_suffix), ("lse_suffix", self._lse_suffix)):
            r[name] = a.data.ptr
        r["q_sb"], r["q_ss"], r["q_sh"] = (s // q.itemsize for s in q.strides[:3])
        out_strides = np.cumprod((1, dv, heads_q, seqlen_q))[::-1]  # C-contiguous (batch, seqlen_q, heads_q, dv)
        r["o_sb"], r["o_ss"], r["o_sh"] = out_strides[:3]
        r["batch"], r["seqlen_q"], r["heads_q"], r["heads_kv"] = batch, seqlen_q, heads_q, heads_kv
        r["group"], r["head_dim"], r["head_dim_v"], r["chunks"] = group, d, dv, chunks
        self._argv, self._argv_ptr = decode.record_argv(rec)
        self._words = memoryview(rec.view(np.uint8)).cast("Q")
        self._no_arrays = VariantArrays()
        self._lock = threading.Lock()  # one call at a time writes the record and the workspaces
        self._empty, self._current_stream, self._get_device, self._launch = (rt.empty, rt.current_stream,
                                                                            rt.get_device, rt.launch)
        self._runtime = rt
        self._threads: set = set()

    _ensure_context = decode.DecodeLaunch._ensure_context

    def run(self, q, k_prefix, v_prefix, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad=None,
            cache_batch_idx=None, block_table=None):
        """``(out, lse)`` of one call (new arrays), appending ``k``, ``v`` into the caches first; None, before
        anything is launched or appended, where the prefix's base address is not a multiple of 16 bytes (the forward
        reads 16-byte rows: the caller runs the composition, whose forward copies it). The arrays must have the
        planned layouts (the front door's guarantee)."""
        if (k_prefix.data.ptr | v_prefix.data.ptr) & 15:
            return None
        if self._get_device() != self.device or threading.get_ident() not in self._threads:
            self._ensure_context()
        decode._check_row_addresses({0: q.data.ptr})
        out = self._empty(self.out_shape, dtype=self.dtype)
        lse = self._empty(self.lse_shape, dtype=np.float32)
        stream, launch, argv, words = self._current_stream().ptr, self._launch, self._argv_ptr, self._words
        with self._lock:
            words[_WORD["q"]], words[_WORD["out"]], words[_WORD["lse"]] = q.data.ptr, out.data.ptr, lse.data.ptr
            launch(self._pack[0], self._grids[0], 1, 1, 128, 1, 1, 0, stream, argv, 0)
            self._prefix.run(self._q_rows, k_prefix, v_prefix, self._no_arrays, stream, out=self._o_prefix,
                             lse_out=self._lse_prefix)
            self._suffix.run(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                             None, None, None, self._o_suffix, self._lse_suffix)
            launch(self._merge[0], self._grids[1], 1, 1, 128, 1, 1, 0, stream, argv, 0)
        return out, lse
