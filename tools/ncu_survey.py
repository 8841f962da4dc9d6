"""Where the Hopper kernels' time goes, for several cells in one device call: each case's kernels profiled by ncu with
one list of counters (the tensor pipe and the exponentials' pipe busy, issue slots, L1 / L2 / DRAM throughput, the
stall reasons per issued instruction, shared memory bank conflicts, global reductions), one table a case.

    PYTHONPATH=. python3 tools/ncu_survey.py [--cases fwd:128:1024 bwd:128:1024 bwd:256:4096 fwd:256:4096]
        [--causal] [--out DIR]

A case is pass:d:N (pass fwd or bwd; bf16, batch x N = 16384 tokens, 16 heads, as the bench grid). Each case runs in
a child process under ``ncu --nvtx --nvtx-include measure/``: the child compiles and warms up first, then makes the
measured call inside the NVTX range "measure", so only that call's kernels are profiled (clocks as ncu sets them:
compare cases with each other, not with the benchmark's TFLOP/s). ``--out`` keeps each case's CSV.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

# (label, metric): pipes and throughput as a share of peak, stalls as cycles per issued instruction
METRICS = (
    ("time us", "gpu__time_duration.sum"),
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("gmma %", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("xu %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("issue %", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("L1 %", "l1tex__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("smem conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"),
    ("L2 red sectors", "lts__t_sectors_op_red.sum"),
) + tuple((f"stall {r}", f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio") for r in (
    "long_scoreboard", "short_scoreboard", "barrier", "membar", "wait", "math_pipe_throttle", "mio_throttle",
    "lg_throttle", "dispatch_stall", "no_instruction", "not_selected", "selected", "sleeping", "branch_resolving"))


def child(spec: str, causal: bool) -> None:
    """Warm up, then one measured call of case ``spec`` inside the NVTX range "measure"."""
    import cupy
    import ml_dtypes
    import numpy as np

    import cuflash

    kind, d, n = spec.split(":")
    d, n = int(d), int(n)
    batch, heads = max(1, 16384 // n), 16
    rng = np.random.default_rng(0)
    q, k, v, do = (cupy.asarray(rng.standard_normal((batch, n, heads, d), np.float32).astype(ml_dtypes.bfloat16))
                   for _ in range(4))

    def call():
        if kind == "fwd":
            return cuflash.attention(q, k, v, causal=causal)
        return cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    for _ in range(3):
        call()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.nvtx.RangePush("measure")
    call()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.nvtx.RangePop()


def table(spec: str, text: str) -> str:
    """The CSV of ncu --csv --page raw as one row a kernel, the metrics as columns."""
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))[1:]  # (the second line: units)
    lines = [f"case {spec}", "| kernel | " + " | ".join(label for label, _ in METRICS) + " |",
             "|---" * (len(METRICS) + 1) + "|"]
    for row in rows:
        name = row.get("Kernel Name", "?").split("<")[0].split("(")[0].removeprefix("void ").removeprefix("cuflash::")
        values = []
        for _, metric in METRICS:
            value = row.get(metric, "")
            try:
                x = float(value.replace(",", ""))
                value = f"{x / 1000:.1f}" if metric == "gpu__time_duration.sum" else f"{x:.3g}"
            except ValueError:
                pass
            values.append(value or "-")
        lines.append(f"| {name} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["fwd:128:1024", "bwd:128:1024", "bwd:256:4096", "fwd:256:4096"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", default=None, help="a folder for each case's CSV")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.causal)
        return 0
    known = [metric for _, metric in METRICS]
    for spec in args.cases:
        for _ in range(3):  # (a counter this ncu does not know fails the run: it is named, left out, and run again)
            command = ["ncu", "--nvtx", "--nvtx-include", "measure/", "--metrics", ",".join(known), "--csv", "--page",
                       "raw", sys.executable, os.path.abspath(__file__), "--child", spec]
            done = subprocess.run(command + (["--causal"] if args.causal else []), capture_output=True, text=True)
            failed = [line for line in (done.stdout + done.stderr).splitlines() if "Failed to find metric" in line]
            unknown = [m for m in known if any(m.split(".")[0] in line for line in failed)]
            if '"ID"' in done.stdout or not unknown:
                break
            known = [m for m in known if m not in unknown]
            print(f"(ncu does not know {', '.join(unknown)}: left out)", flush=True)
        if done.returncode != 0 or '"ID"' not in done.stdout:
            print(f"case {spec}: ncu failed ({done.returncode})\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}",
                  flush=True)
            continue
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, spec.replace(":", "_") + ".csv"), "w") as f:
                f.write(done.stdout)
        print(table(spec + (" causal" if args.causal else ""), done.stdout), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
