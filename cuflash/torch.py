"""PyTorch front end: :func:`attention`, over the custom operators ``cuflash::attention_fwd`` and
``cuflash::attention_bwd``, and :func:`attention_with_kvcache`, over ``cuflash::attention_with_kvcache``
(``cuflash::attention_with_kvcache_readonly`` when nothing is appended) (``torch.library``).

Tensors cross into cuflash without copies: CPU tensors as NumPy views (the NumPy block algorithm), CUDA
tensors as CuPy arrays over their memory (the kernels). A CUDA call runs on PyTorch's current stream, and every
allocation the CuPy launcher makes during it (outputs, workspaces) comes from PyTorch's caching allocator:
there is no second memory pool, the results are tensors over that memory, and a ``torch.cuda.CUDAGraph``
captures the calls (what a replay could not repeat, such as dropout's seed, is refused under capture: see
``docs/pytorch.md``). The forward saves the logsumexp; the backward runs :func:`cuflash.attention_backward`.
Importing :mod:`cuflash` never imports this module, so PyTorch stays an optional dependency
(``pip install cuflash[torch]``).

The operators have fake (meta) implementations, which give the outputs' shapes and dtypes, and the
forward's gradient is registered with ``torch.library.register_autograd``: ``torch.compile(fn,
fullgraph=True)`` traces a function that calls :func:`attention` with no graph break, and
``torch.library.opcheck`` passes on them (``docs/pytorch.md``). They can be called directly as
``torch.ops.cuflash.attention_fwd`` and ``torch.ops.cuflash.attention_bwd``; their schemas are the
keywords of :func:`cuflash.attention` in an operator's types (``window_size`` as ``window_left`` and
``window_right``, ``mod_arrays`` as a list of tensors and ``mod_array_names`` joined by commas, the dropout
seed as a 0-d int64 CPU tensor, the seed and ``dropout_offset`` as the int64 with the same bits).

Layout is cuflash's ``(batch, seqlen, heads, head_dim)``, or packed ``(total, heads, head_dim)`` with
``cu_seqlens_q``/``cu_seqlens_k``; a ``(batch, heads, seqlen, head_dim)`` tensor goes in as
``t.transpose(1, 2)``, with no copy. The variant tensors (``alibi_slopes``, ``cu_seqlens_q``,
``cu_seqlens_k``, ``seqused_k``, ``attn_mask``) cross the same way as q, k, v and get no gradient; ``bias``
crosses the same way and gets one when it requires grad (computed only then).

Dropout (``dropout_p > 0``) draws its Philox seed from PyTorch's default CPU generator when no
``dropout_seed`` is given (the draw of :func:`draw_dropout_seed`, kept a tensor so that ``torch.compile``
traces it), as flash-attention draws from PyTorch's generator: ``torch.manual_seed(s)`` reproduces a run,
and the backward reuses the forward's seed and offset.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Mapping
from typing import Optional

import ml_dtypes
import numpy as np
import torch

import cuflash
from cuflash._ops import api as _api, chunked_prefill as _chunked_prefill, kvcache as _kvcache, validate as _validate
from cuflash._ops.gpu_memory import StreamSinks, stream_owner

__all__ = ["attention", "attention_with_kvcache", "draw_dropout_seed"]


def draw_dropout_seed(generator: torch.Generator | None = None) -> int:
    """One dropout seed, an integer in ``[0, 2**63 - 1)``, drawn with ``torch.randint`` from ``generator``
    (a CPU generator; default: PyTorch's default CPU generator, which ``torch.manual_seed`` seeds).

    :func:`attention` calls this for a ``dropout_p > 0`` call without ``dropout_seed``, so that after
    ``torch.manual_seed(s)`` the same draw gives the seed it used, and
    ``cuflash.dropout_mask((batch, heads_q, seqlen_q, seqlen_k), dropout_p, seed, dropout_offset)`` the mask
    it applied. The draw runs on the CPU: no device synchronization.
    """
    return int(torch.randint(0, 2**63 - 1, (), generator=generator, dtype=torch.int64).item())


# ---------------------------------------------------------------------------------------------------
# Tensors into the backends and results back, without copies
# ---------------------------------------------------------------------------------------------------
#
# CPU tensors cross as NumPy views and run the NumPy reference. CUDA tensors cross as CuPy arrays over the tensors'
# own memory, and a CUDA call runs inside _backend_call: CuPy on the tensors' device, on PyTorch's current stream
# there, and allocating from PyTorch. Every cupy.empty / cupy.zeros of the CuPy launcher during the call (outputs,
# workspaces such as dq_accum and delta, the variant's parameter block) takes its memory from torch.empty, that is
# from torch's caching allocator on the current stream (inside a CUDA graph capture, from the graph's private
# pool), and the results come back as tensors over those torch allocations. Nothing is held in CuPy's memory pool,
# nothing is copied, and no event or synchronization is added: all the work is ordered on the one stream.

# CuPy (NumPy) dtypes of the tensors that cross (bfloat16 is ml_dtypes', as NumPy has none), and back.
_ARRAY_DTYPES = {
    torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64), torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64), torch.int16: np.dtype(np.int16), torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
}
_TENSOR_DTYPES = {dtype: t for t, dtype in _ARRAY_DTYPES.items()}


def _to_array(t: torch.Tensor):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of a tensor."""
    t = t.detach()
    if t.is_cuda:
        return _cuda_array(t)
    if t.dtype == torch.bfloat16:  # NumPy has no native bfloat16: reinterpret the bits as ml_dtypes'
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _cuda_array(t: torch.Tensor):
    """A CuPy array over a CUDA tensor's memory (its shape, strides and dtype), keeping the tensor alive. Built
    directly rather than through DLPack: no stream handshake (the work runs on the tensor's stream anyway), and
    bfloat16 crosses as ml_dtypes' dtype."""
    import cupy

    dtype = _ARRAY_DTYPES.get(t.dtype)
    if dtype is None:  # (a dtype the front door refuses anyway: let it name the array)
        return cupy.from_dlpack(t)
    itemsize = dtype.itemsize
    extent = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * itemsize if t.numel() else 0
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), extent, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0),
                        strides=tuple(s * itemsize for s in t.stride()))


class _TorchMemory:
    """CuPy's allocator during one CUDA call: each request is a ``torch.empty`` uint8 tensor of that many bytes
    (torch's caching allocator, on torch's current stream), held by the ``cupy.cuda.UnownedMemory`` that CuPy
    keeps; when CuPy drops its last array on it, the tensor goes and torch frees the block. :meth:`tensor` turns a
    CuPy array allocated during the call into a tensor over its torch allocation."""

    def __init__(self, device: torch.device):
        import cupy

        self._device, self._index = device, device.index
        self._unowned, self._pointer = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer
        self._owners = weakref.WeakValueDictionary()  # data pointer -> the live uint8 tensor that holds it

    def __call__(self, nbytes: int):
        owner = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        ptr = owner.data_ptr()
        if nbytes:
            self._owners[ptr] = owner
        return self._pointer(self._unowned(ptr, nbytes, owner, self._index), 0)

    def tensor(self, a) -> torch.Tensor | None:
        """``a`` as a tensor over the same memory (its shape, strides, dtype), or None when ``a`` does not lie in
        memory allocated during this call."""
        base = a.data.mem.ptr
        owner = self._owners.get(base)
        dtype = _TENSOR_DTYPES.get(np.dtype(a.dtype))
        itemsize = a.itemsize
        offset = a.data.ptr - base
        if owner is None or dtype is None or offset % itemsize or any(s < 0 or s % itemsize for s in a.strides):
            return None
        return _retyped(owner, dtype, a.shape, [s // itemsize for s in a.strides], offset // itemsize)


def _retyped(owner: torch.Tensor, dtype: torch.dtype, shape, strides, offset: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` over ``owner``'s storage (``offset`` and ``strides`` in its own elements) that is not a
    view: an operator's outputs must not be views, since autograd forbids modifying in place a view returned by a
    custom function (the user's ``out.mul_(2)`` would raise)."""
    return torch.empty(0, dtype=dtype, device=owner.device).set_(owner.untyped_storage(), offset, shape, strides)


@contextlib.contextmanager
def _backend_call(t: torch.Tensor):
    """The context of one call of a backend on tensors like ``t``; yields the call's :class:`_TorchMemory` (None
    for CPU tensors). For CUDA tensors: torch's and CuPy's current device is t's, CuPy's current stream is
    torch's current stream on it, and CuPy allocates through :class:`_TorchMemory`."""
    if not t.is_cuda:
        yield None
        return
    import cupy

    index = t.device.index
    memory = _TorchMemory(t.device)
    with torch.cuda.device(index), cupy.cuda.Device(index):
        with _cupy_stream(cupy, index, torch.cuda.current_stream(index).cuda_stream), \
                cupy.cuda.using_allocator(memory):
            yield memory


# (device, stream pointer) -> CuPy's view of one of torch's streams, made once: CuPy 14 warns (DeprecationWarning)
# at every cupy.cuda.ExternalStream made, which a decode step would otherwise pay at every layer. A view holds only the
# pointer (it never destroys the stream). At most 64, the oldest dropped first.
_streams = _api.CallMemo(64)


def _cupy_stream(cupy, index: int, ptr: int):
    stream = _streams.get((index, ptr))
    if stream is None:
        stream = cupy.cuda.ExternalStream(ptr, index)
        _streams.put((index, ptr), stream)
    return stream


def _output(a, memory: _TorchMemory | None) -> torch.Tensor:
    """A backend's result as a tensor, contiguous at storage offset 0 as the fake implementations promise, and not
    a view (:func:`_retyped`). NumPy results are wrapped; CuPy results are tensors over the torch memory they were
    allocated in during the call (``memory``). A result laid out otherwise, or (none of the launcher's) lying
    elsewhere, is copied into a new tensor on the call's stream."""
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a.view(np.int16) if a.dtype == ml_dtypes.bfloat16 else a)
        if a.dtype == ml_dtypes.bfloat16:
            t = _retyped(t, torch.bfloat16, t.shape, t.stride(), t.storage_offset())
    else:
        t = memory.tensor(a)
        if t is None:
            import cupy

            t = torch.empty(a.shape, dtype=_TENSOR_DTYPES[np.dtype(a.dtype)], device=memory._device)
            cupy.copyto(_cuda_array(t), a)
    return t if t.is_contiguous() and t.storage_offset() == 0 else t.clone(memory_format=torch.contiguous_format)


def _check_devices(**tensors) -> None:
    """The tensors given (None: not given) are on one device, q's (the first): cuflash runs the NumPy reference
    on CPU tensors and the CUDA kernels on CUDA tensors of one GPU, and copies nothing between devices."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    first, device = given[0][0], given[0][1].device
    for name, t in given[1:]:
        if t.device != device:
            raise ValueError(
                f"{first} and {name} must be on the same device (cuflash copies nothing between devices: CPU "
                f"tensors run the NumPy reference, CUDA tensors the kernels); got {first} on {device} and {name} on "
                f"{t.device}"
            )


def _with_arrays(options: dict) -> dict:
    """The options with every tensor among them (the variant arrays, and those of ``mod_arrays``) as an
    array, like q, k, v."""
    def convert(val):
        if isinstance(val, dict):
            return {name: convert(a) for name, a in val.items()}
        return _to_array(val) if isinstance(val, torch.Tensor) else val

    return {key: convert(val) for key, val in options.items()}


# ---------------------------------------------------------------------------------------------------
# The custom operators: cuflash::attention_fwd and cuflash::attention_bwd
# ---------------------------------------------------------------------------------------------------
#
# torch.compile traces through them with their fake implementations (shapes and dtypes only) and
# AOTAutograd differentiates attention_fwd with the formula of register_autograd, which calls
# attention_bwd: no graph break. Their arguments are the keywords of cuflash.attention in the types an
# operator schema has: window_size as two ints, mod_arrays as a list of tensors and their names joined by
# commas, the dropout seed as a 0-d int64 CPU tensor (so that a seed drawn from torch's generator inside a
# compiled function stays a tensor: no .item(), no graph break) and the seed and offset, integers in
# [0, 2**64), as int64 bit patterns (_signed64).

_SCALAR_OPTIONS = (
    "causal", "softmax_scale", "causal_align", "window_left", "window_right", "softcap", "max_seqlen_q",
    "max_seqlen_k", "dropout_p", "dropout_offset", "score_mod", "mask_mod", "mod_array_names", "algorithm",
    "block_q", "block_k", "fp32_precision",
)


def _signed64(value: int) -> int:
    """An integer in [0, 2**64) as the int64 with the same bits (an operator's int is an int64)."""
    return value - 2**64 if value >= 2**63 else value


def _unsigned64(value: int) -> int:
    return value + 2**64 if value < 0 else value


def _front_door_options(args: dict, backward: bool = False) -> dict:
    """The variant keywords of cuflash.attention / attention_backward (``backward``: without the forward's
    ``fp32_precision``) from an operator's arguments (its ``locals()``), the tensors as NumPy or CuPy views (no
    copies)."""
    names = args["mod_array_names"].split(",") if args["mod_array_names"] else []
    seed = args["dropout_seed"]
    skip = ("window_left", "window_right", "dropout_offset", "mod_array_names") + (("fp32_precision",) if backward
                                                                                  else ())
    return dict(
        _with_arrays({name: args[name] for name in _api.ARRAY_OPTIONS}),
        **{name: args[name] for name in _SCALAR_OPTIONS if name not in skip},
        window_size=(args["window_left"], args["window_right"]),
        mod_arrays={name: _to_array(a) for name, a in zip(names, args["mod_arrays"])} if names else None,
        # a CPU tensor: read without a device synchronization (a CUDA graph capture refuses dropout, see below)
        dropout_seed=None if seed is None else _unsigned64(int(seed.item())),
        dropout_offset=_unsigned64(args["dropout_offset"]),
    )


# What a CUDA graph capture of attention_fwd / attention_bwd refuses (torch.cuda.graph, torch.compile's
# mode="reduce-overhead"): the argument, whether a call uses it, and why a replay could not repeat the call. The
# rest (dense, causal, windows, softcap, ALiBi, GQA, any head dim, both backward orders) is launches on the current
# stream with memory from the graph's pool, and is captured.
_NOT_CAPTURABLE = (
    ("dropout_p", lambda a: a["dropout_p"] > 0,
     "the dropout seed and offset reach the kernels by value, so every replay would apply the captured mask "
     "(PyTorch's own kernels read them from device memory that the CUDA generator advances at each replay); "
     "capture with dropout_p=0"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"] is not None,
     "the front door checks the packed batch's offsets on the host, a device-to-host copy that a capture forbids"),
    ("seqused_k", lambda a: a["seqused_k"] is not None,
     "the front door checks the lengths on the host, a device-to-host copy that a capture forbids"),
    ("bias", lambda a: a["bias"] is not None,
     "its address reaches the kernels in a parameter block copied from host memory at each call, which a replay "
     "would read from a reused staging buffer"),
    ("attn_mask", lambda a: a["attn_mask"] is not None,
     "it runs as a bias, whose address reaches the kernels in a parameter block copied from host memory at each "
     "call, which a replay would read from a reused staging buffer"),
    ("score_mod / mask_mod", lambda a: a["score_mod"] is not None or a["mask_mod"] is not None,
     "their arrays and block lists reach the kernels in a parameter block copied from host memory at each call, "
     "which a replay would read from a reused staging buffer"),
)


def _refuse_in_capture(args: dict) -> None:
    """Inside a CUDA graph capture on the current stream, raise for what a replay could not repeat (the operator's
    arguments, its ``locals()``): ``NotImplementedError`` naming the argument, before anything is launched."""
    if not torch.cuda.is_current_stream_capturing():
        return
    for name, used, why in _NOT_CAPTURABLE:
        if used(args):
            value = args.get(name, None)
            if isinstance(value, torch.Tensor):
                given = f"a {name} tensor of shape {tuple(value.shape)}"
            elif name in args:
                given = f"{name}={value!r}"
            else:
                given = f"score_mod={args['score_mod']!r}, mask_mod={args['mask_mod']!r}"
            raise NotImplementedError(
                f"{name} cannot be captured in a CUDA graph yet: {why}; got {given} during a capture. Run this call "
                "outside the captured region (or compile without mode='reduce-overhead')")
    if _validate.finite_checks(False):
        raise NotImplementedError(
            f"{_validate.FINITE_CHECK_ENV}=1 cannot be captured in a CUDA graph: the finite check reads its result on "
            "the host; unset it while capturing")


def _fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor], mod_arrays: list[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    causal: bool, softmax_scale: Optional[float], causal_align: str, window_left: int, window_right: int,
    softcap: float, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], dropout_p: float, dropout_offset: int,
    score_mod: Optional[str], mask_mod: Optional[str], mod_array_names: str, algorithm: str,
    block_q: Optional[int], block_k: Optional[int], fp32_precision: str, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`cuflash.attention` (``deterministic`` is the backward's, kept for autograd)."""
    return _forward_backend(locals())


def _forward_backend(args: dict, remember=None):
    """The body of :func:`_fwd_impl`, whose arguments ``args`` holds by name. ``remember``: the call's
    :func:`_forward_key`, under which the front door's plan of it is kept (a CUDA call)."""
    q, k, v, bias = args["q"], args["k"], args["v"], args["bias"]
    _check_devices(q=q, k=k, v=v, bias=bias, alibi_slopes=args["alibi_slopes"], cu_seqlens_q=args["cu_seqlens_q"],
                   cu_seqlens_k=args["cu_seqlens_k"], seqused_k=args["seqused_k"], attn_mask=args["attn_mask"],
                   **{f"mod_arrays[{i}]": a for i, a in enumerate(args["mod_arrays"])})
    with _backend_call(q) as memory:  # CUDA: torch's stream and allocator (out, lse and workspaces from torch)
        if memory is not None:
            _refuse_in_capture(args)
        qa, ka, va = _to_array(q), _to_array(k), _to_array(v)
        options = _front_door_options(args)
        out, lse = cuflash.attention(qa, ka, va, return_lse=True, bias=None if bias is None else _to_array(bias),
                                     **options)
        if remember is not None and memory is not None:
            plan = _api.attention_plan(qa, ka, va, **options)
            if plan is not None:
                _forward_plans.put(remember, plan)
        return _output(out, memory), _output(lse, memory)


_attention_fwd = torch.library.custom_op("cuflash::attention_fwd", mutates_args=())(_fwd_impl)
_FWD_PARAMS = tuple(inspect.signature(_fwd_impl).parameters)


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, attn_mask, mod_arrays,
                        dropout_seed, *scalars):
    _check_devices(q=q, k=k, v=v, bias=bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, attn_mask=attn_mask,
                   **{f"mod_arrays[{i}]": a for i, a in enumerate(mod_arrays)})
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # (batch, heads_q, seqlen_q); packed (total_q, heads_q, d) q: (heads_q, total_q)
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=lse_dtype)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def _attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    bias: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
    mod_arrays: list[torch.Tensor], dropout_seed: Optional[torch.Tensor],
    causal: bool, softmax_scale: Optional[float], causal_align: str, window_left: int, window_right: int,
    softcap: float, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], dropout_p: float, dropout_offset: int,
    score_mod: Optional[str], mask_mod: Optional[str], mod_array_names: str, algorithm: str,
    block_q: Optional[int], block_k: Optional[int], fp32_precision: str, deterministic: bool, want_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dbias)`` of :func:`cuflash.attention_backward`; ``dbias`` is an empty ``(0,)`` tensor
    unless ``want_dbias`` (an operator returns tensors, never None). ``fp32_precision`` is the forward's (the
    backward has none)."""
    _check_devices(q=q, dout=dout, k=k, v=v, out=out, lse=lse, bias=bias, alibi_slopes=alibi_slopes,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, attn_mask=attn_mask,
                   **{f"mod_arrays[{i}]": a for i, a in enumerate(mod_arrays)})
    args = locals()
    with _backend_call(q) as memory:  # CUDA: torch's stream and allocator (gradients, dq_accum, delta from torch)
        if memory is not None:
            _refuse_in_capture(args)
        grads = cuflash.attention_backward(
            _to_array(dout), _to_array(q), _to_array(k), _to_array(v), _to_array(out), _to_array(lse),
            deterministic=deterministic, return_dbias=want_dbias, bias=None if bias is None else _to_array(bias),
            **_front_door_options(args, backward=True),
        )
        dq, dk, dv = (_output(g, memory) for g in grads[:3])
        dbias = _output(grads[3], memory) if want_dbias else q.new_empty((0,))
        return dq, dk, dv, dbias


@_attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, bias, *rest):
    want_dbias = rest[-1]
    dbias = bias.new_empty(bias.shape) if want_dbias else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, bias, alibi_slopes, cu_q, cu_k, used, mask, mod_arrays, seed, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, cu_q, cu_k, used, mask, seed, *mod_arrays)
    ctx.scalars = scalars  # _SCALAR_OPTIONS, then deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, bias, alibi_slopes, cu_q, cu_k, used, mask, seed, *mod_arrays = ctx.saved_tensors
    if dout is None:  # only lse was used (it has no gradient): nothing flows back
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:  # autograd may hand over an expanded or strided gradient
        dout = dout.contiguous()
    want_dbias = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _attention_bwd(dout, q, k, v, out, lse, bias, alibi_slopes, cu_q, cu_k, used, mask, mod_arrays,
                                       seed, *ctx.scalars, want_dbias)
    # one gradient per input: q, k, v, bias; none for the variant tensors, the list mod_arrays, the seed and
    # the scalars
    return (dq, dk, dv, dbias if want_dbias else None, None, None, None, None, None, [None] * len(mod_arrays),
            None, *(None for _ in ctx.scalars))


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("cuflash.torch.attention has no second derivative (double backward)")


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
# Under create_graph=True the gradients stay connected to q, k, v and dout through attention_bwd, so that
# differentiating them again raises instead of treating them as constants.
_attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache: the custom operators cuflash::attention_with_kvcache and
# cuflash::attention_with_kvcache_readonly
# ---------------------------------------------------------------------------------------------------
#
# cuflash.attention_with_kvcache as an operator that mutates k_cache and v_cache: when k and v are given, the new
# tokens are written into the caches in place before the attention, and the schema says so (mutates_args), so
# that torch.compile functionalizes the call instead of reordering reads of the caches around it. No gradient,
# as flash-attention's flash_attn_with_kvcache. CPU tensors run the NumPy reference (cuflash.reference.decode),
# CUDA tensors the decode kernels, on torch's stream with out, lse and the split workspace from torch's allocator.
# cache_seqlens is a tensor, or (cache_seqlens None) the int cache_seqlens_int for every sequence, which the front
# door checks against the caches' capacity.
#
# A call without k and v writes nothing: it runs cuflash::attention_with_kvcache_readonly, the same operator without
# k, v and without the mutation. Why two: an eager call of an operator that declares mutated arguments goes through
# torch's ADInplaceOrView kernel for custom operators, which bumps the mutated tensors' version counters after
# torch._library.utils.fill_defaults(schema, ...), whose cost grows with the square of the schema's arguments (it
# reads schema.arguments, a new list, once per argument): ~150 us per call on a 2-vCPU VM for these 20 arguments,
# against ~30 us for the whole dispatch of an operator without mutation. A transformers decode step (the cache
# appended by transformers itself) pays it at every layer otherwise.


def _runs_eagerly(*tensors) -> bool:
    """Whether a call may run the operator's implementation directly: plain tensors, no tracing, no dispatch or
    torch-function mode that the operator's dispatch would honour. The dispatch of a Python custom operator costs
    about 0.3 ms on the host (measured on the H100 in generation: 1.06 ms per decode call through the operator,
    0.75 inside it), which a decode step of a few microseconds of GPU time cannot hide."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and all(t is None or type(t) is torch.Tensor for t in tensors))


# ---------------------------------------------------------------------------------------------------
# Calls like ones already run: straight to their plans
# ---------------------------------------------------------------------------------------------------
#
# An eager call on CUDA tensors crosses into CuPy: CuPy arrays over the tensors, CuPy's device, stream and allocator
# switched to torch's, the front door's key of the CuPy arrays, the results wrapped back as tensors (on the H200
# machine ~0.3 ms of host time per decode call, where the decode kernel takes 5-20 us and sdpa's whole call ~0.1 ms).
# Two kinds of calls skip it once a call with the same layouts and options has run (DIRECT_CALLS):
#
# - a decode step (attention_with_kvcache) without k, v, rotary, cache_batch_idx or pages, with fewer query tokens
#   than a chunked prefill and v's head dim q's (what a transformers decode step makes): the launch that call left in
#   the front door's memory (a growing one: it follows the caches' slot count) runs with the tensors' addresses in its
#   record (DecodeLaunch.run_addresses), out and lse from torch.empty, on torch's current stream. The key
#   (_decode_key) is the front door's for a cache that grows: the caches without their slot count and their strides
#   but the last; what it leaves out is checked at each call (_decode_run), as the front door checks it
#   (cuflash._ops.api._fits);
# - an inference call of attention (no gradient wanted) on q, k and v alone without dropout: the front door's plan
#   of the call (_forward_key, _forward_run), the tensors' addresses passed as _Address.
_decode_launches = _api.CallMemo(64)
DIRECT_CALLS = True  # (False: every call crosses into CuPy, for comparison)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (absent from CPU builds)


class _Address:
    """What a plan reads of an array it does not allocate: ``data.ptr``."""

    __slots__ = ("data", "ptr")

    def __init__(self, ptr: int):
        self.data, self.ptr = self, ptr


def _gpu_index(t: torch.Tensor) -> int:
    """t's CUDA device, or -1 (``tools/transformers_profile.py --host`` poses CPU tensors as CUDA ones here)."""
    return t.get_device() if t.is_cuda else -1


def _stream_address(index: int) -> int:
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


def _layout(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


# attention's inference calls: the front door's plan (a ForwardPlan) under the tensors' layouts and options.
_forward_plans = _api.CallMemo(64)


def _hopper_switches() -> tuple:
    """The launcher's switches of the Hopper kernels, which decide a plan too (benchmarks flip them)."""
    from cuflash._cuda import attention as launcher

    return launcher.switches()


def _forward_key(q, k, v, causal, softmax_scale, causal_align, window_size, softcap, max_seqlen_q, max_seqlen_k,
                 dropout_p, dropout_seed, dropout_offset, algorithm, block_q, block_k, fp32_precision):
    """The key of an attention call on q, k and v alone in :data:`_forward_plans`, or None: a gradient wanted, not
    plain CUDA tensors run eagerly, dropout, options of unusual types (the checks judge them), the finite checks."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor and _runs_eagerly()) or (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return None
    index = _gpu_index(q)
    if index < 0:
        return None
    if not (type(causal) is bool and (softmax_scale is None or type(softmax_scale) in (float, int))
            and type(causal_align) is str and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int and type(softcap) in (float, int)
            and (max_seqlen_q is None or type(max_seqlen_q) is int)
            and (max_seqlen_k is None or type(max_seqlen_k) is int) and type(dropout_p) in (float, int)
            and dropout_p == 0 and dropout_seed is None and type(dropout_offset) is int and dropout_offset == 0
            and type(algorithm) is str and (block_q is None or type(block_q) is int)
            and (block_k is None or type(block_k) is int) and fp32_precision in _validate.FP32_PRECISIONS):
        return None
    if _validate.finite_checks(False):
        return None
    stream = _stream_address(index)  # (and its owner: a plan per thread on the per-thread default stream)
    return (index, stream, stream_owner(stream), _hopper_switches(), _layout(q), _layout(k), _layout(v), causal,
            type(softmax_scale), softmax_scale, causal_align, window_size, type(softcap), softcap, max_seqlen_q,
            max_seqlen_k, algorithm, block_q, block_k, fp32_precision)


def _forward_run(key, q, k, v):
    """``(out, lse)`` of a call whose key :data:`_forward_plans` holds, run by that plan; None where there is none,
    where the current device is not the tensors', or where an input's address needs the front door's aligned copy."""
    plan = _forward_plans.get(key)
    if plan is None or key[0] != _current_device():
        return None
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    done = plan.run(_Address(q.data_ptr()), _Address(k.data_ptr()), _Address(v.data_ptr()), stream=key[1],
                    out=_Address(out.data_ptr()), lse_out=_Address(lse.data_ptr()))
    return None if done is None else (out, lse)


def _decode_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, alibi_slopes, rotary_interleaved, causal,
                window_size, softcap, softmax_scale, num_splits):
    """The key of a decode call without k, v, rotary, cache_batch_idx or pages in :data:`_decode_launches`, or None:
    not plain CUDA tensors run eagerly, not the decode kernels' kind of call, options of unusual types (the checks
    judge them), a CUDA graph capture (an int cache_seqlens needs an array of its own there), the debug mode."""
    if not (type(q) is torch.Tensor and type(k_cache) is torch.Tensor and type(v_cache) is torch.Tensor
            and _runs_eagerly(cache_leftpad, alibi_slopes)):
        return None
    index = _gpu_index(q)
    if index < 0 or q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        return None
    qs, ks, vs = q.shape, k_cache.shape, v_cache.shape
    if not (0 < qs[1] < _chunked_prefill.MIN_SEQLEN_Q and ks[3] == vs[3]):
        return None
    if not _api.plain_decode_options(causal, rotary_interleaved, num_splits, window_size, softcap, softmax_scale):
        return None
    if type(cache_seqlens) is int:
        lens = None
    elif type(cache_seqlens) is torch.Tensor:
        lens = _layout(cache_seqlens)
    else:
        return None
    if _validate.device_value_checks() or torch.cuda.is_current_stream_capturing():
        return None
    stream = _stream_address(index)  # (and its owner: a launch per thread on the per-thread default stream)
    return (index, stream, qs, q.stride(), q.dtype, ks[0], ks[2], ks[3], k_cache.stride(3),
            k_cache.dtype, k_cache.get_device(), vs[0], vs[2], v_cache.stride(3), v_cache.dtype, v_cache.get_device(),
            lens, _layout(cache_leftpad), _layout(alibi_slopes), rotary_interleaved, causal, window_size,
            type(softcap), softcap, type(softmax_scale), softmax_scale, num_splits, stream_owner(stream))


# A direct decode step whose caller wants no lse writes it into a buffer of its device and stream (memory of its
# own), grown to the largest asked for and never read: one allocation fewer per step.
_lse_sinks = StreamSinks()


def _new_sink(key, count: int):
    """A new lse sink of ``count`` float32 on device ``key[0]`` (:data:`_lse_sinks`: (device, stream)) and its
    address: device memory of cuflash's own (``decode.own_memory``, as ``CupyRuntime.kept``), not torch's allocator,
    whose CUDA graph trees refuse a warm-up run that leaves a buffer alive in the graph's pool; torch's under a
    capture (where cudaMalloc is not allowed)."""
    if torch.cuda.is_current_stream_capturing():
        sink = torch.empty(count, dtype=torch.float32, device=key[0])
        return sink, sink.data_ptr()
    from ._cuda.decode import own_memory

    sink = own_memory((count,), np.float32, key[0].index)
    return sink, sink.data.ptr


def _rows_fit(slots: int, v_slots: int, ks: tuple, vs: tuple, itemsize: int) -> bool:
    """What a remembered decode launch checks of caches whose slot count and strides its key leaves out (as the front
    door's ``_fits``): slots, the same in both, and strides (elements, any axis order) of multiples of 16 bytes."""
    return slots > 0 and v_slots == slots and not ((ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) * itemsize) & 15


def _decode_run(key, q, k_cache, v_cache, cache_seqlens, cache_leftpad, alibi_slopes, want_lse=True):
    """``(out, lse)`` of a call whose key :data:`_decode_launches` holds, run by that launch (``want_lse`` False:
    ``(out, None)``, the lse written into the stream's sink); None where there is none, or where the caches or an int
    ``cache_seqlens`` need the front door's checks (a slot count of 0 or two different ones, strides not multiples of
    16 bytes, a length outside the slots), or where the current device is not the tensors' (the front door switches
    it)."""
    launch = _decode_launches.get(key)
    if launch is None:
        return None
    index = key[0]
    slots, itemsize = k_cache.shape[1], k_cache.element_size()
    ks, vs = k_cache.stride(), v_cache.stride()
    if not _rows_fit(slots, v_cache.shape[1], ks, vs, itemsize):
        return None
    if type(cache_seqlens) is int:
        lens = (_kvcache.uniform_seqlens_address(index, q.shape[0], cache_seqlens)
                if 0 <= cache_seqlens <= slots else None)
        if lens is None:
            return None
    else:
        lens = cache_seqlens.data_ptr()
    if index != _current_device():
        return None
    out = torch.empty(launch.out_shape, dtype=q.dtype, device=q.device)
    if want_lse:
        lse = torch.empty(launch.lse_shape, dtype=torch.float32, device=q.device)
        lse_ptr = lse.data_ptr()
    else:
        lse, lse_ptr = None, _lse_sinks.address((q.device, key[1]), math.prod(launch.lse_shape), _new_sink)
    # (the record's slots: q, k_cache, v_cache, k, v, out, lse, cache_seqlens, cache_leftpad, cache_batch_idx,
    # block_table, alibi_slopes)
    launch.run_addresses(
        (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), 0, 0, out.data_ptr(), lse_ptr, lens,
         0 if cache_leftpad is None else cache_leftpad.data_ptr(), 0, 0,
         0 if alibi_slopes is None else alibi_slopes.data_ptr()),
        slots, tuple(s * itemsize for s in ks), tuple(s * itemsize for s in vs), itemsize, key[1])
    return out, lse


def _current_device() -> int:
    return torch.cuda.current_device()


# transformers' decode steps, whose tensors are heads first (q (batch, heads_q, 1, d), k and v (batch, heads_kv,
# slots, d), a new, longer cache at every step): a step like one already run, by a key of those layouts and options,
# straight to the launch the front door made for it (the _decode_launches entry of its transposed views, a launch
# that follows the slot count), with no transposed views, few torch calls and its outputs from chunks of several
# (below). cuflash.integrations.transformers calls it first at every decode step of every layer.
_heads_first_steps = _api.CallMemo(64)
# (torch.cuda's is_current_stream_capturing and current_device without their Python wrappers: CUDA builds only, called
# once a tensor is known to be on a GPU)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_current_device_fast = getattr(torch._C, "_cuda_getDevice", None)


class _HeadsFirstStep:
    """A remembered heads-first decode step: its launch, the lse sink's address, and outputs handed out one by one
    from chunks of several (:meth:`output`)."""

    __slots__ = ("launch", "lse_ptr", "itemsize", "_outs", "_chunk", "_dtype", "_device")

    # outputs a chunk holds: as many as fit in 1 MiB, at most 64
    CHUNK_BYTES, CHUNK_MAX = 1 << 20, 64

    def __init__(self, launch, lse_ptr: int, dtype: torch.dtype, device: torch.device):
        self.launch, self.lse_ptr, self._dtype, self._device = launch, lse_ptr, dtype, device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        size = math.prod(launch.out_shape) * self.itemsize
        self._chunk = max(1, min(self.CHUNK_MAX, self.CHUNK_BYTES // max(size, 1)))
        self._outs: list = []

    def output(self) -> torch.Tensor:
        """A new output of the launch's shape: one of a chunk's disjoint views (torch.unbind), each handed out
        once; the chunk's memory goes back to torch's allocator when its last view is dropped. (One torch.empty per
        chunk instead of one per step: a few microseconds of a step's host time.)"""
        try:
            return self._outs.pop()
        except IndexError:
            chunk = torch.empty((self._chunk, *self.launch.out_shape), dtype=self._dtype, device=self._device)
            self._outs = outs = list(chunk.unbind(0))[::-1]
            return outs.pop()


def _direct_context(q, k, v, checks, *others) -> tuple | None:
    """``(device index, stream, its owner)`` of a heads-first call that may run directly (q, k, v plain CUDA tensors
    and ``others`` plain tensors or None, run eagerly (:func:`_runs_eagerly`), no gradient wanted, no capture,
    ``checks()`` off: the debug mode's or the finite checks'), or None."""
    if not DIRECT_CALLS or q is None or k is None or v is None or not _runs_eagerly(q, k, v, *others):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    index = _gpu_index(q)
    if index < 0 or _capturing() or checks():
        return None
    stream = _stream_address(index)
    return index, stream, stream_owner(stream)


def _heads_first_key(q, k, v, cache_leftpad, causal, window_size, softcap, softmax_scale):
    """The key of a heads-first decode step in :data:`_heads_first_steps` (cache_leftpad None or a tensor), or
    None."""
    context = _direct_context(q, k, v, _validate.device_value_checks, cache_leftpad)
    if context is None:
        return None
    index, stream, owner = context
    qs, ks, vs = q.shape, k.shape, v.shape
    return (index, stream, owner, qs, q.stride(), q.dtype, ks[0], ks[1], ks[3], k.stride(3), k.dtype,
            k.get_device(), vs[0], vs[1], vs[3], v.stride(3), v.dtype, v.get_device(),
            None if cache_leftpad is None else _layout(cache_leftpad), causal, window_size, type(softcap), softcap,
            type(softmax_scale), softmax_scale)


def decode_heads_first(q, k, v, cache_leftpad, causal, window_size, softcap, softmax_scale):
    """``out`` ``(batch, 1, heads_q, head_dim)`` of a decode step over transformers' heads-first tensors (q
    ``(batch, heads_q, 1, head_dim)``, k and v ``(batch, heads_kv, slots, head_dim)``, every slot a key of every
    sequence but its first ``cache_leftpad[b]``), as :func:`attention_with_kvcache` on their transposed views with
    ``cache_seqlens=slots`` computes it; None where no step like it has run (:func:`remember_heads_first`) or where
    this call needs the front door's checks (its caches' strides, the current device, a length the shared table of
    lengths does not hold yet)."""
    key = _heads_first_key(q, k, v, cache_leftpad, causal, window_size, softcap, softmax_scale)
    step = None if key is None else _heads_first_steps.get(key)
    if step is None:
        return None
    slots, ks, vs, itemsize = k.shape[2], k.stride(), v.stride(), step.itemsize
    if not _rows_fit(slots, v.shape[2], ks, vs, itemsize):
        return None
    index = key[0]
    lens = _kvcache.uniform_seqlens_address(index, key[3][0], slots)
    if lens is None or index != _current_device_fast():
        return None
    out = step.output()
    # (the record's slots: q, k_cache, v_cache, k, v, out, lse, cache_seqlens, cache_leftpad, cache_batch_idx,
    # block_table, alibi_slopes; the caches' byte strides in the (batch, slots, heads) order of their transposes)
    step.launch.run_addresses(
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), 0, 0, out.data_ptr(), step.lse_ptr, lens,
         0 if cache_leftpad is None else cache_leftpad.data_ptr(), 0, 0, 0),
        slots, (ks[0] * itemsize, ks[2] * itemsize, ks[1] * itemsize),
        (vs[0] * itemsize, vs[2] * itemsize, vs[1] * itemsize), itemsize, key[1])
    return out


def remember_heads_first(q, k, v, cache_leftpad, causal, window_size, softcap, softmax_scale) -> None:
    """After a decode step over heads-first tensors ran through :func:`attention_with_kvcache` (on their transposed
    views, ``cache_seqlens=slots``, no lse asked for): keep the launch the front door made for it under the step's
    heads-first key, for :func:`decode_heads_first`. Nothing where the step is not one the direct path takes."""
    key = _heads_first_key(q, k, v, cache_leftpad, causal, window_size, softcap, softmax_scale)
    if key is None or _heads_first_steps.get(key) is not None:
        return
    kt = k.transpose(1, 2)
    std = _decode_key(q.transpose(1, 2), kt, v.transpose(1, 2), kt.shape[1], cache_leftpad, None, True, causal,
                      window_size, softcap, softmax_scale, 0)
    launch = None if std is None else _decode_launches.get(std)
    if launch is None or not getattr(launch, "grows", False):
        return
    lse_ptr = _lse_sinks.address((q.device, key[1]), math.prod(launch.lse_shape), _new_sink)
    _heads_first_steps.put(key, _HeadsFirstStep(launch, lse_ptr, q.dtype, q.device))


# transformers' inference calls of more than one query (a prefill; q, k, v heads first): a call like one already run,
# by a key of those layouts and options, straight to the front door's plan of its transposed views (the
# _forward_plans entry), with no transposed views and the lse written into a buffer of the stream's.
_heads_first_plans = _api.CallMemo(64)


def _forward_heads_first_key(q, k, v, causal, window_size, softcap, softmax_scale):
    context = _direct_context(q, k, v, _finite_checks_on)
    if context is None:
        return None
    return (*context, _hopper_switches(), q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, k.get_device(),
            v.shape, v.stride(), v.dtype, v.get_device(), causal, window_size, type(softcap), softcap,
            type(softmax_scale), softmax_scale)


def _finite_checks_on() -> bool:
    return _validate.finite_checks(False)


def forward_heads_first(q, k, v, causal, window_size, softcap, softmax_scale):
    """``out`` ``(batch, seqlen_q, heads_q, head_dim_v)`` of an inference call over heads-first tensors (q ``(batch,
    heads_q, seqlen_q, d)``, k and v ``(batch, heads_kv, seqlen_k, d)``, as transformers holds them), as
    :func:`attention` on their transposed views with these options computes it; None where no call like it has run
    (:func:`remember_forward_heads_first`), or where it needs the front door (another current device, an address
    that needs an aligned copy)."""
    key = _forward_heads_first_key(q, k, v, causal, window_size, softcap, softmax_scale)
    entry = None if key is None else _heads_first_plans.get(key)
    if entry is None or key[0] != _current_device_fast():
        return None
    plan, lse_ptr, device = entry
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=device)
    done = plan.run(_Address(q.data_ptr()), _Address(k.data_ptr()), _Address(v.data_ptr()), stream=key[1],
                    out=_Address(out.data_ptr()), lse_out=_Address(lse_ptr))
    return None if done is None else out


def remember_forward_heads_first(q, k, v, causal, window_size, softcap, softmax_scale) -> None:
    """After an inference call on heads-first tensors ran through :func:`attention` on their transposed views (with
    these options, the others at their defaults): keep the plan the front door made for it under the call's
    heads-first key, for :func:`forward_heads_first`. Nothing where the call is not one the direct path takes."""
    key = _forward_heads_first_key(q, k, v, causal, window_size, softcap, softmax_scale)
    if key is None or _heads_first_plans.get(key) is not None:
        return
    std = _forward_key(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **{
        **_forward_key_defaults(), "causal": causal, "softmax_scale": softmax_scale, "window_size": window_size,
        "softcap": softcap})
    plan = None if std is None else _forward_plans.get(std)
    if plan is None:
        return
    lse_ptr = _lse_sinks.address((q.device, key[1]), math.prod(plan.lse_shape), _new_sink)
    _heads_first_plans.put(key, (plan, lse_ptr, q.device))


_FORWARD_KEY_DEFAULTS: dict = {}


def _forward_key_defaults() -> dict:
    """:func:`attention`'s defaults of the options :func:`_forward_key` takes after q, k and v (read from its
    signature once: a call that gave only the options of :func:`remember_forward_heads_first`)."""
    if not _FORWARD_KEY_DEFAULTS:
        given = inspect.signature(attention).parameters
        _FORWARD_KEY_DEFAULTS.update((name, given[name].default)
                                     for name in list(inspect.signature(_forward_key).parameters)[3:])
    return _FORWARD_KEY_DEFAULTS


def _kvcache_backend(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, rotary_cos, rotary_sin,
                     cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_interleaved, causal, window_left,
                     window_right, softcap, softmax_scale, num_splits, remember=None):
    """The body of both decode operators: ``(out, lse)`` of :func:`cuflash.attention_with_kvcache`. ``remember``: the
    call's :func:`_decode_key`, under which the launch the front door ran is kept (a CUDA call)."""
    arrays = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                  cache_leftpad=cache_leftpad, block_table=block_table, alibi_slopes=alibi_slopes)
    _check_devices(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens, **arrays)
    with _backend_call(q) as memory:
        if memory is not None and _validate.device_value_checks() and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                f"{_validate.DEVICE_CHECKS_ENV}=1 cannot be captured in a CUDA graph: it reads the index arrays on the "
                "host at every call; unset it while capturing")
        qa, ka, va = _to_array(q), _to_array(k_cache), _to_array(v_cache)
        lens = cache_seqlens_int if cache_seqlens is None else _to_array(cache_seqlens)
        given = {name: None if a is None else _to_array(a) for name, a in arrays.items()}
        options = dict(rotary_interleaved=rotary_interleaved, causal=causal, window_size=(window_left, window_right),
                       softcap=softcap, softmax_scale=softmax_scale, num_splits=num_splits)
        out, lse = cuflash.attention_with_kvcache(
            qa, ka, va, None if k is None else _to_array(k), None if v is None else _to_array(v), cache_seqlens=lens,
            **given, **options, return_lse=True)
        if remember is not None and memory is not None:
            launch = _api.kvcache_launch(qa, ka, va, cache_seqlens=lens, cache_leftpad=given["cache_leftpad"],
                                         alibi_slopes=given["alibi_slopes"], **options)
            if getattr(launch, "grows", False):
                _decode_launches.put(remember, launch)
        return _output(out, memory), _output(lse, memory)


def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                  block_table, alibi_slopes):
    _check_devices(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens, rotary_cos=rotary_cos,
                   rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                   block_table=block_table, alibi_slopes=alibi_slopes)
    batch, seqlen_q, heads_q = q.shape[:3]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty((batch, seqlen_q, heads_q, v_cache.shape[-1])),
            q.new_empty((batch, heads_q, seqlen_q), dtype=lse_dtype))


@torch.library.custom_op("cuflash::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _attention_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
    v: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor], cache_seqlens_int: int,
    rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    rotary_interleaved: bool, causal: bool, window_left: int, window_right: int, softcap: float,
    softmax_scale: Optional[float], num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`cuflash.attention_with_kvcache`, after it appended ``k`` and ``v`` to the caches."""
    return _kvcache_backend(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, rotary_cos, rotary_sin,
                            cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_interleaved, causal,
                            window_left, window_right, softcap, softmax_scale, num_splits)


@_attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, rotary_cos, rotary_sin,
                                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, *scalars):
    return _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                         cache_leftpad, block_table, alibi_slopes)


@torch.library.custom_op("cuflash::attention_with_kvcache_readonly", mutates_args=())
def _attention_with_kvcache_readonly(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: Optional[torch.Tensor],
    cache_seqlens_int: int, rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor], rotary_interleaved: bool, causal: bool, window_left: int, window_right: int,
    softcap: float, softmax_scale: Optional[float], num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`cuflash.attention_with_kvcache` without ``k`` and ``v``: nothing is written."""
    return _kvcache_backend(q, k_cache, v_cache, None, None, cache_seqlens, cache_seqlens_int, rotary_cos, rotary_sin,
                            cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_interleaved, causal,
                            window_left, window_right, softcap, softmax_scale, num_splits)


@_attention_with_kvcache_readonly.register_fake
def _attention_with_kvcache_readonly_fake(q, k_cache, v_cache, cache_seqlens, cache_seqlens_int, rotary_cos,
                                          rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                                          *scalars):
    return _kvcache_fake(q, k_cache, v_cache, None, None, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                         cache_leftpad, block_table, alibi_slopes)


def _optional_int(name: str, value):
    if value is None:
        return None
    if not _validate._is_int(value):
        raise TypeError(f"{name} must be a positive integer; got {type(value).__name__} {value!r}")
    return int(value)


def _mod_arrays(score_mod, mask_mod, mod_arrays) -> tuple[str, list]:
    """``mod_arrays`` as the operator takes it: the names joined by commas, and the tensors (detached)."""
    for name, text in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if text is not None and not isinstance(text, str):
            hint = ("; cuflash.BlockMask is taken by cuflash.attention (CuPy and NumPy arrays): here pass its "
                    "expression and arrays, mask_mod=m.mask_mod, mod_arrays=m.mod_arrays"
                    if type(text).__name__ == "BlockMask" else "")
            raise TypeError(f"{name} must be a string (a CUDA C expression, see docs/variants.md) or None; got "
                            f"{type(text).__name__}{hint}")
    if mod_arrays is None:
        return "", []
    if not isinstance(mod_arrays, Mapping):
        raise TypeError(f"mod_arrays must be a dict of names to 1-D int32 or float32 tensors; got "
                        f"{type(mod_arrays).__name__}")
    if score_mod is None and mask_mod is None:
        raise ValueError("mod_arrays is read by score_mod and mask_mod only; got mod_arrays without either")
    for name, a in mod_arrays.items():
        if not isinstance(name, str) or not (name.isascii() and name.isidentifier()):
            raise ValueError(f"mod_arrays names must be C identifiers (letters, digits, _); got {name!r}")
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"mod_arrays[{name!r}] must be a torch.Tensor (on the device of q); got {type(a).__name__}")
    return ",".join(mod_arrays), [a.detach() for a in mod_arrays.values()]


def _optional_tensor(name: str, value):
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (on the device of q) or None; got {type(value).__name__}")
    return value


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    causal_align: str = "bottom-right",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_k: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_arrays: dict | None = None,
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
    fp32_precision: str = "tf32x3",
    deterministic: bool = False,
    return_lse: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Differentiable :func:`cuflash.attention` on PyTorch tensors.

    ``score_mod`` and ``mask_mod`` are CUDA C expressions (strings) as in :func:`cuflash.attention`, with
    ``mod_arrays`` a dict of names to 1-D int32 / float32 tensors on q's device (no gradient).


    Arguments as :func:`cuflash.attention` (the variant arrays as tensors on q's device: int32
    ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``, float32 ``alibi_slopes``, floating ``bias``, bool
    ``attn_mask``); ``fp32_precision`` how the CUDA forward multiplies float32 tensors (``"tf32x3"``, ``"fp16x3"``,
    ``"tf32"``, ``"ieee"``: :func:`cuflash.attention`'s; the backward runs float32 arithmetic whatever it says);
    ``deterministic`` selects the backward without atomics. Gradients flow to ``q``, ``k``,
    ``v`` and ``bias`` (summed over the axes it broadcasts over; computed only when it requires grad); the
    other variant tensors and the logsumexp (with ``return_lse=True``, shape ``(heads_q, total_q)`` when
    packed) are not differentiable.

    ``dropout_p > 0`` zeroes probabilities as :func:`cuflash.attention` does. Without ``dropout_seed`` the seed
    is drawn by :func:`draw_dropout_seed` from PyTorch's default CPU generator (one draw per call with
    ``dropout_p > 0``, none otherwise), so ``torch.manual_seed`` makes a run reproducible; the backward
    reuses the forward's seed and ``dropout_offset``. Call with ``dropout_p=0`` to evaluate without dropout.

    ``softmax_scale`` may be any finite real (0: uniform attention; negative allowed), as in PyTorch's
    ``scaled_dot_product_attention``. All tensors must be on q's device. CUDA tensors run on torch's current
    stream with outputs and workspaces from torch's caching allocator; under a CUDA graph capture
    (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) dropout, packed batches (``cu_seqlens_*``),
    ``seqused_k``, ``bias``, ``attn_mask``, ``score_mod`` and ``mask_mod`` raise ``NotImplementedError`` (a replay
    could not repeat them). Inputs are not scanned for NaN or infinities; ``CUFLASH_CHECK_FINITE=1`` in the
    environment scans them when the operator runs (eager or compiled), raising ``ValueError`` with the tensor's
    name and the first bad index.

    FP8: ``torch.float8_e4m3fn`` q, k and v (with float32 ``q_descale``, ``k_descale``, ``v_descale`` of shape
    ``(batch, heads_kv)``, FlashAttention-3's) run :func:`cuflash.attention`'s FP8 forward: a bfloat16 output, no
    gradient (tensors that require one raise), eager only (not through torch.compile or a CUDA graph capture).
    """
    if (q_descale is not None or k_descale is not None or v_descale is not None
            or (isinstance(q, torch.Tensor) and q.dtype in _FP8_DTYPES)):
        return _attention_fp8(q, k, v, (q_descale, k_descale, v_descale), return_lse, dict(
            causal=causal, softmax_scale=softmax_scale, causal_align=causal_align, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, bias=bias,
            attn_mask=attn_mask, dropout_p=dropout_p, score_mod=score_mod, mask_mod=mask_mod, mod_arrays=mod_arrays,
            algorithm=algorithm, block_q=block_q, block_k=block_k))
    key = None
    if (bias is None and alibi_slopes is None and cu_seqlens_q is None and cu_seqlens_k is None and seqused_k is None
            and attn_mask is None and score_mod is None and mask_mod is None and mod_arrays is None and DIRECT_CALLS):
        key = _forward_key(q, k, v, causal, softmax_scale, causal_align, window_size, softcap, max_seqlen_q,
                           max_seqlen_k, dropout_p, dropout_seed, dropout_offset, algorithm, block_q, block_k,
                           fp32_precision)
        done = None if key is None else _forward_run(key, q, k, v)
        if done is not None:  # inference like a call already run: its plan, at once
            return done if return_lse else done[0]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            got = "None" if t is None else f"{type(t).__module__}.{type(t).__name__}"
            raise TypeError(f"{name} must be a torch.Tensor (CPU: the NumPy reference, CUDA: the kernels); got {got}")
    _optional_tensor("bias", bias)
    _validate.backward_order(None, deterministic)  # only the backward uses it: check it before the forward
    # checked before the draw, so that a bad value consumes nothing of the generator
    explicit_seed = dropout_seed is not None
    dropout_p, dropout_seed, dropout_offset = _validate.dropout(
        dropout_p, dropout_seed if explicit_seed else 0, dropout_offset)
    if torch.compiler.is_compiling():
        # Traced by torch.compile: the scalars may be symbolic (dynamic=True makes floats and ints inputs of the
        # graph), which the checks below cannot read; the front door checks them all when the operator runs.
        left, right = window_size
    else:
        # Checked here, in the front door's words, what the operator's schema would refuse in its own: the
        # scalars' types (their values, and the tensors, are checked by the front door when the operator runs).
        causal, _ = _validate.causal_options(causal, causal_align)
        left, right = (-1 if x is None else x for x in _validate.window_size(window_size))
        softcap = _validate.softcap(softcap)
        if softmax_scale is not None:
            _validate.softmax_scale(softmax_scale, 1)
            softmax_scale = float(softmax_scale)
        algorithm = _validate.algorithm(algorithm)
        block_q, block_k = _validate.block_size("block_q", block_q), _validate.block_size("block_k", block_k)
        max_seqlen_q = _optional_int("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = _optional_int("max_seqlen_k", max_seqlen_k)
        fp32_precision = _validate.fp32_precision(fp32_precision)
    arrays = {name: _optional_tensor(name, value) for name, value in (
        ("alibi_slopes", alibi_slopes), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
        ("seqused_k", seqused_k), ("attn_mask", attn_mask))}
    # never differentiated: keep autograd from holding on to their graphs
    arrays = {name: None if value is None else value.detach() for name, value in arrays.items()}
    names, mods = _mod_arrays(score_mod, mask_mod, mod_arrays)
    _check_devices(q=q, k=k, v=v, bias=bias, **arrays, **{f"mod_arrays[{name!r}]": a for name, a in
                                                          zip(names.split(",") if names else [], mods)})
    if not dropout_p:
        seed = None
    elif explicit_seed:
        seed = torch.tensor(_signed64(dropout_seed), dtype=torch.int64)
    else:  # draw_dropout_seed's draw, kept a tensor: traceable by torch.compile (no .item())
        seed = torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
    # inference on plain tensors (nothing to differentiate, nothing tracing): the implementation directly, without
    # the operator's dispatch (about 0.3 ms of host time a call; see _runs_eagerly)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    op_args = (q, k, v, bias, *arrays.values(), mods, seed, causal, softmax_scale, causal_align, left, right, softcap,
               max_seqlen_q, max_seqlen_k, dropout_p, _signed64(dropout_offset), score_mod, mask_mod, names, algorithm,
               block_q, block_k, fp32_precision, bool(deterministic))
    if not needs_grad and _runs_eagerly(q, k, v, bias, seed, *arrays.values(), *mods):
        out, lse = _forward_backend(dict(zip(_FWD_PARAMS, op_args)), remember=key)
    else:
        out, lse = _attention_fwd(*op_args)
    return (out, lse.detach()) if return_lse else out


_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn",) if hasattr(torch, name))


def _fp8_array(t: torch.Tensor):
    """An e4m3 tensor's zero-copy array: NumPy's ml_dtypes float8_e4m3fn (CPU), CuPy's uint8 bits (CUDA: CuPy has no
    e4m3 dtype); other tensors as :func:`_to_array`."""
    if t.dtype not in _FP8_DTYPES:
        return _to_array(t)
    bits = t.detach().view(torch.uint8)
    return _cuda_array(bits) if bits.is_cuda else bits.numpy().view(ml_dtypes.float8_e4m3fn)


def _attention_fp8(q, k, v, descales, return_lse: bool, options: dict):
    """:func:`attention` on e4m3 tensors: cuflash.attention's FP8 forward (it checks the arrays and options), no
    autograd."""
    for name, t in (("q", q), ("k", k), ("v", v), *zip(("q_descale", "k_descale", "v_descale"), descales)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__module__}.{type(t).__name__}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("FP8 attention (float8_e4m3fn) has no backward: call it under torch.no_grad() or "
                                  "with tensors that do not require grad")
    tensors = {name: options.pop(name) for name in ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                                                    "bias", "attn_mask")}
    _check_devices(q=q, k=k, v=v, **dict(zip(("q_descale", "k_descale", "v_descale"), descales)),
                   **{name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)})
    with _backend_call(q) as memory:
        arrays = {name: _to_array(t) if isinstance(t, torch.Tensor) else t for name, t in tensors.items()}
        d = [None if t is None else _to_array(t) for t in descales]
        out, lse = cuflash.attention(_fp8_array(q), _fp8_array(k), _fp8_array(v), return_lse=True, q_descale=d[0],
                                     k_descale=d[1], v_descale=d[2], **arrays, **options)
        out, lse = _output(out, memory), _output(lse, memory)
    return (out, lse) if return_lse else out


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    num_splits: int = 0,
):
    """:func:`cuflash.attention_with_kvcache` on PyTorch tensors: attention of ``q`` over a KV cache, after writing
    the new ``k`` and ``v`` (if given) into ``k_cache`` and ``v_cache`` **in place** at ``cache_seqlens``.

    Arguments, layouts and meaning as :func:`cuflash.attention_with_kvcache` (``docs/decoding.md``), the arrays as
    tensors on q's device: ``cache_seqlens`` an int32 tensor ``(batch,)`` or one int for every sequence,
    ``cache_leftpad``, ``cache_batch_idx`` and ``block_table`` int32 tensors. Runs the custom operator
    ``torch.ops.cuflash.attention_with_kvcache`` (declared to mutate ``k_cache`` and ``v_cache``; traced by
    ``torch.compile``), or without ``k`` and ``v`` ``torch.ops.cuflash.attention_with_kvcache_readonly`` (the same
    without them, mutating nothing: cheaper to dispatch); CPU tensors run the NumPy reference, CUDA tensors the decode kernels (float16 and bfloat16,
    head dims 32, 64, 96, 128; anything else raises ``NotImplementedError`` before the caches are touched), on
    torch's current stream with the output from torch's allocator. Not differentiable (the result never requires
    grad), as flash-attention's ``flash_attn_with_kvcache``.

    Returns ``out`` ``(batch, seqlen_q, heads_q, head_dim_v)``, and with ``return_lse=True`` also ``lse``
    ``(batch, heads_q, seqlen_q)`` (float32; float64 for float64).
    """
    key = None
    if (k is None and v is None and rotary_cos is None and rotary_sin is None and cache_batch_idx is None
            and block_table is None and DIRECT_CALLS):  # a decode step like one already run: its launch, at once
        key = _decode_key(q, k_cache, v_cache, cache_seqlens, cache_leftpad, alibi_slopes, rotary_interleaved, causal,
                          window_size, softcap, softmax_scale, num_splits)
        done = None if key is None else _decode_run(key, q, k_cache, v_cache, cache_seqlens, cache_leftpad,
                                                    alibi_slopes, return_lse)
        if done is not None:
            return done if return_lse else done[0]
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            got = "None" if t is None else f"{type(t).__module__}.{type(t).__name__}"
            raise TypeError(f"{name} must be a torch.Tensor (CPU: the NumPy reference, CUDA: the kernels); got {got}")
    arrays = {name: _optional_tensor(name, value) for name, value in (
        ("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad), ("block_table", block_table),
        ("alibi_slopes", alibi_slopes))}
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens, seqlens_int = cache_seqlens.detach(), -1
    elif _validate._is_int(cache_seqlens):
        seqlens, seqlens_int = None, int(cache_seqlens)
    else:
        raise TypeError(f"cache_seqlens must be an int or an int32 torch.Tensor of shape (batch,) on the device of q; "
                        f"got {type(cache_seqlens).__name__} {cache_seqlens!r}")
    if torch.compiler.is_compiling():  # symbolic scalars: the front door checks them when the operator runs
        left, right = window_size
    else:  # the scalars' types, in the front door's words, before the operator's schema refuses them in its own
        causal, _ = _validate.causal_options(causal, "bottom-right")
        left, right = (-1 if x is None else x for x in _validate.window_size(window_size))
        softcap = _validate.softcap(softcap)
        if softmax_scale is not None:
            _validate.softmax_scale(softmax_scale, 1)
            softmax_scale = float(softmax_scale)
        if not isinstance(rotary_interleaved, bool):
            raise TypeError(f"rotary_interleaved must be a bool; got {type(rotary_interleaved).__name__} "
                            f"{rotary_interleaved!r}")
        if not _validate._is_int(num_splits):
            raise TypeError(f"num_splits must be an integer >= 0 (0: automatic); got {type(num_splits).__name__} "
                            f"{num_splits!r}")
    # no gradient: detached views (the caches' share their version counters, which the operator bumps)
    arrays = {name: None if t is None else t.detach() for name, t in arrays.items()}
    k, v = arrays.pop("k"), arrays.pop("v")
    scalars = dict(rotary_interleaved=rotary_interleaved, causal=causal, window_left=left, window_right=right,
                   softcap=softcap, softmax_scale=softmax_scale, num_splits=int(num_splits))
    if _runs_eagerly(q, k_cache, v_cache, seqlens, k, v, *arrays.values()):  # no operator dispatch (~0.3 ms)
        out, lse = _kvcache_backend(q.detach(), k_cache.detach(), v_cache.detach(), k, v, seqlens, seqlens_int,
                                    **arrays, **scalars, remember=key)
        if k is not None:  # what the operator's dispatch does for its mutated arguments
            torch.autograd.graph.increment_version((k_cache, v_cache))
    elif k is None and v is None:  # nothing to append: the operator that mutates nothing (much cheaper to dispatch)
        out, lse = _attention_with_kvcache_readonly(q.detach(), k_cache.detach(), v_cache.detach(), seqlens,
                                                    seqlens_int, **arrays, **scalars)
    else:
        out, lse = _attention_with_kvcache(q.detach(), k_cache.detach(), v_cache.detach(), k, v, seqlens, seqlens_int,
                                           **arrays, **scalars)
    return (out, lse) if return_lse else out
