"""The CUDA decode kernels (cuflash._cuda.decode, decode.cu) against the float64 truth of the NumPy reference.

cuflash._cuda does not export forward_kvcache until these pass on a GPU; each test hands it to the front door
with monkeypatch, then compares the kernels' output and the caches they appended to with the NumPy reference's
(float64 inputs for the truth, the kernels' dtype for the budget). Skips without CuPy and a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash

from _gpu_helpers import DTYPES, poison
from _helpers import assert_within_budget, rounding_floor

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu_decode(requires_gpu, monkeypatch):
    from cuflash import _cuda
    from cuflash._cuda import decode

    monkeypatch.setattr(_cuda, "forward_kvcache", decode.forward_kvcache, raising=False)
    return requires_gpu


def _case(rng, *, batch, heads_q, heads_kv, d, seqlen_q, seqlen_new, capacity, page_size, dtype):
    """q, the caches (paged when page_size), the new k, v, cache_seqlens and block_table (NumPy)."""
    q = rng.standard_normal((batch, seqlen_q, heads_q, d)).astype(dtype)
    k = v = None
    if seqlen_new:
        k, v = (rng.standard_normal((batch, seqlen_new, heads_kv, d)).astype(dtype) for _ in range(2))
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
}


@pytest.mark.parametrize("label", list(CASES))
@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
@pytest.mark.parametrize("splits", [None, 1])
def test_decode_against_the_truth(gpu_decode, label, dtname, splits):
    cp = gpu_decode
    batch, hq, hkv, d, sq, snew, cap, page, opts = CASES[label]
    rng = np.random.default_rng(len(label) * 31 + len(dtname))
    dtype = DTYPES[dtname]
    q, k_cache, v_cache, k, v, seqlens, table = _case(rng, batch=batch, heads_q=hq, heads_kv=hkv, d=d, seqlen_q=sq,
                                                     seqlen_new=snew, capacity=cap, page_size=page, dtype=dtype)
    opts = dict(opts)
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

    def host(x):
        return None if x is None else np.array(x, dtype=np.float64)

    # truth (float64) and the same reference in the kernels' dtype, each on its own copy of the caches
    k64, v64 = host(k_cache), host(v_cache)
    out_t, lse_t = cuflash.attention_with_kvcache(host(q), k64, v64, host(k), host(v), **extra)
    kn, vn = k_cache.copy(), v_cache.copy()
    out_n, _ = cuflash.attention_with_kvcache(q, kn, vn, k, v, **extra)

    dev = {name: (cp.asarray(val) if isinstance(val, np.ndarray) else val) for name, val in extra.items()}
    ck, cv = cp.asarray(k_cache), cp.asarray(v_cache)
    poison(cp)
    out, lse = cuflash.attention_with_kvcache(cp.asarray(q), ck, cv, None if k is None else cp.asarray(k),
                                             None if v is None else cp.asarray(v), **dev)
    out_h = cp.asnumpy(out)
    assert not np.isnan(out_h.astype(np.float32)).any(), "unwritten (NaN) output"
    assert_within_budget(out_h, out_t, out_n, 2, rounding_floor(out_t, dtype), "out")
    np.testing.assert_allclose(cp.asnumpy(lse), lse_t, rtol=0, atol=2e-3)  # (rows that see no key: -inf in both)
    # the append wrote the same slots with the same values as the reference's, and nothing else
    assert np.array_equal(cp.asnumpy(ck).view(np.uint16), kn.view(np.uint16))
    assert np.array_equal(cp.asnumpy(cv).view(np.uint16), vn.view(np.uint16))


def test_splits_agree(gpu_decode):
    """The same call with 1 and with many splits (the merge is exact up to rounding)."""
    cp = gpu_decode
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, _, _, seqlens, table = _case(rng, batch=2, heads_q=8, heads_kv=2, d=128, seqlen_q=1,
                                                     seqlen_new=0, capacity=3000, page_size=32,
                                                     dtype=DTYPES["bfloat16"])
    args = [cp.asarray(x) for x in (q, k_cache, v_cache)]
    outs = [cuflash.attention_with_kvcache(*args, cache_seqlens=cp.asarray(seqlens), block_table=cp.asarray(table),
                                           num_splits=s).astype(cp.float32) for s in (1, 5, 40)]
    for o in outs[1:]:
        assert float(cp.abs(o - outs[0]).max()) < 2e-2


def test_zero_sized_calls(gpu_decode):
    """No query token (the new keys are still appended) and no sequence: nothing to launch, nothing wrong."""
    cp = gpu_decode
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
