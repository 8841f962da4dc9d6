"""Command line: ``python -m cuflash demo`` and ``python -m cuflash bench``.

``demo`` runs one forward and one backward pass of :func:`cuflash.attention` on the best backend
available (CuPy on a CUDA GPU when both are present, otherwise NumPy on the CPU), checks every result
against an independent float64 computation written out below, and prints the error, the time and the
peak memory. It exits 0 when every error is within its tolerance and 1 otherwise, so it doubles as a
smoke test of an installation.

``bench`` hands its arguments unchanged to ``cuflash.cli.bench_gpu.main`` when CuPy and a GPU are present,
otherwise to ``cuflash.cli.bench_cpu.main``; ``bench-cpu`` and ``bench-gpu`` pick one explicitly.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

# Exit codes: 0 every check passed, 1 a result was outside its tolerance, 2 the request could not be
# run (bad arguments, backend not available, the library refused the problem).
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2

# Relative tolerance of the check, max|x - truth| / max|truth|, by input dtype. The low-precision
# budgets follow from the kernels casting P (and dS) to the input dtype before the matrix products:
# unit roundoff is 2**-11 for float16 and 2**-8 for bfloat16, and a row sums up to seqlen_k terms.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 8e-2}

# Default problem sizes: small enough that the CPU run finishes in seconds, big enough to be real.
CPU_DEFAULTS = dict(batch=2, seqlen=1024, heads=8, head_dim=64, dtype="float32", repeat=1)
GPU_DEFAULTS = dict(batch=4, seqlen=4096, heads=16, head_dim=64, dtype="float16", repeat=10)


class DemoError(Exception):
    """A request the demo cannot run; the message is shown to the user as is."""


# ---------------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------------

def _cupy_status():
    """Return (cupy module or None, reason it cannot be used or None)."""
    try:
        import cupy
    except ImportError:
        return None, 'CuPy is not installed (pip install -e ".[cuda13]" or ".[cuda12]")'
    except Exception as exc:  # a broken CuPy install raises all sorts of errors on import
        return None, f"CuPy failed to import: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"CuPy is installed but no CUDA device is usable: {exc}"
    if count < 1:
        return None, "CuPy is installed but no CUDA device was found"
    return cupy, None


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return _cupy_status()[0] is not None


def _pick_backend(name: str):
    """Return (array module, 'numpy' or 'cupy') for --backend auto|numpy|cupy."""
    if name == "numpy":
        return np, "numpy"
    cupy, reason = _cupy_status()
    if name == "cupy":
        if cupy is None:
            raise DemoError(f"--backend cupy needs CuPy and a CUDA GPU: {reason}")
        return cupy, "cupy"
    return (cupy, "cupy") if cupy is not None else (np, "numpy")


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ---------------------------------------------------------------------------------------------------
# The float64 truth: plain attention, written out independently of cuflash.reference
# ---------------------------------------------------------------------------------------------------

def float64_truth(xp, q, k, v, do, *, scale, causal_offset):
    """Naive attention forward and backward in float64 with the array module ``xp``.

    Layout ``(batch, seqlen, heads, head_dim)``; query head ``h`` reads key/value head
    ``h // (heads_q // heads_kv)``; query row ``i`` sees key ``j`` iff ``j <= i + causal_offset``
    (``causal_offset`` None: no mask). Rows that see no key get output 0, lse -inf and zero gradients.
    Returns (out, lse, dq, dk, dv) in float64; lse has shape ``(batch, heads_q, seqlen_q)``.
    """
    q, k, v, do = (xp.asarray(a, dtype=xp.float64) for a in (q, k, v, do))
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv

    out = xp.zeros_like(q)
    dq = xp.zeros_like(q)
    dk = xp.zeros_like(k)
    dv = xp.zeros_like(v)
    lse = xp.full((batch, heads_q, seqlen_q), -xp.inf)

    if causal_offset is None:
        visible = None
    else:
        rows = xp.arange(seqlen_q)[:, None]
        cols = xp.arange(seqlen_k)[None, :]
        visible = cols <= rows + causal_offset  # (seqlen_q, seqlen_k)

    # Whole key/value groups at a time, as many as keep one (heads, seqlen_q, seqlen_k) float64
    # array under ~256 MiB, so a large GPU problem does not need many gigabytes for the check.
    kv_per_chunk = max(1, (1 << 25) // max(1, group * seqlen_q * seqlen_k))
    for b in range(batch):
        for g0 in range(0, heads_kv, kv_per_chunk):
            g1 = min(heads_kv, g0 + kv_per_chunk)
            h0, h1 = g0 * group, g1 * group
            qh = q[b, :, h0:h1].transpose(1, 0, 2)               # (h, seqlen_q, d)
            doh = do[b, :, h0:h1].transpose(1, 0, 2)
            kh = xp.repeat(k[b, :, g0:g1].transpose(1, 0, 2), group, axis=0)  # (h, seqlen_k, d)
            vh = xp.repeat(v[b, :, g0:g1].transpose(1, 0, 2), group, axis=0)

            s = scale * (qh @ kh.transpose(0, 2, 1))              # (h, seqlen_q, seqlen_k)
            if visible is not None:
                s = xp.where(visible, s, -xp.inf)
            m = s.max(axis=-1, keepdims=True)
            m = xp.where(xp.isfinite(m), m, 0.0)                  # empty rows: avoid inf - inf
            p = xp.exp(s - m)
            l = p.sum(axis=-1, keepdims=True)
            seen = l > 0
            p = xp.where(seen, p / xp.where(seen, l, 1.0), 0.0)
            o = p @ vh
            lse[b, h0:h1] = xp.where(seen, m + xp.log(xp.where(seen, l, 1.0)), -xp.inf)[..., 0]

            dp = doh @ vh.transpose(0, 2, 1)
            delta = (doh * o).sum(axis=-1, keepdims=True)         # rowsum(dO * O) = rowsum(P * dP)
            ds = p * (dp - delta)
            dqh = scale * (ds @ kh)
            dkh = scale * (ds.transpose(0, 2, 1) @ qh)
            dvh = p.transpose(0, 2, 1) @ doh

            out[b, :, h0:h1] = o.transpose(1, 0, 2)
            dq[b, :, h0:h1] = dqh.transpose(1, 0, 2)
            # Query heads of one group share a key/value head: their gradients add up.
            dk[b, :, g0:g1] = dkh.reshape(g1 - g0, group, seqlen_k, head_dim).sum(axis=1).transpose(1, 0, 2)
            dv[b, :, g0:g1] = dvh.reshape(g1 - g0, group, seqlen_k, head_dim).sum(axis=1).transpose(1, 0, 2)
    return out, lse, dq, dk, dv


def relative_error(xp, x, truth) -> float:
    """max|x - truth| / max|truth| over finite entries; inf if x has a NaN or an inf where truth has none."""
    x = xp.asarray(x, dtype=xp.float64)
    finite = xp.isfinite(truth)
    if bool(xp.any(xp.isfinite(x) != finite)) or bool(xp.any(xp.isinf(x) & (x != truth))):
        return math.inf
    if x.size == 0:
        return 0.0
    t = xp.where(finite, truth, 0.0)  # the -inf of empty rows matched above; compare the rest
    diff = xp.abs(xp.where(finite, x, 0.0) - t)
    return float(diff.max()) / max(float(xp.abs(t).max()), 1e-30)


# ---------------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


class _CpuMeter:
    """Wall time and tracemalloc's peak (NumPy reports its buffers to tracemalloc)."""

    name = "tracemalloc peak"

    def run(self, fn, repeat):
        import tracemalloc

        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            t0 = time.perf_counter()
            result = fn()
            first = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:  # also when fn raises: never leave tracing on behind the caller's back
            if not was_tracing:
                tracemalloc.stop()
        times = [first]
        for _ in range(repeat - 1):
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        return result, first, times, peak


class _GpuMeter:
    """Device time between CUDA events; peak device memory held by the call (a CuPy memory hook)."""

    name = "peak device memory"

    def __init__(self, cupy):
        self.cupy = cupy

    def run(self, fn, repeat):
        from .._ops.gpu_memory import peak_bytes

        cupy = self.cupy
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        result, peak = peak_bytes(fn)      # first call: includes NVRTC compile or cache load
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeat):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            result = fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return result, first, times or [first], peak


# ---------------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------------

def _demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cuflash demo",
        description="Run cuflash.attention forward and backward on the best available backend, "
        "check the results against a float64 computation, print error, time and peak memory.",
    )
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto",
                   help="auto (default): CuPy if CuPy and a CUDA GPU are present, else NumPy")
    p.add_argument("--batch", type=int, help="batch size (CPU default 2, GPU default 4)")
    p.add_argument("--seqlen", type=int, help="query sequence length (CPU default 1024, GPU 4096)")
    p.add_argument("--seqlen-k", type=int, help="key/value sequence length (default: --seqlen)")
    p.add_argument("--heads", type=int, help="query heads (CPU default 8, GPU 16)")
    p.add_argument("--heads-kv", type=int, help="key/value heads, a divisor of --heads (GQA; default: --heads)")
    p.add_argument("--head-dim", type=int, help="head dimension (default 64)")
    p.add_argument("--dtype", choices=tuple(TOLERANCE), help="CPU default float32, GPU default float16")
    p.add_argument("--causal", action="store_true", help="causal masking")
    p.add_argument("--causal-align", choices=("bottom-right", "top-left"), default="bottom-right")
    p.add_argument("--algorithm", choices=("fa2", "fa1", "naive"), default="fa2")
    p.add_argument("--no-backward", action="store_true", help="forward pass only")
    p.add_argument("--repeat", type=int, help="timed calls (CPU default 1, GPU default 10)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal):
    """Forward FLOPs by the FlashAttention papers' convention: 4*B*H*Nq*Nk*d, halved when causal."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f


def demo(argv=None, out=None) -> int:
    out = out or sys.stdout
    args = _demo_parser().parse_args(argv)

    def say(line=""):
        print(line, file=out, flush=True)

    try:
        xp, backend = _pick_backend(args.backend)
    except DemoError as exc:
        print(f"cuflash demo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    defaults = GPU_DEFAULTS if backend == "cupy" else CPU_DEFAULTS

    def given_or(value, default):
        return default if value is None else value

    batch = given_or(args.batch, defaults["batch"])
    seqlen_q = given_or(args.seqlen, defaults["seqlen"])
    seqlen_k = given_or(args.seqlen_k, seqlen_q)
    heads = given_or(args.heads, defaults["heads"])
    heads_kv = given_or(args.heads_kv, heads)
    head_dim = given_or(args.head_dim, defaults["head_dim"])
    dtype_name = given_or(args.dtype, defaults["dtype"])
    repeat = given_or(args.repeat, defaults["repeat"])
    if min(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, repeat) < 1:
        print("cuflash demo: error: sizes and --repeat must be positive", file=sys.stderr)
        return EXIT_USAGE

    import cuflash

    dtype = _dtype(dtype_name)
    rng = np.random.default_rng(args.seed)

    def make(shape):
        host = rng.standard_normal(shape).astype(dtype)
        return xp.asarray(host) if backend == "cupy" else host

    try:
        q = make((batch, seqlen_q, heads, head_dim))
        k = make((batch, seqlen_k, heads_kv, head_dim))
        v = make((batch, seqlen_k, heads_kv, head_dim))
        do = make((batch, seqlen_q, heads, head_dim))
    except (TypeError, ValueError) as exc:  # e.g. a CuPy without bfloat16 support
        print(f"cuflash demo: error: cannot make {dtype_name} arrays on {backend}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    scale = 1.0 / math.sqrt(head_dim)
    causal_offset = None
    if args.causal:
        causal_offset = seqlen_k - seqlen_q if args.causal_align == "bottom-right" else 0
    common = dict(causal=args.causal, causal_align=args.causal_align, algorithm=args.algorithm)

    if backend == "cupy":
        import cupy

        meter = _GpuMeter(cupy)
        device = cupy.cuda.Device()
        name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        where = f"CuPy {cupy.__version__} on {name}, device {device.id}"
    else:
        meter = _CpuMeter()
        where = f"NumPy {np.__version__} on the CPU"

    say(f"cuflash {getattr(cuflash, '__version__', '?')} demo: backend {backend} ({where})")
    say(f"problem: batch {batch}, seqlen_q {seqlen_q}, seqlen_k {seqlen_k}, heads {heads} "
        f"(kv {heads_kv}), head_dim {head_dim}, {dtype_name}, "
        f"causal {args.causal_align if args.causal else 'no'}, algorithm {args.algorithm}")
    s_bytes = batch * heads * seqlen_q * seqlen_k * 4
    in_bytes = q.nbytes + k.nbytes + v.nbytes + do.nbytes
    say(f"inputs {_fmt_bytes(in_bytes)}; for scale, one float32 score matrix S = QK^T "
        f"would take {_fmt_bytes(s_bytes)}")

    fwd_flops = _flops(batch, heads, seqlen_q, seqlen_k, head_dim, args.causal)
    unit, div = ("TFLOP/s", 1e12) if backend == "cupy" else ("GFLOP/s", 1e9)

    def report(label, first, times, peak, flops):
        best = float(np.median(times))
        line = f"{label:<9} {best * 1e3:10.2f} ms"
        if len(times) > 1:
            line += f" (median of {len(times)})"
        line += f"  {flops / best / div:8.2f} {unit}   {meter.name} {_fmt_bytes(peak)}"
        say(line)
        if backend == "cupy":
            say(f"{'':<9} first call {first * 1e3:.1f} ms (includes kernel compile or cache load)")

    try:
        (o, lse), first, times, peak = meter.run(
            lambda: cuflash.attention(q, k, v, return_lse=True, **common), repeat)
        report("forward", first, times, peak, fwd_flops)
        grads = None
        if not args.no_backward:
            grads, first, times, peak = meter.run(
                lambda: cuflash.attention_backward(do, q, k, v, o, lse, **common), repeat)
            report("backward", first, times, peak, 2.5 * fwd_flops)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
        # The front door and the backends refuse what they cannot run with one of these, before any
        # work starts (an unsupported head dim or dtype on the GPU, say): show the message, no traceback.
        print(f"cuflash demo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE

    t0 = time.perf_counter()
    truth = float64_truth(xp, q, k, v, do, scale=scale, causal_offset=causal_offset)
    truth_s = time.perf_counter() - t0
    tol = TOLERANCE[dtype_name]
    results = {"out": o, "lse": lse}
    if grads is not None:
        results.update(dq=grads[0], dk=grads[1], dv=grads[2])
    names = ("out", "lse", "dq", "dk", "dv")

    say(f"check against float64 naive attention ({truth_s:.2f} s): "
        f"max|x - truth| / max|truth|, tolerance {tol:.0e}")
    ok = True
    for name, t in zip(names, truth):
        if name not in results:
            continue
        x = results[name]
        if x.shape != t.shape:
            say(f"  {name:<4} shape {tuple(x.shape)}, expected {tuple(t.shape)}  FAIL")
            ok = False
            continue
        err = relative_error(xp, x, t)
        passed = err <= tol
        ok &= passed
        say(f"  {name:<4} {err:9.2e}  {'ok' if passed else 'FAIL'}")
    say("PASS" if ok else "FAIL: some results are outside the tolerance")
    return EXIT_OK if ok else EXIT_CHECK_FAILED


# ---------------------------------------------------------------------------------------------------
# bench and the entry point
# ---------------------------------------------------------------------------------------------------

def bench(argv, which="auto") -> int:
    """Run the GPU side-by-side benchmark when CuPy and a GPU are present, else the CPU benchmark.

    The chosen module's ``main`` gets ``argv`` unchanged and ``prog``, the command as typed (``python -m
    cuflash bench``, ``bench-cpu`` or ``bench-gpu``), for its usage and ``--help`` lines."""
    prog = "python -m cuflash bench" + ("" if which == "auto" else f"-{which}")
    if which == "auto":
        which = "gpu" if gpu_available() else "cpu"
    module_name = f"cuflash.cli.bench_{which}"
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"cuflash bench: error: {module_name} is not available in this version", file=sys.stderr)
        return EXIT_USAGE
    wants_help = any(arg in ("-h", "--help") for arg in argv)  # --help works without a GPU
    if which == "gpu" and not wants_help and not gpu_available():
        print(f"cuflash bench: error: bench-gpu needs CuPy and a CUDA GPU: {_cupy_status()[1]}",
              file=sys.stderr)
        return EXIT_USAGE
    code = module.main(list(argv), prog=prog)
    return int(code or 0)


USAGE = """usage: python -m cuflash {demo,bench,bench-cpu,bench-gpu,bench-decode,tune} [options]

  demo       run attention forward and backward on the best backend, check against float64,
             print error, time and peak memory (python -m cuflash demo --help for options)
  bench      benchmark: cuflash.cli.bench_gpu when CuPy and a GPU are present, else cuflash.cli.bench_cpu;
             options are passed through (python -m cuflash bench --help)
  bench-cpu  the CPU benchmark (NumPy reference), whatever is installed
  bench-gpu  the GPU side-by-side benchmark
  bench-decode  one decode step against a KV cache: bandwidth beside PyTorch SDPA and a device copy
             (NumPy reference at small sizes without a GPU; python -m cuflash bench-decode --help)
  tune       time the candidate tiles of the CUDA kernels on this GPU and write its tile table, which
             the launcher reads over the packaged one (--dry-run lists the candidates without a GPU)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr, end="")
        return EXIT_OK if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    try:
        if command == "demo":
            return demo(rest)
        if command == "bench":
            return bench(rest)
        if command in ("bench-cpu", "bench-gpu"):
            return bench(rest, which=command[len("bench-"):])
        if command == "bench-decode":
            from .bench_decode import main as bench_decode

            return bench_decode(rest)
        if command == "tune":
            from .._cuda.tuning import main as tune

            return tune(rest)
    except SystemExit as exc:  # argparse: --help or a bad option
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    print(f"cuflash: error: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
