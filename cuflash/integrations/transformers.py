"""cuflash as an attention implementation of Hugging Face transformers: ``attn_implementation="cufa"``.

Importing this module registers it (:func:`register`, idempotent)::

    import cuflash.integrations.transformers  # registers "cufa"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cufa")

The name has no "flash" in it on purpose: transformers treats every implementation name containing "flash" as a
flash-attention package or Hub kernel to import (``is_flash_attention_requested``), and would try to load one.

Two functions are registered under the name, as transformers' own implementations are:

- :func:`attention_forward` in ``AttentionInterface``: called by each attention layer with q, k, v as
  ``(batch, heads, seqlen, head_dim)`` (k and v with the model's key/value heads: grouped-query attention runs
  without expanding them), the mask built by the mask function, ``scaling``, ``dropout``, ``sliding_window``,
  ``softcap``; it runs :func:`cuflash.torch.attention` (CPU tensors: the NumPy reference; CUDA tensors: the
  kernels) and returns ``(attn_output (batch, seqlen, heads, head_dim), None)``.
- :func:`attention_mask` in ``AttentionMaskInterface``: called by ``create_causal_mask`` and its siblings. For
  the plain patterns (causal, causal sliding window, bidirectional) whose queries are the last keys (no cache,
  or a ``DynamicCache``), it returns no dense mask: ``None`` without padding, else the 2-D boolean padding mask
  ``(batch, kv_length)`` aligned with the keys (True: a token). Every other case (custom ``or``/``and`` mask
  functions, packed sequences, chunked attention, static caches, tracing) gets transformers' dense boolean
  ``(batch, 1, q_length, kv_length)`` mask, which is always right.

What :func:`attention_forward` does with each kind of mask:

- ``None``: one call, causal (bottom-right aligned: a decode step's query faces the last key) from
  ``module.is_causal``, the window from ``sliding_window``.
- 2-D padding mask, left or right padding: the tokens are unpadded to a packed variable-length batch
  (``cu_seqlens_q``, ``cu_seqlens_k``), run in one call, and the output padded back (zeros at padding queries).
  A single query per sequence (decoding) skips the unpadding: the mask goes in as ``attn_mask`` of shape
  ``(batch, 1, 1, kv_length)``, which is the whole mask for one query, and the cache is not copied.

Decode steps (one query per sequence, no dropout, no gradient, not traced, and on CUDA the decode kernels' dtypes
and head dims) run :func:`cuflash.torch.attention_with_kvcache` instead: the decode kernels (GQA rows packed, the
keys split across the GPU) over the whole cache as transformers hands it over, which has appended the new token
itself (a ``DynamicCache`` concatenates, so there is no in-place append to do), with ``cache_seqlens`` the number
of keys and, under left padding, ``cache_leftpad`` each row's first token, which the mask function marks on the
2-D mask (``_cuflash_leftpad``) in the host read it makes anyway. ``DECODE_WITH_KVCACHE = False`` turns this off.
- 4-D mask: ``attn_mask`` (boolean) or ``bias`` (additive, floating), with no causal flag or window (the mask
  holds them), as "sdpa" does.

transformers' conventions mapped onto cuflash's: a causal ``sliding_window`` of ``N`` tokens (the current one
included) is ``window_size=(N - 1, 0)``; a non-causal one ``(N - 1, N - 1)`` (as transformers' flash-attention
integration); ``softcap`` (Gemma 2's ``attn_logit_softcapping``) and ``scaling`` as cuflash's ``softcap`` and
``softmax_scale``; ``dropout`` as ``dropout_p``, its seed drawn from PyTorch's generator. Not supported (raise
``NotImplementedError``): attention sinks (``s_aux``), ``position_bias``, continuous batching's paged cache.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)
from transformers.utils import logging
from transformers.utils.import_utils import is_tracing

from cuflash import torch as cuflash_torch

__all__ = ["NAME", "attention_forward", "attention_mask", "register"]

#: The name to pass as ``attn_implementation=``.
NAME = "cufa"

_logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------------
# The mask function (AttentionMaskInterface)
# ---------------------------------------------------------------------------------------------------

def _closure(fn: Callable) -> dict:
    """The free variables of a closure, by name."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in cells)))


def _plain_pattern(mask_function: Callable) -> str | None:
    """``"causal"``, ``"sliding"`` or ``"bidirectional"`` when ``mask_function`` is one of masking_utils'
    plain patterns, which :func:`attention_forward` rebuilds from ``module.is_causal`` and ``sliding_window``;
    None for anything else (custom overlays, packed sequences, chunks), which gets a dense mask."""
    if mask_function is causal_mask_function:
        return "causal"
    if mask_function is bidirectional_mask_function:
        return "bidirectional"
    # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal_mask_function)
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = _closure(mask_function).get("mask_functions", ())
        if (len(parts) == 2 and parts[1] is causal_mask_function
                and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"):
            return "sliding"
    return None


def _queries_are_last_keys(q_length, kv_length, q_offset, kv_offset) -> bool:
    """Whether the queries are the last ``q_length`` of the keys (no cache, or a DynamicCache; not a static
    cache, whose keys run past the queries and whose offset is a tensor)."""
    if not all(isinstance(n, int) for n in (q_length, kv_length, q_offset, kv_offset)):
        return False
    return q_offset + q_length == kv_offset + kv_length


# The attribute of a 2-D padding mask handed to a decode step whose keys are left-padded only (each row: padding,
# then tokens, no hole): the first token of each row, int32 (batch,), i.e. attention_with_kvcache's cache_leftpad.
_LEFTPAD = "_cuflash_leftpad"


def _padding_summary(padding: torch.Tensor, decode: bool) -> tuple[bool, torch.Tensor | None]:
    """``(every key kept, left padding)`` of a 2-D padding mask: one host read whether padding is there at all (as
    "sdpa"'s mask function makes), a second only where it is, for a decode step (``decode``): the left padding, each
    row's first token, given only when every row is padding then tokens with no hole (left padding, as ``generate``
    makes it), otherwise None."""
    kept = padding if padding.dtype == torch.bool else padding != 0
    all_kept = bool(kept.all())
    if all_kept or not decode:
        return all_kept, None
    first = kept.to(torch.int8).argmax(1)  # the first token (0 for a row of padding only, which fails the test)
    left_only = kept == (torch.arange(kept.shape[1], device=kept.device) >= first[:, None])
    return False, first.to(torch.int32) if bool(left_only.all()) else None


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> torch.Tensor | None:
    """The mask handed to :func:`attention_forward` (registered in transformers' ``AttentionMaskInterface``).

    ``None`` (no padding) or the 2-D boolean padding mask ``(batch_size, kv_length)`` aligned with the keys,
    for a plain causal, causal sliding-window or bidirectional pattern whose queries are the last keys, when
    the caller allows skipping the mask (``allow_is_causal_skip`` / ``allow_is_bidirectional_skip``: a caller
    that needs the mask materialized gets it) and the mask is not being traced. Otherwise transformers' dense
    boolean ``(batch_size, 1, q_length, kv_length)`` mask (``sdpa_mask``), True where a query sees a key.

    For a decode step (one query) over left padding only (padding then tokens in every row, as ``generate``
    pads), the 2-D mask carries each row's first token (the attribute ``_cuflash_leftpad``), which lets
    :func:`attention_forward` run the decode kernels with ``cache_leftpad``; it is found in the same host read
    that looks for padding.
    """
    pattern = _plain_pattern(mask_function)
    may_skip = allow_is_bidirectional_skip if pattern == "bidirectional" else allow_is_causal_skip
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if pattern is not None and may_skip and not use_vmap and not (padding is not None and is_tracing(padding)):
        aligned = _queries_are_last_keys(q_length, kv_length, q_offset, kv_offset)
        all_kept, leftpad = True, None
        if padding is not None:
            padding = padding[:, kv_offset:kv_offset + kv_length]
            all_kept, leftpad = _padding_summary(padding, decode=aligned and q_length == 1)
        if all_kept:
            if aligned or pattern == "bidirectional":  # a bidirectional pattern needs no alignment
                return None
        elif aligned:
            if leftpad is not None:  # a decode step over left padding: attention_forward runs the decode kernels
                setattr(padding, _LEFTPAD, leftpad)
            return padding
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device, **kwargs,
    )


# ---------------------------------------------------------------------------------------------------
# The attention function (AttentionInterface)
# ---------------------------------------------------------------------------------------------------

def _window(sliding_window, causal: bool) -> tuple[int, int]:
    if sliding_window is None:
        return (-1, -1)
    n = int(sliding_window)
    if n < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens; got {sliding_window!r}")
    return (n - 1, 0) if causal else (n - 1, n - 1)


def _varlen_kwargs(kwargs: dict):
    """transformers' ``FlashAttentionKwargs`` (a packed batch prepared by the caller, e.g. by
    ``DataCollatorWithFlattening``), or None."""
    if "cu_seq_lens_q" not in kwargs:  # (the common case, at every layer of every step: one lookup)
        return None
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    values = [kwargs.get(name) for name in names]
    if any(v is None for v in values):
        return None
    cu_q, cu_k, max_q, max_k = values
    return dict(cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32),
                max_seqlen_q=int(max_q), max_seqlen_k=int(max_k))


def _unpadded(q, k, v, key_mask: torch.Tensor, **options) -> torch.Tensor:
    """Attention over the tokens that ``key_mask`` (batch, seqlen_k) keeps, as one packed variable-length
    batch; the queries are the last ``seqlen_q`` keys. Returns ``(batch, seqlen_q, heads_q, head_dim_v)``
    with zeros at padding queries."""
    batch, nq, nk = q.shape[0], q.shape[1], k.shape[1]
    query_mask = key_mask[:, nk - nq:]
    lens_k = key_mask.sum(1, dtype=torch.int32)
    lens_q = lens_k if nq == nk else query_mask.sum(1, dtype=torch.int32)
    zero = lens_k.new_zeros(1)
    cu_k = torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)])
    cu_q = cu_k if nq == nk else torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)])
    rows_k = key_mask.nonzero(as_tuple=True)
    rows_q = rows_k if nq == nk else query_mask.nonzero(as_tuple=True)
    lens = torch.stack([lens_q.max(), lens_k.max()]).tolist()  # one host read for both maxima
    out = cuflash_torch.attention(
        q[rows_q], k[rows_k], v[rows_k], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=lens[0],
        max_seqlen_k=lens[1], **options,
    )
    padded = out.new_zeros((batch, nq, *out.shape[1:]))
    return padded.index_put(rows_q, out)


#: Decode steps run :func:`cuflash.torch.attention_with_kvcache` (the decode kernels on CUDA) where they can; False
#: runs them through :func:`cuflash.torch.attention` like any other call (a switch for comparisons and benchmarks).
DECODE_WITH_KVCACHE = True


_HALF = (torch.float16, torch.bfloat16)
_decode_head_dims: tuple = ()  # cuflash._cuda.spec.DECODE_HEAD_DIMS, read at the first CUDA decode step


def _decode_kernels_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`cuflash.torch.attention_with_kvcache` runs these tensors: CPU tensors always (the NumPy
    reference); CUDA tensors in the decode kernels' dtypes (16-bit) and head dims, with 16-byte rows (strides of
    multiples of 8 elements, addresses of 16 bytes). At every layer of every step: few Python calls."""
    global _decode_head_dims
    if not q.is_cuda:
        return True
    if not _decode_head_dims:
        from cuflash._cuda.spec import DECODE_HEAD_DIMS

        _decode_head_dims = DECODE_HEAD_DIMS
    d = q.shape[-1]
    if q.dtype not in _HALF or v.shape[-1] != d or d not in _decode_head_dims:
        return False
    for t in (q, k, v):
        s = t.stride()
        if s[3] != 1 or (s[0] | s[1] | s[2]) & 7 or t.data_ptr() & 15:
            return False
    return True


def _decodes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict) -> bool:
    """Whether a call runs as a decode step: one query per sequence (the last of the keys: the mask function
    hands over no mask or a 2-D one only then), no dropout, no gradient (the decode operator has none), not while
    torch.compile traces (the traced model keeps the differentiable operators) and tensors the decode kernels
    take."""
    return (DECODE_WITH_KVCACHE and q.shape[1] == 1 and not options["dropout_p"]
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and _decode_kernels_run(q, k, v))


def _decode_step(query, key, value, leftpad, options: dict) -> torch.Tensor:
    """One query per sequence against all the keys transformers' cache handed over (it has appended the new token
    itself: nothing is appended here), the first ``leftpad[b]`` of them padding: the decode kernels, reading the
    cache in place through its transposed view (GQA rows packed, the keys split across the GPU). ``query``, ``key``,
    ``value`` heads first, as transformers holds them; the step's launch is then kept for
    :func:`cuflash.torch.decode_heads_first`, which runs the next steps like it."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    args = (leftpad, options["causal"], options["window_size"], options["softcap"], options["softmax_scale"])
    out = cuflash_torch.attention_with_kvcache(
        q, k, v, cache_seqlens=k.shape[1], cache_leftpad=leftpad, causal=args[1], window_size=args[2],
        softcap=args[3], softmax_scale=args[4])
    cuflash_torch.remember_heads_first(query, key, value, *args)
    return out


# kwargs that keep a call off the direct paths where given (attention_forward judges them in its general path)
_NOT_PLAIN = ("output_attentions", "s_aux", "position_bias", "cache", "cu_seq_lens_q")


def _plain(kwargs: dict) -> bool:
    """Whether none of :data:`_NOT_PLAIN` is given (None or False: not given)."""
    for name in _NOT_PLAIN:
        value = kwargs.get(name)
        if value is not None and value is not False:
            return False
    return True


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over :func:`cuflash.torch.attention`.

    ``query`` is ``(batch, heads_q, seqlen_q, head_dim)``, ``key`` and ``value`` ``(batch, heads_kv, seqlen_k,
    head_dim)`` with ``heads_kv`` dividing ``heads_q``; ``attention_mask`` None, a 2-D padding mask
    ``(batch, seqlen_k)`` (True or 1: a token), or a 4-D boolean or additive mask. Causal from ``is_causal``,
    else ``module.is_causal``. Returns ``(attn_output, None)``, ``attn_output`` of shape ``(batch, seqlen_q,
    heads_q, head_dim_v)``: there are no attention weights to return.
    """
    if not dropout and _plain(kwargs):
        # a call like one already run, heads first, straight to its launch: a decode step (transformers' cache grew by
        # the new token) with no mask or a padding mask of left padding only, or an inference call with no mask
        leftpad = None if attention_mask is None else getattr(attention_mask, _LEFTPAD, None)
        decode = DECODE_WITH_KVCACHE and query.shape[2] == 1
        if attention_mask is None or (decode and leftpad is not None and attention_mask.shape[-1] == key.shape[2]):
            causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
            args = (causal, _window(sliding_window, causal), float(softcap) if softcap else 0.0, scaling)
            out = (cuflash_torch.decode_heads_first(query, key, value, leftpad, *args) if decode else
                   cuflash_torch.forward_heads_first(query, key, value, *args))
            if out is not None:
                return out, None
    if kwargs.get("output_attentions", False):
        _logger.warning_once(f"attn_implementation={NAME!r} does not return attention weights "
                             "(output_attentions=True); use 'eager' for them.")
    for name, what in (("s_aux", "attention sinks (s_aux)"), ("position_bias", "position_bias"),
                       ("cache", "continuous batching's paged cache")):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation={NAME!r} does not support {what} yet")
    # cuflash's layout is (batch, seqlen, heads, head_dim): transposed views, no copies
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    options = dict(softmax_scale=scaling, softcap=float(softcap) if softcap else 0.0, dropout_p=float(dropout))

    varlen = _varlen_kwargs(kwargs)
    if varlen is not None and (attention_mask is None or attention_mask.dim() == 4):
        # a packed batch described by the caller (batch 1, or each row of the batch flattened); transformers also
        # builds a dense mask for it when it finds the packing in position_ids: the boundaries say the same
        batch, nq = q.shape[:2]
        out = cuflash_torch.attention(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                      v.reshape(-1, *v.shape[2:]), causal=causal,
                                      window_size=_window(sliding_window, causal), **varlen, **options)
        return out.view(batch, nq, *out.shape[1:]), None

    if attention_mask is not None and attention_mask.dim() == 4:
        # a dense mask (transformers' for custom patterns, or the caller's own) holds the causal pattern and the
        # window: as "sdpa", no causal flag on top
        mask = attention_mask
        if mask.shape[-1] > k.shape[1]:
            mask = mask[..., :k.shape[1]]
        if mask.shape[-2] != q.shape[1]:
            mask = mask.expand(*mask.shape[:2], q.shape[1], mask.shape[-1])
        if mask.dtype == torch.bool:
            options["attn_mask"] = mask
        elif mask.is_floating_point():
            options["bias"] = mask
        else:
            options["attn_mask"] = mask != 0
        out = cuflash_torch.attention(q, k, v, **options)
        return out, None

    options.update(causal=causal, window_size=_window(sliding_window, causal))
    if attention_mask is None:
        if _decodes(q, k, v, options):
            return _decode_step(query, key, value, None, options), None
        out = cuflash_torch.attention(q, k, v, **options)
        if not options["dropout_p"]:  # (its plan kept for cuflash.torch.forward_heads_first, where it has one)
            cuflash_torch.remember_forward_heads_first(query, key, value, options["causal"], options["window_size"],
                                                       options["softcap"], options["softmax_scale"])
        return out, None

    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be None, a 2-D padding mask (batch, seqlen_k) or a 4-D mask; got "
                         f"shape {tuple(attention_mask.shape)}")
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    if mask.shape[1] > k.shape[1]:  # the keys are the last ones the mask describes (a sliding-window layer's)
        mask = mask[:, -k.shape[1]:]
    elif mask.shape[1] < k.shape[1]:  # keys past the mask (a static cache's unused slots): not attended
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"a 2-D padding mask needs the queries to be the last keys; got {q.shape[1]} queries and "
                         f"{k.shape[1]} keys")
    if q.shape[1] == 1:  # decoding: the mask of one query is the padding mask itself; no copy of the cache
        leftpad = getattr(attention_mask, _LEFTPAD, None)  # left padding only, found by the mask function
        if (leftpad is not None and attention_mask.shape[1] == k.shape[1] and leftpad.device == q.device
                and _decodes(q, k, v, options)):
            return _decode_step(*(t.transpose(1, 2) for t in (q, k, v)), leftpad, options), None
        return cuflash_torch.attention(q, k, v, attn_mask=mask[:, None, None, :], **options), None
    return _unpadded(q, k, v, mask, **options), None


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` and :func:`attention_mask` under ``name`` in transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface`` (class-wide: every model sees them). Idempotent;
    importing this module calls it with the default name. Returns the name, for ``attn_implementation=``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string; got {name!r}")
    if "flash" in name:
        raise ValueError(f"{name!r} contains 'flash': transformers would try to import a flash-attention package or "
                         "Hub kernel for it; choose a name without 'flash'")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


register()
