"""A/B of FP8 forward builds (``CUFLASH_DEFINES``, e.g. the [fp8 exp16] switch ``CUFLASH_FP8_EXP16=1``), one process
per build, in alternating rounds: TFLOP/s of the FP8 (e4m3) forward through the front door (V^T written, the plan run)
and, in the same process, the bf16 forward on the same values, on bench-gpu's grid (batch x N = 16384, heads x d =
2048), with each build's max |difference| from the bf16 output and the FP8 budget (docs/variants.md, "FP8").

    python tools/fp8_ab.py --builds "" "CUFLASH_FP8_EXP16=1" [--rounds 3] [--dims 128 256] [--n 1024 4096 16384]

(run on the GPU machine from the repository root; ``--one`` is the per-process worker)."""

from __future__ import annotations

import json

import numpy as np

from _gpu_tools import ab_parser, ab_report, ab_run


def one(args) -> None:
    import cupy as cp
    import ml_dtypes
    import torch
    import triton.testing as tt

    import cuflash

    rows = []
    for d in args.dims:
        for causal in (False, True):
            for n in args.n:
                b, h = max(1, 16384 // n), 2048 // d
                rng = np.random.default_rng(n + d)
                host = [rng.standard_normal((b, n, h, d), dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
                        for _ in range(3)]
                q8, k8, v8 = (cp.asarray(x.view(np.uint8)) for x in host)  # (CuPy has no e4m3 dtype: the bits)
                qb, kb, vb = (cp.asarray(x.astype(ml_dtypes.bfloat16)) for x in host)  # (e4m3 is exact in bf16)

                def fp8():
                    return cuflash.attention(q8, k8, v8, causal=causal)

                def bf16():
                    return cuflash.attention(qb, kb, vb, causal=causal)

                o8, ob = (torch.from_dlpack(o.view(cp.uint16)).view(torch.bfloat16).float() for o in (fp8(), bf16()))
                diff = float((o8 - ob).abs().max())
                budget = 2.0 ** -4 * float(np.abs(host[2].astype(np.float32)).max()) + 2.0 ** -7 * float(ob.abs().max())
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                fp8_ms = tt.do_bench(fp8, warmup=25, rep=args.rep_ms, return_mode="median")
                bf16_ms = tt.do_bench(bf16, warmup=25, rep=args.rep_ms, return_mode="median")
                rows.append(dict(d=d, causal=causal, n=n, fp8=flops / fp8_ms / 1e9, bf16=flops / bf16_ms / 1e9,
                                 diff=diff, budget=budget))
    print(json.dumps(rows))


def main() -> None:
    p = ab_parser(__doc__, "CUFLASH_FP8_EXP16=1")
    p.add_argument("--dims", type=int, nargs="+", default=[128, 256])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--rep-ms", type=int, default=100)
    args, results = ab_run(p, one, lambda rows: "; ".join(
        f"d{x['d']} {'c' if x['causal'] else 'n'}{x['n']} {x['fp8']:.0f} ({x['fp8'] / x['bf16']:.2f}x)" for x in rows))
    if results is None:
        return
    def cell(i, rows):
        x, tf = rows[0], np.median([r["fp8"] for r in rows])
        ratio = np.median([r["fp8"] / r["bf16"] for r in rows])
        ok = all(r["diff"] <= r["budget"] for r in rows)
        return (f"d{x['d']} {'causal' if x['causal'] else 'dense'} N{x['n']} {tf:.0f} ({ratio:.2f}x)"
                f"{'' if ok else ' OVER BUDGET'} diff {x['diff']:.1e}")
    ab_report(results, "median TFLOP/s of the FP8 forward (its ratio to the bf16 forward of the same process); "
              "max |FP8 - bf16| against the budget:", cell)


if __name__ == "__main__":
    main()
