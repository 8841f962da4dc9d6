"""cuflash.cascade_attention (shared-prefix decoding) on the CPU: the NumPy paths of its three steps (the prefix
through cuflash.attention, each suffix through attention_with_kvcache, the merge) against the float64 truth over
prefix + suffix and against the unshared computation (the prefix copied in front of every sequence's cache)."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash._ops import blocks as _blocks, cascade as _cascade

from _helpers import LOW_PRECISION, assert_within_budget, rounding_floor


@pytest.fixture
def small_tiles(monkeypatch):
    """Decode tiles of 8 packed query rows and 4 keys, so that small caches span many tiles and splits."""
    monkeypatch.setattr(_blocks, "decode_block_sizes", lambda head_dim, head_dim_v: (8, 4))


def truth(q, k_prefix, v_prefix, k_suffix, v_suffix, *, scale, causal, softcap=0.0):
    """One sequence in float64: q ``(len_q, heads_q, d)`` over the prefix (every key visible) and its suffix (causal
    within the suffix, bottom-right). ``(out (len_q, heads_q, dv), lse (heads_q, len_q))``."""
    q, k_prefix, v_prefix, k_suffix, v_suffix = (np.asarray(x, np.float64)
                                                 for x in (q, k_prefix, v_prefix, k_suffix, v_suffix))
    len_q, heads_q, _ = q.shape
    prefix, len_s, heads_kv = k_prefix.shape[0], k_suffix.shape[0], k_prefix.shape[1]
    keys = np.repeat(np.concatenate([k_prefix, k_suffix]), heads_q // heads_kv, axis=1)
    values = np.repeat(np.concatenate([v_prefix, v_suffix]), heads_q // heads_kv, axis=1)
    t = np.einsum("ihd,jhd->hij", q, keys) * scale
    if softcap:
        t = softcap * np.tanh(t / softcap)
    i = np.arange(len_q)[:, None] + len_s - len_q
    j = np.arange(prefix + len_s)[None, :] - prefix            # suffix position; < 0 in the prefix
    visible = (j < 0) | (j <= i) if causal else np.ones((len_q, prefix + len_s), bool)
    t = np.where(visible, t, -np.inf)
    m = t.max(axis=-1, initial=-np.inf, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(t - m)
    total = e.sum(axis=-1, keepdims=True)
    out = np.einsum("hij,jhd->ihd", e / np.where(total > 0, total, 1.0), values)
    lse = np.where(total[..., 0] > 0, m[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)), -np.inf)
    return out, lse


def make(rng, *, batch=5, seqlen_q=1, heads_q=8, heads_kv=2, d=16, dv=None, prefix=13, capacity=24, seqlens=None,
         seqlen_new=0, dtype=np.float64):
    dv = dv or d
    q = rng.standard_normal((batch, seqlen_q, heads_q, d)).astype(dtype)
    k_prefix = rng.standard_normal((prefix, heads_kv, d)).astype(dtype)
    v_prefix = rng.standard_normal((prefix, heads_kv, dv)).astype(dtype)
    k_cache = rng.standard_normal((batch, capacity, heads_kv, d)).astype(dtype)
    v_cache = rng.standard_normal((batch, capacity, heads_kv, dv)).astype(dtype)
    k = v = None
    if seqlen_new:
        k = rng.standard_normal((batch, seqlen_new, heads_kv, d)).astype(dtype)
        v = rng.standard_normal((batch, seqlen_new, heads_kv, dv)).astype(dtype)
    if seqlens is None:
        seqlens = rng.integers(0, capacity - seqlen_new + 1, batch)
    return q, k_prefix, v_prefix, k_cache, v_cache, k, v, np.asarray(seqlens, np.int32)


def unshared(q, k_prefix, v_prefix, k_cache, v_cache, k, v, seqlens, **options):
    """The same call without sharing: the prefix copied in front of every sequence's keys in one cache."""
    batch, prefix = q.shape[0], k_prefix.shape[0]

    def joined(prefix_part, cache):
        out = np.zeros((batch, prefix + cache.shape[1], *cache.shape[2:]), cache.dtype)
        out[:, :prefix] = prefix_part
        out[:, prefix:] = cache
        return out

    return cuflash.attention_with_kvcache(q, joined(k_prefix, k_cache), joined(v_prefix, v_cache), k, v,
                                          cache_seqlens=seqlens + prefix, return_lse=True, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_new", [(1, 0), (1, 1), (3, 3), (4, 0)])
@pytest.mark.parametrize("prefix, prefix_splits", [(13, 0), (24, 3), (24, 8), (1, 1), (0, 0)])
def test_cascade_equals_attention_over_prefix_and_suffix(causal, seqlen_q, seqlen_new, prefix, prefix_splits,
                                                        small_tiles):
    """GQA 4, suffix lengths from 0 to full (an empty suffix: lse -inf, weight 0 in the merge), appends, the prefix
    in 1 to 8 chunks: the float64 truth per sequence to 1e-12, the unshared computation (the same call over one
    cache holding prefix + suffix) and the caches it appended to, equal."""
    rng = np.random.default_rng(prefix * 7 + seqlen_q)
    capacity = 24
    seqlens = [0, 1, 7, capacity - seqlen_new, 12][:5]
    if causal and seqlen_q > seqlen_new:  # the queries' own keys are in the suffix: at least seqlen_q of them
        seqlens = [max(s, seqlen_q - seqlen_new) for s in seqlens]
    case = make(rng, seqlen_q=seqlen_q, prefix=prefix, capacity=capacity, seqlens=seqlens, seqlen_new=seqlen_new)
    q, k_prefix, v_prefix, k_cache, v_cache, k, v, lens = case
    k_cache_0, v_cache_0 = k_cache.copy(), v_cache.copy()
    out, lse = cuflash.cascade_attention(q, k_prefix, v_prefix, k_cache, v_cache, k, v, cache_seqlens=lens,
                                         causal=causal, return_lse=True, prefix_splits=prefix_splits)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (5, 8, seqlen_q)
    scale = 1 / np.sqrt(16)
    for b in range(5):
        end = lens[b] + seqlen_new
        ref, ref_lse = truth(q[b], k_prefix, v_prefix, k_cache[b, :end], v_cache[b, :end], scale=scale, causal=causal)
        np.testing.assert_allclose(out[b], ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[b], ref_lse, rtol=0, atol=1e-12)
    if seqlen_new:  # the append: the new tokens in their slots, nothing else changed
        for b in range(5):
            k_cache_0[b, lens[b]:lens[b] + seqlen_new] = k[b]
            v_cache_0[b, lens[b]:lens[b] + seqlen_new] = v[b]
    np.testing.assert_array_equal(k_cache, k_cache_0)
    np.testing.assert_array_equal(v_cache, v_cache_0)
    if not causal or seqlen_q <= seqlen_new or min(seqlens) >= seqlen_q:
        plain_out, plain_lse = unshared(q, k_prefix, v_prefix, k_cache_0, v_cache_0, None, None, lens + seqlen_new,
                                        causal=causal)
        np.testing.assert_allclose(out, plain_out, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse, plain_lse, rtol=0, atol=1e-12)


def test_empty_suffix_is_the_prefix_alone_and_nothing_is_zero_and_minus_inf():
    rng = np.random.default_rng(1)
    q, k_prefix, v_prefix, k_cache, v_cache, _, _, _ = make(rng, batch=2, prefix=9)
    out, lse = cuflash.cascade_attention(q, k_prefix, v_prefix, k_cache, v_cache, cache_seqlens=0, return_lse=True)
    alone, alone_lse = cuflash.attention(q.reshape(1, 2, 8, 16), k_prefix[None], v_prefix[None], return_lse=True)
    np.testing.assert_allclose(out.reshape(1, 2, 8, 16), alone, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse[:, :, 0], alone_lse[0].T, rtol=0, atol=1e-13)
    out, lse = cuflash.cascade_attention(q, k_prefix[:0], v_prefix[:0], k_cache, v_cache, cache_seqlens=0,
                                         return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_paged_suffix_softcap_scale_and_head_dim_v(small_tiles):
    """Each sequence's keys in a shuffled page pool, softcap, a given scale, v's head dim 8 against 16, 2 splits of the
    suffix and 3 of the prefix."""
    rng = np.random.default_rng(2)
    batch, page, pages = 3, 4, 6
    q, k_prefix, v_prefix, k_flat, v_flat, k, v, lens = make(rng, batch=batch, seqlen_q=2, dv=8, prefix=15,
                                                             capacity=page * pages, seqlens=[3, 0, 20], seqlen_new=2)
    table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    k_pool = np.zeros((batch * pages, page, 2, 16))
    v_pool = np.zeros((batch * pages, page, 2, 8))
    for b in range(batch):
        for p in range(pages):
            k_pool[table[b, p]] = k_flat[b, p * page:(p + 1) * page]
            v_pool[table[b, p]] = v_flat[b, p * page:(p + 1) * page]
    out, lse = cuflash.cascade_attention(q, k_prefix, v_prefix, k_pool, v_pool, k, v, cache_seqlens=lens,
                                         block_table=table, causal=True, softcap=3.0, softmax_scale=0.4,
                                         num_splits=2, prefix_splits=3, return_lse=True)
    for b in range(batch):
        keys = np.concatenate([k_flat[b, :lens[b]], k[b]])
        values = np.concatenate([v_flat[b, :lens[b]], v[b]])
        ref, ref_lse = truth(q[b], k_prefix, v_prefix, keys, values, scale=0.4, causal=True, softcap=3.0)
        np.testing.assert_allclose(out[b], ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[b], ref_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_low_precision_within_the_error_budget(dtype_name):
    """Against the float64 truth within 2x the error of naive attention in the same dtype (over the concatenated keys)
    plus the rounding floor: the prefix's and suffix's outputs are rounded to the dtype before the merge."""
    dtype = LOW_PRECISION[dtype_name]
    rng = np.random.default_rng(3)
    q, k_prefix, v_prefix, k_cache, v_cache, _, _, lens = make(rng, batch=3, seqlen_q=2, d=32, prefix=96,
                                                               capacity=64, seqlens=[2, 40, 64], dtype=dtype)
    out = cuflash.cascade_attention(q, k_prefix, v_prefix, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                    prefix_splits=4)
    assert out.dtype == dtype
    truths, naives, results = [], [], []
    for b in range(3):
        keys, values = np.concatenate([k_prefix, k_cache[b, :lens[b]]]), np.concatenate([v_prefix, v_cache[b, :lens[b]]])
        truths.append(truth(q[b], k_prefix, v_prefix, k_cache[b, :lens[b]], v_cache[b, :lens[b]], scale=32 ** -0.5,
                            causal=True)[0])
        naives.append(cuflash.attention(q[b:b + 1], keys[None], values[None], causal=True, algorithm="naive")[0])
        results.append(out[b])
    truths = np.stack(truths)
    assert_within_budget(np.stack(results), truths, np.stack(naives), 2, rounding_floor(truths, dtype),
                         name="cascade out")


def test_the_automatic_prefix_split():
    # batch 64, one query token, 32 / 8 heads: 256 packed rows = 2 tiles per key/value head, 16 blocks -> 8 chunks
    assert _cascade.prefix_chunks(8192, rows=64 * 4, heads_kv=8) == 8
    assert _cascade.prefix_chunks(8192, rows=64 * 32, heads_kv=8) == 1      # 128 blocks already
    assert _cascade.prefix_chunks(1000, rows=4, heads_kv=1) == 1            # chunks of 512 keys at least
    assert _cascade.prefix_chunks(3 * 1024, rows=4, heads_kv=1) == 6        # a divisor of the length, <= 6
    assert _cascade.prefix_chunks(7 * 1024 + 1, rows=4, heads_kv=1) == 1    # a prime-ish length: no chunking


def test_errors_name_the_argument_and_leave_the_cache_untouched():
    rng = np.random.default_rng(4)
    q, k_prefix, v_prefix, k_cache, v_cache, k, v, lens = make(rng, batch=2, prefix=12, seqlen_new=1,
                                                               seqlens=[3, 4])
    call = dict(cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"k_prefix must have shape \(prefix_len, heads_kv, head_dim\): one sequence"):
        cuflash.cascade_attention(q, k_prefix[None], v_prefix, k_cache, v_cache, k, v, **call)
    with pytest.raises(ValueError, match=r"v_prefix must have shape .* = \(prefix_len, 2, 16\) as v_cache's heads "
                                         r"and head dim; got \(12, 1, 16\)"):
        cuflash.cascade_attention(q, k_prefix, v_prefix[:, :1], k_cache, v_cache, k, v, **call)
    with pytest.raises(TypeError, match="k_prefix must have q's dtype float64; got float32"):
        cuflash.cascade_attention(q, k_prefix.astype(np.float32), v_prefix, k_cache, v_cache, k, v, **call)
    with pytest.raises(TypeError, match="v_prefix must be an array .* got list"):
        cuflash.cascade_attention(q, k_prefix, v_prefix.tolist(), k_cache, v_cache, k, v, **call)
    with pytest.raises(ValueError, match="k_prefix and v_prefix must hold the same keys: prefix_len 12 and 11"):
        cuflash.cascade_attention(q, k_prefix, v_prefix[:11], k_cache, v_cache, k, v, **call)
    with pytest.raises(ValueError, match="prefix_splits must divide prefix_len 12 .* got 5"):
        cuflash.cascade_attention(q, k_prefix, v_prefix, k_cache, v_cache, k, v, prefix_splits=5, **call)
    with pytest.raises(TypeError, match="prefix_splits must be a non-negative int .* got int -1"):
        cuflash.cascade_attention(q, k_prefix, v_prefix, k_cache, v_cache, k, v, prefix_splits=-1, **call)
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(ValueError, match="cache_seqlens"):  # the suffix call's own check, before its append
        cuflash.cascade_attention(q, k_prefix, v_prefix, k_cache, v_cache, k, v, cache_seqlens=np.array([3, 24], np.int32))
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


@pytest.mark.parametrize("mode, expected", [("--cascade", "cascade batch   2 prefix    128"),
                                            ("--prefill", "prefill batch  1 cache     96 new    64")])
def test_bench_decode_cascade_and_prefill_on_the_cpu(capsys, tmp_path, monkeypatch, mode, expected):
    """bench-decode --cascade / --prefill without a GPU: the NumPy paths at small sizes, checked (the cascade against
    the unshared call, the prefill call against cuflash.attention on the same keys) and written as JSON."""
    import json

    from cuflash.cli import main as cli

    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    out_json = tmp_path / "rows.json"
    sizes = ["--batch", "2", "--cache", "128"] if mode == "--cascade" else ["--batch", "1", "--cache", "96"]
    assert cli.main(["bench-decode", mode, *sizes, "--json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())
    assert row["max_abs_diff"] < 1e-5
    assert expected in capsys.readouterr().out
