"""The front door: normalize the arguments, validate them, pick the backend, run.

NumPy arrays run the NumPy block algorithm (:mod:`cuflash.reference`); CuPy arrays run the CUDA kernels
(:mod:`cuflash._cuda`). Both backends take the same normalized keyword arguments (see
``docs/architecture.md``): the variant options arrive as one :class:`~cuflash._variant.Variant`. The
backends never see unchecked user input.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import _validate
from ._variant import Variant

_BACKEND_MODULES = {"numpy": "cuflash.reference", "cupy": "cuflash._cuda"}


def _backend(library: str) -> ModuleType:
    return importlib.import_module(_BACKEND_MODULES[library])


def _check_supported(backend: ModuleType, problem: _validate.Problem, algorithm: str, variant: Variant) -> None:
    """Let the backend refuse what it cannot run (a head dim, a dtype, a GPU, a variant), before any launch."""
    check = getattr(backend, "check_supported", None)
    if check is not None:
        check(problem, algorithm, variant)


# Variant keywords that are arrays (of q's library), and those that describe a packed batch.
ARRAY_OPTIONS = ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqused_k")
_PACKED_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _prepare(q, k, v, *, softmax_scale, algorithm, block_q, block_k, variant_options, extra=None, read_values=True):
    """Validate everything and normalize: ``(library, problem, options for the backend)``.

    ``read_values=False`` checks cu_seqlens and seqused_k by shape and dtype only (see :mod:`cuflash._validate`).
    """
    packed = [variant_options[name] for name in _PACKED_OPTIONS]
    varlen = _validate.varlen_mode(*packed)
    arrays = {"q": q, "k": k, "v": v, **(extra or {})}
    arrays.update((name, variant_options[name]) for name in ARRAY_OPTIONS if variant_options[name] is not None)
    library = _validate.check_same_library(**arrays)
    problem = _validate.check_qkv(q, k, v, varlen=varlen)
    if varlen:
        problem = _validate.check_cu_seqlens(problem, *packed, read_values=read_values)
    options = dict(
        scale=_validate.softmax_scale(softmax_scale, problem.head_dim),
        variant=_validate.variant(problem, _namespace(q), variant_options, read_values=read_values),
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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_k=None,
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
):
    """Exact softmax attention, ``softmax(scale * q k^T) v``, computed block by block.

    The variant keywords (``window_size``, ``softcap``, ``alibi_slopes``, ``cu_seqlens_q``/``cu_seqlens_k``,
    ``seqused_k``) have flash-attention's names and meaning (``flash_attn_func``,
    ``flash_attn_varlen_func``); their math is in ``docs/variants.md``.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim), or (total_q, heads_q, head_dim) packed
    k, v : arrays, shape (batch, seqlen_k, heads_kv, head_dim), or (total_k, heads_kv, head_dim) packed
        NumPy arrays run the NumPy block algorithm, CuPy arrays the CUDA kernels. float16, bfloat16,
        float32 and float64 are accepted; any strides with a contiguous last axis, without a copy.
        ``heads_kv`` must divide ``heads_q`` (grouped-query attention: query head ``h`` reads key/value
        head ``h // (heads_q // heads_kv)``). The packed layout needs ``cu_seqlens_q`` and ``cu_seqlens_k``.
    causal : bool
        Mask out keys after the query's position on the diagonal chosen by ``causal_align``.
    softmax_scale : float, optional
        Multiplies the scores before the softmax; default ``1 / sqrt(head_dim)``.
    causal_align : {"bottom-right", "top-left"}
        The diagonal of a sequence of ``len_q`` queries and ``len_k`` keys: query ``i`` faces key
        ``i + len_k - len_q`` (bottom-right, as flash-attention >= 2.1) or key ``i`` (top-left). Causal
        masking, windows and ALiBi all measure from it.
    window_size : (int, int)
        Sliding window ``(left, right)``: query ``i`` sees keys ``[i + off - left, i + off + right]`` around
        its diagonal position ``i + off``; -1 is unlimited on that side. With ``causal=True`` the right
        edge is at most 0.
    softcap : float
        0 for none; else each scaled score ``t`` becomes ``softcap * tanh(t / softcap)`` (before ALiBi).
    alibi_slopes : array, optional
        float32, shape ``(heads_q,)`` or ``(batch, heads_q)``, same library as q: adds
        ``-slope * |i + off - j|`` to the scaled score of query ``i`` and key ``j``.
    cu_seqlens_q, cu_seqlens_k : arrays, optional
        int32, shape ``(batch + 1,)``, same library as q: a packed variable-length batch, sequence ``b``
        being rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (and likewise of k, v). Both or neither;
        start at 0, non-decreasing, end at the row count.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest query and key sequence of a packed batch (required with cu_seqlens; upper bounds do).
    seqused_k : array, optional
        int32, shape ``(batch,)``: sequence ``b`` uses only its first ``seqused_k[b]`` keys (key padding);
        its diagonal is placed with ``len_k = seqused_k[b]``. Padded or packed layout.
    algorithm : {"fa2", "fa1", "naive"}
        FlashAttention-2 order (query blocks outer), FlashAttention-1 order (key/value blocks outer,
        O, m, l written back each step), or the naive algorithm that materializes the scores.
    block_q, block_k : int, optional
        Tile sizes. Default: from the on-chip memory budget (NumPy) or the tuned tile table (CUDA).
    return_lse : bool
        Also return the logsumexp of the scaled (and modified) scores, needed by :func:`attention_backward`.

    Returns
    -------
    out : array like q
    lse : array, shape (batch, heads_q, seqlen_q), or (heads_q, total_q) packed; only with ``return_lse=True``
        Natural-log logsumexp, float32 (float64 for float64 inputs); ``-inf`` for a row that sees no key.
    """
    variant_options = dict(
        causal=causal, causal_align=causal_align, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
    )
    library, problem, options = _prepare(
        q, k, v, softmax_scale=softmax_scale, algorithm=algorithm, block_q=block_q, block_k=block_k,
        variant_options=variant_options,
    )
    if problem.is_empty:
        out, lse = _empty_forward(q, problem)
    else:
        backend = _backend(library)
        _check_supported(backend, problem, options["algorithm"], options["variant"])
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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_k=None,
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
    causal, softmax_scale, causal_align, window_size, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, algorithm, block_q, block_k :
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
        Keys that no query sees (past ``seqused_k``, say) get zero ``dk`` and ``dv``.
    """
    variant_options = dict(
        causal=causal, causal_align=causal_align, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
    )
    library, problem, options = _prepare(
        q, k, v, softmax_scale=softmax_scale, algorithm=algorithm, block_q=block_q, block_k=block_k,
        variant_options=variant_options, extra={"do": do, "out": out, "lse": lse},
    )
    _validate.check_backward_tensors(problem, do, out, lse)
    options["order"] = _validate.backward_order(order, deterministic)
    if problem.is_empty:
        return _empty_backward(q, k, v)
    backend = _backend(library)
    _check_supported(backend, problem, options["algorithm"], options["variant"])
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
