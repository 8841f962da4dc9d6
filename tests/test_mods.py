"""User score and mask modifications (``score_mod``, ``mask_mod``, ``mod_arrays``): cuflash/_ops/mods.py and the
NumPy reference's hooks.

- The parser: C precedence and associativity, C's int / float semantics (int division truncates, ``%`` takes
  the dividend's sign, comparisons give int 0 / 1, float literals are float32), short-circuit evaluation,
  and the errors (argument, expression, position).
- Derivatives by dual numbers against central differences.
- The reference (naive, FA2, FA1, every backward order) against a float64 truth written here in plain NumPy,
  with the same modifications written as Python functions; gradients against the truth's analytic backward
  and against finite differences; score_mod and mask_mod reproducing softcap, ALiBi and causal masking match
  the built-in variants; rows that see no key; a -inf bias stays masked.
- The block map against a dense evaluation, its compacted lists, and the reference's tile loops skipping
  exactly its 0 tiles.
- Validation of the new keywords; the generated C++ (and, with NVRTC, that it compiles with
  cuflash_kernels/user_mods.cuh: tests named ``nvrtc``).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from _helpers import numeric_gradient

import cuflash
from cuflash._ops import mods as _mods
from cuflash import reference
from cuflash._ops.variant import Variant

pytestmark = pytest.mark.filterwarnings("error")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def value_of(text, **env):
    value, _, kind = _mods.evaluate(text, "score_mod", **env)
    return value, kind


# ---------------------------------------------------------------------------------------------------
# Parser: precedence and C semantics
# ---------------------------------------------------------------------------------------------------

C_CASES = [
    ("7 / 2", 3, "int"), ("-7 / 2", -3, "int"), ("7 / -2", -3, "int"), ("7 % 3", 1, "int"), ("-7 % 3", -1, "int"),
    ("7 % -3", 1, "int"), ("7 / 2 * 2", 6, "int"), ("7 / 2.0f", 3.5, "float"), ("7 / 2.0", 3.5, "float"),
    ("1 + 2 * 3", 7, "int"), ("(1 + 2) * 3", 9, "int"), ("10 - 4 - 3", 3, "int"), ("100 / 10 / 5", 2, "int"),
    ("2 * 3 % 4", 2, "int"), ("1 < 2 == 1", 1, "int"), ("3 > 2 > 1", 0, "int"), ("1 + 2 < 4", 1, "int"),
    ("1 || 0 && 0", 1, "int"), ("(1 || 0) && 0", 0, "int"), ("0 ? 1 : 2 ? 3 : 4", 3, "int"),
    ("1 ? 0 ? 5 : 6 : 7", 6, "int"), ("-2 * -3", 6, "int"), ("- -2", 2, "int"), ("!0 + !3", 1, "int"),
    ("!!7", 1, "int"), ("+5", 5, "int"), ("min(2, 3) + max(2, 3)", 5, "int"), ("abs(-3)", 3, "int"),
    ("abs(-2.5f)", 2.5, "float"), ("min(2, 2.5f)", 2.0, "float"), ("max(3, 2.5f)", 3.0, "float"),
    ("2 * 0.5f", 1.0, "float"), ("1 / 2 * 2.0f", 0.0, "float"), ("1.0f * 1 / 2", 0.5, "float"),
    ("0.1f", float(np.float32(0.1)), "float"), ("1e-3", float(np.float32(1e-3)), "float"),
    ("2.5e+1F", 25.0, "float"), (".5", 0.5, "float"), ("3.", 3.0, "float"), ("INFINITY > 1e30", 1, "int"),
    ("-INFINITY", -np.inf, "float"), ("floorf(-1.5f)", -2.0, "float"), ("ceilf(1.2f) + 1", 3.0, "float"),
    ("sqrtf(16)", 4.0, "float"), ("exp2f(3)", 8.0, "float"), ("log2f(8.0f)", 3.0, "float"),
    ("fminf(1, 2)", 1.0, "float"), ("fmaxf(1, 2)", 2.0, "float"), ("2147483647", 2**31 - 1, "int"),
    ("1 == 1.0f", 1, "int"), ("3 != 3", 0, "int"), ("2 >= 2", 1, "int"), ("2 <= 1", 0, "int"),
    ("score + 1", 1.0, "score"), ("score > 0 ? 1 : 2", 2, "int"), ("score < 1 ? score : 0.0f", 0.0, "score"),
]


@pytest.mark.parametrize("text, want, kind", C_CASES)
def test_c_semantics(text, want, kind):
    value, got_kind = value_of(text)
    assert got_kind == kind
    if kind == "int":
        assert np.asarray(value).dtype == np.int64 and int(value) == want
    else:
        assert float(value) == pytest.approx(want, rel=1e-6)


def test_index_variables_and_arrays_broadcast():
    doc = np.array([0, 0, 1, 1, 1, 2], np.int32)
    w = np.array([0.5, -1.0], np.float32)
    q_idx, kv_idx = np.arange(6)[:, None], np.arange(6)[None, :]
    value, kind = value_of("doc[q_idx] == doc[kv_idx]", q_idx=q_idx, kv_idx=kv_idx, arrays={"doc": doc})
    assert kind == "int" and np.array_equal(value, (doc[:, None] == doc[None, :]).astype(int))
    value, kind = value_of("w[h] * (q_idx - kv_idx) + b", b=3, h=np.array([0, 1])[:, None, None], q_idx=q_idx,
                           kv_idx=kv_idx, arrays={"w": w})
    assert kind == "float" and value.shape == (2, 6, 6)
    assert np.array_equal(value, w.astype(np.float64)[:, None, None] * (q_idx - kv_idx) + 3)


def test_float_literals_are_float32_and_ints_are_32_bit():
    value, _ = value_of("0.1f + 0.2")
    assert float(value) == float(np.float32(0.1)) + float(np.float32(0.2))
    with pytest.raises(ValueError, match="integer overflow"):
        value_of("2147483647 + 1")
    with pytest.raises(ValueError, match="integer overflow"):
        value_of("q_idx * q_idx", q_idx=np.array([1, 50000]))
    with pytest.raises(ValueError, match="does not fit a 32-bit int"):
        value_of("2147483648")
    with pytest.raises(ValueError, match="overflows float32"):
        value_of("1e39")


def test_short_circuit_and_branches_guard_checks():
    """C evaluates the right of && / || and one branch of ?: only where chosen: an out-of-range index or an
    integer division by zero elsewhere is no error."""
    doc = np.arange(10, dtype=np.int32)
    kv = np.arange(20)
    value, _ = value_of("kv_idx < 10 && doc[kv_idx] >= 5", kv_idx=kv, arrays={"doc": doc})
    assert np.array_equal(value, ((kv < 10) & (kv >= 5)).astype(int))
    value, _ = value_of("kv_idx >= 10 || doc[kv_idx] < 3", kv_idx=kv, arrays={"doc": doc})
    assert np.array_equal(value, ((kv >= 10) | (kv < 3)).astype(int))
    value, _ = value_of("kv_idx < 10 ? doc[kv_idx] : -1", kv_idx=kv, arrays={"doc": doc})
    assert np.array_equal(value, np.where(kv < 10, kv, -1))
    value, _ = value_of("q_idx > 0 ? 10 / q_idx : 0", q_idx=np.arange(4))
    assert list(value) == [0, 10, 5, 3]
    value, _ = value_of("0 && 1 / 0")
    assert int(value) == 0
    with pytest.raises(ValueError, match=r"index 10 out of range for mod_arrays\['doc'\] of length 10"):
        value_of("doc[kv_idx]", kv_idx=kv, arrays={"doc": doc})
    with pytest.raises(ValueError, match="integer division by zero"):
        value_of("10 / q_idx", q_idx=np.arange(4))
    with pytest.raises(ValueError, match="integer remainder by zero"):
        value_of("10 % (q_idx - 1)", q_idx=np.arange(4))


ERROR_CASES = [
    ("mask_mod", "score > 0", "'score' is not available in mask_mod", 0),
    ("score_mod", "score +", "unexpected end of the expression", 7),
    ("score_mod", "(score * 2", "expected ')'", 10),
    ("score_mod", "score * 2)", "unbalanced parentheses", 9),
    ("score_mod", "tanh(score)", "unknown function 'tanh'", 0),
    ("score_mod", "score * scale", "unknown identifier 'scale'", 8),
    ("mask_mod", "doc[q_idx] == 1", "'doc' is not an array of mod_arrays", 0),
    ("score_mod", "score % 2", "'%' needs int operands", 6),
    ("score_mod", "score * 2f", "invalid number '2f'", 8),
    ("score_mod", "score * 010", "octal literals", 8),
    ("score_mod", "score * 0x10", "invalid number", 8),
    ("score_mod", "score $ 1", "unexpected character '$'", 6),
    ("score_mod", "score = 1", "unexpected character '='", 6),
    ("score_mod", "score & 1", "unexpected character '&'", 6),
    ("score_mod", "tanhf(score, 1)", "tanhf takes 1 argument; got 2", 0),
    ("score_mod", "fminf(score)", "fminf takes 2 arguments; got 1", 0),
    ("score_mod", "min + 1", "function 'min' must be called with ( )", 0),
    ("score_mod", "", "empty expression", 0),
    ("score_mod", "   ", "empty expression", 0),
    ("score_mod", "score ? 1", "expected ':'", 9),
    ("mask_mod", "q_idx[1]", "'q_idx' is not an array", 0),
    ("mask_mod", "q_idx < 1; exit(0)", "unexpected character ';'", 9),
    ("mask_mod", "__import__('os')", "unexpected character", 11),
    ("mask_mod", "q_idx < kv_idx)", "unexpected ')' (unbalanced parentheses)", 14),
    ("mask_mod", "1 2", "unexpected '2'", 2),
]


@pytest.mark.parametrize("arg, text, fragment, pos", ERROR_CASES)
def test_parse_errors_name_argument_expression_and_position(arg, text, fragment, pos):
    with pytest.raises(ValueError) as info:
        _mods.parse(text, arg)
    message = str(info.value)
    assert message.startswith(f"{arg}: ") and fragment in message
    assert f"position {pos} of {text!r}" in message


def test_parse_errors_with_arrays_and_limits():
    with pytest.raises(ValueError, match=r"array 'doc' must be indexed"):
        _mods.parse("doc == 1", "mask_mod", {"doc": "int32"})
    with pytest.raises(ValueError, match=r"'doc' is an array: index it with \[ \]"):
        _mods.parse("doc(1) == 1", "mask_mod", {"doc": "int32"})
    with pytest.raises(ValueError, match=r"the index of doc\[...\] must be an int expression"):
        _mods.parse("doc[0.5f] == 1", "mask_mod", {"doc": "int32"})
    with pytest.raises(ValueError, match=r"the arrays doc of mod_arrays"):
        _mods.parse("docs[q_idx]", "mask_mod", {"doc": "int32"})
    with pytest.raises(ValueError, match="at most 1000 characters"):
        _mods.parse("1 + " * 300 + "1", "mask_mod")
    with pytest.raises(ValueError, match="nested too deeply"):
        _mods.parse("(" * 150 + "1" + ")" * 150, "mask_mod")
    with pytest.raises(ValueError, match="nested too deeply"):
        _mods.parse("+".join(["b"] * 150), "mask_mod")
    with pytest.raises(TypeError, match="score_mod must be a string"):
        _mods.parse(3, "score_mod")
    _mods.parse(" + ".join(["q_idx"] * 90), "mask_mod")  # deep, but within the limit


# ---------------------------------------------------------------------------------------------------
# Derivatives (dual numbers)
# ---------------------------------------------------------------------------------------------------

DERIVATIVE_CASES = [
    "30.0f * tanhf(score / 30.0f)", "score * score - 2 * score", "expf(score / 4) + logf(score * score + 1)",
    "sqrtf(score * score + 1)", "exp2f(score) + log2f(fabsf(score) + 1)", "sinf(score) * cosf(score)",
    "fminf(score, 1.0f) + fmaxf(score, -1.0f) + min(score, 0.5f) + max(0.25f, score)",
    "score > 0 ? score : 0.1f * score", "score / (1 + abs(score))", "floorf(score) + score",
    "1.0f / score + score / 3", "-score + (q_idx - kv_idx) * score", "kv_idx > 2 ? -INFINITY : score * 2",
    "score * (h == 1 ? 2 : 3) - b",
]


@pytest.mark.parametrize("text", DERIVATIVE_CASES)
def test_derivative_matches_central_differences(text):
    s = np.array([-2.3, -0.7, -0.2, 0.35, 0.8, 1.7, 2.9])[:, None]
    env = dict(b=1, h=np.array([0, 1])[None, :], q_idx=4, kv_idx=np.array([1, 3])[None, :])
    value, deriv, _ = _mods.evaluate(text, score=s, **env)
    step = 1e-6
    plus, _, _ = _mods.evaluate(text, score=s + step, **env)
    minus, _, _ = _mods.evaluate(text, score=s - step, **env)
    finite = np.isfinite(np.broadcast_to(value, np.broadcast_shapes(np.shape(value), s.shape)))
    with np.errstate(invalid="ignore"):  # -inf - -inf where the value is not finite
        numeric = np.where(finite, (plus - minus) / (2 * step), 0)
    assert np.allclose(np.where(finite, deriv, 0), numeric, rtol=1e-6, atol=1e-6)


def test_usermods_score_and_mask_shapes():
    mods = _mods.user_mods("score * 2", "q_idx >= kv_idx")
    value, deriv = mods.score(np.ones((2, 3, 1)), 0, 0, np.arange(1)[:, None], np.arange(4)[None, :])
    assert value.shape == deriv.shape == (2, 3, 4) and np.all(value == 2) and np.all(deriv == 2)
    constant = _mods.user_mods("1.5f", None)
    value, deriv = constant.score(np.zeros((2, 2), np.float32), 0, 0, 0, 0)
    assert value.dtype == np.float32 and np.all(value == 1.5) and np.all(deriv == 0)
    visible = mods.mask(0, 0, np.arange(3)[:, None], np.arange(3)[None, :])
    assert visible.dtype == bool and np.array_equal(visible, np.tri(3, dtype=bool))


# ---------------------------------------------------------------------------------------------------
# The reference against a float64 truth written here
# ---------------------------------------------------------------------------------------------------


def dense_truth(q, k, v, do, scale, *, score_fn=None, dscore_fn=None, mask_fn=None, causal=False, bias=None):
    """Attention with a score and a mask function, in float64, one (batch, head) at a time:
    ``(out, lse, (dq, dk, dv))``. ``score_fn(t, b, h, i, j)`` modifies the scaled score (after the bias), its
    derivative is ``dscore_fn``; ``mask_fn(b, h, i, j)`` is True where query i sees key j."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    batch, len_q, heads, _ = q.shape
    len_k, heads_kv = k.shape[1], k.shape[2]
    group = heads // heads_kv
    i, j = np.arange(len_q)[:, None], np.arange(len_k)[None, :]
    out, lse = np.zeros(q.shape), np.full((batch, heads, len_q), -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for h in range(heads):
            kh, vh = k[b, :, h // group], v[b, :, h // group]
            t = scale * q[b, :, h] @ kh.T
            if bias is not None:
                t = t + bias[b, h]
            dmod = np.ones_like(t)
            if score_fn is not None:
                masked = np.isneginf(t)
                t, dmod = np.where(masked, t, score_fn(t, b, h, i, j)), np.where(masked, 0, dscore_fn(t, b, h, i, j))
            visible = np.ones(t.shape, bool)
            if mask_fn is not None:
                visible &= np.broadcast_to(mask_fn(b, h, i, j), t.shape)
            if causal:
                visible &= j <= i + len_k - len_q
            t = np.where(visible, t, -np.inf)
            m = t.max(axis=1, keepdims=True)
            m = np.where(np.isneginf(m), 0, m)
            p = np.exp(t - m)
            l = p.sum(axis=1, keepdims=True)
            seen = l[:, 0] > 0
            p = p / np.where(l > 0, l, 1)
            out[b, :, h] = p @ vh
            lse[b, h] = np.where(seen, m[:, 0] + np.log(np.where(seen, l[:, 0], 1)), -np.inf)
            dp = do[b, :, h] @ vh.T
            ds = p * (dp - (p * dp).sum(axis=1, keepdims=True)) * np.where(visible, dmod, 0)
            dq[b, :, h] = scale * ds @ kh
            dk[b, :, h // group] += scale * ds.T @ q[b, :, h]
            dv[b, :, h // group] += p.T @ do[b, :, h]
    return out, lse, (dq, dk, dv)


REL = (np.random.default_rng(7).standard_normal(63) * 0.5).astype(np.float32)  # relative position bias
DOC = np.repeat(np.arange(6), [5, 9, 1, 12, 7, 30]).astype(np.int32)           # document ids, 64 positions

CASES = {
    "softcap": dict(score_mod="20.0f * tanhf(score / 20.0f)",
                    score_fn=lambda t, b, h, i, j: 20 * np.tanh(t / 20),
                    dscore_fn=lambda t, b, h, i, j: 1 - np.tanh(t / 20) ** 2),
    "alibi-like": dict(score_mod="score - 0.25f * abs(q_idx - kv_idx)",
                       score_fn=lambda t, b, h, i, j: t - 0.25 * np.abs(i - j),
                       dscore_fn=lambda t, b, h, i, j: np.ones_like(t)),
    "relative-bias": dict(score_mod="score + rel[min(max(q_idx - kv_idx, -31), 31) + 31]", arrays={"rel": REL},
                          score_fn=lambda t, b, h, i, j: t + REL.astype(np.float64)[np.clip(i - j, -31, 31) + 31],
                          dscore_fn=lambda t, b, h, i, j: np.ones_like(t)),
    "per-head-scale": dict(score_mod="h % 2 == 0 ? score * 2.0f : score - b",
                           score_fn=lambda t, b, h, i, j: t * 2 if h % 2 == 0 else t - b,
                           dscore_fn=lambda t, b, h, i, j: np.full_like(t, 2.0 if h % 2 == 0 else 1.0)),
    "leaky": dict(score_mod="score > 0 ? score : 0.5f * score",
                  score_fn=lambda t, b, h, i, j: np.where(t > 0, t, 0.5 * t),
                  dscore_fn=lambda t, b, h, i, j: np.where(t > 0, 1.0, 0.5)),
    "prefix-lm": dict(mask_mod="kv_idx <= q_idx || kv_idx < 5", mask_fn=lambda b, h, i, j: (j <= i) | (j < 5)),
    "document": dict(mask_mod="doc[q_idx] == doc[kv_idx]", arrays={"doc": DOC},
                     mask_fn=lambda b, h, i, j: DOC[i] == DOC[j]),
    "sliding-window": dict(mask_mod="q_idx - kv_idx >= 0 && q_idx - kv_idx < 8",
                           mask_fn=lambda b, h, i, j: (i - j >= 0) & (i - j < 8)),
    "per-batch-and-head": dict(mask_mod="kv_idx < 10 + 7 * b + 3 * h", mask_fn=lambda b, h, i, j: j < 10 + 7 * b + 3 * h),
    "empty-rows": dict(mask_mod="q_idx >= 3 && kv_idx % 3 != 1", mask_fn=lambda b, h, i, j: (i >= 3) & (j % 3 != 1)),
    "document-softcap": dict(score_mod="10.0f * tanhf(score / 10.0f) + (doc[kv_idx] == 3 ? 1.0f : 0.0f)",
                             mask_mod="doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", arrays={"doc": DOC},
                             score_fn=lambda t, b, h, i, j: 10 * np.tanh(t / 10) + (DOC[j] == 3),
                             dscore_fn=lambda t, b, h, i, j: 1 - np.tanh(t / 10) ** 2,
                             mask_fn=lambda b, h, i, j: (DOC[i] == DOC[j]) & (j <= i)),
}


def keywords(case):
    return {name: case[name] for name in ("score_mod", "mask_mod") if name in case} | (
        {"mod_arrays": case["arrays"]} if "arrays" in case else {})


def truth_of(case, q, k, v, do, scale, **kw):
    fns = {name: case[name] for name in ("score_fn", "dscore_fn", "mask_fn") if name in case}
    return dense_truth(q, k, v, do, scale, **fns, **kw)


def inputs(batch=2, len_q=40, len_k=52, heads=4, heads_kv=2, d=16, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, len_q, heads, d)).astype(dtype)
    k = rng.standard_normal((batch, len_k, heads_kv, d)).astype(dtype)
    v = rng.standard_normal((batch, len_k, heads_kv, d)).astype(dtype)
    do = rng.standard_normal((batch, len_q, heads, d)).astype(dtype)
    return q, k, v, do


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_the_float64_truth(name):
    case = CASES[name]
    q, k, v, do = inputs(len_q=40, len_k=40 if "doc" in case.get("arrays", {}) or name == "prefix-lm" else 52)
    scale = 0.4
    out_t, lse_t, grads_t = truth_of(case, q, k, v, do, scale)
    kw = keywords(case)
    for algorithm in ("naive", "fa2", "fa1"):
        out, lse = cuflash.attention(q, k, v, softmax_scale=scale, algorithm=algorithm, block_q=16, block_k=8,
                                     return_lse=True, **kw)
        assert np.allclose(out, out_t, atol=1e-12), algorithm
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_t)) and np.allclose(lse, lse_t, atol=1e-12)
        orders = ("kv_outer", "q_outer", "split") if algorithm == "fa2" else (None,)
        for order in orders:
            grads = cuflash.attention_backward(do, q, k, v, out, lse, softmax_scale=scale, algorithm=algorithm,
                                               block_q=16, block_k=8, order=order, **kw)
            for g, gt in zip(grads, grads_t):
                assert np.isfinite(g).all() and np.allclose(g, gt, atol=1e-11), (algorithm, order)


def test_rows_that_see_no_key():
    """mask_mod masking whole rows: out 0, lse -inf, zero gradients for them, never NaN."""
    case = CASES["empty-rows"]
    q, k, v, do = inputs(len_q=20, len_k=20)
    out, lse = cuflash.attention(q, k, v, return_lse=True, block_q=4, block_k=4, **keywords(case))
    assert np.all(out[:, :3] == 0) and np.all(np.isneginf(lse[:, :, :3])) and np.isfinite(lse[:, :, 3:]).all()
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, block_q=4, block_k=4, **keywords(case))
    assert np.all(dq[:, :3] == 0) and np.isfinite(dk).all() and np.isfinite(dv).all()
    everything = cuflash.attention(q, k, v, return_lse=True, mask_mod="0")
    assert np.all(everything[0] == 0) and np.all(np.isneginf(everything[1]))
    grads = cuflash.attention_backward(do, q, k, v, *everything, mask_mod="0")
    assert all(np.all(g == 0) for g in grads)


def test_gradients_match_finite_differences():
    """The whole chain (softcap, ALiBi, bias, score_mod, the masks) against central differences of the loss."""
    q, k, v, do = inputs(batch=1, len_q=6, len_k=7, heads=2, heads_kv=1, d=4, seed=3)
    bias = np.random.default_rng(4).standard_normal((1, 2, 6, 7))
    kw = dict(softmax_scale=0.7, softcap=5.0, alibi_slopes=np.array([0.25, 0.5], np.float32), bias=bias,
              score_mod="score > 0 ? 3.0f * tanhf(score / 3.0f) : score + 0.1f * q_idx",
              mask_mod="kv_idx <= q_idx + 1 || kv_idx == 6", block_q=2, block_k=3)

    def loss(q, k, v, bias):
        return float((cuflash.attention(q, k, v, **(kw | {"bias": bias})) * do).sum())

    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv, dbias = cuflash.attention_backward(do, q, k, v, out, lse, **kw)
    for index, grad in enumerate((dq, dk, dv, dbias)):
        numeric = numeric_gradient(loss, [q, k, v, bias], index, step=1e-6)
        assert np.allclose(grad, numeric, atol=1e-7, rtol=1e-6), index


def test_score_mod_and_mask_mod_reproduce_builtin_variants():
    """softcap, ALiBi and causal masking written as score_mod / mask_mod give the built-ins' results."""
    q, k, v, do = inputs(len_q=24, len_k=30)
    off = 30 - 24
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    pairs = [
        (dict(softcap=20.0), dict(score_mod="20.0f * tanhf(score / 20.0f)")),
        (dict(alibi_slopes=slopes), dict(score_mod=f"score - slopes[h] * abs(q_idx + {off} - kv_idx)",
                                         mod_arrays={"slopes": slopes})),
        (dict(alibi_slopes=slopes[:1].repeat(4)), dict(score_mod=f"score - 0.5f * fabsf(q_idx + {off} - kv_idx)")),
        (dict(causal=True), dict(mask_mod=f"kv_idx <= q_idx + {off}")),
        (dict(causal=True, window_size=(5, -1)), dict(mask_mod=f"kv_idx <= q_idx + {off} && kv_idx >= q_idx + {off} - 5")),
        (dict(softcap=8.0, alibi_slopes=slopes, causal=True),
         dict(score_mod=f"8.0f * tanhf(score / 8.0f) - slopes[h] * abs(q_idx + {off} - kv_idx)",
              mask_mod=f"kv_idx <= q_idx + {off}", mod_arrays={"slopes": slopes})),
    ]
    for builtin, user in pairs:
        for algorithm in ("naive", "fa2"):
            common = dict(softmax_scale=0.3, algorithm=algorithm, block_q=8, block_k=8)
            out_b, lse_b = cuflash.attention(q, k, v, return_lse=True, **builtin, **common)
            out_u, lse_u = cuflash.attention(q, k, v, return_lse=True, **user, **common)
            assert np.allclose(out_u, out_b, atol=1e-13) and np.allclose(lse_u, lse_b, atol=1e-13), (builtin, algorithm)
            grads_b = cuflash.attention_backward(do, q, k, v, out_b, lse_b, **builtin, **common)
            grads_u = cuflash.attention_backward(do, q, k, v, out_u, lse_u, **user, **common)
            for g_u, g_b in zip(grads_u, grads_b):
                assert np.allclose(g_u, g_b, atol=1e-12), (builtin, algorithm)


def test_combined_with_other_variants_blocked_equals_naive():
    """With causal masking, windows, GQA, packed batches and key padding, the blocked algorithms equal naive
    in float64, and score_mod / mask_mod see positions within each sequence and b = the sequence's index."""
    rng = np.random.default_rng(5)
    kw_list = [
        dict(causal=True, window_size=(12, 3), score_mod="score + 0.5f * (b - h)", mask_mod="(q_idx + kv_idx) % 5 != 0"),
        dict(seqused_k=np.array([30, 9], np.int32), mask_mod="doc[kv_idx] != 2 && b + kv_idx > 1",
             mod_arrays={"doc": DOC}, score_mod="logf(1 + expf(score))"),
        dict(causal=True, causal_align="top-left", mask_mod="kv_idx > q_idx - 10 || kv_idx == 0"),
    ]
    q, k, v, do = inputs(len_q=33, len_k=37)
    for kw in kw_list:
        naive = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **kw)
        grads_naive = cuflash.attention_backward(do, q, k, v, *naive, algorithm="naive", **kw)
        for algorithm in ("fa2", "fa1"):
            out, lse = cuflash.attention(q, k, v, algorithm=algorithm, block_q=8, block_k=16, return_lse=True, **kw)
            assert np.allclose(out, naive[0], atol=1e-13) and np.allclose(lse, naive[1], atol=1e-13)
        for order in ("kv_outer", "q_outer", "split"):
            grads = cuflash.attention_backward(do, q, k, v, *naive, block_q=16, block_k=8, order=order, **kw)
            assert all(np.allclose(g, gn, atol=1e-12) for g, gn in zip(grads, grads_naive))
    # packed: three sequences, b is the sequence's index and positions restart in each
    lens_q, lens_k = [5, 17, 9], [8, 17, 12]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    qp, dop = (rng.standard_normal((cu_q[-1], 4, 8)) for _ in range(2))
    kp, vp = (rng.standard_normal((cu_k[-1], 2, 8)) for _ in range(2))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=17, max_seqlen_k=17,
              score_mod="score * (1 + b)", mask_mod="kv_idx <= q_idx + b")
    out, lse = cuflash.attention(qp, kp, vp, return_lse=True, block_q=4, block_k=4, **kw)
    grads = cuflash.attention_backward(dop, qp, kp, vp, out, lse, block_q=4, block_k=4, **kw)
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = dict(score_fn=lambda t, _b, h, i, j, b=b: t * (1 + b), dscore_fn=lambda t, _b, h, i, j, b=b: 0 * t + 1 + b,
                   mask_fn=lambda _b, h, i, j, b=b: j <= i + b)
        out_t, lse_t, grads_t = truth_of(one, qp[None, rq], kp[None, rk], vp[None, rk], dop[None, rq], 1 / np.sqrt(8))
        assert np.allclose(out[rq], out_t[0], atol=1e-12) and np.allclose(lse[:, rq], lse_t[0], atol=1e-12)
        for g, gt, rows in zip(grads, grads_t, (rq, rk, rk)):
            assert np.allclose(g[rows], gt[0], atol=1e-11)


def test_masked_bias_stays_masked_under_score_mod():
    """A score_mod cannot unmask a score that attn_mask (or a -inf bias) masked: tanh(-inf) would be finite."""
    q, k, v, do = inputs(batch=1, len_q=12, len_k=12)
    keep = np.random.default_rng(2).random((1, 1, 12, 12)) > 0.4
    keep[..., 0, :] = False  # a row that sees nothing
    case = CASES["softcap"]
    out, lse = cuflash.attention(q, k, v, attn_mask=keep, return_lse=True, block_q=4, block_k=4,
                                 score_mod=case["score_mod"])
    bias = np.where(keep, 0.0, -np.inf)
    out_t, lse_t, grads_t = truth_of(case, q, k, v, do, 0.25, bias=np.broadcast_to(bias, (1, 4, 12, 12)))
    assert np.allclose(out, out_t, atol=1e-12) and np.allclose(lse, lse_t, atol=1e-12)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, attn_mask=keep, block_q=4, block_k=4,
                                       score_mod=case["score_mod"])
    assert all(np.isfinite(g).all() and np.allclose(g, gt, atol=1e-11) for g, gt in zip(grads, grads_t))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_close_to_the_truth(dtype):
    case = CASES["document-softcap"]
    q, k, v, do = inputs(len_q=64, len_k=64, dtype=dtype)
    out_t, lse_t, _ = truth_of(case, q, k, v, do, 0.25)
    naive = cuflash.attention(q, k, v, return_lse=True, algorithm="naive", **keywords(case))
    out, lse = cuflash.attention(q, k, v, return_lse=True, block_q=16, block_k=16, **keywords(case))
    assert out.dtype == dtype and lse.dtype == np.float32
    naive_error = np.abs(naive[0].astype(np.float64) - out_t).max()
    assert np.abs(out.astype(np.float64) - out_t).max() <= 2 * naive_error + 1e-3
    assert np.allclose(lse, lse_t, atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# Block map
# ---------------------------------------------------------------------------------------------------


def dense_tiles(visible, present, block_m, block_n):
    """The block map by brute force: per tile, 0 if no visible present score, 2 if all present are visible."""
    nb, nh, rows, cols = visible.shape
    n_qt, n_kt = -(-rows // block_m), -(-cols // block_n)
    tiles = np.zeros((nb, nh, n_qt, n_kt), np.int8)
    for t in range(n_qt):
        for u in range(n_kt):
            sl = (slice(None), slice(None), slice(t * block_m, (t + 1) * block_m), slice(u * block_n, (u + 1) * block_n))
            vis, pres = visible[sl] & present[sl], present[sl]
            any_vis = vis.any(axis=(2, 3))
            full = (vis | ~pres).all(axis=(2, 3))
            tiles[:, :, t, u] = np.where(any_vis, np.where(full, 2, 1), 0)
    return tiles


MASKS = [
    ("kv_idx <= q_idx", {}),
    ("kv_idx <= q_idx || kv_idx < 16", {}),
    ("doc[q_idx] == doc[kv_idx]", {"doc": DOC}),
    ("q_idx - kv_idx >= 0 && q_idx - kv_idx < 8", {}),
    ("kv_idx < 10 + 7 * b + 3 * h", {}),
    ("(q_idx / 16 + kv_idx / 16 + h) % 2 == 0", {}),
    ("0", {}),
    ("1", {}),
]


@pytest.mark.parametrize("mask, arrays", MASKS)
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (8, 32), (5, 7), (64, 64)])
def test_block_map_against_a_dense_evaluation(mask, arrays, block_m, block_n):
    mods = _mods.user_mods(None, mask, arrays)
    batch, heads, len_q, len_k = 3, 2, 61, 64
    bm = _mods.block_map(mods, batch, heads, len_q, len_k, block_m, block_n, arrays=arrays)
    nb = batch if mods.mask_uses_b else 1
    nh = heads if mods.mask_uses_h else 1
    assert bm.tiles.dtype == np.int8 and bm.tiles.shape == (nb, nh, -(-len_q // block_m), -(-len_k // block_n))
    b, h = np.arange(nb).reshape(-1, 1, 1, 1), np.arange(nh).reshape(1, -1, 1, 1)
    i, j = np.arange(len_q).reshape(1, 1, -1, 1), np.arange(len_k).reshape(1, 1, 1, -1)
    visible = np.broadcast_to(mods.mask(b, h, i, j, arrays), (nb, nh, len_q, len_k))
    assert np.array_equal(bm.tiles, dense_tiles(visible, np.ones_like(visible), block_m, block_n))
    small = _mods.block_map(mods, batch, heads, len_q, len_k, block_m, block_n, arrays=arrays, chunk_elems=1)
    assert np.array_equal(small.tiles, bm.tiles)
    check_compact(bm)


def check_compact(bm):
    live = bm.tiles != 0
    for name in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices"):
        assert getattr(bm, name).dtype == np.int32
    assert np.array_equal(bm.kv_num_blocks, live.sum(-1)) and np.array_equal(bm.q_num_blocks, live.sum(-2))
    nb, nh, n_qt, n_kt = bm.tiles.shape
    assert bm.kv_indices.shape == (nb, nh, n_qt, n_kt) and bm.q_indices.shape == (nb, nh, n_kt, n_qt)
    for idx in np.ndindex(nb, nh, n_qt):
        row = bm.kv_indices[idx]
        count = bm.kv_num_blocks[idx]
        assert list(row[:count]) == list(np.flatnonzero(live[idx])) and sorted(row) == list(range(n_kt))
    for idx in np.ndindex(nb, nh, n_kt):
        col = bm.q_indices[idx]
        count = bm.q_num_blocks[idx]
        assert list(col[:count]) == list(np.flatnonzero(live[idx[0], idx[1], :, idx[2]]))
        assert sorted(col) == list(range(n_qt))


def test_block_map_with_sequence_lengths():
    """Packed sequences and key padding: positions past a sequence's lengths hold no score (and are never
    evaluated: doc is shorter than the longest sequence)."""
    mods = _mods.user_mods(None, "doc[q_idx] == doc[kv_idx] || kv_idx == 0", {"doc": "int32"})
    doc = DOC[:40]
    lengths_q, lengths_k = np.array([40, 17, 0]), np.array([33, 40, 5])
    bm = _mods.block_map(mods, 3, 2, 48, 48, 8, 8, arrays={"doc": doc}, lengths_q=lengths_q, lengths_k=lengths_k)
    assert bm.tiles.shape == (3, 1, 6, 6)
    i, j = np.arange(48).reshape(1, 1, -1, 1), np.arange(48).reshape(1, 1, 1, -1)
    present = (i < lengths_q.reshape(-1, 1, 1, 1)) & (j < lengths_k.reshape(-1, 1, 1, 1))
    visible = (doc[np.minimum(i, 39)] == doc[np.minimum(j, 39)]) | (j == 0)
    assert np.array_equal(bm.tiles, dense_tiles(np.broadcast_to(visible, present.shape), present, 8, 8))
    assert np.all(bm.tiles[2] == 0)
    with pytest.raises(ValueError, match="out of range"):
        _mods.block_map(mods, 1, 1, 48, 48, 8, 8, arrays={"doc": doc})
    assert _mods.block_map(_mods.user_mods("score", None), 1, 1, 8, 8, 4, 4) is None


def test_reference_skips_exactly_the_tiles_of_block_map_0(monkeypatch):
    """The blocked loops compute a tile iff the block map of the run holds a non-0 entry for it, in every loop
    order, and evaluate mask_mod only in tiles not wholly visible."""
    mask = "doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx"
    arrays = {"doc": DOC}
    q, k, v, do = inputs(batch=1, len_q=64, len_k=64)
    bm = _mods.block_map(_mods.user_mods(None, mask, arrays), 1, 4, 64, 64, 8, 8, arrays=arrays)
    want = {(t * 8, u * 8) for t, u in zip(*np.nonzero(bm.tiles.max(axis=(0, 1))))}
    assert 0 < len(want) < 64
    seen, masked = [], []
    real_scores, real_mask = reference._scores, _mods.UserMods.mask

    def spy_scores(q_i, k_j, mods, q_start, q_stop, k_start, k_stop):
        seen.append((q_start, k_start))
        return real_scores(q_i, k_j, mods, q_start, q_stop, k_start, k_stop)

    def spy_mask(self, b, h, q_idx, kv_idx, arrays=None, *, live=None):
        if np.size(q_idx) <= 8 and np.size(kv_idx) <= 8:  # a tile's, not the block map's
            masked.append((int(np.min(q_idx)), int(np.min(kv_idx))))
        return real_mask(self, b, h, q_idx, kv_idx, arrays, live=live)

    monkeypatch.setattr(reference, "_scores", spy_scores)
    monkeypatch.setattr(_mods.UserMods, "mask", spy_mask)
    kw = dict(mask_mod=mask, mod_arrays=arrays, block_q=8, block_k=8)
    for algorithm in ("fa2", "fa1"):
        seen.clear()
        out, lse = cuflash.attention(q, k, v, algorithm=algorithm, return_lse=True, **kw)
        assert set(seen) == want and len(seen) == len(want)
    full = {(t * 8, u * 8) for t, u in zip(*np.nonzero(bm.tiles.min(axis=(0, 1)) == 2))}
    assert full and not (set(masked) & full)
    for order in ("kv_outer", "q_outer", "split"):
        seen.clear()
        cuflash.attention_backward(do, q, k, v, out, lse, order=order, **kw)
        assert set(seen) == want and len(seen) == len(want) * (2 if order == "split" else 1)


# ---------------------------------------------------------------------------------------------------
# The front door: validation and the Variant
# ---------------------------------------------------------------------------------------------------


def test_variant_holds_the_parsed_mods(monkeypatch):
    q, k, v, _ = inputs(batch=1, len_q=8, len_k=8)
    calls = []
    real = reference.forward

    def spy(*args, variant, **kwargs):
        calls.append(variant)
        return real(*args, variant=variant, **kwargs)

    monkeypatch.setattr(reference, "forward", spy)
    w = np.ones(3, np.float32)
    cuflash.attention(q, k, v, score_mod="score * w[0]", mask_mod="kv_idx <= q_idx",
                      mod_arrays={"w": w, "unused": np.zeros(2, np.int32)})
    variant = calls[0]
    assert not variant.is_dense and variant.mods.array_names == ("w",) and variant.mod_arrays[0] is w
    assert hash(variant.mods) == hash(_mods.user_mods("(score) * w[(0)]", "kv_idx<=q_idx", {"w": "float32"}))
    assert Variant(mods=variant.mods).is_dense is False and Variant().is_dense


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(score_mod=3), TypeError, "score_mod must be a string"),
    (dict(mask_mod=b"q_idx"), TypeError, "mask_mod must be a string"),
    (dict(mod_arrays={"doc": np.zeros(3, np.int32)}), ValueError, "mod_arrays is read by score_mod and mask_mod only"),
    (dict(mask_mod="1", mod_arrays=[np.zeros(3, np.int32)]), TypeError, "mod_arrays must be a dict"),
    (dict(mask_mod="1", mod_arrays={f"a{i}": np.zeros(3, np.int32) for i in range(5)}), ValueError, "at most 4"),
    (dict(mask_mod="1", mod_arrays={"score": np.zeros(3, np.int32)}), ValueError, "reserved"),
    (dict(mask_mod="1", mod_arrays={"min": np.zeros(3, np.int32)}), ValueError, "reserved"),
    (dict(mask_mod="1", mod_arrays={"int": np.zeros(3, np.int32)}), ValueError, "reserved"),
    (dict(mask_mod="1", mod_arrays={"__x": np.zeros(3, np.int32)}), ValueError, "reserved"),
    (dict(mask_mod="1", mod_arrays={"1x": np.zeros(3, np.int32)}), ValueError, "C identifiers"),
    (dict(mask_mod="1", mod_arrays={"x-y": np.zeros(3, np.int32)}), ValueError, "C identifiers"),
    (dict(mask_mod="1", mod_arrays={"x": np.zeros(3, np.int64)}), TypeError, "int32 or float32; got int64"),
    (dict(mask_mod="1", mod_arrays={"x": np.zeros((3, 2), np.int32)}), ValueError, "must be 1-D"),
    (dict(mask_mod="1", mod_arrays={"x": np.zeros(0, np.int32)}), ValueError, "between 1 and"),
    (dict(mask_mod="1", mod_arrays={"x": np.zeros(6, np.int32)[::2]}), ValueError, "contiguous"),
    (dict(mask_mod="x[q_idx] > 0", mod_arrays={"y": np.zeros(8, np.int32)}), ValueError, "'x' is not an array"),
    (dict(score_mod="score + scale"), ValueError, "score_mod: unknown identifier 'scale'"),
    (dict(mask_mod="doc[q_idx] > 0", mod_arrays={"doc": np.zeros(4, np.int32)}), ValueError,
     r"index 4 out of range for mod_arrays\['doc'\] of length 4"),
])
def test_front_door_checks(kwargs, error, fragment):
    q, k, v, _ = inputs(batch=1, len_q=8, len_k=8)
    with pytest.raises(error, match=fragment):
        cuflash.attention(q, k, v, **kwargs)


# ---------------------------------------------------------------------------------------------------
# The generated C++
# ---------------------------------------------------------------------------------------------------


def test_generated_struct_interface():
    mods = _mods.user_mods("score - 0.5f * abs(q_idx - kv_idx)", "doc[q_idx] == doc[kv_idx]\n  && kv_idx <= q_idx",
                           {"doc": "int32", "zz": "float32", "aa": "float32"})
    name, source = mods.type_name, mods.source
    assert name.startswith("UserMod_") and f"struct {name} {{" in source
    assert "static constexpr bool Has_score_mod = true;" in source and "static constexpr bool Has_mask_mod = true;" in source
    assert ("template <class F, bool kFast = false>\n    __device__ __forceinline__ static F score(F score, int b, int h, int q_idx, "
            "int kv_idx,\n") in source
    assert "__device__ __forceinline__ static bool mask(int b, int h, int q_idx, int kv_idx, const ModArrays& arrays)" in source
    assert "const int* doc = static_cast<const int*>(arrays.ptr[0]);" in source and "zz" not in source.split("struct")[1]
    assert mods.array_names == ("doc",)
    assert "// mask_mod:  doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx\n" in source  # the user's text on one line
    # Normalized: spacing and parentheses do not change the type; dtypes and expressions do.
    same = _mods.user_mods("(score)-0.5f*abs((q_idx-kv_idx))", "(doc[q_idx]==doc[kv_idx])&&kv_idx<=q_idx", {"doc": "int32"})
    assert same.type_name == name and same == mods
    assert _mods.user_mods("score - 0.5f * abs(q_idx - kv_idx)", "doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx",
                           {"doc": "float32"}).type_name != name
    assert _mods.cpp_struct(None, None) == ("NoMod", "")
    only_mask = _mods.user_mods(None, "kv_idx <= q_idx")
    assert "Has_score_mod = false" in only_mask.source and "return score;" in only_mask.source


# Expressions compiled into one NVRTC program with the header (softcap, ALiBi-like, prefix-LM, document mask,
# and one that calls every function on the score).
NVRTC_CASES = [
    ("30.0f * tanhf(score / 30.0f)", None, {}),
    ("score - 0.5f * abs(q_idx - kv_idx)", None, {}),
    (None, "kv_idx <= q_idx || kv_idx < 16", {}),
    (None, "doc[q_idx] == doc[kv_idx]", {"doc": "int32"}),
    ("score + w[h] * (q_idx > kv_idx ? 1.0f : -INFINITY) + fminf(score, 2) + max(score, 1) + min(q_idx, 3) "
     "+ sqrtf(fabsf(score)) + logf(1 + expf(score)) + exp2f(log2f(2.0f)) + sinf(cosf(score)) + floorf(score) "
     "+ ceilf(score) + (score > 0 ? score : 0) - abs(score) + fmaxf(-1, score) + !score / 2.0f",
     "doc[q_idx] % 3 == 1 && !(b > h) || min(q_idx, kv_idx) == max(0, abs(kv_idx - 1))", {"doc": "int32", "w": "float32"}),
]

_PROBE = r"""
namespace cuflash {
template <class M>
__global__ void probe(const float* s, float* out, const ModArrays* arrays, int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const int q = t / 16, kv = t % 16;
    float g;
    out[5 * t + 0] = M::template score<float>(s[t], 1, 2, q, kv, *arrays);
    const Dual d = M::template score<Dual>(Dual{s[t], 1}, 1, 2, q, kv, *arrays);
    out[5 * t + 1] = d.v;
    out[5 * t + 2] = d.d;
    out[5 * t + 3] = M::mask(1, 2, q, kv, *arrays) ? 1.f : 0.f;
    out[5 * t + 4] = apply_score_mod<M, true>(s[t], 0.5f, 2.f, 1, 2, q, kv, *arrays, g) + g;
}
}  // namespace cuflash
"""


def _nvrtc_program(prefix: str = "", suffix: str = ""):
    from test_nvrtc_compile import _nvrtc

    nvrtc = _nvrtc()
    header = (ROOT / "cuflash_kernels" / "user_mods.cuh").read_text()
    structs, names = [], ["cuflash::probe<cuflash::NoMod>"]
    for score_mod, mask_mod, arrays in NVRTC_CASES:
        type_name, source = _mods.cpp_struct(score_mod, mask_mod, arrays)
        structs.append(source)
        names.append(f"cuflash::probe<cuflash::{type_name}>")
    return nvrtc, prefix + header + "\n".join(structs) + _PROBE + suffix, names


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_user_mods_header_compiles_with_nvrtc_alone(arch):
    from test_nvrtc_compile import compile_with_nvrtc, parse_resources

    nvrtc, text, names = _nvrtc_program()
    assert "#include" not in text
    ok, log = compile_with_nvrtc(nvrtc, text, names, ("-std=c++17",), arch)
    assert ok, log[-6000:]
    rows = parse_resources(log)
    assert len(rows) == len(names) and not any(r["stores"] or r["loads"] for r in rows)


def test_user_mods_header_compiles_with_nvrtc_between_the_kernel_headers():
    """As the kernels include it: after cuflash_tiles.cuh, before variants.cuh (whose policy defaults to NoMod); no
    overload of modmath hides the CUDA builtins the kernel code calls."""
    from test_nvrtc_compile import compile_with_nvrtc

    kernels = ROOT / "cuflash_kernels"
    suffix = (kernels / "variants.cuh").read_text() + (
        "\nnamespace cuflash { __device__ int after(int a, int b) { return min(max(a, 0), b) + (int)fminf(1.f, 2.f); } }\n")
    nvrtc, text, names = _nvrtc_program((kernels / "cuflash_tiles.cuh").read_text(), suffix)
    ok, log = compile_with_nvrtc(nvrtc, text, names, ("-std=c++17",), "sm_80")
    assert ok, log[-6000:]


# ---------------------------------------------------------------------------------------------------
# The PyTorch and JAX front ends (CPU: the NumPy reference)
# ---------------------------------------------------------------------------------------------------

FRONT_END = dict(score_mod="10.0f * tanhf(score / 10.0f) + w[h]", mask_mod="doc[q_idx] == doc[kv_idx] || kv_idx == 0")


def front_end_arrays():
    return {"doc": np.repeat(np.arange(4), 6).astype(np.int32), "w": np.array([0.5, -0.25, 0, 1], np.float32)}


def test_torch_front_end_passes_the_mods_through():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cuflash_torch

    q, k, v, do = inputs(batch=2, len_q=20, len_k=24, heads=4, heads_kv=2, d=8)
    arrays = front_end_arrays()
    out_np, lse_np = cuflash.attention(q, k, v, return_lse=True, mod_arrays=arrays, **FRONT_END)
    grads_np = cuflash.attention_backward(do, q, k, v, out_np, lse_np, mod_arrays=arrays, **FRONT_END)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    t_arrays = {name: torch.tensor(a) for name, a in arrays.items()}
    out = cuflash_torch.attention(tq, tk, tv, mod_arrays=t_arrays, **FRONT_END)
    out.backward(torch.tensor(do))
    assert np.allclose(out.detach().numpy(), out_np, atol=1e-14)
    for t, g in zip((tq, tk, tv), grads_np):
        assert np.allclose(t.grad.numpy(), g, atol=1e-13)
    small = [torch.tensor(x[:1, :8], requires_grad=True) for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda q, k, v: cuflash_torch.attention(q, k, v, mod_arrays=t_arrays, **FRONT_END),
                                    small)
    with pytest.raises(TypeError, match=r"mod_arrays\['doc'\] must have dtype int32 or float32; got int64"):
        cuflash_torch.attention(tq, tk, tv, mod_arrays={**t_arrays, "doc": t_arrays["doc"].long()}, **FRONT_END)


@pytest.mark.parametrize("jit", [False, True])
def test_jax_front_end_passes_the_mods_through(jit):
    jax = pytest.importorskip("jax")
    import cuflash.jax as cuflash_jax

    jax.config.update("jax_enable_x64", True)
    q, k, v, do = inputs(batch=2, len_q=20, len_k=24, heads=4, heads_kv=2, d=8)
    arrays = front_end_arrays()
    out_np, lse_np = cuflash.attention(q, k, v, return_lse=True, mod_arrays=arrays, **FRONT_END)
    grads_np = cuflash.attention_backward(do, q, k, v, out_np, lse_np, mod_arrays=arrays, **FRONT_END)

    def loss(q, k, v, arrays):
        return (cuflash_jax.attention(q, k, v, mod_arrays=arrays, **FRONT_END) * do).sum()

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    with jax.default_device(jax.devices("cpu")[0]):  # float64 on the CPU (the NumPy reference), also beside a GPU
        value, grads = (jax.jit(fn) if jit else fn)(q, k, v, arrays)
        with pytest.raises(ValueError, match="mask_mod: 'docs' is not an array of mod_arrays"):
            cuflash_jax.attention(q, k, v, mod_arrays=arrays, score_mod=FRONT_END["score_mod"], mask_mod="docs[q_idx] > 0")
    assert abs(float(value) - float((out_np * do).sum())) < 1e-12
    for g, g_np in zip(grads, grads_np):
        assert np.allclose(np.asarray(g), g_np, atol=1e-13)


@pytest.mark.gpu
def test_generated_code_on_gpu_matches_the_evaluator(requires_gpu):
    """The generated structs compiled with user_mods.cuh (CuPy's NVRTC) give the evaluator's values, dual-number
    derivatives and masks at 1024 positions (float32: the kernels' arithmetic), and apply_score_mod its raw-unit
    conversion; the array reads go through modmath::load."""
    cp = requires_gpu
    header = (ROOT / "cuflash_kernels" / "user_mods.cuh").read_text()
    rng = np.random.default_rng(0)
    arrays = {"doc": rng.integers(0, 4, 64).astype(np.int32), "w": np.array([0.5, -0.25, 2.0, 1.0], np.float32)}
    cases = [(s, m, {n: arrays[n] for n in a}) for s, m, a in NVRTC_CASES]
    sources, names = [], []
    for score_mod, mask_mod, used in cases:
        mods = _mods.user_mods(score_mod, mask_mod, used)
        sources.append(mods.source)
        names.append(f"cuflash::probe<cuflash::{mods.type_name}>")
    module = cp.RawModule(code=header + "\n".join(sources) + _PROBE, options=("-std=c++17",), name_expressions=names)
    n = 64 * 16
    s = rng.uniform(-3, 3, n).astype(np.float32)
    q_idx, kv_idx = np.arange(n) // 16, np.arange(n) % 16
    for (score_mod, mask_mod, used), name in zip(cases, names):
        mods = _mods.user_mods(score_mod, mask_mod, used)
        device_arrays = [cp.asarray(used[a]) for a in mods.array_names]
        table = np.zeros((), np.dtype([("ptr", np.uint64, (4,)), ("len", np.int32, (4,))]))
        for slot, a in enumerate(device_arrays):
            table["ptr"][slot], table["len"][slot] = a.data.ptr, a.size
        table_gpu = cp.asarray(table.reshape(1).view(np.uint8))
        out = cp.zeros((n, 5), cp.float32)
        module.get_function(name)((n // 128,), (128,), (cp.asarray(s), out, table_gpu, np.int32(n)))
        got = out.get()
        value, deriv = mods.score(s, 1, 2, q_idx, kv_idx, used)
        np.testing.assert_allclose(got[:, 0], value, rtol=3e-6, atol=3e-6, err_msg=name)
        np.testing.assert_allclose(got[:, 1], value, rtol=3e-6, atol=3e-6, err_msg=name)
        np.testing.assert_allclose(got[:, 2], deriv, rtol=3e-5, atol=3e-5, err_msg=name)
        assert np.array_equal(got[:, 3] != 0, mods.mask(1, 2, q_idx, kv_idx, used)), name
        raw_value, raw_deriv = mods.score(s * np.float32(0.5), 1, 2, q_idx, kv_idx, used)
        np.testing.assert_allclose(got[:, 4], raw_value * 2 + raw_deriv, rtol=3e-5, atol=3e-5, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("mask, arrays", MASKS)
def test_block_map_on_gpu_equals_numpy(requires_gpu, mask, arrays):
    """block_map evaluated with CuPy (as the CUDA backend does) gives NumPy's tiles and lists, with lengths."""
    cp = requires_gpu
    mods = _mods.user_mods(None, mask, arrays)
    lengths_q, lengths_k = np.array([61, 17, 0], np.int32), np.array([64, 40, 5], np.int32)
    for lengths in ({}, {"lengths_q": lengths_q, "lengths_k": lengths_k}):
        want = _mods.block_map(mods, 3, 2, 61, 64, 16, 8, arrays=arrays, **lengths)
        got = _mods.block_map(mods, 3, 2, 61, 64, 16, 8, arrays={n: cp.asarray(a) for n, a in arrays.items()},
                              xp=cp, **{n: cp.asarray(a) for n, a in lengths.items()})
        for name, w, g in zip(want._fields, want, got):
            assert np.array_equal(cp.asnumpy(g) if isinstance(g, cp.ndarray) else g, w), name


def test_block_mask_is_the_same_mask_and_checks_its_arrays():
    """A cuflash.BlockMask masks as its expression and arrays do (forward and backward, with a score_mod reading
    its array by name); a clashing mod_arrays entry and a wrong type are refused with messages naming them."""
    rng = np.random.default_rng(11)
    q, k, v, do = (rng.standard_normal((2, 40, 4, 16)) for _ in range(4))
    doc = np.repeat(np.arange(5), 8).astype(np.int32)
    rng.shuffle(doc)
    text, score = "doc[q_idx] == doc[kv_idx] || kv_idx == 0", "score + 0.25f * doc[kv_idx]"
    mask = cuflash.BlockMask(text, {"doc": doc})
    plain = dict(mask_mod=text, mod_arrays={"doc": doc}, score_mod=score, causal=True)
    out, lse = cuflash.attention(q, k, v, mask_mod=mask, score_mod=score, causal=True, return_lse=True)
    want, want_lse = cuflash.attention(q, k, v, **plain, return_lse=True)
    np.testing.assert_array_equal(out, want)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, mask_mod=mask, score_mod=score, causal=True)
    for g, w in zip(grads, cuflash.attention_backward(do, q, k, v, want, want_lse, **plain)):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match=r"mod_arrays\['doc'\] names an array of the BlockMask"):
        cuflash.attention(q, k, v, mask_mod=mask, mod_arrays={"doc": doc.copy()}, score_mod=score)
    with pytest.raises(TypeError, match="mask_mod must be a string .*, a cuflash.BlockMask or None; got int"):
        cuflash.attention(q, k, v, mask_mod=3)
    with pytest.raises(TypeError, match="BlockMask's mask_mod must be a string"):
        cuflash.BlockMask(None)
    assert "doc" in repr(mask) and "0 block lists" in repr(mask)


@pytest.mark.gpu
def test_block_mask_keeps_its_block_lists_on_gpu(requires_gpu):
    """On the GPU a BlockMask's lists are built once per tiling (forward, dQ and dK/dV passes) and reused: a second
    forward and backward build none and give the same results bit for bit; clear() forgets them."""
    cp = requires_gpu
    rng = np.random.default_rng(12)
    q, k, v, do = (cp.asarray(rng.standard_normal((2, 300, 4, 64)).astype(np.float16)) for _ in range(4))
    doc = cp.asarray(np.sort(rng.integers(0, 6, 300)).astype(np.int32))
    mask = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})

    def run():
        out, lse = cuflash.attention(q, k, v, mask_mod=mask, causal=True, return_lse=True)
        return (out, *cuflash.attention_backward(do, q, k, v, out, lse, mask_mod=mask, causal=True, deterministic=True))

    first = run()
    built = len(mask.lists)
    assert built >= 2, mask
    second = run()
    assert len(mask.lists) == built
    for a, b in zip(first, second):
        assert cp.array_equal(a, b)
    plain = cuflash.attention(q, k, v, mask_mod="doc[q_idx] == doc[kv_idx]", mod_arrays={"doc": doc}, causal=True)
    assert cp.array_equal(first[0], plain)
    mask.clear()
    assert not mask.lists


def test_torch_front_end_names_blockmask_as_not_its_type():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cft

    q = torch.randn(1, 16, 2, 8)
    mask = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": torch.zeros(16, dtype=torch.int32)})
    with pytest.raises(TypeError, match=r"got BlockMask; cuflash.BlockMask is taken by cuflash.attention .* "
                                        r"mask_mod=m.mask_mod, mod_arrays=m.mod_arrays"):
        cft.attention(q, q, q, mask_mod=mask)
