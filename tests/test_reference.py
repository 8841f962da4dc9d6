"""The NumPy backend (cuflash.reference) and its block arithmetic (cuflash._ops.blocks).

- The oracle first: naive attention against the seed's hand-worked example, a per-head loop and finite
  differences.
- Blocked vs naive in float64 (no rounding noise): FA2 and FA1 forward and every backward order agree
  to ~1e-12 for many block sizes, awkward shapes, causal alignments and head groupings.
- Low precision against the float64 truth, within the flash-attention error budget.
- Edge cases: huge scores, rows that see no key, strided views, empty shapes, memory.

Every test turns floating-point warnings into errors: nothing may compute exp(-inf - -inf).
"""

import tracemalloc

import numpy as np
import pytest
from _helpers import (
    LOW_PRECISION,
    assert_blocked_within_budget,
    assert_within_budget,
    float64_truth,
    max_abs_error,
    numeric_gradient,
    random_inputs,
    rounding_floor,
)
from scipy.special import softmax

from cuflash._ops import blocks as _blocks
from cuflash import reference
from cuflash._ops.blocks import Band
from cuflash._ops.variant import Variant

pytestmark = pytest.mark.filterwarnings("error")

ORDERS = ["kv_outer", "q_outer", "split"]
BLOCKED_FORWARDS = {"fa2": reference.fa2_forward, "fa1": reference.fa1_forward}


# The variant of each causal alignment ("none", "bottom-right", "top-left").
CAUSAL_VARIANTS = {"none": Variant(), "bottom-right": Variant(causal=True),
                   "top-left": Variant(causal=True, bottom_right=False)}


# ---------------------------------------------------------------------------------------------------
# _blocks
# ---------------------------------------------------------------------------------------------------


def test_default_block_sizes_follow_the_seed_rule():
    # forward: |I| = floor(M / 4d), |J| = min(floor(M / 4d), d)   (000, eq. 44)
    assert _blocks.default_block_sizes(64, sram_elems=2**17) == (512, 64)
    assert _blocks.default_block_sizes(100, sram_elems=100_000) == (250, 100)
    assert _blocks.default_block_sizes(256, sram_elems=2**17) == (128, 128)
    # backward: floor(M / 8d) and min(floor(M / 8d), d)            (000, eq. 79)
    assert _blocks.default_block_sizes(64, sram_elems=2**17, pass_="backward") == (256, 64)
    assert _blocks.default_block_sizes(256, sram_elems=2**17, pass_="backward") == (64, 64)
    # never below 1, even when the budget cannot hold one row
    assert _blocks.default_block_sizes(512, sram_elems=100) == (1, 1)
    assert _blocks.default_block_sizes(64) == _blocks.default_block_sizes(
        64, sram_elems=_blocks.DEFAULT_SRAM_ELEMS, pass_="forward")
    with pytest.raises(ValueError, match="pass_ must be 'forward' or 'backward', got 'sideways'"):
        _blocks.default_block_sizes(64, pass_="sideways")


def test_cpu_block_sizes_follow_the_cache_rule():
    # square tiles B x B, B the largest multiple of 64 in [64, 1024] with B^2 + 3 B d <= cache / itemsize
    assert _blocks.cpu_block_sizes(64, cache=512 * 1024) == (256, 256)   # 65536 + 49152 <= 131072
    assert _blocks.cpu_block_sizes(128, cache=512 * 1024) == (192, 192)  # 256 would need 163840 elements
    assert _blocks.cpu_block_sizes(64, cache=2 * 1024 * 1024) == (576, 576)
    assert _blocks.cpu_block_sizes(64, cache=512 * 1024, itemsize=8) == (128, 128)  # 65536 elements
    assert _blocks.cpu_block_sizes(512, cache=64 * 1024) == (64, 64)     # never below 64
    assert _blocks.cpu_block_sizes(16, cache=2**30) == (1024, 1024)      # nor above 1024
    for d in (1, 8, 64, 100, 128, 256):
        for cache in (2**15, 2**19, 2**20, 3 * 2**20):
            b, _ = _blocks.cpu_block_sizes(d, cache=cache)
            assert b % 64 == 0 and 64 <= b <= 1024
            if 64 < b < 1024:  # the largest that fits
                assert b * b + 3 * b * d <= cache // 4 < (b + 64) ** 2 + 3 * (b + 64) * d


def test_cache_bytes_reads_sysfs_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(_blocks.os, "sysconf_names", {})  # as on Pythons that do not know SC_LEVEL2_CACHE_SIZE
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                                 (2, "Unified", "2048K"), (3, "Unified", "32M")]):
        entry = tmp_path / f"index{index}"
        entry.mkdir()
        (entry / "level").write_text(f"{level}\n")
        (entry / "type").write_text(f"{kind}\n")
        (entry / "size").write_text(f"{size}\n")
    assert _blocks.cache_bytes(2, sysfs=str(tmp_path)) == 2 * 2**20
    assert _blocks.cache_bytes(1, sysfs=str(tmp_path)) == 48 * 2**10
    assert _blocks.cache_bytes(3, sysfs=str(tmp_path)) == 32 * 2**20
    monkeypatch.setattr(_blocks.os, "uname", lambda: type("u", (), {"sysname": "Linux"})())
    assert _blocks.cache_bytes(2, sysfs=str(tmp_path / "missing")) == _blocks.DEFAULT_CACHE_BYTES


def test_default_cpu_forward_tiles_derive_from_the_cache(monkeypatch):
    # the reference's default forward tiles are cpu_block_sizes of this machine's L2 (read once per process),
    # for the larger of q's and v's head dims; the backward keeps the seed rule
    cache = _blocks.cache_bytes(2)
    assert reference._l2_bytes() == cache
    assert reference._resolve_block_sizes(64, None, None, "forward") == _blocks.cpu_block_sizes(64, cache=cache)
    assert reference._resolve_block_sizes(64, 32, None, "forward") == (32, _blocks.cpu_block_sizes(64, cache=cache)[1])
    assert reference._resolve_block_sizes(64, None, None, "backward") == _blocks.default_block_sizes(64, pass_="backward")
    monkeypatch.setattr(reference, "_l2_bytes", lambda: 2 * 2**20)
    assert reference._resolve_block_sizes(64, None, None, "forward") == (576, 576)
    assert reference._resolve_block_sizes(128, None, None, "forward") == (512, 512)


@pytest.mark.parametrize("threads", ["1", "3"])
def test_fa2_forward_threads_give_the_same_result(threads, monkeypatch):
    # query blocks run on CUFLASH_CPU_THREADS threads; every block writes its own rows, so any count agrees
    q, k, v, _ = random_inputs(2, 300, 260, 4, 2, 16, seed=5)
    options = dict(scale=0.25, variant=Variant(causal=True), block_q=32, block_k=48)
    monkeypatch.setenv(reference.THREADS_ENV, "1")
    expected = reference.fa2_forward(q, k, v, **options)
    monkeypatch.setenv(reference.THREADS_ENV, threads)
    assert reference.cpu_threads() == int(threads)
    out, lse = reference.fa2_forward(q, k, v, **options)
    np.testing.assert_array_equal(out, expected[0])
    np.testing.assert_array_equal(lse, expected[1])
    monkeypatch.setenv(reference.THREADS_ENV, "zero")
    assert reference.cpu_threads() >= 1


def test_band_bounds_clamp_to_the_sequence():
    causal = Band(3, None, 0)
    # query rows [8, 16) with offset 3 see keys up to 15 + 3 = 18 inclusive
    assert _blocks.key_range(8, 16, causal, 100) == (0, 19)
    assert _blocks.key_range(8, 16, causal, 10) == (0, 10)
    assert _blocks.key_range(0, 4, Band(-10, None, 0), 10) == (0, 0)
    assert _blocks.key_range(0, 4, None, 10) == (0, 10)
    # key 20 is first seen by row 20 - 3 = 17 (and key 29, the block's last, by every later row)
    assert _blocks.query_range(20, 30, causal, 100) == (17, 100)
    assert _blocks.query_range(2, 5, causal, 100) == (0, 100)
    assert _blocks.query_range(50, 60, Band(-60, None, 0), 100) == (100, 100)
    assert _blocks.query_range(50, 60, None, 100) == (0, 100)
    # a window of 2 keys left, 1 right around the diagonal i + 3: rows [8, 16) see keys [9, 20)
    window = Band(3, 2, 1)
    assert _blocks.key_range(8, 16, window, 100) == (9, 20)
    assert _blocks.key_range(8, 16, window, 12) == (9, 12)
    assert _blocks.key_range(40, 48, window, 12) == (12, 12)  # first >= end: no key block
    # keys [20, 30) are seen by rows 20 - 3 - 1 = 16 to 29 - 3 + 2 = 28
    assert _blocks.query_range(20, 30, window, 100) == (16, 29)
    assert _blocks.query_range(20, 30, Band(3, 2, None), 100) == (0, 29)


def test_iter_blocks_stays_on_the_grid():
    assert list(_blocks.iter_blocks(0, 10, 4, 10)) == [(0, 4), (4, 8), (8, 10)]
    assert list(_blocks.iter_blocks(5, 10, 4, 10)) == [(4, 8), (8, 10)]
    # a block starting before `end` is loaded whole, up to seqlen
    assert list(_blocks.iter_blocks(0, 5, 4, 10)) == [(0, 4), (4, 8)]
    assert list(_blocks.iter_blocks(10, 10, 4, 10)) == []
    assert _blocks.num_blocks(10, 4) == 3 and _blocks.num_blocks(0, 4) == 0


@pytest.mark.parametrize("band", [Band(2, None, 0), Band(2, 1, 0), Band(2, 1, None), Band(-1, 0, 2)])
def test_tile_classification_matches_a_brute_force_mask(band):
    for q_start, q_stop, k_start, k_stop in [(0, 4, 0, 4), (0, 4, 6, 8), (4, 8, 0, 4), (0, 4, 2, 7),
                                             (3, 5, 5, 6), (0, 1, 3, 4), (6, 9, 0, 3), (4, 6, 5, 7)]:
        diagonal = np.arange(q_start, q_stop)[:, None] + band.offset
        cols = np.arange(k_start, k_stop)[None, :]
        masked = np.zeros((q_stop - q_start, k_stop - k_start), bool)
        if band.right is not None:
            masked |= cols > diagonal + band.right
        if band.left is not None:
            masked |= cols < diagonal - band.left
        assert _blocks.tile_needs_mask(q_start, q_stop, k_start, k_stop, band) == masked.any()
        assert _blocks.tile_is_fully_masked(q_start, q_stop, k_start, k_stop, band) == masked.all()
    assert not _blocks.tile_needs_mask(0, 4, 0, 100, None)
    assert not _blocks.tile_is_fully_masked(0, 4, 0, 100, None)


# ---------------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------------

# The fully worked 4x4 example of seed 004 (scale 1). Its printed values are rounded by hand to two
# decimals (and a few are off by one in the last digit), hence the tolerance.
SEED_Q = [[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]]
SEED_K = [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]
SEED_V = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
SEED_DO = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
SEED_O = [[7.20, 8.20, 9.20, 10.20], [9.88, 10.88, 11.88, 12.88], [6.08, 7.08, 8.08, 9.08],
          [7.92, 8.92, 9.92, 10.92]]
SEED_DQ = [[-1.19, 1.18, 4.38, 1.91], [0, 0, 0, 0], [-3.14, 3.14, 4.28, 3.72], [0, 0, 0, 0]]
SEED_DK = [[-12.99, 0, -5.57, 0], [-1.31, 0, -0.73, 0], [8.66, 0, 4.38, 0], [5.64, 0, 1.91, 0]]
SEED_DV = [[0.590] * 4, [0.217] * 4, [0.976] * 4, [0.217] * 4]


@pytest.mark.parametrize("algorithm", ["naive", "fa2", "fa1"])
@pytest.mark.parametrize("order", ORDERS)
def test_seed_worked_example(algorithm, order):
    q, k, v, do = (np.array(x, np.float64)[None, :, None, :] for x in (SEED_Q, SEED_K, SEED_V, SEED_DO))
    options = dict(scale=1.0, variant=Variant(), block_q=2, block_k=2)
    out, lse = reference.forward(q, k, v, algorithm=algorithm, **options)
    grads = reference.backward(do, q, k, v, out, lse, algorithm=algorithm, order=order, **options)
    np.testing.assert_allclose(out[0, :, 0], SEED_O, atol=0.011)
    for grad, expected in zip(grads, (SEED_DQ, SEED_DK, SEED_DV)):
        np.testing.assert_allclose(grad[0, :, 0], expected, atol=0.011)


def _per_head_loop_attention(q, k, v, scale, offset):
    """Attention one (batch, head) at a time, the way the formulas read; query head h uses kv head
    h // (heads_q // heads_kv); query i sees key j iff j <= i + offset (offset None: every key). Only for
    inputs where every row sees a key."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    out = np.empty_like(q)
    for b in range(batch):
        for h in range(heads_q):
            h_kv = h // (heads_q // heads_kv)
            s = scale * q[b, :, h] @ k[b, :, h_kv].T
            if offset is not None:
                s[np.arange(seqlen_k)[None, :] > np.arange(seqlen_q)[:, None] + offset] = -np.inf
            out[b, :, h] = softmax(s, axis=-1) @ v[b, :, h_kv]
    return out


@pytest.mark.parametrize("heads", [(3, 3), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", list(CAUSAL_VARIANTS))
def test_naive_matches_a_per_head_loop(heads, causal):
    q, k, v, _ = random_inputs(2, 9, 14, *heads, 8, seed=1, with_do=False)
    out, _ = reference.naive_forward(q, k, v, scale=0.4, variant=CAUSAL_VARIANTS[causal])
    offset = {"none": None, "bottom-right": 14 - 9, "top-left": 0}[causal]
    np.testing.assert_allclose(out, _per_head_loop_attention(q, k, v, 0.4, offset), rtol=0, atol=1e-13)


def test_naive_backward_matches_finite_differences():
    q, k, v, do = random_inputs(1, 3, 5, 2, 1, 3, seed=2)
    options = dict(scale=0.7, variant=Variant(causal=True))

    def loss(q, k, v):
        return float((reference.naive_forward(q, k, v, **options)[0] * do).sum())

    grads = reference.naive_backward(do, q, k, v, **options)
    for index, grad in enumerate(grads):
        numeric = numeric_gradient(loss, (q, k, v), index, step=1e-6)
        np.testing.assert_allclose(grad, numeric, rtol=0, atol=1e-8)


# ---------------------------------------------------------------------------------------------------
# Blocked vs naive, float64
# ---------------------------------------------------------------------------------------------------

SHAPES = [(1, 1), (1, 257), (113, 203), (203, 113)]
HEADS = {"mha": (3, 3), "gqa": (4, 2), "mqa": (4, 1)}
CAUSALS = list(CAUSAL_VARIANTS)
# 1 on either side, sizes that divide nothing, larger than the sequence, and the defaults
BLOCKS = [(1, 64), (64, 1), (16, 16), (13, 29), (100, 37), (512, 300), (None, None)]
TIGHT = 1e-12


def _assert_forward_matches(result, truth, context):
    (out, lse), (out_ref, lse_ref) = result, truth
    assert out.dtype == out_ref.dtype and lse.dtype == lse_ref.dtype, context
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), context
    assert max_abs_error(out, out_ref) < TIGHT, (context, max_abs_error(out, out_ref))
    assert max_abs_error(lse, lse_ref) < TIGHT, (context, max_abs_error(lse, lse_ref))


def _assert_grads_match(grads, grads_ref, context):
    for name, grad, grad_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert grad.shape == grad_ref.shape and grad.dtype == grad_ref.dtype, (context, name)
        assert max_abs_error(grad, grad_ref) < TIGHT, (context, name, max_abs_error(grad, grad_ref))


def _check_blocked_against_naive(shape, heads, causal, blocks, batch=2, head_dim=24):
    seqlen_q, seqlen_k = shape
    q, k, v, do = random_inputs(batch, seqlen_q, seqlen_k, *heads, head_dim, seed=seqlen_q + seqlen_k)
    options = dict(scale=head_dim**-0.5, variant=CAUSAL_VARIANTS[causal])
    truth = reference.naive_forward(q, k, v, **options)
    grads_ref = reference.naive_backward(do, q, k, v, **options)
    for block_q, block_k in blocks:
        sizes = dict(block_q=block_q, block_k=block_k)
        for name, blocked_forward in BLOCKED_FORWARDS.items():
            _assert_forward_matches(blocked_forward(q, k, v, **options, **sizes), truth, (name, block_q, block_k))
        for order in ORDERS:
            grads = reference.blocked_backward(do, q, k, v, *truth, **options, **sizes, order=order)
            _assert_grads_match(grads, grads_ref, (order, block_q, block_k))


@pytest.mark.parametrize("causal", CAUSALS)
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{q}x{k}" for q, k in SHAPES])
def test_blocked_matches_naive_float64(shape, heads, causal):
    _check_blocked_against_naive(shape, heads, causal, BLOCKS)


@pytest.mark.parametrize("causal", CAUSALS)
def test_blocked_matches_naive_float64_with_unit_blocks(causal):
    _check_blocked_against_naive((9, 17), (4, 2), causal, [(1, 1), (2, 3), (9, 17)])


@pytest.mark.parametrize("causal", CAUSALS)
def test_blocked_matches_naive_float64_long(causal):
    _check_blocked_against_naive((1023, 1024), (2, 1), causal, [(128, 64), (100, 37), (None, None)],
                                 batch=1, head_dim=16)


def test_dispatch_and_defaults():
    q, k, v, do = random_inputs(1, 70, 90, 4, 2, 8, seed=3)
    options = dict(scale=0.3, variant=Variant(causal=True))
    default_q, default_k = _blocks.cpu_block_sizes(8, cache=_blocks.cache_bytes(2))
    out, lse = reference.forward(q, k, v, algorithm="fa2", block_q=None, block_k=None, **options)
    expected = reference.fa2_forward(q, k, v, block_q=default_q, block_k=default_k, **options)
    np.testing.assert_array_equal(out, expected[0])
    np.testing.assert_array_equal(lse, expected[1])
    # one block size given, the other from the rule
    out_q, _ = reference.forward(q, k, v, algorithm="fa1", block_q=7, block_k=None, **options)
    np.testing.assert_array_equal(out_q, reference.fa1_forward(q, k, v, block_q=7, block_k=default_k, **options)[0])
    naive = reference.forward(q, k, v, algorithm="naive", block_q=None, block_k=None, **options)
    np.testing.assert_array_equal(naive[0], reference.naive_forward(q, k, v, **options)[0])
    # order None is kv_outer, for either blocked algorithm
    backward_q, backward_k = _blocks.default_block_sizes(8, pass_="backward")
    expected_grads = reference.blocked_backward(do, q, k, v, out, lse, block_q=backward_q, block_k=backward_k,
                                                order="kv_outer", **options)
    for algorithm in ("fa2", "fa1"):
        grads = reference.backward(do, q, k, v, out, lse, algorithm=algorithm, block_q=None, block_k=None,
                                   order=None, **options)
        for grad, grad_expected in zip(grads, expected_grads):
            np.testing.assert_array_equal(grad, grad_expected)


# ---------------------------------------------------------------------------------------------------
# Low precision against the float64 truth
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", ["none", "bottom-right"])
@pytest.mark.parametrize("dtype_name", list(LOW_PRECISION))
def test_low_precision_within_error_budget(dtype_name, causal):
    dtype = LOW_PRECISION[dtype_name]
    q, k, v, do = random_inputs(2, 150, 230, 4, 2, 64, dtype, seed=4)
    options = dict(scale=64**-0.5, variant=CAUSAL_VARIANTS[causal])
    truth = float64_truth(q, k, v, do, **options)
    naive = (*reference.naive_forward(q, k, v, **options), reference.naive_backward(do, q, k, v, **options))
    sizes = dict(block_q=64, block_k=48)
    assert_blocked_within_budget(
        dtype, truth, naive,
        lambda algorithm: BLOCKED_FORWARDS[algorithm](q, k, v, **options, **sizes),
        lambda out, lse, order: reference.blocked_backward(do, q, k, v, out, lse, **options, **sizes, order=order),
        ORDERS,
    )


def test_probabilities_are_rounded_to_the_input_dtype_before_pv():
    """One tile, float16: the output is exactly ``(fp16(exp(S - m)) @ V) / l``, as the kernel computes it."""
    q, k, v, _ = random_inputs(1, 32, 40, 1, 1, 64, np.float16, seed=5, with_do=False)
    scale = 0.125
    q32, k32, v32 = (x[0, :, 0].astype(np.float32) for x in (q, k, v))
    s = q32 @ k32.T
    s *= scale
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    rounded = ((p.astype(np.float16).astype(np.float32) @ v32) / l).astype(np.float16)
    unrounded = ((p @ v32) / l).astype(np.float16)
    assert not np.array_equal(rounded, unrounded)  # the test can tell the two apart
    out, _ = reference.fa2_forward(q, k, v, scale=scale, block_q=32, block_k=40)
    assert max_abs_error(out[0, :, 0], rounded) <= max_abs_error(out[0, :, 0], unrounded)
    np.testing.assert_allclose(out[0, :, 0].astype(np.float32), rounded.astype(np.float32), rtol=0, atol=2e-3)


# ---------------------------------------------------------------------------------------------------
# Edge cases
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sign", [1, -1])
def test_huge_scores_stay_finite_and_correct(sign):
    """Scores of magnitude ~1e4: the running max keeps every exp in range."""
    q, k, v, do = random_inputs(2, 60, 90, 2, 1, 16, seed=6)
    q *= 100.0
    k *= 100.0 * sign
    options = dict(scale=0.25, variant=Variant(causal=True))
    truth = reference.naive_forward(q, k, v, **options)
    assert np.abs(truth[1]).max() > 5e3  # the scores really are that large
    grads_ref = reference.naive_backward(do, q, k, v, **options)
    for name, blocked_forward in BLOCKED_FORWARDS.items():
        out, lse = blocked_forward(q, k, v, **options, block_q=16, block_k=24)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        assert max_abs_error(out, truth[0]) < 1e-9 and max_abs_error(lse, truth[1]) < 1e-9
    for order in ORDERS:
        grads = reference.blocked_backward(do, q, k, v, *truth, **options, block_q=16, block_k=24, order=order)
        for grad, grad_ref in zip(grads, grads_ref):
            assert np.isfinite(grad).all()
            np.testing.assert_allclose(grad, grad_ref, rtol=0, atol=1e-9 * max(1.0, np.abs(grad_ref).max()))
    # float32 as well. At |S| ~ 1e4 a float32 score is only good to ~1e-3, and where two scores of a row
    # nearly tie, the weights depend on that last bit, which changes with the summation order of each
    # product (tile shape vs full matrix). So blocked and naive float32 scatter around the truth by
    # similar amounts but not within 2x of each other on every draw: allow 8x here.
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    out_naive, _ = reference.naive_forward(q32, k32, v32, **options)
    for name, blocked_forward in BLOCKED_FORWARDS.items():
        out, lse = blocked_forward(q32, k32, v32, **options, block_q=16, block_k=24)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        assert_within_budget(out, truth[0], out_naive, 8, rounding_floor(truth[0], np.float32), f"{name} float32 out")


@pytest.mark.parametrize("dtype_name", ["float64", *LOW_PRECISION])
@pytest.mark.parametrize("algorithm", ["naive", "fa2", "fa1"])
def test_rows_that_see_no_key(algorithm, dtype_name):
    """seqlen_q > seqlen_k, bottom-right: the first seqlen_q - seqlen_k rows see nothing."""
    dtype = LOW_PRECISION.get(dtype_name, np.float64)
    seqlen_q, seqlen_k = 50, 20
    q, k, v, do = random_inputs(2, seqlen_q, seqlen_k, 4, 2, 16, dtype, seed=7)
    options = dict(scale=0.25, variant=Variant(causal=True), block_q=16, block_k=8)
    out, lse = reference.forward(q, k, v, algorithm=algorithm, **options)
    blind = slice(0, seqlen_q - seqlen_k)
    assert np.all(out[:, blind].astype(np.float64) == 0)
    assert np.all(np.isneginf(lse[:, :, blind])) and np.isfinite(lse[:, :, seqlen_q - seqlen_k:]).all()
    assert not np.isnan(out.astype(np.float64)).any()
    for order in ORDERS:
        dq, dk, dv = reference.backward(do, q, k, v, out, lse, algorithm=algorithm, order=order, **options)
        assert np.all(dq[:, blind].astype(np.float64) == 0)
        for grad in (dq, dk, dv):
            assert np.isfinite(grad.astype(np.float64)).all()


def test_rows_that_see_no_key_inside_a_visited_tile():
    """Bottom-right alignment with 5 more queries than keys (offset -5): blind rows share query blocks
    with seeing rows."""
    q, k, v, do = random_inputs(1, 45, 40, 2, 2, 8, seed=8)
    options = dict(scale=0.3, variant=Variant(causal=True))
    truth = reference.naive_forward(q, k, v, **options)
    assert np.isneginf(truth[1][:, :, :5]).all()
    grads_ref = reference.naive_backward(do, q, k, v, **options)
    for name, blocked_forward in BLOCKED_FORWARDS.items():
        _assert_forward_matches(blocked_forward(q, k, v, **options, block_q=16, block_k=16), truth, name)
    for order in ORDERS:
        grads = reference.blocked_backward(do, q, k, v, *truth, **options, block_q=16, block_k=16, order=order)
        _assert_grads_match(grads, grads_ref, order)


def test_strided_views_give_the_same_results():
    """A (batch, heads, seqlen, d) array transposed to (batch, seqlen, heads, d), and a view that skips
    batch entries and heads, give bit-identical results to contiguous copies, and stay untouched."""
    rng = np.random.default_rng(9)
    q_bhnd = rng.standard_normal((2, 4, 70, 32)).astype(np.float32)
    kv_bhnd = rng.standard_normal((2, 2, 2, 90, 32)).astype(np.float32)
    do_wide = rng.standard_normal((4, 70, 8, 32)).astype(np.float32)
    q = q_bhnd.transpose(0, 2, 1, 3)
    k, v = (x.transpose(0, 2, 1, 3) for x in kv_bhnd)
    do = do_wide[::2, :, ::2]
    assert not any(x.flags.c_contiguous for x in (q, k, v, do))
    before = [x.copy() for x in (q, k, v, do)]
    options = dict(scale=0.2, variant=Variant(causal=True), block_q=32, block_k=16)
    contiguous = [np.ascontiguousarray(x) for x in (q, k, v, do)]
    for algorithm in ("fa2", "fa1", "naive"):
        out, lse = reference.forward(q, k, v, algorithm=algorithm, **options)
        out_c, lse_c = reference.forward(*contiguous[:3], algorithm=algorithm, **options)
        np.testing.assert_array_equal(out, out_c)
        np.testing.assert_array_equal(lse, lse_c)
        for order in ORDERS:
            grads = reference.backward(do, q, k, v, out, lse, algorithm=algorithm, order=order, **options)
            grads_c = reference.backward(contiguous[3], *contiguous[:3], out_c, lse_c, algorithm=algorithm,
                                         order=order, **options)
            for grad, grad_c in zip(grads, grads_c):
                np.testing.assert_array_equal(grad, grad_c)
    for x, x_before in zip((q, k, v, do), before):
        np.testing.assert_array_equal(x, x_before)


def test_strided_inputs_are_not_copied_whole(monkeypatch):
    """Peak traced memory of a strided forward stays below one copy of q, k and v (on one thread: each thread
    holds the tiles of its own query block)."""
    monkeypatch.setenv(reference.THREADS_ENV, "1")
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((1, 4, 1024, 64)).astype(np.float32).transpose(0, 2, 1, 3) for _ in range(3))
    tracemalloc.start()
    try:
        out, _ = reference.fa2_forward(q, k, v, scale=0.125, block_q=256, block_k=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    extra = peak - out.nbytes
    assert extra < (q.nbytes + k.nbytes + v.nbytes) / 2, (extra, q.nbytes)


EMPTY_SHAPES = {"batch": (0, 5, 7), "seqlen_q": (2, 0, 7), "seqlen_k": (2, 5, 0)}


@pytest.mark.parametrize("algorithm", ["naive", "fa2", "fa1"])
@pytest.mark.parametrize("which", list(EMPTY_SHAPES))
def test_empty_shapes(which, algorithm):
    batch, seqlen_q, seqlen_k = EMPTY_SHAPES[which]
    q, k, v, do = random_inputs(batch, seqlen_q, seqlen_k, 4, 2, 8, np.float32, seed=11)
    options = dict(scale=0.3, variant=Variant(causal=True), block_q=None, block_k=None)
    out, lse = reference.forward(q, k, v, algorithm=algorithm, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert lse.shape == (batch, 4, seqlen_q) and lse.dtype == np.float32 and np.isneginf(lse).all()
    for order in ORDERS:
        grads = reference.backward(do, q, k, v, out, lse, algorithm=algorithm, order=order, **options)
        for grad, x in zip(grads, (q, k, v)):
            assert grad.shape == x.shape and grad.dtype == x.dtype and not grad.any()


def _traced_peak(function, *args, **kwargs):
    tracemalloc.start()
    try:
        function(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_blocked_peak_memory_is_far_below_naive(monkeypatch):
    """At seqlen 2048 the naive path holds one (forward) or four (backward) 2048 x 2048 matrices per head;
    the blocked paths, at their default block sizes, hold tiles and O(seqlen x head_dim) arrays. The FA2
    forward's default tiles follow the machine's L2 cache and it holds one tile per thread: both are fixed here
    (a 512 KiB L2, the docs' machine, and one thread), so that the bound means the same on every machine (a 1 MiB
    L2's 448-row tiles in two threads hold a quarter of naive's matrices already at this length)."""
    monkeypatch.setattr(reference, "_l2_bytes", lambda: _blocks.DEFAULT_CACHE_BYTES)
    monkeypatch.setenv(reference.THREADS_ENV, "1")
    q, k, v, do = random_inputs(1, 2048, 2048, 2, 2, 32, np.float32, seed=12)
    options = dict(scale=32**-0.5, variant=Variant())
    out, lse = reference.naive_forward(q, k, v, **options)
    naive_forward_peak = _traced_peak(reference.naive_forward, q, k, v, **options)
    naive_backward_peak = _traced_peak(reference.naive_backward, do, q, k, v, **options)
    for name, blocked_forward in BLOCKED_FORWARDS.items():
        peak = _traced_peak(blocked_forward, q, k, v, **options)
        assert peak < naive_forward_peak / 10, (name, peak, naive_forward_peak)
    for order in ORDERS:
        peak = _traced_peak(reference.blocked_backward, do, q, k, v, out, lse, **options, order=order)
        assert peak < naive_backward_peak / 10, (order, peak, naive_backward_peak)


def test_bench_cpu_runs_and_checks_before_timing():
    """A small run of the CPU benchmark: both checks pass and the table has every algorithm. (At this
    size the targets themselves are not expected to hold.)"""
    import io

    from cuflash.cli import bench_cpu

    out = io.StringIO()
    bench_cpu.main(["--batch", "1", "--heads", "2", "--seqlen", "256", "--head-dim", "32", "--repeats", "1",
                    "--memory-seqlen", "512", "--memory-heads", "1"], out=out)
    text = out.getvalue()
    assert text.count("(ok)") == 4, text
    for name in ("naive", "fa2", "fa1"):
        assert f"  {name} " in text, text
    assert "targets:" in text and "fa2 forward time <= 1.2 x naive" in text, text
