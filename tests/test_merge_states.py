"""cuflash.merge_states: attention over disjoint key sets, merged, equals attention over their union."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._ops import merge as _merge

from _helpers import random_inputs


def _attention_over(q, k, v, keys, **options):
    """Attention of q over the keys ``keys`` (indices along the key axis) only: ``(out, lse)``."""
    return cuflash.attention(q, k[:, keys], v[:, keys], return_lse=True, **options)


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_two_parts_of_the_keys_merge_into_one_shot_attention(heads_q, heads_kv, seed):
    rng = np.random.default_rng(seed)
    q, k, v, _ = random_inputs(2, 7, 41, heads_q, heads_kv, 16, seed=seed, with_do=False)
    cut = int(rng.integers(1, 40))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    o_a, lse_a = _attention_over(q, k, v, np.arange(cut))
    o_b, lse_b = _attention_over(q, k, v, np.arange(cut, 41))
    merged, merged_lse = cuflash.merge_states(o_a, lse_a, o_b, lse_b)
    np.testing.assert_allclose(merged, out, rtol=0, atol=1e-13)
    np.testing.assert_allclose(merged_lse, lse, rtol=0, atol=1e-13)
    assert merged.dtype == np.float64 and merged_lse.dtype == np.float64
    # the order of the parts does not matter
    swapped, swapped_lse = cuflash.merge_states(o_b, lse_b, o_a, lse_a)
    np.testing.assert_allclose(swapped, merged, rtol=0, atol=1e-15)
    np.testing.assert_allclose(swapped_lse, merged_lse, rtol=0, atol=1e-15)


@pytest.mark.parametrize("parts", [3, 5, 9])
def test_many_random_disjoint_parts_merge_in_any_order(parts):
    rng = np.random.default_rng(parts)
    q, k, v, _ = random_inputs(2, 5, 60, 4, 2, 8, seed=parts, with_do=False)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    # a random partition of the keys (not contiguous runs), some parts possibly empty
    owner = rng.integers(0, parts, size=60)
    results = [_attention_over(q, k, v, np.flatnonzero(owner == p)) for p in range(parts)]
    order = rng.permutation(parts)
    merged = functools.reduce(lambda a, b: cuflash.merge_states(*a, *b), [results[i] for i in order])
    np.testing.assert_allclose(merged[0], out, rtol=0, atol=1e-13)
    np.testing.assert_allclose(merged[1], lse, rtol=0, atol=1e-13)
    # a tree of merges gives the same
    while len(results) > 1:
        results = [cuflash.merge_states(*results[i], *results[i + 1]) if i + 1 < len(results) else results[i]
                   for i in range(0, len(results), 2)]
    np.testing.assert_allclose(results[0][0], out, rtol=0, atol=1e-13)


def test_merge_with_causal_parts_and_rows_that_see_nothing():
    """Causal attention split into a prefix and a suffix of the keys: rows of the suffix part that see none of its
    keys have lse = -inf there; rows empty in both parts stay 0 / -inf, with no NaN and no warning."""
    q, k, v, _ = random_inputs(1, 9, 6, 2, 2, 8, seed=3, with_do=False)
    # bottom-right with more queries than keys: rows 0..2 see no key at all
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert np.isneginf(lse[:, :, :3]).all()
    o_a, lse_a = cuflash.attention(q, k, v, return_lse=True, attn_mask=_causal_mask(9, 6, keys=range(0, 2)))
    o_b, lse_b = cuflash.attention(q, k, v, return_lse=True, attn_mask=_causal_mask(9, 6, keys=range(2, 6)))
    with np.errstate(all="raise"):
        merged, merged_lse = cuflash.merge_states(o_a, lse_a, o_b, lse_b)
    assert not np.isnan(merged).any() and not np.isnan(merged_lse).any()
    np.testing.assert_allclose(merged, out, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(merged_lse), np.isneginf(lse))
    np.testing.assert_allclose(merged_lse[np.isfinite(lse)], lse[np.isfinite(lse)], rtol=0, atol=1e-13)
    assert (merged[:, :3] == 0).all()


def _causal_mask(len_q, len_k, keys):
    """Bottom-right causal visibility restricted to the key indices ``keys``: (len_q, len_k) bool."""
    i = np.arange(len_q)[:, None] + len_k - len_q
    j = np.arange(len_k)[None, :]
    return (j <= i) & np.isin(j, list(keys))[None, :]


def test_empty_parts_and_both_empty():
    o = np.ones((1, 2, 3, 4))
    lse = np.zeros((1, 3, 2))
    zero = np.zeros_like(o)
    empty = np.full_like(lse, -np.inf)
    with np.errstate(all="raise"):
        merged, merged_lse = cuflash.merge_states(o, lse, zero, empty)
        np.testing.assert_array_equal(merged, o)
        np.testing.assert_array_equal(merged_lse, lse)
        merged, merged_lse = cuflash.merge_states(zero, empty, zero, empty)
    np.testing.assert_array_equal(merged, 0)
    assert np.isneginf(merged_lse).all()


def test_a_nan_part_makes_the_row_nan():
    """A row poisoned by the decode kernels' guards (NaN o and lse in one part) stays NaN after a merge, lse
    included, whatever the other part holds; the other rows merge as usual."""
    rng = np.random.default_rng(3)
    o_a, o_b = rng.standard_normal((2, 1, 2, 3, 4))
    lse_a, lse_b = rng.standard_normal((2, 1, 3, 2))
    lse_b[0, 0, :] = -np.inf                   # head 0: part b empty
    o_a[0, :, 0], lse_a[0, 0, :] = np.nan, np.nan   # ... and part a poisoned
    o_b[0, 1, 2], lse_b[0, 2, 1] = np.nan, np.nan   # head 2, token 1: part b poisoned
    merged, merged_lse = cuflash.merge_states(o_a, lse_a, o_b, lse_b)
    assert np.isnan(merged[0, :, 0]).all() and np.isnan(merged_lse[0, 0]).all()
    assert np.isnan(merged[0, 1, 2]).all() and np.isnan(merged_lse[0, 2, 1])
    fine = np.ones(merged_lse.shape, bool)
    fine[0, 0, :] = fine[0, 2, 1] = False
    assert np.isfinite(merged_lse[fine]).all()
    np.testing.assert_allclose(merged_lse[fine], np.logaddexp(lse_a[fine], lse_b[fine]), rtol=0, atol=1e-14)


def test_equal_parts_add_log_two():
    o = np.random.default_rng(0).standard_normal((2, 3, 4, 5))
    lse = np.random.default_rng(1).standard_normal((2, 4, 3))
    merged, merged_lse = cuflash.merge_states(o, lse, o, lse)
    np.testing.assert_allclose(merged, o, rtol=0, atol=1e-15)
    np.testing.assert_allclose(merged_lse, lse + np.log(2), rtol=0, atol=1e-15)


def test_large_lse_gaps_do_not_overflow():
    o_a, o_b = np.full((1, 1, 1, 2), 1.0), np.full((1, 1, 1, 2), 3.0)
    merged, merged_lse = cuflash.merge_states(o_a, np.array([[[1000.0]]]), o_b, np.array([[[-1000.0]]]))
    np.testing.assert_allclose(merged, o_a)
    np.testing.assert_allclose(merged_lse, 1000.0)


def test_packed_layout():
    q, k, v, _ = random_inputs(1, 10, 30, 4, 2, 8, seed=5, with_do=False)
    cu = np.array([0, 10], np.int32)
    full = cuflash.attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=np.array([0, 30], np.int32),
                             max_seqlen_q=10, max_seqlen_k=30, return_lse=True)
    parts = [cuflash.attention(q[0], k[0, s], v[0, s], cu_seqlens_q=cu, cu_seqlens_k=np.array([0, 15], np.int32),
                               max_seqlen_q=10, max_seqlen_k=15, return_lse=True)
             for s in (slice(0, 15), slice(15, 30))]
    merged, merged_lse = cuflash.merge_states(*parts[0], *parts[1])
    assert merged.shape == (10, 4, 8) and merged_lse.shape == (4, 10)
    np.testing.assert_allclose(merged, full[0], rtol=0, atol=1e-13)
    np.testing.assert_allclose(merged_lse, full[1], rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_outputs_keep_their_dtype_and_merge_in_float32(dtype):
    q, k, v, _ = random_inputs(1, 4, 64, 2, 2, 16, dtype, seed=7, with_do=False)
    out, lse = cuflash.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), return_lse=True)
    a = _attention_over(q, k, v, np.arange(20))
    b = _attention_over(q, k, v, np.arange(20, 64))
    merged, merged_lse = cuflash.merge_states(*a, *b)
    assert merged.dtype == dtype and merged_lse.dtype == np.float32
    one_shot = cuflash.attention(q, k, v, return_lse=True)
    # no worse than one-shot attention in the same dtype, up to the rounding of the two parts' outputs
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert np.abs(merged.astype(np.float64) - out).max() <= 2 * np.abs(one_shot[0].astype(np.float64) - out).max() + 2 * eps
    np.testing.assert_allclose(merged_lse, lse, rtol=0, atol=1e-5)


def test_merge_stacked_matches_pairwise_merges():
    rng = np.random.default_rng(11)
    o = rng.standard_normal((6, 3, 5, 4))
    lse = rng.standard_normal((6, 3, 5)) * 5
    lse[2] = -np.inf
    lse[:, 1, 2] = -np.inf
    with np.errstate(all="raise"):
        stacked, stacked_lse = _merge.merge_stacked(o, lse, np)
    pair = (o[0], lse[0])
    for s in range(1, 6):
        pair = _merge.merge_stacked(np.stack([pair[0], o[s]]), np.stack([pair[1], lse[s]]), np)
    np.testing.assert_allclose(stacked, pair[0], rtol=0, atol=1e-13)
    np.testing.assert_allclose(stacked_lse, pair[1], rtol=0, atol=1e-13)
    assert (stacked[1, 2] == 0).all() and np.isneginf(stacked_lse[1, 2])


@pytest.mark.parametrize("case, error, match", [
    ("o shapes", ValueError, "o_a and o_b must have the same shape"),
    ("lse shape", ValueError, r"lse_b must have shape \(batch, heads, seqlen_q\) = \(1, 3, 2\)"),
    ("o dtypes", TypeError, "o_a and o_b must have the same dtype"),
    ("lse dtype", TypeError, "lse_a must have dtype float32 or float64"),
    ("o rank", ValueError, "o_a must have shape"),
    ("library", TypeError, r"lse_b must be an array \(a numpy.ndarray, or a cupy.ndarray for the CUDA kernels\); "
                           r"got builtins.list"),
])
def test_bad_inputs_are_refused(case, error, match):
    o = np.zeros((1, 2, 3, 4))
    lse = np.zeros((1, 3, 2))
    args = {"o_a": o, "lse_a": lse, "o_b": o, "lse_b": lse}
    if case == "o shapes":
        args["o_b"] = np.zeros((1, 2, 3, 5))
    elif case == "lse shape":
        args["lse_b"] = np.zeros((1, 2, 3))
    elif case == "o dtypes":
        args["o_b"] = o.astype(np.float32)
    elif case == "lse dtype":
        args["lse_a"] = args["lse_b"] = lse.astype(np.float16)
    elif case == "o rank":
        args["o_a"] = args["o_b"] = np.zeros((2, 3))
    elif case == "library":
        args["lse_b"] = [[0.0]]
    with pytest.raises(error, match=match):
        cuflash.merge_states(**args)
