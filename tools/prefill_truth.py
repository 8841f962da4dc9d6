"""Diagnostic: chunked prefill and the dense call on bench-decode --prefill's shapes against a float64 truth (torch),
per query-row block and head, with the persistent forward on and off. Run on the device: python tools/prefill_truth.py"""
import sys

import cupy
import ml_dtypes
import numpy as np
import torch

import cuflash
from cuflash._cuda import attention as A, tuning


def truth(q, k, v):
    q, k, v = (torch.from_dlpack(x).double() for x in (q, k, v))
    b, n, hq, d = q.shape
    g = hq // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
    nk = k.shape[1]
    mask = torch.arange(nk, device=s.device)[None] > torch.arange(n, device=s.device)[:, None] + nk - n
    s.masked_fill_(mask, -torch.inf)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def report(name, out, want):
    err = (torch.from_dlpack(out).double() - want).abs()  # b n h d
    rows = err.amax(dim=(0, 2, 3)).cpu().numpy()
    heads = err.amax(dim=(0, 1, 3)).cpu().numpy()
    blocks = [f"{rows[i:i + 64].max():.0e}" for i in range(0, len(rows), 64)]
    print(f"  {name:28s} max {err.max().item():.2e}  per 64 rows {' '.join(blocks)}  worst heads "
          f"{np.argsort(heads)[-4:].tolist()} {heads.max():.1e}")


rng = np.random.default_rng(0)
for cache, new, hq, hkv, d in [(8192, 512, 32, 8, 128), (32768, 512, 32, 8, 128), (1000, 300, 8, 2, 128),
                               (8192, 512, 32, 8, 64)]:
    def draw(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16))
    q, k, v = draw(1, new, hq, d), draw(1, new, hkv, d), draw(1, new, hkv, d)
    kc, vc = draw(1, cache + new, hkv, d), draw(1, cache + new, hkv, d)
    lens = cupy.full(1, cache, dtype=np.int32)
    chunked = cuflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    want = truth(q, kc, vc)
    print(f"cache {cache} new {new} heads {hq}/{hkv} d {d}")
    report("chunked (two launches)", chunked, want)
    for pers in (None, False, True):
        A.PERSISTENT_FORWARD = pers
        tuning._forget_plans()
        report(f"dense persistent={pers}", cuflash.attention(q, kc, vc, causal=True), want)
    A.PERSISTENT_FORWARD = None
    for short in (A.TMA_SHORT_MAX_ROWS_Q, 0):
        saved = A.TMA_SHORT_MAX_ROWS_Q, A.TMA_SHORT_MAX_ROWS_Q_CAUSAL
        A.TMA_SHORT_MAX_ROWS_Q = A.TMA_SHORT_MAX_ROWS_Q_CAUSAL = short
        tuning._forget_plans()
        report(f"dense short rows <= {short}", cuflash.attention(q, kc, vc, causal=True), want)
        A.TMA_SHORT_MAX_ROWS_Q, A.TMA_SHORT_MAX_ROWS_Q_CAUSAL = saved
    sys.stdout.flush()
