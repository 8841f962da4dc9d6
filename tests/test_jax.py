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
