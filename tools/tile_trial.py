"""Forward tiles tried side by side with torch's cuDNN and flash backends in one process (H100/H200): for each shape,
cuflash's forward with each candidate tile of the Hopper TMA entry point (one tile a block, or persistent), TFLOP/s.

    PYTHONPATH=. python3 tools/tile_trial.py [--dim 64] [--seqlens 512 1024 2048 4096]

bf16, batch x N = 16384, heads x d = 2048 (the ANCHORS grid), dense and causal. Each candidate replaces the head dim's
("fwd", "sm90a_tma_short", d) row for N up to 2048 and its ("fwd", "sm90a_tma", d) row above (the launcher's plans are
forgotten between candidates); "shipped" is the table as packaged. d 256: `--dim 256 --tiles 128,64,12 128,80,12` (80-key
tiles, FlashAttention-3's d 256 forward tile: 225 KiB of shared memory, built by the kernel's n = 80 product). Times: 20 calls back to back between CUDA events,
the median of 5 rounds, every implementation in each round in turn; each output is checked against cuDNN's first.
"""

from __future__ import annotations

import argparse
import statistics

from _gpu_tools import back_to_back


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--tiles", nargs="+", default=["128,128,12", "128,128,12,p", "192,128,16,p", "64,128,8,p"],
                    help="candidates: block_m,block_n,warps[,p for persistent]")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash.torch as ct
    from cuflash._cuda import attention as launcher
    from cuflash._cuda.spec import TILES, Tile
    from cuflash._ops import api

    d = args.dim
    shipped = {key: TILES.get(key) for key in (("fwd", "sm90a_tma_short", d), ("fwd", "sm90a_tma", d))}
    shipped_persistent, shipped_rows = launcher.PERSISTENT_FORWARD, set(launcher._PERSISTENT_ROWS)

    def configure(candidate):
        for key, tile in shipped.items():
            TILES[key] = tile
        launcher.PERSISTENT_FORWARD, launcher._PERSISTENT_ROWS = shipped_persistent, set(shipped_rows)
        if candidate != "shipped":
            parts = candidate.split(",")
            tile = Tile(int(parts[0]), int(parts[1]), int(parts[2]), 2)
            TILES[("fwd", "sm90a_tma_short", d)] = tile
            TILES[("fwd", "sm90a_tma", d)] = tile
            launcher.PERSISTENT_FORWARD = parts[-1] == "p"
        api._checked_calls.clear()
        ct._forward_plans.clear()

    def timed(fn):
        return back_to_back(torch, fn)

    names = ["shipped", *args.tiles]
    print(f"{torch.cuda.get_device_name()}, bf16, d {d}, TFLOP/s (batch x N = 16384, heads x d = 2048)")
    print(f"{'causal':>6s} {'N':>6s} " + " ".join(f"{n:>14s}" for n in names) + f" {'cudnn':>8s} {'flash':>8s}")
    for causal in (False, True):
        for n in args.seqlens:
            batch, heads = max(1, 16384 // n), 2048 // d
            q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            flops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)

            def sdpa(backend):
                def call():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                return call
            ref = sdpa(SDPBackend.CUDNN_ATTENTION)().transpose(1, 2).float()
            times = {name: [] for name in [*names, "cudnn", "flash"]}
            with torch.no_grad():
                for name in names:  # checked first
                    configure(name)
                    err = (ct.attention(q, k, v, causal=causal).float() - ref).abs().max().item()
                    assert err < 3e-2, (name, n, causal, err)
                for _ in range(5):
                    for name in names:
                        configure(name)
                        times[name].append(timed(lambda: ct.attention(q, k, v, causal=causal)))
                    times["cudnn"].append(timed(sdpa(SDPBackend.CUDNN_ATTENTION)))
                    times["flash"].append(timed(sdpa(SDPBackend.FLASH_ATTENTION)))
            tf = {name: flops / statistics.median(t) / 1e12 for name, t in times.items()}
            print(f"{str(causal):>6s} {n:6d} " + " ".join(f"{tf[name]:14.1f}" for name in names)
                  + f" {tf['cudnn']:8.1f} {tf['flash']:8.1f}", flush=True)
    configure("shipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
