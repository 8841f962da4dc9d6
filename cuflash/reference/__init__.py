"""The NumPy backend: naive attention (the oracle), FA2 and FA1 forward, and the blocked backward.

The blocked functions follow the loop structure of the CUDA kernels so that the two can be compared
tile for tile, and each algorithm step carries the tag that marks it in the kernels
(``grep -rn "fa2-fwd 3"`` shows both sides; the tags are listed in ``docs/architecture.md``).

Layout. Arrays are ``(batch, seqlen, heads, head_dim)``, or packed ``(total, heads, head_dim)`` with
``cu_seqlens`` (lse ``(heads, total)``), with any strides and a contiguous last axis; nothing is copied
whole. Inside, a block of rows is loaded ("from HBM into SRAM") as a contiguous
``(batch, heads_kv, group, rows, head_dim)`` array in the accumulation dtype, where
``group = heads_q // heads_kv``: query head ``h`` sits at ``(h // group, h % group)`` and every query head
of a group reads the same key/value head. Keys and values are loaded as
``(batch, heads_kv, 1, rows, head_dim)`` and broadcast over the group, so K and V are never repeated.
One block loop thus serves every (batch, head) pair at once through batched matrix products. ``v``
may have a head dim of its own (``head_dim_v``); ``out``, ``do`` and ``dv`` have it, q, k, dq, dk ``head_dim``.

Precision. Products accumulate in float32 (float64 for float64 inputs). As in the kernels, the
probabilities ``P`` are rounded to the input dtype before ``P @ V`` and ``P^T @ dO``, and ``dS`` before
``dS @ K`` and ``dS^T @ Q``. Outputs and gradients come back in the input dtype, ``lse`` in the
accumulation dtype.

Variants. A :class:`~cuflash._ops.variant.Variant` changes four things, each in one place
(``docs/variants.md`` has the math):

- which rows form a sequence: every function runs its block loops once per sequence
  (:func:`_sequences`) on views of that sequence's rows, as the CUDA grid's per-sequence block info
  does: one run over the whole batch when every batch entry has the same lengths, one per sequence for
  packed variable-length batches (``cu_seqlens``) and for key padding (``seqused_k``, whose keys past the
  used ones are never loaded);
- which keys a row sees by position (a :class:`~cuflash._ops.blocks.Band`: causal masking, sliding windows):
  the block loops visit only tiles that some row can see (bounds from :mod:`cuflash._ops.blocks`) and build
  a mask only for tiles crossing an edge of the band (``[variant mask]``);
- the scores themselves: softcap, ALiBi and an additive bias (``bias`` and ``attn_mask``, one array)
  modify every score of a tile in :func:`_scores` (``[variant mod]``); in the backward softcap's
  derivative multiplies dS and the bias's gradient is written tile by tile (``[variant grad]``);
- dropout, after the softmax: the probabilities that enter ``P V`` (and ``P^T dO``) are multiplied by
  ``keep / (1 - p)``, the keep mask evaluated tile by tile from its counter-based definition
  (:func:`_dropout_tile`), never stored; the row sums and ``lse`` are those of the undropped ``P``, and the
  backward's ``dP`` is multiplied by the same factor before ``D`` is subtracted (``[variant dropout]``).

Rows that see no key. A row that sees no key has running max ``-inf``; every ``exp(x - m)`` below
subtracts :func:`_shift` of the max (``0`` in place of ``-inf``) so that such a row gives ``P = 0``,
``out = 0``, ``lse = -inf`` and zero gradients, with no NaN and no floating-point warning.

Like every backend, these functions trust their arguments: the front door (``cuflash._ops.api``) has
already validated shapes, dtypes, strides and options.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import ml_dtypes
import numpy as np

from .._ops import mods as _mods
from .._ops.blocks import (Band, cache_bytes, cpu_block_sizes, default_block_sizes, iter_blocks, key_range, query_range,
                           tile_is_fully_masked, tile_needs_mask)
from .._ops.variant import Variant

__all__ = [
    "forward",
    "backward",
    "naive_forward",
    "naive_backward",
    "fa2_forward",
    "fa1_forward",
    "blocked_backward",
    "preprocess_delta",
]

_ORDERS = ("kv_outer", "q_outer", "split")
DENSE = Variant()


# ---------------------------------------------------------------------------------------------------
# Backend interface (docs/architecture.md)
# ---------------------------------------------------------------------------------------------------


def forward(q, k, v, *, scale, variant, algorithm, block_q, block_k, fp32_precision="ieee"):
    """Attention forward: ``(out, lse)``. ``algorithm`` is ``"fa2"``, ``"fa1"`` or ``"naive"``. ``fp32_precision`` is
    the CUDA kernels' (how they multiply float32): NumPy computes float32 in IEEE arithmetic whatever it says."""
    if algorithm == "naive":
        return naive_forward(q, k, v, scale=scale, variant=variant)
    blocked = {"fa2": fa2_forward, "fa1": fa1_forward}
    assert algorithm in blocked, algorithm
    return blocked[algorithm](q, k, v, scale=scale, variant=variant, block_q=block_q, block_k=block_k)


def backward(do, q, k, v, out, lse, *, scale, variant, algorithm, block_q, block_k, order, want_dbias=False):
    """Attention backward: ``(dq, dk, dv)``, and ``dbias`` with ``want_dbias`` (``variant.bias`` given):
    ``(batch, heads_q, seqlen_q, seqlen_k)`` in the accumulation dtype, the gradient of the final scores.

    ``algorithm="naive"`` recomputes everything with full-size matrices; ``"fa2"`` and ``"fa1"`` share
    the blocked backward (the two papers differ only in the forward), run in loop order ``order``
    (``None`` means ``"kv_outer"``, the order of both papers).
    """
    if algorithm == "naive":
        return naive_backward(do, q, k, v, scale=scale, variant=variant, want_dbias=want_dbias)
    assert algorithm in ("fa2", "fa1"), algorithm
    return blocked_backward(
        do, q, k, v, out, lse, scale=scale, variant=variant, block_q=block_q, block_k=block_k, order=order,
        want_dbias=want_dbias,
    )


# ---------------------------------------------------------------------------------------------------
# Shared pieces: dtypes, block loads and stores, sequences, scores, masks
# ---------------------------------------------------------------------------------------------------


def _acc_dtype(dtype) -> np.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for float16, bfloat16 and float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _cast_like_kernel(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round an accumulation-precision tile to the input dtype, as the kernel does before a product.

    The result stays in the accumulation dtype (the rounded values are exact there) so that the
    product runs in BLAS; for float32 and float64 inputs this is the tile itself.
    """
    if x.dtype == dtype:
        return x
    if dtype == _E4M3:  # [fp8 p] P at 2^8 its value, as the FP8 kernel packs it (exact scalings by powers of two)
        return (x * _P_SCALE_FP8).astype(dtype).astype(x.dtype) / _P_SCALE_FP8
    return x.astype(dtype).astype(x.dtype)


_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_P_SCALE_FP8 = 256.0


def _resolve_block_sizes(head_dim, block_q, block_k, pass_):
    """The tiles of a call: those given, the others by default; forward from the CPU cache
    (:func:`~cuflash._ops.blocks.cpu_block_sizes`), backward by the seed rule
    (:func:`~cuflash._ops.blocks.default_block_sizes`)."""
    if pass_ == "forward":
        default_q, default_k = cpu_block_sizes(head_dim, cache=_l2_bytes())
    else:
        default_q, default_k = default_block_sizes(head_dim, pass_=pass_)
    return (default_q if block_q is None else block_q), (default_k if block_k is None else block_k)


@functools.lru_cache(maxsize=1)
def _l2_bytes() -> int:
    """One core's L2 cache in bytes, read once per process (:func:`~cuflash._ops.blocks.cache_bytes`)."""
    return cache_bytes(2)


# ---------------------------------------------------------------------------------------------------
# Threads on the CPU (docs/performance.md): query blocks in parallel, one BLAS thread each
# ---------------------------------------------------------------------------------------------------

THREADS_ENV = "CUFLASH_CPU_THREADS"


def cpu_threads() -> int:
    """How many threads the FA2 forward runs query blocks on: ``$CUFLASH_CPU_THREADS`` when set to a positive
    integer, otherwise the CPUs this process may run on."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        try:
            if int(value) > 0:
                return int(value)
        except ValueError:
            pass
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return max(os.cpu_count() or 1, 1)


_BLAS_LOCK = threading.Lock()
_BLAS_STATE = {"depth": 0, "limiter": None}


@functools.lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl's controller of the BLAS libraries loaded (NumPy's), or None without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - a dependency; the reference still runs without it
        return None
    return ThreadpoolController()


@contextlib.contextmanager
def _one_blas_thread():
    """BLAS limited to one thread while the block loops run (the first of nested or concurrent callers sets
    the limit, the last one out restores it): the loops' threads do the parallel work, and a BLAS that splits
    each small tile product across threads spins and stalls whenever a core is busy elsewhere."""
    controller = _blas_controller()
    if controller is None:
        yield
        return
    with _BLAS_LOCK:
        if _BLAS_STATE["depth"] == 0:
            _BLAS_STATE["limiter"] = controller.limit(limits=1, user_api="blas")
        _BLAS_STATE["depth"] += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_STATE["depth"] -= 1
            if _BLAS_STATE["depth"] == 0:
                _BLAS_STATE["limiter"].restore_original_limits()
                _BLAS_STATE["limiter"] = None


def _in_order(step, blocks):
    """Call ``step(start, stop)`` for each block in turn."""
    return [step(*block) for block in blocks]


@contextlib.contextmanager
def _block_runner(threads: int):
    """``run(step, blocks)``: call ``step(start, stop)`` for each block, on ``threads`` threads (each block
    writes only its own rows of the outputs, as each thread block of the kernels' grid does)."""
    if threads <= 1:
        yield _in_order
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cuflash-cpu") as pool:
        def run(step, blocks):
            blocks = list(blocks)
            if len(blocks) <= 1:
                return _in_order(step, blocks)
            return list(pool.map(lambda block: step(*block), blocks))

        yield run


def _grouped(x: np.ndarray, heads_kv: int) -> np.ndarray:
    """View ``(batch, seqlen, heads, d)`` as ``(batch, heads_kv, heads // heads_kv, seqlen, d)``, no copy.

    Splitting the head axis and moving axes only changes strides, so this works for any input strides;
    the functions below also write their outputs through such views.
    """
    batch, seqlen, heads, head_dim = x.shape
    view = x.reshape(batch, seqlen, heads_kv, heads // heads_kv, head_dim).transpose(0, 2, 3, 1, 4)
    assert x.size == 0 or np.may_share_memory(view, x), "splitting the head axis must not copy"
    return view


def _grouped_rows(x: np.ndarray, heads_kv: int) -> np.ndarray:
    """View per-row statistics ``(batch, heads, seqlen)`` as ``(batch, heads_kv, group, seqlen)``, no copy."""
    batch, heads, seqlen = x.shape
    view = x.reshape(batch, heads_kv, heads // heads_kv, seqlen)
    assert x.size == 0 or np.may_share_memory(view, x), "splitting the head axis must not copy"
    return view


def _grouped_scores(x: np.ndarray, heads_kv: int) -> np.ndarray:
    """View a score-shaped ``(batch, heads, rows, cols)`` array (bias, dbias) as
    ``(batch, heads_kv, group, rows, cols)``, no copy (a broadcast head axis splits into two of stride 0)."""
    batch, heads, rows, cols = x.shape
    view = x.reshape(batch, heads_kv, heads // heads_kv, rows, cols)
    assert x.size == 0 or np.may_share_memory(view, x), "splitting the head axis must not copy"
    return view


def _load(x5: np.ndarray, start: int, stop: int, acc: np.dtype) -> np.ndarray:
    """Load rows ``[start, stop)`` of a grouped view as a contiguous block in the accumulation dtype."""
    return np.ascontiguousarray(x5[..., start:stop, :], dtype=acc)


def _online_softmax_step(s: np.ndarray, m_i: np.ndarray, l_i: np.ndarray, acc: np.ndarray):
    """One key tile of the online softmax, in place on ``s``, ``l_i`` and ``acc``; returns ``(P, m_new)``.

    [fa2-fwd 3] new row max; rescale acc and l_i by exp(m_old - m_new);
    [fa2-fwd 4] P = exp(S - m_new) (in place of S), l_i += rowsum(P).
    """
    m_new = np.maximum(m_i, s.max(axis=-1))
    m_shift = _shift(m_new)
    alpha = np.exp(m_i - m_shift)
    acc *= alpha[..., None]
    l_i *= alpha
    s -= m_shift[..., None]
    p = np.exp(s, out=s)
    l_i += p.sum(axis=-1)
    return p, m_new


def _shift(m: np.ndarray) -> np.ndarray:
    """The row max to subtract before ``exp``: ``m`` itself, or 0 for a row that has seen no key yet.

    Such a row has ``m = -inf`` and only ``-inf`` scores, so ``exp(-inf - 0) = 0`` where
    ``exp(-inf - (-inf))`` would be NaN.
    """
    return np.where(np.isneginf(m), 0.0, m).astype(m.dtype, copy=False)


class _ScoreMods(NamedTuple):
    """What turns ``q_i . k_j`` into the scores of one sequence (``docs/variants.md``)."""

    scale: float
    softcap: float               # 0: none
    slopes: np.ndarray | None    # ALiBi, (nb, heads_kv, group, 1, 1) in the accumulation dtype
    offset: int                  # the diagonal: query i faces key i + offset (ALiBi's distance)
    band: Band | None            # the keys each row sees by position (None: all)
    bias: np.ndarray | None      # additive bias, (nb, heads_kv, group, len_q, len_k) view of Variant.bias
    dropout: _Dropout | None     # dropout after the softmax (None: none)
    user: _UserMods | None = None  # the user's score_mod / mask_mod (None: none)


class _UserMods(NamedTuple):
    """What one sequence needs to apply the user's ``score_mod`` and ``mask_mod`` to any tile
    (``docs/variants.md``, "User score and mask modifications")."""

    mods: _mods.UserMods
    arrays: dict                 # name -> the NumPy array of mod_arrays
    b: np.ndarray                # (nb, 1, 1, 1, 1): the batch entries' (or the packed sequence's) indices
    h: np.ndarray                # (1, heads_kv, group, 1, 1): the query head of each grouped position
    # The block map of mask_mod for this run's tiles (cuflash._ops.mods.block_map), reduced over its batch entries
    # and heads, as the reference runs them all at once: a tile whose max is 0 is skipped (no visible score),
    # one whose min is 2 needs no mask_mod. None: no mask_mod, or no tiles (naive attention evaluates it all).
    tile_max: np.ndarray | None
    tile_min: np.ndarray | None
    block_q: int | None
    block_k: int | None


class _ScoreGrad(NamedTuple):
    """The derivatives [variant grad] multiplies dS by, each None when absent."""

    softcap: np.ndarray | None   # 1 - tanh^2 of softcap, d t / d (scale * s) before ALiBi and the bias
    user: np.ndarray | None      # d score_mod / d score, 0 where the score is masked


class _Dropout(NamedTuple):
    """What one sequence needs to evaluate its dropout keep mask on any tile (``docs/variants.md``)."""

    variant: Variant             # holds dropout_p, dropout_seed, dropout_offset (Variant.keep)
    b: np.ndarray                # (nb, 1, 1, 1, 1): the batch entries' (or the packed sequence's) indices
    h: np.ndarray                # (1, heads_kv, group, 1, 1): the query head of each grouped position
    rescale: float               # 1 / (1 - dropout_p)


class _Sequence(NamedTuple):
    """One sequence of a call, or every batch entry at once when they all have the same lengths.

    The accessors view an array of the call as this sequence's ``(nb, rows, heads, d)`` (``q``-like and
    ``k``-like arrays) or ``(nb, heads, rows)`` (``lse`` and ``D``), without a copy, so that the block loops
    run on it unchanged and write their results into the call's outputs.
    """

    batch: slice    # batch entries of a padded batch (one, or all of them)
    rows_q: slice   # its query rows (of the packed rows, or of a batch entry)
    rows_k: slice   # its used key rows
    packed: bool    # q-like arrays are (total, heads, d), lse (heads, total)
    mods: _ScoreMods

    def q(self, x: np.ndarray) -> np.ndarray:
        return x[None, self.rows_q] if self.packed else x[self.batch, self.rows_q]

    def k(self, x: np.ndarray) -> np.ndarray:
        return x[None, self.rows_k] if self.packed else x[self.batch, self.rows_k]

    def rows(self, x: np.ndarray) -> np.ndarray:
        return x[None, :, self.rows_q] if self.packed else x[self.batch, :, self.rows_q]

    def scores(self, x: np.ndarray) -> np.ndarray:
        """``(nb, heads, rows_q, rows_k)`` of a score-shaped array (bias, dbias; padded batches only)."""
        assert not self.packed
        return x[self.batch, :, self.rows_q, self.rows_k]


def _sequences(q, k, variant: Variant, scale: float, blocks=None):
    """The sequences of a call that have a score to compute (a query and a used key), as :class:`_Sequence`.

    Packed batches (``cu_seqlens``) and key padding (``seqused_k``) give one sequence per batch entry, as
    the kernels' per-sequence block info; otherwise the whole batch is one run. A sequence left out
    (no query or no used key) keeps what the outputs start as: ``out = 0``, ``lse = -inf``, zero gradients.
    ``blocks``: the ``(block_q, block_k)`` tiles of the blocked loops (for mask_mod's block map), None for naive.
    """
    if variant.is_varlen:
        cu_q, cu_k = (np.asarray(cu, np.int64) for cu in (variant.cu_seqlens_q, variant.cu_seqlens_k))
        spans = [(b, cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]) for b in range(len(cu_q) - 1)]
    elif variant.seqused_k is not None:
        spans = [(b, 0, q.shape[1], 0, k.shape[1]) for b in range(q.shape[0])]
    else:
        spans = [(None, 0, q.shape[1], 0, k.shape[1])]
    for b, first_q, len_q, first_k, len_k in spans:
        if variant.seqused_k is not None:
            # [variant mask] seqused_k: keys past the used ones are never loaded; the diagonal is placed with them
            len_k = variant.seqused_k[b]
        first_q, len_q, first_k, len_k = (int(x) for x in (first_q, len_q, first_k, len_k))
        if len_q == 0 or len_k == 0:
            continue
        batch = slice(None) if b is None else slice(b, b + 1)
        indices = np.arange(q.shape[0]) if b is None else np.array([b])
        yield _Sequence(batch, slice(first_q, first_q + len_q), slice(first_k, first_k + len_k), variant.is_varlen,
                        _score_mods(variant, scale, q, k, batch, indices, len_q, len_k, blocks))


def _score_mods(variant: Variant, scale: float, q, k, batch: slice, indices, len_q: int, len_k: int,
                blocks=None) -> _ScoreMods:
    """The score modifications of the sequence made of batch entries ``batch`` (the packed sequences'
    ``indices`` name them for dropout: the batch entries, or the one packed sequence)."""
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    slopes = bias = dropout = None
    if variant.alibi_slopes is not None:
        chosen = np.asarray(variant.alibi_slopes[batch], dtype=_acc_dtype(q.dtype))  # (nb, heads_q)
        slopes = chosen.reshape(chosen.shape[0], heads_kv, heads_q // heads_kv, 1, 1)
    if variant.bias is not None:  # padded batches only: the sequence's rows and used keys are the first ones
        bias = _grouped_scores(variant.bias[batch, :, :len_q, :len_k], heads_kv)
    if variant.dropout_p:
        dropout = _Dropout(variant, indices.reshape(-1, 1, 1, 1, 1),
                           np.arange(heads_q).reshape(1, heads_kv, heads_q // heads_kv, 1, 1),
                           1.0 / (1.0 - variant.dropout_p))
    user = None if variant.mods is None else _user_mods(variant, indices, heads_q, heads_kv, len_q, len_k, blocks)
    return _ScoreMods(scale, variant.softcap, slopes, variant.offset(len_q, len_k), variant.band(len_q, len_k), bias,
                      dropout, user)


def _user_mods(variant: Variant, indices, heads_q: int, heads_kv: int, len_q: int, len_k: int, blocks) -> _UserMods:
    """The user's mods for the run of batch entries ``indices`` (their ``b``), with its block map when the
    blocked loops give their tiles (``blocks``)."""
    mods = variant.mods
    arrays = {name: np.asarray(a) for name, a in zip(mods.array_names, variant.mod_arrays)}
    tile_max = tile_min = None
    block_q, block_k = blocks if blocks is not None else (None, None)
    if blocks is not None and mods.has_mask_mod:
        tiles = _mods.block_map(mods, len(indices), heads_q, len_q, len_k, block_q, block_k, arrays=arrays,
                                batch_index=indices).tiles
        tile_max, tile_min = tiles.max(axis=(0, 1)), tiles.min(axis=(0, 1))
    return _UserMods(mods, arrays, np.asarray(indices).reshape(-1, 1, 1, 1, 1),
                     np.arange(heads_q).reshape(1, heads_kv, heads_q // heads_kv, 1, 1), tile_max, tile_min,
                     block_q, block_k)


def _skips(mods: _ScoreMods, q_start: int, k_start: int) -> bool:
    """[variant mask] mask_mod: whether the tile at ``(q_start, k_start)`` holds no visible score (block map 0
    for every batch entry and head of the run), so that the loops skip it as the kernels will."""
    user = mods.user
    if user is None or user.tile_max is None:
        return False
    return bool(user.tile_max[q_start // user.block_q, k_start // user.block_k] == _mods.SKIP)


def _mask_mod_needed(user: _UserMods, q_start: int, k_start: int) -> bool:
    """Whether a tile must evaluate mask_mod score by score: not when the block map says every score of it
    is visible (2) for every batch entry and head."""
    if not user.mods.has_mask_mod:
        return False
    if user.tile_min is None:
        return True
    return bool(user.tile_min[q_start // user.block_q, k_start // user.block_k] != _mods.FULL)


def _dropout_tile(dropout: _Dropout, q_start, q_stop, k_start, k_stop, dtype) -> np.ndarray:
    """``keep / (1 - p)`` for the tile's scores, ``(nb, heads_kv, group, rows, cols)`` in ``dtype``: the keep
    mask evaluated from its definition at the tile's positions, so any tiling gives the same mask."""
    rows = np.arange(q_start, q_stop).reshape(1, 1, 1, -1, 1)
    cols = np.arange(k_start, k_stop).reshape(1, 1, 1, 1, -1)
    keep = dropout.variant.keep(dropout.b, dropout.h, rows, cols)
    return np.where(keep, dtype.type(dropout.rescale), dtype.type(0))


def _outside_band(q_start: int, q_stop: int, k_start: int, k_stop: int, band: Band) -> np.ndarray:
    """Boolean ``(rows, cols)`` tile, True where key ``j`` lies outside what query ``i`` may see."""
    rows = np.arange(q_start, q_stop)[:, None] + band.offset
    cols = np.arange(k_start, k_stop)[None, :]
    outside = np.zeros((q_stop - q_start, k_stop - k_start), bool)
    if band.right is not None:
        outside |= cols > rows + band.right
    if band.left is not None:
        outside |= cols < rows - band.left
    return outside


def _scores(q_i, k_j, mods: _ScoreMods, q_start, q_stop, k_start, k_stop):
    """``(S, grad)``: the scores of one tile, and the derivatives the backward multiplies dS by (a
    :class:`_ScoreGrad`: softcap's, the user's score_mod's; None without either).

    ``S = scale * Q_i K_j^T``, then softcap, ALiBi, the bias and the user's score_mod, then ``-inf`` outside the
    band and where mask_mod is false (a tile of the block map's 2 skips mask_mod). ``q_i`` is
    ``(batch, heads_kv, group, rows, d)``, ``k_j`` ``(batch, heads_kv, 1, cols, d)``; the key block
    broadcasts over the group. Only a tile that crosses an edge of the band builds a mask.
    """
    s = q_i @ k_j.swapaxes(-1, -2)
    s *= mods.scale
    dcap = None
    if mods.softcap:
        # [variant mod] softcap: t = softcap * tanh(t / softcap); keep 1 - tanh^2 for [variant grad]
        s /= mods.softcap
        tanh = np.tanh(s, out=s)
        dcap = 1.0 - tanh * tanh
        s *= mods.softcap
    if mods.slopes is not None:
        # [variant mod] ALiBi: t -= slope * |i + offset - j|
        rows = np.arange(q_start, q_stop)[:, None] + mods.offset
        distance = np.abs(rows - np.arange(k_start, k_stop)[None, :]).astype(s.dtype)
        s -= mods.slopes * distance
    if mods.bias is not None:
        # [variant bias tile] the bias of this tile of scores, rows [q_start, q_stop) x keys [k_start, k_stop) (the
        # wgmma kernels copy it into shared memory with the tile's K/V, or Q/dO, and read it there)
        tile = mods.bias[..., q_start:q_stop, k_start:k_stop]
        # [variant mod] bias: t += bias[b, h, i, j] (attn_mask's False is -inf there)
        s += tile
    user, dmod = mods.user, None
    if user is not None:
        rows = np.arange(q_start, q_stop).reshape(1, 1, 1, -1, 1)
        cols = np.arange(k_start, k_stop).reshape(1, 1, 1, 1, -1)
    if user is not None and user.mods.has_score_mod:
        # [variant mod] score_mod: t = score_mod(t, b, h, i, j), last (FlexAttention's scaled score); keep its
        # derivative for [variant grad]. A score already -inf (a -inf bias, attn_mask) stays -inf: no unmasking
        value, deriv = user.mods.score(s, user.b, user.h, rows, cols, user.arrays)
        masked = np.isneginf(s)
        s = np.where(masked, s, value).astype(s.dtype, copy=False)
        dmod = np.where(masked, 0, deriv).astype(s.dtype, copy=False)
    if tile_needs_mask(q_start, q_stop, k_start, k_stop, mods.band):
        # [variant mask] -inf outside the band (causal masking, sliding window)
        np.copyto(s, -np.inf, where=_outside_band(q_start, q_stop, k_start, k_stop, mods.band))
    if user is not None and _mask_mod_needed(user, q_start, k_start):
        # [variant mask] mask_mod: -inf where it is false (only tiles the block map marks partial)
        np.copyto(s, -np.inf, where=~user.mods.mask(user.b, user.h, rows, cols, user.arrays))
    if dmod is not None:
        # [variant grad] score_mod: no derivative where the score is masked (P = 0 there; keeps 0 * inf away)
        dmod[np.isneginf(s)] = 0
    if dcap is None and dmod is None:
        return s, None
    return s, _ScoreGrad(dcap, dmod)


def _group_transpose_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum over the group of a^T b``: ``(B, Hkv, G, rows, m)``, ``(B, Hkv, G, rows, n)`` -> ``(B, Hkv, 1, m, n)``.

    Every query head of a group contributes to the gradient of the one key/value head they share;
    stacking the group's rows makes that sum part of a single product.
    """
    batch, heads_kv, group, rows, _ = a.shape
    a_rows = a.reshape(batch, heads_kv, group * rows, a.shape[-1])
    b_rows = b.reshape(batch, heads_kv, group * rows, b.shape[-1])
    return (a_rows.swapaxes(-1, -2) @ b_rows)[:, :, None]


def _finish_lse(m: np.ndarray, l: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(l_safe, lse)``: ``lse = m + log l``, ``-inf`` where the row saw no key (``l = 0``).

    ``l_safe`` is ``l`` with 1 in place of 0, to divide by: the unnormalized output of such a row is 0.
    """
    seen = l > 0
    l_safe = np.where(seen, l, 1.0).astype(l.dtype, copy=False)
    lse = np.where(seen, m + np.log(l_safe), -np.inf).astype(l.dtype, copy=False)
    return l_safe, lse


def _is_empty(q, k) -> bool:
    """No score at all: a zero-sized batch, row or head axis (``(batch, seqlen, heads, d)`` or packed)."""
    return 0 in q.shape[:-1] + k.shape[:-1]


def _forward_outputs(q, v):
    """``out`` (zeros, like q with v's head dim) and ``lse`` (``-inf``): what a row that sees no key keeps.

    ``lse`` is ``(batch, heads, seqlen_q)``, or ``(heads, total_q)`` for packed ``(total_q, heads, d)`` q.
    """
    lse_shape = (q.shape[1], q.shape[0]) if q.ndim == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype), np.full(lse_shape, -np.inf, _acc_dtype(q.dtype))


def _zero_grads(q, k, v, want_dbias=False):
    """Gradients start at zero: keys that no query sees (past ``seqused_k``, say) keep it, and so does
    the dbias of every masked score. ``dbias`` (only with ``want_dbias``, padded batches) is
    ``(batch, heads_q, seqlen_q, seqlen_k)`` in the accumulation dtype."""
    grads = np.zeros(q.shape, q.dtype), np.zeros(k.shape, k.dtype), np.zeros(v.shape, v.dtype)
    if not want_dbias:
        return grads
    assert q.ndim == 4, "a bias needs padded (batch, seqlen, heads, head_dim) arrays"
    return (*grads, np.zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), _acc_dtype(q.dtype)))


# ---------------------------------------------------------------------------------------------------
# Naive attention: the oracle (000, sections 2-3)
# ---------------------------------------------------------------------------------------------------


def _naive_probabilities(q5, k5, mods: _ScoreMods):
    """Full ``P = softmax(S)``, ``lse`` per row and the derivatives of the score mods (:func:`_scores`), from
    grouped full-length Q and K."""
    seqlen_q, seqlen_k = q5.shape[-2], k5.shape[-2]
    s, grad = _scores(q5, k5, mods, 0, seqlen_q, 0, seqlen_k)
    m = s.max(axis=-1)
    s -= _shift(m)[..., None]
    p = np.exp(s, out=s)
    l_safe, lse = _finish_lse(m, p.sum(axis=-1))
    p /= l_safe[..., None]
    return p, lse, grad


def naive_forward(q, k, v, *, scale, variant=DENSE):
    """Standard attention that materializes ``S`` and ``P`` (``seqlen_q x seqlen_k`` each): the oracle.

    ``S = scale * Q K^T`` (modified and masked by ``variant``), ``P = softmax(S)`` row by row, ``O = P V``
    (000, eqs. 7-9), with ``P`` rounded to the input dtype before the product, as a framework computing
    in that dtype would. One sequence at a time. Returns ``(out, lse)``.
    """
    out, lse = _forward_outputs(q, v)
    if _is_empty(q, k):
        return out, lse
    dtype, acc = q.dtype, _acc_dtype(q.dtype)
    heads_kv = k.shape[-2]
    for seq in _sequences(q, k, variant, scale):
        q5, k5, v5 = (np.asarray(_grouped(x, heads_kv), dtype=acc) for x in (seq.q(q), seq.k(k), seq.k(v)))
        p, lse_seq, _ = _naive_probabilities(q5, k5, seq.mods)
        if seq.mods.dropout is not None:
            # [variant dropout] P_dropped = P * keep / (1 - p); lse stays that of P
            p *= _dropout_tile(seq.mods.dropout, 0, q5.shape[-2], 0, k5.shape[-2], p.dtype)
        _grouped(seq.q(out), heads_kv)[...] = _cast_like_kernel(p, dtype) @ v5
        _grouped_rows(seq.rows(lse), heads_kv)[...] = lse_seq
    return out, lse


def naive_backward(do, q, k, v, *, scale, variant=DENSE, want_dbias=False):
    """Gradients of standard attention from full-size ``P``, ``dP`` and ``dS`` (000, section 3).

    Everything is recomputed from ``q, k, v, do``; ``gamma = rowsum(P * dP)`` is taken straight from its
    definition (000, eq. 23) rather than from ``O``, so the oracle does not share the blocked backward's
    shortcut. ``P`` and ``dS`` are rounded to the input dtype before their products. Returns
    ``(dq, dk, dv)``, with dk and dv summed over each query-head group, and with ``want_dbias`` the
    gradient of the final scores, ``(batch, heads_q, seqlen_q, seqlen_k)`` in the accumulation dtype.
    """
    grads = _zero_grads(q, k, v, want_dbias)
    if _is_empty(q, k):
        return grads
    dtype, acc = q.dtype, _acc_dtype(q.dtype)
    heads_kv = k.shape[-2]
    for seq in _sequences(q, k, variant, scale):
        q5, do5 = (np.ascontiguousarray(_grouped(seq.q(x), heads_kv), dtype=acc) for x in (q, do))
        k5, v5 = (np.ascontiguousarray(_grouped(seq.k(x), heads_kv), dtype=acc) for x in (k, v))
        p, _, grad = _naive_probabilities(q5, k5, seq.mods)
        dp = do5 @ v5.swapaxes(-1, -2)
        if seq.mods.dropout is None:
            dv = _group_transpose_matmul(_cast_like_kernel(p, dtype), do5)
        else:
            # [variant dropout] dV = P_dropped^T dO; the gradient of P is dP_dropped * keep / (1 - p)
            z = _dropout_tile(seq.mods.dropout, 0, q5.shape[-2], 0, k5.shape[-2], p.dtype)
            dv = _group_transpose_matmul(_cast_like_kernel(p * z, dtype), do5)
            dp *= z
        gamma = (p * dp).sum(axis=-1)
        ds = p * (dp - gamma[..., None])
        if grad is not None and grad.user is not None:
            # [variant grad] score_mod: dS *= d score_mod / d score (the bias is added before score_mod)
            ds *= grad.user
        if want_dbias:
            # [variant grad] bias: dBias = dT = P (dP - D), the gradient of the final scores (before softcap's factor)
            _grouped_scores(seq.scores(grads[3]), heads_kv)[...] = ds
        if grad is not None and grad.softcap is not None:
            # [variant grad] softcap: dS *= 1 - (t_capped / softcap)^2
            ds *= grad.softcap
        ds_in = _cast_like_kernel(ds, dtype)
        dq = scale * (ds_in @ k5)
        dk = scale * _group_transpose_matmul(ds_in, q5)
        for grad, value, view in zip(grads[:3], (dq, dk, dv), (seq.q, seq.k, seq.k)):
            _grouped(view(grad), value.shape[1])[...] = value
    return grads


# ---------------------------------------------------------------------------------------------------
# Blocked forwards: what both loop orders share
# ---------------------------------------------------------------------------------------------------


def _blocked_forward(forward_sequence, q, k, v, scale, variant, block_q, block_k):
    """What both blocked forwards do around their loops: allocate ``(out, lse)``, settle the tile sizes and
    run ``forward_sequence`` (the loops of one order) on each sequence's views, with BLAS on one thread."""
    out, lse = _forward_outputs(q, v)
    if _is_empty(q, k):
        return out, lse
    block_q, block_k = _resolve_block_sizes(max(q.shape[-1], v.shape[-1]), block_q, block_k, "forward")
    with _one_blas_thread():
        for seq in _sequences(q, k, variant, scale, (block_q, block_k)):
            forward_sequence(seq.q(q), seq.k(k), seq.k(v), seq.q(out), seq.rows(lse), seq.mods, block_q, block_k)
    return out, lse


# ---------------------------------------------------------------------------------------------------
# FlashAttention-2 forward: query blocks outer (000 Algorithm 3, 001 FlashForward2)
# ---------------------------------------------------------------------------------------------------


def fa2_forward(q, k, v, *, scale, variant=DENSE, block_q=None, block_k=None):
    """FlashAttention-2 forward: ``(out, lse)``.

    The outer loop takes one query block at a time and keeps its running row max ``m_i``, running sum
    ``l_i`` and unnormalized output ``acc`` in local ("SRAM") arrays while the inner loop streams the
    key/value blocks it can see; ``acc`` is normalized once at the end. Extra memory is
    O(block_q x block_k) per (batch, head) and thread. One sequence at a time (see :func:`_sequences`).

    Query blocks are independent, as the thread blocks of the kernels' grid are: they run on
    :func:`cpu_threads` threads, with BLAS on one thread (docs/performance.md); the results do not depend on
    the number of threads.
    """
    with _block_runner(cpu_threads()) as run:
        return _blocked_forward(functools.partial(_fa2_forward_sequence, run=run), q, k, v, scale, variant,
                                block_q, block_k)


def fa2_forward_fp8(q, k, v, *, scale, variant=DENSE, descales=(None, None, None), block_q=None, block_k=None):
    """The FP8 forward ([fp8]; forward_sm90.cu's FP8 entry point): e4m3 ``q``, ``k``, ``v`` times their descale
    factors (``descales``: q's, k's, v's, each (batch, heads_kv) float32 or None for 1) in float32, then
    :func:`fa2_forward`'s loops with P rounded to e4m3 before P V, as the kernel packs it ([fp8 p]); ``out`` bfloat16.
    (The kernel folds q's and k's factors into the scores' scale and v's into the output's: the same values up to
    float32 rounding.)"""
    heads_kv = k.shape[2]
    group = q.shape[2] // heads_kv

    def real(a, factors, group):
        x = (a.view(_E4M3) if a.dtype == np.uint8 else a).astype(np.float32)  # (uint8: e4m3 bits)
        if factors is None:
            return x
        return x * np.repeat(np.asarray(factors, np.float32), group, axis=1)[:, None, :, None]

    q32, k32, v32 = real(q, descales[0], group), real(k, descales[1], 1), real(v, descales[2], 1)
    with _block_runner(cpu_threads()) as run:
        out, lse = _blocked_forward(functools.partial(_fa2_forward_sequence, run=run, p_dtype=_E4M3), q32, k32, v32,
                                    scale, variant, block_q, block_k)
    return out.astype(ml_dtypes.bfloat16), lse


def _fa2_forward_sequence(q, k, v, out, lse, mods: _ScoreMods, block_q, block_k, run=None, p_dtype=None):
    dtype, acc_dtype = (p_dtype or q.dtype), _acc_dtype(q.dtype)
    seqlen_q, seqlen_k, heads_kv = q.shape[1], k.shape[1], k.shape[2]
    q5, k5, v5 = (_grouped(x, heads_kv) for x in (q, k, v))
    out5, lse4 = _grouped(out, heads_kv), _grouped_rows(lse, heads_kv)

    def query_block(q_start, q_stop):
        # [fa2-fwd 1] load a query block; start its running statistics
        q_i = _load(q5, q_start, q_stop, acc_dtype)
        m_i = np.full(q_i.shape[:-1], -np.inf, acc_dtype)
        l_i = np.zeros(q_i.shape[:-1], acc_dtype)
        acc = np.zeros(q_i.shape[:-1] + v.shape[-1:], acc_dtype)  # v's head dim (may differ from q's)
        k_first, k_end = key_range(q_start, q_stop, mods.band, seqlen_k)
        for k_start, k_stop in iter_blocks(k_first, k_end, block_k, seqlen_k):
            assert not tile_is_fully_masked(q_start, q_stop, k_start, k_stop, mods.band)
            if _skips(mods, q_start, k_start):
                continue  # [variant mask] mask_mod: no visible score in the tile
            k_j = _load(k5, k_start, k_stop, acc_dtype)
            v_j = _load(v5, k_start, k_stop, acc_dtype)
            # [fa2-fwd 2] S = scale * Q K^T (modified and masked)
            s, _ = _scores(q_i, k_j, mods, q_start, q_stop, k_start, k_stop)
            p, m_new = _online_softmax_step(s, m_i, l_i, acc)  # [fa2-fwd 3], [fa2-fwd 4]
            if mods.dropout is not None:
                # [variant dropout] P *= keep / (1 - p) after the row sum: l_i and lse are those of P undropped
                p *= _dropout_tile(mods.dropout, q_start, q_stop, k_start, k_stop, p.dtype)
            # [fa2-fwd 5] acc += P V, P rounded to the input dtype first
            acc += _cast_like_kernel(p, dtype) @ v_j
            m_i = m_new
        # [fa2-fwd 6] O = acc / l, lse = m + log l
        l_safe, lse_i = _finish_lse(m_i, l_i)
        acc /= l_safe[..., None]
        out5[..., q_start:q_stop, :] = acc
        lse4[..., q_start:q_stop] = lse_i

    (run or _in_order)(query_block, iter_blocks(0, seqlen_q, block_q, seqlen_q))


# ---------------------------------------------------------------------------------------------------
# FlashAttention(-1) forward: key/value blocks outer (000 Algorithm 4, 001 FlashForward)
# ---------------------------------------------------------------------------------------------------


def fa1_forward(q, k, v, *, scale, variant=DENSE, block_q=None, block_k=None):
    """FlashAttention forward with the loops of the first paper: ``(out, lse)``.

    The outer loop holds one key/value block; the inner loop visits every query block that can see it
    and reads that block's normalized output ``O``, row max ``m`` and row sum ``l`` from full-size
    ("HBM") arrays, folds in the new tile, and writes all three back. ``O`` is held in the accumulation
    dtype between steps, so the repeated write-backs add no rounding; it is cast to the input dtype once
    at the end, when ``lse = m + log l`` is formed too. One sequence at a time (see :func:`_sequences`).
    """
    return _blocked_forward(_fa1_forward_sequence, q, k, v, scale, variant, block_q, block_k)


def _fa1_forward_sequence(q, k, v, out, lse, mods: _ScoreMods, block_q, block_k):
    dtype, acc_dtype = q.dtype, _acc_dtype(q.dtype)
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    q5, k5, v5 = (_grouped(x, heads_kv) for x in (q, k, v))
    group = heads_q // heads_kv
    o_hbm = np.zeros((batch, heads_kv, group, seqlen_q, head_dim_v), acc_dtype)
    m_hbm = np.full((batch, heads_kv, group, seqlen_q), -np.inf, acc_dtype)
    l_hbm = np.zeros((batch, heads_kv, group, seqlen_q), acc_dtype)

    for k_start, k_stop in iter_blocks(0, seqlen_k, block_k, seqlen_k):
        k_j = _load(k5, k_start, k_stop, acc_dtype)
        v_j = _load(v5, k_start, k_stop, acc_dtype)
        q_first, q_end = query_range(k_start, k_stop, mods.band, seqlen_q)
        for q_start, q_stop in iter_blocks(q_first, q_end, block_q, seqlen_q):
            assert not tile_is_fully_masked(q_start, q_stop, k_start, k_stop, mods.band)
            if _skips(mods, q_start, k_start):
                continue  # [variant mask] mask_mod: no visible score in the tile
            # [fa1-fwd 1] load a query block and its O, m, l from HBM
            q_i = _load(q5, q_start, q_stop, acc_dtype)
            o_old = o_hbm[..., q_start:q_stop, :]
            m_old = m_hbm[..., q_start:q_stop]
            l_old = l_hbm[..., q_start:q_stop]
            # [fa1-fwd 2] S = scale * Q K^T (modified and masked)
            s, _ = _scores(q_i, k_j, mods, q_start, q_stop, k_start, k_stop)
            # [fa1-fwd 3] new row max; rescale factor exp(m_old - m_new) for the old O and l
            m_new = np.maximum(m_old, s.max(axis=-1))
            m_shift = _shift(m_new)
            alpha = np.exp(m_old - m_shift)
            # [fa1-fwd 4] P = exp(S - m_new), l_new = alpha * l_old + rowsum(P)
            s -= m_shift[..., None]
            p = np.exp(s, out=s)
            l_new = alpha * l_old + p.sum(axis=-1)
            if mods.dropout is not None:
                # [variant dropout] P *= keep / (1 - p) after the row sum: l and lse are those of P undropped
                p *= _dropout_tile(mods.dropout, q_start, q_stop, k_start, k_stop, p.dtype)
            # [fa1-fwd 5] unnormalized output: alpha * l_old * O_old + P V, P rounded to the input dtype
            o_new = o_old * (alpha * l_old)[..., None]
            o_new += _cast_like_kernel(p, dtype) @ v_j
            # [fa1-fwd 6] normalize by l_new and write O, m, l back to HBM
            o_new /= np.where(l_new > 0, l_new, 1.0)[..., None]
            o_hbm[..., q_start:q_stop, :] = o_new
            m_hbm[..., q_start:q_stop] = m_new
            l_hbm[..., q_start:q_stop] = l_new

    # [fa1-fwd 6] lse = m + log l; O leaves HBM scratch in the input dtype
    _, lse_all = _finish_lse(m_hbm, l_hbm)
    _grouped(out, heads_kv)[...] = o_hbm
    _grouped_rows(lse, heads_kv)[...] = lse_all


# ---------------------------------------------------------------------------------------------------
# Blocked backward (000 Algorithms 6 and 8, 001 FlashBackward, 003 split passes)
# ---------------------------------------------------------------------------------------------------


def preprocess_delta(do, out, *, block_q=None):
    """``D = rowsum(dO * O)``, shaped like ``lse`` in the accumulation dtype: ``(batch, heads, seqlen_q)``,
    or ``(heads, total_q)`` for packed ``(total_q, heads, d)`` arrays.

    Equal to ``rowsum(P * dP)`` (001, Lemma 2.1), so the backward never needs a whole row of ``P``.
    Computed ``block_q`` rows at a time so that only a block of each input is ever upcast.
    """
    if out.ndim == 3:
        return preprocess_delta(do[None], out[None], block_q=block_q)[0]
    acc_dtype = _acc_dtype(out.dtype)
    batch, seqlen_q, heads_q, head_dim = out.shape
    block_q = block_q or default_block_sizes(head_dim, pass_="backward")[0]
    delta = np.empty((batch, heads_q, seqlen_q), acc_dtype)
    for start, stop in iter_blocks(0, seqlen_q, block_q, seqlen_q):
        # [bwd 0] D = rowsum(dO * O)
        do_i = do[:, start:stop].astype(acc_dtype, copy=False)
        o_i = out[:, start:stop].astype(acc_dtype, copy=False)
        delta[:, :, start:stop] = (do_i * o_i).sum(axis=-1).transpose(0, 2, 1)
    return delta


class _BackwardInputs:
    """One sequence's backward operands as grouped views, its gradients (views of the call's, written in
    place), and the sizes and options every loop order needs."""

    def __init__(self, do, q, k, v, lse, delta, grads, dbias, mods: _ScoreMods, block_q, block_k):
        self.dtype, self.acc = q.dtype, _acc_dtype(q.dtype)
        self.batch, self.seqlen_q, self.heads_q, self.head_dim = q.shape
        self.seqlen_k, self.heads_kv, self.head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
        self.group = self.heads_q // self.heads_kv
        self.mods, self.scale = mods, mods.scale
        self.block_q, self.block_k = block_q, block_k
        self.q5, self.k5, self.v5, self.do5 = (_grouped(x, self.heads_kv) for x in (q, k, v, do))
        self.lse4 = _grouped_rows(lse, self.heads_kv)
        self.delta4 = _grouped_rows(delta, self.heads_kv)
        self.dq5, self.dk5, self.dv5 = (_grouped(x, self.heads_kv) for x in grads)
        self.dbias5 = None if dbias is None else _grouped_scores(dbias, self.heads_kv)

    def load_query_block(self, q_start, q_stop):
        """``Q_i``, ``dO_i`` and the row statistics ``lse_i`` (shifted, see :func:`_shift`) and ``D_i``."""
        q_i = _load(self.q5, q_start, q_stop, self.acc)
        do_i = _load(self.do5, q_start, q_stop, self.acc)
        lse_i = _shift(self.lse4[..., q_start:q_stop].astype(self.acc))
        delta_i = self.delta4[..., q_start:q_stop]
        return q_i, do_i, lse_i, delta_i

    def load_key_block(self, k_start, k_stop):
        """``K_j`` and ``V_j``."""
        return _load(self.k5, k_start, k_stop, self.acc), _load(self.v5, k_start, k_stop, self.acc)

    def key_blocks(self, q_start, q_stop):
        """The key blocks that some row of the query block sees."""
        first, end = key_range(q_start, q_stop, self.mods.band, self.seqlen_k)
        # [variant mask] mask_mod: tiles of no visible score are skipped
        return [(a, b) for a, b in iter_blocks(first, end, self.block_k, self.seqlen_k) if not _skips(self.mods, q_start, a)]

    def query_blocks(self, k_start, k_stop):
        """The query blocks that some row of which sees a key of the key block."""
        first, end = query_range(k_start, k_stop, self.mods.band, self.seqlen_q)
        # [variant mask] mask_mod: tiles of no visible score are skipped
        return [(a, b) for a, b in iter_blocks(first, end, self.block_q, self.seqlen_q) if not _skips(self.mods, a, k_start)]

    def tile(self, q_block, k_block, q_start, q_stop, k_start, k_stop, write_dbias=True):
        """Steps 1, 3 and 4 of one tile: ``(P, dS)``, both rounded to the input dtype for their products
        (``P`` after dropout, ``P * keep / (1 - p)``, the probabilities that entered ``P V``).

        With a dbias to form, the tile's ``dT`` is written there too (``write_dbias``: once per tile, by the
        pass that forms dK and dV when there are two)."""
        assert not tile_is_fully_masked(q_start, q_stop, k_start, k_stop, self.mods.band)
        q_i, do_i, lse_i, delta_i = q_block
        k_j, v_j = k_block
        # [bwd 1] P = exp(S - lse), S = scale * Q K^T (modified and masked) recomputed, lse saved
        s, grad = _scores(q_i, k_j, self.mods, q_start, q_stop, k_start, k_stop)
        s -= lse_i[..., None]
        p = np.exp(s, out=s)
        # [bwd 3] dP = dO V^T
        dp = do_i @ v_j.swapaxes(-1, -2)
        p_v = p
        if self.mods.dropout is not None:
            # [variant dropout] dV uses P_dropped = P * z, z = keep / (1 - p); the gradient of P is z * dP
            z = _dropout_tile(self.mods.dropout, q_start, q_stop, k_start, k_stop, p.dtype)
            p_v = p * z
            dp *= z
        # [bwd 4] dS = P * (dP - D)
        dp -= delta_i[..., None]
        ds = np.multiply(p, dp, out=dp)
        if grad is not None and grad.user is not None:
            # [variant grad] score_mod: dS *= d score_mod / d score (the bias is added before score_mod)
            ds *= grad.user
        if self.dbias5 is not None and write_dbias:
            # [variant grad] bias: dBias_ij = dT_ij = P (dP - D), before softcap's factor; one write per tile
            self.dbias5[..., q_start:q_stop, k_start:k_stop] = ds
        if grad is not None and grad.softcap is not None:
            # [variant grad] softcap: dS *= 1 - (t_capped / softcap)^2, the derivative of softcap * tanh(t / softcap)
            ds *= grad.softcap
        return _cast_like_kernel(p_v, self.dtype), _cast_like_kernel(ds, self.dtype)

    def hbm(self, rows, group, head_dim=None):
        """A zeroed full-size accumulator ``(batch, heads_kv, group, rows, head_dim)`` ("HBM"); ``head_dim``
        defaults to q's (and k's), dV's is ``head_dim_v``."""
        return np.zeros((self.batch, self.heads_kv, group, rows, head_dim or self.head_dim), self.acc)


def _dkdv_pass(a: _BackwardInputs, dq_hbm=None):
    """Key/value blocks outer: dK_j and dV_j stay local to the outer step and are written once.

    With ``dq_hbm`` (a full-size array), dQ is also read, updated and written back there at every tile,
    as the kernel's ``Has_dQ`` variant does with atomics; without it, only dK and dV are formed.
    """
    for k_start, k_stop in iter_blocks(0, a.seqlen_k, a.block_k, a.seqlen_k):
        k_block = k_j, v_j = a.load_key_block(k_start, k_stop)
        dk_j = np.zeros(k_j.shape, a.acc)
        dv_j = np.zeros(v_j.shape, a.acc)
        for q_start, q_stop in a.query_blocks(k_start, k_stop):
            q_block = q_i, do_i, _, _ = a.load_query_block(q_start, q_stop)
            p, ds = a.tile(q_block, k_block, q_start, q_stop, k_start, k_stop)
            # [bwd 2] dV_j += P^T dO
            dv_j += _group_transpose_matmul(p, do_i)
            if dq_hbm is not None:
                # [bwd 5] dQ_i += scale * dS K_j: read-modify-write in HBM (scale applied once, at the end)
                dq_hbm[..., q_start:q_stop, :] += ds @ k_j
            # [bwd 6] dK_j += scale * dS^T Q_i (scale applied when dK_j is written)
            dk_j += _group_transpose_matmul(ds, q_i)
        dk_j *= a.scale
        a.dk5[..., k_start:k_stop, :] = dk_j
        a.dv5[..., k_start:k_stop, :] = dv_j


def _backward_kv_outer(a: _BackwardInputs):
    """Key/value blocks outer (000 Algorithm 8, 001 FlashBackward): dK_j, dV_j stay local to the
    outer step; dQ is read, updated and written back in a full-size array at every tile."""
    dq_hbm = a.hbm(a.seqlen_q, a.group)
    _dkdv_pass(a, dq_hbm)
    dq_hbm *= a.scale
    a.dq5[...] = dq_hbm


def _backward_q_outer(a: _BackwardInputs):
    """Query blocks outer (000 Algorithm 6): dQ_i stays local to the outer step; dK and dV are read,
    updated and written back in full-size arrays at every tile."""
    dk_hbm = a.hbm(a.seqlen_k, 1)
    dv_hbm = a.hbm(a.seqlen_k, 1, a.head_dim_v)
    for q_start, q_stop in iter_blocks(0, a.seqlen_q, a.block_q, a.seqlen_q):
        q_block = q_i, do_i, _, _ = a.load_query_block(q_start, q_stop)
        dq_i = np.zeros(q_i.shape, a.acc)
        for k_start, k_stop in a.key_blocks(q_start, q_stop):
            k_block = k_j, _ = a.load_key_block(k_start, k_stop)
            p, ds = a.tile(q_block, k_block, q_start, q_stop, k_start, k_stop)
            # [bwd 2] dV_j += P^T dO: read-modify-write in HBM
            dv_hbm[..., k_start:k_stop, :] += _group_transpose_matmul(p, do_i)
            # [bwd 5] dQ_i += scale * dS K_j (scale applied when dQ_i is written)
            dq_i += ds @ k_j
            # [bwd 6] dK_j += scale * dS^T Q_i: read-modify-write in HBM (scale applied once, at the end)
            dk_hbm[..., k_start:k_stop, :] += _group_transpose_matmul(ds, q_i)
        dq_i *= a.scale
        a.dq5[..., q_start:q_stop, :] = dq_i
    dk_hbm *= a.scale
    a.dk5[...] = dk_hbm
    a.dv5[...] = dv_hbm


def _backward_split(a: _BackwardInputs):
    """Two passes with no read-modify-write of a shared array (003): first dK and dV with key/value
    blocks outer, then dQ with query blocks outer. P and dS are recomputed in each pass; every
    gradient block is written exactly once, so the GPU version needs no atomics and is deterministic."""
    _dkdv_pass(a)
    for q_start, q_stop in iter_blocks(0, a.seqlen_q, a.block_q, a.seqlen_q):
        q_block = q_i, _, _, _ = a.load_query_block(q_start, q_stop)
        dq_i = np.zeros(q_i.shape, a.acc)
        for k_start, k_stop in a.key_blocks(q_start, q_stop):
            k_block = k_j, _ = a.load_key_block(k_start, k_stop)
            _, ds = a.tile(q_block, k_block, q_start, q_stop, k_start, k_stop, write_dbias=False)
            # [bwd 5] dQ_i += scale * dS K_j (scale applied when dQ_i is written)
            dq_i += ds @ k_j
        dq_i *= a.scale
        a.dq5[..., q_start:q_stop, :] = dq_i


_BACKWARD_ORDERS = {"kv_outer": _backward_kv_outer, "q_outer": _backward_q_outer, "split": _backward_split}


def blocked_backward(do, q, k, v, out, lse, *, scale, variant=DENSE, block_q=None, block_k=None, order=None,
                     want_dbias=False):
    """FlashAttention backward: ``(dq, dk, dv)`` from the forward's ``out`` and ``lse``; with ``want_dbias``
    also ``dbias``, ``(batch, heads_q, seqlen_q, seqlen_k)`` in the accumulation dtype, written tile by tile
    (the gradient of the final scores, zero where masked).

    ``P`` is recomputed tile by tile from ``lse`` ([bwd 1]), so nothing of size ``seqlen_q x seqlen_k``
    exists but the dbias asked for. ``order`` picks the loop order (``docs/architecture.md``): ``"kv_outer"`` (default),
    ``"q_outer"`` or ``"split"``. All three compute the same tiles; they differ in which gradient is
    accumulated across the outer loop. Extra memory is O(seqlen x head_dim) for the accumulator plus
    O(block_q x block_k) per (batch, head). One sequence at a time (see :func:`_sequences`).
    """
    grads = _zero_grads(q, k, v, want_dbias)
    if _is_empty(q, k):
        return grads
    order = "kv_outer" if order is None else order
    assert order in _BACKWARD_ORDERS, order
    block_q, block_k = _resolve_block_sizes(max(q.shape[-1], v.shape[-1]), block_q, block_k, "backward")
    # [bwd 0] D = rowsum(dO * O), once, before the main loops
    delta = preprocess_delta(do, out, block_q=block_q)
    for seq in _sequences(q, k, variant, scale, (block_q, block_k)):
        inputs = _BackwardInputs(seq.q(do), seq.q(q), seq.k(k), seq.k(v), seq.rows(lse), seq.rows(delta),
                                 (seq.q(grads[0]), seq.k(grads[1]), seq.k(grads[2])),
                                 seq.scores(grads[3]) if want_dbias else None, seq.mods, block_q, block_k)
        _BACKWARD_ORDERS[order](inputs)
    return grads
