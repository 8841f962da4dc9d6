"""Where the time of ``attn_implementation="cufa"`` goes in a transformers model (issue 13): host synchronizations,
the Python of the decode loop, and the CPU and CUDA time of each attention call.

On the GPU machine, from the repository root (under 2 minutes)::

    PYTHONPATH=. python3 tools/transformers_profile.py

runs the Llama model of ``tools/transformers_bench.py`` (random weights, 8 layers, d 128, GQA 16/4, bfloat16,
batch 1) with cufa: one prefill of ``--prefill`` tokens (4096) and a greedy ``generate`` of ``--new-tokens`` (32),
after a warm-up of both, and prints

(a) every synchronizing call that ``torch.cuda.set_sync_debug_mode("warn")`` reports during the prefill and the
    generation, deduplicated, with its count and the innermost Python frame in cuflash (or, where cuflash is not
    on the stack, in transformers) that made it;
(b) cProfile's top ``--top`` (25) functions by cumulative time for the generation, cufa's then sdpa's;
(c) torch.profiler's per-call CPU and CUDA time of the attention calls (cuflash's operators beside sdpa's), per
    prefill and per generated token, with the CUDA kernels they launched, for cufa and for sdpa on the same
    weights.

``--smoke`` runs the same on the CPU with a tiny float32 model (the NumPy reference behind cufa: its times mean
nothing; it checks that the script works). ``--host`` needs neither a GPU nor CuPy: it times the Python host path
of one decode-step attention call of the Llama shapes (cufa's ``attention_forward`` down to the decode launcher,
launches stubbed) with a stand-in CuPy (``tests/_fake_cupy.py``) and CPU tensors posing as CUDA ones, for a cache
that grows by one token per step (a ``DynamicCache``) and for a fixed one, at three entry points.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # (torch.profiler's start and stop lines: not in the log)


# ---------------------------------------------------------------------------------------------------
# (a) host synchronizations
# ---------------------------------------------------------------------------------------------------

def _package_dirs() -> tuple[str, ...]:
    import cuflash
    import transformers

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (cuflash, transformers))


def _culprit(stack) -> str:
    """The innermost frame of ``stack`` in cuflash's package, else in transformers', else the innermost one."""
    for package in _package_dirs():
        for frame in reversed(stack):
            if os.path.abspath(frame.filename).startswith(package):
                return f"{_short(frame.filename)}:{frame.lineno} {frame.name}: {(frame.line or '').strip()[:70]}"
    frame = stack[-1]
    return f"{_short(frame.filename)}:{frame.lineno} {frame.name}"


def _short(path: str) -> str:
    """A path from its package's directory on (cuflash/torch.py, transformers/generation/utils.py, torch/...)."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = os.path.abspath(path).split(os.sep)
    if "cuflash" in parts:
        return os.sep.join(parts[len(parts) - parts[::-1].index("cuflash") - 1:])
    return os.path.basename(path)


@contextlib.contextmanager
def _synchronizations(torch, found: collections.Counter):
    """Count, by (what, culprit): the synchronizing calls torch reports (``set_sync_debug_mode("warn")``), and
    cuflash's own host reads of device values on the CuPy side, which torch cannot see (``_validate._to_host``, the
    finite checks) with the runtime's context calls of the decode and forward plans (``make_context_current``)."""
    from cuflash._ops import validate as _validate
    from cuflash._cuda import decode

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        what = text.splitlines()[0][:90] if "synchroniz" in text else f"(a warning) {text.splitlines()[0][:70]}"
        found[(what, _culprit(traceback.extract_stack()[:-1]))] += 1

    def counted(fn, what):
        def wrapper(*args, **kwargs):
            if not (args and type(args[0]).__module__.startswith("numpy")):  # (a NumPy array: no device read)
                found[(what, _culprit(traceback.extract_stack()[:-1]))] += 1
            return fn(*args, **kwargs)
        return wrapper

    patched = [(_validate, "_to_host", "cuflash host read of a CuPy array (_validate._to_host: .get())"),
               (_validate, "check_finite", "cuflash finite check (a reduction and a host read per array)"),
               (decode.CupyRuntime, "make_context_current", "cuflash runtime call memGetInfo (a plan's first run "
                                                             "on a thread)")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    previous = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
    try:
        for owner, name, what in patched:
            setattr(owner, name, counted(getattr(owner, name), what))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            if previous is not None:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if previous is not None:
                    torch.cuda.set_sync_debug_mode(previous)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _print_synchronizations(label: str, found: collections.Counter, steps: int, unit: str, detail: bool) -> None:
    total = sum(n for (what, _), n in found.items() if not what.startswith("(a warning)"))
    print(f"(a) {label}: {total} synchronizations and host reads ({total / max(steps, 1):.1f} per {unit})")
    if detail:
        for (what, where), count in found.most_common(12):
            print(f"    {count:5d}x {what}\n           at {where}")


# ---------------------------------------------------------------------------------------------------
# (b) cProfile of the decode loop
# ---------------------------------------------------------------------------------------------------

def _print_cprofile(impl: str, profile: cProfile.Profile, top: int, tokens: int) -> None:
    stats = pstats.Stats(profile, stream=io.StringIO())
    total = stats.total_tt
    print(f"(b) {impl}: cProfile of generate ({tokens} tokens, {total * 1e3:.0f} ms, {total / tokens * 1e3:.2f} ms per "
          f"token under the profiler); top {top} by cumulative time, then the top {top // 2} by own time (ms per "
          f"token: cumulative, own; calls per token):")
    for key, count in ((3, top), (2, top // 2)):
        if key == 2:
            print("    -- by own time")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][key])[:count]
        for (path, line, name), (_, calls, tottime, cumtime, _) in rows:
            where = f"{_short(path)}:{line}({name})" if path != "~" else name
            print(f"    {cumtime / tokens * 1e3:7.3f} {tottime / tokens * 1e3:7.3f} {calls / tokens:6.1f}  "
                  f"{where[:100]}")


# ---------------------------------------------------------------------------------------------------
# (c) torch.profiler: attention calls, CPU and CUDA time
# ---------------------------------------------------------------------------------------------------

_ATTENTION = ("cuflash::", "aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "aten::_flash_attention",
              "aten::_efficient_attention", "aten::_cudnn_attention")


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: kineto prints its profiler_start and profiler_stop lines there from C++."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _print_torch_profile(label: str, prof, unit: str, units: int, wall: float, device: str) -> None:
    """The attention operators' CPU and CUDA time per call and per ``unit`` (a prefill, a token), the CPU time of
    the profiled region, and the CUDA kernels: their total and the top ones."""
    events = prof.key_averages()
    attention = [e for e in events if e.key.startswith(_ATTENTION)]
    cuda_attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    self_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(f"(c) {label}: {wall / units * 1e3:.2f} ms per {unit} (wall, without the profiler); attention operators "
          f"(calls per {unit}; us per call: CPU, CUDA; us per {unit}: CPU, CUDA):")
    for e in sorted(attention, key=lambda e: -e.cpu_time_total)[:5]:
        cuda = getattr(e, cuda_attr)
        print(f"    {e.count / units:6.1f} {e.cpu_time_total / e.count:9.1f} {cuda / e.count:9.1f} "
              f"{e.cpu_time_total / units:9.1f} {cuda / units:9.1f}  {e.key[:60]}")
    if device == "cuda":
        kernels = [e for e in events if getattr(e, self_attr) > 0 and e.cpu_time_total == 0]
        total = sum(getattr(e, self_attr) for e in kernels) / units
        print(f"    CUDA kernels: {total:.1f} us per {unit} in all; the top 6 (us per {unit}, launches per {unit}):")
        for e in sorted(kernels, key=lambda e: -getattr(e, self_attr))[:6]:
            print(f"    {getattr(e, self_attr) / units:9.1f} {e.count / units:6.1f}  {e.key[:90]}")


# ---------------------------------------------------------------------------------------------------
# The model runs
# ---------------------------------------------------------------------------------------------------

def _llama(torch, transformers, smoke: bool, device: str, dtype):
    from transformers_bench import _models

    config = next(c for c in _models(transformers, torch, smoke).values() if isinstance(c, transformers.LlamaConfig))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval().to(device), config


def _profile_model(args) -> int:
    import torch
    import transformers

    import cuflash.integrations.transformers as cti

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.prefill, args.prompt, args.new_tokens = 64, 16, 4
    model, config = _llama(torch, transformers, args.smoke, device, dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, args.prefill), generator=generator).to(device)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=generator).to(device)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {gpu}, {dtype}; llama "
          f"{config.num_hidden_layers} layers, d {config.hidden_size // config.num_attention_heads}, heads "
          f"{config.num_attention_heads}/{config.num_key_value_heads}; prefill {args.prefill}, generate "
          f"{args.new_tokens} after {args.prompt}")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def prefill():
        model(ids, use_cache=False)

    def generate():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        # (a) synchronizations: cufa in detail, sdpa's counts beside
        for impl in (cti.NAME, "sdpa"):
            model.set_attn_implementation(impl)
            prefill(), generate(), sync()  # warm-up: kernels compiled, plans made
            for label, fn, steps, unit in (("prefill", prefill, 1, "prefill"),
                                           ("generate", generate, args.new_tokens, "token")):
                found: collections.Counter = collections.Counter()
                with _synchronizations(torch, found):
                    fn()
                sync()
                _print_synchronizations(f"{impl} {label}", found, steps, unit, detail=impl == cti.NAME)
        # (b) cProfile of the decode loop, cufa then sdpa (what differs between the two is cufa's cost)
        for impl in (cti.NAME, "sdpa"):
            model.set_attn_implementation(impl)
            profile = cProfile.Profile()
            profile.enable()
            generate()
            sync()
            profile.disable()
            _print_cprofile(impl, profile, args.top, args.new_tokens)
        # (c) torch.profiler, cufa then sdpa
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        for impl in (cti.NAME, "sdpa"):
            model.set_attn_implementation(impl)
            prefill(), generate(), sync()
            for what, fn, units, unit in (("prefill", prefill, 1, "prefill"),
                                          ("generate", generate, args.new_tokens, "token")):
                start = time.perf_counter()
                fn()
                sync()
                wall = time.perf_counter() - start
                with _quiet_stderr(), torch_profile(activities=activities) as prof:
                    fn()
                    sync()
                _print_torch_profile(f"{impl} {what}", prof, unit, units, wall, device)
    return 0


# ---------------------------------------------------------------------------------------------------
# --host: the Python host path of one decode-step attention call, without a GPU
# ---------------------------------------------------------------------------------------------------

def pose_cpu_as_cuda(patch, cp):
    """CPU tensors as CUDA ones for ``cuflash.torch``'s CUDA path over the stand-in CuPy ``cp``
    (``tests/_fake_cupy.py``, installed): they cross into it as a CUDA tensor crosses into CuPy (a view, no copy),
    the results come back as tensors, and a decode step like one already run takes the direct path
    (``cuflash.torch._decode_run``) on device 0's null stream. Returns the crossing (tensor -> stand-in array)."""
    import ml_dtypes
    import numpy as np
    import torch

    import cuflash.torch as ct

    patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def to_array(t):
        t = t.detach()
        a = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
        return a.view(cp.ndarray)

    @contextlib.contextmanager
    def backend_call(t):
        yield object()

    def output(a, memory):
        a = np.asarray(a).view(np.ndarray)
        return (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16
                else torch.from_numpy(a))

    patch.setattr(ct, "_to_array", to_array)
    patch.setattr(ct, "_backend_call", backend_call)
    patch.setattr(ct, "_output", output)
    patch.setattr(ct, "_gpu_index", lambda t: 0)
    patch.setattr(ct, "_stream_address", lambda index: 0)
    patch.setattr(ct, "_current_device", lambda: 0)
    patch.setattr(ct, "_current_device_fast", lambda: 0)
    patch.setattr(ct, "_capturing", lambda: False)
    return to_array


def _host_path(args) -> int:
    """Per-call host time of a decode step's attention at three entry points, the CUDA path emulated on the CPU."""
    import torch
    from _pytest.monkeypatch import MonkeyPatch

    torch.set_num_threads(1)  # (the thread pool's spinning would count as this process's time)
    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
    from _fake_cupy import install

    patch = MonkeyPatch()
    cp, _ = install(patch)  # (a stand-in cupy; the front door's and the launchers' memories emptied)
    to_array = pose_cpu_as_cuda(patch, cp)
    import cuflash
    import cuflash.integrations.transformers as cti
    import cuflash.torch as ct

    class Layer(torch.nn.Module):
        is_causal = True

    layer, batch, heads_q, heads_kv, d, layers = Layer(), 1, 16, 4, 128, 8
    scale = d ** -0.5

    def inputs(n):  # one layer's step: q (batch, heads, 1, d); the cache as a DynamicCache's torch.cat leaves it
        return (torch.zeros(batch, heads_q, 1, d, dtype=torch.bfloat16),
                torch.zeros(batch, heads_kv, n, d, dtype=torch.bfloat16),
                torch.zeros(batch, heads_kv, n, d, dtype=torch.bfloat16))

    entries = {
        "transformers attention_forward": lambda q, k, v: cti.attention_forward(layer, q, k, v, None, scaling=scale),
        "cuflash.torch.attention_with_kvcache": lambda q, k, v: ct.attention_with_kvcache(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=k.shape[2], causal=True,
            softmax_scale=scale),
        "cuflash.attention_with_kvcache": lambda q, k, v: cuflash.attention_with_kvcache(
            to_array(q).transpose(0, 2, 1, 3), to_array(k).transpose(0, 2, 1, 3), to_array(v).transpose(0, 2, 1, 3),
            cache_seqlens=k.shape[2], causal=True, softmax_scale=scale),
    }

    def step(call, n: int, profile=None) -> float:
        """The host time per call of one step (``layers`` calls) over ``n`` cached tokens."""
        batch_inputs = [inputs(n) for _ in range(layers)]
        start = time.process_time()  # (this process's CPU time: a shared machine's other load does not count)
        if profile is not None:
            profile.enable()
        for q, k, v in batch_inputs:
            call(q, k, v)
        if profile is not None:
            profile.disable()
        return (time.process_time() - start) / layers * 1e6

    def calls_per_call(call, n: int) -> float:
        """Python function calls per attention call (cProfile's count: what the machine's load does not blur)."""
        profile = cProfile.Profile()
        step(call, n, profile)
        return sum(row[1] for row in pstats.Stats(profile).stats.values()) / layers

    print(f"host time per attention call of a decode step (stand-in CuPy, launches stubbed, CPU tensors as CUDA "
          f"ones); {layers} layers, heads {heads_q}/{heads_kv}, d {d}, bfloat16, cache from {args.prompt} tokens; "
          f"median of {args.steps} steps, the entry points interleaved step by step; and Python function calls per "
          f"call:")
    print(f"    {'entry point':40s} {'growing cache':>14s} {'fixed cache':>12s} {'calls':>7s}")
    with torch.no_grad():
        times = {(name, grow): [] for name in entries for grow in (True, False)}
        for name, call in entries.items():
            step(call, args.prompt)
        for i in range(args.steps):
            for j, ((name, grow), got) in enumerate(times.items()):  # (each its own lengths: the memos are shared)
                got.append(step(entries[name], args.prompt + 1 + i * len(times) + j if grow else args.prompt))
        for j, (name, call) in enumerate(entries.items()):
            counted = calls_per_call(call, args.prompt + 1 + args.steps * len(times) + j)  # (a growing cache's step)
            print(f"    {name:40s} {statistics.median(times[name, True]):11.1f} us "
                  f"{statistics.median(times[name, False]):9.1f} us {counted:7.0f}")
        if args.top:
            profile = cProfile.Profile()
            for i in range(args.steps):
                step(entries["transformers attention_forward"], args.prompt + (len(times) + 1) * args.steps + i, profile)
            stats = pstats.Stats(profile, stream=io.StringIO())
            calls = args.steps * layers
            print(f"cProfile of attention_forward, growing cache, top {args.top} by own time (us per call: own, "
                  f"cumulative; calls per call):")
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
            for (path, line, fname), (_, ncalls, tottime, cumtime, _) in rows:
                where = f"{_short(path)}:{line}({fname})" if path != "~" else fname
                print(f"    {tottime / calls * 1e6:7.1f} {cumtime / calls * 1e6:7.1f} {ncalls / calls:5.1f}  "
                      f"{where[:100]}")
    patch.undo()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/transformers_profile.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=4096, help="prompt length of the profiled prefill")
    ap.add_argument("--prompt", type=int, default=512, help="prompt length before generating")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=25, help="functions cProfile prints")
    ap.add_argument("--smoke", action="store_true", help="a tiny float32 model on the CPU (checks the script)")
    ap.add_argument("--host", action="store_true",
                    help="host time of one decode attention call on the CPU, stand-in CuPy (no GPU needed)")
    ap.add_argument("--steps", type=int, default=200, help="--host: decode steps")
    args = ap.parse_args(argv)
    if args.host:
        return _host_path(args)
    return _profile_model(args)


if __name__ == "__main__":
    raise SystemExit(main())
