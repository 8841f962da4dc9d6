"""The 16-bit backward's block order on the GPU: dK/dV kernel time for each ``interleave`` (how many (batch, head)
pairs have their key tiles interleaved, longest first; ``cuflash/_cuda/attention.py:BWD_INTERLEAVE``), dense,
causal and windowed, bf16, 16 heads x 16384 tokens, with FlexAttention's backward of the same masks in the same
process for reference (``--flex``).
Checks first that every order gives the gradients of interleave 1 (within float32 summation order).

    PYTHONPATH=. python3 tools/bwd_order.py [--interleave 1,2,4,8,16,64] [--flex] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys


def log(msg: str) -> None:
    print(msg, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interleave", default="1,2,4,8,16,64")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()

    import cupy as cp
    import torch
    import triton.testing as tt

    from cuflash import _cuda as cuda
    from cuflash._cuda import attention as att
    from cuflash._ops.variant import Variant

    sys.path.insert(0, "tools")
    from variants_check import _warm_gpu

    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream())
    orders = [int(x) for x in args.interleave.split(",")]
    rows = []
    _warm_gpu(torch)
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        fa = torch.compile(flex_attention, dynamic=False)
    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.seqlens.split(",")):
            b, hq = 16384 // n, 16
            g = torch.Generator(device="cuda").manual_seed(n + d)
            tq, tk, tv, tdo = (torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
                               for _ in range(4))
            q, k, v, do = (cp.from_dlpack(x) for x in (tq, tk, tv, tdo))
            for name, variant, pairs in (
                    ("dense", Variant(), n * n),
                    ("causal", Variant(causal=True), n * (n + 1) // 2),
                    ("causal-window-1024", Variant(causal=True, window_left=1024),
                     sum(min(i + 1, 1025) for i in range(n)))):
                opts = dict(scale=d ** -0.5, variant=variant, algorithm="fa2", block_q=None, block_k=None)
                flops = 4 * b * hq * pairs * d
                with stream:
                    o, lse = cuda.forward(q, k, v, **opts)
                ref = None
                for il in orders:
                    att.BWD_INTERLEAVE = il
                    with stream:
                        grads = cuda.backward(do, q, k, v, o, lse, order="kv_outer", **opts)
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = [x.astype(cp.float32) for x in grads]
                    err = max(float(cp.abs(x.astype(cp.float32) - r).max()) for x, r in zip(grads, ref))
                    scale_ = max(float(cp.abs(r).max()) for r in ref)

                    def bwd():
                        with stream:
                            cuda.backward(do, q, k, v, o, lse, order="kv_outer", **opts)

                    def fb():
                        with stream:
                            o2, lse2 = cuda.forward(q, k, v, **opts)
                            cuda.backward(do, q, k, v, o2, lse2, order="kv_outer", **opts)

                    tb = tt.do_bench(bwd, rep=args.rep, warmup=20)
                    tfb = tt.do_bench(fb, rep=args.rep, warmup=20)
                    ok = err <= 2e-2 * scale_
                    rows.append(dict(d=d, n=n, case=name, interleave=il, bwd_ms=tb, fb_ms=tfb, max_diff=err, ok=ok,
                                     bwd_tflops=2.5 * flops / tb * 1e-9, fb_tflops=3.5 * flops / tfb * 1e-9))
                    log(f"d {d:3d} N {n:6d} {name:20s} interleave {il:3d}  bwd {tb:7.3f} ms ({2.5 * flops / tb * 1e-9:5.1f}"
                        f" TFLOP/s)  fwd+bwd {tfb:7.3f} ms  diff to 1st {err:.2e}{'' if ok else '  MISMATCH'}")
                att.BWD_INTERLEAVE = None
                if args.flex:
                    tqf, tkf, tvf = (x.transpose(1, 2).contiguous().requires_grad_() for x in (tq, tk, tv))
                    tdof = tdo.transpose(1, 2).contiguous()
                    w = variant.window_left

                    def mask(b_, h, qi, ki, w=w):
                        return (qi >= ki) & (qi - ki <= w) if w is not None else qi >= ki

                    bm = create_block_mask(mask, b, None, n, n, device="cuda") if variant.causal else None

                    def ffb():
                        out = fa(tqf, tkf, tvf, block_mask=bm)
                        out.backward(tdof)

                    def ffwd():
                        return fa(tqf, tkf, tvf, block_mask=bm)

                    tf_ = tt.do_bench(ffwd, rep=args.rep, warmup=20)
                    tfb_ = tt.do_bench(ffb, rep=args.rep, warmup=20, grad_to_none=[tqf, tkf, tvf])
                    rows.append(dict(d=d, n=n, case=name, system="flex", fwd_ms=tf_, fb_ms=tfb_, bwd_ms=tfb_ - tf_))
                    log(f"d {d:3d} N {n:6d} {name:20s} flex         bwd ~{tfb_ - tf_:7.3f} ms  fwd+bwd {tfb_:7.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
