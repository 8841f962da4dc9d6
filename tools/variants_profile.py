"""Where a variant's time goes, on the GPU machine: host time per call against GPU time, and each kernel's own
duration, for the forward (and forward+backward) of the cases of ``variants_check.py --bench``.

    PYTHONPATH=. python3 tools/variants_profile.py [--n 8192] [--cases causal,prefix] [--backward]
    ncu --metrics gpu__time_duration.sum --csv python3 tools/variants_profile.py --once ...

Without ``--once``: ``cupyx.profiler.benchmark`` per case (CPU time of the call's Python and launches, and GPU
time between events around it: a GPU time equal to the CPU time means the host is the bottleneck). With
``--once``: each case runs once after a warm-up (for ncu to time every kernel of one call).
"""

from __future__ import annotations

import argparse

import numpy as np

from variants_check import PREFIX, documents


def cases(n: int, b: int, hq: int):
    import cupy as cp

    from cuflash._mods import user_mods
    from cuflash._variant import Variant

    doc = documents(n)
    slopes = cp.broadcast_to(cp.asarray(2.0 ** (-8.0 * (np.arange(hq) + 1) / hq), dtype=cp.float32), (b, hq))
    return {
        "causal": Variant(causal=True),
        "softcap-causal": Variant(causal=True, softcap=30.0),
        "alibi-causal": Variant(causal=True, alibi_slopes=slopes),
        "dropout-0.1-causal": Variant(causal=True, dropout_p=0.1, dropout_seed=1, dropout_offset=0),
        "document-causal": Variant(causal=True, mods=user_mods(None, "doc[q_idx] == doc[kv_idx]", {"doc": doc}),
                                   mod_arrays=(cp.asarray(doc),), block_lists={}),  # a BlockMask (lists built once, as Flex's)
        "prefix-lm-1024": Variant(mods=user_mods(None, f"kv_idx <= q_idx || kv_idx < {PREFIX}")),
        "mask-causal": Variant(mods=user_mods(None, "kv_idx <= q_idx")),
        "score-mod-softcap-causal": Variant(causal=True, mods=user_mods("30.0f * tanhf(score / 30.0f)", None)),
        "score-mod-identity-causal": Variant(causal=True, mods=user_mods("score", None)),
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

    from cuflash import _cuda as cuda

    d, hq, n = 128, 16, args.n
    b = max(1, 16384 // n)
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, n, hq, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))

    for name, variant in cases(n, b, hq).items():
        if args.cases and not any(w in name for w in args.cases.split(",")):
            continue
        opts = dict(scale=d ** -0.5, variant=variant, algorithm="fa2", block_q=None, block_k=None)

        def fwd():
            return cuda.forward(q, k, v, **opts)

        def fb():
            o, lse = cuda.forward(q, k, v, **opts)
            return cuda.backward(do, q, k, v, o, lse, order="kv_outer", **opts)

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
