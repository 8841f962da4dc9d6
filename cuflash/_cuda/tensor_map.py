"""Tensor memory access (TMA) descriptors: a ``CUtensorMap`` made by the driver's ``cuTensorMapEncodeTiled`` (through
ctypes: CuPy does not wrap it), for kernels that copy tiles with ``cp.async.bulk.tensor`` (decode_sm90.cu's MLA
kernel, forward_sm90.cu's TMA entry point). A map holds its tensor's global address, so it is encoded again when the
tensor moves; it is passed by value as a ``__grid_constant__`` kernel argument (128 bytes), which cuLaunchKernel
copies at each launch."""

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
            # (the encoder's arguments but the address, made once: a call re-encodes at every new address)
            self._args = ((ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
                          (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)))
        self._pointed = None
        self._dtype = {1: _UINT8, 2: _UINT16, 4: _UINT32}[element_bytes]

    @property
    def mapped(self) -> bool:
        """False for the unused map (``TensorMap(None)``)."""
        return self._spec is not None

    def point(self, ptr: int) -> None:
        """Encode the map for a tensor at device address ``ptr`` (once per address: the last one is kept)."""
        if ptr == self._pointed or self._spec is None:
            return
        dims, strides, box = self._spec
        result = _encode_tiled()(self.address, self._dtype, len(dims), ptr, *self._args, _INTERLEAVE_NONE,
                                 _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_ZEROS)
        if result != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {result}) for dims {dims}, strides {strides}, "
                               f"box {box} at address {ptr:#x}")
        self._pointed = ptr
