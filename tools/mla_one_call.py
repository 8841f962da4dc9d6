"""One MLA decode call on the GPU (DeepSeek-V3's shape: 128 query heads over one latent head of 576 = 512 + 64 rope
dims, a paged cache of page 64, bfloat16), run ``--calls`` times: for profilers (``ncu --kernel-name
regex:flash_decode_mla``)."""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--cache", type=int, default=4096)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--seqlen-q", type=int, default=1)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    import cupy
    import ml_dtypes

    import cuflash

    rng = np.random.default_rng(0)
    page = 64
    pages = -(-args.cache // page)
    q = cupy.asarray(rng.standard_normal((args.batch, args.seqlen_q, args.heads, 576), np.float32)
                     .astype(ml_dtypes.bfloat16))
    pool = cupy.asarray(rng.standard_normal((args.batch * pages, page, 1, 576), np.float32).astype(ml_dtypes.bfloat16))
    table = cupy.asarray(rng.permutation(args.batch * pages).astype(np.int32).reshape(args.batch, pages))
    lens = cupy.full(args.batch, args.cache, dtype=cupy.int32)
    plan = cuflash.plan_kvcache(q, pool, pool[..., :512], cache_seqlens=lens, block_table=table,
                                softmax_scale=1 / np.sqrt(192), causal=True)
    for _ in range(args.calls):
        plan.run(q, pool, pool[..., :512], cache_seqlens=lens, block_table=table)
    cupy.cuda.get_current_stream().synchronize()
    print(f"MLA batch {args.batch} cache {args.cache} heads {args.heads} q {args.seqlen_q}: {args.calls} calls, "
          f"{plan.num_splits} splits")


if __name__ == "__main__":
    main()
