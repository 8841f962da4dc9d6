"""The TMA descriptors (cuflash._cuda.tensor_map) and when the launchers use them, on the CPU: the MLA decode kernel,
the Hopper forward's and the dK/dV kernel's TMA entry points (the GPU tests run the kernels' TMA copies against the
truth and against their cp.async ones: test_cuda_decode.py, test_cuda_attention.py, test_cuda_variants.py)."""

from __future__ import annotations

import pytest


def _tma_stand_in(monkeypatch):
    """A stand-in CuPy (tests/_fake_cupy.py) with tensor maps available and their encoder standing in for the
    driver's: ``(cp, recorder, encoded)``, ``encoded`` a list of ``(address, dims, strides, box)`` per map encoded
    (each call checked as the launchers make them: a 64-byte-aligned 4-d map of 128-byte boxes, 128-byte swizzle, zeros
    out of bounds)."""
    from cuflash._cuda import tensor_map

    from _fake_cupy import install
    from conftest import gpu_skip_reason

    gpu_skip_reason()
    cp, recorder = install(monkeypatch)
    monkeypatch.setattr(tensor_map, "available", lambda: True)
    monkeypatch.setattr(tensor_map, "address_field", lambda: None)  # (every new address encoded, and recorded)
    encoded = []

    def encode(address, dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, l2, oob):
        assert address % 64 == 0 and rank == 4 and swizzle == 3 and oob == 0
        # (16-bit maps; 8-bit (e4m3) and 32-bit (float32) ones: the V^T entry point's, whose boxes are 128 bytes too;
        # the codes CUtensorMapDataType's UINT8, UINT16 and UINT32 in cuda.h: 0, 1, 2)
        assert {0: 1, 1: 2, 2: 4}[dtype] * box[0] == 128
        encoded.append((ptr, tuple(dims), tuple(strides), tuple(box)))
        return 0

    monkeypatch.setattr(tensor_map, "_encode_tiled", lambda: encode)
    return cp, recorder, encoded


def _backward_inputs(cp, seed: int, d: int, batch: int = 2, nk: int = 300):
    """Random bf16 (q, k, v, do, out) of a GQA 4 / 2 call, 200 queries and ``nk`` keys of head dim ``d``, and a float32
    lse, on the stand-in CuPy: a backward plan's arguments (their values unused by the plan)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(seed)

    def arr(*shape, dtype=ml_dtypes.bfloat16):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    return (arr(batch, 200, 4, d), arr(batch, nk, 2, d), arr(batch, nk, 2, d), arr(batch, 200, 4, d),
            arr(batch, 200, 4, d), arr(batch, 4, 200, dtype=np.float32))


def test_tensor_maps_and_when_the_mla_kernel_copies_by_tma(monkeypatch):
    """(CPU) A TensorMap's 128 bytes are 64-byte aligned (cuTensorMapEncodeTiled's requirement), an unused one is
    never encoded; the MLA kernel copies by TMA only where every 64-key tile lies whole in one page or the contiguous
    cache's row (no append, no left padding, pages of a multiple of 64), the switch is on and the driver encodes
    maps."""
    import types

    from cuflash._cuda import decode, spec, tensor_map

    unused = tensor_map.TensorMap(None)
    assert unused.address % 64 == 0 and unused.words.nbytes == 128 and not unused.mapped
    unused.point(0x1000)  # (no driver call: nothing to encode)
    mapped = tensor_map.TensorMap((576, 64, 10), (1152, 73728), (64, 64, 1))
    assert mapped.mapped and mapped.address % 64 == 0
    with pytest.raises(AssertionError):
        tensor_map.TensorMap((576, 64, 10), (1152, 73730), (64, 64, 1))  # (strides of multiples of 16 bytes)

    monkeypatch.setattr(tensor_map, "available", lambda: True)

    def fits(seqlen_new=0, leftpad=None, page=64, switch=True):
        monkeypatch.setattr(spec, "TMA_DECODE", switch)
        cache = types.SimpleNamespace(seqlen_new=seqlen_new, cache_leftpad=leftpad)
        k_cache = types.SimpleNamespace(shape=(8, page or 700, 1, 576))
        return decode._tma_tiles(cache, k_cache, paged=page is not None)

    assert fits() and fits(page=128) and fits(page=None)
    assert not fits(seqlen_new=1) and not fits(leftpad=object()) and not fits(page=16) and not fits(switch=False)
    monkeypatch.setattr(tensor_map, "available", lambda: False)
    assert not fits()


def _writing_encoder(layout):
    """A stand-in cuTensorMapEncodeTiled that writes a map: ``layout(ptr, dims)`` -> its 16 words. Returns ``(encode,
    calls)``, ``calls`` the addresses encoded."""
    import ctypes

    calls = []

    def encode(address, dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, l2, oob):
        if ptr & 15:
            return 1  # (CUDA_ERROR_INVALID_VALUE: the driver's answer to an unaligned address)
        calls.append(ptr)
        (ctypes.c_uint64 * 16).from_address(address)[:] = layout(ptr, tuple(dims[:rank]))
        return 0

    return encode, calls


def _shifted(ptr, dims):  # the address >> 4 in word 1 under a flag bit, the rest the shape's
    return [dims[0], (ptr >> 4) | 1 << 60, *(d << 3 for d in dims), *[7] * (14 - len(dims))]


def _split(ptr, dims):  # the address's low and high halves in two words
    return [dims[0], ptr & 0xFFFFFFFF, ptr >> 32, *[5] * 13]


@pytest.mark.parametrize("layout", [_shifted, _split])
def test_a_map_writes_new_addresses_where_the_drivers_layout_is_learnt(monkeypatch, layout):
    """(CPU) TensorMap.point writes a new address into the map's address word, with no encoding, where the layout the
    driver writes is learnt (address_field: one word, the address shifted, every other byte fixed) and checked on the
    map's own first encoding; the words are then the encoder's at that address (an address above the probed bits is
    encoded). Where the layout does not fit the rule
    (the address in two words), or a map's check fails, every new address is encoded."""
    import numpy as np

    from cuflash._cuda import tensor_map

    encode, calls = _writing_encoder(layout)
    monkeypatch.setattr(tensor_map, "_encode_tiled", lambda: encode)
    learnt = tensor_map.address_field
    learnt.cache_clear()
    try:
        field = learnt()
        assert field == ((1, 4) if layout is _shifted else None)
        if field:  # (every bit probed; the split layout stops at bit 32, the first in its other word)
            assert len(calls) == 1 + len(tensor_map._PROBE_BITS)
        rng = np.random.default_rng()
        spec = ((128, 300, 4, 2), (1024, 256, 16), (64, 64, 1, 1))
        m = tensor_map.TensorMap(*spec)
        first = int(rng.integers(1, 1 << 44)) * 16
        calls.clear()
        m.point(first)
        assert calls == [first] + ([first ^ 1 << 20] if field else [])  # (the map's own check of the rule)
        assert list(m.words) == layout(first, spec[0])  # (the first encoding's words, restored after the check)
        for _ in range(20):
            ptr = int(rng.integers(1, 1 << 44)) * 16
            calls.clear()
            m.point(ptr)
            assert calls == ([] if field else [ptr])
            assert list(m.words) == layout(ptr, spec[0])
        high = (1 << 48) + 4096  # (above the probed bits: encoded, not written)
        calls.clear()
        m.point(high)
        assert calls == [high] and list(m.words) == layout(high, spec[0])
        with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed"):
            m.point(first + 8)  # (unaligned: encoded, and the driver's refusal raised)

        # A map whose own encoding does not fit a rule learnt elsewhere encodes every address.
        monkeypatch.setattr(tensor_map, "address_field", lambda: (1, 4))
        encode, calls = _writing_encoder(_split)
        monkeypatch.setattr(tensor_map, "_encode_tiled", lambda: encode)
        m = tensor_map.TensorMap(*spec)
        m.point(first)
        assert list(m.words) == _split(first, spec[0])
        calls.clear()
        m.point(first + 4096)
        assert calls == [first + 4096] and list(m.words) == _split(first + 4096, spec[0])
    finally:
        learnt.cache_clear()


@pytest.mark.gpu
def test_written_addresses_are_the_drivers_encoding(requires_gpu):
    """(GPU) With the driver's encoder: the layout is learnt, and a map pointed at random addresses (16-byte aligned,
    below 2**48) by writing its address word holds what cuTensorMapEncodeTiled writes at each, for 16-, 8- and 32-bit
    maps of ranks 3 and 4 (and its first encoding is restored after the map's own check)."""
    import numpy as np

    from cuflash._cuda import tensor_map

    requires_gpu.zeros(1)  # (the driver initialized, as it is wherever a map is pointed at an array)
    tensor_map.address_field.cache_clear()
    assert tensor_map.address_field() is not None
    rng = np.random.default_rng(2026)
    specs = [(((128, 300, 4, 2), (1024, 256, 16), (64, 64, 1, 1)), 2),
             (((576, 64, 10), (1152, 73728), (64, 64, 1)), 2),
             (((128, 512, 8, 3), (1024, 128, 16), (128, 128, 1, 1)), 1),
             (((64, 200, 2, 2), (512, 256, 16), (32, 64, 1, 1)), 4)]
    for spec, element_bytes in specs:
        m = tensor_map.TensorMap(*spec, element_bytes=element_bytes)
        reference = tensor_map.TensorMap(*spec, element_bytes=element_bytes)
        first = int(rng.integers(1, 1 << 44)) * 16
        m.point(first)
        assert m._base is not None, spec
        assert tensor_map._encode(reference.words, reference._dtype, reference._spec, reference._args, first) == 0
        np.testing.assert_array_equal(m.words, reference.words, err_msg=f"{spec}: the first encoding, restored")
        for _ in range(200):
            ptr = int(rng.integers(1, 1 << 44)) * 16  # (below 2**48: written, not encoded)
            m.point(ptr)
            assert tensor_map._encode(reference.words, reference._dtype, reference._spec, reference._args, ptr) == 0
            np.testing.assert_array_equal(m.words, reference.words, err_msg=f"{spec} at {ptr:#x}")


def test_the_forward_copies_by_tma_where_a_call_allows_it(monkeypatch):
    """(CPU, stand-in CuPy) On sm_90 a 16-bit forward at a head dim of an ("fwd", "sm90a_tma") row runs the wgmma
    kernel's TMA entry point with a 4-d map of each of q, k and v (columns, rows, heads, batch; boxes of 64 columns by
    the tile's rows; the arrays' byte strides, an axis of one element given 16), encoded at each new address only;
    packed batches (their maps with a batch axis of one) and key counts run it too (TMA_SEQUENCE_LENGTHS), head dims
    below a row's run it padded (Pads_head_dim; the maps of the arrays' head dims); the switches off, a bias with
    dropout run the cp.async kernel; a d 64 query sequence of up to TMA_SHORT_MAX_ROWS_Q rows runs the
    ("fwd", "sm90a_tma_short") tile (its boxes that tile's rows), a longer one the row's; the plan's flat call
    (cuflash.jax's kernel calls) names the cp.async kernel either way."""
    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash._cuda import attention, spec

    cp, recorder, encoded = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TMA_SEQUENCE_LENGTHS", True)  # (the defaults, whatever the environment says)
    monkeypatch.setattr(attention, "TMA_PADDED", True)
    rng = np.random.default_rng(5)

    def arr(*shape):
        return cp.asarray(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))

    def kernels():
        return [launch[0].split("<")[0] for launch in recorder.take() if len(launch) == 6]

    q, k, v = arr(2, 300, 4, 128), arr(2, 260, 2, 128), arr(2, 260, 2, 128)
    tile = spec.TILES[("fwd", "sm90a_tma", 128)]
    cuflash.attention(q, k, v, causal=True)
    assert kernels() == ["cuflash::flash_fwd_sm90_tma_kernel"]
    assert encoded == [
        (q.data.ptr, (128, 300, 4, 2), (1024, 256, 300 * 1024), (64, tile.block_m, 1, 1)),
        (k.data.ptr, (128, 260, 2, 2), (512, 256, 260 * 512), (64, tile.block_n, 1, 1)),
        (v.data.ptr, (128, 260, 2, 2), (512, 256, 260 * 512), (64, tile.block_n, 1, 1)),
    ]
    encoded.clear()
    cuflash.attention(q, k, v, causal=True)  # (the same addresses: nothing to encode)
    assert kernels() == ["cuflash::flash_fwd_sm90_tma_kernel"] and encoded == []
    q2 = arr(2, 300, 4, 128)
    cuflash.attention(q2, k, v, causal=True)
    assert kernels() == ["cuflash::flash_fwd_sm90_tma_kernel"] and [e[0] for e in encoded] == [q2.data.ptr]
    encoded.clear()

    # (B, H, N, d) views and a batch of one: the arrays' strides, the batch axis's given as 16 bytes
    qt, kt, vt = (arr(1, 4, 200, 128).transpose(0, 2, 1, 3) for _ in range(3))
    cuflash.attention(qt, kt, vt)
    assert kernels() == ["cuflash::flash_fwd_sm90_tma_kernel"]
    assert [e[1:3] for e in encoded] == [((128, 200, 4, 1), (256, 200 * 256, 16))] * 3
    encoded.clear()

    # key counts and packed batches (the kernel zeroes the rows a box reads past a sequence's keys): a packed
    # array's map has a batch axis of one
    lens = cp.asarray(np.array([100, 260], np.int32))
    cuflash.attention(q2, k, v, seqused_k=lens)
    assert kernels() == ["cuflash::flash_fwd_sm90_tma_kernel"]  # (a plan of its own: its maps)
    assert [e[:2] for e in encoded] == [(q2.data.ptr, (128, 300, 4, 2)), (k.data.ptr, (128, 260, 2, 2)),
                                        (v.data.ptr, (128, 260, 2, 2))]
    encoded.clear()
    cu = cp.asarray(np.array([0, 100, 300], np.int32))
    qp, kp, vp = arr(300, 4, 128), arr(300, 2, 128), arr(300, 2, 128)
    cuflash.attention(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
    assert kernels() == ["cuflash::flash_fwd_sm90_tma_kernel"]
    assert [e[1:] for e in encoded] == [((128, 300, 4, 1), (1024, 256, 16), (64, tile.block_m, 1, 1)),
                                        ((128, 300, 2, 1), (512, 256, 16), (64, tile.block_n, 1, 1)),
                                        ((128, 300, 2, 1), (512, 256, 16), (64, tile.block_n, 1, 1))]
    encoded.clear()
    monkeypatch.setattr(attention, "TMA_SEQUENCE_LENGTHS", False)  # (switched off)
    cuflash.attention(q2, k, v, seqused_k=lens)
    assert kernels() == ["cuflash::flash_fwd_sm90_kernel"] and encoded == []
    monkeypatch.setattr(attention, "TMA_SEQUENCE_LENGTHS", True)
    monkeypatch.setattr(attention, "TMA_PADDED", False)  # (d 96: its own kernel, or below the d 128 one's)
    cuflash.attention(arr(1, 64, 2, 96), arr(1, 64, 2, 96), arr(1, 64, 2, 96))
    monkeypatch.setattr(attention, "TMA_PADDED", True)
    bias = cp.asarray(rng.standard_normal((2, 4, 300, 260)).astype(np.float32))
    cuflash.attention(q, k, v, bias=bias, dropout_p=0.1, dropout_seed=1)  # (a bias with dropout: see _tma_forward)
    monkeypatch.setattr(attention, "TMA_FORWARD", False)
    cuflash.attention(arr(1, 64, 2, 128), arr(1, 64, 2, 128), arr(1, 64, 2, 128))
    assert "cuflash::flash_fwd_sm90_tma_kernel" not in kernels() and encoded == []
    monkeypatch.setattr(attention, "TMA_FORWARD", True)
    monkeypatch.setattr(attention, "SM90A_FORWARD", False)  # (the Hopper kernels off: the mma.sync one, padded or not)
    cuflash.attention(arr(1, 64, 2, 128), arr(1, 64, 2, 128), arr(1, 64, 2, 128))
    cuflash.attention(arr(1, 64, 2, 96), arr(1, 64, 2, 96), arr(1, 64, 2, 96))
    assert kernels() == ["cuflash::flash_fwd_kernel"] * 2 and encoded == []
    monkeypatch.setattr(attention, "SM90A_FORWARD", True)
    # d 64: a short query sequence on the short tile, a longer one on the row's, both by default persistent ([fwd
    # persistent]: as many blocks as the SMs hold walking the tiles (the short tile's two an SM), the batch size after
    # VariantParams)
    monkeypatch.setattr(attention, "PERSISTENT_FORWARD", None)
    short, long = spec.TILES[("fwd", "sm90a_tma_short", 64)], spec.TILES[("fwd", "sm90a_tma", 64)]
    for rows, t in ((attention.TMA_SHORT_MAX_ROWS_Q, short), (attention.TMA_SHORT_MAX_ROWS_Q + 1, long)):
        cuflash.attention(arr(1, rows, 2, 64), arr(1, 64, 2, 64), arr(1, 64, 2, 64))
        (launch,) = [launch for launch in recorder.take() if len(launch) == 6]
        assert launch[0].split("<")[0] == "cuflash::flash_fwd_sm90_tma_kernel"
        assert launch[0].endswith(", true>")
        tiles = -(-rows // t.block_m) * 2
        assert launch[1] == (min(tiles, 132 * (1 if t is long else 2)), 1, 1)
        assert [e[3][1] for e in encoded] == [t.block_m, t.block_n, t.block_n]
        encoded.clear()
    # (causal: the short tile up to TMA_SHORT_MAX_ROWS_Q_CAUSAL rows)
    for rows, t in ((attention.TMA_SHORT_MAX_ROWS_Q_CAUSAL, short), (attention.TMA_SHORT_MAX_ROWS_Q_CAUSAL + 1, long)):
        cuflash.attention(arr(1, rows, 2, 64), arr(1, rows, 2, 64), arr(1, rows, 2, 64), causal=True)
        (launch,) = [launch for launch in recorder.take() if len(launch) == 6]
        assert [e[3][1] for e in encoded] == [t.block_m, t.block_n, t.block_n]
        encoded.clear()
    # ... and where asked everywhere it takes (16-bit padded batches without key counts, d 64 to 192), or nowhere
    monkeypatch.setattr(attention, "PERSISTENT_FORWARD", True)
    cuflash.attention(arr(3, 300, 4, 128), arr(3, 200, 2, 128), arr(3, 200, 2, 128), causal=True)
    cuflash.attention(q2, k, v, seqused_k=lens)
    names = [launch[0] for launch in recorder.take() if len(launch) == 6]
    assert [n.endswith(", true>") for n in names] == [True, False]
    monkeypatch.setattr(attention, "PERSISTENT_FORWARD", False)
    cuflash.attention(arr(1, attention.TMA_SHORT_MAX_ROWS_Q + 1, 2, 64), arr(1, 64, 2, 64), arr(1, 64, 2, 64))
    assert not any(launch[0].endswith(", true>") for launch in recorder.take() if len(launch) == 6)
    monkeypatch.setattr(attention, "PERSISTENT_FORWARD", None)
    # ... by default at d 128 too, dense or not (the blocks take their tiles from a counter: balanced as the one-tile
    # grid's), with the plan's zeroed tile counter after the batch size
    for opts, persistent in (({}, True), ({"causal": True}, True), ({"window_size": (50, 50)}, True)):
        cuflash.attention(arr(2, 300, 4, 128), arr(2, 300, 2, 128), arr(2, 300, 2, 128), **opts)
        (launch,) = [launch for launch in recorder.take() if len(launch) == 6]
        assert launch[0].endswith(", true>") == persistent, opts
        batch, counter = launch[5][-5:-3]  # (then the three maps)
        assert int.from_bytes(batch, "little") == 2 and int.from_bytes(counter, "little") != 0
    encoded.clear()

    # [variant head dim] d 96 on the d 128 kernel, v of d 64 (its maps hold the arrays' head dims: zeros past them)
    q96, k96, v64 = arr(1, 64, 2, 96), arr(1, 64, 2, 96), arr(1, 64, 2, 64)
    out = cuflash.attention(q96, k96, v64)
    (name,) = [launch[0] for launch in recorder.take() if len(launch) == 6]
    # (dense at d 128: persistent by default, its tiles a head at a time)
    assert name.startswith("cuflash::flash_fwd_sm90_tma_kernel<cuflash::bf16, 128,") and name.endswith("true>, true>")
    assert [e[1] for e in encoded] == [(96, 64, 2, 1), (96, 64, 2, 1), (64, 64, 2, 1)] and out.shape == (1, 64, 2, 64)

    plan = attention.ForwardPlan(q, k, v, scale=0.1, variant=cuflash._ops.variant.Variant(causal=True), block_q=None,
                                 block_k=None)
    assert plan._launch is not None and plan.flat_call()[0].family == "fwd_sm90"


def test_the_backward_copies_by_tma_where_a_planned_call_allows_it(monkeypatch):
    """(CPU, stand-in CuPy) With TMA_BACKWARD, on sm_90 a planned 16-bit backward at d 64 / 128 runs the wgmma dK/dV
    kernel's TMA entry point with maps of q, k, v and dO (boxes of the tile's query rows for q and dO, its key rows
    for k and v), each pointed at a run's array; key counts and the switch off run the cp.async kernel; the plan's
    flat calls (cuflash.jax's kernel calls) name the cp.async kernel's flat entry point."""
    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash._cuda import attention, spec
    from cuflash._ops.variant import Variant

    cp, recorder, encoded = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)  # (the default, whatever the environment says)
    rng = np.random.default_rng(7)

    def arr(*shape, dtype=ml_dtypes.bfloat16):
        return cp.asarray(rng.standard_normal(shape).astype(dtype))

    def kernels():
        return [launch[0].split("<")[0] for launch in recorder.take() if len(launch) == 6]

    q, do, out = arr(2, 200, 4, 128), arr(2, 200, 4, 128), arr(2, 200, 4, 128)
    k, v = arr(2, 300, 2, 128), arr(2, 300, 2, 128)
    lse = arr(2, 4, 200, dtype=np.float32)
    tile = spec.TILES[("bwd", "sm90a", 128)]
    cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    assert "cuflash::flash_bwd_dkdv_sm90_tma_kernel" in kernels()
    assert [(e[0], e[1], e[3]) for e in encoded] == [(q.data.ptr, (128, 200, 4, 2), (64, tile.block_m, 1, 1)),
                                                     (k.data.ptr, (128, 300, 2, 2), (64, tile.block_n, 1, 1)),
                                                     (v.data.ptr, (128, 300, 2, 2), (64, tile.block_n, 1, 1)),
                                                     (do.data.ptr, (128, 200, 4, 2), (64, tile.block_m, 1, 1))]
    encoded.clear()
    do2 = arr(2, 200, 4, 128)
    cuflash.attention_backward(do2, q, k, v, out, lse, causal=True)  # (only dO moved: only its map encoded)
    assert "cuflash::flash_bwd_dkdv_sm90_tma_kernel" in kernels() and [e[0] for e in encoded] == [do2.data.ptr]
    encoded.clear()

    cuflash.attention_backward(do, q, k, v, out, lse, seqused_k=cp.asarray(np.array([100, 300], np.int32)))
    monkeypatch.setattr(attention, "TMA_BACKWARD", False)
    cuflash.attention_backward(do, q, k, v, out, lse)
    launched = kernels()
    assert "cuflash::flash_bwd_dkdv_sm90_kernel" in launched
    assert "cuflash::flash_bwd_dkdv_sm90_tma_kernel" not in launched
    assert encoded == []
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)

    plan = attention.BackwardPlan(do, q, k, v, out, lse, scale=0.1, variant=Variant(causal=True), algorithm="fa2",
                                  block_q=None, block_k=None, order="kv_outer")
    calls, _ = plan.flat_calls()
    names = [name.split("<")[0] for _, name, _, _ in calls]
    assert "cuflash::flash_bwd_dkdv_sm90_flat_kernel" in names and not any("tma" in n for n in names)


def test_the_backward_reads_head_dims_below_a_row_by_tma(monkeypatch):
    """(CPU, stand-in CuPy) [bwd tma pad] With TMA_PADDED_BACKWARD, on sm_90 a planned 16-bit backward at a head dim
    below a wgmma dK/dV row's (d 96; q's 64 with v's 96) runs the next row's kernel (d 128) from its TMA entry point,
    Pads_head_dim on, its maps of the arrays' head dims; it has no flat calls (the cp.async entry point cannot pad);
    key counts and the switch off run the mma.sync kernel of the arrays' head dim."""
    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash._cuda import attention
    from cuflash._ops.variant import Variant

    cp, recorder, encoded = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)
    monkeypatch.setattr(attention, "TMA_PADDED_BACKWARD", True)
    rng = np.random.default_rng(11)

    def arr(*shape, dtype=ml_dtypes.bfloat16):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    def dkdv():
        return [launch[0] for launch in recorder.take() if "dkdv" in launch[0]]

    for d, dv in ((96, 96), (64, 96), (32, 32)):
        q, k = arr(2, 200, 4, d), arr(2, 300, 2, d)
        v, do, out = arr(2, 300, 2, dv), arr(2, 200, 4, dv), arr(2, 200, 4, dv)
        lse = arr(2, 4, 200, dtype=np.float32)
        kd = 64 if max(d, dv) <= 64 else 128
        cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
        (name,) = dkdv()
        assert name.startswith(f"cuflash::flash_bwd_dkdv_sm90_tma_kernel<cuflash::bf16, {kd}, ") and "true>" in name
        assert [e[1][0] for e in encoded] == [d, d, dv, dv]  # (q, k, v, dO: the arrays' head dims)
        encoded.clear()
        plan = attention.BackwardPlan(do, q, k, v, out, lse, scale=0.1, variant=Variant(causal=True), algorithm="fa2",
                                      block_q=None, block_k=None, order="kv_outer")
        assert plan.flat_calls() is None
    cuflash.attention_backward(do, q, k, v, out, lse, seqused_k=cp.asarray(np.array([100, 300], np.int32)))
    assert dkdv()[0].startswith("cuflash::flash_bwd_dkdv_kernel<cuflash::bf16, 32, ")
    monkeypatch.setattr(attention, "TMA_PADDED_BACKWARD", False)
    cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    assert dkdv()[0].startswith("cuflash::flash_bwd_dkdv_kernel<cuflash::bf16, 32, ") and encoded == []


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float32"])
def test_the_vt_entry_point_plans(monkeypatch, dtype):
    """(CPU, stand-in CuPy) [fp8] e4m3 inputs (uint8 bits) and, with TF32_WGMMA, [tf32] float32 ones with
    fp32_precision="tf32" run transpose_v_kernel of their element type, then flash_fwd_sm90_vt_kernel, its maps of q and
    k 128-byte boxes of their rows (128 e4m3 or 32 float32 columns) and V^T's (keys_16, d, heads_kv, batch) with boxes
    of 128 bytes of keys by d rows; its plan kept per layout (the same call encodes nothing again). [tf32 qk] float32 q
    and k are first copied rounded to TF32 by round_tf32_kernel (from the arrays' strides; a (B, H, N, d) layout's
    here), and the maps are of the C-contiguous copies. TF32_WGMMA off, or the default fp32_precision, run
    flash_fwd_kernel on TF32 fragments."""
    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash._cuda import attention, spec

    cp, recorder, encoded = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TF32_WGMMA", True)
    rng = np.random.default_rng(3)
    fp8 = dtype == "float8_e4m3fn"
    d = 128
    nbytes, tag, row = (1, "cuflash::e4m3", "sm90a_fp8") if fp8 else (4, "cuflash::tf32", "sm90a_tf32")

    def arr(*shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return cp.asarray(x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8) if fp8 else x)

    launches = []

    def kernels():
        launches[:] = [launch for launch in recorder.take() if len(launch) == 6]
        return [launch[0].split(",")[0] for launch in launches]

    q, k, v = arr(2, 300, 4, d), arr(2, 250, 2, d), arr(2, 250, 2, d)
    if not fp8:  # (q as a (B, H, N, d) array seen as (B, N, H, d): the rounded copy is C-contiguous)
        q = cp.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    options = {} if fp8 else {"fp32_precision": "tf32"}
    tile = spec.TILES[("fwd", row, d)]
    out = cuflash.attention(q, k, v, causal=True, **options)
    assert out.dtype == (np.dtype(ml_dtypes.bfloat16) if fp8 else np.float32) and out.shape == (2, 300, 4, d)
    rounds = [] if fp8 else ["cuflash::round_tf32_kernel<128>"] * 2
    expected = [*rounds, f"cuflash::transpose_v_kernel<{tag}", f"cuflash::flash_fwd_sm90_vt_kernel<{tag}"]
    assert kernels() == expected
    copies = (q.data.ptr, k.data.ptr)
    if not fp8:  # [tf32 qk] read from q's and k's strides (bytes: batch, row, head), written to the copies
        def value(raw):
            return int.from_bytes(raw, "little", signed=True)

        for (_, grid, _, _, _, args), a in zip(launches, (q, k)):
            assert grid == (-(-a.shape[1] * a.shape[2] * d // 1024), 2, 1) and value(args[0]) == a.data.ptr
            assert tuple(value(x) for x in args[2:]) == (a.shape[1], a.shape[2], *a.strides[:3])
        copies = tuple(value(launch[5][1]) for launch in launches[:2])
        assert not set(copies) & {q.data.ptr, k.data.ptr}
    box = 128 // nbytes
    (eq, ek, ev) = encoded
    assert eq == (copies[0], (d, 300, 4, 2), (4 * d * nbytes, d * nbytes, 300 * 4 * d * nbytes),
                  (box, tile.block_m, 1, 1))
    assert ek == (copies[1], (d, 250, 2, 2), (2 * d * nbytes, d * nbytes, 250 * 2 * d * nbytes),
                  (box, tile.block_n, 1, 1))
    n16 = 256
    assert ev[1:] == ((n16, d, 2, 2), (n16 * nbytes, d * n16 * nbytes, 2 * d * n16 * nbytes), (box, d, 1, 1))
    encoded.clear()
    cuflash.attention(q, k, v, causal=True, **options)  # (the plan kept: q and k not encoded again)
    assert kernels() == expected
    if fp8:  # (V^T's may move; the rounded copies too)
        assert len(encoded) <= 1 and all(e[0] not in (q.data.ptr, k.data.ptr) for e in encoded)
    if not fp8:
        monkeypatch.setattr(attention, "TF32_WGMMA", False)
        cuflash.attention(q, k, v, causal=True, **options)
        assert kernels() == ["cuflash::flash_fwd_kernel<cuflash::tf32"]
        monkeypatch.setattr(attention, "TF32_WGMMA", True)
        cuflash.attention(q, k, v, causal=True)  # (fp32_precision's default, tf32x3)
        assert kernels() == ["cuflash::flash_fwd_kernel<cuflash::tf32x3"]


def test_the_f16x2_plan(monkeypatch):
    """(CPU, stand-in CuPy) [f16x2] float32 inputs with fp32_precision="fp16x3" on sm_90 (F16X2_WGMMA): the
    three largest magnitudes' bits zeroed (one memset of 12 bytes), absmax_f32_kernel on q, k and v (from their
    strides; a (B, H, N, d) layout's for q) into consecutive words, split_f16x2_kernel into three C-contiguous pair
    arrays of one allocation (low parts at 2^11 for q and k, 1 for v), then flash_fwd_sm90_vt_kernel<f16x2> on the
    pairs' maps (128-byte boxes of 32 float32 words: 64 fp16 parts) with the bits as its descale pointer. Off, or with
    block sizes of the caller's: flash_fwd_kernel<tf32x3> (the 3xTF32 split); the default precision runs that too."""
    import numpy as np

    import cuflash
    from cuflash._cuda import attention, spec

    cp, recorder, encoded = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "F16X2_WGMMA", True)
    rng = np.random.default_rng(5)
    d = 128
    q, k, v = (cp.asarray(rng.standard_normal(shape).astype(np.float32))
               for shape in ((2, 4, 300, d), (2, 250, 2, d), (2, 250, 2, d)))
    q = q.transpose(0, 2, 1, 3)
    tile = spec.TILES[("fwd", "sm90a_f16x2", d)]
    recorder.take_zeroed()
    out = cuflash.attention(q, k, v, causal=True, fp32_precision="fp16x3")
    assert out.dtype == np.float32 and out.shape == (2, 300, 4, d)
    launches = [launch for launch in recorder.take() if len(launch) == 6]
    names = [launch[0].split(",")[0] for launch in launches]
    assert names == (["cuflash::absmax_f32_kernel<128>"] * 3 + ["cuflash::split_f16x2_kernel<128>"] * 3
                     + ["cuflash::flash_fwd_sm90_vt_kernel<cuflash::f16x2"])

    def value(raw):
        return int.from_bytes(raw, "little", signed=True)

    bits = value(launches[0][5][1])
    assert (bits, 12) in recorder.take_zeroed()
    pairs = []
    for i, a in enumerate((q, k, v)):
        absmax, split = launches[i], launches[3 + i]
        assert value(absmax[5][0]) == a.data.ptr and value(absmax[5][1]) == bits + 4 * i
        assert tuple(value(x) for x in absmax[5][2:]) == (a.shape[1], a.shape[2], *a.strides[:3])
        assert split[1] == (-(-a.shape[1] * a.shape[2] * d // 1024), 2, 1)
        assert value(split[5][0]) == a.data.ptr and value(split[5][2]) == bits + 4 * i
        assert np.frombuffer(split[5][3], np.float32)[0] == (2048.0, 2048.0, 1.0)[i]
        assert tuple(value(x) for x in split[5][4:]) == (a.shape[1], a.shape[2], *a.strides[:3])
        pairs.append(value(split[5][1]))
    assert pairs[1] - pairs[0] == q.size * 4 and pairs[2] - pairs[1] == k.size * 4
    assert not set(pairs) & {q.data.ptr, k.data.ptr, v.data.ptr}
    kernel_args = launches[6][5]
    assert value(kernel_args[-5]) == bits  # (the descale pointer, before VariantParams and the three maps)
    (eq, ek, ev) = encoded
    for (ptr, dims, strides, box), a, rows, at in zip((eq, ek, ev), (q, k, v), (tile.block_m, tile.block_n,
                                                                                tile.block_n), pairs):
        n, h = a.shape[1], a.shape[2]
        assert (ptr, dims, strides, box) == (at, (d, n, h, 2), (4 * d * h, 4 * d, 4 * d * h * n), (32, rows, 1, 1))
    encoded.clear()
    cuflash.attention(q, k, v, causal=True, fp32_precision="fp16x3")  # (the plan kept: the same launches)
    assert [launch[0].split(",")[0] for launch in recorder.take() if len(launch) == 6] == names
    for extra in ({"fp32_precision": "fp16x3", "block_q": 64}, {}, {"fp32_precision": "fp16x3"}):
        if len(extra) == 1:
            monkeypatch.setattr(attention, "F16X2_WGMMA", False)
        cuflash.attention(q, k, v, causal=True, **extra)
        assert [launch[0].split(",")[0] for launch in recorder.take()
                if len(launch) == 6] == ["cuflash::flash_fwd_kernel<cuflash::tf32x3"]


def test_tile_counters_outlive_their_plans_and_a_capture_plans_no_persistent_forward(monkeypatch):
    """(CPU, stand-in CuPy) The persistent forward's tile counters come from chunks that are never freed (a CUDA graph
    that captured a launch keeps its counter's address after the front door's memory dropped the plan): distinct
    zeroed counters of one chunk (device memory of its own, not the call's allocator's), the chunk kept when every
    plan is gone. A call first planned during a CUDA graph
    capture takes a counter of the chunk there is; where a new chunk would be needed (none can be made then) it runs
    the one-tile kernel, without a counter. A plan made for one call has a counter of its own."""
    import gc

    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash._cuda import attention
    from cuflash._ops import api as _api

    cp, recorder, encoded = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "PERSISTENT_FORWARD", None)
    rng = np.random.default_rng(6)

    def arr(*shape):
        return cp.asarray(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))

    def counter_of_call(n):
        cuflash.attention(arr(2, n, 4, 128), arr(2, n, 2, 128), arr(2, n, 2, 128))
        (launch,) = [launch for launch in recorder.take() if len(launch) == 6]
        return launch[0].endswith(", true>"), int.from_bytes(launch[5][-4], "little")

    # the chunks from device memory of their own (raw_zeros), never from the call's allocator (zeros: torch's under
    # cuflash.torch, whose CUDA graph trees refuse a pool allocation that outlives the recording)
    raw = []
    runtime = attention.runtime()
    monkeypatch.setattr(runtime, "raw_zeros", lambda count, dtype: raw.append(count) or np.zeros(count, dtype)
                        .view(cp.ndarray))
    calls = [counter_of_call(n) for n in (300, 301, 302)]
    assert raw == [attention._COUNTERS.chunk]
    assert all(persistent for persistent, _ in calls)
    counters = [c for _, c in calls]
    (chunk,) = attention._COUNTERS._kept
    base = int(chunk.data.ptr)
    assert counters == [base, base + 8, base + 16]  # (two int32 each)
    assert not np.asarray(chunk).any()
    _api._checked_calls.clear()
    gc.collect()
    assert attention._COUNTERS._kept == [chunk]  # (the plans gone, the chunk kept)
    stream = cp.cuda.get_current_stream()
    stream.capturing = True
    try:
        # under a capture: a counter of the chunk there is (no new chunk), and with the chunk used up none
        persistent, counter = counter_of_call(303)
        assert persistent and counter == base + 24
        attention._COUNTERS._chunks[0][1] = chunk.size
        persistent, counter = counter_of_call(304)
    finally:
        stream.capturing = False
    assert not persistent and counter == 0 and len(attention._COUNTERS._kept) == 1
    # a plan for one call (not kept by the front door) has a counter of its own
    variant = cuflash._ops.variant.Variant()
    q, k, v = arr(2, 305, 4, 128), arr(2, 305, 2, 128), arr(2, 305, 2, 128)
    plan = attention.ForwardPlan(q, k, v, scale=0.1, variant=variant, block_q=None, block_k=None, kept=False)
    assert plan._launch.spec.family == "fwd_sm90_tma_persistent" and plan._counter is not None
    assert len(attention._COUNTERS._kept) == 1


def test_stream_sinks_keep_what_they_replace():
    """A sink replaced by a larger one (at least twice the old size) or retired with the oldest key is kept, never
    freed: a CUDA graph that captured a launch writing it goes on writing its address."""
    import weakref

    from cuflash._ops.gpu_memory import StreamSinks

    class Buffer:
        pass

    made = []

    def allocate(key, count):
        buffer = Buffer()
        made.append((weakref.ref(buffer), count))
        return buffer, 1000 * len(made)

    sinks = StreamSinks(size=2)
    assert sinks.address("a", 10, allocate) == 1000
    assert sinks.address("a", 8, allocate) == 1000  # (large enough)
    assert sinks.address("a", 11, allocate) == 2000 and made[-1][1] == 20  # (doubled)
    sinks.address("b", 5, allocate)
    sinks.address("c", 5, allocate)  # ("a", the oldest, retired)
    assert len(sinks) == 2 and sinks.buffer("a") is None
    assert all(ref() is not None for ref, _ in made)  # (every buffer ever made still alive)


def test_chunked_prefill_with_the_append_fused_is_one_launch(monkeypatch):
    """(CPU) [prefill append] With FUSED_PREFILL_APPEND a chunked prefill step is one launch, the TMA forward's append
    form, whose arguments hold this step's addresses: VariantParams' key counts are cache_seqlens; PrefillAppend holds
    cache_seqlens, k and v, their element strides, the new tokens' count and the cache's slots; the kernel's k and v
    are the caches; its five maps are q's, the caches' and then k's and v's (boxes of the key tile's rows). A step with
    new k and v arrays points those two maps at them. Off, the append kernel and the forward."""
    import numpy as np

    import cuflash
    from cuflash._cuda import decode
    from cuflash._cuda.spec import PREFILL_APPEND_DTYPE, VARIANT_PARAMS_DTYPE
    from cuflash._ops import api as _api

    cp, recorder, encoded = _tma_stand_in(monkeypatch)
    rng = np.random.default_rng(73)

    def array(shape):
        return cp.asarray(rng.standard_normal(shape).astype(np.float16))

    q = array((2, 64, 8, 128))
    k_cache, v_cache = array((2, 400, 2, 128)), array((2, 400, 2, 128))
    lens = cp.asarray(np.array([300, 100], np.int32))

    def step():
        k, v = array((2, 64, 2, 128)), array((2, 64, 2, 128))
        recorder.take()
        encoded.clear()
        out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
        return k, v, out, [launch for launch in recorder.take() if len(launch) == 6]

    monkeypatch.setattr(decode, "FUSED_PREFILL_APPEND", False)
    _, _, _, launches = step()
    assert [name.split("<")[0] for name, *_ in launches] == ["cuflash::decode_append_kernel",
                                                           "cuflash::flash_fwd_sm90_tma_kernel"]
    monkeypatch.setattr(decode, "FUSED_PREFILL_APPEND", True)
    _api._kvcache_launches.clear()
    decode._LAUNCHES.clear()
    for i in range(3):
        k, v, out, launches = step()
        assert [name.split("<")[0] for name, *_ in launches] == ["cuflash::flash_fwd_sm90_tma_append_kernel"]
        name, grid, block, smem, stream, args = launches[0]
        assert [int.from_bytes(a, "little") for a in args[:4]] == [q.data.ptr, k_cache.data.ptr, v_cache.data.ptr,
                                                                   out.data.ptr]
        assert np.frombuffer(args[-7], VARIANT_PARAMS_DTYPE)[0]["seqused_k"] == lens.data.ptr
        record = np.frombuffer(args[-6], PREFILL_APPEND_DTYPE)[0]
        assert (record["cache_seqlens"], record["k_new"], record["v_new"]) == (lens.data.ptr, k.data.ptr, v.data.ptr)
        assert (record["kn_sb"], record["kn_ss"], record["kn_sh"]) == tuple(x // 2 for x in k.strides[:3])
        assert (record["vn_sb"], record["vn_ss"], record["vn_sh"]) == tuple(x // 2 for x in v.strides[:3])
        assert (record["seqlen_new"], record["capacity"]) == (64, 400)
        assert (record["k_cache"], record["v_cache"]) == (k_cache.data.ptr, v_cache.data.ptr)
        assert grid == (1, 8, 2)  # (one tile a block: 64 query rows; heads; batch)
        if i == 0:  # planned: the five maps
            assert [e[0] for e in encoded] == [q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, k.data.ptr, v.data.ptr]
            assert [e[3][1] for e in encoded][3:] == [encoded[1][3][1]] * 2
        else:  # new k and v: their maps pointed at them
            assert [e[0] for e in encoded] == [k.data.ptr, v.data.ptr]
    launch = next(iter(_api._kvcache_launches._entries.values()))
    assert isinstance(launch, decode.ChunkedPrefillLaunch) and launch._fused_append and launch._append is None


@pytest.mark.parametrize("seqlen_q", [1, 64], ids=["decode", "chunked-prefill"])
def test_rotary_steps_rotate_by_one_kernel_into_the_launchs_copies(monkeypatch, seqlen_q):
    """(CPU) [decode rotary] A rotary step's first launch is decode_rotary_kernel, one block per row of q and of the new
    k, its record holding the step's q, k, tables (their strides and shape) and lengths, and the launch's own
    contiguous copies and guarded lengths, which the next launches read in place of q, k and cache_seqlens (the decode
    kernels' record; chunked prefill's forward, whose append is fused): the same copies at every step, so that a step
    with out= allocates nothing. Tables
    of another type than float32 or q's: no rotary kernel (CuPy array operations)."""
    import numpy as np

    import cuflash
    from cuflash._cuda import decode
    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE, ROTARY_PARAMS_DTYPE
    from cuflash._ops import api as _api

    cp, recorder, _ = _tma_stand_in(monkeypatch)
    rng = np.random.default_rng(74)

    def array(shape, dtype=np.float16):
        return cp.asarray(rng.standard_normal(shape).astype(dtype))

    q = array((2, seqlen_q, 8, 128))
    k_cache, v_cache = array((2, 400, 2, 128)), array((2, 400, 2, 128))
    lens = cp.asarray(np.array([100, 200], np.int32))
    cos, sin = array((500, 24), np.float32)[::2], array((250, 40), np.float32)[:, :24]  # (tables of other row strides)
    out = cp.empty((2, seqlen_q, 8, 128), dtype=np.float16)
    copies = None
    for step in range(2):
        k, v = array((2, seqlen_q, 2, 128)), array((2, seqlen_q, 2, 128))
        recorder.take()
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin,
                                       rotary_interleaved=False, causal=True, out=out)
        launches = [launch for launch in recorder.take() if len(launch) == 6]
        assert launches[0][0] == "cuflash::decode_rotary_kernel<cuflash::fp16, float>", launches[0][0]
        assert launches[0][1] == (2 * 2 * seqlen_q, 1, 1) and launches[0][2] == (128, 1, 1)
        rec = np.frombuffer(launches[0][5][0], ROTARY_PARAMS_DTYPE)[0]
        assert (rec["q"], rec["k_new"], rec["cos"], rec["sin"], rec["cache_seqlens"]) == (
            q.data.ptr, k.data.ptr, cos.data.ptr, sin.data.ptr, lens.data.ptr)
        assert (rec["cos_s0"], rec["cos_s1"], rec["sin_s0"], rec["sin_s1"]) == (48, 1, 40, 1)
        assert (rec["half"], rec["seqlen_ro"], rec["interleaved"], rec["consecutive_q"]) == (24, 250, 0, 1)
        assert (rec["q_sb"], rec["q_ss"], rec["q_sh"]) == (seqlen_q * 8 * 128, 8 * 128, 128)
        assert (rec["seqlen_q"], rec["seqlen_new"], rec["heads_q"], rec["heads_kv"], rec["head_dim"]) == (
            seqlen_q, seqlen_q, 8, 2, 128)
        (launch,) = _api._kvcache_launches._entries.values()
        rotated = launch._rotary_step
        assert (rec["q_rot"], rec["k_rot"], rec["seqlens_out"]) == (rotated.q_rot.data.ptr, rotated.k_rot.data.ptr,
                                                                    rotated.seqlens.data.ptr)
        assert rotated.q_rot.flags.c_contiguous and rotated.k_rot.shape == k.shape
        if copies is not None:
            assert copies == (rotated.q_rot.data.ptr, rotated.k_rot.data.ptr)  # (the same copies at every step)
        copies = (rotated.q_rot.data.ptr, rotated.k_rot.data.ptr)
        if seqlen_q == 1:  # the split kernel, appending (fused): its record reads the copies
            assert [name.split("<")[0] for name, *_ in launches[1:]] == ["cuflash::flash_decode_kernel"]
            drec = np.frombuffer(launches[1][5][0], DECODE_PARAMS_DTYPE)[0]
            assert (drec["q"], drec["k_new"], drec["v_new"]) == (*copies, v.data.ptr)
            assert drec["cache_seqlens"] == rotated.seqlens.data.ptr  # (the lengths the rotary kernel guarded)
            assert launch.launches_per_step == 2
        else:  # chunked prefill: the forward, appending the copy of k
            assert [name.split("<")[0] for name, *_ in launches[1:]] == ["cuflash::flash_fwd_sm90_tma_append_kernel"]
            assert int.from_bytes(launches[1][5][0], "little") == copies[0]
    # tables of float64: rotated by CuPy array operations (no rotary kernel)
    monkeypatch.setattr(decode, "ROTARY_KERNEL", True)
    launch = decode.DecodeLaunch(q[:, :1], k_cache, v_cache, k[:, :1], v[:, :1], cache=_api._kvcache_call(
        q[:, :1], k_cache, v_cache, k[:, :1], v[:, :1], cache_seqlens=lens, rotary_cos=cos.astype(np.float64),
        rotary_sin=sin.astype(np.float64), rotary_interleaved=True, cache_batch_idx=None, cache_leftpad=None,
        block_table=None, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None,
        num_splits=0, out=None)[2], scale=0.1, variant=cuflash._ops.variant.Variant(causal=True))
    assert launch._rotary_step is None


def test_the_backward_adds_dq_a_tile_at_a_time_where_switched_on(monkeypatch):
    """(CPU, stand-in CuPy) [bwd dq tile] With BWD_DQ_TILE (the kernels' CUFLASH_BWD_DQ_TILE), a planned backward whose
    dK/dV launch is the TMA entry point pads dQ's float32 planes to whole 64-row tiles (200 rows: 256) and converts
    them with flash_bwd_convert_dq_tiles_kernel, a block a tile; its flat calls (the cp.async kernel, rows in order)
    keep the unpadded planes and flash_bwd_convert_dq_kernel; without the switch, the row-order conversion."""

    from cuflash._cuda import attention
    from cuflash._ops.variant import Variant

    cp, recorder, _ = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)
    q, k, v, do, out, lse = _backward_inputs(cp, 13, 128)

    def plan():
        return attention.BackwardPlan(do, q, k, v, out, lse, scale=0.1, variant=Variant(causal=True), algorithm="fa2",
                                      block_q=None, block_k=None, order="kv_outer")

    for on in (True, False):
        monkeypatch.setattr(attention, "BWD_DQ_TILE", on)
        recorder.take()
        p = plan()
        names = [step[0].spec.name.split("<")[0] for step in p._steps]
        assert names[1] == "cuflash::flash_bwd_dkdv_sm90_tma_kernel"
        convert = names[2]
        assert convert == ("cuflash::flash_bwd_convert_dq_tiles_kernel" if on else "cuflash::flash_bwd_convert_dq_kernel")
        grid = p._steps[2][0].grid
        assert tuple(grid) == ((4, 4, 2) if on else (-(-200 * 128 // 2 // 256), 4, 2))
        # the workspace: dQ's planes (padded when on: 2 x 4 x 256 x 128 floats), the GQA sums, then D
        dq_bytes = 2 * 4 * (256 if on else 200) * 128 * 4
        assert p._offsets[1] == 0 and p._offsets[2] == dq_bytes
        calls, workspace = p.flat_calls()
        flat_names = [name.split("<")[0] for _, name, _, _ in calls]
        assert flat_names[1] == "cuflash::flash_bwd_dkdv_sm90_flat_kernel"  # (VariantParams' fields, no counter)
        assert flat_names[2] == "cuflash::flash_bwd_convert_dq_kernel"
        assert workspace["dq_accum"] == (2, 4, 200, 128)
        # (a run: D's launch zeroes the padded planes from the workspace's start, no memset)
        recorder.take()
        p.run(do, q, k, v, out, lse)
        pre, dkdv = recorder.take()[:2]
        assert pre[0].startswith("cuflash::flash_bwd_preprocess_kernel") and p._zero_bytes == 0
        assert int.from_bytes(pre[5][-1], "little") * 16 == dq_bytes
        assert pre[5][-2] == dkdv[5][6]  # (dK/dV's dq_accum argument)


def test_the_d64_backward_on_128_row_query_tiles_where_switched_on(monkeypatch):
    """(CPU, stand-in CuPy) [bwd rows 128] With BWD_ROWS128 (on by default), a planned d-64 backward's TMA
    dK/dV launch takes 128-row query tiles: Q's and dO's maps copy 128-row boxes, dQ's planes are padded to whole
    128-row tiles (200 rows: 256) and converted a block a 128-row tile; the split order (no dQ in the launch), the flat
    twin (rows in order) and a softcap keep the table's 64-row tile."""

    from cuflash._cuda import attention
    from cuflash._ops.variant import Variant

    cp, _, _ = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)
    monkeypatch.setattr(attention, "BWD_DQ_TILE", True)
    monkeypatch.setattr(attention, "BWD_ROWS128", True)
    q, k, v, do, out, lse = _backward_inputs(cp, 23, 64)
    for order, rows in (("kv_outer", 128), ("split", 64)):
        p = attention.BackwardPlan(do, q, k, v, out, lse, scale=0.125, variant=Variant(causal=True), algorithm="fa2",
                                   block_q=None, block_k=None, order=order)
        dkdv = p._steps[1][0]
        assert dkdv.spec.family.startswith("bwd_dkdv_sm90_tma") and dkdv.spec.tile.block_m == rows  # ([bwd persistent])
        assert [m._spec[2][1] for m, _ in p._maps] == [rows, 128, 128, rows]  # (the boxes' rows: q, k, v, dO)
        if order == "kv_outer":
            convert = p._steps[2][0]
            assert convert.spec.name.startswith("cuflash::flash_bwd_convert_dq_tiles_kernel<cuflash::bf16, 64, 128>")
            assert tuple(convert.grid) == (2, 4, 2)
            assert p._offsets[1] == 0 and p._offsets[2] == 2 * 4 * 256 * 64 * 4  # (dQ's padded planes, then GQA's)
            calls, workspace = p.flat_calls()
            names = [name.split("<")[0] for _, name, _, _ in calls]
            assert names[1:3] == ["cuflash::flash_bwd_dkdv_sm90_flat_kernel", "cuflash::flash_bwd_convert_dq_kernel"]
            assert ", 64, 64, 128, 8, 2," in calls[1][1] and workspace["dq_accum"] == (2, 4, 200, 64)
    # (softcap's d mod / d s would spill at 128 rows: 64)
    p = attention.BackwardPlan(do, q, k, v, out, lse, scale=0.125, variant=Variant(causal=True, softcap=30.0),
                               algorithm="fa2", block_q=None, block_k=None, order="kv_outer")
    assert p._steps[1][0].spec.tile.block_m == 64


def test_the_persistent_backward_takes_the_key_tiles_from_one_block_per_sm(monkeypatch):
    """(CPU, stand-in CuPy) [bwd persistent] At a head dim of BWD_PERSISTENT_DIMS, a planned backward whose dK/dV
    launch is the TMA entry point runs it persistent (flash_bwd_dkdv_sm90_tma_kernel<..., true>): one block per SM (at
    most one per key tile) in a one-dimensional grid, its `interleave` argument the order's pairs plus 256 times the
    batch, and a tile counter of its own after VariantParams (two zeroed int32 from the kept chunks, a different one
    for each plan); its flat calls keep a block per key tile; at other head dims, the (key tiles, heads, batch) grid
    and a null counter."""
    import numpy as np

    from cuflash._cuda import attention
    from cuflash._ops.variant import Variant

    cp, _, _ = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)
    counters = set()
    for batch, nk, causal in ((3, 300, True), (1, 130, False)):
        q, k, v, do, out, lse = _backward_inputs(cp, 17, 128, batch, nk)
        tiles = -(-nk // attention.TILES[("bwd", "sm90a", 128)].block_n)
        for on in (True, False):
            monkeypatch.setattr(attention, "BWD_PERSISTENT_DIMS", (128,) if on else (64,))
            p = attention.BackwardPlan(do, q, k, v, out, lse, scale=0.1, variant=Variant(causal=causal),
                                       algorithm="fa2", block_q=None, block_k=None, order="kv_outer")
            launch = p._steps[1][0]
            assert launch.spec.family == ("bwd_dkdv_sm90_tma_persistent" if on else "bwd_dkdv_sm90_tma")
            assert launch.spec.name.endswith(", true, true>" if on else ", true>")  # (has_dq, persistent)
            interleave = int(np.frombuffer(launch._buffer[launch.offsets[14]:launch.offsets[14] + 4], np.int32)[0])
            # (the counter: the last argument before the maps)
            counter = int(np.frombuffer(launch._buffer[launch.offsets[-1]:launch.offsets[-1] + 8], np.uint64)[0])
            order = 4 if causal else 1
            if on:
                assert launch.grid == (min(tiles * 4 * batch, 132), 1, 1) and interleave == order + 256 * batch
                assert counter != 0 and counter not in counters
                counters.add(counter)
            else:
                assert launch.grid == (tiles, 4, batch) and interleave == order and counter == 0
            calls, _ = p.flat_calls()
            (dkdv,) = [c for c in calls if "dkdv" in c[1]]
            assert "sm90_flat_kernel" in dkdv[1] and tuple(dkdv[2]) == (tiles, 4, batch)
            assert dkdv[3][14] == ("i32", order)  # (q ... dkv_accum, rows_q, rows_k, heads_q, group, interleave)


def test_the_d256_backward_on_the_wgmma_kernel_where_switched_on(monkeypatch):
    """(CPU, stand-in CuPy) [bwd shared keys] With BWD_SM90_D256 (the default), a planned d-256 backward's
    dK/dV launch is the wgmma kernel's TMA entry point on d 256's row (both warpgroups on 64 keys): 226 KiB of shared
    memory, dQ added row by row into unpadded planes (no whole-tile dQ: the tile would not fit) and converted by
    flash_bwd_convert_dq_kernel; a head dim of 200 runs it padded; off (CUFLASH_DEFINES=CUFLASH_BWD_SM90_D256=0), the
    mma.sync kernel."""
    from cuflash._cuda import attention
    from cuflash._cuda.spec import TILES, Tile
    from cuflash._ops.variant import Variant

    cp, _, _ = _tma_stand_in(monkeypatch)
    monkeypatch.setattr(attention, "TMA_BACKWARD", True)
    assert TILES[("bwd", "sm90a", 256)] == Tile(64, 64, 8, 2)
    for on, d in ((True, 256), (True, 200), (False, 256)):
        monkeypatch.setattr(attention, "BWD_SM90_D256", on)
        q, k, v, do, out, lse = _backward_inputs(cp, 29, d)
        p = attention.BackwardPlan(do, q, k, v, out, lse, scale=0.1, variant=Variant(causal=True), algorithm="fa2",
                                   block_q=None, block_k=None, order="kv_outer")
        dkdv, convert = p._steps[1][0].spec, p._steps[2][0].spec
        if not on:
            assert dkdv.family == "bwd_dkdv", dkdv.name
            continue
        assert dkdv.family == "bwd_dkdv_sm90_tma" and dkdv.tile == Tile(64, 64, 8, 2) and dkdv.head_dim == 256
        assert dkdv.smem == 231488 and convert.family == "bwd_convert_dq"
        assert [m._spec[2][1] for m, _ in p._maps] == [64, 64, 64, 64]  # (the boxes' rows: q, k, v, dO)
        assert p._offsets[1] == 0 and p._offsets[2] == -(-2 * 4 * 200 * 256 * 4 // 256) * 256  # (dQ's planes unpadded)
