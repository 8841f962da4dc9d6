"""The multi-head projection chain (input -> Q, K, V -> attention -> concat -> W_O), forward and manual
backward, on NumPy (always) and CuPy (skipped without a GPU).

``setup`` checks the layer's output and input gradient against the same layer run in float64 with
naive attention before anything is timed.
"""

import numpy as np

import cuflash

from .bench_gpu import _cupy

D_MODEL, HEADS, KV_HEADS = 256, 8, 2


def _layer(xp, seqlen, dtype, batch):
    params = cuflash.init_mha_params(D_MODEL, HEADS, num_kv_heads=KV_HEADS, bias=True, dtype=dtype, rng=0, xp=xp)
    rng = np.random.default_rng(1)
    z = xp.asarray(rng.standard_normal((batch, seqlen, D_MODEL)), dtype=dtype)
    dy = xp.asarray(rng.standard_normal((batch, seqlen, D_MODEL)), dtype=dtype)
    return params, z, dy


def _to_numpy(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _check(params, z, dy, tolerance):
    """Output and dz against float64 with naive attention, relative to their largest entry."""
    options = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, causal=True)
    y, cache = cuflash.mha_forward(z, params, **options)
    dz = cuflash.mha_backward(dy, cache, params).dz
    params64 = cuflash.MHAParams(*(None if p is None else _to_numpy(p).astype(np.float64) for p in params))
    z64, dy64 = _to_numpy(z).astype(np.float64), _to_numpy(dy).astype(np.float64)
    y64, cache64 = cuflash.mha_forward(z64, params64, algorithm="naive", **options)
    dz64 = cuflash.mha_backward(dy64, cache64, params64).dz
    for name, x, truth in (("y", y, y64), ("dz", dz, dz64)):
        err = np.abs(_to_numpy(x).astype(np.float64) - truth).max() / np.abs(truth).max()
        if not err <= tolerance:
            raise AssertionError(f"{name}: relative error {err:.2e} > {tolerance:.0e}")


class NumPyLayer:
    params = [512, 2048]
    param_names = ["seqlen"]
    timeout = 300

    def setup(self, seqlen):
        self.params_, self.z, self.dy = _layer(np, seqlen, np.float32, batch=1)
        _check(self.params_, self.z, self.dy, 1e-4)

    def time_forward_backward(self, seqlen):
        y, cache = cuflash.mha_forward(self.z, self.params_, num_heads=HEADS, num_kv_heads=KV_HEADS, causal=True)
        cuflash.mha_backward(self.dy, cache, self.params_)


class CuPyLayer:
    params = [2048, 8192]
    param_names = ["seqlen"]
    timeout = 300

    def setup(self, seqlen):
        self.cp = cp = _cupy()
        self.params_, self.z, self.dy = _layer(cp, seqlen, cp.float16, batch=2)
        _check(self.params_, self.z, self.dy, 3e-2)

    def time_forward_backward(self, seqlen):
        y, cache = cuflash.mha_forward(self.z, self.params_, num_heads=HEADS, num_kv_heads=KV_HEADS, causal=True)
        cuflash.mha_backward(self.dy, cache, self.params_)
        self.cp.cuda.runtime.deviceSynchronize()
