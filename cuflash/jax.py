"""JAX front end: :func:`attention` as a ``jax.custom_vjp`` function.

Concrete arrays cross into cuflash through DLPack without copies: GPU arrays into CuPy (the CUDA
kernels), CPU arrays into NumPy (the NumPy block algorithm). Under ``jax.jit`` the inputs are tracers,
which no foreign library can read; there the call becomes a callback in the compiled function, by one of
two routes (:func:`callback_route`):

- ``"buffer"`` (where ``jax.experimental.buffer_callback`` exists): XLA hands the callback its device
  buffers and, on a GPU, its CUDA stream. The buffers are seen as CuPy arrays in place and the kernels are
  queued on XLA's stream: no host round trip, no synchronization, nothing for ``jax.transfer_guard`` to
  refuse. The call is checked and planned once (its first run); the forward's kernel then writes into XLA's
  output buffers, while the backward's gradients and the results of calls the launcher does not plan are
  copied into them (a device-to-device copy each, on the same stream). On the CPU the same callback runs the
  NumPy algorithm on the buffers.
- ``"pure"`` (older JAX, or ``CUFLASH_JAX_CALLBACK=pure``): ``jax.pure_callback`` to the host
  implementation, correct everywhere, but on a GPU a copy through host memory each way.

The forward saves the logsumexp for the backward. ``jax.vmap`` (with ``grad`` and ``jit`` around it) folds
the mapped axis into the batch axis and makes one call of the kernels (``jax.custom_batching.custom_vmap``),
for padded batches without dropout, ``score_mod`` or ``mask_mod`` (the kernels read the batch index there);
with the variant arrays broadcast or folded likewise, except a mapped ``bias`` in the backward. Every other
case runs one call per mapped element (``vmap_method="sequential"``), so any argument may be mapped or not.

The variant arrays (``alibi_slopes``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``, ``attn_mask``) travel
with q, k, v (through DLPack, or into the callback under ``jit``) and get no gradient; ``bias`` travels the
same way and is differentiated (the custom_vjp returns its gradient). Under ``jit`` their values are
tracers too: their shapes and dtypes are checked when the function is traced, their values (cu_seqlens
start at 0, grow, end at the row count; seqused_k in range) only when the compiled function runs, where a
bad value raises from inside the callback. ``max_seqlen_q``, ``max_seqlen_k``, ``window_size`` and
``softcap`` are Python values, static under ``jit``; so are ``dropout_p``, ``dropout_seed`` and
``dropout_offset``. JAX has no global random generator: dropout needs an explicit integer ``dropout_seed``
(draw one from a ``jax.random`` key outside the function, or pass a counter), and the backward reuses the
forward's seed and offset.

Importing :mod:`cuflash` never imports this module, so JAX stays optional (``pip install cuflash[jax]``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import warnings
from typing import Callable, NamedTuple

import jax
import jax.extend
import numpy as np
from jax.interpreters import mlir

import cuflash
from cuflash._ops import api as _api, validate as _validate

try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # a JAX without it: jax.pure_callback only
    _buffer_callback = None

__all__ = ["attention", "attention_with_kvcache", "callback_route", "command_buffer_enabled", "kernel_calls_enabled"]

# CUFLASH_JAX_CALLBACK: "auto" (the default: "buffer" where JAX has it, else "pure"), "buffer" or "pure".
_ROUTE_ENV = "CUFLASH_JAX_CALLBACK"
# CUFLASH_JAX_COMMAND_BUFFER: "1" marks the buffer route's planned forward command-buffer compatible (XLA may
# capture its launch into a CUDA graph and replay it without calling Python); "0" or unset: not (the default).
_GRAPH_ENV = "CUFLASH_JAX_COMMAND_BUFFER"
# CUFLASH_JAX_KERNEL_CALL: "auto" (the default: where jaxlib's CUDA plugin has its kernel call and CuPy is installed),
# "1" or "0": whether the buffer route's planned forward lowers, for CUDA, to jaxlib's kernel call (the kernel launched
# by XLA, no Python at run time) instead of the buffer callback.
_KERNEL_ENV = "CUFLASH_JAX_KERNEL_CALL"


def callback_route() -> str:
    """The callback that :func:`attention` becomes under ``jax.jit``: ``"buffer"`` (device buffers in place,
    on XLA's stream) or ``"pure"`` (``jax.pure_callback``, through host memory on a GPU). Read when a function
    is traced; ``CUFLASH_JAX_CALLBACK=pure`` (or ``buffer``) in the environment chooses. The default is
    ``"buffer"`` where JAX has ``jax.experimental.buffer_callback`` and, when JAX's default backend is not the
    CPU, CuPy is installed (the GPU buffers are read as CuPy arrays); else ``"pure"``."""
    want = os.environ.get(_ROUTE_ENV, "auto")
    if want not in ("auto", "buffer", "pure"):
        raise ValueError(f"{_ROUTE_ENV} must be one of 'auto', 'buffer', 'pure'; got {want!r}")
    if want == "buffer" and _buffer_callback is None:
        raise RuntimeError(f"{_ROUTE_ENV}=buffer needs jax.experimental.buffer_callback, which JAX "
                           f"{jax.__version__} does not have; use 'pure' or 'auto'")
    if want == "auto":
        usable = _buffer_callback is not None and (jax.default_backend() == "cpu" or _have_cupy())
        return "buffer" if usable else "pure"
    return want


def command_buffer_enabled() -> bool:
    """Whether the buffer route marks the calls it can run as one captured launch (the planned forward)
    ``command_buffer_compatible`` (``CUFLASH_JAX_COMMAND_BUFFER=1``; read when a function is traced). XLA then
    records the callback's launch into a command buffer (a CUDA graph) by stream capture and replays it while the
    addresses of the buffers it uses stay the same, re-recording (calling the callback again) when one changes
    (docs/jax.md). Off by default: not yet verified on a GPU."""
    want = os.environ.get(_GRAPH_ENV, "0")
    if want not in ("0", "1", ""):
        raise ValueError(f"{_GRAPH_ENV} must be '0' or '1'; got {want!r}")
    return want == "1"


def kernel_calls_enabled() -> bool:
    """Whether the buffer route's planned forward is lowered, for CUDA, to jaxlib's kernel call (read when a
    function is traced): XLA launches the kernel's flat entry point itself, loaded from its PTX, with the parameters
    fixed when the function was compiled, so a call runs no Python. Calls it cannot take (variant arrays, a bias,
    dropout, mods, head dims run on copies, the backward), other platforms and ``CUFLASH_JAX_COMMAND_BUFFER=1`` keep
    the buffer callback. ``CUFLASH_JAX_KERNEL_CALL``: ``auto`` (the default: on where jaxlib's CUDA plugin has its
    kernel call and CuPy is installed), ``1``, ``0``."""
    want = os.environ.get(_KERNEL_ENV, "auto") or "auto"
    if want not in ("auto", "0", "1"):
        raise ValueError(f"{_KERNEL_ENV} must be one of 'auto', '0', '1'; got {want!r}")
    if want == "1" and not _have_kernel_call():
        raise RuntimeError(f"{_KERNEL_ENV}=1 needs jaxlib's CUDA plugin with its kernel call "
                           f"(jax._src.lib.gpu_triton) and CuPy; use 'auto' or '0'")
    return want == "1" or (want == "auto" and _have_kernel_call())


@functools.lru_cache(maxsize=None)
def _have_kernel_call() -> bool:
    """Whether jaxlib's CUDA plugin registers its kernel call (the legacy ``triton_kernel_call`` target) and CuPy
    (the planning, NVRTC) is installed."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError:
        return False
    return _have_cupy() and all(hasattr(gpu_triton, name) for name in (
        "TritonKernel", "TritonKernelCall", "create_array_parameter", "create_scalar_parameter", "get_custom_call"))


@functools.lru_cache(maxsize=None)
def _have_cupy() -> bool:
    try:
        return importlib.util.find_spec("cupy") is not None
    except ValueError:  # (a module in sys.modules without a spec, as a stand-in: there)
        return True


def _is_traced(*arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _on_gpu(a) -> bool:
    return any(d.platform == "gpu" for d in a.devices())


class _Op(NamedTuple):
    """One call of cuflash as the callbacks and the vmap rule see it.

    ``run`` takes the op's arguments as NumPy or CuPy arrays (pytrees of them; None leaves stay None) and
    returns a tuple of results; ``shapes`` gives the results' ``jax.ShapeDtypeStruct`` from the arguments'
    shapes; ``fold(axis_size, in_batched, args)`` is the vmap rule's plan: None (one call per mapped element), or
    the arguments of one folded call and the function that unfolds each of its results. ``plan`` takes the
    arguments of a first call on CuPy arrays and returns, for the buffer route's later calls with the same
    layouts, ``launch(arrays, results)``, which runs the call with the launcher's plan on the flattened arguments
    and writes the results into ``results``; or None where the launcher does not plan the call."""

    run: Callable
    shapes: Callable
    fold: Callable
    plan: Callable
    capturable: Callable = lambda *args: False  # (whether a call with these arguments may be recorded into a graph)
    kernel: Callable = lambda *args: None  # (the call as a kernel-call primitive, or None: _KernelCall)


def _apply(op: _Op, *args):
    """Run ``op`` on JAX arrays: zero-copy through DLPack when concrete, else a callback that
    ``jax.vmap`` batches with :func:`_vmap_rule`."""
    leaves = jax.tree_util.tree_leaves(args)
    if not _is_traced(*leaves):
        return _eager(op.run, *args)
    call = jax.custom_batching.custom_vmap(lambda *a: _callback(op, *a))
    call.def_vmap(functools.partial(_vmap_rule, op))
    return call(*args)


def _eager(run, *args):
    leaves = jax.tree_util.tree_leaves(args)
    if _on_gpu(leaves[0]):
        import cupy

        for a in leaves:  # JAX and CuPy work on different streams: hand over finished buffers only
            a.block_until_ready()
        results = run(*jax.tree_util.tree_map(cupy.from_dlpack, args))
        cupy.cuda.get_current_stream().synchronize()
        return tuple(jax.dlpack.from_dlpack(r) for r in results)
    results = run(*jax.tree_util.tree_map(np.asarray, args))
    return tuple(jax.numpy.asarray(r) for r in results)


def _callback(op: _Op, *args):
    """``op`` as a callback in a traced function (one call per mapped element under a plain ``jax.vmap``)."""
    shapes = op.shapes(*args)
    if callback_route() == "buffer":
        if kernel_calls_enabled() and not command_buffer_enabled():
            results = op.kernel(*args)
            if results is not None:
                return results
        return _buffer_route(op, args, graph=command_buffer_enabled() and op.capturable(*args))
    return tuple(jax.pure_callback(_host(op.run), shapes, *args, vmap_method="sequential"))


def _buffer_route(op: _Op, args: tuple, graph: bool = False) -> tuple:
    """``op`` on ``args`` as a buffer callback (``graph``: marked command-buffer compatible)."""
    leaves, tree = jax.tree_util.tree_flatten(args)  # (None leaves drop out: the callback gets arrays only)
    shapes = op.shapes(*args)
    call = _BufferCall(op, tree, tuple(leaves), shapes, graph)
    extra = {"command_buffer_compatible": True} if graph else {}
    return tuple(_buffer_callback(call, shapes, vmap_method="sequential", **extra)(*leaves))


def _host(fn):
    """``fn`` on NumPy copies of JAX arrays (any pytree of them), returning NumPy arrays (for ``jax.pure_callback``)."""

    def call(*args):
        return fn(*jax.tree_util.tree_map(np.asarray, args))

    return call


# ---------------------------------------------------------------------------------------------------
# The buffer route: XLA's buffers seen in place, the kernels queued on XLA's stream.
#
# Everything a call's launches depend on but the buffers' addresses is static under jit (shapes, dtypes,
# options), so the work of the front door is done once per traced call and device stream: the first run checks
# the call as cuflash.attention does and keeps the CUDA launcher's plan; every later run only looks up the
# buffers' CuPy views by address and runs the plan, which writes the forward's out and lse into XLA's output
# buffers. Calls the launcher does not plan (a bias, variant arrays whose values are checked at each call, head
# dims run on padded copies, ...) and the backward's gradients (the launcher allocates them) go through the
# front door and are copied into XLA's buffers.

_KDL_CPU = 1
_streams: dict = {}  # (device, XLA stream pointer) -> cupy.cuda.ExternalStream (XLA's streams live long)


class _BufferCall:
    """The ``buffer_callback`` body of one traced call: ``op`` on the input buffers (``leaves``, the flattened
    arguments: ``tree`` rebuilds them), its results written into the output buffers (``shapes``)."""

    def __init__(self, op: _Op, tree, leaves: tuple, shapes: tuple, graph: bool = False):
        self._op, self._tree, self._graph = op, tree, graph
        self._layouts = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in (*leaves, *shapes))
        self._gpu: dict = {}  # (device, XLA stream pointer) -> _GpuCall

    def __call__(self, ctx, outs, *leaves) -> None:
        kind, ordinal = leaves[0].__dlpack_device__()
        if kind == _KDL_CPU:
            results = self._op.run(*self._tree.unflatten([np.asarray(b) for b in leaves]))
            for buf, r in zip(outs, results):
                np.asarray(buf)[...] = r
            return
        key = (ordinal, ctx.stream)
        call = self._gpu.get(key)
        if call is None:
            call = self._gpu[key] = _GpuCall(self._op, self._tree, self._layouts, *key, graph=self._graph)
        call(leaves, outs)


class _GpuCall:
    """A traced call on one device and XLA stream: CuPy views of the buffers by slot and address (XLA hands out
    the same addresses call after call; a view only names an address, owning nothing), and the launcher's plan
    once the first run has made it (None: the front door at each run)."""

    _VIEWS_PER_SLOT = 64  # addresses kept per argument or result (cleared when full)

    def __init__(self, op: _Op, tree, layouts: tuple, ordinal: int, stream: int, graph: bool = False):
        import cupy

        self._op, self._tree, self._layouts, self._ordinal = op, tree, layouts, ordinal
        self._graph = graph  # (marked command_buffer_compatible: under stream capture, the plan's launch only)
        self._device = cupy.cuda.Device  # (a new one per run: a Device keeps the device it replaced until it is left)
        self._stream = _xla_stream(ordinal, stream)
        self._views = tuple({} for _ in layouts)
        self._planned = _UNPLANNED

    def _view(self, slot: int, buf):
        ptr = _buffer_ptr(buf)
        views = self._views[slot]
        view = views.get(ptr)
        if view is None:
            if len(views) >= self._VIEWS_PER_SLOT:
                views.clear()
            view = views[ptr] = _cupy_view(self._ordinal, ptr, *self._layouts[slot])
        return view

    def __call__(self, leaves, outs) -> None:
        with self._device(self._ordinal), self._stream:
            ins = [self._view(i, b) for i, b in enumerate(leaves)]
            dsts = [self._view(i, b) for i, b in enumerate(outs, len(leaves))]
            if self._planned is _UNPLANNED:
                self._planned = self._op.plan(*self._tree.unflatten(ins))
            if self._planned is not None and not _validate.finite_checks(False) and self._planned(ins, dsts):
                return
            if self._graph and _capturing(self._stream.ptr):
                # XLA is recording this call into a CUDA graph: the front door's temporaries (CuPy's pool) and host
                # reads cannot be captured (a replay would write into memory freed since). Refuse.
                raise RuntimeError(
                    f"cuflash.jax: a call marked command_buffer_compatible ({_GRAPH_ENV}=1) is being captured but "
                    f"does not run as the launcher's planned launch (unplanned call, an unaligned buffer, or "
                    f"CUFLASH_CHECK_FINITE=1); unset {_GRAPH_ENV}")
            results = self._op.run(*self._tree.unflatten(ins))
            for dst, r in zip(dsts, results):
                _write(dst, r)


_UNPLANNED = object()


def _capturing(stream: int) -> bool:
    """Whether CUDA stream ``stream`` is capturing (XLA recording a command buffer); False where CuPy cannot say."""
    import cupy

    query = getattr(cupy.cuda.runtime, "streamIsCapturing", None)
    try:
        return bool(query(stream)) if query is not None else False
    except Exception:
        return False


def _xla_stream(ordinal: int, stream: int):
    """A CuPy view of XLA's CUDA stream ``stream`` on device ``ordinal`` (kept: XLA's streams live long)."""
    import cupy

    key = (ordinal, stream)
    view = _streams.get(key)
    if view is None:
        view = _streams[key] = cupy.cuda.ExternalStream(stream)
    return view


def _buffer_ptr(buf) -> int:
    """The device address of an XLA FFI buffer on a GPU."""
    try:
        return buf.__cuda_array_interface__["data"][0]
    except Exception:  # (a dtype without a type string)
        return _dlpack_ptr(buf)


def _dlpack_ptr(buf) -> int:
    """The device address of an XLA FFI buffer from its DLPack capsule, whose DLTensor's first field is the data
    pointer (for the dtypes that ``__cuda_array_interface__`` has no type string for)."""
    capsule = buf.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.c_void_p.from_address(get(capsule, b"dltensor")).value or 0


def _cupy_view(ordinal: int, ptr: int, shape: tuple, dtype: np.dtype):
    """A C-contiguous CuPy array of ``shape`` and ``dtype`` at device address ``ptr`` (memory it does not own)."""
    import cupy

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return cupy.empty(shape, dtype)
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None, ordinal)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _write(dst, src) -> None:
    """``dst[...] = src`` on the current stream: a device-to-device copy where both are contiguous alike, else
    CuPy's elementwise copy (which casts)."""
    if src.data.ptr == dst.data.ptr or dst.size == 0:
        return
    if src.dtype == dst.dtype and src.shape == dst.shape and src.flags.c_contiguous:
        dst.data.copy_from_device_async(src.data, dst.nbytes)
    else:
        dst[...] = src


def _planned_options(q, k, v, keywords: dict, extra=None):
    """``(planner, options)`` of a call on CuPy arrays by cuflash's checks, as the front door makes them before it
    plans a call (:func:`cuflash._ops.api.attention`), or None where it would not plan it: a variant array (checked by
    value at each call), an empty problem, a scale it runs as a positive one on a copy of q."""
    planner = _api._planner(q)
    if planner is None or any(keywords[name] is not None for name in (*_api.ARRAY_OPTIONS, "bias")) \
            or keywords["mod_arrays"] or not isinstance(keywords["mask_mod"], (str, type(None))):
        return None
    library, problem, options = _api._prepare(
        q, k, v, softmax_scale=keywords["softmax_scale"], algorithm=keywords["algorithm"],
        block_q=keywords["block_q"], block_k=keywords["block_k"], variant_options=_api._variant_options(keywords),
        extra=extra)
    if extra is not None:
        _validate.check_backward_tensors(problem, extra["do"], extra["out"], extra["lse"])
    if problem.is_empty:
        return None
    _api._check_supported(_api._backend(library), problem, options["algorithm"], options["variant"])
    kernel_q, options["scale"], _ = _api._kernel_scale(library, q, options["scale"])
    return None if kernel_q is not q else (planner, options)


# ---------------------------------------------------------------------------------------------------
# jax.vmap: fold the mapped axis into the batch axis, one call of the kernels.


def _vmap_rule(op: _Op, axis_size: int, in_batched, *args):
    """``custom_vmap`` rule (mapped axes at the front): the folded call where ``op.fold`` has a plan, else one
    callback per mapped element."""
    plan = op.fold(axis_size, in_batched, args)
    if plan is None:
        in_axes = tuple(jax.tree_util.tree_map(lambda b: 0 if b else None, list(in_batched)))
        outs = jax.vmap(lambda *a: _callback(op, *a), in_axes=in_axes)(*args)
    else:
        folded, unfold = plan
        outs = tuple(unfold(i, o) for i, o in enumerate(_apply(op, *folded)))
    return tuple(outs), tuple(True for _ in outs)


def _foldable(options, arrays) -> bool:
    """Whether a call may run with its mapped axis folded into the batch: a padded batch (the packed one's
    rows are not a batch axis), and nothing that reads the batch index (dropout's counter, the mods' ``b``)."""
    opts = dict(options)
    mod_arrays = arrays[len(_api.ARRAY_OPTIONS)]
    given = dict(zip(_api.ARRAY_OPTIONS, arrays))
    return (given["cu_seqlens_q"] is None and given["cu_seqlens_k"] is None and not opts["dropout_p"]
            and opts["score_mod"] is None and opts["mask_mod"] is None and not mod_arrays)


def _fold_lead(x, batched: bool, n: int):
    """``(n, batch, ...)`` -> ``(n * batch, ...)``; an unmapped ``(batch, ...)`` broadcast to every element first."""
    if not batched:
        x = jax.numpy.broadcast_to(x, (n, *x.shape))
    return x.reshape((n * x.shape[1], *x.shape[2:]))


def _fold_per_batch(x, batched: bool, n: int, batch: int, ndim: int, may_broadcast: bool):
    """A variant array whose full form has ``ndim`` axes, the first one the batch (size ``batch`` or 1), for
    the folded call: unchanged when unmapped and broadcast over the batch (fewer axes, or, where
    ``may_broadcast``, a batch axis of 1); else expanded to ``(n, batch, ...)`` and folded."""
    if x is None:
        return None
    per = x.shape[1:] if batched else x.shape
    if not batched and (len(per) < ndim or (may_broadcast and per[0] == 1)):
        return x
    full = (1,) * (ndim - len(per)) + tuple(per)
    x = x.reshape(((n,) if batched else ()) + full)
    x = jax.numpy.broadcast_to(x, (n, batch, *full[1:]))
    return x.reshape((n * batch, *full[1:]))


def _fold_arrays(arrays, batched, n: int, batch: int):
    """The variant arrays of a foldable call for the folded one (alibi_slopes ``(B, H)``, seqused_k ``(B,)``,
    attn_mask ``(B, H, Sq, Sk)`` in their full forms; cu_seqlens and mod_arrays are absent)."""
    full = {"alibi_slopes": (2, False), "seqused_k": (1, False), "attn_mask": (4, True)}
    out = []
    for name, a, b in zip(_api.ARRAY_OPTIONS, arrays, batched):
        out.append(None if a is None else _fold_per_batch(a, b, n, batch, *full[name]))
    return (*out, arrays[len(_api.ARRAY_OPTIONS)])


def _unfold(n: int):
    return lambda i, x: x.reshape((n, x.shape[0] // n, *x.shape[1:]))


def _lse_shape(q):
    """``(batch, heads_q, seqlen_q)``, or ``(heads_q, total_q)`` for packed ``(total_q, heads_q, d)`` q."""
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    if q.ndim == 3:
        return jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), lse_dtype)
    batch, seqlen_q, heads_q, _ = q.shape
    return jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), lse_dtype)


def _shape_of(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _stand_in(a):
    """A NumPy array of ``a``'s shape and dtype (one row broadcast, contiguous last axis), values zero."""
    return np.broadcast_to(np.zeros(np.shape(a)[-1:], a.dtype), np.shape(a))


def _check(q, k, v, bias, arrays, options):
    """cuflash's checks of shapes, dtypes and options, before anything is traced or called back.

    Under ``jit`` the work runs in a callback, where an error would surface only when the compiled
    function runs. Shapes and dtypes are known at trace time, so the checks run on NumPy stand-ins of
    that shape and dtype; the variant arrays are read when they are concrete (a device-to-host copy of
    a few integers on a GPU), else only their shapes and dtypes are checked here. ``bias`` and
    ``attn_mask`` are never read: their checks need only their shapes and dtypes.
    """
    options = dict(options)
    _validate.backward_order(None, options.pop("deterministic"))
    by_shape = ("attn_mask",)
    traced = _is_traced(*(a for name, a in zip(_api.ARRAY_OPTIONS, arrays) if a is not None and name not in by_shape))
    array_options = {name: None if a is None else (_stand_in(a) if traced or name in by_shape else np.asarray(a))
                     for name, a in zip(_api.ARRAY_OPTIONS, arrays)}
    array_options["bias"] = None if bias is None else _stand_in(bias)
    mod_arrays = arrays[len(_api.ARRAY_OPTIONS)]  # read by the expressions when the call runs: checked by shape
    array_options["mod_arrays"] = ({name: _stand_in(a) if hasattr(a, "dtype") else a for name, a in mod_arrays.items()}
                                   if isinstance(mod_arrays, dict) else mod_arrays)
    _api._prepare(*(_stand_in(a) for a in (q, k, v)), softmax_scale=options.pop("softmax_scale"),
                  algorithm=options.pop("algorithm"), block_q=options.pop("block_q"), block_k=options.pop("block_k"),
                  variant_options={**options, **array_options}, read_values=not traced)


def _check_dropout_seed(dropout_p, dropout_seed) -> None:
    """A positive ``dropout_p`` without a seed: say where a JAX user gets one (cuflash's check says the rest)."""
    if dropout_seed is None and isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) \
            and 0 < dropout_p < 1:
        raise ValueError(
            f"cuflash.jax.attention: dropout_p={float(dropout_p)} needs an explicit integer dropout_seed in "
            f"[0, 2**64) (JAX has no global random generator; draw one from a key outside the function, e.g. "
            f"int(jax.random.randint(key, (), 0, 2**31 - 1))); got dropout_seed=None"
        )
    if isinstance(dropout_seed, jax.Array):
        raise TypeError(
            "cuflash.jax.attention: dropout_seed must be a Python integer (a static value: the mask is drawn "
            "on the host from it); got a JAX array, convert a concrete one with int(...)"
        )


def _keywords(options, arrays):
    """The keywords of cuflash.attention from the static options and the variant arrays (``mod_arrays`` last)."""
    return {**{key: val for key, val in options if key != "deterministic"}, **dict(zip(_api.ARRAY_OPTIONS, arrays)),
            "mod_arrays": arrays[len(_api.ARRAY_OPTIONS)]}


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, bias, arrays, options):
    out, _ = _forward(q, k, v, bias, arrays, options)
    return out


def _forward_op(options) -> _Op:
    def run(q, k, v, bias, arrays):
        return cuflash.attention(q, k, v, return_lse=True, bias=bias, **_keywords(options, arrays))

    def shapes(q, k, v, bias, arrays):
        out = jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype)  # v's head dim may differ from q's
        return out, _lse_shape(q)

    def fold(n, batched, args):
        (q, k, v, bias, arrays), (bq, bk, bv, bb, barr) = args, batched
        if not _foldable(options, arrays):
            return None
        batch = q.shape[1] if bq else q.shape[0]
        folded = (*(_fold_lead(x, b, n) for x, b in ((q, bq), (k, bk), (v, bv))),
                  None if bias is None else _fold_per_batch(bias, bb, n, batch, 4, True),
                  _fold_arrays(arrays, barr, n, batch))
        return folded, _unfold(n)

    def plan(q, k, v, bias, arrays):
        checked = _planned_options(q, k, v, {**_keywords(options, arrays), "bias": bias})
        forward = None if checked is None else checked[0].plan_forward(q, k, v, **checked[1])
        if forward is None:
            return None

        def launch(arrays, results):  # (a planned call's arrays are q, k, v; its results out and lse)
            q, k, v = arrays
            out, lse = results
            return forward.run(q, k, v, out=out, lse_out=lse) is not None  # (False: an unaligned input)

        return launch

    def capturable(q, k, v, bias, arrays):
        return _capturable_forward(options, q, v, bias, arrays)

    def kernel(q, k, v, bias, arrays):
        if not _capturable_forward(options, q, v, bias, arrays):
            return None
        out, lse = shapes(q, k, v, bias, arrays)
        return tuple(_kernel_call_p.bind(q, k, v, options=options, arrays=_hashable(arrays), out=_shape_key(out),
                                         lse=_shape_key(lse)))

    return _Op(run, shapes, fold, plan, capturable, kernel)


def _capturable_forward(options, q, v, bias, arrays) -> bool:
    """Whether a forward call may be recorded into a command buffer: one that the launcher plans as one launch on
    XLA's buffers with no device record (FA2, no bias, no variant array, no dropout, no score_mod / mask_mod, a
    positive or default scale, head dims the kernel reads in place), by what is known when it is traced. (The
    callback still refuses, under capture, a call that turns out unplanned: :class:`_GpuCall`.)"""
    opts = dict(options)
    if (opts["algorithm"] != "fa2" or bias is not None or any(a is not None for a in arrays[:-1]) or arrays[-1]
            or opts["dropout_p"] or opts["score_mod"] is not None or opts["mask_mod"] is not None
            or (opts["softmax_scale"] is not None and not opts["softmax_scale"] > 0)):
        return False
    from cuflash._cuda.spec import HEAD_DIMS  # (no CuPy import)

    dtype, d, dv = np.dtype(q.dtype), q.shape[-1], v.shape[-1]
    if dtype.itemsize == 2:
        return d % 8 == 0 and dv % 8 == 0 and max(d, dv) <= HEAD_DIMS[-1]
    return dtype == np.float32 and d == dv and d in HEAD_DIMS


def _backward_op(options) -> _Op:
    deterministic = dict(options)["deterministic"]

    def run(do, q, k, v, out, lse, bias, arrays):
        return cuflash.attention_backward(do, q, k, v, out, lse, deterministic=deterministic, bias=bias,
                                          **_keywords(options, arrays))

    def shapes(do, q, k, v, out, lse, bias, arrays):
        return tuple(_shape_of(a) for a in (q, k, v) + (() if bias is None else (bias,)))

    def fold(n, batched, args):
        # (with a bias, each element's dbias sums over its own batch only: one call per element)
        if args[6] is not None or not _foldable(options, args[7]):
            return None
        batch = args[1].shape[1] if batched[1] else args[1].shape[0]
        folded = (*(_fold_lead(x, b, n) for x, b in zip(args[:6], batched[:6])), None,
                  _fold_arrays(args[7], batched[7], n, batch))
        return folded, _unfold(n)

    def plan(do, q, k, v, out, lse, bias, arrays):
        checked = _planned_options(q, k, v, {**_keywords(options, arrays), "bias": bias},
                                   extra={"do": do, "out": out, "lse": lse})
        if checked is None:
            return None
        planner, planned = checked
        backward = planner.plan_backward(do, q, k, v, out, lse, order=_validate.backward_order(None, deterministic),
                                         **planned)
        if backward is None:
            return None

        def launch(arrays, results):  # (a planned call's arrays are do, q, k, v, out, lse; its results dq, dk, dv)
            for dst, grad in zip(results, backward.run(*arrays)):  # (the launcher allocates the gradients)
                _write(dst, grad)
            return True

        return launch

    def kernel(do, q, k, v, out, lse, bias, arrays):
        if not BACKWARD_KERNEL_CALLS or not _capturable_forward(options, q, v, bias, arrays):
            return None
        return tuple(_bwd_kernel_call_p.bind(do, q, k, v, out, lse, options=options, arrays=_hashable(arrays)))

    return _Op(run, shapes, fold, plan, kernel=kernel)


# ---------------------------------------------------------------------------------------------------
# Kernel calls (kernel_calls_enabled(): on by default where jaxlib has them): the planned forward lowered, for
# CUDA, to jaxlib's kernel call (the custom call jax-triton uses): XLA loads the kernel's flat entry point from its
# PTX (NVRTC's, compiled by jaxlib for the device) and launches it on its stream with the parameters written into
# the call when the function was compiled (the layouts, the scale, the grid; the five arrays are XLA's buffers). No
# Python runs per call. Planned when the call is lowered for CUDA (the front door's checks and plan on stand-in views
# of the layouts); where the launcher does not plan it as one flat launch, and for every other platform, the call
# lowers to the buffer callback instead.

_TRITON_TARGET = "triton_kernel_call"  # (jaxlib registers it with its CUDA plugin: gpu_triton)


def _shape_key(s) -> tuple:
    return tuple(s.shape), np.dtype(s.dtype).name


def _hashable(arrays) -> tuple:
    """The kernel route's variant arrays (all None, or an empty mod_arrays last): a hashable primitive parameter."""
    return tuple(None if a is None else tuple(a) if isinstance(a, (dict, tuple, list)) else a for a in arrays)


def _restore(arrays) -> tuple:
    *variant, mods = arrays
    return (*variant, {} if mods == () else mods)


_kernel_call_p = jax.extend.core.Primitive("cuflash_attention_kernel_call")
_kernel_call_p.multiple_results = True


@_kernel_call_p.def_abstract_eval
def _kernel_call_abstract(q, k, v, *, options, arrays, out, lse):
    return tuple(jax.core.ShapedArray(shape, np.dtype(dtype)) for shape, dtype in (out, lse))


def _kernel_call_fallback(q, k, v, *, options, arrays, out, lse):
    """The same call by the buffer callback (other platforms; calls the launcher does not plan as one flat launch)."""
    return _buffer_route(_forward_op(options), (q, k, v, None, _restore(arrays)))


def _built(make, *key):
    """``make(*key)`` (a kernel call's planning and descriptors), or None (the buffer callback) where it fails while
    the kernel calls are on by default (``auto``): a jaxlib whose kernel call differs from the ones this was written
    for, or a compile that fails, must not break a user's function. With ``CUFLASH_JAX_KERNEL_CALL=1``, it raises."""
    try:
        return make(*key)
    except Exception as exc:
        if os.environ.get(_KERNEL_ENV) == "1":
            raise
        warnings.warn(f"cuflash.jax: the kernel call could not be built ({type(exc).__name__}: {exc}); the call runs "
                      f"by the buffer callback ({_KERNEL_ENV}=0 uses it throughout)", RuntimeWarning, stacklevel=2)
        return None


def _kernel_call_lowering(ctx, q, k, v, *, options, arrays, out, lse):
    opaque = _built(_kernel_opaque, options, arrays, tuple(_shape_key(a) for a in ctx.avals_in), _route_key())
    if opaque is None:
        return mlir.lower_fun(_kernel_call_fallback, multiple_results=True)(
            ctx, q, k, v, options=options, arrays=arrays, out=out, lse=lse)
    return jax.ffi.ffi_lowering(_TRITON_TARGET, backend_config=opaque, api_version=2)(ctx, q, k, v)


# A forward that the CUDA launcher runs from its TMA entry point (which has no flat twin: a kernel call would launch
# the cp.async kernel) and of more FLOPs than this runs by the buffer callback instead, whose host cost is then the
# smaller one: on the H100 (2026-11-28) the callback costs 45-75 us more per call than the kernel call, and at d 128
# the TMA kernel runs 1.6x the cp.async one (650 against 390 TFLOP/s), which saves more than that from about 70
# GFLOP (a 4 x 4096 x 32 x 128 causal forward is 550).
KERNEL_CALL_MAX_TMA_FLOP = 64e9


def _route_key() -> tuple:
    """What besides a call's layouts and options decides its kernel calls (the memories of :func:`_kernel_opaque` and
    :func:`_backward_kernel_calls` are kept per value): the TMA size limit and the CUDA launcher's switches."""
    from cuflash._cuda import attention

    return (KERNEL_CALL_MAX_TMA_FLOP, *attention.switches())


def _forward_flop(layouts, causal: bool) -> float:
    """A forward's matrix-product FLOPs (2 B H Nq Nk (d + dv), halved when causal) from its layouts ((shape, dtype) of
    q, k, v: (batch, seqlen, heads, d), or packed without the batch axis: then an upper bound, every query against
    every key; a window not counted: an estimate)."""
    (q_shape, _), (k_shape, _), (v_shape, _) = layouts[:3]
    *lead, nq, heads, d = q_shape
    nk, dv = k_shape[-3], v_shape[-1]
    return 2.0 * (lead[0] if lead else 1) * heads * nq * nk * (d + dv) / (2 if causal else 1)


@functools.lru_cache(maxsize=64)
def _kernel_opaque(options, arrays, layouts, route_key=()) -> bytes | None:
    """jaxlib's kernel-call descriptor (a zlib-compressed TritonAnyKernelCall) of the planned forward of these
    layouts on the current CUDA device, or None where the launcher does not plan the call as one flat launch."""
    import cupy

    ordinal = cupy.cuda.runtime.getDevice()
    # stand-in views of the layouts at an aligned address that is never read: the plan needs shapes, dtypes and
    # strides only
    q, k, v = (_cupy_view(ordinal, 1 << 20, shape, np.dtype(dtype)) for shape, dtype in layouts)
    checked = _planned_options(q, k, v, {**_keywords(options, _restore(arrays)), "bias": None})
    forward = None if checked is None else checked[0].plan_forward(q, k, v, **checked[1])
    flat = None if forward is None else forward.flat_call()
    if flat is None or (forward.tma and _forward_flop(layouts, dict(options)["causal"]) > KERNEL_CALL_MAX_TMA_FLOP):
        return None
    spec, grid, scalars = flat
    # q, k, v (the call's operands), out, lse (its results): XLA's buffers in that order
    return _descriptor(spec, spec.flat_name, grid, [("buffer", None)] * 5 + list(scalars), "cuflash.attention")


def _descriptor(spec, name: str, grid, params, label: str) -> bytes:
    """jaxlib's kernel-call descriptor (a zlib-compressed TritonAnyKernelCall) of one launch: the kernel ``name`` of
    ``spec``'s source (its PTX for the current device), ``grid``, and ``params`` in the kernel's order, each
    ``("buffer", _)`` (the call's next buffer: its operands, then its results) or ``(dtype, value)``."""
    import zlib

    from jax._src.lib import gpu_triton

    from cuflash._cuda import compile as cuda_compile

    cc = cuda_compile.device_info()[0]
    ptx, lowered = cuda_compile.flat_ptx(spec, cc, name)
    kernel = _triton_kernel(gpu_triton, lowered, spec.threads // 32, spec.smem, ptx, cc)
    made = [gpu_triton.create_array_parameter(0, 16) if kind == "buffer" else
            gpu_triton.create_scalar_parameter(value, kind) for kind, value in params]
    call = gpu_triton.TritonKernelCall(kernel, *grid, made)
    return zlib.compress(call.to_proto(label, b""))


def _triton_kernel(lib, name: str, num_warps: int, smem: int, ptx: str, cc: int):
    """jaxlib's TritonKernel, whose constructor's arguments differ between jaxlib versions: (name, warps, shared
    memory, PTX, TTIR, compute capability, cluster x, y, z), or (name, warps, CTAs, shared memory, PTX, TTIR,
    compute capability[, scratch size, alignment])."""
    tries = ((name, num_warps, smem, ptx, "", cc, 1, 1, 1), (name, num_warps, 1, smem, ptx, "", cc),
             (name, num_warps, 1, smem, ptx, "", cc, 0, 0))
    for i, args in enumerate(tries):
        try:
            return lib.TritonKernel(*args)
        except TypeError:
            if i == len(tries) - 1:
                raise


mlir.register_lowering(
    _kernel_call_p, mlir.lower_fun(_kernel_call_fallback, multiple_results=True))
mlir.register_lowering(_kernel_call_p, _kernel_call_lowering, platform="cuda")

# The backward: its launches (D, dK / dV with dQ accumulated, dQ's conversion, GQA's sums) as one kernel call each,
# in order, threaded through XLA's buffers: every buffer a launch takes is an operand of its call, in the kernel's
# parameter order, and the ones it writes (gradients, D, the float32 accumulators: created zeroed) are results
# aliased to their operands, so each call updates them in place and the next one reads them.

_SAVED = ("do", "q", "k", "v", "out", "lse")  # (the backward's inputs, by BackwardPlan's slot names)

# Whether the kernel route takes the backward too (on: checked on the CPU against the launches and parameters of
# cuflash.attention_backward on the same layouts, and on the H100 against the buffer route's gradients). Set it to
# False to run the backward through the buffer callback while the forward keeps its kernel call.
BACKWARD_KERNEL_CALLS = True

_bwd_kernel_call_p = jax.extend.core.Primitive("cuflash_attention_backward_kernel_calls")
_bwd_kernel_call_p.multiple_results = True


@_bwd_kernel_call_p.def_abstract_eval
def _bwd_kernel_call_abstract(do, q, k, v, out, lse, *, options, arrays):
    return tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in (q, k, v))


def _bwd_kernel_call_fallback(do, q, k, v, out, lse, *, options, arrays):
    """The same backward by the buffer callback (other platforms; calls the launcher does not plan flat)."""
    return _buffer_route(_backward_op(options), (do, q, k, v, out, lse, None, _restore(arrays)))


def _bwd_kernel_call_lowering(ctx, *saved, options, arrays):
    planned = _built(_backward_kernel_calls, options, arrays, tuple(_shape_key(a) for a in ctx.avals_in), _route_key())
    if planned is None:
        return mlir.lower_fun(_bwd_kernel_call_fallback, multiple_results=True)(ctx, *saved, options=options,
                                                                               arrays=arrays)
    calls, buffers = planned

    def emit(*saved):
        env = dict(zip(_SAVED, saved))
        for slot, shape, dtype in buffers:
            env[slot] = jax.numpy.zeros(shape, dtype)
        for opaque, slots in calls:
            written = tuple(slot for slot in slots if slot not in _SAVED)
            results = jax.ffi.ffi_call(
                _TRITON_TARGET, [jax.ShapeDtypeStruct(env[slot].shape, env[slot].dtype) for slot in written],
                custom_call_api_version=2, legacy_backend_config=opaque,
                input_output_aliases={slots.index(slot): i for i, slot in enumerate(written)},
            )(*(env[slot] for slot in slots))
            env.update(zip(written, results))
        return env["dq"], env["dk"], env["dv"]

    return mlir.lower_fun(emit, multiple_results=True)(ctx, *saved)


@functools.lru_cache(maxsize=64)
def _backward_kernel_calls(options, arrays, layouts, route_key=()):
    """The planned backward of these layouts on the current CUDA device as jaxlib kernel calls: ``(calls,
    buffers)``, ``calls`` the launches in order as ``(descriptor, slots)`` (the buffers each takes, in its
    parameter order), ``buffers`` the ones made for it ``(slot, shape, dtype)`` (the gradients, D, the
    accumulators); None where the launcher does not plan it flat."""
    import cupy

    ordinal = cupy.cuda.runtime.getDevice()
    do, q, k, v, out, lse = (_cupy_view(ordinal, 1 << 20, shape, np.dtype(dtype)) for shape, dtype in layouts)
    checked = _planned_options(q, k, v, {**_keywords(options, _restore(arrays)), "bias": None},
                               extra={"do": do, "out": out, "lse": lse})
    if checked is None:
        return None
    planner, planned = checked
    backward = planner.plan_backward(do, q, k, v, out, lse, **planned,
                                     order=_validate.backward_order(None, dict(options)["deterministic"]))
    flat = getattr(backward, "flat_calls", lambda: None)()
    # (a large backward the launcher runs by TMA: the buffer callback, as the forward's: KERNEL_CALL_MAX_TMA_FLOP)
    if flat is None or (getattr(backward, "tma", False)
                        and 2.5 * _forward_flop(layouts[1:], dict(options)["causal"]) > KERNEL_CALL_MAX_TMA_FLOP):
        return None
    launches, workspace = flat  # (every buffer starts zeroed: the accumulators must)
    calls = [(_descriptor(spec, name, grid, params, "cuflash.attention_backward"),
              tuple(value for kind, value in params if kind == "buffer")) for spec, name, grid, params in launches]
    buffers = tuple((slot, tuple(a.shape), np.dtype(a.dtype).name) for slot, a in zip(("dq", "dk", "dv"), (q, k, v)))
    buffers += tuple((slot, tuple(shape), "float32") for slot, shape in workspace.items())
    return tuple(calls), buffers


mlir.register_lowering(
    _bwd_kernel_call_p, mlir.lower_fun(_bwd_kernel_call_fallback, multiple_results=True))
mlir.register_lowering(_bwd_kernel_call_p, _bwd_kernel_call_lowering, platform="cuda")


def _forward(q, k, v, bias, arrays, options):
    return _apply(_forward_op(options), q, k, v, bias, arrays)


def _attention_fwd(q, k, v, bias, arrays, options):
    out, lse = _forward(q, k, v, bias, arrays, options)
    return out, (q, k, v, bias, arrays, out, lse)


def _attention_bwd(options, saved, dout):
    q, k, v, bias, arrays, out, lse = saved
    grads = _apply(_backward_op(options), dout, q, k, v, out, lse, bias, arrays)
    dbias = None if bias is None else grads[3]
    return grads[0], grads[1], grads[2], dbias, None  # the other variant arrays (slopes, bounds, mask): none


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    causal_align: str = "bottom-right",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_k=None,
    bias=None,
    attn_mask=None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_arrays: dict | None = None,
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
    deterministic: bool = False,
):
    """Differentiable :func:`cuflash.attention` on JAX arrays ``(batch, seqlen, heads, head_dim)``, or
    packed ``(total, heads, head_dim)`` with ``cu_seqlens_q`` and ``cu_seqlens_k``.

    Arguments as :func:`cuflash.attention`; ``deterministic`` selects the backward without atomics.
    Gradients flow to ``q``, ``k``, ``v`` and ``bias`` (summed over the axes it broadcasts over);
    ``alibi_slopes``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k`` and ``attn_mask`` (JAX or NumPy
    arrays) get none. Under ``jax.jit`` the values of ``cu_seqlens_q``,
    ``cu_seqlens_k`` and ``seqused_k`` are checked when the compiled function runs.

    ``dropout_p > 0`` needs an explicit Python integer ``dropout_seed`` in ``[0, 2**64)`` (static under
    ``jit``: a new seed retraces; JAX has no global generator to draw it from); the mask is
    ``cuflash.dropout_mask(..., dropout_p, dropout_seed, dropout_offset)``, the same as NumPy's.

    ``score_mod`` and ``mask_mod`` (CUDA C expressions, static under ``jit``) and ``mod_arrays`` (a dict of
    names to 1-D int32 / float32 arrays, no gradient, read when the call runs) as in :func:`cuflash.attention`.

    ``softmax_scale`` may be any finite real (0: uniform attention; negative allowed), as in
    :func:`cuflash.attention`. Inputs are not scanned for NaN or infinities; ``CUFLASH_CHECK_FINITE=1`` in the
    environment scans them when the call runs (under ``jit``: inside the callback, where the error surfaces).
    """
    options = (
        ("causal", causal), ("softmax_scale", softmax_scale), ("causal_align", causal_align),
        ("window_size", window_size), ("softcap", softcap), ("max_seqlen_q", max_seqlen_q),
        ("max_seqlen_k", max_seqlen_k), ("algorithm", algorithm), ("block_q", block_q), ("block_k", block_k),
        ("dropout_p", dropout_p), ("dropout_seed", dropout_seed), ("dropout_offset", dropout_offset),
        ("score_mod", score_mod), ("mask_mod", mask_mod), ("deterministic", deterministic),
    )
    _check_dropout_seed(dropout_p, dropout_seed)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a is None or not hasattr(a, "shape"):
            got = "None" if a is None else f"{type(a).__module__}.{type(a).__name__}"
            raise TypeError(f"cuflash.jax.attention: {name} must be an array (a jax.Array, or a numpy.ndarray); "
                            f"got {got}")
    q, k, v = (jax.numpy.asarray(a) for a in (q, k, v))  # NumPy inputs too, as any JAX function
    given = dict(alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 seqused_k=seqused_k, attn_mask=attn_mask)
    arrays = tuple(None if given[name] is None else jax.numpy.asarray(given[name]) for name in _api.ARRAY_OPTIONS)
    if isinstance(mod_arrays, dict):  # anything else reaches cuflash's check as it is
        mod_arrays = {name: jax.numpy.asarray(a) if hasattr(a, "dtype") else a for name, a in mod_arrays.items()}
    arrays += (mod_arrays,)
    bias = None if bias is None else jax.numpy.asarray(bias)
    _check(q, k, v, bias, arrays, options)
    if isinstance(window_size, list):  # static under jit: hashable
        options = tuple((key, tuple(val) if key == "window_size" else val) for key, val in options)
    return _attention(q, k, v, bias, arrays, options)


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache. JAX arrays are immutable: the call returns the caches with the new tokens appended, as
# results aliased to the cache arguments (input_output_aliases), so that XLA updates them in place where the caller
# donates them (jax.jit(..., donate_argnums=...)) and copies them first where it does not.

_KV_ARRAYS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "rotary_cos", "rotary_sin", "cache_batch_idx",
              "cache_leftpad", "block_table", "alibi_slopes")


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved: bool = True,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    num_splits: int = 0,
):
    """:func:`cuflash.attention_with_kvcache` for JAX arrays: ``(out, k_cache, v_cache)``, or ``(out, lse, k_cache,
    v_cache)`` with ``return_lse``, the caches returned with ``k`` and ``v`` appended.

    The arguments and their meaning are :func:`cuflash.attention_with_kvcache`'s (flash-attention's
    ``flash_attn_with_kvcache``). JAX arrays cannot change in place: the updated caches are results, aliased to the
    cache arguments, so under ``jax.jit`` with the caches donated (``donate_argnums``) XLA appends into the same
    buffers, and otherwise copies the caches first (the arguments keep their values). The call runs as
    :func:`attention`'s callback does (``callback_route()``): on a GPU the CUDA decode kernels on XLA's buffers and
    stream, on the CPU the NumPy reference. Shapes and dtypes are checked when the call is traced; index values
    (``cache_seqlens``, ``block_table``, ...) when it runs, as cuflash.attention_with_kvcache checks them. Not
    differentiable; no ``jax.vmap`` (a decode step has its batch axis already).
    """
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                 alibi_slopes=alibi_slopes)
    for name in ("q", "k_cache", "v_cache"):
        if not hasattr(given[name], "shape"):
            got = "None" if given[name] is None else f"{type(given[name]).__module__}.{type(given[name]).__name__}"
            raise TypeError(f"cuflash.jax.attention_with_kvcache: {name} must be an array (a jax.Array, or a "
                            f"numpy.ndarray); got {got}")
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.full((np.shape(q)[0],), int(cache_seqlens), np.int32)  # (checked as the array it becomes)
    given["cache_seqlens"] = cache_seqlens
    names = tuple(name for name in _KV_ARRAYS if given[name] is not None)
    arrays = tuple(jax.numpy.asarray(given[name]) for name in names)
    if isinstance(window_size, list):
        window_size = tuple(window_size)
    options = (("rotary_interleaved", rotary_interleaved), ("causal", causal), ("window_size", window_size),
               ("softcap", softcap), ("softmax_scale", softmax_scale), ("num_splits", num_splits))
    _check_kvcache(names, arrays, options)
    out, lse, k_new_cache, v_new_cache = _kvcache_function(names, options)(*arrays)
    return (out, lse, k_new_cache, v_new_cache) if return_lse else (out, k_new_cache, v_new_cache)


def _check_kvcache(names, arrays, options) -> None:
    """cuflash.attention_with_kvcache's checks of shapes, dtypes and options, on NumPy stand-ins of the arrays (their
    values are read when the call runs)."""
    stand = dict(zip(names, (_stand_in(a) for a in arrays)))
    _api._kvcache_call(
        stand["q"], stand["k_cache"], stand["v_cache"], stand.get("k"), stand.get("v"),
        cache_seqlens=stand["cache_seqlens"], **{name: stand.get(name) for name in _KV_ARRAYS[6:]}, out=None,
        read_values=False, **dict(options))


@functools.lru_cache(maxsize=64)
def _kvcache_function(names: tuple, options: tuple):
    """The jitted decode step of these arguments and options: ``(out, lse, k_cache, v_cache)``."""

    def step(*arrays):
        given = dict(zip(names, arrays))
        q, v_cache = given["q"], given["v_cache"]
        batch, seqlen_q, heads_q, _ = q.shape
        lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
        shapes = (jax.ShapeDtypeStruct((batch, seqlen_q, heads_q, v_cache.shape[-1]), q.dtype),
                  jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), lse_dtype),
                  _shape_of(given["k_cache"]), _shape_of(v_cache))
        aliases = {names.index("k_cache"): 2, names.index("v_cache"): 3}
        if callback_route() == "buffer":
            return tuple(_buffer_callback(functools.partial(_kvcache_buffers, names, options), shapes,
                                          input_output_aliases=aliases)(*arrays))
        return tuple(jax.pure_callback(functools.partial(_kvcache_host, names, options), shapes, *arrays))

    return jax.jit(step)


def _kvcache_run(names, options, arrays, k_cache, v_cache, out=None):
    """cuflash.attention_with_kvcache on NumPy or CuPy arrays, appending into ``k_cache`` and ``v_cache`` (and
    writing into ``out`` where given)."""
    given = dict(zip(names, arrays))
    given["k_cache"], given["v_cache"] = k_cache, v_cache
    kwargs = {name: given[name] for name in names if name not in ("q", "k_cache", "v_cache", "k", "v")}
    return cuflash.attention_with_kvcache(given["q"], k_cache, v_cache, given.get("k"), given.get("v"),
                                         return_lse=True, out=out, **kwargs, **dict(options))


def _kvcache_host(names, options, *arrays):
    """The pure-callback body: NumPy copies of the caches, appended to and returned."""
    arrays = [np.asarray(a) for a in arrays]
    k_cache = np.array(arrays[names.index("k_cache")])
    v_cache = np.array(arrays[names.index("v_cache")])
    out, lse = _kvcache_run(names, options, arrays, k_cache, v_cache)
    return out, lse, k_cache, v_cache


def _kvcache_buffers(names, options, ctx, outs, *bufs) -> None:
    """The buffer-callback body: the cache results (aliased to the cache arguments: XLA has put the caches'
    values there) appended to in place, out and lse written into their buffers. On a GPU, CuPy views of XLA's
    buffers on XLA's stream; on the CPU, NumPy views."""
    kind, ordinal = bufs[0].__dlpack_device__()
    if kind == _KDL_CPU:
        arrays = [np.asarray(b) for b in bufs]
        results = [np.asarray(o) for o in outs]
        _, lse = _kvcache_run(names, options, arrays, results[2], results[3], out=results[0])
        results[1][...] = lse
        return
    import cupy

    with cupy.cuda.Device(ordinal), _xla_stream(ordinal, ctx.stream):
        arrays = [_cupy_view(ordinal, _buffer_ptr(b), tuple(b.shape), np.dtype(b.dtype)) for b in bufs]
        results = [_cupy_view(ordinal, _buffer_ptr(o), tuple(o.shape), np.dtype(o.dtype)) for o in outs]
        _, lse = _kvcache_run(names, options, arrays, results[2], results[3], out=results[0])
        _write(results[1], lse)


