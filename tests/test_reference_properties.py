"""Property tests (hypothesis) for the NumPy reference and the block arithmetic.

Over random shapes, head groupings, causal offsets and block sizes: the blocked algorithms equal naive
attention in float64, rows that see no key give zeros and -inf, and the loop bounds of both loop
orders visit exactly the tiles that hold a visible (query, key) pair.
"""

import numpy as np
import pytest
from _helpers import max_abs_error, random_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import _blocks, reference

pytestmark = pytest.mark.filterwarnings("error")

ORDERS = ["kv_outer", "q_outer", "split"]


@st.composite
def problems(draw):
    """A small attention problem: shape, grouping, causal offset (None, either alignment, or any
    offset, including ones that blind every row or none) and block sizes."""
    seqlen_q, seqlen_k = draw(st.integers(0, 32)), draw(st.integers(0, 32))
    causal = draw(st.sampled_from(["none", "bottom-right", "top-left", "any"]))
    offset = {"none": None, "bottom-right": seqlen_k - seqlen_q, "top-left": 0,
              "any": draw(st.integers(-40, 40))}[causal]
    return dict(
        batch=draw(st.integers(1, 2)),
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_kv=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 3, 8, 16])),
        causal_offset=offset,
        block_q=draw(st.integers(1, 40)),
        block_k=draw(st.integers(1, 40)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _visible(seqlen_q, seqlen_k, causal_offset):
    """Brute-force ``(seqlen_q, seqlen_k)`` boolean: query i sees key j."""
    visible = np.ones((seqlen_q, seqlen_k), bool)
    if causal_offset is not None:
        visible &= np.arange(seqlen_k)[None, :] <= np.arange(seqlen_q)[:, None] + causal_offset
    return visible


@settings(max_examples=150, deadline=None)
@given(problems())
def test_blocked_equals_naive_float64(problem):
    p = problem
    q, k, v, do = random_inputs(p["batch"], p["seqlen_q"], p["seqlen_k"], p["heads_kv"] * p["group"],
                                p["heads_kv"], p["head_dim"], seed=p["seed"])
    options = dict(scale=p["head_dim"] ** -0.5, causal_offset=p["causal_offset"])
    sizes = dict(block_q=p["block_q"], block_k=p["block_k"])
    out_ref, lse_ref = reference.naive_forward(q, k, v, **options)
    grads_ref = reference.naive_backward(do, q, k, v, **options)

    blind = ~_visible(p["seqlen_q"], p["seqlen_k"], p["causal_offset"]).any(axis=1)
    assert np.all(out_ref[:, blind] == 0) and np.all(np.isneginf(lse_ref[:, :, blind]))
    assert np.isfinite(lse_ref[:, :, ~blind]).all()

    for forward in (reference.fa2_forward, reference.fa1_forward):
        out, lse = forward(q, k, v, **options, **sizes)
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        assert max_abs_error(out, out_ref) < 1e-12
        assert max_abs_error(lse, lse_ref) < 1e-12
    for order in ORDERS:
        grads = reference.blocked_backward(do, q, k, v, out_ref, lse_ref, **options, **sizes, order=order)
        for grad, grad_ref in zip(grads, grads_ref):
            assert not np.isnan(grad).any()
            assert max_abs_error(grad, grad_ref) < 1e-12 * max(1.0, np.abs(grad_ref).max(initial=0))
        assert np.all(grads[0][:, blind] == 0)


@settings(max_examples=200, deadline=None)
@given(seqlen_q=st.integers(0, 50), seqlen_k=st.integers(0, 50), block_q=st.integers(1, 20),
       block_k=st.integers(1, 20), causal_offset=st.none() | st.integers(-60, 60))
def test_loop_bounds_visit_exactly_the_visible_tiles(seqlen_q, seqlen_k, block_q, block_k, causal_offset):
    visible = _visible(seqlen_q, seqlen_k, causal_offset)
    expected = {
        (q_start, k_start)
        for q_start in range(0, seqlen_q, block_q)
        for k_start in range(0, seqlen_k, block_k)
        if visible[q_start:q_start + block_q, k_start:k_start + block_k].any()
    }
    # query blocks outer (FA2 forward, q_outer backward)
    queries_outer = set()
    for q_start, q_stop in _blocks.iter_blocks(0, seqlen_q, block_q, seqlen_q):
        k_end = _blocks.causal_key_block_end(q_start, q_stop, causal_offset, seqlen_k)
        queries_outer |= {(q_start, k_start) for k_start, _ in _blocks.iter_blocks(0, k_end, block_k, seqlen_k)}
    # key blocks outer (FA1 forward, kv_outer backward)
    keys_outer = set()
    for k_start, _ in _blocks.iter_blocks(0, seqlen_k, block_k, seqlen_k):
        first = _blocks.causal_query_block_start(k_start, causal_offset, seqlen_q)
        keys_outer |= {(q_start, k_start) for q_start, _ in _blocks.iter_blocks(first, seqlen_q, block_q, seqlen_q)}
    assert queries_outer == expected
    assert keys_outer == expected
    # and the per-tile decisions agree with the brute-force mask
    for q_start, k_start in expected:
        q_stop, k_stop = min(q_start + block_q, seqlen_q), min(k_start + block_k, seqlen_k)
        tile = visible[q_start:q_stop, k_start:k_stop]
        assert _blocks.tile_needs_mask(q_start, q_stop, k_start, k_stop, causal_offset) == (not tile.all())
        assert not _blocks.tile_is_fully_masked(q_start, q_stop, k_start, k_stop, causal_offset)


@settings(max_examples=200, deadline=None)
@given(head_dim=st.integers(1, 512), sram_elems=st.integers(1, 2**20), pass_=st.sampled_from(["forward", "backward"]))
def test_default_block_sizes_fit_the_budget(head_dim, sram_elems, pass_):
    """(000, eqs. 43 and 78): |I| d, |J| d and |I| |J| each fit a quarter (forward) or an eighth
    (backward) of M, whenever M holds at least one row per block; |J| never exceeds d."""
    block_q, block_k = _blocks.default_block_sizes(head_dim, sram_elems=sram_elems, pass_=pass_)
    share = sram_elems // (4 if pass_ == "forward" else 8)
    assert block_q >= 1 and 1 <= block_k <= max(head_dim, 1) and block_k <= block_q
    if share >= head_dim:
        assert block_q * head_dim <= share and block_k * head_dim <= share and block_q * block_k <= share
