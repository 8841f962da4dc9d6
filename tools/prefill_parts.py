"""Chunked prefill's launches timed one by one (CUDA events, median of many), beside the dense forward on the same
keys: where the step's time goes (``python tools/prefill_parts.py``, a GPU)."""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cache", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--new", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="also cProfile the host side of both calls (first shape)")
    p.add_argument("--back-to-back", action="store_true",
                   help="also the GPU's time of each part, 20 calls between two events (median of 5 rounds): the step "
                        "with and without the forward's programmatic launch ([pdl]), the append alone, the forward "
                        "alone, the dense plan")
    args = p.parse_args()
    import cupy
    import ml_dtypes

    import cuflash
    from cuflash._ops import api as _api
    from cuflash._cuda import decode

    def timed(fn) -> float:
        fn()
        cupy.cuda.get_current_stream().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(args.reps):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
        return float(np.median(times))

    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    for cache in args.cache:
        for new in args.new:
            def draw(*shape):
                return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16))

            q, k, v = draw(1, new, hq, d), draw(1, new, hkv, d), draw(1, new, hkv, d)
            kc, vc = draw(1, cache + new, hkv, d), draw(1, cache + new, hkv, d)
            lens = cupy.full(1, cache, dtype=np.int32)

            def chunked():
                return cuflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)

            def dense():
                return cuflash.attention(q, kc, vc, causal=True)

            chunked()
            launch = next(iter(_api._kvcache_launches._entries.values()))
            assert isinstance(launch, decode.ChunkedPrefillLaunch), type(launch)
            out = cupy.empty(launch.out_shape, q.dtype)
            lse = cupy.empty(launch.lse_shape, cupy.float32)
            stream = cupy.cuda.get_current_stream().ptr

            def append_only():
                decode_launch = launch._launch
                decode_launch(launch._append[0], launch._append_grid, 1, 1, 128, 1, 1, 0, stream, launch._argv_ptr, 0)

            def forward_only():
                launch._forward.run(q, kc, vc, launch._arrays(seqused_k=launch._seqused), stream, out=out, lse_out=lse)

            dense()
            plan = _api.attention_plan(q, kc, vc, causal=True)

            def dense_plan():
                plan.run(q, kc, vc)

            def run_only():
                launch.run(q, kc, vc, k, v, lens, out=out, lse=lse)

            def run_allocating():
                launch.run(q, kc, vc, k, v, lens)

            def host_us(fn, n=300) -> float:  # host time per call, the GPU left to run behind
                import time

                cupy.cuda.get_current_stream().synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                spent = time.perf_counter() - t0
                cupy.cuda.get_current_stream().synchronize()
                return spent / n * 1e6

            row = {name: timed(fn) for name, fn in (("chunked call", chunked), ("dense call", dense),
                                                    ("launch.run", run_only), ("launch.run allocating", run_allocating),
                                                    ("append kernel", append_only),
                                                    ("forward (seqused_k)", forward_only),
                                                    ("dense plan.run", dense_plan))}
            print(f"cache {cache:6d} new {new:5d}: " + " | ".join(f"{k} {v:8.1f} us" for k, v in row.items()))
            print("  host time per call: " + " | ".join(
                f"{name} {host_us(fn):6.1f} us" for name, fn in (("chunked call", chunked), ("dense call", dense),
                                                                 ("launch.run", run_allocating),
                                                                 ("dense plan.run", dense_plan))))
            if args.back_to_back:
                print("  back to back: " + " | ".join(f"{name} {us:7.2f} us" for name, us in _back_to_back_parts(
                    cupy, launch, append_only, forward_only, dense_plan, run_only).items()))
            if args.profile:  # the host side of each call, by function
                import cProfile
                import pstats

                for name, fn in (("chunked call", chunked), ("dense call", dense)):
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(200):
                        fn()
                    prof.disable()
                    cupy.cuda.get_current_stream().synchronize()
                    print(f"--- {name}: host profile of 200 calls")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
                args.profile = False
            _api._kvcache_launches.clear()
            decode._LAUNCHES.clear()


def _back_to_back_parts(cupy, launch, append_only, forward_only, dense_plan, run_only, calls=20, rounds=5) -> dict:
    """Microseconds per call of each part, ``calls`` calls enqueued between two events, the median of ``rounds``
    rounds taken in turn: the step with the forward's programmatic launch and without, and its parts."""
    def step_with(after):
        def run():
            launch._after_append = after
            run_only()
        return run

    saved = launch._after_append
    parts = {"step (two launches)": step_with(False), "append": append_only, "forward (seqused_k)": forward_only,
             "dense plan.run": dense_plan}
    if launch._forward.waits_for_prior_grid:  # (a forward that does not wait must not be launched so: it would race)
        parts = {"step (pdl)": step_with(True), **parts}
    times = {name: [] for name in parts}
    try:
        for _ in range(rounds):
            for name, fn in parts.items():
                fn()
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                for _ in range(calls):
                    fn()
                stop.record()
                stop.synchronize()
                times[name].append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
    finally:
        launch._after_append = saved
    return {name: float(np.median(t)) for name, t in times.items()}


if __name__ == "__main__":
    main()
