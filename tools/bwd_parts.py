"""Where a planned backward's time goes: each of its launches (D, the workspace's memset, dK/dV with dQ, dQ's
conversion, GQA's sum) timed alone between CUDA events inside one run, median over repeats, beside the whole run, and
the backward's TFLOP/s with and without the side launches (issue 14: the backward at N <= 2048 against cuDNN's).

    python3 tools/bwd_parts.py [--dims 64 128] [--n 1024 2048 8192] [--tokens 16384] [--heads 16] [--reps 20]

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
                                              algorithm="fa2", block_q=None, block_k=None, order="kv_outer")
                plan.run(do, q, k, v, out, lse)  # (compiles)
                names = ["memset"] + [launch.spec.family if hasattr(launch, "spec") else "launch"
                                      for launch, *_ in plan._steps]
                times = [[] for _ in names]
                whole = []
                stream = cupy.cuda.get_current_stream()
                for _ in range(args.reps):
                    events = [cupy.cuda.Event() for _ in range(len(names) + 1)]
                    ws = cupy.empty((plan._ws_bytes,), dtype=np.uint8)
                    dq, dk, dv = (cupy.empty(s, dtype=t) for s, t in zip(plan.shapes, plan.dtypes))
                    base = ws.data.ptr
                    events[0].record(stream)
                    if plan._zero_bytes:
                        plan._memset(base, 0, plan._zero_bytes, stream.ptr)
                    events[1].record(stream)
                    addresses = (q.data.ptr, k.data.ptr, v.data.ptr, do.data.ptr, out.data.ptr, lse.data.ptr,
                                 dq.data.ptr, dk.data.ptr, dv.data.ptr,
                                 *(None if o is None else base + o for o in plan._offsets))
                    for tmap, s in plan._maps:
                        tmap.point(addresses[s])
                    for i, (launch, write, slots, variant_args) in enumerate(plan._steps):
                        ptrs = [addresses[s] for s in slots]
                        if variant_args is not None:
                            ptrs += variant_args.pointers(attention.VariantArrays())
                        write(*ptrs)
                        launch.run(stream.ptr)
                        events[i + 2].record(stream)
                    events[-1].synchronize()
                    for i in range(len(names)):
                        times[i].append(cupy.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e3)
                    whole.append(cupy.cuda.get_elapsed_time(events[0], events[-1]) * 1e3)
                flops = 2.5 * 4 * batch * args.heads * n * n * d / (2 if causal else 1)
                med = [statistics.median(t) for t in times]
                main_us = max(med[1:], default=0)
                parts = " | ".join(f"{name} {t:.1f}" for name, t in zip(names, med))
                print(f"d {d:3d} {'causal' if causal else 'dense '} N {n:5d}: whole {statistics.median(whole):7.1f} "
                      f"us ({flops / statistics.median(whole) / 1e6:.0f} TFLOP/s; main launch alone "
                      f"{flops / main_us / 1e6:.0f}) | {parts}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
