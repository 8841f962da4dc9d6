"""Merging partial attentions: the incremental softmax of seed 001 (section 1.1) applied to whole results.

Attention of a query row over a key set ``K`` is ``o = sum_j exp(t_j - lse) v_j`` with ``lse = log sum_j exp(t_j)``.
For disjoint key sets ``K_1, ..., K_S`` with partial results ``(o_s, lse_s)``, the row over their union is

    lse = log sum_s exp(lse_s)                       (logaddexp for two)
    o   = sum_s exp(lse_s - lse) o_s                 (the weights sum to 1)

exactly (up to rounding): each ``o_s`` is already normalized by its own ``exp(lse_s)``. A part that saw no key has
``lse_s = -inf`` and weight 0; a row for which every part is empty gets ``o = 0`` and ``lse = -inf``, never NaN. A
part with ``lse_s = NaN`` (a row poisoned by the decode kernels' guards) makes the row's ``o`` and ``lse`` NaN.

The code is written against the array module of its inputs (``xp``: NumPy or CuPy), so that
:func:`cuflash.merge_states` (both libraries) and the split-KV reference (``[decode merge]``) share it. The CUDA
decode path merges its splits with ``merge_row`` (``cuflash_kernels/decode.cu``: in the split kernel's last block
of each block column, and as ``decode_merge_kernel``), which follows this function step for step (the same
``[decode merge]`` tags): one warp per query row.
"""

from __future__ import annotations

__all__ = ["merge_stacked"]


def merge_stacked(o_parts, lse_parts, xp):
    """``(o, lse)`` of ``S`` partial results stacked on a leading axis.

    ``o_parts``: ``(S, ..., rows, d)`` and ``lse_parts``: ``(S, ..., rows)``, both in the accumulation dtype
    (float32, or float64); returns ``o`` ``(..., rows, d)`` and ``lse`` ``(..., rows)`` in that dtype.
    """
    neg_inf = xp.asarray(-xp.inf, dtype=lse_parts.dtype)
    zero = xp.asarray(0, dtype=lse_parts.dtype)
    # [decode merge] lse = max_s + log sum_s exp(lse_s - max_s): the largest part sets the scale (no overflow)
    top = xp.max(lse_parts, axis=0)
    top_safe = xp.where(top == neg_inf, zero, top)            # a row of only empty parts: exp(-inf - 0) = 0
    total = xp.sum(xp.exp(lse_parts - top_safe), axis=0)
    seen = total > 0
    # total is NaN where a part's lse is ([decode guard]: a sequence with an index out of range): so are lse and o
    lse = xp.where(seen, top_safe + xp.log(xp.where(seen, total, 1)), xp.where(total == 0, neg_inf, total))
    # [decode merge] o = sum_s exp(lse_s - lse) o_s
    weights = xp.exp(lse_parts - xp.where(total == 0, zero, lse))  # 0 for empty parts and for rows that saw no key
    o = xp.sum(weights[..., None] * o_parts, axis=0)
    return o, lse
