"""Philox-4x32-10 and the dropout keep decision built on it (``docs/variants.md``, "Dropout").

Philox-4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11;
the Random123 constants) maps a 128-bit counter and a 64-bit key to four uniform uint32 words with no
state: the same counter and key give the same words in any order, on any device. That is what lets
attention dropout regenerate its mask in the backward instead of storing it, and lets a GPU kernel
evaluate the mask of any tile in any order.

Everything here is vectorized NumPy: the arguments broadcast against each other, uint32 words are
multiplied in uint64 to get the high and low halves of the product.
"""

from __future__ import annotations

import numpy as np

__all__ = ["philox4x32", "keep_threshold", "dropout_keep", "KEEP_BITS", "THRESHOLD_ONE"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)   # round multipliers
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)   # Weyl key increments (golden ratio, sqrt(3) - 1)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_U1, _U2, _U3, _U4, _U5, _U7 = (np.uint64(n) for n in (1, 2, 3, 4, 5, 7))
ROUNDS = 10


def philox4x32(counter, key, rounds: int = ROUNDS):
    """Philox-4x32 with ``rounds`` rounds: ``(c0, c1, c2, c3)`` words, ``(k0, k1)`` key -> four uint32 arrays.

    Each argument is a sequence of 4 (counter) or 2 (key) integer arrays (or scalars) that broadcast
    against each other. One round: ``(hi0, lo0) = M0 * c0``, ``(hi1, lo1) = M1 * c2``, then
    ``(c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)``; the key is bumped by the Weyl constants
    between rounds.
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK32 for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _MASK32 for k in key)
    for r in range(rounds):
        if r:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _MASK32)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


KEEP_BITS = 8                  # each Philox word serves four scores, an 8-bit quarter each
THRESHOLD_ONE = 1 << KEEP_BITS  # keep_threshold of p = 0 (every score kept)


def keep_threshold(dropout_p: float) -> int:
    """``T = floor((1 - p) * 2**8)``, computed in float64: a score is kept iff its uniform 8-bit quarter-word
    ``r < T``. So ``p`` is quantized to a multiple of ``2**-8`` (the kept fraction is ``T / 256``, at most
    ``2**-8`` below ``1 - p``; flash-attention's 8-bit threshold quantizes ``p`` as finely); ``T`` is 256 only
    when ``1 - p`` rounds to 1 (no dropout)."""
    return int(np.floor((1.0 - float(dropout_p)) * float(THRESHOLD_ONE)))


def dropout_keep(seed: int, offset: int, dropout_p: float, b, h, i, j) -> np.ndarray:
    """The keep decision of score ``(b, h, i, j)``: a boolean array, the broadcast of the index arrays.

    key = ``(seed mod 2**32, seed >> 32)``; counter = ``(c0, c1, lo32(W), hi32(W))`` with
    ``c0 = (i >> 4) * 8 + (i & 7)``, ``c1 = (j >> 5) * 4 + ((j >> 1) & 3)`` and the 64-bit
    ``W = (b * 2**32 + h + offset) mod 2**64``; of that call's word ``2 * ((i >> 3) & 1) + ((j >> 3) & 1)``,
    the byte ``2 * ((j >> 4) & 1) + (j & 1)`` (byte 0 the lowest) is ``r``, and the score is kept iff
    ``r < keep_threshold(p)``. A pure function of ``(seed, offset, b, h, i, j)``.

    One call thus serves the sixteen scores ``(i, i + 8) x (j + 8c + e)``, ``c < 4``, ``e < 2`` (``i & 8 == 0``,
    ``j & 25 == 0``) of a 16 x 32 block: the sixteen accumulator entries that one lane of an mma holds in the
    normal (forward) layout (``docs/variants.md``, "Dropout").
    """
    b, h, i, j = (np.asarray(x, dtype=np.uint64) for x in (b, h, i, j))
    with np.errstate(over="ignore"):  # the 64-bit word wraps mod 2**64 by definition
        w = (b << _SHIFT32) + h + np.uint64(offset)
    c0 = ((i >> _U4) << _U3) + (i & _U7)
    c1 = ((j >> _U5) << _U2) + ((j >> _U1) & _U3)
    words = philox4x32((c0, c1, w & _MASK32, w >> _SHIFT32), (seed & 0xFFFFFFFF, seed >> 32))
    lane = ((((i >> _U3) & _U1) << _U1) + ((j >> _U3) & _U1)).astype(np.intp)
    shape = np.broadcast_shapes(*(x.shape for x in words), lane.shape, j.shape)
    r = np.choose(np.broadcast_to(lane, shape), [np.broadcast_to(x, shape) for x in words])
    quarter = (((j >> _U4) & _U1) << _U1) + (j & _U1)
    r = (r >> (quarter * np.uint64(8)).astype(np.uint32)) & np.uint32(0xFF)
    threshold = keep_threshold(dropout_p)
    if threshold >= THRESHOLD_ONE:
        return np.ones(shape, bool)
    return r < np.uint32(threshold)
