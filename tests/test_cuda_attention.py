"""The CUDA kernels (through the front door on CuPy arrays) against the float64 truth.

Error budget (STYLE.md): max|kernel - truth| <= 2x (outputs) / 3x (gradients) max|naive in the same
dtype - truth| + the floor of rounding the truth to the dtype. Outputs come from a memory pool filled with
NaN first, so an element the kernels never wrote fails the check. Skips without CuPy and a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import reference

from _helpers import assert_within_budget, float64_truth, max_abs_error, random_inputs, rounding_floor

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
ALIGN = {None: (False, "bottom-right"), "br": (True, "bottom-right"), "tl": (True, "top-left")}


def _poison(cp):
    """Leave 256 MiB of NaN in the pool, which hands it out to the next allocations."""
    x = cp.full((1 << 26,), np.nan, dtype=np.float32)
    del x


def _offset(causal, nq, nk):
    return None if causal is None else (nk - nq if causal == "br" else 0)


def _run(cp, q, k, v, do, causal, deterministic=False, layout="bnhd"):
    is_causal, align = ALIGN[causal]

    def dev(x):
        if layout == "bhnd":  # a (B, H, N, d) array seen as (B, N, H, d): non-contiguous, no copy
            return cp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
        return cp.asarray(x)

    cq, ck, cv, cdo = (dev(x) for x in (q, k, v, do))
    _poison(cp)
    out, lse = cuflash.attention(cq, ck, cv, causal=is_causal, causal_align=align, return_lse=True)
    _poison(cp)
    grads = cuflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=is_causal, causal_align=align,
                                       deterministic=deterministic)
    return out, lse, grads


def _check(cp, shape, d, dtname, causal, *, deterministic=False, layout="bnhd", seed=0):
    B, nq, nk, hq, hkv = shape
    dtype = DTYPES[dtname]
    q, k, v, do = random_inputs(B, nq, nk, hq, hkv, d, dtype, seed=seed)
    scale = 1.0 / np.sqrt(d)
    off = _offset(causal, nq, nk)
    out_t, lse_t, grads_t = float64_truth(q, k, v, do, scale=scale, causal_offset=off)
    out_n, _ = reference.naive_forward(q, k, v, scale=scale, causal_offset=off)
    grads_n = reference.naive_backward(do, q, k, v, scale=scale, causal_offset=off)
    out, lse, grads = _run(cp, q, k, v, do, causal, deterministic, layout)
    out_h = cp.asnumpy(out)
    assert not np.isnan(out_h.astype(np.float32)).any(), "forward left unwritten (NaN) elements"
    assert_within_budget(out_h, out_t, out_n, 2, rounding_floor(out_t, dtype), "out")
    lse_h = cp.asnumpy(lse)
    assert max_abs_error(lse_h, lse_t) < 1e-3, max_abs_error(lse_h, lse_t)
    for name, g, gt, gn in zip(("dq", "dk", "dv"), grads, grads_t, grads_n):
        gh = cp.asnumpy(g)
        assert not np.isnan(gh.astype(np.float32)).any(), f"{name}: unwritten (NaN) elements"
        assert_within_budget(gh, gt, gn, 3, rounding_floor(gt, dtype) + 1e-4, name)
    return out, grads


@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
def test_awkward_lengths_every_head_dim(requires_gpu, dtname, d, causal):
    _check(requires_gpu, (2, 113, 203, 4, 2), d, dtname, causal, seed=d)


@pytest.mark.parametrize("shape", [(1, 1, 257, 2, 2), (1, 257, 1, 2, 1), (1, 1023, 1024, 2, 2), (2, 203, 113, 4, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
def test_shapes(requires_gpu, shape, d, causal):
    _check(requires_gpu, shape, d, "bfloat16", causal, seed=shape[1])


@pytest.mark.parametrize("d", [64, 128])
def test_non_contiguous_views_gqa(requires_gpu, d):
    _check(requires_gpu, (2, 300, 300, 8, 2), d, "float16", "br", layout="bhnd")


@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_is_bitwise_reproducible(requires_gpu, d):
    cp = requires_gpu
    _, grads = _check(cp, (2, 257, 300, 4, 2), d, "bfloat16", "br", deterministic=True)
    q, k, v, do = random_inputs(2, 257, 300, 4, 2, d, DTYPES["bfloat16"], seed=0)
    _, _, again = _run(cp, q, k, v, do, "br", deterministic=True)
    for a, b in zip(grads, again):
        assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


def test_rows_that_see_no_key(requires_gpu):
    cp = requires_gpu
    q, k, v, do = random_inputs(1, 200, 50, 2, 1, 64, DTYPES["float16"], seed=3)
    out, lse, (dq, _, _) = _run(cp, q, k, v, do, "br")  # rows i < 150 see no key
    assert float(cp.abs(out[:, :150].astype(cp.float32)).max()) == 0.0
    assert bool(cp.all(lse[:, :, :150] == -cp.inf))
    assert float(cp.abs(dq[:, :150].astype(cp.float32)).max()) == 0.0
    assert not bool(cp.isnan(dq.astype(cp.float32)).any())


@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [None, "br"])
def test_float32_simt_path(requires_gpu, d, causal):
    cp = requires_gpu
    q, k, v, do = random_inputs(2, 113, 203, 4, 2, d, np.float32, seed=d)
    scale = 1.0 / np.sqrt(d)
    off = _offset(causal, 113, 203)
    out_t, _, grads_t = float64_truth(q, k, v, do, scale=scale, causal_offset=off)
    out, _, grads = _run(cp, q, k, v, do, causal)
    assert max_abs_error(cp.asnumpy(out), out_t) < 2e-5
    for g, gt in zip(grads, grads_t):
        assert max_abs_error(cp.asnumpy(g), gt) < 1e-4


def test_unsupported_head_dim_is_a_clear_error(requires_gpu):
    cp = requires_gpu
    q = cp.ones((1, 8, 1, 48), dtype=cp.float16)
    with pytest.raises(RuntimeError, match="head_dim 48"):
        cuflash.attention(q, q, q)
