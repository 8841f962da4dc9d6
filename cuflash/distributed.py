"""Context-parallel attention over ``torch.distributed``: the sequence is split across the ranks of a process group.

Each rank holds a shard ``(batch, local_seqlen, heads, head_dim)`` of q, k and v along the sequence axis and gets
the same shard of the output (and, in the backward, of dq, dk, dv) as single-device attention on the full sequence
would give. Two algorithms (``docs/distributed.md``):

- :func:`ring_attention`: the K/V shards travel around the ring of ranks (non-blocking ``isend``/``irecv``
  through ``torch.distributed.batch_isend_irecv``), each step overlapping the transfer of the next shard with the
  attention of the shard in hand; the partial results ``(o_s, lse_s)`` are merged with the logsumexp rule of
  :func:`cuflash.merge_states` (``cuflash._ops.merge``, seed 001's incremental softmax applied to whole results). The
  backward recomputes each block's gradients with the custom operator ``cuflash::attention_bwd`` from the
  *final* out and lse (so each block's ``P = exp(S - lse)`` is the true probability), keeps dq local and sends
  the dk/dv accumulators around the ring behind the K/V shards, as flash-attention's ring backward does.
- :func:`all_gather_attention`: the Llama 3 recipe: all-gather K and V (small with GQA's few K/V heads), attend
  locally with the causal offset of each query chunk, and reduce-scatter dk/dv in the backward.

Both take flash-attention's sliding window (``window_size``, causal or not) and packed documents (``cu_seqlens`` of
the full sequence): each (query chunk, key chunk) pair then runs on the rows and keys that see each other, with the
window moved to that block's diagonal and a document-id ``mask_mod`` where the block straddles documents.

Layouts (:func:`shard`, :func:`unshard`): ``"contiguous"`` gives rank ``r`` of ``R`` the ``r``-th of ``R`` equal
chunks; ``"zigzag"`` cuts the sequence into ``2R`` chunks and gives rank ``r`` chunks ``r`` and ``2R - 1 - r``, so
that under causal masking every rank does the same work.

Every block is one call of the custom operators ``torch.ops.cuflash.attention_fwd`` / ``attention_bwd``
(:mod:`cuflash.torch`): CPU tensors run the NumPy reference, CUDA tensors the kernels. The same code runs on any
device and backend; with NCCL the P2P operations are batched as NCCL requires. Run over gloo (2 and 4 CPU processes)
and over NCCL on two H200s (``docs/distributed.md``: efficiency 0.90-0.97 at 64k-256k tokens).

CuPy users without PyTorch: :mod:`cuflash.distributed_cupy` (the same ring over ``cupy.cuda.nccl``).

Importing :mod:`cuflash` never imports this module (it imports PyTorch).
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist

import cuflash.torch  # noqa: F401  (registers the custom operators torch.ops.cuflash.*)
from cuflash._ops import merge as _merge, validate as _validate
from cuflash._ops.ring import (  # noqa: F401  (the plans: re-exported for the tests)
    _DOC_MASK, LAYOUTS, _band_plan, _Call, _chunks, _layout, _pair_call, _plan, _ring_backward, _ring_forward,
    _step_plan,
)

__all__ = ["ring_attention", "all_gather_attention", "shard", "unshard"]


# ---------------------------------------------------------------------------------------------------
# Shards of the full sequence (the layouts and chunks: cuflash._ops.ring)
# ---------------------------------------------------------------------------------------------------


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


def _op_options(opts: types.SimpleNamespace, call: _Call) -> dict:
    left, right = call.window
    mask_mod, names, arrays = None, "", []
    if call.docs is not None:
        (q_start, k_start), ids = call.docs, opts.doc_ids
        nq, nk = call.q_rows.stop - call.q_rows.start, call.k_rows.stop - call.k_rows.start
        mask_mod, names = _DOC_MASK, "doc_q,doc_k"
        arrays = [ids[q_start:q_start + nq], ids[k_start:k_start + nk]]
    return dict(
        bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, attn_mask=None,
        mod_arrays=arrays, dropout_seed=None, causal=call.causal, softmax_scale=opts.scale, causal_align=call.align,
        window_left=left, window_right=right, softcap=opts.softcap, max_seqlen_q=None, max_seqlen_k=None,
        dropout_p=0.0, dropout_offset=0, score_mod=None, mask_mod=mask_mod, mod_array_names=names, algorithm="fa2",
        block_q=None, block_k=None, fp32_precision="tf32x3", deterministic=opts.deterministic,
    )


def _block_fwd(q, k, v, call: _Call, opts):
    return torch.ops.cuflash.attention_fwd(q[:, call.q_rows], k[:, call.k_rows], v[:, call.k_rows],
                                           **_op_options(opts, call))


def _block_bwd(dout, q, k, v, out, lse, call: _Call, opts):
    rows = call.q_rows
    dq, dk, dv, _ = torch.ops.cuflash.attention_bwd(
        dout[:, rows], q[:, rows], k[:, call.k_rows], v[:, call.k_rows], out[:, rows], lse[:, :, rows].contiguous(),
        **_op_options(opts, call), want_dbias=False)
    return dq, dk, dv


# cuflash._ops.merge.merge_stacked is written against an array module (NumPy or CuPy); this is the part of the
# array API it uses, in torch's spelling, so that the ring merges with the same code on any device.
_TORCH_XP = types.SimpleNamespace(
    inf=math.inf,
    # a Python number, not a CPU tensor: torch.where would copy a CPU tensor to the GPU with a synchronous copy, which
    # made the host wait for the step's attention kernel (found in an H200 profile: the ring's host time was its GPU
    # time)
    asarray=lambda x, dtype: float(x),
    max=lambda a, axis: torch.amax(a, dim=axis),
    sum=lambda a, axis: torch.sum(a, dim=axis),
    where=torch.where, exp=torch.exp, log=torch.log,
)


def _merge_into(out_acc, lse_acc, rows: slice, out_b, lse_b) -> None:
    """Merge a partial result ``(out_b, lse_b)`` of local query rows ``rows`` into the accumulators, in place
    (``out_acc`` in the accumulation dtype): ``[decode merge]`` of :mod:`cuflash._ops.merge` with two parts.

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


# What the ring loops of cuflash._ops.ring take from torch.
_TORCH_OPS = types.SimpleNamespace(
    zeros=lambda shape, like: torch.zeros(shape, dtype=_acc_dtype(like.dtype), device=like.device),
    full=lambda shape, value, like: torch.full(shape, value, dtype=_acc_dtype(like.dtype), device=like.device),
    contiguous=lambda x: x.contiguous(),
    cast=lambda x, dtype: x.to(dtype),
    block_fwd=lambda *args: _block_fwd(*args),
    block_bwd=lambda *args: _block_bwd(*args),
    merge_into=lambda *args: _merge_into(*args),
)


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, layout, opts):
        out, lse = _ring_forward(q, k, v, ring, layout, opts, _TORCH_OPS)
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, layout, opts)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args, _TORCH_OPS)
        return dq, dk, dv, None, None, None


def _options(q, k, v, *, group, causal, layout, softmax_scale, window_size, softcap, cu_seqlens, deterministic, entry):
    """Validate the arguments common to both entries; ``(world, rank, layout, opts)``, ``opts.band`` being the band
    in global positions (``(left, right)``, None unlimited, causal folded into right) and ``opts.cu`` the document
    boundaries (a tuple of ints, or None) with ``opts.doc_ids`` (int32, one per position of the full sequence)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            if type(t).__module__.split(".")[0] == "cupy":
                raise TypeError(
                    f"cuflash.distributed.{entry} takes torch tensors: for CuPy arrays use "
                    f"cuflash.distributed_cupy.ring_attention (over a cupy.cuda.nccl communicator), or pass "
                    f"torch.from_dlpack({name}) with an NCCL process group; got {name} as a cupy.ndarray")
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
    left, right = _validate.window_size(window_size)
    if causal:
        right = 0 if right is None else min(right, 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    _validate.softmax_scale(scale, q.shape[-1])
    cu = _cu_seqlens(cu_seqlens, world * q.shape[1])
    doc_ids = None
    if cu is not None:
        lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])])
        doc_ids = torch.repeat_interleave(torch.arange(len(cu) - 1, dtype=torch.int32), lengths).to(q.device)
    opts = types.SimpleNamespace(scale=scale, softcap=_validate.softcap(softcap), deterministic=bool(deterministic),
                                 band=(left, right), cu=cu, doc_ids=doc_ids)
    return world, rank, layout, opts


def _cu_seqlens(cu_seqlens, total: int) -> tuple[int, ...] | None:
    """The document boundaries as Python ints (read to the host once per call), validated against the full length."""
    if cu_seqlens is None:
        return None
    expected = (f"cu_seqlens must be a 1-D integer tensor (or a sequence of ints) of document boundaries in the full "
                f"sequence: 0, then non-decreasing, ending at the full length {total}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"{expected}; got a {cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}")
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)) and all(_validate._is_int(x) for x in cu_seqlens):
        values = [int(x) for x in cu_seqlens]
    else:
        raise TypeError(f"{expected}; got {_describe(cu_seqlens)}")
    if len(values) < 2 or values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        shown = values if len(values) <= 8 else values[:4] + ["..."] + values[-2:]
        raise ValueError(f"{expected}; got {shown}")
    return tuple(values)


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
    cu_seqlens=None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Attention of this rank's query shard to the whole sharded sequence, by ring: differentiable in q, k, v.

    ``q`` ``(batch, local_seqlen, heads_q, head_dim)``, ``k`` and ``v`` ``(batch, local_seqlen, heads_kv, ...)``
    (GQA: ``heads_kv`` divides ``heads_q``) are this rank's shards of the full sequences, laid out by ``layout``
    over the ranks of ``group`` (default: the default group), as :func:`shard` cuts them. Returns this rank's shard
    of ``out`` ``(batch, local_seqlen, heads_q, head_dim_v)`` (and with ``return_lse=True`` of the logsumexp
    ``(batch, heads_q, local_seqlen)``, float32, no gradient), equal up to rounding to the same shard of
    ``cuflash.torch.attention`` on the full sequences with the same ``causal``, ``softmax_scale``, ``window_size``
    and ``softcap``.

    ``window_size=(left, right)``: flash-attention's sliding window in positions of the full sequence (query ``p``
    sees keys ``p - left .. p + right``; -1 unlimited; ``causal=True`` caps ``right`` at 0). ``cu_seqlens``: packed
    documents, an integer tensor (or sequence) ``(docs + 1,)`` of boundaries in the full sequence, ``0 .. N``,
    the same on every rank and for every batch entry: a query sees only keys of its own document (the causal mask
    and the window measured from its position, as flash-attention's varlen call with equal ``cu_seqlens_q`` and
    ``cu_seqlens_k``). It is read to the host once per call (to plan the blocks).

    ``R`` steps: in step ``s`` the rank attends to the K/V shard of rank ``rank - s`` while the next one arrives
    (``batch_isend_irecv``); blocks that the mask hides entirely are skipped (their K/V still travel: the next
    rank may need them). ``layout="zigzag"`` balances
    causal work over the ranks; ``"contiguous"`` with ``causal=True`` is correct but unbalanced (rank ``R - 1``
    does ``2R - 1`` blocks' work where rank 0 does one). The backward sends dk/dv around the ring behind K/V.

    With a window or documents, each (query chunk, key chunk) pair is one operator call on the rows and keys that
    see each other, with the window moved to that block's diagonal (``_pair_call``); without them, the calls of a
    step are merged as in flash-attention's zigzag ring. CPU tensors over gloo and CUDA tensors over NCCL (two
    H200s) have been run.
    """
    world, rank, layout, opts = _options(
        q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, cu_seqlens=cu_seqlens, deterministic=deterministic, entry="ring_attention")
    out, lse = _RingAttention.apply(q, k, v, _Ring(group), layout, opts)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------------
# All-gather attention (the Llama 3 recipe)
# ---------------------------------------------------------------------------------------------------


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, world, rank, layout, opts):
        k_full = _in_global_order(_all_gather(k, group, world), layout, world)
        v_full = _in_global_order(_all_gather(v, group, world), layout, world)
        # each query chunk against all keys: every row sees all its keys in one call (no merge)
        plan = _band_plan(_chunks(layout, world, rank, q.shape[1]), [(0, k_full.shape[1])], opts.band, opts.cu)
        batch, local_len, heads, _ = q.shape
        out = q.new_zeros((batch, local_len, heads, v.shape[-1]))
        lse = torch.full((batch, heads, local_len), -math.inf, dtype=_acc_dtype(q.dtype), device=q.device)
        for call in plan:
            out[:, call.q_rows], lse[:, :, call.q_rows] = _block_fwd(q, k_full, v_full, call, opts)
        # the shards, not the gathered K/V: the backward gathers them again (memory stays that of a shard)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, world, layout, opts, plan)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, world, layout, opts, plan = ctx.args
        rank = dist.get_rank(group)
        k_full = _in_global_order(_all_gather(k, group, world), layout, world)
        v_full = _in_global_order(_all_gather(v, group, world), layout, world)
        dout = dout.contiguous()
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dk_full = torch.zeros(k_full.shape, dtype=acc, device=q.device)
        dv_full = torch.zeros(v_full.shape, dtype=acc, device=q.device)
        for call in plan:
            dq_b, dk_b, dv_b = _block_bwd(dout, q, k_full, v_full, out, lse, call, opts)
            dq[:, call.q_rows] = dq_b
            dk_full[:, call.k_rows] += dk_b
            dv_full[:, call.k_rows] += dv_b
        dk = _reduce_scatter(dk_full, group, world, rank, layout).to(k_full.dtype)
        dv = _reduce_scatter(dv_full, group, world, rank, layout).to(v_full.dtype)
        return dq, dk, dv, None, None, None, None, None


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
    cu_seqlens=None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Attention of this rank's query shard to the whole sharded sequence, by all-gathering K and V (the Llama 3
    recipe): differentiable in q, k, v.

    Arguments and result as :func:`ring_attention`. Every rank gathers the full K and V (``2 N heads_kv d``
    elements: small next to q with GQA's few K/V heads), then each local query chunk attends to the keys up to its
    own position in one operator call (causal: aligned bottom-right on the keys before the chunk's end; a window
    or documents: the keys of the chunk's band and documents, with the window moved to that block's diagonal); the
    backward reduce-scatters dk and dv to their owners (gloo, which has no reduce-scatter: an all-reduce). No
    merge is needed: every query row sees all its keys in one call.

    The gathered K/V take ``R`` times the memory of the shards. CPU tensors over gloo and CUDA tensors over NCCL
    (two H200s) have been run.
    """
    world, rank, layout, opts = _options(
        q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, cu_seqlens=cu_seqlens, deterministic=deterministic, entry="all_gather_attention")
    out, lse = _AllGatherAttention.apply(q, k, v, group, world, rank, layout, opts)
    return (out, lse) if return_lse else out
