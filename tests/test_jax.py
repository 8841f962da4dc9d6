"""cuflash.jax: the custom_vjp wrapper against jax.nn.dot_product_attention, eager and under jit."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cfj  # noqa: E402


def _inputs(shape, dtype, seed=0):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    rng = np.random.default_rng(seed)
    make = lambda n, h: jnp.asarray(rng.standard_normal((batch, n, h, head_dim)), dtype=dtype)  # noqa: E731
    return make(seqlen_q, heads_q), make(seqlen_k, heads_kv), make(seqlen_k, heads_kv)


def _plain(q, k, v, causal):
    """Float64 truth in plain jnp (jax.nn.dot_product_attention computes its softmax in float32)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _loss(fn, dout):
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float64) * dout)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape", [(2, 48, 48, 4, 4, 16), (1, 37, 75, 4, 2, 8)], ids=["square", "gqa-cross"]
)
def test_matches_jax_nn(shape, causal, jit):
    q, k, v = _inputs(shape, jnp.float64)
    dout = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape))
    ours = lambda q, k, v: cfj.attention(q, k, v, causal=causal, causal_align="top-left", block_q=16, block_k=24)  # noqa: E731
    ref = lambda q, k, v: _plain(q, k, v, causal)  # noqa: E731
    grad = lambda fn: jax.value_and_grad(_loss(fn, dout), argnums=(0, 1, 2))  # noqa: E731
    if jit:
        ours = jax.jit(ours)
    (l_ours, g_ours), (l_ref, g_ref) = grad(ours)(q, k, v), grad(ref)(q, k, v)
    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=0, atol=1e-10)
    np.testing.assert_allclose(l_ours, l_ref, rtol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv"), g_ours, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=name)
    jax_nn = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    np.testing.assert_allclose(ours(q, k, v), jax_nn, rtol=0, atol=1e-5)


def test_float32_and_deterministic_backward():
    q, k, v = _inputs((1, 33, 33, 2, 2, 16), jnp.float32, seed=2)
    f = lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True, deterministic=True) ** 2)  # noqa: E731
    g = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)  # noqa: E731
    for a, b in zip(jax.grad(f, (0, 1, 2))(q, k, v), jax.grad(g, (0, 1, 2))(q, k, v)):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_matches_jax_nn_on_gpu():
    pytest.importorskip("cupy")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("no JAX GPU device")
    q, k, v = _inputs((2, 128, 128, 4, 4, 64), jnp.bfloat16)
    out = cfj.attention(q, k, v, causal=True, causal_align="top-left")
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_checks_run_before_the_call_and_name_the_argument(jit):
    # Under jit the work runs in a callback, where an error surfaced only when the compiled function
    # ran, wrapped in a runtime error; a 3-d q failed on an unpacking of its shape before any check.
    q, k, v = _inputs((1, 5, 5, 2, 2, 4), jnp.float32)
    call = lambda fn, *a: (jax.jit(fn) if jit else fn)(*a)  # noqa: E731
    with pytest.raises(ValueError, match=r"q must have 4 dimensions .* got 3 dimensions with shape \(5, 2, 4\)"):
        call(cfj.attention, q[0], k, v)
    with pytest.raises(ValueError, match="algorithm must be one of 'fa2', 'fa1', 'naive'; got 'fa3'"):
        call(lambda q, k, v: cfj.attention(q, k, v, algorithm="fa3"), q, k, v)
    with pytest.raises(ValueError, match="key/value heads must divide the number of query heads"):
        call(cfj.attention, q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(TypeError, match="deterministic must be a bool; got str"):
        call(lambda q, k, v: cfj.attention(q, k, v, deterministic="yes"), q, k, v)


def test_accepts_numpy_inputs_like_any_jax_function():
    # NumPy inputs reached the backend choice as they were and failed with an AttributeError (devices).
    q, k, v = _inputs((1, 6, 6, 2, 1, 4), jnp.float64)
    loss = lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True) ** 2)  # noqa: E731
    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    got = jax.value_and_grad(loss, argnums=(0, 1, 2))(np.asarray(q), k, np.asarray(v))
    np.testing.assert_array_equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------------
# Variants: a packed batch (causal, window, softcap, ALiBi, GQA, key padding), eager and under jit
# ---------------------------------------------------------------------------------------------------


def _plain_variant(q, k, v, cu_q, cu_k, seqused_k, slopes, *, scale, window, softcap):
    """float64 causal attention of docs/variants.md in plain jnp, one packed sequence at a time (lengths
    from NumPy cu_seqlens), for jax.grad. Rows that see no key output 0."""
    outs = []
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]]
        len_q, len_k = qb.shape[0], int(seqused_k[b])
        group = q.shape[1] // k.shape[1]
        kb, vb = (jnp.repeat(x[cu_k[b]:cu_k[b] + len_k], group, axis=1) for x in (k, v))
        s = scale * jnp.einsum("qhd,khd->hqk", qb, kb)
        s = softcap * jnp.tanh(s / softcap)
        diagonal = np.arange(len_q)[:, None] + len_k - len_q
        cols = np.arange(len_k)[None, :]
        s = s - slopes[b][:, None, None] * np.abs(diagonal - cols)
        visible = (cols <= diagonal) & (cols >= diagonal - window[0])
        p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1) * visible
        outs.append(jnp.einsum("hqk,khd->qhd", p, vb))
    return jnp.concatenate(outs)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_variants_match_plain_jnp(jit):
    rng = np.random.default_rng(21)
    lens_q, lens_k = [7, 1, 12], [9, 6, 12]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    used = np.array([9, 0, 10], np.int32)
    slopes = rng.uniform(0, 0.5, (3, 4)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((cu_q[-1], 4, 8)))
    k, v = (jnp.asarray(rng.standard_normal((cu_k[-1], 2, 8))) for _ in range(2))
    dout = jnp.asarray(rng.standard_normal(q.shape))
    variant = dict(causal=True, window_size=(5, -1), softcap=3.0)

    def ours(q, k, v, cu_q, cu_k, used, slopes):
        return cfj.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=12, max_seqlen_k=12,
                             seqused_k=used, alibi_slopes=slopes, softmax_scale=0.3, block_q=4, block_k=5, **variant)

    @jax.jit  # compiled once: op by op, the plain version takes seconds
    def ref(q, k, v):
        return _plain_variant(q, k, v, cu_q, cu_k, used, slopes.astype(np.float64), scale=0.3, window=(5, -1),
                              softcap=3.0)

    fn = jax.jit(ours) if jit else ours
    value_and_grad = jax.value_and_grad(lambda q, k, v, *a: jnp.sum(fn(q, k, v, *a) * dout), argnums=(0, 1, 2))
    (l_ours, g_ours) = value_and_grad(q, k, v, cu_q, cu_k, used, slopes)
    (l_ref, g_ref) = jax.value_and_grad(lambda q, k, v: jnp.sum(ref(q, k, v) * dout), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(fn(q, k, v, cu_q, cu_k, used, slopes), ref(q, k, v), rtol=0, atol=1e-10)
    np.testing.assert_allclose(l_ours, l_ref, rtol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv"), g_ours, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=name)
    assert not np.asarray(g_ours[1])[cu_k[1]:cu_k[2]].any()  # keys past seqused_k: no gradient


def test_variant_values_are_checked_eagerly_or_when_the_jit_function_runs():
    q = jnp.ones((8, 2, 4), jnp.float32)
    bad = np.array([1, 3, 8], np.int32)
    call = lambda q, cu: cfj.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)  # noqa: E731
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0; got cu_seqlens_q\[0\] = 1"):
        call(q, bad)
    # shapes and dtypes at trace time, with the message of the eager call
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32; got int64"):
        jax.jit(call)(q, bad.astype(np.int64))
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total, heads, head_dim\) with cu_seqlens_q"):
        jax.jit(call)(q[None], bad)
    # values only when the compiled function runs, from inside the callback
    with pytest.raises(Exception, match="cu_seqlens_q must start at 0"):
        jax.block_until_ready(jax.jit(call)(q, bad))


# ---------------------------------------------------------------------------------------------------
# bias (differentiable) and attn_mask, eager and under jit
# ---------------------------------------------------------------------------------------------------


def _plain_biased(q, k, v, bias, mask, *, scale, softcap):
    """float64 causal (bottom-right) attention with softcap, an additive bias and a boolean mask, in plain jnp."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = softcap * jnp.tanh(scale * jnp.einsum("bqhd,bkhd->bhqk", q, k) / softcap) + bias
    len_q, len_k = s.shape[-2:]
    visible = mask & (np.arange(len_k)[None, :] <= np.arange(len_q)[:, None] + len_k - len_q)
    p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1) * visible
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bias_and_mask_match_plain_jnp(jit):
    rng = np.random.default_rng(31)
    q = jnp.asarray(rng.standard_normal((2, 9, 4, 8)))
    k, v = (jnp.asarray(rng.standard_normal((2, 13, 2, 8))) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((2, 1, 9, 13)))
    mask = rng.random((9, 13)) < 0.75
    mask[2] = False  # a row that sees no key
    mask = jnp.asarray(mask)
    dout = jnp.asarray(rng.standard_normal(q.shape))

    def ours(q, k, v, bias, mask):
        return cfj.attention(q, k, v, bias=bias, attn_mask=mask, causal=True, softcap=2.5, softmax_scale=0.4,
                             block_q=4, block_k=5)

    fn = jax.jit(ours) if jit else ours
    ref = jax.jit(lambda q, k, v, bias: _plain_biased(q, k, v, bias, mask, scale=0.4, softcap=2.5))
    value_and_grad = jax.value_and_grad(lambda *a: jnp.sum(fn(*a, mask) * dout), argnums=(0, 1, 2, 3))
    l_ours, g_ours = value_and_grad(q, k, v, bias)
    l_ref, g_ref = jax.value_and_grad(lambda *a: jnp.sum(ref(*a) * dout), argnums=(0, 1, 2, 3))(q, k, v, bias)
    np.testing.assert_allclose(fn(q, k, v, bias, mask), ref(q, k, v, bias), rtol=0, atol=1e-10)
    np.testing.assert_allclose(l_ours, l_ref, rtol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), g_ours, g_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=name)
    assert not np.asarray(g_ours[3])[:, :, 2].any()


def test_bias_checks_run_at_trace_time():
    q = jnp.ones((1, 5, 2, 4), jnp.float32)
    call = jax.jit(lambda q, bias: cfj.attention(q, q, q, bias=bias))
    with pytest.raises(ValueError, match=r"bias must be broadcastable to \(batch, heads_q, seqlen_q, seqlen_k\) = "
                                         r"\(1, 2, 5, 5\), .*; got \(3, 5, 5\)"):
        call(q, jnp.zeros((3, 5, 5)))
    with pytest.raises(TypeError, match="attn_mask must have dtype bool"):
        jax.jit(lambda q, m: cfj.attention(q, q, q, attn_mask=m))(q, jnp.zeros((5, 5), jnp.int32))


@pytest.mark.parametrize("jit", [False, True])
def test_vmap_forward_and_grad_match_a_loop(jit):
    """jax.vmap over a leading axis (q, k, v all mapped, or k and v shared), with grad inside and jit around:
    the same values as calling the function element by element."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 2, 24, 4, 16)), dtype=jnp.float32) for _ in range(3))

    def f(a, b, c):
        return cfj.attention(a, b, c, causal=True, window_size=(5, 0))

    def loss(a, b, c):
        return (f(a, b, c) ** 2).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    wrap = jax.jit if jit else (lambda fn: fn)
    out = wrap(jax.vmap(f))(q, k, v)
    grads = wrap(jax.vmap(grad))(q, k, v)
    shared = wrap(jax.vmap(f, in_axes=(0, None, None)))(q, k[0], v[0])
    for i in range(3):
        np.testing.assert_allclose(out[i], f(q[i], k[i], v[i]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(shared[i], f(q[i], k[0], v[0]), rtol=1e-6, atol=1e-6)
        for g, w in zip(grads, grad(q[i], k[i], v[i])):
            np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-5)
