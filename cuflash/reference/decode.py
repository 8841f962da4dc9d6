"""The NumPy backend of decoding with a KV cache: rotary, the in-place append, paged gathers, split-KV and the merge.

It follows the structure of the decode kernels (flash-decoding), step for step, with the tags that mark each step
on both sides (``grep -rn "decode split" cuflash cuflash_kernels``; the list is in ``docs/architecture.md``):

1. ``[decode rotary]`` q and the new keys are rotated at their positions (their slots in the sequence's cache),
   in the accumulation dtype, and rounded to the input dtype.
2. ``[decode append]`` the new keys (rotated) and values are written into the cache at slots
   ``cache_seqlens[b] ..`` of each sequence, in place: nothing else of the cache changes.
3. ``[decode pack]`` GQA packing: a tile holds the rows of every query head of one key/value head for a run of
   query tokens (``block_m`` rows: ``block_m // group`` tokens times the ``group`` heads), so that each key/value
   tile is loaded once for all of them. Here the tile is ``(1, heads_kv, group, tokens, d)``: every key/value
   head's tiles at once, the group axis broadcast against one K/V load, as in :mod:`cuflash.reference`.
4. ``[decode split]`` the key tiles that the tile's rows can see (on the grid of multiples of ``block_n`` in the
   sequence's key positions, bounded by the band) are cut into ``num_splits`` parts
   (:func:`cuflash._ops.blocks.split_range`); each part runs FlashAttention-2's online softmax over its tiles
   (``[fa2-fwd 2]`` .. ``[fa2-fwd 6]``) and leaves a normalized partial output ``o_s`` and its ``lse_s`` in
   float32 (float64 for float64 inputs), ``lse_s = -inf`` for a part with no visible key.
5. ``[decode page]`` key position ``j`` of sequence ``b`` is slot ``p = cache_leftpad[b] + j``: row
   ``cache_batch_idx[b]`` of a contiguous cache, or page ``block_table[b, p // page_size]``, slot
   ``p % page_size`` of a paged one; a tile of keys is gathered slot by slot (any page size, pages in any order).
6. ``[decode merge]`` the parts are combined exactly (:func:`cuflash._ops.merge.merge_stacked`, the same math as
   :func:`cuflash.merge_states`) and cast to the input dtype. With one split the part is the output (no merge).

``[decode guard]`` index values out of range, as the kernels treat them (they cannot be checked on the host
before a CUDA launch without a synchronization): a sequence whose ``cache_seqlens[b]`` is negative or leaves no
room for the new tokens, whose ``cache_leftpad[b]`` is negative or past ``cache_seqlens[b]``, or whose
``cache_batch_idx[b]`` names no cache row appends nothing and gets NaN in all its output rows and lse; a
``block_table`` entry naming no page is neither written nor read (its slots load as zeros), and the rows of every
tile whose split read one of its slots get NaN (a NaN part makes the merged row NaN). Nothing is read or written
out of bounds, and nothing else changes.

The score hooks (softcap, ALiBi, the band of causal masking and windows, ``[variant mod]`` / ``[variant mask]``)
are those of :mod:`cuflash.reference` (its ``_scores``), with bottom-right alignment: query token ``i`` of
``seqlen_q`` faces key ``i + len_k - seqlen_q``.

Like every backend it trusts the shapes and dtypes of its arguments: the front door
(:func:`cuflash.attention_with_kvcache`) has checked them, and on NumPy the index values too (a bad one raises
there); the guards above make the reference behave as the kernels where a value was not checked.
"""

from __future__ import annotations

import numpy as np

from .._ops import merge as _merge
from .._ops.blocks import iter_blocks, key_range, split_range, tile_is_fully_masked
from .._ops.kvcache import KVCache, Rotary
from .._ops.variant import Variant
from . import (_acc_dtype, _cast_like_kernel, _finish_lse, _grouped, _grouped_rows, _load, _online_softmax_step,
               _score_mods, _scores)

__all__ = ["forward_kvcache", "apply_rotary", "rotary_positions"]


def apply_rotary(x, cos, sin, positions, interleaved: bool, xp=np):
    """``x`` ``(batch, seqlen, heads, d)`` with its first ``rotary_dim = 2 * cos.shape[1]`` dims of every head rotated
    by the angles of row ``positions[b, i]`` of ``cos`` / ``sin`` (``positions``: ``(batch, seqlen)`` ints); a new
    array in ``x``'s dtype, computed in the accumulation dtype. ``xp``: the arrays' module (the CUDA backend's
    [decode rotary] passes CuPy).

    Each pair ``(x1, x2)`` becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``: pairs ``(x[2i], x[2i + 1])`` when
    ``interleaved`` (GPT-J), ``(x[i], x[i + rotary_dim / 2])`` otherwise (GPT-NeoX).
    """
    acc = _acc_dtype(x.dtype)
    half = cos.shape[1]
    c = xp.asarray(cos[positions], dtype=acc)[:, :, None, :]       # (batch, seqlen, 1, half): rows gathered first
    s = xp.asarray(sin[positions], dtype=acc)[:, :, None, :]
    rotated = xp.array(x, dtype=acc)                               # a contiguous copy
    if interleaved:
        x1, x2 = rotated[..., 0:2 * half:2].copy(), rotated[..., 1:2 * half:2].copy()
        rotated[..., 0:2 * half:2] = x1 * c - x2 * s
        rotated[..., 1:2 * half:2] = x2 * c + x1 * s
    else:
        x1, x2 = rotated[..., :half].copy(), rotated[..., half:2 * half].copy()
        rotated[..., :half] = x1 * c - x2 * s
        rotated[..., half:2 * half] = x2 * c + x1 * s
    return rotated.astype(x.dtype, copy=False)


def rotary_positions(starts: np.ndarray, count: int, consecutive: bool = True) -> np.ndarray:
    """``(batch, count)`` positions: ``starts[b] + i`` (``consecutive``), or ``starts[b]`` for every ``i``."""
    steps = np.arange(count) if consecutive else np.zeros(count, np.int64)
    return np.asarray(starts, np.int64)[:, None] + steps[None, :]


class _Slots:
    """``[decode page]`` Where the keys of sequence ``b`` are: key position ``j`` is slot ``leftpad + j`` of the
    sequence, and slot ``p`` is ``cache[row, p]`` (contiguous) or ``cache[block_table[b, p // page_size],
    p % page_size]`` (paged)."""

    def __init__(self, cache: KVCache, host: dict, b: int, num_pages: int):
        self.leftpad = int(host["leftpad"][b])
        self.row = int(host["batch_idx"][b])
        self.pages = None if host["block_table"] is None else host["block_table"][b]
        self.page_size = cache.page_size
        self.num_pages = num_pages
        self.page_fault = False  # [decode guard] a slot loaded since the last take_fault() had no page

    def index(self, first: int, stop: int):
        """Indices into axes 0 and 1 of the cache of slots ``[first, stop)``, and which of them exist (``[decode
        guard]``: a slot whose page id is out of range does not; its indices are 0, to be masked)."""
        slots = np.arange(first, stop)
        if self.pages is None:
            return self.row, slots, np.ones(slots.shape, bool)
        pages = self.pages[slots // self.page_size]
        ok = (pages >= 0) & (pages < self.num_pages)
        return np.where(ok, pages, 0), np.where(ok, slots % self.page_size, 0), ok

    def load(self, cache_array: np.ndarray, k_start: int, k_stop: int, acc) -> np.ndarray:
        """Keys ``[k_start, k_stop)`` of one cache as a ``(1, heads_kv, 1, cols, d)`` block in ``acc``; slots without
        a page read as zeros and set ``page_fault``."""
        rows, slots, ok = self.index(self.leftpad + k_start, self.leftpad + k_stop)
        tile = np.where(ok[:, None, None], cache_array[rows, slots], 0)  # (cols, heads_kv, d): a gather
        self.page_fault |= not ok.all()
        return np.ascontiguousarray(tile.transpose(1, 0, 2)[None, :, None], dtype=acc)

    def take_fault(self) -> bool:
        """Whether a slot without a page was loaded since the last call (and reset)."""
        fault, self.page_fault = self.page_fault, False
        return fault


def _host_values(cache: KVCache, batch: int) -> dict:
    """The index arrays as int64 NumPy arrays (``leftpad`` 0 and ``batch_idx`` ``b`` where not given)."""
    return {
        "seqlens": np.asarray(cache.cache_seqlens, np.int64),
        "leftpad": np.zeros(batch, np.int64) if cache.cache_leftpad is None else np.asarray(cache.cache_leftpad, np.int64),
        "batch_idx": np.arange(batch) if cache.cache_batch_idx is None else np.asarray(cache.cache_batch_idx, np.int64),
        "block_table": None if cache.block_table is None else np.asarray(cache.block_table, np.int64),
    }


def _in_range(k_cache, cache: KVCache, host: dict) -> np.ndarray:
    """``[decode guard]`` ``(batch,)`` bool: whether each sequence's index values are in range (the kernels'
    ``sequence_in_range``): ``cache_seqlens[b]`` in ``[0, capacity - seqlen_new]``, ``cache_leftpad[b]`` in ``[0,
    cache_seqlens[b]]`` and, for a contiguous cache, ``cache_batch_idx[b]`` a row of it."""
    seqlens, leftpad = host["seqlens"], host["leftpad"]
    ok = (seqlens >= 0) & (seqlens <= cache.capacity - cache.seqlen_new) & (leftpad >= 0) & (leftpad <= seqlens)
    if host["block_table"] is None:
        ok &= (host["batch_idx"] >= 0) & (host["batch_idx"] < k_cache.shape[0])
    return ok


def _rotate(q, k, rotary: Rotary, seqlens: np.ndarray):
    """``[decode rotary]`` q at ``cache_seqlens[b] + i`` (or ``cache_seqlens[b]``), new key ``i`` at
    ``cache_seqlens[b] + i``."""
    q_rot = apply_rotary(q, rotary.cos, rotary.sin, rotary_positions(seqlens, q.shape[1], rotary.consecutive_q),
                         rotary.interleaved)
    k_rot = apply_rotary(k, rotary.cos, rotary.sin, rotary_positions(seqlens, k.shape[1]), rotary.interleaved)
    return q_rot, k_rot


def _append(k_cache, v_cache, k, v, cache: KVCache, host: dict, in_range: np.ndarray) -> None:
    """``[decode append]`` new token ``i`` of sequence ``b`` into slot ``cache_seqlens[b] + i`` of both caches, in
    place. v is written first, then k: where the two caches share memory (MLA's ``v_cache = k_cache[..., :dv]``)
    the cache holds k's values. ``[decode guard]`` a sequence out of range appends nothing, a slot without a page
    is not written. (The GPU fuses this step into the split kernel, which reads the new tokens from ``k``, ``v``
    and writes the same slots: the same caches and the same result as appending first, as here.)"""
    for b in np.flatnonzero(in_range):
        start = int(host["seqlens"][b])
        slots = _Slots(cache, host, b, k_cache.shape[0])
        rows, columns, ok = slots.index(start, start + k.shape[1])
        v_cache[rows[ok] if np.ndim(rows) else rows, columns[ok]] = v[b][ok]
        k_cache[rows[ok] if np.ndim(rows) else rows, columns[ok]] = k[b][ok]


def forward_kvcache(q, k_cache, v_cache, k, v, *, cache: KVCache, scale: float, variant: Variant, out=None):
    """Decode attention with a KV cache: ``(out, lse)``; appends ``k``, ``v`` (when given) into the caches first.

    ``out`` (optional) receives the output in place. ``lse`` is ``(batch, heads_q, seqlen_q)`` in the accumulation
    dtype. Sequence ``b`` attends over its ``cache_seqlens[b] + seqlen_new - cache_leftpad[b]`` keys.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    dtype, acc = q.dtype, _acc_dtype(q.dtype)
    host = _host_values(cache, batch)
    in_range = _in_range(k_cache, cache, host)
    if cache.rotary is not None:
        q, k = _rotate(q, k, cache.rotary, np.where(in_range, host["seqlens"], 0))
    if k is not None and k.shape[1]:
        _append(k_cache, v_cache, k, v, cache, host, in_range)

    head_dim_v = v_cache.shape[-1]
    if out is None:
        out = np.zeros((batch, seqlen_q, heads_q, head_dim_v), dtype)
    else:
        out[...] = 0
    lse = np.full((batch, heads_q, seqlen_q), -np.inf, acc)
    if 0 in (batch, seqlen_q, heads_q):
        return out, lse
    for b in range(batch):
        if not in_range[b]:  # [decode guard] the sequence's rows NaN
            out[b] = np.nan
            lse[b] = np.nan
            continue
        len_k = int(host["seqlens"][b]) + cache.seqlen_new - int(host["leftpad"][b])
        if len_k == 0:
            continue  # no key: out stays 0, lse -inf
        mods = _score_mods(variant, scale, q[b:b + 1], k_cache, slice(b, b + 1), np.array([b]), seqlen_q, len_k)
        slots = _Slots(cache, host, b, k_cache.shape[0])
        _decode_sequence(q[b:b + 1], k_cache, v_cache, out[b:b + 1], lse[b:b + 1], slots, mods, len_k, cache)
    return out, lse


def _decode_sequence(q, k_cache, v_cache, out, lse, slots: _Slots, mods, len_k: int, cache: KVCache) -> None:
    """One sequence: ``q``, ``out`` ``(1, seqlen_q, heads_q, d)`` views, ``lse`` ``(1, heads_q, seqlen_q)``."""
    dtype, acc = q.dtype, _acc_dtype(q.dtype)
    seqlen_q, heads_q = q.shape[1], q.shape[2]
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    q5, out5, lse4 = _grouped(q, heads_kv), _grouped(out, heads_kv), _grouped_rows(lse, heads_kv)
    # [decode pack] block_m packed rows = (query token, query head of the group): block_m // group tokens per tile
    tokens = max(cache.block_m // group, 1)
    for q_start, q_stop in iter_blocks(0, seqlen_q, tokens, seqlen_q):
        # [decode pack] the rows of every query head that reads a key/value head, for tokens [q_start, q_stop)
        q_i = _load(q5, q_start, q_stop, acc)
        first, end = key_range(q_start, q_stop, mods.band, len_k)
        tiles = list(iter_blocks(first, end, cache.block_n, len_k))
        parts = []
        for split in range(cache.num_splits):
            # [decode split] part `split` of the visible key tiles, one thread block each on the GPU
            lo, hi = split_range(0, len(tiles), cache.num_splits, split)
            parts.append(_split_partial(q_i, k_cache, v_cache, slots, tiles[lo:hi], mods, q_start, q_stop, dtype))
        if len(parts) == 1:
            o, lse_i = parts[0]
        else:
            # [decode merge] lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s
            o, lse_i = _merge.merge_stacked(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]), np)
        out5[..., q_start:q_stop, :] = o
        lse4[..., q_start:q_stop] = lse_i


def _split_partial(q_i, k_cache, v_cache, slots: _Slots, tiles, mods, q_start, q_stop, dtype):
    """``[decode split]`` FlashAttention-2's inner loop over the key tiles of one split: ``(o_s, lse_s)``, ``o_s``
    normalized (zeros and ``lse_s = -inf`` where the rows see no key of the split; NaN where a slot had no page), in
    the accumulation dtype."""
    acc_dtype = q_i.dtype
    m_i = np.full(q_i.shape[:-1], -np.inf, acc_dtype)
    l_i = np.zeros(q_i.shape[:-1], acc_dtype)
    acc = np.zeros(q_i.shape[:-1] + v_cache.shape[-1:], acc_dtype)
    slots.take_fault()
    for k_start, k_stop in tiles:
        assert not tile_is_fully_masked(q_start, q_stop, k_start, k_stop, mods.band)
        # [decode page] gather the tile's keys and values slot by slot through the block table
        k_j = slots.load(k_cache, k_start, k_stop, acc_dtype)
        v_j = slots.load(v_cache, k_start, k_stop, acc_dtype)
        # [fa2-fwd 2] S = scale * Q K^T (modified and masked)
        s, _ = _scores(q_i, k_j, mods, q_start, q_stop, k_start, k_stop)
        p, m_new = _online_softmax_step(s, m_i, l_i, acc)  # [fa2-fwd 3], [fa2-fwd 4]
        # [fa2-fwd 5] acc += P V, P rounded to the input dtype first
        acc += _cast_like_kernel(p, dtype) @ v_j
        m_i = m_new
    # [fa2-fwd 6] o_s = acc / l, lse_s = m + log l
    l_safe, lse_s = _finish_lse(m_i, l_i)
    acc /= l_safe[..., None]
    if slots.take_fault():  # [decode guard] a slot of the split had no page: its rows NaN
        acc[...] = np.nan
        lse_s[...] = np.nan
    return acc, lse_s
