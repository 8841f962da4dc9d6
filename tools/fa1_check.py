"""FA1 on the GPU machine in one call: tests, FA1 vs FA2 timing, and the inputs for ncu / compute-sanitizer.

    PYTHONPATH=. python3 tools/fa1_check.py [--tests] [--bench] [--quick] [--out DIR]
    PYTHONPATH=. python3 tools/fa1_check.py --profile-config   # one forward + backward of FA1 and FA2
    PYTHONPATH=. python3 tools/fa1_check.py --sanitize         # small FA1 forward + backward

--tests   pytest tests/test_cuda_fa1.py (float64 truth, error budget, NumPy FA1 at equal tiles, NaN pool)
--bench   FA1 and FA2 TFLOP/s and the FA2/FA1 ratio, forward and forward+backward, on the ANCHORS.md grid
          (batch * seqlen = 16384, heads * d = 2048): bf16 at every seqlen 512..16384, fp16 at 512, 4096, 16384
          (--quick: bf16, seqlens 512, 2048, 8192; --f32: float32 at 512 and 2048, the SIMT kernels of both
          orders). FA1's output is first checked against FA2's.
--profile-config  the configuration whose DRAM bytes ncu counts (docs/fa1-vs-fa2.md): bf16, d 64,
          batch 4, seqlen 4096, 32 heads, not causal; each kernel launched once, after a warm-up that is
          not profiled (ncu --launch-skip). --shape B,N,H,d picks another shape.
--mma-sync  FA1 vs FA2's mma.sync forward (forward.cu, chosen by passing its block sizes; on sm_90 the
          default FA2 forward is the wgmma kernel) at a few grid cells: separates FA1's own cost from wgmma.
--sanitize  on (B, H, N, d) views, 77 x 131, forward + backward: bf16 causal GQA d 64, fp16 non-causal d 64,
          float32 causal GQA d 96 (the FA1 float32 kernels), fp16 causal d 256 (its backward on them).
Prints a short table last; logs go to --out (default $OUT or /tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _gpu_tools import variant_for


def log(*a):
    print(*a, flush=True)


def _f32(cp, x):
    """float32 copy of a float16 / bfloat16 CuPy array (bfloat16 through its bits: no cast kernel needed)."""
    if x.dtype.name == "bfloat16":
        return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(cp.float32)


def _time_ms(cp, fn, min_reps=3, budget_s=0.6):
    """Median milliseconds of fn() over at least min_reps calls (device events), after one warm-up call."""
    fn()
    cp.cuda.runtime.deviceSynchronize()
    times, t_start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - t_start < budget_s and len(times) < 50):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    times.sort()
    return times[len(times) // 2]


def bench(quick, f32=False):
    import cupy as cp
    import ml_dtypes
    import numpy as np

    from cuflash import _cuda as cuda

    cells = []
    if f32:  # the float32 kernels (SIMT, no tensor cores): FA1 order vs FA2 order
        cells = [("float32", n) for n in (512, 2048)]
    elif quick:
        cells = [("bfloat16", n) for n in (512, 2048, 8192)]
    else:
        cells = [("bfloat16", n) for n in (512, 1024, 2048, 4096, 8192, 16384)]
        cells += [("float16", n) for n in (512, 4096, 16384)]
    rows = []
    for dtname, n in cells:
        dtype = np.dtype(ml_dtypes.bfloat16) if dtname == "bfloat16" else np.dtype(dtname)
        for d in (64, 128):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                rs = np.random.default_rng(n + d)
                # (B, H, N, d) memory seen as (B, N, H, d), as bench_gpu shares torch tensors
                q, k, v, do = (cp.asarray(rs.standard_normal((b, h, n, d), dtype=np.float32).astype(dtype))
                               .transpose(0, 2, 1, 3) for _ in range(4))
                off = 0 if causal else None
                scale = d ** -0.5

                def fwd(alg):
                    return lambda: cuda.forward(q, k, v, scale=scale, variant=variant_for(off, 0, 0), algorithm=alg,
                                                block_q=None, block_k=None)

                def fb(alg):
                    def run():
                        o, lse = cuda.forward(q, k, v, scale=scale, variant=variant_for(off, 0, 0), algorithm=alg, block_q=None,
                                              block_k=None)
                        return cuda.backward(do, q, k, v, o, lse, scale=scale, variant=variant_for(off, 0, 0), algorithm=alg,
                                             block_q=None, block_k=None, order="kv_outer")
                    return run

                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                row = {"dtype": dtname, "d": d, "causal": causal, "N": n, "B": b, "H": h}
                try:
                    o1, _ = fwd("fa1")()
                    o2, _ = fwd("fa2")()
                    row["fa1_vs_fa2_maxdiff"] = float(cp.abs(_f32(cp, o1) - _f32(cp, o2)).max())
                    del o1, o2
                except Exception as exc:  # keep timing the other cells
                    row["error"] = repr(exc)[:300]
                for alg in ("fa1", "fa2"):
                    for pass_, fn, mult in (("fwd", fwd(alg), 1.0), ("fwd+bwd", fb(alg), 3.5)):
                        try:
                            row[f"{alg} {pass_}"] = mult * flops / _time_ms(cp, fn) / 1e9
                        except Exception as exc:
                            row[f"{alg} {pass_}"] = float("nan")
                            row[f"{alg} {pass_} error"] = repr(exc)[:300]
                rows.append(row)
                log(json.dumps(row))
                del q, k, v, do
    return rows


def format_rows(rows):
    lines = ["| dtype | d | causal | N | B x H (FA1 blocks) | pass | FA1 | FA2 | FA2 / FA1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in ("fwd", "fwd+bwd"):
            a, b = r[f"fa1 {p}"], r[f"fa2 {p}"]
            lines.append(f"| {r['dtype']} | {r['d']} | {'yes' if r['causal'] else 'no'} | {r['N']} | "
                         f"{r['B'] * r['H']} | {p} | {a:.1f} | {b:.1f} | {b / a:.1f} |")
    return "\n".join(lines)


def profile_config(shape=(4, 4096, 32, 64)):
    """One launch of each FA1 and FA2 kernel on the profiled configuration, after one unprofiled warm-up."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    from cuflash import _cuda as cuda

    b, n, h, d = shape
    rs = np.random.default_rng(0)
    q, k, v, do = (cp.asarray(rs.standard_normal((b, n, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16))
                   for _ in range(4))
    for rep in range(2):  # rep 0: warm-up (compiles; skipped by ncu --launch-skip), rep 1: profiled
        for alg in ("fa1", "fa2"):
            o, lse = cuda.forward(q, k, v, scale=d ** -0.5, variant=variant_for(None, 0, 0), algorithm=alg, block_q=None,
                                  block_k=None)
            cuda.backward(do, q, k, v, o, lse, scale=d ** -0.5, variant=variant_for(None, 0, 0), algorithm=alg, block_q=None,
                          block_k=None, order="kv_outer")
        cp.cuda.runtime.deviceSynchronize()
        log(f"profile-config rep {rep} done")


def mma_sync_rows():
    """FA1 and FA2 forward TFLOP/s, FA2 both as shipped (wgmma on sm_90) and as forward.cu's mma.sync kernel."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    from cuflash import _cuda as cuda
    from cuflash._cuda import compile as cuda_compile

    rows = []
    for d, n in ((64, 4096), (64, 16384), (128, 2048), (128, 16384)):
        b, h = 16384 // n, 2048 // d
        rs = np.random.default_rng(n + d)
        q, k, v = (cp.asarray(rs.standard_normal((b, h, n, d), dtype=np.float32).astype(ml_dtypes.bfloat16))
                   .transpose(0, 2, 1, 3) for _ in range(3))
        t = cuda.TILES[("fwd", cuda_compile.arch_class(cuda_compile.device_info()[0]), d)]
        flops = 4 * b * h * n * n * d
        row = {"d": d, "N": n, "blocks fa1": b * h}
        for label, alg, bq, bk in (("fa1", "fa1", None, None), ("fa2", "fa2", None, None),
                                   ("fa2 mma.sync", "fa2", t.block_m, t.block_n)):
            fn = lambda: cuda.forward(q, k, v, scale=d ** -0.5, variant=variant_for(None, 0, 0), algorithm=alg, block_q=bq,
                                      block_k=bk)
            row[label] = flops / _time_ms(cp, fn) / 1e9
        rows.append(row)
        log(json.dumps(row))
    return rows


def sanitize():
    import cupy as cp
    import ml_dtypes
    import numpy as np

    import cuflash

    for dtype, causal, hkv, d in ((np.dtype(ml_dtypes.bfloat16), True, 1, 64), (np.dtype(np.float16), False, 2, 64),
                                  (np.dtype(np.float32), True, 1, 96), (np.dtype(np.float16), True, 2, 256)):
        rs = np.random.default_rng(0)
        b, nq, nk, hq = 1, 77, 131, 2

        def view(n, h):  # (B, H, N, d) memory seen as (B, N, H, d)
            x = rs.standard_normal((b, h, n, d)).astype(dtype)
            return cp.asarray(x).transpose(0, 2, 1, 3)

        q, k, v, do = view(nq, hq), view(nk, hkv), view(nk, hkv), view(nq, hq)
        out, lse = cuflash.attention(q, k, v, causal=causal, algorithm="fa1", return_lse=True)
        grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, algorithm="fa1")
        cp.cuda.runtime.deviceSynchronize()
        bad = [name for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads))
               if bool(cp.isnan(_f32(cp, x)).any())]
        log(f"sanitize case {dtype} causal={causal} hkv={hkv}: NaN in {bad or 'nothing'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--f32", action="store_true", help="--bench on float32 inputs (N 512, 2048)")
    ap.add_argument("--profile-config", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--shape", default="4,4096,32,64", help="B,N,H,d of --profile-config")
    ap.add_argument("--mma-sync", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    if args.profile_config:
        return profile_config(tuple(int(x) for x in args.shape.split(",")))
    if args.sanitize:
        return sanitize()

    import cupy as cp

    dev = cp.cuda.Device()
    log("device", cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), "cc", dev.compute_capability,
        "SMs", dev.attributes["MultiProcessorCount"], "cupy", cp.__version__)
    summary = []
    if args.tests:
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", "tests/test_cuda_fa1.py", "-q", "-x", "-p", "no:cacheprovider",
               "--no-header", "-rf", "-n", str(args.workers)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        with open(os.path.join(args.out, "fa1_tests.log"), "w") as f:
            f.write(res.stdout + res.stderr)
        tail = (res.stdout + res.stderr).strip().splitlines()[-25:]
        summary.append(f"tests (rc {res.returncode}, {time.time() - t0:.0f} s):")
        summary += ["  " + line for line in tail]
    if args.mma_sync:
        rows = mma_sync_rows()
        summary.append("d N FA1-blocks | FA1 | FA2 (shipped) | FA2 mma.sync (forward.cu) TFLOP/s, bf16 forward")
        summary += [f"{r['d']} {r['N']} {r['blocks fa1']} | {r['fa1']:.1f} | {r['fa2']:.1f} | {r['fa2 mma.sync']:.1f}"
                    for r in rows]
    if args.bench:
        t0 = time.time()
        rows = bench(args.quick, args.f32)
        with open(os.path.join(args.out, "fa1_bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
        summary.append(f"bench ({time.time() - t0:.0f} s):")
        summary.append(format_rows(rows))
    log("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
