"""cuflash.jax under ``jax.jit`` against cuflash.attention on CuPy, time per call side by side, on the GPU machine.

    PYTHONPATH=. python3 tools/jax_bench.py [--shapes 1x128x8x64,4x2048x16x128] [--dtype bfloat16] [--iters 200]
                                            [--routes buffer,kernel,pure] [--no-causal] [--split]
    PYTHONPATH=. python3 tools/jax_bench.py --cpu-profile [--shapes 1x512x16x64]       # no GPU needed
    PYTHONPATH=. python3 tools/jax_bench.py --in-program 64 [--shapes ...]               # the kernel route inside jit

Each row: one shape ``batch x seqlen x heads x head_dim`` (q, k, v alike), forward and forward + backward.
Columns: cuflash.attention on the same memory as CuPy arrays (the front door and the kernels: the raw
call), then ``jax.jit`` of cuflash.jax.attention by each callback route (``buffer``: XLA's buffers in place on
XLA's stream; ``kernel``: the buffer route with ``CUFLASH_JAX_KERNEL_CALL=1``, its planned forward launched by
XLA through jaxlib's kernel call, no Python per call; ``pure``: jax.pure_callback through host memory, the NumPy
algorithm: slow, for comparison only, so left out by default), then the buffer and kernel routes' overheads over the
raw call. Time per call is the
mean over ``--iters`` calls issued back to back with one synchronization at the end: on a launch-bound
(small) shape it is the host's time per call, on a large one the kernels'. ``--split`` adds the time spent
inside cuflash's callbacks per jitted call (its Python, the views of XLA's buffers, the launches): the rest of
the overhead is JAX's and XLA's (dispatch, the custom call, entering Python).

``--in-program K``: the overhead of a forward call inside a jitted program rather than of a jitted call (JAX's own
dispatch, ~35-50 us per jitted call on the H100 machine, is paid once per program): ``jax.jit`` of K forward calls
chained (each call's output the next one's q) by the kernel route, against the raw kernel: the same launch queued K
times back to back from its plan (``ForwardPlan`` staged once, then only ``cuLaunchKernel``: GPU-bound). Per call:
microseconds of each, and the difference (the kernel call's overhead over the raw launch inside a program).

``--cpu-profile`` runs no GPU: the buffer route's GPU side on JAX's CPU, with the stand-in CuPy of
``tests/_fake_cupy.py`` (nothing compiled, launches stubbed) and XLA's CPU buffers presented to the callback as
CUDA buffers. Per shape it prints the Python calls (cProfile, builtins included) made inside cuflash's callbacks
per jitted call and the device-to-device copies they queue, forward and forward + backward: a proxy for the
callback's host time, not a timing.

Memory: XLA takes 75% of the GPU at start; the kernels' results and workspaces come from CuPy's pool, out of
the rest (``XLA_PYTHON_CLIENT_MEM_FRACTION`` lowers XLA's share for larger shapes).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def per_call(fn, sync, iters: int, spent=None) -> float:
    """Microseconds per call of ``fn`` over ``iters`` calls after a warm-up (which compiles); ``spent``
    (:func:`time_callbacks`'s) is reset after the warm-up."""
    sync(fn())
    if spent is not None:
        spent[0] = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        r = fn()
    sync(r)
    return (time.perf_counter() - start) / iters * 1e6


def time_callbacks(cfj) -> list:
    """``[seconds]`` spent inside cuflash's buffer_callback bodies since the last reset (a list, reset by
    :func:`per_call`)."""
    spent = [0.0]
    call = cfj._BufferCall.__call__

    def timed(self, ctx, outs, *leaves):
        start = time.perf_counter()
        try:
            call(self, ctx, outs, *leaves)
        finally:
            spent[0] += time.perf_counter() - start

    cfj._BufferCall.__call__ = timed
    return spent


def cpu_profile(shapes: list[str], dtype: str, causal: bool, iters: int) -> None:
    """``--cpu-profile``: Python calls and device copies inside cuflash's callbacks per jitted call, no GPU."""
    import cProfile
    import ctypes
    import pstats
    import sys
    import types
    from pathlib import Path

    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _fake_cupy import _Memory, install

    patch = pytest.MonkeyPatch()
    module, _ = install(patch)  # a stand-in cupy in sys.modules, the launcher bound to it
    import jax
    import jax.numpy as jnp

    import cuflash.jax as cfj
    from cuflash._cuda import attention, compile

    no_launch = lambda *args, **kwargs: None  # noqa: E731
    for owner in (attention._RUNTIME, attention, compile):
        patch.setattr(owner, "launch", no_launch)
    copies = [0]

    def copy(dst, src, nbytes, stream=None):
        copies[0] += 1
        ctypes.memmove(dst.ptr, src.ptr, nbytes)

    class Context:  # Device and ExternalStream: entered and left
        def __init__(self, arg):
            self.ptr = arg

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    module.cuda.Device = module.cuda.ExternalStream = Context
    module.cuda.UnownedMemory = lambda ptr, size, owner, ordinal: types.SimpleNamespace(ptr=ptr, size=size)
    module.cuda.MemoryPointer = lambda mem, offset: (ctypes.c_char * mem.size).from_address(mem.ptr + offset)
    patch.setattr(_Memory, "copy_from_device_async", copy, raising=False)

    class Buffer:  # what the callback reads of an XLA FFI buffer on a GPU
        def __init__(self, buf):
            self.shape, self.dtype = buf.shape, buf.dtype
            self.__cuda_array_interface__ = {"data": (np.asarray(buf).__array_interface__["data"][0], False)}

        def __dlpack_device__(self):
            return 2, 0

    profile = [None]
    buffer_callback = cfj._buffer_callback

    def as_cuda(callback, result_shapes, **kwargs):
        def call(ctx, outs, *args):
            outs, args = (jax.tree_util.tree_map(Buffer, x) for x in (outs, args))
            if profile[0] is not None:
                profile[0].enable()
            try:
                return callback(types.SimpleNamespace(stream=0x5A), outs, *args)
            finally:
                if profile[0] is not None:
                    profile[0].disable()
        return buffer_callback(call, result_shapes, **kwargs)

    patch.setattr(cfj, "_buffer_callback", as_cuda)
    patch.setenv("CUFLASH_JAX_CALLBACK", "buffer")
    print(f"cuflash.jax buffer route, GPU side on JAX {jax.__version__}'s CPU (stand-in CuPy, launches stubbed); "
          f"{dtype}, causal={causal}: per jitted call, inside cuflash's callbacks")
    cpu = jax.devices("cpu")[0]
    for text in shapes:
        b, n, h, d = (int(x) for x in text.split("x"))
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.device_put(jax.random.normal(key, (b, n, h, d), getattr(jnp, dtype)), cpu)
                       for key in keys)
        fwd = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=causal))
        fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: cfj.attention(*a, causal=causal), q, k, v)[1](do))
        for what, fn, args in (("forward", fwd, (q, k, v)), ("fwd+bwd", fwd_bwd, (q, k, v, do))):
            for _ in range(3):  # compile, plan, views
                jax.block_until_ready(fn(*args))
            copies[0], profile[0] = 0, cProfile.Profile()
            for _ in range(iters):
                jax.block_until_ready(fn(*args))
            calls = pstats.Stats(profile[0]).total_calls / iters
            profile[0] = None
            print(f"{text:20s} {what:8s} {calls:6.0f} Python calls {copies[0] / iters:4.0f} device copies", flush=True)
    patch.undo()


def in_program(shapes: list[str], dtype_name: str, causal: bool, calls: int, iters: int) -> None:
    """``--in-program``: per forward call, K chained calls in one jitted program (kernel route) against K raw
    launches."""
    import cupy
    import jax
    import jax.numpy as jnp

    import cuflash
    import cuflash.jax as cfj
    from cuflash._cuda import attention as cuda_attention

    os.environ["CUFLASH_JAX_KERNEL_CALL"] = "1"
    gpu = next(d for d in jax.devices() if d.platform == "gpu")
    dtype = getattr(jnp, dtype_name)
    reps = max(1, iters // calls)
    print(f"JAX {jax.__version__} on {gpu.device_kind}; {dtype_name}, causal={causal}; forward, {calls} calls a "
          "program; microseconds per call")
    print(f"{'shape':20s} {'raw':>10s} {'in jit':>10s} {'over':>10s}")
    for text in shapes:
        b, n, h, d = (int(x) for x in text.split("x"))
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.device_put(jax.random.normal(key, (b, n, h, d), dtype), gpu) for key in keys)
        cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
        stream = cupy.cuda.get_current_stream()

        @jax.jit
        def chain(q, k, v):
            for _ in range(calls):
                q = cfj.attention(q, k, v, causal=causal)
            return q

        # The raw launches: the plan's arguments staged once, then cuLaunchKernel back to back (the kernel call's
        # launch: jaxlib loads the flat entry point of the same kernel, cuflash.jax plans the cp.async one)
        out, lse = cuflash.attention(cq, ck, cv, causal=causal, return_lse=True)
        variant = cuflash._ops.variant.Variant(causal=causal)
        cuda_attention.TMA_FORWARD, tma = False, cuda_attention.TMA_FORWARD
        plan = cuda_attention.ForwardPlan(cq, ck, cv, scale=d ** -0.5, variant=variant, block_q=None, block_k=None)
        cuda_attention.TMA_FORWARD = tma
        with plan._lock:
            plan.stage(cq.data.ptr, ck.data.ptr, cv.data.ptr, out.data.ptr, lse.data.ptr, variant.arrays)

        def raw():
            with plan._lock:
                for _ in range(calls):
                    plan.launch_staged(stream.ptr)

        t_raw = per_call(raw, lambda *_: stream.synchronize(), reps) / calls
        t_jit = per_call(lambda: chain(q, k, v), jax.block_until_ready, reps) / calls
        print(f"{text:20s} {t_raw:10.1f} {t_jit:10.1f} {t_jit - t_raw:+10.1f}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None,
                        help="default 1x128x8x64,1x512x16x64,2x2048x16x128,4x4096x32x128 (--cpu-profile: the first two)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--routes", default="buffer", help="comma-separated: buffer, kernel, pure")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--split", action="store_true", help="also the time inside cuflash's callbacks per call")
    parser.add_argument("--max-tma-flop", type=float, default=None,
                        help="cuflash.jax.KERNEL_CALL_MAX_TMA_FLOP for this run (inf: the kernel call at any size)")
    parser.add_argument("--backward-kernel-calls", action="store_true",
                        help="the kernel route takes the backward too (cuflash.jax.BACKWARD_KERNEL_CALLS)")
    parser.add_argument("--in-program", type=int, default=0, metavar="K",
                        help="K chained calls inside one jitted program against K raw launches (kernel route)")
    parser.add_argument("--cpu-profile", action="store_true",
                        help="no GPU: Python calls and copies inside the callbacks, on JAX's CPU with a stand-in CuPy")
    args = parser.parse_args(argv)
    if args.cpu_profile:
        cpu_profile((args.shapes or "1x128x8x64,1x512x16x64").split(","), args.dtype, args.causal, args.iters)
        return
    args.shapes = args.shapes or "1x128x8x64,1x512x16x64,2x2048x16x128,4x4096x32x128"
    if args.in_program:
        in_program(args.shapes.split(","), args.dtype, args.causal, args.in_program, args.iters)
        return

    import cupy
    import jax
    import jax.numpy as jnp

    import cuflash
    import cuflash.jax as cfj

    cfj.BACKWARD_KERNEL_CALLS = args.backward_kernel_calls
    if args.max_tma_flop is not None:
        cfj.KERNEL_CALL_MAX_TMA_FLOP = args.max_tma_flop
    gpu = next((d for d in jax.devices() if d.platform == "gpu"), None)
    if gpu is None:
        raise SystemExit(f"no JAX GPU device (JAX {jax.__version__}, backend {jax.default_backend()})")
    dtype = getattr(jnp, args.dtype)
    routes = [r for r in args.routes.split(",") if r]
    print(f"JAX {jax.__version__} on {gpu.device_kind}; CuPy {cupy.__version__}; {args.dtype}, "
          f"causal={args.causal}; default route: {cfj.callback_route()}; microseconds per call")
    header = f"{'shape':20s} {'pass':8s} {'cupy':>10s}" + "".join(f" {'jit/' + r:>12s}" for r in routes)
    split = args.split and "buffer" in routes
    timed = [r for r in ("buffer", "kernel") if r in routes]  # (the routes whose overhead is printed)
    print(header + "".join(f" {'over/' + r:>12s}" for r in timed) + (f" {'callback':>10s}" if split else ""))
    spent = time_callbacks(cfj) if split else None
    causal = args.causal
    # JAX's own floor: a jitted function of one elementwise kernel on an array of the first shape
    b, n, h, d = (int(x) for x in args.shapes.split(",")[0].split("x"))
    x = jax.device_put(jnp.ones((b, n, h, d), dtype), gpu)
    floor = jax.jit(lambda x: x * 2)
    print(f"jit floor (one elementwise kernel, {b}x{n}x{h}x{d}): {per_call(lambda: floor(x), jax.block_until_ready, args.iters):.1f}")
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
        inside = {}  # pass -> microseconds inside cuflash's callbacks per jitted call (buffer route, --split)
        for route in routes:
            # (read when the functions below are traced)
            os.environ["CUFLASH_JAX_CALLBACK"] = "buffer" if route == "kernel" else route
            os.environ["CUFLASH_JAX_KERNEL_CALL"] = "1" if route == "kernel" else "0"
            fwd = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=causal))
            fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: cfj.attention(*a, causal=causal), q, k, v)[1](do))
            iters = args.iters if route != "pure" else max(1, args.iters // 20)
            watch = spent if route == "buffer" else None
            for what, fn in (("forward", lambda: fwd(q, k, v)), ("fwd+bwd", lambda: fwd_bwd(q, k, v, do))):
                times[what].append(per_call(fn, jx_sync, iters, watch))
                if watch is not None:
                    inside[what] = watch[0] / iters * 1e6
        os.environ.pop("CUFLASH_JAX_CALLBACK", None)
        os.environ.pop("CUFLASH_JAX_KERNEL_CALL", None)
        for what, ts in times.items():
            line = f"{text:20s} {what:8s} {ts[0]:10.1f}" + "".join(f" {t:12.1f}" for t in ts[1:])
            line += "".join(f" {ts[1 + routes.index(r)] - ts[0]:+12.1f}" for r in timed)
            if split:
                line += f" {inside[what]:10.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
