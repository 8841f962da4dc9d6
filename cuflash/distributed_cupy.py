"""Ring attention for CuPy arrays over ``cupy.cuda.nccl``: context parallelism without PyTorch.

The same ring as :func:`cuflash.distributed.ring_attention` (the plans and loops of :mod:`cuflash._ops.ring`, tags
``[ring-fwd *]``, ``[ring-bwd *]`` of ``docs/distributed.md``), with each block one call of
:func:`cuflash.attention` / :func:`cuflash.attention_backward` and the K/V shards moved by NCCL send/receive on a
communication stream of its own, so that the transfer of the next shard overlaps the attention of the shard in hand.
There is no autograd here: the backward is its own call, from the forward's ``out`` and ``lse``::

    from cupy.cuda import nccl
    import cuflash.distributed_cupy as cdc

    comm = nccl.NcclCommunicator(world, uid, rank)            # one process per GPU, as usual with NCCL
    q_l, k_l, v_l = (cdc.shard(x, comm) for x in (q, k, v))    # full sequence (the same on every rank) -> shard
    out_l, lse_l = cdc.ring_attention(q_l, k_l, v_l, comm, causal=True)
    dq_l, dk_l, dv_l = cdc.ring_attention_backward(cdc.shard(dout, comm), q_l, k_l, v_l, out_l, lse_l, comm,
                                                   causal=True)
    out = cdc.unshard(out_l, comm)                             # the full sequence again, on every rank

``comm`` may also be any object with ``world``, ``rank``, ``start(send) -> (requests, received)`` and
``wait(requests)`` (a transport of :mod:`cuflash._ops.ring`); the tests run the ring that way on NumPy arrays, whose
blocks run the NumPy reference.
"""

from __future__ import annotations

import math
import types

import numpy as np

from ._ops import api as _api, merge as _merge, validate as _validate
from ._ops.ring import _DOC_MASK, _Call, _chunks, _layout, _ring_backward, _ring_forward

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard"]


class NcclRing:
    """The ring of a ``cupy.cuda.nccl.NcclCommunicator``: send to rank + 1, receive from rank - 1, as bytes, on a
    stream of its own. ``start`` makes that stream wait for the work queued so far on the current stream (the arrays
    to send are written) and queues the grouped sends and receives there; ``wait`` makes the current stream wait for
    them. The host never blocks; the received arrays are allocated on the current stream before the transfer is
    queued, and the sent ones stay referenced until ``wait`` (CuPy's pool reuses freed memory in stream order)."""

    def __init__(self, comm):
        import cupy

        self.comm = comm
        self.world, self.rank = comm.size(), comm.rank_id()
        self.next, self.prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def start(self, send):
        import cupy
        from cupy.cuda import nccl

        received = [cupy.empty_like(t) for t in send]
        ready = cupy.cuda.get_current_stream().record()
        self.stream.wait_event(ready)
        nccl.groupStart()
        for t in send:
            self.comm.send(t.data.ptr, t.nbytes, nccl.NCCL_UINT8, self.next, self.stream.ptr)
        for t in received:
            self.comm.recv(t.data.ptr, t.nbytes, nccl.NCCL_UINT8, self.prev, self.stream.ptr)
        nccl.groupEnd()
        return [(self.stream.record(), send)], received

    @staticmethod
    def wait(requests) -> None:
        import cupy

        for done, _sent in requests:
            cupy.cuda.get_current_stream().wait_event(done)


def _ring_of(comm):
    if all(hasattr(comm, name) for name in ("world", "rank", "start", "wait")):
        return comm
    if hasattr(comm, "rank_id") and hasattr(comm, "size"):
        return NcclRing(comm)
    raise TypeError(f"comm must be a cupy.cuda.nccl.NcclCommunicator (or a ring transport with world, rank, start and "
                    f"wait); got {type(comm).__module__}.{type(comm).__name__}")


def _acc(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _ops(xp) -> types.SimpleNamespace:
    """What the ring loops take from an array module (CuPy, or NumPy for the tests)."""

    def merge_into(out_acc, lse_acc, rows, out_b, lse_b):
        # [decode merge] through cuflash._ops.merge.merge_stacked (outputs of width 0: the lse only), then
        # o = exp(lse_acc - lse) o_acc + exp(lse_b - lse) o_b on the rows
        lse_parts = xp.stack([lse_acc[:, :, rows], lse_b.astype(lse_acc.dtype)])
        _, lse = _merge.merge_stacked(xp.empty((*lse_parts.shape, 0), dtype=lse_parts.dtype), lse_parts, xp)
        weights = xp.exp(lse_parts - xp.where(lse == -math.inf, 0.0, lse)).transpose(0, 1, 3, 2)[..., None]
        out_acc[:, rows] = out_acc[:, rows] * weights[0] + out_b * weights[1]
        lse_acc[:, :, rows] = lse

    return types.SimpleNamespace(
        zeros=lambda shape, like: xp.zeros(shape, dtype=_acc(like.dtype)),
        full=lambda shape, value, like: xp.full(shape, value, dtype=_acc(like.dtype)),
        contiguous=xp.ascontiguousarray,
        cast=lambda x, dtype: x.astype(dtype, copy=False),
        block_fwd=lambda q, k, v, call, opts: _api.attention(
            q[:, call.q_rows], k[:, call.k_rows], v[:, call.k_rows], return_lse=True, **_kwargs(call, opts)),
        block_bwd=lambda dout, q, k, v, out, lse, call, opts: _api.attention_backward(
            dout[:, call.q_rows], q[:, call.q_rows], k[:, call.k_rows], v[:, call.k_rows], out[:, call.q_rows],
            xp.ascontiguousarray(lse[:, :, call.q_rows]), deterministic=opts.deterministic, **_kwargs(call, opts)),
        merge_into=merge_into,
    )


def _kwargs(call: _Call, opts) -> dict:
    """The keywords of cuflash.attention for one block of a plan."""
    kw = dict(causal=call.causal, causal_align=call.align, window_size=call.window, softmax_scale=opts.scale,
              softcap=opts.softcap)
    if call.docs is not None:
        (q_start, k_start), ids = call.docs, opts.doc_ids
        nq, nk = call.q_rows.stop - call.q_rows.start, call.k_rows.stop - call.k_rows.start
        kw.update(mask_mod=_DOC_MASK, mod_arrays={"doc_q": ids[q_start:q_start + nq], "doc_k": ids[k_start:k_start + nk]})
    return kw


def _options(q, k, v, ring, *, causal, layout, softmax_scale, window_size, softcap, cu_seqlens, deterministic):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be an array of shape (batch, local_seqlen, heads, head_dim); got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"q, k and v must have the same batch and local sequence length; got q {q.shape}, k "
                         f"{k.shape}, v {v.shape}")
    layout = _layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__} {causal!r}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"q must have an even local sequence length (dim 1) with layout='zigzag'; got {q.shape[1]}")
    left, right = _validate.window_size(window_size)
    if causal:
        right = 0 if right is None else min(right, 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    _validate.softmax_scale(scale, q.shape[-1])
    cu, doc_ids = None, None
    if cu_seqlens is not None:
        total = ring.world * q.shape[1]
        values = [int(x) for x in (cu_seqlens.get() if hasattr(cu_seqlens, "get") else np.asarray(cu_seqlens))]
        if len(values) < 2 or values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"cu_seqlens must be document boundaries in the full sequence: 0, then non-decreasing, "
                             f"ending at the full length {total}; got {values}")
        cu = tuple(values)
        ids = np.repeat(np.arange(len(cu) - 1, dtype=np.int32), np.diff(cu))
        doc_ids = _like(q, ids)
    return layout, types.SimpleNamespace(scale=scale, softcap=_validate.softcap(softcap),
                                         deterministic=bool(deterministic), band=(left, right), cu=cu, doc_ids=doc_ids)


def _like(x, host: np.ndarray):
    """``host`` on ``x``'s device (NumPy stays NumPy)."""
    if isinstance(x, np.ndarray):
        return host
    import cupy

    return cupy.asarray(host)


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def ring_attention(q, k, v, comm, *, causal: bool = False, layout: str = "zigzag", softmax_scale=None,
                   window_size=(-1, -1), softcap: float = 0.0, cu_seqlens=None):
    """``(out, lse)``: this rank's shard of attention over the sequence sharded across ``comm``'s ranks, by ring.

    ``q`` ``(batch, local_seqlen, heads_q, head_dim)``, ``k``, ``v`` ``(batch, local_seqlen, heads_kv, ...)``
    (GQA) are this rank's shards, laid out by ``layout`` as :func:`shard` cuts them; arguments as
    :func:`cuflash.distributed.ring_attention` (``window_size`` and ``cu_seqlens`` in positions of the full
    sequence). ``out`` has q's dtype, ``lse`` ``(batch, heads_q, local_seqlen)`` float32 (float64 for float64);
    keep both for :func:`ring_attention_backward`. Runs on the current CuPy stream.
    """
    ring = _ring_of(comm)
    layout, opts = _options(q, k, v, ring, causal=causal, layout=layout, softmax_scale=softmax_scale,
                            window_size=window_size, softcap=softcap, cu_seqlens=cu_seqlens, deterministic=False)
    return _ring_forward(q, k, v, ring, layout, opts, _ops(_xp(q)))


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal: bool = False, layout: str = "zigzag",
                            softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0, cu_seqlens=None,
                            deterministic: bool = False):
    """``(dq, dk, dv)`` of this rank's shards, from the forward's ``out`` and ``lse`` (the same arguments): the
    dK/dV accumulators travel around the ring behind the K/V shards and reach their owners at the last step."""
    ring = _ring_of(comm)
    layout, opts = _options(q, k, v, ring, causal=causal, layout=layout, softmax_scale=softmax_scale,
                            window_size=window_size, softcap=softcap, cu_seqlens=cu_seqlens,
                            deterministic=deterministic)
    if dout.shape != out.shape:
        raise ValueError(f"dout must have out's shape {out.shape}; got {dout.shape}")
    return _ring_backward(_xp(dout).ascontiguousarray(dout), q, k, v, out, lse, ring, layout, opts, _ops(_xp(q)))


def shard(x, comm, layout: str = "zigzag"):
    """This rank's shard (a new contiguous array) of ``x`` ``(batch, seqlen, ...)``, the full sequence, along dim 1."""
    layout = _layout(layout)
    ring = _ring_of(comm)
    parts = 2 * ring.world if layout == "zigzag" else ring.world
    if x.shape[1] % parts:
        raise ValueError(f"x must have a sequence length (dim 1) divisible by {parts} with layout={layout!r} over "
                         f"{ring.world} ranks; got {x.shape[1]}")
    local = x.shape[1] // ring.world
    xp = _xp(x)
    return xp.ascontiguousarray(xp.concatenate([x[:, a:a + n] for a, n in _chunks(layout, ring.world, ring.rank,
                                                                                       local)], axis=1))


def unshard(x_local, comm, layout: str = "zigzag"):
    """The full sequence from every rank's shard, on every rank (NCCL all-gather, then the chunks in global order)."""
    import cupy
    from cupy.cuda import nccl

    layout = _layout(layout)
    world = comm.size()
    x_local = cupy.ascontiguousarray(x_local)
    gathered = cupy.empty((world, *x_local.shape), dtype=x_local.dtype)
    comm.allGather(x_local.data.ptr, gathered.data.ptr, x_local.nbytes, nccl.NCCL_UINT8,
                   cupy.cuda.get_current_stream().ptr)
    parts = list(gathered)
    if layout == "contiguous":
        return cupy.concatenate(parts, axis=1)
    c = x_local.shape[1] // 2
    return cupy.concatenate([p[:, :c] for p in parts] + [p[:, c:] for p in reversed(parts)], axis=1)
