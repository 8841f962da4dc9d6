"""Where a variant's time goes, on the GPU machine: host time per call against GPU time, and each kernel's own
duration, for the forward (and forward+backward) of the cases of ``variants_check.py --bench``.

    PYTHONPATH=. python3 tools/variants_profile.py [--n 8192] [--cases causal,prefix] [--backward]
    ncu --metrics gpu__time_duration.sum --csv python3 tools/variants_profile.py --once ...

Without ``--once``: ``cupyx.profiler.benchmark`` per case of the front door (``cuflash.attention``, and
``attention_backward`` with ``--backward``): CPU time of the call (its checks, or their remembered result, and its
launches) and GPU time between events around it (a GPU time equal to the CPU time means the host is the
bottleneck). ``tools/host_profile.py`` measures the host time alone, at small shapes. With
``--once``: each case runs once after a warm-up (for ncu to time every kernel of one call).
"""

from __future__ import annotations

import argparse

import numpy as np

from variants_check import PREFIX, documents


def cases(n: int, b: int, hq: int):
    """name -> the keywords of cuflash.attention / attention_backward."""
    import cupy as cp

    import cuflash

    doc = cp.asarray(documents(n))
    slopes = cp.asarray(2.0 ** (-8.0 * (np.arange(hq) + 1) / hq), dtype=cp.float32)
    return {
        "causal": dict(causal=True),
        "softcap-causal": dict(causal=True, softcap=30.0),
        "alibi-causal": dict(causal=True, alibi_slopes=slopes),
        "dropout-0.1-causal": dict(causal=True, dropout_p=0.1, dropout_seed=1, dropout_offset=0),
        # a BlockMask: lists built once, as Flex's
        "document-causal": dict(causal=True, mask_mod=cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})),
        "prefix-lm-1024": dict(mask_mod=f"kv_idx <= q_idx || kv_idx < {PREFIX}"),
        "mask-causal": dict(mask_mod="kv_idx <= q_idx"),
        "score-mod-softcap-causal": dict(causal=True, score_mod="30.0f * tanhf(score / 30.0f)"),
        "score-mod-identity-causal": dict(causal=True, score_mod="score"),
        "window-1024-causal": dict(causal=True, window_size=(1024, 0)),
        # the same documents as document-causal, packed: each (batch entry, document) a sequence of its own
        "varlen-documents-causal": dict(causal=True, cu_seqlens=documents_cu_seqlens(n, b)),
    }


def documents_cu_seqlens(n: int, b: int):
    """cu_seqlens (int32) of the b x n tokens of :func:`documents` packed: b times its 8 documents."""
    import cupy as cp

    lengths = np.tile(np.bincount(documents(n)), b)
    return cp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--cases", default="")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args()

    import cupy as cp
    from cupyx.profiler import benchmark

    import cuflash

    d, hq, n = 128, 16, args.n
    b = max(1, 16384 // n)
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, n, hq, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))

    for name, opts in cases(n, b, hq).items():
        if args.cases and not any(w in name for w in args.cases.split(",")):
            continue

        arrays = (q, k, v, do)
        if "cu_seqlens" in opts:  # packed: (total tokens, heads, d), max_seqlen of the longest sequence
            cu = opts.pop("cu_seqlens")
            longest = int(cp.diff(cu).max())
            opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            arrays = tuple(a.reshape(b * n, hq, d) for a in arrays)

        def fwd(q=arrays[0], k=arrays[1], v=arrays[2], opts=opts):
            return cuflash.attention(q, k, v, **opts)

        def fb(q=arrays[0], k=arrays[1], v=arrays[2], do=arrays[3], opts=opts):
            o, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
            return cuflash.attention_backward(do, q, k, v, o, lse, **opts)

        fn = fb if args.backward else fwd
        fn()
        cp.cuda.Device().synchronize()
        if args.once:
            print(f"--- {name}", flush=True)
            fn()
            cp.cuda.Device().synchronize()
            continue
        r = benchmark(fn, n_repeat=30, n_warmup=3)
        cpu, gpu = r.cpu_times.mean() * 1e6, r.gpu_times.mean() * 1e6
        print(f"N {n} {name:28s} host {cpu:8.1f} us  GPU {gpu:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
