"""Host time per call of the front door (``cuflash.attention``, ``cuflash.attention_backward``) on CuPy arrays, at
steady state: the same shapes, dtypes and options called again and again, as a model's layers call it.

    PYTHONPATH=. python3 tools/host_profile.py [--n 512] [--cases causal,document] [--profile causal]
    PYTHONPATH=. python3 tools/host_profile.py --emulator /path/to/emulated/cupy   # no GPU
    PYTHONPATH=. python3 tools/host_profile.py --stand-in   # no GPU: the tests' stand-in CuPy (tests/_fake_cupy.py)
    PYTHONPATH=. python3 tools/host_profile.py --count   # and the function calls per call (cProfile)
    PYTHONPATH=. python3 tools/host_profile.py --n 2048 --heads 16 --parts   # and the parts of a planned call (GPU)

On a GPU: the CPU time of each call, from ``cupyx.profiler.benchmark`` (which synchronizes after the timed call,
so the GPU's own time is not in it; printed apart), median and min over ``--calls * --repeats`` calls. With ``--emulator`` (a
directory holding a CPU stand-in package named ``cupy``, put first on ``sys.path``): the same Python path with the
kernels neither compiled nor launched (a stand-in runtime, and a fixed sm_90 device), so the numbers are the
Python of cuflash plus the stand-in's allocations: indicative, not an H100's. ``--profile CASE`` prints the
cProfile of one case's loop.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import numpy as np


def _stub_launches():
    """Neither compile nor launch (the emulator has no NVRTC and no driver): the launch layer's entry points
    replaced, and an H100's device properties. And an emulated array's ``.data`` (its memory pointer) made an
    attribute read, as CuPy's is, instead of a read of ``__array_interface__`` (2 us each)."""
    import cupy

    from cuflash._cuda import attention, compile, fa1, naive

    finalize = cupy.ndarray.__array_finalize__

    def __array_finalize__(self, obj):
        finalize(self, obj)
        self._memory = cupy._Mem(self.__array_interface__["data"][0])

    cupy.ndarray.__array_finalize__ = __array_finalize__
    cupy.ndarray.data = property(lambda self: self._memory)

    compile._device_cache[0] = (90, 227 * 1024)
    compile._sm_counts[0] = 132
    cupy.cuda.runtime.memsetAsync = lambda ptr, value, size, stream: None  # (the backward plan's zeroed workspace)

    def no_launch(*args, **kwargs):
        return None

    for module in (compile, attention, fa1, naive):
        if hasattr(module, "launch"):
            module.launch = no_launch
    if hasattr(attention, "runtime"):  # the planned launches (cuLaunchKernel through a runtime object)
        from cuflash._cuda.decode import CupyRuntime

        class StandIn(CupyRuntime):
            def function(self, spec):
                return 0, None

            def make_context_current(self):
                pass

        stand_in = StandIn()
        stand_in.launch = no_launch
        attention._RUNTIME = stand_in


def _stand_in():
    """The tests' stand-in CuPy (tests/_fake_cupy.py: NumPy memory, an sm_90 device, the launchers' caches fresh) with
    the planned launches' cuLaunchKernel a no-op: the Python path of a call and the stand-in's allocations."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _fake_cupy import install
    from _pytest.monkeypatch import MonkeyPatch

    from cuflash._cuda import compile

    patch = MonkeyPatch()
    cp, _ = install(patch)
    patch.setattr(compile.PackedLaunch, "run", lambda self, stream: None)
    return cp


def _calls_per_call(call, n: int) -> str:
    """Function calls per call of ``call`` as cProfile counts them (Python functions and the built-in ones they call;
    with --emulator, the stand-in's too): a measure of host work that the machine's load does not blur."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        call()
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(calls for (_, _, _), (_, calls, _, _, _) in stats.items())
    own = sum(calls for (path, _, _), (_, calls, _, _, _) in stats.items() if "/cuflash/" in path)
    return f"{total / n:.0f} function calls per call, {own / n:.0f} of them cuflash's Python functions"


def cases(cp, n: int, b: int, hq: int, d: int, dtype):
    """name -> (call, backward: whether it is attention_backward's), each a function of no arguments."""
    import cuflash

    rng = np.random.default_rng(0)
    q, k, v, do = (cp.asarray(rng.standard_normal((b, n, hq, d)).astype(np.float32)).astype(dtype) for _ in range(4))
    doc = cp.asarray(np.repeat(np.arange(8), -(-n // 8))[:n].astype(np.int32))
    block_mask = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})
    options = {
        "dense": {},
        "causal": {"causal": True},
        "window-softcap": {"causal": True, "window_size": (256, 0), "softcap": 30.0},
        "document-blockmask": {"causal": True, "mask_mod": block_mask},
    }
    out = {}
    for name, opts in options.items():
        out[name] = (lambda opts=opts: cuflash.attention(q, k, v, **opts))
    # A model's layers: new q, k, v (new addresses) at every call, four sets in turn.
    sets = [tuple(cp.asarray(rng.standard_normal((b, n, hq, d)).astype(np.float32)).astype(dtype) for _ in range(3))
            for _ in range(4)]
    turn = iter(range(1 << 62))
    out["causal-new-arrays"] = lambda: cuflash.attention(*sets[next(turn) % 4], causal=True)
    out["dense-new-arrays"] = lambda: cuflash.attention(*sets[next(turn) % 4])
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    out["backward-causal"] = lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emulator", help="a directory holding a CPU stand-in package named cupy (no GPU)")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per case (the median is printed)")
    ap.add_argument("--cases", default="", help="comma-separated substrings of the case names")
    ap.add_argument("--profile", default="", help="print the cProfile of this case's loop")
    ap.add_argument("--count", action="store_true",
                    help="print the function calls per call (cProfile's count: all, and cuflash's own Python functions)")
    ap.add_argument("--stand-in", action="store_true", help="the tests' stand-in CuPy, launches no-ops (no GPU)")
    ap.add_argument("--parts", action="store_true",
                    help="(GPU) also time the parts of the causal case's call alone: its key, CuPy's allocation of the "
                         "output, the plan's run, its cuLaunchKernel, pointing a tensor map at a new address")
    args = ap.parse_args()
    if args.emulator:
        sys.path.insert(0, args.emulator)
    if args.stand_in:
        cp = _stand_in()
        args.emulator = "stand-in"
    else:
        import cupy as cp

        if args.emulator:
            _stub_launches()

    def sync():
        if not args.emulator:
            cp.cuda.Device().synchronize()


    where = f"{args.emulator} (launches stubbed)" if args.emulator else cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"host time per call, {where}: (batch {args.batch}, seqlen {args.n}, heads {args.heads}, head_dim "
          f"{args.head_dim}) float16", flush=True)
    for name, call in cases(cp, args.n, args.batch, args.heads, args.head_dim, cp.float16).items():
        if args.cases and not any(word in name for word in args.cases.split(",")):
            continue
        for _ in range(3):  # compile, plan
            call()
        sync()
        if args.emulator:
            loops = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                loops.append((time.perf_counter() - t0) / args.calls)
            print(f"{name:22s} {statistics.median(loops) * 1e6:8.1f} us/call  (min {min(loops) * 1e6:.1f})",
                  flush=True)
        else:  # the CPU time of each call alone (the GPU's time is measured apart, between events around it)
            from cupyx.profiler import benchmark

            r = benchmark(call, n_repeat=args.calls * args.repeats, n_warmup=10)
            cpu, gpu = np.asarray(r.cpu_times) * 1e6, np.asarray(r.gpu_times).ravel() * 1e6
            print(f"{name:22s} {np.median(cpu):8.1f} us/call host (min {cpu.min():.1f})  GPU {np.median(gpu):8.1f} us",
                  flush=True)
        if args.count:
            print(f"{'':22s} {_calls_per_call(call, args.calls)}", flush=True)
        if args.profile and args.profile in name:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    if args.parts and not args.emulator:
        parts(cp, args.n, args.batch, args.heads, args.head_dim, cp.float16, args.calls * args.repeats)


def parts(cp, n: int, b: int, hq: int, d: int, dtype, calls: int) -> None:
    """The host time of the parts of a planned causal forward (median of ``calls`` calls, each timed alone, the device
    synchronized every 50 calls outside the timed region)."""
    import cuflash
    from cuflash._cuda import tensor_map
    from cuflash._ops import api

    def timed(name, fn):
        for _ in range(20):
            fn()
        cp.cuda.Device().synchronize()
        times = []
        for i in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
            if i % 50 == 49:
                cp.cuda.Device().synchronize()
        cp.cuda.Device().synchronize()
        print(f"  {name:40s} {statistics.median(times) / 1e3:6.2f} us  (p10 {np.percentile(times, 10) / 1e3:.2f})",
              flush=True)

    rng = np.random.default_rng(1)
    q, k, v = (cp.asarray(rng.standard_normal((b, n, hq, d)).astype(np.float32)).astype(dtype) for _ in range(3))
    cuflash.attention(q, k, v, causal=True)
    plan = api.attention_plan(q, k, v, causal=True)  # (the plan the call above left in the front door's memory)
    stream = cp.cuda.get_current_stream().ptr
    print(f"parts of a causal call ({type(plan).__name__}, {len(plan._maps)} tensor maps; address word "
          f"{tensor_map.address_field() if plan._maps else None}):", flush=True)
    timed("key of the call and its lookup", lambda: api.attention_plan(q, k, v, causal=True))
    timed("output allocation (cupy.ndarray)", lambda: cp.ndarray(plan.out_shape, dtype=plan.dtype))
    timed("plan.run", lambda: plan.run(q, k, v, api._NO_ARRAYS, stream, False))
    timed("cuLaunchKernel", lambda: plan._launch.run(stream))
    if plan._maps:
        addresses = [q.data.ptr + 256 * i for i in range(4)]
        turn = iter(range(1 << 62))
        timed("a tensor map pointed at a new address", lambda: plan._maps[0].point(addresses[next(turn) % 4]))
        plan._maps[0].point(q.data.ptr)


if __name__ == "__main__":
    main()
