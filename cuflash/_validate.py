"""Every user-facing check of cuflash, in one place.

Each check raises before any computation starts, with a message that names the argument, what was
expected and what was given. The front door (:mod:`cuflash._api`) calls these and hands the backends
normalized values only: a Python float scale, an integer causal offset (or ``None``), positive integer
block sizes (or ``None``), a known algorithm and backward order.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("fa2", "fa1", "naive")
ORDERS = ("kv_outer", "q_outer", "split")
CAUSAL_ALIGNS = ("bottom-right", "top-left")
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Problem:
    """Shapes of one attention call, read off validated q, k, v."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: np.dtype

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def is_empty(self) -> bool:
        """True when there is no score to compute (a zero-sized batch, sequence or head axis)."""
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


def check_same_library(**arrays) -> str:
    """All arrays come from one array library and, for device arrays, one device.

    Returns the library name (``"numpy"`` or ``"cupy"``).
    """
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


def check_qkv(q, k, v) -> Problem:
    """Ranks, shapes, dtypes and strides of q, k, v; returns the problem's sizes."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim); "
                f"got {a.ndim} dimensions with shape {_shape(a)}"
            )
    dtype = np.dtype(q.dtype)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if np.dtype(a.dtype).name not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} must have a floating dtype (one of {', '.join(_FLOAT_DTYPES)}); "
                f"got {np.dtype(a.dtype).name}"
            )
    if np.dtype(k.dtype) != dtype or np.dtype(v.dtype) != dtype:
        raise TypeError(
            "q, k and v must have the same dtype; "
            f"got q {_dtype_name(dtype)}, k {_dtype_name(k.dtype)}, v {_dtype_name(v.dtype)}"
        )
    batch, seqlen_q, heads_q, head_dim = _shape(q)
    if _shape(k) != _shape(v):
        raise ValueError(f"k and v must have the same shape; got k {_shape(k)} and v {_shape(v)}")
    batch_k, seqlen_k, heads_kv, head_dim_k = _shape(k)
    if head_dim_k != head_dim:
        raise ValueError(
            f"q, k and v must have the same head_dim (last axis); got q {head_dim}, k and v {head_dim_k}"
        )
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive; got {head_dim}")
    if batch_k != batch:
        raise ValueError(f"q and k must have the same batch size (axis 0); got q {batch}, k {batch_k}")
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(
            "the number of key/value heads must divide the number of query heads (axis 2); "
            f"got {heads_q} query heads and {heads_kv} key/value heads"
        )
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_contiguous_last_axis(name, a)
    return Problem(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)


def check_backward_tensors(problem: Problem, do, out, lse) -> None:
    """do and out are shaped and typed like q; lse like the forward's logsumexp."""
    q_shape = (problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)
    for name, a in (("do", do), ("out", out)):
        if _shape(a) != q_shape:
            raise ValueError(f"{name} must have the shape of q, {q_shape}; got {_shape(a)}")
        if np.dtype(a.dtype) != problem.dtype:
            raise TypeError(
                f"{name} must have the dtype of q, {_dtype_name(problem.dtype)}; got {_dtype_name(a.dtype)}"
            )
        _check_contiguous_last_axis(name, a)
    if _shape(lse) != problem.lse_shape:
        raise ValueError(
            f"lse must have shape (batch, heads, seqlen_q) = {problem.lse_shape}; got {_shape(lse)}"
        )
    want = lse_dtype(problem.dtype)
    if np.dtype(lse.dtype) != want:
        raise TypeError(
            f"lse must have dtype {want.name} for {problem.dtype.name} inputs "
            f"(as returned by attention(..., return_lse=True)); got {_dtype_name(lse.dtype)}"
        )


def softmax_scale(value, head_dim: int) -> float:
    """The scale applied to q k^T: ``1/sqrt(head_dim)`` by default, else a finite positive real."""
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got {type(value).__name__}")
    scale = float(value)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be finite and positive; got {value!r}")
    return scale


def causal_offset(causal, causal_align: str, seqlen_q: int, seqlen_k: int) -> int | None:
    """The diagonal offset: query ``i`` sees key ``j`` iff ``j <= i + offset``; None when not causal."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__} {causal!r}")
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(
            f"causal_align must be one of {', '.join(map(repr, CAUSAL_ALIGNS))}; got {causal_align!r}"
        )
    if not causal:
        return None
    return seqlen_k - seqlen_q if causal_align == "bottom-right" else 0


def algorithm(value) -> str:
    if value not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}; got {value!r}")
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


def block_size(name: str, value) -> int | None:
    """None (the default from the on-chip budget) or a positive integer."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer or None; got {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be a positive integer or None; got {int(value)}")
    return int(value)
