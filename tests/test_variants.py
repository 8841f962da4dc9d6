"""Attention variants in the NumPy reference and through the front door: sliding windows, softcap, ALiBi,
key padding (``seqused_k``) and packed variable-length batches (``cu_seqlens``), alone and combined.

- An independent oracle written here with explicit Python loops over sequences, heads, queries and keys,
  straight from the definitions of docs/variants.md, on tiny problems: naive and blocked attention
  (out, lse) must match it, so that the reference cannot be wrong together with itself.
- Gradients against finite differences of the forward (softcap's derivative, ALiBi's, the masks).
- Blocked vs naive in float64 (~1e-12) for combinations, many block sizes, awkward lengths.
- Low precision within the flash-attention error budget of the float64 truth.
- Front-door behaviour: a packed batch equals per-sequence calls, seqused_k equals cutting the keys,
  (heads,) ALiBi slopes are a broadcast view, empty packed batches.

Every test turns floating-point warnings into errors.
"""

import math

import numpy as np
import pytest
from _helpers import LOW_PRECISION, assert_blocked_within_budget, float64_truth, max_abs_error, numeric_gradient, spy_on_backend

import cuflash
from cuflash import reference
from cuflash._ops.variant import Variant

pytestmark = pytest.mark.filterwarnings("error")

ORDERS = ["kv_outer", "q_outer", "split"]


# ---------------------------------------------------------------------------------------------------
# The oracle: explicit loops over i and j
# ---------------------------------------------------------------------------------------------------


def loop_attention(q, k, v, scale, *, causal=False, top_left=False, window=(-1, -1), softcap=0.0, slopes=None,
                   cu_q=None, cu_k=None, seqused_k=None):
    """Attention of docs/variants.md one score at a time, in float64: ``(out, lse)``.

    Sequence ``b`` is batch entry ``b`` of ``(batch, seqlen, heads, d)`` arrays, or rows
    ``cu[b]:cu[b + 1]`` of packed ``(total, heads, d)`` ones; it uses its first ``seqused_k[b]`` keys.
    """
    if cu_q is None:
        sequences = [(q[b], k[b], v[b]) for b in range(q.shape[0])]
    else:
        sequences = [(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]])
                     for b in range(len(cu_q) - 1)]
    outs, lses = [], []
    for b, (qb, kb, vb) in enumerate(sequences):
        len_q, heads_q = qb.shape[0], qb.shape[1]
        len_k = kb.shape[0] if seqused_k is None else int(seqused_k[b])
        group = heads_q // kb.shape[1]
        off = 0 if top_left else len_k - len_q
        left, right = window
        if causal:
            right = 0 if right == -1 else min(right, 0)
        out, lse = np.zeros(qb.shape), np.full((heads_q, len_q), -np.inf)
        for h in range(heads_q):
            g = h // group
            for i in range(len_q):
                scores, values = [], []
                for j in range(len_k):
                    if right != -1 and j > i + off + right:
                        continue
                    if left != -1 and j < i + off - left:
                        continue
                    t = scale * float(np.dot(qb[i, h], kb[j, g]))
                    if softcap > 0:
                        t = softcap * math.tanh(t / softcap)
                    if slopes is not None:
                        slope = slopes[h] if slopes.ndim == 1 else slopes[b, h]
                        t += -float(slope) * abs(i + off - j)
                    scores.append(t)
                    values.append(vb[j, g])
                if scores:
                    m = max(scores)
                    weights = [math.exp(t - m) for t in scores]
                    total = sum(weights)
                    out[i, h] = sum(w * x for w, x in zip(weights, values)) / total
                    lse[h, i] = m + math.log(total)
        outs.append(out)
        lses.append(lse)
    if cu_q is None:
        return np.stack(outs), np.stack(lses)
    return np.concatenate(outs), np.concatenate(lses, axis=1)


def _variant(*, causal=False, top_left=False, window=(-1, -1), softcap=0.0, slopes=None, cu_q=None, cu_k=None,
             seqused_k=None, batch=None):
    """The reference's Variant for the oracle's keywords (slopes broadcast to (batch, heads) as the front door does)."""
    if slopes is not None and slopes.ndim == 1:
        slopes = np.broadcast_to(slopes, (batch, slopes.shape[0]))
    return Variant(
        causal=causal, bottom_right=not top_left, window_left=None if window[0] == -1 else window[0],
        window_right=None if window[1] == -1 else window[1], softcap=softcap, alibi_slopes=slopes,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k,
        max_seqlen_q=None if cu_q is None else int(np.diff(cu_q).max()),
        max_seqlen_k=None if cu_k is None else int(np.diff(cu_k).max()),
    )


def _packed(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


# Tiny problems: 5 queries and 7 keys, 2 query heads sharing 1 key/value head, d 3, batch 2 (padded);
# or three packed sequences, one of them without keys.
TINY_CU_Q, TINY_CU_K = _packed([5, 2, 3]), _packed([7, 0, 4])
SLOPES = np.array([0.25, 0.5], np.float32)
TINY_CASES = {
    "causal-bottom-right": dict(causal=True),
    "causal-top-left": dict(causal=True, top_left=True),
    "window-left": dict(window=(2, -1)),
    "window-right": dict(window=(-1, 1)),
    "window-both": dict(window=(1, 0)),
    "window-top-left": dict(window=(1, 2), top_left=True),
    "causal-window": dict(causal=True, window=(3, 2)),
    "softcap": dict(softcap=0.8),
    "alibi-heads": dict(slopes=SLOPES),
    "alibi-batch": dict(slopes=np.array([[0.25, 0.5], [1.0, 0.125]], np.float32)),
    "alibi-causal-top-left": dict(slopes=SLOPES, causal=True, top_left=True),
    "seqused": dict(seqused_k=np.array([4, 0], np.int32), causal=True),
    "softcap-alibi-window": dict(softcap=1.5, slopes=SLOPES, window=(2, 1)),
    "packed": dict(cu_q=TINY_CU_Q, cu_k=TINY_CU_K),
    "packed-causal-softcap": dict(cu_q=TINY_CU_Q, cu_k=TINY_CU_K, causal=True, softcap=2.0),
    "packed-seqused-alibi": dict(cu_q=TINY_CU_Q, cu_k=TINY_CU_K, seqused_k=np.array([3, 0, 4], np.int32),
                                 slopes=np.array([[0.25, 0.5], [1.0, 1.0], [0.5, 2.0]], np.float32)),
}


def _tiny_inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    if "cu_q" in case:
        shape_q, shape_k = (int(case["cu_q"][-1]), 2, 3), (int(case["cu_k"][-1]), 1, 3)
    else:
        shape_q, shape_k = (2, 5, 2, 3), (2, 7, 1, 3)
    q, do = 2 * rng.standard_normal(shape_q), rng.standard_normal(shape_q)
    k, v = 2 * rng.standard_normal(shape_k), rng.standard_normal(shape_k)
    batch = len(case["cu_q"]) - 1 if "cu_q" in case else 2
    return q, k, v, do, _variant(**case, batch=batch)


@pytest.mark.parametrize("name", list(TINY_CASES))
def test_each_variant_matches_explicit_loops(name):
    case = TINY_CASES[name]
    q, k, v, _, variant = _tiny_inputs(case)
    out_loop, lse_loop = loop_attention(q, k, v, 0.6, **case)
    results = {"naive": reference.naive_forward(q, k, v, scale=0.6, variant=variant)}
    for block_q, block_k in [(1, 1), (2, 3), (8, 8)]:
        for algorithm, forward in (("fa2", reference.fa2_forward), ("fa1", reference.fa1_forward)):
            results[f"{algorithm} {block_q}x{block_k}"] = forward(q, k, v, scale=0.6, variant=variant,
                                                                   block_q=block_q, block_k=block_k)
    for label, (out, lse) in results.items():
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_loop)), label
        assert max_abs_error(out, out_loop) < 1e-12, (label, max_abs_error(out, out_loop))
        assert max_abs_error(lse, lse_loop) < 1e-12, (label, max_abs_error(lse, lse_loop))


def test_the_oracle_sees_what_the_cases_mean():
    """A few of the tiny cases worked by hand, so that the loops above are checked too."""
    q, k, v, _, _ = _tiny_inputs(TINY_CASES["window-both"])
    _, lse = loop_attention(q, k, v, 1.0, window=(1, 0))
    # window (1, 0), bottom-right (off = 2): query 0 sees keys 1 and 2
    s = [float(np.dot(q[0, 0, 0], k[0, j, 0])) for j in (1, 2)]
    assert lse[0, 0, 0] == pytest.approx(math.log(sum(math.exp(x) for x in s)), abs=1e-12)
    # softcap 0.8 bounds every score to (-0.8, 0.8), so lse <= log(7) + 0.8
    _, lse = loop_attention(q, k, v, 1.0, softcap=0.8)
    assert (lse < math.log(7) + 0.8).all()
    # ALiBi with slope 0.5 on head 1, one query aligned top-left (it faces key 0): key j is biased by -0.5 j
    _, lse = loop_attention(q[:, :1], k, v, 1.0, slopes=np.array([0.0, 0.5], np.float32), top_left=True)
    s = [float(np.dot(q[0, 0, 1], k[0, j, 0])) - 0.5 * j for j in range(7)]
    assert lse[0, 1, 0] == pytest.approx(math.log(sum(math.exp(x) for x in s)), abs=1e-12)


@pytest.mark.parametrize("name", ["causal-window", "softcap", "alibi-batch", "softcap-alibi-window", "seqused",
                                  "packed-causal-softcap", "packed-seqused-alibi"])
def test_gradients_match_finite_differences(name):
    """naive and blocked backward against central differences of the forward (float64)."""
    case = TINY_CASES[name]
    q, k, v, do, variant = _tiny_inputs(case, seed=1)
    options = dict(scale=0.6, variant=variant)

    def loss(q, k, v):
        return float((reference.naive_forward(q, k, v, **options)[0] * do).sum())

    out, lse = reference.naive_forward(q, k, v, **options)
    results = {"naive": reference.naive_backward(do, q, k, v, **options)}
    for order in ORDERS:
        results[order] = reference.blocked_backward(do, q, k, v, out, lse, **options, block_q=2, block_k=3,
                                                    order=order)
    for index, name_x in enumerate(("dq", "dk", "dv")):
        numeric = numeric_gradient(loss, (q, k, v), index, step=1e-6)
        for label, grads in results.items():
            np.testing.assert_allclose(grads[index], numeric, rtol=0, atol=2e-8, err_msg=f"{label} {name_x}")


# ---------------------------------------------------------------------------------------------------
# Blocked vs naive, float64, larger problems
# ---------------------------------------------------------------------------------------------------

BLOCKS = [(1, 64), (16, 16), (13, 29), (64, 1), (None, None)]
LENS_Q, LENS_K = [100, 1, 0, 57, 130], [150, 300, 90, 0, 129]
# label: (layout, variant keywords), heads (4, 2) throughout. Layouts: "packed" (LENS_Q, LENS_K, with
# sequences without queries or keys), "padded" (113 queries, 203 keys), "long-q" (203 queries, 113 keys,
# so that bottom-right alignment leaves the first rows blind).
COMBINATIONS = {
    "packed-causal-window-softcap": ("packed", dict(causal=True, window=(40, -1), softcap=5.0)),
    "packed-window-both-top-left": ("packed", dict(window=(30, 10), top_left=True)),
    "packed-seqused-alibi-causal": ("packed", dict(seqused_k=np.array([120, 0, 90, 0, 60], np.int32),
                                                   slopes="batch", causal=True)),
    "seqused-alibi": ("padded", dict(seqused_k=np.array([203, 17, 0], np.int32), slopes="heads")),
    "window-left-only": ("padded", dict(window=(25, -1))),
    "window-right-only-blind-rows": ("long-q", dict(window=(-1, 3))),
    "window-both-blind-rows": ("long-q", dict(window=(5, 0), causal=True)),
    "window-top-left-causal-softcap": ("padded", dict(window=(7, 20), causal=True, top_left=True, softcap=1.0)),
}


def _combination(label, dtype=np.float64, seed=3):
    layout, case = COMBINATIONS[label]
    case = dict(case)
    rng = np.random.default_rng(seed)
    if layout == "packed":
        case.update(cu_q=_packed(LENS_Q), cu_k=_packed(LENS_K))
        shape_q, shape_k, batch = (sum(LENS_Q), 4, 24), (sum(LENS_K), 2, 24), len(LENS_Q)
    else:
        seqlen_q, seqlen_k = (113, 203) if layout == "padded" else (203, 113)
        shape_q, shape_k, batch = (3, seqlen_q, 4, 24), (3, seqlen_k, 2, 24), 3
    if case.get("slopes") == "heads":
        case["slopes"] = rng.uniform(0.01, 0.5, 4).astype(np.float32)
    elif case.get("slopes") == "batch":
        case["slopes"] = rng.uniform(0.01, 0.5, (batch, 4)).astype(np.float32)
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_k, shape_q))
    return q, k, v, do, _variant(**case, batch=batch)


@pytest.mark.parametrize("label", list(COMBINATIONS))
def test_blocked_matches_naive_float64(label):
    q, k, v, do, variant = _combination(label)
    options = dict(scale=24**-0.5, variant=variant)
    out_ref, lse_ref = reference.naive_forward(q, k, v, **options)
    grads_ref = reference.naive_backward(do, q, k, v, **options)
    if "blind" in label:
        assert np.isneginf(lse_ref).any() and np.isfinite(lse_ref).any()
    for block_q, block_k in BLOCKS:
        sizes = dict(block_q=block_q, block_k=block_k)
        for forward in (reference.fa2_forward, reference.fa1_forward):
            out, lse = forward(q, k, v, **options, **sizes)
            assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
            assert max_abs_error(out, out_ref) < 1e-12, (forward.__name__, sizes)
            assert max_abs_error(lse, lse_ref) < 1e-12, (forward.__name__, sizes)
        for order in ORDERS:
            grads = reference.blocked_backward(do, q, k, v, out_ref, lse_ref, **options, **sizes, order=order)
            for name, grad, grad_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
                assert max_abs_error(grad, grad_ref) < 1e-12, (order, sizes, name, max_abs_error(grad, grad_ref))


def test_rows_that_see_no_key_and_unused_keys():
    """A window that leaves rows blind mid-sequence, a sequence with no used key: out 0, lse -inf, zero dq;
    keys past seqused_k get zero dk and dv."""
    q, k, v, do, variant = _combination("seqused-alibi")
    out, lse = reference.fa2_forward(q, k, v, scale=0.2, variant=variant, block_q=16, block_k=16)
    assert np.isneginf(lse[2]).all() and not out[2].any() and np.isfinite(lse[:2]).all()
    for order in ORDERS:
        dq, dk, dv = reference.blocked_backward(do, q, k, v, out, lse, scale=0.2, variant=variant, block_q=16,
                                                block_k=16, order=order)
        assert not dq[2].any() and not dk[2].any() and not dv[2].any()
        assert not dk[1, 17:].any() and not dv[1, 17:].any() and dk[1, :17].all()
    # window (0, 0) with causal top-left over 5 queries and 3 keys: queries 3 and 4 face keys 3 and 4
    q, k, v, do, variant = _tiny_inputs(dict(window=(0, 0), top_left=True))
    out, lse = reference.fa2_forward(q[:, :5], k[:, :3], v[:, :3], scale=1.0, variant=variant, block_q=2, block_k=2)
    assert np.isneginf(lse[:, :, 3:]).all() and np.isfinite(lse[:, :, :3]).all() and not out[:, 3:].any()


# ---------------------------------------------------------------------------------------------------
# Low precision against the float64 truth
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["packed-causal-window-softcap", "packed-seqused-alibi-causal"])
@pytest.mark.parametrize("dtype_name", list(LOW_PRECISION))
def test_low_precision_within_error_budget(dtype_name, label):
    dtype = LOW_PRECISION[dtype_name]
    q, k, v, do, variant = _combination(label, dtype, seed=4)
    options = dict(scale=24**-0.5, variant=variant)
    truth = float64_truth(q, k, v, do, **options)
    naive = (*reference.naive_forward(q, k, v, **options), reference.naive_backward(do, q, k, v, **options))
    sizes = dict(block_q=64, block_k=48)
    assert_blocked_within_budget(
        dtype, truth, naive,
        lambda algorithm: reference.forward(q, k, v, algorithm=algorithm, **options, **sizes),
        lambda out, lse, order: reference.blocked_backward(do, q, k, v, out, lse, **options, **sizes, order=order),
        ORDERS,
    )


# ---------------------------------------------------------------------------------------------------
# Through the front door
# ---------------------------------------------------------------------------------------------------


def test_packed_batch_equals_per_sequence_calls():
    """One packed call gives, sequence by sequence, what a batch-1 call on that sequence's rows gives."""
    rng = np.random.default_rng(5)
    lens_q, lens_k = [30, 1, 0, 45], [50, 20, 7, 45]
    cu_q, cu_k = _packed(lens_q), _packed(lens_k)
    q, do = (rng.standard_normal((cu_q[-1], 4, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((cu_k[-1], 2, 16)).astype(np.float32) for _ in range(2))
    slopes = rng.uniform(0, 0.3, (4, 4)).astype(np.float32)
    common = dict(causal=True, window_size=(16, -1), softcap=4.0, block_q=8, block_k=8)
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=45, max_seqlen_k=50, alibi_slopes=slopes, **common)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **packed)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, **packed)
    assert lse.shape == (4, cu_q[-1]) and out.shape == q.shape and dk.shape == k.shape
    for b in range(4):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [x[None, rows] for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k), (do, rows_q))]
        out_b, lse_b = cuflash.attention(*one[:3], return_lse=True, alibi_slopes=slopes[b:b + 1], **common)
        np.testing.assert_array_equal(out_b[0], out[rows_q])
        np.testing.assert_array_equal(lse_b[0], lse[:, rows_q])
        grads_b = cuflash.attention_backward(one[3], *one[:3], out_b, lse_b, alibi_slopes=slopes[b:b + 1], **common)
        for grad_b, grad, rows in zip(grads_b, (dq, dk, dv), (rows_q, rows_k, rows_k)):
            np.testing.assert_array_equal(grad_b[0], grad[rows])


def test_seqused_k_equals_cutting_the_keys():
    rng = np.random.default_rng(6)
    q, do = (rng.standard_normal((2, 20, 2, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 33, 2, 8)) for _ in range(2))
    used = np.array([21, 33], np.int32)
    common = dict(causal=True, window_size=(6, 2))
    out, lse = cuflash.attention(q, k, v, return_lse=True, seqused_k=used, **common)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, seqused_k=used, **common)
    for b, n in enumerate(used):
        out_b, lse_b = cuflash.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], return_lse=True, **common)
        grads_b = cuflash.attention_backward(do[b:b + 1], q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], out_b, lse_b,
                                             **common)
        assert max_abs_error(out_b[0], out[b]) < 1e-14 and max_abs_error(lse_b[0], lse[b]) < 1e-14
        for grad_b, grad, rows in zip(grads_b, (dq, dk, dv), (slice(None), slice(0, n), slice(0, n))):
            assert max_abs_error(grad_b[0], grad[b, rows]) < 1e-14
        assert not dk[b, n:].any() and not dv[b, n:].any()


def test_alibi_slopes_per_head_are_a_broadcast_view(monkeypatch):
    """(heads_q,) slopes reach the backend as a (batch, heads_q) view with batch stride 0, no copy, and
    give what the same slopes repeated per batch entry give."""
    seen = spy_on_backend(monkeypatch)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((3, 10, 4, 8)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.1, 0.2, 0.4, 0.8], np.float32)
    out = cuflash.attention(q, k, v, alibi_slopes=slopes)
    passed = seen[-1].alibi_slopes
    assert passed.shape == (3, 4) and passed.strides == (0, 4)
    assert np.shares_memory(passed, slopes)
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v, alibi_slopes=np.tile(slopes, (3, 1))))


def test_defaults_are_dense_attention():
    """window (-1, -1), softcap 0, no slopes: bit for bit the plain call; the Variant says dense."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 9, 2, 8)).astype(np.float32) for _ in range(3))
    np.testing.assert_array_equal(cuflash.attention(q, k, v), cuflash.attention(q, k, v, window_size=(-1, -1),
                                                                                  softcap=0.0))
    assert Variant().is_dense and not Variant(window_left=3).is_dense
    # causal with a window: the right edge is min(right, 0); the left edge stays
    assert Variant(causal=True, window_left=4, window_right=9).band(5, 7) == (2, 4, 0)
    assert Variant(causal=True).band(5, 7) == (2, None, 0) and Variant().band(5, 7) is None
    assert Variant(window_right=3, bottom_right=False).band(5, 7) == (0, None, 3)


@pytest.mark.parametrize("lens", [([0, 0], [3, 4]), ([2, 3], [0, 0]), ([], [])], ids=["no-queries", "no-keys", "no-sequences"])
def test_empty_packed_batches(lens):
    lens_q, lens_k = lens
    cu_q, cu_k = _packed(lens_q), _packed(lens_k)
    q = np.ones((int(cu_q[-1]), 2, 4), np.float32)
    k = v = np.ones((int(cu_k[-1]), 2, 4), np.float32)
    options = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q, default=1) or 1,
                   max_seqlen_k=max(lens_k, default=1) or 1, causal=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    assert out.shape == q.shape and not out.any() and lse.shape == (2, q.shape[0]) and np.isneginf(lse).all()
    dq, dk, dv = cuflash.attention_backward(q, q, k, v, out, lse, **options)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and not dq.any() and not dk.any()
