"""``python -m cuflash bench-decode``: one decode step (one new query token per sequence against a KV cache), the
achieved bandwidth side by side with PyTorch's SDPA backends and the device's copy bandwidth, in one process.

Decoding reads the whole cache for one token, so its cost is memory traffic: the figure of merit is the
bandwidth ``bytes of K and V read / time`` against what a plain device copy reaches (``docs/decoding.md``).
On a GPU it first measures the host time of a call (a tiny step, batch 1 and 256 cached tokens, whose GPU work
is a few microseconds: ``--host-calls`` calls without synchronizing, timed with ``time.perf_counter``) through the
front door, through a plan's run and as a CUDA graph's launch; then, for each batch and cache length, it checks
cuflash's output against SDPA's and times cuflash through the front door and through a plan
(``cuflash.plan_kvcache``) beside every SDPA backend that runs the shape, and prints a table (``--json`` writes it,
``--plot`` draws bandwidth against cache length). Without a GPU it runs the NumPy reference at small sizes, so the
command and its table stay exercised on any machine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflash bench-decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default: 1 4 32 on a GPU)")
    p.add_argument("--cache", type=int, nargs="+", default=None, help="cached tokens (default: 4096 16384 65536)")
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--num-splits", type=int, nargs="+", default=None, metavar="S",
                   help="also time each row's plan (and its paged rows) at these split counts")
    p.add_argument("--page-size", type=int, nargs="+", default=None, metavar="P",
                   help="also time paged caches of these page sizes (a shuffled page pool) beside each contiguous row")
    p.add_argument("--mla", action="store_true",
                   help="MLA's absorbed decoding instead: one latent head of 576 (V: its first 512 dims), 128 query "
                        "heads, page 64 (default batch 1 8 32 64 128, cache 4096 16384 32768): TB/s and TFLOP/s")
    p.add_argument("--cascade", action="store_true",
                   help="shared-prefix decoding instead: cuflash.cascade_attention against the unshared call (the "
                        "prefix copied into every sequence's cache); --cache gives the prefix lengths (default "
                        "8192), --batch the batch (default 64), each sequence's own suffix 256-1024 tokens")
    p.add_argument("--prefill", action="store_true",
                   help="chunked prefill instead: --new-tokens new tokens appended to a cache of --cache tokens "
                        "(default 8192 32768) through attention_with_kvcache (the forward over the cache), beside "
                        "cuflash.attention on the same work and the decode kernels forced")
    p.add_argument("--new-tokens", type=int, nargs="+", default=None, help="--prefill: new tokens (default 512 2048)")
    p.add_argument("--seqlen-q", type=int, default=1, help="query tokens per sequence (--mla; 2: speculative)")
    p.add_argument("--mla-heads", type=int, default=128,
                   help="--mla: query heads (128: DeepSeek-V3's, compute-bound; 16: its share of 8 GPUs, memory-bound)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="time budget per measurement (GPU)")
    p.add_argument("--host-calls", type=int, default=200,
                   help="calls per host-time measurement (GPU; batch 1, cache 256, no synchronization)")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--plot", default=None, help="write a bandwidth plot (PNG) here")
    return p


def _kv_bytes(batch: int, cache: int, heads_kv: int, d: int, itemsize: int) -> int:
    return 2 * batch * cache * heads_kv * d * itemsize


def _copy_bandwidth(timed, dev) -> float:
    """Bytes read and written per second by a device-to-device copy of 1 GiB."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src))


def _host_times(cupy, cuflash, hq: int, hkv: int, d: int, calls: int) -> dict:
    """Host microseconds per call of a decode step whose GPU work is tiny (batch 1, 256 cached tokens, one token
    appended): ``calls`` calls enqueued without synchronizing, timed with time.perf_counter, for the front door
    (allocating out and lse, and with out=), a plan's run with out= and lse= (the same arrays every step, and new
    q, k, v objects every step as a model's projections are), and a CUDA graph of that run."""
    rng = np.random.default_rng(0)
    cache, batch = 256, 1
    dtype = np.float16

    def dev(*shape):
        return cupy.asarray(rng.standard_normal(shape).astype(dtype))

    q, k, v = dev(batch, 1, hq, d), dev(batch, 1, hkv, d), dev(batch, 1, hkv, d)
    k_cache, v_cache = dev(batch, cache, hkv, d), dev(batch, cache, hkv, d)
    lens = cupy.full(batch, cache - 1, dtype=cupy.int32)  # room for the appended token (the same slot each call)
    out = cupy.empty((batch, 1, hq, d), dtype=dtype)
    lse = cupy.empty((batch, hq, 1), dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    from .._cuda import decode

    with stream:
        plan = cuflash.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, out=out)
        fused, decode.FUSE_APPEND = decode.FUSE_APPEND, False
        try:  # the same step with the append kernel first (two launches), for comparison
            plan_two = cuflash.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, out=out)
        finally:
            decode.FUSE_APPEND = fused
        plan_two.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, out=out, lse=lse)
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, out=out, lse=lse)
        stream.synchronize()
        stream.begin_capture()
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, out=out, lse=lse)
        graph = stream.end_capture()
        news = [(dev(batch, 1, hq, d), dev(batch, 1, hkv, d), dev(batch, 1, hkv, d)) for _ in range(2)]
        turn = [0]

        def new_qkv(plan=plan):
            turn[0] ^= 1
            nq, nk, nv = news[turn[0]]
            plan.run(nq, k_cache, v_cache, nk, nv, cache_seqlens=lens, out=out, lse=lse)

        launches = plan._runner.__self__.launches_per_step
        launches_two = plan_two._runner.__self__.launches_per_step

        cases = {
            "front door (allocating out, lse)":
                lambda: cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True),
            "front door with out=":
                lambda: cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                                       out=out),
            "plan.run with out=, lse=":
                lambda: plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, out=out, lse=lse),
            f"plan.run, new q, k, v every step ({launches} launch{'es' if launches > 1 else ''})": new_qkv,
            f"the same, append kernel first ({launches_two} launches)": lambda: new_qkv(plan_two),
            "CUDA graph of plan.run: graph.launch()": lambda: graph.launch(stream),
        }
        steps = plan._runner.__self__._steps  # the launches of the plan's DecodeLaunch, for their share alone
        argv = plan._runner.__self__._argv_ptr
        launch = cupy.cuda.driver.launchKernel

        def launches_alone():
            for fn, gx, gy, gz, threads, smem in steps:
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream.ptr, argv, 0)
        cases[f"its {len(steps)} cuLaunchKernel calls alone"] = launches_alone
        times = {}
        for name, fn in cases.items():
            for _ in range(10):
                fn()
            stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host = (time.perf_counter() - t0) / calls
            stream.synchronize()
            times[name] = host * 1e6
    print(f"host time per call (batch {batch}, cache {cache}, {hq}/{hkv} heads, d {d}, one token appended, "
          f"{plan.num_splits} splits; a step is {launches} launch{'es' if launches > 1 else ''}: "
          f"{_STEP_WORDS[launches]}; {calls} calls without synchronizing):")
    for name, us in times.items():
        print(f"  {name:40s} {us:7.1f} us")
    return times


class _HostArray:
    """A NumPy array seen as a CuPy array by the decode launcher (shape, strides, dtype, data.ptr): host memory
    standing in for the device's, for :func:`host_path_times`."""

    __slots__ = ("host", "shape", "strides", "dtype", "itemsize", "size", "ndim", "data", "__weakref__")

    def __init__(self, host: np.ndarray):
        self.host, self.shape, self.strides, self.dtype = host, host.shape, host.strides, host.dtype
        self.itemsize, self.size, self.ndim = host.itemsize, host.size, host.ndim
        self.data = _Pointer(host.ctypes.data)


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class _HostRuntime:
    """The decode launcher's runtime (cuflash._cuda.decode.CupyRuntime's attributes) with host memory and
    launches that do nothing: what is left of a step is its Python."""

    float32 = np.float32

    def __init__(self, launch=None):
        self.launch = launch or (lambda *args: None)
        self._stream = _Pointer(0)

    def empty(self, shape, dtype):
        return _HostArray(np.empty(shape, dtype))

    def zeros(self, shape, dtype):
        return _HostArray(np.zeros(shape, dtype))

    def kept(self, shape, dtype, zero=False):
        return _HostArray(np.zeros(shape, dtype))

    def current_stream(self):
        return self._stream

    def get_device(self):
        return 0

    def check_supported(self, q, k_cache, v_cache):
        pass

    def function(self, spec):
        return 0, None

    def make_context_current(self):
        pass


def host_path_cases(*, hq: int = 32, hkv: int = 8, d: int = 128, launch=None) -> dict:
    """The steps :func:`host_path_times` times, each a function of the step's index: a plan (``DecodePlan`` over a
    ``DecodeLaunch``) of the host-time shape (batch 1, 256 cached tokens, one token appended, causal), built with a
    stand-in runtime whose memory is NumPy's and whose launches do nothing (``launch``: a function to call
    instead). Three steps: the decode loop's over persistent buffers (the same arrays every step, out= and lse=
    given: the record already holds their addresses), a model's (new q, k, v objects every step, the caches,
    lengths, out and lse kept: those three are compared and written) and one with new out and lse arrays."""
    from .._ops import api as _api
    from .._cuda.decode import DecodeLaunch
    from .._ops.decode_plan import DecodePlan, layouts_of

    rng = np.random.default_rng(0)
    cache, batch = 256, 1
    host = {"q": (batch, 1, hq, d), "k_cache": (batch, cache, hkv, d), "v_cache": (batch, cache, hkv, d),
            "k": (batch, 1, hkv, d), "v": (batch, 1, hkv, d)}
    host = {name: rng.standard_normal(shape).astype(np.float16) for name, shape in host.items()}
    lens = np.full(batch, cache - 1, np.int32)
    _, problem, kv, scale, variant = _api._kvcache_call(
        host["q"], host["k_cache"], host["v_cache"], host["k"], host["v"], cache_seqlens=lens, rotary_cos=None,
        rotary_sin=None, rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None, block_table=None,
        causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None, num_splits=0, out=None)
    arrays = {name: _HostArray(a) for name, a in host.items()}
    q, k_cache, v_cache, k, v = (arrays[n] for n in ("q", "k_cache", "v_cache", "k", "v"))
    lens_d = _HostArray(lens)
    runtime = _HostRuntime(launch)
    launch_ = DecodeLaunch(q, k_cache, v_cache, k, v, cache=kv, scale=scale, variant=variant, runtime=runtime)
    layouts = layouts_of(q, k_cache, v_cache, k, v, lens_d, None, None, None, None, None, None)
    out = runtime.empty(launch_.out_shape, np.float16)
    lse = runtime.empty(launch_.lse_shape, np.float32)
    plan = DecodePlan(layouts, launch_.run, out_layout=layouts_of(out)[0], lse_layout=layouts_of(lse)[0],
                      num_splits=launch_.num_splits, xp=None, launch=launch_)
    outs = [(runtime.empty(launch_.out_shape, np.float16), runtime.empty(launch_.lse_shape, np.float32))
            for _ in range(2)]
    news = [tuple(_HostArray(host[name].copy()) for name in ("q", "k", "v")) for _ in range(2)]
    cases = {
        "plan.run, the same arrays (out=, lse=)":
            lambda i: plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens_d, out=out, lse=lse),
        "plan.run, new q, k, v arrays":
            lambda i: plan.run(news[i & 1][0], k_cache, v_cache, news[i & 1][1], news[i & 1][2],
                               cache_seqlens=lens_d, out=out, lse=lse),
        "plan.run, new out= and lse= arrays":
            lambda i: plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens_d, out=outs[i & 1][0],
                               lse=outs[i & 1][1]),
    }
    cases["launches per step"] = launch_.launches_per_step
    return cases


def host_path_times(calls: int = 20000, *, hq: int = 32, hkv: int = 8, d: int = 128, launch=None) -> dict:
    """Host microseconds per step of the decode launcher's Python path alone, on any machine: the steps of
    :func:`host_path_cases`, best of five runs of ``calls / 5`` steps. The launches themselves (``cuLaunchKernel``,
    one or two per step) come on top on a GPU."""
    cases = host_path_cases(hq=hq, hkv=hkv, d=d, launch=launch)
    launches = cases.pop("launches per step")
    times = {}
    for name, fn in cases.items():
        for i in range(100):
            fn(i)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(calls // 5):
                fn(i)
            best = min(best, (time.perf_counter() - t0) / (calls // 5))
        times[name] = best * 1e6
    times["launches per step"] = launches
    return times


# What a decode step with one new token launches, by its number of launches (cuflash._cuda.decode.DecodeLaunch).
_STEP_WORDS = {1: "the split kernel appending the new tokens and merging its splits",
               2: "the append kernel, then the split kernel merging its splits"}


def _print_host_path(times: dict) -> None:
    launches = times.pop("launches per step")
    print(f"host time of the launcher's Python path per step (stand-in runtime, launches not made; a step is "
          f"{launches} launch{'es' if launches > 1 else ''}: {_STEP_WORDS[launches]}):")
    for name, us in times.items():
        print(f"  {name:40s} {us:7.2f} us")


def _attention_f32(torch, q, k, v):
    """One query token of one sequence in float32: q ``(heads_q, d)``, k and v ``(n, heads_kv, d)`` (GQA)."""
    heads_q, d = q.shape
    heads_kv = k.shape[1]
    qg = q.float().view(heads_kv, heads_q // heads_kv, d)
    p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k.float()) / d ** 0.5, dim=-1)
    return torch.einsum("kgn,nkd->kgd", p, v.float()).reshape(heads_q, d)


def _timer(torch, rep_ms: float):
    """Seconds per call of a function, by CUDA events around each call until ``rep_ms`` are spent (3 calls at
    least), after one untimed call."""
    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps, spent, total = 0, 0.0, 0.0
        while spent < rep_ms or reps < 3:
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
            total, spent, reps = total + ms, spent + ms, reps + 1
        return total / reps * 1e-3
    return timed


def _back_to_back(torch, fn, calls: int = 20, reps: int = 5) -> float:
    """Seconds per call of ``calls`` calls enqueued back to back between two CUDA events (the median of ``reps``):
    the kernels' own time, the host's work hidden behind the GPU's, as in a model's loop of layers. (``_timer``
    synchronizes around each call, so a call's host time before its launch counts there.)"""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / calls)
    return float(np.median(times))


def _side_by_side(timed, *fns, rounds: int = 5) -> list[float]:
    """Seconds per call of each function: ``timed`` of each in turn, ``rounds`` times, the median of each (a slow
    moment of the machine falls on one round of every function, not on all of one)."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for spent, fn in zip(times, fns):
            spent.append(timed(fn))
    return [float(np.median(t)) for t in times]


def _gpu_rows(args) -> list[dict]:
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    dev = torch.device("cuda")
    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    timed = _timer(torch, args.rep_ms)

    _print_host_path(host_path_times(hq=hq, hkv=hkv, d=d))
    copy_bw = _copy_bandwidth(timed, dev)
    print(f"device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write of 1 GiB)")
    host = _host_times(cupy, cuflash, hq, hkv, d, args.host_calls)

    rows = []
    for batch in args.batch or (1, 4, 32):
        for cache in args.cache or (4096, 16384, 65536):
            q = torch.randn(batch, 1, hq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(batch, cache, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            nbytes = _kv_bytes(batch, cache, hkv, d, 2)
            row = dict(batch=batch, cache=cache, heads_q=hq, heads_kv=hkv, head_dim=d, kv_bytes=nbytes,
                       copy_tbs=copy_bw / 1e12, **{f"host_us[{name}]": us for name, us in host.items()})
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
                try:
                    with sdpa_kernel(backend):
                        s = timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
                    row[f"sdpa_{name}_us"] = s * 1e6
                except RuntimeError:
                    row[f"sdpa_{name}_us"] = None
            sdpa = [(row[f"sdpa_{n}_us"], n) for n in ("flash", "efficient", "cudnn", "math") if row[f"sdpa_{n}_us"]]
            best_us, best = min(sdpa)
            row.update(sdpa_best=best, sdpa_best_us=best_us, sdpa_tbs=nbytes / best_us / 1e6)

            cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
            lens = cupy.full(batch, cache, dtype=cupy.int32)
            stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
            with stream:
                # checked first: the first sequence against float32 attention on the same bfloat16 inputs
                got = torch.from_dlpack(cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens))
                err = float((got[0, 0].float() - _attention_f32(torch, q[0, 0], k[0], v[0])).abs().max())
                row["max_abs_err"] = err
                s = timed(lambda: cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens))
                plan = cuflash.plan_kvcache(cq, ck, cv, cache_seqlens=lens)
                out, lse = cupy.empty(plan.out_shape, dtype=cq.dtype), cupy.empty(plan.lse_shape, dtype=cupy.float32)
                s_plan = timed(lambda: plan.run(cq, ck, cv, cache_seqlens=lens, out=out, lse=lse))
            row.update(cuflash_us=s * 1e6, cuflash_tbs=nbytes / s / 1e12, cuflash_plan_us=s_plan * 1e6,
                       cuflash_plan_tbs=nbytes / s_plan / 1e12, num_splits=plan.num_splits)
            rows.append(row)
            flag = "" if err <= 2e-2 else f"  MISMATCH: max |cuflash - float32 SDPA| = {err:.3g}"
            print(f"batch {batch:3d} cache {cache:6d}: cuflash {s * 1e6:8.1f} us {row['cuflash_tbs']:5.2f} TB/s | "
                  f"plan {s_plan * 1e6:8.1f} us {row['cuflash_plan_tbs']:5.2f} TB/s ({plan.num_splits:2d} splits) | "
                  f"SDPA {best:9s} {best_us:8.1f} us {row['sdpa_tbs']:5.2f} TB/s | err {err:.1e}{flag}")
            for page in args.page_size or ():
                with stream:
                    paged = _paged_row(cupy, timed, cq, ck, cv, lens, page, s_plan)
                row[f"paged{page}_us"], row[f"paged{page}_tbs"] = paged["us"], nbytes / paged["us"] / 1e6
                row[f"paged{page}_vs_contiguous"] = paged["ratio"]
                print(f"    paged, page {page:3d}: plan {paged['us']:8.1f} us {nbytes / paged['us'] / 1e6:5.2f} TB/s "
                      f"= {paged['ratio']:.2f}x contiguous | max |paged - contiguous| {paged['diff']:.1e}")
            for splits in args.num_splits or ():  # the split rule's choice against others, contiguous and paged
                with stream:
                    other = cuflash.plan_kvcache(cq, ck, cv, cache_seqlens=lens, num_splits=splits)
                    s_other = timed(lambda: other.run(cq, ck, cv, cache_seqlens=lens, out=out, lse=lse))
                    line = f"    {splits:3d} splits: plan {s_other * 1e6:8.1f} us {nbytes / s_other / 1e12:5.2f} TB/s"
                    row[f"splits{splits}_us"] = s_other * 1e6
                    for page in args.page_size or ():
                        paged = _paged_row(cupy, timed, cq, ck, cv, lens, page, s_other, splits)
                        row[f"splits{splits}_paged{page}_us"] = paged["us"]
                        line += f" | page {page}: {paged['us']:8.1f} us = {paged['ratio']:.2f}x"
                print(line)
    return rows


def _paged_row(cupy, timed, q, k, v, lens, page: int, contiguous_s: float, num_splits: int = 0) -> dict:
    """The same step over a paged copy of the cache (a shuffled pool of pages of ``page`` slots, the block table
    mapping each sequence's slots to them) through a plan: its time, its ratio to the contiguous plan's and the
    largest difference of the outputs (none is expected: the same keys in the same order)."""
    import cuflash

    batch, cache, heads_kv, d = k.shape
    pages = -(-cache // page)
    rng = np.random.default_rng(page)
    table = cupy.asarray(rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages))
    pool_k = cupy.empty((batch * pages, page, heads_kv, d), dtype=k.dtype)
    pool_v = cupy.empty_like(pool_k)
    padded = pages * page
    for src, dst in ((k, pool_k), (v, pool_v)):
        full = cupy.zeros((batch, padded, heads_kv, d), dtype=k.dtype)
        full[:, :cache] = src
        dst[table.reshape(-1)] = full.reshape(batch * pages, page, heads_kv, d)
        del full
    plan = cuflash.plan_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=table, num_splits=num_splits)
    out, lse = cupy.empty(plan.out_shape, dtype=q.dtype), cupy.empty(plan.lse_shape, dtype=cupy.float32)
    plan.run(q, pool_k, pool_v, cache_seqlens=lens, block_table=table, out=out, lse=lse)
    want = cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens)
    diff = float(cupy.abs(out.astype(cupy.float32) - want.astype(cupy.float32)).max())
    s = timed(lambda: plan.run(q, pool_k, pool_v, cache_seqlens=lens, block_table=table, out=out, lse=lse))
    return {"us": s * 1e6, "ratio": contiguous_s / s, "diff": diff}


MLA_D, MLA_DV, MLA_HEADS, MLA_PAGE = 576, 512, 128, 64


def _mla_flops(batch: int, seqlen_q: int, heads: int, cache: int) -> float:
    """Absorbed MLA's matrix products: q K^T over 576 dims and P V over 512, per query row and key."""
    return 2.0 * batch * seqlen_q * heads * cache * (MLA_D + MLA_DV)


def _mla_rows(args) -> list[dict]:
    """MLA's absorbed decoding (DeepSeek-V3's shape): one latent key/value head of 576 dims (V its first 512),
    128 query heads, a paged cache of page 64, bfloat16. Bytes: the latent cache read once (batch x cache x 576 x
    2); FLOPs: 2 x rows x cache x (576 + 512). Beside it: plain torch on a contiguous cache (q K^T, softmax,
    P V as batched matrix products, the absorbed computation) and every SDPA backend that takes the shape (q
    128 heads, k and v one head, enable_gqa), the best of them printed."""
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    dev = torch.device("cuda")
    timed = _timer(torch, args.rep_ms)
    sq, heads = args.seqlen_q, args.mla_heads
    scale = 1.0 / (128 + 64) ** 0.5  # DeepSeek's: the unabsorbed head dim
    rows = []
    for batch in args.batch or (1, 8, 32, 64, 128):
        for cache in args.cache or (4096, 16384, 32768):
            pages = -(-cache // MLA_PAGE)
            q = torch.randn(batch, sq, heads, MLA_D, device=dev, dtype=torch.bfloat16)
            kc = torch.randn(batch, cache, 1, MLA_D, device=dev, dtype=torch.bfloat16)
            nbytes = batch * cache * MLA_D * 2
            flops = _mla_flops(batch, sq, heads, cache)
            row = dict(mla=True, batch=batch, cache=cache, seqlen_q=sq, heads_q=heads, head_dim=MLA_D,
                       head_dim_v=MLA_DV, page_size=MLA_PAGE, kv_bytes=nbytes, flops=flops)

            # torch, absorbed, contiguous: (batch, sq * heads, 576) x (batch, 576, cache) -> softmax -> x V
            qf = q.reshape(batch, sq * heads, MLA_D)
            kt = kc[:, :, 0]
            mask = None
            if sq > 1:  # causal, bottom-right: query token t sees keys <= cache - sq + t
                t = torch.arange(sq, device=dev).repeat_interleave(heads)[:, None]
                mask = torch.arange(cache, device=dev)[None, :] > cache - sq + t

            def torch_mla():
                s = torch.matmul(qf, kt.transpose(1, 2)).float() * scale
                if mask is not None:
                    s = s.masked_fill(mask, float("-inf"))
                return torch.matmul(torch.softmax(s, dim=-1).to(torch.bfloat16), kt[..., :MLA_DV])
            try:
                # the check's reference in float32 (torch_mla rounds S to bfloat16: errors of a few 1e-2)
                s32 = torch.matmul(qf.float(), kt.float().transpose(1, 2)) * scale
                if mask is not None:
                    s32 = s32.masked_fill(mask, float("-inf"))
                want = torch.matmul(torch.softmax(s32, dim=-1), kt[..., :MLA_DV].float())
                del s32
                row["torch_matmul_us"] = timed(torch_mla) * 1e6
            except torch.OutOfMemoryError:
                want, row["torch_matmul_us"] = None, None
            torch.cuda.empty_cache()
            qs, ks = q.transpose(1, 2), kc.transpose(1, 2)
            # SDPA's is_causal is top-left aligned: bottom-right causal (query t sees keys <= cache - sq + t) as a mask
            sees = None if sq == 1 else (torch.arange(cache, device=dev)[None, :]
                                         <= cache - sq + torch.arange(sq, device=dev)[:, None])
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        fn = lambda: F.scaled_dot_product_attention(qs, ks, ks[..., :MLA_DV], attn_mask=sees,
                                                                    scale=scale, enable_gqa=True)
                        row[f"sdpa_{name}_us"] = timed(fn) * 1e6
                except (RuntimeError, torch.OutOfMemoryError):
                    row[f"sdpa_{name}_us"] = None
            base = [(row[k], k[:-3]) for k in ("torch_matmul_us", "sdpa_flash_us", "sdpa_efficient_us", "sdpa_cudnn_us")
                    if row.get(k)]
            best_us, best = min(base) if base else (None, "none")
            row.update(torch_best=best, torch_best_us=best_us)

            # cuflash: the same cache, paged (a shuffled pool of 64-slot pages), V a view of K
            rng = np.random.default_rng(batch)
            perm = rng.permutation(batch * pages).astype(np.int32)
            table = torch.from_numpy(perm.reshape(batch, pages)).to(dev)
            pool = torch.zeros(batch * pages, MLA_PAGE, 1, MLA_D, device=dev, dtype=torch.bfloat16)
            full = torch.zeros(batch, pages * MLA_PAGE, 1, MLA_D, device=dev, dtype=torch.bfloat16)
            full[:, :cache] = kc
            pool[table.reshape(-1).long()] = full.reshape(batch * pages, MLA_PAGE, 1, MLA_D)
            del full
            stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
            with stream:
                cq, cpool, ctable = (cupy.from_dlpack(x) for x in (q, pool, table))
                lens = cupy.full(batch, cache, dtype=cupy.int32)
                plan = cuflash.plan_kvcache(cq, cpool, cpool[..., :MLA_DV], cache_seqlens=lens, block_table=ctable,
                                            softmax_scale=scale, causal=sq > 1)
                out = cupy.empty(plan.out_shape, dtype=cq.dtype)
                lse = cupy.empty(plan.lse_shape, dtype=cupy.float32)
                plan.run(cq, cpool, cpool[..., :MLA_DV], cache_seqlens=lens, block_table=ctable, out=out, lse=lse)
                got = torch.from_dlpack(out).reshape(batch, sq * heads, MLA_DV)
                err = None if want is None else float((got.float() - want.float()).abs().max())
                vview = cpool[..., :MLA_DV]
                s = timed(lambda: plan.run(cq, cpool, vview, cache_seqlens=lens, block_table=ctable, out=out,
                                           lse=lse))
                s_b2b = _back_to_back(torch, lambda: plan.run(cq, cpool, vview, cache_seqlens=lens,
                                                              block_table=ctable, out=out, lse=lse))
                from .._cuda import spec as cuda_spec

                def timed_without(switch):
                    """The same call planned with one of the launcher's switches off, timed."""
                    setattr(cuda_spec, switch, False)
                    try:
                        other = cuflash.plan_kvcache(cq, cpool, vview, cache_seqlens=lens, block_table=ctable,
                                                     softmax_scale=scale, causal=sq > 1)
                    finally:
                        setattr(cuda_spec, switch, True)
                    return timed(lambda: other.run(cq, cpool, vview, cache_seqlens=lens, block_table=ctable, out=out,
                                                   lse=lse))
                # the mma.sync kernel (sm_90 runs the wgmma one by default); the wgmma kernel's tiles by cp.async
                s_old, s_cp = timed_without("SM90A_DECODE"), timed_without("TMA_DECODE")
            row.update(cuflash_us=s * 1e6, cuflash_tbs=nbytes / s / 1e12, cuflash_tflops=flops / s / 1e12,
                       num_splits=plan.num_splits, max_abs_err=err, cuflash_mma_sync_us=s_old * 1e6,
                       cuflash_cp_async_us=s_cp * 1e6, cuflash_back_to_back_us=s_b2b * 1e6,
                       cuflash_back_to_back_tflops=flops / s_b2b / 1e12)
            rows.append(row)
            flag = "" if err is None or err <= 3e-2 else f"  MISMATCH: max |cuflash - torch| = {err:.3g}"
            base_txt = (f"{best:13s} {best_us:8.1f} us {nbytes / best_us / 1e6:5.2f} TB/s "
                        f"{flops / best_us / 1e6:6.1f} TFLOP/s" if best_us else "no torch baseline ran")
            print(f"MLA batch {batch:3d} cache {cache:6d} q {sq}: cuflash {s * 1e6:8.1f} us {row['cuflash_tbs']:5.2f} "
                  f"TB/s {row['cuflash_tflops']:6.1f} TFLOP/s ({plan.num_splits:2d} splits; back to back "
                  f"{s_b2b * 1e6:8.1f} us {nbytes / s_b2b / 1e12:5.2f} TB/s {flops / s_b2b / 1e12:6.1f} TFLOP/s; "
                  f"cp.async tiles {s_cp * 1e6:8.1f} us; mma.sync kernel {s_old * 1e6:8.1f} us) | torch {base_txt} | "
                  f"err {err if err is None else f'{err:.1e}'}{flag}")
    return rows


def _cpu_rows(args) -> list[dict]:
    import cuflash

    _print_host_path(host_path_times(hq=args.heads[0], hkv=args.heads[1], d=args.head_dim))

    rng = np.random.default_rng(0)
    hq, hkv, d = 4, 2, 32
    rows = []
    for batch in args.batch or (1, 2):
        for cache in args.cache or (256, 1024):
            q = rng.standard_normal((batch, 1, hq, d)).astype(np.float32)
            k, v = (rng.standard_normal((batch, cache, hkv, d)).astype(np.float32) for _ in range(2))
            lens = np.full(batch, cache, np.int32)
            t0 = time.perf_counter()
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens)
            s = time.perf_counter() - t0
            nbytes = _kv_bytes(batch, cache, hkv, d, 4)
            rows.append(dict(batch=batch, cache=cache, heads_q=hq, heads_kv=hkv, head_dim=d, kv_bytes=nbytes,
                             numpy_us=s * 1e6, numpy_gbs=nbytes / s / 1e9))
            print(f"batch {batch:3d} cache {cache:6d}: NumPy reference {s * 1e6:10.1f} us {nbytes / s / 1e9:6.2f} GB/s")
    return rows


def _cpu_mla_rows(args) -> list[dict]:
    """MLA through the NumPy reference at small sizes (16 heads, float32, page 64): the command stays exercised
    without a GPU."""
    import cuflash

    rng = np.random.default_rng(0)
    heads, sq, rows = 16, args.seqlen_q, []
    for batch in args.batch or (1, 2):
        for cache in args.cache or (256, 1024):
            pages = -(-cache // MLA_PAGE)
            q = rng.standard_normal((batch, sq, heads, MLA_D)).astype(np.float32)
            pool = rng.standard_normal((batch * pages, MLA_PAGE, 1, MLA_D)).astype(np.float32)
            table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
            lens = np.full(batch, cache, np.int32)
            t0 = time.perf_counter()
            cuflash.attention_with_kvcache(q, pool, pool[..., :MLA_DV], cache_seqlens=lens, block_table=table,
                                           softmax_scale=1 / 192 ** 0.5, causal=sq > 1)
            s = time.perf_counter() - t0
            nbytes, flops = batch * cache * MLA_D * 4, _mla_flops(batch, sq, heads, cache)
            rows.append(dict(mla=True, batch=batch, cache=cache, seqlen_q=sq, heads_q=heads, head_dim=MLA_D,
                             head_dim_v=MLA_DV, page_size=MLA_PAGE, kv_bytes=nbytes, flops=flops, numpy_us=s * 1e6,
                             numpy_gbs=nbytes / s / 1e9))
            print(f"MLA batch {batch:3d} cache {cache:6d} q {sq}: NumPy reference {s * 1e6:10.1f} us "
                  f"{nbytes / s / 1e9:6.2f} GB/s {flops / s / 1e9:7.2f} GFLOP/s")
    return rows


# ---------------------------------------------------------------------------------------------------
# --cascade: a shared prefix read once (cuflash.cascade_attention) against the unshared call
# ---------------------------------------------------------------------------------------------------

_SUFFIX_RANGE = (256, 1024)  # each sequence's own tokens after the shared prefix (GPU rows)


def _cascade_case(xp, rng, dtype, batch: int, prefix: int, suffix_range, hq: int, hkv: int, d: int) -> dict:
    """q, the shared prefix, each sequence's suffix cache and lengths, and the unshared cache (the prefix copied in
    front of every sequence's suffix), as arrays of ``xp``."""
    lo, hi = suffix_range
    lens = rng.integers(lo, hi + 1, batch).astype(np.int32)

    def draw(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    q, k_prefix, v_prefix = draw(batch, 1, hq, d), draw(prefix, hkv, d), draw(prefix, hkv, d)
    k_suffix, v_suffix = draw(batch, hi, hkv, d), draw(batch, hi, hkv, d)
    case = dict(q=q, k_prefix=k_prefix, v_prefix=v_prefix, k_suffix=k_suffix, v_suffix=v_suffix, lens=lens)
    case = {name: xp.asarray(a) for name, a in case.items()}
    for name, part, suffix in (("k_full", "k_prefix", "k_suffix"), ("v_full", "v_prefix", "v_suffix")):
        full = xp.empty((batch, prefix + hi, hkv, d), dtype=case[part].dtype)
        full[:, :prefix] = case[part][None]
        full[:, prefix:] = case[suffix]
        case[name] = full
    case["full_lens"] = case["lens"] + np.int32(prefix)
    return case


def _cascade_calls(cuflash, c: dict):
    def cascade():
        return cuflash.cascade_attention(c["q"], c["k_prefix"], c["v_prefix"], c["k_suffix"], c["v_suffix"],
                                         cache_seqlens=c["lens"], causal=True)

    def unshared():
        return cuflash.attention_with_kvcache(c["q"], c["k_full"], c["v_full"], cache_seqlens=c["full_lens"],
                                              causal=True)
    return cascade, unshared


def _cascade_row(batch, prefix, mean_suffix, hq, hkv, d, itemsize, cascade_s, unshared_s, err) -> dict:
    shared_bytes = _kv_bytes(1, prefix, hkv, d, itemsize) + _kv_bytes(batch, 1, hkv, d, itemsize) * mean_suffix
    return dict(cascade=True, batch=batch, prefix=prefix, mean_suffix=mean_suffix, heads_q=hq, heads_kv=hkv,
                head_dim=d, unshared_kv_bytes=_kv_bytes(batch, prefix + mean_suffix, hkv, d, itemsize),
                cascade_kv_bytes=shared_bytes, cascade_us=cascade_s * 1e6, unshared_us=unshared_s * 1e6,
                speedup=unshared_s / cascade_s, max_abs_diff=err)


def _print_cascade(row: dict, unit: str) -> None:
    print(f"cascade batch {row['batch']:3d} prefix {row['prefix']:6d} suffix ~{row['mean_suffix']:5.0f}: "
          f"cascade_attention {row['cascade_us']:9.1f} us | unshared {row['unshared_us']:9.1f} us | "
          f"{row['speedup']:5.2f}x (target >= 3x on the GPU) | max |cascade - unshared| {row['max_abs_diff']:.1e}"
          f"{unit}")


def _cascade_rows_gpu(args) -> list[dict]:
    import cupy
    import torch

    import cuflash

    timed = _timer(torch, args.rep_ms)
    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    rng, rows = np.random.default_rng(0), []
    import ml_dtypes

    stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    with stream:
        for batch in args.batch or (64,):
            for prefix in args.cache or (8192,):
                c = _cascade_case(cupy, rng, ml_dtypes.bfloat16, batch, prefix, _SUFFIX_RANGE, hq, hkv, d)
                cascade, unshared = _cascade_calls(cuflash, c)
                err = float(cupy.abs(cascade().astype(cupy.float32) - unshared().astype(cupy.float32)).max())
                row = _cascade_row(batch, prefix, float(c["lens"].mean()), hq, hkv, d, 2,
                                   *_side_by_side(timed, cascade, unshared), err)
                rows.append(row)
                _print_cascade(row, "" if err <= 2e-2 else "  MISMATCH")
                del c
    return rows


def _cascade_rows_cpu(args) -> list[dict]:
    import cuflash

    rng, rows = np.random.default_rng(0), []
    hq, hkv, d = 4, 2, 32
    for batch in args.batch or (4,):
        for prefix in args.cache or (512,):
            c = _cascade_case(np, rng, np.float32, batch, prefix, (16, 64), hq, hkv, d)
            cascade, unshared = _cascade_calls(cuflash, c)
            times, outs = [], []
            for fn in (cascade, unshared):
                t0 = time.perf_counter()
                outs.append(fn())
                times.append(time.perf_counter() - t0)
            row = _cascade_row(batch, prefix, float(c["lens"].mean()), hq, hkv, d, 4, *times,
                               float(np.abs(outs[0] - outs[1]).max()))
            rows.append(row)
            _print_cascade(row, " (NumPy reference)")
    return rows


# ---------------------------------------------------------------------------------------------------
# --prefill: chunked prefill (the forward over the cache) against cuflash.attention on the same work
# ---------------------------------------------------------------------------------------------------


def _prefill_flops(batch: int, new: int, cache: int, hq: int, d: int) -> float:
    """Causal bottom-right: query token i of ``new`` sees ``cache + i + 1`` keys; 4 d FLOPs per (row, key)."""
    return 4.0 * d * hq * batch * (new * cache + new * (new + 1) / 2)


def _prefill_case(xp, rng, dtype, batch: int, cache: int, new: int, hq: int, hkv: int, d: int) -> dict:
    def draw(*shape):
        return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    return dict(q=draw(batch, new, hq, d), k=draw(batch, new, hkv, d), v=draw(batch, new, hkv, d),
                k_cache=draw(batch, cache + new, hkv, d), v_cache=draw(batch, cache + new, hkv, d),
                lens=xp.full(batch, cache, dtype=np.int32))


def _prefill_calls(cuflash, c: dict):
    def chunked():  # appends the same tokens into the same slots at every call: the same work each time
        return cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"],
                                              cache_seqlens=c["lens"], causal=True)

    def dense():  # the same attention over the cache after the append, as plain arrays
        return cuflash.attention(c["q"], c["k_cache"], c["v_cache"], causal=True)
    return chunked, dense


class _decode_kernels_forced:
    """Within: attention_with_kvcache runs the decode kernels for any seqlen_q (the launches remembered by the front
    door and the backend are forgotten on entry and exit, since they were chosen under the other threshold)."""

    def __enter__(self):
        from .._ops import api as _api, chunked_prefill as _chunked_prefill

        self._module, self._saved = _chunked_prefill, _chunked_prefill.MIN_SEQLEN_Q
        _chunked_prefill.MIN_SEQLEN_Q = 1 << 62
        self._forget(_api)
        return self

    def __exit__(self, *exc):
        from .._ops import api as _api

        self._module.MIN_SEQLEN_Q = self._saved
        self._forget(_api)

    @staticmethod
    def _forget(api) -> None:
        api._kvcache_launches.clear()
        try:
            from .._cuda import decode
        except ImportError:
            return
        decode._LAUNCHES.clear()


class _FusedAppend:
    """[prefill append] Calls of a chunked-prefill function with the append fused into the forward or not
    (``cuflash._cuda.decode.FUSED_PREFILL_APPEND``), side by side: switching forgets the launches planned under the
    other setting (the next call plans again: the timers' untimed first call)."""

    def __init__(self):
        self.state = None

    def __call__(self, fn, on: bool):
        def call():
            if self.state is not on:
                from .._cuda import decode
                from .._ops import api as _api

                decode.FUSED_PREFILL_APPEND, self.state = on, on
                _decode_kernels_forced._forget(_api)
            return fn()
        return call


def _prefill_row(batch, cache, new, hq, hkv, d, chunked_s, dense_s, decode_s, err) -> dict:
    flops = _prefill_flops(batch, new, cache, hq, d)
    return dict(prefill=True, batch=batch, cache=cache, new_tokens=new, heads_q=hq, heads_kv=hkv, head_dim=d,
                flops=flops, chunked_us=chunked_s * 1e6, dense_us=dense_s * 1e6, decode_kernels_us=decode_s * 1e6,
                chunked_vs_dense=dense_s / chunked_s, max_abs_diff=err)


def _print_prefill(row: dict, unit: str, scale: float = 1e12, rate: str = "TFLOP/s") -> None:
    print(f"prefill batch {row['batch']:2d} cache {row['cache']:6d} new {row['new_tokens']:5d}: attention_with_kvcache "
          f"{row['chunked_us']:9.1f} us {row['flops'] / row['chunked_us'] * 1e6 / scale:7.2f} {rate} | "
          f"attention (same work) {row['dense_us']:9.1f} us | decode kernels {row['decode_kernels_us']:9.1f} us | "
          f"{row['chunked_vs_dense']:4.2f}x dense (target >= 0.95) | max |diff| {row['max_abs_diff']:.1e}{unit}"
          + (f" | back to back {row['chunked_back_to_back_us']:9.1f} / {row['dense_back_to_back_us']:9.1f} us, "
             f"{row['chunked_vs_dense_back_to_back']:4.2f}x" if "chunked_back_to_back_us" in row else "")
          + (f" | append fused: {row['fused_us']:9.1f} us, {row['fused_vs_dense']:4.2f}x dense; back to back "
             f"{row['fused_back_to_back_us']:9.1f} us, {row['fused_vs_dense_back_to_back']:4.2f}x (max |diff| "
             f"{row['fused_max_abs_diff']:.1e})" if "fused_us" in row else ""))


def _prefill_rows_gpu(args) -> list[dict]:
    import cupy
    import ml_dtypes
    import torch

    import cuflash

    timed = _timer(torch, args.rep_ms)
    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    rng, rows = np.random.default_rng(0), []
    switch = _FusedAppend()
    from .._cuda import decode

    shipped = decode.FUSED_PREFILL_APPEND
    stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    with stream:
        for batch in args.batch or (1,):
            for cache in args.cache or (8192, 32768):
                for new in args.new_tokens or (512, 2048):
                    c = _prefill_case(cupy, rng, ml_dtypes.bfloat16, batch, cache, new, hq, hkv, d)
                    plain, dense = _prefill_calls(cuflash, c)
                    # the chunked call with the append kernel, and [prefill append] with the append fused (where its
                    # launch is the forward's append form: else both are the same call)
                    chunked, fused = switch(plain, False), switch(plain, True)
                    # (the chunked call first: the dense call reads the new tokens from the slots it appends to)
                    got = chunked().astype(cupy.float32)
                    want = dense().astype(cupy.float32)
                    err = float(cupy.abs(got - want).max())
                    fused_err = float(cupy.abs(fused().astype(cupy.float32) - want).max())
                    chunked_s, dense_s, fused_s = _side_by_side(timed, chunked, dense, fused)
                    # ... and back to back (the GPU's time: the host's hidden behind it, as in a model's loop)
                    b2b = _side_by_side(lambda fn: _back_to_back(torch, fn, calls=10, reps=3), chunked, dense, fused)
                    with _decode_kernels_forced():
                        decode_s = timed(chunked)
                    row = _prefill_row(batch, cache, new, hq, hkv, d, chunked_s, dense_s, decode_s, err)
                    row.update(chunked_back_to_back_us=b2b[0] * 1e6, dense_back_to_back_us=b2b[1] * 1e6,
                               chunked_vs_dense_back_to_back=b2b[1] / b2b[0], fused_us=fused_s * 1e6,
                               fused_vs_dense=dense_s / fused_s, fused_back_to_back_us=b2b[2] * 1e6,
                               fused_vs_dense_back_to_back=b2b[1] / b2b[2], fused_max_abs_diff=fused_err)
                    err = max(err, fused_err)
                    rows.append(row)
                    _print_prefill(row, "" if err <= 2e-2 else "  MISMATCH")
                    del c
    switch(lambda: None, shipped)()  # (the setting as it was)
    return rows


def _prefill_rows_cpu(args) -> list[dict]:
    """The NumPy reference runs its decode path whatever seqlen_q: the rows time the same call as the GPU's."""
    import cuflash

    rng, rows = np.random.default_rng(0), []
    hq, hkv, d = 4, 2, 32
    for batch in args.batch or (1,):
        for cache in args.cache or (256,):
            for new in args.new_tokens or (64,):
                c = _prefill_case(np, rng, np.float32, batch, cache, new, hq, hkv, d)
                chunked, dense = _prefill_calls(cuflash, c)
                times, outs = [], []
                for fn in (chunked, dense):
                    t0 = time.perf_counter()
                    outs.append(fn())
                    times.append(time.perf_counter() - t0)
                row = _prefill_row(batch, cache, new, hq, hkv, d, *times, times[0],
                                   float(np.abs(outs[0] - outs[1]).max()))
                rows.append(row)
                _print_prefill(row, " (NumPy reference)", 1e9, "GFLOP/s")
    return rows


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    # one colour a batch, one line style a method: cuflash's plan.run solid, its front door dotted, SDPA dashed
    # (key, style, name, TB per the key's unit)
    styles = (("cuflash_plan_tbs", "-o", "cuflash plan.run", 1), ("cuflash_tbs", ":x", "cuflash (front door)", 1),
              ("sdpa_tbs", "--s", "SDPA best", 1), ("numpy_gbs", "-o", "NumPy reference", 1e-3))
    for i, batch in enumerate(sorted({r["batch"] for r in rows})):
        sel = [r for r in rows if r["batch"] == batch]
        xs = [r["cache"] for r in sel]
        for key, style, name, unit in styles:
            if sel[0].get(key) is not None:
                ax.plot(xs, [r[key] * unit for r in sel], style, color=f"C{i}", label=f"{name}, batch {batch}")
    if rows and rows[0].get("copy_tbs"):
        ax.axhline(rows[0]["copy_tbs"], color="k", lw=0.8, label="device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("K and V bytes read / time (TB/s)")
    if rows:
        r = rows[0]
        ax.set_title(f"one decode step: {r['heads_q']} / {r['heads_kv']} heads, d {r['head_dim']}")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .main import gpu_available

    if args.cascade:
        rows = _cascade_rows_gpu(args) if gpu_available() else _cascade_rows_cpu(args)
    elif args.prefill:
        rows = _prefill_rows_gpu(args) if gpu_available() else _prefill_rows_cpu(args)
    elif args.mla:
        rows = _mla_rows(args) if gpu_available() else _cpu_mla_rows(args)
    else:
        rows = _gpu_rows(args) if gpu_available() else _cpu_rows(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot and not (args.cascade or args.prefill):
        _plot(rows, args.plot)
    return 0
