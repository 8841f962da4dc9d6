"""Context-parallel attention over ``torch.distributed``: the sequence is split across the ranks of a process group.

Each rank holds a shard ``(batch, local_seqlen, heads, head_dim)`` of q, k and v along the sequence axis and gets
the same shard of the output (and, in the backward, of dq, dk, dv) as single-device attention on the full sequence
would give. Two algorithms (``docs/distributed.md``):

- :func:`ring_attention`: the K/V shards travel around the ring of ranks (non-blocking ``isend``/``irecv``
  through ``torch.distributed.batch_isend_irecv``), each step overlapping the transfer of the next shard with the
  attention of the shard in hand; the partial results ``(o_s, lse_s)`` are merged with the logsumexp rule of
  :func:`cuflash.merge_states` (``cuflash._merge``, seed 001's incremental softmax applied to whole results). The
  backward recomputes each block's gradients with the custom operator ``cuflash::attention_bwd`` from the
  *final* out and lse (so each block's ``P = exp(S - lse)`` is the true probability), keeps dq local and sends
  the dk/dv accumulators around the ring behind the K/V shards, as flash-attention's ring backward does.
- :func:`all_gather_attention`: the Llama 3 recipe: all-gather K and V (small with GQA's few K/V heads), attend
  locally with the causal offset of each query chunk, and reduce-scatter dk/dv in the backward.

Layouts (:func:`shard`, :func:`unshard`): ``"contiguous"`` gives rank ``r`` of ``R`` the ``r``-th of ``R`` equal
chunks; ``"zigzag"`` cuts the sequence into ``2R`` chunks and gives rank ``r`` chunks ``r`` and ``2R - 1 - r``, so
that under causal masking every rank does the same work.

Every block is one call of the custom operators ``torch.ops.cuflash.attention_fwd`` / ``attention_bwd``
(:mod:`cuflash.torch`): CPU tensors run the NumPy reference, CUDA tensors the kernels. The same code runs on any
device and backend; with NCCL the P2P operations are batched as NCCL requires. **Only the CPU path (gloo, 2 and 4
processes) has been run**; the NCCL / GPU path has not run on a GPU yet.

CuPy users: a CuPy entry over ``cupy.cuda.nccl`` is not implemented (:func:`ring_attention` on CuPy arrays raises
``NotImplementedError`` saying so); CUDA tensors over the arrays' memory (``torch.from_dlpack``) run this module.

Importing :mod:`cuflash` never imports this module (it imports PyTorch).
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist

import cuflash.torch  # noqa: F401  (registers the custom operators torch.ops.cuflash.*)
from cuflash import _merge, _validate

__all__ = ["ring_attention", "all_gather_attention", "shard", "unshard"]

LAYOUTS = ("zigzag", "contiguous")


# ---------------------------------------------------------------------------------------------------
# Layouts: which global chunks of the sequence a rank holds
# ---------------------------------------------------------------------------------------------------


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


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cuflash.distributed needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group); got none")
    return dist.get_world_size(group), dist.get_rank(group)


def _global_rank(group, group_rank: int) -> int:
    """The global rank of a rank of ``group`` (what P2P operations take as peer)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _check_split(name: str, length: int, layout: str, world: int, what: str) -> None:
    parts = 2 * world if layout == "zigzag" else world
    if length % parts:
        raise ValueError(
            f"{name} must have a sequence length (dim 1) divisible by {parts} ({what} with layout={layout!r} over "
            f"{world} ranks); got {length}")


def shard(x: torch.Tensor, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of ``x`` ``(batch, seqlen, ...)``, the full sequence (the same on every rank), along dim 1.

    ``layout="contiguous"``: chunk ``r`` of ``R``; ``"zigzag"``: chunks ``r`` and ``2R - 1 - r`` of ``2R``
    (concatenated). The sequence length must divide into ``R`` (``2R``) chunks. Returns a new contiguous tensor.
    """
    layout = _layout(layout)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise TypeError(f"x must be a torch.Tensor of shape (batch, seqlen, ...); got {_describe(x)}")
    world, rank = _group_info(group)
    _check_split("x", x.shape[1], layout, world, "the full sequence")
    local = x.shape[1] // world
    return torch.cat([x[:, a:a + n] for a, n in _chunks(layout, world, rank, local)], dim=1).contiguous()


def unshard(x_local: torch.Tensor, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard (an all-gather, then the chunks in global order), on every rank.

    The inverse of :func:`shard`. Not differentiable (``torch.distributed.all_gather`` records no gradient).
    """
    layout = _layout(layout)
    if not isinstance(x_local, torch.Tensor) or x_local.dim() < 2:
        raise TypeError(f"x_local must be a torch.Tensor of shape (batch, local_seqlen, ...); got {_describe(x_local)}")
    world, _ = _group_info(group)
    if layout == "zigzag" and x_local.shape[1] % 2:
        raise ValueError(f"x_local must have an even local sequence length (dim 1) with layout='zigzag' (two chunks "
                         f"per rank); got {x_local.shape[1]}")
    parts = _all_gather(x_local, group, world)
    return _in_global_order(parts, layout, world)


def _in_global_order(parts: list[torch.Tensor], layout: str, world: int) -> torch.Tensor:
    """The rank-ordered shards ``parts`` concatenated in global sequence order along dim 1."""
    if layout == "contiguous":
        return torch.cat(parts, dim=1)
    c = parts[0].shape[1] // 2
    return torch.cat([p[:, :c] for p in parts] + [p[:, c:] for p in reversed(parts)], dim=1)


def _all_gather(x: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return parts


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return "None" if x is None else f"{type(x).__module__}.{type(x).__name__}"


# ---------------------------------------------------------------------------------------------------
# One block: the custom operators, and the merge of partial results
# ---------------------------------------------------------------------------------------------------


def _op_options(opts: types.SimpleNamespace, causal: bool, window) -> dict:
    left, right = window
    return dict(
        bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, attn_mask=None,
        mod_arrays=[], dropout_seed=None, causal=causal, softmax_scale=opts.scale, causal_align="bottom-right",
        window_left=left, window_right=right, softcap=opts.softcap, max_seqlen_q=None, max_seqlen_k=None,
        dropout_p=0.0, dropout_offset=0, score_mod=None, mask_mod=None, mod_array_names="", algorithm="fa2",
        block_q=None, block_k=None, deterministic=opts.deterministic,
    )


def _block_fwd(q, k, v, causal, opts, window=(-1, -1)):
    return torch.ops.cuflash.attention_fwd(q, k, v, **_op_options(opts, causal, window))


def _block_bwd(dout, q, k, v, out, lse, causal, opts, window=(-1, -1)):
    dq, dk, dv, _ = torch.ops.cuflash.attention_bwd(dout, q, k, v, out, lse, **_op_options(opts, causal, window),
                                                     want_dbias=False)
    return dq, dk, dv


# cuflash._merge.merge_stacked is written against an array module (NumPy or CuPy); this is the part of the
# array API it uses, in torch's spelling, so that the ring merges with the same code on any device.
_TORCH_XP = types.SimpleNamespace(
    inf=math.inf,
    asarray=lambda x, dtype: torch.tensor(x, dtype=dtype),
    max=lambda a, axis: torch.amax(a, dim=axis),
    sum=lambda a, axis: torch.sum(a, dim=axis),
    where=torch.where, exp=torch.exp, log=torch.log,
)


def _merge_into(out_acc, lse_acc, rows: slice, out_b, lse_b) -> None:
    """Merge a partial result ``(out_b, lse_b)`` of local query rows ``rows`` into the accumulators, in place
    (``out_acc`` in the accumulation dtype): ``[decode merge]`` of :mod:`cuflash._merge` with two parts.

    The logsumexp comes from ``merge_stacked`` itself (given outputs of width 0: it costs ``B H L`` elements);
    the outputs are then rescaled in place by the same weights ``exp(lse_s - lse)`` (0 for an empty part and for a
    row that saw no key), two passes over ``out_acc`` instead of the stacked copies and products of the
    ``S``-part form: per ring step this is memory traffic next to the block's compute (``docs/distributed.md``)."""
    lse_parts = torch.stack([lse_acc[:, :, rows], lse_b.to(lse_acc.dtype)])
    _, lse = _merge.merge_stacked(lse_parts.new_empty((*lse_parts.shape, 0)), lse_parts, _TORCH_XP)
    # [decode merge] o = sum_s exp(lse_s - lse) o_s
    weights = torch.exp(lse_parts - torch.where(lse == -math.inf, 0.0, lse)).transpose(-1, -2)[..., None]
    out_acc[:, rows].mul_(weights[0]).addcmul_(out_b, weights[1])
    lse_acc[:, :, rows] = lse


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
# Ring attention
# ---------------------------------------------------------------------------------------------------


class _Ring:
    """The ring of a group: this rank, its neighbours (global ranks, as P2P operations take them), one exchange."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = _group_info(group)
        self.next = _global_rank(group, (self.rank + 1) % self.world)
        self.prev = _global_rank(group, (self.rank - 1) % self.world)

    def start(self, send: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        """Send ``send`` to the next rank and receive tensors like them from the previous one, without blocking:
        ``(requests, received)``; the received tensors are valid after :meth:`wait`. One batch of P2P operations
        (``batch_isend_irecv``), as NCCL needs so that the ring does not deadlock."""
        received = [torch.empty_like(t) for t in send]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def wait(requests) -> None:
        for req in requests:
            req.wait()


def _ring_forward(q, k, v, ring: _Ring, layout: str, causal: bool, opts):
    batch, local_len, heads, _ = q.shape
    acc = _acc_dtype(q.dtype)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full((batch, heads, local_len), -math.inf, dtype=acc, device=q.device)
    q_chunks = _chunks(layout, ring.world, ring.rank, local_len)
    k, v = k.contiguous(), v.contiguous()
    for step in range(ring.world):
        # [ring-fwd 1] start moving the K/V in hand to the next rank; receive the previous rank's
        pending = ring.start([k, v]) if step + 1 < ring.world else None
        # [ring-fwd 2] attention of the local queries to the K/V of rank (rank - step), merged by logsumexp
        src = (ring.rank - step) % ring.world
        for q_rows, k_rows, block_causal in _step_plan(q_chunks, _chunks(layout, ring.world, src, local_len), causal):
            out_b, lse_b = _block_fwd(q[:, q_rows], k[:, k_rows], v[:, k_rows], block_causal, opts)
            _merge_into(out, lse, q_rows, out_b, lse_b)
        # [ring-fwd 3] the next step's K/V
        if pending is not None:
            requests, (k, v) = pending
            _Ring.wait(requests)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring, layout: str, causal: bool, opts):
    local_len = q.shape[1]
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    q_chunks = _chunks(layout, ring.world, ring.rank, local_len)
    k, v = k.contiguous(), v.contiguous()
    dkv_pending = None
    for step in range(ring.world):
        # [ring-bwd 1] start moving the K/V in hand on, as in the forward
        kv_pending = ring.start([k, v]) if step + 1 < ring.world else None
        # [ring-bwd 2] this rank's share of the gradients of the K/V of rank (rank - step), from the final out, lse
        src = (ring.rank - step) % ring.world
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for q_rows, k_rows, block_causal in _step_plan(q_chunks, _chunks(layout, ring.world, src, local_len), causal):
            dq_b, dk_b, dv_b = _block_bwd(dout[:, q_rows], q[:, q_rows], k[:, k_rows], v[:, k_rows], out[:, q_rows],
                                          lse[:, :, q_rows].contiguous(), block_causal, opts)
            dq[:, q_rows] += dq_b
            dk[:, k_rows] += dk_b
            dv[:, k_rows] += dv_b
        # [ring-bwd 3] add the shares of the ranks this K/V visited before (their accumulators travel behind it)
        if dkv_pending is not None:
            requests, (dk_before, dv_before) = dkv_pending
            _Ring.wait(requests)
            dk += dk_before
            dv += dv_before
        if kv_pending is not None:
            requests, (k, v) = kv_pending
            _Ring.wait(requests)
        # [ring-bwd 4] pass the accumulators on with the K/V: after the last step they reach their owner
        dkv_pending = ring.start([dk, dv]) if ring.world > 1 else ([], [dk, dv])
    requests, (dk, dv) = dkv_pending
    _Ring.wait(requests)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, layout, causal, opts):
        out, lse = _ring_forward(q, k, v, ring, layout, causal, opts)
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, layout, causal, opts)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _options(q, k, v, *, group, causal, layout, softmax_scale, window_size, softcap, deterministic, entry):
    """Validate the arguments common to both entries; ``(world, rank, layout, opts, window)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            if type(t).__module__.split(".")[0] == "cupy":
                raise NotImplementedError(
                    f"cuflash.distributed.{entry} takes torch tensors; a CuPy entry over cupy.cuda.nccl is not "
                    f"implemented yet: pass torch.from_dlpack({name}) (CUDA tensors over the same memory, no copy) "
                    f"with an NCCL process group; got {name} as a cupy.ndarray")
            raise TypeError(f"{name} must be a torch.Tensor of shape (batch, local_seqlen, heads, head_dim); got "
                            f"{_describe(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, local_seqlen, heads, head_dim); got shape "
                             f"{tuple(t.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(
            f"q, k and v must have the same batch and local sequence length (self-attention over a sharded sequence); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    layout = _layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__} {causal!r}")
    world, rank = _group_info(group)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"q must have an even local sequence length (dim 1) with layout='zigzag' (two chunks per "
                         f"rank); got {q.shape[1]}")
    left, right = (-1 if x is None else x for x in _validate.window_size(window_size))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    _validate.softmax_scale(scale, q.shape[-1])
    opts = types.SimpleNamespace(scale=scale, softcap=_validate.softcap(softcap), deterministic=bool(deterministic))
    return world, rank, layout, opts, (left, right)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Attention of this rank's query shard to the whole sharded sequence, by ring: differentiable in q, k, v.

    ``q`` ``(batch, local_seqlen, heads_q, head_dim)``, ``k`` and ``v`` ``(batch, local_seqlen, heads_kv, ...)``
    (GQA: ``heads_kv`` divides ``heads_q``) are this rank's shards of the full sequences, laid out by ``layout``
    over the ranks of ``group`` (default: the default group), as :func:`shard` cuts them. Returns this rank's shard
    of ``out`` ``(batch, local_seqlen, heads_q, head_dim_v)`` (and with ``return_lse=True`` of the logsumexp
    ``(batch, heads_q, local_seqlen)``, float32, no gradient), equal up to rounding to the same shard of
    ``cuflash.torch.attention`` on the full sequences with the same ``causal``, ``softmax_scale`` and ``softcap``.

    ``R`` steps: in step ``s`` the rank attends to the K/V shard of rank ``rank - s`` while the next one arrives
    (``batch_isend_irecv``); blocks that causal masking hides entirely are skipped. ``layout="zigzag"`` balances
    causal work over the ranks; ``"contiguous"`` with ``causal=True`` is correct but unbalanced (rank ``R - 1``
    does ``2R - 1`` blocks' work where rank 0 does one). The backward sends dk/dv around the ring behind K/V.

    ``window_size`` other than ``(-1, -1)`` raises ``NotImplementedError``: a window cut inside a block with a
    diagonal that lies outside it is not one of the operator's alignments; :func:`all_gather_attention` has
    causal windows. CPU tensors over gloo have been run; CUDA tensors over NCCL have not run on a GPU yet.
    """
    world, rank, layout, opts, window = _options(
        q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, deterministic=deterministic, entry="ring_attention")
    if window != (-1, -1):
        raise NotImplementedError(
            f"ring_attention has no sliding window yet (a window cut inside a block whose diagonal lies outside it is "
            f"not one of the operator's causal alignments); use all_gather_attention with causal=True; got "
            f"window_size={tuple(window_size)!r}")
    out, lse = _RingAttention.apply(q, k, v, _Ring(group), layout, causal, opts)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------------
# All-gather attention (the Llama 3 recipe)
# ---------------------------------------------------------------------------------------------------


def _gather_plan(q_chunks, causal: bool, window) -> list[tuple[slice, slice]]:
    """``[(q_rows, k_rows), ...]``: local query rows and global key rows of each operator call. Causal: each query
    chunk at global start ``a`` attends to the keys before ``a + C`` with the mask aligned bottom-right (query ``i``
    faces key ``a + i``); a left window starts the keys at ``a - left`` (those before it are masked anyway)."""
    total_q = sum(n for _, n in q_chunks)
    if not causal:
        return [(slice(0, total_q), None)]
    left = window[0]
    calls, row = [], 0
    for a, n in q_chunks:
        start = 0 if left < 0 else max(0, a - left)
        calls.append((slice(row, row + n), slice(start, a + n)))
        row += n
    return calls


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, world, rank, layout, causal, opts, window):
        k_full = _in_global_order(_all_gather(k, group, world), layout, world)
        v_full = _in_global_order(_all_gather(v, group, world), layout, world)
        q_chunks = _chunks(layout, world, rank, q.shape[1])
        outs, lses = [], []
        for q_rows, k_rows in _gather_plan(q_chunks, causal, window):
            k_rows = k_rows or slice(0, k_full.shape[1])
            out_b, lse_b = _block_fwd(q[:, q_rows], k_full[:, k_rows], v_full[:, k_rows], causal, opts, window)
            outs.append(out_b)
            lses.append(lse_b)
        out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=2)
        # the shards, not the gathered K/V: the backward gathers them again (memory stays that of a shard)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, world, rank, layout, causal, opts, window)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, world, rank, layout, causal, opts, window = ctx.args
        k_full = _in_global_order(_all_gather(k, group, world), layout, world)
        v_full = _in_global_order(_all_gather(v, group, world), layout, world)
        dout = dout.contiguous()
        acc = _acc_dtype(q.dtype)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk_full = torch.zeros(k_full.shape, dtype=acc, device=q.device)
        dv_full = torch.zeros(v_full.shape, dtype=acc, device=q.device)
        for q_rows, k_rows in _gather_plan(_chunks(layout, world, rank, q.shape[1]), causal, window):
            k_rows = k_rows or slice(0, k_full.shape[1])
            dq_b, dk_b, dv_b = _block_bwd(dout[:, q_rows], q[:, q_rows], k_full[:, k_rows], v_full[:, k_rows],
                                          out[:, q_rows], lse[:, :, q_rows].contiguous(), causal, opts, window)
            dq[:, q_rows] = dq_b
            dk_full[:, k_rows] += dk_b
            dv_full[:, k_rows] += dv_b
        dk = _reduce_scatter(dk_full, group, world, rank, layout).to(k_full.dtype)
        dv = _reduce_scatter(dv_full, group, world, rank, layout).to(v_full.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None


def _reduce_scatter(full: torch.Tensor, group, world: int, rank: int, layout: str) -> torch.Tensor:
    """This rank's shard of the sum over ranks of ``full`` (global order along dim 1): a reduce-scatter of the
    shards in rank order. gloo has no reduce-scatter: there, an all-reduce of ``full`` and this rank's chunks."""
    local_len = full.shape[1] // world
    if dist.get_backend(group) == "gloo":
        full = full.contiguous()
        dist.all_reduce(full, group=group)
        return torch.cat([full[:, a:a + n] for a, n in _chunks(layout, world, rank, local_len)], dim=1)
    shards = [torch.cat([full[:, a:a + n] for a, n in _chunks(layout, world, r, local_len)], dim=1).contiguous()
              for r in range(world)]
    mine = torch.empty_like(shards[rank])
    dist.reduce_scatter(mine, shards, group=group)
    return mine


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Attention of this rank's query shard to the whole sharded sequence, by all-gathering K and V (the Llama 3
    recipe): differentiable in q, k, v.

    Arguments and result as :func:`ring_attention`. Every rank gathers the full K and V (``2 N heads_kv d``
    elements: small next to q with GQA's few K/V heads), then each local query chunk attends to the keys up to its
    own position in one operator call (causal: aligned bottom-right on the keys before the chunk's end); the
    backward reduce-scatters dk and dv to their owners (gloo, which has no reduce-scatter: an all-reduce). No
    merge is needed: every query row sees all its keys in one call.

    Causal sliding windows (``window_size=(left, 0)`` with ``causal=True``) are supported; a window with
    ``causal=False`` raises ``NotImplementedError``. The gathered K/V take ``R`` times the memory of the shards.
    CPU tensors over gloo have been run; CUDA tensors over NCCL have not run on a GPU yet.
    """
    world, rank, layout, opts, window = _options(
        q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, deterministic=deterministic, entry="all_gather_attention")
    if window != (-1, -1) and not causal:
        raise NotImplementedError(
            f"all_gather_attention has sliding windows with causal=True only (a window around a diagonal that lies "
            f"outside the chunk's keys is not one of the operator's alignments); got window_size="
            f"{tuple(window_size)!r} with causal=False")
    out, lse = _AllGatherAttention.apply(q, k, v, group, world, rank, layout, causal, opts, window)
    return (out, lse) if return_lse else out
