"""Where a generated token's host time goes, cufa against "sdpa", inside ``model.generate`` itself (issues 12 and 13:
generation at >= 1.0x sdpa's best backend, which is host-bound).

On the GPU machine, from the repository root::

    PYTHONPATH=. python3 tools/generation_host.py [--prompt 512] [--new-tokens 48] [--rounds 5]

The Llama model of ``tools/transformers_bench.py`` (random weights, 8 layers, d 128, GQA 16/4, bfloat16, batch 1).
The attention and mask functions that transformers looks up by name at every call (``AttentionInterface``,
``AttentionMaskInterface``) are wrapped with a timer for the run, so that each call's host time (``perf_counter``
around it; the GPU is never waited for there) is recorded in the real loop. Each round runs ``generate`` once per
implementation, in turn (cufa, sdpa on its flash backend, sdpa on its default choice); per implementation it prints
the median over rounds of: the wall time per generated token (CUDA-synchronized at the end), the attention
function's host time per call and per token (all layers), the mask function's per token, and what is left (the
rest of the model and of ``generate``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--parts", action="store_true",
                    help="instead: the host time of one decode call's parts, each in a loop of its own")
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="instead: prefills of these lengths, each attention call synchronized and timed alone")
    ap.add_argument("--model", choices=("llama", "qwen2"), default="llama")
    args = ap.parse_args(argv)
    if args.parts:
        return parts()
    if args.prefill:
        return prefill(args)

    import torch
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import cuflash.integrations.transformers as cti

    model, config = _model(args)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), device="cuda")

    spent: dict = {}  # (function kind) -> list of seconds per call

    def timed(kind, fn):
        calls = spent.setdefault(kind, [])

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                calls.append(time.perf_counter() - t0)
        return wrapper

    attn_map, mask_map = AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping
    maps = {"attention": attn_map, "mask": mask_map}
    originals = {(kind, name): m[name] for kind, m in maps.items() for name in ("sdpa", cti.NAME)}
    for (kind, name), fn in originals.items():
        maps[kind][name] = timed((kind, name), fn)

    impls = {"cufa": (cti.NAME, None), "sdpa/flash": ("sdpa", SDPBackend.FLASH_ATTENTION),
             "sdpa/default": ("sdpa", None)}
    rows: dict = {name: [] for name in impls}
    order = list(impls)
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        for name in order[round_ % len(order):] + order[:round_ % len(order)]:
            impl, backend = impls[name]
            model.set_attn_implementation(impl)
            context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            for calls in spent.values():
                calls.clear()
            with context, torch.no_grad():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            attn = spent.get(("attention", impl), [])
            mask = spent.get(("mask", impl), [])
            decode = attn[args.layers:]  # (the prompt's calls first)
            if round_:
                rows[name].append(dict(
                    token_us=wall / args.new_tokens * 1e6,
                    attn_call_us=statistics.median(decode) * 1e6 if decode else float("nan"),
                    attn_token_us=sum(decode) / max(args.new_tokens - 1, 1) * 1e6,
                    mask_token_us=sum(mask[1:]) / max(args.new_tokens - 1, 1) * 1e6,
                    calls=len(attn)))
    for (kind, name), fn in originals.items():
        maps[kind][name] = fn
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"Llama {args.layers} layers d 128 16/4 heads bf16, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"median of {args.rounds} rounds")
    print(f"{'impl':14s} {'tokens/s':>9s} {'us/token':>9s} {'attn us/call':>13s} {'attn us/token':>14s} "
          f"{'mask us/token':>14s} {'rest us/token':>14s}")
    for name, samples in rows.items():
        med = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        rest = med["token_us"] - med["attn_token_us"] - med["mask_token_us"]
        print(f"{name:14s} {1e6 / med['token_us']:9.1f} {med['token_us']:9.1f} {med['attn_call_us']:13.1f} "
              f"{med['attn_token_us']:14.1f} {med['mask_token_us']:14.1f} {rest:14.1f}")
    return 0


def _model(args):
    """The benchmark's Llama (d 128, 16 / 4 heads) or Qwen2 (d 64, 16 / 2 heads), random weights, bf16, on the GPU."""
    import torch
    import transformers

    common = dict(vocab_size=32000, num_hidden_layers=args.layers, num_attention_heads=16,
                  max_position_embeddings=32768, rope_theta=1e6)
    if getattr(args, "model", "llama") == "qwen2":
        config, cls = transformers.Qwen2Config(**common, hidden_size=1024, intermediate_size=2816,
                                               num_key_value_heads=2), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**common, hidden_size=2048, intermediate_size=5632,
                                               num_key_value_heads=4), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval().to("cuda"), config


def prefill(args, reps: int = 5) -> int:
    """A forward pass over a prompt (no cache), per implementation: its time (CUDA events, median of ``reps``) and
    each attention call's time with the GPU synchronized before and after it (host and GPU), summed per pass."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface

    import cuflash.integrations.transformers as cti

    model, config = _model(args)
    attn_map = AttentionInterface._global_mapping
    originals = {name: attn_map[name] for name in ("sdpa", cti.NAME)}
    spent: list = []

    def synced(fn):
        def wrapper(*a, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            torch.cuda.synchronize()
            spent.append(time.perf_counter() - t0)
            return out
        return wrapper

    spent_host: dict = {}

    def timed(kind, fn):  # (the host time alone: the GPU not waited for)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            spent_host[kind].append(time.perf_counter() - t0)
            return out
        return wrapper

    impls = {"cufa": (cti.NAME, None), "sdpa/flash": ("sdpa", SDPBackend.FLASH_ATTENTION),
             "sdpa/cudnn": ("sdpa", SDPBackend.CUDNN_ATTENTION)}
    print(f"{torch.cuda.get_device_name()}, {args.model} {args.layers} layers, bf16, batch 1: forward ms (events, "
          f"median of {reps}); attention ms per pass (each call synchronized, median of {reps})")
    for n in args.prefill:
        ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
        for name, (impl, backend) in impls.items():
            model.set_attn_implementation(impl)
            context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            with context, torch.no_grad():
                model(ids, use_cache=False)
                times = []
                for _ in range(reps):
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    model(ids, use_cache=False)
                    stop.record()
                    stop.synchronize()
                    times.append(start.elapsed_time(stop))
                attn, host = [], []
                attn_map[impl] = synced(originals[impl])
                try:
                    for _ in range(reps):
                        spent.clear()
                        model(ids, use_cache=False)
                        attn.append(sum(spent) * 1e3)
                    attn_map[impl] = timed(("prefill", impl), originals[impl])
                    for _ in range(reps):
                        calls = spent_host.setdefault(("prefill", impl), [])
                        calls.clear()
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        model(ids, use_cache=False)
                        enqueued = time.perf_counter() - t0
                        torch.cuda.synchronize()
                        host.append((enqueued * 1e3, statistics.median(calls) * 1e6))
                finally:
                    attn_map[impl] = originals[impl]
            import collections
            import os
            import sys

            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import transformers_profile

            found: collections.Counter = collections.Counter()
            context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            model.set_attn_implementation(impl)
            with transformers_profile._synchronizations(torch, found), context, torch.no_grad():
                model(ids, use_cache=False)
            for (what, culprit), count in found.items():
                print(f"  prefill {n:6d} {name:12s} {count} x {what[:60]} at {culprit}")
            print(f"  prefill {n:6d} {name:12s} forward {statistics.median(times):8.2f} ms   attention "
                  f"{statistics.median(attn):7.2f} ms ({len(spent)} calls); the pass enqueued in "
                  f"{statistics.median(h[0] for h in host):7.2f} ms, attention's host time per call "
                  f"{statistics.median(h[1] for h in host):7.1f} us")
    return 0


def parts(calls: int = 2000) -> int:
    """Host microseconds per call (median) of a decode step's attention (Llama's shapes, context ~1024, a new cache
    view at every call as a DynamicCache makes) and of the parts of cufa's path, each timed in a loop of its own."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import cuflash.integrations.transformers as cti
    import cuflash.torch as ct

    class Module(torch.nn.Module):
        is_causal, num_key_value_groups, training = True, 4, False

    module = Module()
    b, hq, hkv, d, n0 = 1, 16, 4, 128, 1024
    dev, dtype = "cuda", torch.bfloat16
    q = torch.randn(b, hq, 1, d, device=dev, dtype=dtype)
    big_k = torch.randn(b, hkv, n0 + calls + 8, d, device=dev, dtype=dtype)
    big_v = torch.randn_like(big_k)
    scale = d ** -0.5
    kvs = [(big_k[:, :, :n], big_v[:, :, :n]) for n in range(n0, n0 + calls)]

    def loop(fn):
        for i in range(20):
            fn(i)
        torch.cuda.synchronize()
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return statistics.median(times) * 1e6

    qt = q.transpose(1, 2)
    kts = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kvs]
    cases = {
        "sdpa_attention_forward (transformers'), flash": lambda i: sdpa_attention_forward(
            module, q, *kvs[i], None, dropout=0.0, scaling=scale),
        "cufa attention_forward": lambda i: cti.attention_forward(module, q, *kvs[i], None, dropout=0.0,
                                                                  scaling=scale),
        "cuflash.torch.attention_with_kvcache": lambda i: ct.attention_with_kvcache(
            qt, *kts[i], cache_seqlens=kts[i][0].shape[1], causal=True, softmax_scale=scale),
    }
    cases["  cuflash.torch.decode_heads_first"] = lambda i: ct.decode_heads_first(
        q, *kvs[i], None, True, (-1, -1), 0.0, scale)
    key = ct._decode_key(qt, *kts[0], kts[0][0].shape[1], None, None, True, True, (-1, -1), 0.0, scale, 0)
    cases.update({
        "  _decode_key": lambda i: ct._decode_key(qt, *kts[i], kts[i][0].shape[1], None, None, True, True, (-1, -1),
                                                 0.0, scale, 0),
        "  _decode_run": lambda i: ct._decode_run(key, qt, *kts[i], kts[i][0].shape[1], None, None, False),
        "  three transposes": lambda i: [t.transpose(1, 2) for t in (q, *kvs[i])],
        "  _decodes": lambda i: cti._decodes(qt, *kts[i], dict(dropout_p=0.0)),
        "    torch.empty (out)": lambda i: torch.empty((1, 1, hq, d), dtype=dtype, device=q.device),
        "    torch.cuda.current_device()": lambda i: torch.cuda.current_device(),
        "    is_current_stream_capturing()": lambda i: torch.cuda.is_current_stream_capturing(),
        "    _stream_address": lambda i: ct._stream_address(0),
        "    _runs_eagerly()": lambda i: ct._runs_eagerly(None, None),
        "    stride() x 3, data_ptr() x 3": lambda i: (qt.stride(), kts[i][0].stride(), kts[i][1].stride(),
                                                     qt.data_ptr(), kts[i][0].data_ptr(), kts[i][1].data_ptr()),
    })
    launch = ct._decode_launches.get(key)
    if launch is not None:
        out = torch.empty((1, 1, hq, d), dtype=dtype, device=dev)
        lse = torch.empty((1, hq, 1), dtype=torch.float32, device=dev)

        def run(i):
            k, v = kts[i]
            launch.run_addresses((qt.data_ptr(), k.data_ptr(), v.data_ptr(), 0, 0, out.data_ptr(), lse.data_ptr(),
                                  ct._kvcache.uniform_seqlens_address(0, 1, k.shape[1]), 0, 0, 0, 0),
                                 k.shape[1], tuple(x * 2 for x in k.stride()), tuple(x * 2 for x in v.stride()), 2,
                                 key[1])
        cases["    launch.run_addresses"] = run
    print(f"{torch.cuda.get_device_name()}: host us per call, median of {calls} (decode step, 16/4 heads, d 128, "
          f"bf16, context {n0}+)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad():
        for name, fn in cases.items():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if "flash" in name else contextlib.nullcontext():
                print(f"  {name:46s} {loop(fn):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
