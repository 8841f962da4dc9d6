"""Property tests (hypothesis) for the NumPy reference and the block arithmetic.

Over random shapes, head groupings, variants (causal alignments, sliding windows, softcap, ALiBi, key
padding, packed variable-length batches) and block sizes: the blocked algorithms equal naive attention
in float64, exactly the rows that see no key give zeros and -inf, and the loop bounds of both loop
orders visit exactly the tiles that hold a visible (query, key) pair.
"""

import numpy as np
import pytest
from _helpers import max_abs_error
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash._ops import blocks as _blocks
from cuflash import reference
from cuflash._ops.blocks import Band
from cuflash._ops.variant import Variant

pytestmark = pytest.mark.filterwarnings("error")

ORDERS = ["kv_outer", "q_outer", "split"]


@st.composite
def problems(draw):
    """A small attention problem: a padded batch or packed sequences (lengths 0 included), grouping,
    variant and block sizes. Windows, softcap and ALiBi are each drawn off half of the time."""
    packed = draw(st.booleans())
    batch = draw(st.integers(1, 3))
    if packed:
        lens_q = draw(st.lists(st.integers(0, 20), min_size=batch, max_size=batch))
        lens_k = draw(st.lists(st.integers(0, 20), min_size=batch, max_size=batch))
    else:
        lens_q, lens_k = [draw(st.integers(0, 32))] * batch, [draw(st.integers(0, 32))] * batch
    edge = st.none() | st.integers(0, 40)
    return dict(
        packed=packed,
        lens_q=lens_q,
        lens_k=lens_k,
        seqused_k=draw(st.none() | st.tuples(*(st.integers(0, n) for n in lens_k))),
        heads_kv=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 3, 8, 16])),
        causal=draw(st.sampled_from(["none", "bottom-right", "top-left"])),
        window=draw(st.just((None, None)) | st.tuples(edge, edge)),
        softcap=draw(st.just(0.0) | st.floats(0.5, 5.0)),
        alibi=draw(st.sampled_from([None, "heads", "batch"])),
        block_q=draw(st.integers(1, 40)),
        block_k=draw(st.integers(1, 40)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _build(p):
    """Inputs ``q, k, v, do`` and the :class:`Variant` of a drawn problem."""
    rng = np.random.default_rng(p["seed"])
    batch, heads_q, heads_kv, d = len(p["lens_q"]), p["heads_kv"] * p["group"], p["heads_kv"], p["head_dim"]
    cu_q = cu_k = None
    if p["packed"]:
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (p["lens_q"], p["lens_k"]))
        shape_q, shape_k = (int(cu_q[-1]), heads_q, d), (int(cu_k[-1]), heads_kv, d)
    else:
        shape_q, shape_k = (batch, p["lens_q"][0], heads_q, d), (batch, p["lens_k"][0], heads_kv, d)
    q, do = rng.standard_normal(shape_q), rng.standard_normal(shape_q)
    k, v = rng.standard_normal(shape_k), rng.standard_normal(shape_k)
    slopes = {None: None, "heads": lambda: np.broadcast_to(rng.uniform(0, 1, heads_q).astype(np.float32), (batch, heads_q)),
              "batch": lambda: rng.uniform(0, 1, (batch, heads_q)).astype(np.float32)}[p["alibi"]]
    variant = Variant(
        causal=p["causal"] != "none", bottom_right=p["causal"] != "top-left",
        window_left=p["window"][0], window_right=p["window"][1], softcap=p["softcap"],
        alibi_slopes=slopes() if slopes else None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(p["lens_q"]) if p["packed"] else None, max_seqlen_k=max(p["lens_k"]) if p["packed"] else None,
        seqused_k=None if p["seqused_k"] is None else np.array(p["seqused_k"], np.int32),
    )
    return q, k, v, do, variant


def _visible(len_q, len_k, variant):
    """Brute-force ``(len_q, len_k)`` boolean of one sequence: query i sees key j (docs/variants.md)."""
    i, j = np.arange(len_q)[:, None], np.arange(len_k)[None, :]
    diagonal = i + (len_k - len_q if variant.bottom_right else 0)
    visible = np.ones((len_q, len_k), bool)
    if variant.causal:
        visible &= j <= diagonal
    if variant.window_right is not None:
        visible &= j <= diagonal + variant.window_right
    if variant.window_left is not None:
        visible &= j >= diagonal - variant.window_left
    return visible


def _blind_rows(p, variant):
    """Which query rows see no key: ``(batch, seqlen_q)`` for a padded batch, ``(total_q,)`` packed."""
    blind = []
    for b, (len_q, len_k) in enumerate(zip(p["lens_q"], p["lens_k"])):
        used = len_k if p["seqused_k"] is None else p["seqused_k"][b]
        blind.append(~_visible(len_q, used, variant).any(axis=1))
    return np.concatenate(blind) if p["packed"] else np.stack(blind)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_blocked_equals_naive_float64(problem):
    p = problem
    q, k, v, do, variant = _build(p)
    options = dict(scale=p["head_dim"] ** -0.5, variant=variant)
    sizes = dict(block_q=p["block_q"], block_k=p["block_k"])
    out_ref, lse_ref = reference.naive_forward(q, k, v, **options)
    grads_ref = reference.naive_backward(do, q, k, v, **options)

    # exactly the rows that see no key have lse -inf and out 0 (lse is (heads, total) packed)
    blind = _blind_rows(p, variant)
    blind_lse = np.broadcast_to(blind[None] if p["packed"] else blind[:, None], lse_ref.shape)
    assert np.array_equal(np.isneginf(lse_ref), blind_lse)
    assert np.all(out_ref[blind] == 0) and np.isfinite(lse_ref[~blind_lse]).all()

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
        assert np.all(grads[0][blind] == 0)


def _band_visible(seqlen_q, seqlen_k, band):
    """Brute-force ``(seqlen_q, seqlen_k)`` boolean: query i sees key j under ``band`` (None: all)."""
    visible = np.ones((seqlen_q, seqlen_k), bool)
    if band is not None:
        diagonal = np.arange(seqlen_q)[:, None] + band.offset
        cols = np.arange(seqlen_k)[None, :]
        if band.right is not None:
            visible &= cols <= diagonal + band.right
        if band.left is not None:
            visible &= cols >= diagonal - band.left
    return visible


edges = st.none() | st.integers(0, 60)


@settings(max_examples=200, deadline=None)
@given(seqlen_q=st.integers(0, 50), seqlen_k=st.integers(0, 50), block_q=st.integers(1, 20),
       block_k=st.integers(1, 20), band=st.none() | st.builds(Band, st.integers(-60, 60), edges, edges))
def test_loop_bounds_visit_exactly_the_visible_tiles(seqlen_q, seqlen_k, block_q, block_k, band):
    visible = _band_visible(seqlen_q, seqlen_k, band)
    expected = {
        (q_start, k_start)
        for q_start in range(0, seqlen_q, block_q)
        for k_start in range(0, seqlen_k, block_k)
        if visible[q_start:q_start + block_q, k_start:k_start + block_k].any()
    }
    # query blocks outer (FA2 forward, q_outer backward)
    queries_outer = set()
    for q_start, q_stop in _blocks.iter_blocks(0, seqlen_q, block_q, seqlen_q):
        k_first, k_end = _blocks.key_range(q_start, q_stop, band, seqlen_k)
        queries_outer |= {(q_start, k_start) for k_start, _ in _blocks.iter_blocks(k_first, k_end, block_k, seqlen_k)}
    # key blocks outer (FA1 forward, kv_outer backward)
    keys_outer = set()
    for k_start, k_stop in _blocks.iter_blocks(0, seqlen_k, block_k, seqlen_k):
        q_first, q_end = _blocks.query_range(k_start, k_stop, band, seqlen_q)
        keys_outer |= {(q_start, k_start) for q_start, _ in _blocks.iter_blocks(q_first, q_end, block_q, seqlen_q)}
    assert queries_outer == expected
    assert keys_outer == expected
    # and the per-tile decisions agree with the brute-force mask
    for q_start, k_start in expected:
        q_stop, k_stop = min(q_start + block_q, seqlen_q), min(k_start + block_k, seqlen_k)
        tile = visible[q_start:q_stop, k_start:k_stop]
        assert _blocks.tile_needs_mask(q_start, q_stop, k_start, k_stop, band) == (not tile.all())
        assert not _blocks.tile_is_fully_masked(q_start, q_stop, k_start, k_stop, band)


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
