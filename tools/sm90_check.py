"""One call on an H100/H200 for the Hopper forward (cuflash_kernels/forward_sm90.cu): compile, check, time.

    PYTHONPATH=. python3 tools/sm90_check.py [--quick] [--no-check] [--no-bench] [--sanitize] [--out DIR]

--quick   benchmark seqlens 512, 2048, 8192 only; --shipped: only the tile-table tiles

check     every tile variant below on awkward lengths, causal bottom-right / top-left / none, GQA and MQA,
          (B, H, N, d) views, rows that see no key: max |out - truth| against 2x the error of naive
          attention in the same dtype (+ the rounding floor), truth in float64; lse within 1e-3; outputs
          from a NaN-poisoned pool. Also checks that cuflash.attention dispatches to the sm_90a kernel.
bench     forward TFLOP/s of each variant, torch-flash (SDPA FLASH_ATTENTION) and torch-cudnn on the
          ANCHORS.md grid, same process, same inputs; every cuflash result compared with torch-flash first.
sanitize  one tiny launch per dtype for compute-sanitizer (no torch, no timing).
Prints a short table last; the full log and the JSON rows go to --out (default $OUT or /tmp).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import zlib

import numpy as np

from cuflash import _cuda as cuda
from cuflash._cuda import Tile

from _gpu_tools import log, poison_pool, ref_attention

# Tile variants per head dim (the first is the one the tile table ships).
VARIANTS = {
    # block_m == 16 * (warps - 4): warp-specialized (one producer warpgroup), see forward_sm90.cu.
    64: [cuda.TILES[("fwd", "sm90a", 64)], Tile(128, 128, 8, 2), Tile(256, 64, 16, 2), Tile(128, 128, 12, 2),
         Tile(192, 128, 16, 2), Tile(128, 64, 12, 2), Tile(192, 64, 16, 2)],
    128: [cuda.TILES[("fwd", "sm90a", 128)], Tile(128, 128, 12, 2), Tile(192, 64, 16, 2), Tile(128, 64, 12, 2)],
}
CT = {"bfloat16": "cuflash::bf16", "float16": "cuflash::fp16"}




def vname(t: Tile) -> str:
    return f"{t.block_m}x{t.block_n}" + ("ws" if t.block_m == 16 * (t.warps - 4) else "")


def launch(cp, q, k, v, scale, off, t: Tile, dtname=None):
    """flash_fwd_sm90_kernel with tile t on CuPy arrays (B, N, H, d); mirrors _cuda.forward. dtname names
    the element type when the arrays hold bfloat16 bits as uint16 (CuPy has no bfloat16)."""
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    name = cuda._fwd_sm90_name(CT[dtname or np.dtype(q.dtype).name], d, t, off is not None)
    smem = cuda._fwd_sm90_smem(d, t)
    kern = cuda._kernel("forward_sm90.cu", name, smem, cuda.SM90A_OPTIONS)
    q, k, v = cuda._aligned(q), cuda._aligned(k), cuda._aligned(v)
    out = cp.empty(q.shape, dtype=q.dtype)
    lse = cp.empty((B, Hq, Nq), dtype=cp.float32)
    kern((cuda._cdiv(Nq, t.block_m), Hq, B), (32 * t.warps,), (
        q, k, v, out, lse, np.int32(Nq), np.int32(Nk), np.int32(Hq), np.int32(Hq // Hkv),
        *cuda._strides(q), *cuda._strides(k), *cuda._strides(v), *cuda._strides(out),
        np.float32(scale * 1.4426950408889634), np.int32(0 if off is None else off)), shared_mem=smem)
    return out, lse




# ---------------------------------------------------------------------------------------------------
# Correctness.




CASES = [  # (B, Nq, Nk, Hq, Hkv, dtype, causal, layout)
    (2, 113, 203, 4, 2, "bfloat16", None, "bnhd"),
    (2, 113, 203, 4, 2, "float16", "br", "bnhd"),
    (2, 113, 203, 4, 2, "bfloat16", "tl", "bnhd"),
    (1, 1, 257, 2, 2, "float16", "tl", "bnhd"),
    (1, 257, 1, 2, 1, "bfloat16", "br", "bnhd"),
    (1, 1023, 1024, 2, 2, "bfloat16", "br", "bnhd"),
    (1, 1024, 1023, 2, 2, "float16", None, "bnhd"),
    (2, 203, 113, 4, 1, "bfloat16", "tl", "bnhd"),
    (2, 300, 300, 8, 2, "float16", "br", "bhnd"),
    (1, 200, 50, 2, 1, "float16", "br", "bnhd"),
    (2, 1500, 1700, 4, 4, "bfloat16", "br", "bhnd"),
    (1, 2048, 2048, 2, 1, "float16", None, "bnhd"),
]


def check(torch, cp, quick, rows):
    fails = 0
    for d, tiles in VARIANTS.items():
        for t in tiles:
            for case in CASES:
                B, Nq, Nk, Hq, Hkv, dtname, causal, layout = case
                dtype = getattr(torch, dtname)
                off = None if causal is None else (Nk - Nq if causal == "br" else 0)
                scale = 1.0 / math.sqrt(d)
                g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, d, t)).encode()) % 100000)

                def rnd(n, h):
                    if layout == "bhnd":
                        return torch.randn(B, h, n, d, generator=g, device="cuda").to(dtype).transpose(1, 2)
                    return torch.randn(B, n, h, d, generator=g, device="cuda").to(dtype)

                q, k, v = rnd(Nq, Hq), rnd(Nk, Hkv), rnd(Nk, Hkv)
                ref, lse_ref = ref_attention(torch, q, k, v, scale, off, True, return_lse=True)
                low = ref_attention(torch, q, k, v, scale, off, False)
                poison_pool(cp, 1 << 28)
                out, lse = launch(cp, *(cp.from_dlpack(x) for x in (q, k, v)), scale, off, t)
                cp.cuda.runtime.deviceSynchronize()
                o = torch.from_dlpack(out).double()
                ls = torch.from_dlpack(lse).double()
                err = float((o - ref).abs().max())
                err_low = float((low.double() - ref).abs().max())
                floor = float((ref.to(dtype).double() - ref).abs().max())
                both_inf = torch.isinf(ls) & (ls == lse_ref)
                lse_err = float(torch.where(both_inf, 0.0, (ls - lse_ref).abs()).max()) if ls.numel() else 0.0
                nan = bool(torch.isnan(o).any())
                ok = (not nan) and err <= 2 * err_low + floor and lse_err < 1e-3
                if causal == "br" and Nk < Nq:  # rows that see no key: exactly 0 and -inf
                    dead = Nq - Nk
                    ok = ok and float(o[:, :dead].abs().max()) == 0.0 and bool((ls[:, :, :dead] == -math.inf).all())
                fails += not ok
                row = {"tile": vname(t), "d": d, "case": case, "err": err, "budget": 2 * err_low + floor,
                       "lse_err": lse_err, "nan": nan, "ok": ok}
                rows.append(row)
                log(("PASS " if ok else "FAIL ") + json.dumps(row))
    # The front door dispatches to the sm_90a kernel (d 64 and 128, 16-bit) on this device.
    import cuflash

    x = cp.random.standard_normal((1, 129, 2, 128)).astype(cp.float16)
    cuflash.attention(x, x, x, causal=True)
    used = [key for key in cuda._modules if key[1] == "forward_sm90.cu"]
    log("dispatch: cuflash.attention used forward_sm90.cu:", bool(used))
    fails += not used
    return fails


# ---------------------------------------------------------------------------------------------------
# Benchmark.


def bench(torch, cp, quick, rows):
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seqlens = (512, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    for dtname in ("bfloat16", "float16"):
        dtype = getattr(torch, dtname)
        for d, tiles in VARIANTS.items():
            tiles = tiles if dtname == "bfloat16" else tiles[:1]
            for causal in (False, True):
                for n in seqlens:
                    b, h = 16384 // n, 2048 // d
                    g = torch.Generator(device="cuda").manual_seed(n + d)
                    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
                    qc, kc, vc = (cp.from_dlpack(x.transpose(1, 2)) for x in (q, k, v))
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    row = {"dtype": dtname, "d": d, "causal": causal, "N": n}

                    def sdpa(backend):
                        def f():
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        return f

                    o_t = sdpa(SDPBackend.FLASH_ATTENTION)()
                    fns = {"torch-flash": sdpa(SDPBackend.FLASH_ATTENTION), "torch-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
                    for t in tiles:
                        def f(t=t):
                            with stream:
                                return launch(cp, qc, kc, vc, 1.0 / math.sqrt(d), 0 if causal else None, t)
                        o_c, _ = f()
                        torch.cuda.synchronize()
                        diff = float((torch.from_dlpack(o_c).transpose(1, 2).float() - o_t.float()).abs().max())
                        row[f"diff {vname(t)}"] = diff
                        if not diff < 0.05:
                            log(f"MISMATCH {vname(t)} {row} diff {diff}")
                            row[f"cuflash {vname(t)}"] = float("nan")
                            continue
                        fns[f"cuflash {vname(t)}"] = f
                    for system, fn in fns.items():
                        try:
                            ms = tt.do_bench(fn, warmup=25, rep=60 if quick else 100, return_mode="median")
                            row[system] = flops / ms / 1e9
                        except Exception as exc:
                            row[system] = float("nan")
                            row[f"{system} error"] = str(exc)[:200]
                    rows.append(row)
                    log(json.dumps(row))
                    del q, k, v, qc, kc, vc, fns, o_t


def table(rows) -> str:
    lines = ["| dtype | d | causal | N | torch-flash | torch-cudnn | shipped | ratio | best variant | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tf, tc = r["torch-flash"], r["torch-cudnn"]
        ship = r.get(f"cuflash {vname(VARIANTS[r['d']][0])}", float("nan"))
        var = {k[8:]: val for k, val in r.items() if k.startswith("cuflash ") and not k.endswith("error")}
        best = max(var, key=lambda k_: var[k_] if var[k_] == var[k_] else -1) if var else "-"
        bv = var.get(best, float("nan"))
        lines.append(f"| {r['dtype']} | {r['d']} | {'yes' if r['causal'] else 'no'} | {r['N']} | {tf:.0f} | {tc:.0f} | "
                     f"{ship:.0f} | {ship / tf:.2f} | {best} {bv:.0f} | {bv / tf:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------


def sanitize(cp):
    """Tiny launches for compute-sanitizer: bf16 causal GQA on a (B, H, N, d) view, fp16 non-causal d 128."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    for d, dt, causal, nq, nk in ((64, "bfloat16", "br", 77, 131), (128, "float16", None, 131, 77)):
        npdt = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(np.float16)

        def arr(n, h):  # (1, h, n, d) in memory, seen as (1, n, h, d)
            x = rng.standard_normal((1, h, n, d)).astype(npdt).view(np.uint16 if dt == "bfloat16" else np.float16)
            return cp.asarray(x).transpose(0, 2, 1, 3)

        q, k, v = arr(nq, 4), arr(nk, 2), arr(nk, 2)
        off = None if causal is None else nk - nq
        ws = [t for t in VARIANTS[d] if vname(t).endswith("ws")]
        for t in [VARIANTS[d][0]] + ws[:1]:  # the shipped tile and a warp-specialized one
            out, lse = launch(cp, q, k, v, 1.0 / math.sqrt(d), off, t, dtname=dt)
            cp.cuda.runtime.deviceSynchronize()
            o = cp.asnumpy(out).view(npdt).astype(np.float32)
            log(f"sanitize {vname(t)} d={d} {dt} causal={causal}: finite={bool(np.isfinite(o).all())}, "
                f"lse finite rows={int(np.isfinite(cp.asnumpy(lse)).sum())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--shipped", action="store_true", help="only the tile-table tiles")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    import cupy as cp

    if args.shipped:
        for d in VARIANTS:
            VARIANTS[d] = VARIANTS[d][:1]
    if args.sanitize:
        sanitize(cp)
        return 0
    import torch

    dev = cp.cuda.Device()
    log("device:", torch.cuda.get_device_name(), "cc", dev.compute_capability, "torch", torch.__version__,
        "cupy", cp.__version__, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    t0 = time.time()
    for d, tiles in VARIANTS.items():
        for t in tiles:
            for dt in CT:
                for causal in (False, True):
                    cuda._kernel("forward_sm90.cu", cuda._fwd_sm90_name(CT[dt], d, t, causal),
                                 cuda._fwd_sm90_smem(d, t), cuda.SM90A_OPTIONS)
    log(f"compiled {sum(len(t) for t in VARIANTS.values()) * 4} kernels in {time.time() - t0:.1f} s")
    log("tiles:", {d: [vname(t) for t in ts] for d, ts in VARIANTS.items()})
    rows_c, rows_b, fails = [], [], 0
    if not args.no_check:
        try:
            fails = check(torch, cp, args.quick, rows_c)
        except Exception:
            traceback.print_exc()
            fails = -1
        log(f"CHECK: {len(rows_c)} cases, {fails} failed")
    if not args.no_bench:
        try:
            bench(torch, cp, args.quick, rows_b)
        except Exception:
            traceback.print_exc()
    with open(os.path.join(args.out, "sm90_rows.json"), "w") as f:
        json.dump({"check": rows_c, "bench": rows_b}, f, default=str)
    if rows_b:
        log(table(rows_b))
    log(f"CHECK: {len(rows_c)} cases, {fails} failed")
    return 0 if fails == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
