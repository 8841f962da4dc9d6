"""Context parallelism without a framework: which blocks a rank computes in each ring step, and the ring itself.

The plans (:func:`_step_plan`, :func:`_band_plan`, :func:`_plan`) are host arithmetic on chunk positions; the ring
loops (:func:`_ring_forward`, :func:`_ring_backward`) run them over any array library and any transport, given

- ``ring``: ``world``, ``rank``, ``start(send) -> (requests, received)`` (send the arrays to the next rank, receive
  arrays like them from the previous one, without blocking) and ``wait(requests)`` (the received arrays are then
  valid for the work queued after it);
- ``ops``: ``zeros(shape, like)`` and ``full(shape, value, like)`` (accumulators in ``like``'s accumulation dtype),
  ``contiguous``, ``cast(x, dtype)``, ``block_fwd(q, k, v, call, opts) -> (out, lse)``, ``block_bwd(dout, q, k, v,
  out, lse, call, opts) -> (dq, dk, dv)`` and ``merge_into(out_acc, lse_acc, rows, out_b, lse_b)``.

:mod:`cuflash.distributed` binds them to torch tensors, ``torch.distributed`` and the custom operators;
:mod:`cuflash.distributed_cupy` to CuPy arrays, ``cupy.cuda.nccl`` and :func:`cuflash.attention`. The math of each
step (tags ``[ring-fwd *]``, ``[ring-bwd *]``, ``[band *]``) is in ``docs/distributed.md``.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

LAYOUTS = ("zigzag", "contiguous")


def _layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return layout


def _chunks(layout: str, world: int, rank: int, local_len: int) -> list[tuple[int, int]]:
    """``(global_start, length)`` of the chunks that rank ``rank`` holds, in its local order (ascending)."""
    if layout == "contiguous":
        return [(rank * local_len, local_len)]
    c = local_len // 2
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]



class _Call(NamedTuple):
    """One operator call of a plan: local query rows, local key rows, and the mask of that block.

    ``causal``, ``align`` (``causal_align``) and ``window`` (``(left, right)``, -1 unlimited) are the operator's
    arguments, relative to the diagonal of the sliced block; ``docs`` is ``(q_start, k_start)``, the global
    positions of the block's first query and key row, when the block straddles documents (the operator then
    masks by document ids, ``mask_mod="doc_q[q_idx] == doc_k[kv_idx]"``), else None."""

    q_rows: slice
    k_rows: slice
    causal: bool = False
    align: str = "bottom-right"
    window: tuple[int, int] = (-1, -1)
    docs: tuple[int, int] | None = None


_DOC_MASK = "doc_q[q_idx] == doc_k[kv_idx]"



# ---------------------------------------------------------------------------------------------------
# The plan of one ring step: which local query rows attend to which local key rows, with or without causal mask
# ---------------------------------------------------------------------------------------------------
#
# q and k chunks have one length (both layouts cut the sequence into equal chunks) and a rank's chunks are in
# ascending global order, so under causal masking the keys that a query chunk at global start a sees among the
# chunks in hand are a prefix of the local key rows: every chunk that starts before a (fully visible), then the
# chunk that starts at a if it is in hand (the diagonal block). One operator call on that prefix with the causal
# mask aligned bottom-right puts the diagonal where it belongs: query i of the chunk faces local key
# i + e - C, the same position in the diagonal chunk. Calls that can be one are merged: adjacent query chunks with
# the same unmasked prefix, and a step whose every query chunk ends at its own diagonal (the rank's own K/V: one
# causal call on the whole shard, as zigzag ring attention does).


def _step_plan(q_chunks, k_chunks, causal: bool) -> list[tuple[slice, slice, bool]]:
    """``[(q_rows, k_rows, causal), ...]``: the operator calls of one step (local row slices)."""
    total_q = sum(n for _, n in q_chunks)
    total_k = sum(n for _, n in k_chunks)
    if not causal:
        return [(slice(0, total_q), slice(0, total_k), False)]
    calls = []
    row = 0
    for a, n in q_chunks:
        end, diagonal, k_row = 0, False, 0
        for b, m in k_chunks:
            if b + m <= a:
                end = k_row + m
            elif b == a:
                end, diagonal = k_row + m, True
            k_row += m
        if end:
            calls.append((slice(row, row + n), slice(0, end), diagonal))
        row += n
    # merge: adjacent query chunks with the same key prefix and no mask
    merged = []
    for call in calls:
        if merged and not call[2] and not merged[-1][2] and merged[-1][1] == call[1] \
                and merged[-1][0].stop == call[0].start:
            merged[-1] = (slice(merged[-1][0].start, call[0].stop), call[1], False)
        else:
            merged.append(call)
    # the rank's own K/V: each query chunk attends to the keys up to its own diagonal -> one causal call
    if len(merged) > 1 and all(c[2] and c[0].stop == c[1].stop for c in merged) and merged[0][0].start == 0 \
            and all(x[0].stop == y[0].start for x, y in zip(merged, merged[1:])):
        merged = [(slice(0, merged[-1][0].stop), slice(0, merged[-1][1].stop), True)]
    return merged


# ---------------------------------------------------------------------------------------------------
# The band plan: sliding windows and packed documents, one call per (query chunk, key chunk) pair
# ---------------------------------------------------------------------------------------------------
#
# In global positions, query p sees key g when p - left <= g <= p + right (``band``: ``(left, right)``, None
# unlimited; causal caps right at 0) and, with packed documents, when p and g lie in the same document. For a
# query chunk [qa, qa + nq) and a key chunk [kb, kb + nk), _pair_call keeps the query rows that see some key of
# the chunk and the keys that some row sees: both are contiguous ranges (document ids and band edges are
# monotonic in the position), and each row of the kept rows sees a key of the kept keys. Relative to the sliced
# block, whose first query row is delta = q_lo - k_lo positions after its first key, the band is
# i + delta - left <= j <= i + delta + right: the operator's window (left - delta, right + delta) around the
# top-left diagonal (query i faces key i), or (left - delta + off, right + delta - off) around the bottom-right
# one (off = nk - nq). The slicing keeps -right <= delta <= left, so the top-left window is never negative; a
# side that reaches past the block's edge for every row is unlimited (-1), and a right edge of 0 becomes the
# causal mask, so that a block inside the band runs unmasked and a diagonal block as the plain causal call.


def _pair_call(qa: int, nq: int, kb: int, nk: int, band, cu) -> tuple | None:
    """``(q_lo, q_hi, k_lo, k_hi, causal, align, window, masked_by_docs)`` in global positions (half-open), or
    None when no query of ``[qa, qa + nq)`` sees a key of ``[kb, kb + nk)`` (the pair is skipped)."""
    q_lo, q_hi, k_lo, k_hi = qa, qa + nq, kb, kb + nk
    if cu is not None:
        # [band docs] only the documents that both ranges hold
        doc = lambda pos: bisect.bisect_right(cu, pos) - 1  # noqa: E731
        d_lo, d_hi = max(doc(q_lo), doc(k_lo)), min(doc(q_hi - 1), doc(k_hi - 1))
        if d_lo > d_hi:
            return None
        q_lo, q_hi = max(q_lo, cu[d_lo]), min(q_hi, cu[d_hi + 1])
        k_lo, k_hi = max(k_lo, cu[d_lo]), min(k_hi, cu[d_hi + 1])
    # [band rows] rows whose band meets the keys, keys in some row's band (from the same bounds: simultaneous)
    left, right = band
    rows = (q_lo if right is None else max(q_lo, k_lo - right), q_hi if left is None else min(q_hi, k_hi + left))
    keys = (k_lo if left is None else max(k_lo, q_lo - left), k_hi if right is None else min(k_hi, q_hi + right))
    (q_lo, q_hi), (k_lo, k_hi) = rows, keys
    if q_lo >= q_hi or k_lo >= k_hi:
        return None
    masked_by_docs = cu is not None and doc(min(q_lo, k_lo)) != doc(max(q_hi, k_hi) - 1)
    # [band window] the window relative to the sliced block's diagonal
    nq, nk, delta = q_hi - q_lo, k_hi - k_lo, q_lo - k_lo
    left_free = left is None or left - delta >= nq - 1
    right_free = right is None or right + delta >= nk - 1
    if left_free and right_free:
        return q_lo, q_hi, k_lo, k_hi, False, "bottom-right", (-1, -1), masked_by_docs
    best = None
    for align, shift in (("bottom-right", nk - nq), ("top-left", 0)):
        wl = -1 if left_free else left - delta + shift
        wr = -1 if right_free else right + delta - shift
        if (not left_free and wl < 0) or (not right_free and wr < 0):
            continue  # this diagonal lies outside the band: a negative window is not one the operator takes
        causal = wr == 0
        call = (q_lo, q_hi, k_lo, k_hi, causal, align, (wl, -1 if causal else wr), masked_by_docs)
        if causal:
            return call
        best = best or call
    return best


def _band_plan(q_chunks, k_chunks, band, cu) -> list[_Call]:
    """The calls of local query chunks ``q_chunks`` against local key chunks ``k_chunks`` (``(global_start,
    length)`` in local order) under ``band`` and the documents ``cu``: one per pair that has a visible score, then
    adjacent unmasked calls on the same keys merged (all-gather without a window: one call)."""
    calls, q_row = [], 0
    for qa, nq in q_chunks:
        k_row = 0
        for kb, nk in k_chunks:
            pair = _pair_call(qa, nq, kb, nk, band, cu)
            if pair is not None:
                q_lo, q_hi, k_lo, k_hi, causal, align, window, masked = pair
                calls.append(_Call(slice(q_row + q_lo - qa, q_row + q_hi - qa), slice(k_row + k_lo - kb, k_row + k_hi - kb),
                                   causal, align, window, (q_lo, k_lo) if masked else None))
            k_row += nk
        q_row += nq
    merged = []
    for call in calls:
        plain = lambda c: not c.causal and c.window == (-1, -1) and c.docs is None  # noqa: E731
        if merged and plain(call) and plain(merged[-1]) and merged[-1].k_rows == call.k_rows \
                and merged[-1].q_rows.stop == call.q_rows.start:
            merged[-1] = merged[-1]._replace(q_rows=slice(merged[-1].q_rows.start, call.q_rows.stop))
        else:
            merged.append(call)
    return merged


def _plan(q_chunks, k_chunks, opts) -> list[_Call]:
    """The calls of one ring step: the causal prefix plan without window and documents, else the band plan."""
    if opts.cu is None and opts.band[0] is None and opts.band[1] in (None, 0):
        return [_Call(q_rows, k_rows, causal) for q_rows, k_rows, causal in
                _step_plan(q_chunks, k_chunks, opts.band[1] == 0)]
    return _band_plan(q_chunks, k_chunks, opts.band, opts.cu)



# ---------------------------------------------------------------------------------------------------
# The ring: one loop for every array library and transport
# ---------------------------------------------------------------------------------------------------


def _ring_forward(q, k, v, ring, layout: str, opts, ops):
    batch, local_len, heads, _ = q.shape
    out = ops.zeros((*q.shape[:-1], v.shape[-1]), q)  # the accumulators, in the accumulation dtype
    lse = ops.full((batch, heads, local_len), -math.inf, q)
    q_chunks = _chunks(layout, ring.world, ring.rank, local_len)
    k, v = ops.contiguous(k), ops.contiguous(v)
    written: list[slice] = []  # the rows that hold a partial result (the others: nothing to merge with yet)
    for step in range(ring.world):
        # [ring-fwd 1] start moving the K/V in hand to the next rank; receive the previous rank's
        pending = ring.start([k, v]) if step + 1 < ring.world else None
        # [ring-fwd 2] attention of the local queries to the K/V of rank (rank - step), merged by logsumexp
        src = (ring.rank - step) % ring.world
        for call in _plan(q_chunks, _chunks(layout, ring.world, src, local_len), opts):
            out_b, lse_b = ops.block_fwd(q, k, v, call, opts)
            rows = call.q_rows
            if any(rows.start < w.stop and w.start < rows.stop for w in written):
                ops.merge_into(out, lse, rows, out_b, lse_b)
            else:  # the rows' first part: merging it with the empty accumulator would give it back, at two passes' cost
                out[:, rows] = out_b
                lse[:, :, rows] = lse_b
            written.append(rows)
        # [ring-fwd 3] the next step's K/V
        if pending is not None:
            requests, (k, v) = pending
            ring.wait(requests)
    return ops.cast(out, q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, ring, layout: str, opts, ops):
    local_len = q.shape[1]
    dq = ops.zeros(q.shape, q)
    q_chunks = _chunks(layout, ring.world, ring.rank, local_len)
    k, v = ops.contiguous(k), ops.contiguous(v)
    dkv_pending = None
    for step in range(ring.world):
        # [ring-bwd 1] start moving the K/V in hand on, as in the forward
        kv_pending = ring.start([k, v]) if step + 1 < ring.world else None
        # [ring-bwd 2] this rank's share of the gradients of the K/V of rank (rank - step), from the final out, lse
        src = (ring.rank - step) % ring.world
        dk = ops.zeros(k.shape, k)
        dv = ops.zeros(v.shape, v)
        for call in _plan(q_chunks, _chunks(layout, ring.world, src, local_len), opts):
            dq_b, dk_b, dv_b = ops.block_bwd(dout, q, k, v, out, lse, call, opts)
            dq[:, call.q_rows] += dq_b
            dk[:, call.k_rows] += dk_b
            dv[:, call.k_rows] += dv_b
        # [ring-bwd 3] add the shares of the ranks this K/V visited before (their accumulators travel behind it)
        if dkv_pending is not None:
            requests, (dk_before, dv_before) = dkv_pending
            ring.wait(requests)
            dk += dk_before
            dv += dv_before
        if kv_pending is not None:
            requests, (k, v) = kv_pending
            ring.wait(requests)
        # [ring-bwd 4] pass the accumulators on with the K/V: after the last step they reach their owner
        dkv_pending = ring.start([dk, dv]) if ring.world > 1 else ([], [dk, dv])
    requests, (dk, dv) = dkv_pending
    ring.wait(requests)
    return ops.cast(dq, q.dtype), ops.cast(dk, k.dtype), ops.cast(dv, v.dtype)
