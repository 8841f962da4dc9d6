"""Shared test helpers: random inputs, the float64 truth, the error-budget assertions, central differences and a
spy on the backends.

The error budget is the one flash-attention's tests use (see /work/shared/STYLE.md): a low-precision
result may be off the float64 truth by at most ``factor`` times what naive attention computed in the same
dtype is off by, plus a small ``floor``. ``factor`` is 2 for outputs and 3 for gradients.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from cuflash._ops import api as _api
from cuflash import reference
from cuflash._ops.variant import Variant

# The dtypes the low-precision tests run, by name (the test ids)
LOW_PRECISION = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def random_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=np.float64, *, seed=0,
                  with_do=True):
    """Fresh standard-normal ``q, k, v`` (and ``do``), ``(batch, seqlen, heads, head_dim)``, in ``dtype``.

    Fixed seed, never zeros. Returns ``(q, k, v, do)``, with ``do = None`` when ``with_do`` is False.
    """
    rng = np.random.default_rng(seed)

    def draw(seqlen, heads):
        return rng.standard_normal((batch, seqlen, heads, head_dim)).astype(dtype)

    q, k, v = draw(seqlen_q, heads_q), draw(seqlen_k, heads_kv), draw(seqlen_k, heads_kv)
    do = draw(seqlen_q, heads_q) if with_do else None
    return q, k, v, do


def float64_truth(q, k, v, do=None, *, scale, variant=Variant()):
    """The truth: naive attention on the inputs converted to float64 (any variant; its ALiBi slopes are
    float32 by definition and used as they are).

    Returns ``(out, lse)``, or ``(out, lse, (dq, dk, dv))`` when ``do`` is given; all float64.
    """
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    out, lse = reference.naive_forward(q64, k64, v64, scale=scale, variant=variant)
    if do is None:
        return out, lse
    grads = reference.naive_backward(np.asarray(do, dtype=np.float64), q64, k64, v64, scale=scale, variant=variant)
    return out, lse, grads



def numeric_gradient(loss, inputs, index, *, step):
    """Central differences of ``loss(*inputs)`` with respect to ``inputs[index]``, entry by entry: each
    entry moved by ``+step`` and ``-step`` on fresh copies of ``inputs``. An entry that is not finite (a
    ``-inf`` bias entry: the score is masked) gets 0."""
    numeric = np.zeros_like(inputs[index])
    for position in np.ndindex(numeric.shape):
        if not np.isfinite(inputs[index][position]):
            continue
        shifted = [x.copy() for x in inputs]
        shifted[index][position] += step
        plus = loss(*shifted)
        shifted[index][position] -= 2 * step
        numeric[position] = (plus - loss(*shifted)) / (2 * step)
    return numeric


def max_abs_error(result, truth) -> float:
    """``max |result - truth|`` in float64. Entries where both are the same infinity count as exact
    (an ``lse`` of ``-inf`` for a row that sees no key); any other non-finite difference is ``inf``."""
    result = np.asarray(result, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    assert result.shape == truth.shape, (result.shape, truth.shape)
    if result.size == 0:
        return 0.0
    same_inf = np.isinf(result) & (result == truth)
    diff = np.abs(np.where(same_inf, 0.0, result) - np.where(same_inf, 0.0, truth))
    return float(np.where(np.isnan(diff), np.inf, diff).max())


def rounding_floor(truth, dtype) -> float:
    """What storing the truth in ``dtype`` alone costs: ``max |round(truth) - truth|``.

    A data-driven floor for :func:`assert_within_budget`, in the spirit of flash-attention's
    ``(out_ref + 0.3 - 0.3 - out_ref)``: no computation in ``dtype`` can be expected to beat it.
    """
    truth = np.asarray(truth, dtype=np.float64)
    finite = np.isfinite(truth)
    rounded = truth[finite].astype(dtype).astype(np.float64)
    return float(np.abs(rounded - truth[finite]).max(initial=0.0))


def assert_within_budget(result, truth, naive_same_dtype, factor, floor, name="result"):
    """Assert ``max|result - truth| <= factor * max|naive_same_dtype - truth| + floor``.

    ``truth`` is float64; ``naive_same_dtype`` is naive attention computed in the dtype of ``result``.
    The message prints both errors, the factor and the floor, so a failure shows by how much.
    """
    error = max_abs_error(result, truth)
    naive_error = max_abs_error(naive_same_dtype, truth)
    budget = factor * naive_error + floor
    assert error <= budget, (
        f"{name}: max|result - truth| = {error:.3e} exceeds {factor} * max|naive - truth| + floor = "
        f"{factor} * {naive_error:.3e} + {floor:.3e} = {budget:.3e}"
    )


def assert_blocked_within_budget(dtype, truth, naive, forward, backward, orders):
    """The low-precision check of the blocked algorithms against the float64 truth.

    ``forward(algorithm)`` returns ``(out, lse)`` of ``"fa2"`` and of ``"fa1"``: out in ``dtype``, lse in
    float32, each within 2x the naive error plus the rounding floor. Then ``backward(out, lse, order)``, on the
    fa2 forward's out and lse, returns the gradients (``dq, dk, dv`` and, where asked, ``dbias``) in each of
    ``orders``: each in ``dtype``, within 3x the naive error plus the rounding floor. ``truth`` (float64) and
    ``naive`` (computed in ``dtype``) are ``(out, lse, grads)``.
    """
    out_truth, lse_truth, grads_truth = truth
    out_naive, lse_naive, grads_naive = naive
    for algorithm in ("fa2", "fa1"):
        out, lse = forward(algorithm)
        assert out.dtype == dtype and lse.dtype == np.float32
        assert_within_budget(out, out_truth, out_naive, 2, rounding_floor(out_truth, dtype), f"{algorithm} out")
        assert_within_budget(lse, lse_truth, lse_naive, 2, rounding_floor(lse_truth, np.float32), f"{algorithm} lse")
    out, lse = forward("fa2")
    for order in orders:
        grads = backward(out, lse, order)
        for name, grad, grad_truth, grad_naive in zip(("dq", "dk", "dv", "dbias"), grads, grads_truth, grads_naive):
            assert grad.dtype == dtype
            assert_within_budget(grad, grad_truth, grad_naive, 3, rounding_floor(grad_truth, dtype), f"{order} {name}")


def small_qkv(batch=2, seqlen_q=5, seqlen_k=7, heads_q=4, heads_kv=2, head_dim=8, dtype=np.float32, seed=0):
    """Small random q, k, v of the batched layout (GQA by default), for tests of the front door's checks."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dtype)
    return q, k, v


def spy_on_backend(monkeypatch):
    """Let the front door's backends run as they are but note what they get: returns a list that gains, per
    ``forward`` call, its :class:`Variant`, and per ``backward`` call ``(variant, want_dbias, grads)``, with
    ``want_dbias`` None where the keyword was not passed and ``grads`` what the backend returned."""
    calls = []
    real = _api._backend

    def spy(library):
        backend = real(library)

        class Spy:
            @staticmethod
            def forward(*args, variant, **kwargs):
                calls.append(variant)
                return backend.forward(*args, variant=variant, **kwargs)

            @staticmethod
            def backward(*args, variant, **kwargs):
                grads = backend.backward(*args, variant=variant, **kwargs)
                calls.append((variant, kwargs.get("want_dbias"), grads))
                return grads

        return Spy

    monkeypatch.setattr(_api, "_backend", spy)
    return calls
