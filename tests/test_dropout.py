"""Attention dropout (docs/variants.md, "Dropout"): the Philox-4x32-10 generator against its published
known answers and an independent scalar version, the keep decision as a pure function of
(seed, offset, b, h, i, j), and the NumPy algorithms (blocked vs naive, gradients) with dropout on."""

import numpy as np
import pytest
from _helpers import numeric_gradient, random_inputs

import cuflash
from cuflash._ops import philox as _philox
from cuflash import reference
from cuflash._ops.variant import Variant

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
    """The documented counter words c0, c1, the word index and the quarter of score (i, j): 16 x 32 blocks, one
    call per (i, i + 8) x (j + 8c + e, c < 4, e < 2) block of 16 scores, an 8-bit quarter-word per score."""
    return ((i >> 4) * 8 + (i & 7), (j >> 5) * 4 + ((j >> 1) & 3), 2 * ((i >> 3) & 1) + ((j >> 3) & 1),
            2 * ((j >> 4) & 1) + (j & 1))


def _keep_scalar(seed, offset, p, b, h, i, j):
    """The documented keep decision, on Python integers."""
    w = ((b << 32) + h + offset) % 2**64
    c0, c1, word, quarter = _layout(i, j)
    words = _philox_scalar((c0, c1, w & 0xFFFFFFFF, w >> 32), (seed & 0xFFFFFFFF, seed >> 32))
    return (words[word] >> (8 * quarter)) & 0xFF < int(np.floor((1.0 - p) * 2.0**8))


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
    shape = (2, 3, 18, 36)  # past 8 and 16 (and 32 for keys): every word, quarter and counter step
    for seed, offset in ((0x0123456789ABCDEF, 0), (7, 2**32 - 2), (2**64 - 1, 2**64 - 1)):
        mask = cuflash.dropout_mask(shape, 0.4, seed, offset)
        assert mask.shape == shape and mask.dtype == bool
        for b, h, i, j in np.ndindex(shape):
            assert mask[b, h, i, j] == _keep_scalar(seed, offset, 0.4, b, h, i, j), (seed, offset, b, h, i, j)
        # scalar indices too (the 64-bit word wraps without a warning)
        assert bool(_philox.dropout_keep(seed, offset, 0.4, 1, 2, 3, 4)) == _keep_scalar(seed, offset, 0.4, 1, 2, 3, 4)


def test_counter_layout_against_scalar_philox():
    """dropout_keep at chosen (i, j) equals the threshold test of quarter 2 * ((j >> 4) & 1) + (j & 1) of word
    2 * ((i >> 3) & 1) + ((j >> 3) & 1) of one scalar Philox call at counter ((i >> 4) * 8 + (i & 7),
    (j >> 5) * 4 + ((j >> 1) & 3), lo32(W), hi32(W)), written out by hand here; p = 0.5 makes the quarter's top
    bit the decision."""
    seed, offset, b, h = 0x0123456789ABCDEF, 5, 1, 2
    w = (b << 32) + h + offset
    key = (seed & 0xFFFFFFFF, seed >> 32)
    cases = {  # (i, j): (c0, c1, word, quarter)
        (0, 0): (0, 0, 0, 0), (0, 1): (0, 0, 0, 1), (0, 8): (0, 0, 1, 0), (8, 0): (0, 0, 2, 0), (8, 9): (0, 0, 3, 1),
        (0, 16): (0, 0, 0, 2), (0, 17): (0, 0, 0, 3), (8, 25): (0, 0, 3, 3), (5, 13): (5, 2, 1, 1),
        (13, 5): (5, 2, 2, 1), (16, 16): (8, 0, 0, 2), (23, 31): (15, 3, 1, 3), (16, 32): (8, 4, 0, 0),
        (100, 37): (52, 6, 0, 1), (1000, 2047): (496, 255, 3, 3),
    }
    for (i, j), (c0, c1, word, quarter) in cases.items():
        assert _layout(i, j) == (c0, c1, word, quarter), (i, j)
        r = (_philox_scalar((c0, c1, w & 0xFFFFFFFF, w >> 32), key)[word] >> (8 * quarter)) & 0xFF
        assert bool(_philox.dropout_keep(seed, offset, 0.5, b, h, i, j)) == (r < 2**7), (i, j)
    # the sixteen scores (i, i + 8) x (j + 8c + e) of a 16 x 32 block read the sixteen quarters of one call, in
    # order: word 2a + (c & 1), quarter 2 (c >> 1) + e
    i0, j0 = 16 * 3 + 5, 32 * 7 + 2
    words = _philox_scalar(((i0 >> 4) * 8 + (i0 & 7), (j0 >> 5) * 4 + ((j0 >> 1) & 3), w & 0xFFFFFFFF, w >> 32), key)
    quarters = [(x >> (8 * q)) & 0xFF for x in words for q in range(4)]
    block = [(i0 + 8 * (wd >> 1), j0 + 8 * ((wd & 1) + 2 * (q >> 1)) + (q & 1)) for wd in range(4) for q in range(4)]
    threshold = _philox.keep_threshold(0.3)
    for n, (i, j) in enumerate(block):
        assert bool(_philox.dropout_keep(seed, offset, 0.3, b, h, i, j)) == (quarters[n] < threshold), (i, j)
    # distinct scores of a sequence never share (counter, word, quarter): the layout is a bijection
    seen = {_layout(i, j) for i in range(64) for j in range(96)}
    assert len(seen) == 64 * 96


def test_threshold_quantizes_p_to_a_multiple_of_2_to_the_minus_8():
    """T = floor((1 - p) 2**8): the kept fraction T / 256 is 1 - p rounded down to a multiple of 2**-8."""
    assert _philox.KEEP_BITS == 8 and _philox.THRESHOLD_ONE == 2**8
    for p in (0.1, 0.25, 0.5, 0.9, 1e-9, 1 - 2**-8, 0.999999, 2**-9):
        t = _philox.keep_threshold(p)
        assert t == int(np.floor((1 - p) * 256)) and 0 <= t < 2**8
        assert 0 <= (1 - p) - t / 2**8 < 2**-8
    assert _philox.keep_threshold(0.0) == 2**8
    assert _philox.keep_threshold(0.1) == 230 and _philox.keep_threshold(0.25) == 192
    assert _philox.keep_threshold(1e-9) == 255  # any p > ~1e-16 drops at least 1/256


def _quarter_kept(x, q, t24):
    """variants.cuh's quarter_kept: (x << (24 - 8 q)) mod 2**32 < T << 24."""
    return ((x << (24 - 8 * q)) & 0xFFFFFFFF) < t24


def _lane_bits(seed, offset, p, b, h, row_base, col_base, n_tiles, transposed, row_tiles=1, mutation=None):
    """The CUDA kernels' dropout_bits_tiles (cuflash_kernels/variants.cuh) for all 32 lanes of a warp, written
    out in Python statement by statement: bits[r][lane] bit 4 nt + e is the keep bit of element e of n8 tile nt
    of row tile r of the mma accumulator (rows row_base + 16 r + g + 8 (e >> 1), columns col_base + 8 nt + 2t +
    (e & 1); rows are keys when transposed). Transposed, lane pairs g, g ^ 1 each make one Philox call and swap
    the quarters the other needs. ``mutation`` breaks one step on purpose (the test must then fail)."""
    t24 = _philox.keep_threshold(p) << 24
    w = ((b << 32) + h + offset) % 2**64
    key = (seed & 0xFFFFFFFF, seed >> 32)

    def call(c0, c1):
        return _philox_scalar((c0 & 0xFFFFFFFF, c1 & 0xFFFFFFFF, w & 0xFFFFFFFF, w >> 32), key)

    bits = [[0] * 32 for _ in range(row_tiles)]  # Python integers: bits 0 .. 4 n_tiles - 1
    if not transposed:
        assert row_tiles == 1
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            c0 = (row_base >> 1) + g
            if n_tiles % 4 == 0:
                assert col_base % 32 == 0
                for nq in range(n_tiles // 4):
                    words = call(c0, (col_base >> 3) + t + 4 * nq)
                    for wd in range(4):
                        for q in range(4):
                            a, c, e = wd >> 1, (wd & 1) + 2 * (q >> 1), q & 1
                            if mutation == "quarter":
                                c, e = (wd & 1) + 2 * (q & 1), q >> 1
                            pos = 4 * (4 * nq + c) + 2 * a + e
                            bits[0][lane] |= int(_quarter_kept(words[wd], q, t24)) << pos
            else:  # one call per 16 columns, the half of each word that their 32-column block gives them
                for np_ in range(n_tiles // 2):
                    col = col_base + 16 * np_
                    words = call(c0, (col >> 5) * 4 + t)
                    sh = 16 * ((col >> 4) & 1)
                    if mutation == "half":
                        sh = 16 - sh
                    for wd in range(4):
                        for e in range(2):
                            pos = 4 * (2 * np_ + (wd & 1)) + 2 * (wd >> 1) + e
                            bits[0][lane] |= int(_quarter_kept(words[wd] >> sh, e, t24)) << pos
        return bits
    lo = [[0] * 32 for _ in range(row_tiles)]
    hi = [[0] * 32 for _ in range(row_tiles)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        s = g & 1
        c0, c1 = (col_base >> 1) + 2 * t + s, ((row_base >> 3) & ~3) + (g >> 1)
        sh = 0 if row_tiles == 2 else 16 * ((row_base >> 4) & 1)
        if mutation == "half":
            sh = 16 - sh
        for np_ in range(n_tiles // 2):
            words = call(c0 + 8 * np_, c1)
            for wd in range(4):
                pos = 4 * (2 * np_ + (wd >> 1)) + 2 * (wd & 1)
                for r in range(row_tiles):
                    x = words[wd] >> (16 * (r if mutation != "tiles" else 1 - r) if row_tiles == 2 else sh)
                    lo[r][lane] |= int(_quarter_kept(x, 0, t24)) << pos
                    hi[r][lane] |= int(_quarter_kept(x, 1, t24)) << pos
    for r in range(row_tiles):
        for lane in range(32):
            s, partner = (lane >> 2) & 1, lane ^ 4
            own = hi[r][lane] if s else lo[r][lane]
            send_partner = lo[r][partner] if (partner >> 2) & 1 else hi[r][partner]  # the partner's other parity
            if mutation == "swap":  # no exchange: the lane's own call for both query parities
                send_partner = lo[r][lane] if s else hi[r][lane]
            bits[r][lane] = (own << s) | (send_partner << (1 - s))
    return bits


# (row_base, col_base, n8 tiles, row tiles) per layout: the kernels' shapes (wgmma forward 16 x 128, mma.sync
# 16 x 32 and 16 x 64; a user's 16 x 48 tile; wgmma dK/dV 16 keys x 64 queries at both halves of a 32-key
# block; mma.sync dK/dV 32 keys x 32 and x 16 queries)
_LANE_CASES = {
    False: ((0, 0, 16, 1), (48, 96, 4, 1), (1024, 2048, 8, 1), (32, 48, 6, 1), (16, 16, 2, 1)),
    True: ((0, 0, 8, 1), (48, 96, 8, 1), (1040, 2048, 4, 1), (0, 0, 4, 2), (64, 80, 2, 2), (1024, 2048, 8, 2)),
}


def _lane_mismatches(transposed, mutation=None):
    """How many keep bits of the emulated lanes differ from the reference's mask (0: the layout is right)."""
    seed, offset, p, b, h = 2**40 + 12345, 2**33 + 5, 0.3, 1, 3
    bad = 0
    for row_base, col_base, n_tiles, row_tiles in _LANE_CASES[transposed]:
        bits = _lane_bits(seed, offset, p, b, h, row_base, col_base, n_tiles, transposed, row_tiles, mutation)
        for r in range(row_tiles):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for nt in range(n_tiles):
                    for e in range(4):
                        rr, cc = row_base + 16 * r + g + 8 * (e >> 1), col_base + 8 * nt + 2 * t + (e & 1)
                        i, j = (cc, rr) if transposed else (rr, cc)
                        want = bool(_philox.dropout_keep(seed, offset, p, b, h, i, j))
                        bad += bool((bits[r][lane] >> (4 * nt + e)) & 1) != want
    return bad


@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_lane_layout_gives_the_reference_mask(transposed):
    """Every lane's keep bits, as the kernels draw them (normal: one call per 16 scores, or per 8 on 16-column
    leftovers; transposed: one per 16 scores over 32 keys, one per 8 over 16 keys), are the reference's keep
    decisions of the scores that lane holds."""
    assert _lane_mismatches(transposed) == 0


@pytest.mark.parametrize("transposed, mutation", [(False, "quarter"), (False, "half"), (True, "half"),
                                                  (True, "tiles"), (True, "swap")])
def test_lane_layout_check_catches_a_wrong_layout(transposed, mutation):
    """The check above can fail: a wrong quarter order, the wrong half of a word, swapped row tiles or a missing
    lane exchange each give many wrong bits."""
    assert _lane_mismatches(transposed, mutation) > 100


# The keep mask of one 16 x 32 block, (b, h) = (1, 3), seed 2024, offset 7, p = 0.5: bit j of row i is
# keep(i, j), computed once from the scalar definition above (a pin for the CUDA kernels' tests)
KNOWN_BLOCK = (0xCA235715, 0x04D51EF5, 0x96E41B9E, 0xD5BEDA18, 0x40A99AED, 0x525BEBAD, 0xBB60D7CF, 0xB43F4AC1,
               0x69D70629, 0xD97DC820, 0xD757C260, 0x7336B0DC, 0xAAB5F0D3, 0xB5126C29, 0xC8D3E533, 0x07408C1B)


def test_known_block_mask():
    mask = cuflash.dropout_mask((2, 4, 16, 32), 0.5, seed=2024, offset=7)[1, 3]
    rows = tuple(int((mask[i].astype(np.int64) << np.arange(32)).sum()) for i in range(16))
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
