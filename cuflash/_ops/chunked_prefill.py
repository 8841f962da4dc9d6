"""Chunked prefill: a decode call with many query tokens runs the FlashAttention-2 forward over the cache itself.

A call of :func:`cuflash.attention_with_kvcache` whose ``seqlen_q`` is large (a chunk of 512-2048 prompt tokens
against a long cache) is no longer memory-bound: each key/value byte serves ``group * seqlen_q`` query rows, past
the H100's ~300 FLOPs per byte once ``seqlen_q`` reaches a few dozen tokens (``docs/decoding.md``, "Why decoding is
memory-bound"). The decode kernels are built for few query rows (64 packed rows a tile, 64 keys a tile); the
forward kernels for many (128-row tiles, the Hopper wgmma kernels at head dims 64 and 128). So, for a contiguous
cache, after the in-place append the call is the forward over the cache arrays, each sequence using its first
``cache_seqlens[b] + seqlen_new`` keys (``seqused_k``), causal masking, windows and ALiBi bottom-right aligned, as
in the decode call. :func:`forward_over_cache` composes it of array operations, step tag by step tag as the CUDA
launch (:class:`cuflash._cuda.decode.ChunkedPrefillLaunch`) runs it in two kernels:

1. ``[decode rotary]`` q and the new keys rotated at their positions
   (:func:`cuflash.reference.decode.apply_rotary`, in the array module of the inputs; on CuPy the same operations);
2. ``[decode append]`` the new keys and values written into slots ``cache_seqlens[b] ..`` of cache row ``b`` (an
   indexed assignment, v first, then k), and ``[prefill lengths]`` each sequence's key count ``seqused_k =
   cache_seqlens + seqlen_new`` (CUDA: ``decode_append_kernel``, one launch for both);
3. the forward (``forward``: the backend's, :func:`cuflash.reference.forward` on NumPy; CUDA: the launch's
   ``ForwardPlan``), ``seqused_k``, over ``k_cache[:batch]``;
4. ``[decode guard]`` as in the decode kernels: a sequence whose ``cache_seqlens[b]`` is negative or leaves no
   room for the new tokens (a device value, not checked before the call on CuPy) appends nothing (its slots are
   written with the values they hold), reads no key (``seqused_k`` 0) and gets NaN in its output rows and lse
   (CUDA: its ``seqused_k`` is -1, and the forward writes NaN rows for a negative count).

``[prefill append]`` (CUDA, ``cuflash._cuda.decode.FUSED_PREFILL_APPEND``; on by default where the forward takes its
TMA entry point): steps 2 and 3 in one launch, the TMA forward appending as it goes (each key tile copied from the
cache or from ``k`` / ``v`` themselves, the new rows written into the cache by the blocks of each key/value head's
first query head, the key count ``cache_seqlens[b] + seqlen_new`` or -1 computed by each block): the same values, the
same output; this composition is its reference too.

When it applies (:func:`eligible`): ``seqlen_q >= MIN_SEQLEN_Q``, a contiguous cache (no ``block_table``), no
``cache_leftpad`` (the forward's keys start at slot 0) and no ``cache_batch_idx`` (row ``b`` of the cache is batch
entry ``b``), ``head_dim_v == head_dim``. The CUDA backend dispatches to it; the NumPy backend keeps its decode
reference (the step tags of the decode kernels), and the tests run this composition on NumPy against it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .kvcache import KVCache, Rotary
from .variant import Variant
from ..reference.decode import apply_rotary

__all__ = ["MIN_SEQLEN_Q", "eligible", "forward_over_cache", "bits"]

# From this many query tokens on, the forward kernels run the call (CUDA backend). At seqlen_q 64 with GQA group 4
# a key/value byte serves 256 query rows, near the H100's ridge of ~300 FLOPs per byte; below it the decode kernels'
# small tiles waste less. To be tuned by `python -m cuflash bench-decode --prefill` on the GPU.
MIN_SEQLEN_Q = 64


def bits(a):
    """A 16-bit float array seen as uint16 (an indexed assignment moves bits: no dependence on the array library's
    bfloat16 support), any other array as it is."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def eligible(seqlen_q: int, cache: KVCache, head_dim: int, head_dim_v: int) -> bool:
    """Whether a decode call of these shapes runs as the forward over the cache (see the module's docstring)."""
    return (seqlen_q >= MIN_SEQLEN_Q and cache.block_table is None and cache.cache_leftpad is None
            and cache.cache_batch_idx is None and head_dim == head_dim_v)


def forward_over_cache(q, k_cache, v_cache, k, v, cache_seqlens, *, rotary: Rotary | None, scale: float,
                       variant: Variant, forward, xp):
    """``(out, lse)`` of a decode call over a contiguous cache, appending ``k``, ``v`` first (in place).

    ``cache_seqlens``: int32 ``(batch,)`` of ``xp``; ``variant``: the decode call's (bottom-right causal masking,
    window, softcap, ALiBi slopes ``(batch, heads_q)``), to which ``seqused_k`` is added; ``forward``: a backend's
    ``forward(q, k, v, *, scale, variant, algorithm, block_q, block_k)``.
    """
    batch, seqlen_q = q.shape[:2]
    seqlen_new = 0 if k is None else k.shape[1]
    # [decode guard] a sequence out of range takes slot 0 for its positions below, and appends and reads nothing
    in_range = (cache_seqlens >= 0) & (cache_seqlens <= k_cache.shape[1] - seqlen_new)
    seqlens = xp.where(in_range, cache_seqlens, 0)
    starts = seqlens.astype(xp.int64)[:, None]
    if rotary is not None:
        # [decode rotary] query token i at cache_seqlens[b] + i (or cache_seqlens[b]), new key i at cache_seqlens[b] + i
        q_steps = xp.arange(seqlen_q) if rotary.consecutive_q else xp.zeros(seqlen_q, dtype=xp.int64)
        q = apply_rotary(q, rotary.cos, rotary.sin, starts + q_steps[None, :], rotary.interleaved, xp=xp)
        if seqlen_new:
            k = apply_rotary(k, rotary.cos, rotary.sin, starts + xp.arange(seqlen_new)[None, :], rotary.interleaved,
                             xp=xp)
    if seqlen_new:
        # [decode append] row b, slots cache_seqlens[b] .. + seqlen_new - 1, v first then k
        rows, slots = xp.arange(batch)[:, None], starts + xp.arange(seqlen_new)[None, :]
        keep = ~in_range[:, None, None, None]  # [decode guard] those slots get the values they hold
        bits(v_cache)[rows, slots] = xp.where(keep, bits(v_cache)[rows, slots], bits(v))
        bits(k_cache)[rows, slots] = xp.where(keep, bits(k_cache)[rows, slots], bits(k))
    # [prefill lengths] the keys the forward reads of each sequence
    seqused_k = xp.where(in_range, seqlens + seqlen_new, 0).astype(xp.int32)
    variant = dataclasses.replace(variant, seqused_k=seqused_k)
    out, lse = forward(q, k_cache[:batch], v_cache[:batch], scale=scale, variant=variant, algorithm="fa2",
                       block_q=None, block_k=None)
    # [decode guard] the rows of a sequence out of range NaN (through the bits: no bfloat16 arithmetic needed)
    bad = ~in_range
    bits(out)[...] = xp.where(bad[:, None, None, None], _nan_bits(out.dtype), bits(out))
    lse[...] = xp.where(bad[:, None, None], xp.nan, lse)
    return out, lse


def _nan_bits(dtype):
    """A quiet NaN of ``dtype``, as :func:`bits` sees an array of it."""
    name = np.dtype(dtype).name
    if name == "float16":
        return np.uint16(0x7E00)
    if name == "bfloat16":
        return np.uint16(0x7FC0)
    return np.dtype(dtype).type(np.nan)
