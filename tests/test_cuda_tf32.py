"""The float32 forward on the tensor cores (flash_fwd_kernel on TF32 fragments, ``fp32_precision``) against the
float64 truth, through the public API.

``"tf32x3"`` (the default) and ``"ieee"`` (the SIMT kernel) are held to float32's error budget (STYLE.md): outputs
within 2x the error of naive attention computed in float32, plus the floor of rounding the truth to float32.
``"tf32"`` (one TF32 product) is held to its stated budget: 2x the error of naive attention whose matrix-product
operands (q and k; P and v) are rounded to TF32, plus the same floor. Outputs come from a NaN-poisoned pool, so an
element the kernel never wrote fails. Skips without CuPy and a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash

from _gpu_helpers import poison
from _helpers import assert_within_budget, float64_truth, max_abs_error, random_inputs, rounding_floor
from test_cuda_variants import PADDED_CASES, _resolve

pytestmark = pytest.mark.gpu

PRECISE = ["tf32x3", "ieee"]


def _forward(cp, q, k, v, *, fp32_precision, views=False, **opts):
    """cuflash.attention on the device (poisoned outputs): (out, lse) on the host. ``views``: q, k, v as views that
    start one float into a wider allocation (not 16-byte aligned: the launcher copies them)."""
    def dev(val):
        if isinstance(val, dict):
            return {name: cp.asarray(a) for name, a in val.items()}
        return cp.asarray(val) if isinstance(val, np.ndarray) else val

    def shifted(x):
        flat = cp.empty(x.size + 1, dtype=x.dtype)
        flat[1:] = cp.asarray(x).ravel()
        return flat[1:].reshape(x.shape)

    cq, ck, cv = (shifted(x) if views else cp.asarray(x) for x in (q, k, v))
    poison(cp)
    out, lse = cuflash.attention(cq, ck, cv, return_lse=True, fp32_precision=fp32_precision,
                                 **{key: dev(val) for key, val in opts.items()})
    return cp.asnumpy(out), cp.asnumpy(lse)


def check_float32(cp, q, k, v, *, fp32_precision="tf32x3", views=False, **opts):
    """The forward within float32's budget (the float64 truth and naive float32 attention: the NumPy oracle)."""
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    opts64 = dict(opts, **({"bias": opts["bias"].astype(np.float64)} if "bias" in opts else {}))
    out_t, lse_t = cuflash.attention(q64, k64, v64, algorithm="naive", return_lse=True, **opts64)
    out_n, _ = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **opts)
    out, lse = _forward(cp, q, k, v, fp32_precision=fp32_precision, views=views, **opts)
    assert out.dtype == np.float32 and not np.isnan(out).any(), "forward left unwritten (NaN) elements"
    # The floor: storing the truth in float32, or one float32 spacing at the output's magnitude, whichever is more.
    # The second is flash-attention's floor ((out + 0.3 - 0.3) - out); it counts here where the truth is a float32
    # value itself (one visible key: out = v), which naive float32 attention returns exactly but 3xTF32 cannot (the
    # split carries 22 of float32's 24 significant bits of V: one spacing off, measured on the H100).
    floor = max(rounding_floor(out_t, np.float32), float(np.spacing(np.float32(np.abs(out_t).max()))))
    assert_within_budget(out, out_t, out_n, 2, floor, f"{fp32_precision} out")
    lse_err = max_abs_error(lse, lse_t)
    assert lse_err < 5e-5, f"lse: max|err| = {lse_err:.3e}"
    return out, lse


@pytest.mark.parametrize("fp32_precision", PRECISE)
@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
def test_awkward_lengths_every_head_dim(requires_gpu, fp32_precision, d, causal):
    q, k, v, _ = random_inputs(2, 113, 203, 4, 2, d, np.float32, seed=d, with_do=False)
    opts = {} if causal is None else dict(causal=True, causal_align="bottom-right" if causal == "br" else "top-left")
    check_float32(requires_gpu, q, k, v, fp32_precision=fp32_precision, **opts)


@pytest.mark.parametrize("shape", [(1, 1, 257, 2, 2), (1, 257, 1, 2, 1), (1, 1023, 1024, 2, 2), (2, 203, 113, 8, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_shapes_and_gqa(requires_gpu, shape, d, causal):
    q, k, v, _ = random_inputs(*shape, d, np.float32, seed=shape[1], with_do=False)
    check_float32(requires_gpu, q, k, v, causal=causal)


@pytest.mark.parametrize("label", list(PADDED_CASES))
@pytest.mark.parametrize("d", [64, 128])
def test_padded_batch_variants(requires_gpu, label, d):
    """Every variant of the 16-bit kernels' list (windows, softcap, ALiBi, seqused_k, bias and masks, dropout, user
    mods) through the same hooks, in float32's budget."""
    rng = np.random.default_rng(abs(hash((label, d, "tf32"))) % 2**32)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 300, 4, d), (2, 333, 2, d), (2, 333, 2, d)))
    check_float32(requires_gpu, q, k, v, **_resolve(PADDED_CASES[label], rng, 2, 4))


@pytest.mark.parametrize("label", ["plain", "causal", "causal-window-softcap", "dropout"])
@pytest.mark.parametrize("d", [64, 128])
def test_packed_variable_length(requires_gpu, label, d):
    """Four sequences of uneven lengths (one query row; one sequence of 1 key), GQA, one launch."""
    rng = np.random.default_rng(len(label) + d)
    lens_q, lens_k = [100, 257, 1, 130], [150, 300, 100, 1]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 4, d)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 2, d)).astype(np.float32) for _ in range(2))
    opts = {"plain": {}, "causal": dict(causal=True), "causal-window-softcap": dict(causal=True, window_size=(50, 0),
            softcap=10.0), "dropout": dict(dropout_p=0.25, dropout_seed=3)}[label]
    check_float32(requires_gpu, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                  max_seqlen_k=max(lens_k), **opts)


def test_unaligned_views_and_bhnd_layout(requires_gpu):
    """Inputs whose base is not 16-byte aligned run on aligned copies; (B, H, N, d) arrays seen as (B, N, H, d)
    (non-contiguous, 16-byte strides) are read in place."""
    cp = requires_gpu
    q, k, v, _ = random_inputs(2, 300, 300, 8, 2, 128, np.float32, seed=4, with_do=False)
    check_float32(cp, q, k, v, causal=True, views=True)
    out_t, _ = float64_truth(q, k, v, scale=128 ** -0.5)
    bhnd = [cp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3) for x in (q, k, v)]
    out = cp.asnumpy(cuflash.attention(*bhnd))
    contiguous = cp.asnumpy(cuflash.attention(*(cp.asarray(x) for x in (q, k, v))))
    assert np.array_equal(out, contiguous) and max_abs_error(out, out_t) < 1e-5


def test_rows_that_see_no_key(requires_gpu):
    cp = requires_gpu
    q, k, v, _ = random_inputs(1, 200, 50, 2, 1, 64, np.float32, seed=3, with_do=False)
    out, lse = _forward(cp, q, k, v, fp32_precision="tf32x3", causal=True)  # rows i < 150 see no key
    assert np.abs(out[:, :150]).max() == 0.0 and np.all(lse[:, :, :150] == -np.inf)
    assert not np.isnan(out).any()


def test_backward_after_the_tf32x3_forward(requires_gpu):
    """The backward (SIMT float32 kernels) on the tensor-core forward's out and lse: gradients in float32's budget."""
    cp = requires_gpu
    q, k, v, do = random_inputs(2, 150, 203, 4, 2, 128, np.float32, seed=9)
    scale = 128 ** -0.5
    from cuflash._ops.variant import Variant

    _, _, grads_t = float64_truth(q, k, v, do, scale=scale, variant=Variant(causal=True))
    out_n, lse_n = cuflash.attention(q, k, v, causal=True, algorithm="naive", return_lse=True)
    grads_n = cuflash.attention_backward(do, q, k, v, out_n, lse_n, causal=True, algorithm="naive")
    cq, ck, cv, cdo = (cp.asarray(x) for x in (q, k, v, do))
    out, lse = cuflash.attention(cq, ck, cv, causal=True, return_lse=True)
    grads = cuflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=True)
    for name, g, gt, gn in zip(("dq", "dk", "dv"), grads, grads_t, grads_n):
        assert_within_budget(cp.asnumpy(g), gt, gn, 3, rounding_floor(gt, np.float32) + 1e-4, name)


# -- fp32_precision="tf32": one TF32 product, its stated budget


def _tf32(x):
    """x rounded to TF32 (10 explicit mantissa bits; to nearest, ties away from zero: cvt.rna), as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def naive_tf32(q, k, v, *, scale, causal):
    """Naive attention (float64 arithmetic) whose matrix-product operands are rounded to TF32 as the kernel rounds
    them: q and k for the scores, P = exp(s - max) (before the division by the row sum) and v for the output.
    Bottom-right causal alignment; GQA."""
    group = q.shape[2] // k.shape[2]
    kk, vv = (np.repeat(x, group, axis=2) for x in (k, v))
    s = np.einsum("bihd,bjhd->bhij", _tf32(q), _tf32(kk)) * scale
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return np.einsum("bhij,bjhd->bihd", _tf32(p), _tf32(vv)) / p.sum(-1)[..., None].transpose(0, 2, 1, 3)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_tf32_within_its_stated_budget(requires_gpu, d, causal):
    cp = requires_gpu
    q, k, v, out, out_t = _check_tf32(cp, d, causal, factor=2, seed=d, name="tf32 out")
    # and it is TF32: further from the truth than the 3xTF32 forward
    out3, _ = _forward(cp, q, k, v, fp32_precision="tf32x3", causal=causal)
    assert max_abs_error(out3, out_t) < max_abs_error(out, out_t)


def _check_tf32(cp, d, causal, *, factor, seed, name):
    """One TF32 product's forward on random inputs (batch 2, 300 x 333, GQA 4 / 2) within ``factor`` x the error of
    naive attention on TF32-rounded operands, lse within 1e-2: ``(q, k, v, out, truth)``."""
    from cuflash._ops.variant import Variant

    q, k, v, _ = random_inputs(2, 300, 333, 4, 2, d, np.float32, seed=seed, with_do=False)
    scale = d ** -0.5
    out_t, lse_t = float64_truth(q, k, v, scale=scale, variant=Variant(causal=causal))
    out, lse = _forward(cp, q, k, v, fp32_precision="tf32", causal=causal)
    assert not np.isnan(out).any()
    budget_ref = naive_tf32(q, k, v, scale=scale, causal=causal)
    assert_within_budget(out, out_t, budget_ref, factor, rounding_floor(out_t, np.float32), name)
    assert max_abs_error(lse, lse_t) < 1e-2
    return q, k, v, out, out_t


def test_tf32_variants(requires_gpu):
    """A window, softcap, ALiBi and dropout on one TF32 product: within 1e-2 of the truth (the variants' hooks are
    tf32x3's; the budget test above states the accuracy)."""
    cp = requires_gpu
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 300, 4, 128), (2, 333, 2, 128), (2, 333, 2, 128)))
    opts = _resolve(dict(window_size=(60, 20), softcap=5.0, alibi_slopes="heads", dropout_p=0.1, dropout_seed=4),
                    rng, 2, 4)
    out_t = cuflash.attention(*(x.astype(np.float64) for x in (q, k, v)), algorithm="naive", **opts)
    out, _ = _forward(cp, q, k, v, fp32_precision="tf32", **opts)
    assert max_abs_error(out, out_t) < 1e-2


def test_float32_kernels_by_precision(requires_gpu):
    """Which kernel a float32 call runs: TF32 fragments (3xTF32 or one product) on sm_80+ up to head dim 128, the
    SIMT kernel for "ieee" and above 128."""
    from cuflash._cuda.attention import _f32_forward_spec
    from cuflash._cuda.compile import device_info
    from cuflash._cuda.spec import DENSE

    tensor_cores = device_info()[0] >= 80
    for d, precision, family in [(128, "tf32x3", "fwd_tf32x3"), (64, "tf32", "fwd_tf32"), (128, "ieee", "fwd_f32"),
                                 (256, "tf32x3", "fwd_f32")]:
        spec = _f32_forward_spec(d, DENSE, precision, None, None)
        assert spec.family == (family if tensor_cores else "fwd_f32"), (d, precision)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_tf32_on_wgmma_within_its_budget(requires_gpu, monkeypatch, d, causal):
    """[tf32] (attention.TF32_WGMMA, sm_90): one TF32 product on wgmma from the V^T entry point. q, k ([tf32 qk]), P
    and V are rounded to TF32 as the mma.sync kernel rounds them (wgmma alone would truncate q and k): within the same
    2x the error of naive attention on TF32-rounded operands, lse within 1e-2."""
    cp = requires_gpu
    from cuflash._cuda import attention, vt
    from cuflash._ops.variant import Variant

    if not vt.supported():
        pytest.skip("the V^T entry point needs sm_90")
    monkeypatch.setattr(attention, "TF32_WGMMA", True)
    q, k, v, _, _ = _check_tf32(cp, d, causal, factor=2, seed=d + 7, name="tf32 (wgmma) out")
    plan = vt.plan(cp.asarray(q), cp.asarray(k), cp.asarray(v), d ** -0.5, Variant(causal=causal), "float32")
    assert plan.dtype == np.float32  # (the plan this call ran: its family is the [tf32] one)


@pytest.mark.parametrize("d", [64, 128])
def test_round_kernel_matches_its_definition(requires_gpu, d):
    """[tf32 qk] round_tf32_kernel's copy (what the [tf32] plans run on q and k) is the strided input rounded to TF32
    (to nearest, ties away: + 2^12 in the bits, the low 13 cleared), C-contiguous; on heads of a wider array, ties and
    values that round up into the next binade included."""
    cp = requires_gpu
    from cuflash._cuda.attention import cdiv, i32
    from cuflash._cuda.compile import launch
    from cuflash._cuda.spec import spec as kernel_spec

    rng = np.random.default_rng(d)
    bits = rng.integers(0, 2 ** 32, (2, 77, 5, d), dtype=np.uint64).astype(np.uint32)
    bits &= ~np.uint32(0x7F800000) | np.uint32(0x3F000000)  # (finite values)
    bits[0, 0, :, :4] = [0x3F801000, 0x3F802000, 0x3FFFF000, 0xBF801000]  # (ties either way, a carry, a negative tie)
    wide = cp.asarray(bits.view(np.float32))
    x = wide[:, :, 1:4]
    y = cp.full((2, 77, 3, d), np.nan, dtype=cp.float32)
    launch(kernel_spec("round_tf32", "float32", d), (cdiv(77 * 3 * d // 4, 256), 2, 1),
           (x, y, i32(77), i32(3), *(np.int64(s) for s in x.strides[:3])))
    want = (np.ascontiguousarray(bits[:, :, 1:4]) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    assert np.array_equal(cp.asnumpy(y).view(np.uint32), want)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("magnitude", [1.0, 3e4, 2e-3])
def test_f16x2_split_kernels_match_their_definition(requires_gpu, d, magnitude):
    """[f16x2] absmax_f32_kernel's largest magnitude and split_f16x2_kernel's pairs of fp16 parts (what the plans run
    on q, k and v) are .vt.split_f16x2's (x * 2^e rounded to fp16, the rest times lo_scale rounded; e from the
    largest magnitude), bit for bit, on heads of a wider array, at magnitudes from 2e-3 to 3e4."""
    cp = requires_gpu
    from cuflash._cuda import vt
    from cuflash._cuda.attention import cdiv, i32
    from cuflash._cuda.compile import launch
    from cuflash._cuda.spec import spec as kernel_spec

    rng = np.random.default_rng(d)
    wide = cp.asarray((rng.standard_normal((2, 77, 5, d)) * magnitude).astype(np.float32))
    x = wide[:, :, 1:4]
    for lo_scale in (2048.0, 1.0):
        bits = cp.zeros(1, dtype=cp.uint32)
        y = cp.full((2, 77, 3, d), np.nan, dtype=cp.float32)
        shape_args = (i32(77), i32(3), *(np.int64(s) for s in x.strides[:3]))
        launch(kernel_spec("absmax_f32", "float32", d), (3, 2, 1), (x, bits, *shape_args))
        launch(kernel_spec("split_f16x2", "float32", d), (cdiv(77 * 3 * d // 4, 256), 2, 1),
               (x, y, bits, np.float32(lo_scale), *shape_args))
        want, e = vt.split_f16x2(x, lo_scale)
        assert int(bits.get()[0]) == int(np.float32(float(cp.abs(x).max())).view(np.uint32))
        assert np.array_equal(cp.asnumpy(y).view(np.uint32), cp.asnumpy(want).view(np.uint32)), (lo_scale, e)


def check_fp16x3(cp, q, k, v, **opts):
    """fp32_precision="fp16x3" within its stated budget: 4x the error of naive float32 attention, plus the floor of
    two float32 spacings at the output's magnitude (a row of one key returns v, which naive float32 attention returns
    exactly and fp16x3 to 22-23 of float32's 24 bits); lse within 1e-4."""
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out_t, lse_t = cuflash.attention(q64, k64, v64, algorithm="naive", return_lse=True, **opts)
    out_n, _ = cuflash.attention(q, k, v, algorithm="naive", return_lse=True, **opts)
    out, lse = _forward(cp, q, k, v, fp32_precision="fp16x3", **opts)
    assert out.dtype == np.float32 and not np.isnan(out).any(), "forward left unwritten (NaN) elements"
    floor = max(rounding_floor(out_t, np.float32), 2 * float(np.spacing(np.float32(np.abs(out_t).max()))))
    assert_within_budget(out, out_t, out_n, 4, floor, "fp16x3 out")
    lse_err = max_abs_error(lse, lse_t)
    assert lse_err < 1e-4, f"lse: max|err| = {lse_err:.3e}"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scales", [(1.0, 1.0, 1.0), (1e3, 1e-3, 30.0), (1e-3, 1e-3, 1e-3)])
@pytest.mark.parametrize("shape", [(2, 333, 517, 4, 2), (1, 1023, 1024, 2, 1), (1, 257, 1, 2, 2)])
def test_fp16x3_on_wgmma_within_its_budget(requires_gpu, monkeypatch, d, causal, scales, shape):
    """[f16x2] (fp32_precision="fp16x3", attention.F16X2_WGMMA, sm_90): float32 inputs split in fp16 parts, three
    fp16 products on wgmma from the V^T entry point, within fp16x3's budget (check_fp16x3), over GQA, lengths that end
    inside a tile, a row of one key, and q, k and v scaled apart (the split's powers of two: q by 1e3 and k by 1e-3
    leave the scores as they are). The plan that ran is the [f16x2] one."""
    cp = requires_gpu
    from cuflash._cuda import attention, vt
    from cuflash._ops.variant import Variant

    if not vt.supported():
        pytest.skip("the V^T entry point needs sm_90")
    monkeypatch.setattr(attention, "F16X2_WGMMA", True)
    q, k, v, _ = random_inputs(*shape, d, np.float32, seed=d + int(causal), with_do=False)
    q, k, v = (x * np.float32(f) for x, f in zip((q, k, v), scales))
    check_fp16x3(cp, q, k, v, causal=causal)
    cq, ck, cv = (cp.asarray(x) for x in (q, k, v))
    assert attention._sm90_float32(cq, ck, cv, Variant(causal=causal), "fp16x3", None, None) == "f16x2"
    assert vt.plan(cq, ck, cv, d ** -0.5, Variant(causal=causal), "f16x2")._split


@pytest.mark.parametrize("opts", [dict(causal=True, window_size=(100, 0)), dict(softcap=30.0),
                                  dict(causal=True, alibi_slopes="alibi")])
def test_fp16x3_variants(requires_gpu, monkeypatch, opts):
    """[f16x2] with a window, softcap (the scores' factors applied before the mod; tanhf, as the float32 kernels) and
    ALiBi slopes: fp16x3's budget."""
    cp = requires_gpu
    from cuflash._cuda import attention, vt

    if not vt.supported():
        pytest.skip("the V^T entry point needs sm_90")
    monkeypatch.setattr(attention, "F16X2_WGMMA", True)
    q, k, v, _ = random_inputs(2, 300, 300, 4, 2, 128, np.float32, seed=11, with_do=False)
    if opts.get("alibi_slopes") == "alibi":
        opts = dict(opts, alibi_slopes=np.linspace(0.05, 0.4, 4).astype(np.float32))
    check_fp16x3(cp, q, k, v, **opts)


def test_fp16x3_elsewhere_runs_the_3xtf32_kernel(requires_gpu, monkeypatch):
    """fp32_precision="fp16x3" where [f16x2] does not run (F16X2_WGMMA off here; head dims other than 64 and 128, other
    GPUs) runs the 3xTF32 kernel: float32's budget, the same output as "tf32x3"."""
    cp = requires_gpu
    from cuflash._cuda import attention

    monkeypatch.setattr(attention, "F16X2_WGMMA", False)
    q, k, v, _ = random_inputs(1, 200, 300, 2, 2, 96, np.float32, seed=3, with_do=False)
    out, _ = check_float32(cp, q, k, v, fp32_precision="fp16x3", causal=True)
    ref, _ = _forward(cp, q, k, v, fp32_precision="tf32x3", causal=True)
    assert np.array_equal(out, ref)
