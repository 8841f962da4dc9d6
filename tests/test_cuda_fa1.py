"""algorithm="fa1" on CuPy arrays: the FlashAttention-1 kernels (cuflash_kernels/fa1.cu).

Three kinds of check, all skipped without CuPy and a GPU:
- against the float64 truth with the error budget of STYLE.md (2x / 3x naive attention in the same dtype
  + the rounding floor), over every head dim, both causal alignments, GQA, awkward lengths, views;
- against the NumPy FA1 reference (reference.fa1_forward, blocked_backward order "kv_outer") at equal tile
  sizes: both accumulate in float32 and round P and dS to the input dtype in the same places, so they
  agree to a few float32 ulps in lse and to a rounding of the input dtype in the outputs;
- outputs come from a memory pool filled with NaN first (the float32 running O, m, l and dQ workspaces
  too), so an element never written, or a running statistic read before it was written, shows as NaN.
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


def _f32(cp, x):
    """float32 copy of a float16 / bfloat16 CuPy array (bfloat16 through its bits)."""
    if x.dtype == DTYPES["bfloat16"]:
        return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(cp.float32)


def _poison(cp):
    """Leave 256 MiB of NaN in the pool, which hands it out to the next allocations."""
    x = cp.full((1 << 26,), np.nan, dtype=np.float32)
    del x


def _offset(causal, nq, nk):
    return None if causal is None else (nk - nq if causal == "br" else 0)


def _dev(cp, x, layout):
    if layout == "bhnd":  # a (B, H, N, d) array seen as (B, N, H, d): non-contiguous, no copy
        return cp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    return cp.asarray(x)


def _run(cp, q, k, v, do, causal, layout="bnhd", block_q=None, block_k=None, algorithm="fa1"):
    is_causal, align = ALIGN[causal]
    cq, ck, cv, cdo = (_dev(cp, x, layout) for x in (q, k, v, do))
    opts = dict(causal=is_causal, causal_align=align, algorithm=algorithm, block_q=block_q, block_k=block_k)
    _poison(cp)
    out, lse = cuflash.attention(cq, ck, cv, return_lse=True, **opts)
    _poison(cp)
    grads = cuflash.attention_backward(cdo, cq, ck, cv, out, lse, **opts)
    return out, lse, grads


def _check(cp, shape, d, dtname, causal, *, layout="bnhd", seed=0):
    B, nq, nk, hq, hkv = shape
    dtype = DTYPES[dtname]
    q, k, v, do = random_inputs(B, nq, nk, hq, hkv, d, dtype, seed=seed)
    scale = 1.0 / np.sqrt(d)
    off = _offset(causal, nq, nk)
    out_t, lse_t, grads_t = float64_truth(q, k, v, do, scale=scale, causal_offset=off)
    out_n, _ = reference.naive_forward(q, k, v, scale=scale, causal_offset=off)
    grads_n = reference.naive_backward(do, q, k, v, scale=scale, causal_offset=off)
    out, lse, grads = _run(cp, q, k, v, do, causal, layout)
    out_h = cp.asnumpy(out)
    assert not np.isnan(out_h.astype(np.float32)).any(), "forward left unwritten (NaN) elements"
    assert_within_budget(out_h, out_t, out_n, 2, rounding_floor(out_t, dtype), "out")
    lse_h = cp.asnumpy(lse)
    assert max_abs_error(lse_h, lse_t) < 1e-3, max_abs_error(lse_h, lse_t)
    for name, g, gt, gn in zip(("dq", "dk", "dv"), grads, grads_t, grads_n):
        gh = cp.asnumpy(g)
        assert not np.isnan(gh.astype(np.float32)).any(), f"{name}: unwritten (NaN) elements"
        assert_within_budget(gh, gt, gn, 3, rounding_floor(gt, dtype) + 1e-4, name)


@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
def test_fa1_awkward_lengths_every_head_dim(requires_gpu, dtname, d, causal):
    _check(requires_gpu, (2, 113, 203, 4, 2), d, dtname, causal, seed=d)


@pytest.mark.parametrize("shape", [(1, 1, 257, 2, 2), (1, 257, 1, 2, 1), (1, 1023, 1024, 2, 2), (2, 203, 113, 4, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
def test_fa1_shapes(requires_gpu, shape, d, causal):
    _check(requires_gpu, shape, d, "bfloat16", causal, seed=shape[1])


@pytest.mark.parametrize("d", [64, 128])
def test_fa1_non_contiguous_views_gqa(requires_gpu, d):
    _check(requires_gpu, (2, 300, 300, 8, 2), d, "float16", "br", layout="bhnd")


def test_fa1_rows_that_see_no_key(requires_gpu):
    cp = requires_gpu
    q, k, v, do = random_inputs(1, 200, 50, 2, 1, 64, DTYPES["float16"], seed=3)
    out, lse, (dq, _, _) = _run(cp, q, k, v, do, "br")  # rows i < 150 see no key
    assert float(cp.abs(out[:, :150].astype(cp.float32)).max()) == 0.0
    assert bool(cp.all(lse[:, :, :150] == -cp.inf))
    assert float(cp.abs(dq[:, :150].astype(cp.float32)).max()) == 0.0
    assert not bool(cp.isnan(dq.astype(cp.float32)).any())


@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
@pytest.mark.parametrize("d,block_k", [(64, 128), (128, 64), (64, 32)])
@pytest.mark.parametrize("causal", [None, "br"])
def test_fa1_matches_numpy_fa1_at_equal_tiles(requires_gpu, dtname, d, block_k, causal):
    """Kernel vs reference.fa1_forward / blocked_backward with the kernel's tiles, both float32 inside."""
    cp = requires_gpu
    dtype = DTYPES[dtname]
    B, nq, nk, hq, hkv = 1, 150, 230, 4, 2
    q, k, v, do = random_inputs(B, nq, nk, hq, hkv, d, dtype, seed=7)
    scale = 1.0 / np.sqrt(d)
    off = _offset(causal, nq, nk)
    out_r, lse_r = reference.fa1_forward(q, k, v, scale=scale, causal_offset=off, block_q=16, block_k=block_k)
    is_causal, align = ALIGN[causal]
    _poison(cp)
    out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=is_causal, causal_align=align,
                                 algorithm="fa1", block_q=16, block_k=block_k, return_lse=True)
    fin = np.isfinite(lse_r)
    lse_h = cp.asnumpy(lse)
    assert np.array_equal(np.isfinite(lse_h), fin)
    assert np.abs(lse_h[fin] - lse_r[fin]).max() < 2e-5, np.abs(lse_h[fin] - lse_r[fin]).max()
    # Outputs: both round the same float32 value (up to exp2 and summation order) to the dtype.
    ulp = float(np.finfo(dtype).eps) if dtname == "float16" else 2.0**-7
    out_err = max_abs_error(cp.asnumpy(out), out_r)
    assert out_err <= ulp * max(1.0, float(np.abs(out_r.astype(np.float32)).max())), out_err

    # Backward at the kernel's tiles (block_q = 32 query rows, block_k = 16 * warps key rows).
    grads_r = reference.blocked_backward(do, q, k, v, out_r, lse_r, scale=scale, causal_offset=off, block_q=32,
                                         block_k=64, order="kv_outer")
    cq, ck, cv, cdo, co = (cp.asarray(x) for x in (q, k, v, do, out_r))
    _poison(cp)
    grads = cuflash.attention_backward(cdo, cq, ck, cv, co, cp.asarray(lse_r.astype(np.float32)), causal=is_causal,
                                       causal_align=align, algorithm="fa1", block_q=32, block_k=64)
    for name, g, gr in zip(("dq", "dk", "dv"), grads, grads_r):
        gr32 = gr.astype(np.float32)
        err = max_abs_error(cp.asnumpy(g), gr32)
        assert err <= 2 * ulp * max(1.0, float(np.abs(gr32).max())), (name, err)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [None, "tl"])
def test_fa1_agrees_with_fa2_kernels(requires_gpu, d, causal):
    cp = requires_gpu
    q, k, v, do = random_inputs(2, 333, 333, 4, 4, d, DTYPES["bfloat16"], seed=11)
    out1, lse1, g1 = _run(cp, q, k, v, do, causal)
    out2, lse2, g2 = _run(cp, q, k, v, do, causal, algorithm="fa2")
    assert float(cp.abs(lse1 - lse2).max()) < 1e-4
    assert float(cp.abs(_f32(cp, out1) - _f32(cp, out2)).max()) < 2e-2
    for a, b in zip(g1, g2):
        assert float(cp.abs(_f32(cp, a) - _f32(cp, b)).max()) < 5e-2


def test_fa1_float32_inputs(requires_gpu):
    """float32 takes the float32 SIMT path (documented); still within float32 accuracy of the truth."""
    cp = requires_gpu
    q, k, v, do = random_inputs(2, 113, 203, 4, 2, 64, np.float32, seed=5)
    out_t, _, grads_t = float64_truth(q, k, v, do, scale=0.125, causal_offset=90)
    out, _, grads = _run(cp, q, k, v, do, "br")
    assert max_abs_error(cp.asnumpy(out), out_t) < 2e-5
    for g, gt in zip(grads, grads_t):
        assert max_abs_error(cp.asnumpy(g), gt) < 1e-4


def test_fa1_invalid_block_sizes_are_a_clear_error(requires_gpu):
    cp = requires_gpu
    q = cp.ones((1, 64, 2, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="not a valid CUDA tile for algorithm='fa1'"):
        cuflash.attention(q, q, q, algorithm="fa1", block_q=32, block_k=64)
