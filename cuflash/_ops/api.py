"""The front door: normalize the arguments, validate them, pick the backend, run.

NumPy arrays run the NumPy block algorithm (:mod:`cuflash.reference`); CuPy arrays run the CUDA kernels
(:mod:`cuflash._cuda`). Both backends take the same normalized keyword arguments (see
``docs/architecture.md``): the variant options arrive as one :class:`~cuflash._ops.variant.Variant`. The
backends never see unchecked user input.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import numbers
import weakref
from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from . import (blocks as _blocks, cascade as _cascade, chunked_prefill as _chunked_prefill, decode_plan as _decode_plan,
               kvcache as _kvcache, merge as _merge, mods as _mods, validate as _validate)
from .decode_plan import DecodePlan
from .variant import Variant, VariantArrays

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


# ---------------------------------------------------------------------------------------------------
# The front door's memory of checked calls. A backend that plans its launches (the CUDA one: plan_forward, and
# plan_kvcache for decoding) gets each call checked once per signature: everything the checks read (each
# array's type, shape, strides, dtype and device; every option with its type; the backend's call_context(): the
# current device and stream) is the key of what the checks concluded and of the plan. A call with the same key
# would pass the same checks, so it runs the plan at once: its host time is the plan's, not the checks' (~150 us
# of Python). Checks that read array values (cu_seqlens, seqused_k, check_finite) still run at every call.


class _Unkeyed(Exception):
    """An argument the memory does not key (an array of another type, a dict subclass): the call is checked."""


class CallMemo:
    """Checked calls, oldest first, at most ``size`` of them: key -> what the checks concluded. (Oldest, not least
    recently used: a hit hashes its key once and reorders nothing. A working set of more than ``size`` signatures
    would be checked again under either order.)"""

    def __init__(self, size: int):
        self.size = size
        self._entries: dict = {}

    def get(self, key):
        try:
            return self._entries.get(key)
        except TypeError:  # an unhashable option (checked, then refused)
            return None

    def put(self, key, entry) -> None:
        try:
            self._entries[key] = entry
        except TypeError:
            return
        while len(self._entries) > self.size:
            try:
                del self._entries[next(iter(self._entries))]
            except (KeyError, StopIteration, RuntimeError):  # changed by another thread meanwhile
                break

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_NOT_PLANNED = object()
_planners: dict = {}  # array type -> its backend, when that plans launches, else None


def _planner(q):
    """The backend of q's array type when it plans launches (plan_forward, call_context), else None."""
    kind = type(q)
    planner = _planners.get(kind, _NOT_PLANNED)
    if planner is _NOT_PLANNED:
        library = _validate._library(q)  # (the module is asked what it can do; the checks choose the backend)
        module = importlib.import_module(_BACKEND_MODULES[library]) if library in _BACKEND_MODULES else None
        planner = _planners[kind] = module if hasattr(module, "plan_forward") else None
    return planner


def _array_key(a, kind):
    """What the checks read of an array: None, or its type, shape, strides, dtype and device (of ``kind`` only)."""
    if a is None:
        return None
    if type(a) is not kind:
        raise _Unkeyed
    return a.shape, a.strides, a.dtype, a.data.device_id


def _arrays_key(arrays: tuple, kind) -> tuple:
    """:func:`_array_key` of each of ``arrays`` (in one Python call: a front-door call keys up to ten)."""
    keys = []
    for a in arrays:
        if a is None:
            keys.append(None)
        elif type(a) is kind:
            keys.append((a.shape, a.strides, a.dtype, a.data.device_id))
        else:
            raise _Unkeyed
    return tuple(keys)


def _dict_key(arrays, kind):
    if type(arrays) is not dict:
        raise _Unkeyed
    return tuple((type(name), name, _array_key(a, kind)) for name, a in arrays.items())


def _mods_key(mask_mod, mod_arrays, kind):
    """``mask_mod`` (a string, or a BlockMask: the object, its expression and its arrays) and ``mod_arrays``."""
    if type(mask_mod) is _mods.BlockMask:
        if mod_arrays is not None and type(mod_arrays) is dict and not mask_mod.mod_arrays.keys().isdisjoint(mod_arrays):
            raise _Unkeyed  # (a name in both: the checks compare the arrays themselves)
        mask = (id(mask_mod), type(mask_mod.mask_mod), mask_mod.mask_mod, _dict_key(mask_mod.mod_arrays, kind))
    else:
        mask = (type(mask_mod), mask_mod)
    return mask, None if mod_arrays is None else _dict_key(mod_arrays, kind)


def _call_key(planner, arrays: tuple, options: tuple, mask_mod, mod_arrays, window_size):
    """The memory's key of a call: the backend's ``call_context()`` first (the device, the stream's pointer that a
    plan's run takes, ...), ``arrays`` (q first, None where not given), the options (with their types), mask_mod,
    mod_arrays and window_size (a tuple of two ints); None where the call is not remembered."""
    kind = type(arrays[0])
    if type(window_size) is not tuple:
        return None
    try:
        return (planner.call_context(), _arrays_key(arrays, kind), options,
                tuple(map(type, options)), tuple(map(type, window_size)),
                None if mask_mod is None and mod_arrays is None else _mods_key(mask_mod, mod_arrays, kind))
    except _Unkeyed:
        return None
    except Exception:  # an array without a device address, no usable CuPy: the checks (or the backend) will say
        return None


class _Checked(NamedTuple):
    """What the checks of a call concluded, for the calls with its key."""

    plan: Any                    # the backend's plan of the call
    plain: bool                  # no array but q, k, v (and the backward's): nothing to re-check or pass
    problem_qkv: _validate.Problem  # check_qkv's (a packed batch's cu_seqlens are checked against it at each call)
    problem: _validate.Problem
    mod_names: tuple             # the arrays the mods read, in their slot order
    mask: Any                    # a weak reference to the BlockMask given as mask_mod, or None
    xp: ModuleType


def _checked(plan, problem_qkv, problem, variant: Variant, mask_mod, xp) -> _Checked:
    names = variant.mods.array_names if variant.mods is not None else ()
    mask = weakref.ref(mask_mod) if isinstance(mask_mod, _mods.BlockMask) else None
    plain = variant.arrays.empty
    return _Checked(plan, plain, problem_qkv, problem, names, mask, xp)


def _rechecked_arrays(call: _Checked, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, alibi_slopes,
                      mask_mod, mod_arrays) -> VariantArrays | None:
    """A remembered call's variant arrays for its plan, after the checks that read their values (as at every
    call); None when its BlockMask is not the remembered one (another object at the same address)."""
    block_lists = None
    if call.mask is not None:
        if call.mask() is not mask_mod:
            return None
        block_lists = mask_mod.lists
        mod_arrays = {**mask_mod.mod_arrays, **(mod_arrays or {})}
    if call.problem.is_varlen:
        _validate.check_cu_seqlens(call.problem_qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if seqused_k is not None:
        _validate.seqused_k(seqused_k, call.problem, cu_seqlens_k)
    if alibi_slopes is not None:
        alibi_slopes = _validate.alibi_slopes(alibi_slopes, call.problem, call.xp)  # (its (batch, heads_q) view)
    mods = tuple(mod_arrays[name] for name in call.mod_names) if call.mod_names else ()
    return VariantArrays(cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, None, mods, block_lists)


# Checked attention calls (their keys name the operation), and their plans.
_checked_calls = CallMemo(256)
_NO_ARRAYS = VariantArrays()


def _prepare(q, k, v, *, softmax_scale, algorithm, block_q, block_k, variant_options, extra=None, read_values=True,
             fp8=False):
    """Validate everything and normalize: ``(library, problem, options for the backend)``.

    ``read_values=False`` checks cu_seqlens and seqused_k by shape and dtype only (see :mod:`cuflash._ops.validate`).
    """
    arrays = {"q": q, "k": k, "v": v, **(extra or {})}
    arrays.update((name, variant_options[name]) for name in ("bias", *ARRAY_OPTIONS) if variant_options[name] is not None)
    if isinstance(variant_options.get("mod_arrays"), Mapping):
        arrays.update((f"mod_arrays[{name!r}]", a) for name, a in variant_options["mod_arrays"].items())
    if isinstance(variant_options.get("mask_mod"), _mods.BlockMask):
        arrays.update((f"mask_mod.mod_arrays[{name!r}]", a) for name, a in variant_options["mask_mod"].mod_arrays.items())
    library = _validate.check_same_library(**arrays)  # first: None or a list for an array is named here
    packed = [variant_options[name] for name in _PACKED_OPTIONS]
    varlen = _validate.varlen_mode(*packed)
    problem = _validate.check_qkv(q, k, v, varlen=varlen, fp8=fp8)
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


# Libraries whose backend takes positive scales only. The CUDA kernels keep raw scores q . k, take their row
# maximum and convert softcap, ALiBi and the bias into raw-score units with 1 / scale
# (cuflash/_cuda/spec.py:variant_params): a negative scale would make the raw maximum the scaled minimum and a
# masked -inf score +inf, and 0 divides by zero. The front door hands them an equivalent positive scale
# instead (_kernel_scale); the NumPy reference multiplies by the scale first and takes any finite one.
_POSITIVE_SCALE_ONLY = ("cupy",)


def _times(a, factor: int):
    """``factor * a`` for ``factor`` -1 or 0, through the bits (exact, and for bfloat16 CuPy arrays too): the
    sign bit flipped, or a signed zero (NaN where ``a`` is NaN or infinite, as ``0 * a``)."""
    bits, exponent, sign = _validate.float_bits(a)
    exponent, sign = bits.dtype.type(exponent), bits.dtype.type(sign)
    if factor == -1:
        return (bits ^ sign).view(a.dtype)
    xp = _namespace(a)
    nan = bits.dtype.type(int(exponent) | (int(exponent) & -int(exponent)) >> 1)  # exponent all ones, top mantissa bit
    return xp.where((bits & exponent) == exponent, nan, bits & sign).view(a.dtype)


def _kernel_scale(library: str, q, scale: float):
    """``(q, scale, dq_factor)`` for the backend: unchanged for a positive scale or a backend that takes any
    (NumPy); else an equivalent call with a positive scale and the factor that turns its dq into the caller's.

    ``scale * q . k`` is ``(-scale) * (-q) . k``: a negative scale runs with ``-q`` (a copy) and ``-scale``, and
    dq changes sign (dk, dv, dbias, out and lse are those of the caller's call). Scale 0 runs with ``0 * q`` (zeros,
    NaN where q is not finite) and scale 1: every score is 0 as with scale 0; dq is ``0 * dq`` and dk is 0 already.
    """
    if scale > 0 or library not in _POSITIVE_SCALE_ONLY:
        return q, scale, 1
    if scale < 0:
        return _times(q, -1), -scale, -1
    return _times(q, 0), 1.0, 0


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
    mask_mod: str | _mods.BlockMask | None = None,
    mod_arrays: dict | None = None,
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
    fp32_precision: str = "tf32x3",
    return_lse: bool = False,
    check_finite: bool = False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
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
        Multiplies the scores before the softmax; default ``1 / sqrt(head_dim)`` (q's and k's head dim). Any
        finite real, as PyTorch and flash-attention: 0 gives uniform attention over the keys a row sees, a
        negative scale is allowed (softcap, ALiBi and the bias apply to ``softmax_scale * q . k``). On CuPy
        arrays a scale <= 0 runs as an equivalent positive one (``-q``, or zeros, in a copy of q).
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
    mask_mod : str or cuflash.BlockMask, optional
        A CUDA C expression over ``b``, ``h``, ``q_idx``, ``kv_idx``: query ``q_idx`` sees key ``kv_idx`` where it
        is non-zero (AND-ed with the other masks); tiles it masks entirely are skipped. A
        :class:`cuflash.BlockMask` (an expression and its arrays) keeps the tiles it skips across calls.
    mod_arrays : dict, optional
        Up to four named 1-D int32 or float32 arrays (same library as q) the expressions index, ``name[expr]``
        (a document id per position, a per-head table).
    algorithm : {"fa2", "fa1", "naive"}
        FlashAttention-2 order (query blocks outer), FlashAttention-1 order (key/value blocks outer,
        O, m, l written back each step), or the naive algorithm that materializes the scores.
    block_q, block_k : int, optional
        Tile sizes. Default: from the on-chip memory budget (NumPy) or the tuned tile table (CUDA).
    fp32_precision : {"tf32x3", "fp16x3", "tf32", "ieee"}
        How the CUDA forward (``algorithm="fa2"``) multiplies float32 inputs (Triton's ``tl.dot`` spellings):
        ``"tf32x3"`` (default) on the tensor cores with the 3xTF32 split, float32 accuracy (the float32 error
        budget of the tests); ``"fp16x3"`` each operand split in two float16 parts, three float16 products (on
        sm_90 at head dims 64 and 128: 4-6x faster than ``"tf32x3"``, within 4x naive float32 attention's error;
        elsewhere it runs ``"tf32x3"``); ``"tf32"`` one TF32 product, faster, operands rounded to 10-bit mantissas
        (~1e-3 relative error, like PyTorch's ``allow_tf32``; on sm_90 at head dims 64 and 128 on wgmma, several
        times faster again); ``"ieee"`` plain float32 arithmetic (the SIMT kernel).
        The tensor-core modes need sm_80 or newer and head dims up to 128; elsewhere the SIMT kernel runs (as
        accurate or more). Other dtypes, NumPy arrays, ``algorithm="fa1"``/``"naive"`` and the backward ignore it
        (``docs/performance.md``, "float32").
    return_lse : bool
        Also return the logsumexp of the scaled (and modified) scores, needed by :func:`attention_backward`.
    q_descale, k_descale, v_descale : arrays, shape (batch, heads_kv), float32, optional
        FP8 only (q, k and v ``float8_e4m3fn``, ml_dtypes' e4m3, or ``uint8`` arrays of e4m3 bits, as CuPy, which
        has no e4m3 dtype, holds them; FlashAttention-3's names and meaning): the factors
        that turn each (sequence, key/value head)'s stored values into the real ones (real q = q_descale * q);
        None: 1. An FP8 call returns bfloat16. It runs the forward only (no backward), on padded batches, head dims
        128 and 256 on CuPy (sm_90: the FP8 kernel), any on NumPy (the reference, rounding P to e4m3 as the
        kernel does); with causal, windows, softcap and ALiBi, not with bias, masks, dropout, mods or key counts.
        Accuracy: ``docs/variants.md``, "FP8".
    check_finite : bool
        Scan q, k, v, ``alibi_slopes`` and ``bias`` for NaN and infinities (``-inf`` allowed in ``bias``: it
        masks) after the other checks and before any computation, and raise ``ValueError`` naming the array and
        its first bad index. Off by default: inputs are not scanned and a NaN propagates as IEEE arithmetic does
        (``docs/conventions.md``, "NaN and infinities"). Also on when the environment variable
        ``CUFLASH_CHECK_FINITE=1`` is set (at call time: the torch and JAX front ends too). On CuPy arrays it
        costs one device reduction and one host synchronization per array.

    Returns
    -------
    out : array like q, with v's head dim
    lse : array, shape (batch, heads_q, seqlen_q), or (heads_q, total_q) packed; only with ``return_lse=True``
        Natural-log logsumexp, float32 (float64 for float64 inputs); ``-inf`` for a row that sees no key.
    """
    if (q_descale is not None or k_descale is not None or v_descale is not None
            or getattr(getattr(q, "dtype", None), "itemsize", 0) == 1):  # (FP8: e4m3 inputs, its own memory)
        return _attention_fp8(q, k, v, locals())
    planner = _planners.get(type(q), _NOT_PLANNED)
    if planner is _NOT_PLANNED:
        planner = _planner(q)
    key = None
    if planner is not None and bias is None and attn_mask is None:  # (a bias is converted at every call)
        key = _attention_key(planner, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, causal,
                             softmax_scale, causal_align, window_size, softcap, max_seqlen_q, max_seqlen_k, dropout_p,
                             dropout_seed, dropout_offset, score_mod, algorithm, block_q, block_k, fp32_precision,
                             mask_mod, mod_arrays)
        call = _checked_calls.get(key) if key is not None else None
        if call is not None:  # the same signature as a call already checked: its plan, at once
            arrays = _NO_ARRAYS if call.plain else _rechecked_arrays(
                call, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
                mod_arrays=mod_arrays)
            if arrays is not None:
                if check_finite is True or _validate.finite_checks(check_finite):
                    _validate.check_finite({"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes})
                result = call.plan.run(q, k, v, arrays, key[0][1], return_lse)
                if result is not None:  # (None: an input's address needs an aligned copy; the call below makes it)
                    return result if return_lse else result[0]
    variant_options = _variant_options(locals())
    library, problem, options = _prepare(
        q, k, v, softmax_scale=softmax_scale, algorithm=algorithm, block_q=block_q, block_k=block_k,
        variant_options=variant_options,
    )
    options["fp32_precision"] = _validate.fp32_precision(fp32_precision)
    if _validate.finite_checks(check_finite):
        _validate.check_finite({"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "bias": bias},
                               allow_neginf=("bias",))
    if problem.is_empty:
        out, lse = _empty_forward(q, problem)
    else:
        backend = _backend(library)
        _check_supported(backend, problem, options["algorithm"], options["variant"])
        kernel_q, options["scale"], _ = _kernel_scale(library, q, options["scale"])
        plan = None
        if key is not None and kernel_q is q:  # (a call whose q is mapped to a positive scale is not remembered)
            plan = planner.plan_forward(q, k, v, **options)
        if plan is not None:
            out, lse = plan.run(q, k, v, options["variant"].arrays, key[0][1], return_lse)
            _checked_calls.put(key, _checked(plan, _validate.check_qkv(q, k, v, varlen=problem.is_varlen), problem,
                                             options["variant"], mask_mod, _namespace(q)))
        else:
            out, lse = backend.forward(kernel_q, k, v, **options)
    return (out, lse) if return_lse else out


# What an FP8 call of attention() may not use: keyword -> its default.
_FP8_UNSUPPORTED = {"cu_seqlens_q": None, "cu_seqlens_k": None, "seqused_k": None, "bias": None, "attn_mask": None,
                    "dropout_p": 0.0, "score_mod": None, "mask_mod": None, "mod_arrays": None, "block_q": None,
                    "block_k": None}


class _CheckedFp8(NamedTuple):
    """What the checks of an FP8 call concluded (:data:`_fp8_calls`)."""

    plan: Any                    # the V^T entry point's plan (cuflash._cuda.vt.VtForwardPlan)
    problem: _validate.Problem
    descale_shape: tuple         # (batch, heads_kv)
    xp: ModuleType


# Checked FP8 calls: the key of attention()'s remembered calls over q, k, v, alibi_slopes and the three descale arrays
# and the options below (every other option the checks read), for calls whose options FP8 refuses are all at their
# defaults.
_FP8_KEYED = ("causal", "softmax_scale", "causal_align", "window_size", "softcap", "max_seqlen_q", "max_seqlen_k",
              "dropout_seed", "dropout_offset", "algorithm", "fp32_precision")
_FP8_DESCALES = ("q_descale", "k_descale", "v_descale")
_fp8_calls = CallMemo(64)


def _fp8_key(q, k, v, arguments: dict):
    """The key of an FP8 call in :data:`_fp8_calls`, or None (NumPy, an option FP8 refuses not at its default)."""
    planner = _planner(q)
    if planner is None or any(arguments[name] is not default and not (
            type(arguments[name]) is type(default) and arguments[name] == default)
            for name, default in _FP8_UNSUPPORTED.items()):
        return None
    return _call_key(planner, (q, k, v, arguments["alibi_slopes"], *(arguments[name] for name in _FP8_DESCALES)),
                     ("attention_fp8", *(arguments[name] for name in _FP8_KEYED)),
                     None, None, arguments["window_size"])


def _check_fp8_finite(q, k, v, arguments: dict) -> None:
    """check_finite's scan of an FP8 call's arrays (q, k, v, alibi_slopes and the descale factors), when asked."""
    if _validate.finite_checks(arguments["check_finite"]):
        _validate.check_finite({"q": q, "k": k, "v": v, "alibi_slopes": arguments["alibi_slopes"],
                                **{name: arguments[name] for name in _FP8_DESCALES}})


def _run_fp8(call: _CheckedFp8, q, k, v, arguments: dict, stream: int):
    """A remembered FP8 call: its value checks (alibi_slopes, check_finite), the stacked descale factors and its
    plan's run; None where an input's address needs an aligned copy (the checked call makes it)."""
    _check_fp8_finite(q, k, v, arguments)
    alibi = arguments["alibi_slopes"]
    arrays = _NO_ARRAYS
    if alibi is not None:
        arrays = VariantArrays(alibi_slopes=_validate.alibi_slopes(alibi, call.problem, call.xp))
    from .._cuda import vt

    stacked = vt.stacked_descale([arguments[name] for name in _FP8_DESCALES], call.descale_shape, stream)
    return call.plan.run(q, k, v, arrays, stream, arguments["return_lse"], descale=stacked)


def _attention_fp8(q, k, v, arguments: dict):
    """attention() on e4m3 q, k, v (``arguments``: the call's locals): checked, then the FP8 kernel (CuPy) or the
    reference (NumPy); ``out`` bfloat16. A CuPy call like one already checked (:func:`_fp8_key`) runs its plan at
    once."""
    key = _fp8_key(q, k, v, arguments)
    call = _fp8_calls.get(key) if key is not None else None
    if call is not None:
        result = _run_fp8(call, q, k, v, arguments, key[0][1])
        if result is not None:
            return result if arguments["return_lse"] else result[0]
    _validate.check_same_library(q=q, k=k, v=v)  # (before the arrays' dtypes are read: None or a list is named here)
    for name in ("q", "k", "v"):
        dtype = np.dtype(arguments[name].dtype).name
        if dtype not in _validate.FP8_DTYPES:
            raise TypeError(f"{name} must be float8_e4m3fn (ml_dtypes' e4m3) or uint8 (e4m3 bits: CuPy has no e4m3 "
                            f"dtype) for FP8 attention (1-byte inputs, or q_descale / k_descale / v_descale given), as "
                            f"q, k and v together; got {name} {dtype}")
    for name, default in _FP8_UNSUPPORTED.items():
        value = arguments[name]
        if value is not default and (value is None or _validate._is_array(value) or value != default):
            given = type(value).__name__ if _validate._is_array(value) else repr(value)
            raise NotImplementedError(f"FP8 attention (float8_e4m3fn inputs) does not take {name}; got {given}")
    if arguments["algorithm"] != "fa2":
        raise NotImplementedError(f"FP8 attention runs algorithm='fa2' only; got algorithm={arguments['algorithm']!r}")
    library, problem, options = _prepare(
        q, k, v, softmax_scale=arguments["softmax_scale"], algorithm="fa2", block_q=None, block_k=None,
        variant_options=_variant_options(arguments), fp8=True)
    if problem.head_dim_v != problem.head_dim:
        raise NotImplementedError(f"FP8 attention needs v's head_dim equal to q's; got q {problem.head_dim}, "
                                  f"v {problem.head_dim_v}")
    if not options["scale"] > 0:
        raise ValueError(f"FP8 attention takes a positive softmax_scale; got {options['scale']}")
    xp = _namespace(q)
    shape = (problem.batch, problem.heads_kv)
    descales = [arguments[name] for name in _FP8_DESCALES]
    for name, a in zip(_FP8_DESCALES, descales):
        if a is None:
            continue
        _validate.check_same_library(q=q, **{name: a})
        if tuple(a.shape) != shape or np.dtype(a.dtype) != np.float32:
            raise ValueError(f"{name} must be a float32 array of shape (batch, heads_kv) = {shape}; got "
                             f"{np.dtype(a.dtype).name} of shape {tuple(a.shape)}")
    _check_fp8_finite(q, k, v, arguments)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    if problem.is_empty:
        out = xp.zeros(problem.out_shape, dtype=bf16)
        lse = xp.full(problem.lse_shape, -np.inf, dtype=np.float32)
    elif library == "numpy":
        from .. import reference

        out, lse = reference.fa2_forward_fp8(q, k, v, scale=options["scale"], variant=options["variant"],
                                             descales=descales)
    else:
        from .._cuda import vt

        if problem.head_dim not in vt.FP8_HEAD_DIMS:
            raise NotImplementedError(f"FP8 attention on the GPU runs head dims {vt.FP8_HEAD_DIMS}; got "
                                      f"{problem.head_dim}")
        stacked = vt.stacked_descale(descales, shape)
        plan = vt.plan_fp8(q, k, v, scale=options["scale"], variant=options["variant"]) if key is not None else None
        result = None if plan is None else plan.run(q, k, v, options["variant"].arrays, key[0][1], descale=stacked)
        if result is not None:
            out, lse = result
            _fp8_calls.put(key, _CheckedFp8(plan, problem, shape, xp))
        else:
            out, lse = vt.forward_fp8(q, k, v, scale=options["scale"], variant=options["variant"], descale=stacked)
    return (out, lse) if arguments["return_lse"] else out


def _attention_key(planner, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, causal, softmax_scale,
                   causal_align, window_size, softcap, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed,
                   dropout_offset, score_mod, algorithm, block_q, block_k, fp32_precision, mask_mod, mod_arrays):
    """The key of an :func:`attention` call without bias or attn_mask in :data:`_checked_calls`, or None."""
    return _call_key(planner, (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k), (
        "attention", causal, softmax_scale, causal_align, window_size, softcap, max_seqlen_q, max_seqlen_k,
        dropout_p, dropout_seed, dropout_offset, score_mod, algorithm, block_q, block_k, fp32_precision,
    ), mask_mod, mod_arrays, window_size)


def attention_plan(q, k, v, *, causal=False, softmax_scale=None, causal_align="bottom-right", window_size=(-1, -1),
                   softcap=0.0, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, dropout_seed=None,
                   dropout_offset=0, score_mod=None, algorithm="fa2", block_q=None, block_k=None,
                   fp32_precision="tf32x3", **arrays):
    """The plan this memory holds for an :func:`attention` call on arrays of a planning backend (CuPy) with no array
    but q, k and v (``arrays``: the other array keywords, all None), one the front door has run in the same device
    and stream context; None otherwise. ``cuflash.torch`` keeps it under its own key of the tensors, to run such calls
    without crossing into CuPy."""
    planner = _planners.get(type(q))
    if planner is None or any(a is not None for a in arrays.values()):
        return None
    key = _attention_key(planner, q, k, v, None, None, None, None, causal, softmax_scale, causal_align, window_size,
                         softcap, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed, dropout_offset, score_mod,
                         algorithm, block_q, block_k, fp32_precision, None, None)
    call = _checked_calls.get(key) if key is not None else None
    return call.plan if call is not None and call.plain else None


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
    mask_mod: str | _mods.BlockMask | None = None,
    mod_arrays: dict | None = None,
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
    order: str | None = None,
    deterministic: bool = False,
    return_dbias: bool | None = None,
    check_finite: bool = False,
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
    check_finite : bool
        As in :func:`attention`, over do, q, k, v, out, lse (``-inf`` allowed: a row that sees no key),
        ``alibi_slopes`` and ``bias``; also on with ``CUFLASH_CHECK_FINITE=1``.

    Returns
    -------
    dq, dk, dv : arrays like q, k, v
        Keys that no query sees (past ``seqused_k``, say) get zero ``dk`` and ``dv``.
    dbias : array like bias, only with ``bias`` (and ``return_dbias`` not False)
        The gradient of the scaled, modified score (after softcap and ALiBi) at each query and key, zero
        where masked, summed over the axes ``bias`` broadcasts over. ``attn_mask`` gets no gradient.
    """
    planner = _planners.get(type(q), _NOT_PLANNED)
    if planner is _NOT_PLANNED:
        planner = _planner(q)
    key = None
    if planner is not None and bias is None and attn_mask is None:  # (a bias is converted at every call)
        key = _call_key(planner, (q, do, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k), (
            "attention_backward", causal, softmax_scale, causal_align, window_size, softcap, max_seqlen_q,
            max_seqlen_k, dropout_p, dropout_seed, dropout_offset, score_mod, algorithm, block_q, block_k, order,
            deterministic, return_dbias,
        ), mask_mod, mod_arrays, window_size)
        call = _checked_calls.get(key) if key is not None else None
        if call is not None:  # the same signature as a call already checked: its plan, at once
            arrays = _NO_ARRAYS if call.plain else _rechecked_arrays(
                call, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
                mod_arrays=mod_arrays)
            if arrays is not None:
                if check_finite is True or _validate.finite_checks(check_finite):
                    _validate.check_finite({"do": do, "q": q, "k": k, "v": v, "out": out, "lse": lse,
                                            "alibi_slopes": alibi_slopes}, allow_neginf=("lse",))
                grads = call.plan.run(do, q, k, v, out, lse, arrays, key[0][1])
                if grads is not None:  # (None: an input's address needs an aligned copy; the call below makes it)
                    return grads
    variant_options = _variant_options(locals())
    library, problem, options = _prepare(
        q, k, v, softmax_scale=softmax_scale, algorithm=algorithm, block_q=block_q, block_k=block_k,
        variant_options=variant_options, extra={"do": do, "out": out, "lse": lse},
    )
    _validate.check_backward_tensors(problem, do, out, lse)
    options["order"] = _validate.backward_order(order, deterministic)
    want_dbias = _validate.return_dbias(return_dbias, bias)
    if _validate.finite_checks(check_finite):
        _validate.check_finite({"do": do, "q": q, "k": k, "v": v, "out": out, "lse": lse,
                                "alibi_slopes": alibi_slopes, "bias": bias}, allow_neginf=("lse", "bias"))
    if problem.is_empty:
        grads = _empty_backward(q, k, v)
        return (*grads, _namespace(q).zeros(bias.shape, bias.dtype)) if want_dbias else grads
    backend = _backend(library)
    _check_supported(backend, problem, options["algorithm"], options["variant"])
    kernel_q, options["scale"], dq_factor = _kernel_scale(library, q, options["scale"])
    plan = None
    if key is not None and kernel_q is q and not want_dbias:
        plan = planner.plan_backward(do, q, k, v, out, lse, **options)
    if plan is not None:
        _checked_calls.put(key, _checked(plan, _validate.check_qkv(q, k, v, varlen=problem.is_varlen), problem,
                                         options["variant"], mask_mod, _namespace(q)))
        grads = plan.run(do, q, k, v, out, lse, options["variant"].arrays, key[0][1])
        if grads is not None:  # (None: an input's address needs an aligned copy, made below)
            return grads
    q = kernel_q
    if not want_dbias:  # the keyword only when asked: the backend interface without a bias is unchanged
        dq, dk, dv = backend.backward(do, q, k, v, out, lse, **options)
        return (dq if dq_factor == 1 else _times(dq, dq_factor)), dk, dv
    dq, dk, dv, dbias = backend.backward(do, q, k, v, out, lse, **options, want_dbias=True)
    return (dq if dq_factor == 1 else _times(dq, dq_factor)), dk, dv, _reduce_dbias(dbias, bias)


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
    dbias = dbias.reshape(bias.shape)
    if dbias.dtype == bias.dtype:  # (the CUDA backend writes a bias's own dtype where nothing is summed)
        return dbias
    if isinstance(dbias, np.ndarray):
        return dbias.astype(bias.dtype)
    return _cascade._from_acc(dbias, bias.dtype, _namespace(dbias))  # (to bfloat16 through the bits on CuPy)


def _empty_backward(q, k, v):
    xp = _namespace(q)
    return (xp.zeros(q.shape, dtype=q.dtype), xp.zeros(k.shape, dtype=k.dtype), xp.zeros(v.shape, dtype=v.dtype))


# ---------------------------------------------------------------------------------------------------
# Decoding with a KV cache, and merging partial attentions
# ---------------------------------------------------------------------------------------------------

# The backends of attention_with_kvcache: a module with forward_kvcache (docs/architecture.md), and, for
# plan_kvcache, plan_kvcache (the CUDA backend; the NumPy reference runs each step through the front door).
_DECODE_BACKEND_MODULES = {"numpy": "cuflash.reference.decode", "cupy": "cuflash._cuda"}
_decode_backends: dict = {}  # module name -> module, imported once (a decode step's host time is counted in us)


def _decode_backend(library: str) -> ModuleType:
    name = _DECODE_BACKEND_MODULES[library]
    backend = _decode_backends.get(name)
    if backend is None:
        backend = _decode_backends[name] = importlib.import_module(name)
    return backend


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
    out=None,
):
    """Attention of new queries over a KV cache, appending new keys and values to it in place first (decoding).

    flash-attention's ``flash_attn_with_kvcache``, with the same arguments and meaning, and any page size. For
    batch entry ``b``, the cache holds the sequence's keys in slots ``cache_leftpad[b] .. cache_seqlens[b] - 1``.
    When ``k`` and ``v`` are given, their ``seqlen_new`` tokens are rotated (``rotary_cos``, ``rotary_sin``) and
    written **in place** into ``k_cache`` and ``v_cache`` at slots ``cache_seqlens[b] .. cache_seqlens[b] +
    seqlen_new - 1``; nothing else of the caches changes. Then q attends over slots ``cache_leftpad[b] ..
    cache_seqlens[b] + seqlen_new - 1``, ``len_k = cache_seqlens[b] + seqlen_new - cache_leftpad[b]`` keys, with
    causal masking, windows and ALiBi measured from the bottom-right diagonal (query token ``i`` of ``seqlen_q``
    faces key ``i + len_k - seqlen_q``). ``cache_seqlens`` is not updated: the caller adds ``seqlen_new``.
    The math and the split-KV algorithm: ``docs/decoding.md``.

    Index values (``cache_seqlens``, ``cache_leftpad``, ``cache_batch_idx``, ``block_table``) are checked before
    anything is written: always for NumPy arrays (a bad one raises ``ValueError``); for CuPy arrays only in the
    debug mode ``CUFLASH_CHECK_DEVICE_VALUES=1`` (reading device values costs a synchronization per step).
    Without it the CUDA kernels check them as they read them and never access memory out of bounds: a sequence
    whose length leaves no room for the new tokens, is negative, or is below its ``cache_leftpad``, or whose
    ``cache_batch_idx`` names no cache row, appends nothing and gets NaN in every output row and ``lse`` row; a
    ``block_table`` entry that names no page is neither written nor read, and the rows that would read it are NaN
    (``docs/limits.md``). The other sequences are computed as usual.

    On CuPy arrays the launches of a call are planned at the first call with its layouts and options, and a
    repeated call runs them without checking again; :func:`plan_kvcache` makes such a plan explicitly.

    Parameters
    ----------
    q : array, shape (batch, seqlen_q, heads_q, head_dim)
        NumPy (the NumPy reference runs it) or CuPy (the CUDA decode kernels: float16 and bfloat16, head dims 32,
        64, 96, 128 and 256 with ``head_dim_v == head_dim``, and MLA's 576 / 512 with ``v_cache = k_cache[...,
        :512]``; anything else raises ``NotImplementedError`` before the caches are touched). float16, bfloat16, float32 or float64 on NumPy. ``seqlen_q`` from 1 (a decode step)
        to many (speculative decoding, chunked prefill).
    k_cache, v_cache : arrays
        ``(batch_cache, seqlen_cache, heads_kv, head_dim)`` (contiguous cache: row ``cache_batch_idx[b]``, or
        ``b``), or with ``block_table`` ``(num_blocks, page_size, heads_kv, head_dim)`` (paged cache, any
        ``page_size >= 1``). q's dtype; ``heads_kv`` divides ``heads_q`` (GQA, MQA). v_cache's head dim may
        differ from q's: for MLA pass ``v_cache = k_cache[..., :head_dim_v]`` (a view: one cache).
        Any strides with a contiguous last axis; they are written through in place.
    k, v : arrays, optional
        ``(batch, seqlen_new, heads_kv, head_dim)`` and ``(..., head_dim_v)``: new tokens to append (both or
        neither). Where v_cache is a view into k_cache, v is written first and k last.
    cache_seqlens : int or array
        int32 ``(batch,)`` (or one int for all): the end of each sequence's cached keys, before the append.
    rotary_cos, rotary_sin : arrays, optional
        ``(seqlen_ro, rotary_dim / 2)``, floating: rotate the first ``rotary_dim`` dims of every head of q and of
        the new k (requires k), new key ``i`` at position ``cache_seqlens[b] + i``, query token ``i`` at
        ``cache_seqlens[b] + i`` when ``causal`` or a window is set, else every query token at
        ``cache_seqlens[b]`` (as flash-attention). The cache stores the rotated keys.
    rotary_interleaved : bool
        True (flash-attention's default): rotate pairs ``(x[2i], x[2i+1])`` (GPT-J); False: pairs
        ``(x[i], x[i + rotary_dim/2])`` (GPT-NeoX).
    cache_batch_idx : array, optional
        int32 ``(batch,)``: the cache row of each batch entry (contiguous caches). Rows must be distinct when k
        and v are appended.
    cache_leftpad : array, optional
        int32 ``(batch,)``: the first used slot of each sequence (left padding), default 0.
    block_table : array, optional
        int32 ``(batch, max_pages)``: page ``block_table[b, p // page_size]`` holds slot ``p`` of sequence ``b``.
        Pages may be shared between sequences (a common prefix) where they are read; entries past a sequence's
        last used page are never read (any value).
    causal, window_size, softcap, alibi_slopes, softmax_scale :
        As in :func:`attention`, with bottom-right alignment (``causal=False`` by default, as flash-attention).
    return_lse : bool
        Also return ``lse`` ``(batch, heads_q, seqlen_q)`` (float32; float64 for float64), ``-inf`` for rows that
        see no key: partial results merge with :func:`merge_states`.
    num_splits : int
        Split each sequence's keys into this many parts, computed independently and merged (flash-decoding); 0
        chooses from the shapes (``cuflash._ops.blocks.decode_num_splits``: more parts when ``batch x heads_kv``
        cannot fill the GPU). The result does not depend on it beyond rounding.
    out : array, optional
        ``(batch, seqlen_q, heads_q, head_dim_v)`` in q's dtype: written in place and returned.

    Returns
    -------
    out : array (batch, seqlen_q, heads_q, head_dim_v), like q
    lse : only with ``return_lse=True``
    """
    grows = _grows(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table)
    key = _kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved,
                       cache_batch_idx, cache_leftpad, block_table, causal, window_size, softcap, alibi_slopes,
                       softmax_scale, num_splits, out, grows=grows)
    launch = _kvcache_launches.get(key) if key is not None else None
    if launch is not None and not _fits(k_cache, v_cache, k, block_table, cache_seqlens, grows):
        launch = key = None  # (the checks below say what is wrong with this call's caches or lengths)
    if launch is not None:  # the same layouts and options as a call already checked: its launch, at once
        if type(cache_seqlens) is int:
            cache_seqlens = _kvcache.uniform_seqlens(_namespace(q), q.shape[0], cache_seqlens)
        # (without return_lse, the launch's own lse array: nothing allocated for what nobody reads)
        result, lse = launch.run(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                                 alibi_slopes, rotary_cos, rotary_sin, out, None if return_lse else launch.lse_sink)
        return (result, lse) if return_lse else result
    library, problem, cache, scale, variant = _kvcache_call(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        softmax_scale=softmax_scale, num_splits=num_splits, out=out)
    backend = _decode_backend(library)
    forward_kvcache = getattr(backend, "forward_kvcache", None)
    if forward_kvcache is None:
        raise NotImplementedError(f"attention_with_kvcache has no decode backend for {library} arrays")
    kernel_q, scale, _ = _kernel_scale(library, q, scale)
    if key is not None and kernel_q is q:  # (a call whose q is mapped to a positive scale is not remembered)
        if grows:  # a launch of its own, which follows the caches' slot count from call to call
            launch = backend.plan_kvcache(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out,
                                          splits_for=functools.partial(_decode_splits, problem, num_splits))
            _kvcache_launches.put(key, launch)
            result, lse = launch.run(q, k_cache, v_cache, k, v, cache.cache_seqlens, cache.cache_leftpad,
                                     cache.cache_batch_idx, cache.block_table, variant.alibi_slopes, None, None, out,
                                     None)
            return (result, lse) if return_lse else result
        _kvcache_launches.put(key, backend.plan_kvcache(q, k_cache, v_cache, k, v, cache=cache, scale=scale,
                                                        variant=variant, out=out, shared=True))
    result, lse = forward_kvcache(kernel_q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out)
    return (result, lse) if return_lse else result


# The front door's memory of CuPy decode calls it has checked: everything the checks read (each array's type, shape,
# strides, dtype and device; the options, with their types; the current device and stream) -> the backend's launch.
# A call with the same key would pass the same checks (CuPy index values are not read outside the debug mode), so
# it runs the launch at once: a decode step's host time is the launch's, not the checks' (~150 us of Python).
#
# A call over a cache that grows (a transformers DynamicCache, which concatenates each new token into a new tensor:
# a new slot count, and new strides for its (batch, heads, slots, d) layout seen as (batch, slots, heads, d), at
# every step) would miss at every step: checks, a new launch, its workspace. Such a call, one that appends nothing
# into a contiguous cache (_grows), is keyed without the caches' slot count and strides but the last; what the
# checks read of those (_fits) is checked at each call, and its launch (a DecodeLaunch with splits_for) writes the
# slot count, the strides and the split count they give into its parameters when they change. An int cache_seqlens
# (a new value at every step of a loop that appends) is keyed without its value, checked at each call (_fits).
_kvcache_launches = CallMemo(64)


def kvcache_launch(q, k_cache, v_cache, *, cache_seqlens, cache_leftpad, alibi_slopes, rotary_interleaved, causal,
                   window_size, softcap, softmax_scale, num_splits):
    """The launch this memory holds for a decode call on CuPy arrays without ``k``, ``v``, rotary, ``cache_batch_idx``,
    pages or ``out`` (one the front door has run, in the same device and stream context), or None. ``cuflash.torch``
    keeps it under its own key of the tensors, to run such calls without crossing into CuPy."""
    grows = _grows(q, k_cache, v_cache, None, None, None, None, None)
    key = _kvcache_key(q, k_cache, v_cache, None, None, cache_seqlens, None, None, rotary_interleaved, None,
                       cache_leftpad, None, causal, window_size, softcap, alibi_slopes, softmax_scale, num_splits, None,
                       grows=grows)
    return None if key is None else _kvcache_launches.get(key)


def _grows(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, block_table) -> bool:
    """Whether a decode call is remembered without its caches' slot count: nothing appended, no rotary, a contiguous
    cache of CuPy-like arrays, one to 63 query tokens (the decode kernels, not the forward over the cache), v's head
    dim q's (not MLA)."""
    kind = type(q)
    return (k is None and v is None and rotary_cos is None and rotary_sin is None and block_table is None
            and type(k_cache) is kind and type(v_cache) is kind and q.ndim == 4 and k_cache.ndim == 4
            and v_cache.ndim == 4 and q.shape[0] > 0 and 0 < q.shape[1] < _chunked_prefill.MIN_SEQLEN_Q
            and q.shape[2] > 0 and k_cache.shape[3] == v_cache.shape[3])


def _slots_key(a, kind):
    """What the key of a growing call (_grows) holds of a cache: its shape but the slot axis, its last stride, dtype
    and device."""
    if type(a) is not kind:
        raise _Unkeyed
    shape = a.shape
    return shape[0], shape[2], shape[3], a.strides[3], a.dtype, a.data.device_id


def _fits(k_cache, v_cache, k, block_table, cache_seqlens, grows: bool) -> bool:
    """Whether a call whose key is remembered passes the checks that read what the key leaves out: for a growing call
    (_grows), a slot count of at least 1, the same in both caches, and strides of multiples of 16 bytes (the decode
    kernels read 16-byte rows); for every call, an int cache_seqlens that leaves room for k's tokens in the slots.
    Otherwise the checks run and say what is wrong."""
    if grows:
        slots = k_cache.shape[1]
        if not (slots > 0 and v_cache.shape[1] == slots):
            return False
        ks, vs = k_cache.strides, v_cache.strides
        if (ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) & 15:
            return False
    if type(cache_seqlens) is not int:
        return True
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    return 0 <= cache_seqlens <= capacity - (0 if k is None else k.shape[1])


def plain_decode_options(causal, rotary_interleaved, num_splits, window_size, softcap, softmax_scale) -> bool:
    """Whether a decode call's options have the types a remembered call may have (others: the checks judge them)."""
    return (type(causal) is bool and type(rotary_interleaved) is bool and type(num_splits) is int
            and type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and type(softcap) in (float, int)
            and (softmax_scale is None or type(softmax_scale) in (float, int)))


def _kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx,
                 cache_leftpad, block_table, causal, window_size, softcap, alibi_slopes, softmax_scale, num_splits, out,
                 grows: bool = False):
    """The key of a CuPy decode call in :data:`_kvcache_launches`, or None: NumPy arrays (their index values are
    checked at every call), options of unusual types (an int for a bool, a list for the window: the checks judge
    them), the debug mode ``CUFLASH_CHECK_DEVICE_VALUES=1``. An int ``cache_seqlens`` is keyed without its value
    (:func:`_fits` checks it at each call), but with rotary (whose table's rows the checks measure against it).
    ``grows`` (:func:`_grows`): the caches keyed without their slot count and strides (:func:`_slots_key`)."""
    kind = type(q)
    if _validate._library(q) != "cupy" or _validate.device_value_checks():
        return None
    if not plain_decode_options(causal, rotary_interleaved, num_splits, window_size, softcap, softmax_scale):
        return None
    try:
        # (one Python call for the arrays of fixed layout; a growing call's caches by their slots key, no rotary)
        caches = (_slots_key(k_cache, kind), _slots_key(v_cache, kind)) if grows else (k_cache, v_cache)
        int_lens = type(cache_seqlens) is int
        arrays = _arrays_key((q, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                              alibi_slopes, out, *(() if int_lens else (cache_seqlens,)), *(() if grows else caches)),
                             kind)
        lens = (("int",) if rotary_cos is None and rotary_sin is None else ("int", cache_seqlens)) if int_lens else None
        extra = (lens, caches if grows else None)
    except _Unkeyed:  # an array of another type: not remembered (the checks will say what is wrong)
        return None
    planner = _planners.get(kind, _NOT_PLANNED)
    if planner is _NOT_PLANNED:
        planner = _planner(q)
    if planner is None:
        return None
    # (the backend's device, stream and, on the per-thread default stream, thread: a launch's workspace per stream)
    return (planner.call_context(), arrays, extra, rotary_interleaved, causal, window_size,
            type(softcap), softcap, type(softmax_scale), softmax_scale, num_splits, grows)


def _kvcache_call(q, k_cache, v_cache, k, v, *, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved,
                  cache_batch_idx, cache_leftpad, block_table, causal, window_size, softcap, alibi_slopes,
                  softmax_scale, num_splits, out, read_values: bool | None = None):
    """Every check of a decode call, and its normalized form: ``(library, problem, cache, scale, variant)`` with the
    split count chosen (:func:`_plan_kvcache`). ``read_values``: whether the index arrays' values are checked (None:
    NumPy's always, CuPy's in the debug mode; False: by shape and dtype only, as for stand-ins of traced arrays)."""
    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache}  # required: None is named by check_same_library
    given.update((name, a) for name, a in (
        ("k", k), ("v", v), ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
        ("block_table", block_table), ("alibi_slopes", alibi_slopes), ("out", out),
    ) if a is not None)
    if hasattr(cache_seqlens, "dtype") and hasattr(cache_seqlens, "shape"):
        given["cache_seqlens"] = cache_seqlens
    library = _validate.check_same_library(**given)
    xp = _namespace(q)
    variant_options = dict(
        causal=causal, causal_align="bottom-right", window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, bias=None, attn_mask=None,
    )
    is_causal, _ = _validate.causal_options(causal, "bottom-right")
    local = _validate.window_size(window_size) != (None, None)
    problem, cache = _validate.kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, num_splits=num_splits, rotary_consecutive_q=is_causal or local, xp=xp,
        read_values=(library == "numpy" or _validate.device_value_checks()) if read_values is None else read_values,
    )
    scale = _validate.softmax_scale(softmax_scale, problem.head_dim)
    variant = _validate.variant(problem, xp, variant_options)
    _validate.kvcache_out(out, problem)
    return library, problem, _plan_kvcache(problem, cache), scale, variant


# (work units, key tiles) -> the automatic split count: the rule tries up to 128 candidates, too slow for every step
_auto_splits: dict = {}


def _plan_kvcache(problem: _validate.Problem, cache):
    """The tiles and the split count of a decode call, from its shapes alone (never from device values), so that
    every backend, and a graph captured for a batch shape, makes the same choice (``docs/decoding.md``)."""
    block_m, block_n = _blocks.decode_block_sizes(problem.head_dim, problem.head_dim_v)
    splits = _decode_splits(problem, cache.num_splits, problem.seqlen_k)
    return dataclasses.replace(cache, num_splits=splits, block_m=block_m, block_n=block_n)


def _decode_splits(problem: _validate.Problem, requested: int, capacity: int) -> int:
    """The split count of a decode call of ``problem``'s batch, heads, query length and head dims over ``capacity``
    slots: ``requested``, or (0) the automatic rule's, remembered per (work units, key tiles)."""
    if requested:
        return requested
    block_m, block_n = _blocks.decode_block_sizes(problem.head_dim, problem.head_dim_v)
    group = problem.heads_q // problem.heads_kv
    m_tiles = _blocks.num_blocks(max(problem.seqlen_q, 1) * group, block_m)
    key = (problem.batch * problem.heads_kv * m_tiles, _blocks.num_blocks(capacity, block_n),
           _blocks.decode_blocks_per_sm(problem.head_dim, problem.head_dim_v))
    splits = _auto_splits.get(key)
    if splits is None:
        splits = _auto_splits[key] = _blocks.decode_num_splits(*key[:2], blocks_per_sm=key[2])
    return splits


def plan_kvcache(
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
    num_splits: int = 0,
    out=None,
) -> DecodePlan:
    """Plan a decode call once for its shapes and options; run it every step with :meth:`DecodePlan.run`.

    Takes the arguments of :func:`attention_with_kvcache` (the first step's, say), checks them as it does, and
    returns a :class:`DecodePlan`. Nothing is computed or appended. Each ``plan.run(q, k_cache, v_cache, k, v, *,
    cache_seqlens, ..., out=None, lse=None)`` then does what ``attention_with_kvcache(..., return_lse=True)``
    would with the same options, on arrays of the planned shapes, strides and dtype (given or not as at planning):
    their values may change from step to step, their layouts may not.

    On CuPy arrays the plan compiles the kernels and allocates the splits' workspace now; a step writes the arrays'
    addresses into the kernels' parameters and launches (append, attention, merge): a few microseconds of host
    time, no allocation given ``out`` and ``lse``, no host synchronization, capturable in a CUDA graph (without
    rotary, whose rotation still runs as CuPy array operations). ``softmax_scale`` must be positive there. On
    NumPy arrays each step runs :func:`attention_with_kvcache` (the reference, with every check).

    Examples
    --------
    >>> plan = cuflash.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table, causal=True)
    >>> for step in range(steps):                                          # doctest: +SKIP
    ...     out, lse = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table, out=out, lse=lse)
    ...     lens += 1
    """
    library, problem, cache, scale, variant = _kvcache_call(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        softmax_scale=softmax_scale, num_splits=num_splits, out=out)
    xp = _namespace(q)
    options = dict(rotary_interleaved=rotary_interleaved, causal=causal, window_size=window_size, softcap=softcap,
                   softmax_scale=softmax_scale, num_splits=num_splits)
    backend = _decode_backend(library)
    checker = launch = None
    if hasattr(backend, "plan_kvcache"):
        if scale <= 0:
            raise NotImplementedError(f"plan_kvcache on {library} arrays takes softmax_scale > 0; got {scale!r} "
                                      f"(attention_with_kvcache runs 0 and negative scales)")
        launch = backend.plan_kvcache(q, k_cache, v_cache, k, v, cache=cache, scale=scale, variant=variant, out=out)
        runner, splits = launch.run, launch.num_splits
        if _validate.device_value_checks():  # the debug mode: every step's index values, read on the host
            def checker(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                        alibi_slopes, rotary_cos, rotary_sin):
                _kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=rotary_cos,
                              rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                              block_table=block_table, alibi_slopes=alibi_slopes, out=None, **options)
    else:
        splits = cache.num_splits

        def runner(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                   alibi_slopes, rotary_cos, rotary_sin, out, lse):
            result, lse_run = attention_with_kvcache(
                q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                alibi_slopes=alibi_slopes, out=out, return_lse=True, **options)
            if lse is None:
                return result, lse_run
            lse[...] = lse_run
            return result, lse
    layouts = _decode_plan.layouts_of(q, k_cache, v_cache, k, v, cache.cache_seqlens, cache_leftpad, cache_batch_idx,
                                      block_table, alibi_slopes, rotary_cos, rotary_sin)
    out_layout = (_decode_plan.layouts_of(out)[0] if out is not None else
                  _decode_plan.contiguous_layout(xp, problem.out_shape, problem.dtype))
    lse_layout = _decode_plan.contiguous_layout(xp, problem.lse_shape, _validate.lse_dtype(problem.dtype))
    return DecodePlan(layouts, runner, out_layout=out_layout, lse_layout=lse_layout, num_splits=splits, xp=xp,
                      checker=checker, launch=launch)


def cascade_attention(
    q,
    k_prefix,
    v_prefix,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    causal: bool = False,
    softcap: float = 0.0,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    num_splits: int = 0,
    prefix_splits: int = 0,
):
    """Decoding over a prefix shared by every sequence of the batch, read once for all of them, then each sequence's
    own keys in its KV cache (shared-prefix, or cascade, attention; ``docs/decoding.md``).

    Sequence ``b``'s keys are the ``prefix_len`` keys of ``k_prefix`` (the same for every sequence: a system
    prompt) followed by its keys in the cache, exactly as :func:`attention_with_kvcache` finds them (``k``, ``v``
    appended in place first; ``cache_seqlens`` not updated). The result equals :func:`attention_with_kvcache` over
    a cache holding the prefix in front of each sequence's keys, but the prefix is read once per key/value head for
    the whole batch, not once per sequence. Every query sees the whole prefix (it comes before every query);
    ``causal`` masks within each sequence's own keys, bottom-right aligned, as :func:`attention_with_kvcache`
    (equal to causal masking over prefix + suffix when the suffix holds at least ``seqlen_q`` keys, which a call
    that appends the query tokens' own keys always does).

    Runs as :func:`attention` of the whole batch's queries (GQA-packed rows) against the prefix, cut into
    ``prefix_splits`` chunks, then :func:`attention_with_kvcache` with ``return_lse=True``, then the exact merge of
    :func:`merge_states`: NumPy and CuPy arrays, with the dtypes and head dims those two calls take on each. On CuPy
    the call is planned at its first run with these layouts and options (``cuflash._cuda.cascade``: a packing
    kernel, one forward launch over the chunks, the decode launch, a merge kernel) and later calls only launch.
    Not supported here: rotary embedding, ALiBi and sliding windows (they measure positions across the prefix
    boundary, differently for each sequence): rotate q and k before the call.

    Parameters
    ----------
    q : array (batch, seqlen_q, heads_q, head_dim)
    k_prefix, v_prefix : arrays (prefix_len, heads_kv, head_dim) and (prefix_len, heads_kv, head_dim_v)
        The shared prefix's keys and values, q's library and dtype, the caches' heads and head dims (FlashInfer's
        ``k_shared`` / ``v_shared``). ``prefix_len`` may be 0.
    k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, causal, softcap,
    softmax_scale, num_splits :
        As in :func:`attention_with_kvcache`, for each sequence's own keys (``num_splits``: its split-KV parts).
    return_lse : bool
        Also return ``lse`` ``(batch, heads_q, seqlen_q)`` over prefix and suffix (float32; float64 for float64).
    prefix_splits : int
        Cut the prefix into this many equal chunks (a divisor of ``prefix_len``), attended as one batched call and
        merged: more thread blocks when the batch's query rows make few tiles. 0 chooses (at least 512 keys a
        chunk, enough blocks to fill 132 SMs).

    Returns
    -------
    out : array (batch, seqlen_q, heads_q, head_dim_v), q's dtype
    lse : array (batch, heads_q, seqlen_q); only with ``return_lse=True``
    """
    key = _cascade_key(q, k_prefix, v_prefix, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                       block_table, causal, softcap, softmax_scale, num_splits, prefix_splits)
    launch = _cascade_launches.get(key) if key is not None else None
    if launch is not None and not _fits(k_cache, v_cache, k, block_table, cache_seqlens, False):
        launch = key = None  # (the checks below say what is wrong with this call's lengths)
    if launch is None:
        prefix_splits = _cascade.check_prefix(q, k_prefix, v_prefix, k_cache, v_cache, prefix_splits)
        if key is not None:  # (remembered either way: a call the plan does not take is not checked twice each time)
            launch = _plan_cascade(q, k_prefix, v_prefix, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                   block_table=block_table, causal=causal, softcap=softcap,
                                   softmax_scale=softmax_scale, num_splits=num_splits,
                                   prefix_splits=prefix_splits) or _COMPOSED
            _cascade_launches.put(key, launch)
    if launch is not None and launch is not _COMPOSED:  # CuPy: the planned launches (cuflash._cuda.cascade)
        lens = (_kvcache.uniform_seqlens(_namespace(q), q.shape[0], cache_seqlens) if type(cache_seqlens) is int
                else cache_seqlens)
        result = launch.run(q, k_prefix, v_prefix, k_cache, v_cache, k, v, lens, cache_leftpad, cache_batch_idx,
                            block_table)
        if result is not None:  # (None: a prefix off a multiple of 16 bytes; the composition runs it)
            return result if return_lse else result[0]

    def suffix():
        return attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, block_table=block_table, causal=causal, softcap=softcap,
            softmax_scale=softmax_scale, return_lse=True, num_splits=num_splits)

    out, lse = _cascade.cascade(q, k_prefix, v_prefix, suffix, prefix_splits=prefix_splits, softcap=softcap,
                                softmax_scale=softmax_scale, attention=attention, xp=_namespace(q))
    return (out, lse) if return_lse else out


# The front door's memory of CuPy cascade calls it has checked and planned (as _kvcache_launches for decode calls):
# the decode call's key with the prefix's arrays and split -> a cuflash._cuda.cascade.CascadeLaunch, or _COMPOSED
# for layouts and options the plan does not take (the composition of public operations runs them).
_cascade_launches = CallMemo(16)
_COMPOSED = object()


def _cascade_key(q, k_prefix, v_prefix, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, causal, softcap, softmax_scale, num_splits, prefix_splits):
    """The key of a CuPy cascade call in :data:`_cascade_launches`, or None (as :func:`_kvcache_key`)."""
    if type(prefix_splits) is not int:
        return None
    suffix = _kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, None, None, True, cache_batch_idx, cache_leftpad,
                          block_table, causal, (-1, -1), softcap, None, softmax_scale, num_splits, None)
    if suffix is None:
        return None
    try:
        prefix = (_array_key(k_prefix, type(q)), _array_key(v_prefix, type(q)))
    except _Unkeyed:
        return None
    return suffix, prefix, prefix_splits


def _plan_cascade(q, k_prefix, v_prefix, k_cache, v_cache, k, v, *, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, causal, softcap, softmax_scale, num_splits, prefix_splits):
    """A checked CuPy cascade call's launches (:class:`cuflash._cuda.cascade.CascadeLaunch`), or None where the
    composition of public operations runs it (:func:`cuflash._cuda.cascade.eligible`, a scale the kernels take)."""
    library, problem, cache, scale, variant = _kvcache_call(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=None, rotary_sin=None,
        rotary_interleaved=True, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        causal=causal, window_size=(-1, -1), softcap=softcap, alibi_slopes=None, softmax_scale=softmax_scale,
        num_splits=num_splits, out=None)
    from .._cuda import cascade as cuda_cascade

    if library != "cupy" or scale <= 0 or not cuda_cascade.eligible(q, k_prefix, v_prefix, k_cache, v_cache):
        return None
    rows = problem.batch * problem.seqlen_q * (problem.heads_q // problem.heads_kv)
    chunks = prefix_splits or _cascade.prefix_chunks(k_prefix.shape[0], rows, problem.heads_kv)
    return cuda_cascade.CascadeLaunch(q, k_prefix, v_prefix, k_cache, v_cache, k, v, cache=cache, scale=scale,
                                      variant=variant, chunks=chunks)


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two partial attentions of the same queries over disjoint key sets into the attention over their union.

    With ``(o_a, lse_a)`` the attention over keys ``K_a`` and ``(o_b, lse_b)`` over ``K_b`` (as
    :func:`attention` and :func:`attention_with_kvcache` return them with ``return_lse=True``):

    ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``

    exactly (up to rounding), row by row and head by head. A row empty in one part (``lse = -inf``) takes the
    other; empty in both, it gets ``o = 0`` and ``lse = -inf`` (no NaN). Used by split-KV decoding, shared-prefix
    (cascade) attention and context parallelism (``docs/decoding.md``). Written with the array module of the inputs:
    NumPy and CuPy arrays.

    Parameters
    ----------
    o_a, o_b : arrays (batch, seqlen_q, heads, head_dim), or packed (total, heads, head_dim)
        Same shape and floating dtype.
    lse_a, lse_b : arrays (batch, heads, seqlen_q), or (heads, total) packed
        float32 or float64, natural-log logsumexp of each part's scores.

    Returns
    -------
    o : array like o_a (its dtype), computed in float32 (float64 when o or lse is float64)
    lse : array like lse_a
    """
    _validate.merge_states(o_a, lse_a, o_b, lse_b)
    xp = _namespace(o_a)
    acc = np.float64 if np.float64 in (np.dtype(o_a.dtype), np.dtype(lse_a.dtype)) else np.float32

    def rows(lse):  # lse in o's row order: (batch, seqlen_q, heads) or (total, heads)
        return lse.transpose(0, 2, 1) if lse.ndim == 3 else lse.T

    o_parts = xp.stack([o_a.astype(acc), o_b.astype(acc)])
    lse_parts = xp.stack([rows(lse_a).astype(acc), rows(lse_b).astype(acc)])
    o, lse = _merge.merge_stacked(o_parts, lse_parts, xp)
    return o.astype(o_a.dtype), xp.ascontiguousarray(rows(lse)).astype(lse_a.dtype, copy=False)
