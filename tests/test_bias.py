"""The additive attention bias (``bias``, with its gradient) and the boolean mask (``attn_mask``), alone and
combined with the other variants, through the front door on NumPy arrays.

- An oracle written here with explicit Python loops over batch, heads, queries and keys, straight from
  docs/variants.md, on tiny problems: naive and blocked attention must match it (rows whose keys are all
  masked included).
- dbias (and dq, dk, dv with a bias) against central differences of the forward, for every backward
  order; with softcap on, so that dbias is seen to be the gradient of the final score.
- Blocked vs naive in float64 (~1e-12) for many block sizes and combinations; broadcast shapes
  (2-D, 3-D, batch or heads of 1) against the same values given in full; low precision within the
  flash-attention error budget of the float64 truth.

Every test turns floating-point warnings into errors.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from _helpers import LOW_PRECISION, assert_blocked_within_budget, max_abs_error, numeric_gradient, spy_on_backend

import cuflash
from cuflash._ops.variant import Variant

pytestmark = pytest.mark.filterwarnings("error")

ORDERS = ["kv_outer", "q_outer", "split"]


# ---------------------------------------------------------------------------------------------------
# The oracle: explicit loops over b, h, i, j
# ---------------------------------------------------------------------------------------------------


def loop_attention(q, k, v, scale, *, bias=None, attn_mask=None, causal=False, window=(-1, -1), softcap=0.0,
                   slopes=None, seqused_k=None):
    """Attention of docs/variants.md one score at a time, in float64, padded ``(batch, seqlen, heads, d)``
    arrays, bottom-right diagonal: ``(out, lse)``. ``bias`` and ``attn_mask`` as the user gives them
    (broadcast here to ``(batch, heads_q, seqlen_q, seqlen_k)``), ``slopes`` ``(heads_q,)``."""
    batch, len_q, heads_q, _ = q.shape
    full = (batch, heads_q, len_q, k.shape[1])
    bias = np.zeros(full) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    attn_mask = np.ones(full, bool) if attn_mask is None else np.broadcast_to(attn_mask, full)
    group = heads_q // k.shape[2]
    out, lse = np.zeros(q.shape), np.full((batch, heads_q, len_q), -np.inf)
    for b in range(batch):
        len_k = k.shape[1] if seqused_k is None else int(seqused_k[b])
        off = len_k - len_q
        left, right = window
        if causal:
            right = 0 if right == -1 else min(right, 0)
        for h in range(heads_q):
            for i in range(len_q):
                scores, values = [], []
                for j in range(len_k):
                    if (right != -1 and j > i + off + right) or (left != -1 and j < i + off - left):
                        continue
                    if not attn_mask[b, h, i, j]:
                        continue
                    t = scale * float(np.dot(q[b, i, h], k[b, j, h // group]))
                    if softcap:
                        t = softcap * math.tanh(t / softcap)
                    if slopes is not None:
                        t -= float(slopes[h]) * abs(i + off - j)
                    t += bias[b, h, i, j]
                    if t == -math.inf:
                        continue
                    scores.append(t)
                    values.append(v[b, j, h // group])
                if not scores:
                    continue
                m = max(scores)
                weights = [math.exp(t - m) for t in scores]
                total = sum(weights)
                lse[b, h, i] = m + math.log(total)
                out[b, i, h] = sum(w * x for w, x in zip(weights, values)) / total
    return out, lse


def _tiny(seed=0, dtype=np.float64):
    """q, k, v, do: batch 2, 5 queries, 7 keys, 2 query heads sharing 1 key/value head, d 3."""
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((2, 5, 2, 3)) * s for s in (2, 1))
    k, v = (rng.standard_normal((2, 7, 1, 3)) * s for s in (2, 1))
    return tuple(x.astype(dtype) for x in (q, k, v, do))


def _tiny_bias_and_mask(seed=0):
    """A full bias, a (batch, 1, Nq, Nk) mask with one row of batch 0 all False and one of batch 1 half
    False, and a (1, heads, Nq, Nk) bias with a row of -inf."""
    rng = np.random.default_rng(seed + 100)
    bias = rng.standard_normal((2, 2, 5, 7))
    mask = rng.random((2, 1, 5, 7)) > 0.3
    mask[0, 0, 3] = False
    mask[1, 0, 1, ::2] = False
    neg_inf = rng.standard_normal((1, 2, 5, 7))
    neg_inf[0, 1, 4] = -np.inf
    neg_inf[0, 0, 0, :3] = -np.inf
    return bias, mask, neg_inf


_BIAS, _MASK, _NEG_INF = _tiny_bias_and_mask()
SLOPES = np.array([0.25, 0.5], np.float32)
# label: (the front door's keywords, the oracle's keywords)
TINY_CASES = {
    "bias": (dict(bias=_BIAS), {}),
    "bias-2d": (dict(bias=_BIAS[1, 0]), {}),
    "bias-3d-heads": (dict(bias=_BIAS[0]), {}),
    "mask": (dict(attn_mask=_MASK), {}),
    "mask-2d": (dict(attn_mask=_MASK[1, 0]), {}),
    "bias-with-neg-inf": (dict(bias=_NEG_INF), {}),
    "bias-and-mask": (dict(bias=_BIAS, attn_mask=_MASK), {}),
    "bias-causal-softcap-alibi": (dict(bias=_BIAS[:1], causal=True, softcap=0.8, alibi_slopes=SLOPES),
                                  dict(causal=True, softcap=0.8, slopes=SLOPES)),
    "mask-window": (dict(attn_mask=_MASK, window_size=(2, 1)), dict(window=(2, 1))),
    "bias-mask-seqused": (dict(bias=_BIAS, attn_mask=_MASK, seqused_k=np.array([4, 0], np.int32), causal=True),
                          dict(seqused_k=[4, 0], causal=True)),
}


def _oracle_keywords(front, oracle):
    return {**{name: front[name] for name in ("bias", "attn_mask") if name in front}, **oracle}


@pytest.mark.parametrize("name", list(TINY_CASES))
def test_each_case_matches_explicit_loops(name):
    front, oracle = TINY_CASES[name]
    q, k, v, _ = _tiny()
    out_loop, lse_loop = loop_attention(q, k, v, 0.6, **_oracle_keywords(front, oracle))
    results = {"naive": cuflash.attention(q, k, v, softmax_scale=0.6, algorithm="naive", return_lse=True, **front)}
    for block_q, block_k in [(1, 1), (2, 3), (8, 8)]:
        for algorithm in ("fa2", "fa1"):
            results[f"{algorithm} {block_q}x{block_k}"] = cuflash.attention(
                q, k, v, softmax_scale=0.6, algorithm=algorithm, block_q=block_q, block_k=block_k, return_lse=True,
                **front)
    for label, (out, lse) in results.items():
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_loop)), label
        assert max_abs_error(out, out_loop) < 1e-12, (label, max_abs_error(out, out_loop))
        assert max_abs_error(lse, lse_loop) < 1e-12, (label, max_abs_error(lse, lse_loop))


def test_the_oracle_sees_what_the_cases_mean():
    """A few scores worked by hand, so that the loops above are checked too."""
    q, k, v, _ = _tiny()
    # bias on one score only: query 0 of batch 0, head 1 gets +2 on key 5
    bias = np.zeros((5, 7))
    bias[0, 5] = 2.0
    _, lse = loop_attention(q, k, v, 1.0, bias=bias)
    s = [float(np.dot(q[0, 0, 1], k[0, j, 0])) + (2.0 if j == 5 else 0.0) for j in range(7)]
    assert lse[0, 1, 0] == pytest.approx(math.log(sum(math.exp(x) for x in s)), abs=1e-12)
    # the mask keeps keys 1 and 4 of query 2 (every head and batch entry)
    mask = np.zeros((5, 7), bool)
    mask[2, [1, 4]] = True
    out, lse = loop_attention(q, k, v, 1.0, attn_mask=mask)
    s = [float(np.dot(q[1, 2, 0], k[1, j, 0])) for j in (1, 4)]
    assert lse[1, 0, 2] == pytest.approx(math.log(sum(math.exp(x) for x in s)), abs=1e-12)
    assert np.isneginf(lse[:, :, [0, 1, 3, 4]]).all() and not out[:, [0, 1, 3, 4]].any()


def test_rows_whose_keys_are_all_masked():
    """out 0, lse -inf, zero dq and a zero dbias row; nothing NaN (warnings are errors)."""
    q, k, v, do = _tiny()
    front = dict(bias=_BIAS, attn_mask=_MASK)
    for algorithm, order in (("naive", None), ("fa2", "kv_outer"), ("fa1", "q_outer"), ("fa2", "split")):
        sizes = {} if algorithm == "naive" else dict(block_q=2, block_k=3)
        out, lse = cuflash.attention(q, k, v, algorithm=algorithm, return_lse=True, **sizes, **front)
        dq, dk, dv, dbias = cuflash.attention_backward(do, q, k, v, out, lse, algorithm=algorithm, order=order,
                                                       **sizes, **front)
        assert np.isneginf(lse[0, :, 3]).all() and not out[0, 3].any() and not dq[0, 3].any()
        assert not dbias[0, :, 3].any() and not dbias[~np.broadcast_to(_MASK, dbias.shape)].any()
        assert all(np.isfinite(x).all() for x in (out, dq, dk, dv, dbias))


# ---------------------------------------------------------------------------------------------------
# Gradients against finite differences
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bias", "bias-3d-heads", "bias-and-mask", "bias-with-neg-inf",
                                  "bias-causal-softcap-alibi", "bias-mask-seqused"])
def test_gradients_match_finite_differences(name):
    """naive and every blocked order against central differences of the forward (float64), dbias included:
    with softcap on, dbias is the gradient of the final score, without softcap's factor."""
    front, _ = TINY_CASES[name]
    q, k, v, do = _tiny(seed=1)
    bias = front["bias"]
    options = {key: val for key, val in front.items() if key != "bias"}

    def loss(q, k, v, bias):
        return float((cuflash.attention(q, k, v, softmax_scale=0.6, algorithm="naive", bias=bias, **options) * do).sum())

    out, lse = cuflash.attention(q, k, v, softmax_scale=0.6, return_lse=True, bias=bias, **options)
    results = {"naive": cuflash.attention_backward(do, q, k, v, out, lse, softmax_scale=0.6, algorithm="naive",
                                                   bias=bias, **options)}
    for order in ORDERS:
        results[order] = cuflash.attention_backward(do, q, k, v, out, lse, softmax_scale=0.6, bias=bias, block_q=2,
                                                    block_k=3, order=order, **options)
    inputs = (q, k, v, bias)
    for index, grad_name in enumerate(("dq", "dk", "dv", "dbias")):
        numeric = numeric_gradient(loss, inputs, index, step=1e-6)  # 0 at a -inf bias entry (a masked score)
        for label, grads in results.items():
            assert grads[index].shape == inputs[index].shape and grads[index].dtype == np.float64
            np.testing.assert_allclose(grads[index], numeric, rtol=0, atol=2e-8, err_msg=f"{label} {grad_name}")


# ---------------------------------------------------------------------------------------------------
# Blocked vs naive, float64, larger problems
# ---------------------------------------------------------------------------------------------------

BLOCKS = [(1, 64), (16, 16), (13, 29), (64, 1), (None, None)]
BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, HEAD_DIM = 3, 113, 203, 4, 2, 24


def _bias(rng, shape, masked_fraction=0.0, dtype=np.float64):
    bias = rng.standard_normal(shape)
    if masked_fraction:
        bias[rng.random(shape) < masked_fraction] = -np.inf
    return bias.astype(dtype)


def _mask(rng, shape, seen=0.7):
    return rng.random(shape) < seen


# label: keywords of the call, built from a generator (shapes relative to (B, Hq, Nq, Nk)).
COMBINATIONS = {
    "bias-full": lambda r: dict(bias=_bias(r, (BATCH, HEADS_Q, SEQLEN_Q, SEQLEN_K))),
    "bias-shared-mask-batch-causal": lambda r: dict(bias=_bias(r, (1, 1, SEQLEN_Q, SEQLEN_K)), causal=True,
                                                    attn_mask=_mask(r, (BATCH, 1, SEQLEN_Q, SEQLEN_K))),
    "bias-batch-window-softcap": lambda r: dict(bias=_bias(r, (BATCH, 1, SEQLEN_Q, SEQLEN_K), 0.05),
                                                window_size=(30, 10), softcap=5.0),
    "bias-heads-3d-alibi-seqused": lambda r: dict(bias=_bias(r, (HEADS_Q, SEQLEN_Q, SEQLEN_K)),
                                                  alibi_slopes=r.uniform(0.01, 0.5, HEADS_Q).astype(np.float32),
                                                  seqused_k=np.array([203, 17, 0], np.int32)),
    "mask-2d-window-top-left-blind-rows": lambda r: dict(attn_mask=_mask(r, (SEQLEN_Q, SEQLEN_K), 0.5), causal=True,
                                                         window_size=(5, -1), causal_align="top-left"),
    "bias-mask-everything": lambda r: dict(bias=_bias(r, (1, HEADS_Q, SEQLEN_Q, SEQLEN_K), 0.02),
                                           attn_mask=_mask(r, (BATCH, 1, SEQLEN_Q, SEQLEN_K), 0.9), causal=True,
                                           window_size=(60, -1), softcap=3.0, alibi_slopes=r.uniform(
                                               0.01, 0.2, (BATCH, HEADS_Q)).astype(np.float32),
                                           seqused_k=np.array([150, 203, 40], np.int32)),
}


def _combination(label, dtype=np.float64, seed=3):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((BATCH, SEQLEN_Q, HEADS_Q, HEAD_DIM)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((BATCH, SEQLEN_K, HEADS_KV, HEAD_DIM)).astype(dtype) for _ in range(2))
    return q, k, v, do, COMBINATIONS[label](rng)


@pytest.mark.parametrize("label", list(COMBINATIONS))
def test_blocked_matches_naive_float64(label):
    q, k, v, do, options = _combination(label)
    options["softmax_scale"] = HEAD_DIM**-0.5
    out_ref, lse_ref = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **options)
    grads_ref = cuflash.attention_backward(do, q, k, v, out_ref, lse_ref, algorithm="naive", **options)
    if "blind" in label:
        assert np.isneginf(lse_ref).any() and np.isfinite(lse_ref).any()
    names = ("dq", "dk", "dv", "dbias") if "bias" in options else ("dq", "dk", "dv")
    assert len(grads_ref) == len(names)
    for block_q, block_k in BLOCKS:
        sizes = dict(block_q=block_q, block_k=block_k)
        for algorithm in ("fa2", "fa1"):
            out, lse = cuflash.attention(q, k, v, algorithm=algorithm, return_lse=True, **sizes, **options)
            assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
            assert max_abs_error(out, out_ref) < 1e-12, (algorithm, sizes)
            assert max_abs_error(lse, lse_ref) < 1e-12, (algorithm, sizes)
        for order in ORDERS:
            grads = cuflash.attention_backward(do, q, k, v, out_ref, lse_ref, order=order, **sizes, **options)
            for name, grad, grad_ref in zip(names, grads, grads_ref):
                assert max_abs_error(grad, grad_ref) < 1e-12, (order, sizes, name, max_abs_error(grad, grad_ref))


# ---------------------------------------------------------------------------------------------------
# Broadcast shapes, dtypes, the backend's view of the bias
# ---------------------------------------------------------------------------------------------------

SHAPES = {"(1, 1, Nq, Nk)": (1, 1), "(B, 1, Nq, Nk)": (3, 1), "(1, H, Nq, Nk)": (1, 4), "(B, H, Nq, Nk)": (3, 4),
          "(Nq, Nk)": (), "(H, Nq, Nk)": (4,), "(1, Nq, Nk)": (1,)}


@pytest.mark.parametrize("label", list(SHAPES))
def test_broadcast_shapes_equal_the_full_bias(label):
    """A broadcastable bias gives what the same values repeated to (B, H, Nq, Nk) give, and its dbias is that
    full dbias summed over the broadcast axes; a mask of the same shape likewise (bit for bit)."""
    rng = np.random.default_rng(9)
    q, do = (rng.standard_normal((3, 10, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((3, 12, 2, 8)) for _ in range(2))
    bias = rng.standard_normal(SHAPES[label] + (10, 12))
    full = np.broadcast_to(bias.reshape((1,) * (2 - len(SHAPES[label])) + bias.shape), (3, 4, 10, 12)).copy()
    common = dict(causal=True, block_q=4, block_k=5)
    out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True, **common)
    out_full, lse_full = cuflash.attention(q, k, v, bias=full, return_lse=True, **common)
    np.testing.assert_array_equal(out, out_full)
    *grads, dbias = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias, **common)
    *grads_full, dbias_full = cuflash.attention_backward(do, q, k, v, out, lse, bias=full, **common)
    for grad, grad_full in zip(grads, grads_full):
        np.testing.assert_array_equal(grad, grad_full)
    axes = tuple(axis for axis, n in enumerate((1,) * (4 - bias.ndim) + bias.shape) if n == 1 and full.shape[axis] > 1)
    assert dbias.shape == bias.shape
    assert max_abs_error(dbias, dbias_full.sum(axis=axes, keepdims=True).reshape(bias.shape)) < 1e-14
    mask = bias > 0
    full_mask = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), (3, 4, 10, 12))
    np.testing.assert_array_equal(cuflash.attention(q, k, v, attn_mask=mask, **common),
                                  cuflash.attention(q, k, v, attn_mask=full_mask, **common))


def test_attn_mask_is_a_minus_inf_bias():
    q, k, v, do = _tiny()
    out, lse = cuflash.attention(q, k, v, attn_mask=_MASK, return_lse=True)
    as_bias = np.where(_MASK, 0.0, -np.inf)
    out_b, lse_b = cuflash.attention(q, k, v, bias=as_bias, return_lse=True)
    np.testing.assert_array_equal(out, out_b)
    np.testing.assert_array_equal(lse, lse_b)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, attn_mask=_MASK)
    assert len(grads) == 3  # the mask gets no gradient
    for grad, grad_b in zip(grads, cuflash.attention_backward(do, q, k, v, out, lse, bias=as_bias)):
        np.testing.assert_array_equal(grad, grad_b)


def test_dbias_has_the_dtype_of_bias_and_return_dbias_false_skips_it():
    rng = np.random.default_rng(10)
    q, k, v, do = (x.astype(np.float32) for x in _tiny())
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        bias = rng.standard_normal((2, 5, 7)).astype(dtype)
        out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
        np.testing.assert_array_equal(out, cuflash.attention(q, k, v, bias=bias.astype(np.float32)))
        dq, dk, dv, dbias = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias)
        assert dbias.dtype == dtype and dbias.shape == bias.shape and dq.dtype == np.float32
        three = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias, return_dbias=False)
        assert len(three) == 3
        for a, b in zip(three, (dq, dk, dv)):
            np.testing.assert_array_equal(a, b)


def test_backend_receives_one_bias(monkeypatch):
    """The backend gets one (B, H, Nq, Nk) bias in the accumulation dtype: a float32 bias of float32 inputs as
    a broadcast view of the caller's array (stride 0 on its broadcast axes, no copy), a mask as 0 / -inf
    added to it; the backward is asked for the full dbias only when the caller wants it."""
    seen = spy_on_backend(monkeypatch)
    rng = np.random.default_rng(11)
    q, do = (rng.standard_normal((3, 6, 4, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((3, 9, 2, 8)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((4, 6, 9)).astype(np.float32)
    out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    variant = seen[-1]
    assert variant.bias.shape == (3, 4, 6, 9) and variant.bias.strides == (0, 6 * 9 * 4, 9 * 4, 4)
    assert np.shares_memory(variant.bias, bias) and not variant.is_dense
    cuflash.attention_backward(do, q, k, v, out, lse, bias=bias)
    assert seen[-1][1] is True
    full_dbias = seen[-1][2][3]
    assert full_dbias.shape == (3, 4, 6, 9) and full_dbias.dtype == np.float32
    cuflash.attention_backward(do, q, k, v, out, lse, bias=bias, return_dbias=False)
    assert seen[-1][1] is None  # not even the keyword: a backend without bias support keeps its interface
    mask = rng.random((3, 1, 6, 9)) < 0.5
    cuflash.attention(q, k, v, bias=bias.astype(np.float16), attn_mask=mask)
    combined = seen[-1].bias
    assert combined.dtype == np.float32 and combined.shape == (3, 4, 6, 9)
    np.testing.assert_array_equal(combined, np.where(mask, bias.astype(np.float16).astype(np.float32), -np.inf))
    cuflash.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), bias=bias)
    assert seen[-1].bias.dtype == np.float64
    assert Variant().is_dense and not Variant(bias=combined).is_dense


def test_empty_problems_with_a_bias():
    q = np.ones((2, 4, 2, 8), np.float32)
    k = v = np.ones((2, 0, 2, 8), np.float32)
    bias = np.ones((2, 4, 0), np.float16)
    out, lse = cuflash.attention(q, k, v, bias=bias, attn_mask=np.ones((4, 0), bool), return_lse=True)
    assert not out.any() and np.isneginf(lse).all()
    *_, dbias = cuflash.attention_backward(q, q, k, v, out, lse, bias=bias)
    assert dbias.shape == bias.shape and dbias.dtype == np.float16


# ---------------------------------------------------------------------------------------------------
# Low precision against the float64 truth
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["bias-batch-window-softcap", "bias-mask-everything"])
@pytest.mark.parametrize("dtype_name", list(LOW_PRECISION))
def test_low_precision_within_error_budget(dtype_name, label):
    """Inputs and bias in the low dtype; the truth is float64 attention of the same (rounded) values."""
    dtype = LOW_PRECISION[dtype_name]
    q, k, v, do, options = _combination(label, dtype, seed=4)
    options = dict(options, softmax_scale=HEAD_DIM**-0.5, bias=options["bias"].astype(dtype))
    wide = [x.astype(np.float64) for x in (q, k, v, do)]
    truth_options = dict(options, bias=options["bias"].astype(np.float64))
    out_truth, lse_truth = cuflash.attention(*wide[:3], algorithm="naive", return_lse=True, **truth_options)
    grads_truth = cuflash.attention_backward(wide[3], *wide[:3], out_truth, lse_truth, algorithm="naive",
                                             **truth_options)
    out_naive, lse_naive = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **options)
    grads_naive = cuflash.attention_backward(do, q, k, v, out_naive, lse_naive, algorithm="naive", **options)
    sizes = dict(block_q=64, block_k=48)
    assert_blocked_within_budget(
        dtype, (out_truth, lse_truth, grads_truth), (out_naive, lse_naive, grads_naive),
        lambda algorithm: cuflash.attention(q, k, v, algorithm=algorithm, return_lse=True, **sizes, **options),
        lambda out, lse, order: cuflash.attention_backward(do, q, k, v, out, lse, order=order, **sizes, **options),
        ORDERS,
    )


# ---------------------------------------------------------------------------------------------------
# The CUDA launcher's view of a bias, on the CPU (tests/_fake_cupy.py: a stand-in CuPy records the launches)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_cupy(monkeypatch):
    from _fake_cupy import install
    from conftest import gpu_skip_reason

    gpu_skip_reason()  # (decided before the stand-in is in sys.modules)
    return install(monkeypatch)


def _launched(recorder):
    """``[(kernel name expression, shared memory or None, ExtraParams or None)]`` of the recorded launches (planned
    ones through the driver and those through CuPy); block-list launches left out."""
    import ctypes

    from cuflash._cuda.spec import EXTRA_PARAMS_DTYPE, VARIANT_PARAMS_DTYPE

    out = []
    for launch in recorder.take():
        if len(launch) == 3:  # through CuPy: (spec name, grid, args)
            name, smem, params = launch[0], None, launch[2][-1]
            params = params if isinstance(params, np.void) and params.dtype == VARIANT_PARAMS_DTYPE else None
        else:
            name, smem, raw = launch[0], launch[3], launch[5][-1]
            params = np.frombuffer(raw, VARIANT_PARAMS_DTYPE)[0] if len(raw) == VARIANT_PARAMS_DTYPE.itemsize else None
        extra = None
        if params is not None and int(params["extra"]):
            extra = np.frombuffer(ctypes.string_at(int(params["extra"]), EXTRA_PARAMS_DTYPE.itemsize),
                                  EXTRA_PARAMS_DTYPE)[0]
        if "block_" not in name:
            out.append((name, smem, extra))
    return out


def _device_inputs(cp, b, nq, nk, h, d, dtype=ml_dtypes.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q, do = (cp.asarray(rng.standard_normal((b, nq, h, d)).astype(dtype)) for _ in range(2))
    k, v = (cp.asarray(rng.standard_normal((b, nk, h, d)).astype(dtype)) for _ in range(2))
    return q, k, v, do, rng


@pytest.mark.parametrize(("bias_dtype", "d", "nk", "policy", "tile", "staged_in_backward"), [
    # [variant bias tile] 16-byte rows: staged by the wgmma kernels with their table tiles
    (ml_dtypes.bfloat16, 128, 136, "cuflash::BiasArray<cuflash::bf16, true>", "128, 128, 8, 2", True),
    (np.float16, 64, 200, "cuflash::BiasArray<cuflash::fp16, true>", "128, 64, 8, 2", True),
    # float32 at d 128: two 128 x 128 float32 tiles do not fit beside K and V: half the keys (the backward reads a
    # float32 bias from global memory)
    (np.float32, 128, 136, "cuflash::BiasArray<float, true>", "128, 64, 8, 2", False),
    # float32 at d 64: its tiles would leave room for one block per SM of the two: read from global memory
    (np.float32, 64, 136, "cuflash::BiasArray<float, false>", "128, 64, 8, 2", False),
    # rows of 333 16-bit entries are not 16-byte aligned: read from global memory, in their dtype
    (ml_dtypes.bfloat16, 128, 333, "cuflash::BiasArray<cuflash::bf16, false>", "128, 128, 8, 2", False),
])
def test_the_kernels_read_a_bias_in_its_own_dtype(fake_cupy, bias_dtype, d, nk, policy, tile, staged_in_backward):
    """A float16, bfloat16 or float32 bias of 16-bit inputs reaches the kernels as the caller's array (no copy),
    its element type in the kernel's policy, staged in shared memory where its rows allow (and the shared memory
    of the staged tiles counted); the gradient in the bias's dtype, not zeroed where every element is written."""
    cp, recorder = fake_cupy
    q, k, v, do, rng = _device_inputs(cp, 2, 100, nk, 4, d)
    bias = cp.asarray(rng.standard_normal((2, 4, 100, nk)).astype(bias_dtype))
    out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    (name, smem, extra), = _launched(recorder)
    assert name.startswith(f"cuflash::flash_fwd_sm90_kernel<cuflash::bf16, {d}, {tile}, cuflash::Variant<") and policy in name
    staged = ", true" in policy
    m, n = (int(x) for x in tile.split(", ")[:2])
    base = 2 * d * (m + 4 * n) + 1024 + 128
    assert smem == base + (2 * m * n * np.dtype(bias_dtype).itemsize if staged else 0)
    assert int(extra["bias"]) == bias.data.ptr and int(extra["sm"]) == nk  # (the caller's array, no copy)
    recorder.take_zeroed()
    dq, dk, dv, dbias = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias)
    assert dbias.dtype == np.dtype(bias_dtype) and dbias.shape == bias.shape
    launches = _launched(recorder)
    dkdv = [(n_, s, e) for n_, s, e in launches if "flash_bwd_dkdv" in n_]
    assert len(dkdv) == 1 and "flash_bwd_dkdv_sm90_kernel" in dkdv[0][0]
    bwd_policy = (policy.replace(", false>", ", true>") if staged_in_backward else policy.replace(", true>", ", false>"))
    assert bwd_policy in dkdv[0][0]
    assert int(dkdv[0][2]["dbias"]) == dbias.data.ptr  # (written in place: nothing summed, no conversion)
    assert not any(ptr == dbias.data.ptr for ptr, _ in recorder.take_zeroed())


def test_a_broadcast_bias_gets_a_float32_gradient_and_the_split_order_reads_it_directly(fake_cupy):
    """A bias broadcast over the batch: the kernels write its gradient per batch entry in float32, which the front door
    sums and rounds once to the bias's dtype. The split order's dQ kernel (mma.sync) reads the bias from global
    memory; the dK/dV kernel stages it. Causal: the tiles above the diagonal are never visited, so dbias is zeroed."""
    cp, recorder = fake_cupy
    q, k, v, do, rng = _device_inputs(cp, 2, 64, 128, 4, 128)
    bias = cp.asarray(rng.standard_normal((4, 64, 128)).astype(ml_dtypes.bfloat16))
    out, lse = cuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    recorder.take(), recorder.take_zeroed()
    dq, dk, dv, dbias = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias, causal=True, deterministic=True)
    assert dbias.dtype == ml_dtypes.bfloat16 and dbias.shape == (4, 64, 128)
    names = [name for name, _, _ in _launched(recorder)]
    dkdv = next(name for name in names if "flash_bwd_dkdv_sm90_kernel" in name)
    dq_pass = next(name for name in names if "flash_bwd_dq_kernel" in name)
    assert "cuflash::BiasArray<cuflash::bf16, true, float>" in dkdv
    assert "cuflash::BiasArray<cuflash::bf16, false, float>" in dq_pass
    zeroed = recorder.take_zeroed()
    assert any(size == 2 * 4 * 64 * 128 * 4 for _, size in zeroed)  # the float32 (batch, heads, 64, 128) dbias


def test_attn_mask_on_the_gpu_path_stays_in_16_bits(fake_cupy, monkeypatch):
    """CuPy arrays of 16-bit inputs: a mask alone becomes 0 / -inf in q's dtype; a bias with a mask that broadcasts
    no further than it keeps the bias's dtype, -inf selected through the bits where the mask is False; a mask over
    more axes than the bias adds them in float32 (as the NumPy path does). A float32 bias stays float32."""
    cp, _ = fake_cupy
    seen = spy_on_backend(monkeypatch)
    q, k, v, _, rng = _device_inputs(cp, 2, 16, 24, 2, 64)
    bias = rng.standard_normal((2, 16, 24)).astype(ml_dtypes.bfloat16)
    mask = rng.random((16, 24)) < 0.7
    cuflash.attention(q, k, v, attn_mask=cp.asarray(mask))
    got = seen[-1].bias
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == (2, 2, 16, 24) and got.strides[:2] == (0, 0)
    np.testing.assert_array_equal(np.asarray(got[1, 1]).astype(np.float32), np.where(mask, 0, -np.inf))
    cuflash.attention(q, k, v, bias=cp.asarray(bias), attn_mask=cp.asarray(mask))
    got = seen[-1].bias
    assert got.dtype == ml_dtypes.bfloat16 and got.strides[0] == 0
    np.testing.assert_array_equal(np.asarray(got[0]).astype(np.float32),
                                  np.where(mask, bias.astype(np.float32), -np.inf))
    wide = rng.random((2, 1, 16, 24)) < 0.7
    cuflash.attention(q, k, v, bias=cp.asarray(bias), attn_mask=cp.asarray(wide))
    got = seen[-1].bias
    assert got.dtype == np.float32 and got.shape == (2, 2, 16, 24)
    np.testing.assert_array_equal(np.asarray(got), np.where(wide, bias.astype(np.float32), -np.inf))
    cuflash.attention(q, k, v, bias=cp.asarray(bias.astype(np.float32)))
    assert seen[-1].bias.dtype == np.float32
