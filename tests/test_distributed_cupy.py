"""cuflash.distributed_cupy: the ring of cuflash._ops.ring over an array module and a transport, without PyTorch.

On the CPU the ring runs NumPy arrays (each block the NumPy reference through cuflash.attention) with an in-process
transport, one thread per rank: outputs, lse and the gradients of every rank's shard against cuflash.attention and
cuflash.attention_backward on the full sequence, in float64. The NCCL transport (``NcclRing``) runs on GPUs:
``tests/test_distributed.py::test_cupy_ring_over_nccl`` (two GPUs).
"""

import threading

import numpy as np
import pytest

import cuflash
import cuflash.distributed_cupy as cdc


class ThreadRing:
    """Rank ``rank`` of ``world`` threads: ``start`` posts copies of the arrays for the next rank, ``wait`` takes
    the previous rank's (blocking until they are there)."""

    def __init__(self, world, rank, boxes, cond):
        self.world, self.rank, self.boxes, self.cond, self.sent = world, rank, boxes, cond, 0

    def start(self, send):
        with self.cond:
            self.boxes[(self.rank, (self.rank + 1) % self.world, self.sent)] = [t.copy() for t in send]
            self.cond.notify_all()
        received = [np.empty_like(t) for t in send]
        request = ((self.rank - 1) % self.world, self.rank, self.sent, received)
        self.sent += 1
        return [request], received

    def wait(self, requests):
        for src, dst, n, received in requests:
            with self.cond:
                self.cond.wait_for(lambda: (src, dst, n) in self.boxes, timeout=60)
                for target, value in zip(received, self.boxes.pop((src, dst, n))):
                    target[...] = value


def _run_ranks(world, fn):
    boxes, cond = {}, threading.Condition()
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = fn(ThreadRing(world, rank, boxes, cond))
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


CASES = {
    "zigzag-causal-gqa": (2, "zigzag", dict(causal=True)),
    "zigzag-causal-3-ranks": (3, "zigzag", dict(causal=True)),
    "contiguous-softcap": (2, "contiguous", dict(softcap=2.0)),
    "zigzag-causal-window": (2, "zigzag", dict(causal=True, window_size=(5, 0))),
    "zigzag-causal-documents": (2, "zigzag", dict(causal=True, cu_seqlens=[0, 7, 8, 19, 24])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ring_matches_attention_on_the_full_sequence(case):
    world, layout, kw = CASES[case]
    n = 24 if world == 2 else 36
    rng = np.random.default_rng(len(case))
    q, dout = (rng.standard_normal((2, n, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, n, 2, 8)) for _ in range(2))
    full_kw = dict(kw)
    if "cu_seqlens" in full_kw:  # the truth: the packed varlen call with the same boundaries, per batch entry
        cu = np.asarray(full_kw.pop("cu_seqlens"), dtype=np.int32)
        outs = [cuflash.attention(q[b], k[b], v[b], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                  max_seqlen_k=n, return_lse=True, **full_kw) for b in range(2)]
        out_t = np.stack([o for o, _ in outs])
        grads_t = [np.stack(g) for g in zip(*[cuflash.attention_backward(
            dout[b], q[b], k[b], v[b], outs[b][0], outs[b][1], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
            max_seqlen_k=n, **full_kw) for b in range(2)])]
    else:
        out_t, lse_t = cuflash.attention(q, k, v, return_lse=True, **full_kw)
        grads_t = cuflash.attention_backward(dout, q, k, v, out_t, lse_t, **full_kw)

    def rank_fn(ring):
        local = [cdc.shard(x, ring, layout) for x in (q, k, v)]
        out, lse = cdc.ring_attention(*local, ring, layout=layout, **kw)
        grads = cdc.ring_attention_backward(cdc.shard(dout, ring, layout), *local, out, lse, ring, layout=layout, **kw)
        return out, grads

    for rank, (out, grads) in enumerate(_run_ranks(world, rank_fn)):
        ring = type("R", (), dict(world=world, rank=rank, start=None, wait=None))()
        np.testing.assert_allclose(out, cdc.shard(out_t, ring, layout), atol=1e-12, rtol=0)
        for name, g, g_t in zip(("dq", "dk", "dv"), grads, grads_t):
            np.testing.assert_allclose(g, cdc.shard(g_t, ring, layout), atol=1e-11, rtol=0, err_msg=name)


def test_errors_name_the_argument():
    ring = type("R", (), dict(world=2, rank=0, start=None, wait=None))()
    q = np.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="layout must be one of"):
        cdc.ring_attention(q, q, q, ring, layout="ring")
    with pytest.raises(ValueError, match="q must have an even local sequence length"):
        cdc.ring_attention(q[:, :7], q[:, :7], q[:, :7], ring)
    with pytest.raises(ValueError, match="cu_seqlens must be document boundaries"):
        cdc.ring_attention(q, q, q, ring, cu_seqlens=[0, 5, 15])
    with pytest.raises(TypeError, match="comm must be a cupy.cuda.nccl.NcclCommunicator"):
        cdc.ring_attention(q, q, q, object())


# ---------------------------------------------------------------------------------------------------
# Two GPUs over NCCL (skipped without them)
# ---------------------------------------------------------------------------------------------------


def _nccl_worker(rank, world, uid, queue):
    try:
        import cupy as cp
        from cupy.cuda import nccl

        cp.cuda.Device(rank).use()
        comm = nccl.NcclCommunicator(world, uid, rank)
        rng = np.random.default_rng(0)  # the same full sequence on every rank
        dt = cp.float16
        q, dout = (cp.asarray(rng.standard_normal((2, 4096, 8, 128))).astype(dt) for _ in range(2))
        k, v = (cp.asarray(rng.standard_normal((2, 4096, 2, 128))).astype(dt) for _ in range(2))
        report = {}
        for label, layout, kw in [("zigzag-causal", "zigzag", dict(causal=True)),
                                  ("contiguous", "contiguous", {}),
                                  ("zigzag-window-softcap", "zigzag", dict(causal=True, window_size=(700, 0),
                                                                           softcap=20.0))]:
            out_t, lse_t = cuflash.attention(q, k, v, return_lse=True, **kw)
            grads_t = cuflash.attention_backward(dout, q, k, v, out_t, lse_t, deterministic=True, **kw)
            local = [cdc.shard(x, comm, layout) for x in (q, k, v)]
            side = cp.cuda.Stream(non_blocking=True)
            with side:  # on a stream of the caller's: the transfers must order against it
                out, lse = cdc.ring_attention(*local, comm, layout=layout, **kw)
                grads = cdc.ring_attention_backward(cdc.shard(dout, comm, layout), *local, out, lse, comm,
                                                    layout=layout, deterministic=True, **kw)
                full = cdc.unshard(out, comm, layout)
            side.synchronize()
            errs = {"out": float(cp.abs(full.astype(cp.float32) - out_t.astype(cp.float32)).max()),
                    "out scale": float(cp.abs(out_t.astype(cp.float32)).max())}
            for name, g, g_t in zip(("dq", "dk", "dv"), grads, grads_t):
                want = cdc.shard(g_t, comm, layout).astype(cp.float32)
                errs[name] = float(cp.abs(g.astype(cp.float32) - want).max())
                errs[name + " scale"] = float(cp.abs(want).max())
            report[label] = errs
        queue.put((rank, report))
    except Exception:  # noqa: BLE001
        import traceback

        queue.put((rank, traceback.format_exc()))


@pytest.mark.gpu
def test_cupy_ring_over_nccl():
    """Ring attention on two GPUs over cupy.cuda.nccl (fp16, 2 x 8192 tokens split in two, GQA 8/2, d 128) against
    cuflash on the whole sequence on one GPU: the output gathered back (unshard) within two float16 spacings of the
    largest value (two partial results, each rounded to float16, merged in float32 and rounded again, where the
    one-GPU kernel rounds once) and every rank's dq, dk, dv within three (one more rounding: each block's gradient
    reaches the float32 accumulator in float16)."""
    cp = pytest.importorskip("cupy")
    try:
        from cupy.cuda import nccl
        if cp.cuda.runtime.getDeviceCount() < 2 or not nccl.available:
            pytest.skip("needs 2 CUDA devices and NCCL")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs 2 CUDA devices and NCCL: {exc}")
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    uid = nccl.get_unique_id()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 2, uid, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, report in sorted(results.items()):
        assert isinstance(report, dict), f"rank {rank}:\n{report}"
        for label, errs in report.items():
            for name in ("out", "dq", "dk", "dv"):
                spacings = 2 if name == "out" else 3  # each block's gradient is rounded to float16 before the sum
                bound = spacings * float(np.spacing(np.float16(errs[name + " scale"])))
                assert errs[name] <= bound, (rank, label, name, errs)
