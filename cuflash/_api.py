"""The front door: normalize the arguments, validate them, pick the backend, run.

NumPy arrays run the NumPy block algorithm (:mod:`cuflash.reference`); CuPy arrays run the CUDA kernels
(:mod:`cuflash._cuda`). Both backends take the same normalized keyword arguments (see
``docs/architecture.md``): the variant options arrive as one :class:`~cuflash._variant.Variant`. The
backends never see unchecked user input.
"""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Mapping
from types import ModuleType

import numpy as np

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


# Variant keywords that are arrays (of q's library) and get no gradient; "bias" is one too, the one with a
# gradient (the framework front ends pass it apart from these). And those that describe a packed batch.
ARRAY_OPTIONS = ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "attn_mask")
_PACKED_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
# All the variant keywords of attention and attention_backward: what _prepare and _validate.variant read.
_VARIANT_OPTIONS = (
    "causal", "causal_align", "window_size", "softcap", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k",
    "max_seqlen_q", "max_seqlen_k", "seqused_k", "bias", "attn_mask", "dropout_p", "dropout_seed", "dropout_offset",
    "score_mod", "mask_mod", "mod_arrays",
)


def _variant_options(arguments: dict) -> dict:
    """The variant keywords of a call of :func:`attention` or :func:`attention_backward`, from its ``locals()``
    (their parameters have the keywords' names)."""
    return {name: arguments[name] for name in _VARIANT_OPTIONS}


def _prepare(q, k, v, *, softmax_scale, algorithm, block_q, block_k, variant_options, extra=None, read_values=True):
    """Validate everything and normalize: ``(library, problem, options for the backend)``.

    ``read_values=False`` checks cu_seqlens and seqused_k by shape and dtype only (see :mod:`cuflash._validate`).
    """
    packed = [variant_options[name] for name in _PACKED_OPTIONS]
    varlen = _validate.varlen_mode(*packed)
    arrays = {"q": q, "k": k, "v": v, **(extra or {})}
    arrays.update((name, variant_options[name]) for name in ("bias", *ARRAY_OPTIONS) if variant_options[name] is not None)
    if isinstance(variant_options.get("mod_arrays"), Mapping):
        arrays.update((f"mod_arrays[{name!r}]", a) for name, a in variant_options["mod_arrays"].items())
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
    return_lse: bool = False,
):
    """Exact softmax attention, ``softmax(scale * q k^T) v``, computed block by block.

    The variant keywords (``window_size``, ``softcap``, ``alibi_slopes``, ``cu_seqlens_q``/``cu_seqlens_k``,
    ``seqused_k``) have flash-attention's names and meaning (``flash_attn_func``,
    ``flash_attn_varlen_func``); ``bias`` and ``attn_mask`` those of PyTorch's
    ``scaled_dot_product_attention``. Their math is in ``docs/variants.md``.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim), or (total_q, heads_q, head_dim) packed
    k, v : arrays, shape (batch, seqlen_k, heads_kv, head_dim), or (total_k, heads_kv, head_dim) packed
        v's last axis, ``head_dim_v``, may differ from q's and k's (DeepSeek's 192 for q, k and 128 for v);
        the output has it. NumPy arrays run the NumPy block algorithm, CuPy arrays the CUDA kernels. float16, bfloat16,
        float32 and float64 are accepted; any strides with a contiguous last axis, without a copy.
        ``heads_kv`` must divide ``heads_q`` (grouped-query attention: query head ``h`` reads key/value
        head ``h // (heads_q // heads_kv)``). The packed layout needs ``cu_seqlens_q`` and ``cu_seqlens_k``.
    causal : bool
        Mask out keys after the query's position on the diagonal chosen by ``causal_align``.
    softmax_scale : float, optional
        Multiplies the scores before the softmax; default ``1 / sqrt(head_dim)`` (q's and k's head dim).
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
    bias : array, optional
        Floating, same library as q, broadcastable to ``(batch, heads_q, seqlen_q, seqlen_k)`` with batch and
        heads full or 1 (or 2-D ``(seqlen_q, seqlen_k)``, 3-D ``(heads_q, seqlen_q, seqlen_k)``): added to
        the scaled score of query ``i`` and key ``j`` after softcap and ALiBi, before the masks; ``-inf``
        masks. Padded layout only. Differentiable: see :func:`attention_backward`.
    attn_mask : array, optional
        bool, same shapes as ``bias``: ``True`` where query ``i`` sees key ``j`` (PyTorch's convention),
        ``False`` masks the score. May be given with ``bias``.
    dropout_p : float
        In ``[0, 1)``: each probability (after the softmax, whose ``lse`` it leaves unchanged) is zeroed with
        this probability and the kept ones are scaled by ``1 / (1 - dropout_p)``, as flash-attention. The
        keep decision of each score is a pure function of ``(dropout_seed, dropout_offset, b, h, i, j)``
        (``docs/variants.md``, "Dropout"; :func:`dropout_mask` returns it). NumPy and CuPy (fa2) arrays.
    dropout_seed : int, optional
        In ``[0, 2**64)``; required when ``dropout_p > 0``. The same seed and offset give the same mask.
    dropout_offset : int
        In ``[0, 2**64)``, default 0: added to the Philox counter's (head, batch) word, so that calls sharing a
        seed draw different masks (advance it by ``batch * 2**32`` per call for disjoint counters).
    score_mod : str, optional
        A CUDA C expression over ``score``, ``b``, ``h``, ``q_idx``, ``kv_idx`` (FlexAttention's ``score_mod``):
        its value replaces the score. ``score`` is the scaled score ``softmax_scale * q . k`` after softcap,
        ALiBi and the bias (score_mod comes last); ``b`` the batch entry (packed: the sequence), ``h`` the query
        head, ``q_idx`` / ``kv_idx`` positions within the sequence. Differentiated (dual numbers). Grammar and
        examples: ``docs/variants.md``, "User score and mask modifications".
    mask_mod : str, optional
        A CUDA C expression over ``b``, ``h``, ``q_idx``, ``kv_idx``: query ``q_idx`` sees key ``kv_idx`` where it
        is non-zero (AND-ed with the other masks); tiles it masks entirely are skipped.
    mod_arrays : dict, optional
        Up to four named 1-D int32 or float32 arrays (same library as q) the expressions index, ``name[expr]``
        (a document id per position, a per-head table).
    algorithm : {"fa2", "fa1", "naive"}
        FlashAttention-2 order (query blocks outer), FlashAttention-1 order (key/value blocks outer,
        O, m, l written back each step), or the naive algorithm that materializes the scores.
    block_q, block_k : int, optional
        Tile sizes. Default: from the on-chip memory budget (NumPy) or the tuned tile table (CUDA).
    return_lse : bool
        Also return the logsumexp of the scaled (and modified) scores, needed by :func:`attention_backward`.

    Returns
    -------
    out : array like q, with v's head dim
    lse : array, shape (batch, heads_q, seqlen_q), or (heads_q, total_q) packed; only with ``return_lse=True``
        Natural-log logsumexp, float32 (float64 for float64 inputs); ``-inf`` for a row that sees no key.
    """
    variant_options = _variant_options(locals())
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
    order: str | None = None,
    deterministic: bool = False,
    return_dbias: bool | None = None,
):
    """Gradients of :func:`attention` with respect to q, k and v (and ``bias``).

    Recomputes the probabilities tile by tile from ``lse`` (as returned by
    ``attention(..., return_lse=True)``); nothing of size ``seqlen_q x seqlen_k`` is stored.

    Parameters
    ----------
    do : array like out
        Gradient of the loss with respect to ``out`` (q's shape with v's head dim).
    q, k, v, out, lse :
        The forward's inputs, output and logsumexp.
    causal, softmax_scale, causal_align, window_size, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, bias, attn_mask, dropout_p, dropout_seed, dropout_offset, score_mod, mask_mod, mod_arrays, algorithm, block_q, block_k :
        As given to the forward (the same dropout seed and offset regenerate the forward's mask).
    order : {"kv_outer", "q_outer", "split"}, optional
        Backward loop order: key/value blocks outer with dQ accumulated across the outer loop (the
        default, as both FlashAttention papers), query blocks outer with dK and dV accumulated, or two
        passes (dK/dV, then dQ) with no read-modify-write.
    deterministic : bool
        Run the ``"split"`` order: bitwise reproducible on the GPU (no atomics), at some cost in speed.
    return_dbias : bool, optional
        Whether to compute and return ``dbias``; default: when ``bias`` is given. ``False`` with a bias
        that needs no gradient saves writing ``batch x heads_q x seqlen_q x seqlen_k`` floats.

    Returns
    -------
    dq, dk, dv : arrays like q, k, v
        Keys that no query sees (past ``seqused_k``, say) get zero ``dk`` and ``dv``.
    dbias : array like bias, only with ``bias`` (and ``return_dbias`` not False)
        The gradient of the scaled, modified score (after softcap and ALiBi) at each query and key, zero
        where masked, summed over the axes ``bias`` broadcasts over. ``attn_mask`` gets no gradient.
    """
    variant_options = _variant_options(locals())
    library, problem, options = _prepare(
        q, k, v, softmax_scale=softmax_scale, algorithm=algorithm, block_q=block_q, block_k=block_k,
        variant_options=variant_options, extra={"do": do, "out": out, "lse": lse},
    )
    _validate.check_backward_tensors(problem, do, out, lse)
    options["order"] = _validate.backward_order(order, deterministic)
    want_dbias = _validate.return_dbias(return_dbias, bias)
    if problem.is_empty:
        grads = _empty_backward(q, k, v)
        return (*grads, _namespace(q).zeros(bias.shape, bias.dtype)) if want_dbias else grads
    backend = _backend(library)
    _check_supported(backend, problem, options["algorithm"], options["variant"])
    if not want_dbias:  # the keyword only when asked: the backend interface without a bias is unchanged
        return backend.backward(do, q, k, v, out, lse, **options)
    dq, dk, dv, dbias = backend.backward(do, q, k, v, out, lse, **options, want_dbias=True)
    return dq, dk, dv, _reduce_dbias(dbias, bias)


def dropout_mask(shape, dropout_p: float, seed: int, offset: int = 0):
    """The boolean keep mask that :func:`attention` applies with these dropout options: a NumPy array of
    ``shape = (batch, heads_q, seqlen_q, seqlen_k)``, True where the probability of query ``i`` and key ``j``
    of head ``h`` in sequence ``b`` is kept (all True for ``dropout_p = 0``).

    For a packed batch, ``b`` is the sequence's index and ``i``, ``j`` positions within it: the mask of
    sequence ``b`` is ``dropout_mask((nseq, heads_q, max_seqlen_q, max_seqlen_k), ...)[b, :, :len_q, :len_k]``.
    """
    shape = tuple(shape)
    if len(shape) != 4 or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0 for n in shape):
        raise ValueError(f"shape must be 4 non-negative integers (batch, heads_q, seqlen_q, seqlen_k); got {shape!r}")
    p, seed, offset = _validate.dropout(dropout_p, seed, offset)
    if not p:
        return np.ones(shape, bool)
    b, h, i, j = np.ix_(*(np.arange(n) for n in shape))
    return Variant(dropout_p=p, dropout_seed=seed, dropout_offset=offset).keep(b, h, i, j)


def _namespace(a) -> ModuleType:
    return importlib.import_module(type(a).__module__.split(".")[0])


def _empty_forward(q, problem: _validate.Problem):
    """No key (seqlen_k = 0): every row outputs zeros with lse = -inf. Other empty axes: empty arrays."""
    xp = _namespace(q)
    out = xp.zeros(problem.out_shape, dtype=q.dtype)
    lse = xp.full(problem.lse_shape, -xp.inf, dtype=_validate.lse_dtype(problem.dtype))
    return out, lse


def _reduce_dbias(dbias, bias):
    """The gradient of the user's ``bias`` from the backend's ``(batch, heads_q, seqlen_q, seqlen_k)`` one:
    summed over the axes ``bias`` broadcasts over, in its shape and dtype."""
    shape = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    axes = tuple(axis for axis in range(2) if shape[axis] == 1 and dbias.shape[axis] != 1)
    if axes:
        dbias = dbias.sum(axis=axes, keepdims=True)
    return dbias.reshape(bias.shape).astype(bias.dtype, copy=False)


def _empty_backward(q, k, v):
    xp = _namespace(q)
    return (xp.zeros(q.shape, dtype=q.dtype), xp.zeros(k.shape, dtype=k.dtype), xp.zeros(v.shape, dtype=v.dtype))
