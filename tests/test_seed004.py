"""The fully worked 4x4 example of seed 004 (scale 1), checked figure by figure.

cuflash exposes O, lse, dQ, dK and dV; the seed's intermediate matrices are read back from them:

- P = exp(S - lse) with S = Q K^T,
- D = rowsum(dO * O),
- dS from dQ = dS K (K is unit lower triangular, so dS = dQ K^-1 exactly) and, independently, from
  dK = dS^T Q (Q is invertible too),
- dP = dS / P + D (every P > 0 here),
- the weight updates through the MHA layer with X = I, W_O = I, one head: dW_Q = X^T dQ = dQ, etc.

Each figure is compared with a tolerance of one unit in its last printed digit (1.1 units, so that a
figure truncated instead of rounded still passes). The seed is not consistent about rounding; these
printed figures are truncated (or rounded the wrong way) rather than rounded to nearest:

- P[0,0] = P[1,1] = 0.224   (exact 0.22452, rounds to 0.225)
- dQ[0,1] = 1.18            (exact 1.18680, rounds to 1.19; the seed prints dQ[0,0] = -1.19 for the same magnitude)
- dQ[2,0] = -3.14, dQ[2,1] = 3.14   (exact -/+3.14579, round to -/+3.15)
- trace, after the first key tile: O_unnorm[0,2] = 5.57   (exact 5.57516)
- trace, after the second key tile: l = 1.638   (exact 1.63855); O_unnorm[0,3] = 16.71 (exact 16.7196),
  O_unnorm[1,3] = 21.10 (exact 21.1084); rounded up instead: O_unnorm[0,0] = 11.81 (exact 11.8039),
  O_unnorm[1,0] = 16.20 (exact 16.1928)

and one figure is off by more than a unit: D_0 = 34.83, where the exact value is 34.8155 (34.82). The seed
computed it from its 3-decimal P: 0.224*10 + 0.083*26 + 0.610*42 + 0.083*58 = 34.832. The test checks
that origin and compares D_0 with a tolerance of 1.5 units.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.mha import MHAParams, mha_backward, mha_forward

# ---- The example's inputs (seed 004, "Input Matrices" and the dO of "Computing All Gradients").
Q = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=np.float64)
K = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=np.float64)
V = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], dtype=np.float64)
DO = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.float64)
LEARNING_RATE = 0.1

# ---- The seed's printed figures, with the number of decimals printed.
S_PRINTED = ([[1, 0, 2, 0], [0, 1, 0, 2], [1, 0, 1, 0], [0, 1, 0, 1]], 0)
P_PRINTED = ([[0.224, 0.083, 0.610, 0.083],
              [0.083, 0.224, 0.083, 0.610],
              [0.366, 0.134, 0.366, 0.134],
              [0.134, 0.366, 0.134, 0.366]], 3)
O_PRINTED = ([[7.20, 8.20, 9.20, 10.20],
              [9.88, 10.88, 11.88, 12.88],
              [6.08, 7.08, 8.08, 9.08],
              [7.92, 8.92, 9.92, 10.92]], 2)
DV_PRINTED = ([[0.590] * 4, [0.217] * 4, [0.976] * 4, [0.217] * 4], 3)
DP_PRINTED = ([[10, 26, 42, 58], [0, 0, 0, 0], [10, 26, 42, 58], [0, 0, 0, 0]], 0)
D_PRINTED = ([34.83, 0, 30.30, 0], 2)
DS_PRINTED = ([[-5.57, -0.73, 4.38, 1.91],
               [0, 0, 0, 0],
               [-7.42, -0.58, 4.28, 3.72],
               [0, 0, 0, 0]], 2)
DQ_PRINTED = ([[-1.19, 1.18, 4.38, 1.91],
               [0, 0, 0, 0],
               [-3.14, 3.14, 4.28, 3.72],
               [0, 0, 0, 0]], 2)
DK_PRINTED = ([[-12.99, 0, -5.57, 0],
               [-1.31, 0, -0.73, 0],
               [8.66, 0, 4.38, 0],
               [5.64, 0, 1.91, 0]], 2)
W_V_NEW_PRINTED = ([[0.94, 1.94, 2.94, 3.94],
                    [4.98, 5.98, 6.98, 7.98],
                    [8.90, 9.90, 10.90, 11.90],
                    [12.98, 13.98, 14.98, 15.98]], 2)
W_Q_NEW_0_PRINTED = ([1.12, -0.12, 0.56, -0.19], 2)
W_K_NEW_0_PRINTED = ([2.30, 0, 0.56, 0], 2)

# The tile-by-tile forward trace, block size 2, query block 0 (rows 0-1).
TRACE_TILE_1 = {  # after key tile 0 (keys 0-1)
    "m": ([1, 1], 0),
    "p_tilde": ([[1, 0.368], [0.368, 1]], 3),
    "l": ([1.368, 1.368], 3),
    "o_unnorm": ([[2.84, 4.21, 5.57, 6.94], [5.37, 6.74, 8.10, 9.47]], 2),
}
TRACE_TILE_2 = {  # after key tile 1 (keys 2-3)
    "m": ([2, 2], 0),
    "c": ([0.368, 0.368], 3),
    "p_tilde": ([[1, 0.135], [0.135, 1]], 3),
    "l": ([1.638, 1.638], 3),
    "o_unnorm": ([[11.81, 13.44, 15.08, 16.71], [16.20, 17.83, 19.47, 21.10]], 2),
}
O_FINAL_BLOCK_0_PRINTED = ([[7.20, 8.20, 9.20, 10.20], [9.88, 10.88, 11.88, 12.88]], 2)

# (algorithm, backward order): the naive path, and both blocked algorithms with every loop order.
CASES = [("naive", None)] + [(alg, order) for alg in ("fa1", "fa2") for order in ("kv_outer", "q_outer", "split")]


def assert_printed(actual, printed, name, units=1.1):
    """``actual`` matches the seed's figure to ``units`` units in its last printed digit."""
    values, decimals = printed
    values = np.asarray(values, dtype=np.float64)
    tolerance = units * 10.0 ** -decimals
    err = np.abs(np.asarray(actual, dtype=np.float64) - values)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.ndim else ()
    assert np.all(err <= tolerance), (
        f"{name}: off by {err[worst]:.4g} at {worst} (allowed {tolerance:.3g}); "
        f"got\n{np.round(actual, decimals + 2)}\nseed prints\n{values}"
    )


def blocked_options(algorithm):
    return {} if algorithm == "naive" else {"block_q": 2, "block_k": 2}


def as_heads(x):
    """(seqlen, d) -> (batch 1, seqlen, heads 1, d)."""
    return x[None, :, None, :]


def run_attention(algorithm, order):
    options = dict(softmax_scale=1.0, algorithm=algorithm, **blocked_options(algorithm))
    q, k, v, do = map(as_heads, (Q, K, V, DO))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, order=order, **options)
    return out[0, :, 0], lse[0, 0], dq[0, :, 0], dk[0, :, 0], dv[0, :, 0]


@pytest.mark.parametrize("algorithm,order", CASES)
def test_forward_figures(algorithm, order):
    out, lse, *_ = run_attention(algorithm, order)
    s = Q @ K.T
    assert_printed(s, S_PRINTED, "S")
    p = np.exp(s - lse[:, None])
    assert_printed(p, P_PRINTED, "P = exp(S - lse)")
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-14)
    assert_printed(out, O_PRINTED, "O")


@pytest.mark.parametrize("algorithm,order", CASES)
def test_backward_figures(algorithm, order):
    out, lse, dq, dk, dv = run_attention(algorithm, order)
    p = np.exp(Q @ K.T - lse[:, None])
    assert_printed(dv, DV_PRINTED, "dV")

    d = np.sum(DO * out, axis=1)
    assert_printed(d[1:], (D_PRINTED[0][1:], 2), "D_1, D_2, D_3")
    # D_0: the seed's 34.83 is rowsum(P * dP) of its own 3-decimal P; the exact value is 34.8155.
    p_printed, dp_printed = np.array(P_PRINTED[0]), np.array(DP_PRINTED[0])
    assert abs(np.sum(p_printed[0] * dp_printed[0]) - 34.83) < 0.005
    assert_printed(d[:1], ([34.83], 2), "D_0", units=1.5)

    ds_from_dq = np.linalg.solve(K.T, dq.T).T  # dQ = dS K
    ds_from_dk = np.linalg.solve(Q.T, dk.T)  # dK = dS^T Q, so dK^T = Q^T dS
    np.testing.assert_allclose(ds_from_dq, ds_from_dk, atol=1e-12)
    assert_printed(ds_from_dq, DS_PRINTED, "dS")
    assert_printed(ds_from_dq / p + d[:, None], DP_PRINTED, "dP = dS / P + D")
    assert_printed(dq, DQ_PRINTED, "dQ")
    assert_printed(dk, DK_PRINTED, "dK")


@pytest.mark.parametrize("algorithm,order", CASES)
def test_weight_updates_through_the_layer(algorithm, order):
    """Q = X W_Q, K = X W_K, V = X W_V with X = I, one head, W_O = I so that dO = dY; one SGD step."""
    params = MHAParams(w_q=Q.copy(), w_k=K.copy(), w_v=V.copy(), w_o=np.eye(4))
    x = np.eye(4)[None]
    y, cache = mha_forward(x, params, num_heads=1, softmax_scale=1.0, algorithm=algorithm,
                           **blocked_options(algorithm))
    assert_printed(y[0], O_PRINTED, "Y = O W_O = O")
    grads = mha_backward(DO[None], cache, params, order=order)
    new = MHAParams(*(w - LEARNING_RATE * dw for w, dw in zip(params[:4], grads[1:5])))
    assert_printed(new.w_v, W_V_NEW_PRINTED, "W_V_new")
    assert_printed(new.w_q[0], W_Q_NEW_0_PRINTED, "W_Q_new[0]")
    assert_printed(new.w_k[0], W_K_NEW_0_PRINTED, "W_K_new[0]")
    # "Token 2's value decreased most (by 0.098)".
    decrease = (params.w_v - new.w_v)[:, 0]
    assert int(np.argmax(decrease)) == 2
    assert_printed(decrease[2], (0.098, 3), "W_V decrease of token 2")
    # dZ = dQ W_Q^T + dK W_K^T + dV W_V^T with X = I: the input gradient is the sum of the three paths.
    _, _, dq, dk, dv = run_attention(algorithm, order)
    np.testing.assert_allclose(grads.dz[0], dq @ Q.T + dk @ K.T + dv @ V.T, rtol=1e-12, atol=1e-12)


def test_tile_trace_block_size_2():
    """The seed's trace for query block 0, recomputed with the FA2 loop (query block outer, key blocks
    inner) written out here step by step: running max m, correction c, local exponentials P~, running
    sum l and unnormalized output O_unnorm."""
    block = 2
    rows = slice(0, block)
    m = np.full(block, -np.inf)
    l = np.zeros(block)
    o_unnorm = np.zeros((block, V.shape[1]))
    states = []
    for start in range(0, K.shape[0], block):
        keys = slice(start, start + block)
        s = Q[rows] @ K[keys].T
        m_new = np.maximum(m, s.max(axis=1))
        c = np.exp(m - m_new)
        p_tilde = np.exp(s - m_new[:, None])
        l = l * c + p_tilde.sum(axis=1)
        o_unnorm = o_unnorm * c[:, None] + p_tilde @ V[keys]
        m = m_new
        states.append(dict(m=m, c=c, p_tilde=p_tilde, l=l, o_unnorm=o_unnorm))
    assert_printed(states[0]["c"], ([0, 0], 0), "tile 1: c = exp(-inf - 1)")
    for number, (state, printed) in enumerate(zip(states, (TRACE_TILE_1, TRACE_TILE_2)), start=1):
        for name, figures in printed.items():
            assert_printed(state[name], figures, f"tile {number}: {name}")
    assert_printed(o_unnorm / l[:, None], O_FINAL_BLOCK_0_PRINTED, "O block 0 = O_unnorm / l")


@pytest.mark.parametrize("algorithm", ["fa1", "fa2", "naive"])
def test_trace_states_from_the_library(algorithm):
    """The online-softmax state after a key tile is attention over the keys seen so far:
    l = exp(lse - m) and O_unnorm = O * l. Attention over keys 0-1 gives the state after tile 1;
    over all keys, the state after tile 2 and the final rows of query block 0."""
    options = dict(softmax_scale=1.0, algorithm=algorithm, return_lse=True, **blocked_options(algorithm))
    q = as_heads(Q[:2])
    for keys, printed in ((slice(0, 2), TRACE_TILE_1), (slice(0, 4), TRACE_TILE_2)):
        out, lse = cuflash.attention(q, as_heads(K[keys]), as_heads(V[keys]), **options)
        out, lse = out[0, :, 0], lse[0, 0]
        m = np.array(printed["m"][0], dtype=np.float64)
        l = np.exp(lse - m)
        assert_printed(l, printed["l"], f"keys {keys}: l = exp(lse - m)")
        assert_printed(out * l[:, None], printed["o_unnorm"], f"keys {keys}: O_unnorm = O * l")
    assert_printed(out, O_FINAL_BLOCK_0_PRINTED, "O block 0")
