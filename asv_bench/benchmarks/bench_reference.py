"""The NumPy reference: naive vs FA1 vs FA2, forward and backward, time and peak memory.

Every benchmark first checks its own result against float64 attention in ``setup`` (a failed check
fails the benchmark, so a wrong algorithm is never timed). The float64 truth is computed a block of
query rows at a time, so that the check itself stays small next to what ``peakmem_`` measures (asv's
peak memory is the whole process's, setup included).
"""

import math

import numpy as np

import cuflash

ALGORITHMS = ["naive", "fa1", "fa2"]
SEQLENS = [512, 2048]
BATCH, HEADS, HEAD_DIM = 1, 4, 64
DTYPE = np.float32
RTOL = 1e-4  # max|x - truth| / max|truth| for float32 inputs
ROWS_PER_CHUNK = 32


def make_inputs(seqlen, seed=0):
    rng = np.random.default_rng(seed)
    shape = (BATCH, seqlen, HEADS, HEAD_DIM)
    return tuple(rng.standard_normal(shape).astype(DTYPE) for _ in range(4))  # q, k, v, do


def truth_by_row_chunks(q, k, v, do, scale, grads=True):
    """float64 (out, dq, dk, dv) of plain attention, ROWS_PER_CHUNK query rows at a time.

    With ``grads=False`` only ``out`` is computed (the gradients are returned as None).
    """
    q, k, v, do = (np.asarray(a, dtype=np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, do))
    out, dq = np.empty_like(q), np.empty_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for r0 in range(0, q.shape[2], ROWS_PER_CHUNK):
        rows = slice(r0, r0 + ROWS_PER_CHUNK)
        s = scale * q[:, :, rows] @ k.swapaxes(-1, -2)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        o = p @ v
        out[:, :, rows] = o
        if not grads:
            continue
        dp = do[:, :, rows] @ v.swapaxes(-1, -2)
        ds = p * (dp - (do[:, :, rows] * o).sum(axis=-1, keepdims=True))
        dq[:, :, rows] = scale * ds @ k
        dk += scale * ds.swapaxes(-1, -2) @ q[:, :, rows]
        dv += p.swapaxes(-1, -2) @ do[:, :, rows]
    if not grads:
        return out.transpose(0, 2, 1, 3), None, None, None
    return tuple(a.transpose(0, 2, 1, 3) for a in (out, dq, dk, dv))


def check(name, x, truth):
    err = np.abs(np.asarray(x, dtype=np.float64) - truth).max() / np.abs(truth).max()
    if not err <= RTOL:
        raise AssertionError(f"{name}: max|x - truth| / max|truth| = {err:.2e} > {RTOL:.0e}")


class Forward:
    params = (SEQLENS, ALGORITHMS)
    param_names = ["seqlen", "algorithm"]
    timeout = 300

    def setup(self, seqlen, algorithm):
        self.q, self.k, self.v, do = make_inputs(seqlen)
        out = cuflash.attention(self.q, self.k, self.v, algorithm=algorithm)
        truth = truth_by_row_chunks(self.q, self.k, self.v, do, 1 / math.sqrt(HEAD_DIM), grads=False)
        check("out", out, truth[0])

    def time_forward(self, seqlen, algorithm):
        cuflash.attention(self.q, self.k, self.v, algorithm=algorithm)

    def peakmem_forward(self, seqlen, algorithm):
        cuflash.attention(self.q, self.k, self.v, algorithm=algorithm)


class Backward:
    params = (SEQLENS, ALGORITHMS)
    param_names = ["seqlen", "algorithm"]
    timeout = 300

    def setup(self, seqlen, algorithm):
        q, k, v, do = make_inputs(seqlen)
        out, lse = cuflash.attention(q, k, v, algorithm=algorithm, return_lse=True)
        self.args = (do, q, k, v, out, lse)
        grads = cuflash.attention_backward(*self.args, algorithm=algorithm)
        truth = truth_by_row_chunks(q, k, v, do, 1 / math.sqrt(HEAD_DIM))
        for name, x, t in zip(("dq", "dk", "dv"), grads, truth[1:]):
            check(name, x, t)

    def time_backward(self, seqlen, algorithm):
        cuflash.attention_backward(*self.args, algorithm=algorithm)

    def peakmem_backward(self, seqlen, algorithm):
        cuflash.attention_backward(*self.args, algorithm=algorithm)
