"""A/B of MLA decode builds (``CUFLASH_DEFINES``, e.g. the [mla early s0] switch), one process per build, in
alternating rounds: per call and back-to-back TFLOP/s of ``plan.run`` at DeepSeek-V3's compute-bound shapes (128 query
heads over one latent head of 576, page 64, bfloat16), and each build's max |error| against a float32 reference.

    python tools/mla_ab.py --builds "" "CUFLASH_MLA_EARLY_S0=0" [--rounds 3] [--batch 64 128] [--cache 4096 32768]

(run on the GPU machine from the repository root; ``--one`` is the per-process worker)."""

from __future__ import annotations

import json

import numpy as np

from _gpu_tools import ab_parser, ab_report, ab_run


def one(args) -> None:
    import cupy
    import torch

    import cuflash
    from cuflash.cli.bench_decode import _back_to_back, _timer

    timed, out_rows = _timer(torch, args.rep_ms), []
    scale, page, d, dv = 1.0 / 192 ** 0.5, 64, 576, 512
    for batch in args.batch:
        for cache in args.cache:
            g = torch.Generator(device="cuda").manual_seed(batch * 7 + cache)
            q = torch.randn(batch, args.seqlen_q, args.heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
            pages = -(-cache // page)
            pool = torch.randn(batch * pages, page, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
            table = torch.randperm(batch * pages, device="cuda", generator=g).to(torch.int32).reshape(batch, pages)
            cq, cpool, ctable = (cupy.from_dlpack(x) for x in (q, pool, table))
            lens = cupy.full(batch, cache, dtype=cupy.int32)
            vview = cpool[..., :dv]
            plan = cuflash.plan_kvcache(cq, cpool, vview, cache_seqlens=lens, block_table=ctable, softmax_scale=scale,
                                        causal=args.seqlen_q > 1)
            out = cupy.full(plan.out_shape, float("nan"), dtype=cq.dtype)
            lse = cupy.empty(plan.lse_shape, dtype=cupy.float32)

            def run():
                plan.run(cq, cpool, vview, cache_seqlens=lens, block_table=ctable, out=out, lse=lse)
            run()
            kc = pool[table.long()].reshape(batch, pages * page, d)[:, :cache].float()
            qf = q.reshape(batch, args.seqlen_q * args.heads, d).float()
            s = torch.matmul(qf, kc.transpose(1, 2)) * scale
            if args.seqlen_q > 1:
                t = torch.arange(args.seqlen_q, device="cuda").repeat_interleave(args.heads)[:, None]
                s.masked_fill_(torch.arange(cache, device="cuda")[None, :] > cache - args.seqlen_q + t, float("-inf"))
            want = torch.matmul(torch.softmax(s, -1), kc[..., :dv])
            del s, kc
            got = torch.from_dlpack(out).reshape(want.shape).float()
            err = float((got - want).abs().max())
            flops = 2.0 * batch * args.seqlen_q * args.heads * cache * (d + dv)
            per_call, b2b = timed(run), _back_to_back(torch, run)
            out_rows.append(dict(batch=batch, cache=cache, per_call=flops / per_call / 1e12,
                                 b2b=flops / b2b / 1e12, err=err, splits=plan.num_splits))
    print(json.dumps(out_rows))


def main() -> None:
    p = ab_parser(__doc__, "CUFLASH_MLA_EARLY_S0=0")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    p.add_argument("--cache", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--seqlen-q", type=int, default=1)
    p.add_argument("--rep-ms", type=float, default=40)
    args, results = ab_run(p, one, lambda rows: "; ".join(
        f"b{x['batch']} n{x['cache']} {x['per_call']:.0f}/{x['b2b']:.0f} TFLOP/s err {x['err']:.1e}" for x in rows))
    if results is None:
        return
    ab_report(results, "median TFLOP/s per call / back to back:", lambda i, rows: (
        f"b{rows[0]['batch']} n{rows[0]['cache']} q{args.seqlen_q} {np.median([r['per_call'] for r in rows]):.0f}/"
        f"{np.median([r['b2b'] for r in rows]):.0f}"))


if __name__ == "__main__":
    main()
