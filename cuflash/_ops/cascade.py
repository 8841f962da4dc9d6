"""Shared-prefix (cascade) attention: many sequences that begin with the same keys read them once, not once each.

Sequence ``b`` of a batch attends over a shared prefix (``k_prefix``, ``v_prefix``: ``prefix_len`` keys, the same
for every sequence, a system prompt say) followed by its own keys in a KV cache (its suffix). Prefix and suffix
are disjoint key sets, so the attention over their union is the exact merge of the attention over each
(``docs/decoding.md``, "Split-KV"). :func:`cascade_attention` composes it from public operations, so that NumPy and
CuPy arrays both run it:

1. ``[cascade prefix]`` the queries of the whole batch, packed as the rows of one long query sequence, attend over
   the prefix in one :func:`cuflash.attention` call (not causal: the prefix comes before every query). The rows are
   GQA-packed as in the decode kernels' ``[decode pack]``: row ``(b, i, g)`` (sequence, query token, query head of
   the group) of key/value head ``h``, so each prefix key/value head is read once for all ``batch * seqlen_q *
   group`` rows that read it. To keep a GPU busy when those rows make few tiles, the prefix is cut into
   ``prefix_splits`` equal chunks that run as the batch axis of the same call (split-KV over the prefix).
2. ``[cascade suffix]`` each sequence's own keys through :func:`cuflash.attention_with_kvcache` (appending ``k``,
   ``v`` in place first, causal masking within the suffix), ``return_lse=True``.
3. ``[cascade merge]`` the prefix chunks' and the suffix's ``(o, lse)`` merged exactly
   (:func:`cuflash._ops.merge.merge_stacked`, the merge of :func:`cuflash.merge_states`), in float32 (float64 for
   float64), cast to the input dtype. An empty suffix (``lse = -inf``) has weight 0.

The prefix's keys and values are read ``heads_kv`` times in all (once per key/value head) instead of ``batch *
heads_kv`` times: for a batch of 64, a 64-fold saving on the prefix's memory traffic.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import merge as _merge

__all__ = ["check_prefix", "prefix_chunks", "cascade"]

# The automatic prefix split: enough (GQA-packed query tile, key/value head, chunk) thread blocks to fill an H100
# (132 SMs, as the decode split rule), each chunk keeping at least MIN_CHUNK keys (below that the merge costs more
# than the parallelism gains), the count dividing prefix_len (the chunks are a view of the prefix).
_SMS = 132
_ROWS_PER_TILE = 128
MIN_CHUNK = 512


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name if not hasattr(dtype, "name") else str(dtype.name)


def check_prefix(q, k_prefix, v_prefix, k_cache, v_cache, prefix_splits) -> int:
    """The shared prefix's arrays against q and the caches (the rest is checked by the two calls): returns
    ``prefix_splits`` as an int. Raises before anything is computed or appended."""
    for name, a in (("k_prefix", k_prefix), ("v_prefix", v_prefix)):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{name} must be an array (prefix_len, heads_kv, head_dim) of q's library; got "
                            f"{type(a).__name__}")
        if type(a).__module__.split(".")[0] != type(q).__module__.split(".")[0]:
            raise TypeError(f"{name} must be an array of q's library ({type(q).__module__.split('.')[0]}); got "
                            f"{type(a).__module__.split('.')[0]}")
        if a.ndim != 3:
            raise ValueError(f"{name} must have shape (prefix_len, heads_kv, head_dim): one sequence shared by the "
                             f"batch; got {a.ndim} dimensions with shape {tuple(a.shape)}")
        if np.dtype(a.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{name} must have q's dtype {_dtype_name(q.dtype)}; got {_dtype_name(a.dtype)}")
    for cache_name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not hasattr(cache, "shape") or len(cache.shape) != 4:
            return _splits(prefix_splits, k_prefix.shape[0])  # attention_with_kvcache names the bad cache
    if k_prefix.shape[0] != v_prefix.shape[0]:
        raise ValueError(f"k_prefix and v_prefix must hold the same keys: prefix_len {k_prefix.shape[0]} and "
                         f"{v_prefix.shape[0]}")
    heads_kv, d, dv = k_cache.shape[2], q.shape[-1], v_cache.shape[-1]
    expected = {"k_prefix": (heads_kv, d), "v_prefix": (heads_kv, dv)}
    for name, a in (("k_prefix", k_prefix), ("v_prefix", v_prefix)):
        if tuple(a.shape[1:]) != expected[name]:
            cache = "k_cache" if name == "k_prefix" else "v_cache"
            raise ValueError(f"{name} must have shape (prefix_len, heads_kv, head_dim) = (prefix_len, "
                             f"{expected[name][0]}, {expected[name][1]}) as {cache}'s heads and head dim; got "
                             f"{tuple(a.shape)}")
    return _splits(prefix_splits, k_prefix.shape[0])


def _splits(value, prefix_len: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise TypeError(f"prefix_splits must be a non-negative int (0: chosen from the shapes); got "
                        f"{type(value).__name__} {value!r}")
    value = int(value)
    if value > 1 and prefix_len % value:
        raise ValueError(f"prefix_splits must divide prefix_len {prefix_len} (the chunks are equal views of the "
                         f"prefix); got {value}")
    return value


def prefix_chunks(prefix_len: int, rows: int, heads_kv: int) -> int:
    """The automatic prefix split for ``rows`` GQA-packed query rows per key/value head: 1 when the unsplit call's
    blocks already nearly fill the GPU (0.8 of ``_SMS``, as the decode split rule), else the smallest count that
    gives at least ``_SMS`` blocks, at most ``prefix_len // MIN_CHUNK``, lowered to a divisor of ``prefix_len``."""
    blocks = -(-max(rows, 1) // _ROWS_PER_TILE) * max(heads_kv, 1)
    if blocks >= 0.8 * _SMS:
        return 1
    want = min(-(-_SMS // blocks), prefix_len // MIN_CHUNK)
    return max(n for n in range(1, max(want, 1) + 1) if prefix_len % n == 0) if want > 1 else 1


def _bits(a):
    """A bfloat16 array seen as uint16 (copies and reshapes move bits; CuPy before its bfloat16 support has no
    kernels for ml_dtypes' bfloat16), any other array as it is."""
    return a.view(np.uint16) if np.dtype(a.dtype).name == "bfloat16" else a


def _to_acc(a, acc, xp):
    """``a`` in the accumulation dtype; bfloat16 widened through its bits (exact)."""
    if np.dtype(a.dtype).name == "bfloat16" and np.dtype(acc) == np.float32:
        return (a.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a.astype(acc)


def _from_acc(a, dtype, xp):
    """float32 ``a`` rounded to ``dtype``; to bfloat16 through the bits, to nearest even (finite values; the merge
    makes no NaN or infinity)."""
    if np.dtype(dtype).name == "bfloat16" and a.dtype == np.float32:
        u = xp.ascontiguousarray(a).view(np.uint32)
        u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
        return (u >> np.uint32(16)).astype(np.uint16).view(dtype)
    return a.astype(dtype)


def _to_rows(x, heads_kv: int):
    """``(batch, seqlen_q, heads_q, ...)`` -> ``(heads_kv, rows, ...)``, row ``(b, i, g)`` of head ``h`` being query
    head ``h * group + g`` of token ``i`` of sequence ``b`` (the ``[decode pack]`` order)."""
    batch, seqlen_q, heads_q = x.shape[:3]
    group = heads_q // heads_kv
    x = x.reshape(batch, seqlen_q, heads_kv, group, *x.shape[3:])
    x = x.transpose(2, 0, 1, 3, *range(4, x.ndim))
    return x.reshape(heads_kv, batch * seqlen_q * group, *x.shape[4:])


def _from_rows(x, batch: int, seqlen_q: int, heads_q: int):
    """The inverse of :func:`_to_rows`."""
    heads_kv = x.shape[0]
    x = x.reshape(heads_kv, batch, seqlen_q, heads_q // heads_kv, *x.shape[2:])
    return x.transpose(1, 2, 0, 3, *range(4, x.ndim)).reshape(batch, seqlen_q, heads_q, *x.shape[4:])


def cascade(q, k_prefix, v_prefix, suffix, *, prefix_splits: int, softcap: float, softmax_scale, attention, xp):
    """``(out, lse)``: the prefix part (:func:`cuflash.attention`, passed as ``attention``), the suffix part
    (``suffix()``: ``attention_with_kvcache(..., return_lse=True)``, called after the prefix part so that nothing is
    appended when the prefix call fails) and their merge. ``out`` in q's dtype, ``lse`` ``(batch, heads_q,
    seqlen_q)`` float32 (float64 for float64)."""
    batch, seqlen_q, heads_q, d = q.shape
    prefix_len, heads_kv = k_prefix.shape[0], k_prefix.shape[1]
    if heads_kv == 0 or heads_q % heads_kv:
        return suffix()  # no key/value head (or no GQA grouping): attention_with_kvcache's checks say what holds
    rows = batch * seqlen_q * (heads_q // heads_kv)
    n = prefix_splits or prefix_chunks(prefix_len, rows, heads_kv)
    n = 1 if prefix_len == 0 else n
    # [cascade prefix] q as (1, rows, heads_kv, d), repeated once per chunk; the chunks: a view of the prefix
    q_rows = _to_rows(_bits(q), heads_kv).transpose(1, 0, 2)[None]              # (1, rows, heads_kv, d)
    if n > 1:
        q_rows = xp.ascontiguousarray(xp.broadcast_to(q_rows, (n, *q_rows.shape[1:])))
    q_rows = q_rows.view(q.dtype)
    chunk = prefix_len // n
    k_chunks = k_prefix.reshape(n, chunk, *k_prefix.shape[1:])
    v_chunks = v_prefix.reshape(n, chunk, *v_prefix.shape[1:])
    o_p, lse_p = attention(q_rows, k_chunks, v_chunks, softcap=softcap, softmax_scale=softmax_scale,
                           return_lse=True)                                      # (n, rows, hkv, dv), (n, hkv, rows)
    # [cascade suffix] each sequence's own keys, appending first
    o_s, lse_s = suffix()
    # [cascade merge] n + 1 disjoint key sets of every row, merged exactly
    acc = lse_s.dtype
    o_parts = xp.concatenate([_to_acc(o_p.transpose(0, 2, 1, 3), acc, xp),
                              _to_acc(xp.ascontiguousarray(_to_rows(_bits(o_s), heads_kv)).view(o_s.dtype), acc,
                                      xp)[None]])
    lse_rows = _to_rows(lse_s.transpose(0, 2, 1), heads_kv)                       # (hkv, rows)
    lse_parts = xp.concatenate([lse_p.astype(acc), lse_rows[None].astype(acc)])
    o, lse = _merge.merge_stacked(o_parts, lse_parts, xp)                       # (hkv, rows, dv), (hkv, rows)
    out = _from_acc(_from_rows(o, batch, seqlen_q, heads_q), q.dtype, xp)
    lse = xp.ascontiguousarray(_from_rows(lse, batch, seqlen_q, heads_q).transpose(0, 2, 1))
    return out, lse
