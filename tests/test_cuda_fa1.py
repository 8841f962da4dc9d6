"""algorithm="fa1" on CuPy arrays: the FlashAttention-1 kernels (cuflash_kernels/fa1.cu).

The checks against the float64 truth (every head dim, both causal alignments, GQA, awkward lengths,
views, float32) are shared with FA2 in test_cuda_attention.py. Here, skipped without CuPy and a GPU:
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

from _gpu_helpers import ALIGN, DTYPES, as_float32, poison, run, variant_of
from _helpers import float64_truth, max_abs_error, random_inputs

pytestmark = pytest.mark.gpu


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
    variant = variant_of(causal)
    out_r, lse_r = reference.fa1_forward(q, k, v, scale=scale, variant=variant, block_q=16, block_k=block_k)
    is_causal, align = ALIGN[causal]
    poison(cp)
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
    grads_r = reference.blocked_backward(do, q, k, v, out_r, lse_r, scale=scale, variant=variant, block_q=32,
                                         block_k=64, order="kv_outer")
    cq, ck, cv, cdo, co = (cp.asarray(x) for x in (q, k, v, do, out_r))
    poison(cp)
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
    out1, lse1, g1 = run(cp, q, k, v, do, causal, algorithm="fa1")
    out2, lse2, g2 = run(cp, q, k, v, do, causal, algorithm="fa2")
    assert float(cp.abs(lse1 - lse2).max()) < 1e-4
    assert float(cp.abs(as_float32(cp, out1) - as_float32(cp, out2)).max()) < 2e-2
    for a, b in zip(g1, g2):
        assert float(cp.abs(as_float32(cp, a) - as_float32(cp, b)).max()) < 5e-2


def test_fa1_invalid_block_sizes_are_a_clear_error(requires_gpu):
    cp = requires_gpu
    q = cp.ones((1, 64, 2, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="not a valid CUDA tile for algorithm='fa1'"):
        cuflash.attention(q, q, q, algorithm="fa1", block_q=32, block_k=64)


@pytest.mark.parametrize("d,block_k", [(32, None), (96, None), (256, None), (64, 8)])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
@pytest.mark.parametrize("shape", [(2, 150, 230, 4, 2), (1, 200, 50, 2, 1)])
def test_fa1_float32_kernels_match_numpy_fa1(requires_gpu, d, block_k, causal, shape):
    """float32 inputs run fa1.cu's FA1-order float32 kernels: against reference.fa1_forward and
    blocked_backward(order="kv_outer") at the kernel's key tile (both float32, so they differ only by
    summation order), and against the float64 truth. (1, 200, 50) with causal bottom-right has rows that
    see no key (O = 0, lse = -inf, dQ = 0). Inputs as (B, H, N, d) views for the GQA shape."""
    cp = requires_gpu
    B, nq, nk, hq, hkv = shape
    q, k, v, do = random_inputs(B, nq, nk, hq, hkv, d, np.float32, seed=d + nq)
    scale = 1.0 / np.sqrt(d)
    variant = variant_of(causal)
    bk_fwd = block_k or 32
    bk_bwd = block_k or (32 if d <= 128 else 16)
    out_r, lse_r = reference.fa1_forward(q, k, v, scale=scale, variant=variant, block_q=1, block_k=bk_fwd)
    grads_r = reference.blocked_backward(do, q, k, v, out_r, lse_r, scale=scale, variant=variant, block_q=1,
                                         block_k=bk_bwd, order="kv_outer")
    out_t, lse_t, grads_t = float64_truth(q, k, v, do, scale=scale, variant=variant)
    layout = "bhnd" if hq > hkv else "bnhd"
    out, lse, grads = run(cp, q, k, v, do, causal, algorithm="fa1", layout=layout, block_k=block_k)

    lse_h = cp.asnumpy(lse)
    fin = np.isfinite(lse_r)
    assert np.array_equal(np.isfinite(lse_h), fin)
    assert np.abs(lse_h[fin] - lse_r[fin]).max() < 1e-5
    assert np.abs(lse_h[fin] - lse_t[fin]).max() < 1e-4
    for name, x, xr, xt, rel in (("out", out, out_r, out_t, 2e-5),
                                 *zip(("dq", "dk", "dv"), grads, grads_r, grads_t, (1e-4,) * 3)):
        xh = cp.asnumpy(x)
        assert not np.isnan(xh).any(), f"{name}: unwritten (NaN) elements"
        size = max(1.0, float(np.abs(xt).max()))
        assert max_abs_error(xh, xr) <= rel * size, (name, max_abs_error(xh, xr))
        assert max_abs_error(xh, xt) <= 2 * rel * size, (name, max_abs_error(xh, xt))
    if causal == "br" and nq > nk:
        blind = nq - nk  # rows i < nq - nk see no key
        assert float(cp.abs(out[:, :blind]).max()) == 0.0 and float(cp.abs(grads[0][:, :blind]).max()) == 0.0


def test_fa1_float32_invalid_block_k_is_a_clear_error(requires_gpu):
    cp = requires_gpu
    q = cp.ones((1, 64, 2, 64), dtype=cp.float32)
    with pytest.raises(ValueError, match="block_k=48 is not a valid CUDA tile for algorithm='fa1' on float32"):
        cuflash.attention(q, q, q, algorithm="fa1", block_k=48)
