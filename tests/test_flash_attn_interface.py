"""cuflash.flash_attn_interface: FlashAttention-3's flash_attn_func and flash_attn_varlen_func (signatures, return
conventions, FP8 descales) against cuflash.torch and the flash-attention 2 drop-in, on CPU tensors (the NumPy
reference)."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.torch as ct  # noqa: E402
from cuflash import flash_attn as fa2  # noqa: E402
from cuflash import flash_attn_interface as fa3  # noqa: E402

_EMPTY = inspect.Parameter.empty
# FlashAttention-3's signatures (hopper/flash_attn_interface.py): names, order, defaults.
_TAIL = [("softmax_scale", None), ("causal", False), ("qv", None), ("q_descale", None), ("k_descale", None),
         ("v_descale", None), ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1),
         ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False)]
SIGNATURES = {
    "flash_attn_func": [("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), *_TAIL],
    "flash_attn_varlen_func": [("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("cu_seqlens_q", _EMPTY),
                               ("cu_seqlens_k", _EMPTY), ("max_seqlen_q", _EMPTY), ("max_seqlen_k", _EMPTY),
                               ("seqused_q", None), ("seqused_k", None), *_TAIL],
}


def test_signatures_are_flash_attention_3s():
    assert sorted(fa3.__all__) == sorted(SIGNATURES)
    for name, expected in SIGNATURES.items():
        params = inspect.signature(getattr(fa3, name)).parameters.values()
        assert [(p.name, p.default) for p in params] == expected, name


def _qkv(dtype=torch.float64, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 33, 4, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 40, 2, 16, generator=g, dtype=dtype) for _ in range(2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def test_flash_attn_func_matches_the_flash_attention_2_drop_in_with_gradients():
    q, k, v = _qkv(requires_grad=True)
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, window_size=(10, 0), softcap=5.0, return_attn_probs=True)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want, want_lse, _ = fa2.flash_attn_func(q2, k2, v2, causal=True, window_size=(10, 0), softcap=5.0,
                                            return_attn_probs=True)
    assert lse.shape == (2, 4, 33)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    out.square().sum().backward()
    want.square().sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # the performance knobs change nothing
    torch.testing.assert_close(fa3.flash_attn_func(q, k, v, num_splits=4, pack_gqa=True, sm_margin=8),
                               fa2.flash_attn_func(q, k, v), rtol=0, atol=0)


def test_varlen_matches_the_flash_attention_2_drop_in():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(50, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(60, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 25, 60], dtype=torch.int32)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 35, causal=True, return_attn_probs=True)
    want, want_lse, _ = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 35, causal=True, return_attn_probs=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert lse.shape == (4, 50)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    used = torch.tensor([10, 30], dtype=torch.int32)
    torch.testing.assert_close(fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 35, seqused_k=used),
                               ct.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30,
                                            max_seqlen_k=35, seqused_k=used), rtol=0, atol=0)


def test_fp8_with_descales():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    import ml_dtypes

    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype(ml_dtypes.float8_e4m3fn) for s in ((2, 30, 4, 32), (2, 36, 2, 32),
                                                                                 (2, 36, 2, 32)))
    descales = [rng.uniform(0.5, 2.0, (2, 2)).astype(np.float32) for _ in range(3)]
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q, k, v))
    out, lse = fa3.flash_attn_func(tq, tk, tv, causal=True, q_descale=torch.from_numpy(descales[0]),
                                   k_descale=torch.from_numpy(descales[1]), v_descale=torch.from_numpy(descales[2]),
                                   return_attn_probs=True)
    want, want_lse = cuflash.attention(q, k, v, causal=True, q_descale=descales[0], k_descale=descales[1],
                                       v_descale=descales[2], return_lse=True)
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.view(torch.int16).numpy(), want.view(np.int16))
    np.testing.assert_array_equal(lse.numpy(), want_lse)


def test_what_cuflash_lacks_is_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="does not take qv"):
        fa3.flash_attn_func(q, k, v, qv=q)
    with pytest.raises(NotImplementedError, match=r"does not take attention_chunk \(other than 0\); got 64"):
        fa3.flash_attn_func(q, k, v, attention_chunk=64)
    cu = torch.tensor([0, 33], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="does not take seqused_q"):
        fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, torch.tensor([0, 40], dtype=torch.int32), 33, 40,
                                   seqused_q=torch.tensor([20], dtype=torch.int32))
