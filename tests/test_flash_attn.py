"""cuflash.flash_attn: flash-attention 2.x's functions (signatures, layouts, return conventions) against a
float64 truth in plain torch, with gradients; on CPU tensors (the NumPy reference)."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import cuflash.torch as cft  # noqa: E402
from cuflash import flash_attn as fa  # noqa: E402

from _torch_truth import packed_lengths, sequence_scores  # noqa: E402

# flash-attention 2.x's public signatures (flash_attn/flash_attn_interface.py, 2.8): names, order, defaults.
_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_EMPTY = inspect.Parameter.empty
SIGNATURES = {
    "flash_attn_qkvpacked_func": [("qkv", _EMPTY), *_COMMON],
    "flash_attn_kvpacked_func": [("q", _EMPTY), ("kv", _EMPTY), *_COMMON],
    "flash_attn_func": [("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), *_COMMON],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _EMPTY), ("cu_seqlens", _EMPTY), ("max_seqlen", _EMPTY), *_COMMON],
    "flash_attn_varlen_kvpacked_func": [
        ("q", _EMPTY), ("kv", _EMPTY), ("cu_seqlens_q", _EMPTY), ("cu_seqlens_k", _EMPTY), ("max_seqlen_q", _EMPTY),
        ("max_seqlen_k", _EMPTY), *_COMMON],
    "flash_attn_varlen_func": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("cu_seqlens_q", _EMPTY), ("cu_seqlens_k", _EMPTY),
        ("max_seqlen_q", _EMPTY), ("max_seqlen_k", _EMPTY), *_COMMON, ("block_table", None)],
    "flash_attn_with_kvcache": [
        ("q", _EMPTY), ("k_cache", _EMPTY), ("v_cache", _EMPTY), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
        ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)],
}


def test_signatures_are_flash_attention_2s():
    assert sorted(fa.__all__) == sorted(SIGNATURES)
    for name, expected in SIGNATURES.items():
        params = inspect.signature(getattr(fa, name)).parameters.values()
        assert [(p.name, p.default) for p in params] == expected, name
        assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params), name


# ---------------------------------------------------------------------------------------------------
# The float64 truth: one sequence at a time, plain torch, bottom-right diagonal (flash-attention >= 2.1)
# ---------------------------------------------------------------------------------------------------


def _truth(q, k, v, cu_q, cu_k, *, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """``(out, lse)`` of packed ``(total, heads, d)`` tensors: out ``(total_q, heads_q, d_v)``, lse
    ``(heads_q, total_q)``; rows that see no key output 0 with lse -inf. Differentiable (torch autograd)."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        slopes_b = None if slopes is None else slopes[b if slopes.dim() == 2 else slice(None)]
        s, visible, vb = sequence_scores(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]],
                                         scale=scale, causal=causal, window=window, softcap=softcap, slopes=slopes_b)
        s = torch.where(visible, s, -torch.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _padded_truth(q, k, v, **kw):
    """The truth of padded ``(batch, seqlen, heads, d)`` tensors: out like q, lse ``(batch, heads, seqlen_q)``."""
    batch, len_q, len_k = q.shape[0], q.shape[1], k.shape[1]
    out, lse = _truth(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), packed_lengths([len_q] * batch), packed_lengths([len_k] * batch), **kw)
    return out.unflatten(0, (batch, len_q)), lse.unflatten(1, (batch, len_q)).transpose(0, 1)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _check(ours, truth, leaves, truth_leaves, grad_out):
    """Values of (out, lse) and the gradients of ``leaves`` (from out only) against the truth's."""
    (out, lse), (out_t, lse_t) = ours, truth
    assert out.shape == out_t.shape and lse.shape == lse_t.shape and not lse.requires_grad
    torch.testing.assert_close(out, out_t, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_t, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out, leaves, grad_out)
    grads_t = torch.autograd.grad(out_t, truth_leaves, grad_out)
    for a, b in zip(grads, grads_t):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


VARIANTS = {
    "dense": {},
    "causal": dict(causal=True),
    "causal-window-softcap": dict(causal=True, window_size=(3, 2), softcap=2.5),
    "window-alibi": dict(window_size=(4, 1), alibi_slopes="per-head"),
    "alibi-per-batch-scale": dict(alibi_slopes="per-batch", softmax_scale=0.3),
}


def _variant(name, g, batch, heads):
    """flash-attention's keywords for a VARIANTS entry, and the truth's."""
    kw = dict(VARIANTS[name])
    slopes = None
    if kw.get("alibi_slopes") == "per-head":
        slopes = torch.rand(heads, generator=g, dtype=torch.float32) * 0.5
    elif kw.get("alibi_slopes") == "per-batch":
        slopes = torch.rand(batch, heads, generator=g, dtype=torch.float32) * 0.5
    if slopes is not None:
        kw["alibi_slopes"] = slopes
    truth = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                 slopes=slopes)
    return kw, truth


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flash_attn_func(variant):
    g = torch.Generator().manual_seed(1)
    q, k, v = _randn(g, 2, 9, 4, 8), _randn(g, 2, 13, 2, 8), _randn(g, 2, 13, 2, 8)
    kw, truth_kw = _variant(variant, g, 2, 4)
    scale = kw.get("softmax_scale", 8**-0.5)
    ours_leaves, truth_leaves = _leaves(q, k, v), _leaves(q, k, v)
    out, lse, s_dmask = fa.flash_attn_func(*ours_leaves, return_attn_probs=True, **kw)
    assert s_dmask is None
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float64
    _check((out, lse), _padded_truth(*truth_leaves, scale=scale, **truth_kw), ours_leaves, truth_leaves,
           _randn(g, *out.shape))
    plain = fa.flash_attn_func(q, k, v, **kw)  # return_attn_probs=False: out alone
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out.detach())


@pytest.mark.parametrize("variant", ["causal", "window-alibi"])
def test_flash_attn_qkvpacked_func(variant):
    g = torch.Generator().manual_seed(2)
    qkv = _randn(g, 2, 10, 3, 4, 8)
    kw, truth_kw = _variant(variant, g, 2, 4)
    (leaf,), (truth_leaf,) = _leaves(qkv), _leaves(qkv)
    out, lse, _ = fa.flash_attn_qkvpacked_func(leaf, return_attn_probs=True, **kw)
    assert out.shape == (2, 10, 4, 8) and lse.shape == (2, 4, 10)
    truth = _padded_truth(*truth_leaf.unbind(2), scale=8**-0.5, **truth_kw)
    _check((out, lse), truth, [leaf], [truth_leaf], _randn(g, *out.shape))


@pytest.mark.parametrize("variant", ["causal-window-softcap", "alibi-per-batch-scale"])
def test_flash_attn_kvpacked_func(variant):
    g = torch.Generator().manual_seed(3)
    q, kv = _randn(g, 2, 7, 4, 8), _randn(g, 2, 11, 2, 2, 8)  # GQA: 2 key/value heads
    kw, truth_kw = _variant(variant, g, 2, 4)
    ours_leaves, truth_leaves = _leaves(q, kv), _leaves(q, kv)
    out, lse, _ = fa.flash_attn_kvpacked_func(*ours_leaves, return_attn_probs=True, **kw)
    assert out.shape == (2, 7, 4, 8) and lse.shape == (2, 4, 7)
    truth = _padded_truth(truth_leaves[0], *truth_leaves[1].unbind(2), scale=kw.get("softmax_scale", 8**-0.5),
                          **truth_kw)
    _check((out, lse), truth, ours_leaves, truth_leaves, _randn(g, *out.shape))


@pytest.mark.parametrize("variant", ["dense", "causal-window-softcap", "alibi-per-batch-scale"])
def test_flash_attn_varlen_func(variant):
    g = torch.Generator().manual_seed(4)
    cu_q, cu_k = packed_lengths([5, 1, 9]), packed_lengths([8, 6, 9])
    q, k, v = _randn(g, 15, 4, 8), _randn(g, 23, 2, 8), _randn(g, 23, 2, 8)
    kw, truth_kw = _variant(variant, g, 3, 4)
    ours_leaves, truth_leaves = _leaves(q, k, v), _leaves(q, k, v)
    out, lse, _ = fa.flash_attn_varlen_func(*ours_leaves, cu_q, cu_k, 9, 9, return_attn_probs=True, **kw)
    assert out.shape == (15, 4, 8) and lse.shape == (4, 15)
    truth = _truth(*truth_leaves, cu_q, cu_k, scale=kw.get("softmax_scale", 8**-0.5), **truth_kw)
    _check((out, lse), truth, ours_leaves, truth_leaves, _randn(g, *out.shape))


def test_flash_attn_varlen_qkvpacked_func():
    g = torch.Generator().manual_seed(5)
    cu = packed_lengths([6, 3, 7])
    qkv = _randn(g, 16, 3, 2, 8)
    (leaf,), (truth_leaf,) = _leaves(qkv), _leaves(qkv)
    out, lse, _ = fa.flash_attn_varlen_qkvpacked_func(leaf, cu, 7, causal=True, window_size=(2, -1),
                                                      return_attn_probs=True)
    assert out.shape == (16, 2, 8) and lse.shape == (2, 16)
    truth = _truth(*truth_leaf.unbind(1), cu, cu, scale=8**-0.5, causal=True, window=(2, -1))
    _check((out, lse), truth, [leaf], [truth_leaf], _randn(g, *out.shape))


def test_flash_attn_varlen_kvpacked_func():
    g = torch.Generator().manual_seed(6)
    cu_q, cu_k = packed_lengths([3, 4]), packed_lengths([9, 4])
    q, kv = _randn(g, 7, 4, 8), _randn(g, 13, 2, 1, 8)  # MQA
    ours_leaves, truth_leaves = _leaves(q, kv), _leaves(q, kv)
    out, lse, _ = fa.flash_attn_varlen_kvpacked_func(*ours_leaves, cu_q, cu_k, 4, 9, causal=True, softcap=1.5,
                                                     return_attn_probs=True)
    assert out.shape == (7, 4, 8) and lse.shape == (4, 7)
    truth = _truth(truth_leaves[0], *truth_leaves[1].unbind(1), cu_q, cu_k, scale=8**-0.5, causal=True, softcap=1.5)
    _check((out, lse), truth, ours_leaves, truth_leaves, _randn(g, *out.shape))


def test_matches_cuflash_torch_in_float32_with_head_dim_v_and_strided_inputs():
    """The drop-in is cuflash.torch.attention underneath; a strided last axis is copied, as flash-attention does."""
    g = torch.Generator().manual_seed(7)
    q, k = _randn(g, 1, 6, 2, 16).float(), _randn(g, 1, 8, 2, 16).float()
    v = _randn(g, 1, 8, 2, 8).float()
    q_strided = torch.stack([q, q], dim=-1).flatten(-2)[..., ::2]  # q's values, last-axis stride 2
    assert q_strided.stride(-1) == 2 and torch.equal(q_strided, q)
    out = fa.flash_attn_func(q_strided, k, v, causal=True, deterministic=True)
    assert torch.equal(out, cft.attention(q, k, v, causal=True))


def test_softcap_at_or_below_zero_is_off_as_in_flash_attention():
    g = torch.Generator().manual_seed(8)
    q, k, v = (_randn(g, 1, 5, 2, 8) for _ in range(3))
    assert torch.equal(fa.flash_attn_func(q, k, v, softcap=-1.0), fa.flash_attn_func(q, k, v))


def test_dropout_draws_from_torch_generator():
    g = torch.Generator().manual_seed(9)
    q, k, v = (_randn(g, 1, 6, 2, 8) for _ in range(3))
    torch.manual_seed(11)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    assert s_dmask is None
    torch.manual_seed(11)
    seed = cft.draw_dropout_seed()
    assert torch.equal(out, cft.attention(q, k, v, dropout_p=0.4, dropout_seed=seed))
    assert not torch.equal(out, fa.flash_attn_func(q, k, v, dropout_p=0.4))  # the next draw: another mask


def test_varlen_block_table_is_not_supported():
    q, k, v = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    cu = packed_lengths([4])
    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func with block_table"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_compiles_with_no_graph_break():
    g = torch.Generator().manual_seed(10)
    qkv = _randn(g, 2, 8, 3, 2, 8).float().requires_grad_()
    cu = packed_lengths([5, 3])

    def fn(qkv):
        a = fa.flash_attn_qkvpacked_func(qkv, causal=True)
        b = fa.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1)[:8], cu, 5, window_size=(2, 2))
        return a.sum() + b.square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss, (grad,) = compiled(qkv), torch.autograd.grad(compiled(qkv), qkv)
    loss_e, (grad_e,) = fn(qkv), torch.autograd.grad(fn(qkv), qkv)
    assert torch.equal(loss, loss_e) and torch.equal(grad, grad_e)


# ---------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: the operator cuflash::attention_with_kvcache (cuflash.attention_with_kvcache) underneath
# ---------------------------------------------------------------------------------------------------


def test_with_kvcache_appends_in_place_and_matches_attention():
    g = torch.Generator().manual_seed(12)
    k_cache, v_cache = _randn(g, 2, 10, 2, 8), _randn(g, 2, 10, 2, 8)
    q, k_new, v_new = _randn(g, 2, 1, 4, 8), _randn(g, 2, 1, 2, 8), _randn(g, 2, 1, 2, 8)
    lengths = [4, 7]
    before = k_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                          cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=True,
                                          return_softmax_lse=True)
    assert out.shape == (2, 1, 4, 8) and lse.shape == (2, 4, 1)
    for b, n in enumerate(lengths):
        assert torch.equal(k_cache[b, n], k_new[b, 0]) and torch.equal(v_cache[b, n], v_new[b, 0])
        assert torch.equal(k_cache[b, :n], before[b, :n]) and torch.equal(k_cache[b, n + 1:], before[b, n + 1:])
        ref, ref_lse = cft.attention(q[b:b + 1], k_cache[b:b + 1, :n + 1], v_cache[b:b + 1, :n + 1], causal=True,
                                     return_lse=True)
        torch.testing.assert_close(out[b:b + 1], ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b:b + 1], ref_lse, rtol=1e-12, atol=1e-12)
    # cache_seqlens None: the whole cache, as flash-attention
    full = fa.flash_attn_with_kvcache(q, k_cache, v_cache)
    torch.testing.assert_close(full, cft.attention(q, k_cache, v_cache), rtol=1e-12, atol=1e-12)


def test_with_kvcache_runs_the_decode_operator_and_has_no_gradient(monkeypatch):
    """Eager plain tensors run the operator's implementation directly (no dispatch cost), still bumping the caches'
    version counters as the operator's declared mutation does; torch.compile goes through the operator (next test)."""
    g = torch.Generator().manual_seed(13)
    k_cache, v_cache = _randn(g, 1, 6, 1, 8), _randn(g, 1, 6, 1, 8)
    q = _randn(g, 1, 2, 2, 8).requires_grad_()
    seen = []
    real = cft._kvcache_backend

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(cft, "_kvcache_backend", spy)
    version = k_cache._version
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, _randn(g, 1, 1, 1, 8), _randn(g, 1, 1, 1, 8),
                                     cache_seqlens=3)
    assert len(seen) == 1 and not out.requires_grad
    assert k_cache._version > version and v_cache._version > version  # autograd sees the append


def test_with_kvcache_compiles_with_no_graph_break_and_appends():
    """torch.compile(fullgraph=True) traces flash_attn_with_kvcache (the mutating operator, functionalized), and the
    compiled call appends to the caches as the eager one does."""
    g = torch.Generator().manual_seed(14)
    caches = [_randn(g, 2, 12, 2, 8) for _ in range(2)]
    q, k_new, v_new = _randn(g, 2, 2, 4, 8), _randn(g, 2, 2, 2, 8), _randn(g, 2, 2, 2, 8)
    lens = torch.tensor([3, 9], dtype=torch.int32)

    def fn(q, k_cache, v_cache, k, v, lens):
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                              window_size=(4, 0), return_softmax_lse=True)
        return out * 2, lse

    eager_caches = [c.clone() for c in caches]
    compiled_caches = [c.clone() for c in caches]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(q, *compiled_caches, k_new, v_new, lens)
    want = fn(q, *eager_caches, k_new, v_new, lens)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b, before in zip(compiled_caches, eager_caches, caches):
        assert torch.equal(a, b) and not torch.equal(a, before)


def test_with_kvcache_checks_in_the_front_doors_words():
    q, cache = torch.zeros(1, 1, 2, 8), torch.zeros(1, 4, 1, 8)
    with pytest.raises(TypeError, match="cache_seqlens must be an int or an int32 torch.Tensor"):
        cft.attention_with_kvcache(q, cache, cache, cache_seqlens=[2])
    with pytest.raises(TypeError, match="num_splits must be an integer >= 0"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2, num_splits=1.5)
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2, rotary_interleaved=1)
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor"):
        cft.attention_with_kvcache(q, None, cache, cache_seqlens=2)
    with pytest.raises(ValueError, match="cache_seqlens"):  # an int past the capacity: the front door's check
        cft.attention_with_kvcache(q, cache, cache, cache_seqlens=5)


# ---------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the decode kernels through the operator
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_with_kvcache_cuda_matches_the_reference(dtype, paged):
    """The decode kernels (append, split-KV attention, merge) through flash_attn_with_kvcache on CUDA tensors: the
    appended caches bit for bit, out and lse against the NumPy reference on the same inputs (float64 truth budget)
    and the output allocated by torch on the current stream."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import cupy

    g = torch.Generator().manual_seed(15)
    batch, heads_q, heads_kv, d, capacity = 3, 8, 2, 128, 640
    page = 16 if paged else None
    if paged:
        pages = batch * capacity // page
        k_cache, v_cache = (_randn(g, pages, page, heads_kv, d).to(dtype) for _ in range(2))
        table = torch.randperm(pages, generator=g).reshape(batch, -1).to(torch.int32)
    else:
        k_cache, v_cache = (_randn(g, batch, capacity, heads_kv, d).to(dtype) for _ in range(2))
        table = None
    q, k_new, v_new = _randn(g, batch, 1, heads_q, d).to(dtype), *(_randn(g, batch, 1, heads_kv, d).to(dtype)
                                                                  for _ in range(2))
    lens = torch.tensor([5, 600, 321], dtype=torch.int32)
    opts = dict(causal=True, window_size=(256, 0), softcap=20.0, return_softmax_lse=True)
    host = [t.clone() for t in (k_cache, v_cache)]
    out_ref, lse_ref = fa.flash_attn_with_kvcache(q, *host, k_new, v_new, cache_seqlens=lens, block_table=table, **opts)
    truth = [t.double() for t in (k_cache, v_cache)]
    out_t, lse_t = fa.flash_attn_with_kvcache(q.double(), *truth, k_new.double(), v_new.double(), cache_seqlens=lens,
                                              block_table=table, **opts)
    dev = [t.cuda() for t in (k_cache, v_cache)]
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a non-default stream: the kernels run on torch's current one
        out, lse = fa.flash_attn_with_kvcache(q.cuda(), *dev, k_new.cuda(), v_new.cuda(), cache_seqlens=lens.cuda(),
                                              block_table=None if table is None else table.cuda(), **opts)
    side.synchronize()
    assert pool.used_bytes() == used, "the call held memory in CuPy's pool"
    assert out.dtype == dtype and out.is_contiguous() and lse.dtype == torch.float32
    for got, want in zip(dev, host):
        assert torch.equal(got.cpu(), want)
    err = (out.cpu().double() - out_t).abs().max().item()
    ref = (out_ref.double() - out_t).abs().max().item()
    floor = (out_t.to(dtype).double() - out_t).abs().max().item()
    assert err <= 2 * ref + floor + 1e-6, f"max|cuda - truth| = {err:.3g}; reference in {dtype}: {ref:.3g}"
    assert (lse.cpu().double() - lse_t).abs().max().item() < 2e-3
