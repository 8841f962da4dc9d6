"""Decode tiles tried side by side with torch's cuDNN SDPA in one process (sm_90): for each cache shape, one decode
step (one query token, bf16, 32 query / 8 key-value heads, d 128 unless told) through ``cuflash.plan_kvcache`` with
each candidate tile of flash_decode_kernel, in TB/s of K and V read.

    PYTHONPATH=. python3 tools/decode_tile_trial.py [--tiles 64,4,2 64,4,3 32,2,4] [--shapes 32x65536 64x16384]

A candidate ``block_n,warps,stages`` replaces the head dim's ("decode", "any", d) row (16 packed rows); "shipped" is
the table as packaged. Times: 20 steps back to back between CUDA events (the kernels' time, the host's hidden), the
median of 5 rounds, every candidate and cuDNN in each round in turn; each output is checked against cuDNN's first.
"""

from __future__ import annotations

import argparse
import os
import statistics

from _gpu_tools import back_to_back


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    ap.add_argument("--shapes", nargs="+", default=["1x16384", "1x65536", "4x65536", "8x16384", "32x4096",
                                                    "32x16384", "32x65536", "64x16384", "64x65536"],
                    help="batch x cached tokens")
    ap.add_argument("--tiles", nargs="*", default=["64,4,3", "32,2,4", "32,2,3", "128,8,2"],
                    help="candidates: block_n,warps,stages (none: the shipped tile against cuDNN, e.g. for a build of "
                         "CUFLASH_DEFINES)")
    args = ap.parse_args(argv)

    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash._cuda import decode
    from cuflash._cuda.spec import TILES, Tile

    d, (hq, hkv) = args.dim, args.heads
    key = ("decode", "any", d)
    shipped = TILES[key]

    def configure(candidate):
        TILES[key] = shipped if candidate == "shipped" else Tile(16, *map(int, candidate.split(",")))
        decode._LAUNCHES.clear()

    def timed(fn):
        return back_to_back(torch, fn)

    names = ["shipped", *args.tiles]
    print(f"{torch.cuda.get_device_name()}, bf16, {hq} / {hkv} heads, d {d}, shipped tile {tuple(shipped)}, "
          f"CUFLASH_DEFINES={os.environ.get('CUFLASH_DEFINES', '')!r}; TB/s of K and V (splits chosen)", flush=True)
    print(f"{'batch':>5s} {'cache':>6s} " + " ".join(f"{n:>14s}" for n in names) + f" {'cudnn':>8s}", flush=True)
    stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    for shape in args.shapes:
        batch, cache = map(int, shape.split("x"))
        q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, cache, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        nbytes = 2 * batch * cache * hkv * d * 2

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        ref = cudnn().transpose(1, 2).float()
        cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
        lens = cupy.full(batch, cache, dtype=cupy.int32)
        runs, splits = {}, {}
        with stream:
            for name in names:  # planned and checked first
                configure(name)
                plan = cuflash.plan_kvcache(cq, ck, cv, cache_seqlens=lens)
                out = cupy.full(plan.out_shape, cupy.nan, dtype=cq.dtype)
                lse = cupy.empty(plan.lse_shape, dtype=cupy.float32)
                plan.run(cq, ck, cv, cache_seqlens=lens, out=out, lse=lse)
                err = (torch.from_dlpack(out).float() - ref).abs().max().item()
                assert err < 2e-2, (name, shape, err)
                runs[name] = (lambda p=plan, o=out, s=lse: p.run(cq, ck, cv, cache_seqlens=lens, out=o, lse=s))
                splits[name] = plan.num_splits
            times = {name: [] for name in [*names, "cudnn"]}
            for _ in range(5):
                for name in names:
                    times[name].append(timed(runs[name]))
                times["cudnn"].append(timed(cudnn))
        tbs = {name: nbytes / statistics.median(t) / 1e12 for name, t in times.items()}
        print(f"{batch:5d} {cache:6d} " + " ".join(f"{tbs[n]:8.2f} ({splits[n]:3d})" for n in names)
              + f" {tbs['cudnn']:8.2f}", flush=True)
    configure("shipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
