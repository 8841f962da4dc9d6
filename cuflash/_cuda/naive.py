"""algorithm="naive" on CuPy arrays: the materialized computation with CuPy matmuls (float32
accumulation, float64 for float64 inputs), dense or causal. O(seqlen_q x seqlen_k) memory."""

from __future__ import annotations

import numpy as np

__all__ = ["forward", "backward"]



def _acc_dtype(dtype):
    import cupy

    return cupy.float64 if np.dtype(dtype) == np.float64 else cupy.float32


def _naive_scores(q, k, scale, causal_offset):
    import cupy

    acc = _acc_dtype(q.dtype)
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    qh = q.astype(acc).transpose(0, 2, 1, 3)  # (B, Hq, Nq, d)
    kh = cupy.repeat(k.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    s = scale * (qh @ kh.transpose(0, 1, 3, 2))
    if causal_offset is not None:
        i = cupy.arange(Nq)[:, None]
        j = cupy.arange(Nk)[None, :]
        s = cupy.where(j <= i + causal_offset, s, -cupy.inf)
    return s


def _naive_probs(s):
    import cupy

    m = s.max(axis=-1, keepdims=True)
    m = cupy.where(cupy.isfinite(m), m, 0)
    e = cupy.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = cupy.where(l > 0, e / cupy.where(l > 0, l, 1), 0)
    lsum = l[..., 0]
    lse = cupy.where(lsum > 0, m[..., 0] + cupy.log(cupy.where(lsum > 0, lsum, 1)), -cupy.inf)
    return p, lse


def forward(q, k, v, *, scale, causal_offset):
    import cupy

    acc = _acc_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    p, lse = _naive_probs(_naive_scores(q, k, scale, causal_offset))
    vh = cupy.repeat(v.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    out = (p @ vh).transpose(0, 2, 1, 3).astype(q.dtype)
    return cupy.ascontiguousarray(out), lse.astype(acc)


def backward(do, q, k, v, *, scale, causal_offset):
    import cupy

    acc = _acc_dtype(q.dtype)
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    p, _ = _naive_probs(_naive_scores(q, k, scale, causal_offset))
    qh = q.astype(acc).transpose(0, 2, 1, 3)
    kh = cupy.repeat(k.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    vh = cupy.repeat(v.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    doh = do.astype(acc).transpose(0, 2, 1, 3)
    dv = p.transpose(0, 1, 3, 2) @ doh
    dp = doh @ vh.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = scale * (ds @ kh)
    dk = scale * (ds.transpose(0, 1, 3, 2) @ qh)

    def to_kv(g):
        return g.reshape(B, Hkv, group, Nk, g.shape[-1]).sum(axis=2).transpose(0, 2, 1, 3)

    return (
        cupy.ascontiguousarray(dq.transpose(0, 2, 1, 3).astype(q.dtype)),
        cupy.ascontiguousarray(to_kv(dk).astype(k.dtype)),
        cupy.ascontiguousarray(to_kv(dv).astype(v.dtype)),
    )
