"""Side-by-side GPU benchmark: cuflash vs PyTorch SDPA (FLASH_ATTENTION, CUDNN_ATTENTION), same process,
same inputs, the FlashAttention FLOP convention of ANCHORS.md.

    python -m cuflash bench-gpu [--quick] [--dtypes bfloat16,float16] [--dims 64,128,256] [--seqlens ...]
                                [--no-extras] [--json FILE]
    python -m cuflash bench-gpu --float32 [--dims 64,128] [--seqlens 1024,4096] [--json FILE]
    python -m cuflash bench-gpu --fp8 [--dims 128,256] [--seqlens ...] [--json FILE]

``--float32``: float32 inputs at batch 2, 16 heads instead of the grid: cuflash's forward at each
``fp32_precision`` ("tf32x3", "fp16x3", "tf32", "ieee") and PyTorch SDPA's EFFICIENT_ATTENTION and MATH backends (the
FLASH and cuDNN ones take no float32), each first checked against torch's MATH on float64 inputs (max|error| printed).

``--fp8``: the FP8 (e4m3) forward on the grid (sm_90) against cuflash's bf16 forward and torch's cuDNN backend in
bf16 on the same real values (e4m3 values are exact in bf16), each FP8 output first checked against the bf16 one.

Grid: batch * seqlen = 16384, heads * head_dim = 2048. FLOPs: forward 4 B H N^2 d (halved when causal),
forward + backward 3.5x that. cuflash is called through its front door (``cuflash.attention`` and
``cuflash.attention_backward``, each call checked, its launch plan kept per layout, as users call it). Each cuflash
cell is first checked against torch-flash's output. Timing:
``triton.testing.do_bench`` median (CUDA events). torch tensors are shared with CuPy through DLPack, and
cuflash runs on torch's current stream. cuflash-fa1 is ``algorithm="fa1"`` (FlashAttention-1 order, one block
per (batch, head)); the table gives the FA2 / FA1 ratio (docs/fa1-vs-fa2.md). Extras: first-call compile
time with a cold CuPy cache, warm-call overhead of a tiny problem, and peak GPU memory at seqlen 16384
(cuflash vs naive CuPy attention).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def _backend_fns(torch, cp, q, k, v, do, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    qc, kc, vc, doc = (cp.from_dlpack(x.transpose(1, 2)) for x in (q, k, v, do))
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())

    def cuflash_pair(algorithm):
        # Through the front door, as users call it (its plans kept per layout): the CUDA backend's own entry points
        # would plan every call afresh.
        options = dict(softmax_scale=scale, causal=causal, algorithm=algorithm)

        def fwd():
            with stream:
                return cuflash.attention(qc, kc, vc, return_lse=True, **options)

        def fb():
            with stream:
                o, lse = cuflash.attention(qc, kc, vc, return_lse=True, **options)
                return cuflash.attention_backward(doc, qc, kc, vc, o, lse, **options)

        return fwd, fb

    qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

    def torch_pair(backend):
        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def fb():
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            qr.grad = kr.grad = vr.grad = None
            o.backward(do)

        return fwd, fb

    # cuflash-fa1: FlashAttention-1 order (fa1.cu: one block per (batch, head), O, m, l and dQ through
    # global memory).
    return {"cuflash": cuflash_pair("fa2"), "torch-flash": torch_pair(SDPBackend.FLASH_ATTENTION),
            "torch-cudnn": torch_pair(SDPBackend.CUDNN_ATTENTION), "cuflash-fa1": cuflash_pair("fa1")}


def run_grid(dtypes, dims, seqlens, rep_ms=200, log=print, fa1=True):
    import cupy as cp
    import torch
    import triton.testing as tt

    rows = []
    for dtname in dtypes:
        dtype = getattr(torch, dtname)
        for d in dims:
            for causal in (False, True):
                for n in seqlens:
                    b, h = 16384 // n, 2048 // d
                    g = torch.Generator(device="cuda").manual_seed(n + d)
                    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
                    fns = _backend_fns(torch, cp, q, k, v, do, causal)
                    if not fa1:
                        del fns["cuflash-fa1"]
                    o_c, _ = fns["cuflash"][0]()
                    o_t = fns["torch-flash"][0]()
                    torch.cuda.synchronize()
                    diff = float((torch.from_dlpack(o_c).transpose(1, 2).float() - o_t.float()).abs().max())
                    if not diff < 0.05:
                        raise AssertionError(f"cuflash differs from torch-flash by {diff} at {dtname} d={d} "
                                             f"causal={causal} N={n}")
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    row = {"dtype": dtname, "d": d, "causal": causal, "N": n, "maxdiff": diff}
                    if fa1:
                        o_1, _ = fns["cuflash-fa1"][0]()  # FA1 is checked against torch-flash too
                        diff1 = float((torch.from_dlpack(o_1).transpose(1, 2).float() - o_t.float()).abs().max())
                        if not diff1 < 0.05:
                            raise AssertionError(f"cuflash fa1 differs from torch-flash by {diff1} at {dtname} "
                                                 f"d={d} causal={causal} N={n}")
                        row["maxdiff fa1"] = diff1
                    for system, (fwd, fb) in fns.items():
                        for pass_, fn, mult in (("fwd", fwd, 1.0), ("fwd+bwd", fb, 3.5)):
                            try:
                                ms = tt.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
                                row[f"{system} {pass_}"] = flops * mult / ms / 1e9
                            except Exception as exc:  # e.g. a backend not available for this shape
                                row[f"{system} {pass_}"] = float("nan")
                                row[f"{system} error"] = str(exc)[:200]
                    rows.append(row)
                    log(json.dumps(row))
                    del q, k, v, do, fns
    return rows


# The float32 comparison: (system, max|out - float64 truth| it must meet before it is timed).
FLOAT32_SYSTEMS = (("cuflash tf32x3", 1e-4), ("cuflash fp16x3", 1e-4), ("cuflash tf32", 2e-2),
                   ("cuflash ieee", 1e-4), ("torch efficient", 2e-2), ("torch math", 1e-4))


def _float64_truth(q, k, v, causal: bool, budget_bytes: float = 8e9):
    """torch's MATH backend in float64 on (batch, heads, N, d) tensors, a few heads at a time (a head's float64 scores
    take 8 N^2 bytes: 2 GiB at N 16384), so long sequences fit beside the timed calls."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, _ = q.shape
    step = max(1, int(budget_bytes // (3 * 8 * n * k.shape[2])) // b)
    with sdpa_kernel(SDPBackend.MATH):
        return torch.cat([F.scaled_dot_product_attention(q[:, i:i + step].double(), k[:, i:i + step].double(),
                                                         v[:, i:i + step].double(), is_causal=causal)
                          for i in range(0, h, step)], dim=1)


def run_float32(dims=(128,), seqlens=(4096,), batch=2, heads=16, rep_ms=200, log=print):
    """Forward TFLOP/s of float32 attention, cuflash at each fp32_precision and torch SDPA's float32 backends, side
    by side (same inputs, same stream); each output first checked against torch's MATH backend in float64."""
    import cupy as cp
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    rows = []
    for d in dims:
        for causal in (False, True):
            for n in seqlens:
                g = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.float32, generator=g)
                           for _ in range(3))
                truth = _float64_truth(q, k, v, causal)
                qc, kc, vc = (cp.from_dlpack(x.transpose(1, 2)) for x in (q, k, v))
                stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())

                def cuflash_fwd(precision):
                    def fwd():
                        with stream:
                            return torch.from_dlpack(cuflash.attention(qc, kc, vc, causal=causal,
                                                                       fp32_precision=precision)).transpose(1, 2)
                    return fwd

                def torch_fwd(backend):
                    def fwd():
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    return fwd

                fns = {"cuflash tf32x3": cuflash_fwd("tf32x3"), "cuflash fp16x3": cuflash_fwd("fp16x3"),
                       "cuflash tf32": cuflash_fwd("tf32"),
                       "cuflash ieee": cuflash_fwd("ieee"), "torch efficient": torch_fwd(SDPBackend.EFFICIENT_ATTENTION),
                       "torch math": torch_fwd(SDPBackend.MATH)}
                flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
                row = {"dtype": "float32", "d": d, "causal": causal, "N": n}
                for system, tolerance in FLOAT32_SYSTEMS:
                    try:
                        err = float((fns[system]().double() - truth).abs().max())
                        row[f"{system} maxerr"] = err
                        if not err < tolerance:
                            raise AssertionError(f"{system}: max|out - truth| = {err:.3e} >= {tolerance}")
                        ms = tt.do_bench(fns[system], warmup=10, rep=rep_ms, return_mode="median")
                        row[f"{system} fwd"] = flops / ms / 1e9
                    except Exception as exc:  # e.g. a backend not available for this shape, or memory
                        row[f"{system} fwd"] = float("nan")
                        row[f"{system} error"] = str(exc)[:200]
                rows.append(row)
                log(json.dumps(row))
    return rows


def run_fp8(dims=(128, 256), seqlens=(1024, 2048, 4096, 8192, 16384), rep_ms=200, log=print):
    """Forward TFLOP/s of the FP8 forward (the front door's call: V^T written, the plan run) beside cuflash's bf16
    forward and torch's cuDNN backend in bf16 on the same values, on the grid (batch x N = 16384, heads x d = 2048).
    Each FP8 output is first held to its error budget against the bf16 one (docs/variants.md, "FP8":
    2^-4 max|V| + 2^-8 |O|, with the bf16 output's own rounding)."""
    import cupy as cp
    import ml_dtypes
    import numpy as np
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())  # (cuflash on torch's stream, as run_grid)
    rows = []
    for d in dims:
        for causal in (False, True):
            for n in seqlens:
                b, h = max(1, 16384 // n), 2048 // d
                rng = np.random.default_rng(n + d)
                host = [rng.standard_normal((b, n, h, d), dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
                        for _ in range(3)]
                q8, k8, v8 = (cp.asarray(x.view(np.uint8)) for x in host)  # (CuPy has no e4m3 dtype: the bits)
                tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).cuda().to(torch.bfloat16) for x in host)
                qb, kb, vb = (cp.from_dlpack(t) for t in (tq, tk, tv))
                tq, tk, tv = (t.transpose(1, 2) for t in (tq, tk, tv))

                def fp8():
                    with stream:
                        return cuflash.attention(q8, k8, v8, causal=causal)

                def bf16():
                    with stream:
                        return cuflash.attention(qb, kb, vb, causal=causal)

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                o8, ob = (torch.from_dlpack(o.view(cp.uint16)).view(torch.bfloat16).float() for o in (fp8(), bf16()))
                torch.cuda.synchronize()
                diff = float((o8 - ob).abs().max())
                budget = 2.0 ** -4 * float(tv.abs().max()) + 2.0 ** -7 * float(ob.abs().max())
                if not diff <= budget:
                    raise AssertionError(f"FP8 differs from bf16 by {diff} (budget {budget}) at d={d} causal={causal} "
                                         f"N={n}")
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                row = {"d": d, "causal": causal, "N": n, "maxdiff": diff}
                for system, fn in (("cuflash fp8", fp8), ("cuflash bf16", bf16), ("torch-cudnn bf16", cudnn)):
                    ms = tt.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
                    row[f"{system} fwd"] = flops / ms / 1e9
                rows.append(row)
                log(json.dumps(row))
    return rows


def plot_special(rows, path, device: str) -> None:
    """The FP8 or float32 table as :func:`.plots.plot_throughput`'s panels (forward TFLOP/s against N, a column per
    head dim and mask): rows of :func:`run_fp8` (which name no dtype: "e4m3") or :func:`run_float32`."""
    from .plots import plot_throughput

    fp8 = "cuflash fp8 fwd" in rows[0]
    rows = [{"dtype": "e4m3 vs bf16" if fp8 else "float32", **row} for row in rows]
    what = "FP8 (e4m3) forward beside bf16" if fp8 else "float32 forward"
    plot_throughput(rows, path, title=f"cuflash {what} on {device}")


def format_fp8_table(rows) -> str:
    lines = ["| d | causal | N | cuflash fp8 | cuflash bf16 | torch-cudnn bf16 | fp8 / bf16 | fp8 / cudnn bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f8, bf, cu = r["cuflash fp8 fwd"], r["cuflash bf16 fwd"], r["torch-cudnn bf16 fwd"]
        lines.append(f"| {r['d']} | {'yes' if r['causal'] else 'no'} | {r['N']} | {f8:.0f} | {bf:.0f} | {cu:.0f} | "
                     f"{f8 / bf:.2f} | {f8 / cu:.2f} |")
    ratios = {}
    for r in rows:
        ratios.setdefault(r["d"], []).append(r["cuflash fp8 fwd"] / r["cuflash bf16 fwd"])
    for d, x in ratios.items():
        lines.append(f"fp8 / bf16 at d {d}: {min(x):.2f}-{max(x):.2f} (median {statistics.median(x):.2f}); "
                     f"at or above 1.5 in {sum(v >= 1.5 for v in x)} of {len(x)}")
    return "\n".join(lines)


def format_float32_table(rows) -> str:
    """The float32 table of :func:`run_float32`'s rows, then per cuflash precision at float32-class accuracy (tf32x3,
    fp16x3) its TFLOP/s range, its count of cells at issue 14's 100, and its error over torch MATH's (naive float32
    attention) at most."""
    names = [name for name, _ in FLOAT32_SYSTEMS]
    lines = ["forward TFLOP/s (max|out - float64 truth|), float32, batch 2, 16 heads",
             "   d causal      N | " + " | ".join(f"{name:>24}" for name in names)]
    for r in rows:
        cells = [f"{r.get(name + ' fwd', float('nan')):8.1f} ({r.get(name + ' maxerr', float('nan')):.1e})"
                 for name in names]
        lines.append(f"{r['d']:4d} {str(r['causal']):>6} {r['N']:6d} | " + " | ".join(f"{c:>24}" for c in cells))
    for name in ("cuflash tf32x3", "cuflash fp16x3"):
        speed = [x for x in (r.get(name + " fwd") for r in rows) if x is not None and not math.isnan(x)]
        errs = [r[name + " maxerr"] / r["torch math maxerr"] for r in rows
                if name + " maxerr" in r and r.get("torch math maxerr")]
        if speed:
            lines.append(f"{name}: {min(speed):.1f}-{max(speed):.1f} TFLOP/s, at or above 100 in "
                         f"{sum(x >= 100 for x in speed)} of {len(speed)}"
                         + (f"; max|error| / torch math's at most {max(errs):.2f}" if errs else ""))
    return "\n".join(lines)


def format_table(rows) -> str:
    """The Markdown table of :func:`run_grid`'s rows: TFLOP/s of each system per pass, and cuflash's ratios to
    torch-flash and torch-cudnn (and to cuflash-fa1 where it ran)."""
    fa1 = any(f"cuflash-fa1 {p}" in r for r in rows for p in ("fwd", "fwd+bwd"))
    head = ("| dtype | d | causal | pass | N | cuflash | torch-flash | torch-cudnn | cuflash / torch-flash "
            "| cuflash / torch-cudnn |")
    lines = [head + (" cuflash-fa1 | cuflash / cuflash-fa1 |" if fa1 else ""),
             "|---" * (12 if fa1 else 10) + "|"]
    for r in rows:
        for pass_ in ("fwd", "fwd+bwd"):
            c, f, n = r[f"cuflash {pass_}"], r[f"torch-flash {pass_}"], r[f"torch-cudnn {pass_}"]
            line = (f"| {r['dtype']} | {r['d']} | {'yes' if r['causal'] else 'no'} | {pass_} | {r['N']} | "
                    f"{c:.0f} | {f:.0f} | {n:.0f} | {c / f:.2f} | {c / n:.2f} |")
            if fa1:  # FA1 column: FA2 / FA1 is the issue-4 ratio
                a1 = r.get(f"cuflash-fa1 {pass_}", float("nan"))
                line += f" {a1:.0f} | {c / a1:.1f} |"
            lines.append(line)
    return "\n".join(lines)


def cudnn_target(n: int) -> float:
    """Issue 14's target for cuflash / torch-cudnn in a cell of sequence length ``n``: 1.0, 0.9 at N 512 and below."""
    return 0.9 if n <= 512 else 1.0


def summarize(rows) -> str:
    """Per pass, cuflash's ratio to each peer over the grid (range, median) and, against torch-cudnn, the cells at or
    above :func:`cudnn_target`: the lines the side-by-side table is judged by; then, where the grid has several head
    dims, the ratio to torch-cudnn by head dim (one line each, both passes)."""
    def cells_of(pass_, peer, selected):
        """(cuflash / peer, N) of the rows in ``selected`` where both ran."""
        return [(r[f"cuflash {pass_}"] / r[f"{peer} {pass_}"], r["N"]) for r in selected
                if r.get(f"{peer} {pass_}", 0) > 0 and f"cuflash {pass_}" in r]

    lines = []
    for pass_ in ("fwd", "fwd+bwd"):
        for peer in ("torch-flash", "torch-cudnn"):
            cells = cells_of(pass_, peer, rows)
            if not cells:
                continue
            ratios = sorted(x for x, _ in cells)
            line = (f"{pass_:7s} cuflash / {peer}: {ratios[0]:.2f}-{ratios[-1]:.2f} "
                    f"(median {statistics.median(ratios):.2f}, {len(ratios)} cells)")
            if peer == "torch-cudnn":
                met = sum(x >= cudnn_target(n) - 5e-3 for x, n in cells)
                line += f"; at or above target (1.0, 0.9 at N <= 512) in {met} of {len(cells)}"
            lines.append(line)
    dims = sorted({r["d"] for r in rows})
    for d in dims if len(dims) > 1 else ():
        parts = []
        for pass_ in ("fwd", "fwd+bwd"):
            ratios = sorted(x for x, _ in cells_of(pass_, "torch-cudnn", [r for r in rows if r["d"] == d]))
            if ratios:
                parts.append(f"{pass_} {ratios[0]:.2f}-{ratios[-1]:.2f}")
        if parts:
            lines.append(f"d {d:3d}    cuflash / torch-cudnn: " + ", ".join(parts))
    return "\n".join(lines)


_COLD_SNIPPET = r"""
import time, cupy as cp, numpy as np
t0 = time.perf_counter()
import cuflash
q = cp.random.standard_normal((1, 128, 2, 64)).astype(cp.float16)
t1 = time.perf_counter()
out, lse = cuflash.attention(q, q, q, causal=True, return_lse=True)
cp.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
g = cuflash.attention_backward(q, q, q, q, out, lse, causal=True)
cp.cuda.runtime.deviceSynchronize()
t3 = time.perf_counter()
print(f"{t2 - t1:.3f} {t3 - t2:.3f}")
"""


def extras(log=print):
    """Cold-cache compile time, warm-call overhead, and peak memory at seqlen 16384."""
    import cupy as cp

    import cuflash

    res = {}
    for label in ("cold", "warm disk cache"):
        env = dict(os.environ)
        if label == "cold":
            cache = tempfile.mkdtemp(prefix="cuflash-cupy-cache-")
        env["CUPY_CACHE_DIR"] = cache
        out = subprocess.run([sys.executable, "-c", _COLD_SNIPPET], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        res[f"first forward call, {label} (s)"] = float(out[0])
        res[f"first backward call, {label} (s)"] = float(out[1])

    q = cp.random.standard_normal((1, 128, 2, 64)).astype(cp.float16)
    cuflash.attention(q, q, q)
    cp.cuda.runtime.deviceSynchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        cuflash.attention(q, q, q)
    cp.cuda.runtime.deviceSynchronize()
    res["warm forward call, (1, 128, 2, 64) float16 (us)"] = (time.perf_counter() - t0) / n * 1e6

    (point,) = memory_sweep((16384,), log=lambda _: None)
    for label, nbytes in point.items():
        if label != "N":
            res[f"peak extra memory at (1, 16384, 16, 128) fp16 causal, {label} (MiB)"] = nbytes / 2**20
    for key, val in res.items():
        log(f"{key}: {val:.3f}")
    return res


def memory_sweep(seqlens=(1024, 2048, 4096, 8192, 16384), heads=16, head_dim=128, log=print):
    """Peak extra GPU memory (bytes) of cuflash forward and backward and of naive CuPy attention per seqlen.

    batch 1, float16, causal; naive stores the float32 scores and the probabilities, O(N^2).
    """
    import cupy as cp

    import cuflash

    points = []
    for n in seqlens:
        points.append(_memory_point(cp, cuflash, n, heads, head_dim))
        log(json.dumps(points[-1]))
    return points


def _memory_point(cp, cuflash, n, heads, head_dim):
    from .._ops.gpu_memory import peak_bytes

    q, k, v, do = (cp.random.standard_normal((1, n, heads, head_dim), dtype=cp.float32).astype(cp.float16)
                   for _ in range(4))
    (out, lse), fwd = peak_bytes(lambda: cuflash.attention(q, k, v, causal=True, return_lse=True))
    _, bwd = peak_bytes(lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True))
    try:
        _, naive = peak_bytes(lambda: cuflash.attention(q, k, v, causal=True, algorithm="naive"))
    except cp.cuda.memory.OutOfMemoryError:
        naive = float("inf")
    return {"N": n, "cuflash forward": fwd, "cuflash backward": bwd, "naive CuPy forward": naive}


def main(argv=None, prog: str = "python -m cuflash bench-gpu"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="bfloat16, seqlens 512, 2048, 8192, short timing")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--dims", default=None, help="head dims (default 64,128,256; --float32: 128)")
    ap.add_argument("--seqlens", default=None, help="sequence lengths (default the grid's; --float32: 4096)")
    ap.add_argument("--rep-ms", type=int, default=200, help="milliseconds of timed repeats per cell (default 200)")
    ap.add_argument("--no-fa1", action="store_true", help="leave out the FA1 kernels (slow at long seqlens)")
    ap.add_argument("--no-extras", action="store_true")
    ap.add_argument("--json", default=None, help="write all numbers to this file")
    ap.add_argument("--float32", action="store_true",
                    help="float32 at batch 2, 16 heads: cuflash tf32x3 / fp16x3 / tf32 / ieee vs torch SDPA efficient / "
                         "math (--dims default 128, --seqlens default 4096)")
    ap.add_argument("--fp8", action="store_true",
                    help="the FP8 (e4m3) forward against cuflash bf16 and torch cuDNN bf16 (sm_90; --dims default "
                         "128,256, --seqlens default 1024-16384)")
    ap.add_argument("--all", action="store_true",
                    help="the grid, then the FP8 table (its defaults) and the float32 table (d 64 and 128, N 1024, "
                         "4096, 16384): every table in one run, one JSON and one plot directory")
    ap.add_argument("--plot", metavar="DIR", default=None,
                    help="write throughput.png (TFLOP/s vs seqlen, peers included) and memory.png "
                         "(peak memory vs seqlen, cuflash vs naive) to DIR (needs matplotlib)")
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    dims = [int(x) for x in (args.dims or ("128" if args.float32 else "64,128,256")).split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")] if args.seqlens else list(DEFAULT_SEQLENS)
    rep = args.rep_ms
    if args.quick:
        dtypes, seqlens, rep = ["bfloat16"], [512, 2048, 8192], 100
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    print(f"device: {props['name'].decode()}")
    device = props["name"].decode()

    def special(kind: str, rows):
        """Print an FP8 or float32 table, and plot it into --plot's directory."""
        if args.plot:
            from pathlib import Path

            Path(args.plot).mkdir(parents=True, exist_ok=True)
            plot_special(rows, Path(args.plot) / f"{kind}.png", device)
        print(format_fp8_table(rows) if kind == "fp8" else format_float32_table(rows))

    if args.fp8 or args.float32:
        if args.fp8:
            rows = run_fp8([int(x) for x in (args.dims or "128,256").split(",")],
                           seqlens if args.seqlens else (1024, 2048, 4096, 8192, 16384), rep_ms=rep)
        else:
            rows = run_float32(dims, seqlens if args.seqlens else [4096], rep_ms=rep)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        special("fp8" if args.fp8 else "float32", rows)
        return 0
    rows = run_grid(dtypes, dims, seqlens, rep, fa1=not args.no_fa1)
    ext = {} if args.no_extras else extras()
    memory = memory_sweep() if args.plot else []
    more = {}
    if args.all:
        more = {"fp8": run_fp8(rep_ms=rep), "float32": run_float32((64, 128), (1024, 4096, 16384), rep_ms=rep)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "extras": ext, "memory": memory, **more}, f, indent=1)
    if args.plot:
        from pathlib import Path

        from .plots import plot_memory, plot_throughput

        directory = Path(args.plot)
        directory.mkdir(parents=True, exist_ok=True)
        plot_throughput(rows, directory / "throughput.png", title=f"cuflash vs PyTorch SDPA on {device}")
        plot_memory(memory, directory / "memory.png",
                    title=f"peak memory, batch 1, 16 heads, d 128, fp16, causal, {device}")
    print(format_table(rows))
    print(summarize(rows))
    for key, val in ext.items():
        print(f"{key}: {val:.3f}")
    for kind, special_rows in more.items():
        special(kind, special_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
