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
    }


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

        def fwd():
            return cuflash.attention(q, k, v, **opts)

        def fb():
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
