"""Attention dropout (docs/variants.md, "Dropout"): the Philox-4x32-10 generator against its published
known answers and an independent scalar version, the keep decision as a pure function of
(seed, offset, b, h, i, j), and the NumPy algorithms (blocked vs naive, gradients) with dropout on."""

import numpy as np
import pytest
from _helpers import numeric_gradient, random_inputs

import cuflash
from cuflash import _philox, reference
from cuflash._variant import Variant

# Random123's kat_vectors, philox4x32 10 rounds: (counter words, key words) -> the four output words
PHILOX4X32_10_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox_scalar(counter, key, rounds=10):
    """Philox-4x32 on Python integers, straight from the SC'11 paper's description."""
    c, (k0, k1) = list(counter), key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
    return tuple(c)


def _layout(i, j):
    """The documented counter words c0, c1, the word index and the half of score (i, j): 16 x 16 blocks, one
    call per (i, i + 8) x (j, j + 1, j + 8, j + 9) octuple, a 16-bit half-word per score."""
    return (i >> 4) * 8 + (i & 7), (j >> 4) * 4 + ((j >> 1) & 3), 2 * ((i >> 3) & 1) + ((j >> 3) & 1), j & 1


def _keep_scalar(seed, offset, p, b, h, i, j):
    """The documented keep decision, on Python integers."""
    w = ((b << 32) + h + offset) % 2**64
    c0, c1, word, half = _layout(i, j)
    words = _philox_scalar((c0, c1, w & 0xFFFFFFFF, w >> 32), (seed & 0xFFFFFFFF, seed >> 32))
    return (words[word] >> (16 * half)) & 0xFFFF < int(np.floor((1.0 - p) * 2.0**16))


@pytest.mark.parametrize("counter, key, expected", PHILOX4X32_10_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(x) for x in _philox.philox4x32(counter, key)) == expected
    assert _philox_scalar(counter, key) == expected


def test_philox_vectorized_matches_scalar():
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, (4, 50), dtype=np.uint64)
    keys = rng.integers(0, 2**32, (2, 50), dtype=np.uint64)
    words = _philox.philox4x32(counters, keys)
    assert all(w.dtype == np.uint32 for w in words)
    for n in range(50):
        expected = _philox_scalar([int(c) for c in counters[:, n]], [int(k) for k in keys[:, n]])
        assert tuple(int(w[n]) for w in words) == expected


def test_keep_decision_matches_its_definition():
    """cuflash.dropout_mask entry by entry against the scalar definition, with a seed and an offset that
    use both 32-bit halves and an offset that carries from the head word into the batch word."""
    shape = (2, 3, 18, 20)  # past 8 and 16 on both axes: every word and counter step of the layout
    for seed, offset in ((0x0123456789ABCDEF, 0), (7, 2**32 - 2), (2**64 - 1, 2**64 - 1)):
        mask = cuflash.dropout_mask(shape, 0.4, seed, offset)
        assert mask.shape == shape and mask.dtype == bool
        for b, h, i, j in np.ndindex(shape):
            assert mask[b, h, i, j] == _keep_scalar(seed, offset, 0.4, b, h, i, j), (seed, offset, b, h, i, j)
        # scalar indices too (the 64-bit word wraps without a warning)
        assert bool(_philox.dropout_keep(seed, offset, 0.4, 1, 2, 3, 4)) == _keep_scalar(seed, offset, 0.4, 1, 2, 3, 4)


def test_counter_layout_against_scalar_philox():
    """dropout_keep at chosen (i, j) equals the threshold test of half j & 1 of word 2 * ((i >> 3) & 1) +
    ((j >> 3) & 1) of one scalar Philox call at counter ((i >> 4) * 8 + (i & 7), (j >> 4) * 4 + ((j >> 1) & 3),
    lo32(W), hi32(W)), written out by hand here; p = 0.5 makes the half-word's top bit the decision."""
    seed, offset, b, h = 0x0123456789ABCDEF, 5, 1, 2
    w = (b << 32) + h + offset
    key = (seed & 0xFFFFFFFF, seed >> 32)
    cases = {  # (i, j): (c0, c1, word, half)
        (0, 0): (0, 0, 0, 0), (0, 1): (0, 0, 0, 1), (0, 8): (0, 0, 1, 0), (8, 0): (0, 0, 2, 0), (8, 9): (0, 0, 3, 1),
        (5, 13): (5, 2, 1, 1), (13, 5): (5, 2, 2, 1), (16, 16): (8, 4, 0, 0), (23, 31): (15, 7, 1, 1),
        (100, 37): (52, 10, 0, 1), (1000, 2047): (496, 511, 3, 1),
    }
    for (i, j), (c0, c1, word, half) in cases.items():
        assert _layout(i, j) == (c0, c1, word, half), (i, j)
        r = (_philox_scalar((c0, c1, w & 0xFFFFFFFF, w >> 32), key)[word] >> (16 * half)) & 0xFFFF
        assert bool(_philox.dropout_keep(seed, offset, 0.5, b, h, i, j)) == (r < 2**15), (i, j)
    # the eight scores (i, i + 8) x (j, j + 1, j + 8, j + 9) of a 16 x 16 block read the eight half-words of
    # one call, in order: word 2a + c, low half for the even key
    i0, j0 = 16 * 3 + 5, 16 * 7 + 2
    words = _philox_scalar(((i0 >> 4) * 8 + (i0 & 7), (j0 >> 4) * 4 + ((j0 >> 1) & 3), w & 0xFFFFFFFF, w >> 32), key)
    halves = [(x >> (16 * hb)) & 0xFFFF for x in words for hb in (0, 1)]
    octet = [(i0 + 8 * a, j0 + 8 * c + hb) for a in (0, 1) for c in (0, 1) for hb in (0, 1)]
    threshold = _philox.keep_threshold(0.3)
    for n, (i, j) in enumerate(octet):
        assert bool(_philox.dropout_keep(seed, offset, 0.3, b, h, i, j)) == (halves[n] < threshold), (i, j)
    # distinct scores of a sequence never share (counter, word, half): the layout is a bijection
    seen = {_layout(i, j) for i in range(64) for j in range(48)}
    assert len(seen) == 64 * 48


def test_threshold_quantizes_p_to_a_multiple_of_2_to_the_minus_16():
    """T = floor((1 - p) 2**16): the kept fraction T / 2**16 is 1 - p rounded down to a multiple of 2**-16."""
    assert _philox.KEEP_BITS == 16 and _philox.THRESHOLD_ONE == 2**16
    for p in (0.1, 0.25, 0.5, 0.9, 1e-9, 1 - 2**-16, 0.999999):
        t = _philox.keep_threshold(p)
        assert t == int(np.floor((1 - p) * 65536)) and 0 <= t < 2**16
        assert 0 <= (1 - p) - t / 2**16 < 2**-16
    assert _philox.keep_threshold(0.0) == 2**16
    assert _philox.keep_threshold(0.1) == 58982 and _philox.keep_threshold(0.25) == 49152


def _lane_bits(seed, offset, p, b, h, row_base, col_base, n_tiles, transposed):
    """The CUDA kernels' dropout_bits (cuflash_kernels/variants.cuh) for all 32 lanes of a warp, written out in
    Python: bit 4 nt + e of lane (g, t) is the keep bit of element e of n8 tile nt of the mma accumulator
    (rows row_base + g + 8 (e >> 1), columns col_base + 8 nt + 2t + (e & 1); rows are keys when transposed).
    Transposed, lane pairs g, g ^ 1 each make one Philox call and swap the halves the other needs."""
    threshold = _philox.keep_threshold(p)
    w = ((b << 32) + h + offset) % 2**64
    key = (seed & 0xFFFFFFFF, seed >> 32)
    lo, hi = [0] * 32, [0] * 32  # Python integers: bits 0 .. 4 n_tiles - 1
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        if transposed:
            c0, c1 = (col_base >> 1) + 2 * t + (g & 1), (row_base >> 2) + (g >> 1)
        else:
            c0, c1 = (row_base >> 1) + g, (col_base >> 2) + t
        for np_ in range(n_tiles // 2):
            cc0, cc1 = (c0 + 8 * np_, c1) if transposed else (c0, c1 + 4 * np_)
            words = _philox_scalar((cc0, cc1, w & 0xFFFFFFFF, w >> 32), key)
            for wd in range(4):
                qa, kc = wd >> 1, wd & 1
                pos = 4 * (2 * np_ + qa) + 2 * kc if transposed else 4 * (2 * np_ + kc) + 2 * qa
                lo[lane] |= int((words[wd] & 0xFFFF) < threshold) << pos
                hi[lane] |= int((words[wd] >> 16) < threshold) << pos
    if not transposed:
        return [x | (y << 1) for x, y in zip(lo, hi)]
    bits = [0] * 32
    for lane in range(32):
        s, partner = (lane >> 2) & 1, lane ^ 4
        own = hi[lane] if s else lo[lane]
        got = lo[partner] if (partner >> 2) & 1 else hi[partner]  # what the partner sends: its other half
        bits[lane] = (own << s) | (got << (1 - s))
    return bits


@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_lane_layout_gives_the_reference_mask(transposed):
    """Every lane's keep bits, as the kernels draw them (one call per 8 scores in both layouts), are the
    reference's keep decisions of the scores that lane holds."""
    seed, offset, p, b, h = 2**40 + 12345, 2**33 + 5, 0.3, 1, 3
    for row_base, col_base, n_tiles in ((0, 0, 8), (48, 96, 16), (1024, 2048, 4)):
        bits = _lane_bits(seed, offset, p, b, h, row_base, col_base, n_tiles, transposed)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for nt in range(n_tiles):
                for e in range(4):
                    r, c = row_base + g + 8 * (e >> 1), col_base + 8 * nt + 2 * t + (e & 1)
                    i, j = (c, r) if transposed else (r, c)
                    want = bool(_philox.dropout_keep(seed, offset, p, b, h, i, j))
                    assert bool((bits[lane] >> (4 * nt + e)) & 1) == want, (transposed, lane, nt, e)


# The keep mask of one 16 x 16 block, (b, h) = (1, 3), seed 2024, offset 7, p = 0.5: bit j of row i is
# keep(i, j), computed once from the scalar definition above (a pin for the CUDA kernels' tests)
KNOWN_BLOCK = (0x8B22, 0x05D0, 0x87E5, 0xC5AE, 0x45FC, 0x575E, 0xEB65, 0xA56A,
               0x2996, 0xCC38, 0xC312, 0x7266, 0xFAE1, 0xB416, 0xD893, 0x4605)


def test_known_block_mask():
    mask = cuflash.dropout_mask((2, 4, 16, 16), 0.5, seed=2024, offset=7)[1, 3]
    rows = tuple(int((mask[i].astype(np.int64) << np.arange(16)).sum()) for i in range(16))
    assert rows == KNOWN_BLOCK, [hex(r) for r in rows]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_tolerance(p):
    mask = cuflash.dropout_mask((2, 4, 128, 128), p, seed=2024, offset=3)
    n = mask.size
    sigma = np.sqrt(n * p * (1 - p))
    assert abs(mask.sum() - n * (1 - p)) < 5 * sigma, (mask.mean(), 1 - p)


def test_mask_is_a_pure_function_of_its_indices():
    """Any tiling (and any order of evaluation) gives the same mask; seed, offset and index change it."""
    shape = (2, 3, 37, 41)
    full = cuflash.dropout_mask(shape, 0.3, seed=11, offset=5)
    variant = Variant(dropout_p=0.3, dropout_seed=11, dropout_offset=5)
    rng = np.random.default_rng(1)
    for block_q, block_k in ((1, 1), (7, 5), (16, 3), (37, 41)):
        tiles = [(qs, ks) for qs in range(0, 37, block_q) for ks in range(0, 41, block_k)]
        tiled = np.zeros(shape, bool)
        for n in rng.permutation(len(tiles)):
            qs, ks = tiles[n]
            i = np.arange(qs, min(qs + block_q, 37))[:, None]
            j = np.arange(ks, min(ks + block_k, 41))[None, :]
            tiled[:, :, i, j] = variant.keep(np.arange(2)[:, None, None, None], np.arange(3)[None, :, None, None],
                                             i[None, None], j[None, None])
        np.testing.assert_array_equal(tiled, full)
    assert (cuflash.dropout_mask(shape, 0.3, seed=12, offset=5) != full).mean() > 0.2
    assert (cuflash.dropout_mask(shape, 0.3, seed=11, offset=6) != full).mean() > 0.2
    assert (full[0] != full[1]).mean() > 0.2 and (full[:, 0] != full[:, 1]).mean() > 0.2
    np.testing.assert_array_equal(cuflash.dropout_mask(shape, 0.3, seed=11, offset=5), full)
    assert cuflash.dropout_mask(shape, 0.0, seed=11).all()


def test_attention_applies_dropout_mask():
    """The front door's output is (softmax(S) * mask / (1 - p)) V with cuflash.dropout_mask's mask, and its
    lse is that of the undropped scores."""
    q, k, v, _ = random_inputs(2, 9, 12, 4, 2, 8, with_do=False)
    out, lse = cuflash.attention(q, k, v, dropout_p=0.25, dropout_seed=99, dropout_offset=1, return_lse=True)
    mask = cuflash.dropout_mask((2, 4, 9, 12), 0.25, 99, 1)
    kk, vv = (np.repeat(x, 2, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", q, kk) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = np.einsum("bhij,bjhd->bihd", p * mask / 0.75, vv)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    _, lse_plain = cuflash.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(lse, lse_plain, rtol=0, atol=1e-12)


_VARIANTS = {
    "dense": {},
    "gqa-causal": dict(causal=True),
    "window": dict(window_size=(5, 2)),
    "bias-softcap-alibi": dict(bias="random", softcap=3.0, alibi="random"),
    "seqused": dict(seqused_k=np.array([9, 21], np.int32)),
}


def _variant_keywords(name, seqlen_q, seqlen_k, heads_q):
    kw = dict(_VARIANTS[name])
    rng = np.random.default_rng(5)
    if kw.pop("bias", None):
        kw["bias"] = rng.standard_normal((2, heads_q, seqlen_q, seqlen_k))
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, heads_q).astype(np.float32)
    return kw


@pytest.mark.parametrize("name", list(_VARIANTS))
def test_blocked_matches_naive_float64(name):
    q, k, v, do = random_inputs(2, 19, 21, 4, 2, 8)
    kw = dict(_variant_keywords(name, 19, 21, 4), dropout_p=0.3, dropout_seed=0xC0FFEE, dropout_offset=2**33 + 7)
    out_n, lse_n = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **kw)
    grads_n = cuflash.attention_backward(do, q, k, v, out_n, lse_n, algorithm="naive", **kw)
    for block_q, block_k in ((1, 1), (4, 8), (7, 5), (32, 32)):
        for algorithm in ("fa2", "fa1"):
            out, lse = cuflash.attention(q, k, v, algorithm=algorithm, block_q=block_q, block_k=block_k,
                                         return_lse=True, **kw)
            np.testing.assert_allclose(out, out_n, rtol=0, atol=1e-12, err_msg=f"{algorithm} {block_q}x{block_k}")
            np.testing.assert_allclose(lse, lse_n, rtol=0, atol=1e-12)
        for order in ("kv_outer", "q_outer", "split"):
            grads = cuflash.attention_backward(do, q, k, v, out_n, lse_n, block_q=block_q, block_k=block_k,
                                               order=order, **kw)
            for got, want, label in zip(grads, grads_n, ("dq", "dk", "dv", "dbias")):
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=f"{label} {order} {block_q}x{block_k}")


def test_packed_batch_uses_sequence_index_and_positions():
    """A packed batch of equal-length sequences draws the mask of the padded batch: b is the sequence's
    index, i and j positions within it."""
    q, k, v, do = random_inputs(3, 6, 10, 2, 2, 8)
    kw = dict(dropout_p=0.5, dropout_seed=3, dropout_offset=4)
    padded = cuflash.attention(q, k, v, **kw)
    cu_q, cu_k = np.arange(0, 19, 6, dtype=np.int32), np.arange(0, 31, 10, dtype=np.int32)
    packed = cuflash.attention(*(x.reshape(-1, 2, 8) for x in (q, k, v)), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=6, max_seqlen_k=10, block_q=4, block_k=3, **kw)
    np.testing.assert_allclose(packed.reshape(padded.shape), padded, rtol=0, atol=1e-12)


def test_gradients_match_finite_differences():
    """With the mask fixed by the seed, the naive backward is the gradient of the naive forward."""
    q, k, v, do = random_inputs(1, 5, 6, 2, 1, 4, seed=3)
    kw = dict(scale=0.5, variant=Variant(causal=True, softcap=2.0, dropout_p=0.4, dropout_seed=17, dropout_offset=9))

    def loss(q, k, v):
        return float((reference.naive_forward(q, k, v, **kw)[0] * do).sum())

    grads = reference.naive_backward(do, q, k, v, **kw)
    for index, grad in enumerate(grads):
        numeric = numeric_gradient(loss, [q, k, v], index, step=1e-6)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_dropout_p_zero_is_no_dropout_exactly():
    q, k, v, do = random_inputs(2, 11, 13, 4, 2, 8)
    for algorithm in ("fa2", "fa1", "naive"):
        out, lse = cuflash.attention(q, k, v, causal=True, algorithm=algorithm, block_q=4, block_k=5, return_lse=True)
        for kw in (dict(dropout_p=0.0), dict(dropout_p=0.0, dropout_seed=5, dropout_offset=3)):
            out_0, lse_0 = cuflash.attention(q, k, v, causal=True, algorithm=algorithm, block_q=4, block_k=5,
                                             return_lse=True, **kw)
            np.testing.assert_array_equal(out_0, out)
            np.testing.assert_array_equal(lse_0, lse)
            grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=True, algorithm=algorithm, **kw)
            for got, want in zip(grads, cuflash.attention_backward(do, q, k, v, out, lse, causal=True,
                                                                   algorithm=algorithm)):
                np.testing.assert_array_equal(got, want)


def test_low_precision_dropout_runs():
    """float32 inputs: the keep factor enters P before its rounding; the blocked result stays close to truth."""
    q, k, v, _ = random_inputs(1, 16, 16, 2, 2, 8)
    kw = dict(dropout_p=0.2, dropout_seed=1)
    truth = cuflash.attention(q, k, v, algorithm="naive", **kw)
    out = cuflash.attention(*(x.astype(np.float32) for x in (q, k, v)), block_q=4, block_k=4, **kw)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, truth, rtol=0, atol=1e-5)
