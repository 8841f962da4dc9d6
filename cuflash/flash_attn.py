"""flash-attention 2.x's public functions, on cuflash: change ``from flash_attn import flash_attn_func`` to
``from cuflash.flash_attn import flash_attn_func``.

The seven functions of ``flash_attn`` 2.x (``flash_attn_func``, ``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func``, ``flash_attn_varlen_func``, ``flash_attn_varlen_qkvpacked_func``,
``flash_attn_varlen_kvpacked_func``, ``flash_attn_with_kvcache``) with its argument names, order, defaults
and return conventions. They run :func:`cuflash.torch.attention` (the custom operators
``cuflash::attention_fwd`` / ``cuflash::attention_bwd``: differentiable, traced by ``torch.compile`` with no
graph break) and, for ``flash_attn_with_kvcache``, :func:`cuflash.torch.attention_with_kvcache` (the custom
operator ``cuflash::attention_with_kvcache``, which appends to the caches in place). CUDA tensors run the CUDA
kernels, CPU tensors the NumPy reference: nothing to compile at install time.

Differences from flash-attention, all documented in ``docs/flash-attn.md``:

- ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: cuflash does not build ``S_dmask`` (the
  probabilities with the dropout pattern in their sign, "for testing only" in flash-attention, which also
  returns None there when ``dropout_p == 0``). :func:`cuflash.dropout_mask` gives the mask a call applied.
- Dropout draws its seed from PyTorch's default CPU generator (:func:`cuflash.torch.draw_dropout_seed`), not
  from the CUDA generator's Philox state: ``torch.manual_seed`` reproduces a run, but the masks differ from
  flash-attention's; and a call with dropout cannot be captured in a CUDA graph (``NotImplementedError``).
- ``block_table`` (a paged KV cache) in ``flash_attn_varlen_func`` raises ``NotImplementedError``;
  ``flash_attn_with_kvcache`` takes it.
- Inputs in more dtypes (float32 and float64 too) and head dims than flash-attention's CUDA build; the last
  axis of every input must be contiguous, as there (a strided one is copied, as flash-attention does).
"""

from __future__ import annotations

import numbers

import torch

from cuflash import torch as _ft

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


def _maybe_contiguous(x):
    """flash-attention's own rule: a tensor whose last axis is strided is copied (cuflash refuses those)."""
    return x.contiguous() if isinstance(x, torch.Tensor) and x.stride(-1) != 1 else x


def _softcap(softcap):
    """flash-attention turns softcapping off for any ``softcap <= 0``; cuflash wants exactly 0 for none."""
    if isinstance(softcap, numbers.Real) and not isinstance(softcap, bool) and softcap <= 0:
        return 0.0
    return softcap


def _window(window_size):
    return tuple(window_size) if isinstance(window_size, (list, tuple)) else window_size


def _attention(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, **packed):
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    out, lse = _ft.attention(
        q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=_window(window_size),
        softcap=_softcap(softcap), alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True, **packed,
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attention's ``flash_attn_qkvpacked_func``: attention of ``qkv`` of shape
    ``(batch_size, seqlen, 3, nheads, headdim)``.

    Returns ``out`` ``(batch_size, seqlen, nheads, headdim)``, or with ``return_attn_probs=True``
    ``(out, softmax_lse, None)``, ``softmax_lse`` of shape ``(batch_size, nheads, seqlen)`` (float32). The other
    arguments as :func:`flash_attn_func`. The gradient flows to ``qkv``.
    """
    q, k, v = qkv.unbind(2)
    return _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attention's ``flash_attn_kvpacked_func``: ``q`` ``(batch_size, seqlen_q, nheads, headdim)``,
    ``kv`` ``(batch_size, seqlen_k, 2, nheads_k, headdim)`` (``nheads_k`` divides ``nheads``: MQA/GQA).

    Returns as :func:`flash_attn_func`; the gradients flow to ``q`` and ``kv``.
    """
    k, v = kv.unbind(2)
    return _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attention's ``flash_attn_func``.

    Parameters
    ----------
    q : torch.Tensor, (batch_size, seqlen_q, nheads, headdim)
    k, v : torch.Tensor, (batch_size, seqlen_k, nheads_k, headdim)
        ``nheads_k`` divides ``nheads`` (MQA/GQA: query head ``h`` reads key/value head
        ``h // (nheads // nheads_k)``). v's head dim may differ from q's.
    dropout_p : float
        Dropout probability (0.0 in evaluation). The seed comes from PyTorch's default CPU generator.
    softmax_scale : float, optional
        Scale of ``q k^T`` before the softmax; default ``1 / sqrt(headdim)``.
    causal : bool
        Causal mask aligned to the bottom-right corner of the attention matrix (as flash-attention >= 2.1).
    window_size : (int, int)
        ``(left, right)``: query ``i`` sees keys ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q +
        right]``; -1 is unlimited.
    softcap : float
        Anything > 0 softcaps the scores (``softcap * tanh(score / softcap)``); 0 or less: none.
    alibi_slopes : torch.Tensor, optional
        float32, ``(nheads,)`` or ``(batch_size, nheads)``: adds ``-slope * |i + seqlen_k - seqlen_q - j|``.
    deterministic : bool
        The backward without atomics (bitwise reproducible on the GPU).
    return_attn_probs : bool
        Return ``(out, softmax_lse, S_dmask)``; cuflash gives ``S_dmask = None``.

    Returns
    -------
    out : torch.Tensor, (batch_size, seqlen_q, nheads, headdim_v)
    softmax_lse : torch.Tensor, (batch_size, nheads, seqlen_q), float32; only with ``return_attn_probs=True``
        The logsumexp of each row of the scaled scores; not differentiable.
    S_dmask : None; only with ``return_attn_probs=True``
    """
    return _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attention's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` ``(total, 3, nheads, headdim)``, the
    sequences packed along ``total``, ``cu_seqlens`` int32 ``(batch_size + 1,)`` their prefix sums (the same
    for queries and keys), ``max_seqlen`` the longest.

    Returns ``out`` ``(total, nheads, headdim)``, or ``(out, softmax_lse, None)`` with ``softmax_lse`` of shape
    ``(nheads, total)``. The gradient flows to ``qkv``.
    """
    q, k, v = qkv.unbind(1)
    return _attention(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                      max_seqlen_k=max_seqlen, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attention's ``flash_attn_varlen_kvpacked_func``: ``q`` ``(total_q, nheads, headdim)``, ``kv``
    ``(total_k, 2, nheads_k, headdim)``, with their int32 prefix sums and longest lengths.

    Returns as :func:`flash_attn_varlen_func`; the gradients flow to ``q`` and ``kv``.
    """
    k, v = kv.unbind(1)
    return _attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attention's ``flash_attn_varlen_func``: ``q`` ``(total_q, nheads, headdim)``, ``k`` and ``v``
    ``(total_k, nheads_k, headdim)``, sequence ``b`` being rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q
    and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v (int32 ``(batch_size + 1,)``); ``max_seqlen_q`` and
    ``max_seqlen_k`` the longest. The other arguments as :func:`flash_attn_func`.

    Returns ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse, None)`` with ``softmax_lse`` of shape
    ``(nheads, total_q)``. ``block_table`` (a paged KV cache) is not supported here: ``NotImplementedError``
    (:func:`flash_attn_with_kvcache` takes one).
    """
    if block_table is not None:
        raise NotImplementedError(
            "flash_attn_varlen_func with block_table (a paged KV cache) is not supported by cuflash; gather the "
            "pages into packed k and v, or decode with flash_attn_with_kvcache, which takes a block_table"
        )
    return _attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                      return_attn_probs=return_attn_probs)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """flash-attention's ``flash_attn_with_kvcache``: attention of ``q`` over a KV cache, after writing the new
    ``k`` and ``v`` (if given, rotated by ``rotary_cos`` / ``rotary_sin``) **in place** into ``k_cache`` and
    ``v_cache`` at ``cache_seqlens``. Runs :func:`cuflash.torch.attention_with_kvcache`, the custom operator
    ``cuflash::attention_with_kvcache`` (arguments and meaning as :func:`cuflash.attention_with_kvcache`; traced by
    ``torch.compile``); no gradient, as in flash-attention. CUDA tensors run the decode kernels on torch's stream.

    ``cache_seqlens`` None means full caches (``seqlen_cache`` keys each, or every page of ``block_table``'s
    rows), as in flash-attention.

    Returns ``out`` ``(batch_size, seqlen_q, nheads, headdim)``, or with ``return_softmax_lse=True``
    ``(out, softmax_lse)``, ``softmax_lse`` of shape ``(batch_size, nheads, seqlen_q)``.
    """
    if cache_seqlens is None:  # flash-attention: every slot of the cache (of each row's pages) is in use
        cache_seqlens = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    out, lse = _ft.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, causal=causal, window_size=_window(window_size), softcap=_softcap(softcap),
        alibi_slopes=alibi_slopes, softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True,
    )
    return (out, lse) if return_softmax_lse else out
