"""cuflash.attention_with_kvcache on NumPy arrays (the reference of the decode kernels) against a float64 truth.

The truth is computed per sequence: the cache is gathered into a dense ``(len_k, heads_kv, d)`` array (through the
block table for paged caches), the new keys rotated and appended by hand, and plain softmax attention (written
here with explicit masks) runs on it. Most tests shrink the decode tiles (``small_tiles``: 8 packed query rows, 4
keys per tile) so that small caches already span many tiles, splits and query tiles.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash._ops import api as _api, blocks as _blocks, validate as _validate
from cuflash._ops.blocks import decode_num_splits, split_range

from _helpers import LOW_PRECISION, assert_within_budget, rounding_floor


@pytest.fixture
def small_tiles(monkeypatch):
    """Decode tiles of 8 packed query rows and 4 keys (the front door asks _blocks for them)."""
    monkeypatch.setattr(_blocks, "decode_block_sizes", lambda head_dim, head_dim_v: (8, 4))


# ---------------------------------------------------------------------------------------------------
# The truth, written independently of the reference
# ---------------------------------------------------------------------------------------------------


def rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding through complex numbers: pair (x1, x2) -> (x1 + i x2) e^{i theta}. float64."""
    x = np.array(x, dtype=np.float64)
    half = cos.shape[1]
    theta = np.arctan2(np.asarray(sin, np.float64), np.asarray(cos, np.float64))[positions][:, :, None, :]
    radius = np.hypot(np.asarray(sin, np.float64), np.asarray(cos, np.float64))[positions][:, :, None, :]
    if interleaved:
        first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2))
    else:
        first, second = (slice(0, half), slice(half, 2 * half))
    z = (x[..., first] + 1j * x[..., second]) * radius * np.exp(1j * theta)
    x[..., first], x[..., second] = z.real, z.imag
    return x


def dense_attention(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """One sequence, float64: q ``(len_q, heads_q, d)``, k ``(len_k, heads_kv, d)``, v ``(len_k, heads_kv, dv)``;
    bottom-right diagonal. Returns ``(out (len_q, heads_q, dv), lse (heads_q, len_q))``."""
    len_q, heads_q, _ = q.shape
    len_k, heads_kv, _ = k.shape
    group = heads_q // heads_kv
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    t = np.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap:
        t = softcap * np.tanh(t / softcap)
    i = np.arange(len_q)[:, None] + len_k - len_q
    j = np.arange(len_k)[None, :]
    if slopes is not None:
        t = t - np.asarray(slopes, np.float64)[:, None, None] * np.abs(i - j)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    visible = np.ones((len_q, len_k), bool)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    t = np.where(visible, t, -np.inf)
    m = t.max(axis=-1, initial=-np.inf, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(t - m)
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    out = np.einsum("hij,jhd->ihd", p, vv)
    lse = np.where(total[..., 0] > 0, m[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)), -np.inf)
    return out, lse


class Scenario:
    """A cache, its block table (or rows), the call's arrays and the expected cache contents after the append."""

    def __init__(self, *, batch=3, heads_q=4, heads_kv=2, d=16, dv=None, page_size=None, capacity=40, seqlens=None,
                 leftpad=None, seqlen_new=1, seqlen_q=None, dtype=np.float64, seed=0, shared_prefix_pages=0,
                 batch_idx=False, mla=False, rotary=None, extra_pages=3):
        rng = np.random.default_rng(seed)
        dv = d if dv is None else dv
        self.rng, self.dtype, self.page_size, self.capacity = rng, dtype, page_size, capacity
        self.seqlen_new = seqlen_new
        seqlen_q = seqlen_new if seqlen_q is None else seqlen_q
        if seqlens is None:
            seqlens = rng.integers(0, capacity - seqlen_new + 1, size=batch)
        self.seqlens = np.asarray(seqlens, np.int32)
        self.leftpad = None if leftpad is None else np.asarray(leftpad, np.int32)
        if page_size is None:
            rows = batch + 2 if batch_idx else batch
            k_store = rng.standard_normal((rows, capacity, heads_kv, d)).astype(dtype)
            self.batch_idx = rng.permutation(rows)[:batch].astype(np.int32) if batch_idx else None
            self.block_table = None
        else:
            max_pages = -(-capacity // page_size)
            # every sequence gets its own pages, shuffled in the pool; the first sequences may share a prefix
            num_pages = batch * max_pages + extra_pages
            k_store = rng.standard_normal((num_pages, page_size, heads_kv, d)).astype(dtype)
            pool = rng.permutation(num_pages)
            table = pool[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
            if shared_prefix_pages:
                table[1:, :shared_prefix_pages] = table[0, :shared_prefix_pages]
            # entries past a sequence's pages are never read: poison them
            for b in range(batch):
                used = -(-(int(self.seqlens[b]) + seqlen_new) // page_size)
                table[b, used:] = -7
            self.block_table = table
            self.batch_idx = None
        if mla:
            self.k_cache = k_store
            self.v_cache = k_store[..., :dv]
        else:
            self.k_cache = k_store
            self.v_cache = rng.standard_normal(k_store.shape[:-1] + (dv,)).astype(dtype)
        self.q = rng.standard_normal((batch, seqlen_q, heads_q, d)).astype(dtype)
        self.k = rng.standard_normal((batch, seqlen_new, heads_kv, d)).astype(dtype)
        self.v = self.k[..., :dv] if mla else rng.standard_normal((batch, seqlen_new, heads_kv, dv)).astype(dtype)
        self.rotary = rotary
        if rotary is not None:
            half = rotary
            angles = rng.uniform(0, 2 * np.pi, size=(capacity + 16, half))
            self.cos, self.sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
        self.before = (self.k_cache.copy(), self.v_cache.copy())

    # where the slots of each sequence are
    def locate(self, b, positions):
        positions = np.asarray(positions)
        if self.block_table is None:
            row = b if self.batch_idx is None else int(self.batch_idx[b])
            return np.full(positions.shape, row), positions
        return self.block_table[b, positions // self.page_size], positions % self.page_size

    def gather(self, cache, b, start, stop):
        rows, slots = self.locate(b, np.arange(start, stop))
        return np.asarray(cache[rows, slots], np.float64)

    def call(self, **options):
        kwargs = dict(cache_seqlens=self.seqlens, cache_leftpad=self.leftpad, block_table=self.block_table,
                      cache_batch_idx=self.batch_idx)
        if self.rotary is not None:
            kwargs.update(rotary_cos=self.cos, rotary_sin=self.sin)
        kwargs.update(options)
        new = (self.k, self.v) if self.seqlen_new else ()
        return cuflash.attention_with_kvcache(self.q, self.k_cache, self.v_cache, *new, return_lse=True, **kwargs)

    def truth(self, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, interleaved=True, scale=None):
        """Per sequence: the expected keys (old cache gathered + new ones rotated), and attention over them."""
        batch, seqlen_q, heads_q, d = self.q.shape
        scale = 1 / np.sqrt(d) if scale is None else scale
        q, k = np.asarray(self.q, np.float64), np.asarray(self.k, np.float64)
        dv = self.v_cache.shape[-1]
        if self.rotary is not None:
            consecutive = causal or window != (-1, -1)
            q_pos = self.seqlens[:, None].astype(np.int64) + (np.arange(seqlen_q) if consecutive else 0)
            q = rotate(q, self.cos, self.sin, q_pos, interleaved)
            k = rotate(k, self.cos, self.sin, self.seqlens[:, None] + np.arange(self.seqlen_new), interleaved)
        outs, lses, keys = [], [], []
        for b in range(batch):
            start = 0 if self.leftpad is None else int(self.leftpad[b])
            end = int(self.seqlens[b])
            k_b = np.concatenate([self.gather(self.before[0], b, start, end), k[b]])
            # MLA (v_cache a view of k_cache): k is written last, so the values are the (rotated) keys' first dims
            v_new = k[b][..., :dv] if _shares(self) else np.asarray(self.v[b], np.float64)
            v_b = np.concatenate([self.gather(self.before[1], b, start, end), v_new])
            keys.append((k_b, v_b))
            slope_b = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
            out, lse = dense_attention(q[b], k_b, v_b, scale=scale, causal=causal, window=window, softcap=softcap,
                                       slopes=slope_b)
            outs.append(out)
            lses.append(lse)
        return np.stack(outs), np.stack(lses), keys, q

    def check_cache(self, rotated_k):
        """The caches changed exactly at the appended slots (to the new values and the rotated new keys, up to the
        rounding of the rotation), and nowhere else."""
        dv = self.v_cache.shape[-1]
        written = np.zeros(self.k_cache.shape[:2], bool)
        for b in range(self.q.shape[0]):
            rows, slots = self.locate(b, np.arange(self.seqlens[b], self.seqlens[b] + self.seqlen_new))
            written[rows, slots] = True
            np.testing.assert_allclose(np.asarray(self.k_cache[rows, slots], np.float64),
                                       np.asarray(rotated_k[b], np.float64), rtol=1e-13, atol=1e-14)
            expected_v = rotated_k[b][..., :dv] if _shares(self) else self.v[b]
            np.testing.assert_allclose(np.asarray(self.v_cache[rows, slots], np.float64),
                                       np.asarray(expected_v, np.float64), rtol=1e-13, atol=1e-14)
        np.testing.assert_array_equal(self.k_cache[~written], self.before[0][~written])
        np.testing.assert_array_equal(self.v_cache[~written], self.before[1][~written])


def _shares(s: Scenario) -> bool:
    return np.shares_memory(s.k_cache, s.v_cache)


def check(s: Scenario, atol=1e-12, **options):
    """Run the call and compare with the truth; the appended keys are checked in the cache too."""
    truth_options = {name: options[name] for name in ("causal", "softcap") if name in options}
    if "window_size" in options:
        truth_options["window"] = tuple(options["window_size"])
    if "alibi_slopes" in options:
        truth_options["slopes"] = options["alibi_slopes"]
    if "rotary_interleaved" in options:
        truth_options["interleaved"] = options["rotary_interleaved"]
    if "softmax_scale" in options:
        truth_options["scale"] = options["softmax_scale"]
    out_truth, lse_truth, _, _ = s.truth(**truth_options)
    out, lse = s.call(**options)
    assert out.dtype == s.dtype and out.shape == s.q.shape[:-1] + (s.v_cache.shape[-1],)
    np.testing.assert_allclose(out, out_truth, rtol=0, atol=atol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_truth))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_truth[np.isfinite(lse_truth)], rtol=0, atol=atol)
    if s.seqlen_new:
        k_new = s.k
        if s.rotary is not None:
            interleaved = options.get("rotary_interleaved", True)
            k_new = rotate(s.k, s.cos, s.sin, s.seqlens[:, None] + np.arange(s.seqlen_new), interleaved).astype(s.dtype)
        s.check_cache(k_new)
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Paged caches, lengths, appends, GQA, q lengths
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_paged_cache_with_shuffled_and_shared_pages(page_size, small_tiles):
    capacity = 300 if page_size == 256 else 45
    # lengths: empty, one key, page boundaries, full after the append
    ends = [0, 1, page_size, 2 * page_size - 1, capacity - 2]
    seqlens = [min(e, capacity - 2) for e in ends]
    s = Scenario(batch=5, heads_q=8, heads_kv=2, page_size=page_size, capacity=capacity, seqlens=seqlens,
                 seqlen_new=2, seed=page_size)
    check(s, causal=True)


def test_shared_prefix_pages_are_read_by_every_sequence(small_tiles):
    s = Scenario(batch=4, page_size=4, capacity=40, seqlens=[12, 17, 20, 33], seqlen_new=1, shared_prefix_pages=3)
    assert (s.block_table[:, :3] == s.block_table[0, :3]).all()
    check(s)


@pytest.mark.parametrize("seqlen_new, seqlens", [(1, [3, 7, 8]), (5, [2, 6, 11]), (9, [0, 4, 7])])
def test_appends_crossing_page_boundaries(seqlen_new, seqlens, small_tiles):
    s = Scenario(batch=3, page_size=4, capacity=24, seqlens=seqlens, seqlen_new=seqlen_new, seed=seqlen_new)
    check(s, causal=True)


@pytest.mark.parametrize("heads_q, heads_kv", [(2, 2), (8, 2), (8, 1), (16, 1)])
@pytest.mark.parametrize("seqlen_q", [1, 3, 16])
def test_gqa_ratios_and_query_lengths_causal(heads_q, heads_kv, seqlen_q, small_tiles):
    s = Scenario(batch=2, heads_q=heads_q, heads_kv=heads_kv, page_size=5, capacity=50, seqlens=[0, 30],
                 seqlen_new=seqlen_q, seed=heads_q * 100 + seqlen_q)
    check(s, causal=True)


def test_more_queries_than_keys_see_nothing_bottom_right(small_tiles):
    """Speculative decoding against an empty cache with q longer than the new keys: the first rows see no key."""
    s = Scenario(batch=2, page_size=3, capacity=12, seqlens=[0, 0], seqlen_new=2, seqlen_q=5)
    out, lse = check(s, causal=True)
    assert np.isneginf(lse[:, :, :3]).all() and (out[:, :3] == 0).all()


def test_no_new_keys_reads_the_cache_as_it_is(small_tiles):
    s = Scenario(batch=3, page_size=4, capacity=30, seqlens=[0, 9, 30], seqlen_new=0, seqlen_q=2)
    out, lse = check(s, causal=True)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    np.testing.assert_array_equal(s.k_cache, s.before[0])


@pytest.mark.parametrize("batch_idx", [False, True])
def test_contiguous_cache_and_cache_batch_idx(batch_idx, small_tiles):
    s = Scenario(batch=3, heads_q=6, heads_kv=3, capacity=33, seqlens=[0, 13, 30], seqlen_new=3, batch_idx=batch_idx)
    check(s, causal=True)


@pytest.mark.parametrize("page_size", [None, 4])
def test_cache_leftpad(page_size, small_tiles):
    s = Scenario(batch=3, page_size=page_size, capacity=30, seqlens=[5, 20, 9], leftpad=[5, 3, 0], seqlen_new=2)
    check(s, causal=True)
    # leftpad == cache_seqlens with no new key: no key at all
    s = Scenario(batch=2, page_size=page_size, capacity=30, seqlens=[7, 9], leftpad=[7, 2], seqlen_new=0, seqlen_q=1)
    out, lse = check(s, causal=True)
    assert np.isneginf(lse[0]).all()


def test_int_cache_seqlens(small_tiles):
    s = Scenario(batch=2, page_size=4, capacity=20, seqlens=[6, 6], seqlen_new=1)
    s.seqlens = np.asarray(s.seqlens)
    truth = s.truth(causal=True)
    out, lse = cuflash.attention_with_kvcache(s.q, s.k_cache, s.v_cache, s.k, s.v, cache_seqlens=6,
                                              block_table=s.block_table, causal=True, return_lse=True)
    np.testing.assert_allclose(out, truth[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_random_combinations(seed, small_tiles):
    """Random page size, lengths, left padding, GQA ratio, q length, rotary layout, variant and split count."""
    rng = np.random.default_rng(100 + seed)
    heads_kv = int(rng.choice([1, 2]))
    heads_q = heads_kv * int(rng.choice([1, 2, 4, 8]))
    page_size = [None, 1, 2, 3, 5, 8][int(rng.integers(6))]
    capacity = int(rng.integers(8, 40))
    seqlen_new = int(rng.integers(0, 6))
    batch = int(rng.integers(1, 4))
    seqlens = rng.integers(0, capacity - seqlen_new + 1, size=batch)
    leftpad = None if rng.random() < 0.5 else rng.integers(0, seqlens + 1)
    rotary = int(rng.choice([2, 4, 8])) if seqlen_new and rng.random() < 0.6 else None
    s = Scenario(batch=batch, heads_q=heads_q, heads_kv=heads_kv, d=8, page_size=page_size, capacity=capacity,
                 seqlens=seqlens, leftpad=leftpad, seqlen_new=seqlen_new, seqlen_q=int(rng.integers(1, 7)),
                 rotary=rotary, seed=seed)
    options = dict(causal=bool(rng.random() < 0.6), num_splits=int(rng.integers(0, 6)))
    if rotary:
        options["rotary_interleaved"] = bool(rng.random() < 0.5)
    if rng.random() < 0.3:
        options["window_size"] = (int(rng.integers(-1, 6)), int(rng.integers(-1, 3)))
    if rng.random() < 0.3:
        options["softcap"] = 2.5
    if rng.random() < 0.3:
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, size=heads_q).astype(np.float32)
    check(s, **options)


# ---------------------------------------------------------------------------------------------------
# Split-KV
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_split_counts_give_the_same_result(causal, small_tiles):
    """num_splits 1 .. more than there are tiles: the same output up to rounding; each call appends the same keys,
    so the cache is reset between calls."""
    s = Scenario(batch=3, heads_q=8, heads_kv=2, page_size=3, capacity=70, seqlens=[1, 35, 65], seqlen_new=3, seed=4)
    results = []
    for splits in (1, 2, 3, 5, 8, 17, 40):
        s.k_cache[...], s.v_cache[...] = s.before
        out, lse = check(s, causal=causal, num_splits=splits)
        results.append((out, lse))
    for out, lse in results[1:]:
        np.testing.assert_allclose(out, results[0][0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(lse, results[0][1], rtol=0, atol=1e-13)


def test_split_count_at_the_default_tiles_with_a_long_cache():
    """With the real tiles (128 keys), a cache of 1000 keys is 8 tiles: splits 1, 3, 8 and automatic agree."""
    s = Scenario(batch=1, heads_q=4, heads_kv=1, d=8, capacity=1000, seqlens=[998], seqlen_new=2, seed=9)
    outs = []
    for splits in (1, 3, 8, 0):
        s.k_cache[...], s.v_cache[...] = s.before
        outs.append(check(s, causal=True, num_splits=splits)[0])
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=0, atol=1e-13)


def test_float32_splits_differ_by_rounding_only(small_tiles):
    s = Scenario(batch=2, heads_q=4, heads_kv=1, page_size=4, capacity=64, seqlens=[40, 61], seqlen_new=1,
                 dtype=np.float32, seed=2)
    one = s.call(num_splits=1, causal=True)
    s.k_cache[...], s.v_cache[...] = s.before
    many = s.call(num_splits=7, causal=True)
    np.testing.assert_allclose(many[0], one[0], rtol=0, atol=2e-6)
    np.testing.assert_allclose(many[1], one[1], rtol=0, atol=2e-6)


def test_the_automatic_split_rule():
    # a grid that nearly fills the GPU: no split
    assert decode_num_splits(8 * 16, 64) == 1
    assert decode_num_splits(106, 64) == 1
    # batch 1, 8 KV heads, 4096 keys (32 tiles of 128): split so that 8 * s blocks fill the GPU's block slots
    # (two per SM) in whole waves
    s = decode_num_splits(8, 32)
    assert 1 < s <= 32 and (8 * s / 264) / np.ceil(8 * s / 264) >= 0.95 * 0.9
    assert decode_num_splits(8, 512) >= 28  # 65536 keys: about 33 (H100: 107.5 us, where 14 splits took 158)
    # never more splits than tiles; one tile is never split
    assert decode_num_splits(1, 3) <= 3 and decode_num_splits(1, 1) == 1
    for units in (1, 2, 5, 17, 40, 100):
        for tiles in (1, 2, 7, 64, 1000):
            splits = decode_num_splits(units, tiles)
            assert 1 <= splits <= min(tiles, 128)


def test_the_front_door_plans_from_the_shapes(monkeypatch):
    """The split count depends on the shapes (batch, heads_kv, q rows, the cache's capacity), not on the values."""
    seen = []
    from cuflash.reference import decode as reference_decode

    real = reference_decode.forward_kvcache

    def spy(*args, cache, **kwargs):
        seen.append(cache)
        return real(*args, cache=cache, **kwargs)

    monkeypatch.setattr(reference_decode, "forward_kvcache", spy)
    q = np.zeros((1, 1, 8, 16), np.float32)
    kc = np.zeros((1, 4096, 2, 16), np.float32)
    for seqlens in (0, 100, 4000):
        cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=seqlens)
    assert len({c.num_splits for c in seen}) == 1
    assert seen[0].num_splits == decode_num_splits(2, 32) > 1
    assert (seen[0].block_m, seen[0].block_n) == _blocks.decode_block_sizes(16, 16)
    cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=5, num_splits=3)
    assert seen[-1].num_splits == 3


def test_split_range_covers_the_tiles_once():
    for n in range(0, 20):
        for splits in range(1, 25):
            parts = [split_range(2, 2 + n, splits, s) for s in range(splits)]
            assert parts[0][0] == 2 and parts[-1][1] == 2 + n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            sizes = [b - a for a, b in parts]
            assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------------------------------------
# Rotary, variants, MLA, dtypes
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_both_layouts(interleaved, causal, small_tiles):
    s = Scenario(batch=3, heads_q=4, heads_kv=2, d=16, page_size=3, capacity=30, seqlens=[0, 11, 25], seqlen_new=3,
                 rotary=6, seed=int(interleaved) + 2 * int(causal))
    check(s, causal=causal, rotary_interleaved=interleaved)


def test_rotary_full_head_dim_with_leftpad_and_window(small_tiles):
    s = Scenario(batch=2, heads_q=2, heads_kv=1, d=8, capacity=20, seqlens=[6, 12], leftpad=[2, 0], seqlen_new=2,
                 rotary=4)
    check(s, window_size=(5, 0), rotary_interleaved=False)


@pytest.mark.parametrize("variant", ["window", "window-causal", "softcap", "alibi", "alibi-batch", "all"])
def test_variants(variant, small_tiles):
    s = Scenario(batch=3, heads_q=8, heads_kv=2, page_size=5, capacity=48, seqlens=[3, 20, 44], seqlen_new=4, seed=7)
    slopes = (2.0 ** -np.arange(1, 9)).astype(np.float32)
    options = {
        "window": dict(window_size=(6, 2)),
        "window-causal": dict(window_size=(9, -1), causal=True),
        "softcap": dict(softcap=3.0, causal=True),
        "alibi": dict(alibi_slopes=slopes, causal=True),
        "alibi-batch": dict(alibi_slopes=np.stack([slopes, slopes / 2, slopes * 3])),
        "all": dict(window_size=(10, 0), softcap=2.0, alibi_slopes=slopes, causal=True, num_splits=3),
    }[variant]
    check(s, **options)


@pytest.mark.parametrize("page_size", [None, 4])
def test_mla_v_cache_is_a_view_of_k_cache(page_size, small_tiles):
    """MLA's absorbed decoding in small: one latent head of 72 dims (64 + 8 of rope), 16 query heads, V = the first 64
    dims of the same cache (a view), appended once."""
    s = Scenario(batch=2, heads_q=16, heads_kv=1, d=72, dv=64, page_size=page_size, capacity=24, seqlens=[5, 17],
                 seqlen_new=2, mla=True, seed=3)
    assert np.shares_memory(s.k_cache, s.v_cache)
    check(s, causal=True, softmax_scale=0.1, num_splits=2)


def test_mla_equals_the_unabsorbed_computation(small_tiles):
    """Seed 001, section 3.2: with a latent cache Z (m dims) and a shared rope key (p dims), attention of head h
    with q_h = [q_nope_h U_k^T, q_rope_h] over [Z, k_rope] and values Z, followed by U_v, equals ordinary attention
    with K_h = [Z U_k, k_rope], V_h = Z U_v (the up-projections absorbed into q and the output)."""
    rng = np.random.default_rng(0)
    m, p, dh, heads, tokens = 16, 4, 8, 4, 11
    z = rng.standard_normal((tokens, m))
    k_rope = rng.standard_normal((tokens, p))
    u_k, u_v = rng.standard_normal((heads, m, dh)), rng.standard_normal((heads, m, dh))
    q_nope, q_rope = rng.standard_normal((heads, dh)), rng.standard_normal((heads, p))
    scale = 1 / np.sqrt(dh + p)
    # unabsorbed: per head, keys [Z U_k, k_rope], values Z U_v
    expected = []
    for h in range(heads):
        keys = np.concatenate([z @ u_k[h], k_rope], axis=1)
        t = scale * keys @ np.concatenate([q_nope[h], q_rope[h]])
        w = np.exp(t - t.max())
        expected.append((w / w.sum()) @ (z @ u_v[h]))
    # absorbed: one latent KV head [Z, k_rope] of m + p dims, V = its first m dims (a view), 4 query heads
    cache = np.zeros((1, 16, 1, m + p))
    q = np.concatenate([np.einsum("hd,hmd->hm", q_nope, u_k), q_rope], axis=1)[None, None]
    latent = np.concatenate([z, k_rope], axis=1)[None, :, None]
    out = cuflash.attention_with_kvcache(q, cache, cache[..., :m], latent, latent[..., :m], cache_seqlens=0,
                                         softmax_scale=scale)
    absorbed = np.einsum("hm,hmd->hd", out[0, 0], u_v)
    np.testing.assert_allclose(absorbed, np.stack(expected), rtol=0, atol=1e-12)


def test_cascade_shared_prefix_merged_with_each_suffix(small_tiles):
    """docs/decoding.md's cascade: the shared prefix attended once for every sequence's queries, each sequence's
    suffix through its cache, merged: equal to attention over prefix + suffix."""
    rng = np.random.default_rng(8)
    batch, seqlen_q, heads_q, heads_kv, d, prefix = 4, 2, 4, 2, 16, 13
    k_prefix, v_prefix = rng.standard_normal((2, prefix, heads_kv, d))
    k_cache, v_cache = rng.standard_normal((2, batch, 20, heads_kv, d))
    suffix_lengths = np.array([2, 5, 11, 20], np.int32)
    q = rng.standard_normal((batch, seqlen_q, heads_q, d))
    q_all = q.reshape(1, batch * seqlen_q, heads_q, d)
    o_p, lse_p = cuflash.attention(q_all, k_prefix[None], v_prefix[None], return_lse=True)
    o_p = o_p.reshape(batch, seqlen_q, heads_q, -1)
    lse_p = lse_p.reshape(heads_q, batch, seqlen_q).transpose(1, 0, 2)
    o_s, lse_s = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=suffix_lengths, causal=True,
                                                return_lse=True)
    out, lse = cuflash.merge_states(o_p, lse_p, o_s, lse_s)
    for b in range(batch):
        keys = np.concatenate([k_prefix, k_cache[b, :suffix_lengths[b]]])
        values = np.concatenate([v_prefix, v_cache[b, :suffix_lengths[b]]])
        ref, ref_lse = dense_attention(q[b], keys, values, scale=1 / np.sqrt(d), causal=True)
        np.testing.assert_allclose(out[b], ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[b], ref_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_low_precision_within_the_error_budget(dtype_name):
    """Paged, GQA, splits and rotary in a low-precision dtype, at the decode kernels' tiles (128 keys: the caches span
    5 tiles, cut into 3 splits). The attention: against float64 attention on the same
    inputs (q rotated as the call does, the keys and values as they are in the cache after the append), within 2x
    the error of naive attention in the same dtype plus the rounding floor. The rotation (float32 arithmetic, as
    the kernels): the appended keys within a few units of the dtype's last place of the float64 rotation."""
    from cuflash.reference.decode import apply_rotary, rotary_positions

    dtype = LOW_PRECISION[dtype_name]
    s = Scenario(batch=2, heads_q=8, heads_kv=2, d=32, page_size=3, capacity=600, seqlens=[300, 590], seqlen_new=4,
                 rotary=8, dtype=dtype, seed=5)
    out, lse = s.call(causal=True, num_splits=3)
    assert out.dtype == dtype and lse.dtype == np.float32
    q_rot = apply_rotary(s.q, s.cos, s.sin, rotary_positions(s.seqlens, 4), True)
    outs = {"truth": ([], []), "naive": ([], [])}
    for b in range(2):
        k_b = s.gather(s.k_cache, b, 0, s.seqlens[b] + 4)[None]
        v_b = s.gather(s.v_cache, b, 0, s.seqlens[b] + 4)[None]
        for name, cast, algorithm in (("truth", np.float64, "fa2"), ("naive", dtype, "naive")):
            o, l_b = cuflash.attention(*(x.astype(cast) for x in (q_rot[b:b + 1], k_b, v_b)), causal=True,
                                       algorithm=algorithm, return_lse=True)
            outs[name][0].append(o[0])
            outs[name][1].append(l_b[0])
    (out_truth, lse_truth), (out_naive, lse_naive) = ((np.stack(o), np.stack(l_b)) for o, l_b in outs.values())
    assert_within_budget(out, out_truth, out_naive, 2, rounding_floor(out_truth, dtype), "out")
    assert_within_budget(lse, lse_truth, lse_naive, 2, rounding_floor(lse_truth, np.float32), "lse")
    k_rot = rotate(s.k, s.cos, s.sin, s.seqlens[:, None] + np.arange(4), True)
    for b in range(2):
        stored = s.gather(s.k_cache, b, s.seqlens[b], s.seqlens[b] + 4)
        eps = 2.0 ** -{"bfloat16": 8, "float16": 11, "float32": 24}[dtype_name]
        assert np.abs(stored - k_rot[b]).max() <= 4 * eps * max(np.abs(k_rot[b]).max(), 1.0)


def test_out_is_written_in_place(small_tiles):
    s = Scenario(batch=2, page_size=4, capacity=20, seqlens=[3, 9], seqlen_new=1, dtype=np.float32)
    buffer = np.full((2, 1, 4, 16), np.nan, np.float32)
    result = cuflash.attention_with_kvcache(s.q, s.k_cache, s.v_cache, s.k, s.v, cache_seqlens=s.seqlens,
                                            block_table=s.block_table, out=buffer)
    assert result is buffer and np.isfinite(buffer).all()


def test_strided_cache_views(small_tiles):
    """Caches that are views with odd strides (a slice of a bigger pool, heads interleaved) are written through."""
    rng = np.random.default_rng(1)
    pool = rng.standard_normal((2, 20, 3, 2, 8))        # (rows, slots, [k, v, pad], heads, d)
    k_cache, v_cache = pool[:, :, 0], pool[:, :, 1]
    q = rng.standard_normal((2, 1, 4, 8))
    k, v = rng.standard_normal((2, 1, 2, 8)), rng.standard_normal((2, 1, 2, 8))
    before = pool.copy()
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([4, 10], np.int32))
    assert (pool[0, 4, 0] == k[0, 0]).all() and (pool[1, 10, 1] == v[1, 0]).all()
    changed = np.argwhere((pool != before).any(axis=(-1, -2)))
    assert {tuple(x) for x in changed} <= {(0, 4, 0), (0, 4, 1), (1, 10, 0), (1, 10, 1)}
    for b, end in ((0, 5), (1, 11)):
        ref = dense_attention(q[b], k_cache[b, :end], v_cache[b, :end], scale=1 / np.sqrt(8))[0]
        np.testing.assert_allclose(out[b], ref, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# Errors, before anything is written
# ---------------------------------------------------------------------------------------------------


def _bad_call(case):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 8))
    kc = rng.standard_normal((6, 4, 2, 8))       # paged: 6 pages of 4 slots
    vc = rng.standard_normal((6, 4, 2, 8))
    k, v = rng.standard_normal((2, 1, 2, 8)), rng.standard_normal((2, 1, 2, 8))
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    args = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=np.array([3, 5], np.int32), block_table=table)
    cos = np.ones((16, 2))
    if case == "q rank":
        args["q"] = q[0]
    elif case == "cache dtype":
        args["k_cache"] = kc.astype(np.float32)
    elif case == "head dim":
        args["k_cache"] = rng.standard_normal((6, 4, 2, 6))
    elif case == "heads":
        args["k_cache"] = args["v_cache"] = rng.standard_normal((6, 4, 3, 8))
        args["k"] = args["v"] = rng.standard_normal((2, 1, 3, 8))
    elif case == "k without v":
        args["v"] = None
    elif case == "k shape":
        args["k"] = rng.standard_normal((2, 1, 1, 8))
    elif case == "seqlens dtype":
        args["cache_seqlens"] = np.array([3, 5], np.int64)
    elif case == "seqlens shape":
        args["cache_seqlens"] = np.array([3, 5, 1], np.int32)
    elif case == "seqlens type":
        args["cache_seqlens"] = 3.0
    elif case == "seqlens negative":
        args["cache_seqlens"] = np.array([-1, 5], np.int32)
    elif case == "too long":
        args["cache_seqlens"] = np.array([3, 12], np.int32)
    elif case == "too long int":
        args["cache_seqlens"] = 12
    elif case == "table dtype":
        args["block_table"] = table.astype(np.int64)
    elif case == "table rank":
        args["block_table"] = table[0]
    elif case == "page out of range":
        args["block_table"] = np.array([[6, -1, 99], [3, 4, 5]], np.int32)   # only [0, 0] is used by sequence 0
    elif case == "shared write":
        args["block_table"] = np.array([[0, 1, 2], [3, 1, 5]], np.int32)
        args["cache_seqlens"] = np.array([5, 5], np.int32)
    elif case == "leftpad past seqlens":
        args["cache_leftpad"] = np.array([4, 0], np.int32)
    elif case == "batch idx with table":
        args["cache_batch_idx"] = np.array([0, 1], np.int32)
    elif case == "batch idx range":
        args.update(block_table=None, k_cache=rng.standard_normal((3, 12, 2, 8)), v_cache=rng.standard_normal((3, 12, 2, 8)),
                    cache_batch_idx=np.array([0, 3], np.int32))
    elif case == "batch idx repeated":
        args.update(block_table=None, k_cache=rng.standard_normal((3, 12, 2, 8)), v_cache=rng.standard_normal((3, 12, 2, 8)),
                    cache_batch_idx=np.array([1, 1], np.int32))
    elif case == "cache rows":
        args.update(block_table=None, k_cache=rng.standard_normal((1, 12, 2, 8)), v_cache=rng.standard_normal((1, 12, 2, 8)))
    elif case == "rotary alone":
        args["rotary_cos"] = cos
    elif case == "rotary without k":
        args.update(rotary_cos=cos, rotary_sin=cos, k=None, v=None)
    elif case == "rotary dim":
        args.update(rotary_cos=np.ones((16, 5)), rotary_sin=np.ones((16, 5)))
    elif case == "rotary short":
        args.update(rotary_cos=np.ones((5, 2)), rotary_sin=np.ones((5, 2)))
    elif case == "num_splits":
        args["num_splits"] = -1
    elif case == "num_splits type":
        args["num_splits"] = 2.0
    elif case == "window":
        args["window_size"] = (1,)
    elif case == "out shape":
        args["out"] = np.zeros((2, 1, 4, 7))
    elif case == "strided q":
        args["q"] = rng.standard_normal((2, 1, 4, 16))[..., ::2]
    elif case == "seqlens list":
        args["cache_seqlens"] = [3, 5]
    elif case == "new tokens past the capacity":
        args["k"], args["v"] = (rng.standard_normal((2, 13, 2, 8)) for _ in range(2))
        args["q"] = rng.standard_normal((2, 13, 4, 8))
        args["cache_seqlens"] = np.array([0, 0], np.int32)
    return args


BAD_CASES = [
    ("q rank", ValueError, r"q must have 4 dimensions \(batch, seqlen_q, heads_q, head_dim\)"),
    ("cache dtype", TypeError, "k_cache must have the dtype of q, float64; got float32"),
    ("head dim", ValueError, "k_cache must have q's head_dim"),
    ("heads", ValueError, "must divide the number of query heads"),
    ("k without v", ValueError, "k and v .* must be given together"),
    ("k shape", ValueError, r"k must have shape \(batch, seqlen_new, heads_kv, head_dim\) = \(2, 1, 2, 8\)"),
    ("seqlens dtype", TypeError, "cache_seqlens must have dtype int32; got int64"),
    ("seqlens shape", ValueError, r"cache_seqlens must have shape \(batch,\) = \(2,\); got \(3,\)"),
    ("seqlens type", TypeError, "cache_seqlens must be an int or an int32 array"),
    ("seqlens negative", ValueError, r"cache_seqlens must be >= 0 .*cache_seqlens\[0\] = -1"),
    ("too long", ValueError, r"max_pages \* page_size = 3 \* 4 = 12 slots; got cache_seqlens\[1\] = 12 \+ seqlen_new 1"),
    ("too long int", ValueError, r"fit the cache.*cache_seqlens\[0\] = 12"),
    ("table dtype", TypeError, "block_table must have dtype int32; got int64"),
    ("table rank", ValueError, r"block_table must be a 2-D int32 array \(batch, max_pages\)"),
    ("page out of range", ValueError, r"num_blocks = 6\); got block_table\[0, 0\] = 6"),
    ("shared write", ValueError, r"page 1 slot 1 is written by batch entries 0 and 1"),
    ("leftpad past seqlens", ValueError, r"cache_leftpad\[0\] = 4 > cache_seqlens\[0\] = 3"),
    ("batch idx with table", ValueError, "cache_batch_idx cannot be used with block_table"),
    ("batch idx range", ValueError, r"cache_batch_idx entries must lie in \[0, batch_cache = 3\).*cache_batch_idx\[1\] = 3"),
    ("batch idx repeated", ValueError, "cache_batch_idx must not repeat a row when k and v are appended"),
    ("cache rows", ValueError, "k_cache must have a row per batch entry"),
    ("rotary alone", ValueError, "rotary_cos and rotary_sin must be given together"),
    ("rotary without k", ValueError, "they need k and v"),
    ("rotary dim", ValueError, r"rotary_dim = 2 \* rotary_cos.shape\[1\] must lie in \[2, head_dim = 8\]"),
    ("rotary short", ValueError, r"seqlen_ro must be > 5 .*got seqlen_ro 5"),
    ("num_splits", ValueError, "num_splits must be an integer >= 0"),
    ("num_splits type", TypeError, "num_splits must be an integer >= 0"),
    ("window", ValueError, "window_size must be a pair"),
    ("out shape", ValueError, r"out must have shape \(batch, seqlen_q, heads_q, head_dim_v\) = \(2, 1, 4, 8\)"),
    ("strided q", ValueError, "q must have a contiguous last axis"),
    ("seqlens list", TypeError, "cache_seqlens must be an int or an int32 array"),
    ("new tokens past the capacity", ValueError, r"seqlen_new must fit the cache, at most max_pages \* page_size = "
                                                 r"3 \* 4 = 12 slots; got seqlen_new 13"),
]


@pytest.mark.parametrize("case, error, match", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_inputs_are_refused_before_the_cache_changes(case, error, match):
    args = _bad_call(case)
    before = [args["k_cache"].copy(), args["v_cache"].copy()]
    with pytest.raises(error, match=match):
        cuflash.attention_with_kvcache(**args)
    np.testing.assert_array_equal(args["k_cache"], before[0])
    np.testing.assert_array_equal(args["v_cache"], before[1])


# ---------------------------------------------------------------------------------------------------
# [decode guard]: index values out of range, as the CUDA kernels treat them (device values are not read before a
# launch). The NumPy front door refuses them (above); the reference backend, called directly, mirrors the kernels.
# ---------------------------------------------------------------------------------------------------

# label: (Scenario options, the broken value of sequence 1, whether sequence 1 still appends)
GUARD_CASES = {
    "seqlens negative": (dict(), ("seqlens", -3), False),
    "seqlens leave no room": (dict(seqlen_new=2), ("seqlens", 39), False),   # capacity 40
    "seqlens huge, 1 split": (dict(num_splits=1), ("seqlens", 2**31 - 1), False),
    "seqlens huge paged": (dict(page_size=4), ("seqlens", 2**31 - 1), False),
    "leftpad past seqlens": (dict(leftpad=[0, 2, 1]), ("leftpad", 21), False),
    "leftpad negative paged": (dict(leftpad=[0, 2, 1], page_size=3), ("leftpad", -1), False),
    "batch idx past the rows": (dict(batch_idx=True), ("batch_idx", 5), False),   # rows: batch + 2 = 5
    "batch idx negative": (dict(batch_idx=True), ("batch_idx", -1), False),
    "page read past num_blocks, 1 split": (dict(page_size=4, num_splits=1), ("page", 0, 10**9), True),
    "page read negative, 3 splits": (dict(page_size=4), ("page", 2, -1), True),
    "page of the appended slot": (dict(page_size=4), ("page", 5, -2), False),    # slot 20: page 5
    "page of the last slot only, page 1": (dict(page_size=1), ("page", 20, 2**31 - 1), False),
}


def _guard_call(label, dtype=np.float64):
    """The Scenario (batch 3, sequence 1 at 20 cached keys and one new token), the normalized call of its valid
    values, and the same call with sequence 1's value broken."""
    options, (what, *where), appends = GUARD_CASES[label]
    options = dict(options)
    splits = options.pop("num_splits", 3)
    s = Scenario(batch=3, capacity=40, seqlens=[7, 20, 33], seqlen_new=options.pop("seqlen_new", 1), dtype=dtype,
                 seed=len(label), **options)
    _, _, cache, scale, variant = _normalized(s.q, s.k_cache, s.v_cache, s.k, s.v, s.seqlens, dict(
        block_table=s.block_table, cache_leftpad=s.leftpad, cache_batch_idx=s.batch_idx, causal=True,
        num_splits=splits))
    broken = {"seqlens": "cache_seqlens", "leftpad": "cache_leftpad", "batch_idx": "cache_batch_idx",
              "page": "block_table"}[what]
    values = getattr(cache, broken).copy()
    if what == "page":
        values[1, where[0]] = where[1]
    else:
        values[1] = where[0]
    return s, cache, dataclasses.replace(cache, **{broken: values}), scale, variant, appends


@pytest.mark.parametrize("label", list(GUARD_CASES))
def test_the_reference_gives_nan_rows_for_values_out_of_range(label, small_tiles):
    """reference_decode.forward_kvcache with one sequence's index value out of range: that sequence's output rows and
    lse are NaN, the other sequences' are what the valid call gives (bit for bit), nothing is read or written out
    of bounds (NumPy would raise or wrap), and the caches change only where the valid call appends, but for the
    slots the broken sequence cannot write."""
    from cuflash.reference import decode as reference_decode

    s, good, bad, scale, variant, appends = _guard_call(label)
    runs = {}
    for name, cache in (("good", good), ("bad", bad)):
        kc, vc = s.k_cache.copy(), s.v_cache.copy()
        out, lse = reference_decode.forward_kvcache(s.q, kc, vc, s.k, s.v, cache=cache, scale=scale, variant=variant)
        runs[name] = out, lse, kc, vc
    (out_g, lse_g, kc_g, vc_g), (out_b, lse_b, kc_b, vc_b) = runs["good"], runs["bad"]
    assert np.isnan(out_b[1]).all() and np.isnan(lse_b[1]).all()
    np.testing.assert_array_equal(out_b[[0, 2]], out_g[[0, 2]])
    np.testing.assert_array_equal(lse_b[[0, 2]], lse_g[[0, 2]])
    assert not np.isnan(out_g).any()
    if not appends:  # the slots sequence 1 appends to in the valid call keep their old values
        rows, slots = s.locate(1, np.arange(s.seqlens[1], s.seqlens[1] + s.seqlen_new))
        kc_g[rows, slots], vc_g[rows, slots] = s.before[0][rows, slots], s.before[1][rows, slots]
    np.testing.assert_array_equal(kc_b, kc_g)
    np.testing.assert_array_equal(vc_b, vc_g)


def test_the_front_door_still_refuses_numpy_values_out_of_range(small_tiles):
    """On NumPy the values are on the host: attention_with_kvcache checks them and raises before writing."""
    s, _, bad, _, _, _ = _guard_call("page read past num_blocks, 1 split")
    before = s.k_cache.copy()
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 1000000000"):
        cuflash.attention_with_kvcache(s.q, s.k_cache, s.v_cache, s.k, s.v, cache_seqlens=s.seqlens,
                                       block_table=bad.block_table)
    np.testing.assert_array_equal(s.k_cache, before)


def test_entries_past_the_used_pages_are_never_read(small_tiles):
    s = Scenario(batch=2, page_size=4, capacity=32, seqlens=[2, 9], seqlen_new=1)
    assert (s.block_table == -7).any()   # poisoned, and accepted
    check(s, causal=True)


def test_a_backend_without_decode_kernels_is_refused_after_validation(monkeypatch):
    """A backend without forward_kvcache (none today: NumPy and CuPy both have one) gets validation, then
    NotImplementedError."""
    monkeypatch.setitem(_api._DECODE_BACKEND_MODULES, "numpy", "cuflash._ops.blocks")
    q = np.zeros((1, 1, 2, 8))
    kc = np.zeros((1, 8, 1, 8))
    with pytest.raises(ValueError, match="fit the cache"):
        cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=9)
    with pytest.raises(NotImplementedError, match="attention_with_kvcache has no decode backend for numpy arrays"):
        cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=3)


def test_device_value_checks_follow_the_environment(monkeypatch):
    monkeypatch.delenv(_validate.DEVICE_CHECKS_ENV, raising=False)
    assert not _validate.device_value_checks()
    monkeypatch.setenv(_validate.DEVICE_CHECKS_ENV, "1")
    assert _validate.device_value_checks()


# ---------------------------------------------------------------------------------------------------
# cuflash.plan_kvcache: plan once, run every step (NumPy: each step runs the reference with every check)
# ---------------------------------------------------------------------------------------------------


def _plan_step_arrays(rng, *, batch=2, heads_q=4, heads_kv=2, d=8, capacity=24, page_size=4):
    pages = -(-capacity // page_size)
    table = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32)
    caches = [rng.standard_normal((batch * pages, page_size, heads_kv, d)) for _ in range(2)]
    angles = rng.uniform(0, 2 * np.pi, (capacity + 4, d // 4))
    return dict(table=table, caches=caches, cos=np.cos(angles), sin=np.sin(angles), batch=batch, heads_q=heads_q,
                heads_kv=heads_kv, d=d)


def test_a_plan_runs_each_step_as_the_front_door():
    """Five steps of a paged, rotary, causal GQA call with ALiBi: plan.run gives what attention_with_kvcache gives,
    appends the same tokens, and writes into the out and lse it is handed."""
    rng = np.random.default_rng(30)
    a = _plan_step_arrays(rng)
    batch, heads_q, heads_kv, d = a["batch"], a["heads_q"], a["heads_kv"], a["d"]
    lens = np.array([0, 9], np.int32)
    slopes = rng.uniform(0.1, 0.5, heads_q).astype(np.float32)
    options = dict(block_table=a["table"], rotary_cos=a["cos"], rotary_sin=a["sin"], alibi_slopes=slopes)
    fixed = dict(causal=True, rotary_interleaved=False, num_splits=3)
    kc, vc = (c.copy() for c in a["caches"])
    kc2, vc2 = (c.copy() for c in a["caches"])
    q, k, v = (rng.standard_normal((batch, 1, h, d)) for h in (heads_q, heads_kv, heads_kv))
    plan = cuflash.plan_kvcache(q, kc, vc, k, v, cache_seqlens=lens, **options, **fixed)
    assert isinstance(plan, cuflash.DecodePlan) and plan.num_splits == 3
    assert plan.out_shape == (batch, 1, heads_q, d) and plan.lse_shape == (batch, heads_q, 1)
    np.testing.assert_array_equal(kc, kc2)  # planning appends nothing
    out, lse = np.empty(plan.out_shape), np.empty(plan.lse_shape)
    for step in range(5):
        q, k, v = (rng.standard_normal((batch, 1, h, d)) for h in (heads_q, heads_kv, heads_kv))
        out[...], lse[...] = np.nan, np.nan
        got = plan.run(q, kc, vc, k, v, cache_seqlens=lens, out=out, lse=lse, **options)
        want = cuflash.attention_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens, return_lse=True, **options,
                                              **fixed)
        assert got[0] is out and got[1] is lse
        np.testing.assert_array_equal(out, want[0])
        np.testing.assert_array_equal(lse, want[1])
        np.testing.assert_array_equal(kc, kc2)
        np.testing.assert_array_equal(vc, vc2)
        lens += 1
    o1, l1 = plan.run(q, kc, vc, k, v, cache_seqlens=3, **options)  # an int, and out / lse allocated
    o2, l2 = cuflash.attention_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=3, return_lse=True, **options, **fixed)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)


def test_a_plan_checks_its_arguments_as_the_front_door():
    q, kc = np.zeros((1, 1, 2, 8)), np.zeros((1, 8, 1, 8))
    with pytest.raises(ValueError, match="fit the cache"):
        cuflash.plan_kvcache(q, kc, kc, cache_seqlens=9)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuflash.plan_kvcache(q, kc, kc, cache_seqlens=1, causal=1)


PLAN_MISMATCHES = [
    ("another dtype", lambda a: dict(q=a["q"].astype(np.float32)),
     r"q must be a numpy.ndarray of shape \(2, 1, 4, 8\), strides \(256, 256, 64, 8\) and dtype float64 as when the "
     r"plan was made .*got a numpy.ndarray of shape \(2, 1, 4, 8\), strides \(128, 128, 32, 4\) and dtype float32"),
    ("another shape", lambda a: dict(k_cache=a["k_cache"][:-1]),
     r"k_cache must be a numpy.ndarray of shape \(12, 4, 2, 8\)"),
    ("other strides", lambda a: dict(q=np.asfortranarray(a["q"])), r"q must be .*got .*strides \(8, 16, 16, 64\)"),
    ("a missing array", lambda a: dict(k=None, v=None), "k was given when the plan was made, so every step needs it; "
     "got None"),
    ("an extra array", lambda a: dict(cache_leftpad=np.zeros(2, np.int32)),
     r"cache_leftpad was not given when the plan was made; got a numpy.ndarray of shape \(2,\)"),
    ("an index array of another dtype", lambda a: dict(block_table=a["block_table"].astype(np.int64)),
     "block_table must be .* dtype int32 as when"),
    ("out", lambda a: dict(out=np.zeros((2, 1, 4, 8), np.float32)), r"out must be a numpy.ndarray .* as when the plan "
     r"was made; got .*float32"),
    ("lse", lambda a: dict(lse=np.zeros((2, 1, 4))), r"lse must be a numpy.ndarray of shape \(2, 4, 1\), strides "
     r"\(32, 8, 8\) and dtype float64 \(contiguous\); got a numpy.ndarray of shape \(2, 1, 4\)"),
]


@pytest.mark.parametrize("case, change, match", PLAN_MISMATCHES, ids=[c[0] for c in PLAN_MISMATCHES])
def test_a_plan_refuses_a_step_of_another_layout(case, change, match):
    """Each array of a step must have the planned type, shape, strides and dtype, given or not as then; nothing is
    written when it has not."""
    rng = np.random.default_rng(31)
    a = _plan_step_arrays(rng)
    args = dict(q=rng.standard_normal((2, 1, 4, 8)), k_cache=a["caches"][0], v_cache=a["caches"][1],
                k=rng.standard_normal((2, 1, 2, 8)), v=rng.standard_normal((2, 1, 2, 8)), block_table=a["table"],
                cache_seqlens=np.array([1, 2], np.int32))
    plan = cuflash.plan_kvcache(**args)
    before = args["k_cache"].copy()
    with pytest.raises(ValueError, match=match):
        plan.run(**{**args, **change(args)})
    np.testing.assert_array_equal(args["k_cache"], before)


def test_a_plan_made_with_a_strided_out_needs_one_at_every_step():
    rng = np.random.default_rng(32)
    q, kc = rng.standard_normal((2, 1, 4, 8)), rng.standard_normal((2, 8, 2, 8))
    out = np.zeros((2, 4, 1, 8)).transpose(0, 2, 1, 3)
    plan = cuflash.plan_kvcache(q, kc, kc, cache_seqlens=3, out=out)
    assert plan.run(q, kc, kc, cache_seqlens=3, out=out)[0] is out
    with pytest.raises(ValueError, match=r"out must be given: the plan was made with an out of strides"):
        plan.run(q, kc, kc, cache_seqlens=3)


def test_the_front_door_remembers_cupy_calls_only():
    """NumPy calls are checked in full every time (their index values too): no key."""
    q, kc = np.zeros((1, 1, 2, 8)), np.zeros((1, 8, 1, 8))
    key = _api._kvcache_key(q, kc, kc, None, None, 3, None, None, True, None, None, None, False, (-1, -1), 0.0,
                            None, None, 0, None)
    assert key is None


def test_the_cuda_launcher_checks_and_writes_only_new_arrays():
    """The decode launcher's step paths, with bench-decode's stand-in runtime (host memory, launches recorded) and
    the layouts a DecodePlan gives it (expect): a first step writes every address; a step of the very objects of
    the step before only launches; a step with new q, k, v (a model's projections), a new out of the planned
    layouts or an out to allocate writes those addresses only, without the plan's full check; an array of another
    layout or a None where an array was planned (even once the last step's array has died) goes through the full
    check (here a spy) first. The record's words are what the kernels would read."""
    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE, DecodeLaunch
    from cuflash._ops.decode_plan import layouts_of
    from cuflash.cli.bench_decode import _HostArray, _HostRuntime

    rng = np.random.default_rng(40)
    host = dict(q=(1, 1, 8, 32), k_cache=(1, 256, 2, 32), v_cache=(1, 256, 2, 32), k=(1, 1, 2, 32), v=(1, 1, 2, 32))
    host = {name: rng.standard_normal(shape).astype(np.float16) for name, shape in host.items()}
    lens = np.array([40], np.int32)
    _, _, cache, scale, variant = _api._kvcache_call(
        *host.values(), cache_seqlens=lens, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
        cache_batch_idx=None, cache_leftpad=None, block_table=None, causal=True, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, softmax_scale=None, num_splits=3, out=None)
    launches, checked = [], []
    runtime = _HostRuntime(lambda *args: launches.append(args))
    q, kc, vc, k, v = (_HostArray(a) for a in host.values())
    launch = DecodeLaunch(q, kc, vc, k, v, cache=cache, scale=scale, variant=variant, runtime=runtime)
    seqlens = _HostArray(lens)
    out, lse = runtime.empty(launch.out_shape, np.float16), runtime.empty(launch.lse_shape, np.float32)
    launch.expect(layouts_of(q, kc, vc, k, v, seqlens, None, None, None, None, None, None), layouts_of(out)[0],
                  layouts_of(lse)[0], lambda *arrays: checked.append(arrays))
    # [decode append] fused: one launch, the split kernel appending and merging its splits itself
    assert launch.num_splits == 3 and len(launch._steps) == 1 and launch.launches_per_step == 1
    record = launch._record[0]
    assert record["fuse_new"] == 1

    def step(q=q, k=k, v=v, out=out):
        return launch.run(q, kc, vc, k, v, seqlens, None, None, None, None, None, None, out, lse)

    assert step()[0] is out and not checked and len(launches) == 1
    assert record["q"] == q.data.ptr and record["out"] == out.data.ptr and record["cache_seqlens"] == seqlens.data.ptr
    assert record["k_new"] == k.data.ptr and record["lse"] == lse.data.ptr and record["k_cache"] == kc.data.ptr
    assert record["o_part"] == launch.o_part.data.ptr and record["split_count"] == launch.split_count.data.ptr
    assert (record["batch"], record["num_splits"], record["heads_kv"]) == (1, 3, 2)
    assert (record["capacity"], record["cache_rows"]) == (256, 1)  # [decode guard]'s bounds
    step()
    assert not checked and len(launches) == 2  # the same objects: launched
    q2, k2, v2 = (_HostArray(host[name].copy()) for name in ("q", "k", "v"))
    step(q2, k2, v2)
    assert not checked and len(launches) == 3
    assert (record["q"], record["k_new"], record["v_new"]) == (q2.data.ptr, k2.data.ptr, v2.data.ptr)
    # a k whose address is not a multiple of 16 bytes (its layout the planned one): the append kernel first, then
    # the split kernel not appending; an aligned k again: fused
    odd = _HostArray(np.zeros(host["k"].size + 1, np.float16)[1:].reshape(host["k"].shape))
    assert odd.data.ptr % 16 and (odd.shape, odd.strides) == (k2.shape, k2.strides)
    step(q2, odd, v2)
    assert not checked and len(launches) == 5 and record["fuse_new"] == 0 and launch.launches_per_step == 2
    assert launches[-2][1:4] == (1, 1, 1) and launches[-1][1:4] == (2, 3, 1)  # the append's grid, the split's
    step(q2, odd, v2)  # the same objects: the same two launches
    assert len(launches) == 7 and record["fuse_new"] == 0
    step(q2, k2, v2)
    assert not checked and len(launches) == 8 and record["fuse_new"] == 1 and launch.launches_per_step == 1
    other = runtime.empty(launch.out_shape, np.float16)
    step(q2, k2, v2, other)
    assert not checked and len(launches) == 9 and record["out"] == other.data.ptr
    # another layout: the full check (a DecodePlan's raises, naming it)
    wide = _HostArray(np.zeros((1, 1, 8, 64), np.float16)[..., :32])
    step(wide, k2, v2, other)
    assert len(checked) == 1 and checked[0][0] is wide
    # a None where the plan has k, after the last step's k died: not taken for the same (None) argument
    step(q2, k2, v2, other)
    del k2
    step(q2, None, v2, other)
    assert len(checked) == 2 and checked[1][3] is None
    # out to allocate: a new out of the planned layout, written
    got, _ = step(q2, k, v2, None)
    assert len(checked) == 2 and got is not other and record["out"] == got.data.ptr
    # the front door's launch (no expect): lse allocated at each call, even once the last one has died (a dead
    # reference must not pass for the None argument: the kernels would write into freed memory)
    front = DecodeLaunch(q, kc, vc, k, v, cache=cache, scale=scale, variant=variant, runtime=runtime)
    first = front.run(q, kc, vc, k, v, seqlens, None, None, None, None, None, None, out, None)[1]
    assert front._record[0]["lse"] == first.data.ptr
    del first
    second = front.run(q, kc, vc, k, v, seqlens, None, None, None, None, None, None, out, None)[1]
    assert second is not None and front._record[0]["lse"] == second.data.ptr
    # fuse_append=False: the two launches of every step
    apart = DecodeLaunch(q, kc, vc, k, v, cache=cache, scale=scale, variant=variant, runtime=runtime,
                         fuse_append=False)
    assert apart.launches_per_step == 2 and apart._record[0]["fuse_new"] == 0
    before = len(launches)
    apart.run(q, kc, vc, k, v, seqlens, None, None, None, None, None, None, out, lse)
    assert len(launches) == before + 2 and apart._record[0]["fuse_new"] == 0
    # every launch passes its record's address as the one kernel argument
    argv = {args[9] for args in launches}
    assert argv == {launch._argv_ptr, front._argv_ptr, apart._argv_ptr}
    assert launch._argv[0] == launch._record.ctypes.data
    assert DECODE_PARAMS_DTYPE.itemsize == launch._record.itemsize


# ---------------------------------------------------------------------------------------------------
# Chunked prefill: the forward over the cache (cuflash._ops.chunked_prefill), as the CUDA backend runs seqlen_q >= 64
# ---------------------------------------------------------------------------------------------------

PREFILL_CASES = {  # label: (batch, batch_cache, heads_q, heads_kv, d, seqlen_q, seqlen_new, capacity, seqlens, options)
    "append-gqa4-causal": (2, 2, 8, 2, 16, 64, 64, 200, [0, 136], dict(causal=True)),
    "no-append-mha": (3, 3, 4, 4, 32, 100, 0, 300, [100, 300, 217], dict(causal=True)),
    "mqa-rotary-neox-window": (2, 2, 8, 1, 16, 70, 70, 150, [5, 80], dict(causal=True, window_size=(40, 0),
                                                                           rotary="neox")),
    "partial-append-softcap-gptj": (2, 2, 4, 2, 16, 65, 30, 200, [0, 170], dict(softcap=5.0, rotary="gptj")),
    "spare-cache-rows-alibi": (3, 5, 8, 2, 16, 64, 64, 128, [0, 64, 20], dict(causal=True, alibi="batch")),
    "exactly-full-alibi-heads-scale": (1, 1, 2, 2, 8, 130, 130, 130, [0], dict(causal=True, alibi="heads",
                                                                                softmax_scale=0.3)),
    "rows-without-keys": (2, 2, 4, 2, 16, 80, 0, 100, [10, 90], dict(causal=True)),
    "right-window-not-causal": (2, 2, 4, 2, 16, 96, 16, 160, [40, 144], dict(window_size=(-1, 7))),
}


def _prefill_case(rng, batch, batch_cache, heads_q, heads_kv, d, seqlen_q, seqlen_new, capacity, seqlens, options,
                  dtype=np.float64):
    q = rng.standard_normal((batch, seqlen_q, heads_q, d)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((batch_cache, capacity, heads_kv, d)).astype(dtype) for _ in range(2))
    k = v = None
    if seqlen_new:
        k, v = (rng.standard_normal((batch, seqlen_new, heads_kv, d)).astype(dtype) for _ in range(2))
    call = {name: value for name, value in options.items() if name not in ("rotary", "alibi")}
    if "rotary" in options:
        angles = rng.uniform(0, 2 * np.pi, (capacity + seqlen_q, d // 4))
        call.update(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles),
                    rotary_interleaved=options["rotary"] == "gptj")
    if "alibi" in options:
        shape = (heads_q,) if options["alibi"] == "heads" else (batch, heads_q)
        call["alibi_slopes"] = rng.uniform(0.01, 0.3, shape).astype(np.float32)
    return q, k_cache, v_cache, k, v, np.array(seqlens, np.int32), call


def _normalized(q, k_cache, v_cache, k, v, lens, call):
    defaults = dict(rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_batch_idx=None,
                    cache_leftpad=None, block_table=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, softmax_scale=None, num_splits=0, out=None)
    return _api._kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens=lens, **{**defaults, **call})


@pytest.mark.parametrize("label", list(PREFILL_CASES))
def test_chunked_prefill_composition_equals_the_decode_reference(label):
    """The CUDA backend's chunked-prefill path (rotate, append by an indexed assignment, the FA2 forward with
    seqused_k = cache_seqlens + seqlen_new over the cache rows, bottom-right masks) run on NumPy with the reference's
    forward: the same output, lse and caches as the decode reference, in float64 to 1e-12."""
    from cuflash._ops import chunked_prefill as _chunked_prefill
    from cuflash import reference
    from cuflash.reference import decode as reference_decode

    rng = np.random.default_rng(sum(map(ord, label)))
    q, k_cache, v_cache, k, v, lens, call = _prefill_case(rng, *PREFILL_CASES[label])
    _, problem, cache, scale, variant = _normalized(q, k_cache, v_cache, k, v, lens, call)
    assert _chunked_prefill.eligible(q.shape[1], cache, problem.head_dim, problem.head_dim_v)
    k_decode, v_decode = k_cache.copy(), v_cache.copy()
    out_ref, lse_ref = reference_decode.forward_kvcache(q, k_decode, v_decode, k, v, cache=cache, scale=scale,
                                                        variant=variant)
    out, lse = _chunked_prefill.forward_over_cache(q, k_cache, v_cache, k, v, cache.cache_seqlens, rotary=cache.rotary,
                                                   scale=scale, variant=variant, forward=reference.forward, xp=np)
    np.testing.assert_array_equal(k_cache, k_decode)
    np.testing.assert_array_equal(v_cache, v_decode)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad_length", [-1, 137, 2**31 - 1])
def test_chunked_prefill_composition_guards_lengths_out_of_range(bad_length):
    """[decode guard] on the chunked-prefill path: a cache_seqlens entry out of range (capacity 200, 64 new tokens)
    gives that sequence NaN rows and appends nothing, as the decode reference does; the other sequence is
    unchanged."""
    from cuflash._ops import chunked_prefill as _chunked_prefill
    from cuflash import reference
    from cuflash.reference import decode as reference_decode

    rng = np.random.default_rng(3)
    q, k_cache, v_cache, k, v, lens, call = _prefill_case(rng, *PREFILL_CASES["append-gqa4-causal"])
    _, _, cache, scale, variant = _normalized(q, k_cache, v_cache, k, v, lens, call)
    cache = dataclasses.replace(cache, cache_seqlens=np.array([bad_length, lens[1]], np.int32))
    k_decode, v_decode = k_cache.copy(), v_cache.copy()
    out_ref, lse_ref = reference_decode.forward_kvcache(q, k_decode, v_decode, k, v, cache=cache, scale=scale,
                                                        variant=variant)
    before = k_cache.copy()
    out, lse = _chunked_prefill.forward_over_cache(q, k_cache, v_cache, k, v, cache.cache_seqlens, rotary=None,
                                                   scale=scale, variant=variant, forward=reference.forward, xp=np)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all() and np.isnan(out_ref[0]).all()
    np.testing.assert_array_equal(k_cache[0], before[0])
    np.testing.assert_array_equal(k_cache, k_decode)
    np.testing.assert_array_equal(v_cache, v_decode)
    np.testing.assert_allclose(out[1], out_ref[1], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse[1], lse_ref[1], rtol=0, atol=1e-12)


def test_chunked_prefill_only_where_the_forward_reads_the_same_keys():
    """Eligible: seqlen_q >= MIN_SEQLEN_Q over a contiguous cache; not with a block table, left padding, cache rows
    chosen by cache_batch_idx, or v's head dim differing from q's (MLA)."""
    from cuflash._ops import chunked_prefill as _chunked_prefill

    rng = np.random.default_rng(0)
    q, k_cache, v_cache, k, v, lens, call = _prefill_case(rng, *PREFILL_CASES["append-gqa4-causal"])
    n = _chunked_prefill.MIN_SEQLEN_Q
    assert n == 64

    def eligible(q, v_cache=v_cache, **extra):
        _, problem, cache, _, _ = _normalized(q, k_cache, v_cache, k, v, lens, {**call, **extra})
        return _chunked_prefill.eligible(q.shape[1], cache, problem.head_dim, problem.head_dim_v)

    assert eligible(q) and not eligible(q[:, :n - 1])
    assert not eligible(q, cache_leftpad=np.zeros(2, np.int32))
    assert not eligible(q, cache_batch_idx=np.array([1, 0], np.int32))
    table = np.arange(2 * 50, dtype=np.int32).reshape(2, 50)
    _, problem, cache, _, _ = _api._kvcache_call(
        q, k_cache.reshape(100, 4, 2, 16), v_cache.reshape(100, 4, 2, 16), k, v, cache_seqlens=lens, rotary_cos=None,
        rotary_sin=None, rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None, block_table=table,
        causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None, num_splits=0, out=None)
    assert not _chunked_prefill.eligible(q.shape[1], cache, 16, 16)
    contiguous = dataclasses.replace(cache, block_table=None, page_size=None)
    assert _chunked_prefill.eligible(q.shape[1], contiguous, 16, 16)
    assert not _chunked_prefill.eligible(q.shape[1], contiguous, 16, 8)    # head_dim_v != head_dim (MLA)


def test_chunked_prefill_composition_in_float32():
    """float32, the decode tiles (64 / 128) against the forward's: the two paths agree to float32 rounding."""
    from cuflash._ops import chunked_prefill as _chunked_prefill
    from cuflash import reference
    from cuflash.reference import decode as reference_decode

    rng = np.random.default_rng(1)
    q, k_cache, v_cache, k, v, lens, call = _prefill_case(rng, 2, 2, 8, 2, 32, 256, 256, 1024, [0, 700],
                                                          dict(causal=True), dtype=np.float32)
    _, _, cache, scale, variant = _normalized(q, k_cache, v_cache, k, v, lens, call)
    k_decode, v_decode = k_cache.copy(), v_cache.copy()
    out_ref, lse_ref = reference_decode.forward_kvcache(q, k_decode, v_decode, k, v, cache=cache, scale=scale,
                                                        variant=variant)
    out, lse = _chunked_prefill.forward_over_cache(q, k_cache, v_cache, k, v, cache.cache_seqlens, rotary=None,
                                                   scale=scale, variant=variant, forward=reference.forward, xp=np)
    np.testing.assert_array_equal(k_cache, k_decode)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=2e-6)


def test_uniform_seqlens_reads_rows_of_a_growing_table(monkeypatch):
    """An int cache_seqlens on CuPy: a row of a table kept per (device, batch), grown by doubling (a NumPy-backed
    stand-in for the module here); NumPy arrays get a plain fill."""
    import types

    from cuflash._ops import kvcache as _kvcache

    monkeypatch.setattr(_kvcache, "_SEQLEN_TABLES", {})
    fake = types.SimpleNamespace(__name__="cupy", cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        getDevice=lambda: 0), get_current_stream=lambda: types.SimpleNamespace(is_capturing=lambda: False)),
        arange=np.arange, broadcast_to=np.broadcast_to, full=np.full)
    for value in (0, 5, 1023, 1024, 5000, 3):
        row = _kvcache.uniform_seqlens(fake, 3, value)
        assert row.dtype == np.int32 and row.tolist() == [value] * 3
    assert len(_kvcache._SEQLEN_TABLES) == 1 and _kvcache._SEQLEN_TABLES[(0, 3)].shape[0] >= 5001
    big = _kvcache.uniform_seqlens(fake, 4096, 2000)  # past the table limit: a fill
    assert big.shape == (4096,) and (0, 4096) not in _kvcache._SEQLEN_TABLES
    assert _kvcache.uniform_seqlens(np, 2, 9).tolist() == [9, 9]
