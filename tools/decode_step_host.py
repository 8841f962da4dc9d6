"""Host time of one decode step's attention call on the GPU, cuflash.torch's direct path (a step like one already run:
``cuflash.torch._decode_run``) beside the full path (``cuflash.torch.DIRECT_CALLS = False``: every call crosses into
CuPy) and torch's SDPA as transformers' "sdpa" calls it (K and V repeated to q's heads), over a cache that grows by
one token per call as a transformers DynamicCache's does (new tensors; cuflash sees them transposed), in one process,
one path after the other (each checked against SDPA first).

    PYTHONPATH=. python3 tools/decode_step_host.py [--contexts 512 4096] [--calls 400]

Then the same for a prefill's attention call (``cuflash.torch.attention``, causal, inference, fixed shapes; direct:
the front door's plan of a call already run, ``cuflash.torch._forward_run``) at ``--prefill`` tokens.

Prints, per path and context, the median host time per call (the time to enqueue it: ``time.perf_counter`` around the
call, the GPU never waited for) and the wall time per call over the whole loop (synchronized at the end).
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096], help="prefill lengths (attention)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash.torch as ct

    batch, heads_q, heads_kv, d = args.batch, 16, 4, 128
    dev, dtype = "cuda", torch.bfloat16
    scale = d ** -0.5

    def direct(q, k, v, n):
        ct.DIRECT_CALLS = True
        return ct.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=n,
                                         causal=True, softmax_scale=scale)

    def full(q, k, v, n):
        ct.DIRECT_CALLS = False
        return ct.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=n,
                                         causal=True, softmax_scale=scale)

    def sdpa(q, k, v, n):  # as transformers' "sdpa" calls it: K, V repeated to q's heads (repeat_kv); its flash
        group = heads_q // heads_kv  # backend (cuDNN's plans for each new cache length cost ~40 ms a call here)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  scale=scale)

    paths = {"cuflash direct": direct, "cuflash full": full, "sdpa": sdpa}
    print(f"{torch.cuda.get_device_name()}, batch {batch}, heads {heads_q}/{heads_kv}, d {d}, bf16; host us per call "
          f"(median), wall us per call")
    for context in args.contexts:
        q = torch.randn(batch, heads_q, 1, d, device=dev, dtype=dtype)
        k = torch.randn(batch, heads_kv, context + args.calls + 8, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        host = {name: [] for name in paths}
        wall = dict.fromkeys(paths, 0.0)
        ref = sdpa(q, k[:, :, :context], v[:, :, :context], context)
        for name, fn in paths.items():  # checked against SDPA first (and warmed up)
            for n in range(context, context + 4):
                got = fn(q, k[:, :, :n].clone(), v[:, :, :n].clone(), n)
            got = fn(q, k[:, :, :context].clone(), v[:, :, :context].clone(), context)
            got = got.transpose(1, 2) if got.shape[1] == 1 else got
            err = (got.float() - ref.float()).abs().max().item()
            assert err < 2e-2, (name, err)
        for name, fn in paths.items():
            steps = [(k[:, :, :n].clone(), v[:, :, :n].clone(), n)
                     for n in range(context + 8, context + 8 + args.calls)]  # a new, longer cache at every call
            torch.cuda.synchronize()
            start = time.perf_counter()
            for kc, vc, n in steps:
                t0 = time.perf_counter()
                fn(q, kc, vc, n)
                host[name].append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            wall[name] = (time.perf_counter() - start) / args.calls
            del steps
        for name in paths:
            print(f"context {context:6d}  {name:16s} host {statistics.median(host[name]) * 1e6:8.1f} us  "
                  f"wall {wall[name] * 1e6:8.1f} us")
    # A prefill's attention call (inference, fixed shapes): cuflash.torch.attention direct and full, and SDPA
    for n in args.prefill:
        q = torch.randn(batch, n, heads_q, d, device=dev, dtype=dtype)
        k = torch.randn(batch, n, heads_kv, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        group = heads_q // heads_kv

        def attn(direct, q=q, k=k, v=v):
            ct.DIRECT_CALLS = direct
            return ct.attention(q, k, v, causal=True, softmax_scale=scale)

        def sdpa_prefill(q=q, k=k, v=v):  # (transposed back to cuflash's layout: a view)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1),
                                                  v.transpose(1, 2).repeat_interleave(group, 1), is_causal=True,
                                                  scale=scale).transpose(1, 2)

        prefill_paths = {"cuflash direct": lambda: attn(True), "cuflash full": lambda: attn(False), "sdpa": sdpa_prefill}
        ref = sdpa_prefill().float()
        for name, fn in prefill_paths.items():
            err = (fn().float() - ref).abs().max().item()
            assert err < 2e-2, (name, err)
        with torch.no_grad():
            for name, fn in prefill_paths.items():
                host = []
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.calls // 4):
                    t0 = time.perf_counter()
                    fn()
                    host.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / (args.calls // 4)
                print(f"prefill {n:6d}  {name:16s} host {statistics.median(host) * 1e6:8.1f} us  "
                      f"wall {wall * 1e6:8.1f} us")
    ct.DIRECT_CALLS = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
