"""FP8 (e4m3) attention: the reference's FP8 forward against the float64 truth on the real (descaled) inputs, the
front door's checks, and on an sm_90 GPU the FP8 kernel against both.

Error budget of an FP8 forward (docs/variants.md, "FP8"): q, k and v are exact e4m3 values, so the truth is that of
their real values (times the descale factors); the forward rounds P to e4m3 (3-bit mantissa: relative error at
most 2^-4 per probability) before P V and O to bfloat16, so |O - truth| <= 2^-4 max|V| + 2^-8 |truth| per row.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._ops.variant import Variant

from _helpers import float64_truth

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _inputs(batch, n_q, n_k, heads_q, heads_kv, d, seed, scales=True):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, n_q, heads_q, d)).astype(E4M3)
    k = rng.standard_normal((batch, n_k, heads_kv, d)).astype(E4M3)
    v = (rng.standard_normal((batch, n_k, heads_kv, d)) * 2).astype(E4M3)
    descales = tuple(rng.uniform(0.25, 2.0, (batch, heads_kv)).astype(np.float32) for _ in range(3)) if scales \
        else (None, None, None)
    return q, k, v, descales


def _truth(q, k, v, descales, *, causal=False, window=(-1, -1), softcap=0.0):
    """float64 attention of the real inputs (the naive reference in float64), the lse's error budget and V's real
    values (each key/value head repeated for its query heads)."""
    group = q.shape[2] // k.shape[2]

    def real(a, f, g):
        x = a.astype(np.float64)
        return x if f is None else x * np.repeat(f.astype(np.float64), g, axis=1)[:, None, :, None]

    qr, kr, vr = real(q, descales[0], group), real(k, descales[1], 1), real(v, descales[2], 1)
    left, right = window
    variant = Variant(causal=causal, window_left=None if left < 0 else left, window_right=None if right < 0 else right,
                      softcap=softcap)
    out, lse = float64_truth(qr, kr, vr, scale=q.shape[-1] ** -0.5, variant=variant)
    kr, vr = (np.repeat(x, group, axis=2) for x in (kr, vr))
    # (the bound of the scaled scores' rounding by the tensor cores, whose FP8 products accumulate with about 13 bits
    # of mantissa, truncated, 32 products an instruction: 2^-10 of sum |q_i k_i|; the lse's error budget)
    score_error = 2.0 ** -10 * np.einsum("bqhd,bkhd->bhqk", np.abs(qr), np.abs(kr)).max() / np.sqrt(q.shape[-1])
    return out, (lse, score_error), vr


def _assert_budget(out, truth, v_real):
    err = np.abs(np.asarray(out, np.float64) - truth)
    budget = 2.0 ** -4 * np.abs(v_real).max() + 2.0 ** -8 * np.abs(truth)
    assert np.all(np.isfinite(np.asarray(out, np.float64)))
    assert np.all(err <= budget), f"max error {err.max():.4g}, budget there {budget.flat[err.argmax()]:.4g}"


@pytest.mark.parametrize("case", ["dense", "causal", "gqa-window-softcap"])
def test_reference_fp8_within_budget_of_truth(case):
    causal = case == "causal"
    window, softcap = ((24, 8), 20.0) if case.startswith("gqa") else ((-1, -1), 0.0)
    q, k, v, descales = _inputs(2, 70, 90, 4, 2 if case.startswith("gqa") else 4, 64, seed=len(case))
    out, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, q_descale=descales[0],
                                 k_descale=descales[1], v_descale=descales[2], return_lse=True)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16) and lse.dtype == np.float32
    truth, (lse_truth, _), v_real = _truth(q, k, v, descales, causal=causal, window=window, softcap=softcap)
    _assert_budget(out, truth, v_real)
    np.testing.assert_allclose(lse, lse_truth, atol=1e-4, rtol=1e-5)


def test_uint8_inputs_are_e4m3_bits():
    q, k, v, descales = _inputs(1, 20, 30, 2, 1, 32, seed=3)
    a = cuflash.attention(q, k, v, causal=True, v_descale=descales[2])
    b = cuflash.attention(q.view(np.uint8), k.view(np.uint8), v.view(np.uint8), causal=True, v_descale=descales[2])
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_reference_fp8_rounds_p_to_e4m3():
    """The reference's FP8 forward differs from a float32 forward of the same real inputs by P's rounding: not equal
    (a reference that forgot it would be), within the budget."""
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 32, seed=5, scales=False)
    out = cuflash.attention(q, k, v)
    plain = cuflash.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert not np.array_equal(np.asarray(out, np.float32), plain.astype(ml_dtypes.bfloat16).astype(np.float32))
    _assert_budget(out, plain.astype(np.float64), v.astype(np.float64))


def test_fp8_checks_name_the_argument():
    q, k, v, (qd, kd, vd) = _inputs(1, 16, 16, 2, 2, 32, seed=1)
    with pytest.raises(ValueError, match=r"k_descale must be a float32 array of shape \(batch, heads_kv\) = \(1, 2\)"):
        cuflash.attention(q, k, v, k_descale=kd[:, :1])
    with pytest.raises(ValueError, match="q_descale must be a float32 array"):
        cuflash.attention(q, k, v, q_descale=qd.astype(np.float64))
    with pytest.raises(TypeError, match="q must be float8_e4m3fn"):
        cuflash.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), q_descale=qd)
    with pytest.raises(TypeError, match="v must be float8_e4m3fn"):
        cuflash.attention(q, k, v.astype(np.float16))
    with pytest.raises(TypeError, match="must have the same dtype"):
        cuflash.attention(q, k.view(np.uint8), v)
    with pytest.raises(NotImplementedError, match="does not take dropout_p; got 0.1"):
        cuflash.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="does not take bias; got ndarray"):
        cuflash.attention(q, k, v, bias=np.zeros((1, 2, 16, 16), np.float32))
    with pytest.raises(NotImplementedError, match="algorithm='fa2' only"):
        cuflash.attention(q, k, v, algorithm="fa1")
    with pytest.raises(NotImplementedError, match="v's head_dim equal to q's"):
        cuflash.attention(q, k, np.concatenate([v, v], axis=-1))


# ---------------------------------------------------------------------------------------------------
# On the GPU (sm_90): the FP8 kernel.


def _cupy_sm90():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no GPU")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no GPU")
    from cuflash._cuda import vt

    if not vt.supported():
        pytest.skip("the FP8 kernel needs sm_90")
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("case", ["dense", "causal", "gqa-window-softcap", "short-uneven"])
def test_kernel_fp8_within_budget_and_near_reference(d, case):
    from _gpu_helpers import poison

    cp = _cupy_sm90()
    causal = case in ("causal", "short-uneven")
    window, softcap = ((300, 40), 30.0) if case.startswith("gqa") else ((-1, -1), 0.0)
    n_q, n_k = (77, 141) if case == "short-uneven" else (384, 520)
    q, k, v, descales = _inputs(2, n_q, n_k, 4, 2 if case.startswith("gqa") else 4, d, seed=d + len(case),
                                scales=case != "dense")
    dev = [cp.asarray(x.view(np.uint8)) for x in (q, k, v)]  # (CuPy has no e4m3 dtype: its bits)
    dd = [None if f is None else cp.asarray(f) for f in descales]
    poison(cp)
    out, lse = cuflash.attention(*dev, causal=causal, window_size=window, softcap=softcap, q_descale=dd[0],
                                 k_descale=dd[1], v_descale=dd[2], return_lse=True)
    out_h = cp.asnumpy(out.view(cp.uint16)).view(ml_dtypes.bfloat16)
    truth, (lse_truth, score_error), v_real = _truth(q, k, v, descales, causal=causal, window=window,
                                                     softcap=softcap)
    _assert_budget(out_h, truth, v_real)
    ref = cuflash.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, q_descale=descales[0],
                            k_descale=descales[1], v_descale=descales[2])
    # The same algorithm, but exp2's last bits differ (the kernel's ex2.approx), and a probability near a rounding
    # boundary of e4m3 (3-bit mantissa) then rounds the other way: near the reference, and as accurate on average.
    diff = np.abs(out_h.astype(np.float64) - ref.astype(np.float64))
    assert diff.max() <= 2.0 ** -5 * np.abs(v_real).max(), diff.max()
    assert np.mean(np.abs(out_h.astype(np.float64) - truth)) <= 1.5 * np.mean(np.abs(ref.astype(np.float64) - truth))
    np.testing.assert_allclose(cp.asnumpy(lse), lse_truth, atol=score_error + 1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float32"])
@pytest.mark.parametrize("n", [1, 77, 128, 300, 1000])
def test_transpose_kernel_matches_its_definition(n, dtype):
    """[fp8 v] transpose_v_kernel's V^T (what the plans run) equals vt.transposed_v's (CuPy operations), on a strided
    v (heads of a wider array), zeros past the keys included: e4m3 bits (groups of 16 keys) and float32 (groups of 8,
    the [tf32] path's)."""
    cp = _cupy_sm90()
    from cuflash._cuda import vt as vt_module
    from cuflash._cuda.attention import cdiv, i32
    from cuflash._cuda.compile import launch
    from cuflash._cuda.spec import TRANSPOSE_V_KEYS
    from cuflash._cuda.spec import spec as kernel_spec

    rng = np.random.default_rng(n)
    element = np.uint8 if dtype == "float8_e4m3fn" else np.float32
    for d in ((128, 256) if dtype == "float8_e4m3fn" else (64, 128)):
        wide = cp.asarray(rng.integers(0, 255, (2, n, 5, d)).astype(element))
        v = wide[:, :, 1:4]
        n16 = -(-n // 16) * 16
        vt = cp.full((2, 3, d, n16), 7, dtype=element)
        launch(kernel_spec("transpose_v", dtype, d), (cdiv(n16, TRANSPOSE_V_KEYS[dtype]), 3, 2),
               (v, vt, i32(n), i32(n16), i32(3), *(np.int64(s) for s in v.strides[:3])))
        np.testing.assert_array_equal(cp.asnumpy(vt), cp.asnumpy(vt_module.transposed_v(v, dtype)))


def test_torch_takes_fp8_tensors():
    """cuflash.torch.attention on torch.float8_e4m3fn tensors (CPU: the NumPy reference): equal to cuflash.attention
    on the same bits, bfloat16 out, no backward. (The flash-attention drop-in keeps flash-attention 2's signatures,
    which have no descale factors.)"""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    import cuflash.torch as ct

    q, k, v, descales = _inputs(2, 40, 50, 4, 2, 32, seed=9)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q, k, v))
    td = [torch.from_numpy(f) for f in descales]
    want, want_lse = cuflash.attention(q, k, v, causal=True, q_descale=descales[0], k_descale=descales[1],
                                       v_descale=descales[2], return_lse=True)
    out, lse = ct.attention(tq, tk, tv, causal=True, q_descale=td[0], k_descale=td[1], v_descale=td[2],
                            return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 40, 4, 32)
    np.testing.assert_array_equal(out.view(torch.int16).numpy(), want.view(np.int16))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    with pytest.raises(NotImplementedError, match="no backward"):
        ct.attention(tq.float().requires_grad_().to(torch.float8_e4m3fn), tk, tv)
    with pytest.raises(NotImplementedError, match="does not take dropout_p"):
        ct.attention(tq, tk, tv, dropout_p=0.5)


@pytest.mark.gpu
def test_torch_cuda_fp8_matches_cupy():
    """cuflash.torch.attention on CUDA float8_e4m3fn tensors: the FP8 kernel on torch's stream and memory, equal to
    the CuPy call on the same bits."""
    cp = _cupy_sm90()
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    q, k, v, descales = _inputs(2, 200, 260, 4, 2, 128, seed=13)
    dev = [cp.asarray(x.view(np.uint8)) for x in (q, k, v)]
    dd = [cp.asarray(f) for f in descales]
    want = cuflash.attention(*dev, causal=True, q_descale=dd[0], k_descale=dd[1], v_descale=dd[2])
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn) for x in (q, k, v))
    td = [torch.from_numpy(f).cuda() for f in descales]
    out = ct.attention(tq, tk, tv, causal=True, q_descale=td[0], k_descale=td[1], v_descale=td[2])
    assert out.dtype == torch.bfloat16 and out.is_cuda
    np.testing.assert_array_equal(out.view(torch.int16).cpu().numpy(), cp.asnumpy(want.view(cp.int16)))


def test_check_finite_finds_e4m3_nans_and_only_them():
    """e4m3 has no infinities and one NaN pattern (S.1111.111): check_finite names a NaN's index, in float8_e4m3fn and
    in uint8 bits, and takes 448 (S.1111.110, the largest finite value) as finite."""
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 32, seed=2, scales=False)
    q[0, 1, 0, 0] = E4M3.type(448.0)
    assert np.isfinite(np.asarray(cuflash.attention(q, k, v, check_finite=True), np.float32)).all()
    k[0, 3, 1, 5] = np.nan
    for a, b, c in ((q, k, v), (q.view(np.uint8), k.view(np.uint8), v.view(np.uint8))):
        with pytest.raises(ValueError, match=r"k must be finite; got nan at k\[0, 3, 1, 5\]"):
            cuflash.attention(a, b, c, check_finite=True)


def test_fp8_calls_like_checked_ones_run_their_plan(monkeypatch):
    """(CPU, stand-in CuPy) An FP8 call like one already checked (the same layouts, options and descale arrays' layout:
    _api._fp8_calls) runs its plan without the checks, with the new descale values stacked, its lse into the stream's
    sink when not returned, and check_finite still scans the values; a call that differs (descale factors of another shape, an option FP8 refuses) is checked, and
    refused, as the first."""
    from test_tensor_map import _tma_stand_in

    from cuflash._ops import api as _api, validate as _validate

    cp, recorder, _ = _tma_stand_in(monkeypatch)
    rng = np.random.default_rng(5)

    def e4m3(*shape):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))

    q, k, v = e4m3(2, 300, 4, 128), e4m3(2, 250, 2, 128), e4m3(2, 250, 2, 128)
    descales = [cp.asarray(rng.uniform(0.5, 2, (2, 2)).astype(np.float32)) for _ in range(3)]
    slopes = cp.asarray(rng.uniform(0, 1, 4).astype(np.float32))

    def call(**options):
        return cuflash.attention(q, k, v, causal=True, alibi_slopes=slopes, q_descale=descales[0],
                                 k_descale=descales[1], v_descale=descales[2], **options)

    call()
    assert len(_api._fp8_calls) == 1
    recorder.take()

    def unchecked(*args, **kwargs):
        raise AssertionError("a remembered FP8 call was checked again")

    monkeypatch.setattr(_validate, "check_qkv", unchecked)
    descales[0] = cp.asarray(np.full((2, 2), 3.0, np.float32))  # (new values, the same layout)
    out, lse = call(return_lse=True)
    assert out.shape == (2, 300, 4, 128) and lse.shape == (2, 4, 300)
    launches = [launch for launch in recorder.take() if len(launch) == 6]
    assert [launch[0].split(",")[0] for launch in launches] == ["cuflash::transpose_v_kernel<cuflash::e4m3",
                                                                "cuflash::flash_fwd_sm90_vt_kernel<cuflash::e4m3"]

    def passed_descales(launch):  # (the argument before VariantParams and the three maps: (3, batch, heads_kv))
        import ctypes

        address = int.from_bytes(launch[5][-5], "little")
        return np.frombuffer(ctypes.string_at(address, 3 * 4 * 4), np.float32).reshape(3, 2, 2)

    assert np.array_equal(passed_descales(launches[1]), np.stack([np.asarray(a) for a in descales]))

    def lse_address():  # (the kernel's fifth argument)
        call()
        return int.from_bytes([launch for launch in recorder.take() if len(launch) == 6][-1][5][4], "little")

    from cuflash._cuda import attention as cuda_attention

    sinks = cuda_attention._LSE_SINKS._sinks.values()  # (without return_lse: the stream's lse sink, no allocation)
    assert lse_address() in [address for _, _, address in sinks] and len(sinks) == 1
    descales[2][1, 1] = np.float32(np.inf)
    with pytest.raises(ValueError, match="v_descale"):  # (check_finite reads the values at every call)
        call(check_finite=True)
    monkeypatch.undo()
    cp, recorder, _ = _tma_stand_in(monkeypatch)
    q, k, v = (cp.asarray(np.asarray(a)) for a in (q, k, v))
    descales = [cp.asarray(np.asarray(a)) for a in descales]
    slopes = cp.asarray(np.asarray(slopes))
    call()
    kept, descales[1] = descales[1], None  # (k's factors not given: ones)
    for _ in range(2):  # (checked, then remembered)
        call()
        launch = [launch for launch in recorder.take() if len(launch) == 6][-1]
        assert np.array_equal(passed_descales(launch),
                              np.stack([np.asarray(descales[0]), np.ones((2, 2), np.float32), np.asarray(descales[2])]))
    descales[1] = kept
    descales[1] = cp.asarray(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="k_descale must be a float32 array of shape"):
        call()
    descales[1] = cp.asarray(np.ones((2, 2), np.float32))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        call(dropout_p=0.1, dropout_seed=1)
    with pytest.raises(ValueError, match="max_seqlen_q is only used with cu_seqlens"):  # (an option the key holds)
        call(max_seqlen_q=7)
