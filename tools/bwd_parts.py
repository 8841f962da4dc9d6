"""Where a planned backward's time goes: each of its launches (D, the workspace's memset, dK/dV with dQ, dQ's
conversion, GQA's sum) timed alone between CUDA events inside one run, median over repeats, beside the whole run, and
the backward's TFLOP/s with and without the side launches (issue 14: the backward at N <= 2048 against cuDNN's).
``--order split`` times the two-pass order instead (dK / dV without dQ, then dQ by query tiles: no atomics; the
"main launch" then the dK/dV one).

    python3 tools/bwd_parts.py [--dims 64 128] [--n 1024 2048 8192] [--tokens 16384] [--heads 16] [--reps 20]
        [--order split]

(on the GPU machine from the repository root, as bench-gpu's grid: batch x N = tokens, bf16)."""

from __future__ import annotations

import argparse
import statistics

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 8192])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--order", default="kv_outer", choices=("kv_outer", "split"))
    args = ap.parse_args(argv)

    import cupy
    import ml_dtypes

    import cuflash
    from cuflash._cuda import attention
    from cuflash._ops.variant import Variant

    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, bf16, batch x N = {args.tokens}, "
          f"{args.heads} heads; microseconds a launch (median of {args.reps})", flush=True)
    for d in args.dims:
        for causal in (False, True):
            for n in args.n:
                batch = max(1, args.tokens // n)
                rng = np.random.default_rng(n + d)

                def draw():
                    x = rng.standard_normal((batch, n, args.heads, d), np.float32)
                    return cupy.asarray(x.astype(ml_dtypes.bfloat16))
                q, k, v, do = draw(), draw(), draw(), draw()
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                plan = attention.BackwardPlan(do, q, k, v, out, lse, scale=d ** -0.5, variant=Variant(causal=causal),
                                              algorithm="fa2", block_q=None, block_k=None, order=args.order)
                plan.run(do, q, k, v, out, lse)  # (compiles)
                stream = cupy.cuda.get_current_stream()
                marks = []  # (a run's events: after its memset, after each launch)

                def after(name, fn):
                    def timed(*args):
                        fn(*args)
                        seen = sum(mark[0].split(" #")[0] == name for mark in marks)  # (a second memset: "memset #2")
                        marks.append((f"{name} #{seen + 1}" if seen else name, cupy.cuda.Event()))
                        marks[-1][1].record(stream)
                    return timed
                # plan.run itself, each of its memsets and launches followed by an event
                plan._memset = after("memset", plan._memset)
                for launch, *_ in plan._steps:
                    launch.run = after(launch.spec.family, launch.run)
                times: dict = {}
                whole = []
                for _ in range(args.reps):
                    marks.clear()
                    start = cupy.cuda.Event()
                    start.record(stream)
                    plan.run(do, q, k, v, out, lse, stream=stream.ptr)
                    marks[-1][1].synchronize()
                    before = start
                    for name, event in marks:
                        times.setdefault(name, []).append(cupy.cuda.get_elapsed_time(before, event) * 1e3)
                        before = event
                    whole.append(cupy.cuda.get_elapsed_time(start, marks[-1][1]) * 1e3)
                names = list(times)
                flops = 2.5 * 4 * batch * args.heads * n * n * d / (2 if causal else 1)
                med = [statistics.median(times[name]) for name in names]
                main_us = next(t for name, t in zip(names, med) if name.startswith("bwd_dkdv"))
                parts = " | ".join(f"{name} {t:.1f}" for name, t in zip(names, med))
                print(f"d {d:3d} {'causal' if causal else 'dense '} N {n:5d}: whole {statistics.median(whole):7.1f} "
                      f"us ({flops / statistics.median(whole) / 1e6:.0f} TFLOP/s; main launch alone "
                      f"{flops / main_us / 1e6:.0f}) | {parts}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
