"""A NumPy model of float32 attention from fp16 tensor-core products, for issue 14's fast float32 (3xTF32's accuracy
at >= 100 TFLOP/s): each of q, k, v and P split in two fp16 parts, ``x * scale = h1 + h2`` (``scale`` a power of two
that puts max|x| at 2^14; P's is 2^14), three products per matrix product (h1 h1', h1 h2', h2 h1'). The tensor core is
modelled as it behaves on the float32 accumulator: each k16 step's products summed exactly, added to the accumulator
rounded toward zero. Variants: where the small products go (S and O each: with the large ones in one accumulator, or
in a second one whose operands carry 2^11, added at the end), O accumulated fresh per key tile and added in float32.
Prints each variant's max|error| against the float64 truth over naive float32 attention's (the tests' budget: 2).

    python tools/fp16x2_model.py        (about a minute, no GPU)
"""

from __future__ import annotations

import numpy as np


def _rz32(x):
    r = x.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r


def _mma(a, b, acc, k=16):
    """acc (float32) += a @ b by k-steps: a step's products exact, added to acc rounded toward zero."""
    acc = acc.astype(np.float64)
    for i in range(0, a.shape[-1], k):
        acc = _rz32(acc + a[..., i:i + k].astype(np.float64) @ b[i:i + k].astype(np.float64)).astype(np.float64)
    return acc.astype(np.float32)


def _split(x, scale=None, cross_scale=1.0):
    """(h1, h2, scale): x * scale = h1 + h2 / cross_scale, fp16 parts; scale puts max|x| at 2^14 unless given."""
    if scale is None:
        m = float(np.abs(x).max())
        scale = np.float32(2.0 ** (14 - np.ceil(np.log2(m)))) if m > 0 else np.float32(1)
    xs = x * scale
    h1 = xs.astype(np.float16)
    return h1, ((xs - h1.astype(np.float32)) * np.float32(cross_scale)).astype(np.float16), scale


def product(a, b, tile, separate, scale_a=None):
    """a @ b (float32) by the split: per tile of ``tile`` columns of a (the keys of P V; all of d for S) a fresh
    accumulator, added in float32; ``separate``: the small products in their own accumulator (operands times 2^11)."""
    c = 2048.0 if separate else 1.0
    a1, a2, sa = _split(a, scale_a, c)
    b1, b2, sb = _split(b, None, c)
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for j in range(0, a.shape[1], tile):
        cols = slice(j, j + tile)
        main = _mma(a1[:, cols], b1[cols], np.zeros_like(out))
        if separate:
            cross = _mma(a2[:, cols], b1[cols], _mma(a1[:, cols], b2[cols], np.zeros_like(out)))
            main = main + cross * np.float32(1 / c)
        else:
            main = _mma(a2[:, cols], b1[cols], _mma(a1[:, cols], b2[cols], main))
        out = out + main / (sa * sb)
    return out


def attention(q, k, v, *, s_separate=True, o_separate=False, key_tile=64):
    d = q.shape[1]
    s = product(q, k.T, d, s_separate) * np.float32(d ** -0.5)
    p = np.exp(s - s.max(1, keepdims=True)).astype(np.float32)
    return product(p, v, key_tile, o_separate, scale_a=np.float32(2.0 ** 14)) / p.sum(1, keepdims=True)


def main() -> None:
    rng = np.random.default_rng(0)
    cases = [(333, 64, 1.0), (333, 128, 1.0), (1024, 128, 1.0), (4096, 128, 1.0), (1024, 128, 30.0),
             (1024, 128, 1e-3)]
    variants = {"S, O one accumulator": (False, False), "S two, O one": (True, False),
                "S one, O two": (False, True), "S, O two": (True, True)}
    print("n, d, |x|: max|error| / naive float32's, per variant (budget 2)")
    print(" " * 18 + "".join(f"{name:>22}" for name in variants))
    for n, d, mag in cases:
        q, k, v = (rng.standard_normal((n, d)).astype(np.float32) * np.float32(mag) for _ in range(3))
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        s = (q64 @ k64.T) * d ** -0.5
        p = np.exp(s - s.max(1, keepdims=True))
        truth = (p @ v64) / p.sum(1, keepdims=True)
        s32 = (q @ k.T) * np.float32(d ** -0.5)
        p32 = np.exp(s32 - s32.max(1, keepdims=True))
        naive = np.abs((p32 @ v) / p32.sum(1, keepdims=True) - truth).max()
        ratios = [np.abs(attention(q, k, v, s_separate=a, o_separate=b) - truth).max() / naive
                  for a, b in variants.values()]
        print(f"{n:5d} {d:4d} {mag:7g}" + "".join(f"{r:22.2f}" for r in ratios))


if __name__ == "__main__":
    main()
