"""Where the host time of a decode step goes: ``DecodePlan.run`` over a ``DecodeLaunch`` (and the front door), timed
and profiled on the CPU, without a GPU.

    PYTHONPATH=. python3 tools/decode_host_profile.py [--profile CASE] [--cupy DIR] [--calls N]

Two kinds of arrays:

- default: ``cuflash.cli.bench_decode``'s stand-ins (NumPy memory seen as CuPy arrays: shape, strides, dtype,
  ``data.ptr``) and a runtime whose launches do nothing: the launcher's Python path alone, the figure
  ``bench-decode`` prints first (``host_path_times``);
- ``--cupy DIR``: the ``cupy`` module found first in DIR (a CPU emulation of CuPy, or on the GPU machine CuPy
  itself with ``--cupy ''``), with ``cupy.cuda.driver.launchKernel`` and the NVRTC compile replaced by no-ops, so
  that ``cuflash.plan_kvcache`` and ``cuflash.attention_with_kvcache`` run their real code paths up to the driver.

The cases (batch 1, 256 cached tokens, 32 / 8 heads, d 128, one token appended, causal; ``out`` and ``lse`` given):
the same array objects every step (a decode loop over persistent buffers), new q, k, v objects every step (a
model's projections: the caches, lengths, out and lse stay), new out and lse every step. ``--profile CASE`` prints
cProfile's top functions for one of them. On a GPU, ``python -m cuflash bench-decode`` measures the same cases with
the launches (``cuLaunchKernel``) included.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import numpy as np


def _best_us(fn, calls: int) -> float:
    """Microseconds per call, the best of five runs of ``calls / 5``, in this process's CPU time (a shared machine's
    other load does not count)."""
    for i in range(100):
        fn(i)
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for i in range(calls // 5):
            fn(i)
        best = min(best, (time.process_time() - t0) / (calls // 5))
    return best * 1e6


def _cupy_cases(hq: int, hkv: int, d: int):
    """The cases through the real cupy module (emulated or not), launches and compiles stubbed."""
    import cupy

    import cuflash
    from cuflash._cuda import compile as C

    cupy.cuda.driver.launchKernel = lambda *args: None

    class _Function:
        ptr = 0

    class _Kernel:
        kernel = _Function()
        max_dynamic_shared_size_bytes = 0

    C.kernel = lambda spec: _Kernel()
    C.check_smem = lambda spec: None
    from cuflash._cuda import decode as D

    D.kernel, D.check_smem = C.kernel, C.check_smem
    rng = np.random.default_rng(0)
    batch, cache = 1, 256

    def dev(*shape, dtype=np.float16):
        return cupy.asarray(rng.standard_normal(shape).astype(dtype))

    q, k, v = dev(batch, 1, hq, d), dev(batch, 1, hkv, d), dev(batch, 1, hkv, d)
    k_cache, v_cache = dev(batch, cache, hkv, d), dev(batch, cache, hkv, d)
    lens = cupy.asarray(np.full(batch, cache - 1, np.int32))
    out, lse = cupy.empty((batch, 1, hq, d), dtype=np.float16), cupy.empty((batch, hq, 1), dtype=np.float32)
    plan = cuflash.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, out=out)
    news = [(dev(batch, 1, hq, d), dev(batch, 1, hkv, d), dev(batch, 1, hkv, d)) for _ in range(2)]
    outs = [(cupy.empty_like(out), cupy.empty_like(lse)) for _ in range(2)]
    return {
        "plan.run, the same arrays": lambda i: plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, out=out,
                                                        lse=lse),
        "plan.run, new q, k, v": lambda i: plan.run(news[i & 1][0], k_cache, v_cache, news[i & 1][1],
                                                    news[i & 1][2], cache_seqlens=lens, out=out, lse=lse),
        "plan.run, new out, lse": lambda i: plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, out=outs[i & 1][0],
                                                     lse=outs[i & 1][1]),
        "front door with out=": lambda i: cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v,
                                                                        cache_seqlens=lens, causal=True, out=out),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cupy", default=None, metavar="DIR",
                   help="run through the cupy module found in DIR ('' for the installed CuPy), launches stubbed")
    p.add_argument("--profile", default=None, metavar="CASE", help="cProfile this case (a prefix of its name)")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8))
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    hq, hkv = args.heads
    if args.cupy is not None:
        if args.cupy:
            sys.path.insert(0, args.cupy)
        cases = _cupy_cases(hq, hkv, args.head_dim)
        label = "through the cupy module (launches and compiles stubbed)"
    else:
        from cuflash.cli.bench_decode import host_path_cases

        cases = host_path_cases(hq=hq, hkv=hkv, d=args.head_dim)
        cases.pop("launches per step")
        label = "stand-in arrays and runtime (launches not made)"
    print(f"host time per decode step, {label}; batch 1, cache 256, {hq}/{hkv} heads, d {args.head_dim}:")
    for name, fn in cases.items():
        print(f"  {name:32s} {_best_us(fn, args.calls):7.2f} us")
    if args.profile:
        name = next(n for n in cases if n.startswith(args.profile))
        fn = cases[name]
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.calls):
            fn(i)
        profile.disable()
        print(f"\ncProfile of {name!r}, {args.calls} steps:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
