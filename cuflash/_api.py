"""The front door: normalize the arguments, validate them, pick the backend, run.

NumPy arrays run the NumPy block algorithm (:mod:`cuflash.reference`); CuPy arrays run the CUDA kernels
(:mod:`cuflash._cuda`). Both backends take the same normalized keyword arguments (see
``docs/architecture.md``) and never see unchecked user input.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import _validate

_BACKEND_MODULES = {"numpy": "cuflash.reference", "cupy": "cuflash._cuda"}


def _backend(library: str) -> ModuleType:
    return importlib.import_module(_BACKEND_MODULES[library])


def _check_supported(backend: ModuleType, problem: _validate.Problem, algorithm: str) -> None:
    """Let the backend refuse what it cannot run (a head dim, a dtype, a GPU), before any launch."""
    check = getattr(backend, "check_supported", None)
    if check is not None:
        check(problem, algorithm)


def _prepare(q, k, v, *, causal, softmax_scale, causal_align, algorithm, block_q, block_k, extra=None):
    arrays = {"q": q, "k": k, "v": v, **(extra or {})}
    library = _validate.check_same_library(**arrays)
    problem = _validate.check_qkv(q, k, v)
    options = dict(
        scale=_validate.softmax_scale(softmax_scale, problem.head_dim),
        causal_offset=_validate.causal_offset(causal, causal_align, problem.seqlen_q, problem.seqlen_k),
        algorithm=_validate.algorithm(algorithm),
        block_q=_validate.block_size("block_q", block_q),
        block_k=_validate.block_size("block_k", block_k),
    )
    return library, problem, options


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    causal_align: str = "bottom-right",
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
):
    """Exact softmax attention, ``softmax(scale * q k^T) v``, computed block by block.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim)
    k, v : arrays, shape (batch, seqlen_k, heads_kv, head_dim)
        NumPy arrays run the NumPy block algorithm, CuPy arrays the CUDA kernels. float16, bfloat16,
        float32 and float64 are accepted; any strides with a contiguous last axis, without a copy.
        ``heads_kv`` must divide ``heads_q`` (grouped-query attention: query head ``h`` reads key/value
        head ``h // (heads_q // heads_kv)``).
    causal : bool
        Mask out keys after the query's position on the diagonal chosen by ``causal_align``.
    softmax_scale : float, optional
        Multiplies the scores before the softmax; default ``1 / sqrt(head_dim)``.
    causal_align : {"bottom-right", "top-left"}
        With ``seqlen_q != seqlen_k``: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``
        (bottom-right, as flash-attention >= 2.1) or ``j <= i`` (top-left).
    algorithm : {"fa2", "fa1", "naive"}
        FlashAttention-2 order (query blocks outer), FlashAttention-1 order (key/value blocks outer,
        O, m, l written back each step), or the naive algorithm that materializes the scores.
    block_q, block_k : int, optional
        Tile sizes. Default: from the on-chip memory budget (NumPy) or the tuned tile table (CUDA).
    return_lse : bool
        Also return the logsumexp of the scaled scores, needed by :func:`attention_backward`.

    Returns
    -------
    out : array like q
    lse : array, shape (batch, heads_q, seqlen_q), only with ``return_lse=True``
        Natural-log logsumexp, float32 (float64 for float64 inputs); ``-inf`` for a row that sees no key.
    """
    library, problem, options = _prepare(
        q, k, v, causal=causal, softmax_scale=softmax_scale, causal_align=causal_align,
        algorithm=algorithm, block_q=block_q, block_k=block_k,
    )
    if problem.is_empty:
        out, lse = _empty_forward(q, problem)
    else:
        backend = _backend(library)
        _check_supported(backend, problem, options["algorithm"])
        out, lse = backend.forward(q, k, v, **options)
    return (out, lse) if return_lse else out


def attention_backward(
    do,
    q,
    k,
    v,
    out,
    lse,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    causal_align: str = "bottom-right",
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
    order: str | None = None,
    deterministic: bool = False,
):
    """Gradients of :func:`attention` with respect to q, k and v.

    Recomputes the probabilities tile by tile from ``lse`` (as returned by
    ``attention(..., return_lse=True)``); nothing of size ``seqlen_q x seqlen_k`` is stored.

    Parameters
    ----------
    do : array like q
        Gradient of the loss with respect to ``out``.
    q, k, v, out, lse :
        The forward's inputs, output and logsumexp.
    causal, softmax_scale, causal_align, algorithm, block_q, block_k :
        As given to the forward.
    order : {"kv_outer", "q_outer", "split"}, optional
        Backward loop order: key/value blocks outer with dQ accumulated across the outer loop (the
        default, as both FlashAttention papers), query blocks outer with dK and dV accumulated, or two
        passes (dK/dV, then dQ) with no read-modify-write.
    deterministic : bool
        Run the ``"split"`` order: bitwise reproducible on the GPU (no atomics), at some cost in speed.

    Returns
    -------
    dq, dk, dv : arrays like q, k, v
    """
    library, problem, options = _prepare(
        q, k, v, causal=causal, softmax_scale=softmax_scale, causal_align=causal_align,
        algorithm=algorithm, block_q=block_q, block_k=block_k,
        extra={"do": do, "out": out, "lse": lse},
    )
    _validate.check_backward_tensors(problem, do, out, lse)
    options["order"] = _validate.backward_order(order, deterministic)
    if problem.is_empty:
        return _empty_backward(q, k, v)
    backend = _backend(library)
    _check_supported(backend, problem, options["algorithm"])
    return backend.backward(do, q, k, v, out, lse, **options)


def _namespace(a) -> ModuleType:
    return importlib.import_module(type(a).__module__.split(".")[0])


def _empty_forward(q, problem: _validate.Problem):
    """No key (seqlen_k = 0): every row outputs zeros with lse = -inf. Other empty axes: empty arrays."""
    xp = _namespace(q)
    out = xp.zeros(q.shape, dtype=q.dtype)
    lse = xp.full(problem.lse_shape, -xp.inf, dtype=_validate.lse_dtype(problem.dtype))
    return out, lse


def _empty_backward(q, k, v):
    xp = _namespace(q)
    return (xp.zeros(q.shape, dtype=q.dtype), xp.zeros(k.shape, dtype=k.dtype), xp.zeros(v.shape, dtype=v.dtype))
