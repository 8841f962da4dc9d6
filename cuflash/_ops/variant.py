"""What changes the scores of one attention call: the backends' normalized view of the variant options.

The front door (:mod:`cuflash._ops.api`) validates the user's options (``causal``, ``window_size``,
``softcap``, ``alibi_slopes``, ``cu_seqlens_q``/``cu_seqlens_k``, ``seqused_k``, ``bias``, ``attn_mask``) and
hands every backend
one :class:`Variant`. The math of each piece, in the forward and the backward, is in
``docs/variants.md``; both backends apply it through the same hooks:

- **sequences** (:meth:`Variant.lengths`): which rows of the arrays form sequence ``b`` (packed
  variable-length batches) and how many of its keys are used (``seqused_k``);
- **the band** (:meth:`Variant.band`): which keys a query row sees by position (causal masking and
  sliding windows), from which the loop bounds of both backends follow (:mod:`cuflash._ops.blocks`);
- **score modifications**: softcap, ALiBi and an additive bias change the visible scores before the
  softmax; softcap's derivative multiplies dS in the backward, and the bias's gradient is the gradient of
  the final scores, ``dT``;
- **user modifications** (``mods``, ``mod_arrays``): the user's ``score_mod`` (a CUDA C expression applied
  to the scaled score last, with its derivative in the backward) and ``mask_mod`` (AND-ed with the other
  masks; whole tiles it masks are skipped), parsed by :mod:`cuflash._ops.mods`;
- **dropout** (:meth:`Variant.keep`): after the softmax, each probability is kept with probability
  ``1 - dropout_p`` (and scaled by ``1 / (1 - dropout_p)``) or zeroed, by a counter-based generator
  (:mod:`cuflash._ops.philox`) that the backward evaluates again; the lse is that of the undropped scores.

A plain dense call is ``Variant()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .blocks import Band
from .philox import dropout_keep

__all__ = ["Variant", "VariantArrays"]


class VariantArrays(NamedTuple):
    """The fields of a :class:`Variant` that hold arrays (and a BlockMask's store of block lists), apart: what
    differs between calls that share everything else. A planned launch (``cuflash._cuda.attention``) is made for
    a variant without them and reads them at each run."""

    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    seqused_k: Any = None
    alibi_slopes: Any = None
    bias: Any = None
    mod_arrays: tuple = ()
    block_lists: dict | None = None

    @property
    def empty(self) -> bool:
        """No array at all (a plain call: nothing of it changes between calls but q, k, v)."""
        return all(a is None for a in self[:5]) and not self.mod_arrays and self.block_lists is None


@dataclass(frozen=True, eq=False)
class Variant:
    """Normalized variant options (validated by :mod:`cuflash._ops.validate`; backends trust them).

    Attributes
    ----------
    causal : bool
        Keys after the query's diagonal are masked (the band's right edge is at most 0).
    bottom_right : bool
        The diagonal of sequence ``b``: query ``i`` faces key ``i + len_k - len_q`` (True, flash-attention's
        alignment) or key ``i`` (False, ``causal_align="top-left"``). Used by causal masking, windows and ALiBi.
    window_left, window_right : int or None
        Sliding window: query ``i`` sees keys ``[i + off - window_left, i + off + window_right]``;
        None is unlimited on that side (flash-attention's -1).
    softcap : float
        0 for none; else scores ``t`` (already scaled) become ``softcap * tanh(t / softcap)``.
    alibi_slopes : array or None
        float32, shape ``(batch, heads_q)`` (a ``(heads_q,)`` input arrives broadcast, batch stride 0),
        same array library as q: adds ``-slope * |i + off - j|`` to the scaled scores.
    cu_seqlens_q, cu_seqlens_k : arrays or None
        int32 ``(batch + 1,)`` prefix sums: sequence ``b`` is rows ``[cu[b], cu[b + 1])`` of the packed
        ``(total, heads, head_dim)`` arrays. Both or neither.
    max_seqlen_q, max_seqlen_k : int or None
        Upper bounds of the sequence lengths (with cu_seqlens): they size the CUDA grid.
    seqused_k : array or None
        int32 ``(batch,)``: sequence ``b`` uses only its first ``seqused_k[b]`` keys (the rest are padding),
        in the padded ``(batch, seqlen, heads, d)`` layout or with cu_seqlens_k.
    bias : array or None
        Shape ``(batch, heads_q, seqlen_q, seqlen_k)``, float32 (float64 for float64 inputs; on CuPy with
        float16 / bfloat16 inputs also float16 or bfloat16, which the kernels read as such), same array
        library as q, padded layout only: added to the scaled score of query ``i`` and key ``j`` after
        softcap and ALiBi, before the masks. It is the user's ``bias`` and ``attn_mask`` (``False`` as
        ``-inf``) in one array; ``-inf`` entries mask. Any strides on the first three axes (0 on the axes
        the user's array broadcasts over: no copy of a bias of such a dtype), a contiguous last axis.
    dropout_p : float
        In ``[0, 1)``; 0 for no dropout. Probabilities are zeroed with this probability after the softmax.
    dropout_seed : int or None
        In ``[0, 2**64)``, the Philox key; given whenever ``dropout_p > 0``.
    dropout_offset : int
        In ``[0, 2**64)``, folded into the Philox counter (flash-attention's philox offset).
    mods : cuflash._ops.mods.UserMods or None
        The user's ``score_mod`` and ``mask_mod``, parsed and typed (hashable: equal mods generate the same C++
        struct, ``mods.type_name`` / ``mods.source``), and the names and dtypes of the arrays they read.
    mod_arrays : tuple or None
        Those arrays (1-D int32 / float32, same array library as q), in the order of ``mods.array_names``
        (``ModArrays::ptr[k]``); ``()`` when the expressions read none.
    block_lists : dict or None
        A :class:`cuflash.BlockMask`'s store of mask_mod block lists (the CUDA backend reuses them across
        calls); None: built per call (or cached by shape for masks that read no array).
    """

    causal: bool = False
    bottom_right: bool = True
    window_left: int | None = None
    window_right: int | None = None
    softcap: float = 0.0
    alibi_slopes: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    seqused_k: Any = None
    bias: Any = None
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    dropout_offset: int = 0
    mods: Any = None
    mod_arrays: tuple | None = None
    block_lists: dict | None = field(default=None, compare=False, repr=False)

    @property
    def arrays(self) -> VariantArrays:
        return VariantArrays(self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k, self.alibi_slopes, self.bias,
                             self.mod_arrays or (), self.block_lists)

    def with_arrays(self, arrays: VariantArrays) -> "Variant":
        """This variant with other arrays (of the same layouts: a plan's variant and a run's arrays)."""
        return dataclasses.replace(
            self, cu_seqlens_q=arrays.cu_seqlens_q, cu_seqlens_k=arrays.cu_seqlens_k, seqused_k=arrays.seqused_k,
            alibi_slopes=arrays.alibi_slopes, bias=arrays.bias,
            mod_arrays=arrays.mod_arrays if self.mods is not None else None, block_lists=arrays.block_lists)

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def is_dense(self) -> bool:
        """Nothing but plain softmax attention over the whole (batch, seqlen) arrays."""
        return (not self.causal and self.window_left is None and self.window_right is None and not self.softcap
                and self.alibi_slopes is None and not self.is_varlen and self.seqused_k is None and self.bias is None
                and not self.dropout_p and self.mods is None)

    @property
    def right(self) -> int | None:
        """The band's right edge: causal caps it at 0."""
        if self.causal:
            return 0 if self.window_right is None else min(self.window_right, 0)
        return self.window_right

    def offset(self, len_q: int, len_k: int) -> int:
        """The diagonal of a sequence: query ``i`` faces key ``i + offset``."""
        return len_k - len_q if self.bottom_right else 0

    def keep(self, b, h, i, j):
        """The dropout keep mask of scores ``(b, h, i, j)`` (broadcast index arrays; positions within the
        sequence, ``b`` its index), or None without dropout. See :func:`cuflash._ops.philox.dropout_keep`."""
        if not self.dropout_p:
            return None
        return dropout_keep(self.dropout_seed, self.dropout_offset, self.dropout_p, b, h, i, j)

    def band(self, len_q: int, len_k: int) -> Band | None:
        """The positional mask of a sequence of ``len_q`` queries and ``len_k`` keys (None: every key)."""
        right, left = self.right, self.window_left
        if right is None and left is None:
            return None
        return Band(self.offset(len_q, len_k), left, right)
