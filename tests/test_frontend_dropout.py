"""Dropout through the PyTorch and JAX front ends on the CPU: the same mask and results as the NumPy
front door with the same seed, torch's generator for the seed when none is given, the backward on the
forward's seed, and dropout_p = 0 as no dropout."""

import re

import numpy as np
import pytest
from _helpers import random_inputs

import cuflash

P, SEED, OFFSET = 0.3, 0x0123456789ABCDEF, 2**32 + 5
SHAPE = (2, 19, 23, 4, 2, 8)  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim: past 16 on both axes


def _numpy_reference(q, k, v, do, **kw):
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    return out, cuflash.attention_backward(do, q, k, v, out, lse, **kw)


def _explicit(q, k, v, mask, p):
    """(softmax(q k^T / sqrt(d)) * mask / (1 - p)) v, with plain einsums (GQA by repetition)."""
    group = q.shape[2] // k.shape[2]
    kk, vv = (np.repeat(x, group, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q, kk) / np.sqrt(q.shape[-1])
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", s * mask / (1 - p), vv)


# --------------------------------------------------------------------------------------------------- PyTorch


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _torch_run(torch, q, k, v, do, **kw):
    import cuflash.torch as cft

    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    out = cft.attention(tq, tk, tv, **kw)
    out.backward(torch.from_numpy(do))
    return out.detach().numpy(), (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, window_size=(6, -1))], ids=["dense", "causal-window"])
def test_torch_matches_numpy_with_the_same_seed(torch, kw):
    q, k, v, do = random_inputs(*SHAPE)
    kw = dict(kw, dropout_p=P, dropout_seed=SEED, dropout_offset=OFFSET, block_q=8, block_k=16)
    out, grads = _torch_run(torch, q, k, v, do, **kw)
    out_np, grads_np = _numpy_reference(q, k, v, do, **kw)
    np.testing.assert_array_equal(out, out_np)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_np):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_torch_seed_comes_from_the_default_generator(torch):
    """torch.manual_seed(s) reproduces a run; the seed it used is draw_dropout_seed() after the same
    manual_seed, and cuflash.dropout_mask with it is the mask applied; the backward uses that seed even when
    the generator has moved on before it runs."""
    import cuflash.torch as cft

    q, k, v, do = random_inputs(*SHAPE)
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))

    def run(s):
        torch.manual_seed(s)
        return cft.attention(tq, tk, tv, dropout_p=P, dropout_offset=OFFSET)

    out = run(1234)
    torch.rand(7)  # the generator moves on: the backward must not draw again
    out.backward(torch.from_numpy(do))
    np.testing.assert_array_equal(run(1234).detach().numpy(), out.detach().numpy())
    assert (run(1235).detach().numpy() != out.detach().numpy()).mean() > 0.1

    torch.manual_seed(1234)
    seed = cft.draw_dropout_seed()
    assert isinstance(seed, int) and 0 <= seed < 2**63
    mask = cuflash.dropout_mask((2, 4, 19, 23), P, seed, OFFSET)
    np.testing.assert_allclose(out.detach().numpy(), _explicit(q, k, v, mask, P), rtol=0, atol=1e-12)
    _, grads_np = _numpy_reference(q, k, v, do, dropout_p=P, dropout_seed=seed, dropout_offset=OFFSET)
    for name, a, b in zip(("dq", "dk", "dv"), (tq.grad, tk.grad, tv.grad), grads_np):
        np.testing.assert_allclose(a.numpy(), b, rtol=0, atol=1e-12, err_msg=name)

    # an explicit generator: the same draw as the default one seeded alike
    assert cft.draw_dropout_seed(torch.Generator().manual_seed(1234)) == seed


def test_torch_gradcheck_with_dropout(torch):
    import cuflash.torch as cft

    q, k, v, _ = random_inputs(1, 9, 18, 2, 1, 4, seed=3, with_do=False)
    tensors = tuple(torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    fn = lambda q, k, v: cft.attention(q, k, v, causal=True, softcap=3.0, dropout_p=0.4,  # noqa: E731
                                       dropout_seed=17, block_q=4, block_k=5)
    assert torch.autograd.gradcheck(fn, tensors)


def test_torch_dropout_p_zero_is_no_dropout_and_draws_nothing(torch):
    import cuflash.torch as cft

    q, k, v, do = random_inputs(*SHAPE)
    plain, plain_grads = _torch_run(torch, q, k, v, do, causal=True)
    torch.manual_seed(0)
    out, grads = _torch_run(torch, q, k, v, do, causal=True, dropout_p=0.0)
    after = torch.rand(3)
    torch.manual_seed(0)
    np.testing.assert_array_equal(after.numpy(), torch.rand(3).numpy())  # the generator was not touched
    np.testing.assert_array_equal(out, plain)
    for a, b in zip(grads, plain_grads):
        np.testing.assert_array_equal(a, b)
    # a bad dropout_p raises before anything is drawn
    torch.manual_seed(0)
    t = torch.from_numpy(q)
    with pytest.raises(ValueError, match=re.escape("dropout_p must lie in [0, 1)")):
        cft.attention(t, torch.from_numpy(k), torch.from_numpy(v), dropout_p=1.0)
    with pytest.raises(TypeError, match="dropout_seed must be an integer"):
        cft.attention(t, torch.from_numpy(k), torch.from_numpy(v), dropout_p=0.5, dropout_seed=1.5)
    after = torch.rand(3)
    torch.manual_seed(0)
    np.testing.assert_array_equal(after.numpy(), torch.rand(3).numpy())


# --------------------------------------------------------------------------------------------------- JAX


@pytest.fixture
def jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_matches_numpy_with_the_same_seed(jax, jit):
    import cuflash.jax as cfj

    q, k, v, do = random_inputs(*SHAPE)
    kw = dict(causal=True, dropout_p=P, dropout_seed=SEED, dropout_offset=OFFSET, block_q=8, block_k=16)
    fn = lambda q, k, v: cfj.attention(q, k, v, **kw)  # noqa: E731
    loss = lambda q, k, v: (fn(q, k, v) * do).sum()  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    if jit:
        fn, grad = jax.jit(fn), jax.jit(grad)
    out_np, grads_np = _numpy_reference(q, k, v, do, **kw)
    np.testing.assert_allclose(np.asarray(fn(q, k, v)), out_np, rtol=0, atol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv"), grad(q, k, v), grads_np):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-12, err_msg=name)
    # another seed, another mask
    other = cfj.attention(q, k, v, **dict(kw, dropout_seed=SEED + 1))
    assert (np.asarray(other) != out_np).mean() > 0.1


def test_jax_dropout_needs_an_integer_seed(jax):
    import cuflash.jax as cfj

    q, k, v, _ = random_inputs(1, 4, 4, 2, 2, 8, with_do=False)
    with pytest.raises(ValueError, match=re.escape(
            "cuflash.jax.attention: dropout_p=0.1 needs an explicit integer dropout_seed in [0, 2**64) "
            "(JAX has no global random generator")):
        cfj.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="dropout_seed must be a Python integer"):
        cfj.attention(q, k, v, dropout_p=0.1, dropout_seed=jax.numpy.asarray(3))
    with pytest.raises(ValueError, match=re.escape("dropout_p must lie in [0, 1)")):
        cfj.attention(q, k, v, dropout_p=1.5, dropout_seed=3)


def test_jax_dropout_p_zero_is_no_dropout(jax):
    import cuflash.jax as cfj

    q, k, v, do = random_inputs(*SHAPE)
    loss = lambda **kw: (lambda q, k, v: (cfj.attention(q, k, v, causal=True, **kw) * do).sum())  # noqa: E731
    plain = jax.grad(loss(), argnums=(0, 1, 2))(q, k, v)
    zero = jax.grad(loss(dropout_p=0.0), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(zero, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(cfj.attention(q, k, v, dropout_p=0.0)), np.asarray(cfj.attention(q, k, v)))
