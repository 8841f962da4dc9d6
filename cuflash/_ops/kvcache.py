"""The normalized options of decoding with a KV cache (:func:`cuflash.attention_with_kvcache`).

The front door (:mod:`cuflash._ops.api`) checks the user's arguments (:func:`cuflash._ops.validate.kvcache`) and hands
each backend one :class:`KVCache` beside the usual :class:`~cuflash._ops.variant.Variant` (causal masking, window,
softcap, ALiBi). Its meaning, for batch entry ``b`` (``docs/decoding.md``):

- the cache of the sequence holds its keys in slots ``cache_leftpad[b] .. cache_seqlens[b] - 1`` (``leftpad``
  0 when not given); a call with new keys ``k``, ``v`` of ``seqlen_new`` tokens writes them (after rotary) into
  slots ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``, then attends over slots
  ``cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1``: ``len_k = cache_seqlens[b] + seqlen_new -
  cache_leftpad[b]`` keys, key ``j`` of the sequence being slot ``cache_leftpad[b] + j``;
- slot ``p`` lives at ``k_cache[cache_batch_idx[b], p]`` (``cache_batch_idx[b] = b`` when not given), or, for a
  paged cache, at ``k_cache[block_table[b, p // page_size], p % page_size]``;
- rotary positions are slots: new key ``i`` is rotated at position ``cache_seqlens[b] + i``, query token ``i``
  at ``cache_seqlens[b] + i`` (``Rotary.consecutive_q``: causal or windowed calls) or at ``cache_seqlens[b]``
  (every token of q, as flash-attention does for calls without a causal or local mask).

Backends trust these values: shapes, dtypes and (where readable) the device-resident values were checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Rotary", "KVCache"]


@dataclass(frozen=True, eq=False)
class Rotary:
    """Rotary embedding of q and the new keys.

    Attributes
    ----------
    cos, sin : arrays ``(seqlen_ro, rotary_dim // 2)``, floating, of q's library: row ``p`` holds the angles'
        cosines and sines at position ``p``.
    interleaved : bool
        True: pairs ``(x[2i], x[2i + 1])`` are rotated (GPT-J); False: pairs ``(x[i], x[i + rotary_dim / 2])``
        (GPT-NeoX). Dims from ``rotary_dim`` on are left as they are.
    consecutive_q : bool
        Query token ``i`` sits at position ``cache_seqlens[b] + i`` (True) or every token at
        ``cache_seqlens[b]`` (False).
    """

    cos: Any
    sin: Any
    interleaved: bool
    consecutive_q: bool

    @property
    def dim(self) -> int:
        """``rotary_dim``: the leading dims of each head that are rotated (even, at most ``head_dim``)."""
        return 2 * int(self.cos.shape[1])


@dataclass(frozen=True, eq=False)
class KVCache:
    """Where the keys of each sequence are and what the call appends (see the module's docstring).

    Attributes
    ----------
    cache_seqlens : array
        int32 ``(batch,)``, of q's library (an int given by the user arrives as a full array): the end of each
        sequence's cached keys before this call's append (a slot index, counting the left padding).
    cache_leftpad : array or None
        int32 ``(batch,)``: the first used slot of each sequence (None: 0).
    cache_batch_idx : array or None
        int32 ``(batch,)``: the cache row of each batch entry (contiguous caches only; None: ``b``).
    block_table : array or None
        int32 ``(batch, max_pages)``: the pages of each sequence (None: a contiguous cache).
    page_size : int or None
        Slots per page (``k_cache.shape[1]``) when paged: any size from 1.
    capacity : int
        The slots a sequence can address: ``k_cache.shape[1]``, or ``max_pages * page_size`` paged.
    seqlen_new : int
        New keys per sequence (0 without ``k``, ``v``).
    rotary : Rotary or None
    num_splits : int
        Parts each sequence's visible key tiles are split into (>= 1; the automatic count already chosen by
        :func:`cuflash._ops.blocks.decode_num_splits`); 1 means no merge.
    block_m, block_n : int
        Packed query rows and keys per tile (:func:`cuflash._ops.blocks.decode_block_sizes`).
    """

    cache_seqlens: Any
    cache_leftpad: Any = None
    cache_batch_idx: Any = None
    block_table: Any = None
    page_size: int | None = None
    capacity: int = 0
    seqlen_new: int = 0
    rotary: Rotary | None = None
    num_splits: int = 1
    block_m: int = 64
    block_n: int = 128

    @property
    def paged(self) -> bool:
        return self.block_table is not None


# One int ``cache_seqlens`` for every sequence becomes an int32 array (batch,) for the kernels. A decode loop passes a
# new int every step (transformers' caches: the length so far): rather than fill a new device array each time (a
# kernel launch and an allocation), CuPy reads a row of a table whose row v holds v (batch,) times, kept per
# (device, batch) and grown by doubling; tables above 4 Mi elements are not kept (a plain fill instead).
_SEQLEN_TABLES: dict = {}
_TABLE_LIMIT = 1 << 22


def _capturing(xp) -> bool:
    """Whether the current stream is capturing a CUDA graph (a runtime that cannot tell: as if it were). A table
    made or grown during a capture would hold its rows only in the graph's replays, and one grown later would free
    the rows a graph reads: a capture gets an array of its own."""
    try:
        return bool(xp.cuda.get_current_stream().is_capturing())
    except Exception:
        return True


def uniform_seqlens_address(device: int, batch: int, value: int) -> int | None:
    """The device address of :func:`uniform_seqlens`' row for ``value`` where the kept table of ``(device, batch)``
    holds it already; None otherwise (the caller's other way makes or grows it)."""
    table = _SEQLEN_TABLES.get((device, batch))
    if table is None or not 0 <= value < table.shape[0]:
        return None
    return table.data.ptr + value * batch * 4


def uniform_seqlens(xp, batch: int, value: int):
    """An int32 array ``(batch,)`` of ``value`` (not to be written: on CuPy, a view of a shared table)."""
    if xp.__name__ != "cupy" or (value + 1) * batch > _TABLE_LIMIT or _capturing(xp):
        return xp.full((batch,), value, dtype="int32")
    key = (xp.cuda.runtime.getDevice(), batch)
    table = _SEQLEN_TABLES.get(key)
    if table is None or table.shape[0] <= value:
        rows = min(max(2 * value + 2, 1024), _TABLE_LIMIT // batch)
        table = _SEQLEN_TABLES[key] = xp.broadcast_to(xp.arange(rows, dtype="int32")[:, None], (rows, batch)).copy()
    return table[value]
