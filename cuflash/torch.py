"""PyTorch front end: :func:`attention`, over the custom operators ``cuflash::attention_fwd`` and
``cuflash::attention_bwd`` (``torch.library``).

Tensors cross into cuflash without copies: CUDA tensors through DLPack into CuPy (the kernels run on
PyTorch's current stream), CPU tensors as NumPy views (the NumPy block algorithm). The forward saves the
logsumexp; the backward runs :func:`cuflash.attention_backward`. Importing :mod:`cuflash` never imports
this module, so PyTorch stays an optional dependency (``pip install cuflash[torch]``).

The two operators have fake (meta) implementations, which give the outputs' shapes and dtypes, and the
forward's gradient is registered with ``torch.library.register_autograd``: ``torch.compile(fn,
fullgraph=True)`` traces a function that calls :func:`attention` with no graph break, and
``torch.library.opcheck`` passes on them (``docs/integrations.md``). They can be called directly as
``torch.ops.cuflash.attention_fwd`` and ``torch.ops.cuflash.attention_bwd``; their schemas are the
keywords of :func:`cuflash.attention` in an operator's types (``window_size`` as ``window_left`` and
``window_right``, ``mod_arrays`` as a list of tensors and ``mod_array_names`` joined by commas, the dropout
seed as a 0-d int64 CPU tensor, the seed and ``dropout_offset`` as the int64 with the same bits).

Layout is cuflash's ``(batch, seqlen, heads, head_dim)``, or packed ``(total, heads, head_dim)`` with
``cu_seqlens_q``/``cu_seqlens_k``; a ``(batch, heads, seqlen, head_dim)`` tensor goes in as
``t.transpose(1, 2)``, with no copy. The variant tensors (``alibi_slopes``, ``cu_seqlens_q``,
``cu_seqlens_k``, ``seqused_k``, ``attn_mask``) cross the same way as q, k, v and get no gradient; ``bias``
crosses the same way and gets one when it requires grad (computed only then).

Dropout (``dropout_p > 0``) draws its Philox seed from PyTorch's default CPU generator when no
``dropout_seed`` is given (the draw of :func:`draw_dropout_seed`, kept a tensor so that ``torch.compile``
traces it), as flash-attention draws from PyTorch's generator: ``torch.manual_seed(s)`` reproduces a run,
and the backward reuses the forward's seed and offset.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Optional

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


def _check_devices(**tensors) -> None:
    """The tensors given (None: not given) are on one device, q's (the first): cuflash runs the NumPy reference
    on CPU tensors and the CUDA kernels on CUDA tensors of one GPU, and copies nothing between devices."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    first, device = given[0][0], given[0][1].device
    for name, t in given[1:]:
        if t.device != device:
            raise ValueError(
                f"{first} and {name} must be on the same device (cuflash copies nothing between devices: CPU "
                f"tensors run the NumPy reference, CUDA tensors the kernels); got {first} on {device} and {name} on "
                f"{t.device}"
            )


def _output(a) -> torch.Tensor:
    """A backend's result as a tensor, contiguous as the fake implementations promise (the backends allocate
    contiguous results: this copies nothing)."""
    t = _to_tensor(a)
    return t if t.is_contiguous() else t.contiguous()


# ---------------------------------------------------------------------------------------------------
# The custom operators: cuflash::attention_fwd and cuflash::attention_bwd
# ---------------------------------------------------------------------------------------------------
#
# torch.compile traces through them with their fake implementations (shapes and dtypes only) and
# AOTAutograd differentiates attention_fwd with the formula of register_autograd, which calls
# attention_bwd: no graph break. Their arguments are the keywords of cuflash.attention in the types an
# operator schema has: window_size as two ints, mod_arrays as a list of tensors and their names joined by
# commas, the dropout seed as a 0-d int64 CPU tensor (so that a seed drawn from torch's generator inside a
# compiled function stays a tensor: no .item(), no graph break) and the seed and offset, integers in
# [0, 2**64), as int64 bit patterns (_signed64).

_SCALAR_OPTIONS = (
    "causal", "softmax_scale", "causal_align", "window_left", "window_right", "softcap", "max_seqlen_q",
    "max_seqlen_k", "dropout_p", "dropout_offset", "score_mod", "mask_mod", "mod_array_names", "algorithm",
    "block_q", "block_k",
)


def _signed64(value: int) -> int:
    """An integer in [0, 2**64) as the int64 with the same bits (an operator's int is an int64)."""
    return value - 2**64 if value >= 2**63 else value


def _unsigned64(value: int) -> int:
    return value + 2**64 if value < 0 else value


def _front_door_options(args: dict) -> dict:
    """The variant keywords of cuflash.attention / attention_backward from an operator's arguments (its
    ``locals()``), the tensors as NumPy or CuPy views (no copies)."""
    names = args["mod_array_names"].split(",") if args["mod_array_names"] else []
    seed = args["dropout_seed"]
    return dict(
        _with_arrays({name: args[name] for name in _api.ARRAY_OPTIONS}),
        **{name: args[name] for name in _SCALAR_OPTIONS if name not in ("window_left", "window_right",
                                                                         "dropout_offset", "mod_array_names")},
        window_size=(args["window_left"], args["window_right"]),
        mod_arrays={name: _to_array(a) for name, a in zip(names, args["mod_arrays"])} if names else None,
        # TODO(GPU path, CUDA graphs): read on the host, so a captured graph replays with the captured seed
        dropout_seed=None if seed is None else _unsigned64(int(seed.item())),
        dropout_offset=_unsigned64(args["dropout_offset"]),
    )


@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def _attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor], mod_arrays: list[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    causal: bool, softmax_scale: Optional[float], causal_align: str, window_left: int, window_right: int,
    softcap: float, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], dropout_p: float, dropout_offset: int,
    score_mod: Optional[str], mask_mod: Optional[str], mod_array_names: str, algorithm: str,
    block_q: Optional[int], block_k: Optional[int], deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`cuflash.attention` (``deterministic`` is the backward's, kept for autograd)."""
    _check_devices(q=q, k=k, v=v, bias=bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, attn_mask=attn_mask,
                   **{f"mod_arrays[{i}]": a for i, a in enumerate(mod_arrays)})
    options = _front_door_options(locals())
    # TODO(GPU path): out and lse come from CuPy's memory pool here and cross back through DLPack; the issue
    # wants them (and the backend's workspaces) from torch's caching allocator on the current stream, which a
    # CUDA graph capture also needs (docs/integrations.md, "What the GPU path still lacks").
    with _on_torch_stream(q):
        out, lse = cuflash.attention(_to_array(q), _to_array(k), _to_array(v), return_lse=True,
                                     bias=None if bias is None else _to_array(bias), **options)
    return _output(out), _output(lse)


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, attn_mask, mod_arrays,
                        dropout_seed, *scalars):
    _check_devices(q=q, k=k, v=v, bias=bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, attn_mask=attn_mask,
                   **{f"mod_arrays[{i}]": a for i, a in enumerate(mod_arrays)})
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # (batch, heads_q, seqlen_q); packed (total_q, heads_q, d) q: (heads_q, total_q)
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=lse_dtype)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def _attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    bias: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
    mod_arrays: list[torch.Tensor], dropout_seed: Optional[torch.Tensor],
    causal: bool, softmax_scale: Optional[float], causal_align: str, window_left: int, window_right: int,
    softcap: float, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], dropout_p: float, dropout_offset: int,
    score_mod: Optional[str], mask_mod: Optional[str], mod_array_names: str, algorithm: str,
    block_q: Optional[int], block_k: Optional[int], deterministic: bool, want_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dbias)`` of :func:`cuflash.attention_backward`; ``dbias`` is an empty ``(0,)`` tensor
    unless ``want_dbias`` (an operator returns tensors, never None)."""
    _check_devices(q=q, dout=dout, k=k, v=v, out=out, lse=lse, bias=bias, alibi_slopes=alibi_slopes,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, attn_mask=attn_mask,
                   **{f"mod_arrays[{i}]": a for i, a in enumerate(mod_arrays)})
    options = _front_door_options(locals())
    # TODO(GPU path): dq, dk, dv, dbias and the workspaces (dq_accum, delta) from torch's allocator, as above.
    with _on_torch_stream(q):
        grads = cuflash.attention_backward(
            _to_array(dout), _to_array(q), _to_array(k), _to_array(v), _to_array(out), _to_array(lse),
            deterministic=deterministic, return_dbias=want_dbias, bias=None if bias is None else _to_array(bias),
            **options,
        )
    dq, dk, dv = (_output(g) for g in grads[:3])
    dbias = _output(grads[3]) if want_dbias else q.new_empty((0,))
    return dq, dk, dv, dbias


@_attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, bias, *rest):
    want_dbias = rest[-1]
    dbias = bias.new_empty(bias.shape) if want_dbias else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, bias, alibi_slopes, cu_q, cu_k, used, mask, mod_arrays, seed, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, cu_q, cu_k, used, mask, seed, *mod_arrays)
    ctx.scalars = scalars  # _SCALAR_OPTIONS, then deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, bias, alibi_slopes, cu_q, cu_k, used, mask, seed, *mod_arrays = ctx.saved_tensors
    if dout is None:  # only lse was used (it has no gradient): nothing flows back
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:  # autograd may hand over an expanded or strided gradient
        dout = dout.contiguous()
    want_dbias = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _attention_bwd(dout, q, k, v, out, lse, bias, alibi_slopes, cu_q, cu_k, used, mask, mod_arrays,
                                       seed, *ctx.scalars, want_dbias)
    # one gradient per input: q, k, v, bias; none for the variant tensors, the list mod_arrays, the seed and
    # the scalars
    return (dq, dk, dv, dbias if want_dbias else None, None, None, None, None, None, [None] * len(mod_arrays),
            None, *(None for _ in ctx.scalars))


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("cuflash.torch.attention has no second derivative (double backward)")


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
# Under create_graph=True the gradients stay connected to q, k, v and dout through attention_bwd, so that
# differentiating them again raises instead of treating them as constants.
_attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _optional_int(name: str, value):
    if value is None:
        return None
    if not _validate._is_int(value):
        raise TypeError(f"{name} must be a positive integer; got {type(value).__name__} {value!r}")
    return int(value)


def _mod_arrays(score_mod, mask_mod, mod_arrays) -> tuple[str, list]:
    """``mod_arrays`` as the operator takes it: the names joined by commas, and the tensors (detached)."""
    for name, text in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if text is not None and not isinstance(text, str):
            raise TypeError(
                f"{name} must be a string (a CUDA C expression, see docs/variants.md) or None; got {type(text).__name__}"
            )
    if mod_arrays is None:
        return "", []
    if not isinstance(mod_arrays, Mapping):
        raise TypeError(f"mod_arrays must be a dict of names to 1-D int32 or float32 tensors; got "
                        f"{type(mod_arrays).__name__}")
    if score_mod is None and mask_mod is None:
        raise ValueError("mod_arrays is read by score_mod and mask_mod only; got mod_arrays without either")
    for name, a in mod_arrays.items():
        if not isinstance(name, str) or not (name.isascii() and name.isidentifier()):
            raise ValueError(f"mod_arrays names must be C identifiers (letters, digits, _); got {name!r}")
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"mod_arrays[{name!r}] must be a torch.Tensor (on the device of q); got {type(a).__name__}")
    return ",".join(mod_arrays), [a.detach() for a in mod_arrays.values()]


def _optional_tensor(name: str, value):
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (on the device of q) or None; got {type(value).__name__}")
    return value


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

    ``softmax_scale`` may be any finite real (0: uniform attention; negative allowed), as in PyTorch's
    ``scaled_dot_product_attention``. All tensors must be on q's device. Inputs are not scanned for NaN or
    infinities; ``CUFLASH_CHECK_FINITE=1`` in the environment scans them when the operator runs (eager or
    compiled), raising ``ValueError`` with the tensor's name and the first bad index.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            got = "None" if t is None else f"{type(t).__module__}.{type(t).__name__}"
            raise TypeError(f"{name} must be a torch.Tensor (CPU: the NumPy reference, CUDA: the kernels); got {got}")
    _optional_tensor("bias", bias)
    _validate.backward_order(None, deterministic)  # only the backward uses it: check it before the forward
    # checked before the draw, so that a bad value consumes nothing of the generator
    explicit_seed = dropout_seed is not None
    dropout_p, dropout_seed, dropout_offset = _validate.dropout(
        dropout_p, dropout_seed if explicit_seed else 0, dropout_offset)
    if torch.compiler.is_compiling():
        # Traced by torch.compile: the scalars may be symbolic (dynamic=True makes floats and ints inputs of the
        # graph), which the checks below cannot read; the front door checks them all when the operator runs.
        left, right = window_size
    else:
        # Checked here, in the front door's words, what the operator's schema would refuse in its own: the
        # scalars' types (their values, and the tensors, are checked by the front door when the operator runs).
        causal, _ = _validate.causal_options(causal, causal_align)
        left, right = (-1 if x is None else x for x in _validate.window_size(window_size))
        softcap = _validate.softcap(softcap)
        if softmax_scale is not None:
            _validate.softmax_scale(softmax_scale, 1)
            softmax_scale = float(softmax_scale)
        algorithm = _validate.algorithm(algorithm)
        block_q, block_k = _validate.block_size("block_q", block_q), _validate.block_size("block_k", block_k)
        max_seqlen_q = _optional_int("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = _optional_int("max_seqlen_k", max_seqlen_k)
    arrays = {name: _optional_tensor(name, value) for name, value in (
        ("alibi_slopes", alibi_slopes), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
        ("seqused_k", seqused_k), ("attn_mask", attn_mask))}
    # never differentiated: keep autograd from holding on to their graphs
    arrays = {name: None if value is None else value.detach() for name, value in arrays.items()}
    names, mods = _mod_arrays(score_mod, mask_mod, mod_arrays)
    _check_devices(q=q, k=k, v=v, bias=bias, **arrays, **{f"mod_arrays[{name!r}]": a for name, a in
                                                          zip(names.split(",") if names else [], mods)})
    if not dropout_p:
        seed = None
    elif explicit_seed:
        seed = torch.tensor(_signed64(dropout_seed), dtype=torch.int64)
    else:  # draw_dropout_seed's draw, kept a tensor: traceable by torch.compile (no .item())
        seed = torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
    out, lse = _attention_fwd(
        q, k, v, bias, *arrays.values(), mods, seed, causal, softmax_scale, causal_align, left, right, softcap,
        max_seqlen_q, max_seqlen_k, dropout_p, _signed64(dropout_offset), score_mod, mask_mod, names, algorithm,
        block_q, block_k, bool(deterministic),
    )
    return (out, lse.detach()) if return_lse else out
