"""v with a head dim of its own (``head_dim_v != head_dim``, DeepSeek's q, k of 192 and v of 128), and odd head
dims, in the NumPy reference and the front ends: against a float64 truth written with einsums here, blocked
against naive for every variant, the PyTorch and JAX wrappers, empty inputs and the shape checks."""

import re

import numpy as np
import pytest
from _helpers import numeric_gradient

import cuflash
from cuflash._ops import validate as _validate
from cuflash import reference
from cuflash._ops.variant import Variant

HEAD_DIM_PAIRS = [(192, 128), (64, 32), (16, 40), (1, 3)]
ORDERS = ("kv_outer", "q_outer", "split")


def _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, dv, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, heads_q, d)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, heads_kv, d)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, heads_kv, dv)).astype(dtype)
    do = rng.standard_normal((batch, seqlen_q, heads_q, dv)).astype(dtype)
    return q, k, v, do


def _truth(q, k, v, do, *, scale, causal=False, window=(None, None)):
    """``(out, lse, (dq, dk, dv))`` of softmax attention in float64, from its textbook formulas (bottom-right
    diagonal; every row must see a key). GQA: query head h reads key/value head h // group."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    (batch, len_q, heads_q, _), (_, len_k, heads_kv, _) = q.shape, k.shape
    group = heads_q // heads_kv
    kk, vv = (np.repeat(x, group, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    i = np.arange(len_q)[:, None] + (len_k - len_q)
    j = np.arange(len_k)[None, :]
    visible = np.ones((len_q, len_k), bool)
    if causal:
        visible &= j <= i
    left, right = window
    if left is not None:
        visible &= j >= i - left
    if right is not None:
        visible &= j <= i + right
    assert visible.any(axis=1).all()
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    p /= total
    lse = (m + np.log(total))[..., 0]
    out = np.einsum("bhij,bjhd->bihd", p, vv)
    dp = np.einsum("bihd,bjhd->bhij", do, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, kk)
    fold = lambda x: x.reshape(batch, len_k, heads_kv, group, x.shape[-1]).sum(3)  # noqa: E731
    dk = fold(scale * np.einsum("bhij,bihd->bjhd", ds, q))
    dv = fold(np.einsum("bhij,bihd->bjhd", p, do))
    return out, lse, (dq, dk, dv)


_BANDS = {
    "dense-gqa": dict(heads=(4, 2)),
    "causal-gqa": dict(heads=(4, 2), causal=True),
    "window-mqa": dict(heads=(3, 1), window=(3, 2)),
    "causal-window-mha": dict(heads=(2, 2), causal=True, window=(5, None)),
}


@pytest.mark.parametrize("band", list(_BANDS))
@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=[f"d{d}-dv{dv}" for d, dv in HEAD_DIM_PAIRS])
def test_reference_against_float64_truth(dims, band):
    d, dv = dims
    spec = _BANDS[band]
    causal, window = spec.get("causal", False), spec.get("window", (None, None))
    q, k, v, do = _inputs(2, 13, 17, *spec["heads"], d, dv, seed=d + dv)
    out_t, lse_t, grads_t = _truth(q, k, v, do, scale=d**-0.5, causal=causal, window=window)
    kw = dict(causal=causal, window_size=tuple(-1 if w is None else w for w in window))
    for algorithm, blocks in (("naive", (None, None)), ("fa2", (5, 6)), ("fa1", (4, 16)), ("fa2", (None, None))):
        out, lse = cuflash.attention(q, k, v, algorithm=algorithm, block_q=blocks[0], block_k=blocks[1],
                                     return_lse=True, **kw)
        assert out.shape == (2, 13, spec["heads"][0], dv)
        np.testing.assert_allclose(out, out_t, rtol=0, atol=1e-12, err_msg=algorithm)
        np.testing.assert_allclose(lse, lse_t, rtol=0, atol=1e-12, err_msg=algorithm)
    for algorithm, order in (("naive", None), *(("fa2", order) for order in ORDERS)):
        grads = cuflash.attention_backward(do, q, k, v, out_t, lse_t.astype(np.float64), algorithm=algorithm,
                                           block_q=5, block_k=6, order=order, **kw)
        for name, got, want in zip(("dq", "dk", "dv"), grads, grads_t):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-11, err_msg=f"{name} {algorithm} {order}")


def test_float32_within_tolerance_of_truth():
    q, k, v, do = _inputs(1, 33, 40, 4, 2, 192, 128, dtype=np.float32, seed=7)
    out_t, lse_t, grads_t = _truth(q, k, v, do, scale=192**-0.5, causal=True)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == np.float32 and out.shape == (1, 33, 4, 128)
    np.testing.assert_allclose(out, out_t, rtol=0, atol=2e-5)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    for got, want in zip(grads, grads_t):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


_VARIANTS = {
    "softcap-alibi": dict(softcap=2.5, alibi=True),
    "bias-mask": dict(bias=True, causal=True),
    "seqused": dict(seqused_k=np.array([9, 21], np.int32), window_size=(4, 4)),
    "dropout": dict(dropout_p=0.3, dropout_seed=5, dropout_offset=2, causal=True),
    "top-left": dict(causal=True, causal_align="top-left", softmax_scale=0.3),
}


@pytest.mark.parametrize("name", list(_VARIANTS))
def test_blocked_matches_naive_for_every_variant(name):
    q, k, v, do = _inputs(2, 19, 21, 4, 2, 16, 40, seed=1)
    kw = dict(_VARIANTS[name])
    rng = np.random.default_rng(2)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, 4).astype(np.float32)
    if kw.pop("bias", False):
        kw["bias"] = rng.standard_normal((4, 19, 21))
        kw["attn_mask"] = rng.uniform(size=(19, 21)) < 0.8
    out_n, lse_n = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **kw)
    grads_n = cuflash.attention_backward(do, q, k, v, out_n, lse_n, algorithm="naive", **kw)
    for algorithm in ("fa2", "fa1"):
        out, lse = cuflash.attention(q, k, v, algorithm=algorithm, block_q=7, block_k=5, return_lse=True, **kw)
        np.testing.assert_allclose(out, out_n, rtol=0, atol=1e-12, err_msg=algorithm)
        np.testing.assert_allclose(lse, lse_n, rtol=0, atol=1e-12, err_msg=algorithm)
    for order in ORDERS:
        grads = cuflash.attention_backward(do, q, k, v, out_n, lse_n, block_q=7, block_k=5, order=order, **kw)
        assert len(grads) == len(grads_n)
        for label, got, want in zip(("dq", "dk", "dv", "dbias"), grads, grads_n):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=f"{label} {order}")


def test_packed_batch_matches_per_sequence_calls():
    lens_q, lens_k = (5, 0, 9), (7, 3, 12)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((cu_q[-1], 4, 24))
    k = rng.standard_normal((cu_k[-1], 2, 24))
    v = rng.standard_normal((cu_k[-1], 2, 8))
    do = rng.standard_normal((cu_q[-1], 4, 8))
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9, max_seqlen_k=12, causal=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True, block_q=4, block_k=5, **packed)
    assert out.shape == (14, 4, 8) and lse.shape == (4, 14)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, block_q=4, block_k=5, **packed)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o_b, l_b = cuflash.attention(q[None, rq], k[None, rk], v[None, rk], causal=True, return_lse=True)
        np.testing.assert_allclose(out[rq], o_b[0], rtol=0, atol=1e-12)
        g_b = cuflash.attention_backward(do[None, rq], q[None, rq], k[None, rk], v[None, rk], o_b, l_b, causal=True)
        for got, want in zip((dq[rq], dk[rk], dv[rk]), g_b):
            np.testing.assert_allclose(got, want[0], rtol=0, atol=1e-12)


def test_gradients_match_finite_differences():
    q, k, v, do = _inputs(1, 4, 5, 2, 1, 3, 2, seed=4)
    kw = dict(scale=0.7, variant=Variant(causal=True, softcap=2.0))

    def loss(q, k, v):
        return float((reference.naive_forward(q, k, v, **kw)[0] * do).sum())

    for index, grad in enumerate(reference.naive_backward(do, q, k, v, **kw)):
        np.testing.assert_allclose(grad, numeric_gradient(loss, [q, k, v], index, step=1e-6), rtol=1e-6, atol=1e-8)


def test_default_scale_is_that_of_q_and_k():
    q, k, v, _ = _inputs(1, 6, 7, 2, 2, 16, 4)
    np.testing.assert_array_equal(cuflash.attention(q, k, v), cuflash.attention(q, k, v, softmax_scale=0.25))


def test_problem_keeps_positional_construction():
    problem = _validate.Problem(2, 5, 7, 4, 2, 8, np.dtype(np.float32))
    assert problem.head_dim_v == 8 and problem.out_shape == problem.q_shape == (2, 5, 4, 8)
    packed = _validate.Problem(3, 5, 7, 4, 2, 8, np.dtype(np.float32), 11, 13)
    assert packed.head_dim_v == 8 and packed.out_shape == (11, 4, 8)
    mixed = _validate.Problem(2, 5, 7, 4, 2, 8, np.dtype(np.float32), head_dim_v=3)
    assert mixed.out_shape == (2, 5, 4, 3) and mixed.q_shape == (2, 5, 4, 8)


def test_checks_name_the_argument():
    q, k, v, do = _inputs(2, 5, 7, 4, 2, 8, 3)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=re.escape(
            "do must have the shape of the output (q's, with v's head_dim), (2, 5, 4, 3); got (2, 5, 4, 8)")):
        cuflash.attention_backward(np.zeros_like(q), q, k, v, out, lse)
    with pytest.raises(ValueError, match=re.escape(
            "out must have the shape of the output (q's, with v's head_dim), (2, 5, 4, 3); got (2, 5, 4, 8)")):
        cuflash.attention_backward(do, q, k, v, np.zeros_like(q), lse)
    with pytest.raises(ValueError, match=re.escape(
            "q and k must have the same head_dim (last axis; v's may differ); got q 8, k 3")):
        cuflash.attention(q, v, v)
    with pytest.raises(ValueError, match=re.escape(
            "k and v must have the same shape but for the last axis (v's head_dim may differ); "
            "got k (2, 7, 2, 8) and v (2, 7, 1, 3)")):
        cuflash.attention(q, k, v[:, :, :1])


@pytest.mark.parametrize("algorithm", ["fa2", "fa1", "naive"])
def test_empty_inputs(algorithm):
    for shape_q, shape_k in (((0, 5, 4, 8), (0, 7, 2, 8)), ((2, 0, 4, 8), (2, 7, 2, 8)), ((2, 5, 4, 8), (2, 0, 2, 8))):
        q, k = np.ones(shape_q, np.float32), np.ones(shape_k, np.float32)
        v = np.ones(shape_k[:-1] + (3,), np.float32)
        out, lse = cuflash.attention(q, k, v, algorithm=algorithm, return_lse=True)
        assert out.shape == shape_q[:-1] + (3,) and not out.any()
        dq, dk, dv = cuflash.attention_backward(out, q, k, v, out, lse, algorithm=algorithm)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        # the backend's own empty path (the front door returns before it)
        got = reference.forward(q, k, v, scale=1.0, variant=Variant(), algorithm=algorithm, block_q=None,
                                block_k=None)
        assert got[0].shape == out.shape


ODD_HEAD_DIMS = [1, 3, 16, 40, 59, 80, 111, 160, 192, 224, 256]


@pytest.mark.parametrize("d", ODD_HEAD_DIMS)
def test_odd_head_dims(d):
    """Any head dim from 1 to 256 runs in the reference: naive against the einsum truth, blocked (default and
    awkward tiles) against naive, and v with another head dim."""
    for dv in (d, max(1, d // 2 + 3)):
        q, k, v, do = _inputs(1, 7, 9, 2, 1, d, dv, seed=d)
        out_t, lse_t, grads_t = _truth(q, k, v, do, scale=d**-0.5, causal=True)
        for blocks in ((None, None), (3, 4)):
            out, lse = cuflash.attention(q, k, v, causal=True, block_q=blocks[0], block_k=blocks[1], return_lse=True)
            np.testing.assert_allclose(out, out_t, rtol=0, atol=1e-12)
            np.testing.assert_allclose(lse, lse_t, rtol=0, atol=1e-12)
            grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=True, block_q=blocks[0],
                                               block_k=blocks[1])
            for got, want in zip(grads, grads_t):
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)


# --------------------------------------------------------------------------------------------------- frameworks


def test_torch_wrapper_matches_numpy_and_gradcheck():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cft

    q, k, v, do = _inputs(2, 11, 13, 4, 2, 24, 8, seed=9)
    kw = dict(causal=True, block_q=4, block_k=8)
    tensors = [torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v)]
    out = cft.attention(*tensors, **kw)
    assert tuple(out.shape) == (2, 11, 4, 8)
    out.backward(torch.from_numpy(do))
    out_np, lse_np = cuflash.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_array_equal(out.detach().numpy(), out_np)
    for t, want in zip(tensors, cuflash.attention_backward(do, q, k, v, out_np, lse_np, **kw)):
        np.testing.assert_array_equal(t.grad.numpy(), want)
    small = [torch.from_numpy(x).requires_grad_() for x in _inputs(1, 5, 6, 2, 1, 3, 2, seed=1)[:3]]
    assert torch.autograd.gradcheck(lambda q, k, v: cft.attention(q, k, v, causal=True, block_q=2, block_k=3), small)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_wrapper_matches_numpy(jit):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import cuflash.jax as cfj

    q, k, v, do = _inputs(2, 11, 13, 4, 2, 24, 8, seed=9)
    cpu = jax.devices("cpu")[0]  # (JAX arrays on the CPU: the NumPy reference's path, also where JAX has a GPU)
    qj, kj, vj, doj = (jax.device_put(x, cpu) for x in (q, k, v, do))
    kw = dict(causal=True, window_size=(4, -1), block_q=4, block_k=8)
    fn = lambda q, k, v: cfj.attention(q, k, v, **kw)  # noqa: E731
    grad = jax.grad(lambda q, k, v: (fn(q, k, v) * doj).sum(), argnums=(0, 1, 2))
    if jit:
        fn, grad = jax.jit(fn), jax.jit(grad)
    out_np, lse_np = cuflash.attention(q, k, v, return_lse=True, **kw)
    out = fn(qj, kj, vj)
    assert out.shape == (2, 11, 4, 8)
    np.testing.assert_allclose(np.asarray(out), out_np, rtol=0, atol=1e-13)
    for got, want in zip(grad(qj, kj, vj), cuflash.attention_backward(do, q, k, v, out_np, lse_np, **kw)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-13)
