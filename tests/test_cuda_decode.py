"""The CUDA decode kernels (cuflash._cuda.decode, decode.cu) against the float64 truth of the NumPy reference.

Each call goes through the front door (cuflash.attention_with_kvcache) or a plan (cuflash.plan_kvcache), and the
kernels' output and the caches they appended to are compared with the NumPy reference's (float64 inputs for the
truth, the kernels' dtype for the budget). The merge kernel alone against cuflash._ops.merge.merge_stacked; plans over
several steps, in a CuPy stream-capture graph and in a torch.cuda.CUDAGraph. Skips without CuPy and a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash._ops import api as _api

from _gpu_helpers import DTYPES, as_float32, poison
from _helpers import assert_within_budget, rounding_floor

pytestmark = pytest.mark.gpu


def _case(rng, *, batch, heads_q, heads_kv, d, seqlen_q, seqlen_new, capacity, page_size, dtype, dv=None):
    """q, the caches (paged when page_size), the new k, v, cache_seqlens and block_table (NumPy). With ``dv``
    (MLA): v_cache is k_cache[..., :dv], a view, and v has head dim dv."""
    q = rng.standard_normal((batch, seqlen_q, heads_q, d)).astype(dtype)
    k = v = None
    if seqlen_new:
        k = rng.standard_normal((batch, seqlen_new, heads_kv, d)).astype(dtype)
        v = rng.standard_normal((batch, seqlen_new, heads_kv, dv or d)).astype(dtype)
    seqlens = rng.integers(0, capacity - seqlen_new + 1, batch).astype(np.int32)
    seqlens[0] = capacity - seqlen_new  # one full sequence
    if page_size:
        pages = -(-capacity // page_size)
        table = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32)
        shape = (batch * pages, page_size, heads_kv, d)
    else:
        table = None
        shape = (batch, capacity, heads_kv, d)
    k_cache, v_cache = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    if dv is not None:
        v_cache = k_cache[..., :dv]
    return q, k_cache, v_cache, k, v, seqlens, table


CASES = {  # label: (batch, heads_q, heads_kv, d, seqlen_q, seqlen_new, capacity, page_size, options)
    "decode-gqa4": (4, 16, 4, 128, 1, 1, 700, None, dict()),
    "mqa-group32-spec3": (2, 32, 1, 64, 3, 3, 300, None, dict(causal=True)),  # a token spans two row tiles
    "leftpad-batch-idx-rotary": (3, 8, 2, 64, 2, 2, 260, None,
                                 dict(causal=True, cache_leftpad="random", cache_batch_idx="spare", rotary="neox")),
    "paged-rotary-interleaved": (2, 8, 4, 128, 1, 1, 333, 5, dict(causal=True, rotary="gptj")),
    "empty-rows": (2, 4, 2, 64, 6, 0, 4, None, dict(causal=True, short=True)),  # more query tokens than keys
    "huge-window-alibi-batch": (2, 8, 2, 64, 2, 0, 200, 8, dict(window_size=(10, 2**31 - 1), alibi_slopes="batch")),
    "decode-paged16-causal": (3, 8, 2, 128, 1, 1, 513, 16, dict(causal=True)),
    "decode-paged1": (2, 8, 8, 64, 1, 1, 200, 1, dict(causal=True)),
    "decode-paged3-spec4": (2, 16, 2, 64, 4, 4, 300, 3, dict(causal=True)),
    "mqa-window-softcap": (2, 8, 1, 96, 3, 0, 400, None, dict(causal=True, window_size=(100, 0), softcap=20.0)),
    "alibi-splits": (1, 4, 4, 32, 1, 1, 4096, 64, dict(causal=True, alibi_slopes="heads", num_splits=7)),
    "many-splits-long": (1, 32, 8, 128, 1, 1, 16384, None, dict(causal=True)),
    # head dim 256 (flash_decode_wide_kernel: one row group, the warps splitting O's columns)
    "d256-gqa8-paged16": (2, 16, 2, 256, 1, 1, 700, 16, dict(causal=True)),
    "d256-spec3-window": (2, 8, 4, 256, 3, 3, 300, None, dict(causal=True, window_size=(90, 0), softcap=30.0)),
    # MLA, absorbed (DeepSeek-V3's shape, fewer heads): one latent head of 576 = 512 + 64 rope, V the first 512
    # columns of the K cache; 64 packed rows per block (a token's heads span two blocks at 80 heads)
    "mla-paged64-spec2": (2, 80, 1, 576, 2, 2, 700, 64, dict(causal=True, mla=512)),
    "mla-contiguous-alibi": (3, 16, 1, 576, 1, 1, 300, None, dict(causal=True, mla=512, alibi_slopes="heads")),
    # ... without appended tokens: on sm_90 the key tiles come by TMA (pages of 64 and 128, the contiguous cache)
    "mla-paged64-tma": (2, 64, 1, 576, 1, 0, 700, 64, dict(causal=True, mla=512)),
    "mla-paged128-spec2-splits-tma": (3, 128, 1, 576, 2, 0, 1000, 128, dict(causal=True, mla=512, num_splits=3)),
    "mla-contiguous-tma": (2, 16, 1, 576, 1, 0, 300, None, dict(mla=512)),
    # chunked prefill (seqlen_q >= 64, contiguous, no leftpad / batch_idx): the forward kernels over the cache
    "prefill-append-gqa4": (2, 16, 4, 128, 128, 128, 1024, None, dict(causal=True)),
    "prefill-rotary-window-alibi": (2, 8, 2, 64, 96, 96, 600, None,
                                    dict(causal=True, window_size=(200, 0), rotary="neox", alibi_slopes="batch")),
    "prefill-softcap-no-append": (2, 8, 8, 64, 64, 0, 400, None, dict(softcap=20.0)),
    "prefill-gptj-alibi-heads": (3, 8, 4, 128, 80, 80, 500, None, dict(causal=True, rotary="gptj",
                                                                      alibi_slopes="heads")),
}


def _call_of(label, dtname, splits):
    """The NumPy inputs of CASES[label]: q, the caches, k, v, the keyword arguments of the call (the lengths,
    block table and options), dv (MLA) and the dtype."""
    batch, hq, hkv, d, sq, snew, cap, page, opts = CASES[label]
    rng = np.random.default_rng(len(label) * 31 + len(dtname))
    dtype = DTYPES[dtname]
    opts = dict(opts)
    dv = opts.pop("mla", None)
    q, k_cache, v_cache, k, v, seqlens, table = _case(rng, batch=batch, heads_q=hq, heads_kv=hkv, d=d, seqlen_q=sq,
                                                     seqlen_new=snew, capacity=cap, page_size=page, dtype=dtype, dv=dv)
    if dv is not None:
        opts["softmax_scale"] = 1 / np.sqrt(192)  # DeepSeek's: the unabsorbed head dim, 128 + 64
    if splits is not None:
        opts["num_splits"] = splits
    if opts.get("alibi_slopes") == "heads":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, hq).astype(np.float32)
    elif opts.get("alibi_slopes") == "batch":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (batch, hq)).astype(np.float32)
    if opts.pop("short", False):  # every sequence shorter than q: the first rows see no key
        seqlens[:] = rng.integers(0, 3, batch)
    if opts.get("cache_leftpad") == "random":
        opts["cache_leftpad"] = np.minimum(rng.integers(0, 50, batch), seqlens).astype(np.int32)
    if opts.get("cache_batch_idx") == "spare":  # the cache has spare rows; sequences use a permutation of some
        k_cache, v_cache = (np.concatenate([x, x[:2]]) for x in (k_cache, v_cache))
        opts["cache_batch_idx"] = rng.permutation(batch + 2)[:batch].astype(np.int32)
    if opts.get("rotary") in ("neox", "gptj"):
        interleaved = opts.pop("rotary") == "gptj"
        angles = rng.uniform(0, 2 * np.pi, (cap + sq, d // 4))
        opts.update(rotary_cos=np.cos(angles).astype(np.float32), rotary_sin=np.sin(angles).astype(np.float32),
                    rotary_interleaved=interleaved)
    extra = dict(cache_seqlens=seqlens, block_table=table, return_lse=True, **opts)
    return q, k_cache, v_cache, k, v, extra, dv, dtype


@pytest.mark.parametrize("label", list(CASES))
@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
@pytest.mark.parametrize("splits", [None, 1])
def test_decode_against_the_truth(requires_gpu, label, dtname, splits):
    cp = requires_gpu
    q, k_cache, v_cache, k, v, extra, dv, dtype = _call_of(label, dtname, splits)

    def host(x):
        return None if x is None else np.array(x, dtype=np.float64)

    def caches(k_cache, v_cache, copy):  # its own copy of both (MLA: v_cache a view of the copy of k_cache)
        kc = copy(k_cache)
        return (kc, kc[..., :dv]) if dv is not None else (kc, copy(v_cache))

    # truth (float64) and the same reference in the kernels' dtype, each on its own copy of the caches
    k64, v64 = caches(k_cache, v_cache, host)
    out_t, lse_t = cuflash.attention_with_kvcache(host(q), k64, v64, host(k), host(v), **extra)
    kn, vn = caches(k_cache, v_cache, np.copy)
    out_n, lse_n = cuflash.attention_with_kvcache(q, kn, vn, k, v, **extra)

    dev = {name: (cp.asarray(val) if isinstance(val, np.ndarray) else val) for name, val in extra.items()}
    ck, cv = caches(k_cache, v_cache, cp.asarray)
    poison(cp)
    out, lse = cuflash.attention_with_kvcache(cp.asarray(q), ck, cv, None if k is None else cp.asarray(k),
                                             None if v is None else cp.asarray(v), **dev)
    out_h = cp.asnumpy(out)
    assert not np.isnan(out_h.astype(np.float32)).any(), "unwritten (NaN) output"
    assert_within_budget(out_h, out_t, out_n, 2, rounding_floor(out_t, dtype), "out")
    # lse: within twice the reference's own distance in the kernels' dtype (rotary rounds the rotated q and k to
    # it), at least 2e-3; rows that see no key: -inf in both
    seen = np.isfinite(lse_t)
    lse_budget = max(2e-3, 2 * float(np.abs(lse_n.astype(np.float64) - lse_t)[seen].max(initial=0.0)))
    np.testing.assert_allclose(cp.asnumpy(lse), lse_t, rtol=0, atol=lse_budget)
    # the append wrote the same slots with the same values as the reference's, and nothing else
    assert np.array_equal(cp.asnumpy(ck).view(np.uint16), kn.view(np.uint16))
    assert np.array_equal(cp.asnumpy(cv).view(np.uint16), vn.view(np.uint16))


# [decode append] fused into the split kernel: the cases that append through the decode kernels
FUSED_CASES = [label for label, case in CASES.items() if case[5] and not label.startswith("prefill")]


def _switch(monkeypatch, name: str, value) -> None:
    """A switch of cuflash._cuda.decode set for the test, the launches planned under its other value forgotten."""
    from cuflash._cuda import decode

    monkeypatch.setattr(decode, name, value)
    decode._LAUNCHES.clear()
    _api._kvcache_launches.clear()


@pytest.mark.parametrize("seqlen_q, causal", [(1, True), (3, False), (80, True)],
                         ids=["decode", "speculative-not-causal", "chunked-prefill"])
@pytest.mark.parametrize("table", ["float32", "q"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_rotary_kernel_matches_the_array_operations(requires_gpu, monkeypatch, seqlen_q, causal, table, interleaved):
    """[decode rotary] decode_rotary_kernel (decode.ROTARY_KERNEL, the default) gives what the CuPy array operations
    give (the reference's apply_rotary on CuPy arrays, ROTARY_KERNEL off): out, lse and both caches bit for bit, for
    decode steps, a non-causal speculative step (every query token at cache_seqlens[b]) and chunked prefill, tables of
    float32 and of q's dtype, both pair layouts, a rotary_dim below the head dim."""

    cp = requires_gpu
    rng = np.random.default_rng(90 + seqlen_q)
    dtype = DTYPES["bfloat16"]
    batch, heads_q, heads_kv, d, capacity = 3, 8, 2, 128, 1024
    q, k_cache, v_cache, k, v, seqlens, _ = _case(rng, batch=batch, heads_q=heads_q, heads_kv=heads_kv, d=d,
                                                  seqlen_q=seqlen_q, seqlen_new=seqlen_q, capacity=capacity,
                                                  page_size=None, dtype=dtype)
    angles = np.outer(np.arange(capacity + 5), 1e-2 ** (np.arange(40) / 40))  # rotary_dim 80
    cast = np.float32 if table == "float32" else dtype
    cos, sin = cp.asarray(np.cos(angles).astype(cast)), cp.asarray(np.sin(angles).astype(cast))
    results = {}
    for kernel in (True, False):
        _switch(monkeypatch, "ROTARY_KERNEL", kernel)
        ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
        poison(cp)
        out, lse = cuflash.attention_with_kvcache(cp.asarray(q), ck, cv, cp.asarray(k), cp.asarray(v),
                                                  cache_seqlens=cp.asarray(seqlens), rotary_cos=cos, rotary_sin=sin,
                                                  rotary_interleaved=interleaved, causal=causal, return_lse=True)
        (launch,) = _api._kvcache_launches._entries.values()
        assert (launch._rotary_step is not None) == kernel
        results[kernel] = [cp.asnumpy(x).view(np.uint8) for x in (out, lse, ck, cv)]
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), results[True], results[False]):
        assert np.array_equal(a, b), name


def test_rotary_kernel_makes_a_sequence_past_its_tables_nan(requires_gpu):
    """[decode guard] A position past the rotary tables (a device length the host does not read): the rotary kernel
    never reads past the tables and gives the sequence the length -1 for the kernels after it, so it appends nothing
    and its output rows are NaN; the other sequences are computed and appended as usual."""
    cp = requires_gpu
    rng = np.random.default_rng(95)
    dtype = DTYPES["float16"]
    q, k_cache, v_cache, k, v, _, _ = _case(rng, batch=2, heads_q=4, heads_kv=2, d=64, seqlen_q=1, seqlen_new=1,
                                            capacity=512, page_size=None, dtype=dtype)
    angles = np.outer(np.arange(300), 1e-2 ** (np.arange(32) / 32))
    cos, sin = cp.asarray(np.cos(angles).astype(np.float32)), cp.asarray(np.sin(angles).astype(np.float32))
    lens = cp.asarray(np.array([100, 400], np.int32))  # (sequence 1's position 400: past the tables' 300 rows)
    ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
    out = cuflash.attention_with_kvcache(cp.asarray(q), ck, cv, cp.asarray(k), cp.asarray(v), cache_seqlens=lens,
                                         rotary_cos=cos, rotary_sin=sin, causal=True)
    host = cp.asnumpy(out).astype(np.float32)
    assert np.isfinite(host[0]).all() and np.isnan(host[1]).all()
    kc, vc = cp.asnumpy(ck), cp.asnumpy(cv)
    assert np.array_equal(kc[1], k_cache[1]) and np.array_equal(vc[1], v_cache[1])  # (nothing appended)
    assert np.array_equal(vc[0, 100], v[0, 0]) and not np.array_equal(kc[0, 100], k_cache[0, 100])


@pytest.mark.parametrize("label", FUSED_CASES)
@pytest.mark.parametrize("splits", [None, 1])
def test_fused_append_matches_the_two_launches(requires_gpu, monkeypatch, label, splits):
    """[decode append] fused (decode.cu: append_head, NewRows): the front door's step is one launch, the split
    kernel reading the new tokens from k and v and writing them into the caches, and gives what the append kernel
    followed by the split kernel gives (FUSE_APPEND off: two launches): out and lse bit for bit, and caches bit for
    bit equal to the reference's after its append (the slots it appends, and nothing else). A k two bytes past a
    multiple of 16 (of the planned layout) runs the two launches (rotary: its contiguous copy, fused)."""
    from cuflash._cuda import decode

    cp = requires_gpu
    q, k_cache, v_cache, k, v, extra, dv, dtype = _call_of(label, "bfloat16", splits)
    rotary = "rotary_cos" in extra

    def caches(copy):  # its own copy of both (MLA: v_cache a view of the copy of k_cache)
        kc = copy(k_cache)
        return (kc, kc[..., :dv]) if dv is not None else (kc, copy(v_cache))

    kn, vn = caches(np.copy)
    cuflash.attention_with_kvcache(q, kn, vn, k, v, **extra)  # the reference's append
    dev = {name: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for name, x in extra.items()}
    results = {}
    for mode, launches in (("fused", 1), ("two", 2), ("odd-k", 1 if rotary else 2)):
        _switch(monkeypatch, "FUSE_APPEND", mode != "two")
        ck, cv = caches(cp.asarray)
        ck_new = cp.asarray(k)
        if mode == "odd-k":
            flat = cp.empty(k.size + 1, dtype=k.dtype)[1:]
            flat[...] = ck_new.ravel()
            ck_new = flat.reshape(k.shape)
            assert ck_new.data.ptr % 16 == 2 and ck_new.strides == cp.asarray(k).strides
        poison(cp)
        out, lse = cuflash.attention_with_kvcache(cp.asarray(q), ck, cv, ck_new, cp.asarray(v), **dev)
        (launch,) = decode._LAUNCHES.values()
        merge = int(dv is not None and launch.num_splits > 1)  # MLA's merge of several splits: a launch of its own
        # (+1: [decode rotary]'s kernel before them)
        assert launch.launches_per_step == launches + merge + rotary, (mode, launch.launches_per_step)
        assert int(launch._record[0]["fuse_new"]) == (launches == 1)
        assert np.array_equal(cp.asnumpy(ck).view(np.uint16), kn.view(np.uint16)), mode
        assert np.array_equal(cp.asnumpy(cv).view(np.uint16), vn.view(np.uint16)), mode
        results[mode] = (cp.asnumpy(out).view(np.uint16), cp.asnumpy(lse))
    for mode in ("two", "odd-k"):
        assert np.array_equal(results[mode][0], results["fused"][0]), mode
        np.testing.assert_array_equal(results[mode][1], results["fused"][1])
    decode._LAUNCHES.clear()
    _api._kvcache_launches.clear()


def test_fused_append_steps_in_a_plan(requires_gpu):
    """A plan's steps of one token each, fused (one launch), against the same steps with the append kernel first
    (fuse_append=False), each over its own caches: after every step the same out and lse, bit for bit, and the
    same caches; the fused step reads this step's token from k, v (not from the slot it writes)."""
    from cuflash._cuda import decode

    cp = requires_gpu
    dtype = DTYPES["bfloat16"]
    rng = np.random.default_rng(77)
    q, k_cache, v_cache, seqlens, table = _steps_case(rng, dtype, paged=True)
    batch, _, heads_q, d = q.shape
    heads_kv = k_cache.shape[2]
    lens = cp.asarray(seqlens)
    runs = {}
    for fused in (True, False):
        decode.FUSE_APPEND, saved = fused, decode.FUSE_APPEND
        try:
            ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
            cq, ck_new, cv_new = (cp.zeros(s, dtype) for s in (q.shape, (batch, 1, heads_kv, d),
                                                                (batch, 1, heads_kv, d)))
            plan = cuflash.plan_kvcache(cq, ck, cv, ck_new, cv_new, cache_seqlens=lens, causal=True,
                                        block_table=cp.asarray(table), num_splits=3)
        finally:
            decode.FUSE_APPEND = saved
        runs[fused] = (plan, cq, ck, cv, ck_new, cv_new, cp.asarray(seqlens), cp.asarray(table))
    step_rng = np.random.default_rng(5)
    for step in range(4):
        qs = step_rng.standard_normal(q.shape).astype(dtype)
        ks, vs = (step_rng.standard_normal((batch, 1, heads_kv, d)).astype(dtype) for _ in range(2))
        got = {}
        for fused, (plan, cq, ck, cv, ck_new, cv_new, lens_f, table_f) in runs.items():
            cq[...], ck_new[...], cv_new[...] = cp.asarray(qs), cp.asarray(ks), cp.asarray(vs)
            out, lse = plan.run(cq, ck, cv, ck_new, cv_new, cache_seqlens=lens_f, block_table=table_f)
            assert plan._runner.__self__.launches_per_step == (1 if fused else 2)
            got[fused] = (cp.asnumpy(out).view(np.uint16), cp.asnumpy(lse), cp.asnumpy(ck).view(np.uint16),
                          cp.asnumpy(cv).view(np.uint16))
            lens_f += 1
        for a, b in zip(got[True], got[False]):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


@pytest.mark.parametrize("d", [64, 128])
def test_chunked_prefill_matches_the_decode_kernels(requires_gpu, monkeypatch, d):
    """A call of 512 new tokens against a contiguous cache runs as the forward over the cache
    (ChunkedPrefillLaunch); forced onto the decode kernels (MIN_SEQLEN_Q raised) the same call gives the same output
    within bfloat16 rounding and the same caches, bit for bit."""
    from cuflash._ops import chunked_prefill as _chunked_prefill
    from cuflash._cuda import decode

    cp = requires_gpu
    rng = np.random.default_rng(d)
    q, k_cache, v_cache, k, v, seqlens, _ = _case(rng, batch=2, heads_q=16, heads_kv=4, d=d, seqlen_q=512,
                                                  seqlen_new=512, capacity=4096, page_size=None,
                                                  dtype=DTYPES["bfloat16"])
    args = dict(cache_seqlens=cp.asarray(seqlens), causal=True, return_lse=True)
    results = {}
    for path, threshold in (("prefill", _chunked_prefill.MIN_SEQLEN_Q), ("decode", 10**9)):
        monkeypatch.setattr(_chunked_prefill, "MIN_SEQLEN_Q", threshold)
        decode._LAUNCHES.clear()
        _api._kvcache_launches.clear()
        ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
        out, lse = cuflash.attention_with_kvcache(cp.asarray(q), ck, cv, cp.asarray(k), cp.asarray(v), **args)
        kinds = {type(launch).__name__ for launch in decode._LAUNCHES.values()}
        assert kinds == {"ChunkedPrefillLaunch" if path == "prefill" else "DecodeLaunch"}, kinds
        results[path] = (as_float32(cp, out), lse, ck, cv)
    (o1, l1, k1, v1), (o2, l2, k2, v2) = results["prefill"], results["decode"]
    assert float(cp.abs(o1 - o2).max()) < 2e-2
    assert float(cp.abs(l1 - l2).max()) < 1e-3
    assert cp.array_equal(k1.view(cp.uint16), k2.view(cp.uint16)) and cp.array_equal(v1.view(cp.uint16),
                                                                                      v2.view(cp.uint16))
    decode._LAUNCHES.clear()
    _api._kvcache_launches.clear()


# [prefill append] fixed lengths for the fused form: (batch, heads_q, heads_kv, d, new tokens (= query rows), capacity,
# cache_seqlens, options). "edges": a cache of 0, of a whole number of 128-key tiles, of less than a tile; "short-new":
# fewer new tokens than the rest of the straddling tile; "window-skips": query tiles whose window starts past the
# straddling tile; "d64-long": d 64's 192-row tile (2100 query rows, not causal), GQA 4, several query tiles;
# "no-room": a sequence whose length leaves no room (NaN rows, nothing appended).
FUSED_PREFILL_CASES = {
    "edges": (3, 8, 2, 128, 96, 1000, [0, 256, 100], dict(causal=True)),
    "short-new": (2, 8, 2, 64, 64, 1000, [130, 250], dict(causal=True)),
    "window-skips": (1, 8, 2, 128, 400, 1400, [900], dict(causal=True, window_size=(32, 0))),
    "d64-long": (1, 16, 4, 64, 2100, 3000, [500], dict()),
    "no-room": (3, 8, 2, 128, 200, 1000, [300, 900, 0], dict(causal=True)),
}


@pytest.mark.parametrize("label", [label for label in CASES if label.startswith("prefill")] + list(FUSED_PREFILL_CASES))
def test_chunked_prefill_with_the_append_fused_matches_two_launches(requires_gpu, monkeypatch, label):
    """[prefill append] The append fused into the TMA forward (decode.FUSED_PREFILL_APPEND: one launch a step) gives
    the two launches' output and lse bit for bit and leaves the caches bit for bit as they leave them: the chunked
    prefill cases (GQA, rotary, a window, ALiBi, softcap; d 64 and 128; a call that appends nothing runs as before)
    and FUSED_PREFILL_CASES' fixed lengths."""
    from cuflash._cuda import decode

    cp = requires_gpu
    if label in FUSED_PREFILL_CASES:
        batch, hq, hkv, d, new, cap, lengths, opts = FUSED_PREFILL_CASES[label]
        rng = np.random.default_rng(len(label))
        q, k_cache, v_cache, k, v, seqlens, _ = _case(rng, batch=batch, heads_q=hq, heads_kv=hkv, d=d, seqlen_q=new,
                                                      seqlen_new=new, capacity=cap, page_size=None,
                                                      dtype=DTYPES["bfloat16"])
        seqlens[:] = lengths
        extra = dict(cache_seqlens=seqlens, return_lse=True, **opts)
    else:
        q, k_cache, v_cache, k, v, extra, _, _ = _call_of(label, "bfloat16", None)
        extra.pop("block_table")
    dev = {name: (cp.asarray(val) if isinstance(val, np.ndarray) else val) for name, val in extra.items()}
    results, kinds = {}, {}
    for fused in (False, True):
        _switch(monkeypatch, "FUSED_PREFILL_APPEND", fused)
        ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
        poison(cp)
        out, lse = cuflash.attention_with_kvcache(cp.asarray(q), ck, cv, None if k is None else cp.asarray(k),
                                                 None if v is None else cp.asarray(v), **dev)
        kinds[fused] = {getattr(launch, "_fused_append", None) for launch in decode._LAUNCHES.values()}
        results[fused] = [cp.asnumpy(x) for x in (out.view(cp.uint16), lse, ck.view(cp.uint16), cv.view(cp.uint16))]
    assert kinds[False] == {False} and kinds[True] == {k is not None}, kinds
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), results[True], results[False]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    if label == "no-room":
        assert np.isnan(results[True][1][1]).all() and np.isfinite(results[True][1][[0, 2]]).all()
    decode._LAUNCHES.clear()
    _api._kvcache_launches.clear()


def test_chunked_prefill_writes_an_out_of_other_strides(requires_gpu):
    """Chunked prefill given an ``out=`` that is not C-contiguous (a view into a wider buffer): the result lands in
    it, bit for bit what a call without ``out`` returns, and nothing else of the buffer changes."""
    cp = requires_gpu
    rng = np.random.default_rng(5)
    dtype = DTYPES["bfloat16"]
    q, k_cache, v_cache, k, v, seqlens, _ = _case(rng, batch=2, heads_q=8, heads_kv=2, d=64, seqlen_q=100,
                                                  seqlen_new=100, capacity=700, page_size=None, dtype=dtype)
    args = dict(cache_seqlens=cp.asarray(seqlens), causal=True)
    want = cuflash.attention_with_kvcache(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(k),
                                         cp.asarray(v), **args)
    wide = cp.full((2, 100, 8, 80), 7, dtype=dtype)
    out = wide[..., 8:72]
    got = cuflash.attention_with_kvcache(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(k),
                                        cp.asarray(v), out=out, **args)
    assert got is out
    assert cp.array_equal(out.view(cp.uint16), want.view(cp.uint16))
    assert bool((wide[..., :8] == 7).all()) and bool((wide[..., 72:] == 7).all())


CASCADE_CASES = {  # label: (batch, heads_q, heads_kv, d, seqlen_q, prefix, capacity, page_size, options)
    "decode-gqa4-chunks4": (16, 16, 4, 128, 1, 2048, 301, None, dict(causal=True, prefix_splits=4)),
    "paged16-softcap-auto": (8, 8, 2, 64, 1, 4096, 400, 16, dict(causal=True, softcap=30.0)),
    "spec3-mha-d96": (4, 4, 4, 96, 3, 512, 200, None, dict(causal=True, prefix_splits=2)),
    "chunked-prefill-suffix": (2, 8, 2, 128, 80, 1024, 600, None, dict(causal=True)),
}


@pytest.mark.parametrize("label", list(CASCADE_CASES))
@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
def test_cascade_attention_on_the_gpu(requires_gpu, label, dtname):
    """cuflash.cascade_attention on CuPy (its planned launches: pack, the forward over the prefix chunks, the decode
    call over each suffix with the append, the merge) against the same call on NumPy in float64 (the truth),
    within the error budget of the NumPy call in the same dtype; the caches appended as the reference appends them.
    Suffix lengths from 0 to full; a second call with new arrays of the same layouts runs the same launch."""
    from cuflash._ops import api as _api

    cp = requires_gpu
    dtype = DTYPES[dtname]
    batch, hq, hkv, d, sq, prefix, cap, page, opts = CASCADE_CASES[label]
    rng = np.random.default_rng(sum(map(ord, label)) + len(dtname))
    q = rng.standard_normal((batch, sq, hq, d)).astype(dtype)
    k_prefix, v_prefix = (rng.standard_normal((prefix, hkv, d)).astype(dtype) for _ in range(2))
    _, k_cache, v_cache, k, v, lens, table = _case(rng, batch=batch, heads_q=hq, heads_kv=hkv, d=d, seqlen_q=sq,
                                                   seqlen_new=sq, capacity=cap, page_size=page, dtype=dtype)
    lens[0], lens[-1] = 0, cap - sq
    extra = dict(cache_seqlens=lens, block_table=table, return_lse=True, **opts)

    def host(x):
        return np.array(x, dtype=np.float64)

    out_t, lse_t = cuflash.cascade_attention(*map(host, (q, k_prefix, v_prefix, k_cache, v_cache, k, v)), **extra)
    kn, vn = k_cache.copy(), v_cache.copy()
    out_n, _ = cuflash.cascade_attention(q, k_prefix, v_prefix, kn, vn, k, v, **extra)
    dev = {name: (cp.asarray(val) if isinstance(val, np.ndarray) else val) for name, val in extra.items()}
    _api._cascade_launches.clear()
    for call in range(2):
        ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
        poison(cp)
        out, lse = cuflash.cascade_attention(*map(cp.asarray, (q, k_prefix, v_prefix)), ck, cv, cp.asarray(k),
                                             cp.asarray(v), **dev)
        assert len(_api._cascade_launches) == 1, call  # planned, and the second call found the plan
        assert_within_budget(cp.asnumpy(out), out_t, out_n, 2, rounding_floor(out_t, dtype), "out")
        np.testing.assert_allclose(cp.asnumpy(lse), lse_t, rtol=0, atol=2e-3)
        assert np.array_equal(cp.asnumpy(ck).view(np.uint16), kn.view(np.uint16))
        assert np.array_equal(cp.asnumpy(cv).view(np.uint16), vn.view(np.uint16))


def test_cascade_attention_guards_lengths_on_the_gpu(requires_gpu):
    """A suffix length out of range (no room for the appended token), left on the device: that sequence's rows of
    out and lse are NaN after the merge, the others' as the truth's, and it appends nothing."""
    cp = requires_gpu
    dtype = DTYPES["bfloat16"]
    rng = np.random.default_rng(3)
    batch, hq, hkv, d, prefix, cap = 3, 8, 2, 64, 1024, 200
    q = rng.standard_normal((batch, 1, hq, d)).astype(dtype)
    k_prefix, v_prefix = (rng.standard_normal((prefix, hkv, d)).astype(dtype) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((batch, cap, hkv, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((batch, 1, hkv, d)).astype(dtype) for _ in range(2))
    lens = np.array([50, cap, 120], np.int32)
    ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
    out, lse = cuflash.cascade_attention(*map(cp.asarray, (q, k_prefix, v_prefix)), ck, cv, cp.asarray(k),
                                         cp.asarray(v), cache_seqlens=cp.asarray(lens), causal=True, return_lse=True)
    out, lse = as_float32(cp, out).get(), lse.get()
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
    good = np.array([0, 2])
    lens64 = lens[good]
    kt, vt = k_cache[good].astype(np.float64), v_cache[good].astype(np.float64)
    out_t, lse_t = cuflash.cascade_attention(q[good].astype(np.float64), k_prefix.astype(np.float64),
                                             v_prefix.astype(np.float64), kt, vt, k[good].astype(np.float64),
                                             v[good].astype(np.float64), cache_seqlens=lens64, causal=True,
                                             return_lse=True)
    np.testing.assert_allclose(out[good], out_t, rtol=0, atol=2e-2)
    np.testing.assert_allclose(lse[good], lse_t, rtol=0, atol=2e-3)
    assert np.array_equal(cp.asnumpy(ck)[1].view(np.uint16), k_cache[1].view(np.uint16))


def _with_and_without(monkeypatch, switch: str, run) -> dict:
    """{True: run(), False: run()} with the launcher's ``switch`` (cuflash._cuda.spec) on, then off: the decode
    launches remembered by the launcher and the front door forgotten before each and after both."""
    from cuflash._cuda import decode, spec

    results = {}
    for on in (True, False):
        monkeypatch.setattr(spec, switch, on)
        decode._LAUNCHES.clear()
        _api._kvcache_launches.clear()
        results[on] = run()
    decode._LAUNCHES.clear()
    _api._kvcache_launches.clear()
    return results


@pytest.mark.parametrize("paged, seqlen_q, heads_q, num_splits", [(True, 1, 128, 0), (False, 2, 16, 3),
                                                                    (True, 3, 40, 1)])
def test_mla_wgmma_kernel_matches_the_mma_sync_kernel(requires_gpu, monkeypatch, paged, seqlen_q, heads_q,
                                                      num_splits):
    """On sm_90 MLA decoding runs flash_decode_mla_sm90_kernel (wgmma); with SM90A_DECODE off the mma.sync kernel
    runs the same call. Both give the same output within bfloat16 rounding and the same lse; both append the same
    bits. (Each is checked against the float64 truth by test_decode_against_the_truth's MLA cases.)"""
    from cuflash._cuda import compile as cuda_compile

    cp = requires_gpu
    if cuda_compile.device_info()[0] != 90:
        pytest.skip("the wgmma MLA kernel runs on sm_90")
    rng = np.random.default_rng(heads_q + seqlen_q)
    q, k_cache, _, k, v, seqlens, table = _case(rng, batch=3, heads_q=heads_q, heads_kv=1, d=576, seqlen_q=seqlen_q,
                                                seqlen_new=seqlen_q, capacity=1000, page_size=64 if paged else None,
                                                dtype=DTYPES["bfloat16"], dv=512)
    call = dict(cache_seqlens=cp.asarray(seqlens), block_table=None if table is None else cp.asarray(table),
                causal=True, softmax_scale=1 / np.sqrt(192), num_splits=num_splits, return_lse=True)
    def run():
        kc = cp.asarray(k_cache)
        out, lse = cuflash.attention_with_kvcache(cp.asarray(q), kc, kc[..., :512], cp.asarray(k), cp.asarray(v),
                                                  **call)
        return as_float32(cp, out), lse, kc

    results = _with_and_without(monkeypatch, "SM90A_DECODE", run)
    assert any("flash_decode_mla_sm90_kernel" in key[3] for key in cuda_compile._modules)
    (o1, l1, k1), (o2, l2, k2) = results[True], results[False]
    assert float(cp.abs(o1 - o2).max()) < 2e-2
    assert float(cp.abs(l1 - l2).max()) < 1e-3
    assert cp.array_equal(k1.view(cp.uint16), k2.view(cp.uint16))


@pytest.mark.parametrize("page_size, seqlen_q, num_splits", [(64, 1, 0), (128, 2, 3), (None, 1, 2)])
def test_mla_tma_tiles_match_the_cp_async_tiles(requires_gpu, monkeypatch, page_size, seqlen_q, num_splits):
    """Without appended tokens the sm_90 MLA kernel copies its key tiles with TMA (TMA_DECODE), which reads a last
    tile's rows past the sequence's end as the cache holds them: NaN here, which the kernel must zero in V before
    P V. The same call with cp.async copies (TMA_DECODE off) gives the same output and lse."""
    from cuflash._cuda import compile as cuda_compile

    cp = requires_gpu
    if cuda_compile.device_info()[0] != 90:
        pytest.skip("the wgmma MLA kernel runs on sm_90")
    rng = np.random.default_rng(seqlen_q + (page_size or 0))
    q, k_cache, _, _, _, seqlens, table = _case(rng, batch=3, heads_q=64, heads_kv=1, d=576, seqlen_q=seqlen_q,
                                                seqlen_new=0, capacity=700, page_size=page_size,
                                                dtype=DTYPES["bfloat16"], dv=512)
    seqlens[1] = 130  # (a last tile of 2 keys)
    for b, n in enumerate(seqlens):  # NaN in every slot past each sequence's length
        if table is None:
            k_cache[b, n:] = np.nan
        else:
            for slot in range(n, 700):
                k_cache[table[b, slot // page_size], slot % page_size] = np.nan
    kc = cp.asarray(k_cache)
    call = dict(cache_seqlens=cp.asarray(seqlens), block_table=None if table is None else cp.asarray(table),
                causal=True, softmax_scale=1 / np.sqrt(192), num_splits=num_splits, return_lse=True)
    def run():
        out, lse = cuflash.attention_with_kvcache(cp.asarray(q), kc, kc[..., :512], **call)
        return as_float32(cp, out), lse

    results = _with_and_without(monkeypatch, "TMA_DECODE", run)
    (o1, l1), (o2, l2) = results[True], results[False]
    assert bool(cp.isfinite(o1).all()) and bool(cp.isfinite(l1).all())
    assert float(cp.abs(o1 - o2).max()) < 2e-2
    assert float(cp.abs(l1 - l2).max()) < 1e-3


def test_mla_needs_v_as_a_view_of_k(requires_gpu):
    """MLA on the GPU reads V from the K tiles: a v_cache of its own is refused before anything is written, and so
    is a later step of the same layouts whose v_cache is not k_cache's view."""
    cp = requires_gpu
    rng = np.random.default_rng(12)
    q, k_cache, v_cache, k, v, seqlens, table = _case(rng, batch=1, heads_q=16, heads_kv=1, d=576, seqlen_q=1,
                                                     seqlen_new=1, capacity=128, page_size=64,
                                                     dtype=DTYPES["bfloat16"], dv=512)
    ck = cp.asarray(k_cache)
    before = ck.copy()
    args = dict(cache_seqlens=cp.asarray(seqlens), block_table=cp.asarray(table), softmax_scale=0.07)
    with pytest.raises(NotImplementedError, match=r"pass v_cache = k_cache\[\.\.\., :512\]"):
        cuflash.attention_with_kvcache(cp.asarray(q), ck, cp.asarray(v_cache), cp.asarray(k), cp.asarray(v), **args)
    assert cp.array_equal(ck.view(cp.uint16), before.view(cp.uint16))
    cuflash.attention_with_kvcache(cp.asarray(q), ck, ck[..., :512], cp.asarray(k), cp.asarray(v), **args)
    other = cp.asarray(k_cache)  # the same layout, but v_cache from another array
    with pytest.raises(NotImplementedError, match="v_cache must be k_cache"):
        cuflash.attention_with_kvcache(cp.asarray(q), ck, other[..., :512], cp.asarray(k), cp.asarray(v), **args)


def test_splits_agree(requires_gpu):
    """The same call with 1 and with many splits (the merge is exact up to rounding)."""
    cp = requires_gpu
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, _, _, seqlens, table = _case(rng, batch=2, heads_q=8, heads_kv=2, d=128, seqlen_q=1,
                                                     seqlen_new=0, capacity=3000, page_size=32,
                                                     dtype=DTYPES["bfloat16"])
    args = [cp.asarray(x) for x in (q, k_cache, v_cache)]
    outs = [cuflash.attention_with_kvcache(*args, cache_seqlens=cp.asarray(seqlens), block_table=cp.asarray(table),
                                           num_splits=s).astype(cp.float32) for s in (1, 5, 40)]
    for o in outs[1:]:
        assert float(cp.abs(o - outs[0]).max()) < 2e-2


def test_zero_sized_calls(requires_gpu):
    """No query token (the new keys are still appended) and no sequence: nothing to launch, nothing wrong."""
    cp = requires_gpu
    rng = np.random.default_rng(9)
    q, k_cache, v_cache, k, v, seqlens, _ = _case(rng, batch=2, heads_q=4, heads_kv=2, d=64, seqlen_q=1,
                                                  seqlen_new=1, capacity=50, page_size=None, dtype=DTYPES["bfloat16"])
    ck = cp.asarray(k_cache)
    out, lse = cuflash.attention_with_kvcache(cp.asarray(q[:, :0]), ck, cp.asarray(v_cache), cp.asarray(k),
                                             cp.asarray(v), cache_seqlens=cp.asarray(seqlens), return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    kn = k_cache.copy()
    cuflash.attention_with_kvcache(q[:, :0], kn, v_cache.copy(), k, v, cache_seqlens=seqlens)
    assert np.array_equal(cp.asnumpy(ck).view(np.uint16), kn.view(np.uint16))  # the append happened


# ---------------------------------------------------------------------------------------------------
# [decode guard]: device index values out of range give NaN rows, never an access out of bounds
# ---------------------------------------------------------------------------------------------------

# label: (batch, heads_q, heads_kv, d, seqlen_q, seqlen_new, capacity, page_size, options, sequence 1's broken value:
# ("seqlens" | "leftpad" | "batch_idx", value) or ("page", column of block_table or "append", value)). Huge values
# would fault (an illegal address) if a kernel used them.
GUARD_CASES = {
    "seqlens-negative": (3, 8, 2, 128, 1, 1, 700, None, dict(causal=True), ("seqlens", -5)),
    "seqlens-no-room-splits": (3, 8, 2, 128, 1, 1, 4096, None, dict(causal=True, num_splits=8), ("seqlens", 4096)),
    "seqlens-huge-paged5-spec2": (3, 8, 2, 64, 2, 2, 333, 5, dict(causal=True), ("seqlens", 2**31 - 1)),
    "leftpad-past-seqlens": (3, 8, 2, 64, 1, 1, 300, None, dict(causal=True, leftpad=True), ("leftpad", 10**6)),
    "leftpad-negative-paged16": (3, 8, 2, 64, 1, 1, 300, 16, dict(leftpad=True), ("leftpad", -1)),
    "batch-idx-huge": (3, 8, 2, 96, 1, 1, 300, None, dict(batch_idx=True), ("batch_idx", 1 << 30)),
    "batch-idx-negative": (3, 8, 2, 32, 1, 1, 300, None, dict(batch_idx=True), ("batch_idx", -1)),
    "page-huge-first": (3, 8, 2, 128, 1, 1, 700, 16, dict(causal=True), ("page", 0, 1 << 30)),
    "page-negative-splits": (3, 8, 2, 128, 1, 1, 4096, 16, dict(causal=True, num_splits=8), ("page", 3, -7)),
    "page-huge-appended-slot-page1": (3, 8, 8, 64, 1, 1, 200, 1, dict(causal=True), ("page", "append", 1 << 30)),
    "d256-page-huge": (3, 16, 2, 256, 1, 1, 700, 16, dict(causal=True), ("page", 0, 1 << 30)),
    "d256-seqlens-negative-spec3": (3, 8, 4, 256, 3, 3, 300, None, dict(causal=True), ("seqlens", -1)),
    "mla-page-huge": (3, 16, 1, 576, 1, 1, 300, 64, dict(causal=True, mla=512), ("page", 1, 1 << 30)),
    "mla-seqlens-no-room-splits": (3, 16, 1, 576, 1, 1, 1000, 64, dict(causal=True, mla=512, num_splits=4),
                                   ("seqlens", 1024)),  # 16 pages of 64: capacity 1024
    # chunked prefill (the forward kernels over the cache): its guards are CuPy array operations
    "prefill-seqlens-no-room": (3, 8, 2, 64, 64, 64, 400, None, dict(causal=True), ("seqlens", 400)),
}


@pytest.mark.parametrize("label", list(GUARD_CASES))
@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
def test_device_values_out_of_range_give_nan_rows(requires_gpu, monkeypatch, label, dtname):
    """Sequence 1 of 3 with an index value out of range, left on the device (no debug mode): a plan's step
    completes without a device error, writes NaN into that sequence's rows of out and lse (both poisoned with a
    finite 7.0 first), gives the other sequences what the float64 reference gives, and leaves the caches as the
    reference's mirror of the guards leaves them (bit for bit: the broken sequence appends nothing, or nothing
    where its page is out of range). A valid step runs afterwards (the context is healthy)."""
    from cuflash.reference import decode as reference_decode

    cp = requires_gpu
    monkeypatch.delenv("CUFLASH_CHECK_DEVICE_VALUES", raising=False)
    batch, hq, hkv, d, sq, snew, cap, page, opts, (what, *where) = GUARD_CASES[label]
    opts = dict(opts)
    dv = opts.pop("mla", None)
    dtype = DTYPES[dtname]
    rng = np.random.default_rng(sum(map(ord, label)) + len(dtname))
    q, k_cache, v_cache, k, v, seqlens, table = _case(rng, batch=batch, heads_q=hq, heads_kv=hkv, d=d, seqlen_q=sq,
                                                     seqlen_new=snew, capacity=cap, page_size=page, dtype=dtype, dv=dv)
    seqlens[:] = [cap - snew, cap // 2, cap // 3]
    call = dict(causal=opts.get("causal", False), num_splits=opts.get("num_splits", 0))
    if dv is not None:
        call["softmax_scale"] = 1 / np.sqrt(192)
    if opts.get("leftpad"):
        call["cache_leftpad"] = np.array([0, 5, 1], np.int32)
    if opts.get("batch_idx"):  # two spare rows
        k_cache, v_cache = (np.concatenate([x, x[:2]]) for x in (k_cache, v_cache))
        call["cache_batch_idx"] = rng.permutation(batch + 2)[:batch].astype(np.int32)
    if table is not None:
        call["block_table"] = table

    def caches(copy):  # a copy of both caches (MLA: v_cache a view of the copy of k_cache)
        kc = copy(k_cache)
        return (kc, kc[..., :dv]) if dv is not None else (kc, copy(v_cache))

    # the reference's KVCache of the valid call, then sequence 1's value broken
    normalized = dict(rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_batch_idx=None,
                      cache_leftpad=None, block_table=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, softmax_scale=None, num_splits=0, out=None)
    kn, vn = caches(np.copy)
    _, _, cache, scale, variant = _api._kvcache_call(q, kn, vn, k, v, cache_seqlens=seqlens,
                                                     **{**normalized, **call})
    field = {"seqlens": "cache_seqlens", "leftpad": "cache_leftpad", "batch_idx": "cache_batch_idx",
             "page": "block_table"}[what]
    values = getattr(cache, field).copy()
    if what == "page":
        column = seqlens[1] // page if where[0] == "append" else where[0]
        values[1, column] = where[1]
    else:
        values[1] = where[0]
    broken = dataclasses.replace(cache, **{field: values})
    k64, v64 = caches(lambda x: np.array(x, dtype=np.float64))
    out_t, lse_t = reference_decode.forward_kvcache(q.astype(np.float64), k64, v64, k.astype(np.float64),
                                                    v.astype(np.float64), cache=broken, scale=scale, variant=variant)
    out_n, _ = reference_decode.forward_kvcache(q, kn, vn, k, v, cache=broken, scale=scale, variant=variant)

    dev = {name: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for name, x in call.items()}
    dev[field] = cp.asarray(values)
    lens = dev.pop("cache_seqlens", cp.asarray(seqlens))
    ck, cv = caches(cp.asarray)
    cq, ck_new, cv_new = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    seven = 0x40E0 if dtname == "bfloat16" else 0x4700
    out = cp.full((batch, sq, hq, dv or d), seven, dtype=cp.uint16).view(dtype)
    lse = cp.full((batch, hq, sq), 7.0, dtype=cp.float32)
    plan = cuflash.plan_kvcache(cq, ck, cv, ck_new, cv_new, cache_seqlens=lens, out=out, **dev)
    plan.run(cq, ck, cv, ck_new, cv_new, cache_seqlens=lens, out=out, lse=lse,
             **{name: dev[name] for name in ("cache_leftpad", "cache_batch_idx", "block_table") if name in dev})
    cp.cuda.Device().synchronize()  # an access out of bounds would surface here (an illegal address)
    out_h, lse_h = cp.asnumpy(as_float32(cp, out)), cp.asnumpy(lse)
    assert np.isnan(out_h[1]).all() and np.isnan(lse_h[1]).all(), "the broken sequence's rows are not NaN"
    good = [0, 2]
    assert not np.isnan(out_h[good]).any() and not np.isnan(lse_h[good]).any()
    assert_within_budget(cp.asnumpy(out)[good], out_t[good], out_n[good], 2, rounding_floor(out_t[good], dtype), "out")
    np.testing.assert_allclose(lse_h[good], lse_t[good], rtol=0, atol=2e-3)
    assert np.array_equal(cp.asnumpy(ck).view(np.uint16), kn.view(np.uint16))
    assert np.array_equal(cp.asnumpy(cv).view(np.uint16), vn.view(np.uint16))
    # the context is healthy: the same plan with valid values
    dev.update({name: cp.asarray(x) for name, x in call.items() if isinstance(x, np.ndarray)})
    plan.run(cq, ck, cv, ck_new, cv_new, cache_seqlens=cp.asarray(seqlens), out=out, lse=lse,
             **{name: dev[name] for name in ("cache_leftpad", "cache_batch_idx", "block_table") if name in dev})
    assert not np.isnan(cp.asnumpy(lse)).any()


# ---------------------------------------------------------------------------------------------------
# [decode merge]: the merge kernel by itself
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [32, 96, 128])
@pytest.mark.parametrize("splits", [2, 7, 40])
def test_merge_kernel_against_merge_stacked(requires_gpu, dtname, d, splits):
    """Random partials with empty parts (lse -inf) and rows whose parts are all empty, into a NaN-poisoned out
    with the strides of a (batch, heads, seqlen, d) array seen as (batch, seqlen, heads, d)."""
    from cuflash._cuda.decode import merge_partials
    from cuflash._ops.merge import merge_stacked

    cp = requires_gpu
    dtype = DTYPES[dtname]
    rng = np.random.default_rng(splits * 1000 + d)
    batch, heads, seqlen_q = 3, 5, 2
    o_parts = rng.standard_normal((splits, batch, heads, seqlen_q, d)).astype(np.float32)
    lse_parts = rng.uniform(-30, 30, (splits, batch, heads, seqlen_q)).astype(np.float32)
    lse_parts[rng.random(lse_parts.shape) < 0.3] = -np.inf   # empty parts
    lse_parts[:, 1, 2, :] = -np.inf                           # rows that saw no key at all
    lse_parts[:, 2, 0, 1] = -np.inf
    lse_parts[0, 0, 0, 0], lse_parts[1:, 0, 0, 0] = 80.0, -np.inf  # one part only, large
    o_want, lse_want = merge_stacked(o_parts, lse_parts, np)  # (batch, heads, seqlen_q, d), (batch, heads, seqlen_q)

    nan_bits = 0x7FC0 if dtname == "bfloat16" else 0x7E00
    out = cp.full((batch, heads, seqlen_q, d), nan_bits, dtype=cp.uint16).view(dtype).transpose(0, 2, 1, 3)
    lse = cp.full((batch, heads, seqlen_q), np.nan, dtype=np.float32)
    merge_partials(cp.asarray(o_parts), cp.asarray(lse_parts), out, lse)
    got = cp.asnumpy(as_float32(cp, out)).transpose(0, 2, 1, 3)
    assert not np.isnan(got).any(), "unwritten (NaN) output"
    # the kernel's float32 sums in another order: at most one rounding step of the output dtype apart
    want = o_want.astype(dtype).astype(np.float32)
    ulp = 2.0 ** (-7 if dtname == "bfloat16" else -10)
    np.testing.assert_allclose(got, want, rtol=ulp, atol=1e-6)
    assert (got[1, 2] == 0).all() and (got[2, 0, 1] == 0).all()
    lse_h = cp.asnumpy(lse)
    assert np.array_equal(np.isneginf(lse_h), np.isneginf(lse_want))
    np.testing.assert_allclose(lse_h, lse_want, rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Plans: several steps, CUDA graphs, the front door's memory of checked calls
# ---------------------------------------------------------------------------------------------------


def _steps_case(rng, dtype, *, paged: bool, batch=3, heads_q=8, heads_kv=2, d=64, capacity=300, seqlen_q=1):
    page = 16 if paged else None
    q, k_cache, v_cache, _, _, seqlens, table = _case(rng, batch=batch, heads_q=heads_q, heads_kv=heads_kv, d=d,
                                                     seqlen_q=seqlen_q, seqlen_new=seqlen_q, capacity=capacity,
                                                     page_size=page, dtype=dtype)
    seqlens = np.minimum(seqlens, capacity - 8 * seqlen_q).astype(np.int32)  # room for the steps' appends
    return q, k_cache, v_cache, seqlens, table


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_plan_runs_steps_against_the_truth(requires_gpu, paged, num_splits):
    """A plan made at the first step runs five steps, each appending one token and reading the lengths the
    previous step's caller advanced on the device; out and lse preallocated and poisoned before each step."""
    cp = requires_gpu
    dtype = DTYPES["bfloat16"]
    rng = np.random.default_rng(21 + paged)
    q, k_cache, v_cache, seqlens, table = _steps_case(rng, dtype, paged=paged)
    batch, _, heads_q, d = q.shape
    heads_kv = k_cache.shape[2]
    opts = dict(block_table=table, causal=True, num_splits=num_splits)
    dev = {name: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for name, x in opts.items()}
    ck, cv, lens = cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(seqlens)
    k64, v64, kn, vn = k_cache.astype(np.float64), v_cache.astype(np.float64), k_cache.copy(), v_cache.copy()
    cq = cp.asarray(q)
    ck_new = cp.asarray(rng.standard_normal((batch, 1, heads_kv, d)).astype(dtype))
    cv_new = cp.asarray(rng.standard_normal((batch, 1, heads_kv, d)).astype(dtype))
    out = cp.empty((batch, 1, heads_q, d), dtype=dtype)
    lse = cp.empty((batch, heads_q, 1), dtype=cp.float32)
    plan = cuflash.plan_kvcache(cq, ck, cv, ck_new, cv_new, cache_seqlens=lens, out=out, **dev)
    assert plan.out_shape == out.shape and plan.num_splits >= 1
    for step in range(5):
        qs = rng.standard_normal(q.shape).astype(dtype)
        ks, vs = (rng.standard_normal((batch, 1, heads_kv, d)).astype(dtype) for _ in range(2))
        cq[...], ck_new[...], cv_new[...] = cp.asarray(qs), cp.asarray(ks), cp.asarray(vs)  # static input buffers
        out.view(cp.uint16).fill(0x7FC0)  # NaN in bfloat16
        lse.fill(np.nan)
        got_out, got_lse = plan.run(cq, ck, cv, ck_new, cv_new, cache_seqlens=lens, out=out, lse=lse, **{
            name: dev[name] for name in ("block_table",)})
        assert got_out is out and got_lse is lse
        lens_h = seqlens + step
        out_t, lse_t = cuflash.attention_with_kvcache(qs.astype(np.float64), k64, v64, ks.astype(np.float64),
                                                     vs.astype(np.float64), cache_seqlens=lens_h, return_lse=True,
                                                     **opts)
        out_n = cuflash.attention_with_kvcache(qs, kn, vn, ks, vs, cache_seqlens=lens_h, **opts)
        out_h = cp.asnumpy(out)
        assert not np.isnan(out_h.astype(np.float32)).any(), f"step {step}: unwritten (NaN) output"
        assert_within_budget(out_h, out_t, out_n, 2, rounding_floor(out_t, dtype), f"out, step {step}")
        np.testing.assert_allclose(cp.asnumpy(lse), lse_t, rtol=0, atol=2e-3)
        lens += 1  # the caller advances the lengths, on the device
    assert np.array_equal(cp.asnumpy(ck).view(np.uint16), kn.view(np.uint16))
    assert np.array_equal(cp.asnumpy(cv).view(np.uint16), vn.view(np.uint16))


def test_plan_refuses_arrays_of_another_layout(requires_gpu):
    cp = requires_gpu
    dtype = DTYPES["float16"]
    rng = np.random.default_rng(2)
    q, k_cache, v_cache, seqlens, _ = _steps_case(rng, dtype, paged=False)
    cq, ck, cv, lens = (cp.asarray(x) for x in (q, k_cache, v_cache, seqlens))
    plan = cuflash.plan_kvcache(cq, ck, cv, cache_seqlens=lens)
    with pytest.raises(ValueError, match="q must be a cupy.ndarray of shape"):
        plan.run(cq[:2], ck, cv, cache_seqlens=lens)
    with pytest.raises(ValueError, match="block_table was not given when the plan was made"):
        plan.run(cq, ck, cv, cache_seqlens=lens, block_table=cp.zeros((3, 2), cp.int32))
    with pytest.raises(ValueError, match="lse must be"):
        plan.run(cq, ck, cv, cache_seqlens=lens, lse=cp.empty((3, 1, 8), cp.float32))
    with pytest.raises(NotImplementedError, match="softmax_scale > 0"):
        cuflash.plan_kvcache(cq, ck, cv, cache_seqlens=lens, softmax_scale=-1.0)
    # the same shape and strides at a base 2 bytes past a multiple of 16: refused at each step, before any launch
    wide = cp.zeros(q.shape[:3] + (q.shape[3] + 8,), dtype=cq.dtype)
    plan = cuflash.plan_kvcache(wide[..., :64], ck, cv, cache_seqlens=lens)
    misaligned = "q: the kernels read 16-byte rows; its base address must be a multiple of 16 bytes"
    with pytest.raises(NotImplementedError, match=misaligned):
        plan.run(wide[..., 1:65], ck, cv, cache_seqlens=lens)
    cuflash.attention_with_kvcache(wide[..., :64], ck, cv, cache_seqlens=lens)  # remembered
    with pytest.raises(NotImplementedError, match=misaligned):
        cuflash.attention_with_kvcache(wide[..., 1:65], ck, cv, cache_seqlens=lens)


def test_plan_checks_device_values_in_the_debug_mode(requires_gpu, monkeypatch):
    cp = requires_gpu
    rng = np.random.default_rng(4)
    q, k_cache, v_cache, seqlens, _ = _steps_case(rng, DTYPES["float16"], paged=False)
    cq, ck, cv, lens = (cp.asarray(x) for x in (q, k_cache, v_cache, seqlens))
    monkeypatch.setenv("CUFLASH_CHECK_DEVICE_VALUES", "1")
    plan = cuflash.plan_kvcache(cq, ck, cv, cache_seqlens=lens)
    lens[0] = k_cache.shape[1] + 1
    with pytest.raises(ValueError, match="must fit the cache"):
        plan.run(cq, ck, cv, cache_seqlens=lens)


def _graph_inputs(cp, rng, dtype, *, paged, seqlen_q=1, rotary=False):
    capacity = 600 if seqlen_q == 1 else 2048
    q, k_cache, v_cache, seqlens, table = _steps_case(rng, dtype, paged=paged, batch=2, capacity=capacity,
                                                      seqlen_q=seqlen_q)
    batch, _, heads_q, d = q.shape
    heads_kv = k_cache.shape[2]
    k, v = (rng.standard_normal((batch, seqlen_q, heads_kv, d)).astype(dtype) for _ in range(2))
    # [decode rotary] tables of q's dtype, rotary_dim d / 2, GPT-NeoX pairs
    angles = np.outer(np.arange(capacity + seqlen_q), 1e-2 ** (np.arange(d // 4) / (d // 4)))
    tables = (np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)) if rotary else None

    def fresh():  # one copy of everything a step reads and writes
        return dict(q=cp.asarray(q), k_cache=cp.asarray(k_cache), v_cache=cp.asarray(v_cache), k=cp.asarray(k),
                    v=cp.asarray(v), cache_seqlens=cp.asarray(seqlens),
                    block_table=None if table is None else cp.asarray(table),
                    out=cp.empty((batch, seqlen_q, heads_q, d), dtype=dtype),
                    lse=cp.empty((batch, heads_q, seqlen_q), cp.float32),
                    rotary=None if tables is None else tuple(cp.asarray(t) for t in tables))
    return fresh


def _rotary_args(a) -> dict:
    return {} if a.get("rotary") is None else dict(rotary_cos=a["rotary"][0], rotary_sin=a["rotary"][1],
                                               rotary_interleaved=False)


def _run(plan, a):
    return plan.run(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], cache_seqlens=a["cache_seqlens"],
                    block_table=a["block_table"], out=a["out"], lse=a["lse"],
                    **{name: value for name, value in _rotary_args(a).items() if name != "rotary_interleaved"})


@pytest.mark.parametrize("paged, seqlen_q, rotary", [(False, 1, False), (True, 1, False), (False, 96, False),
                                                     (True, 1, True), (False, 96, True)],
                         ids=["contiguous", "paged16", "chunked-prefill", "paged16-rotary", "chunked-prefill-rotary"])
def test_plan_run_in_a_cupy_graph(requires_gpu, paged, seqlen_q, rotary):
    """plan.run captured by CuPy's stream capture (append, attention, merge; chunked prefill's append, forward and
    guard; [decode rotary]'s kernel before them) and replayed for three steps gives what eager runs give, bit for bit;
    the caller advances the lengths on the device between steps."""
    cp = requires_gpu
    rng = np.random.default_rng(8)
    fresh = _graph_inputs(cp, rng, DTYPES["bfloat16"], paged=paged, seqlen_q=seqlen_q, rotary=rotary)
    eager, captured = fresh(), fresh()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        plan = cuflash.plan_kvcache(eager["q"], eager["k_cache"], eager["v_cache"], eager["k"], eager["v"],
                                    cache_seqlens=eager["cache_seqlens"], block_table=eager["block_table"],
                                    causal=True, out=eager["out"], **_rotary_args(eager))
        # batch 2 x 2 heads: the split kernel merges (its counters reset each replay); chunked prefill's forward
        assert plan.num_splits > 1 or seqlen_q > 1
        assert (type(plan._runner.__self__).__name__ == "ChunkedPrefillLaunch") == (seqlen_q > 1)
        assert (plan._runner.__self__._rotary_step is not None) == rotary
        graph_plan = cuflash.plan_kvcache(captured["q"], captured["k_cache"], captured["v_cache"], captured["k"],
                                          captured["v"], cache_seqlens=captured["cache_seqlens"],
                                          block_table=captured["block_table"], causal=True, out=captured["out"],
                                          **_rotary_args(captured))
        _run(graph_plan, fresh())  # a first eager run on this thread (the context), outside the capture
        stream.synchronize()
        stream.begin_capture()
        _run(graph_plan, captured)
        graph = stream.end_capture()
        for step in range(3):
            for a in (eager, captured):
                a["out"].view(cp.uint16).fill(0x7FC0)
                a["lse"].fill(np.nan)
            _run(plan, eager)
            graph.launch(stream)
            for name in ("out", "lse", "k_cache", "v_cache"):
                assert cp.array_equal(eager[name].view(cp.uint8), captured[name].view(cp.uint8)), (name, step)
            eager["cache_seqlens"] += seqlen_q
            captured["cache_seqlens"] += seqlen_q
        stream.synchronize()
    assert not np.isnan(cp.asnumpy(eager["lse"])).any()


def test_plan_run_in_a_torch_cuda_graph(requires_gpu):
    """The same with torch.cuda.CUDAGraph: CuPy views of torch tensors, plan.run on torch's capture stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    cp = requires_gpu
    rng = np.random.default_rng(9)
    batch, heads_q, heads_kv, d, capacity = 2, 8, 2, 64, 700
    shapes = dict(q=(batch, 1, heads_q, d), k_cache=(batch, capacity, heads_kv, d), v_cache=(batch, capacity, heads_kv, d),
                  k=(batch, 1, heads_kv, d), v=(batch, 1, heads_kv, d))
    host = {name: rng.standard_normal(shape).astype(np.float16) for name, shape in shapes.items()}
    seqlens = np.array([100, 650], np.int32)

    def fresh():
        t = {name: torch.from_numpy(x).cuda() for name, x in host.items()}
        t["cache_seqlens"] = torch.from_numpy(seqlens).cuda()
        t["out"] = torch.empty(batch, 1, heads_q, d, dtype=torch.float16, device="cuda")
        t["lse"] = torch.empty(batch, heads_q, 1, dtype=torch.float32, device="cuda")
        return t, {"block_table": None, **{name: cp.from_dlpack(x) for name, x in t.items()}}

    (te, eager), (tc, captured) = fresh(), fresh()
    torch.cuda.synchronize()
    plan = cuflash.plan_kvcache(eager["q"], eager["k_cache"], eager["v_cache"], eager["k"], eager["v"],
                                cache_seqlens=eager["cache_seqlens"], causal=True, out=eager["out"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), cp.cuda.ExternalStream(side.cuda_stream):
        _run(plan, fresh()[1])  # warm-up on a side stream, as torch asks before a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _run(plan, captured)
    for step in range(3):
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _run(plan, eager)
        graph.replay()
        torch.cuda.synchronize()
        for name in ("out", "lse", "k_cache", "v_cache"):
            assert torch.equal(te[name], tc[name]), (name, step)
        te["cache_seqlens"] += 1
        tc["cache_seqlens"] += 1
    assert not torch.isnan(te["out"]).any()


def test_the_front_door_reuses_checked_launches(requires_gpu):
    """A repeated call runs the launch of the call it repeats (no new entry); other layouts and options are
    checked in full (an int for causal is still refused after causal=True was remembered)."""
    cp = requires_gpu
    rng = np.random.default_rng(6)
    q, k_cache, v_cache, seqlens, _ = _steps_case(rng, DTYPES["bfloat16"], paged=False)
    cq, ck, cv, lens = (cp.asarray(x) for x in (q, k_cache, v_cache, seqlens))
    _api._kvcache_launches.clear()  # (earlier tests may have filled it: it keeps 64)
    first = cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens, causal=True)
    entries = len(_api._kvcache_launches)
    second = cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens, causal=True)
    assert len(_api._kvcache_launches) == entries
    assert cp.array_equal(first.view(cp.uint16), second.view(cp.uint16))
    # Results dropped at once: each call still allocates its own output (the weak reference of the last call's
    # dead output reads None, as an output not given does; that is no reason to skip the allocation).
    del first
    for _ in range(3):
        again, lse = cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens, causal=True, return_lse=True)
        assert again is not None and lse is not None
        assert cp.array_equal(again.view(cp.uint16), second.view(cp.uint16))
        del again, lse
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens, causal=1)
    with pytest.raises(ValueError, match="cache_seqlens must have shape"):
        cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens[:2], causal=True)
    cuflash.attention_with_kvcache(cq[:, :, :4], ck, cv[..., :], cache_seqlens=lens, causal=True)  # another q
    assert len(_api._kvcache_launches) == entries + 1
    # with out= given, each repeated call allocates its lse, even once the last call's lse has died (it once came
    # back None, and the kernels wrote into the freed memory)
    out = cp.empty_like(second)
    _, lse = cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens, causal=True, return_lse=True, out=out)
    want = cp.asnumpy(lse)
    del lse
    poison(cp)
    _, lse = cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens, causal=True, return_lse=True, out=out)
    assert lse is not None and np.array_equal(cp.asnumpy(lse), want)

