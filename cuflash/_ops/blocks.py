"""Block arithmetic shared by the NumPy reference and the CUDA launcher.

Everything here is integer arithmetic on row and column indices, so that the reference loops and the
GPU grid agree on exactly which tiles exist, which are skipped and which are masked:

- :func:`default_block_sizes` turns an on-chip budget of ``M`` elements into tile sizes, by the rule
  of the seeds (000, eqs. 44 and 79): the forward keeps four blocks on chip, the backward eight.
- :func:`key_range` and :func:`query_range` bound the inner loop under a positional mask (a
  :class:`Band`: causal masking, sliding windows), one for each loop order, so that tiles lying
  entirely outside the band are never visited.
- :func:`tile_needs_mask` says whether a visited tile crosses an edge of the band; the others are
  computed without building a mask at all.
- :func:`decode_block_sizes`, :func:`decode_num_splits` and :func:`split_range`: the tiles of decoding with a
  KV cache, how many parts each sequence's keys are split into (split-KV, chosen from the shapes alone) and
  which key tiles each part gets (``docs/decoding.md``).

The kernels hold the same arithmetic (``cuflash_kernels/variants.cuh``); the band's meaning is in
``docs/variants.md``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import NamedTuple

__all__ = [
    "DEFAULT_SRAM_ELEMS",
    "default_block_sizes",
    "DEFAULT_CACHE_BYTES",
    "cache_bytes",
    "cpu_block_sizes",
    "num_blocks",
    "iter_blocks",
    "align_down",
    "Band",
    "key_range",
    "query_range",
    "tile_needs_mask",
    "tile_is_fully_masked",
    "NOMINAL_SM_COUNT",
    "decode_block_sizes",
    "decode_num_splits",
    "decode_blocks_per_sm",
    "split_range",
]

# The "SRAM" of the CPU reference's backward (its forward sizes square tiles from the L2 cache instead:
# cpu_block_sizes below, docs/cpu-performance.md): 2**14 elements, 64 KiB of float32. At head_dim 64 the rule gives
# 64 x 64 tiles forward (32 x 32 backward): the four blocks of one (batch, head) take 16 KiB each, and
# since the reference runs the tile of every (batch, head) at once, a score tile at batch x heads = 16
# is 1 MiB, about one core's L2. (It is also the scale of a GPU thread block's shared memory, and the
# tiles are of the order of the kernels', 64 to 128 rows.) Larger budgets are no faster on an idle
# CPU and much slower on a busy one: each product of a larger tile is big enough for BLAS to split it
# across threads, and thousands of such small threaded calls stall whenever a core is taken away.
# Measured with bench_cpu on a shared 2-core EPYC (FA2 forward, batch x heads 16, seqlen 2048, d 64):
# M = 2**14 ran at 0.4x naive's time where M = 2**15 to 2**18 ran at 1.7x to 2.3x (medians of 5, with
# single runs up to 19 s); on an idle machine all of them ran at 0.5x to 1.1x of naive.
DEFAULT_SRAM_ELEMS = 2**14

# How many tiles the algorithm keeps on chip at once: Q, O, K-or-V and S forward (000, eq. 43);
# Q, K, V, P-or-dS, dO, dQ, dK, dV backward (000, eq. 78).
_BLOCKS_ON_CHIP = {"forward": 4, "backward": 8}


def default_block_sizes(
    head_dim: int, *, sram_elems: int = DEFAULT_SRAM_ELEMS, pass_: str = "forward"
) -> tuple[int, int]:
    """Tile sizes ``(block_q, block_k)`` that fit an on-chip budget of ``sram_elems`` elements.

    Forward (000, eq. 44): ``block_q = floor(M / 4d)``, ``block_k = min(floor(M / 4d), d)``.
    Backward (000, eq. 79): the same with ``8d``, since eight blocks are live instead of four.
    Query blocks are made as tall as possible because every query block streams all of K and V;
    key blocks are capped at ``d`` so that the ``block_q x block_k`` score tile fits the same budget.
    Both are at least 1.
    """
    if pass_ not in _BLOCKS_ON_CHIP:
        raise ValueError(f"pass_ must be 'forward' or 'backward', got {pass_!r}")
    d = max(int(head_dim), 1)
    rows = max(int(sram_elems) // (_BLOCKS_ON_CHIP[pass_] * d), 1)
    return rows, max(min(rows, d), 1)


# ---------------------------------------------------------------------------------------------------
# The NumPy reference's forward tiles on the CPU: from the size of one core's cache (docs/performance.md)
# ---------------------------------------------------------------------------------------------------

# What cache_bytes() assumes when the machine does not say: the L2 of one core on most x86 server parts
# of the last years lies between 512 KiB and 2 MiB.
DEFAULT_CACHE_BYTES = 512 * 1024
# The CPU tiles are multiples of this (the kernels' tile granule) and lie in [_CPU_TILE_MIN, _CPU_TILE_MAX].
_CPU_TILE_STEP, _CPU_TILE_MIN, _CPU_TILE_MAX = 64, 64, 1024
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)B?\s*$", re.IGNORECASE)


def _parse_size(text: str) -> int | None:
    """``"512K"`` -> 524288 (the format of ``/sys/devices/system/cpu/cpu0/cache/index*/size``); None if unreadable."""
    match = _SIZE.match(text)
    if not match:
        return None
    return int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2).upper()]


def cache_bytes(level: int = 2, *, sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Size in bytes of one core's data (or unified) cache of ``level``, read portably, or
    :data:`DEFAULT_CACHE_BYTES` when the machine does not say.

    Tried in turn: ``os.sysconf("SC_LEVEL2_CACHE_SIZE")`` (glibc, where Python knows the name), Linux's sysfs
    (``index*/level``, ``type``, ``size`` under ``sysfs``), macOS's ``sysctl hw.l2cachesize``. The first positive
    answer wins; a failure of any kind moves on to the next.
    """
    name = f"SC_LEVEL{level}_{'D' if level == 1 else ''}CACHE_SIZE"
    try:
        if name in os.sysconf_names and os.sysconf(name) > 0:
            return int(os.sysconf(name))
    except (AttributeError, OSError, ValueError):
        pass
    try:
        for entry in sorted(os.listdir(sysfs)):
            path = os.path.join(sysfs, entry)
            if not entry.startswith("index"):
                continue
            with open(os.path.join(path, "level")) as f_level, open(os.path.join(path, "type")) as f_type:
                if int(f_level.read()) != level or f_type.read().strip() not in ("Data", "Unified"):
                    continue
            with open(os.path.join(path, "size")) as f_size:
                size = _parse_size(f_size.read())
            if size:
                return size
    except (OSError, ValueError):
        pass
    if level == 2 and hasattr(os, "uname") and os.uname().sysname == "Darwin":
        import subprocess

        try:
            size = int(subprocess.run(["sysctl", "-n", "hw.l2cachesize"], capture_output=True, text=True,
                                      timeout=2).stdout.strip() or 0)
            if size > 0:
                return size
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return DEFAULT_CACHE_BYTES


def cpu_block_sizes(head_dim: int, *, cache: int | None = None, itemsize: int = 4) -> tuple[int, int]:
    """The NumPy reference's default forward tiles ``(block_q, block_k)`` on the CPU: square tiles of ``B``
    rows, the largest multiple of 64 (at least 64, at most 1024) whose working set of one (batch, head) fits
    one core's L2 cache of ``cache`` bytes (:func:`cache_bytes` when None) in ``itemsize``-byte elements:

        B * B + 3 * B * d <= cache / itemsize      (S; Q_i, O_i, K_j or V_j)

    The four blocks are the seed rule's (000, eq. 43), but the score tile is square instead of capped at ``d``:
    on the CPU each tile costs a fixed Python and NumPy overhead of about a dozen array operations, so the
    tile must be large enough for its products to dominate it (64 x 64 tiles spend more time in overhead than
    in arithmetic), and the L2 bound keeps one head's S in cache between the softmax's passes over it.
    ``head_dim`` is the larger of q's and v's. The kernels choose their own tiles (docs/kernel-notes.md).
    """
    d = max(int(head_dim), 1)
    elems = (cache_bytes() if cache is None else int(cache)) // max(int(itemsize), 1)
    # the positive root of B^2 + 3dB - elems = 0
    rows = (math.isqrt(9 * d * d + 4 * elems) - 3 * d) // 2
    rows = min(max(rows - rows % _CPU_TILE_STEP, _CPU_TILE_MIN), _CPU_TILE_MAX)
    return rows, rows


def num_blocks(seqlen: int, block: int) -> int:
    """How many blocks of ``block`` rows cover ``seqlen`` rows (the last one may be short)."""
    return -(-seqlen // block)


def iter_blocks(first: int, end: int, block: int, seqlen: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of the blocks on the grid of multiples of ``block`` that hold a row of ``[first, end)``.

    The first block starts at ``align_down(first, block)``, so blocks sit on the same grid whichever
    loop visits them; there are none when ``first >= end``. ``stop`` is clipped to ``seqlen``, not to
    ``end``: a block that starts before ``end`` is loaded whole and masked, as a kernel tile would be.
    """
    if first >= end:
        return
    for start in range(align_down(first, block), end, block):
        yield start, min(start + block, seqlen)


def align_down(index: int, block: int) -> int:
    """Start of the block (on the grid of multiples of ``block``) that holds row ``index``."""
    return index - index % block


class Band(NamedTuple):
    """The keys a query row sees by position: row ``i`` sees key ``j`` iff
    ``i + offset - left <= j <= i + offset + right``; ``left`` or ``right`` None is unlimited on that side.

    Causal masking is the band with ``right = 0`` (``offset`` from the alignment); a sliding window sets
    both edges. ``None`` in place of a band means every key is seen.
    """

    offset: int
    left: int | None
    right: int | None


def key_range(q_start: int, q_stop: int, band: Band | None, seqlen_k: int) -> tuple[int, int]:
    """``(first, end)``: the keys that some query row of ``[q_start, q_stop)`` sees, clipped to ``[0, seqlen_k]``.

    The block's last row ``q_stop - 1`` sees keys up to ``q_stop - 1 + offset + right`` and its first row
    keys from ``q_start + offset - left``; every row in between sees a range inside those two, so key
    blocks wholly outside ``[first, end)`` are skipped. ``first >= end`` means none.
    """
    if band is None:
        return 0, seqlen_k
    first = 0 if band.left is None else min(max(q_start + band.offset - band.left, 0), seqlen_k)
    end = seqlen_k if band.right is None else min(max(q_stop + band.offset + band.right, 0), seqlen_k)
    return first, end


def query_range(k_start: int, k_stop: int, band: Band | None, seqlen_q: int) -> tuple[int, int]:
    """``(first, end)``: the query rows that see some key of ``[k_start, k_stop)``, clipped to ``[0, seqlen_q]``.

    Row ``i`` sees key ``k_start`` or a later one of the block iff ``i >= k_start - offset - right``, and
    key ``k_stop - 1`` or an earlier one iff ``i <= k_stop - 1 - offset + left``: the loops with key
    blocks outer visit the query blocks holding ``[first, end)`` (see :func:`iter_blocks`).
    """
    if band is None:
        return 0, seqlen_q
    first = 0 if band.right is None else min(max(k_start - band.offset - band.right, 0), seqlen_q)
    end = seqlen_q if band.left is None else min(max(k_stop - band.offset + band.left, 0), seqlen_q)
    return first, end


def tile_needs_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, band: Band | None) -> bool:
    """Whether some score of the tile ``[q_start, q_stop) x [k_start, k_stop)`` lies outside the band.

    The tile's first row sees keys up to ``q_start + offset + right`` and its last row keys from
    ``q_stop - 1 + offset - left``; a tile inside both is computed without building a mask at all.
    """
    if band is None:
        return False
    beyond = band.right is not None and k_stop - 1 > q_start + band.offset + band.right
    before = band.left is not None and k_start < q_stop - 1 + band.offset - band.left
    return beyond or before


def tile_is_fully_masked(q_start: int, q_stop: int, k_start: int, k_stop: int, band: Band | None) -> bool:
    """Whether every score of the tile lies outside the band. The loop bounds above never visit such a
    tile; the reference asserts that."""
    if band is None:
        return False
    beyond = band.right is not None and k_start > q_stop - 1 + band.offset + band.right
    before = band.left is not None and k_stop - 1 < q_start + band.offset - band.left
    return beyond or before


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache: tiles, and how many splits of the cache (flash-decoding)
# ---------------------------------------------------------------------------------------------------

# The SM count the automatic split rule assumes (an H100 SXM has 132). The rule depends on the shapes only,
# never on the device or on the cache's device-resident lengths, so the NumPy reference and the GPU launcher
# choose the same count for the same call and a captured CUDA graph stays valid for a batch shape.
NOMINAL_SM_COUNT = 132
MAX_DECODE_SPLITS = 128
# Thread blocks of the decode kernel that one SM holds at once (d 128 on the H100: 213-216 registers x 128 threads,
# 68 KiB of shared memory: two). The split rule fills these slots, not just the SMs: on the H100 (bf16, batch 1,
# 8 KV heads, 65536 keys) 14 splits (112 blocks, one per SM) took 158 us and 33 (264 blocks) 107.5 us.
DECODE_BLOCKS_PER_SM = 2
# A decode tile holds this many packed query rows: (query token, query head of the group) pairs.
DECODE_BLOCK_M = 64


def decode_block_sizes(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """``(block_m, block_n)`` of the decode kernels and of their reference: ``block_m`` packed query rows
    (each a query token and one query head of a key/value head's group: GQA packing), ``block_n`` keys per
    tile, 128 up to head dim 128 and 64 above (the K and V tiles of one step stay within the on-chip budget)."""
    return DECODE_BLOCK_M, (128 if max(head_dim, head_dim_v) <= 128 else 64)


def decode_blocks_per_sm(head_dim: int, head_dim_v: int) -> int:
    """Thread blocks of the decode kernel of these head dims that one SM holds: :data:`DECODE_BLOCKS_PER_SM`, but one
    for MLA's 576 / 512 (its 64 x 576 tiles take 225 KiB of shared memory)."""
    return 1 if max(head_dim, head_dim_v) > 256 else DECODE_BLOCKS_PER_SM


def decode_num_splits(work_units: int, n_key_tiles: int, *, num_sms: int = NOMINAL_SM_COUNT,
                      max_splits: int = MAX_DECODE_SPLITS, blocks_per_sm: int = DECODE_BLOCKS_PER_SM) -> int:
    """How many parts to split each sequence's keys into (split-KV), when the caller leaves it to us.

    ``work_units`` is the number of thread blocks of one split, ``batch * heads_kv * m_tiles`` (``m_tiles``:
    tiles of ``DECODE_BLOCK_M`` packed query rows), and ``n_key_tiles`` the key tiles of the longest possible
    sequence (the cache's capacity, known from the shapes). The rule:

    1. ``work_units >= 0.8 * num_sms``: the grid nearly fills the GPU already; 1 split (no merge).
    2. Otherwise, with ``slots = num_sms * blocks_per_sm`` (the blocks the GPU holds at once), for each candidate
       ``s`` in ``1 .. min(max_splits, slots, n_key_tiles)`` (only counts that change the tiles per split,
       ``ceil(n / s) != ceil(n / (s - 1))``: the others do the same work in more blocks), the wave efficiency
       ``w / ceil(w)`` with ``w = work_units * s / slots`` (the fraction of the last wave of slots that has work);
       the smallest ``s`` within 95 % of the best efficiency wins: as few splits (and as little merging) as fill
       the slots. A memory-bound kernel needs the slots filled: one block per SM leaves too few loads in flight.
    """
    if work_units <= 0 or n_key_tiles <= 1 or work_units >= 0.8 * num_sms:
        return 1
    slots = num_sms * blocks_per_sm
    limit = min(max_splits, slots, n_key_tiles)
    candidates = [s for s in range(1, limit + 1) if s == 1 or num_blocks(n_key_tiles, s) != num_blocks(n_key_tiles, s - 1)]

    def efficiency(splits: int) -> float:
        waves = work_units * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.95 * best)


def split_range(first: int, end: int, num_splits: int, split: int) -> tuple[int, int]:
    """The part ``split`` of ``num_splits`` of the tiles ``[first, end)``: ``[first + split * n // num_splits,
    first + (split + 1) * n // num_splits)`` with ``n = end - first``, so that the parts differ by at most one
    tile and are empty only when there are fewer tiles than splits."""
    n = max(end - first, 0)
    return first + split * n // num_splits, first + (split + 1) * n // num_splits
