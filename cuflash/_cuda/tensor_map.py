"""Tensor memory access (TMA) descriptors: a ``CUtensorMap`` made by the driver's ``cuTensorMapEncodeTiled`` (through
ctypes: CuPy does not wrap it), for kernels that copy tiles with ``cp.async.bulk.tensor`` (decode_sm90.cu's MLA
kernel, forward_sm90.cu's TMA entry point). A map holds its tensor's global address, so it changes when the tensor
moves; it is passed by value as a ``__grid_constant__`` kernel argument (128 bytes), which cuLaunchKernel copies at
each launch.

A map's layout is the driver's (opaque); an encode through ctypes takes 3-4 us, three of them a forward call whose
arrays are new (H200). So the launchers learn where this driver keeps the address (:func:`address_field`: one 64-bit
word, the address or the address shifted right, every other byte unchanged, checked bit by bit) and write a new
address into that word; each map checks the rule once more on its own encoding before it relies on it, and encodes
at every address where either check fails."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

# CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill
_UINT8 = 0             # 8-bit elements (e4m3)
_UINT16 = 1            # 16-bit elements copied as such (float16 and bfloat16 alike)
_UINT32 = 2            # 32-bit elements (float32: [tf32]; CU_TENSOR_MAP_DATA_TYPE_UINT32)
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3      # hopper_tiles.cuh's 128-byte-swizzled layout, for boxes 128 bytes wide
_L2_PROMOTION_128B = 2
_OOB_ZEROS = 0         # boxes past the tensor's edges read zeros


@functools.cache
def _encode_tiled():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


# address_field's probes: the base address (16-byte aligned, never dereferenced: the encoder only records it; every
# other bit set, so that no flipped probe is the null address) and the address bits flipped one at a time.
_PROBE_BASE = 0x5555_5555_5550
_PROBE_BITS = range(4, 48)
_WORD = (1 << 64) - 1
# The bits of an address that TensorMap.point writes only when zero: below 16-byte alignment, and above the probed ones
# (such an address is encoded).
_UNPROBED = _WORD ^ ((1 << _PROBE_BITS.stop) - (1 << _PROBE_BITS.start))


def _encode(words, dtype: int, spec: tuple, args: tuple, ptr: int) -> int:
    """cuTensorMapEncodeTiled into ``words`` (a map's 16 uint64 words, 64-byte aligned): its CUresult."""
    return _encode_tiled()(int(words.ctypes.data), dtype, len(spec[0]), ptr, *args, _INTERLEAVE_NONE, _SWIZZLE_128B,
                           _L2_PROMOTION_128B, _OOB_ZEROS)


def _field_of(before, after, delta: int):
    """``(word, shift)`` where ``after`` (the map encoded ``delta`` bytes further, a signed count) differs from
    ``before`` in one word alone, by ``delta >> shift`` modulo 2**64 (shift 0-4: the address's low 4 bits are
    zero), else None."""
    changed = [i for i in range(16) if before[i] != after[i]]
    if len(changed) != 1:
        return None
    (i,) = changed
    for shift in range(5):
        if (int(after[i]) - int(before[i])) & _WORD == (delta >> shift) & _WORD:
            return i, shift
    return None


@functools.cache
def address_field() -> tuple[int, int] | None:
    """``(word, shift)``: the 64-bit word of a map that holds its global address, as ``base + (address >> shift)``,
    every other byte independent of the address, learnt from this driver's encodings of one map at
    :data:`_PROBE_BASE` and at every address bit flipped in turn; None where any probe does not fit the rule (the
    maps are then encoded at every address). Raises RuntimeError, remembering nothing, where the driver encodes no
    map at all (not initialized yet)."""
    spec = ((64, 256, 4, 2), (128, 128 * 256, 128 * 256 * 4), (64, 64, 1, 1))
    probe = TensorMap(*spec)
    base = np.empty(16, np.uint64)
    result = _encode(probe.words, _UINT16, probe._spec, probe._args, _PROBE_BASE)
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {result}) at the probe's base address")
    base[:] = probe.words
    field = None
    for bit in _PROBE_BITS:
        ptr = _PROBE_BASE ^ (1 << bit)
        if _encode(probe.words, _UINT16, probe._spec, probe._args, ptr) != 0:
            return None
        found = _field_of(base, probe.words, ptr - _PROBE_BASE)
        if found is None or (field is not None and found != field):
            return None
        field = found
    return field


@functools.cache
def available() -> bool:
    """Whether the driver has cuTensorMapEncodeTiled (CUDA 12 and later); without it the kernels copy with cp.async."""
    try:
        _encode_tiled()
    except (OSError, AttributeError):
        return False
    return True


class TensorMap:
    """The map of a 16-bit tensor (8- or 32-bit with ``element_bytes`` 1 or 4) of ``dims`` elements (innermost
    first) with ``strides`` bytes between the steps of each outer dimension, copied in boxes of ``box`` elements (the
    innermost 128 bytes wide: the 128-byte swizzle), at the address :meth:`point` gives. :attr:`address` is the host
    address of its 128 bytes (64-byte aligned), a kernel argument; ``TensorMap(None)`` is an unused one (zeros: a kernel that takes the argument and reads it not)."""

    def __init__(self, dims: tuple | None, strides: tuple = (), box: tuple = (), element_bytes: int = 2):
        self._storage = np.zeros(24, dtype=np.uint64)  # 192 bytes: a 64-byte aligned 128 inside
        start = (-self._storage.ctypes.data % 64) // 8
        self.words = self._storage[start:start + 16]
        self.address = int(self.words.ctypes.data)
        self._spec = None if dims is None else (tuple(dims), tuple(strides), tuple(box))
        if self._spec is not None:
            assert len(strides) == len(dims) - 1 == len(box) - 1 and box[0] * element_bytes == 128
            assert all(s % 16 == 0 for s in strides), strides
            rank = len(dims)
            # (the encoder's arguments but the address, made once: point encodes with them where it cannot write the address)
            self._args = ((ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
                          (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)))
        self._pointed = None
        self._dtype = {1: _UINT8, 2: _UINT16, 4: _UINT32}[element_bytes]
        self._word = memoryview(self.words).cast("B").cast("Q")  # (item assignment: the cheapest write there is)
        self._field = self._shift = 0
        self._base: int | None = None  # the address word's base where the layout is known and checked

    @property
    def mapped(self) -> bool:
        """False for the unused map (``TensorMap(None)``)."""
        return self._spec is not None

    def point(self, ptr: int) -> None:
        """Point the map at device address ``ptr`` (the last one is kept): its address word rewritten where the
        driver's layout is known (:func:`address_field`, checked on this map's first encoding), else encoded."""
        if ptr == self._pointed or self._spec is None:
            return
        if self._base is not None and not ptr & _UNPROBED:
            self._word[self._field] = (self._base + (ptr >> self._shift)) & _WORD
        else:
            result = _encode(self.words, self._dtype, self._spec, self._args, ptr)
            if result != 0:
                dims, strides, box = self._spec
                raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {result}) for dims {dims}, strides "
                                   f"{strides}, box {box} at address {ptr:#x}")
            if self._pointed is None:
                self._learn(ptr)
        self._pointed = ptr

    def _learn(self, ptr: int) -> None:
        """After the first encoding (at ``ptr``): where :func:`address_field` is known, check it on this map (the
        encoding at another address must be this one with the address word alone changed, as the rule says), and
        keep the word's base for :meth:`point`."""
        try:
            field = address_field()
        except RuntimeError:
            return
        if field is None:
            return
        first = self.words.copy()
        other = ptr ^ (1 << 20)
        if (_encode(self.words, self._dtype, self._spec, self._args, other) == 0
                and _field_of(first, self.words, other - ptr) == field):
            word, shift = field
            self._field, self._shift, self._base = word, shift, (int(first[word]) - (ptr >> shift)) & _WORD
        self.words[:] = first
