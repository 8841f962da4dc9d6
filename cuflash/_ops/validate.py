"""Every user-facing check of cuflash, in one place.

Each check raises before any computation starts, with a message that names the argument, what was
expected and what was given. The front door (:mod:`cuflash._ops.api`) calls these and hands the backends
normalized values only: a Python float scale, a :class:`~cuflash._ops.variant.Variant` (causal masking,
window, softcap, ALiBi slopes, packed sequences, used keys, one additive bias), positive integer block sizes (or ``None``),
a known algorithm and backward order.

Reading the values of ``cu_seqlens_q``, ``cu_seqlens_k`` and ``seqused_k`` (first entry, order, ranges)
copies them to the host when they are CuPy arrays: a few bytes, and only when they are given. A caller
that cannot read them yet (``cuflash.jax`` under ``jit``, where they are tracers) passes
``read_values=False``: their shapes and dtypes are checked, their values when the call runs.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from . import mods as _mods
from .kvcache import uniform_seqlens
from .variant import Variant

ALGORITHMS = ("fa2", "fa1", "naive")
# How float32 inputs are multiplied (attention's fp32_precision): 3xTF32 on the tensor cores (float32 accuracy), one
# TF32 product (faster, ~1e-3 relative), or IEEE float32 arithmetic (the SIMT kernels). Triton's tl.dot spellings.
FP32_PRECISIONS = ("tf32x3", "fp16x3", "tf32", "ieee")
ORDERS = ("kv_outer", "q_outer", "split")
CAUSAL_ALIGNS = ("bottom-right", "top-left")
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# FP8 inputs (cuflash.attention's forward only; the output is bfloat16): ml_dtypes' e4m3, or its bits as uint8 (CuPy
# has no e4m3 dtype)
FP8_DTYPES = ("float8_e4m3fn", "uint8")


@dataclass(frozen=True)
class Problem:
    """Shapes of one attention call, read off validated q, k, v.

    A padded batch has ``(batch, seqlen, heads, head_dim)`` arrays. A packed variable-length batch
    (``cu_seqlens_q``/``cu_seqlens_k``) has ``(total, heads, head_dim)`` arrays: then ``batch`` is the
    number of sequences, ``seqlen_q``/``seqlen_k`` are ``max_seqlen_q``/``max_seqlen_k`` and
    ``total_q``/``total_k`` the row counts (None for a padded batch).

    ``head_dim`` is the last axis of q and k, ``head_dim_v`` that of v (and of out, do, dv); it may differ
    (DeepSeek's 192 and 128). Constructed without it (positionally, as before it existed), it is
    ``head_dim``.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: np.dtype
    total_q: int | None = None
    total_k: int | None = None
    head_dim_v: int | None = None  # last, with a default: positional constructions keep working

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def is_varlen(self) -> bool:
        return self.total_q is not None

    @property
    def q_shape(self) -> tuple[int, ...]:
        """The shape of q (and of dq)."""
        if self.is_varlen:
            return (self.total_q, self.heads_q, self.head_dim)
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of out (and of do): q's with v's head dim."""
        return self.q_shape[:-1] + (self.head_dim_v,)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        """``(batch, heads_q, seqlen_q)``, or ``(heads_q, total_q)`` packed (flash-attention's varlen layout)."""
        if self.is_varlen:
            return (self.heads_q, self.total_q)
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def is_empty(self) -> bool:
        """True when there is no score to compute (a zero-sized batch, sequence or head axis)."""
        if self.is_varlen:
            return 0 in (self.batch, self.total_q, self.total_k, self.heads_q)
        return 0 in (self.batch, self.seqlen_q, self.seqlen_k, self.heads_q)


def _shape(a) -> tuple[int, ...]:
    return tuple(int(s) for s in a.shape)


def _library(a) -> str:
    """``numpy``, ``cupy``, ... : the top-level module an array type comes from."""
    return type(a).__module__.split(".")[0]


def _dtype_name(dtype) -> str:
    """The dtype's name, plus its byte order when that is not the machine's (the name alone omits it)."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else f"{dtype.name} (non-native byte order)"


def lse_dtype(dtype: np.dtype) -> np.dtype:
    """The logsumexp dtype for inputs of ``dtype``: float64 for float64, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


_ARRAY_KINDS = "a numpy.ndarray, or a cupy.ndarray for the CUDA kernels"


def _is_array(a) -> bool:
    return all(hasattr(a, attr) for attr in ("shape", "dtype", "ndim"))


def check_arrays(**arrays) -> None:
    """Each argument is an array (anything with ``shape``, ``dtype`` and ``ndim``; which library it may come
    from is :func:`check_same_library`'s check): ``None`` or a list for an array is named here, before any other
    check reads it."""
    for name, a in arrays.items():
        if _is_array(a) or _library(a) in ("torch", "jax", "jaxlib"):  # the latter: check_same_library's hint
            continue
        if a is None:
            raise TypeError(f"{name} must be an array ({_ARRAY_KINDS}); got None")
        hint = "; convert it with numpy.asarray" if isinstance(a, (list, tuple)) else ""
        raise TypeError(f"{name} must be an array ({_ARRAY_KINDS}); got {type(a).__module__}.{type(a).__name__}"
                        f"{hint}")


def check_same_library(**arrays) -> str:
    """Every argument is an array (:func:`check_arrays`), all from one array library and, for device arrays,
    one device.

    Returns the library name (``"numpy"`` or ``"cupy"``).
    """
    check_arrays(**arrays)
    names = list(arrays)
    libs = {name: _library(a) for name, a in arrays.items()}
    first = names[0]
    for name in names[1:]:
        if libs[name] != libs[first]:
            raise TypeError(
                f"{first} and {name} must come from the same array library; "
                f"got {type(arrays[first]).__module__}.{type(arrays[first]).__name__} for {first} "
                f"and {type(arrays[name]).__module__}.{type(arrays[name]).__name__} for {name}"
            )
    lib = libs[first]
    if lib not in ("numpy", "cupy"):
        kind = f"{type(arrays[first]).__module__}.{type(arrays[first]).__name__}"
        hint = ""
        if lib == "torch":
            hint = "; for PyTorch tensors use cuflash.torch.attention"
        elif lib in ("jax", "jaxlib"):
            hint = "; for JAX arrays use cuflash.jax.attention"
        raise TypeError(f"{first} must be a numpy.ndarray or cupy.ndarray; got {kind}{hint}")
    if lib == "cupy":
        devices = {name: int(a.device.id) for name, a in arrays.items()}
        for name in names[1:]:
            if devices[name] != devices[first]:
                raise ValueError(
                    f"{first} and {name} must be on the same device; "
                    f"got {first} on cuda:{devices[first]} and {name} on cuda:{devices[name]}"
                )
    return lib


def _check_contiguous_last_axis(name: str, a) -> None:
    if a.size and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        raise ValueError(
            f"{name} must have a contiguous last axis (stride {a.itemsize} bytes, one element); "
            f"got strides {tuple(a.strides)} for shape {_shape(a)}; "
            f"pass a copy with a contiguous last axis"
        )


def check_qkv(q, k, v, *, varlen: bool = False, fp8: bool = False) -> Problem:
    """Ranks, shapes, dtypes and strides of q, k, v; returns the problem's sizes.

    ``varlen``: the arrays are packed ``(total, heads, head_dim)`` (cu_seqlens given); the problem's batch
    and lengths then come from :func:`check_cu_seqlens`, and this returns them as one sequence of
    ``total`` rows. ``fp8``: the dtype is e4m3 (:data:`FP8_DTYPES`) instead of a floating one.
    """
    ndim = 3 if varlen else 4
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != ndim:
            if varlen:
                raise ValueError(
                    f"{name} must have 3 dimensions (total, heads, head_dim) with cu_seqlens_q and "
                    f"cu_seqlens_k; got {a.ndim} dimensions with shape {_shape(a)}"
                )
            hint = ("; packed (total, heads, head_dim) arrays need cu_seqlens_q and cu_seqlens_k"
                    if a.ndim == 3 else "")
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim); "
                f"got {a.ndim} dimensions with shape {_shape(a)}{hint}"
            )
    dtype = np.dtype(q.dtype)
    accepted = FP8_DTYPES if fp8 else _FLOAT_DTYPES
    for name, a in (("q", q), ("k", k), ("v", v)):
        if np.dtype(a.dtype).name not in accepted:
            raise TypeError(
                f"{name} must have a floating dtype (one of {', '.join(accepted)}); "
                f"got {np.dtype(a.dtype).name}"
            )
    if np.dtype(k.dtype) != dtype or np.dtype(v.dtype) != dtype:
        raise TypeError(
            "q, k and v must have the same dtype; "
            f"got q {_dtype_name(dtype)}, k {_dtype_name(k.dtype)}, v {_dtype_name(v.dtype)}"
        )
    if _shape(k)[:-1] != _shape(v)[:-1]:
        raise ValueError(
            f"k and v must have the same shape but for the last axis (v's head_dim may differ); "
            f"got k {_shape(k)} and v {_shape(v)}"
        )
    head_dim_v = _shape(v)[-1]
    if varlen:
        (total_q, heads_q, head_dim), (total_k, heads_kv, head_dim_k) = _shape(q), _shape(k)
        batch, seqlen_q, seqlen_k, heads_axis = 1, total_q, total_k, 1
    else:
        (batch, seqlen_q, heads_q, head_dim), (batch_k, seqlen_k, heads_kv, head_dim_k) = _shape(q), _shape(k)
        heads_axis = 2
    if head_dim_k != head_dim:
        raise ValueError(
            f"q and k must have the same head_dim (last axis; v's may differ); got q {head_dim}, k {head_dim_k}"
        )
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive; got {head_dim}")
    if head_dim_v < 1:
        raise ValueError(f"v's head_dim (last axis) must be positive; got {head_dim_v}")
    if not varlen and batch_k != batch:
        raise ValueError(f"q and k must have the same batch size (axis 0); got q {batch}, k {batch_k}")
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(
            f"the number of key/value heads must divide the number of query heads (axis {heads_axis}); "
            f"got {heads_q} query heads and {heads_kv} key/value heads"
        )
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_contiguous_last_axis(name, a)
    if varlen:
        return Problem(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, total_q, total_k,
                       head_dim_v=head_dim_v)
    return Problem(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, head_dim_v=head_dim_v)


def check_backward_tensors(problem: Problem, do, out, lse) -> None:
    """do and out are shaped like the forward's output (q's shape with v's head dim) and typed like q; lse
    like the forward's logsumexp."""
    for name, a in (("do", do), ("out", out)):
        if _shape(a) != problem.out_shape:
            what = "q" if problem.head_dim_v == problem.head_dim else "the output (q's, with v's head_dim)"
            raise ValueError(f"{name} must have the shape of {what}, {problem.out_shape}; got {_shape(a)}")
        if np.dtype(a.dtype) != problem.dtype:
            raise TypeError(
                f"{name} must have the dtype of q, {_dtype_name(problem.dtype)}; got {_dtype_name(a.dtype)}"
            )
        _check_contiguous_last_axis(name, a)
    if _shape(lse) != problem.lse_shape:
        layout = "(heads, total_q)" if problem.is_varlen else "(batch, heads, seqlen_q)"
        raise ValueError(f"lse must have shape {layout} = {problem.lse_shape}; got {_shape(lse)}")
    want = lse_dtype(problem.dtype)
    if np.dtype(lse.dtype) != want:
        raise TypeError(
            f"lse must have dtype {want.name} for {problem.dtype.name} inputs "
            f"(as returned by attention(..., return_lse=True)); got {_dtype_name(lse.dtype)}"
        )


def softmax_scale(value, head_dim: int) -> float:
    """The scale applied to q k^T: ``1/sqrt(head_dim)`` (q's and k's head dim, not v's) by default, else any
    finite real, as PyTorch's ``scaled_dot_product_attention`` and flash-attention take it: 0 gives every key
    the same score (uniform attention over the keys a row sees), a negative scale favours the least similar
    keys. softcap, ALiBi and the bias apply to ``scale * q . k`` whatever its sign."""
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got {type(value).__name__}")
    scale = float(value)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite (any sign; 0 gives uniform attention); got {value!r}")
    return scale


def causal_options(causal, causal_align: str) -> tuple[bool, bool]:
    """``(causal, bottom_right)``: whether keys after the diagonal are masked, and which diagonal."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__} {causal!r}")
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(
            f"causal_align must be one of {', '.join(map(repr, CAUSAL_ALIGNS))}; got {causal_align!r}"
        )
    return bool(causal), causal_align == "bottom-right"


def _is_int(value) -> bool:
    # (a plain int first: the ABC check costs microseconds, and a decode step makes several)
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)))


def window_size(value) -> tuple[int | None, int | None]:
    """``(left, right)`` of a sliding window, each an int >= 0 or None (flash-attention's -1: unlimited)."""
    expected = "window_size must be a pair of integers (left, right), -1 for unlimited"
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{expected}; got {type(value).__name__} {value!r}")
    if len(value) != 2:
        raise ValueError(f"{expected}; got {len(value)} entries {tuple(value)!r}")
    if not all(_is_int(x) for x in value):
        raise TypeError(f"{expected}; got ({', '.join(f'{type(x).__name__} {x!r}' for x in value)})")
    left, right = (int(x) for x in value)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unlimited on that side); got ({left}, {right})")
    return (None if left == -1 else left), (None if right == -1 else right)


def softcap(value) -> float:
    """The softcap: 0.0 for none, else a finite positive float."""
    if type(value) is not float and (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)):
        raise TypeError(f"softcap must be a real number (0 for none); got {type(value).__name__} {value!r}")
    cap = float(value)
    if not math.isfinite(cap) or cap < 0.0:
        raise ValueError(f"softcap must be finite and >= 0 (0 for none); got {value!r}")
    return cap


def varlen_mode(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """Whether the call is a packed variable-length batch: cu_seqlens_q and cu_seqlens_k both given (or
    neither), with max_seqlen_q and max_seqlen_k (which mean nothing without them)."""
    given = {"cu_seqlens_q": cu_seqlens_q is not None, "cu_seqlens_k": cu_seqlens_k is not None}
    if given["cu_seqlens_q"] != given["cu_seqlens_k"]:
        have, missing = ("cu_seqlens_q", "cu_seqlens_k") if given["cu_seqlens_q"] else ("cu_seqlens_k", "cu_seqlens_q")
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must be given together (a packed variable-length batch); "
            f"got {have} without {missing}"
        )
    varlen = given["cu_seqlens_q"]
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if varlen and value is None:
            raise ValueError(
                f"{name} is required with cu_seqlens_q and cu_seqlens_k (the longest sequence's length, "
                f"as in flash_attn_varlen_func); got None"
            )
        if not varlen and value is not None:
            raise ValueError(
                f"{name} is only used with cu_seqlens_q and cu_seqlens_k (a packed variable-length batch); "
                f"got {name}={value!r} without them"
            )
    return varlen


def _to_host(a) -> np.ndarray:
    """The values of a NumPy or CuPy array as a NumPy array (a device-to-host copy for CuPy)."""
    return a if isinstance(a, np.ndarray) else a.get()


def _check_index_array(name: str, a, length: int | None, what: str) -> None:
    """A 1-D contiguous int32 array (of ``length`` entries when given): cu_seqlens and seqused_k."""
    if a.ndim != 1 or (length is not None and _shape(a)[0] != length):
        raise ValueError(f"{name} must have shape {what}; got {_shape(a)}")
    if np.dtype(a.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32; got {_dtype_name(a.dtype)}")
    if a.size > 1 and a.strides[0] != a.itemsize:
        raise ValueError(f"{name} must be contiguous (stride {a.itemsize} bytes); got strides {tuple(a.strides)}")


def _max_seqlen(name: str, value, longest: int, what: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be a positive integer; got {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be a positive integer; got {int(value)}")
    if int(value) < longest:
        raise ValueError(f"{name} must be at least the longest {what} sequence, {longest}; got {int(value)}")
    return int(value)


def check_cu_seqlens(problem: Problem, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     read_values: bool = True) -> Problem:
    """A packed batch's prefix sums and maximum lengths, against the row counts of ``problem`` (from
    :func:`check_qkv` with ``varlen=True``). Returns the problem with its batch and maximum lengths."""
    lengths = {"cu_seqlens_q": np.zeros(0, np.int64), "cu_seqlens_k": np.zeros(0, np.int64)}
    for name, cu, total, rows in (("cu_seqlens_q", cu_seqlens_q, problem.total_q, "q"),
                                  ("cu_seqlens_k", cu_seqlens_k, problem.total_k, "k")):
        _check_index_array(name, cu, None, "(batch + 1,)")
        if cu.size < 1:
            raise ValueError(f"{name} must have batch + 1 >= 1 entries, starting with 0; got shape {_shape(cu)}")
        if not read_values:
            continue
        host = _to_host(cu).astype(np.int64)
        if host[0] != 0:
            raise ValueError(f"{name} must start at 0; got {name}[0] = {host[0]}")
        steps = np.diff(host)
        if (steps < 0).any():
            b = int(np.argmax(steps < 0)) + 1
            raise ValueError(
                f"{name} must be non-decreasing (sequence b is rows {name}[b]:{name}[b + 1]); "
                f"got {name}[{b}] = {host[b]} < {name}[{b - 1}] = {host[b - 1]}"
            )
        if host[-1] != total:
            raise ValueError(f"{name} must end at the number of rows of {rows}, {total}; got {name}[-1] = {host[-1]}")
        lengths[name] = steps
    if cu_seqlens_q.size != cu_seqlens_k.size:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, batch + 1; "
            f"got {cu_seqlens_q.size} and {cu_seqlens_k.size}"
        )
    seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q, int(lengths["cu_seqlens_q"].max(initial=0)), "query")
    seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k, int(lengths["cu_seqlens_k"].max(initial=0)), "key")
    return Problem(int(cu_seqlens_q.size) - 1, seqlen_q, seqlen_k, problem.heads_q, problem.heads_kv,
                   problem.head_dim, problem.dtype, problem.total_q, problem.total_k, problem.head_dim_v)


def seqused_k(value, problem: Problem, cu_seqlens_k=None, *, read_values: bool = True):
    """int32 ``(batch,)``: the keys each sequence uses, within its keys (``seqlen_k`` of a padded batch,
    or its segment ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of a packed one). Returns the array as given."""
    if value is None:
        return None
    _check_index_array("seqused_k", value, problem.batch, f"(batch,) = ({problem.batch},)")
    if not read_values:
        return value
    used = _to_host(value).astype(np.int64)
    if cu_seqlens_k is None:
        bad = np.flatnonzero((used < 0) | (used > problem.seqlen_k))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"seqused_k must lie in [0, seqlen_k] = [0, {problem.seqlen_k}]; got seqused_k[{b}] = {used[b]}"
            )
    else:
        lengths = np.diff(_to_host(cu_seqlens_k).astype(np.int64))
        bad = np.flatnonzero((used < 0) | (used > lengths))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"seqused_k[b] must lie in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]] (the keys of sequence b); "
                f"got seqused_k[{b}] = {used[b]} for a sequence of {lengths[b]} keys"
            )
    return value


def alibi_slopes(value, problem: Problem, xp):
    """float32 ``(heads_q,)`` or ``(batch, heads_q)``; returns a ``(batch, heads_q)`` array of the same
    library (a ``(heads_q,)`` input as a broadcast view, batch stride 0, no copy)."""
    if value is None:
        return None
    per_head, per_batch = (problem.heads_q,), (problem.batch, problem.heads_q)
    if _shape(value) not in (per_head, per_batch):
        raise ValueError(
            f"alibi_slopes must have shape (heads_q,) = {per_head} or (batch, heads_q) = {per_batch}; "
            f"got {_shape(value)}"
        )
    if np.dtype(value.dtype) != np.float32:
        raise TypeError(f"alibi_slopes must have dtype float32 (as flash-attention); got {_dtype_name(value.dtype)}")
    _check_contiguous_last_axis("alibi_slopes", value)
    return xp.broadcast_to(value, per_batch) if value.ndim == 1 else value


def _bias_shape(name: str, value, problem: Problem) -> tuple[int, int, int, int]:
    """The 4-D shape of a ``bias`` or ``attn_mask`` given with 2, 3 or 4 dimensions (leading axes of 1
    prepended), checked against ``(batch, heads_q, seqlen_q, seqlen_k)``: batch and heads full or 1."""
    full = (problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k)
    expected = (f"{name} must be broadcastable to (batch, heads_q, seqlen_q, seqlen_k) = {full}, with batch and "
                f"heads_q full or 1 and seqlen_q, seqlen_k full (2-D (seqlen_q, seqlen_k) and 3-D "
                f"(heads_q, seqlen_q, seqlen_k) arrays get leading axes of 1)")
    if value.ndim not in (2, 3, 4):
        raise ValueError(f"{expected}; got {value.ndim} dimensions with shape {_shape(value)}")
    shape = (1,) * (4 - value.ndim) + _shape(value)
    if shape[2:] != full[2:] or any(n not in (1, m) for n, m in zip(shape[:2], full[:2])):
        raise ValueError(f"{expected}; got {_shape(value)}")
    return shape


def _compact(a):
    """``a`` without its broadcast axes (stride 0): a view holding each distinct value once, so that a
    conversion touches no more than the caller's data."""
    return a[tuple(slice(0, 1) if n > 1 and stride == 0 else slice(None) for n, stride in zip(a.shape, a.strides))]


# The biases whose own dtype the CUDA kernels read for float16 / bfloat16 inputs (the policy's BiasArray element).
_KERNEL_BIAS_DTYPES = ("float16", "bfloat16", "float32")


def _neg_inf_bits(dtype):
    """The bits of -inf in ``dtype``, a scalar of the unsigned integer type of its size (selections through the bits)."""
    return np.array(-np.inf, dtype).view(f"u{np.dtype(dtype).itemsize}")[()]


def _widen(value, acc, xp):
    """``value`` in the accumulation dtype ``acc``; bfloat16 through its bits (exact, and without arithmetic on
    bfloat16 arrays, which CuPy before its bfloat16 support lacks)."""
    if np.dtype(value.dtype).name == "bfloat16" and np.dtype(acc) == np.float32:
        return (value.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return value.astype(acc)


def attention_bias(bias, attn_mask, problem: Problem, xp):
    """The additive ``bias`` (floating) and the boolean ``attn_mask`` (True: the key is seen) as one
    ``(batch, heads_q, seqlen_q, seqlen_k)`` array for the backends, or None when neither is given.

    Its dtype is the accumulation dtype of q (float32, float64 for float64 inputs); ``attn_mask`` becomes
    0 / -inf and is added to ``bias``. Each array is converted once, over its own (compact) shape, and
    broadcast as a view: a bias that already has that dtype reaches the backend without a copy (stride 0
    on its broadcast axes). Not with cu_seqlens: a packed batch has no (seqlen_q, seqlen_k) grid of scores.

    CuPy arrays of float16 / bfloat16 inputs (the CUDA kernels, which read a bias in its own dtype): a float16,
    bfloat16 or float32 ``bias`` stays as it is (no copy); ``attn_mask`` alone becomes 0 / -inf in q's dtype; both
    together are selected through the bits in the bias's dtype (``bias`` where the mask is True, -inf where not:
    exactly ``bias + mask``) where the mask broadcasts at least as far as the bias, else added in float32.
    """
    given = {name: a for name, a in (("bias", bias), ("attn_mask", attn_mask)) if a is not None}
    if not given:
        return None
    if problem.is_varlen:
        raise ValueError(
            f"{' and '.join(given)} cannot be used with cu_seqlens_q and cu_seqlens_k: a packed batch has no "
            f"(seqlen_q, seqlen_k) grid of scores; use padded (batch, seqlen, heads, head_dim) arrays "
            f"(with seqused_k for key padding)"
        )
    acc = lse_dtype(problem.dtype)
    own = getattr(xp, "__name__", "") == "cupy" and np.dtype(problem.dtype).name in ("float16", "bfloat16")
    total = None
    compact = {}
    for name, value in given.items():
        dtype = np.dtype(value.dtype)
        if name == "bias" and dtype.name not in _FLOAT_DTYPES:
            hint = "; a boolean mask goes in attn_mask" if dtype == np.bool_ else ""
            raise TypeError(
                f"bias must have a floating dtype (one of {', '.join(_FLOAT_DTYPES)}); got {_dtype_name(dtype)}{hint}"
            )
        if name == "attn_mask" and dtype != np.bool_:
            raise TypeError(
                f"attn_mask must have dtype bool (True: the key is seen, as in torch's scaled_dot_product_attention); "
                f"got {_dtype_name(dtype)}; an additive floating mask goes in bias"
            )
        _bias_shape(name, value, problem)
        _check_contiguous_last_axis(name, value)
        compact[name] = _compact(value[(None,) * (4 - value.ndim)])
    full = (problem.batch, problem.heads_q, problem.seqlen_q, problem.seqlen_k)
    bias, mask = compact.get("bias"), compact.get("attn_mask")
    if own and (bias is None or np.dtype(bias.dtype).name in _KERNEL_BIAS_DTYPES):
        if mask is None:
            return xp.broadcast_to(bias, full)
        if bias is None:
            dtype = np.dtype(problem.dtype)
            bits = _neg_inf_bits(dtype)
            return xp.broadcast_to(((~mask).astype(bits.dtype) * bits).view(dtype), full)
        if np.broadcast_shapes(bias.shape, mask.shape) == bias.shape:
            bits = _neg_inf_bits(bias.dtype)
            return xp.broadcast_to(xp.where(mask, bias.view(bits.dtype), bits).view(bias.dtype), full)
    for name, value in compact.items():
        if name == "bias":
            term = value if np.dtype(value.dtype) == acc else _widen(value, acc, xp)
        else:
            term = xp.where(value, xp.zeros((), acc), xp.full((), -np.inf, acc))
        total = term if total is None else total + term
    return xp.broadcast_to(total, full)


def _uint64(name: str, value) -> int:
    """An integer in ``[0, 2**64)`` (a Philox key or counter offset)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer in [0, 2**64); got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < 2**64:
        raise ValueError(f"{name} must be an integer in [0, 2**64); got {int(value)}")
    return int(value)


def dropout(dropout_p, dropout_seed, dropout_offset) -> tuple[float, int | None, int]:
    """``(dropout_p, dropout_seed, dropout_offset)`` normalized: a probability in ``[0, 1)``, the seed
    (required, explicit, when ``dropout_p > 0``: no hidden global generator) and the offset."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1); got {type(dropout_p).__name__} {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1) (the probability of zeroing a score); got {p}")
    offset = _uint64("dropout_offset", dropout_offset)
    if dropout_seed is None:
        if p > 0:
            raise ValueError(
                f"dropout_p={p} needs an explicit dropout_seed (an integer in [0, 2**64)), and the backward the "
                f"same dropout_seed and dropout_offset, so that it regenerates the forward's mask; got dropout_seed=None"
            )
        return p, None, offset
    return p, _uint64("dropout_seed", dropout_seed), offset


def user_mods(score_mod, mask_mod, mod_arrays) -> tuple:
    """``(mods, arrays)``: the user's ``score_mod`` and ``mask_mod`` parsed (a :class:`cuflash._ops.mods.UserMods`,
    or None when neither is given) and the arrays of ``mod_arrays`` they read, in its slot order.

    ``mod_arrays``: a dict of at most four names (C identifiers, none of the variables, functions or keywords)
    to 1-D, non-empty, contiguous int32 or float32 arrays. Arrays the expressions do not read are ignored.
    ``mask_mod`` may be a :class:`cuflash.BlockMask`: its expression, and its arrays with ``mod_arrays``.
    """
    if isinstance(mask_mod, _mods.BlockMask):
        given = mask_mod
        mask_mod = given.mask_mod
        if given.mod_arrays:
            for name, a in (mod_arrays or {}).items():
                if name in given.mod_arrays and a is not given.mod_arrays[name]:
                    raise ValueError(f"mod_arrays[{name!r}] names an array of the BlockMask given as mask_mod too, "
                                     "and a different one; rename one of them")
            mod_arrays = {**given.mod_arrays, **(mod_arrays or {})}
    for name, text in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if text is not None and not isinstance(text, str):
            kinds = "a string (a CUDA C expression, see docs/variants.md), a cuflash.BlockMask" if name == "mask_mod" else (
                "a string (a CUDA C expression, see docs/variants.md)")
            raise TypeError(f"{name} must be {kinds} or None; got {type(text).__name__}")
    arrays = {}
    if mod_arrays is not None:
        if not isinstance(mod_arrays, Mapping):
            raise TypeError(f"mod_arrays must be a dict of names to 1-D int32 or float32 arrays; got "
                            f"{type(mod_arrays).__name__}")
        if score_mod is None and mask_mod is None:
            raise ValueError("mod_arrays is read by score_mod and mask_mod only; got mod_arrays without either")
        if len(mod_arrays) > _mods.MAX_ARRAYS:
            raise ValueError(f"mod_arrays may hold at most {_mods.MAX_ARRAYS} arrays; got {len(mod_arrays)}: "
                             f"{', '.join(map(str, mod_arrays))}")
        for name, a in mod_arrays.items():
            label = f"mod_arrays[{name!r}]"
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"mod_arrays names must be C identifiers (letters, digits, _); got {name!r}")
            if name in _mods.RESERVED or name.startswith("__") or re.match(r"_[A-Z]", name):
                raise ValueError(f"mod_arrays name {name!r} is reserved (a variable, function or keyword of the "
                                 f"expressions, or a C++ reserved name); pick another")
            if not hasattr(a, "dtype") or not hasattr(a, "shape"):
                raise TypeError(f"{label} must be an array (of the library of q); got {type(a).__name__}")
            if a.ndim != 1:
                raise ValueError(f"{label} must be 1-D; got shape {_shape(a)}")
            if np.dtype(a.dtype).name not in _mods.ARRAY_DTYPES:
                raise TypeError(f"{label} must have dtype int32 or float32; got {_dtype_name(a.dtype)}")
            if not 1 <= a.shape[0] < 2**31:
                raise ValueError(f"{label} must have between 1 and 2**31 - 1 entries; got {a.shape[0]}")
            if a.shape[0] > 1 and a.strides[0] != a.itemsize:
                raise ValueError(f"{label} must be contiguous (stride {a.itemsize} bytes); got strides {tuple(a.strides)}")
            arrays[name] = a
    mods = _mods.user_mods(score_mod, mask_mod, arrays)
    if mods is None:
        return None, None
    return mods, tuple(arrays[name] for name in mods.array_names)


def variant(problem: Problem, xp, options: dict, *, read_values: bool = True) -> Variant:
    """The variant options of a call, checked against its problem and normalized into a :class:`Variant`.

    ``options`` holds the user's keywords: ``causal``, ``causal_align``, ``window_size``, ``softcap``,
    ``alibi_slopes``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``, ``bias``, ``attn_mask`` (the
    cu_seqlens already checked by :func:`check_cu_seqlens`, whose problem this is), ``dropout_p``,
    ``dropout_seed``, ``dropout_offset`` (absent: no dropout), and ``score_mod``, ``mask_mod``, ``mod_arrays``
    (absent: none). ``xp`` is the array module of q.
    """
    is_causal, bottom_right = causal_options(options["causal"], options["causal_align"])
    left, right = window_size(options["window_size"])
    dropout_p, dropout_seed, dropout_offset = dropout(
        options.get("dropout_p", 0.0), options.get("dropout_seed"), options.get("dropout_offset", 0))
    mods, mod_arrays = user_mods(options.get("score_mod"), options.get("mask_mod"), options.get("mod_arrays"))
    given_mask = options.get("mask_mod")
    block_lists = given_mask.lists if isinstance(given_mask, _mods.BlockMask) else None
    return Variant(
        causal=is_causal, bottom_right=bottom_right, window_left=left, window_right=right,
        softcap=softcap(options["softcap"]),
        alibi_slopes=alibi_slopes(options["alibi_slopes"], problem, xp),
        cu_seqlens_q=options["cu_seqlens_q"], cu_seqlens_k=options["cu_seqlens_k"],
        max_seqlen_q=problem.seqlen_q if problem.is_varlen else None,
        max_seqlen_k=problem.seqlen_k if problem.is_varlen else None,
        seqused_k=seqused_k(options["seqused_k"], problem, options["cu_seqlens_k"], read_values=read_values),
        bias=attention_bias(options["bias"], options["attn_mask"], problem, xp),
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
        mods=mods, mod_arrays=mod_arrays, block_lists=block_lists,
    )


def algorithm(value) -> str:
    if value not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}; got {value!r}")
    return value


def fp32_precision(value) -> str:
    if not isinstance(value, str) or value not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {', '.join(map(repr, FP32_PRECISIONS))}; got {value!r}")
    return value


def backward_order(order, deterministic) -> str | None:
    """The backward loop order; ``deterministic=True`` means the two-pass ``"split"`` order."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__}")
    if order is not None and order not in ORDERS:
        raise ValueError(
            f"order must be None or one of {', '.join(map(repr, ORDERS))}; got {order!r}"
        )
    if deterministic:
        if order not in (None, "split"):
            raise ValueError(
                f"deterministic=True runs the 'split' order (no read-modify-write); got order={order!r}"
            )
        return "split"
    return order


def return_dbias(value, bias) -> bool:
    """Whether the backward returns ``dbias``: ``None`` means when ``bias`` is given."""
    if value is None:
        return bias is not None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"return_dbias must be a bool or None; got {type(value).__name__} {value!r}")
    if value and bias is None:
        raise ValueError("return_dbias=True needs the bias whose gradient it returns; got bias=None")
    return bool(value)


def block_size(name: str, value) -> int | None:
    """None (the default from the on-chip budget) or a positive integer."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer or None; got {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be a positive integer or None; got {int(value)}")
    return int(value)


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache (attention_with_kvcache) and merge_states
# ---------------------------------------------------------------------------------------------------

DEVICE_CHECKS_ENV = "CUFLASH_CHECK_DEVICE_VALUES"


def device_value_checks() -> bool:
    """Whether the values of device-resident (CuPy) index arrays of a decode call are checked: only in the debug
    mode ``CUFLASH_CHECK_DEVICE_VALUES=1``, since reading them is a device-to-host copy and a synchronization
    that a decode step must not pay. NumPy arrays are always checked."""
    return _environment_flag(DEVICE_CHECKS_ENV)


# ---------------------------------------------------------------------------------------------------
# The opt-in finite check (check_finite=True, CUFLASH_CHECK_FINITE=1)
# ---------------------------------------------------------------------------------------------------

FINITE_CHECK_ENV = "CUFLASH_CHECK_FINITE"

# dtype name -> (unsigned integer of its width, exponent bits, sign bit): NaN and +-inf have every exponent bit set.
# Read through the bits, so that bfloat16 CuPy arrays (ml_dtypes' dtype, with no CuPy arithmetic) are read too.
_FLOAT_BITS = {
    "float16": (np.uint16, 0x7C00, 0x8000),
    "bfloat16": (np.uint16, 0x7F80, 0x8000),
    "float32": (np.uint32, 0x7F80_0000, 0x8000_0000),
    "float64": (np.uint64, 0x7FF0_0000_0000_0000, 0x8000_0000_0000_0000),
    # e4m3 (its bits as uint8 on CuPy): no infinities, NaN only where exponent and mantissa are all ones ("exponent"
    # here masks both, so the test below finds exactly the NaNs)
    "float8_e4m3fn": (np.uint8, 0x7F, 0x80),
    "uint8": (np.uint8, 0x7F, 0x80),
}


def finite_checks(check_finite) -> bool:
    """Whether the inputs of an attention call are scanned for NaN and infinities: ``check_finite=True``, or
    the environment variable ``CUFLASH_CHECK_FINITE=1`` (read at each call, so that a whole program, or a
    framework front end that has no such keyword, can turn it on)."""
    if check_finite is False and _ENVIRON_DATA is not None:  # (the common case, in one Python call)
        raw = _ENVIRON_DATA.get(_ENVIRON_KEYS[FINITE_CHECK_ENV])
        return bool(raw) and _environment_flag(FINITE_CHECK_ENV)
    if check_finite is True:
        return True
    if check_finite is not False and not isinstance(check_finite, (bool, np.bool_)):
        raise TypeError(f"check_finite must be a bool; got {type(check_finite).__name__} {check_finite!r}")
    return bool(check_finite) or _environment_flag(FINITE_CHECK_ENV)


def _environment_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is on ("1", "true", "yes", "on"), as ``os.environ`` holds it now.
    Read through the mapping's own dict where it has one (a front-door call reads it at every call: one lookup
    instead of os.environ.get's four Python calls)."""
    raw = _ENVIRON_DATA.get(_ENVIRON_KEYS[name]) if _ENVIRON_DATA is not None else os.environ.get(name)
    if not raw:
        return False
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    return raw.strip().lower() in ("1", "true", "yes", "on")


# os.environ's dict (POSIX: encoded keys and values; the mapping updates it at every assignment), when it has one.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
try:
    _ENVIRON_KEYS = {name: os.environ.encodekey(name) for name in (FINITE_CHECK_ENV, DEVICE_CHECKS_ENV)}
except AttributeError:
    _ENVIRON_KEYS = {}
if not isinstance(_ENVIRON_DATA, dict) or not _ENVIRON_KEYS:
    _ENVIRON_DATA = None


def float_bits(a):
    """``(bits, exponent, sign)``: a floating array viewed (no copy) as unsigned integers of its width, and the
    masks of its exponent and sign bits, as Python ints."""
    uint, exponent, sign = _FLOAT_BITS[np.dtype(a.dtype).name]
    return a.view(uint), exponent, sign


def check_finite(arrays: dict, *, allow_neginf: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the first array of ``arrays`` (name -> array or None) that holds a NaN or an
    infinity, and the first such index in C order. The arrays named in ``allow_neginf`` may hold ``-inf``
    (a bias's mask, the lse of a row that sees no key). A CuPy array costs a device reduction and a
    synchronization (``bool(...any())``) per array; its bad index is read only when there is one."""
    for name, a in arrays.items():
        if a is None or a.size == 0:
            continue
        a = _compact(a)  # a broadcast axis once: its index 0 is an index of the caller's array too
        bits, exponent, sign = float_bits(a)
        exponent, sign = bits.dtype.type(exponent), bits.dtype.type(sign)
        bad = (bits & exponent) == exponent
        if name in allow_neginf:
            bad &= bits != (exponent | sign)
        if not bool(bad.any()):
            continue
        flat = int(bad.ravel().argmax())
        index = tuple(int(i) for i in np.unravel_index(flat, bad.shape))
        word = int(bits[index])
        kind = ("nan" if word & ~(int(exponent) | int(sign)) or bits.dtype == np.uint8
                else ("-inf" if word & int(sign) else "inf"))
        expected = ("finite or -inf (which masks a score)" if name == "bias" else
                    "finite or -inf (a row that sees no key)" if name == "lse" else
                    "finite or -inf" if name in allow_neginf else "finite")
        where = f"{name}[{', '.join(map(str, index))}]" if index else name
        raise ValueError(f"{name} must be {expected}; got {kind} at {where} (check_finite=True or "
                         f"{FINITE_CHECK_ENV}=1 scans the inputs before any computation)")


def _check_4d(name: str, a, layout: str) -> None:
    if a.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions {layout}; got {a.ndim} dimensions with shape {_shape(a)}")


def _check_float_like_q(name: str, a, dtype: np.dtype) -> None:
    if np.dtype(a.dtype) != dtype:
        raise TypeError(f"{name} must have the dtype of q, {_dtype_name(dtype)}; got {_dtype_name(a.dtype)}")


def _int32_array(name: str, a, shape: tuple[int, ...], what: str) -> None:
    """An int32 array of ``shape`` (``what`` spells it) with a contiguous last axis."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be an int32 array of shape {what}; got {type(a).__name__}")
    if _shape(a) != shape:
        raise ValueError(f"{name} must have shape {what} = {shape}; got {_shape(a)}")
    if np.dtype(a.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32; got {_dtype_name(a.dtype)}")
    _check_contiguous_last_axis(name, a)


def kvcache(q, k_cache, v_cache, k, v, *, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved,
            cache_batch_idx, cache_leftpad, block_table, num_splits, rotary_consecutive_q: bool, xp,
            read_values: bool = True):
    """Every check of :func:`cuflash.attention_with_kvcache` but the variant's: ``(problem, cache)``.

    ``problem`` is the call as an attention :class:`Problem` (``seqlen_k`` the cache's capacity per sequence,
    ``head_dim_v`` v_cache's head dim); ``cache`` a :class:`cuflash._ops.kvcache.KVCache` with ``num_splits`` as
    given (0: automatic, resolved by the front door). ``read_values=False`` (CuPy outside the debug mode) checks
    the index arrays by shape and dtype only; a Python int ``cache_seqlens`` is always checked.
    """
    from .kvcache import KVCache, Rotary

    paged = block_table is not None
    _check_4d("q", q, "(batch, seqlen_q, heads_q, head_dim)")
    cache_layout = ("(num_blocks, page_size, heads_kv, head_dim) with block_table" if paged
                    else "(batch_cache, seqlen_cache, heads_kv, head_dim)")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_4d(name, a, cache_layout)
    dtype = np.dtype(q.dtype)
    if dtype.name not in _FLOAT_DTYPES:
        raise TypeError(f"q must have a floating dtype (one of {', '.join(_FLOAT_DTYPES)}); got {_dtype_name(dtype)}")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float_like_q(name, a, dtype)
    batch, seqlen_q, heads_q, head_dim = _shape(q)
    rows, slots, heads_kv, head_dim_k = _shape(k_cache)
    head_dim_v = _shape(v_cache)[3]
    if _shape(v_cache)[:3] != _shape(k_cache)[:3]:
        raise ValueError(f"k_cache and v_cache must have the same shape but for the last axis (v's head_dim may "
                         f"differ); got k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)}")
    if head_dim_k != head_dim:
        raise ValueError(f"k_cache must have q's head_dim (last axis), {head_dim}; got {head_dim_k}")
    if head_dim < 1 or head_dim_v < 1:
        raise ValueError(f"head dims must be positive; got q {head_dim}, v_cache {head_dim_v}")
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of key/value heads (k_cache axis 2) must divide the number of query heads (q axis "
                         f"2); got {heads_q} query heads and {heads_kv} key/value heads")
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_contiguous_last_axis(name, a)

    # The new keys and values
    if (k is None) != (v is None):
        raise ValueError(f"k and v (the new tokens to append) must be given together; got {'k' if v is None else 'v'} "
                         f"without {'v' if v is None else 'k'}")
    seqlen_new = 0
    if k is not None:
        for name, a in (("k", k), ("v", v)):
            _check_4d(name, a, "(batch, seqlen_new, heads_kv, head_dim)")
            _check_float_like_q(name, a, dtype)
        seqlen_new = _shape(k)[1]
        for name, a, dim, label in (("k", k, head_dim, "head_dim"), ("v", v, head_dim_v, "head_dim_v")):
            want = (batch, seqlen_new, heads_kv, dim)
            if _shape(a) != want:
                raise ValueError(f"{name} must have shape (batch, seqlen_new, heads_kv, {label}) = {want} (q's batch, "
                                 f"the caches' heads and head dims, k's seqlen_new); got {_shape(a)}")
            _check_contiguous_last_axis(name, a)

    # Where the keys live
    if paged:
        if not hasattr(block_table, "ndim") or block_table.ndim != 2:
            raise ValueError(f"block_table must be a 2-D int32 array (batch, max_pages); got "
                             f"{getattr(block_table, 'shape', type(block_table).__name__)}")
        _int32_array("block_table", block_table, (batch, _shape(block_table)[1]), "(batch, max_pages)")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with block_table: the block table already names each "
                             "sequence's pages; got both")
        if slots < 1:
            raise ValueError(f"a paged k_cache must have pages of at least one slot (axis 1); got page_size {slots}")
        page_size, capacity = slots, _shape(block_table)[1] * slots
    else:
        page_size, capacity = None, slots
        if cache_batch_idx is not None:
            _int32_array("cache_batch_idx", cache_batch_idx, (batch,), "(batch,)")
        elif rows < batch:
            raise ValueError(f"k_cache must have a row per batch entry without cache_batch_idx (axis 0 >= batch = "
                             f"{batch}); got {rows} rows")

    if seqlen_new > capacity:  # (the shapes alone: no sequence can take the new tokens)
        room = (f"max_pages * page_size = {_shape(block_table)[1]} * {page_size}" if paged else "seqlen_cache")
        raise ValueError(f"k and v's seqlen_new must fit the cache, at most {room} = {capacity} slots; got "
                         f"seqlen_new {seqlen_new}")

    seqlens_int = None
    if _is_int(cache_seqlens):
        seqlens_int = int(cache_seqlens)
        lengths, host_lengths = np.full(batch, seqlens_int, np.int64), True
    elif hasattr(cache_seqlens, "dtype"):
        _int32_array("cache_seqlens", cache_seqlens, (batch,), "(batch,)")
        lengths = _to_host(cache_seqlens).astype(np.int64) if read_values else None
        host_lengths = read_values
    else:
        raise TypeError(f"cache_seqlens must be an int or an int32 array of shape (batch,); got "
                        f"{type(cache_seqlens).__name__} {cache_seqlens!r}")
    if cache_leftpad is not None:
        _int32_array("cache_leftpad", cache_leftpad, (batch,), "(batch,)")

    # Rotary
    rotary = None
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"rotary_cos and rotary_sin must be given together; got "
                         f"{'rotary_cos' if rotary_sin is None else 'rotary_sin'} alone")
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool; got {type(rotary_interleaved).__name__} {rotary_interleaved!r}")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin rotate q and the new keys k: they need k and v (as "
                             "flash-attention); got them without k")
        for name, a in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if a.ndim != 2:
                raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2); got {_shape(a)}")
            if np.dtype(a.dtype).name not in _FLOAT_DTYPES:
                raise TypeError(f"{name} must have a floating dtype; got {_dtype_name(a.dtype)}")
            _check_contiguous_last_axis(name, a)
        if _shape(rotary_sin) != _shape(rotary_cos):
            raise ValueError(f"rotary_cos and rotary_sin must have the same shape; got {_shape(rotary_cos)} and "
                             f"{_shape(rotary_sin)}")
        half = _shape(rotary_cos)[1]
        if half < 1 or 2 * half > head_dim:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] must lie in [2, head_dim = {head_dim}] (the leading "
                             f"dims of each head that are rotated); got rotary_cos of shape {_shape(rotary_cos)}, "
                             f"rotary_dim {2 * half}")
        rotary = Rotary(rotary_cos, rotary_sin, bool(rotary_interleaved), bool(rotary_consecutive_q))

    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an integer >= 0 (0: automatic); got {type(num_splits).__name__} {num_splits!r}")
    if int(num_splits) < 0:
        raise ValueError(f"num_splits must be an integer >= 0 (0: automatic); got {int(num_splits)}")

    # Values, where readable (before anything is written into the cache)
    leftpad = None
    if cache_leftpad is not None and read_values:
        leftpad = _to_host(cache_leftpad).astype(np.int64)
    starts = np.zeros(batch, np.int64) if leftpad is None else leftpad
    if leftpad is not None:
        bad = np.flatnonzero(leftpad < 0)
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_leftpad must be >= 0 (the first used slot); got cache_leftpad[{b}] = {leftpad[b]}")
    if host_lengths:
        bad = np.flatnonzero(lengths < 0)
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_seqlens must be >= 0 (the keys already in the cache); got cache_seqlens[{b}] = "
                             f"{lengths[b]}")
        bad = np.flatnonzero(starts > lengths)
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_leftpad[b] must be at most cache_seqlens[b] (slots cache_leftpad[b] .. "
                             f"cache_seqlens[b] - 1 hold the keys); got cache_leftpad[{b}] = {starts[b]} > "
                             f"cache_seqlens[{b}] = {lengths[b]}")
        bad = np.flatnonzero(lengths + seqlen_new > capacity)
        if bad.size:
            b = int(bad[0])
            room = (f"max_pages * page_size = {_shape(block_table)[1]} * {page_size}" if paged else "seqlen_cache")
            raise ValueError(f"cache_seqlens[b] + seqlen_new must fit the cache, at most {room} = {capacity} slots; got "
                             f"cache_seqlens[{b}] = {lengths[b]} + seqlen_new {seqlen_new} = {lengths[b] + seqlen_new}")
    if read_values and cache_batch_idx is not None:
        rows_used = _to_host(cache_batch_idx).astype(np.int64)
        bad = np.flatnonzero((rows_used < 0) | (rows_used >= rows))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_batch_idx entries must lie in [0, batch_cache = {rows}) (rows of k_cache); got "
                             f"cache_batch_idx[{b}] = {rows_used[b]}")
        if seqlen_new and len(set(rows_used.tolist())) < batch:
            values, counts = np.unique(rows_used, return_counts=True)
            row = int(values[counts > 1][0])
            who = np.flatnonzero(rows_used == row)[:2].tolist()
            raise ValueError(f"cache_batch_idx must not repeat a row when k and v are appended (two sequences would write "
                             f"the same slots); got row {row} for batch entries {who[0]} and {who[1]}")
    if paged and read_values and host_lengths:
        _check_block_table(_to_host(block_table).astype(np.int64), starts, lengths, seqlen_new, page_size, rows)
    if rotary is not None and host_lengths:
        seqlen_ro = _shape(rotary_cos)[0]
        last_k = lengths + seqlen_new - 1
        last_q = lengths + (seqlen_q - 1 if rotary.consecutive_q else 0)
        needed = np.maximum(last_k, np.where(seqlen_q > 0, last_q, -1)) if batch else np.zeros(0, np.int64)
        bad = np.flatnonzero(needed >= seqlen_ro)
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"rotary_cos and rotary_sin must have a row for every rotated position: seqlen_ro must be "
                             f"> {needed[b]} (sequence {b}: cache_seqlens {lengths[b]}, seqlen_new {seqlen_new}, seqlen_q "
                             f"{seqlen_q}); got seqlen_ro {seqlen_ro}")

    if seqlens_int is not None:  # checked above: it fits int32
        cache_seqlens = uniform_seqlens(xp, batch, seqlens_int)
    problem = Problem(batch, seqlen_q, capacity, heads_q, heads_kv, head_dim, dtype, head_dim_v=head_dim_v)
    cache = KVCache(cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                    block_table=block_table, page_size=page_size, capacity=capacity, seqlen_new=seqlen_new,
                    rotary=rotary, num_splits=int(num_splits))
    return problem, cache


def _check_block_table(table: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seqlen_new: int, page_size: int,
                       num_pages: int) -> None:
    """The entries of ``block_table`` that the call reads or writes (the pages holding slots ``starts[b] ..
    lengths[b] + seqlen_new - 1`` of each sequence) name pages of the cache, and no slot is appended to by two
    sequences (pages may be shared where they are only read). Other entries are never read: any value."""
    batch, max_pages = table.shape
    ends = lengths + seqlen_new
    columns = np.arange(max_pages)
    used = (columns >= (starts // page_size)[:, None]) & (columns < (-(-ends // page_size))[:, None])
    used &= (ends > starts)[:, None]
    bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, c = (int(x) for x in bad[0])
        raise ValueError(f"block_table entries that a sequence uses must lie in [0, num_blocks = {num_pages}); got "
                         f"block_table[{b}, {c}] = {table[b, c]} (sequence {b} uses slots {starts[b]} .. {ends[b] - 1}, "
                         f"its pages {starts[b] // page_size} .. {-(-ends[b] // page_size) - 1})")
    if not seqlen_new or not batch:
        return
    positions = lengths[:, None] + np.arange(seqlen_new)[None, :]               # (batch, seqlen_new) slots written
    pages = np.take_along_axis(table, positions // page_size, axis=1)
    flat = (pages * page_size + positions % page_size).ravel()
    owners = np.repeat(np.arange(batch), seqlen_new)
    order = np.argsort(flat, kind="stable")
    same = np.flatnonzero(flat[order][1:] == flat[order][:-1])
    if same.size:
        first, second = int(owners[order][same[0]]), int(owners[order][same[0] + 1])
        slot = int(flat[order][same[0]])
        where = (f"page {slot // page_size} slot {slot % page_size}" if first != second
                 else f"page {slot // page_size} slot {slot % page_size} (twice)")
        raise ValueError(f"block_table makes two appended tokens share a slot: {where} is written by batch entries "
                         f"{first} and {second} (pages may be shared between sequences only where they are read, not "
                         f"where new keys are appended)")


def kvcache_out(out, problem: Problem) -> None:
    """``out=`` of a decode call: q's shape with v's head dim, q's dtype, a contiguous last axis."""
    if out is None:
        return
    if _shape(out) != problem.out_shape:
        raise ValueError(f"out must have shape (batch, seqlen_q, heads_q, head_dim_v) = {problem.out_shape}; got "
                         f"{_shape(out)}")
    if np.dtype(out.dtype) != problem.dtype:
        raise TypeError(f"out must have the dtype of q, {_dtype_name(problem.dtype)}; got {_dtype_name(out.dtype)}")
    _check_contiguous_last_axis("out", out)


def merge_states(o_a, lse_a, o_b, lse_b) -> None:
    """Two partial attentions to merge: ``o`` ``(batch, seqlen_q, heads, d)`` with ``lse`` ``(batch, heads,
    seqlen_q)``, or packed ``o`` ``(total, heads, d)`` with ``lse`` ``(heads, total)``; equal shapes and dtypes."""
    check_same_library(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if o_a.ndim not in (3, 4):
        raise ValueError(f"o_a must have shape (batch, seqlen_q, heads, head_dim) or packed (total, heads, head_dim); "
                         f"got {_shape(o_a)}")
    if _shape(o_b) != _shape(o_a):
        raise ValueError(f"o_a and o_b must have the same shape; got {_shape(o_a)} and {_shape(o_b)}")
    if o_a.ndim == 4:
        batch, seqlen_q, heads, _ = _shape(o_a)
        want, layout = (batch, heads, seqlen_q), "(batch, heads, seqlen_q)"
    else:
        total, heads, _ = _shape(o_a)
        want, layout = (heads, total), "(heads, total)"
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if _shape(lse) != want:
            raise ValueError(f"{name} must have shape {layout} = {want} for o of shape {_shape(o_a)} (as "
                             f"attention(..., return_lse=True) returns them); got {_shape(lse)}")
    for name, a in (("o_a", o_a), ("o_b", o_b)):
        if np.dtype(a.dtype).name not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype (one of {', '.join(_FLOAT_DTYPES)}); got "
                            f"{_dtype_name(a.dtype)}")
    if np.dtype(o_b.dtype) != np.dtype(o_a.dtype):
        raise TypeError(f"o_a and o_b must have the same dtype; got {_dtype_name(o_a.dtype)} and {_dtype_name(o_b.dtype)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if np.dtype(lse.dtype) not in (np.float32, np.float64):
            raise TypeError(f"{name} must have dtype float32 or float64; got {_dtype_name(lse.dtype)}")
    if np.dtype(lse_b.dtype) != np.dtype(lse_a.dtype):
        raise TypeError(f"lse_a and lse_b must have the same dtype; got {_dtype_name(lse_a.dtype)} and "
                        f"{_dtype_name(lse_b.dtype)}")
