"""Context parallelism on the GPUs of one host: ring and all-gather attention against one GPU (issue 15's benchmark).

On a machine with 2 (or more) GPUs, from the repository root::

    PYTHONPATH=. python3 tools/cp_bench.py                       # N 65536 131072 262144, 32 heads, d 128, bf16
    PYTHONPATH=. python3 tools/cp_bench.py --seqlens 65536 --profile --out /tmp/cp

One process per GPU (``torch.multiprocessing``, NCCL, a FileStore rendezvous; NVLink SHARP / multicast off:
``NCCL_NVLS_ENABLE=0``). For each total length ``N`` (batch 1, causal, ``--layout`` zigzag):

- **one GPU**: every rank runs ``cuflash.torch.attention`` on the whole sequence at the same time (so every GPU is
  as busy and as warm as in the distributed run), forward and forward + backward; the slowest rank's median;
- **ring** and **all-gather** (``cuflash.distributed``) on this rank's shard; forward and forward + backward;
- **efficiency** = one-GPU time / (R x R-GPU time), the issue's definition;
- the error of the distributed output against the one-GPU output on the same inputs (max |diff| over this rank's
  shard, and the one-GPU output's own bfloat16 spacing for scale);
- the host time of a call (the Python side, before the GPU has finished: ``perf_counter`` around the call, no
  synchronization) beside its GPU time.

``--profile`` records one ring forward + backward per rank under ``torch.profiler`` and reports, from the GPU
kernel timeline, the NCCL kernels' time, the part of it overlapped by other (attention, merge) kernels and the part
exposed; the Chrome traces go to ``--out``. A link test first times NCCL send/recv of a K/V shard between ranks 0
and 1 (GB/s one way). ``--json`` writes every number. Times are CUDA-event medians of ``--reps`` after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
import traceback


def _say(rank: int, *args) -> None:
    if rank == 0:
        print(*args, flush=True)


def _sync(torch) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(torch, fn, reps: int, cuda: bool) -> tuple[float, float]:
    """(median device ms, median host ms per call) of ``fn`` after one warm-up call (CPU: both the wall time)."""
    fn()
    _sync(torch)
    dev, host = [], []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            dev.append(start.elapsed_time(end))
        else:
            dev.append(host[-1])
    return statistics.median(dev), statistics.median(host)


def _slowest(torch, dist, value: float, device: str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _link_bandwidth(torch, dist, rank: int, nbytes: int, device: str, reps: int = 10) -> float:
    """GB/s of one send from rank 0 to rank 1 of ``nbytes`` (the other ranks idle)."""
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(reps + 1):
        dist.barrier()
        _sync(torch)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
        _sync(torch)
        if i:
            times.append(time.perf_counter() - t0)
    sec = _slowest(torch, dist, statistics.median(times), device)
    return nbytes / sec / 1e9


def _intervals_overlap(trace_path: str) -> dict:
    """From a Chrome trace: total NCCL kernel time, the part covered by other kernels, the part exposed (us)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    comm = [(a, b) for a, b, n in kernels if "nccl" in n.lower()]
    comp = sorted((a, b) for a, b, n in kernels if "nccl" not in n.lower())
    merged: list[list[float]] = []
    for a, b in comp:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in comm)
    covered = 0.0
    for a, b in comm:
        for x, y in merged:
            lo, hi = max(a, x), min(b, y)
            if hi > lo:
                covered += hi - lo
    busy = sum(b - a for a, b in merged)
    span = (max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)) if kernels else 0.0
    return dict(nccl_us=total, overlapped_us=covered, exposed_us=total - covered, compute_us=busy, span_us=span,
                nccl_kernels=len(comm), compute_kernels=len(comp))


def _worker(rank: int, world: int, store_path: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    import cuflash.torch as cft
    from cuflash import distributed as cd

    cuda = not args.cpu
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.deadline))
    rows = []
    try:
        hq, hkv, d = args.heads, args.heads_kv, args.head_dim
        nbytes = 2 * (args.seqlens[0] // world) * hkv * d * 2  # one K/V shard, bf16
        bw = _link_bandwidth(torch, dist, rank, nbytes, device) if world > 1 else 0.0
        name = torch.cuda.get_device_name() if cuda else "CPU processes over gloo"
        _say(rank, f"{world} x {name}; send of one K/V shard ({nbytes / 2**20:.0f} MiB) "
                   f"from rank 0 to 1: {bw:.1f} GB/s")
        for n in args.seqlens:
            gen = torch.Generator(device=device).manual_seed(n)
            q, dout = (torch.randn((1, n, hq, d), generator=gen, device=device, dtype=dtype) for _ in range(2))
            k, v = (torch.randn((1, n, hkv, d), generator=gen, device=device, dtype=dtype) for _ in range(2))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            flops_fwd = 4 * n * n * hq * d / 2  # causal

            def single_fwd():
                with torch.no_grad():
                    return cft.attention(*full, causal=True)

            def single_fwd_bwd():
                out = cft.attention(*full, causal=True)
                out.backward(dout)

            ref = single_fwd()
            one_f, _ = _time(torch, single_fwd, args.reps, cuda)
            one_fb, _ = _time(torch, single_fwd_bwd, args.reps, cuda)
            one_f, one_fb = _slowest(torch, dist, one_f, device), _slowest(torch, dist, one_fb, device)
            for t in full:
                t.grad = None
            if cuda:
                torch.cuda.empty_cache()
            local = [cd.shard(t, layout=args.layout).detach().clone().requires_grad_() for t in (q, k, v)]
            dlocal = cd.shard(dout, layout=args.layout).contiguous()
            want = cd.shard(ref, layout=args.layout).float()
            spacing = float(torch.finfo(dtype).eps) * float(want.abs().max())
            for name, fn in (("ring", cd.ring_attention), ("all-gather", cd.all_gather_attention)):
                def fwd():
                    with torch.no_grad():
                        return fn(*local, causal=True, layout=args.layout)

                def fwd_bwd():
                    out = fn(*local, causal=True, layout=args.layout)
                    out.backward(dlocal)

                err = float((fwd().float() - want).abs().max())
                err = _slowest(torch, dist, err, device)
                f_ms, f_host = _time(torch, fwd, args.reps, cuda)
                fb_ms, fb_host = _time(torch, fwd_bwd, args.reps, cuda)
                f_ms, fb_ms = _slowest(torch, dist, f_ms, device), _slowest(torch, dist, fb_ms, device)
                f_host, fb_host = _slowest(torch, dist, f_host, device), _slowest(torch, dist, fb_host, device)
                for t in local:
                    t.grad = None
                row = dict(N=n, mode=name, world=world, heads=hq, heads_kv=hkv, d=d, layout=args.layout,
                           one_gpu_fwd_ms=one_f, one_gpu_fwd_bwd_ms=one_fb, fwd_ms=f_ms, fwd_bwd_ms=fb_ms,
                           eff_fwd=one_f / (world * f_ms), eff_fwd_bwd=one_fb / (world * fb_ms),
                           host_fwd_ms=f_host, host_fwd_bwd_ms=fb_host, max_err=err, bf16_spacing=spacing,
                           one_gpu_fwd_tflops=flops_fwd / one_f / 1e9, link_gbs=bw)
                rows.append(row)
                _say(rank, f"N {n:7d} {name:10s} one GPU fwd {one_f:9.2f} ms fwd+bwd {one_fb:9.2f} | {world} GPUs fwd "
                           f"{f_ms:8.2f} ms (eff {row['eff_fwd']:.3f}) fwd+bwd {fb_ms:9.2f} ms "
                           f"(eff {row['eff_fwd_bwd']:.3f}) | host per call fwd {f_host:.2f} ms fwd+bwd "
                           f"{fb_host:.2f} ms | max|err| vs one GPU {err:.2e} (spacing of the dtype there {spacing:.2e})")
            q = k = v = dout = full = ref = local = dlocal = want = None  # free before the next length
            if cuda:
                torch.cuda.empty_cache()
        if args.profile and cuda:
            n = args.seqlens[0]
            gen = torch.Generator(device="cuda").manual_seed(1)
            local = [torch.randn((1, n // world, h, d), generator=gen, device="cuda", dtype=torch.bfloat16)
                     .requires_grad_() for h in (hq, hkv, hkv)]
            dlocal = torch.randn((1, n // world, hq, d), generator=gen, device="cuda", dtype=torch.bfloat16)
            from torch.profiler import ProfilerActivity, profile

            for what in ("fwd", "fwd_bwd"):
                def step():
                    out = cd.ring_attention(*local, causal=True, layout=args.layout)
                    if what == "fwd_bwd":
                        out.backward(dlocal)

                step()
                torch.cuda.synchronize()
                dist.barrier()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                path = os.path.join(args.out, f"cp-trace-ring-{what}-N{n}-rank{rank}.json")
                prof.export_chrome_trace(path)
                with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                    dst.write(src.read())
                os.remove(path)
                ov = _intervals_overlap(path + ".gz")
                ov.update(rank=rank, what=what, N=n)
                rows.append(dict(profile=ov))
                print(f"rank {rank} ring {what} N {n}: NCCL kernels {ov['nccl_us'] / 1e3:.2f} ms "
                      f"({ov['nccl_kernels']}), overlapped by compute {ov['overlapped_us'] / 1e3:.2f} ms, exposed "
                      f"{ov['exposed_us'] / 1e3:.2f} ms; compute kernels busy {ov['compute_us'] / 1e3:.2f} ms of a "
                      f"{ov['span_us'] / 1e3:.2f} ms span", flush=True)
                for t in local:
                    t.grad = None
    except Exception:
        rows.append(dict(error=traceback.format_exc()))
        print(f"rank {rank} failed:\n{traceback.format_exc()}", flush=True)
    finally:
        with open(os.path.join(args.out, f"cp-rank{rank}.json"), "w") as f:
            json.dump(rows, f, indent=1)
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072, 262144])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=None, help="K/V heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=None, help="processes (default: every visible GPU)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu", action="store_true",
                    help="CPU processes over gloo, float32, the NumPy reference (a check of the script; times mean nothing)")
    ap.add_argument("--deadline", type=int, default=540, help="seconds before the run is given up")
    ap.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    ap.add_argument("--json", default=None, help="write every rank's rows here (default: OUT/cp_bench.json)")
    args = ap.parse_args(argv)
    args.heads_kv = args.heads_kv or args.heads
    import torch
    import torch.multiprocessing as mp

    world = args.world or (2 if args.cpu else torch.cuda.device_count())
    if world < 2 and not args.cpu:
        print(f"needs 2 or more GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + args.deadline
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                print(f"gave up after {args.deadline} s", file=sys.stderr)
                return 1
    rows = []
    for r in range(world):
        with open(os.path.join(args.out, f"cp-rank{r}.json")) as f:
            rows += [dict(row, rank=r) for row in json.load(f)]
    with open(args.json or os.path.join(args.out, "cp_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    table = [r for r in rows if r.get("rank") == 0 and "mode" in r]
    if table:
        print("\n| N | mode | 1 GPU fwd ms | fwd+bwd ms | "
              f"{world} GPUs fwd ms | fwd+bwd ms | efficiency fwd | fwd+bwd | host ms/call fwd |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in table:
            print(f"| {r['N']} | {r['mode']} | {r['one_gpu_fwd_ms']:.2f} | {r['one_gpu_fwd_bwd_ms']:.2f} | "
                  f"{r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['eff_fwd']:.3f} | {r['eff_fwd_bwd']:.3f} | "
                  f"{r['host_fwd_ms']:.2f} |")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
