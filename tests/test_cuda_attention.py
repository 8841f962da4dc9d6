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

from _gpu_helpers import DTYPES, check, run, variant_of
from _helpers import float64_truth, max_abs_error, random_inputs

pytestmark = pytest.mark.gpu

# Both blocked algorithms run every shared check; fa1-only checks live in test_cuda_fa1.py.
ALGORITHMS = ["fa2", "fa1"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtname", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
def test_awkward_lengths_every_head_dim(requires_gpu, algorithm, dtname, d, causal):
    check(requires_gpu, (2, 113, 203, 4, 2), d, dtname, causal, algorithm=algorithm, seed=d)


@pytest.mark.parametrize("shape", [(1, 1, 257, 2, 2), (1, 257, 1, 2, 1), (1, 1023, 1024, 2, 2), (2, 203, 113, 4, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [None, "br", "tl"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_shapes(requires_gpu, algorithm, shape, d, causal):
    check(requires_gpu, shape, d, "bfloat16", causal, algorithm=algorithm, seed=shape[1])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_non_contiguous_views_gqa(requires_gpu, algorithm, d):
    check(requires_gpu, (2, 300, 300, 8, 2), d, "float16", "br", algorithm=algorithm, layout="bhnd")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_is_bitwise_reproducible(requires_gpu, d):
    cp = requires_gpu
    _, grads = check(cp, (2, 257, 300, 4, 2), d, "bfloat16", "br", deterministic=True)
    q, k, v, do = random_inputs(2, 257, 300, 4, 2, d, DTYPES["bfloat16"], seed=0)
    _, _, again = run(cp, q, k, v, do, "br", deterministic=True)
    for a, b in zip(grads, again):
        assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_rows_that_see_no_key(requires_gpu, algorithm):
    cp = requires_gpu
    q, k, v, do = random_inputs(1, 200, 50, 2, 1, 64, DTYPES["float16"], seed=3)
    out, lse, (dq, _, _) = run(cp, q, k, v, do, "br", algorithm=algorithm)  # rows i < 150 see no key
    assert float(cp.abs(out[:, :150].astype(cp.float32)).max()) == 0.0
    assert bool(cp.all(lse[:, :, :150] == -cp.inf))
    assert float(cp.abs(dq[:, :150].astype(cp.float32)).max()) == 0.0
    assert not bool(cp.isnan(dq.astype(cp.float32)).any())


@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [None, "br"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float32_simt_path(requires_gpu, algorithm, d, causal):
    """The SIMT float32 kernels (fp32_precision="ieee"; the tensor-core forward: test_cuda_tf32.py)."""
    cp = requires_gpu
    q, k, v, do = random_inputs(2, 113, 203, 4, 2, d, np.float32, seed=d)
    scale = 1.0 / np.sqrt(d)
    variant = variant_of(causal)
    out_t, _, grads_t = float64_truth(q, k, v, do, scale=scale, variant=variant)
    out, _, grads = run(cp, q, k, v, do, causal, algorithm=algorithm, fp32_precision="ieee")
    assert max_abs_error(cp.asnumpy(out), out_t) < 2e-5
    for g, gt in zip(grads, grads_t):
        assert max_abs_error(cp.asnumpy(g), gt) < 1e-4
    if algorithm == "fa2":  # the split order: a dK/dV pass, then a row-wise dQ pass, no atomics
        _, _, det = run(cp, q, k, v, do, causal, deterministic=True)
        _, _, again = run(cp, q, k, v, do, causal, deterministic=True)
        for g, g2, gt in zip(det, again, grads_t):
            assert max_abs_error(cp.asnumpy(g), gt) < 1e-4
            assert bool((g.view(cp.uint32) == g2.view(cp.uint32)).all())


def _shipped_tiles(d, dtname):
    """(forward tile, backward dK/dV tile) the launcher picks for this GPU with default block sizes."""
    from cuflash import _cuda

    from cuflash._cuda import compile as cuda_compile

    cc, _ = cuda_compile.device_info()
    arch = cuda_compile.arch_class(cc)
    if dtname == "float32":  # the 3xTF32 forward (sm_80+, d <= 128), else the SIMT one
        return (_cuda.TILES.get(("fwd_tf32x3", arch, d)) if cc >= 80 else None) or _cuda.TILES[("fwd", "f32", d)], None
    fwd = _cuda.TILES.get(("fwd", "sm90a", d)) if cc == 90 and _cuda.attention.SM90A_FORWARD else None
    bwd = _cuda.TILES.get(("bwd", "sm90a", d)) if cc == 90 and _cuda.attention.SM90A_BACKWARD else None
    return fwd or _cuda.TILES[("fwd", arch, d)], bwd or _cuda.TILES[("bwd", arch, d)]


@pytest.mark.parametrize("dtname", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [None, "br"])
def test_fa2_matches_numpy_fa2_at_equal_tiles(requires_gpu, dtname, d, causal):
    """The FA2 kernels with their shipped tiles vs reference.fa2_forward / blocked_backward(order="kv_outer")
    at the same tiles: both accumulate in float32 and round P and dS to the input dtype in the same places,
    so lse agrees to a few float32 ulps and the outputs and gradients to a rounding of the input dtype
    (float32: to float32 summation-order noise). The float32 backward kernels are row-wise (no tiles);
    they are held to the reference at the forward's tiles."""
    cp = requires_gpu
    dtype = np.dtype(np.float32) if dtname == "float32" else DTYPES[dtname]
    B, nq, nk, hq, hkv = 1, 300, 459, 4, 2
    q, k, v, do = random_inputs(B, nq, nk, hq, hkv, d, dtype, seed=d + 5)
    scale = 1.0 / np.sqrt(d)
    variant = variant_of(causal)
    tf, tb = _shipped_tiles(d, dtname)
    tb = tb or tf
    out_r, lse_r = reference.fa2_forward(q, k, v, scale=scale, variant=variant, block_q=tf.block_m,
                                         block_k=tf.block_n)
    grads_r = reference.blocked_backward(do, q, k, v, out_r, lse_r, scale=scale, variant=variant,
                                         block_q=tb.block_m, block_k=tb.block_n, order="kv_outer")
    out, lse, grads = run(cp, q, k, v, do, causal)
    lse_h = cp.asnumpy(lse)
    fin = np.isfinite(lse_r)
    assert np.array_equal(np.isfinite(lse_h), fin)
    assert np.abs(lse_h[fin] - lse_r[fin]).max() < 2e-5, np.abs(lse_h[fin] - lse_r[fin]).max()
    ulp = {"float32": 2e-5, "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0**-7}[dtname]
    out_r32 = out_r.astype(np.float32)
    assert max_abs_error(cp.asnumpy(out), out_r32) <= ulp * max(1.0, float(np.abs(out_r32).max()))
    for name, g, gr in zip(("dq", "dk", "dv"), grads, grads_r):
        gr32 = gr.astype(np.float32)
        err = max_abs_error(cp.asnumpy(g), gr32)
        assert err <= (5 if dtname == "float32" else 2) * ulp * max(1.0, float(np.abs(gr32).max())), (name, err)


def test_unsupported_head_dim_is_a_clear_error(requires_gpu):
    cp = requires_gpu
    q = cp.ones((1, 8, 1, 300), dtype=cp.float16)
    with pytest.raises(ValueError, match="head_dim 300 is not supported by the CUDA kernels"):
        cuflash.attention(q, q, q)


@pytest.mark.parametrize("dtname", ["float16", "bfloat16"])
def test_contiguous_views_at_an_odd_offset(requires_gpu, dtname):
    """q, k, v contiguous but starting one element into their allocation (base not a multiple of 16 bytes): the
    forward and the deterministic backward run on aligned copies and give what the aligned arrays give, bit for bit,
    twice (the second call is a remembered one)."""
    cp = requires_gpu
    q, k, v, do = random_inputs(2, 130, 190, 4, 2, 64, DTYPES[dtname], seed=5)

    def shifted(x):
        flat = cp.empty(x.size + 1, dtype=x.dtype)
        flat[1:] = cp.asarray(x).ravel()
        return flat[1:].reshape(x.shape)

    dev = [cp.asarray(x) for x in (q, k, v)]
    want, lse_want = cuflash.attention(*dev, causal=True, return_lse=True)
    grads_want = cuflash.attention_backward(cp.asarray(do), *dev, want, lse_want, causal=True, deterministic=True)
    views = [shifted(x) for x in (q, k, v)]
    assert all(x.data.ptr % 16 for x in views)
    for _ in range(2):
        out, lse = cuflash.attention(*views, causal=True, return_lse=True)
        grads = cuflash.attention_backward(shifted(do), *views, out, lse, causal=True, deterministic=True)
        assert bool((out == want).all()) and bool((lse == lse_want).all())
        for a, b in zip(grads, grads_want):
            assert bool((a == b).all())
