"""One call on the GPU machine for the attention variants: check the kernels against a float64 truth, then
time each variant against dense attention (and PyTorch's FlexAttention where it has the same variant).

    PYTHONPATH=. python3 tools/variants_check.py [--check] [--bench] [--flex] [--quick] [--out DIR]

--check  the CUDA backend (cuflash._cuda, every FA2 kernel family: wgmma, mma.sync, float32) on windows,
         softcap, ALiBi, key padding (seqused_k), packed variable-length batches and combinations, against a
         float64 oracle written here (independent of cuflash.reference), with the error budget: 2x / 3x the
         error of the same oracle computed in the kernels' dtype. NaN-poisoned pool.
--bench  bf16, d 128, heads 16, 16384 tokens per N: TFLOP/s of each variant and its ratio to dense per
         computed FLOP (windows: FLOPs inside the window), forward and forward+backward; varlen on a mix of
         64 documents against dense on the same total tokens. Dropout (p 0.1, with and without causal) is
         printed as a ratio to its baseline without dropout (issue 11: <= 1.10); `--cases dropout` runs
         just those and their baselines.
--flex   the same variants through torch.nn.attention.flex_attention (compiled), side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from _gpu_tools import log, poison_pool


# ---------------------------------------------------------------------------------------------------
# The float64 oracle: one sequence at a time, every score materialized.

def oracle(q, k, v, do, *, scale, causal=False, bottom_right=True, window=(-1, -1), softcap=0.0, slopes=None,
           used_k=None, bias=None, dtype=np.float64):
    """out (Nq, H, d), lse (H, Nq), dq, dk, dv of one sequence, computed in ``dtype`` with float32/64
    accumulation (P and dS rounded to the dtype, as a framework computing in that dtype would)."""
    acc = np.float64 if dtype == np.float64 else np.float32

    def rnd(x):
        return x.astype(dtype).astype(acc)

    nq, hq, d = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    nk_used = nk if used_k is None else used_k
    qh = rnd(q).transpose(1, 0, 2)
    kh = np.repeat(rnd(k).transpose(1, 0, 2), g, axis=0)
    vh = np.repeat(rnd(v).transpose(1, 0, 2), g, axis=0)
    doh = rnd(do).transpose(1, 0, 2)
    s0 = scale * (qh @ kh.transpose(0, 2, 1))
    t = s0
    dcap = np.ones_like(t)
    if softcap:
        th = np.tanh(t / softcap)
        t = softcap * th
        dcap = 1 - th * th
    off = nk_used - nq if bottom_right else 0
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    if slopes is not None:
        t = t - slopes[:, None, None] * np.abs(i + off - j)[None]
    if bias is not None:
        t = t + bias  # (H or 1, Nq, Nk)
    vis = j < nk_used
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        vis = vis & (j <= i + off + right)
    if left >= 0:
        vis = vis & (j >= i + off - left)
    t = np.where(vis[None], t, -np.inf)
    m = t.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(t - m)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1), 0)
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)), -np.inf)
    out = rnd(p) @ vh
    dp = doh @ vh.transpose(0, 2, 1)
    pr = rnd(p)  # a framework computing in the dtype keeps P in the dtype for the softmax's backward too
    dt = pr * (dp - (pr * dp).sum(-1, keepdims=True))  # the gradient of the biased score (bias after softcap)
    ds = dt * dcap
    dq = scale * (rnd(ds) @ kh)
    dk = scale * (rnd(ds).transpose(0, 2, 1) @ qh)
    dv = rnd(p).transpose(0, 2, 1) @ doh
    dk = dk.reshape(hkv, g, nk, d).sum(1)
    dv = dv.reshape(hkv, g, nk, d).sum(1)
    return (out.transpose(1, 0, 2), lse, dq.transpose(1, 0, 2), dk.transpose(1, 0, 2), dv.transpose(1, 0, 2),
            np.broadcast_to(dt, (hq, nq, nk)))


def oracle_batch(q, k, v, do, opts, lens_q=None, lens_k=None, dtype=np.float64):
    """Run the oracle per sequence: padded (B, N, H, d) arrays, or packed (total, H, d) with lengths."""
    slopes = opts.get("alibi")
    used = opts.get("seqused_k")
    kw = dict(scale=opts["scale"], causal=opts.get("causal", False), bottom_right=opts.get("bottom_right", True),
              window=opts.get("window", (-1, -1)), softcap=opts.get("softcap", 0.0), dtype=dtype)
    if lens_q is None:
        bias = opts.get("bias")
        parts = [oracle(q[b], k[b], v[b], do[b], slopes=None if slopes is None else slopes[b],
                        used_k=None if used is None else int(used[b]),
                        bias=None if bias is None else bias[b % bias.shape[0]], **kw) for b in range(q.shape[0])]
        return tuple(np.stack([p[i] for p in parts]) for i in range(6))
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    outs = []
    for b in range(len(lens_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        outs.append(oracle(q[sq], k[sk], v[sk], do[sq], slopes=None if slopes is None else slopes[b],
                           used_k=None if used is None else int(used[b]), **kw))
    return (np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs], axis=1),
            np.concatenate([o[2] for o in outs]), np.concatenate([o[3] for o in outs]),
            np.concatenate([o[4] for o in outs]), None)


def err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = np.isinf(a) & (a == b)
    dlt = np.abs(np.where(same, 0, a) - np.where(same, 0, b))
    return float(np.where(np.isnan(dlt), np.inf, dlt).max()) if dlt.size else 0.0


# ---------------------------------------------------------------------------------------------------
# Checks.

CASES = [  # (label, options)
    ("dense", {}),
    ("causal", dict(causal=True)),
    ("window", dict(window=(40, 10))),
    ("window-left", dict(window=(100, -1))),
    ("window-right", dict(window=(-1, 7))),
    ("causal-window", dict(causal=True, window=(64, -1))),
    ("tl-causal-window", dict(causal=True, bottom_right=False, window=(30, -1))),
    ("softcap", dict(softcap=5.0)),
    ("softcap-causal", dict(softcap=2.0, causal=True)),
    ("alibi-causal", dict(alibi="heads", causal=True)),
    ("alibi", dict(alibi="batch")),
    ("seqused", dict(seqused_k=[333, 0])),
    ("seqused-all", dict(seqused_k=[120, 333], causal=True, softcap=8.0, alibi="heads", window=(50, -1))),
    ("bias", dict(bias="full")),
    ("bias-broadcast-causal", dict(bias="broadcast", causal=True)),
    ("bias-mask", dict(bias="mask")),
    ("bias-mask-softcap-window", dict(bias="mask", softcap=5.0, window=(60, 20), alibi="heads")),
]


def make_variant(opts, cp, batch, heads, rng, cu=None, maxlen=None, shape_qk=(0, 0)):
    from cuflash._ops.variant import Variant

    slopes = None
    if opts.get("alibi") == "heads":
        slopes = np.broadcast_to(rng.uniform(0.01, 0.3, heads).astype(np.float32), (batch, heads))
    elif opts.get("alibi") == "batch":
        slopes = rng.uniform(0.01, 0.3, (batch, heads)).astype(np.float32)
    used = None if "seqused_k" not in opts else np.asarray(opts["seqused_k"], np.int32)
    left, right = opts.get("window", (-1, -1))
    dslopes = None
    if slopes is not None:
        dslopes = cp.asarray(slopes[0]) if opts["alibi"] == "heads" else cp.asarray(slopes)
        if opts["alibi"] == "heads":
            dslopes = cp.broadcast_to(dslopes, (batch, heads))
    bias = dbias_view = None
    nq, nk = shape_qk
    if opts.get("bias") == "full":
        bias = rng.standard_normal((batch, heads, nq, nk)).astype(np.float32)
    elif opts.get("bias") == "broadcast":
        bias = rng.standard_normal((1, 1, nq, nk)).astype(np.float32)
    elif opts.get("bias") == "mask":  # -inf on a fifth of the scores and on every key of query row 3
        bias = rng.standard_normal((batch, heads, nq, nk)).astype(np.float32)
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        bias[:, :, 3, :] = -np.inf
    extra = {}
    if bias is not None:
        dbias_view = cp.broadcast_to(cp.asarray(bias), (batch, heads, nq, nk))
        extra["bias"] = dbias_view
    v = Variant(**extra, causal=opts.get("causal", False), bottom_right=opts.get("bottom_right", True),
                window_left=None if left < 0 else left, window_right=None if right < 0 else right,
                softcap=opts.get("softcap", 0.0), alibi_slopes=dslopes,
                cu_seqlens_q=None if cu is None else cp.asarray(cu[0]), cu_seqlens_k=None if cu is None else cp.asarray(cu[1]),
                max_seqlen_q=None if cu is None else maxlen[0], max_seqlen_k=None if cu is None else maxlen[1],
                seqused_k=None if used is None else cp.asarray(used))
    return v, dict(opts, alibi=slopes, seqused_k=used, bias=bias)


def check(args, results):
    import cupy as cp
    import ml_dtypes

    from cuflash import _cuda as cuda

    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    rng = np.random.default_rng(0)
    configs = []
    for d in (64, 128):
        for dt in ("bfloat16", "float16"):
            for label, o in CASES:
                configs.append(("padded", dt, d, label, o))
    for d in (32, 96, 256):
        for label in ("causal-window", "softcap-causal", "alibi", "seqused"):
            configs.append(("padded", "bfloat16", d, label, dict(CASES)[label]))
    for d in (64, 128):
        for label in ("causal-window", "softcap-causal", "alibi-causal", "seqused-all"):
            configs.append(("padded", "float32", d, label, dict(CASES)[label]))
    for d in (64, 128):
        for dt in ("bfloat16", "float32"):
            for label, o in (("varlen", {}), ("varlen-causal", dict(causal=True)),
                             ("varlen-causal-window-softcap", dict(causal=True, window=(50, -1), softcap=10.0)),
                             ("varlen-alibi", dict(alibi="heads")),
                             ("varlen-seqused-causal", dict(seqused_k=[150, 0, 100, 1], causal=True))):
                configs.append(("varlen", dt, d, label, o))
    if args.quick:
        configs = configs[::5]
    if args.cases:
        configs = [c for c in configs if any(word in c[3] for word in args.cases.split(","))]
    for layout, dt, d, label, o in configs:
        dtype = np.dtype(dtypes[dt])
        t0 = time.time()
        if layout == "padded":
            B, nq, nk, hq, hkv = 2, 300 if d <= 128 else 150, 333, 4, 2
            q, k, v, do = (rng.standard_normal(s) for s in ((B, nq, hq, d), (B, nk, hkv, d), (B, nk, hkv, d), (B, nq, hq, d)))
            cu = maxlen = lens_q = lens_k = None
        else:
            lens_q, lens_k = [100, 257, 1, 130], [150, 300, 100, 129]
            B, hq, hkv = 4, 4, 2
            cu = (np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32),
                  np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32))
            maxlen = (max(lens_q), max(lens_k))
            q, k, v, do = (rng.standard_normal(s) for s in ((cu[0][-1], hq, d), (cu[1][-1], hkv, d),
                                                           (cu[1][-1], hkv, d), (cu[0][-1], hq, d)))
        q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
        variant, oopts = make_variant(o, cp, B, hq, rng, cu, maxlen, (q.shape[1], k.shape[1]) if layout == "padded" else (0, 0))
        oopts["scale"] = scale = d ** -0.5
        truth = oracle_batch(*(x.astype(np.float64) for x in (q, k, v, do)), oopts, lens_q, lens_k)
        low = oracle_batch(q, k, v, do, oopts, lens_q, lens_k, dtype=dtype)
        cq, ck, cv, cdo = (cp.asarray(x) for x in (q, k, v, do))
        row = dict(layout=layout, dtype=dt, d=d, case=label)
        try:
            for order in ("kv_outer", "split"):
                poison_pool(cp)
                out, lse = cuda.forward(cq, ck, cv, scale=scale, variant=variant, algorithm="fa2", block_q=None, block_k=None)
                poison_pool(cp)
                has_bias = oopts.get("bias") is not None
                grads = cuda.backward(cdo, cq, ck, cv, out, lse, scale=scale, variant=variant, algorithm="fa2",
                                      block_q=None, block_k=None, order=order, want_dbias=has_bias)
                got = [cp.asnumpy(x) for x in (out, lse, *grads)]
                if layout == "varlen":
                    got[1] = got[1].reshape(hq, -1)
                names = ("out", "lse", "dq", "dk", "dv", "dbias")[:len(got)]
                worst = 0.0
                for name, a, t, lw in zip(names, got, truth, low):
                    if np.isnan(a.astype(np.float32)).any():
                        raise AssertionError(f"{name}: NaN (unwritten or invalid)")
                    e = err(a, t)
                    if name == "lse":
                        bud = 2e-3
                    else:
                        fin = np.isfinite(t)
                        floor = float(np.abs(t[fin].astype(dtype).astype(np.float64) - t[fin]).max(initial=0))
                        bud = (2 if name == "out" else 3) * err(lw, t) + floor + (0 if name == "out" else 1e-4)
                    row[f"{name}_{order}"] = e
                    row[f"{name}_budget"] = bud
                    worst = max(worst, e / bud if bud > 0 else (0 if e == 0 else math.inf))
                    if e > bud:
                        raise AssertionError(f"{name} ({order}): err {e:.3e} > budget {bud:.3e}")
                row[f"ratio_{order}"] = worst
            row["ok"] = True
        except Exception as exc:  # keep going: report every failing case
            row["ok"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        row["s"] = round(time.time() - t0, 2)
        results.append(row)
        log(f"{'ok  ' if row['ok'] else 'FAIL'} {layout:6s} {dt:8s} d{d:<3d} {label:30s} "
            f"worst/budget kv {row.get('ratio_kv_outer', float('nan')):.2f} split {row.get('ratio_split', float('nan')):.2f}"
            f" {row.get('error', '')}")
    bad = [r for r in results if not r["ok"]]
    log(f"check: {len(results) - len(bad)} passed, {len(bad)} failed")
    return not bad


# ---------------------------------------------------------------------------------------------------
# Timing.

PREFIX = 1024


def documents(n: int) -> np.ndarray:
    """Document ids of n positions: 8 documents of random lengths (the same for cuflash and Flex)."""
    cuts = np.sort(np.random.default_rng(n).choice(np.arange(1, n), 7, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)


def prefix_pairs(n: int) -> int:
    """Visible pairs of prefix-LM: query i sees keys j <= i and every key of the first PREFIX."""
    i = np.arange(n)
    return int(np.maximum(i + 1, min(PREFIX, n)).sum())


def _warm_gpu(torch, ms: float = 300.0) -> None:
    """Matrix products for ``ms`` milliseconds, so that the first case timed does not pay the clocks' ramp (one run
    measured the first case, a window at N 2048, at 5x its time in a later run)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= ms:
            return


def bench(args, rows):
    import cupy as cp
    import torch
    import triton.testing as tt

    from cuflash import _cuda as cuda
    from cuflash._ops.mods import user_mods
    from cuflash._ops.variant import Variant

    d, hq = 128, 16
    seqlens = (2048, 8192) if args.quick else (2048, 4096, 8192, 16384)
    rep = 50 if args.quick else args.rep_ms
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())

    def timed(fn):
        with stream:
            fn()
        torch.cuda.synchronize()
        return tt.do_bench(lambda: _run(fn), rep=rep, warmup=20)

    def _run(fn):
        with stream:
            fn()

    _warm_gpu(torch)

    def pair(q, k, v, do, variant):
        scale = d ** -0.5
        opts = dict(scale=scale, variant=variant, algorithm="fa2", block_q=None, block_k=None)

        def fwd():
            return cuda.forward(q, k, v, **opts)

        def fb():
            o, lse = cuda.forward(q, k, v, **opts)
            return cuda.backward(do, q, k, v, o, lse, order="kv_outer", **opts)

        return timed(fwd), timed(fb)

    for n in seqlens:
        b = 16384 // n
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, do = (cp.from_dlpack(torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16, generator=g))
                       for _ in range(4))
        slopes = cp.broadcast_to(cp.asarray(2.0 ** (-8.0 * (np.arange(hq) + 1) / hq), dtype=cp.float32), (b, hq))
        flops_full = 4 * b * hq * n * n * d
        doc = documents(n)
        doc_pairs = sum(c * (c + 1) // 2 for c in np.bincount(doc))  # causal pairs inside each document
        w = 1024
        window_pairs = sum(min(i + 1, w + 1) for i in range(n))  # visible (i, j) pairs of a causal window of w
        cases = {
            "dense": (Variant(), flops_full),
            "causal": (Variant(causal=True), flops_full / 2),
            "causal-window-1024": (Variant(causal=True, window_left=w), 4 * b * hq * window_pairs * d),
            "softcap-causal": (Variant(causal=True, softcap=30.0), flops_full / 2),
            "alibi-causal": (Variant(causal=True, alibi_slopes=slopes), flops_full / 2),
            "seqused-causal (all keys)": (Variant(causal=True, seqused_k=cp.full((b,), n, cp.int32)), flops_full / 2),
            "dropout-0.1": (Variant(dropout_p=0.1, dropout_seed=1, dropout_offset=0), flops_full),
            "dropout-0.1-causal": (Variant(causal=True, dropout_p=0.1, dropout_seed=1, dropout_offset=0), flops_full / 2),
            # user mask_mods: block-sparse (the tiles the map lists), FLOPs of the visible pairs
            "document-causal": (Variant(causal=True, mods=user_mods(None, "doc[q_idx] == doc[kv_idx]", {"doc": doc}),
                                        mod_arrays=(cp.asarray(doc),), block_lists={}),  # a BlockMask (lists built once, as Flex's)
                                4 * b * hq * doc_pairs * d),
            "prefix-lm-1024": (Variant(mods=user_mods(None, f"kv_idx <= q_idx || kv_idx < {PREFIX}")),
                               4 * b * hq * prefix_pairs(n) * d),
            "score-mod-softcap-causal": (Variant(causal=True, mods=user_mods("30.0f * tanhf(score / 30.0f)", None)),
                                         flops_full / 2),
        }
        def selected(name):
            if not args.cases:
                return True
            words = args.cases.split(",")
            # a dropout case brings its baseline (the same FLOPs without dropout) into the run
            return any(word in name for word in words) or any(
                word in other and DROPOUT_BASELINE.get(other) == name for other in cases for word in words)

        for name, (variant, flops) in cases.items():
            if not selected(name):
                continue
            tf, tb = pair(q, k, v, do, variant)
            r = dict(n=n, case=name, fwd_ms=tf, fb_ms=tb, fwd_tflops=flops / tf * 1e-9, fb_tflops=3.5 * flops / tb * 1e-9)
            rows.append(r)
            log(f"N {n:6d} {name:28s} fwd {r['fwd_tflops']:6.1f} TFLOP/s  fwd+bwd {r['fb_tflops']:6.1f}")
    dropout_ratios(rows)
    if args.cases and "varlen" not in args.cases:
        return
    # Varlen: 64 documents of 256..8192 tokens (one packed batch) vs dense batches of the same total tokens.
    rs = np.random.default_rng(0)
    lens = rs.integers(256, 8193, 64)
    total = int(lens.sum())
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    q, k, v, do = (cp.from_dlpack(torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)) for _ in range(4))
    flops = float(sum(4 * hq * int(x) * int(x) * d for x in lens))
    var = Variant(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()))
    tf, tb = pair(q, k, v, do, var)
    rows.append(dict(n=total, case="varlen-causal 64 docs 256..8192", fwd_ms=tf, fb_ms=tb,
                     fwd_tflops=flops / 2 / tf * 1e-9, fb_tflops=3.5 * flops / 2 / tb * 1e-9))
    log(f"varlen causal, {total} tokens in 64 docs: fwd {rows[-1]['fwd_tflops']:.1f} TFLOP/s, fwd+bwd {rows[-1]['fb_tflops']:.1f}")
    # dense causal batches at the mean document length, same total
    n = 4096
    b = total // n
    q, k, v, do = (cp.from_dlpack(torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)) for _ in range(4))
    tf, tb = pair(q, k, v, do, Variant(causal=True))
    fl = 4 * b * hq * n * n * d / 2
    rows.append(dict(n=b * n, case=f"dense-causal batch {b} x {n}", fwd_ms=tf, fb_ms=tb, fwd_tflops=fl / tf * 1e-9,
                     fb_tflops=3.5 * fl / tb * 1e-9))
    log(f"dense causal {b} x {n}: fwd {rows[-1]['fwd_tflops']:.1f} TFLOP/s, fwd+bwd {rows[-1]['fb_tflops']:.1f}")


DROPOUT_BASELINE = {"dropout-0.1": "dense", "dropout-0.1-causal": "causal"}  # same FLOPs, no dropout


def dropout_ratios(rows):
    """Issue 11's dropout budget (<= 1.10): time per FLOP of each dropout case over its baseline without
    dropout (the same FLOPs, so the time ratio), forward and forward+backward, side by side."""
    by = {(r["n"], r["case"]): r for r in rows}
    lines = []
    for (n, case), r in sorted(by.items()):
        base = by.get((n, DROPOUT_BASELINE.get(case)))
        if base:
            lines.append(f"| {n} | {case} / {base['case']} | {r['fwd_ms']:.3f} / {base['fwd_ms']:.3f} | "
                         f"**{r['fwd_ms'] / base['fwd_ms']:.3f}** | {r['fb_ms']:.3f} / {base['fb_ms']:.3f} | "
                         f"**{r['fb_ms'] / base['fb_ms']:.3f}** |")
    if lines:
        log("dropout cost per FLOP (time ratio dropout / no dropout; budget <= 1.10):")
        log("| N | case | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio |")
        log("|---|---|---|---|---|---|")
        for line in lines:
            log(line)


def bias_bench(args, rows):
    """cuflash against PyTorch SDPA with the same additive bias as its attn_mask (issue 11's target: >= 1.2x), batch 4,
    16 heads, N 8192, d 128, bf16, not causal; fwd+bwd includes dbias on both sides (SDPA's in the mask's dtype,
    cuflash's in the bias's own dtype). Two cuflash cases: the bias in bf16, read as such and staged in shared memory
    by the wgmma kernels (the same tensor SDPA gets), and in float32 (SDPA gets it rounded to bf16, as it requires
    the query's dtype). Each checks its output against SDPA's first."""
    import cupy as cp
    import torch
    import torch.nn.functional as F
    import triton.testing as tt

    from cuflash import _cuda as cuda
    from cuflash._ops.variant import Variant

    b, h, n, d = (2, 16, 4096, 128) if args.quick else (4, 16, 8192, 128)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    bias32 = torch.randn(b, h, n, n, device="cuda", dtype=torch.float32)
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    cq, ck, cv, cdo = (cp.from_dlpack(x) for x in (q, k, v, do))
    tq, tk, tv = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
    tb = bias32.to(torch.bfloat16).requires_grad_(True)
    tdo = do.transpose(1, 2)

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb)

    def sdpa_fb():
        F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb).backward(tdo)

    ref = sdpa_fwd().transpose(1, 2).float()
    res = {"sdpa fwd": tt.do_bench(sdpa_fwd, rep=args.rep_ms, warmup=10),
           "sdpa fwd+bwd": tt.do_bench(sdpa_fb, rep=args.rep_ms, warmup=10, grad_to_none=[tq, tk, tv, tb])}
    for label, bias in (("bf16", tb.detach()), ("float32", bias32)):
        opts = dict(scale=d ** -0.5, variant=Variant(bias=cp.from_dlpack(bias)), algorithm="fa2", block_q=None,
                    block_k=None)

        def ours_fwd():
            with stream:
                return cuda.forward(cq, ck, cv, **opts)

        def ours_fb():
            with stream:
                o, lse = cuda.forward(cq, ck, cv, **opts)
                cuda.backward(cdo, cq, ck, cv, o, lse, order="kv_outer", want_dbias=True, **opts)

        out = torch.from_dlpack(ours_fwd()[0]).float()
        torch.cuda.synchronize()
        err = float((out - ref).abs().max())
        res[f"cuflash {label} fwd"] = tt.do_bench(ours_fwd, rep=args.rep_ms, warmup=10)
        res[f"cuflash {label} fwd+bwd"] = tt.do_bench(ours_fb, rep=args.rep_ms, warmup=10)
        fwd, fb = res[f"cuflash {label} fwd"], res[f"cuflash {label} fwd+bwd"]
        log(f"bias {label} (B {b}, H {h}, N {n}, d {d}, not causal; max|out - SDPA's| {err:.2e}): cuflash fwd "
            f"{fwd:.3f} ms, SDPA fwd {res['sdpa fwd']:.3f} ms (SDPA / cuflash {res['sdpa fwd'] / fwd:.2f}x); fwd+bwd "
            f"{fb:.3f} vs {res['sdpa fwd+bwd']:.3f} ms ({res['sdpa fwd+bwd'] / fb:.2f}x; target >= 1.2x)")
        res[f"max abs diff {label}"] = err
    rows.append(dict(case=f"bias {b}x{h}x{n}x{d}", **res))


def flex(args, rows):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import triton.testing as tt

    d, hq = 128, 16
    torch._dynamo.config.recompile_limit = 64  # one compiled kernel per (variant, shape)
    fa = torch.compile(flex_attention, dynamic=False)
    for n in ((2048, 8192) if args.quick else (2048, 4096, 8192)):
        b = 16384 // n
        q, k, v, do = (torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4))
        slopes = torch.tensor(2.0 ** (-8.0 * (np.arange(hq) + 1) / hq), device="cuda", dtype=torch.float32)

        def causal(b_, h, qi, ki):
            return qi >= ki

        def window(b_, h, qi, ki):
            return (qi >= ki) & (qi - ki <= 1024)

        def softcap(score, b_, h, qi, ki):
            return 30.0 * torch.tanh(score / 30.0)

        def alibi(score, b_, h, qi, ki):
            return score - slopes[h] * (qi - ki).abs()

        doc = torch.from_numpy(documents(n)).cuda()

        def document(b_, h, qi, ki):
            return (qi >= ki) & (doc[qi] == doc[ki])

        def prefix_lm(b_, h, qi, ki):
            return (ki <= qi) | (ki < PREFIX)

        cases = {"causal": (None, causal), "causal-window-1024": (None, window), "softcap-causal": (softcap, causal),
                 "alibi-causal": (alibi, causal), "document-causal": (None, document), "prefix-lm-1024": (None, prefix_lm),
                 "score-mod-softcap-causal": (softcap, causal)}
        for name, (mod, mask) in cases.items():
            if args.cases and not any(word in name for word in args.cases.split(",")):
                continue
            bm = create_block_mask(mask, b, None, n, n, device="cuda")

            def fwd():
                return fa(q, k, v, score_mod=mod, block_mask=bm)

            def fb():
                o = fa(q, k, v, score_mod=mod, block_mask=bm)
                o.backward(do)

            tf = tt.do_bench(fwd, rep=args.rep_ms, warmup=20)
            tb = tt.do_bench(fb, rep=args.rep_ms, warmup=20, grad_to_none=[q, k, v])
            rows.append(dict(n=n, case=name, system="flex", fwd_ms=tf, fb_ms=tb))
            log(f"flex N {n:6d} {name:28s} fwd {tf:.3f} ms  fwd+bwd {tb:.3f} ms")


def head_dims_bench(args, rows):
    """Forward time per FLOP (FLOPs of the call's own head dims) of head dims between the instantiated ones, bf16,
    causal, 16384 tokens of 16 heads at N 4096: d 80 against 96 and d 200 against 256 are the issue's pairs."""
    import cupy as cp
    import torch
    import triton.testing as tt

    from cuflash import _cuda as cuda
    from cuflash._ops.variant import Variant

    n, hq, b = 4096, 16, 4
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    for d in (64, 80, 96, 128, 160, 192, 200, 224, 256):
        q, k, v = (cp.from_dlpack(torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)) for _ in range(3))
        opts = dict(scale=d ** -0.5, variant=Variant(causal=True), algorithm="fa2", block_q=None, block_k=None)

        def fwd():
            with stream:
                cuda.forward(q, k, v, **opts)

        fwd()
        t = tt.do_bench(fwd, rep=args.rep_ms, warmup=10)
        flops = 4 * b * hq * n * n * d / 2
        rows.append(dict(case=f"head-dim-{d}", d=d, fwd_ms=t, fwd_tflops=flops / t * 1e-9))
        log(f"head dim {d:3d} (kernel {cuda.attention.kernel_head_dim(d, d, in_place=True)}): fwd {t:.3f} ms, "
            f"{flops / t * 1e-9:6.1f} TFLOP/s of its own FLOPs, {t / flops * 1e12:.3f} ps/FLOP")
    # Tiles other than the table's for the in-place head dims between rows (block_q x block_k; warps follow)
    for d in args.tile_sweep:
        q, k, v = (cp.from_dlpack(torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)) for _ in range(3))
        flops = 4 * b * hq * n * n * d / 2
        for bq, bk in ((128, 64), (128, 32), (64, 64), (64, 32), (128, 128)):
            opts = dict(scale=d ** -0.5, variant=Variant(causal=True), algorithm="fa2", block_q=bq, block_k=bk)

            def fwd():
                with stream:
                    cuda.forward(q, k, v, **opts)

            try:
                fwd()
            except Exception as exc:  # (a tile whose shared memory does not fit)
                log(f"head dim {d:3d} tile {bq}x{bk}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            t = tt.do_bench(fwd, rep=args.rep_ms, warmup=10)
            log(f"head dim {d:3d} tile {bq}x{bk}: fwd {t:.3f} ms, {t / flops * 1e12:.3f} ps/FLOP")
    per_flop = {r["d"]: r["fwd_ms"] / (4 * b * hq * n * n * r["d"] / 2) for r in rows if r["case"].startswith("head-dim")}
    for d, ref in ((80, 96), (200, 256)):  # the pairs: <= 1.10 is the target
        log(f"head dim {d} / {ref}: time per FLOP ratio {per_flop[d] / per_flop[ref]:.3f} (target <= 1.10)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--bias", action="store_true", help="bias against PyTorch SDPA with an additive mask")
    ap.add_argument("--head-dims", action="store_true", help="forward time per FLOP at head dims 64..256")
    ap.add_argument("--tile-sweep", type=int, nargs="*", default=[], metavar="D",
                    help="with --head-dims: forward time of head dims D at other tiles than the table's")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated words: check only the cases whose label has one")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    ok = True
    results, rows, flex_rows = [], [], []
    if args.check:
        ok = check(args, results)
    if args.bench:
        bench(args, rows)
    if args.bias:
        bias_bench(args, rows)
    if args.head_dims:
        head_dims_bench(args, rows)
    if args.flex:
        try:
            flex(args, flex_rows)
        except Exception as exc:
            log(f"flex failed: {type(exc).__name__}: {exc}")
    if rows and flex_rows:  # side by side, same process: time ratio FlexAttention / cuflash (> 1: cuflash faster)
        ours = {(r.get("n"), r["case"]): r for r in rows}
        log("| N | case | cuflash fwd ms | Flex fwd ms | Flex/cuflash | cuflash fwd+bwd ms | Flex fwd+bwd ms | Flex/cuflash |")
        log("|---|---|---|---|---|---|---|---|")
        for fr in flex_rows:
            r = ours.get((fr["n"], fr["case"]))
            if r:
                log(f"| {fr['n']} | {fr['case']} | {r['fwd_ms']:.3f} | {fr['fwd_ms']:.3f} | {fr['fwd_ms'] / r['fwd_ms']:.2f} | "
                    f"{r['fb_ms']:.3f} | {fr['fb_ms']:.3f} | {fr['fb_ms'] / r['fb_ms']:.2f} |")
    with open(os.path.join(args.out, "variants_check.json"), "w") as f:
        json.dump(dict(check=results, bench=rows, flex=flex_rows), f, indent=1, default=float)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
