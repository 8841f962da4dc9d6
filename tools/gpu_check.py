"""One call on the GPU machine: compile, check against a float64 truth, time against PyTorch SDPA.

    PYTHONPATH=. python3 tools/gpu_check.py [--check] [--bench] [--quick] [--sanitize] [--out DIR]

--check  correctness grid (forward, backward kv_outer and split, GQA, causal both alignments, awkward
         lengths, non-contiguous views): max |err| vs a float64 truth against 2x (forward) / 3x (grads)
         the error of naive attention in the same dtype; NaN-poisoned memory pool; split bitwise repeat.
--bench  TFLOP/s of cuflash and torch SDPA FLASH_ATTENTION on the ANCHORS.md grid (subset with --quick).
--sanitize  small calls for compute-sanitizer (no timing): forward+backward (the launcher's and the front door's
         planned ones: the TMA entry points), then the decode launches (only those with --decode-only; only the
         planned calls with --planned-only). Run racecheck on the CUFLASH_RACECHECK=1 build (docs/testing.md: the MLA
         kernel's bar.arrive handovers).
Prints a short table last; full logs go to --out (default $OUT or /tmp).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
import traceback

from _gpu_tools import log, make_inputs, poison_pool, ref_attention, variant_for










def check_case(torch, cp, cuda, case, results):
    B, Nq, Nk, Hq, Hkv, d, dtname, causal, layout = case
    dtype = getattr(torch, dtname)
    offset = None if causal is None else (Nk - Nq if causal == "br" else 0)
    scale = 1.0 / math.sqrt(d)
    q, k, v, do = make_inputs(torch, B, Nq, Nk, Hq, Hkv, d, dtype, layout, seed=zlib.crc32(str(case).encode()) % 100000)
    for x in (q, k, v):
        x.requires_grad_(True)
    ref = ref_attention(torch, q, k, v, scale, offset, upcast=True)
    gref = torch.autograd.grad(ref, (q, k, v), do.to(torch.float64))
    low = ref_attention(torch, q, k, v, scale, offset, upcast=False)
    glow = torch.autograd.grad(low, (q, k, v), do)

    cq, ck, cv, cdo = (cp.from_dlpack(x.detach()) for x in (q, k, v, do))
    poison_pool(cp)
    out, lse = cuda.forward(cq, ck, cv, scale=scale, variant=variant_for(offset, Nq, Nk), algorithm="fa2", block_q=None, block_k=None)
    grads = {}
    for order in ("kv_outer", "split"):
        poison_pool(cp)
        grads[order] = cuda.backward(cdo, cq, ck, cv, out, lse, scale=scale, variant=variant_for(offset, Nq, Nk), algorithm="fa2",
                                     block_q=None, block_k=None, order=order)
    rep = cuda.backward(cdo, cq, ck, cv, out, lse, scale=scale, variant=variant_for(offset, Nq, Nk), algorithm="fa2",
                        block_q=None, block_k=None, order="split")
    cp.cuda.runtime.deviceSynchronize()
    det = all(bool((a.view(cp.uint16 if a.itemsize == 2 else cp.uint32) ==
                    b.view(cp.uint16 if b.itemsize == 2 else cp.uint32)).all()) for a, b in zip(grads["split"], rep))

    def err(a, b):
        return float((a.double() - b.double()).abs().max())

    row = {"case": case, "ok": True, "det": det}
    t_out = torch.from_dlpack(out)
    nan_out = bool(torch.isnan(t_out).any())
    e, e0 = err(t_out, ref), err(low, ref)
    row["fwd"] = (e, e0)
    ok = (not nan_out) and e <= 2 * e0 + 1e-5
    # lse check against float64 truth
    qh = q.detach().double().transpose(1, 2)
    kh = k.detach().double().transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    s = scale * qh @ kh.transpose(-1, -2)
    if offset is not None:
        i = torch.arange(Nq, device="cuda")[:, None]
        j = torch.arange(Nk, device="cuda")[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    lse_ref = torch.logsumexp(s, dim=-1)
    t_lse = torch.from_dlpack(lse).double()
    fin = torch.isfinite(lse_ref)
    lse_err = float((t_lse[fin] - lse_ref[fin]).abs().max()) if fin.any() else 0.0
    lse_inf_ok = bool((t_lse[~fin] == float("-inf")).all())
    row["lse"] = lse_err
    ok = ok and lse_err < 1e-2 and lse_inf_ok
    for order, (dq, dk, dv) in grads.items():
        es = []
        for name, a, r, r0 in zip("qkv", (dq, dk, dv), gref, glow):
            ta = torch.from_dlpack(a)
            nan = bool(torch.isnan(ta).any())
            ea, eb = err(ta, r), err(r0, r)
            es.append((ea, eb))
            ok = ok and (not nan) and ea <= 3 * eb + 1e-4
        row[order] = es
    ok = ok and det
    row["ok"] = ok
    results.append(row)
    log(json.dumps(row))
    return ok


CASES_FULL = []


def build_cases(quick):
    cases = []
    for dt in ("bfloat16", "float16"):
        for d in (32, 64, 96, 128, 256):
            cases.append((2, 113, 203, 4, 2, d, dt, None, "bnhd"))
            cases.append((2, 113, 203, 4, 2, d, dt, "br", "bnhd"))
            if quick and d not in (64, 128):
                continue
            cases.append((1, 257, 1, 2, 2, d, dt, None, "bnhd"))
            cases.append((1, 1023, 1024, 2, 1, d, dt, "tl", "bhnd"))
            cases.append((1, 1024, 1023, 4, 4, d, dt, "br", "bhnd"))
            cases.append((2, 203, 113, 4, 1, d, dt, "br", "bnhd"))  # rows that see no key
    for d in (32, 64, 128, 256):
        cases.append((2, 113, 203, 4, 2, d, "float32", "br", "bnhd"))
        cases.append((1, 257, 130, 2, 1, d, "float32", None, "bhnd"))
    return cases


def run_check(torch, cp, cuda, quick):
    results, fails = [], 0
    for case in build_cases(quick):
        try:
            if not check_case(torch, cp, cuda, case, results):
                fails += 1
        except Exception:
            fails += 1
            log("EXC", case, traceback.format_exc()[-3000:])
            results.append({"case": case, "ok": False, "exc": traceback.format_exc()[-2000:]})
    return results, fails


# --------------------------------------------------------------------------------------------------


def bench(torch, cp, cuda, quick):
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows = []
    dts = ("bfloat16",) if quick else ("bfloat16", "float16")
    Ns = (512, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    for dtname in dts:
        dtype = getattr(torch, dtname)
        for d in (64, 128):
            for causal in (False, True):
                for N in Ns:
                    B, H = 16384 // N, 2048 // d
                    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
                    do = torch.randn(B, H, N, d, device="cuda", dtype=dtype)
                    flops = 4 * B * H * N * N * d / (2 if causal else 1)
                    scale = 1 / math.sqrt(d)
                    # cuflash on (B, N, H, d) views of the same memory
                    qc, kc, vc, doc = (cp.from_dlpack(x.transpose(1, 2)) for x in (q, k, v, do))
                    off = 0 if causal else None
                    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

                    def cf_fwd():
                        with stream:
                            return cuda.forward(qc, kc, vc, scale=scale, variant=variant_for(off, 0, 0), algorithm="fa2",
                                                block_q=None, block_k=None)

                    def cf_fwdbwd():
                        with stream:
                            o, l = cuda.forward(qc, kc, vc, scale=scale, variant=variant_for(off, 0, 0), algorithm="fa2",
                                                block_q=None, block_k=None)
                            return cuda.backward(doc, qc, kc, vc, o, l, scale=scale, variant=variant_for(off, 0, 0),
                                                 algorithm="fa2", block_q=None, block_k=None, order="kv_outer")

                    qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

                    def th_fwd():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def th_fwdbwd():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                        qr.grad = kr.grad = vr.grad = None
                        o.backward(do)

                    # correctness vs torch first
                    o_c, _ = cf_fwd()
                    torch.cuda.synchronize()
                    o_t = th_fwd()
                    diff = float((torch.from_dlpack(o_c).transpose(1, 2).float() - o_t.float()).abs().max())
                    r = {"dtype": dtname, "d": d, "causal": causal, "N": N, "maxdiff_vs_torch": diff}
                    for name, fn, mult in (("cf_fwd", cf_fwd, 1), ("th_fwd", th_fwd, 1),
                                           ("cf_fb", cf_fwdbwd, 3.5), ("th_fb", th_fwdbwd, 3.5)):
                        ms = tt.do_bench(fn, warmup=25, rep=100 if quick else 200, return_mode="median")
                        r[name] = flops * mult / ms / 1e9
                    rows.append(r)
                    log(json.dumps(r))
                    del q, k, v, do, qr, kr, vr
    return rows


FWD_SWEEP = {
    64: [(128, 64, 4, 2), (128, 128, 4, 2)],
}


def sweep(torch, cp, cuda):
    """Forward tile candidates: check against torch flash, then time at N = 4096 (ANCHORS grid)."""
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows = []
    cc = cp.cuda.Device().compute_capability
    arch = cuda.attention.arch_class(int(cc))
    for d, cands in FWD_SWEEP.items():
        saved = cuda.TILES[("fwd", arch, d)]
        N = 4096
        B, H = 16384 // N, 2048 // d
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qc, kc, vc = (cp.from_dlpack(x.transpose(1, 2)) for x in (q, k, v))
        for cand in cands:
            cuda.TILES[("fwd", arch, d)] = cuda.Tile(*cand)
            for causal in (False, True):
                off = 0 if causal else None
                fn = lambda: cuda.forward(qc, kc, vc, scale=d ** -0.5, variant=variant_for(off, 0, 0), algorithm="fa2",
                                          block_q=None, block_k=None)
                try:
                    o, _ = fn()
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o_t = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    diff = float((torch.from_dlpack(o).transpose(1, 2).float() - o_t.float()).abs().max())
                    ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    tf = 4 * B * H * N * N * d / (2 if causal else 1) / ms / 1e9
                except Exception as exc:
                    diff, tf = float("nan"), 0.0
                    log("sweep EXC", d, cand, exc)
                rows.append((d, cand, causal, tf, diff))
                log("sweep", d, cand, causal, f"{tf:.0f}", f"{diff:.3g}")
        cuda.TILES[("fwd", arch, d)] = saved
    return rows


BWD_SWEEP = {64: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2)]}


def sweep_bwd(torch, cp, cuda):
    """Backward (kv_outer) tile candidates at N = 4096: max |dq - dq of the shipped tile|, then time."""
    import triton.testing as tt

    rows = []
    arch = cuda.attention.arch_class(int(cp.cuda.Device().compute_capability))
    for d, cands in BWD_SWEEP.items():
        saved = cuda.TILES[("bwd", arch, d)]
        N = 4096
        B, H = 16384 // N, 2048 // d
        q, k, v, do = (cp.random.standard_normal((B, N, H, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
        for causal in (False, True):
            off = 0 if causal else None
            o, lse = cuda.forward(q, k, v, scale=d ** -0.5, variant=variant_for(off, 0, 0), algorithm="fa2", block_q=None, block_k=None)
            fn = lambda: cuda.backward(do, q, k, v, o, lse, scale=d ** -0.5, variant=variant_for(off, 0, 0), algorithm="fa2",
                                       block_q=None, block_k=None, order="kv_outer")
            cuda.TILES[("bwd", arch, d)] = saved
            ref = fn()
            for cand in cands:
                cuda.TILES[("bwd", arch, d)] = cuda.Tile(*cand)
                g = fn()
                diff = max(float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max()) for a, b in zip(g, ref))
                ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
                tf = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1) / ms / 1e9
                rows.append((d, cand, causal, tf, diff))
                log("sweep bwd", d, cand, causal, f"{tf:.0f}", f"{diff:.3g}")
        cuda.TILES[("bwd", arch, d)] = saved
    return rows


def sanitize_decode(cp):
    """Small calls of the decode launches for compute-sanitizer: MLA (576 / 512, page 64) with its key tiles by TMA
    (no append; 3 and 4 tiles: an odd pair and a partial last tile) and by cp.async (an append), a contiguous MLA
    cache, and a chunked-prefill step with a sequence out of range (the forward's NaN rows)."""
    import ml_dtypes
    import numpy as np

    import cuflash

    rng = np.random.default_rng(0)

    def bf16(*shape):
        return cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16))

    lens = cp.asarray(np.array([200, 130], np.int32))
    table = cp.asarray(rng.permutation(8).astype(np.int32).reshape(2, 4))
    pool = bf16(8, 64, 1, 576)
    q = bf16(2, 1, 16, 576)
    for call in (dict(), dict(k=bf16(2, 1, 1, 576), v=bf16(2, 1, 1, 512))):
        out = cuflash.attention_with_kvcache(q, pool, pool[..., :512], cache_seqlens=lens, block_table=table,
                                             causal=True, softmax_scale=0.07, **call)
        log("sanitize MLA paged", "append" if call else "TMA", "finite:", bool(cp.isfinite(out).all()))
    flat = bf16(2, 256, 1, 576)
    out = cuflash.attention_with_kvcache(q, flat, flat[..., :512], cache_seqlens=lens, num_splits=2)
    log("sanitize MLA contiguous, 2 splits, finite:", bool(cp.isfinite(out).all()))
    kc, vc = bf16(2, 1024, 2, 64), bf16(2, 1024, 2, 64)
    bad = cp.asarray(np.array([300, 1000], np.int32))  # (1000 + 64 new > 1024 slots: out of range)
    out = cuflash.attention_with_kvcache(bf16(2, 64, 8, 64), kc, vc, bf16(2, 64, 2, 64), bf16(2, 64, 2, 64),
                                         cache_seqlens=bad, causal=True)
    log("sanitize chunked prefill: sequence 0 finite", bool(cp.isfinite(out[0]).all()), "sequence 1 NaN",
        bool(cp.isnan(out[1]).all()))


def sanitize_planned(cp):
    """Small calls through the front door for compute-sanitizer: the planned forward and backward (the TMA entry points
    where the device has them: flash_bwd_dkdv_sm90_tma_kernel and, with CUFLASH_BWD_DQ_TILE=1, its whole-tile dQ and
    flash_bwd_convert_dq_tiles_kernel), bf16 at d 64 and 128, dense and causal, lengths that end inside a tile
    (GQA 4 / 2), with dQ, dK, dV checked finite."""
    import ml_dtypes
    import numpy as np

    import cuflash

    rng = np.random.default_rng(1)

    def bf16(*shape):
        return cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16))

    for d in (64, 128):
        for causal in (False, True):
            q, do = bf16(2, 200, 4, d), bf16(2, 200, 4, d)
            k, v = bf16(2, 333, 2, d), bf16(2, 333, 2, d)
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
            log("sanitize planned backward d", d, "causal", causal, "finite:",
                all(bool(cp.isfinite(g).all()) for g in (out, *grads)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="--sanitize: the decode launches only")
    ap.add_argument("--planned-only", action="store_true", help="--sanitize: the front door's planned calls only")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()

    import cupy as cp
    import torch

    from cuflash import _cuda as cuda

    dev = cp.cuda.Device()
    log("device", cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), "cc", dev.compute_capability,
        "cupy", cp.__version__, "torch", torch.__version__, "bf16 in cupy:", hasattr(cp, "bfloat16"))

    if args.sanitize:
        for d, dtname, causal in () if args.decode_only or args.planned_only else ((64, "bfloat16", "br"), (128, "float16", None), (128, "bfloat16", "tl"),
                                  (64, "float32", "br"), (256, "float32", None)):
            case = (1, 77, 131, 2, 1, d, dtname, causal, "bhnd")
            check_case(torch, cp, cuda, case, [])
        if not args.decode_only:
            sanitize_planned(cp)
        if not args.planned_only:
            sanitize_decode(cp)
        return

    t0 = time.time()
    summary = []
    if args.check:
        results, fails = run_check(torch, cp, cuda, args.quick)
        with open(os.path.join(args.out, "check.json"), "w") as f:
            json.dump(results, f, default=str)
        summary.append(f"check: {len(results) - fails}/{len(results)} cases pass ({time.time() - t0:.0f} s)")
        for r in results:
            if not r["ok"]:
                summary.append(f"  FAIL {r['case']} {str({k: r.get(k) for k in ('fwd', 'lse', 'kv_outer', 'split', 'det')})[:400]}")
    if args.sweep:
        for d, cand, causal, tf, diff in sweep(torch, cp, cuda):
            summary.append(f"sweep fwd bf16 d={d} tile={cand} causal={int(causal)} N=4096: {tf:.0f} TFLOP/s (diff {diff:.3g})")
    if args.sweep:
        for d, cand, causal, tf, diff in sweep_bwd(torch, cp, cuda):
            summary.append(f"sweep bwd fp16 d={d} tile={cand} causal={int(causal)} N=4096: {tf:.0f} TFLOP/s (diff {diff:.3g})")
    if args.bench:
        rows = bench(torch, cp, cuda, args.quick)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(rows, f)
        summary.append("dtype d causal N | cf_fwd th_fwd ratio | cf_fb th_fb ratio | maxdiff")
        for r in rows:
            summary.append(
                f"{r['dtype'][:4]} {r['d']} {int(r['causal'])} {r['N']} | {r['cf_fwd']:.0f} {r['th_fwd']:.0f} "
                f"{r['cf_fwd'] / r['th_fwd']:.2f} | {r['cf_fb']:.0f} {r['th_fb']:.0f} {r['cf_fb'] / r['th_fb']:.2f} | "
                f"{r['maxdiff_vs_torch']:.3g}")
    log("\n".join(summary))


if __name__ == "__main__":
    sys.exit(main())
