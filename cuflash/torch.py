"""PyTorch front end: :func:`attention` as a ``torch.autograd.Function``.

Tensors cross into cuflash without copies: CUDA tensors through DLPack into CuPy (the kernels run on
PyTorch's current stream), CPU tensors as NumPy views (the NumPy block algorithm). The forward saves the
logsumexp; the backward runs :func:`cuflash.attention_backward`. Importing :mod:`cuflash` never imports
this module, so PyTorch stays an optional dependency (``pip install cuflash[torch]``).

Layout is cuflash's ``(batch, seqlen, heads, head_dim)``, or packed ``(total, heads, head_dim)`` with
``cu_seqlens_q``/``cu_seqlens_k``; a ``(batch, heads, seqlen, head_dim)`` tensor goes in as
``t.transpose(1, 2)``, with no copy. The variant tensors (``alibi_slopes``, ``cu_seqlens_q``,
``cu_seqlens_k``, ``seqused_k``, ``attn_mask``) cross the same way as q, k, v and get no gradient; ``bias``
crosses the same way and gets one when it requires grad (computed only then).

Dropout (``dropout_p > 0``) draws its Philox seed from PyTorch's default CPU generator when no
``dropout_seed`` is given (:func:`draw_dropout_seed`), as flash-attention draws from PyTorch's generator:
``torch.manual_seed(s)`` reproduces a run, and the backward reuses the forward's seed and offset.
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import torch

import cuflash
from cuflash import _api, _validate

__all__ = ["attention", "draw_dropout_seed"]


def draw_dropout_seed(generator: torch.Generator | None = None) -> int:
    """One dropout seed, an integer in ``[0, 2**63 - 1)``, drawn with ``torch.randint`` from ``generator``
    (a CPU generator; default: PyTorch's default CPU generator, which ``torch.manual_seed`` seeds).

    :func:`attention` calls this for a ``dropout_p > 0`` call without ``dropout_seed``, so that after
    ``torch.manual_seed(s)`` the same draw gives the seed it used, and
    ``cuflash.dropout_mask((batch, heads_q, seqlen_q, seqlen_k), dropout_p, seed, dropout_offset)`` the mask
    it applied. The draw runs on the CPU: no device synchronization.
    """
    return int(torch.randint(0, 2**63 - 1, (), generator=generator, dtype=torch.int64).item())


def _to_array(t: torch.Tensor):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of a tensor."""
    t = t.detach()
    if t.is_cuda:
        import cupy

        return cupy.from_dlpack(t)
    if t.dtype == torch.bfloat16:  # NumPy has no native bfloat16: reinterpret the bits as ml_dtypes'
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_tensor(a) -> torch.Tensor:
    """The inverse of :func:`_to_array`, again without a copy."""
    if isinstance(a, np.ndarray):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


def _with_arrays(options: dict) -> dict:
    """The options with every tensor among them (the variant arrays, and those of ``mod_arrays``) as an
    array, like q, k, v."""
    def convert(val):
        if isinstance(val, dict):
            return {name: convert(a) for name, a in val.items()}
        return _to_array(val) if isinstance(val, torch.Tensor) else val

    return {key: convert(val) for key, val in options.items()}


def _on_torch_stream(t: torch.Tensor):
    """Run CuPy work on PyTorch's current stream for the tensor's device."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Stream.from_external(torch.cuda.current_stream(t.device))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, options, deterministic):
        with _on_torch_stream(q):
            out, lse = cuflash.attention(_to_array(q), _to_array(k), _to_array(v), return_lse=True,
                                         **_with_arrays({**options, "bias": bias}))
        out, lse = _to_tensor(out), _to_tensor(lse)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.options, ctx.deterministic = options, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, bias = ctx.saved_tensors
        if dout.stride(-1) != 1:  # autograd may hand over an expanded or strided gradient
            dout = dout.contiguous()
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        grads = _AttentionBackward.apply(dout, q, k, v, out, lse, bias, ctx.options, ctx.deterministic, want_dbias)
        dbias = grads[3] if want_dbias else None
        return grads[0], grads[1], grads[2], dbias, None, None


class _AttentionBackward(torch.autograd.Function):
    """The backward as a node of its own: under ``create_graph=True`` the gradients stay connected to
    q, k, v and dout, so that differentiating them again raises instead of treating them as constants."""

    @staticmethod
    def forward(ctx, dout, q, k, v, out, lse, bias, options, deterministic, want_dbias):
        with _on_torch_stream(q):
            grads = cuflash.attention_backward(
                _to_array(dout), _to_array(q), _to_array(k), _to_array(v), _to_array(out), _to_array(lse),
                deterministic=deterministic, return_dbias=want_dbias, **_with_arrays({**options, "bias": bias}),
            )
        return tuple(_to_tensor(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError("cuflash.torch.attention has no second derivative (double backward)")


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
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Differentiable :func:`cuflash.attention` on PyTorch tensors.

    ``score_mod`` and ``mask_mod`` are CUDA C expressions (strings) as in :func:`cuflash.attention`, with
    ``mod_arrays`` a dict of names to 1-D int32 / float32 tensors on q's device (no gradient).


    Arguments as :func:`cuflash.attention` (the variant arrays as tensors on q's device: int32
    ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``, float32 ``alibi_slopes``, floating ``bias``, bool
    ``attn_mask``); ``deterministic`` selects the backward without atomics. Gradients flow to ``q``, ``k``,
    ``v`` and ``bias`` (summed over the axes it broadcasts over; computed only when it requires grad); the
    other variant tensors and the logsumexp (with ``return_lse=True``, shape ``(heads_q, total_q)`` when
    packed) are not differentiable.

    ``dropout_p > 0`` zeroes probabilities as :func:`cuflash.attention` does. Without ``dropout_seed`` the seed
    is drawn by :func:`draw_dropout_seed` from PyTorch's default CPU generator (one draw per call with
    ``dropout_p > 0``, none otherwise), so ``torch.manual_seed`` makes a run reproducible; the backward
    reuses the forward's seed and ``dropout_offset``. Call with ``dropout_p=0`` to evaluate without dropout.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        kinds = ", ".join(type(t).__name__ for t in (q, k, v))
        raise TypeError(f"q, k and v must be torch.Tensor; got {kinds}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor (on the device of q) or None; got {type(bias).__name__}")
    _validate.backward_order(None, deterministic)  # only the backward uses it: check it before the forward
    # checked before the draw, so that a bad value consumes nothing of the generator
    dropout_p, _, dropout_offset = _validate.dropout(dropout_p, 0 if dropout_seed is None else dropout_seed,
                                                     dropout_offset)
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed()
    options = dict(
        causal=causal, softmax_scale=softmax_scale, causal_align=causal_align, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, attn_mask=attn_mask,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
        score_mod=score_mod, mask_mod=mask_mod, mod_arrays=mod_arrays,
        algorithm=algorithm, block_q=block_q, block_k=block_k,
    )
    for name in _api.ARRAY_OPTIONS:  # never differentiated: keep autograd from holding on to their graphs
        if isinstance(options[name], torch.Tensor):
            options[name] = options[name].detach()
    if isinstance(mod_arrays, dict):
        options["mod_arrays"] = {name: a.detach() if isinstance(a, torch.Tensor) else a for name, a in mod_arrays.items()}
    out, lse = _Attention.apply(q, k, v, bias, options, deterministic)
    return (out, lse) if return_lse else out
