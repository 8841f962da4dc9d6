"""CPU benchmark of the NumPy reference: blocked FA2 and FA1 forward against naive attention.

Two measurements, each after checking the blocked results against naive:

- time: the median of a few forward runs at batch x heads = 16, seqlen 2048, head_dim 64, float32;
  the algorithms take turns within each round, so a noisy neighbour slows them alike;
- memory: peak traced memory (``tracemalloc``) of one forward at seqlen 8192, where naive attention's
  ``seqlen x seqlen`` score matrix dominates and the blocked paths keep only tiles.

The blocked paths use the reference's default tiles (square, from one core's L2 cache:
``cuflash._ops.blocks.cpu_block_sizes``) unless ``--block`` or ``--sram-elems`` says otherwise; the FA2 forward runs
its query blocks on ``$CUFLASH_CPU_THREADS`` threads (``--threads``), BLAS on one thread (``docs/cpu-performance.md``).

Targets: FA2 forward within 1.2x of naive time; blocked peak memory below a tenth of naive's.
Run with ``python -m cuflash bench-cpu [options]`` or ``python -m cuflash.cli.bench_cpu``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

from .._ops import blocks as _blocks
from .. import reference

ALGORITHMS = {"naive": reference.naive_forward, "fa2": reference.fa2_forward, "fa1": reference.fa1_forward}
TIME_TARGET = 1.2  # FA2 forward time / naive forward time
MEMORY_TARGET = 0.1  # blocked peak / naive peak
CHECK_TOLERANCE = 1e-5  # max|blocked - naive| / max|naive| for float32


def _parser(prog: str = "python -m cuflash bench-cpu") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Time and peak memory of the NumPy reference forward: blocked FA2 and FA1 vs naive.",
    )
    parser.add_argument("--batch", type=int, default=2, help="batch for the timing (default 2)")
    parser.add_argument("--heads", type=int, default=8, help="heads for the timing (default 8)")
    parser.add_argument("--seqlen", type=int, default=2048, help="seqlen for the timing (default 2048)")
    parser.add_argument("--head-dim", type=int, default=64, help="head_dim (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per algorithm (default 5)")
    parser.add_argument("--memory-seqlen", type=int, default=8192,
                        help="seqlen for the peak-memory measurement (default 8192; 0 skips it)")
    parser.add_argument("--memory-heads", type=int, default=2,
                        help="heads for the peak-memory measurement, batch 1 (default 2)")
    parser.add_argument("--block", type=int, default=None, metavar="B",
                        help="square B x B tiles for the blocked paths (default: from the L2 cache, "
                             "cuflash._ops.blocks.cpu_block_sizes)")
    parser.add_argument("--sram-elems", type=int, default=None,
                        help="tiles by the seed rule with an on-chip budget of M elements instead "
                             f"(the earlier default was {_blocks.DEFAULT_SRAM_ELEMS})")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of the FA2 forward's query blocks (sets $CUFLASH_CPU_THREADS; "
                             "default: the CPUs this process may use)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--plot", metavar="DIR", default=None,
                        help="also sweep seqlen 256..4096 (batch 1, --memory-heads heads) and write "
                             "cpu-throughput.png and cpu-memory.png to DIR (needs matplotlib)")
    return parser


def _inputs(batch, seqlen, heads, head_dim, seed):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((batch, seqlen, heads, head_dim)).astype(np.float32) for _ in range(3))


def _check(outputs, naive_out, out=sys.stdout) -> bool:
    """Compare each blocked output with naive's; print the relative errors; True if all pass."""
    scale = float(np.abs(naive_out).max())
    passed = True
    for name, result in outputs.items():
        error = float(np.abs(result.astype(np.float64) - naive_out).max()) / scale
        ok = error <= CHECK_TOLERANCE
        passed &= ok
        print(f"  check {name}: max|{name} - naive| / max|naive| = {error:.2e}  "
              f"({'ok' if ok else f'FAILED, tolerance {CHECK_TOLERANCE:.0e}'})", file=out)
    return passed


def _time(args, options, out) -> tuple[bool, dict[str, float]]:
    """Median forward time per algorithm, in seconds, after the correctness check."""
    q, k, v = _inputs(args.batch, args.seqlen, args.heads, args.head_dim, args.seed)
    results = {name: forward(q, k, v, **options[name])[0] for name, forward in ALGORITHMS.items()}
    passed = _check({name: results[name] for name in ("fa2", "fa1")}, results["naive"], out)
    del results
    times = {name: [] for name in ALGORITHMS}
    for _ in range(args.repeats):
        for name, forward in ALGORITHMS.items():
            start = time.perf_counter()
            forward(q, k, v, **options[name])
            times[name].append(time.perf_counter() - start)
    return passed, {name: statistics.median(runs) for name, runs in times.items()}


def _peak_memory(args, options, out) -> tuple[bool, dict[str, int]]:
    """Peak traced memory of one forward per algorithm, in bytes, after the correctness check."""
    q, k, v = _inputs(1, args.memory_seqlen, args.memory_heads, args.head_dim, args.seed + 1)
    peaks, results = {}, {}
    for name, forward in ALGORITHMS.items():
        tracemalloc.start()
        try:
            results[name] = forward(q, k, v, **options[name])[0]
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    passed = _check({name: results[name] for name in ("fa2", "fa1")}, results["naive"], out)
    return passed, peaks


def _sweep(args, options, out, seqlens=(256, 512, 1024, 2048, 4096)):
    """Forward GFLOP/s and peak traced memory per algorithm over ``seqlens``, for the plots."""
    rows, points = [], []
    for seqlen in seqlens:
        q, k, v = _inputs(1, seqlen, args.memory_heads, args.head_dim, args.seed + seqlen)
        flops = 4 * args.memory_heads * seqlen * seqlen * args.head_dim
        row = {"dtype": "float32", "d": args.head_dim, "causal": False, "N": seqlen}
        point = {"N": seqlen}
        results = {name: forward(q, k, v, **options[name])[0] for name, forward in ALGORITHMS.items()}
        if not _check({name: results[name] for name in ("fa2", "fa1")}, results["naive"], out):
            raise AssertionError(f"blocked and naive forward disagree at seqlen {seqlen}")
        del results
        for name, forward in ALGORITHMS.items():
            tracemalloc.start()
            try:
                forward(q, k, v, **options[name])
                point[name] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                forward(q, k, v, **options[name])
                seconds.append(time.perf_counter() - start)
            row[f"{name} fwd"] = flops / min(seconds) / 1e9
        rows.append(row)
        points.append(point)
        print(f"  sweep seqlen {seqlen}: " + ", ".join(
            f"{name} {row[f'{name} fwd']:.1f} GFLOP/s, {point[name] / 2**20:.1f} MiB" for name in ALGORITHMS),
            file=out)
    return rows, points


def _plot(args, options, out) -> None:
    from pathlib import Path

    from .plots import plot_memory, plot_throughput

    directory = Path(args.plot)
    directory.mkdir(parents=True, exist_ok=True)
    print(f"\nsweep for the plots (batch 1, heads {args.memory_heads}, head_dim {args.head_dim}):", file=out)
    rows, points = _sweep(args, options, out)
    title = f"cuflash NumPy reference, forward, float32, batch 1, heads {args.memory_heads}"
    plot_throughput(rows, directory / "cpu-throughput.png", title=title, unit="GFLOP/s")
    plot_memory(points, directory / "cpu-memory.png", title=title)
    print(f"  wrote {directory / 'cpu-throughput.png'} and {directory / 'cpu-memory.png'}", file=out)


def main(argv=None, out=None, prog: str = "python -m cuflash bench-cpu") -> int:
    """Run both measurements and print the table; exit status 1 if a check or a target fails. ``prog``
    names the command in the usage line (``python -m cuflash bench`` hands its own name)."""
    out = sys.stdout if out is None else out
    args = _parser(prog).parse_args(argv)
    if args.threads is not None:
        os.environ[reference.THREADS_ENV] = str(args.threads)
    if args.block is not None:
        block_q = block_k = args.block
        rule = "--block"
    elif args.sram_elems is not None:
        block_q, block_k = _blocks.default_block_sizes(args.head_dim, sram_elems=args.sram_elems)
        rule = f"seed rule, M = {args.sram_elems} elements"
    else:
        cache = _blocks.cache_bytes(2)
        block_q, block_k = _blocks.cpu_block_sizes(args.head_dim, cache=cache)
        rule = f"L2 cache {cache // 1024} KiB"
    blocked = dict(block_q=block_q, block_k=block_k)
    scale = args.head_dim**-0.5
    options = {"naive": dict(scale=scale),
               "fa2": dict(scale=scale, **blocked), "fa1": dict(scale=scale, **blocked)}
    print(f"cuflash CPU benchmark (NumPy reference), forward, float32, head_dim {args.head_dim}; "
          f"blocked paths use block_q={block_q}, block_k={block_k} ({rule}); "
          f"fa2 on {reference.cpu_threads()} thread(s)", file=out)

    print(f"\ntime: batch {args.batch} x heads {args.heads}, seqlen {args.seqlen}, "
          f"median of {args.repeats} runs", file=out)
    passed, times = _time(args, options, out)
    print(f"  {'algorithm':<10}{'median ms':>12}{'vs naive':>10}", file=out)
    for name, seconds in times.items():
        print(f"  {name:<10}{seconds * 1e3:>12.1f}{seconds / times['naive']:>9.2f}x", file=out)
    time_ratio = times["fa2"] / times["naive"]
    targets = [(f"fa2 forward time <= {TIME_TARGET:g} x naive", time_ratio <= TIME_TARGET, f"{time_ratio:.2f}x")]

    if args.memory_seqlen > 0:
        print(f"\npeak traced memory: batch 1 x heads {args.memory_heads}, seqlen {args.memory_seqlen}",
              file=out)
        memory_passed, peaks = _peak_memory(args, options, out)
        passed &= memory_passed
        print(f"  {'algorithm':<10}{'peak MiB':>12}{'vs naive':>10}", file=out)
        for name, peak in peaks.items():
            print(f"  {name:<10}{peak / 2**20:>12.1f}{peak / peaks['naive']:>10.4f}  (1/{peaks['naive'] / peak:.0f})",
                  file=out)
        memory_ratio = max(peaks["fa2"], peaks["fa1"]) / peaks["naive"]
        targets.append((f"blocked peak memory < {MEMORY_TARGET:g} x naive", memory_ratio < MEMORY_TARGET,
                        f"{memory_ratio:.4f}"))

    if args.plot:
        _plot(args, options, out)

    print("\ntargets:", file=out)
    for text, met, value in targets:
        passed &= met
        print(f"  {text}: {'met' if met else 'NOT met'} ({value})", file=out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
