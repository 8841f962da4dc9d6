"""``python -m cuflash bench-decode``: one decode step (one new query token per sequence against a KV cache), the
achieved bandwidth side by side with PyTorch's SDPA backends and the device's copy bandwidth, in one process.

Decoding reads the whole cache for one token, so its cost is memory traffic: the figure of merit is the
bandwidth ``bytes of K and V read / time`` against what a plain device copy reaches (``docs/decoding.md``).
On a GPU it times cuflash's decode kernels (``--unverified-kernels``: the first version of ``decode.cu``, which
the front door does not use until its GPU tests pass) and every SDPA backend that runs the shape, and prints a
table (``--json`` writes it, ``--plot`` draws bandwidth against cache length). Without a GPU it runs the NumPy
reference at small sizes, so the command and its table stay exercised on any machine.
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
    p.add_argument("--page-size", type=int, default=0, help="paged cache with this page size (0: contiguous)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="time budget per measurement (GPU)")
    p.add_argument("--unverified-kernels", action="store_true",
                   help="time cuflash's first decode kernels (not yet enabled at the front door)")
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


def _gpu_rows(args) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    dev = torch.device("cuda")
    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps, spent, total = 0, 0.0, 0.0
        while spent < args.rep_ms or reps < 3:
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
            total, spent, reps = total + ms, spent + ms, reps + 1
        return total / reps * 1e-3

    copy_bw = _copy_bandwidth(timed, dev)
    print(f"device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write of 1 GiB)")

    if args.unverified_kernels:
        from . import _cuda
        from ._cuda import decode

        _cuda.forward_kvcache = decode.forward_kvcache
    import cupy

    rows = []
    for batch in args.batch or (1, 4, 32):
        for cache in args.cache or (4096, 16384, 65536):
            q = torch.randn(batch, 1, hq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(batch, cache, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            nbytes = _kv_bytes(batch, cache, hkv, d, 2)
            row = dict(batch=batch, cache=cache, heads_q=hq, heads_kv=hkv, head_dim=d, kv_bytes=nbytes,
                       copy_tbs=copy_bw / 1e12)
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
            row["cuflash_us"] = row["cuflash_tbs"] = None
            if args.unverified_kernels:
                cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
                lens = cupy.full(batch, cache, dtype=cupy.int32)
                stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
                with stream:
                    s = timed(lambda: cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=lens))
                row.update(cuflash_us=s * 1e6, cuflash_tbs=nbytes / s / 1e12)
            rows.append(row)
            ours = f"{row['cuflash_us']:8.1f} us {row['cuflash_tbs']:5.2f} TB/s" if row["cuflash_us"] else "   (not run)"
            print(f"batch {batch:3d} cache {cache:6d}: cuflash {ours} | SDPA {best:9s} {best_us:8.1f} us "
                  f"{row['sdpa_tbs']:5.2f} TB/s")
    return rows


def _cpu_rows(args) -> list[dict]:
    import cuflash

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


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in sorted({r["batch"] for r in rows}):
        sel = [r for r in rows if r["batch"] == batch]
        xs = [r["cache"] for r in sel]
        if sel[0].get("sdpa_tbs") is not None:
            ax.plot(xs, [r["sdpa_tbs"] for r in sel], "--o", label=f"SDPA best, batch {batch}")
        if sel[0].get("cuflash_tbs") is not None:
            ax.plot(xs, [r["cuflash_tbs"] for r in sel], "-o", label=f"cuflash, batch {batch}")
        if sel[0].get("numpy_gbs") is not None:
            ax.plot(xs, [r["numpy_gbs"] / 1e3 for r in sel], "-o", label=f"NumPy reference, batch {batch}")
    if rows and rows[0].get("copy_tbs"):
        ax.axhline(rows[0]["copy_tbs"], color="k", lw=0.8, label="device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("K and V bytes read / time (TB/s)")
    ax.set_title("one decode step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .__main__ import gpu_available

    rows = _gpu_rows(args) if gpu_available() else _cpu_rows(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0
