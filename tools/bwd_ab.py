"""A/B of backward builds (``CUFLASH_DEFINES``: the dK/dV kernel's compile-time schedules, e.g.
``CUFLASH_BWD_DQ_TILE=1``), one process per build, in alternating rounds: the backward alone
(``cuflash.attention_backward``, CUDA events, median of repeats) in TFLOP/s at d 64 and 128 (bf16, or --dtype
float16; --heads-kv for GQA), dense and causal, and whether each build's dK and dV are bit for bit the first build's
(dQ: its max |difference|, the float32 additions' order).

    python tools/bwd_ab.py --builds "" "CUFLASH_BWD_SHARE_DQ=0" [--rounds 3] [--n 4096 16384] [--dims 64 128]

(run on the GPU machine from the repository root; ``--one`` is the per-process worker)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from _gpu_tools import ab_parser, ab_report, ab_run


def one(args) -> None:
    import cupy
    import ml_dtypes

    import cuflash

    rows = []
    for d in args.dims:
        for causal in (False, True):
            for n in args.n:
                batch, heads, heads_kv = max(1, args.tokens // n), args.heads, args.heads_kv or args.heads
                rng = np.random.default_rng(d * 1000 + n + causal)
                dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float16

                def draw(h):
                    return cupy.asarray(rng.standard_normal((batch, n, h, d), np.float32).astype(dtype))
                q, k, v, do = draw(heads), draw(heads_kv), draw(heads_kv), draw(heads)
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)

                def bwd():
                    return cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
                dq, dk, dv = bwd()
                cupy.cuda.Device().synchronize()
                start, stop, times = cupy.cuda.Event(), cupy.cuda.Event(), []
                for _ in range(args.reps):
                    start.record()
                    bwd()
                    stop.record()
                    stop.synchronize()
                    times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e-3)
                flops = 2.5 * 4 * batch * heads * n * n * d / (2 if causal else 1)
                digest = hashlib.sha1(cupy.asnumpy(dk).tobytes() + cupy.asnumpy(dv).tobytes()).hexdigest()[:12]
                np.save(f"/tmp/bwd_ab_dq_{d}_{int(causal)}_{n}_{os.getpid()}.npy", cupy.asnumpy(dq).astype(np.float32))
                rows.append(dict(d=d, causal=causal, n=n, tflops=flops / float(np.median(times)) / 1e12,
                                 dkdv=digest, dq=f"/tmp/bwd_ab_dq_{d}_{int(causal)}_{n}_{os.getpid()}.npy"))
    print(json.dumps(rows))


def main() -> None:
    p = ab_parser(__doc__, "CUFLASH_BWD_SHARE_DQ=0")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=32768, help="batch x N")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=0, help="key/value heads (GQA; default: --heads)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--reps", type=int, default=10)
    args, results = ab_run(p, one, lambda rows: "; ".join(
        f"d{x['d']} {'c' if x['causal'] else 'n'}{x['n']} {x['tflops']:.0f}" for x in rows))
    if results is None:
        return
    base = results[args.builds[0]][0] if results[args.builds[0]] else None

    def cell(i, rows):
        x, tf = rows[0], np.median([r["tflops"] for r in rows])
        same = base is not None and all(r["dkdv"] == base[i]["dkdv"] for r in rows)
        dq = 0.0 if base is None else float(np.abs(np.load(x["dq"]) - np.load(base[i]["dq"])).max())
        return (f"d{x['d']} {'causal' if x['causal'] else 'dense'} N{x['n']} {tf:.0f}"
                f"{'' if same else ' dK/dV DIFFER'} dq {dq:.1e}")
    ab_report(results, "median TFLOP/s (backward alone); dK, dV against the first build; dQ max |diff|:", cell)


if __name__ == "__main__":
    main()
