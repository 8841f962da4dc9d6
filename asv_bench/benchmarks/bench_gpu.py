"""The CUDA kernels: forward and backward time and TFLOP/s, compile time cold and warm.

Skipped (``NotImplementedError`` in ``setup``) without CuPy or a GPU. Each benchmark checks its result
in ``setup`` against naive attention computed in float32 on the same device before timing. Time is
measured around a device synchronization (``time_``); ``track_tflops`` times with CUDA events and
reports the FlashAttention FLOP convention (forward 4·B·H·N²·d, halved when causal; backward 2.5x).
"""

import os
import subprocess
import sys
import tempfile

import cuflash

BATCH_TOKENS, HIDDEN = 16384, 2048  # the grid of ANCHORS.md: batch = 16384 / N, heads = 2048 / d
SEQLENS = [1024, 4096]
DTYPES = ["float16", "bfloat16"]
HEAD_DIMS = [64, 128]
CAUSAL = [False, True]
TOLERANCE = 2e-2  # max|cuflash - naive float32| for fp16/bf16 outputs of unit-variance inputs


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise NotImplementedError("CuPy is not installed") from exc
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise NotImplementedError("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise NotImplementedError("no CUDA device") from exc
    return cupy


def _inputs(cp, seqlen, head_dim, dtype, seed=0):
    batch, heads = BATCH_TOKENS // seqlen, HIDDEN // head_dim
    rng = cp.random.default_rng(seed)
    shape = (batch, seqlen, heads, head_dim)
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    return tuple(rng.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(4))


def _forward_flops(q, causal):
    batch, seqlen, heads, head_dim = q.shape
    return 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)


def _event_ms(cp, fn, repeat=10):
    fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeat):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / repeat


def _check(cp, name, x, truth, truth_name="naive float32"):
    err = float(cp.abs(x.astype(cp.float32) - truth.astype(cp.float32)).max())
    if not err <= TOLERANCE:
        raise AssertionError(f"{name}: max|cuflash - {truth_name}| = {err:.3g} > {TOLERANCE}")


class Forward:
    params = (SEQLENS, HEAD_DIMS, CAUSAL, DTYPES)
    param_names = ["seqlen", "head_dim", "causal", "dtype"]
    timeout = 300

    def setup(self, seqlen, head_dim, causal, dtype):
        self.cp = cp = _cupy()
        self.q, self.k, self.v, _ = _inputs(cp, seqlen, head_dim, dtype)
        out = cuflash.attention(self.q, self.k, self.v, causal=causal)
        q32, k32, v32 = (a[:1].astype(cp.float32) for a in (self.q, self.k, self.v))
        _check(cp, "out", out[:1], cuflash.attention(q32, k32, v32, causal=causal, algorithm="naive"))
        self.causal = causal

    def _run(self):
        cuflash.attention(self.q, self.k, self.v, causal=self.causal)

    def time_forward(self, *params):
        self._run()
        self.cp.cuda.runtime.deviceSynchronize()

    def track_tflops(self, *params):
        return _forward_flops(self.q, self.causal) / _event_ms(self.cp, self._run) / 1e9

    track_tflops.unit = "TFLOP/s"


class Backward:
    params = (SEQLENS, HEAD_DIMS, CAUSAL, DTYPES)
    param_names = ["seqlen", "head_dim", "causal", "dtype"]
    timeout = 300

    def setup(self, seqlen, head_dim, causal, dtype):
        self.cp = cp = _cupy()
        self.q, self.k, self.v, self.do = _inputs(cp, seqlen, head_dim, dtype)
        self.out, self.lse = cuflash.attention(self.q, self.k, self.v, causal=causal, return_lse=True)
        dq, dk, dv = cuflash.attention_backward(self.do, self.q, self.k, self.v, self.out, self.lse, causal=causal)
        one = [a[:1].astype(cp.float32) for a in (self.do, self.q, self.k, self.v)]
        out32, lse32 = cuflash.attention(*one[1:], causal=causal, return_lse=True, algorithm="naive")
        truth = cuflash.attention_backward(*one, out32, lse32, causal=causal, algorithm="naive")
        scale = max(float(self.cp.abs(t).max()) for t in truth)
        for name, x, t in zip(("dq", "dk", "dv"), (dq, dk, dv), truth):
            _check(cp, name, x[:1].astype(cp.float32) / scale, t / scale)
        self.causal = causal

    def _run(self):
        cuflash.attention_backward(self.do, self.q, self.k, self.v, self.out, self.lse, causal=self.causal)

    def time_backward(self, *params):
        self._run()
        self.cp.cuda.runtime.deviceSynchronize()

    def track_tflops(self, *params):
        return 2.5 * _forward_flops(self.q, self.causal) / _event_ms(self.cp, self._run) / 1e9

    track_tflops.unit = "TFLOP/s"


class ForwardFP8(Forward):
    """The FP8 (e4m3) forward on sm_90 (the front door's call: V^T written, the plan run), d 128 and 256; checked in
    setup against the float32 forward of the same real values to its budget (2^-4 max|V| + 2^-7 max|O|: P in e4m3,
    O in bf16). Timed as :class:`Forward` is."""

    params = (SEQLENS, [128, 256], CAUSAL)
    param_names = ["seqlen", "head_dim", "causal"]
    timeout = 300

    def setup(self, seqlen, head_dim, causal):
        import ml_dtypes
        import numpy as np

        self.cp = cp = _cupy()
        from cuflash._cuda import vt

        if not vt.supported():
            raise NotImplementedError("the FP8 forward needs sm_90")
        batch, heads = BATCH_TOKENS // seqlen, HIDDEN // head_dim
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
                for _ in range(3)]
        self.q, self.k, self.v = (cp.asarray(x.view(np.uint8)) for x in host)  # (CuPy has no e4m3 dtype: the bits)
        out = cuflash.attention(self.q, self.k, self.v, causal=causal)
        real = [cp.asarray(x[:1].astype(np.float32)) for x in host]
        truth = cuflash.attention(*real, causal=causal, fp32_precision="ieee")
        got = (out[:1].view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        err, budget = float(cp.abs(got - truth).max()), 2.0 ** -4 * float(cp.abs(real[2]).max()) + 2.0 ** -7 * float(
            cp.abs(truth).max())
        if not err <= budget:
            raise AssertionError(f"FP8 out: max|cuflash - float32| = {err:.3g} > {budget:.3g}")
        self.causal = causal


class ForwardFloat32(Forward):
    """float32 forwards on the tensor cores by ``fp32_precision``: "tf32x3" (the default, float32's accuracy) and
    "tf32" (one TF32 product; on sm_90 at d 64 and 128 the wgmma path), batch 2 and 16 heads (the float32 table's
    shape: docs/performance.md); checked in setup against naive attention in float64 on the same device (1e-4 for
    tf32x3, 1e-2 for tf32, on unit-variance inputs). Timed as :class:`Forward` is."""

    params = (SEQLENS, HEAD_DIMS, CAUSAL, ["tf32x3", "tf32"])
    param_names = ["seqlen", "head_dim", "causal", "fp32_precision"]
    timeout = 300

    def setup(self, seqlen, head_dim, causal, fp32_precision):
        self.cp = cp = _cupy()
        rng = cp.random.default_rng(0)
        self.q, self.k, self.v = (rng.standard_normal((2, seqlen, 16, head_dim), dtype=cp.float32) for _ in range(3))
        self.causal, self.precision = causal, fp32_precision
        out = self._run()
        truth = cuflash.attention(*(a[:1].astype(cp.float64) for a in (self.q, self.k, self.v)), causal=causal,
                                  algorithm="naive")
        err, tolerance = float(cp.abs(out[:1] - truth).max()), {"tf32x3": 1e-4, "tf32": 1e-2}[fp32_precision]
        if not err <= tolerance:
            raise AssertionError(f"{fp32_precision} out: max|cuflash - float64| = {err:.3g} > {tolerance}")

    def _run(self):
        return cuflash.attention(self.q, self.k, self.v, causal=self.causal, fp32_precision=self.precision)


_FIRST_CALL = """
import time, cupy as cp, cuflash
q = cp.random.standard_normal((1, 128, 2, 64), dtype=cp.float32).astype(cp.float16)
start = time.perf_counter()
out, lse = cuflash.attention(q, q, q, causal=True, return_lse=True)
cuflash.attention_backward(q, q, q, q, out, lse, causal=True)
cp.cuda.runtime.deviceSynchronize()
print(time.perf_counter() - start)
"""


class Compile:
    """Seconds to the first forward + backward result in a new process: cold (empty CuPy kernel cache:
    NVRTC compiles) and warm (CuPy's disk cache holds the kernels)."""

    timeout = 600

    def setup(self):
        _cupy()
        self.cache = tempfile.mkdtemp(prefix="cuflash-asv-cache-")

    def _first_call(self, cache):
        env = {**os.environ, "CUPY_CACHE_DIR": cache}
        result = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True,
                                check=True)
        return float(result.stdout.split()[-1])

    def track_first_call_cold(self):
        return self._first_call(tempfile.mkdtemp(prefix="cuflash-asv-cold-"))

    track_first_call_cold.unit = "s"

    def track_first_call_warm(self):
        self._first_call(self.cache)
        return self._first_call(self.cache)

    track_first_call_warm.unit = "s"


class WarmCall:
    """Host overhead of a tiny warm call (the kernels are compiled and loaded)."""

    def setup(self):
        self.cp = cp = _cupy()
        self.q = cp.random.standard_normal((1, 128, 2, 64), dtype=cp.float32).astype(cp.float16)
        cuflash.attention(self.q, self.q, self.q)
        cp.cuda.runtime.deviceSynchronize()

    def time_tiny_forward(self):
        cuflash.attention(self.q, self.q, self.q)
        self.cp.cuda.runtime.deviceSynchronize()
