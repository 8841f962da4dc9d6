"""cuflash.jax under ``jax.jit`` against cuflash.attention on CuPy, time per call side by side, on the GPU machine.

    PYTHONPATH=. python3 tools/jax_bench.py [--shapes 1x128x8x64,4x2048x16x128] [--dtype bfloat16] [--iters 200]
                                            [--routes buffer,pure] [--no-causal]

Each row: one shape ``batch x seqlen x heads x head_dim`` (q, k, v alike), forward and forward + backward.
Columns: cuflash.attention on the same memory as CuPy arrays (the front door and the kernels: the raw
call), then ``jax.jit`` of cuflash.jax.attention by each callback route (``buffer``: XLA's buffers in place on
XLA's stream; ``pure``: jax.pure_callback through host memory, the NumPy algorithm: slow, for comparison
only, so left out by default), then the buffer route's overhead over the raw call. Time per call is the
mean over ``--iters`` calls issued back to back with one synchronization at the end: on a launch-bound
(small) shape it is the host's time per call, on a large one the kernels'.

Memory: XLA takes 75% of the GPU at start; the kernels' results and workspaces come from CuPy's pool, out of
the rest (``XLA_PYTHON_CLIENT_MEM_FRACTION`` lowers XLA's share for larger shapes).
"""

from __future__ import annotations

import argparse
import os
import time


def per_call(fn, sync, iters: int) -> float:
    """Microseconds per call of ``fn`` over ``iters`` calls after a warm-up (which compiles)."""
    sync(fn())
    start = time.perf_counter()
    for _ in range(iters):
        r = fn()
    sync(r)
    return (time.perf_counter() - start) / iters * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x128x8x64,1x512x16x64,2x2048x16x128,4x4096x32x128")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--routes", default="buffer", help="comma-separated: buffer, pure")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    args = parser.parse_args(argv)

    import cupy
    import jax
    import jax.numpy as jnp

    import cuflash
    import cuflash.jax as cfj

    gpu = next((d for d in jax.devices() if d.platform == "gpu"), None)
    if gpu is None:
        raise SystemExit(f"no JAX GPU device (JAX {jax.__version__}, backend {jax.default_backend()})")
    dtype = getattr(jnp, args.dtype)
    routes = [r for r in args.routes.split(",") if r]
    print(f"JAX {jax.__version__} on {gpu.device_kind}; CuPy {cupy.__version__}; {args.dtype}, "
          f"causal={args.causal}; default route: {cfj.callback_route()}; microseconds per call")
    header = f"{'shape':20s} {'pass':8s} {'cupy':>10s}" + "".join(f" {'jit/' + r:>12s}" for r in routes)
    print(header + (f" {'overhead':>10s}" if "buffer" in routes else ""))
    causal = args.causal
    for text in args.shapes.split(","):
        b, n, h, d = (int(x) for x in text.split("x"))
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.device_put(jax.random.normal(key, (b, n, h, d), dtype), gpu) for key in keys)
        cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))

        def cupy_fwd():
            return cuflash.attention(cq, ck, cv, causal=causal)

        def cupy_fwd_bwd():
            out, lse = cuflash.attention(cq, ck, cv, causal=causal, return_lse=True)
            return cuflash.attention_backward(cdo, cq, ck, cv, out, lse, causal=causal)

        cu_sync = lambda *_: cupy.cuda.get_current_stream().synchronize()  # noqa: E731
        jx_sync = jax.block_until_ready
        times = {"forward": [per_call(cupy_fwd, cu_sync, args.iters)],
                 "fwd+bwd": [per_call(cupy_fwd_bwd, cu_sync, args.iters)]}
        for route in routes:
            os.environ["CUFLASH_JAX_CALLBACK"] = route  # read when the functions below are traced
            fwd = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=causal))
            fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: cfj.attention(*a, causal=causal), q, k, v)[1](do))
            iters = args.iters if route == "buffer" else max(1, args.iters // 20)
            times["forward"].append(per_call(lambda: fwd(q, k, v), jx_sync, iters))
            times["fwd+bwd"].append(per_call(lambda: fwd_bwd(q, k, v, do), jx_sync, iters))
        os.environ.pop("CUFLASH_JAX_CALLBACK", None)
        for what, ts in times.items():
            line = f"{text:20s} {what:8s} {ts[0]:10.1f}" + "".join(f" {t:12.1f}" for t in ts[1:])
            if "buffer" in routes:
                line += f" {ts[1 + routes.index('buffer')] - ts[0]:+10.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
