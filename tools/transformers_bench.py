"""transformers models with cuflash's attention (``attn_implementation="cufa"``) against "sdpa" on each of its
backends, side by side in one process: prefill time and greedy generation tokens/s (issue 13's benchmark).

On the GPU machine, from the repository root::

    PYTHONPATH=. python3 tools/transformers_bench.py                 # Llama (d 128, GQA 16/4), Qwen2 (d 64, 16/2)
    PYTHONPATH=. python3 tools/transformers_bench.py --prefill 4096 16384 --new-tokens 128

Random-weight models (no download) in bfloat16, batch 1. Prefill: one forward pass over the prompt without a cache
(CUDA events; the implementations in turn over ``--reps`` rounds, the median of each). Generation: ``model.generate`` (greedy, the model's default dynamic cache)
of ``--new-tokens`` after a prompt of ``--prompt`` tokens, the implementations timed in turn over ``--rounds``
rounds (the median of each); tokens per second of the generated tokens. "sdpa" runs
under ``torch.nn.attention.sdpa_kernel`` with one backend at a time (a backend that refuses a shape is reported as
such). Before timing, each implementation's prefill logits are compared with the first sdpa backend's.

``--smoke`` runs tiny float32 models on the CPU (the NumPy reference behind cufa), a check that the script works
on any machine; its times mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _models(transformers, torch, smoke: bool):
    """name -> config: the two shapes of the issue (smaller than the real models: 8 layers; --smoke: 2 tiny)."""
    if smoke:
        common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=512)
        return {"llama-tiny": transformers.LlamaConfig(**common, num_key_value_heads=2),
                "qwen2-tiny": transformers.Qwen2Config(**common, num_key_value_heads=2)}
    common = dict(vocab_size=32000, num_hidden_layers=8, num_attention_heads=16, max_position_embeddings=32768,
                  rope_theta=1e6)
    return {"llama d128 gqa16/4": transformers.LlamaConfig(**common, hidden_size=2048, intermediate_size=5632,
                                                           num_key_value_heads=4),
            "qwen2 d64 gqa16/2": transformers.Qwen2Config(**common, hidden_size=1024, intermediate_size=2816,
                                                          num_key_value_heads=2)}


def _timer(torch, device):
    if device == "cpu":
        def timed(fn, reps, warm=True):
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        return timed

    def timed(fn, reps, warm=True):
        if warm:
            fn()  # warm-up (compiles cuflash's kernels, torch's autotuning)
        times = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e-3)
        return statistics.median(times)
    return timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/transformers_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, nargs="+", default=[4096, 16384], help="prompt lengths of the prefill")
    ap.add_argument("--prompt", type=int, default=512, help="prompt length before generating")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="prefill: rounds, each timing every implementation once in turn (the median)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="generation: rounds, each timing every implementation once in turn (the median)")
    ap.add_argument("--smoke", action="store_true", help="tiny float32 models on the CPU (checks the script)")
    args = ap.parse_args(argv)

    import contextlib

    import torch
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash.integrations.transformers as cti

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.prefill, args.prompt, args.new_tokens, args.reps, args.rounds = [64], 16, 4, 1, 1
    backends = {"sdpa/flash": SDPBackend.FLASH_ATTENTION, "sdpa/efficient": SDPBackend.EFFICIENT_ATTENTION,
                "sdpa/cudnn": SDPBackend.CUDNN_ATTENTION}
    if args.smoke:
        backends = {"sdpa/math": SDPBackend.MATH}
    timed = _timer(torch, device)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {gpu}, {dtype}, batch 1")
    for label, config in _models(transformers, torch, args.smoke).items():
        torch.manual_seed(0)
        cls = transformers.LlamaForCausalLM if isinstance(config, transformers.LlamaConfig) else \
            transformers.Qwen2ForCausalLM
        model = cls._from_config(config, attn_implementation="sdpa", dtype=dtype).eval().to(device)
        # (the sdpa backends first: the first one's logits are the reference the others are compared with)
        impls = {**{name: ("sdpa", b) for name, b in backends.items()}, cti.NAME: ("cufa", None)}
        generator = torch.Generator().manual_seed(1)
        rows = {}
        for n in args.prefill:
            ids = torch.randint(0, config.vocab_size, (1, n), generator=generator).to(device)
            # each implementation checked and warmed up, then timed call by call in rounds, each round from another
            # first implementation (a GPU's clocks and a shared host drift: every implementation sees the same
            # drift), the median of each one's ``reps`` calls
            reference, samples, order = None, {}, []
            for name, (impl, backend) in impls.items():
                model.set_attn_implementation(cti.NAME if impl == "cufa" else "sdpa")
                context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
                try:
                    with context, torch.no_grad():
                        logits = model(ids, use_cache=False).logits[0, -8:].float()
                        timed(lambda: model(ids, use_cache=False), 1)
                except RuntimeError as exc:
                    rows[(name, f"prefill {n}")] = f"refused ({str(exc).splitlines()[0][:40]})"
                    continue
                if reference is None:
                    reference = logits
                samples[name] = (f" (max |logits - {next(iter(backends))}'s| "
                                 f"{float((logits - reference).abs().max()):.2g})", [])
                order.append((name, impl, backend))
            for round_ in range(args.reps):
                for name, impl, backend in order[round_ % len(order):] + order[:round_ % len(order)]:
                    model.set_attn_implementation(cti.NAME if impl == "cufa" else "sdpa")
                    context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
                    with context, torch.no_grad():
                        samples[name][1].append(timed(lambda: model(ids, use_cache=False), 1, warm=False))
            for name, (check, times) in samples.items():
                s = rows[(name, f"prefill {n}")] = statistics.median(times)
                print(f"{label:20s} {name:16s} prefill {n:6d} tokens: {s * 1e3:9.2f} ms "
                      f"{n / s:10.0f} tokens/s{check}")
        prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=generator).to(device)
        # generation: the implementations in turn, round after round (a host-bound loop on a shared host drifts:
        # interleaved rounds, each from another first one, expose every implementation to the same drift), the
        # median of each one's rounds
        samples = {}
        order = list(impls.items())
        for round_ in range(args.rounds + 1):  # (round 0: warm-up, not kept)
            # each round starts at another implementation: none is always the last of a round
            for name, (impl, backend) in order[round_ % len(order):] + order[:round_ % len(order)]:
                if isinstance(rows.get((name, "generate")), str):
                    continue
                model.set_attn_implementation(cti.NAME if impl == "cufa" else "sdpa")
                context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()

                def generate():
                    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
                try:
                    with context, torch.no_grad():
                        s = timed(generate, 1, warm=False)
                except RuntimeError as exc:
                    rows[(name, "generate")] = f"refused ({str(exc).splitlines()[0][:40]})"
                    continue
                if round_:
                    samples.setdefault(name, []).append(s)
        for name, times in samples.items():
            s = rows[(name, "generate")] = statistics.median(times)
            print(f"{label:20s} {name:16s} generate {args.new_tokens} after {args.prompt}: "
                  f"{args.new_tokens / s:8.1f} tokens/s ({args.new_tokens / max(times):.1f}-"
                  f"{args.new_tokens / min(times):.1f} over {len(times)} rounds)")
        # side by side: cufa's time over the best sdpa backend's (> 1: cufa faster)
        for what in [f"prefill {n}" for n in args.prefill] + ["generate"]:
            ours = rows.get((cti.NAME, what))
            theirs = [(v, name) for (name, w), v in rows.items() if w == what and name != cti.NAME
                      and isinstance(v, float)]
            if isinstance(ours, float) and theirs:
                best, best_name = min(theirs)
                print(f"{label:20s} {what:16s} best sdpa: {best_name} -> {cti.NAME} speed / best = {best / ours:.2f}x")
        model = None  # (its memory back before the next model)
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
