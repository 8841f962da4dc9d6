"""One call on the GPU machine for the backward: compile, check against a float64 truth, time against
PyTorch's FlashAttention-2 backward.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 tools/bwd_check.py [--quick] [--no-check] [--out DIR] 2>&1 | tee $OUT/log

1. Compiles every backward instantiation the run needs in a thread pool (NVRTC releases the GIL; CuPy's
   disk cache does not serve modules with name expressions, so each process compiles once).
2. Correctness (float16 and bfloat16, head dims 32, 64, 96, 128): awkward lengths (113, 203), (1, 257),
   (257, 1), (1023, 1024), (1024, 1023), (203, 113) with query rows that see no key; causal bottom-right,
   top-left and none; GQA 2:1 and 4:1, MQA; (B, H, N, d) views. out and lse come from the naive forward
   (float32 softmax), so the check does not depend on the forward kernels. Gradients of both orders
   (kv_outer, split) vs a float64 truth against 3x the error of naive attention in the same dtype, NaN-
   poisoned memory pool, split order bitwise reproducible.
3. Timing on the ANCHORS.md grid (batch = 16384 / N, heads = 2048 / d): backward alone of each variant and
   of torch-flash (autograd of SDPA, FLASH_ATTENTION backend, same out and lse), FLOPs 2.5 x forward; the
   forward of both, so that fwd+bwd is reported measured and projected with the forward at parity.
Prints a short table last; full records go to DIR (default $OUT or /tmp) as bwd_check.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import sys
import time
import traceback
import zlib

from _gpu_tools import log, make_inputs, poison_pool, ref_attention




# Variants of the backward timed side by side: name -> (extra NVRTC options, {head_dim: bwd Tile args}).
# Options reach the kernels through cuflash._cuda._kernel's default options (for -D knobs while tuning);
# the tile entries replace the "bwd" rows of the tile table for this GPU's arch class.
VARIANTS = {
    "shipped": ((), {}),
    "d64_8warps": ((), {64: (64, 128, 8, 2)}),
    "d128_4warps": ((), {128: (64, 64, 4, 2)}),
}


class Variant:
    def __init__(self, cuda, arch, name):
        self.cuda, self.arch, self.name = cuda, arch, name
        self.extra, self.tiles = VARIANTS[name]

    def __enter__(self):
        c = self.cuda
        self.saved = (c.NVRTC_OPTIONS, dict(c.TILES), c._kernel.__defaults__)
        c.NVRTC_OPTIONS = tuple(self.saved[0]) + tuple(self.extra)
        if c._kernel.__defaults__ and len(c._kernel.__defaults__) == 2:  # _kernel(source, name, smem=0, options=...)
            c._kernel.__defaults__ = (c._kernel.__defaults__[0], c.NVRTC_OPTIONS)
        for d, t in self.tiles.items():
            c.TILES[("bwd", self.arch, d)] = c.Tile(*t)
        return self

    def __exit__(self, *exc):
        self.cuda.NVRTC_OPTIONS = self.saved[0]
        self.cuda._kernel.__defaults__ = self.saved[2]
        self.cuda.TILES.clear()
        self.cuda.TILES.update(self.saved[1])


def backward_names(cuda, arch, dtypes, dims, causals, orders):
    """(source, name, smem) of every backward kernel a call with these settings launches."""
    out = []
    for dt in dtypes:
        ctype = cuda._CXX_TYPE[dt]
        for d in dims:
            out.append(("backward.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {d}>", 0))
            out.append(("backward.cu", f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {d}>", 0))
            out.append(("backward.cu", f"cuflash::flash_bwd_reduce_dkv_kernel<{ctype}, {d}>", 0))
            t = cuda.TILES[("bwd", arch, d)]
            tq = cuda.TILES[("bwd_dq", arch, d)]
            for causal in causals:
                for order in orders:
                    split = order == "split"
                    out.append(("backward.cu", cuda._dkdv_name(ctype, d, t, causal, not split), cuda._dkdv_smem(d, t, not split)))
                    if split:
                        out.append(("backward.cu", cuda._dq_name(ctype, d, tq, causal), cuda._dq_smem(d, tq)))
    return out


def precompile(cp, cuda, items, workers=16):
    """Compile (source, name, smem) items in parallel and put them in cuflash's module cache."""
    dev = cp.cuda.runtime.getDevice()
    todo = []
    seen = set()
    for source, name, smem in items:
        key = (dev, source, cuda.NVRTC_OPTIONS, name)
        if key in cuda._modules or key in seen:
            continue
        seen.add(key)
        todo.append((key, source, name))
    opts = cuda.NVRTC_OPTIONS
    t0 = time.time()

    def one(job):
        key, source, name = job
        cp.cuda.Device(dev).use()
        text = cuda.compile_source_for_nvrtc(source)
        mod = cp.RawModule(code=text, options=opts, name_expressions=[name])
        return key, mod.get_function(name)

    errors = []
    with cf.ThreadPoolExecutor(max_workers=workers) as ex:
        for fut in cf.as_completed([ex.submit(one, j) for j in todo]):
            try:
                key, fn = fut.result()
                cuda._modules[key] = [fn, 0]
            except Exception as exc:  # compiled again (and reported) on first use
                errors.append(str(exc)[-2000:])
    log(f"precompiled {len(todo)} kernels ({' '.join(opts)}) in {time.time() - t0:.1f} s; {len(errors)} errors")
    for e in errors[:3]:
        log("compile error:", e)
    return len(errors)


# --------------------------------------------------------------------------------------------------
# Correctness


def build_cases():
    cases = []
    for dt in ("bfloat16", "float16"):
        for d in (32, 64, 96, 128):
            cases.append((2, 113, 203, 4, 2, d, dt, None, "bnhd"))
            cases.append((2, 113, 203, 4, 2, d, dt, "br", "bnhd"))
            cases.append((1, 257, 1, 2, 2, d, dt, None, "bnhd"))
            cases.append((1, 1023, 1024, 2, 1, d, dt, "tl", "bhnd"))
            cases.append((1, 1024, 1023, 4, 4, d, dt, "br", "bhnd"))
            cases.append((2, 203, 113, 4, 1, d, dt, "br", "bnhd"))  # rows that see no key
            cases.append((1, 300, 300, 2, 2, d, dt, "tl", "bnhd"))
    return cases








def check_case(torch, cp, cuda, case):
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
    # out and lse as a forward kernel leaves them: float32 softmax, out rounded once to the dtype.
    with torch.no_grad():
        qh, kh, vh = (x.float().transpose(1, 2) for x in (q, k, v))
        kh, vh = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (kh, vh))
        s = scale * qh @ kh.transpose(-1, -2)
        if offset is not None:
            i = torch.arange(Nq, device="cuda")[:, None]
            j = torch.arange(Nk, device="cuda")[None, :]
            s = s.masked_fill(j > i + offset, float("-inf"))
        lse_t = torch.logsumexp(s, dim=-1).contiguous()
        o_t = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0) @ vh
        o_t = o_t.transpose(1, 2).to(dtype).contiguous()
    out, lse = cp.from_dlpack(o_t), cp.from_dlpack(lse_t)
    grads = {}
    for order in ("kv_outer", "split"):
        poison_pool(cp)
        grads[order] = cuda.backward(cdo, cq, ck, cv, out, lse, scale=scale, causal_offset=offset, algorithm="fa2",
                                     block_q=None, block_k=None, order=order)
    rep = cuda.backward(cdo, cq, ck, cv, out, lse, scale=scale, causal_offset=offset, algorithm="fa2",
                        block_q=None, block_k=None, order="split")
    cp.cuda.runtime.deviceSynchronize()
    det = all(bool((a.view(cp.uint16) == b.view(cp.uint16)).all()) for a, b in zip(grads["split"], rep))
    row = {"case": case, "det": det}
    ok = det
    worst = 0.0
    for order, gs in grads.items():
        es = []
        for a, r, r0 in zip(gs, gref, glow):
            ta = torch.from_dlpack(a).double()
            nan = bool(torch.isnan(ta).any())
            ea = float((ta - r).abs().max()) if ta.numel() else 0.0
            eb = float((r0.double() - r).abs().max()) if ta.numel() else 0.0
            es.append((ea, eb))
            ok = ok and (not nan) and ea <= 3 * eb + 1e-4
            worst = max(worst, ea / (eb + 1e-4 / 3))
        row[order] = es
    row["ok"], row["worst_ratio"] = ok, worst
    return row


# --------------------------------------------------------------------------------------------------
# Timing


def bench(torch, cp, cuda, arch, cells, variants, rep_ms):
    import triton.testing as tt
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for dtname, d, causal, N in cells:
        dtype = getattr(torch, dtname)
        B, H = 16384 // N, 2048 // d
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(4))
        fl = 4 * B * H * N * N * d / (2 if causal else 1)
        scale = 1 / math.sqrt(d)
        off = 0 if causal else None
        qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o_t = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        # torch-flash's out and lse (natural log, (B, H, N) float32) for cuflash's backward
        o_a, lse_t = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        lse_t = lse_t[..., :N].contiguous()
        qc, kc, vc, doc, oc = (cp.from_dlpack(x.detach().transpose(1, 2)) for x in (q, k, v, do, o_a))
        lc = cp.from_dlpack(lse_t)

        def th_bwd():
            return torch.autograd.grad(o_t, (qr, kr, vr), do, retain_graph=True)

        def th_fwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def cf_fwd():
            with stream:
                return cuda.forward(qc, kc, vc, scale=scale, causal_offset=off, algorithm="fa2", block_q=None, block_k=None)

        r = {"dtype": dtname, "d": d, "causal": causal, "N": N}
        g_t = th_bwd()
        r["th_bwd"] = fl * 2.5 / tt.do_bench(th_bwd, warmup=25, rep=rep_ms, return_mode="median") / 1e9
        r["th_fwd"] = fl / tt.do_bench(th_fwd, warmup=25, rep=rep_ms, return_mode="median") / 1e9
        try:
            r["cf_fwd"] = fl / tt.do_bench(cf_fwd, warmup=25, rep=rep_ms, return_mode="median") / 1e9
        except Exception as exc:
            r["cf_fwd"] = float("nan")
            log("cf_fwd failed", str(exc)[:300])
        # other variants only on bfloat16 cells at N = 1024, 4096, 16384 (compile and device time)
        for vname in [v for v in variants if v == "shipped" or (dtname == "bfloat16" and N in (1024, 4096, 16384))]:
            with Variant(cuda, arch, vname):
                def cf_bwd():
                    with stream:
                        return cuda.backward(doc, qc, kc, vc, oc, lc, scale=scale, causal_offset=off, algorithm="fa2",
                                             block_q=None, block_k=None, order="kv_outer")
                try:
                    g_c = cf_bwd()
                    torch.cuda.synchronize()
                    diff = max(float((torch.from_dlpack(a).transpose(1, 2).float() - b.float()).abs().max())
                               for a, b in zip(g_c, g_t))
                    r[f"cf_bwd_{vname}"] = fl * 2.5 / tt.do_bench(cf_bwd, warmup=25, rep=rep_ms, return_mode="median") / 1e9
                    r[f"diff_{vname}"] = diff
                except Exception as exc:
                    r[f"cf_bwd_{vname}"] = float("nan")
                    log("variant", vname, "failed", str(exc)[-500:])
        rows.append(r)
        log(json.dumps(r))
        del q, k, v, do, qr, kr, vr, o_t, o_a, g_t
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer timing cells")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only a few backward calls (for ncu)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--check-variants", default="", help="variants to run the correctness cases on as well")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()

    import cupy as cp
    import torch

    from cuflash import _cuda as cuda

    if args.profile:  # a few backward calls for a profiler: bf16, d = 128 and 64, N = 4096, not causal
        for d in (128, 64):
            N, B, H = 4096, 4, 2048 // d
            q, k, v, do = (cp.random.standard_normal((B, N, H, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
            out, lse = q.copy(), cp.zeros((B, H, N), dtype=cp.float32)
            for _ in range(3):
                cuda.backward(do, q, k, v, out, lse, scale=d ** -0.5, causal_offset=None, algorithm="fa2",
                              block_q=None, block_k=None, order="kv_outer")
            cp.cuda.runtime.deviceSynchronize()
        return 0

    dev = cp.cuda.Device()
    cc = int(dev.compute_capability)
    arch = cuda._arch_class(cc)
    log("device", cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), "cc", cc, "cupy", cp.__version__,
        "torch", torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S"))
    variants = [v for v in args.variants.split(",") if v]
    t_start = time.time()

    # 1. compile
    dts = ("bfloat16", "float16")
    precompile(cp, cuda, backward_names(cuda, arch, dts, (32, 64, 96, 128), (False, True), ("kv_outer", "split"))
               + [("forward.cu", cuda._fwd_name(cuda._CXX_TYPE[dt], d, cuda.TILES[("fwd", arch, d)], c),
                   cuda._fwd_smem(d, cuda.TILES[("fwd", arch, d)])) for dt in dts for d in (64, 128) for c in (False, True)])
    for vname in variants:
        if vname == "shipped":
            continue
        with Variant(cuda, arch, vname):
            precompile(cp, cuda, backward_names(cuda, arch, ("bfloat16",), (64, 128), (False, True), ("kv_outer",)))

    summary = []
    fails = 0
    # 2. correctness (of the shipped kernels, and of each variant named in --check-variants)
    checks = [] if args.no_check else ["shipped"]
    checks += [v for v in args.check_variants.split(",") if v and v != "shipped"]
    for cname in checks:
        with Variant(cuda, arch, cname):
            if cname != "shipped":
                precompile(cp, cuda, backward_names(cuda, arch, dts, (32, 64, 96, 128), (False, True), ("kv_outer", "split")))
            t0 = time.time()
            results, nfail = [], 0
            for case in build_cases():
                try:
                    row = check_case(torch, cp, cuda, case)
                except Exception:
                    row = {"case": case, "ok": False, "exc": traceback.format_exc()[-2000:]}
                    log("EXC", case, row["exc"])
                results.append(row)
                nfail += not row["ok"]
                log(json.dumps(row, default=str))
        fails += nfail
        worst = max((r.get("worst_ratio", 0.0) for r in results), default=0.0)
        summary.append(f"check {cname}: {len(results) - nfail}/{len(results)} cases pass, worst gradient error / "
                       f"naive error {worst:.2f} (budget 3), split bitwise reproducible: "
                       f"{all(r.get('det', False) for r in results)} ({time.time() - t0:.0f} s)")
        for r in results:
            if not r["ok"]:
                summary.append(f"  FAIL {r['case']} {str({k: r.get(k) for k in ('kv_outer', 'split', 'det', 'exc')})[:600]}")
        with open(os.path.join(args.out, f"bwd_check_correct_{cname}.json"), "w") as f:
            json.dump(results, f, default=str)

    # 3. timing
    Ns = (1024, 4096, 16384) if args.quick else (512, 1024, 2048, 4096, 8192, 16384)
    cells = [("bfloat16", d, c, N) for d in (64, 128) for c in (False, True) for N in Ns]
    cells += [("float16", d, c, 4096) for d in (64, 128) for c in (False, True)]
    rows = bench(torch, cp, cuda, arch, cells, variants, rep_ms=100)
    with open(os.path.join(args.out, "bwd_check.json"), "w") as f:
        json.dump(rows, f)
    summary.append("bwd TFLOP/s (2.5x fwd FLOPs); fb_proj = fwd+bwd ratio with cuflash's forward at torch-flash's speed")
    summary.append("dtype d causal N | th_bwd " + " ".join(variants) + " | bwd ratio | th_fwd cf_fwd | fb_meas fb_proj")
    for r in rows:
        best = r.get("cf_bwd_shipped", float("nan"))
        tb, tf, cfw = r["th_bwd"], r["th_fwd"], r["cf_fwd"]
        # fwd+bwd = 3.5 F / (F / fwd_rate + 2.5 F / bwd_rate)
        th_fb = 3.5 / (1 / tf + 2.5 / tb)
        meas = 3.5 / (1 / cfw + 2.5 / best) / th_fb if cfw == cfw else float("nan")
        proj = 3.5 / (1 / tf + 2.5 / best) / th_fb
        summary.append(
            f"{r['dtype'][:4]} {r['d']} {int(r['causal'])} {r['N']} | {tb:.0f} "
            + " ".join(f"{r.get('cf_bwd_' + v, float('nan')):.0f}" for v in variants)
            + f" | {best / tb:.2f} | {tf:.0f} {cfw:.0f} | {meas:.2f} {proj:.2f}")
    summary.append(f"total {time.time() - t_start:.0f} s")
    log("\n".join(summary))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
