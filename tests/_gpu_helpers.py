"""Shared pieces of the GPU tests: inputs on the device, NaN-poisoned outputs, the checked run.

Error budget (STYLE.md): max|kernel - truth| <= 2x (outputs) / 3x (gradients) max|naive in the same
dtype - truth| + the floor of rounding the truth to the dtype. Outputs come from a memory pool filled with
NaN first, so an element the kernels never wrote fails the check.
"""

from __future__ import annotations

import numpy as np

import cuflash
from cuflash import reference
from cuflash._ops.variant import Variant

from _helpers import assert_within_budget, float64_truth, max_abs_error, random_inputs, rounding_floor

try:
    import ml_dtypes

    DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
except ImportError:  # ml_dtypes is a dependency of cuflash; this only keeps collection alive without it
    DTYPES = {"float16": np.dtype(np.float16)}

# Test ids for causal masking: not causal, bottom-right aligned, top-left aligned.
ALIGN = {None: (False, "bottom-right"), "br": (True, "bottom-right"), "tl": (True, "top-left")}


def poison(cp):
    """Leave 256 MiB of NaN in the pool, which hands it out to the next allocations."""
    x = cp.full((1 << 26,), np.nan, dtype=np.float32)
    del x


def variant_of(causal):
    """The reference's Variant for a causal test id (None, "br", "tl")."""
    is_causal, align = ALIGN[causal]
    return Variant(causal=is_causal, bottom_right=align == "bottom-right")


def to_device(cp, x, layout="bnhd"):
    if layout == "bhnd":  # a (B, H, N, d) array seen as (B, N, H, d): non-contiguous, no copy
        return cp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    return cp.asarray(x)


def as_float32(cp, x):
    """float32 copy of a float16 / bfloat16 CuPy array (bfloat16 through its bits)."""
    if x.dtype == DTYPES.get("bfloat16"):
        return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(cp.float32)


def run(cp, q, k, v, do, causal, *, algorithm="fa2", deterministic=False, layout="bnhd",
        block_q=None, block_k=None, fp32_precision="tf32x3"):
    """Forward (poisoned outputs) then backward (poisoned gradients) through the front door."""
    is_causal, align = ALIGN[causal]
    cq, ck, cv, cdo = (to_device(cp, x, layout) for x in (q, k, v, do))
    opts = dict(causal=is_causal, causal_align=align, algorithm=algorithm, block_q=block_q, block_k=block_k)
    poison(cp)
    out, lse = cuflash.attention(cq, ck, cv, return_lse=True, fp32_precision=fp32_precision, **opts)
    poison(cp)
    grads = cuflash.attention_backward(cdo, cq, ck, cv, out, lse, deterministic=deterministic, **opts)
    return out, lse, grads


def check(cp, shape, d, dtname, causal, *, algorithm="fa2", deterministic=False, layout="bnhd", seed=0):
    """Run on random inputs and hold out, lse and the gradients to the float64 truth's error budget."""
    B, nq, nk, hq, hkv = shape
    dtype = DTYPES[dtname]
    q, k, v, do = random_inputs(B, nq, nk, hq, hkv, d, dtype, seed=seed)
    scale = 1.0 / np.sqrt(d)
    variant = variant_of(causal)
    out_t, lse_t, grads_t = float64_truth(q, k, v, do, scale=scale, variant=variant)
    out_n, _ = reference.naive_forward(q, k, v, scale=scale, variant=variant)
    grads_n = reference.naive_backward(do, q, k, v, scale=scale, variant=variant)
    out, lse, grads = run(cp, q, k, v, do, causal, algorithm=algorithm, deterministic=deterministic,
                          layout=layout)
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
