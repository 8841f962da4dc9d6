"""Attention variants on the GPU (windows, softcap, ALiBi, key padding, packed variable-length batches,
bias, dropout and their combinations) against the float64 truth, through the public API.

The truth is the NumPy naive oracle in float64 (``cuflash.attention(..., algorithm="naive")`` on float64
NumPy arrays); the error budget (STYLE.md) compares the kernels with the same oracle run in the kernels'
dtype: outputs within 2x its error, gradients within 3x, plus the floor of rounding the truth. Outputs and
gradients come from a NaN-poisoned pool, so an element no kernel wrote fails. Skips without CuPy and a GPU.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash

from _gpu_helpers import DTYPES, poison
from _helpers import assert_within_budget, max_abs_error, rounding_floor

pytestmark = pytest.mark.gpu


def _inputs(rng, q_shape, kv_shape, dtype):
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in (q_shape, kv_shape, kv_shape, q_shape))
    return q, k, v, do


def _nan_padded(cp, x):
    """``x`` on the device as a view of a wider array whose extra 16 columns hold NaN: a kernel that reads past
    the view's head dim poisons its output."""
    wide = cp.full((*x.shape[:-1], x.shape[-1] + 16), np.nan, dtype=x.dtype)
    wide[..., :x.shape[-1]] = cp.asarray(x)
    return wide[..., :x.shape[-1]]


def _bias_view(cp, bias, layout):
    """``bias`` on the device as a view of a NaN-filled wider array: "padded" 8 more rows and 16 more columns
    (16-byte aligned rows: the wgmma kernels stage it; a tile load past its rows or columns poisons the output),
    "unaligned" also starting one element in (rows not 16-byte aligned: read from global memory)."""
    shape = bias.shape
    start = 1 if layout == "unaligned" else 0
    wide = cp.full((*shape[:-2], shape[-2] + 8, shape[-1] + 16 + start), np.nan, dtype=bias.dtype)
    view = wide[..., :shape[-2], start:start + shape[-1]]
    view[...] = cp.asarray(bias)
    return view


def check_variant(cp, q, k, v, do, *, deterministic=False, views=False, bias_layout=None, kernel_opts=None, **opts):
    """Forward and backward on the GPU against the float64 truth with the error budget (``views``: the inputs
    as views of wider arrays with NaN past their head dims; ``bias_layout``: the bias as such a view,
    :func:`_bias_view`; ``kernel_opts``: keywords of the GPU calls only, block sizes say)."""
    dtype = q.dtype
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    opts64 = dict(opts, **({"bias": opts["bias"].astype(np.float64)} if "bias" in opts else {}))
    out_t, lse_t = cuflash.attention(q64, k64, v64, algorithm="naive", return_lse=True, **opts64)
    grads_t = cuflash.attention_backward(do64, q64, k64, v64, out_t, lse_t, algorithm="naive", **opts64)
    out_n, lse_n = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **opts)
    grads_n = cuflash.attention_backward(do, q, k, v, out_n, lse_n, algorithm="naive", **opts)

    def to_dev(val):
        if isinstance(val, dict):  # mod_arrays
            return {name: cp.asarray(a) for name, a in val.items()}
        return cp.asarray(val) if isinstance(val, np.ndarray) else val

    dev = {key: to_dev(val) for key, val in opts.items()}
    if bias_layout is not None:
        dev["bias"] = _bias_view(cp, opts["bias"], bias_layout)
    dev.update(kernel_opts or {})
    cq, ck, cv, cdo = (_nan_padded(cp, x) if views else cp.asarray(x) for x in (q, k, v, do))
    poison(cp)
    out, lse = cuflash.attention(cq, ck, cv, return_lse=True, **dev)
    poison(cp)
    grads = cuflash.attention_backward(cdo, cq, ck, cv, out, lse, deterministic=deterministic, **dev)

    out_h = cp.asnumpy(out)
    assert not np.isnan(out_h.astype(np.float32)).any(), "forward left unwritten (NaN) elements"
    floor = rounding_floor(out_t, dtype)
    if np.dtype(dtype) == np.float32:  # the 3xTF32 forward: one float32 spacing at the output's magnitude
        floor = max(floor, float(np.spacing(np.float32(np.abs(out_t).max()))))  # (test_cuda_tf32.py's floor)
    assert_within_budget(out_h, out_t, out_n, 2, floor, "out")
    lse_err = max_abs_error(cp.asnumpy(lse), lse_t)
    assert lse_err < 2e-3, f"lse: max|err| = {lse_err:.3e}"
    assert len(grads) == len(grads_t) == (4 if "bias" in opts else 3)
    # dbias = dS element by element, with D = rowsum(dO * O) from the output as stored (FlashAttention's
    # D): each element carries D's rounding, |dO| . |O| times the dtype's unit roundoff, which the oracle
    # (D = rowsum(P * dP) in float32) does not have. Added to that gradient's floor.
    d_rounding = float(ml_dtypes.finfo(dtype).eps) / 2 * float(np.abs(do64 * out_t).sum(-1).max())
    if "bias" in opts:
        assert grads[3].dtype == opts["bias"].dtype and grads[3].shape == opts["bias"].shape
    for name, g, gt, gn in zip(("dq", "dk", "dv", "dbias"), grads, grads_t, grads_n):
        gh = cp.asnumpy(g)
        assert not np.isnan(gh.astype(np.float32)).any(), f"{name}: unwritten (NaN) elements"
        floor = rounding_floor(gt, dtype) + 1e-4 + (d_rounding if name == "dbias" else 0.0)
        assert_within_budget(gh, gt, gn, 3, floor, name)
    return out, lse, grads


# (label, options): each on a padded batch (B, Nq, Nk, Hq, Hkv) = (2, 300, 333, 4, 2) unless it says.
PADDED_CASES = {
    "window": dict(window_size=(40, 10)),
    "window-left-only": dict(window_size=(100, -1)),
    "window-right-only": dict(window_size=(-1, 7)),
    "causal-window": dict(causal=True, window_size=(64, -1)),
    "causal-top-left-window": dict(causal=True, causal_align="top-left", window_size=(30, 0)),
    "softcap": dict(softcap=5.0),
    "softcap-causal": dict(softcap=2.0, causal=True),
    "alibi-causal": dict(alibi_slopes="heads", causal=True),
    "alibi-batch": dict(alibi_slopes="batch"),
    "seqused": dict(seqused_k=[333, 0]),
    "seqused-causal-softcap-alibi": dict(seqused_k=[120, 333], causal=True, softcap=8.0, alibi_slopes="heads"),
    "bias": dict(bias="full"),
    "bias-broadcast-causal": dict(bias="broadcast", causal=True),
    "attn-mask": dict(attn_mask="random"),
    "bias-mask-softcap-window-alibi": dict(bias="full", attn_mask="random", softcap=5.0, window_size=(60, 20),
                                           alibi_slopes="heads"),
    # dropout: the kernels' keep decision is the reference's bit for bit (a seed and an offset past 2**32)
    "dropout": dict(dropout_p=0.17, dropout_seed=2**40 + 12345, dropout_offset=2**33 + 5),
    "dropout-causal-bias-softcap": dict(dropout_p=0.3, dropout_seed=99, causal=True, bias="full", softcap=6.0),
    # user mods (CUDA C expressions compiled into the kernels)
    "score-mod-relative": dict(score_mod="score + 0.05f * (q_idx - kv_idx) / 8"),
    "score-mod-tanh-causal": dict(score_mod="6.0f * tanhf(score / 6.0f)", causal=True),
    "mask-mod-prefix-lm": dict(mask_mod="kv_idx <= q_idx || kv_idx < 40"),
    "mask-mod-document": dict(mask_mod="doc[q_idx] == doc[kv_idx]", mod_arrays="doc"),
    "mods-bias-dropout-window": dict(score_mod="score * (h + 1) * 0.5f", mask_mod="(q_idx + kv_idx) % 7 != 0",
                                     bias="full", dropout_p=0.2, dropout_seed=5, window_size=(80, 30)),
}


def _resolve(opts, rng, batch, heads, nq=300, nk=333):
    opts = dict(opts)
    if opts.get("bias") == "full":
        opts["bias"] = rng.standard_normal((batch, heads, nq, nk)).astype(np.float32)
    elif opts.get("bias") == "broadcast":
        opts["bias"] = rng.standard_normal((1, 1, nq, nk)).astype(np.float32)
    if opts.get("attn_mask") == "random":  # a fifth of the scores masked, and every key of query row 3
        mask = rng.random((batch, heads, nq, nk)) >= 0.2
        mask[:, :, 3] = False
        opts["attn_mask"] = mask
    if opts.get("alibi_slopes") == "heads":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, heads).astype(np.float32)
    elif opts.get("alibi_slopes") == "batch":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (batch, heads)).astype(np.float32)
    if opts.get("mod_arrays") == "doc":  # document ids: sorted, a few documents over the longer axis
        opts["mod_arrays"] = {"doc": np.sort(rng.integers(0, 5, max(nq, nk))).astype(np.int32)}
    if "seqused_k" in opts:
        opts["seqused_k"] = np.asarray(opts["seqused_k"], dtype=np.int32)
    return opts


@pytest.mark.parametrize("label", list(PADDED_CASES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
def test_padded_batch_variants(requires_gpu, label, d, dtname):
    rng = np.random.default_rng(abs(hash((label, d))) % 2**32)
    q, k, v, do = _inputs(rng, (2, 300, 4, d), (2, 333, 2, d), DTYPES[dtname])
    check_variant(requires_gpu, q, k, v, do, **_resolve(PADDED_CASES[label], rng, 2, 4))


@pytest.mark.parametrize("d", [32, 96, 256])
@pytest.mark.parametrize("label", ["causal-window", "softcap-causal", "alibi-batch", "seqused", "bias-broadcast-causal",
                                   "dropout"])
def test_other_head_dims(requires_gpu, d, label):
    """Head dims without a wgmma row of their own (32 and 96 run padded onto 64's and 128's from the TMA entry points;
    256's backward the wgmma kernel with both warpgroups on 64 keys [bwd shared keys]), and at
    256 the float32 backward on upcast inputs."""
    rng = np.random.default_rng(d)
    q, k, v, do = _inputs(rng, (2, 150, 4, d), (2, 333, 2, d), DTYPES["bfloat16"])
    check_variant(requires_gpu, q, k, v, do, **_resolve(PADDED_CASES[label], rng, 2, 4, 150))


@pytest.mark.parametrize(("d", "dv"), [(1, 1), (16, 16), (40, 40), (59, 59), (80, 80), (111, 111), (160, 160),
                                       (192, 128), (224, 224), (3, 17), (64, 256)])
@pytest.mark.parametrize("dtname", ["bfloat16", "float32"])
def test_any_head_dim(requires_gpu, d, dv, dtname):
    """Head dims between the instantiated ones, and v's head dim apart from q's and k's (DeepSeek's 192 / 128),
    with GQA, causal and a window, forward and backward (both backward orders)."""
    rng = np.random.default_rng(d * 1000 + dv)
    dtype = DTYPES.get(dtname, np.dtype(dtname))
    q, k, _, _ = _inputs(rng, (2, 130, 4, d), (2, 150, 2, d), dtype)
    v = rng.standard_normal((2, 150, 2, dv)).astype(dtype)
    do = rng.standard_normal((2, 130, 4, dv)).astype(dtype)
    out, _, grads = check_variant(requires_gpu, q, k, v, do, causal=True, window_size=(90, -1))
    assert out.shape == (2, 130, 4, dv) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    check_variant(requires_gpu, q, k, v, do, deterministic=True)


@pytest.mark.parametrize(("d", "dv", "label"), [(80, 80, "causal-window"), (40, 40, "dropout"), (200, 200, "softcap-causal"),
                                                (112, 112, "alibi-batch"), (192, 128, "bias-broadcast-causal"),
                                                (24, 64, "seqused")])
def test_head_dims_read_in_place(requires_gpu, d, dv, label):
    """[variant head dim] Head dims that are multiples of 8 below the kernel's, read in place from views of wider
    arrays whose extra columns hold NaN (a load or store past the view's columns shows)."""
    rng = np.random.default_rng(d * 7 + dv)
    dtype = DTYPES["bfloat16"]
    q, k, _, _ = _inputs(rng, (2, 150, 4, d), (2, 333, 2, d), dtype)
    v = rng.standard_normal((2, 333, 2, dv)).astype(dtype)
    do = rng.standard_normal((2, 150, 4, dv)).astype(dtype)
    out, _, _ = check_variant(requires_gpu, q, k, v, do, views=True, **_resolve(PADDED_CASES[label], rng, 2, 4, 150))
    assert out.shape == (2, 150, 4, dv)


@pytest.mark.parametrize("label", ["causal-window", "softcap-causal", "alibi-causal", "seqused-causal-softcap-alibi",
                                   "bias-mask-softcap-window-alibi", "dropout", "dropout-causal-bias-softcap",
                                   "score-mod-tanh-causal", "mask-mod-document", "mods-bias-dropout-window"])
def test_deterministic_order_and_float32(requires_gpu, label):
    rng = np.random.default_rng(7)
    opts = _resolve(PADDED_CASES[label], rng, 2, 4)
    q, k, v, do = _inputs(rng, (2, 300, 4, 64), (2, 333, 2, 64), DTYPES["bfloat16"])
    check_variant(requires_gpu, q, k, v, do, deterministic=True, **opts)
    opts = _resolve(PADDED_CASES[label], rng, 2, 4, 100)
    q, k, v, do = _inputs(rng, (2, 100, 4, 64), (2, 333, 2, 64), np.float32)
    check_variant(requires_gpu, q, k, v, do, **opts)
    check_variant(requires_gpu, q, k, v, do, deterministic=True, **opts)


# [variant bias tile] Biases in their own dtype (issue 11): (label, (bias dtype or None for q's, bias shape of
# (batch, heads, nq, nk) with None for the full axis, options, GPU-only options)). On (B, Nq, Nk, Hq, Hkv) =
# (2, 300, 336, 4, 2) unless "nk" says: 336 keys of 16 bits are 16-byte rows, staged by the wgmma kernels, ragged
# last tiles of 128 queries and 128 (d 128) or 64 keys; 333 keys are not, and are read from global memory.
BIAS_CASES = {
    "own-dtype-staged": dict(bias_layout="padded"),
    "own-dtype-ragged-333": dict(nk=333),
    "own-dtype-unaligned-view": dict(bias_layout="unaligned"),
    "float32-bias": dict(bias_dtype=np.float32, bias_layout="padded"),
    "broadcast-batch": dict(shape=(1, None, None, None)),
    "broadcast-2d-causal": dict(shape=(None, None), causal=True),
    "with-mask": dict(attn_mask="per-batch"),
    "causal-softcap-alibi-window": dict(causal=True, softcap=5.0, alibi_slopes="heads", window_size=(200, 40)),
    "seqused": dict(seqused_k=[336, 201]),
    "deterministic": dict(deterministic=True),
    "mma-sync-kernels": dict(kernel_opts=dict(block_q=64, block_k=64)),
}


@pytest.mark.parametrize("label", list(BIAS_CASES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
def test_bias_in_its_own_dtype(requires_gpu, label, d, dtname):
    """A float16 / bfloat16 bias (or float32) read by the kernels in its own dtype, staged in shared memory or read
    from global memory, full or broadcast, with ragged tiles, a mask, other variants, both backward orders and the
    mma.sync kernels; dbias in the bias's dtype, against the float64 truth's budget."""
    case = dict(BIAS_CASES[label])
    rng = np.random.default_rng([d, *label.encode(), *dtname.encode()])  # (fixed: str hashes vary by process)
    nq, nk = 300, case.pop("nk", 336)
    dtype = DTYPES[dtname]
    q, k, v, do = _inputs(rng, (2, nq, 4, d), (2, nk, 2, d), dtype)
    shape = [n if m is None else m for n, m in zip((2, 4, nq, nk)[-len(case.get("shape", (0,) * 4)):],
                                                  case.pop("shape", (None,) * 4))]
    opts = dict(bias=rng.standard_normal(shape).astype(case.pop("bias_dtype", dtype)))
    if case.pop("attn_mask", None) == "per-batch":  # a batch entry's padding keys, and a row that sees none
        mask = np.ones((2, 1, nq, nk), bool)
        mask[1, :, :, 250:] = False
        mask[0, :, 7] = False
        opts["attn_mask"] = mask
    opts.update(_resolve({key: case.pop(key) for key in ("alibi_slopes",) if key in case}, rng, 2, 4, nq, nk))
    if "seqused_k" in case:
        opts["seqused_k"] = np.asarray(case.pop("seqused_k"), np.int32)
    check_variant(requires_gpu, q, k, v, do, **case, **opts)


VARLEN_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-window-softcap": dict(causal=True, window_size=(50, 0), softcap=10.0),
    "alibi": dict(alibi_slopes="heads"),
    "seqused-causal": dict(seqused_k=[150, 0, 100, 1], causal=True),
    "dropout-causal-window": dict(dropout_p=0.25, dropout_seed=3, causal=True, window_size=(70, 0)),
}


@pytest.mark.parametrize("label", list(VARLEN_CASES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("d", [64, 128])
def test_packed_variable_length(requires_gpu, label, dtype, d):
    """Four sequences of uneven lengths (one with no key), GQA, one launch; dK/dV of padding keys are 0."""
    rng = np.random.default_rng(len(label) + d)
    lens_q, lens_k = [100, 257, 1, 130], [150, 300, 100, 129]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v, do = _inputs(rng, (cu_q[-1], 4, d), (cu_k[-1], 2, d), DTYPES.get(dtype, np.dtype(dtype)))
    opts = _resolve(VARLEN_CASES[label], rng, 4, 4)
    check_variant(requires_gpu, q, k, v, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                  max_seqlen_k=max(lens_k), **opts)


def test_varlen_equals_per_sequence_calls(requires_gpu):
    """One packed call gives, sequence by sequence, what separate calls give (same kernels, same tiles)."""
    cp = requires_gpu
    rng = np.random.default_rng(11)
    lens = [64, 200, 1, 333]
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    q, k, v = (cp.asarray(rng.standard_normal((sum(lens), 4, 128)).astype(DTYPES["bfloat16"])) for _ in range(3))
    out = cuflash.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=333,
                            max_seqlen_k=333)
    start = 0
    for n in lens:
        one = cuflash.attention(q[None, start:start + n], k[None, start:start + n], v[None, start:start + n],
                                causal=True)
        assert bool((one[0].view(cp.uint16) == out[start:start + n].view(cp.uint16)).all()), n
        start += n


@pytest.mark.parametrize(("mask", "causal", "window"), [
    ("doc[q_idx] == doc[kv_idx]", True, None),
    ("kv_idx <= q_idx || kv_idx < 70", False, None),
    ("(q_idx / 64 + kv_idx / 64 + h) % 3 == 0", False, (100, 20)),
])
def test_block_lists_are_the_visible_tiles(requires_gpu, mask, causal, window):
    """The launcher's block lists (block_map.cu: lengths, band and mask_mod score by score) list, ascending
    and for both loop orders, exactly the tiles that hold a visible score of a dense evaluation, flagged full
    (kFullTile) exactly where mask_mod keeps every score that the lengths and the band leave visible."""
    cp = requires_gpu
    from cuflash._cuda.attention import Shape, block_lists
    from cuflash._ops.mods import user_mods
    from cuflash._ops.variant import Variant

    rng = np.random.default_rng(len(mask))
    nq, nk, heads = 300, 333, 3
    doc = np.sort(rng.integers(0, 6, nk)).astype(np.int32)
    arrays = {"doc": doc} if "doc[" in mask else {}
    mods = user_mods(None, mask, arrays)
    variant = Variant(causal=causal, window_left=None if window is None else window[0],
                      window_right=None if window is None else window[1], mods=mods,
                      mod_arrays=tuple(cp.asarray(a) for a in arrays.values()) or None)
    shp = Shape(2, nq, nk, heads, heads, 64, nq, nk, 2)
    i, j = np.arange(nq).reshape(-1, 1), np.arange(nk).reshape(1, -1)
    h = np.arange(heads).reshape(-1, 1, 1)
    by_mask = np.broadcast_to(mods.mask(0, h, i, j, arrays), (heads, nq, nk))
    offset = nk - nq
    by_band = np.ones((nq, nk), bool)
    if causal:
        by_band &= j <= i + offset
    if window is not None:
        by_band &= (j >= i + offset - window[0]) & (j <= i + offset + window[1])

    def tiles_of(visible, bm_, bn_):
        nqt, nkt = -(-nq // bm_), -(-nk // bn_)
        pad = np.zeros((heads, nqt * bm_, nkt * bn_), bool)
        pad[:, :nq, :nk] = visible
        return pad.reshape(heads, nqt, bm_, nkt, bn_).any(axis=(2, 4))

    full_flag = 1 << 30  # kFullTile (variants.cuh)
    seen_full = seen_partial = 0
    for bm_, bn_ in ((128, 64), (64, 128)):
        need = tiles_of(by_mask & by_band, bm_, bn_)
        partial = tiles_of(~by_mask & by_band, bm_, bn_)
        for transposed in (False, True):
            count, lists = (cp.asnumpy(x) for x in block_lists(variant, shp, bm_, bn_, transposed))
            t_need = need.swapaxes(-1, -2) if transposed else need
            t_partial = partial.swapaxes(-1, -2) if transposed else partial
            for b in range(count.shape[0]):
                for hh in range(heads):
                    hm = hh if count.shape[1] > 1 else 0
                    for r in range(t_need.shape[1]):
                        got = lists[b, hm, r, :count[b, hm, r]]
                        where = (bm_, bn_, transposed, b, hh, r, list(got))
                        assert list(got & ~full_flag) == list(np.flatnonzero(t_need[hh, r])), where
                        want_full = ~t_partial[hh, r, got & ~full_flag]
                        assert list((got & full_flag) != 0) == list(want_full), where
                        seen_full += int(want_full.sum())
                        seen_partial += int((~want_full).sum())
    # (documents of ~55 keys hold no full tile of 64 x 128 or 128 x 64; the prefix mask holds both kinds)
    assert seen_partial and (seen_full or "doc[" in mask), "the listed tiles hold both kinds"


def test_a_mod_that_nvrtc_refuses_names_the_expression(requires_gpu, monkeypatch):
    """Should NVRTC refuse a generated user mod (the parser lets through only its grammar, so this stands in
    for a compiler limit), the error quotes the user's expression and NVRTC's message."""
    cp = requires_gpu
    from cuflash._cuda import spec as spec_module
    from cuflash._ops.mods import user_mods

    expr = "score + 0.123456789f * q_idx"
    mods = user_mods(expr, None)
    broken = mods.source.replace("return ", "return undeclared_name + ", 1)
    monkeypatch.setitem(spec_module.PRELUDES, mods.type_name, broken)
    q = cp.ones((1, 32, 2, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="score_mod / mask_mod did not compile with NVRTC") as info:
        cuflash.attention(q, q, q, score_mod=expr)
    assert expr in str(info.value) and "undeclared_name" in str(info.value)
