"""cuflash.jax: the custom_vjp wrapper against jax.nn.dot_product_attention, eager and under jit."""

import contextlib
import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cfj  # noqa: E402


@pytest.fixture(autouse=True)
def _on_the_cpu_unless_marked_gpu(request):
    """The tests not marked gpu run on JAX's CPU device (the NumPy algorithm, float64), also where JAX has a GPU."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


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


# How a test runs the function: eagerly, under jit by the default route (buffer_callback where JAX has it),
# or under jit through jax.pure_callback.
MODES = pytest.mark.parametrize("mode", ["eager", "jit", "jit-pure"])


def _compiled(fn, mode, monkeypatch):
    if mode == "jit-pure":
        monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "pure")
    return fn if mode == "eager" else jax.jit(fn)


@MODES
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape", [(2, 48, 48, 4, 4, 16), (1, 37, 75, 4, 2, 8)], ids=["square", "gqa-cross"]
)
def test_matches_jax_nn(shape, causal, mode, monkeypatch):
    q, k, v = _inputs(shape, jnp.float64)
    dout = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape))
    ours = lambda q, k, v: cfj.attention(q, k, v, causal=causal, causal_align="top-left", block_q=16, block_k=24)  # noqa: E731
    ref = lambda q, k, v: _plain(q, k, v, causal)  # noqa: E731
    grad = lambda fn: jax.value_and_grad(_loss(fn, dout), argnums=(0, 1, 2))  # noqa: E731
    ours = _compiled(ours, mode, monkeypatch)
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


@MODES
def test_variants_match_plain_jnp(mode, monkeypatch):
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

    fn = _compiled(ours, mode, monkeypatch)
    value_and_grad = jax.value_and_grad(lambda q, k, v, *a: jnp.sum(fn(q, k, v, *a) * dout), argnums=(0, 1, 2))
    (l_ours, g_ours) = value_and_grad(q, k, v, cu_q, cu_k, used, slopes)
    (l_ref, g_ref) = jax.value_and_grad(lambda q, k, v: jnp.sum(ref(q, k, v) * dout), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(fn(q, k, v, cu_q, cu_k, used, slopes), ref(q, k, v), rtol=0, atol=1e-10)
    np.testing.assert_allclose(l_ours, l_ref, rtol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv"), g_ours, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=name)
    assert not np.asarray(g_ours[1])[cu_k[1]:cu_k[2]].any()  # keys past seqused_k: no gradient


@pytest.mark.parametrize("route", ["buffer", "pure"])
def test_variant_values_are_checked_eagerly_or_when_the_jit_function_runs(route, monkeypatch):
    if route == "buffer" and cfj._buffer_callback is None:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback")
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", route)
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


@MODES
def test_bias_and_mask_match_plain_jnp(mode, monkeypatch):
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

    fn = _compiled(ours, mode, monkeypatch)
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


# ---------------------------------------------------------------------------------------------------
# The callback routes under jit, and jax.vmap (the mapped axis folded into the batch, or one call per element)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["buffer", "pure"])
def test_jit_lowers_to_the_chosen_callback(route, monkeypatch):
    """CUFLASH_JAX_CALLBACK picks the custom call the forward and the backward lower to (on the CPU here:
    buffer_callback's and pure_callback's CPU targets)."""
    if route == "buffer" and cfj._buffer_callback is None:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback")
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", route)
    assert cfj.callback_route() == route
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    loss = lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True) ** 2)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).as_text()
    targets = [line.split("@")[1].split("(")[0] for line in text.splitlines() if "custom_call @" in line]
    want = "xla_buffer_python_cpu_callback" if route == "buffer" else "xla_ffi_python_cpu_callback"
    assert targets == [want, want], targets  # the forward, then the backward


def test_callback_route_setting_is_checked(monkeypatch):
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "host")
    with pytest.raises(ValueError, match="CUFLASH_JAX_CALLBACK must be one of 'auto', 'buffer', 'pure'; got 'host'"):
        cfj.callback_route()
    if cfj._buffer_callback is not None:  # a GPU backend without CuPy to read its buffers: the host route
        monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "auto")
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(cfj, "_have_cupy", lambda: False)
        assert cfj.callback_route() == "pure"
        monkeypatch.setattr(cfj, "_have_cupy", lambda: True)
        assert cfj.callback_route() == "buffer"
    monkeypatch.setattr(cfj, "_buffer_callback", None)
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "auto")
    assert cfj.callback_route() == "pure"
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "buffer")
    with pytest.raises(RuntimeError, match="needs jax.experimental.buffer_callback"):
        cfj.callback_route()


@pytest.fixture
def calls(monkeypatch):
    """Counts of the calls that reach cuflash.attention and cuflash.attention_backward."""
    import cuflash

    counts = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(cuflash, "attention", counted("forward", cuflash.attention))
    monkeypatch.setattr(cuflash, "attention_backward", counted("backward", cuflash.attention_backward))
    return counts


@pytest.mark.parametrize("mode", ["eager", "jit", "jit-pure"])
def test_vmap_forward_and_grad_match_a_loop(mode, monkeypatch, calls):
    """jax.vmap over a leading axis (q, k, v all mapped, or k and v shared), with grad inside and jit around:
    the same values as calling the function element by element, from one call of cuflash per direction."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 2, 24, 4, 16)), dtype=jnp.float32) for _ in range(3))

    def f(a, b, c):
        return cfj.attention(a, b, c, causal=True, window_size=(5, 0))

    def loss(a, b, c):
        return (f(a, b, c) ** 2).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    wrap = functools.partial(_compiled, mode=mode, monkeypatch=monkeypatch)
    out = wrap(jax.vmap(f))(q, k, v)
    assert calls == {"forward": 1, "backward": 0}  # folded: one call for the 3 x 2 sequences
    grads = wrap(jax.vmap(grad))(q, k, v)
    assert calls == {"forward": 2, "backward": 1}
    shared = wrap(jax.vmap(f, in_axes=(0, None, None)))(q, k[0], v[0])
    assert calls["forward"] == 3
    for i in range(3):
        np.testing.assert_allclose(out[i], f(q[i], k[i], v[i]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(shared[i], f(q[i], k[0], v[0]), rtol=1e-6, atol=1e-6)
        for g, w in zip(grads, grad(q[i], k[i], v[i])):
            np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_folds_other_axes_nested_maps_and_variant_arrays(jit, calls):
    """A mapped axis that is not the first (in_axes=2, out_axes=1), vmap of vmap, and the variant arrays that
    fold with the batch: ALiBi slopes (heads,) shared and (batch, heads) mapped, seqused_k mapped, a 2-d
    attn_mask shared, a bias mapped (forward) and shared (backward): all equal to a loop, one call per
    direction."""
    rng = np.random.default_rng(8)
    n, batch, seqlen, heads, d = 3, 2, 12, 4, 8
    x = lambda *shape: jnp.asarray(rng.standard_normal(shape))  # noqa: E731
    q, k, v = (x(batch, seqlen, n, heads, d) for _ in range(3))  # mapped along axis 2
    slopes = jnp.asarray(rng.uniform(0, 0.5, (n, batch, heads)), jnp.float32)
    used = jnp.asarray(rng.integers(1, seqlen + 1, (n, batch)), jnp.int32)
    mask = jnp.asarray(rng.random((seqlen, seqlen)) < 0.8)
    bias = x(n, 1, heads, seqlen, seqlen)

    def f(q, k, v, slopes, used, bias):
        return cfj.attention(q, k, v, causal=True, alibi_slopes=slopes, seqused_k=used, attn_mask=mask, bias=bias)

    wrap = jax.jit if jit else (lambda fn: fn)
    mapped = wrap(jax.vmap(f, in_axes=(2, 2, 2, 0, 0, 0), out_axes=1))
    out = mapped(q, k, v, slopes, used, bias)
    assert calls["forward"] == 1
    for i in range(n):
        want = f(q[:, :, i], k[:, :, i], v[:, :, i], slopes[i], used[i], bias[i])
        np.testing.assert_allclose(out[:, i], want, rtol=1e-12, atol=1e-12)

    def loss(q, k, v, shared_bias):  # heads-only slopes, a bias shared by all elements: the backward folds
        out = cfj.attention(q, k, v, alibi_slopes=slopes[0, 0], bias=shared_bias, window_size=(4, 2))
        return jnp.sum(out ** 2)

    shared_bias = x(1, heads, seqlen, seqlen)
    grads = wrap(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(2, 2, 2, None)))(q, k, v, shared_bias)
    assert calls["backward"] == n  # a bias in the backward: each element's dbias is its own, one call each
    grads = wrap(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(2, 2, 2, None)))(q, k, v, None)
    assert calls["backward"] == n + 1
    for i in range(n):
        want = jax.grad(loss, argnums=(0, 1, 2))(q[:, :, i], k[:, :, i], v[:, :, i], None)
        for g, w in zip(grads, want):
            np.testing.assert_allclose(g[i], w, rtol=1e-10, atol=1e-12)

    twice = wrap(jax.vmap(jax.vmap(lambda q, k, v: cfj.attention(q, k, v, causal=True))))
    qq, kk, vv = (x(2, n, batch, seqlen, heads, d) for _ in range(3))
    before = calls["forward"]
    out = twice(qq, kk, vv)
    assert calls["forward"] == before + 1
    np.testing.assert_allclose(out[1, 2], cfj.attention(qq[1, 2], kk[1, 2], vv[1, 2], causal=True), atol=1e-12)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_runs_one_call_per_element_where_the_batch_index_matters(jit, calls):
    """Dropout (its counter reads the batch index), a packed batch (no batch axis) and a bias mapped in the
    backward run element by element: the loop's values, one call each."""
    rng = np.random.default_rng(9)
    n = 3
    q, k, v = (jnp.asarray(rng.standard_normal((n, 2, 10, 2, 8))) for _ in range(3))
    wrap = jax.jit if jit else (lambda fn: fn)
    drop = lambda q, k, v: cfj.attention(q, k, v, dropout_p=0.3, dropout_seed=7)  # noqa: E731
    out = wrap(jax.vmap(drop))(q, k, v)
    assert calls["forward"] == n
    for i in range(n):
        np.testing.assert_allclose(out[i], drop(q[i], k[i], v[i]), rtol=0, atol=1e-12)

    cu = jnp.asarray([0, 4, 10], jnp.int32)
    packed = lambda q, k, v: cfj.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,  # noqa: E731
                                           max_seqlen_k=6, causal=True)
    flat = [a.reshape(n, 20, 2, 8)[:, :10] for a in (q, k, v)]
    out = wrap(jax.vmap(packed))(*flat)
    for i in range(n):
        np.testing.assert_allclose(out[i], packed(*(a[i] for a in flat)), rtol=0, atol=1e-12)

    bias = jnp.asarray(rng.standard_normal((n, 2, 1, 10, 10)))
    grad = jax.grad(lambda q, bias: jnp.sum(cfj.attention(q, k[0], v[0], bias=bias) ** 2), argnums=(0, 1))
    before = calls["backward"]
    g_q, g_bias = wrap(jax.vmap(grad))(q, bias)
    assert calls["backward"] == before + n
    for i in range(n):
        want = grad(q[i], bias[i])
        np.testing.assert_allclose(g_q[i], want[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g_bias[i], want[1], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# The buffer route's GPU side on the CPU: a stand-in CuPy (tests/_fake_cupy.py: launches recorded, nothing
# computed) and JAX's CPU buffers presented to the callback as CUDA buffers on an XLA stream
# ---------------------------------------------------------------------------------------------------

_XLA_STREAM = 0x5A


@pytest.fixture
def cuda_buffers(monkeypatch):
    """``(recorder, seen, copies)``: the stand-in's recorded launches; the addresses of the input and output
    buffers of each callback run (``[(ins, outs)]``); the device-to-device copies queued (``[(dst, src)]``)."""
    import ctypes
    import types

    from conftest import gpu_skip_reason

    gpu_skip_reason()  # (decided before the stand-in is in sys.modules)
    if cfj._buffer_callback is None:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback")
    from _fake_cupy import _Memory, install

    from cuflash._cuda import attention

    module, recorder = install(monkeypatch)
    streams = [types.SimpleNamespace(ptr=0)]

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            streams.append(self)

        def __exit__(self, *exc):
            streams.pop()

    class Device:
        def __init__(self, ordinal):
            assert ordinal == 0

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    copies = []

    def copy(dst, src, nbytes, stream=None):
        copies.append((dst.ptr, src.ptr))
        ctypes.memmove(dst.ptr, src.ptr, nbytes)

    module.cuda.Device, module.cuda.ExternalStream = Device, Stream
    module.cuda.UnownedMemory = lambda ptr, size, owner, ordinal: types.SimpleNamespace(ptr=ptr, size=size)
    module.cuda.MemoryPointer = lambda mem, offset: (ctypes.c_char * mem.size).from_address(mem.ptr + offset)
    module.cuda.get_current_stream = lambda: streams[-1]
    monkeypatch.setattr(attention._RUNTIME, "current_stream", module.cuda.get_current_stream)
    monkeypatch.setattr(_Memory, "copy_from_device_async", copy, raising=False)
    monkeypatch.setattr(cfj, "_streams", {})

    class Buffer:  # what the callback reads of an XLA FFI buffer on a GPU
        def __init__(self, buf):
            self.shape, self.dtype = buf.shape, buf.dtype
            self.__cuda_array_interface__ = {"data": (np.asarray(buf).__array_interface__["data"][0], False)}

        def __dlpack_device__(self):
            return 2, 0  # (kDLCUDA, device 0)

    seen = []
    buffer_callback = cfj._buffer_callback

    def as_cuda(callback, shapes, **kwargs):
        def call(ctx, outs, *args):
            outs, args = (jax.tree_util.tree_map(Buffer, x) for x in (outs, args))
            seen.append(tuple([b.__cuda_array_interface__["data"][0] for b in jax.tree_util.tree_leaves(x)]
                              for x in (args, outs)))
            return callback(types.SimpleNamespace(stream=_XLA_STREAM), outs, *args)
        return buffer_callback(call, shapes, **kwargs)

    monkeypatch.setattr(cfj, "_buffer_callback", as_cuda)
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "buffer")
    return recorder, seen, copies


def _stand_in_kernel_call(monkeypatch) -> dict:
    """jaxlib's kernel-call classes stood in for (``made``: the last kernel's and call's arguments), the flat PTX, the
    planning views and the switch (CUFLASH_JAX_KERNEL_CALL=1), for lowering the kernel route for CUDA on the CPU."""
    import types

    import cupy
    import jax._src.lib

    from cuflash._cuda import compile as cuda_compile

    made = {}

    class Kernel:
        def __init__(self, *args):
            made["kernel"] = args

    class Call:
        def __init__(self, kernel, gx, gy, gz, params):
            made["call"] = ((gx, gy, gz), params)

        def to_proto(self, name, metadata):
            return b"proto"

    triton = types.SimpleNamespace(TritonKernel=Kernel, TritonKernelCall=Call,
                                   create_array_parameter=lambda zero, align: ("array", zero, align),
                                   create_scalar_parameter=lambda value, dtype: (dtype, value))
    monkeypatch.setattr(jax._src.lib, "gpu_triton", triton, raising=False)
    monkeypatch.setattr(cuda_compile, "flat_ptx", lambda spec, cc, name=None: (f"// {name}", "_Z4flat"))
    monkeypatch.setattr(cfj, "_cupy_view", lambda ordinal, ptr, shape, dtype: cupy.empty(shape, dtype))
    monkeypatch.setattr(cfj, "_have_kernel_call", lambda: True)
    monkeypatch.setenv("CUFLASH_JAX_KERNEL_CALL", "1")
    return made


def test_kernel_call_route_lowers_the_planned_forward_for_cuda(cuda_buffers, monkeypatch):
    """CUFLASH_JAX_KERNEL_CALL=1: lowered for CUDA, a planned forward is jaxlib's kernel call of the kernel's flat
    entry point, with the grid and the parameters of the launch cuflash.attention makes on the same layouts (after
    its five arrays: the sizes, strides and scale, then VariantParams field by field), q, k, v its operands and out,
    lse its results; lowered for the CPU, and for a call the launcher does not plan as one flat launch, the buffer
    callback. (The stand-in CuPy records the launch; jaxlib's kernel-call classes are stood in for.)"""
    import zlib

    import cupy

    import cuflash
    from cuflash._cuda.spec import VARIANT_PARAMS_DTYPE

    recorder, _, _ = cuda_buffers
    made = _stand_in_kernel_call(monkeypatch)
    cfj._kernel_opaque.cache_clear()
    opaques, made_opaque = [], cfj._kernel_opaque
    monkeypatch.setattr(cfj, "_kernel_opaque", lambda *key: (opaques.append(made_opaque(*key)), opaques[-1])[1])
    q, k, v = _inputs((2, 96, 160, 4, 2, 64), jnp.bfloat16, seed=5)
    f = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True, softmax_scale=0.2))
    text = f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "custom_call" in line]
    assert len(call) == 1 and "@triton_kernel_call(%arg0, %arg1, %arg2)" in call[0], call
    assert "api_version = 2" in call[0] and [zlib.decompress(o) for o in opaques] == [b"proto"]
    name, warps, *rest = made["kernel"]
    assert name == "_Z4flat" and "flash_fwd_sm90_flat_kernel<" in next(a for a in rest if isinstance(a, str)
                                                                       and a.startswith("//"))
    grid, params = made["call"]
    assert params[:5] == [("array", 0, 16)] * 5  # q, k, v, out, lse: XLA's buffers in order
    # the launch cuflash.attention makes (the stand-in records each argument in 8-byte words; VariantParams whole)
    recorder.take()
    cuflash.attention(*(cupy.asarray(np.asarray(x)) for x in (q, k, v)), causal=True, softmax_scale=0.2)
    (kernel, want_grid, block, smem, _, args), = (x for x in recorder.take() if len(x) == 6)
    assert "flash_fwd_sm90_kernel<" in kernel and want_grid == grid and block == (32 * warps, 1, 1)
    kinds = {"i32": np.int32, "i64": np.int64, "u64": np.uint64, "fp32": np.float32}
    got = [np.array(value, kinds[dtype]).tobytes() for dtype, value in params[5:]]
    record = np.frombuffer(args[-1][:VARIANT_PARAMS_DTYPE.itemsize], VARIANT_PARAMS_DTYPE)[0]
    want = [a[:len(g)] for a, g in zip(args[5:-1], got)] + [record[n].tobytes() for n in VARIANT_PARAMS_DTYPE.names]
    assert got == want
    # the CPU, and a call the launcher does not plan as one launch (ALiBi slopes: an array read at each run)
    assert "xla_buffer_python_cpu_callback" in f.lower(q, k, v).as_text()
    slopes = jnp.linspace(0.1, 0.8, 4, dtype=jnp.float32)
    g = jax.jit(lambda q, k, v: cfj.attention(q, k, v, alibi_slopes=slopes))
    assert "triton_kernel_call" not in g.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()


def test_a_large_forward_the_launcher_runs_by_tma_takes_the_buffer_callback(cuda_buffers, monkeypatch):
    """Lowered for CUDA, a forward that the launcher runs from its TMA entry point (no flat twin) takes the buffer
    callback above KERNEL_CALL_MAX_TMA_FLOP (its FLOPs counted from the layouts, halved when causal), the kernel call
    (of the cp.async kernel's flat entry point) below it, and the kernel call whatever its size where the launcher
    plans no TMA."""
    from cuflash._cuda import tensor_map

    _stand_in_kernel_call(monkeypatch)
    monkeypatch.setattr(tensor_map, "available", lambda: True)
    q, k, v = _inputs((2, 96, 160, 4, 2, 128), jnp.bfloat16, seed=6)
    flop = 4 * 2 * 4 * 96 * 160 * 128 / 2

    def lowered(limit):
        monkeypatch.setattr(cfj, "KERNEL_CALL_MAX_TMA_FLOP", limit)
        cfj._kernel_opaque.cache_clear()
        f = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True))  # (a new function: no cached lowering)
        return f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()

    assert "triton_kernel_call" in lowered(flop) and "xla_buffer_python" not in lowered(flop)
    assert "triton_kernel_call" not in lowered(flop - 1) and "xla_buffer_python" in lowered(flop - 1)
    monkeypatch.setattr(tensor_map, "available", lambda: False)  # (no TMA: the kernel call at any size)
    assert "triton_kernel_call" in lowered(0)


def test_a_large_backward_the_launcher_runs_by_tma_takes_the_buffer_callback(cuda_buffers, monkeypatch):
    """The backward likewise (TMA_BACKWARD; its FLOPs 2.5 times the forward's): between the two sizes, the forward
    by the kernel call and the backward by the buffer callback."""
    from cuflash._cuda import attention, tensor_map

    _stand_in_kernel_call(monkeypatch)
    monkeypatch.setattr(tensor_map, "available", lambda: True)
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)
    monkeypatch.setattr(cfj, "BACKWARD_KERNEL_CALLS", True)
    q, k, v = _inputs((2, 96, 160, 4, 2, 128), jnp.bfloat16, seed=9)
    flop = 4 * 2 * 4 * 96 * 160 * 128 / 2

    def lowered(limit):
        monkeypatch.setattr(cfj, "KERNEL_CALL_MAX_TMA_FLOP", limit)
        cfj._kernel_opaque.cache_clear()
        cfj._backward_kernel_calls.cache_clear()
        loss = lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True).astype(jnp.float32))  # noqa: E731
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return g.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()

    everything = lowered(2.5 * flop)
    assert "triton_kernel_call" in everything and "xla_buffer_python" not in everything
    split = lowered(2 * flop)
    assert "triton_kernel_call" in split and "xla_buffer_python" in split


@pytest.mark.parametrize("deterministic,heads_kv", [(False, 2), (True, 4)])
def test_backward_kernel_calls_are_the_backward_s_launches(deterministic, heads_kv, cuda_buffers, monkeypatch):
    """cuflash.jax.BACKWARD_KERNEL_CALLS: lowered for CUDA, a planned backward is one kernel call per launch of
    cuflash.attention_backward on the same layouts, in order, with its kernel (the flat entry point where it takes a
    VariantParams), grid and scalars; each call's operands are the buffers its kernel takes, in parameter order,
    and the ones it writes are results aliased to them (GQA's sums and the deterministic dQ pass included)."""
    import types

    import cupy

    import cuflash
    from cuflash._cuda import compile as cuda_compile
    from cuflash._cuda.spec import VARIANT_PARAMS_DTYPE

    recorder, _, _ = cuda_buffers
    made = []

    class Kernel:
        def __init__(self, *args):
            self.name = args[0]

    class Call:
        def __init__(self, kernel, gx, gy, gz, params):
            made.append((kernel.name, (gx, gy, gz), params))

        def to_proto(self, name, metadata):
            return str(len(made)).encode()

    triton = types.SimpleNamespace(TritonKernel=Kernel, TritonKernelCall=Call,
                                   create_array_parameter=lambda zero, align: ("array", zero, align),
                                   create_scalar_parameter=lambda value, dtype: (dtype, value))
    import jax._src.lib

    monkeypatch.setattr(jax._src.lib, "gpu_triton", triton, raising=False)
    monkeypatch.setattr(cuda_compile, "flat_ptx", lambda spec, cc, name=None: ("", name or spec.flat_name))
    monkeypatch.setattr(cfj, "_cupy_view", lambda ordinal, ptr, shape, dtype: cupy.empty(shape, dtype))
    monkeypatch.setattr(cfj, "_have_kernel_call", lambda: True)
    monkeypatch.setattr(cfj, "BACKWARD_KERNEL_CALLS", True)
    monkeypatch.setenv("CUFLASH_JAX_KERNEL_CALL", "1")
    cfj._kernel_opaque.cache_clear()
    cfj._backward_kernel_calls.cache_clear()
    q, k, v = _inputs((2, 96, 160, 4, heads_kv, 64), jnp.bfloat16, seed=8)
    do = jnp.ones_like(q)

    def f(q, k, v):
        return cfj.attention(q, k, v, causal=True, deterministic=deterministic)

    step = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    text = step.trace(q, k, v, do).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @triton_kernel_call" in line]
    forward, *made = made  # (the forward's kernel call first)
    assert "flash_fwd_sm90_flat_kernel<" in forward[0]
    assert "xla_buffer_python" not in text and len(calls) == 1 + len(made)
    # the launches cuflash.attention_backward makes on the same layouts (the stand-in records them)
    cq, ck, cv, cdo = (cupy.asarray(np.asarray(x)) for x in (q, k, v, do))
    out, lse = cuflash.attention(cq, ck, cv, causal=True, return_lse=True)
    recorder.take()
    cuflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=True, deterministic=deterministic)
    launches = [x for x in recorder.take() if len(x) == 6]
    assert len(launches) == len(made) == 3 + (heads_kv < 4)
    kinds = {"i32": np.int32, "i64": np.int64, "u64": np.uint64, "fp32": np.float32}
    for (name, grid, params), (kernel, want_grid, _, _, _, args), line in zip(made, launches, calls[1:]):
        assert want_grid == grid
        assert name == (kernel.replace("_kernel<", "_flat_kernel<") if len(args[-1]) >= VARIANT_PARAMS_DTYPE.itemsize
                        else kernel), (name, kernel)
        assert len(params) == (len(args) - 1 + len(VARIANT_PARAMS_DTYPE.names) if "_flat_" in name else len(args))
        has_vp = len(args[-1]) >= VARIANT_PARAMS_DTYPE.itemsize  # (the last argument a VariantParams)
        got, want, i = [], [], 0
        for param, arg in zip(params, args[:-1] if has_vp else args):
            if param[0] == "array":
                i += 1
                continue
            got.append(np.array(param[1], kinds[param[0]]).tobytes())
            want.append(arg[:len(got[-1])])
        if has_vp:  # its VariantParams, field by field
            record = np.frombuffer(args[-1][:VARIANT_PARAMS_DTYPE.itemsize], VARIANT_PARAMS_DTYPE)[0]
            got += [np.array(p[1], kinds[p[0]]).tobytes() for p in params[len(args) - 1:]]
            want += [record[n].tobytes() for n in VARIANT_PARAMS_DTYPE.names]
        assert got == want, name
        operands = line[line.index("(") + 1:line.index(")")].count("%") if "()" not in line else 0
        assert operands == i and "output_operand_aliases" in line


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_a_kernel_call_that_cannot_be_built_falls_back_to_the_callback(mode, monkeypatch):
    """Where the kernel call cannot be built (here: a jaxlib whose TritonKernel takes other arguments), the default
    mode warns and lowers the call to the buffer callback; CUFLASH_JAX_KERNEL_CALL=1 raises."""
    def broken(*key):
        raise TypeError("__init__(): incompatible function arguments")

    monkeypatch.setattr(cfj, "_have_kernel_call", lambda: True)
    monkeypatch.setattr(cfj, "_kernel_opaque", broken)
    monkeypatch.setenv("CUFLASH_JAX_KERNEL_CALL", mode)
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "buffer")
    if cfj._buffer_callback is None:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback")
    q, k, v = _inputs((1, 64, 64, 2, 2, 64), jnp.float16)
    lowered = jax.jit(lambda q, k, v: cfj.attention(q, k, v)).trace(q, k, v)
    if mode == "1":
        with pytest.raises(TypeError, match="incompatible function arguments"):
            lowered.lower(lowering_platforms=("cuda",))
        return
    with pytest.warns(RuntimeWarning, match="the kernel call could not be built .TypeError: __init__"):
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python_gpu_callback" in text and "triton_kernel_call" not in text


@pytest.mark.parametrize("available", [True, False])
def test_kernel_call_switch_is_read_from_the_environment(available, monkeypatch):
    monkeypatch.setattr(cfj, "_have_kernel_call", lambda: available)
    for value, want in (("1", True), ("0", False), ("", available), ("auto", available)):
        monkeypatch.setenv("CUFLASH_JAX_KERNEL_CALL", value)
        if value == "1" and not available:
            with pytest.raises(RuntimeError, match="CUFLASH_JAX_KERNEL_CALL=1 needs jaxlib's CUDA plugin"):
                cfj.kernel_calls_enabled()
            continue
        assert cfj.kernel_calls_enabled() is want
    monkeypatch.setenv("CUFLASH_JAX_KERNEL_CALL", "yes")
    with pytest.raises(ValueError, match="CUFLASH_JAX_KERNEL_CALL must be one of 'auto', '0', '1'; got 'yes'"):
        cfj.kernel_calls_enabled()


def _named(launches, names):
    """Planned launches (kernel, grid, stream, arguments) with the 8-byte arguments that are addresses in
    ``names`` replaced by their names; CuPy launches (kernel, grid, arguments) with arrays by shape and strides."""
    named = []
    for launch in launches:
        if len(launch) == 3:
            spec, grid, args = launch
            named.append((spec, grid, [a.tobytes() if isinstance(a, np.generic) else names.get(
                a.data.ptr, (a.shape, a.strides)) if hasattr(a, "shape") else a for a in args]))
            continue
        kernel, grid, _, _, stream, args = launch
        named.append((kernel, grid, stream, [names.get(int.from_bytes(a, "little"), a) if len(a) == 8 else a
                                             for a in args]))
    return named


def test_buffer_route_runs_the_launcher_s_plan_on_xla_s_buffers(cuda_buffers, calls):
    """Under jit on a GPU, the forward's kernel writes out and lse into XLA's output buffers (no copy) and the
    backward's gradients are copied into XLA's, on XLA's stream; the front door's checks run once per traced
    call (its first run plans it) and the launches are those cuflash.attention makes on the same arrays."""
    import cupy

    import cuflash

    recorder, seen, copies = cuda_buffers
    rng = np.random.default_rng(11)
    q, k, v, do = (jnp.asarray(rng.standard_normal((2, 64, 4, 64)), jnp.bfloat16) for _ in range(4))
    f = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True, window_size=(32, 0)))
    step = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: cfj.attention(*a, causal=True, window_size=(32, 0)),
                                              q, k, v)[1](do))
    cq, ck, cv, cdo = (cupy.asarray(np.asarray(x)) for x in (q, k, v, do))
    recorder.take()
    out, lse = cuflash.attention(cq, ck, cv, causal=True, window_size=(32, 0), return_lse=True)
    names = {a.data.ptr: name for a, name in zip((cq, ck, cv, out, lse), ("q", "k", "v", "out", "lse"))}
    want = _named(recorder.take(), names)
    grads = cuflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=True, window_size=(32, 0))
    names.update({cdo.data.ptr: "do", **{g.data.ptr: name for g, name in zip(grads, ("dq", "dk", "dv"))}})
    want_bwd = _named(recorder.take(), names)
    calls["forward"] = calls["backward"] = 0
    for _ in range(3):
        jax.block_until_ready(f(q, k, v))
        (ins, outs), = seen[-1:]
        launches = recorder.take()
        assert len(launches) == 1 and launches[0][4] == _XLA_STREAM  # one planned launch, on XLA's stream
        assert _named(launches, dict(zip((*ins, *outs), ("q", "k", "v", "out", "lse")))) == \
            [(kernel, grid, _XLA_STREAM, args) for kernel, grid, _, args in want]
    assert copies == [] and calls == {"forward": 0, "backward": 0}

    for _ in range(2):
        before = len(copies)
        jax.block_until_ready(step(q, k, v, do))
        (_, fwd_outs), (ins, outs) = seen[-2:]
        assert ins[4:] == fwd_outs  # (the backward reads the forward's out and lse where XLA had them written)
        launches, new = recorder.take(), copies[before:]
        assert len(launches[0]) == 6 and launches[0][4] == _XLA_STREAM  # the forward, planned
        assert [dst for dst, _ in new] == list(outs)  # dq, dk, dv: the launcher's, copied into XLA's buffers
        names = dict(zip((*ins, *(src for _, src in new)), ("do", "q", "k", "v", "out", "lse", "dq", "dk", "dv")))
        # the backward's launches: the same kernels and grids as attention_backward's, reading and writing the same
        # arrays in the same argument slots (its workspaces are allocated at each call: other addresses), on XLA's
        # stream
        got_bwd = _named(launches[1:], names)
        assert all(stream == _XLA_STREAM for _, _, stream, _ in got_bwd)
        assert [(kernel, grid, [a for a in args if isinstance(a, str)]) for kernel, grid, _, args in got_bwd] == \
            [(kernel, grid, [a for a in args if isinstance(a, str)]) for kernel, grid, _, args in want_bwd]
    assert calls == {"forward": 0, "backward": 0}


def test_buffer_route_goes_through_the_front_door_where_nothing_is_planned(cuda_buffers, calls):
    """Variant arrays (their values are checked at each call) and a bias: cuflash.attention at every run, its
    results copied into XLA's buffers."""
    recorder, seen, copies = cuda_buffers
    rng = np.random.default_rng(12)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 32, 4, 64)), jnp.float16) for _ in range(3))
    slopes = jnp.asarray(rng.uniform(0, 0.5, 4), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    for n, f in enumerate((jax.jit(lambda q, k, v: cfj.attention(q, k, v, alibi_slopes=slopes)),
                           jax.jit(lambda q, k, v: cfj.attention(q, k, v, bias=bias)))):
        for i in range(2):
            jax.block_until_ready(f(q, k, v))
            assert calls["forward"] == 2 * n + i + 1
            assert [dst for dst, _ in copies[-2:]] == list(seen[-1][1])  # out, lse
    assert recorder.take()


# ---------------------------------------------------------------------------------------------------
# On the GPU under jit: the kernels on XLA's stream (buffer_callback), no host transfer, vmap, the overhead
# ---------------------------------------------------------------------------------------------------


def _jax_gpu():
    """Skip unless JAX has a GPU device (CuPy is checked by the gpu marker); the GPU as a JAX device."""
    pytest.importorskip("cupy")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip(f"no JAX GPU device (JAX {jax.__version__}, backend {jax.default_backend()})")
    return gpus[0]


def _buffer_route_or_skip():
    if cfj.callback_route() != "buffer":
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback: jit runs through the host")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [None, "br", "tl"])
@pytest.mark.parametrize("dtname", ["float16", "bfloat16"])
def test_jit_on_gpu_forward_and_backward_within_budget(dtname, causal):
    """jit(forward) and jit(vjp) on the GPU, held to the float64 truth's error budget (tests/_helpers.py), as
    the CuPy tests hold cuflash.attention; and the compiled function calls buffer_callback's GPU target."""
    from _gpu_helpers import ALIGN, DTYPES, variant_of
    from _helpers import assert_within_budget, float64_truth, random_inputs, rounding_floor

    from cuflash import reference

    gpu = _jax_gpu()
    dtype = DTYPES[dtname]
    q, k, v, do = random_inputs(2, 200, 264, 4, 2, 64, dtype, seed=3)
    scale, variant = 1 / np.sqrt(64), variant_of(causal)
    out_t, lse_t, grads_t = float64_truth(q, k, v, do, scale=scale, variant=variant)
    out_n, _ = reference.naive_forward(q, k, v, scale=scale, variant=variant)
    grads_n = reference.naive_backward(do, q, k, v, scale=scale, variant=variant)
    is_causal, align = ALIGN[causal]

    def f(q, k, v):
        return cfj.attention(q, k, v, causal=is_causal, causal_align=align)

    fwd = jax.jit(f)
    bwd = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    jq, jk, jv, jdo = (jax.device_put(x, gpu) for x in (q, k, v, do))
    text = bwd.lower(jq, jk, jv, jdo).as_text()
    if cfj.callback_route() == "buffer" and cfj.kernel_calls_enabled() and cfj.BACKWARD_KERNEL_CALLS:
        assert "triton_kernel_call" in text  # (XLA launches the planned kernels: jaxlib's kernel call)
    elif cfj.callback_route() == "buffer":
        assert "xla_buffer_python_gpu_callback" in text
    out = np.asarray(fwd(jq, jk, jv))
    assert not np.isnan(out.astype(np.float32)).any()
    assert_within_budget(out, out_t, out_n, 2, rounding_floor(out_t, dtype), "out")
    for name, g, gt, gn in zip(("dq", "dk", "dv"), bwd(jq, jk, jv, jdo), grads_t, grads_n):
        g = np.asarray(g)
        assert g.dtype == dtype and not np.isnan(g.astype(np.float32)).any(), name
        assert_within_budget(g, gt, gn, 3, rounding_floor(gt, dtype) + 1e-4, name)


@pytest.mark.gpu
def test_jit_on_gpu_makes_no_host_transfer():
    """Under jax.transfer_guard("disallow"), a compiled forward + backward on device arrays runs (the kernels
    read and write XLA's buffers in place: buffer_callback), and so does a vmap of it."""
    gpu = _jax_gpu()
    _buffer_route_or_skip()
    q, k, v = _inputs((2, 256, 256, 8, 2, 64), jnp.bfloat16, seed=4)
    q, k, v = (jax.device_put(x, gpu) for x in (q, k, v))
    dout = jax.device_put(jnp.ones(q.shape, jnp.bfloat16), gpu)

    def step(q, k, v, dout):
        out, pullback = jax.vjp(lambda *a: cfj.attention(*a, causal=True), q, k, v)
        return out, pullback(dout)

    step = jax.jit(step)
    stacked = jax.jit(jax.vmap(step))
    qs, ks, vs, ds = (jnp.stack([x, x]) for x in (q, k, v, dout))
    want = jax.block_until_ready(step(q, k, v, dout))  # compiled (and kernels compiled) outside the guard
    jax.block_until_ready(stacked(qs, ks, vs, ds))
    with jax.transfer_guard("disallow"):
        got = jax.block_until_ready(step(q, k, v, dout))
        got_vmap = jax.block_until_ready(stacked(qs, ks, vs, ds))
        fresh = jax.block_until_ready(jax.jit(lambda q, k, v: cfj.attention(q, k, v, window_size=(64, 0)))(q, k, v))
    assert fresh.shape == q.shape
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.devices() == {gpu}
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got_vmap[0][1], np.float32), np.asarray(want[0], np.float32), rtol=0,
                               atol=2e-2)


@contextlib.contextmanager
def _same_kernel_as_the_route(monkeypatch):
    """A context in which cuflash.attention on CuPy runs the kernel a jitted planned forward runs: with jaxlib's
    kernel call, the cp.async kernel's flat entry point (a kernel call cannot launch the TMA entry point, which the
    front door takes, with another tile at d 64: the same values, in another rounding order)."""
    from cuflash._cuda import attention as cuda_attention

    with monkeypatch.context() as patch:
        if cfj.kernel_calls_enabled():
            patch.setattr(cuda_attention, "TMA_FORWARD", False)
        yield


@pytest.mark.gpu
def test_jit_on_gpu_forward_writes_into_xla_s_buffers(monkeypatch):
    """After its first call (which checks and plans), a jitted forward takes no memory from CuPy's allocator: the
    kernel writes out and lse into XLA's output buffers. Its values are cuflash.attention's on the same arrays,
    bit for bit, as are those of a call the launcher does not plan (ALiBi slopes: the front door at every call,
    its results copied into XLA's buffers)."""
    import cupy

    import cuflash

    gpu = _jax_gpu()
    _buffer_route_or_skip()
    q, k, v = (jax.device_put(x, gpu) for x in _inputs((2, 200, 200, 8, 2, 64), jnp.float16, seed=12))
    slopes = jax.device_put(jnp.linspace(0.1, 0.8, 8, dtype=jnp.float32), gpu)
    planned = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True))
    unplanned = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True, alibi_slopes=slopes))
    first = jax.block_until_ready(planned(q, k, v))
    jax.block_until_ready(unplanned(q, k, v))
    pool = cupy.get_default_memory_pool()
    taken = []
    cupy.cuda.set_allocator(lambda nbytes: (taken.append(nbytes), pool.malloc(nbytes))[1])
    try:
        again = jax.block_until_ready([planned(q, k, v) for _ in range(3)])
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    assert taken == []
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    with _same_kernel_as_the_route(monkeypatch):
        want = cupy.asnumpy(cuflash.attention(cq, ck, cv, causal=True))
    want_alibi = cupy.asnumpy(cuflash.attention(cq, ck, cv, causal=True, alibi_slopes=cupy.from_dlpack(slopes)))
    for out in (first, *again):
        np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(unplanned(q, k, v)), want_alibi)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["buffer", "pure"])
def test_vmap_on_gpu_matches_a_loop(route, monkeypatch):
    """jit(vmap) of the forward and of a deterministic backward on the GPU against a loop of jit calls (the
    folded call runs the same kernels on the same tiles; the pure route runs the NumPy algorithm on the host)."""
    gpu = _jax_gpu()
    if route == "buffer":
        _buffer_route_or_skip()
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", route)
    rng = np.random.default_rng(6)
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((3, 2, 96, 4, 64)), jnp.float16), gpu)
               for _ in range(3))

    def f(q, k, v):
        return cfj.attention(q, k, v, causal=True, deterministic=True)

    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    out = jax.jit(jax.vmap(f))(q, k, v)
    grads = jax.jit(jax.vmap(grad))(q, k, v)
    one, one_grad = jax.jit(f), jax.jit(grad)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(out[i], np.float32), np.asarray(one(q[i], k[i], v[i]), np.float32),
                                   rtol=0, atol=1e-3)
        for g, w in zip(grads, one_grad(q[i], k[i], v[i])):
            np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(w, np.float32), rtol=0, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtname,causal", [((2, 200, 264, 8, 2, 64), "float16", True),
                                                  ((1, 300, 300, 4, 4, 128), "bfloat16", False),
                                                  ((2, 129, 77, 6, 2, 128), "bfloat16", True)])
def test_kernel_call_on_gpu_equals_cupy(shape, dtname, causal, monkeypatch):
    """CUFLASH_JAX_KERNEL_CALL=1 on the GPU: the compiled forward is jaxlib's kernel call (no callback), equal bit for
    bit to cuflash.attention on the same arrays, with no host transfer; its gradients (the backward by the buffer
    callback, from the kernel call's lse) equal the buffer route's."""
    import cupy

    import cuflash

    gpu = _jax_gpu()
    _buffer_route_or_skip()
    monkeypatch.setenv("CUFLASH_JAX_KERNEL_CALL", "1")
    q, k, v = (jax.device_put(x, gpu) for x in _inputs(shape, getattr(jnp, dtname), seed=21))

    def f(q, k, v):  # (a deterministic backward: the routes' gradients compared bit for bit)
        return cfj.attention(q, k, v, causal=causal, deterministic=True)

    fwd = jax.jit(f)
    assert "triton_kernel_call" in fwd.lower(q, k, v).as_text()
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    out = jax.block_until_ready(fwd(q, k, v))
    grads = jax.block_until_ready(grad(q, k, v))
    with jax.transfer_guard("disallow"):
        again = jax.block_until_ready(fwd(q, k, v))
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    with _same_kernel_as_the_route(monkeypatch):
        want = cupy.asnumpy(cuflash.attention(cq, ck, cv, causal=causal))
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(again), want)
    with _same_kernel_as_the_route(monkeypatch):  # (entered with kernel calls on: the buffer route's forward below
        monkeypatch.setenv("CUFLASH_JAX_KERNEL_CALL", "0")  # runs the kernel call's kernel)
        want_grads = jax.block_until_ready(jax.jit(jax.grad(
            lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(q, k, v))
    for g, w in zip(grads, want_grads):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic,heads_kv", [(True, 2), (False, 4)])
def test_backward_kernel_calls_on_gpu_equal_the_buffer_route(deterministic, heads_kv, monkeypatch):
    """cuflash.jax.BACKWARD_KERNEL_CALLS on the GPU: the compiled backward is jaxlib's kernel calls only (no
    callback) and its gradients equal the buffer callback's: bit for bit in the deterministic order, within a bf16
    step where dQ is accumulated atomically."""
    gpu = _jax_gpu()
    _buffer_route_or_skip()
    monkeypatch.setattr(cfj, "BACKWARD_KERNEL_CALLS", True)
    q, k, v = (jax.device_put(x, gpu) for x in _inputs((2, 200, 264, 8, heads_kv, 64), jnp.bfloat16, seed=23))

    def grad():
        f = lambda q, k, v: cfj.attention(q, k, v, causal=True, deterministic=deterministic)  # noqa: E731
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))

    by_kernel = grad()
    text = by_kernel.lower(q, k, v).as_text()
    assert "triton_kernel_call" in text and "xla_buffer_python" not in text
    got = jax.block_until_ready(by_kernel(q, k, v))
    monkeypatch.setattr(cfj, "BACKWARD_KERNEL_CALLS", False)
    want = grad()(q, k, v)
    for g, w in zip(got, want):
        if deterministic:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_jit_overhead_on_gpu_is_printed():
    """Time per call of jit(cuflash.jax.attention) against cuflash.attention on the same CuPy arrays, forward and
    forward + backward (printed, not asserted: run with -s). A small shape is launch-bound: the difference is
    the callback's overhead per call; a large one is bound by the kernels."""
    import time

    import cupy
    import cuflash

    gpu = _jax_gpu()
    rows = []
    for shape in [(1, 128, 128, 8, 8, 64), (2, 1024, 1024, 16, 16, 128)]:
        q, k, v = _inputs(shape, jnp.bfloat16, seed=7)
        q, k, v = (jax.device_put(x, gpu) for x in (q, k, v))
        cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
        cdo = cupy.from_dlpack(jnp.ones_like(q))
        f = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True))
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True).astype(jnp.float32)),
                             argnums=(0, 1, 2)))

        def cupy_fwd():
            return cuflash.attention(cq, ck, cv, causal=True)

        def cupy_fwd_bwd():
            out, lse = cuflash.attention(cq, ck, cv, causal=True, return_lse=True)
            return cuflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=True)

        def per_call(fn, sync, n=100):
            sync(fn())  # compile, warm up
            start = time.perf_counter()
            for _ in range(n):
                r = fn()
            sync(r)
            return (time.perf_counter() - start) / n * 1e6

        cu_sync = lambda *_: cupy.cuda.get_current_stream().synchronize()  # noqa: E731
        jx_sync = lambda r=None: jax.block_until_ready(r)  # noqa: E731
        rows.append((shape, "forward", per_call(cupy_fwd, cu_sync), per_call(lambda: f(q, k, v), jx_sync)))
        rows.append((shape, "fwd+bwd", per_call(cupy_fwd_bwd, cu_sync), per_call(lambda: g(q, k, v), jx_sync)))
    print(f"\ncuflash.jax under jit ({cfj.callback_route()} route, JAX {jax.__version__}, {gpu.device_kind}): "
          "microseconds per call")
    for shape, what, t_cupy, t_jax in rows:
        print(f"  {str(shape):28s} {what:8s} cupy {t_cupy:9.1f}  jax.jit {t_jax:9.1f}  overhead {t_jax - t_cupy:+8.1f}")


# ---------------------------------------------------------------------------------------------------
# CUFLASH_JAX_COMMAND_BUFFER: the planned forward marked command_buffer_compatible (XLA may capture its launch).


def test_command_buffer_setting_is_checked(monkeypatch):
    monkeypatch.delenv("CUFLASH_JAX_COMMAND_BUFFER", raising=False)
    assert cfj.command_buffer_enabled() is False
    monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "1")
    assert cfj.command_buffer_enabled() is True
    monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "0")
    assert cfj.command_buffer_enabled() is False
    monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "yes")
    with pytest.raises(ValueError, match="CUFLASH_JAX_COMMAND_BUFFER must be '0' or '1'; got 'yes'"):
        cfj.command_buffer_enabled()


@pytest.fixture
def marked(monkeypatch):
    """The command_buffer_compatible flag of each buffer_callback made while tracing, in order."""
    if cfj._buffer_callback is None:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback")
    seen, real = [], cfj._buffer_callback

    def spy(callback, shapes, **kwargs):
        seen.append(kwargs.get("command_buffer_compatible", False))
        return real(callback, shapes, **kwargs)

    monkeypatch.setattr(cfj, "_buffer_callback", spy)
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", "buffer")
    return seen


@pytest.mark.parametrize("setting", ["0", "1"])
def test_command_buffer_marks_the_planned_forward_only(setting, marked, monkeypatch):
    """With the switch on, the forward of a call the launcher plans as one launch is marked (the backward, which
    allocates, never is); results are unchanged (on the CPU the flag does not change the target:
    jax/_src/buffer_callback.py adds ``_cmd_buffer`` for cuda and rocm only)."""
    monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", setting)
    q, k, v = _inputs((1, 16, 16, 2, 2, 32), jnp.float32, seed=8)
    loss = lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.lower(q, k, v).as_text()
    assert marked == [setting == "1", False]  # the forward, then the backward
    assert "xla_buffer_python_cpu_callback_cmd_buffer" not in text
    want = jax.grad(lambda q, k, v: jnp.sum(_plain(q, k, v, True) ** 2), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grad(q, k, v), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw, dims, dtype, want", [
    ({}, (64, 64), jnp.bfloat16, True),
    ({}, (72, 72), jnp.float16, True),  # (read in place by the 16-bit kernel)
    ({}, (64, 64), jnp.float32, True),
    ({}, (72, 72), jnp.float32, False),  # (float32 runs on padded copies)
    ({}, (36, 36), jnp.bfloat16, False),
    ({"softmax_scale": 0.5}, (64, 64), jnp.bfloat16, True),
    ({"softmax_scale": -0.5}, (64, 64), jnp.bfloat16, False),
    ({"algorithm": "fa1"}, (64, 64), jnp.bfloat16, False),
    ({"dropout_p": 0.1, "dropout_seed": 3}, (64, 64), jnp.bfloat16, False),
    ({"score_mod": "score * 0.5f"}, (64, 64), jnp.bfloat16, False),
    ({"alibi_slopes": np.ones(2, np.float32)}, (64, 64), jnp.bfloat16, False),
    ({"bias": np.zeros((1, 2, 8, 8), np.float32)}, (64, 64), jnp.bfloat16, False),
], ids=["bf16", "f16-d72", "f32", "f32-d72", "d36", "scale", "negative-scale", "fa1", "dropout", "score_mod",
        "alibi", "bias"])
def test_command_buffer_marks_only_capturable_forwards(kw, dims, dtype, want, marked, monkeypatch):
    monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "1")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 8, 2, dims[0])), dtype)
    v = jnp.asarray(rng.standard_normal((1, 8, 2, dims[1])), dtype)
    jax.jit(lambda q, k, v: cfj.attention(q, k, v, **kw)).lower(q, q, v)
    assert marked == [want]


# On the GPU. XLA builds a command buffer only from a run of at least xla_gpu_graph_min_graph_size (default 5)
# consecutive command-compatible ops, so these functions chain four attention calls with fusions between them.


def _chained(q, k, v):
    x = q
    for i in range(4):
        x = cfj.attention(x, k, v, causal=True) * jnp.asarray(1.5 + i, x.dtype) + q
    return x


def _chained_cupy(q, k, v):
    import cupy

    import cuflash

    x = q
    for i in range(4):
        x = cuflash.attention(x, k, v, causal=True) * cupy.asarray(1.5 + i, x.dtype) + q
    return x


@pytest.mark.gpu
def test_command_buffer_forward_matches_on_fresh_inputs_and_replays(monkeypatch):
    """CUFLASH_JAX_COMMAND_BUFFER=1: the compiled function's results on inputs at new addresses (which make XLA
    re-record the command buffer: the callback runs again under capture) and on the same inputs again (a replay,
    no Python) equal the unmarked function's, call after call, alternating inputs (a stale address baked into the
    graph would show); prints how many runs of the function entered cuflash's callback."""
    gpu = _jax_gpu()
    _buffer_route_or_skip()
    entered = []
    real = cfj._GpuCall.__call__
    monkeypatch.setattr(cfj._GpuCall, "__call__", lambda self, *a: (entered.append(self._graph), real(self, *a))[1])
    plain = jax.jit(_chained)
    monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "1")
    graphed = jax.jit(_chained)
    inputs = [tuple(jax.device_put(x, gpu) for x in _inputs((1, 128, 128, 8, 8, 64), jnp.bfloat16, seed=s))
              for s in range(3)]
    compiled = graphed.lower(*inputs[0]).compile().as_text()
    print(f"\ncommand_buffer in the compiled HLO: {'command_buffer' in compiled}")
    wants = [np.asarray(plain(*x)) for x in inputs]
    del entered[:]
    runs = 0
    for _ in range(3):
        for x, want in zip(inputs + inputs[:1], wants + wants[:1]):
            for _ in range(2):  # (the second: the same addresses, a replay where XLA captured)
                np.testing.assert_array_equal(np.asarray(graphed(*x)), want)
                runs += 1
    fresh = tuple(jax.device_put(x, gpu) for x in _inputs((1, 128, 128, 8, 8, 64), jnp.bfloat16, seed=9))
    count = len(entered)
    want_fresh = np.asarray(plain(*fresh))
    del entered[count:]  # (the plain function's run)
    np.testing.assert_array_equal(np.asarray(graphed(*fresh)), want_fresh)
    runs += 1
    print(f"{runs} runs of the marked function entered cuflash's callback {len(entered)} times (4 calls a run "
          f"without a command buffer: {4 * runs})")


@pytest.mark.gpu
def test_command_buffer_forward_equals_cupy_bit_for_bit(monkeypatch):
    """The marked chain's output equals the same chain of cuflash.attention on CuPy views of the inputs."""
    import cupy

    gpu = _jax_gpu()
    _buffer_route_or_skip()
    monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "1")
    f = jax.jit(_chained)
    for seed in range(3):
        q, k, v = (jax.device_put(x, gpu) for x in _inputs((2, 200, 200, 8, 2, 64), jnp.float16, seed=20 + seed))
        got = np.asarray(f(q, k, v))
        want = cupy.asnumpy(_chained_cupy(*(cupy.from_dlpack(x) for x in (q, k, v))))
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_command_buffer_overhead_is_printed(monkeypatch):
    """Time per run of the four-call chain under jit with the switch off and on, on the same inputs (a replay
    where XLA captured) and on alternating inputs (a re-record each run), beside the CuPy chain (printed: -s)."""
    import time

    import cupy

    gpu = _jax_gpu()
    _buffer_route_or_skip()
    rows = []
    for shape in [(1, 128, 128, 8, 8, 64), (2, 2048, 2048, 16, 16, 128)]:
        a = tuple(jax.device_put(x, gpu) for x in _inputs(shape, jnp.bfloat16, seed=1))
        b = tuple(jax.device_put(x, gpu) for x in _inputs(shape, jnp.bfloat16, seed=2))
        ca = tuple(cupy.from_dlpack(x) for x in a)
        monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "0")
        off = jax.jit(_chained)
        monkeypatch.setenv("CUFLASH_JAX_COMMAND_BUFFER", "1")
        on = jax.jit(_chained)

        def per_run(fn, sync, n=100):
            sync(fn(0))
            sync(fn(1))
            start = time.perf_counter()
            for i in range(n):
                r = fn(i)
            sync(r)
            return (time.perf_counter() - start) / n * 1e6

        cu_sync = lambda *_: cupy.cuda.get_current_stream().synchronize()  # noqa: E731
        t_cupy = per_run(lambda i: _chained_cupy(*ca), cu_sync)
        for name, fn in (("off", off), ("on", on)):
            same = per_run(lambda i: fn(*a), jax.block_until_ready)
            alternating = per_run(lambda i: fn(*(a if i % 2 else b)), jax.block_until_ready)
            rows.append((shape, name, t_cupy, same, alternating))
    print(f"\nfour chained forwards under jit, CUFLASH_JAX_COMMAND_BUFFER off/on (JAX {jax.__version__}, "
          f"{gpu.device_kind}): microseconds per run")
    for shape, name, t_cupy, same, alternating in rows:
        print(f"  {str(shape):28s} {name:3s} cupy {t_cupy:9.1f}  same inputs {same:9.1f} ({same - t_cupy:+8.1f})  "
              f"alternating {alternating:9.1f} ({alternating - t_cupy:+8.1f})")


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache: the caches returned appended to, the arguments unchanged
# ---------------------------------------------------------------------------------------------------


def _kv_inputs(paged: bool, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    b, hkv, hq, d, new = 2, 2, 4, 32, 3
    shape = (8, 16, hkv, d) if paged else (b, 64, hkv, d)
    kc, vc = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    q = rng.standard_normal((b, 2, hq, d)).astype(dtype)
    k, v = (rng.standard_normal((b, new, hkv, d)).astype(dtype) for _ in range(2))
    table = rng.permutation(8).astype(np.int32).reshape(2, 4) if paged else None
    return q, kc, vc, k, v, table


@pytest.mark.parametrize("route", ["buffer", "pure"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_returns_what_the_numpy_call_computes_and_writes(route, paged, monkeypatch):
    """cuflash.jax.attention_with_kvcache: out, lse and the appended caches equal cuflash.attention_with_kvcache's on
    NumPy copies (GQA, causal, two query tokens, a paged cache with shuffled pages, an int cache_seqlens), by both
    callback routes; the cache arguments keep their values."""
    import cuflash

    if route == "buffer" and cfj._buffer_callback is None:
        pytest.skip(f"JAX {jax.__version__} has no jax.experimental.buffer_callback")
    monkeypatch.setenv("CUFLASH_JAX_CALLBACK", route)
    q, kc, vc, k, v, table = _kv_inputs(paged)
    lens = 20 if paged else np.array([10, 40], np.int32)
    want_k, want_v = kc.copy(), vc.copy()
    want, want_lse = cuflash.attention_with_kvcache(q, want_k, want_v, k, v, cache_seqlens=lens, block_table=table,
                                                    causal=True, return_lse=True)
    jkc, jvc = jnp.asarray(kc), jnp.asarray(vc)
    out, lse, new_k, new_v = cfj.attention_with_kvcache(
        jnp.asarray(q), jkc, jvc, jnp.asarray(k), jnp.asarray(v), cache_seqlens=lens,
        block_table=None if table is None else jnp.asarray(table), causal=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    np.testing.assert_array_equal(np.asarray(new_k), want_k)
    np.testing.assert_array_equal(np.asarray(new_v), want_v)
    assert not np.array_equal(want_k, kc)  # (the append changed the cache)
    np.testing.assert_array_equal(np.asarray(jkc), kc)  # (the argument did not)
    np.testing.assert_array_equal(np.asarray(jvc), vc)


def test_kvcache_decode_loop_under_jit_with_donated_caches():
    """A jitted decode step with the caches donated, run step after step: each step's out equals the NumPy call's
    on caches appended to in place the same way, and the returned caches carry the appends forward."""
    import cuflash

    q, kc, vc, k, v, _ = _kv_inputs(False, seed=3)
    step = jax.jit(lambda q, kc, vc, k, v, lens: cfj.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                                            causal=True),
                   donate_argnums=(1, 2))
    jkc, jvc = jnp.asarray(kc), jnp.asarray(vc)
    lens = np.array([5, 9], np.int32)
    for i in range(3):
        qi, ki, vi = (x + i for x in (q, k, v))
        want = cuflash.attention_with_kvcache(qi, kc, vc, ki, vi, cache_seqlens=lens, causal=True)
        out, jkc, jvc = step(jnp.asarray(qi), jkc, jvc, jnp.asarray(ki), jnp.asarray(vi), jnp.asarray(lens))
        np.testing.assert_array_equal(np.asarray(out), want)
        lens = lens + k.shape[1]
    np.testing.assert_array_equal(np.asarray(jkc), kc)
    np.testing.assert_array_equal(np.asarray(jvc), vc)


def test_kvcache_shapes_are_checked_when_traced():
    """A mistake visible in shapes or dtypes raises when the function is traced, naming the argument."""
    q, kc, vc, k, v, _ = _kv_inputs(False)
    f = jax.jit(lambda q, kc, vc: cfj.attention_with_kvcache(q, kc, vc, cache_seqlens=4))
    with pytest.raises(TypeError, match="v_cache"):
        f.trace(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc, jnp.float16))
    with pytest.raises(ValueError, match="cache_seqlens"):
        cfj.attention_with_kvcache(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc),
                                   cache_seqlens=jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="k_cache must be an array"):
        cfj.attention_with_kvcache(jnp.asarray(q), None, jnp.asarray(vc), cache_seqlens=4)


def test_kvcache_buffer_route_appends_into_xla_s_cache_results(cuda_buffers):
    """The buffer route's GPU side (the stand-in CuPy records the decode launch; XLA's CPU buffers presented as CUDA
    ones): the decode kernels read q, k, v from XLA's argument buffers and write the appended caches into XLA's
    cache results (aliased to the cache arguments) and out into its out buffer, on XLA's stream."""
    import ml_dtypes

    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE

    recorder, seen, _ = cuda_buffers
    q, kc, vc, k, v, table = _kv_inputs(True, seed=2, dtype=ml_dtypes.bfloat16)
    args = [jnp.asarray(x) for x in (q, kc, vc, k, v, table)]
    f = jax.jit(lambda q, kc, vc, k, v, t: cfj.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=20,
                                                                      block_table=t, causal=True))
    recorder.take()
    jax.block_until_ready(f(*args))
    (ins, outs), = seen[-1:]
    launches = [x for x in recorder.take() if len(x) == 6]
    assert launches and all(stream == _XLA_STREAM for (_, _, _, _, stream, _) in launches)
    record = np.frombuffer(launches[-1][5][0][:DECODE_PARAMS_DTYPE.itemsize], DECODE_PARAMS_DTYPE)[0]
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table")
    address = dict(zip(names, ins))
    assert record["q"] == address["q"] and record["k_new"] == address["k"] and record["v_new"] == address["v"]
    assert (record["k_cache"], record["v_cache"]) == (outs[2], outs[3])  # (the cache results: aliased)
    assert record["out"] == outs[0]  # (out written in place: no copy)


@pytest.mark.gpu
def test_kvcache_on_gpu_equals_cupy():
    """On the GPU (the decode kernels on XLA's buffers, the caches aliased): out, lse and the appended caches equal
    cuflash.attention_with_kvcache on CuPy copies, bit for bit (bfloat16, a paged cache)."""
    import cupy

    import cuflash

    gpu = _jax_gpu()
    _buffer_route_or_skip()
    import ml_dtypes

    q, kc, vc, k, v, table = _kv_inputs(True, seed=5, dtype=ml_dtypes.bfloat16)
    cq, ckc, cvc, ck, cv, ctable = (cupy.asarray(x) for x in (q, kc, vc, k, v, table))
    want, want_lse = cuflash.attention_with_kvcache(cq, ckc, cvc, ck, cv, cache_seqlens=20, block_table=ctable,
                                                    causal=True, return_lse=True)
    args = [jax.device_put(jnp.asarray(x), gpu) for x in (q, kc, vc, k, v, table)]
    out, lse, new_k, new_v = jax.jit(lambda q, kc, vc, k, v, t: cfj.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=20, block_table=t, causal=True, return_lse=True))(*args)
    for got, w in ((out, want), (lse, want_lse), (new_k, ckc), (new_v, cvc)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), cupy.asnumpy(w).view(np.uint8))
