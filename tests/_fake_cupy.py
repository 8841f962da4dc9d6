"""A stand-in ``cupy`` module for CPU tests of the CUDA launcher's host side: arrays are NumPy arrays of a subclass
whose module is ``cupy`` (host memory standing in for device memory, ``.data.ptr`` its address), and nothing is
compiled or launched: every launch is recorded instead, with its arguments' bytes, so that a test can compare what
two calls would run. Installed by :func:`install` (the ``fake_cupy`` fixture of the tests that use it).
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np


class _Memory:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr):
        self.ptr, self.device_id = ptr, 0


class _Device:
    id = 0


class ndarray(np.ndarray):
    device = _Device()

    def __array_finalize__(self, obj):
        self._memory = _Memory(self.__array_interface__["data"][0])

    @property
    def data(self):
        return self._memory

    def get(self):
        return np.asarray(self).view(np.ndarray).copy()


ndarray.__module__ = "cupy"


def _wrap(x):
    return x.view(ndarray) if isinstance(x, np.ndarray) and not isinstance(x, ndarray) else x


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr
        self.capturing = False  # (a test may pretend a CUDA graph capture)

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        pass


class Recorder:
    """The launches since the last :meth:`take`: ``(kernel name, grid, block, shared memory, stream, [bytes of each
    argument])`` for launches through the driver (planned), ``(spec name, grid, args)`` for CuPy launches; and the
    memory zeroed since the last :meth:`take_zeroed`."""

    def __init__(self):
        self.launches = []
        self.programmatic = []  # [pdl] the indices in launches of those launched with programmatic serialization
        self.names = {}  # function handle -> kernel name
        self.zeroed = []  # (address, bytes) of what cupy.zeros allocated and memsetAsync zeroed
        # keep_zeroed: cupy.zeros' arrays kept alive until take_zeroed, so that a later allocation of the call (an upcast
        # path's astype of its result) cannot reuse their memory and pass for zeroed memory (attributed by address)
        self.keep_zeroed = False
        self._zeroed_arrays = []

    def take(self):
        out, self.launches, self.programmatic = self.launches, [], []
        return out

    def take_zeroed(self):
        out, self.zeroed, self._zeroed_arrays = self.zeroed, [], []
        return out


def install(monkeypatch):
    """Put a stand-in ``cupy`` in ``sys.modules`` and make the CUDA backend use it: its planned launches go to a
    :class:`Recorder` (returned; the decode launcher's too), a fixed sm_90 device, the front door's and the launchers'
    caches emptied."""
    from cuflash._ops import api as _api, kvcache as _kvcache
    from cuflash._cuda import attention, compile, decode, fa1, spec, tensor_map, vt

    recorder = Recorder()
    module = types.ModuleType("cupy")
    for name in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "inf", "nan"):
        setattr(module, name, getattr(np, name))
    module.ndarray = ndarray
    for name in ("empty", "zeros", "ones", "full", "zeros_like", "empty_like", "arange", "where", "concatenate",
                 "stack"):
        setattr(module, name, (lambda fn: lambda *a, **k: _wrap(fn(*a, **k)))(getattr(np, name)))

    def zeros(*args, **kwargs):
        a = _wrap(np.zeros(*args, **kwargs))
        recorder.zeroed.append((a.data.ptr, a.nbytes))
        if recorder.keep_zeroed:
            recorder._zeroed_arrays.append(a)
        return a

    def memset(ptr, value, size, stream):
        ctypes.memset(ptr, value, size)
        recorder.zeroed.append((ptr, size))

    module.zeros = zeros
    module.ascontiguousarray = lambda a, dtype=None: _wrap(np.ascontiguousarray(a, dtype=dtype))
    module.asarray = lambda a, dtype=None: _wrap(np.array(a, dtype=dtype)) if not isinstance(a, ndarray) or (
        dtype is not None and a.dtype != dtype) else a
    module.broadcast_to = lambda a, shape: np.broadcast_to(a, shape, subok=True)
    stream = _Stream(0)

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream_ptr, argv, extra):
        spec = recorder.names[fn]
        pointers = (ctypes.c_uint64 * len(spec["sizes"])).from_address(argv)
        args = [ctypes.string_at(p, size) for p, size in zip(pointers, spec["sizes"])]
        recorder.launches.append((spec["name"], (gx, gy, gz), (bx, by, bz), smem, stream_ptr, args))

    def launch_programmatic(self, config, fn, argv):  # [pdl] cuLaunchKernelEx: recorded as a launch, its index noted
        grid, block, smem, stream_ptr = compile.unpack_config(config)
        recorder.programmatic.append(len(recorder.launches))
        launch_kernel(fn, *grid, *block, smem, stream_ptr, argv, 0)

    module.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0, memGetInfo=lambda: (0, 0), getDeviceCount=lambda: 1,
                                      memsetAsync=memset, memcpyDeviceToDevice=3,
                                      memcpyAsync=lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size)),
        get_current_stream=lambda: stream,
        driver=types.SimpleNamespace(launchKernel=launch_kernel),
    )
    monkeypatch.setitem(sys.modules, "cupy", module)

    class Runtime(decode.CupyRuntime):

        def function(self, spec):
            handle = 0x1000 + len(recorder.names)
            recorder.names[handle] = {"name": spec.name, "sizes": None}
            self._last = handle
            return handle, None

    def decode_function(self, spec):  # the decode launcher's kernels, which take one argument: the DecodeParams record
        handle = 0x1000 + len(recorder.names)  # (or the rotary kernel's RotaryParams)
        record = decode.ROTARY_PARAMS_DTYPE if spec.family == "decode_rotary" else decode.DECODE_PARAMS_DTYPE
        recorder.names[handle] = {"name": spec.name, "sizes": [record.itemsize]}
        return handle, None

    original_init = compile.PackedLaunch.__init__

    def packed_init(self, runtime, spec, grid, args, more=()):
        original_init(self, runtime, spec, grid, args, more)
        recorder.names[self.fn]["sizes"] = [
            -(-(np.asarray(a).dtype.itemsize if isinstance(a, np.generic) else 8) // 8) * 8 for a in args
        ] + [128] * len(more)  # (more: tensor maps)

    def cupy_launch(spec, grid, args):
        recorder.launches.append((spec.name, tuple(grid), args))

    monkeypatch.setattr(compile.PackedLaunch, "__init__", packed_init)
    monkeypatch.setattr(attention, "launch", cupy_launch)
    monkeypatch.setattr(compile, "launch", cupy_launch)
    monkeypatch.setattr(fa1, "launch", cupy_launch)
    monkeypatch.setitem(compile._device_cache, 0, (90, 227 * 1024))
    monkeypatch.setitem(compile._sm_counts, 0, 132)  # (an H100 SXM's: the persistent kernels' grids)
    # (no driver: no tensor maps; a test that wants them stands in for the encoder, tests/test_tensor_map.py)
    monkeypatch.setattr(tensor_map, "available", lambda: False)
    monkeypatch.setattr(attention, "_RUNTIME", Runtime())
    monkeypatch.setattr(spec, "_EXTRA_CACHE", {})  # (device copies: the stand-in's must not outlive the test)
    monkeypatch.setattr(attention, "_LISTS_CACHE", {})
    monkeypatch.setattr(attention, "_LSE_SINKS", type(attention._LSE_SINKS)())
    monkeypatch.setattr(attention, "_COUNTERS", type(attention._COUNTERS)())
    monkeypatch.setattr(_api, "_planners", {})
    monkeypatch.setattr(_api, "_checked_calls", _api.CallMemo(_api._checked_calls.size))
    monkeypatch.setattr(_api, "_fp8_calls", _api.CallMemo(_api._fp8_calls.size))
    monkeypatch.setattr(vt, "_PLANS", _api.CallMemo(vt._PLANS.size))
    monkeypatch.setattr(vt, "_ONES", {})
    monkeypatch.setattr(decode.CupyRuntime, "function", decode_function)
    monkeypatch.setattr(decode.CupyRuntime, "launch_programmatic", launch_programmatic)
    monkeypatch.setattr(decode.CupyRuntime, "prepare_programmatic", lambda self: None)
    # (memory of a launch's own, outside a capture: the stand-in's, NumPy's)
    monkeypatch.setattr(decode, "own_memory", lambda shape, dtype, device=None: zeros(shape, dtype=dtype))
    monkeypatch.setattr(decode, "_LAUNCHES", type(decode._LAUNCHES)())
    monkeypatch.setattr(_api, "_kvcache_launches", _api.CallMemo(_api._kvcache_launches.size))
    monkeypatch.setattr(_kvcache, "_SEQLEN_TABLES", {})
    try:  # cuflash.torch's launches of decode steps like ones already run: the stand-in's must not outlive the test
        import cuflash.torch as cuflash_torch
    except ImportError:
        pass
    else:
        for name in ("_decode_launches", "_forward_plans", "_heads_first_steps", "_heads_first_plans"):
            monkeypatch.setattr(cuflash_torch, name, _api.CallMemo(getattr(cuflash_torch, name).size))
    return module, recorder
