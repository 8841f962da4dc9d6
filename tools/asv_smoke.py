"""Run every asv benchmark once, without asv: setup, then each time_/track_/peakmem_ method, for the
first and the last parameter combination of each class. For machines where asv itself is not installed (the lent
GPU machine); CI runs ``asv check`` instead.

    PYTHONPATH=.:asv_bench python3 tools/asv_smoke.py [module ...]     (default: all modules)
"""

import importlib
import inspect
import itertools
import sys
import time

PREFIXES = ("time_", "track_", "peakmem_")


def run_module(name):
    module = importlib.import_module(f"benchmarks.{name}")
    failures = 0
    for cls_name, cls in inspect.getmembers(module, inspect.isclass):
        if (cls_name.startswith("_") or cls.__module__ != module.__name__  # (asv skips private names too)
                or not any(m.startswith(PREFIXES) for m in dir(cls))):
            continue
        params = getattr(cls, "params", [])
        if params and not isinstance(params[0], (list, tuple)):
            params = [params]
        combos = list(itertools.product(*params)) if params else [()]
        for combo in dict.fromkeys([combos[0], combos[-1]]):
            failures += _run_class(f"{name}.{cls_name}", cls, combo)
    return failures


def _run_class(label, cls, combo):
    bench, failures = cls(), 0
    try:
        if hasattr(bench, "setup"):
            bench.setup(*combo)
    except NotImplementedError as exc:
        print(f"{label}{combo}: skipped ({exc})")
        return 0
    for method in sorted(m for m in dir(cls) if m.startswith(PREFIXES)):
        t0 = time.perf_counter()
        try:
            value = getattr(bench, method)(*combo)
        except Exception as exc:  # report every failure, then fail at the end
            failures += 1
            print(f"{label}.{method}{combo}: FAILED {type(exc).__name__}: {exc}")
            continue
        shown = "" if value is None else f" -> {value:.4g} {getattr(getattr(cls, method), 'unit', '')}"
        print(f"{label}.{method}{combo}: ok ({time.perf_counter() - t0:.2f} s){shown}")
    return failures


def main(argv):
    modules = argv or ["bench_reference", "bench_mha", "bench_gpu"]
    failures = sum(run_module(m) for m in modules)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
