"""Inference on the GPU: a decode step, chunked prefill, shared-prefix (cascade) attention and MLA's absorbed decoding.

Skipped (``NotImplementedError`` in ``setup``) without CuPy or a GPU. Each benchmark checks its result in ``setup``
before timing: the decode step and MLA against attention computed in float32 with CuPy matrix products, chunked
prefill against ``cuflash.attention`` over the same keys, the cascade against the same call over a cache holding the
prefix in front of every sequence. Shapes as ``python -m cuflash bench-decode`` times them (bf16, d 128, 32 / 8
heads; MLA: 128 heads over one latent head of 576 = 512 + 64 rope dims, pages of 64). ``track_`` methods report
the bandwidth (K and V bytes read per second) or TFLOP/s, timed with CUDA events.
"""

import numpy as np

import cuflash

from .bench_gpu import _check, _cupy, _event_ms


def _bf16(cp, rng, *shape):
    import ml_dtypes

    return rng.standard_normal(shape, dtype=cp.float32).astype(ml_dtypes.bfloat16)


def _gqa_f32(cp, q, k, v, scale):
    """One query token per sequence over all keys, float32: q (b, 1, hq, d), k and v (b, n, hkv, d)."""
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    qf = q.astype(cp.float32).reshape(b, hkv, hq // hkv, d)
    s = cp.einsum("bkgd,bnkd->bkgn", qf, k.astype(cp.float32)) * scale
    p = cp.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return cp.einsum("bkgn,bnkd->bkgd", p, v.astype(cp.float32)).reshape(b, 1, hq, d)


class _Call:
    """A benchmark of one call, ``_run``: its time around a device synchronization, and (``_per_second``) the rate
    of an amount of work per call, timed with CUDA events."""

    def time_call(self, *params):
        self._run()
        self.cp.cuda.runtime.deviceSynchronize()

    def _per_second(self, amount):
        return amount / (_event_ms(self.cp, self._run) * 1e-3)


class DecodeStep(_Call):
    """One decode step (one query token per sequence) through a plan, over a contiguous cache."""

    params = ([1, 32], [4096, 32768])
    param_names = ["batch", "cache"]

    def setup(self, batch, cache):
        self.cp = cp = _cupy()
        rng = cp.random.default_rng(0)
        self.q, self.kc, self.vc = _bf16(cp, rng, batch, 1, 32, 128), _bf16(cp, rng, batch, cache, 8, 128), \
            _bf16(cp, rng, batch, cache, 8, 128)
        self.lens = cp.full(batch, cache, dtype=cp.int32)
        self.plan = cuflash.plan_kvcache(self.q, self.kc, self.vc, cache_seqlens=self.lens)
        self.out = cp.empty(self.plan.out_shape, dtype=self.q.dtype)
        self.lse = cp.empty(self.plan.lse_shape, dtype=cp.float32)
        self._run()
        _check(cp, "decode step", self.out, _gqa_f32(cp, self.q, self.kc, self.vc, 128 ** -0.5))
        self.bytes = 2 * self.kc.nbytes

    def _run(self):
        self.plan.run(self.q, self.kc, self.vc, cache_seqlens=self.lens, out=self.out, lse=self.lse)

    def track_tbs(self, *params):
        return self._per_second(self.bytes) / 1e12

    track_tbs.unit = "TB/s"


class ChunkedPrefill(_Call):
    """A chunk of new tokens appended to a cache and attended over it (the forward kernels over the cache), the
    same tokens into the same slots at every call."""

    params = ([8192], [512, 2048])
    param_names = ["cache", "new_tokens"]

    def setup(self, cache, new):
        self.cp = cp = _cupy()
        rng = cp.random.default_rng(1)
        self.q, self.k, self.v = (_bf16(cp, rng, 1, new, h, 128) for h in (32, 8, 8))
        self.kc, self.vc = _bf16(cp, rng, 1, cache + new, 8, 128), _bf16(cp, rng, 1, cache + new, 8, 128)
        self.lens = cp.full(1, cache, dtype=cp.int32)
        got = self._run()
        _check(cp, "chunked prefill", got, cuflash.attention(self.q, self.kc, self.vc, causal=True),
               "attention over the same keys")
        self.flops = 4.0 * 128 * 32 * (new * cache + new * (new + 1) / 2)

    def _run(self):
        return cuflash.attention_with_kvcache(self.q, self.kc, self.vc, self.k, self.v, cache_seqlens=self.lens,
                                              causal=True)

    def track_tflops(self, *params):
        return self._per_second(self.flops) / 1e12

    track_tflops.unit = "TFLOP/s"


class Cascade:
    """A batch of 64 decode steps sharing a prefix, read once (cascade_attention), and the unshared call."""

    params = [8192]
    param_names = ["prefix"]

    def setup(self, prefix):
        self.cp = cp = _cupy()
        rng = cp.random.default_rng(2)
        batch, suffix = 64, 512
        self.q = _bf16(cp, rng, batch, 1, 32, 128)
        self.kp, self.vp = _bf16(cp, rng, prefix, 8, 128), _bf16(cp, rng, prefix, 8, 128)
        self.ks, self.vs = _bf16(cp, rng, batch, suffix, 8, 128), _bf16(cp, rng, batch, suffix, 8, 128)
        self.lens = cp.asarray(np.random.default_rng(2).integers(1, suffix + 1, batch).astype(np.int32))
        self.kf, self.vf = (cp.concatenate([cp.broadcast_to(p[None], (batch, *p.shape)), s], axis=1)
                            for p, s in ((self.kp, self.ks), (self.vp, self.vs)))
        self.full_lens = self.lens + np.int32(prefix)
        _check(cp, "cascade", self._cascade(), self._unshared(), "the unshared call")

    def _cascade(self):
        return cuflash.cascade_attention(self.q, self.kp, self.vp, self.ks, self.vs, cache_seqlens=self.lens,
                                         causal=True)

    def _unshared(self):
        return cuflash.attention_with_kvcache(self.q, self.kf, self.vf, cache_seqlens=self.full_lens, causal=True)

    def time_cascade(self, *params):
        self._cascade()
        self.cp.cuda.runtime.deviceSynchronize()

    def time_unshared(self, *params):
        self._unshared()
        self.cp.cuda.runtime.deviceSynchronize()

    def track_speedup(self, *params):
        return _event_ms(self.cp, self._unshared) / _event_ms(self.cp, self._cascade)

    track_speedup.unit = "x"


class MLA(_Call):
    """MLA's absorbed decoding (DeepSeek-V3's shape), paged cache of 64-slot pages, V a view of the latent cache."""

    params = ([16, 128], [64])
    param_names = ["heads", "batch"]

    def setup(self, heads, batch):
        self.cp = cp = _cupy()
        rng = cp.random.default_rng(3)
        cache, page = 4096, 64
        pages = cache // page
        self.q = _bf16(cp, rng, batch, 1, heads, 576)
        self.pool = _bf16(cp, rng, batch * pages, page, 1, 576)
        self.table = cp.asarray(np.random.default_rng(3).permutation(batch * pages).astype(np.int32)
                                .reshape(batch, pages))
        self.lens = cp.full(batch, cache, dtype=cp.int32)
        self.scale = 1 / np.sqrt(192)
        self.plan = cuflash.plan_kvcache(self.q, self.pool, self.pool[..., :512], cache_seqlens=self.lens,
                                         block_table=self.table, softmax_scale=self.scale)
        self.out = cp.empty(self.plan.out_shape, dtype=self.q.dtype)
        self._run()
        latent = self.pool[self.table.reshape(-1)].reshape(batch, cache, 1, 576)
        want = _gqa_f32(cp, self.q, latent, latent, self.scale)[..., :512]
        _check(cp, "MLA", self.out, want)
        self.bytes, self.flops = latent.nbytes, 2.0 * batch * heads * cache * (576 + 512)

    def _run(self):
        self.plan.run(self.q, self.pool, self.pool[..., :512], cache_seqlens=self.lens, block_table=self.table,
                      out=self.out)

    def track_tbs(self, *params):
        return self._per_second(self.bytes) / 1e12

    track_tbs.unit = "TB/s"

    def track_tflops(self, *params):
        return self._per_second(self.flops) / 1e12

    track_tflops.unit = "TFLOP/s"
