"""FlashAttention-3's public functions (``hopper/flash_attn_interface.py``), on cuflash: change
``from flash_attn_interface import flash_attn_func`` to ``from cuflash.flash_attn_interface import flash_attn_func``.

``flash_attn_func`` and ``flash_attn_varlen_func`` with FlashAttention-3's argument names, order, defaults and return
conventions (``out``, or ``(out, softmax_lse)`` with ``return_attn_probs=True``), over :func:`cuflash.torch.attention`:
differentiable for 16-bit and float32 inputs, and the FP8 forward for ``torch.float8_e4m3fn`` q, k, v with
``q_descale``, ``k_descale``, ``v_descale`` (float32, ``(batch, nheads_k)``; a bfloat16 output, no backward, as
there). CUDA tensors run the CUDA kernels, CPU tensors the NumPy reference.

Differences, all raising ``NotImplementedError`` before anything runs where an argument asks for what cuflash lacks:
``qv`` (the extra query of MLA's absorbed prefill), ``attention_chunk`` other than 0, ``seqused_q``. The performance
knobs ``num_splits``, ``pack_gqa`` and ``sm_margin`` are accepted and have no effect (cuflash plans its own launches).
docs/flash-attn.md, "FlashAttention-3's interface".
"""

from __future__ import annotations

from cuflash import torch as _ft
from cuflash.flash_attn import _maybe_contiguous, _softcap, _window

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def _refuse(qv, attention_chunk, seqused_q=None) -> None:
    for name, value, default in (("qv", qv, None), ("attention_chunk", attention_chunk, 0),
                                 ("seqused_q", seqused_q, None)):
        if value is not default and (value is None or default is None or value != default):
            raise NotImplementedError(f"cuflash.flash_attn_interface does not take {name} (other than "
                                      f"{default!r}); got {type(value).__name__ if default is None else value!r}")


def _attention(q, k, v, *, softmax_scale, causal, q_descale, k_descale, v_descale, window_size, softcap,
               deterministic, return_attn_probs, **packed):
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    fp8 = {} if q_descale is None and k_descale is None and v_descale is None else dict(
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    out, lse = _ft.attention(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=_window(window_size),
                             softcap=_softcap(softcap), deterministic=deterministic, return_lse=True, **packed, **fp8)
    return (out, lse) if return_attn_probs else out


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """FlashAttention-3's ``flash_attn_func``: q ``(batch, seqlen_q, nheads, headdim)``, k and v ``(batch, seqlen_k,
    nheads_k, headdim)`` (``nheads_k`` divides ``nheads``); causal masks aligned to the bottom-right corner;
    ``window_size`` ``(left, right)``, -1 unlimited; ``softcap`` > 0 caps the scores. FP8: ``torch.float8_e4m3fn``
    q, k, v with the descale factors (float32, ``(batch, nheads_k)``), forward only, bfloat16 out.

    Returns ``out`` ``(batch, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)`` with ``return_attn_probs=True``,
    ``softmax_lse`` ``(batch, nheads, seqlen_q)`` float32 (not differentiable)."""
    _refuse(qv, attention_chunk)
    return _attention(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale, k_descale=k_descale,
                      v_descale=v_descale, window_size=window_size, softcap=softcap, deterministic=deterministic,
                      return_attn_probs=return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """FlashAttention-3's ``flash_attn_varlen_func``: q ``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_k,
    headdim)``, the sequences packed along the first axis by the int32 prefix sums ``cu_seqlens_q`` and
    ``cu_seqlens_k`` ``(batch + 1,)``; ``seqused_k`` int32 ``(batch,)``: keys past it unused. (FP8 runs padded batches
    only: packed FP8 raises ``NotImplementedError``.)

    Returns ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse)``, ``softmax_lse`` ``(nheads,
    total_q)``."""
    _refuse(qv, attention_chunk, seqused_q)
    return _attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                      q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                      softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs)
