"""The front door's memory of checked CuPy calls (cuflash._ops.api.CallMemo) and the launch plans it keeps, on the CPU:
a stand-in CuPy (tests/_fake_cupy.py) records what each call would launch, with its arguments' bytes.

A remembered call must launch exactly what a fresh call (memory emptied) launches, for every signature, whichever
signatures came before; a bad call after a good one must raise the same error as without the memory; checks of
array values (cu_seqlens, seqused_k, check_finite) run at every call; the memory is bounded and keeps no array or
BlockMask alive.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._ops import api as _api, kvcache as _kvcache
from cuflash._cuda.spec import EXTRA_PARAMS_DTYPE, VARIANT_PARAMS_DTYPE

from _fake_cupy import install
from conftest import gpu_skip_reason


@pytest.fixture
def fake(monkeypatch):
    gpu_skip_reason()  # (decided before the stand-in is in sys.modules)
    return install(monkeypatch)


def _normalized(launches, result):
    """The planned launches with the outputs' addresses named (they are new at every call). (CuPy launches, which
    build block lists, are left out: whether a call builds them depends on what was built before.)"""
    out, lse = result
    names = {out.data.ptr: "out", lse.data.ptr: "lse"}
    normal = []
    for launch in launches:
        if len(launch) == 3:
            continue
        name, grid, block, smem, stream, args = launch
        args = [names.get(int.from_bytes(a, "little"), a) if len(a) == 8 else a for a in args]
        if len(args[-1]) == VARIANT_PARAMS_DTYPE.itemsize:  # VariantParams: its ExtraParams by content
            params = np.frombuffer(args[-1], VARIANT_PARAMS_DTYPE)[0]
            extra = None
            if params["extra"]:
                extra = np.frombuffer(ctypes.string_at(int(params["extra"]), EXTRA_PARAMS_DTYPE.itemsize),
                                      EXTRA_PARAMS_DTYPE).copy()
                extra["tile_count"] = extra["tile_list"] = 0  # (lists built at every call: new arrays)
                extra = extra.tobytes()
            args[-1] = (args[-1][:72], extra)
        normal.append((name, grid, block, smem, stream, args))
    return normal


def _signatures(cp):
    rng = np.random.default_rng(0)

    def array(shape, dtype=np.float16):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    b, n, h, d = 2, 96, 4, 64
    q, k, v = (array((b, n, h, d)) for _ in range(3))
    kg, vg = array((b, n, 2, d)), array((b, n, 2, d))
    qt = array((b, h, n, d)).transpose(0, 2, 1, 3)  # (b, n, h, d) with the heads outer: other strides
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    qb, kb, vb = (a.astype(ml_dtypes.bfloat16) for a in (q, k, v))
    q1, k1, v1 = (array((1, n, h, d)) for _ in range(3))
    doc = cp.asarray(np.repeat(np.arange(4), n // 4).astype(np.int32))
    mask = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})
    slopes = cp.asarray(np.linspace(0.1, 0.5, h).astype(np.float32))
    cu = cp.asarray(np.array([0, 50, 96, 96 + 70, 2 * n], np.int32))
    packed = [a.reshape(b * n, h, d) for a in (q, k, v)]
    used = cp.asarray(np.array([40, 96], np.int32))
    return {
        "causal": lambda: cuflash.attention(q, k, v, causal=True, return_lse=True),
        "dense": lambda: cuflash.attention(q, k, v, return_lse=True),
        "scale 0.5": lambda: cuflash.attention(q, k, v, causal=True, softmax_scale=0.5, return_lse=True),
        "scale 0.25": lambda: cuflash.attention(q, k, v, causal=True, softmax_scale=0.25, return_lse=True),
        "scale int 1": lambda: cuflash.attention(q, k, v, causal=True, softmax_scale=1, return_lse=True),
        "top-left": lambda: cuflash.attention(q, k, v, causal=True, causal_align="top-left", return_lse=True),
        "window softcap": lambda: cuflash.attention(q, k, v, causal=True, window_size=(8, 0), softcap=30.0,
                                                    return_lse=True),
        "window 8 8": lambda: cuflash.attention(q, k, v, window_size=(8, 8), return_lse=True),
        "softcap 20": lambda: cuflash.attention(q, k, v, causal=True, window_size=(8, 0), softcap=20.0,
                                                return_lse=True),
        "gqa": lambda: cuflash.attention(q, kg, vg, causal=True, return_lse=True),
        "strides": lambda: cuflash.attention(qt, k, v, causal=True, return_lse=True),
        "batch 1": lambda: cuflash.attention(q1, k1, v1, causal=True, return_lse=True),
        "float32": lambda: cuflash.attention(q32, k32, v32, causal=True, return_lse=True),
        "bfloat16": lambda: cuflash.attention(qb, kb, vb, causal=True, return_lse=True),
        "tiles 64": lambda: cuflash.attention(q, k, v, causal=True, block_q=64, block_k=64, return_lse=True),
        "alibi": lambda: cuflash.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True),
        "dropout seed 1": lambda: cuflash.attention(q, k, v, dropout_p=0.1, dropout_seed=1, return_lse=True),
        "dropout seed 2": lambda: cuflash.attention(q, k, v, dropout_p=0.1, dropout_seed=2, return_lse=True),
        "score_mod": lambda: cuflash.attention(q, k, v, causal=True, score_mod="score * 0.5f", return_lse=True),
        "BlockMask": lambda: cuflash.attention(q, k, v, causal=True, mask_mod=mask, return_lse=True),
        "BlockMask 64": lambda: cuflash.attention(q, k, v, causal=True, mask_mod=mask, block_q=64, block_k=64,
                                                  return_lse=True),
        "mask_mod array": lambda: cuflash.attention(q, k, v, mask_mod="doc[q_idx] == doc[kv_idx]",
                                                    mod_arrays={"doc": doc}, return_lse=True),
        "mask_mod shape": lambda: cuflash.attention(q, k, v, mask_mod="kv_idx <= q_idx + 3", return_lse=True),
        "varlen": lambda: cuflash.attention(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=96,
                                            max_seqlen_k=96, causal=True, return_lse=True),
        "varlen max 100": lambda: cuflash.attention(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100,
                                                    max_seqlen_k=100, causal=True, return_lse=True),
        "seqused_k": lambda: cuflash.attention(q, k, v, seqused_k=used, return_lse=True),
    }


def test_a_remembered_call_launches_what_a_fresh_call_launches(fake):
    cp, recorder = fake
    signatures = _signatures(cp)
    fresh = {}
    for name, call in signatures.items():
        _api._checked_calls.clear()
        recorder.take()
        result = call()
        fresh[name] = _normalized(recorder.take(), result)
        assert fresh[name], name
    _api._checked_calls.clear()
    for call in signatures.values():  # every signature remembered, in one memory
        call()
    remembered = len(_api._checked_calls)
    assert remembered == len(signatures)
    for name, call in reversed(signatures.items()):
        recorder.take()
        result = call()
        launches = recorder.take()
        assert _normalized(launches, result) == fresh[name], name
        if name == "mask_mod array":  # its arrays may have changed in place: its block lists are built again
            assert any(len(launch) == 3 for launch in launches)
    assert len(_api._checked_calls) == remembered  # (every call above was a remembered one)


def test_a_call_without_lse_writes_it_into_a_buffer_of_the_stream(fake):
    cp, recorder = fake
    from cuflash._cuda import attention

    q = cp.zeros((2, 64, 4, 64), np.float16)
    for _ in range(2):  # planned, then remembered
        result = cuflash.attention(q, q, q, causal=True, return_lse=True)
        with_lse = _normalized(recorder.take(), result)
    for _ in range(2):
        out = cuflash.attention(q, q, q, causal=True)
        sink = attention._LSE_SINKS.buffer((0, 0))
        assert _normalized(recorder.take(), (out, sink)) == with_lse
        assert sink.size == 2 * 4 * 64
    big = cp.zeros((2, 128, 4, 64), np.float16)
    cuflash.attention(big, big, big, causal=True)
    cuflash.attention(q, q, q, causal=True)
    assert attention._LSE_SINKS.buffer((0, 0)).size == 2 * 4 * 128  # (grown for the larger call, kept for the smaller)
    assert len(attention._LSE_SINKS) == 1


def _error(call):
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value)


def _assert_errors_unchanged_by_the_memory(goods_and_bads):
    """Each bad call raises the same error after its good call was remembered as with an empty memory."""
    for good, bads in goods_and_bads:
        for bad in bads:
            _api._checked_calls.clear()
            without = _error(bad)
            good()
            good()  # (remembered)
            assert _error(bad) == without


def test_bad_calls_after_a_good_one_raise_what_they_raise_without_the_memory(fake):
    cp, _ = fake
    rng = np.random.default_rng(1)
    q, k, v = (cp.asarray(rng.standard_normal((2, 64, 4, 64)).astype(np.float16)) for _ in range(3))
    packed = [a.reshape(128, 4, 64) for a in (q, k, v)]
    good_cu = cp.asarray(np.array([0, 64, 128], np.int32))
    bad_cu = cp.asarray(np.array([0, 100, 64], np.int32))
    used = cp.asarray(np.array([10, 64], np.int32))
    nan_q = q.copy()
    nan_q[0, 3, 1, 5] = np.nan
    goods_and_bads = [
        (lambda: cuflash.attention(q, k, v, causal=True), [
            lambda: cuflash.attention(q, k.astype(np.float32), v, causal=True),
            lambda: cuflash.attention(q, k, v, causal=1),
            lambda: cuflash.attention(q, k, v, causal=True, window_size=(True, -1)),
            lambda: cuflash.attention(q, k, v, causal=True, softmax_scale=float("nan")),
            lambda: cuflash.attention(q, k, v, causal=True, softcap=True),
            lambda: cuflash.attention(q, k[:, :, :3], v[:, :, :3], causal=True),
            lambda: cuflash.attention(q, k, np.asarray(v), causal=True),
            lambda: cuflash.attention(nan_q, k, v, causal=True, check_finite=True),
        ]),
        (lambda: cuflash.attention(*packed, cu_seqlens_q=good_cu, cu_seqlens_k=good_cu, max_seqlen_q=64,
                                   max_seqlen_k=64), [
            lambda: cuflash.attention(*packed, cu_seqlens_q=bad_cu, cu_seqlens_k=good_cu, max_seqlen_q=64,
                                      max_seqlen_k=64),
            lambda: cuflash.attention(*packed, cu_seqlens_q=good_cu, cu_seqlens_k=good_cu, max_seqlen_q=32,
                                      max_seqlen_k=64),
        ]),
        (lambda: cuflash.attention(q, k, v, seqused_k=used), [
            lambda: cuflash.attention(q, k, v, seqused_k=cp.asarray(np.array([10, 65], np.int32))),
        ]),
    ]
    _assert_errors_unchanged_by_the_memory(goods_and_bads)
    # Options of other types than the remembered call's, but valid: checked (not remembered), and run.
    cuflash.attention(q, k, v, causal=np.bool_(True), window_size=[4, 0], softcap=np.float32(30.0))


def test_value_checks_run_at_every_remembered_call(fake):
    cp, _ = fake
    q, k, v = (cp.zeros((128, 2, 64), np.float16) for _ in range(3))
    cu = cp.asarray(np.array([0, 64, 128], np.int32))
    cuflash.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64)
    cu[1] = 200  # in place: the same array, the same key
    with pytest.raises(ValueError, match="non-decreasing"):
        cuflash.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64)
    q4 = q.reshape(2, 64, 2, 64)
    cuflash.attention(q4, q4, q4, check_finite=True)
    q4[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"q must be finite; got inf at q\[0, 0, 0, 0\]"):
        cuflash.attention(q4, q4, q4, check_finite=True)


def test_the_memory_is_bounded_and_keeps_no_array_alive(fake, monkeypatch):
    cp, _ = fake
    monkeypatch.setattr(_api, "_checked_calls", _api.CallMemo(4))
    q = cp.zeros((1, 64, 2, 64), np.float16)
    for scale in np.linspace(0.1, 1.0, 10):
        cuflash.attention(q, q, q, softmax_scale=float(scale))
    assert len(_api._checked_calls) == 4
    doc = cp.zeros(64, np.int32)
    mask = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})
    k = cp.zeros((1, 64, 2, 64), np.float16)
    cuflash.attention(q, k, k, mask_mod=mask)
    cuflash.attention(q, k, k, mask_mod=mask)
    refs = [weakref.ref(a) for a in (mask, doc, k)]
    del mask, doc, k
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_new_blockmask_is_not_taken_for_a_remembered_one(fake):
    cp, recorder = fake
    q = cp.zeros((1, 64, 2, 64), np.float16)
    doc = cp.zeros(64, np.int32)
    first = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})
    cuflash.attention(q, q, q, mask_mod=first)
    second = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})
    cuflash.attention(q, q, q, mask_mod=second)
    assert first.lists and second.lists  # each built its own lists, in its own store
    first.clear()
    recorder.take()
    cuflash.attention(q, q, q, mask_mod=first)  # remembered, its lists cleared: built again
    assert first.lists
    assert any(len(launch) == 3 for launch in recorder.take())


def test_a_remembered_backward_launches_what_a_fresh_one_launches(fake):
    cp, recorder = fake
    rng = np.random.default_rng(2)
    q, k, v, do = (cp.asarray(rng.standard_normal((2, 64, 4, 64)).astype(np.float16)) for _ in range(4))
    kg, vg = k[:, :, :2].copy(), v[:, :, :2].copy()
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    q32, k32, v32, do32, out32 = (a.astype(np.float32) for a in (q, k, v, do, out))
    signatures = {
        "causal": lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True),
        "scale": lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True, softmax_scale=0.3),
        "window softcap": lambda: cuflash.attention_backward(do, q, k, v, out, lse, window_size=(8, 0), softcap=20.0),
        "gqa": lambda: cuflash.attention_backward(do, q, kg, vg, out, lse, causal=True),
        "deterministic": lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True),
        "float32": lambda: cuflash.attention_backward(do32, q32, k32, v32, out32, lse, causal=True),
    }

    def launched(call):
        recorder.take()
        grads = call()
        names = {id(g): name for g, name in zip(grads, ("dq", "dk", "dv"))}
        return [(launch[0], launch[1], [names.get(id(a), a.tobytes() if isinstance(a, np.generic) else
                                              (a.shape, a.strides) if hasattr(a, "shape") else a)
                                        for a in launch[2]]) for launch in recorder.take()]

    fresh = {}
    for name, call in signatures.items():
        _api._checked_calls.clear()
        fresh[name] = launched(call)
        assert fresh[name], name
    for call in signatures.values():
        call()
    remembered = len(_api._checked_calls)
    assert remembered == len(signatures)
    for name, call in reversed(signatures.items()):
        assert launched(call) == fresh[name], name
    assert len(_api._checked_calls) == remembered
    with pytest.raises(ValueError, match=r"do must have the shape of q"):
        cuflash.attention_backward(do[:, :32], q, k, v, out, lse, causal=True)


def _backward_launches(launches, grads, inputs):
    """The backward's launches, planned (packed bytes) or through CuPy (array and scalar arguments), in one form:
    ``(kernel name, grid, [each argument's 8-byte-padded bytes])`` with the arrays' addresses named (the inputs and
    gradients by name, other buffers, the workspaces, by order of first appearance) and each VariantParams'
    ExtraParams by content (its new buffers, dbias and the block lists, zeroed). Block-list launches are left out."""
    names = {a.data.ptr: name for name, a in inputs.items() if a is not None}
    names.update((g.data.ptr, name) for g, name in zip(grads, ("dq", "dk", "dv", "dbias")))
    workspaces = {}

    def name_of(value: bytes):
        ptr = int.from_bytes(value, "little")
        if ptr in names:
            return names[ptr]
        # An address (host memory stands in for the device's, which may lie below 4 GiB): any value of 1 MiB and
        # more (this test's sizes and strides are far below)
        if ptr >= 1 << 20:
            return workspaces.setdefault(ptr, f"workspace {len(workspaces)}")
        return value

    normal = []
    for launch in launches:
        if len(launch) == 3:  # through CuPy: (spec name, grid, args)
            name, grid, args = launch
            args = [np.uint64(a.data.ptr).tobytes() if hasattr(a, "data") and hasattr(a.data, "ptr") else
                    np.asarray(a).tobytes() for a in args]
            args = [a + bytes(-len(a) % 8) for a in args]
        else:
            name, grid, _, _, _, args = launch
        if "block_" in name:
            continue
        args = [name_of(a) if len(a) == 8 else a for a in args]
        if len(args[-1]) == VARIANT_PARAMS_DTYPE.itemsize:
            params = np.frombuffer(args[-1], VARIANT_PARAMS_DTYPE)[0].copy()
            extra = None
            if params["extra"]:
                extra = np.frombuffer(ctypes.string_at(int(params["extra"]), EXTRA_PARAMS_DTYPE.itemsize),
                                      EXTRA_PARAMS_DTYPE).copy()
                extra["tile_count"] = extra["tile_list"] = extra["dbias"] = 0
                extra = extra.tobytes()
            pointers = [name_of(params[field].tobytes()) for field in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                                                                        "alibi_slopes")]
            params["extra"] = params["cu_seqlens_q"] = params["cu_seqlens_k"] = params["seqused_k"] = 0
            params["alibi_slopes"] = 0
            args[-1] = (params.tobytes(), pointers, extra)
        normal.append((name, tuple(int(g) for g in grid), args))
    return normal, {ptr: name for ptr, name in [*names.items(), *workspaces.items()]}


def _zeroed_by_d(launches):
    """``(address, bytes)`` that D's 16-bit launches zero (their last two arguments: a float4 pointer and a count)."""
    out = []
    for launch in launches:
        if "flash_bwd_preprocess_kernel" not in launch[0]:
            continue
        ptr, count = launch[-1][-2:]
        if isinstance(ptr, bytes):
            ptr = int.from_bytes(ptr, "little")
        else:
            ptr = ptr.data.ptr if hasattr(ptr, "data") and hasattr(ptr.data, "ptr") else int(ptr)
        count = int.from_bytes(count, "little") if isinstance(count, bytes) else int(count)
        if ptr and count:
            out.append((ptr, 16 * count))
    return out


def _zeroed(zeroed, names):
    """The named buffers that start in zeroed memory, with the bytes zeroed from their start."""
    return {names[ptr]: start + size - ptr for ptr in names for start, size in zeroed if start <= ptr < start + size}


def _backward_signatures(cp):
    """name -> (the backward call, its inputs by name, whether the front door packs its launches)."""
    rng = np.random.default_rng(3)

    def array(shape, dtype=np.float16):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    b, n, h, d = 2, 96, 4, 64
    q, k, v, do = (array((b, n, h, d)) for _ in range(4))
    out, lse = array((b, n, h, d)), array((b, h, n), np.float32)
    kg, vg = array((b, n, 2, d)), array((b, n, 2, d))
    qt = array((b, h, n, d)).transpose(0, 2, 1, 3)
    qb, kb, vb, dob, outb = (a.astype(ml_dtypes.bfloat16) for a in (q, k, v, do, out))
    q32, k32, v32, do32, out32 = (a.astype(np.float32) for a in (q, k, v, do, out))
    q80, k80, v80, do80, out80 = (array((b, n, h, 80)) for _ in range(5))
    q200, k200, v200, do200, out200 = (array((1, 32, 2, 200)) for _ in range(5))
    lse200 = array((1, 2, 32), np.float32)
    doc = cp.asarray(np.repeat(np.arange(4), n // 4).astype(np.int32))
    mask = cuflash.BlockMask("doc[q_idx] == doc[kv_idx]", {"doc": doc})
    slopes = cp.asarray(np.linspace(0.1, 0.5, h).astype(np.float32))
    cu = cp.asarray(np.array([0, 50, 96, 96 + 70, 2 * n], np.int32))
    packed = [a.reshape(b * n, h, d) for a in (do, q, k, v, out)]
    lse_packed = array((h, b * n), np.float32)
    used = cp.asarray(np.array([40, 96], np.int32))
    bias = array((h, n, n), np.float32)
    base = {"q": q, "k": k, "v": v, "do": do, "out": out, "lse": lse}

    def call(inputs=base, packs=True, **options):
        x = {**base, **inputs}
        return (lambda: cuflash.attention_backward(x["do"], x["q"], x["k"], x["v"], x["out"], x["lse"], **options),
                x, packs)

    return {
        "dense": call(),
        "causal": call(causal=True),
        "scale": call(causal=True, softmax_scale=0.3),
        "gqa": call({"k": kg, "v": vg}, causal=True),
        "gqa split": call({"k": kg, "v": vg}, causal=True, deterministic=True),
        "split": call(causal=True, order="split"),
        "strides": call({"q": qt}, causal=True),
        "bfloat16": call({"q": qb, "k": kb, "v": vb, "do": dob, "out": outb}, causal=True),
        "window softcap alibi": call(window_size=(8, 0), softcap=20.0, alibi_slopes=slopes),
        "dropout": call(dropout_p=0.1, dropout_seed=7),
        "dropout split": call(dropout_p=0.1, dropout_seed=7, deterministic=True),
        "score_mod": call(causal=True, score_mod="score * 0.5f"),
        "BlockMask": call(causal=True, mask_mod=mask),
        "BlockMask split": call(causal=True, mask_mod=mask, deterministic=True),
        "mask_mod array": call(mask_mod="doc[q_idx] == doc[kv_idx]", mod_arrays={"doc": doc}),
        "varlen": call(dict(zip(("do", "q", "k", "v", "out"), packed), lse=lse_packed), cu_seqlens_q=cu,
                       cu_seqlens_k=cu, max_seqlen_q=96, max_seqlen_k=96, causal=True),
        "seqused_k": call(seqused_k=used),
        "seqused_k gqa": call({"k": kg, "v": vg}, seqused_k=used),
        "head dim 80": call({"q": q80, "k": k80, "v": v80, "do": do80, "out": out80}, causal=True),
        "head dim 200": call({"q": q200, "k": k200, "v": v200, "do": do200, "out": out200, "lse": lse200},
                             causal=True),  # (read in place by the d 256 kernels)
        "float32": call({"q": q32, "k": k32, "v": v32, "do": do32, "out": out32}, False, causal=True),
        "fa1": call({}, False, causal=True, algorithm="fa1"),
        "bias dbias": call({}, False, bias=bias),
        "bias no dbias": call({}, False, bias=bias, return_dbias=False),
    }


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (the upcast paths cast uninitialized memory)
def test_a_planned_backward_launches_what_the_unplanned_backward_launches(fake, monkeypatch):
    cp, recorder = fake
    from cuflash import _cuda
    from cuflash._cuda.attention import BackwardPlan

    recorder.keep_zeroed = True  # (else a result copied after the call's zeroing may reuse zeroed memory: see Recorder)
    signatures = _backward_signatures(cp)

    def launched(call, inputs):
        recorder.take()
        recorder.take_zeroed()
        grads = call()
        launches = recorder.take()
        normal, names = _backward_launches(launches, grads, inputs)
        return normal, _zeroed(recorder.take_zeroed() + _zeroed_by_d(launches), names), launches

    unplanned = {}
    with monkeypatch.context() as m:
        m.setattr(_cuda, "plan_backward", lambda *args, **kwargs: None)
        for name, (call, inputs, _) in signatures.items():
            unplanned[name] = launched(call, inputs)[:2]
            assert unplanned[name][0], name
            assert not len(_api._checked_calls), name
    for name, (call, inputs, packs) in signatures.items():  # the first call (plans), then a remembered one
        for _ in range(2):
            normal, zeroed, launches = launched(call, inputs)
            assert normal == unplanned[name][0], name
            # What starts zeroed (the float32 dQ accumulator; dK, dV and GQA's accumulator with seqused_k): zeroed,
            # from its start over at least its size (D, also in the planned workspace, is not).
            assert zeroed.keys() == unplanned[name][1].keys(), name
            assert all(zeroed[buffer] >= size for buffer, size in unplanned[name][1].items()), name
            if packs:
                assert all(len(launch) == 6 for launch in launches if "block_" not in launch[0]), name
    plans = [type(entry.plan) for entry in _api._checked_calls._entries.values()]
    assert plans.count(BackwardPlan) == sum(packs for _, _, packs in signatures.values())
    assert len(plans) == len(signatures) - 2  # (a bias is never remembered)


def test_bad_backward_calls_after_a_good_one_raise_what_they_raise_without_the_memory(fake):
    cp, _ = fake
    rng = np.random.default_rng(4)
    q, k, v, do, out = (cp.asarray(rng.standard_normal((2, 64, 4, 64)).astype(np.float16)) for _ in range(5))
    lse = cp.asarray(rng.standard_normal((2, 4, 64)).astype(np.float32))
    nan_do = do.copy()
    nan_do[1, 2, 3, 4] = np.nan
    packed = [a.reshape(128, 4, 64) for a in (do, q, k, v, out)]
    lse_packed = lse.reshape(4, 128)
    good_cu = cp.asarray(np.array([0, 64, 128], np.int32))
    bad_cu = cp.asarray(np.array([0, 100, 64], np.int32))
    goods_and_bads = [
        (lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True), [
            lambda: cuflash.attention_backward(do[:, :32], q, k, v, out, lse, causal=True),
            lambda: cuflash.attention_backward(do, q, k, v, out[:, :32], lse, causal=True),
            lambda: cuflash.attention_backward(do, q, k, v, out, lse[:, :2], causal=True),
            lambda: cuflash.attention_backward(do, q, k, v, out, lse.astype(np.float16), causal=True),
            lambda: cuflash.attention_backward(do, q, k.astype(np.float32), v, out, lse, causal=True),
            lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=1),
            lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True, order="sideways"),
            lambda: cuflash.attention_backward(do, q, k, v, out, np.asarray(lse), causal=True),
            lambda: cuflash.attention_backward(nan_do, q, k, v, out, lse, causal=True, check_finite=True),
        ]),
        (lambda: cuflash.attention_backward(*packed, lse_packed, cu_seqlens_q=good_cu, cu_seqlens_k=good_cu,
                                            max_seqlen_q=64, max_seqlen_k=64), [
            lambda: cuflash.attention_backward(*packed, lse_packed, cu_seqlens_q=bad_cu, cu_seqlens_k=good_cu,
                                               max_seqlen_q=64, max_seqlen_k=64),
        ]),
    ]
    _assert_errors_unchanged_by_the_memory(goods_and_bads)


# ---------------------------------------------------------------------------------------------------
# Decode calls over a cache that grows (a transformers DynamicCache: a new, longer tensor at every step)
# ---------------------------------------------------------------------------------------------------

def _decode_step(launches, batch):
    """A decode call's launches as comparable values: the kernel, its grid, block and shared memory, and its
    DecodeParams record with the addresses taken out (the outputs are new at every call; the workspace is the
    launch's), the lengths it reads by value, and with more than one split whether the workspace addresses are set
    (with one, the kernel reads none of them)."""
    from cuflash._cuda.decode import _POINTERS, DECODE_PARAMS_DTYPE

    steps = []
    for name, grid, block, smem, stream, (record,) in launches:
        r = np.frombuffer(record, DECODE_PARAMS_DTYPE)[0].copy()
        lens = np.frombuffer(ctypes.string_at(int(r["cache_seqlens"]), 4 * batch), np.int32).tolist()
        workspace = r["num_splits"] > 1 and all(r[f] for f in ("o_part", "lse_part", "split_count"))
        for field in _POINTERS:
            r[field] = 0
        steps.append((name, grid, block, smem, r.item(), lens, workspace))  # (its fields: padding bytes are any)
    return steps


def _growing_calls(cp):
    """Decode calls whose caches grow (and shrink, as a new generate call's), by name: (batch, query heads,
    key/value heads, head dim, arguments, the slot counts of the steps). The caches are transposed views of new
    (batch, heads, slots, d) arrays, as transformers hands them over."""
    rng = np.random.default_rng(70)
    leftpad = cp.asarray(np.array([0, 3], np.int32))
    slots = [1, 2, 63, 64, 65, 127, 128, 129, 700, 5000, 5001, 90, 4096]
    return {
        "gqa causal int lengths": (1, 16, 4, 128, dict(causal=True), slots),
        "window softcap scale": (2, 8, 2, 64, dict(causal=True, window_size=(100, 0), softcap=30.0,
                                                   softmax_scale=0.3), slots),
        "leftpad array lengths": (2, 8, 8, 64, dict(causal=True, cache_leftpad=leftpad, lengths="array"), slots[3:]),
        "splits 3": (1, 4, 1, 32, dict(num_splits=3), slots),
        "mha not causal": (1, 4, 4, 96, dict(), slots),
    }, rng


def _growing_call(cp, rng, batch, hq, hkv, d, options, n):
    options = dict(options)
    q = cp.asarray(rng.standard_normal((batch, hq, 1, d)).astype(np.float16)).transpose(0, 2, 1, 3)
    k, v = (cp.asarray(rng.standard_normal((batch, hkv, n, d)).astype(np.float16)).transpose(0, 2, 1, 3)
            for _ in range(2))
    lengths = n
    if options.pop("lengths", None) == "array":
        lengths = cp.asarray(np.full(batch, n, np.int32))
    return lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, **options)


def test_a_growing_cache_launches_what_fresh_calls_launch(fake, monkeypatch):
    """A decode call over a cache of a new slot count (new strides too) reuses the launch of the call before (one
    memory entry, no checks, no new workspace but where a larger split count needs one) and launches exactly what a
    call with every memory emptied launches: the same kernel, grid and record (slot count, strides, window edges,
    split count), lengths and workspace."""
    cp, recorder = fake
    from cuflash._cuda import decode

    calls, rng = _growing_calls(cp)
    checked = []
    real_check = _api._kvcache_call
    monkeypatch.setattr(_api, "_kvcache_call", lambda *a, **k: checked.append(1) or real_check(*a, **k))
    for name, (batch, hq, hkv, d, options, slots) in calls.items():
        fresh = []
        for n in slots:
            _api._kvcache_launches.clear()
            decode._LAUNCHES.clear()
            recorder.take()
            _growing_call(cp, rng, batch, hq, hkv, d, options, n)()
            fresh.append(_decode_step(recorder.take(), batch))
        _api._kvcache_launches.clear()
        decode._LAUNCHES.clear()
        checked.clear()
        for n, want in zip(slots, fresh):
            recorder.take()
            _growing_call(cp, rng, batch, hq, hkv, d, options, n)()
            assert _decode_step(recorder.take(), batch) == want, (name, n)
        assert len(checked) == 1 and len(_api._kvcache_launches) == 1, name  # checked once, one launch
        assert not decode._LAUNCHES, name
        assert any(step[0][1][1] > 1 for step in fresh), name  # (the steps crossed split counts)


def test_a_growing_cache_call_the_remembered_launch_cannot_take_is_checked(fake):
    """What the growing key leaves out (the slot count, the strides, an int cache_seqlens's value) is checked at each
    call: a call it does not fit raises what it raises with the memory emptied."""
    cp, _ = fake
    q = cp.zeros((1, 1, 8, 64), np.float16)

    def cache(n, heads=2, d=64, order=(0, 2, 1, 3)):
        return cp.zeros((1, heads, n, d), np.float16).transpose(*order)

    good = cache(40)
    cuflash.attention_with_kvcache(q, good, good, cache_seqlens=40, causal=True)
    odd = cp.zeros((1, 2, 41, 65), np.float16)[..., :64].transpose(0, 2, 1, 3)  # rows of 130 bytes
    cases = [
        ((q, cache(40), cache(40)), dict(cache_seqlens=41), ValueError, r"cache_seqlens\[b\] \+ seqlen_new must fit"),
        ((q, cache(40), cache(40)), dict(cache_seqlens=-1), ValueError, "cache_seqlens must be >= 0"),
        ((q, cache(40), cache(41)), dict(cache_seqlens=40), ValueError, "k_cache and v_cache must have the same shape"),
        ((q, odd, odd), dict(cache_seqlens=41), NotImplementedError, "16-byte rows"),
    ]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            cuflash.attention_with_kvcache(*args, causal=True, **kwargs)
        _api._kvcache_launches.clear()
        with pytest.raises(error, match=match):
            cuflash.attention_with_kvcache(*args, causal=True, **kwargs)
        cuflash.attention_with_kvcache(q, good, good, cache_seqlens=40, causal=True)


def test_the_layers_of_a_step_share_the_lengths_of_an_int_cache_seqlens(fake):
    """An int cache_seqlens becomes a row of a kept int32 table per (device, batch), shared by the calls that use
    it (the layers of a decode step), not one allocated and filled per call; never during a CUDA graph capture,
    where a table grown later could free the row the graph reads, and one made inside holds its rows only in the
    graph's replays."""
    cp, recorder = fake
    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE

    q = cp.zeros((1, 1, 8, 64), np.float16)
    caches = [cp.zeros((1, 2, 40, 64), np.float16).transpose(0, 2, 1, 3) for _ in range(3)]

    def lengths_address():
        (*_, (record,)), = recorder.take()
        return int(np.frombuffer(record, DECODE_PARAMS_DTYPE)[0]["cache_seqlens"])

    cuflash.attention_with_kvcache(q, caches[0], caches[0], cache_seqlens=40)  # (checked: its own array)
    recorder.take()
    addresses = []
    for c in caches:
        cuflash.attention_with_kvcache(q, c, c, cache_seqlens=40)
        addresses.append(lengths_address())
    assert len(set(addresses)) == 1 and len(_kvcache._SEQLEN_TABLES) == 1
    cuflash.attention_with_kvcache(q, caches[0], caches[0], cache_seqlens=39)
    assert lengths_address() == addresses[0] - 4 * 1 and len(_kvcache._SEQLEN_TABLES) == 1  # the row above
    cp.cuda.get_current_stream().capturing = True
    try:
        cuflash.attention_with_kvcache(q, caches[1], caches[1], cache_seqlens=40)
        address = lengths_address()
        assert address != addresses[0] and len(_kvcache._SEQLEN_TABLES) == 1
        table = _kvcache._SEQLEN_TABLES[(0, 1)]
        assert not table.data.ptr <= address < table.data.ptr + table.nbytes
    finally:
        cp.cuda.get_current_stream().capturing = False


def test_chunked_prefill_launches_its_forward_after_the_append_programmatically(fake, monkeypatch):
    """[pdl] A chunked prefill (64 query tokens over a contiguous cache) is the append kernel, then the forward kernel
    launched with programmatic stream serialization (its kernel waits for the append in-kernel), the same kernel,
    grid, block, shared memory and arguments as its ordinary launch (PROGRAMMATIC_PREFILL off), call after call."""
    cp, recorder = fake
    from cuflash._cuda import decode

    rng = np.random.default_rng(72)

    def array(shape):
        return cp.asarray(rng.standard_normal(shape).astype(np.float16))

    q, k, v = array((1, 64, 8, 128)), array((1, 64, 2, 128)), array((1, 64, 2, 128))
    k_cache, v_cache = array((1, 400, 2, 128)), array((1, 400, 2, 128))
    lens = cp.asarray(np.array([300], np.int32))

    def call():
        out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
        launches, programmatic = recorder.launches, recorder.programmatic
        recorder.take()
        return [(name, grid, block, smem, args[:3]) for name, grid, block, smem, _, args in launches], programmatic, out

    steps = []
    for switch in (True, False):
        monkeypatch.setattr(decode, "PROGRAMMATIC_PREFILL", switch)
        _api._kvcache_launches.clear()
        decode._LAUNCHES.clear()
        recorder.take()
        steps.append([call() for _ in range(3)])
    for (after, programmatic, out), (plain, none, _) in zip(*steps):
        assert [name for name, *_ in after] == [name for name, *_ in plain]
        assert "decode_append_kernel" in after[0][0] and "flash_fwd_sm90" in after[1][0], after
        assert programmatic == [1] and none == []
        assert after[1][1:4] == plain[1][1:4]
        assert out.shape == q.shape
    launch = next(iter(_api._kvcache_launches._entries.values()))
    assert isinstance(launch, decode.ChunkedPrefillLaunch) and not launch._after_append  # (the last: switch off)


def test_threads_on_the_per_thread_default_stream_get_plans_of_their_own(fake):
    """On CUDA's per-thread default stream (handle 2: a stream per thread) each thread's calls get plans of their own
    (a plan's workspace, the persistent forward's tile counter, serves one launch at a time); on any other stream the
    threads share them."""
    import threading

    cp, recorder = fake
    rng = np.random.default_rng(74)
    q, k, v = (cp.asarray(rng.standard_normal((1, 256, 4, 128)).astype(np.float16)) for _ in range(3))
    stream = cp.cuda.get_current_stream()

    def plans():
        got = []

        def call():
            cuflash.attention(q, k, v, causal=True)
            got.append(_api.attention_plan(q, k, v, causal=True))

        call()
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
        return got

    try:
        stream.ptr = 2
        mine, theirs = plans()
        assert mine is not None and theirs is not None and mine is not theirs
    finally:
        stream.ptr = 0
    mine, theirs = plans()
    assert mine is not None and mine is theirs


def test_a_refused_programmatic_launch_falls_back_to_the_ordinary_one(fake, monkeypatch):
    """[pdl] Where the driver refuses the forward's programmatic launch, the ordinary launch runs in its place (after
    the append, with a RuntimeWarning), and the launch asks no more."""
    cp, recorder = fake
    from cuflash._cuda import decode

    def refuse(self, config, fn, argv):
        raise RuntimeError("cuLaunchKernelEx failed: CUDA_ERROR_NOT_SUPPORTED (801)")

    monkeypatch.setattr(decode.CupyRuntime, "launch_programmatic", refuse)
    rng = np.random.default_rng(73)
    q, k, v = (cp.asarray(rng.standard_normal(shape).astype(np.float16))
               for shape in ((1, 64, 8, 128), (1, 64, 2, 128), (1, 64, 2, 128)))
    k_cache, v_cache = (cp.asarray(rng.standard_normal((1, 400, 2, 128)).astype(np.float16)) for _ in range(2))
    lens = cp.asarray(np.array([300], np.int32))
    recorder.take()
    with pytest.warns(RuntimeWarning, match="programmatic dependent launch refused"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
    launches = recorder.take()
    assert [name.split("<")[0] for name, *_ in launches][-2:] == ["cuflash::decode_append_kernel",
                                                                  "cuflash::flash_fwd_sm90_kernel"], launches
    launch = next(iter(_api._kvcache_launches._entries.values()))
    assert isinstance(launch, decode.ChunkedPrefillLaunch) and not launch._after_append
    cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)  # (no warning)
    assert len(recorder.take()) == 2 and not recorder.programmatic


def test_a_call_without_lse_writes_it_into_an_array_the_launch_keeps(fake):
    """A remembered decode call without return_lse writes its lse into the launch's own array (lse_sink: nothing
    allocated for it, the same address at every call); with return_lse each call gets a new lse array."""
    cp, recorder = fake
    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE

    q = cp.zeros((1, 1, 8, 64), np.float16)
    k_cache = cp.zeros((1, 40, 2, 64), np.float16)
    lens = cp.asarray(np.array([40], np.int32))

    def lse_address(**options):
        result = cuflash.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=lens, **options)
        (*_, (record,)), = recorder.take()
        return int(np.frombuffer(record, DECODE_PARAMS_DTYPE)[0]["lse"]), result

    lse_address()  # (checked and planned)
    sinks = [lse_address()[0] for _ in range(3)]
    assert len(set(sinks)) == 1
    kept = [lse_address(return_lse=True) for _ in range(2)]  # (the results kept: their memory is not reused)
    assert kept[0][0] == kept[0][1][1].data.ptr and kept[1][0] == kept[1][1][1].data.ptr
    assert len({sinks[0], kept[0][0], kept[1][0]}) == 3


def test_an_int_cache_seqlens_that_changes_reuses_the_launch(fake, monkeypatch):
    """A decode loop that appends with an int cache_seqlens (a new value at every step), contiguous or paged: one
    remembered launch, checked once, launching what a fresh call launches; a value that leaves no room for the new
    tokens raises what it raises with the memory emptied. With rotary the value stays in the key (the checks measure
    the table's rows against it)."""
    cp, recorder = fake
    from cuflash._cuda import decode

    rng = np.random.default_rng(71)

    def array(*shape, dtype=np.float16):
        return cp.asarray(rng.standard_normal(shape).astype(dtype))

    q, k, v = array(2, 1, 8, 64), array(2, 1, 2, 64), array(2, 1, 2, 64)
    contiguous = (array(2, 300, 2, 64), array(2, 300, 2, 64))
    pool = (array(12, 32, 2, 64), array(12, 32, 2, 64))
    table = cp.asarray(rng.permutation(12).reshape(2, 6).astype(np.int32))
    layouts = {"contiguous": (contiguous, {}), "paged": (pool, dict(block_table=table))}
    checked = []
    real_check = _api._kvcache_call
    monkeypatch.setattr(_api, "_kvcache_call", lambda *a, **kw: checked.append(1) or real_check(*a, **kw))
    for name, ((k_cache, v_cache), extra) in layouts.items():
        lengths = [0, 1, 31, 32, 100, 191]

        def step(n):
            recorder.take()
            cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n, causal=True, **extra)
            return _decode_step(recorder.take(), 2)

        fresh = []
        for n in lengths:
            _api._kvcache_launches.clear()
            decode._LAUNCHES.clear()
            fresh.append(step(n))
        _api._kvcache_launches.clear()
        checked.clear()
        assert [step(n) for n in lengths] == fresh, name
        assert len(checked) == 1 and len(_api._kvcache_launches) == 1, name
        bad = 300 if name == "contiguous" else 192
        with pytest.raises(ValueError, match=r"cache_seqlens\[b\] \+ seqlen_new must fit the cache"):
            cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=bad, **extra)
    cos, sin = (cp.asarray(rng.standard_normal((40, 16)).astype(np.float32)) for _ in range(2))
    k_cache, v_cache = contiguous

    def key(n, rotary):
        return _api._kvcache_key(q, k_cache, v_cache, k, v, n, *((cos, sin) if rotary else (None, None)), True, None,
                                 None, None, True, (-1, -1), 0.0, None, None, 0, None)

    assert key(3, False) == key(4, False) and key(3, True) != key(4, True)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must have a row for every rotated position"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=40, rotary_cos=cos, rotary_sin=sin)


def test_cascade_calls_plan_once_and_compose_what_the_plan_does_not_take(fake, monkeypatch):
    """cuflash.cascade_attention on (stand-in) CuPy arrays: the first call with a layout is checked and planned (the
    pack kernel, the forward over the prefix chunks, the decode launch, the merge kernel), later ones only launch; a
    prefix view whose base is off a multiple of 16 bytes runs the composition (no pack kernel) without a new check;
    a layout the plan does not take (float32) is checked at its first call only, then composed."""
    cp, recorder = fake
    checked, composed = [], []
    real_plan = _api._plan_cascade
    monkeypatch.setattr(_api, "_plan_cascade", lambda *a, **k: checked.append(1) or real_plan(*a, **k))
    # (the composition's CuPy array operations are not the stand-in's: only whether it runs is recorded)
    monkeypatch.setattr(_api._cascade, "cascade", lambda q, *a, **k: composed.append(1) or (q, None))
    monkeypatch.setattr(_api, "_cascade_launches", _api.CallMemo(16))
    rng = np.random.default_rng(5)

    def arrays(dtype, offset=0):
        def a(*shape):
            flat = cp.asarray(rng.standard_normal(int(np.prod(shape)) + offset).astype(dtype))
            return flat[offset:].reshape(shape)
        return a(4, 1, 8, 64), a(256, 2, 64), a(256, 2, 64), a(4, 100, 2, 64), a(4, 100, 2, 64)

    lens = cp.asarray(np.full(4, 50, np.int32))

    def kernels(q, kp, vp, kc, vc):
        recorder.take()
        cuflash.cascade_attention(q, kp, vp, kc, vc, cache_seqlens=lens, causal=True)
        return [r[0].split("<")[0] for r in recorder.take()]

    planned = ["cuflash::cascade_pack_kernel", "cuflash::flash_fwd_sm90_kernel", "cuflash::flash_decode_kernel",
               "cuflash::cascade_merge_kernel"]
    assert kernels(*arrays(np.float16)) == planned and len(checked) == 1
    assert kernels(*arrays(np.float16)) == planned and len(checked) == 1 and not composed
    q, _, _, kc, vc = arrays(np.float16)
    _, kp, vp, _, _ = arrays(np.float16, offset=1)  # (2 bytes past a multiple of 16; the same layout)
    assert kernels(q, kp, vp, kc, vc) == [] and len(checked) == 1 and len(composed) == 1
    kernels(*arrays(np.float32))
    kernels(*arrays(np.float32))
    assert len(checked) == 2 and len(composed) == 3 and len(_api._cascade_launches) == 2


def test_the_host_profile_tool_runs_on_the_stand_in():
    """tools/host_profile.py --stand-in (the tests' stand-in CuPy, no GPU): the host time of the front door's planned
    calls is printed for each case, the calls with new arrays at every call among them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tools" / "host_profile.py"), "--stand-in", "--cases", "new-arrays",
                          "--calls", "20", "--repeats", "1", "--count"], capture_output=True, text=True, timeout=300,
                         cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines() if "-new-arrays" in line]
    assert [row[0] for row in rows] == ["causal-new-arrays", "dense-new-arrays"], run.stdout
    assert all(float(row[1]) > 0 and row[2] == "us/call" for row in rows), run.stdout


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_every_backward_launch_of_d_passes_the_kernels_parameters(fake, algorithm, dtype):
    """Each launcher of D's kernel (the FA2 backward's and the FA1 backward's, 16-bit and float32) passes as many
    arguments as the compiled kernel takes (its PTX entry's parameters): a launcher left behind by a change of the
    kernel's signature would hand it garbage for the missing ones (found so: the FA1 launch after D's launch began
    zeroing dQ's workspace)."""
    cp, recorder = fake
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings not installed (pip install .[nvrtc])")
    from cuflash import _cuda

    rng = np.random.default_rng(5)
    q, k, v, do, out = (cp.asarray(rng.standard_normal((1, 40, 2, 64)).astype(dtype)) for _ in range(5))
    lse = cp.asarray(rng.standard_normal((1, 2, 40)).astype(np.float32))
    recorder.take()
    cuflash.attention_backward(do, q, k, v, out, lse, causal=True, algorithm=algorithm)
    pre = [launch for launch in recorder.take() if "preprocess" in launch[0]]
    assert len(pre) == 1, [launch[0] for launch in pre]
    name, _, args = pre[0][:3] if len(pre[0]) == 3 else (pre[0][0], None, pre[0][5])
    family = "bwd_pre_f32" if dtype == np.float32 else "bwd_pre"
    spec = _cuda.spec.spec(family, np.dtype(dtype).name, 64)
    assert spec.name == name
    compiled = _cuda.compile.nvrtc_offline(_cuda.compile_source_for_nvrtc(spec.source), [name], spec.options,
                                           spec.targets[-1])
    if not compiled["ok"]:
        pytest.skip("NVRTC could not compile here: " + compiled["log"][-300:])
    entry = compiled["ptx"][compiled["ptx"].index(".entry " + compiled["lowered"][name]):]
    assert entry[:entry.index(")")].count(".param") == len(args), (algorithm, dtype)
