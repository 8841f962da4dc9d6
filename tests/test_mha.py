"""The multi-head self-attention layer (cuflash.mha): forward against a plain NumPy float64 layer written
here, every gradient against float64 central finite differences, for each algorithm, causal or not,
grouped-query or not."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash.mha import MHACache, MHAGrads, MHAParams, init_mha_params, mha_backward, mha_forward

ALGORITHMS = ("fa2", "fa1", "naive")
ORDERS = ("kv_outer", "q_outer", "split")
# (num_heads, num_kv_heads): ordinary multi-head attention and grouped-query attention (2 query heads
# per key/value head).
HEADS = {"mha": (2, 2), "gqa": (4, 2)}
BATCH, SEQLEN, D_MODEL, HEAD_DIM = 2, 5, 6, 3


def blocks(algorithm):
    """Tile sizes that do not divide SEQLEN, so the blocked paths meet partial tiles."""
    return {} if algorithm == "naive" else {"block_q": 2, "block_k": 3}


def random_params(rng, num_heads, num_kv_heads, *, bias=True, d_model=D_MODEL, head_dim=HEAD_DIM):
    width_q, width_kv = num_heads * head_dim, num_kv_heads * head_dim

    def draw(*shape):
        return rng.standard_normal(shape) / math.sqrt(shape[0])

    return MHAParams(
        w_q=draw(d_model, width_q),
        w_k=draw(d_model, width_kv),
        w_v=draw(d_model, width_kv),
        w_o=draw(width_q, d_model),
        b_q=rng.standard_normal(width_q) if bias else None,
        b_k=rng.standard_normal(width_kv) if bias else None,
        b_v=rng.standard_normal(width_kv) if bias else None,
        b_o=rng.standard_normal(d_model) if bias else None,
    )


def numpy_mha(z, params, num_heads, num_kv_heads, causal, scale):
    """The layer written out plainly in float64: one head and one sequence at a time."""
    z = np.asarray(z, dtype=np.float64)

    def project(w, b):
        return z @ w + (0.0 if b is None else b)

    q, k, v = project(params.w_q, params.b_q), project(params.w_k, params.b_k), project(params.w_v, params.b_v)
    batch, seqlen, _ = z.shape
    head_dim = q.shape[-1] // num_heads
    group = num_heads // num_kv_heads
    heads = []
    for h in range(num_heads):
        g = h // group
        q_h = q[:, :, h * head_dim:(h + 1) * head_dim]
        k_g = k[:, :, g * head_dim:(g + 1) * head_dim]
        v_g = v[:, :, g * head_dim:(g + 1) * head_dim]
        o_h = np.empty_like(q_h)
        for b in range(batch):
            s = scale * q_h[b] @ k_g[b].T
            if causal:
                s[np.triu_indices(seqlen, 1)] = -np.inf
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            o_h[b] = p @ v_g[b]
        heads.append(o_h)
    o = np.concatenate(heads, axis=-1)
    return o @ params.w_o + (0.0 if params.b_o is None else params.b_o)


def central_differences(loss, x, eps=1e-6):
    """d loss / d x, element by element, by (loss(x + eps) - loss(x - eps)) / (2 eps); x is restored."""
    grad = np.empty_like(x)
    for idx in np.ndindex(*x.shape):
        saved = x[idx]
        x[idx] = saved + eps
        up = loss()
        x[idx] = saved - eps
        down = loss()
        x[idx] = saved
        grad[idx] = (up - down) / (2 * eps)
    return grad


def assert_close(actual, expected, name, rtol, atol):
    err = np.max(np.abs(actual - expected))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=f"{name}: max abs err {err:.3e}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("softmax_scale", [None, 0.7])
def test_forward_matches_numpy(algorithm, causal, heads, softmax_scale):
    num_heads, num_kv_heads = HEADS[heads]
    rng = np.random.default_rng(1)
    params = random_params(rng, num_heads, num_kv_heads)
    z = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    y, cache = mha_forward(
        z, params, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal,
        softmax_scale=softmax_scale, algorithm=algorithm, **blocks(algorithm),
    )
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else softmax_scale
    truth = numpy_mha(z, params, num_heads, num_kv_heads, causal, scale)
    assert y.shape == (BATCH, SEQLEN, D_MODEL) and y.dtype == np.float64
    assert_close(y, truth, "y", rtol=1e-12, atol=1e-12)
    assert isinstance(cache, MHACache)
    assert cache.q.shape == (BATCH, SEQLEN, num_heads, HEAD_DIM)
    assert cache.k.shape == cache.v.shape == (BATCH, SEQLEN, num_kv_heads, HEAD_DIM)
    assert cache.out.shape == (BATCH, SEQLEN, num_heads, HEAD_DIM)
    assert cache.lse.shape == (BATCH, num_heads, SEQLEN)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", list(HEADS))
def test_gradients_match_finite_differences(algorithm, causal, heads):
    """L = sum(Z̃^out * G) for a fixed random G, so dL/dZ̃^out = G; every gradient of mha_backward is
    compared with central differences of the float64 NumPy layer."""
    num_heads, num_kv_heads = HEADS[heads]
    rng = np.random.default_rng(2)
    params = random_params(rng, num_heads, num_kv_heads)
    z = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    g = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    scale = 0.8
    options = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal, softmax_scale=scale)

    y, cache = mha_forward(z, params, algorithm=algorithm, **blocks(algorithm), **options)
    grads = mha_backward(g, cache, params)
    assert isinstance(grads, MHAGrads)

    def loss():
        return float(np.sum(numpy_mha(z, params, num_heads, num_kv_heads, causal, scale) * g))

    checks = {"dz": (grads.dz, z)}
    for name in MHAParams._fields:
        checks["d" + name] = (getattr(grads, "d" + name), getattr(params, name))
    for name, (analytic, x) in checks.items():
        assert analytic.shape == x.shape, name
        assert_close(analytic, central_differences(loss, x), name, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("heads", list(HEADS))
def test_gradients_without_bias(heads):
    num_heads, num_kv_heads = HEADS[heads]
    rng = np.random.default_rng(3)
    params = random_params(rng, num_heads, num_kv_heads, bias=False)
    z = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    g = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    y, cache = mha_forward(z, params, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True)
    grads = mha_backward(g, cache, params)
    assert grads.db_q is None and grads.db_k is None and grads.db_v is None and grads.db_o is None
    scale = 1.0 / math.sqrt(HEAD_DIM)

    def loss():
        return float(np.sum(numpy_mha(z, params, num_heads, num_kv_heads, True, scale) * g))

    for name in ("w_q", "w_k", "w_v", "w_o"):
        assert_close(getattr(grads, "d" + name), central_differences(loss, getattr(params, name)),
                     "d" + name, rtol=1e-6, atol=1e-7)
    assert_close(grads.dz, central_differences(loss, z), "dz", rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_backward_orders_agree(algorithm):
    """Every backward loop order (and deterministic=True) gives the same gradients in float64."""
    num_heads, num_kv_heads = HEADS["gqa"]
    rng = np.random.default_rng(4)
    params = random_params(rng, num_heads, num_kv_heads)
    z = rng.standard_normal((BATCH, 7, D_MODEL))
    g = rng.standard_normal((BATCH, 7, D_MODEL))
    y, cache = mha_forward(z, params, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True,
                           algorithm=algorithm, block_q=3, block_k=2)
    baseline = mha_backward(g, cache, params)
    runs = {order: mha_backward(g, cache, params, order=order) for order in ORDERS}
    runs["deterministic"] = mha_backward(g, cache, params, deterministic=True)
    for label, grads in runs.items():
        for name, a, b in zip(MHAGrads._fields, grads, baseline):
            assert_close(a, b, f"{label} {name}", rtol=1e-12, atol=1e-12)


def test_float32_layer_close_to_float64_truth():
    """float32 parameters and input: the layer stays float32 and is near the float64 truth."""
    num_heads, num_kv_heads = HEADS["gqa"]
    rng = np.random.default_rng(5)
    params64 = random_params(rng, num_heads, num_kv_heads)
    z64 = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    g64 = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    params32 = MHAParams(*(p.astype(np.float32) for p in params64))
    options = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True)
    y32, cache32 = mha_forward(z64.astype(np.float32), params32, **options)
    grads32 = mha_backward(g64.astype(np.float32), cache32, params32)
    y64, cache64 = mha_forward(z64, params64, **options)
    grads64 = mha_backward(g64, cache64, params64)
    assert y32.dtype == np.float32 and all(a.dtype == np.float32 for a in grads32)
    assert_close(y32, y64, "y", rtol=1e-4, atol=1e-5)
    for name, a, b in zip(MHAGrads._fields, grads32, grads64):
        assert_close(a, b, name, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_layer_keeps_its_dtype(dtype):
    """float16 / bfloat16 in, the same dtype out for y and every gradient (NumPy's bfloat16 matmul returns
    float32; the layer rounds back), within a few units of the dtype's rounding of the float64 truth."""
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    num_heads, num_kv_heads = HEADS["gqa"]
    rng = np.random.default_rng(11)
    params64 = random_params(rng, num_heads, num_kv_heads)
    z64 = rng.standard_normal((BATCH, 16, D_MODEL))
    g64 = rng.standard_normal((BATCH, 16, D_MODEL))
    options = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True)
    params_lo = MHAParams(*(p.astype(dtype) for p in params64))
    y_lo, cache_lo = mha_forward(z64.astype(dtype), params_lo, **options)
    grads_lo = mha_backward(g64.astype(dtype), cache_lo, params_lo)
    assert y_lo.dtype == dtype and all(a.dtype == dtype for a in grads_lo)
    # Truth: the float64 layer on the same (rounded) inputs.
    params_r = MHAParams(*(p.astype(np.float64) for p in params_lo))
    y64, cache64 = mha_forward(z64.astype(dtype).astype(np.float64), params_r, **options)
    grads64 = mha_backward(g64.astype(dtype).astype(np.float64), cache64, params_r)
    eps = float(ml_dtypes.finfo(dtype).eps)
    for name, a, b in [("y", y_lo, y64), *zip(MHAGrads._fields, grads_lo, grads64)]:
        err = np.max(np.abs(a.astype(np.float64) - b))
        bound = 16 * eps * max(1.0, float(np.max(np.abs(b))))
        assert err <= bound, f"{name}: max abs err {err:.3g} > {bound:.3g}"


def test_strided_input_needs_no_copy_and_matches():
    """An input that is a transposed view (not C-contiguous) gives the same layer output."""
    num_heads, num_kv_heads = HEADS["mha"]
    rng = np.random.default_rng(6)
    params = random_params(rng, num_heads, num_kv_heads)
    base = rng.standard_normal((SEQLEN, BATCH, D_MODEL))
    z = base.transpose(1, 0, 2)
    assert not z.flags.c_contiguous
    y, cache = mha_forward(z, params, num_heads=num_heads)
    y_contig, _ = mha_forward(np.ascontiguousarray(z), params, num_heads=num_heads)
    assert_close(y, y_contig, "y", rtol=1e-13, atol=1e-13)


def test_cache_keeps_the_attention_options():
    num_heads, num_kv_heads = HEADS["gqa"]
    rng = np.random.default_rng(7)
    params = random_params(rng, num_heads, num_kv_heads)
    z = rng.standard_normal((1, SEQLEN, D_MODEL))
    _, cache = mha_forward(z, params, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True,
                           softmax_scale=0.5, causal_align="top-left", algorithm="fa1", block_q=2, block_k=2)
    assert cache.options == dict(causal=True, softmax_scale=0.5, causal_align="top-left", algorithm="fa1",
                                 block_q=2, block_k=2)
    assert cache.z is z


@pytest.mark.parametrize("bias", [False, True])
def test_init_mha_params(bias):
    params = init_mha_params(8, 4, num_kv_heads=2, bias=bias, dtype=np.float64, rng=0)
    assert params.w_q.shape == (8, 8) and params.w_k.shape == params.w_v.shape == (8, 4)
    assert params.w_o.shape == (8, 8)
    assert all(w.dtype == np.float64 for w in params if w is not None)
    assert np.all(np.abs(params.w_q) <= 1 / math.sqrt(8)) and np.all(np.abs(params.w_o) <= 1 / math.sqrt(8))
    if bias:
        assert params.b_q.shape == (8,) and params.b_k.shape == params.b_v.shape == (4,)
        assert params.b_o.shape == (8,)
        assert all(np.all(b == 0) for b in params[4:])
    else:
        assert params[4:] == (None, None, None, None)
    again = init_mha_params(8, 4, num_kv_heads=2, bias=bias, dtype=np.float64, rng=0)
    assert all(np.array_equal(a, b) for a, b in zip(params[:4], again[:4]))

    wide = init_mha_params(6, 2, head_dim=5, d_out=3, rng=1)
    assert wide.w_q.shape == (6, 10) and wide.w_o.shape == (10, 3) and wide.w_q.dtype == np.float32
    rng = np.random.default_rng(8)
    z = rng.standard_normal((2, 4, 6)).astype(np.float32)
    y, cache = mha_forward(z, wide, num_heads=2)
    assert y.shape == (2, 4, 3)
    grads = mha_backward(rng.standard_normal((2, 4, 3)).astype(np.float32), cache, wide)
    assert grads.dw_o.shape == (10, 3) and grads.dz.shape == z.shape


def test_init_mha_params_errors():
    with pytest.raises(ValueError, match="num_kv_heads must be a positive divisor of num_heads"):
        init_mha_params(8, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_heads must divide d_model"):
        init_mha_params(10, 4)


def test_init_mha_params_size_errors_name_the_argument():
    # Zero or non-integer sizes failed inside the weight draw (ZeroDivisionError, or NumPy's messages).
    with pytest.raises(TypeError, match="num_heads must be a positive integer; got float 2.0"):
        init_mha_params(8, 2.0)
    with pytest.raises(TypeError, match="num_kv_heads must be a positive integer; got float 1.0"):
        init_mha_params(8, 2, num_kv_heads=1.0)
    with pytest.raises(ValueError, match="head_dim must be a positive integer; got 0"):
        init_mha_params(8, 2, head_dim=0)
    with pytest.raises(ValueError, match="d_model must be a positive integer; got 0"):
        init_mha_params(0, 2, head_dim=4)
    with pytest.raises(ValueError, match="d_out must be a positive integer; got -1"):
        init_mha_params(8, 2, d_out=-1)


def test_layer_errors():
    rng = np.random.default_rng(9)
    params = random_params(rng, 2, 2)
    z = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    with pytest.raises(ValueError, match="num_heads must be a positive integer; got 0"):
        mha_forward(z, params, num_heads=0)
    with pytest.raises(TypeError, match="num_kv_heads must be a positive integer; got float 2.0"):
        mha_forward(z, params, num_heads=2, num_kv_heads=2.0)
    with pytest.raises(ValueError, match=r"params.w_q must have shape \(d_model, num_heads \* head_dim\)"):
        mha_forward(z, params, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        mha_forward(z, params, num_heads=2, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"params.w_k must have shape \(6, 3\)"):
        mha_forward(z, params, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"z must have shape \(batch, seqlen, d_model\); got shape \(5, 6\)"):
        mha_forward(z[0], params, num_heads=2)
    with pytest.raises(ValueError, match=r"params.b_o must have shape \(6,\)"):
        mha_forward(z, params._replace(b_o=np.ones(5)), num_heads=2)
    with pytest.raises(TypeError, match="params.w_v must have the dtype of z, float64; got float32"):
        mha_forward(z, params._replace(w_v=params.w_v.astype(np.float32)), num_heads=2)
    y, cache = mha_forward(z, params, num_heads=2)
    with pytest.raises(ValueError, match=r"dy must have the shape of the forward's output, \(2, 5, 6\)"):
        mha_backward(y[:, :-1], cache, params)
    with pytest.raises(TypeError, match="dy must have the dtype of the forward's output, float64; got float32"):
        mha_backward(y.astype(np.float32), cache, params)


def test_backward_checks_params_against_the_forward():
    # Parameters other than the forward's used to fail half-way through the backward, in a reshape or
    # in the attention core's checks, with a message that did not name them.
    rng = np.random.default_rng(10)
    params = random_params(rng, 2, 2)
    z = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    y, cache = mha_forward(z, params, num_heads=2)
    with pytest.raises(ValueError, match=r"params.w_q must have shape \(d_model, num_heads \* head_dim\) = \(6, 2 \* head_dim\); got \(4, 6\)"):
        mha_backward(y, cache, random_params(rng, 2, 2, d_model=4))
    with pytest.raises(ValueError, match=r"params.w_q must have shape \(6, 6\) as in the forward; got \(6, 4\)"):
        mha_backward(y, cache, random_params(rng, 2, 2, head_dim=2))
    with pytest.raises(TypeError, match="params.w_q must have the dtype of z, float64; got float32"):
        mha_backward(y, cache, MHAParams(*(None if a is None else a.astype(np.float32) for a in params)))


def test_forward_checks_attention_options_before_any_product(monkeypatch):
    import cuflash.mha

    rng = np.random.default_rng(13)
    params = random_params(rng, 2, 2)
    z = rng.standard_normal((BATCH, SEQLEN, D_MODEL))

    def refuse(*args):
        raise AssertionError("the forward started computing before its options were checked")

    monkeypatch.setattr(cuflash.mha, "_matmul", refuse)
    with pytest.raises(ValueError, match="algorithm must be one of 'fa2', 'fa1', 'naive'; got 'fa3'"):
        mha_forward(z, params, num_heads=2, algorithm="fa3")
    with pytest.raises(TypeError, match="causal must be a bool; got str"):
        mha_forward(z, params, num_heads=2, causal="yes")
    with pytest.raises(ValueError, match="causal_align must be one of"):
        mha_forward(z, params, num_heads=2, causal_align="top_left")
    with pytest.raises(ValueError, match=r"softmax_scale must be finite \(any sign; 0 gives uniform attention\); got inf"):
        mha_forward(z, params, num_heads=2, softmax_scale=float("inf"))
    with pytest.raises(ValueError, match="block_k must be a positive integer or None; got 0"):
        mha_forward(z, params, num_heads=2, block_k=0)


def test_backward_checks_order_before_any_product(monkeypatch):
    import cuflash.mha

    rng = np.random.default_rng(12)
    params = random_params(rng, 2, 2)
    z = rng.standard_normal((BATCH, SEQLEN, D_MODEL))
    y, cache = mha_forward(z, params, num_heads=2)

    def refuse(*args):
        raise AssertionError("the backward started computing before its options were checked")

    monkeypatch.setattr(cuflash.mha, "_matmul", refuse)
    with pytest.raises(TypeError, match="deterministic must be a bool; got str"):
        mha_backward(y, cache, params, deterministic="yes")
    with pytest.raises(ValueError, match="order must be None or one of 'kv_outer', 'q_outer', 'split'; got 'ij'"):
        mha_backward(y, cache, params, order="ij")


@pytest.mark.gpu
def test_cupy_matches_numpy(requires_gpu):
    """The same functions on CuPy arrays (the CUDA kernels) agree with the NumPy layer in float32."""
    cp = requires_gpu
    num_heads, num_kv_heads = HEADS["gqa"]
    rng = np.random.default_rng(10)
    params = MHAParams(*(p.astype(np.float32) for p in random_params(rng, num_heads, num_kv_heads, head_dim=32)))
    z = rng.standard_normal((BATCH, 37, D_MODEL)).astype(np.float32)
    g = rng.standard_normal((BATCH, 37, D_MODEL)).astype(np.float32)
    options = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, causal=True)
    y, cache = mha_forward(z, params, **options)
    grads = mha_backward(g, cache, params)
    params_d = MHAParams(*(cp.asarray(p) for p in params))
    y_d, cache_d = mha_forward(cp.asarray(z), params_d, **options)
    grads_d = mha_backward(cp.asarray(g), cache_d, params_d)
    assert_close(cp.asnumpy(y_d), y, "y", rtol=1e-3, atol=1e-4)
    for name, a, b in zip(MHAGrads._fields, grads_d, grads):
        assert_close(cp.asnumpy(a), b, name, rtol=1e-3, atol=1e-3)
