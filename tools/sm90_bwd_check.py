"""One call on an H100/H200 for the draft Hopper backward (cuflash_kernels/backward_sm90.cu, not dispatched):
compile, check against a float64 truth, time against the shipped backward and torch-flash's backward.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 tools/sm90_bwd_check.py 2>&1 | tee $OUT/sm90_bwd_check.log

Each phase runs in a child process of its own, so that a kernel fault (illegal address, misaligned
descriptor) loses only that phase, not the whole device call:
  check  per variant (the two dQ splits of backward_sm90.cu, see VARIANTS): float16 and bfloat16, head dims
         64 and 128, tools/bwd_check.py's awkward cases (113 x 203, 1 x 257, 257 x 1, 1023 x 1024, 1024 x
         1023, 203 x 113 with rows that see no key, 300 x 300) plus multi-tile ones (2048 x 2048, 64 x 4096,
         4096 x 64), causal bottom-right / top-left / none, GQA 2:1, 4:1, MQA, (B, H, N, d) views. out and
         lse from a float32 softmax (no forward kernel involved); dq, dk, dv from a NaN-poisoned pool against
         3x the error of naive attention in the same dtype (+1e-4), truth in float64. A failing gradient is
         localized: which 64-row tiles and 32-column slices exceed the budget (tells the S^T / dV / dK / dQ
         phases and the two warpgroups' dQ column halves apart).
  bench  bfloat16 on the ANCHORS.md grid (batch = 16384 / N, heads = 2048 / d), d 64 and 128, causal and not,
         N 1024 .. 16384 (+ float16 at N = 4096): backward alone of torch-flash (autograd of SDPA with the
         FLASH_ATTENTION backend), of the shipped cuflash backward (order kv_outer) and of each variant on
         the same out and lse; FLOPs 2.5 x forward (4 B H N^2 d, halved when causal). Every variant's
         gradients are compared with torch-flash's first (max |diff| printed).
  sanitize (--sanitize) one small causal GQA case per head dim under compute-sanitizer memcheck and
         racecheck, if compute-sanitizer is on PATH.
Prints a summary table last; JSON rows go to --out (default $OUT or /tmp).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuflash import _cuda as cuda  # noqa: E402
from cuflash._cuda import Tile  # noqa: E402

# Tiles of flash_bwd_dkdv_sm90_kernel per head dim: block_m = 64 streamed query rows, block_n = 64 key rows
# per computing warpgroup, warps, stages (2 query buffers).
TILES = {64: Tile(64, 128, 8, 2), 128: Tile(64, 128, 8, 2)}
# Variants: name -> extra NVRTC options. "nsplit": the two warpgroups split dQ's head-dim columns (a
# descriptor starting 64 bytes into a swizzle row at d = 64); "ksplit": they split the keys instead
# (twice the dQ reductions, only 1024-byte-aligned row starts).
VARIANTS = {"nsplit": ("-DCUFLASH_SM90_BWD_DQ_KEY_SPLIT=0",), "ksplit": ("-DCUFLASH_SM90_BWD_DQ_KEY_SPLIT=1",)}
CT = {"bfloat16": "cuflash::bf16", "float16": "cuflash::fp16"}


def log(*a):
    print(*a, flush=True)


def kernel_name(ctype: str, d: int, t: Tile, causal: bool, has_dq: bool = True) -> str:
    return (f"cuflash::flash_bwd_dkdv_sm90_kernel<{ctype}, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, "
            f"{'true' if causal else 'false'}, {'true' if has_dq else 'false'}>")


def kernel_smem(d: int, t: Tile) -> int:
    """Sm90BwdConfig::kSmemBytes: K, V; 2 x (Q, dO); dS^T (16-bit); 2 x (lse, D) float32; 1024 alignment."""
    return 2 * (2 * t.block_n * d + 4 * t.block_m * d + t.block_n * t.block_m) + 16 * t.block_m + 1024


def options(variant: str) -> tuple[str, ...]:
    return cuda.SM90A_OPTIONS + VARIANTS[variant]


def sm90_backward(cp, do, q, k, v, out, lse, *, scale, causal_offset, variant, dtname=None):
    """cuflash's fp16/bf16 backward (order kv_outer, _cuda.backward) with flash_bwd_dkdv_sm90_kernel in place
    of flash_bwd_dkdv_kernel: the same preprocess, convert-dQ and GQA-reduce kernels of backward.cu."""
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    causal = causal_offset is not None
    ctype = CT[dtname or np.dtype(q.dtype).name]
    t = TILES[d]
    dq = cp.empty(q.shape, dtype=q.dtype)
    dk = cp.empty(k.shape, dtype=k.dtype)
    dv = cp.empty(v.shape, dtype=v.dtype)
    q, k, v, do = cuda._aligned(q), cuda._aligned(k), cuda._aligned(v), cuda._aligned(do)
    lse = cp.ascontiguousarray(lse)
    delta = cp.empty((B, Hq, Nq), dtype=cp.float32)
    i32 = np.int32
    pre = cuda._kernel("backward.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {d}>")
    pre((cuda._cdiv(Nq, 4), Hq, B), (128,), (do, out, delta, i32(Nq), i32(Hq), *cuda._strides(do), *cuda._strides(out)))
    smem = kernel_smem(d, t)
    kern = cuda._kernel("backward_sm90.cu", kernel_name(ctype, d, t, causal), smem, options(variant))
    dq_accum = cp.zeros((B, Hq, Nq, d), dtype=cp.float32)
    dkv_accum = cp.empty((2, B, Hq, Nk, d), dtype=cp.float32) if group > 1 else None
    null = np.uintp(0)
    kern((cuda._cdiv(Nk, t.block_n), Hq, B), (32 * t.warps,), (
        q, k, v, do, lse, delta, dq_accum, dk, dv, dkv_accum if dkv_accum is not None else null,
        i32(Nq), i32(Nk), i32(Hq), i32(group),
        *cuda._strides(q), *cuda._strides(k), *cuda._strides(v), *cuda._strides(do), *cuda._strides(dk),
        *cuda._strides(dv), np.float32(scale), i32(causal_offset if causal else 0)), shared_mem=smem)
    conv = cuda._kernel("backward.cu", f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {d}>")
    conv((cuda._cdiv(Nq * d // 2, 256), Hq, B), (256,), (dq_accum, dq, i32(Nq), i32(Hq), *cuda._strides(dq),
                                                        np.float32(scale)))
    if group > 1:
        red = cuda._kernel("backward.cu", f"cuflash::flash_bwd_reduce_dkv_kernel<{ctype}, {d}>")
        red((cuda._cdiv(Nk * d // 2, 256), Hkv, B), (256,), (
            dkv_accum, dk, dv, i32(Nk), i32(group), np.int64(B * Hq * Nk * d), *cuda._strides(dk), *cuda._strides(dv)))
    return dq, dk, dv


def precompile(cp, variants, dtypes, dims, causals):
    """Compile the sm90 kernels (and backward.cu's helpers) in a thread pool into cuflash's module cache."""
    dev = cp.cuda.runtime.getDevice()
    jobs = []
    for dt in dtypes:
        ctype = CT[dt]
        for d in dims:
            for name in (f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {d}>",
                         f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {d}>",
                         f"cuflash::flash_bwd_reduce_dkv_kernel<{ctype}, {d}>"):
                jobs.append(("backward.cu", name, cuda.NVRTC_OPTIONS))
            for var in variants:
                for c in causals:
                    jobs.append(("backward_sm90.cu", kernel_name(ctype, d, TILES[d], c), options(var)))

    def one(job):
        source, name, opts = job
        cp.cuda.Device(dev).use()
        mod = cp.RawModule(code=cuda.compile_source_for_nvrtc(source), options=opts, name_expressions=[name])
        return (dev, source, opts, name), mod.get_function(name)

    t0, errors = time.time(), []
    with cf.ThreadPoolExecutor(max_workers=16) as ex:
        for fut in cf.as_completed([ex.submit(one, j) for j in jobs]):
            try:
                key, fn = fut.result()
                cuda._modules[key] = [fn, 0]
            except Exception as exc:
                errors.append(str(exc)[-3000:])
    log(f"precompiled {len(jobs)} kernels in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors[:3]:
        log("COMPILE ERROR:", e)
    return not errors


# --------------------------------------------------------------------------------------------------
# Correctness


def build_cases():
    cases = []
    for dt in ("bfloat16", "float16"):
        for d in (64, 128):
            cases.append((2, 113, 203, 4, 2, d, dt, None, "bnhd"))
            cases.append((2, 113, 203, 4, 2, d, dt, "br", "bnhd"))
            cases.append((1, 257, 1, 2, 2, d, dt, None, "bnhd"))
            cases.append((1, 1, 257, 2, 1, d, dt, "br", "bnhd"))
            cases.append((1, 1023, 1024, 2, 1, d, dt, "tl", "bhnd"))
            cases.append((1, 1024, 1023, 4, 4, d, dt, "br", "bhnd"))
            cases.append((2, 203, 113, 4, 1, d, dt, "br", "bnhd"))  # rows that see no key
            cases.append((1, 300, 300, 2, 2, d, dt, "tl", "bnhd"))
            cases.append((1, 2048, 2048, 2, 1, d, dt, "br", "bnhd"))
            cases.append((1, 2048, 2048, 2, 2, d, dt, None, "bhnd"))
            cases.append((1, 64, 4096, 2, 2, d, dt, "br", "bnhd"))
            cases.append((1, 4096, 64, 2, 2, d, dt, "tl", "bnhd"))
    return cases


def localize(err, budget, d):
    """Where a (B, N, H, d) error exceeds the budget: 64-row tiles and 32-column slices hit, as short text."""
    bad = (err > budget)
    if not bool(bad.any()):
        return ""
    rows = bad.any(dim=3).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    cols = bad.any(dim=2).any(dim=1).any(dim=0).nonzero().flatten().tolist()
    tiles = sorted({r // 64 for r in rows})
    slices = sorted({c // 32 for c in cols})
    return (f"{int(bad.sum())} elements over budget; row tiles (64) {tiles[:12]}{'...' if len(tiles) > 12 else ''}, "
            f"column slices (32) {slices} of {d // 32}; rows within tile {sorted({r % 64 for r in rows})[:16]}")


def check_case(torch, cp, bwd, case, variant):
    B, Nq, Nk, Hq, Hkv, d, dtname, causal, layout = case
    dtype = getattr(torch, dtname)
    offset = None if causal is None else (Nk - Nq if causal == "br" else 0)
    scale = 1.0 / math.sqrt(d)
    q, k, v, do = bwd.make_inputs(torch, B, Nq, Nk, Hq, Hkv, d, dtype, layout, seed=zlib.crc32(str(case).encode()) % 100000)
    for x in (q, k, v):
        x.requires_grad_(True)
    ref = bwd.ref_attention(torch, q, k, v, scale, offset, upcast=True)
    gref = torch.autograd.grad(ref, (q, k, v), do.to(torch.float64))
    low = bwd.ref_attention(torch, q, k, v, scale, offset, upcast=False)
    glow = torch.autograd.grad(low, (q, k, v), do)
    with torch.no_grad():  # out and lse as a forward kernel leaves them (float32 softmax, out rounded once)
        qh, kh, vh = (x.float().transpose(1, 2) for x in (q, k, v))
        kh, vh = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (kh, vh))
        s = scale * qh @ kh.transpose(-1, -2)
        if offset is not None:
            i = torch.arange(Nq, device="cuda")[:, None]
            j = torch.arange(Nk, device="cuda")[None, :]
            s = s.masked_fill(j > i + offset, float("-inf"))
        lse_t = torch.logsumexp(s, dim=-1).contiguous()
        o_t = (torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0) @ vh).transpose(1, 2).to(dtype).contiguous()
    cq, ck, cv, cdo = (cp.from_dlpack(x.detach()) for x in (q, k, v, do))
    out, lse = cp.from_dlpack(o_t), cp.from_dlpack(lse_t)
    bwd.poison_pool(cp)
    grads = sm90_backward(cp, cdo, cq, ck, cv, out, lse, scale=scale, causal_offset=offset, variant=variant)
    cp.cuda.runtime.deviceSynchronize()
    row = {"case": case, "variant": variant}
    ok, worst, where = True, 0.0, {}
    for name, a, r, r0 in zip(("dq", "dk", "dv"), grads, gref, glow):
        ta = torch.from_dlpack(a).double()
        nan = int(torch.isnan(ta).sum())
        ea = float((ta - r).abs().max()) if ta.numel() else 0.0
        eb = float((r0.double() - r).abs().max()) if ta.numel() else 0.0
        good = nan == 0 and ea <= 3 * eb + 1e-4
        row[name] = {"err": ea, "naive_err": eb, "nan": nan}
        if not good and ta.numel():
            where[name] = localize((ta - r).abs(), 3 * eb + 1e-4, d) + (f"; {nan} NaN" if nan else "")
        ok = ok and good
        worst = max(worst, ea / (eb + 1e-4 / 3))
    row["ok"], row["worst_ratio"], row["where"] = ok, worst, where
    return row


def phase_check(args):
    import cupy as cp
    import torch

    import bwd_check as bwd

    variants = [v for v in args.variants.split(",") if v]
    if not precompile(cp, variants, ("bfloat16", "float16"), (64, 128), (False, True)):
        return 2
    rows = []
    for variant in variants:
        t0, nfail = time.time(), 0
        for case in build_cases():
            try:
                row = check_case(torch, cp, bwd, case, variant)
            except Exception:
                row = {"case": case, "variant": variant, "ok": False, "exc": traceback.format_exc()[-2500:]}
                log("EXC", variant, case, row["exc"])
                if any(w in row["exc"] for w in ("illegal", "misaligned", "cudaErrorLaunch", "unspecified launch")):
                    rows.append(row)
                    log("sticky CUDA error: this process's context is lost, stopping the phase")
                    _dump(args, rows, "sm90_bwd_check_correct_" + "_".join(variants) + ".json")
                    return 3
            rows.append(row)
            nfail += not row["ok"]
            log(json.dumps(row, default=str))
        log(f"check {variant}: {sum(r['ok'] for r in rows if r['variant'] == variant)}/"
            f"{sum(r['variant'] == variant for r in rows)} pass ({time.time() - t0:.0f} s)")
    _dump(args, rows, "sm90_bwd_check_correct_" + "_".join(variants) + ".json")
    return 0 if all(r["ok"] for r in rows) else 1


# --------------------------------------------------------------------------------------------------
# Timing


def cells(quick):
    Ns = (1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384)
    out = [("bfloat16", d, c, N) for d in (64, 128) for c in (False, True) for N in Ns]
    return out + [("float16", d, c, 4096) for d in (64, 128) for c in (False, True)]


def phase_bench(args):
    import cupy as cp
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    variants = [v for v in args.variants.split(",") if v]
    sm90 = [v for v in variants if v in VARIANTS]
    if sm90 and not precompile(cp, sm90, ("bfloat16", "float16"), (64, 128), (False, True)):
        return 2
    if "shipped" in variants:
        import bwd_check as bwd

        arch = cuda._arch_class(int(cp.cuda.Device().compute_capability))
        bwd.precompile(cp, cuda, bwd.backward_names(cuda, arch, ("bfloat16", "float16"), (64, 128), (False, True),
                                                    ("kv_outer",)))
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    rows = []
    for dtname, d, causal, N in cells(args.quick):
        dtype = getattr(torch, dtname)
        B, H = 16384 // N, 2048 // d
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(4))
        fl = 4 * B * H * N * N * d / (2 if causal else 1) * 2.5
        scale = 1 / math.sqrt(d)
        off = 0 if causal else None
        qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o_t = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        o_a, lse_t = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        lse_t = lse_t[..., :N].contiguous()
        qc, kc, vc, doc, oc = (cp.from_dlpack(x.detach().transpose(1, 2)) for x in (q, k, v, do, o_a))
        lc = cp.from_dlpack(lse_t)

        def th_bwd():
            return torch.autograd.grad(o_t, (qr, kr, vr), do, retain_graph=True)

        g_t = th_bwd()
        r = {"dtype": dtname, "d": d, "causal": causal, "N": N}
        fns = {}
        if "torch" in variants:
            fns["torch"] = th_bwd
        if "shipped" in variants:
            def shipped():
                with stream:
                    return cuda.backward(doc, qc, kc, vc, oc, lc, scale=scale, causal_offset=off, algorithm="fa2",
                                         block_q=None, block_k=None, order="kv_outer")
            fns["shipped"] = shipped
        for var in sm90:
            def run(var=var):
                with stream:
                    return sm90_backward(cp, doc, qc, kc, vc, oc, lc, scale=scale, causal_offset=off, variant=var)
            fns[var] = run
        for name, fn in fns.items():
            try:
                g = fn()
                torch.cuda.synchronize()
                if name != "torch":
                    r[f"diff_{name}"] = max(float((torch.from_dlpack(a).transpose(1, 2).float() - b.float()).abs().max())
                                            for a, b in zip(g, g_t))
                r[name] = fl / tt.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median") / 1e9
            except Exception as exc:
                r[name] = float("nan")
                log("bench", name, "failed:", str(exc)[-600:])
                if "illegal" in str(exc) or "misaligned" in str(exc):
                    rows.append(r)
                    _dump(args, rows, "sm90_bwd_bench_" + "_".join(variants) + ".json")
                    return 3
        rows.append(r)
        log(json.dumps(r))
    _dump(args, rows, "sm90_bwd_bench_" + "_".join(variants) + ".json")
    return 0


def _dump(args, rows, name):
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(rows, f)


# --------------------------------------------------------------------------------------------------
# compute-sanitizer


def phase_sanitize(args):
    import cupy as cp

    rng = np.random.default_rng(0)
    variants = [v for v in args.variants.split(",") if v in VARIANTS]
    for var in variants:
        for d in (64, 128):
            B, Nq, Nk, Hq, Hkv = 1, 77, 131, 4, 2
            q = cp.asarray(rng.standard_normal((B, Hq, Nq, d)).astype(np.float16)).transpose(0, 2, 1, 3)
            k = cp.asarray(rng.standard_normal((B, Nk, Hkv, d)).astype(np.float16))
            v = cp.asarray(rng.standard_normal((B, Nk, Hkv, d)).astype(np.float16))
            do = cp.asarray(rng.standard_normal((B, Nq, Hq, d)).astype(np.float16))
            out = cp.asarray(rng.standard_normal((B, Nq, Hq, d)).astype(np.float16))
            lse = cp.asarray(rng.standard_normal((B, Hq, Nq)).astype(np.float32) + 5)
            sm90_backward(cp, do, q, k, v, out, lse, scale=d ** -0.5, causal_offset=Nk - Nq, variant=var)
            cp.cuda.runtime.deviceSynchronize()
            log("sanitize launch done", var, d)
    return 0


# --------------------------------------------------------------------------------------------------


def child(phase, args, variants, timeout, deadline, reserve):
    """Run one phase in a child process, within `timeout` and leaving `reserve` seconds before `deadline`."""
    timeout = max(20, min(timeout, int(deadline - time.time() - reserve)))
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--variants", variants, "--out", args.out,
           "--rep-ms", str(args.rep_ms)] + (["--quick"] if args.quick else [])
    log(f"=== {phase} [{variants}]: {' '.join(cmd)}")
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    log(f"=== {phase} [{variants}] rc {rc} ({time.time() - t0:.0f} s)")
    return rc


def summary(args, rcs):
    lines = [f"phase return codes: {rcs}"]
    rows = []
    for name in sorted(os.listdir(args.out)):
        if name.startswith("sm90_bwd_check_correct_") and name.endswith(".json"):
            rows += json.load(open(os.path.join(args.out, name)))
    if rows:
        for var in VARIANTS:
            rs = [r for r in rows if r["variant"] == var]
            if rs:
                worst = max((r.get("worst_ratio", 0.0) for r in rs), default=0.0)
                lines.append(f"check {var}: {sum(r['ok'] for r in rs)}/{len(rs)} pass, worst gradient error / naive "
                             f"error {worst:.2f} (budget 3)")
                for r in rs:
                    if not r["ok"]:
                        lines.append(f"  FAIL {r['case']} {r.get('where') or r.get('exc', '')[-300:]}")
    rows = {}
    for name in os.listdir(args.out):
        if name.startswith("sm90_bwd_bench_") and name.endswith(".json"):
            for r in json.load(open(os.path.join(args.out, name))):
                key = (r["dtype"], r["d"], r["causal"], r["N"])
                rows.setdefault(key, {}).update(r)
    if rows:
        names = ["torch", "shipped"] + list(VARIANTS)
        lines.append("backward TFLOP/s (2.5 x forward FLOPs); ratio = best sm90 variant / torch-flash")
        lines.append("dtype d causal N | " + " ".join(names) + " | shipped/torch best/torch | max|diff| vs torch")
        for key in sorted(rows):
            r = rows[key]
            vals = [r.get(n, float("nan")) for n in names]
            best = max((r.get(v, float("nan")) for v in VARIANTS if r.get(v, float("nan")) == r.get(v, float("nan"))),
                       default=float("nan"))
            th = r.get("torch", float("nan"))
            diffs = " ".join(f"{v}:{r.get('diff_' + v, float('nan')):.3g}" for v in VARIANTS)
            lines.append(f"{key[0][:4]} {key[1]} {int(key[2])} {key[3]} | " + " ".join(f"{x:.0f}" for x in vals)
                         + f" | {r.get('shipped', float('nan')) / th:.2f} {best / th:.2f} | {diffs}")
    log("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("all", "check", "bench", "sanitize"), default="all")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="timing at N = 1024, 4096, 16384 only")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--budget-s", type=int, default=540, help="wall-clock budget of all phases (device call: 600 s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.phase == "check":
        return phase_check(args)
    if args.phase == "bench":
        return phase_bench(args)
    if args.phase == "sanitize":
        return phase_sanitize(args)

    t0 = time.time()
    deadline = t0 + args.budget_s
    rcs = {}
    variants = [v for v in args.variants.split(",") if v]
    plan = [] if args.no_check else [("check", v, 180) for v in variants]
    plan += [] if args.no_bench else [("bench", "torch,shipped", 180)] + [("bench", v, 120) for v in variants]
    for i, (phase, var, limit) in enumerate(plan):
        reserve = 40 * (len(plan) - i - 1)  # a minimum for every later phase
        rcs[f"{phase} {var}"] = child(phase, args, var, limit, deadline, reserve)
    if args.sanitize:
        san = shutil.which("compute-sanitizer")
        if san is None:
            log("compute-sanitizer not on PATH: sanitize skipped")
        else:
            for tool in ("memcheck", "racecheck"):
                cmd = [san, "--tool", tool, "--error-exitcode", "9", sys.executable, os.path.abspath(__file__),
                       "--phase", "sanitize", "--variants", args.variants, "--out", args.out]
                log("===", " ".join(cmd))
                try:
                    rcs[f"sanitize {tool}"] = subprocess.run(cmd, timeout=300).returncode
                except subprocess.TimeoutExpired:
                    rcs[f"sanitize {tool}"] = 124
    summary(args, rcs)
    log(f"total {time.time() - t0:.0f} s")
    return 0 if all(rc == 0 for rc in rcs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
