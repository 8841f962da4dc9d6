"""JAX front end: :func:`attention` as a ``jax.custom_vjp`` function.

Concrete arrays cross into cuflash through DLPack without copies: GPU arrays into CuPy (the CUDA
kernels), CPU arrays into NumPy (the NumPy block algorithm). Under ``jax.jit`` the inputs are tracers,
which no foreign library can read; there the call goes through ``jax.pure_callback`` to the host
implementation (correct everywhere, but on a GPU it copies through host memory: call the function
outside ``jit`` for the kernels). The forward saves the logsumexp for the backward. ``jax.vmap`` works (with
``grad`` and ``jit`` around it): inside it the arrays are tracers too, and the callback runs once per mapped
element (``vmap_method="sequential"``), so every argument may be mapped or not.

The variant arrays (``alibi_slopes``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``, ``attn_mask``) travel
with q, k, v (through DLPack, or into the callback under ``jit``) and get no gradient; ``bias`` travels the
same way and is differentiated (the custom_vjp returns its gradient). Under ``jit`` their values are
tracers too: their shapes and dtypes are checked when the function is traced, their values (cu_seqlens
start at 0, grow, end at the row count; seqused_k in range) only when the compiled function runs, where a
bad value raises from inside the callback. ``max_seqlen_q``, ``max_seqlen_k``, ``window_size`` and
``softcap`` are Python values, static under ``jit``; so are ``dropout_p``, ``dropout_seed`` and
``dropout_offset``. JAX has no global random generator: dropout needs an explicit integer ``dropout_seed``
(draw one from a ``jax.random`` key outside the function, or pass a counter), and the backward reuses the
forward's seed and offset.

Importing :mod:`cuflash` never imports this module, so JAX stays optional (``pip install cuflash[jax]``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

import cuflash
from cuflash import _api, _validate

__all__ = ["attention"]


def _is_traced(*arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _on_gpu(a) -> bool:
    return any(d.platform == "gpu" for d in a.devices())


def _host(fn):
    """``fn`` on NumPy copies of JAX arrays (any pytree of them), returning NumPy arrays (for ``jax.pure_callback``)."""

    def call(*args):
        return fn(*jax.tree_util.tree_map(np.asarray, args))

    return call


def _call(fn, result_shapes, *args):
    """Run a cuflash function on JAX arrays (pytrees of them; None leaves stay None): zero-copy through
    DLPack when concrete, else a callback."""
    leaves = jax.tree_util.tree_leaves(args)
    if _is_traced(*leaves):
        # (under vmap the callback runs once per mapped element: correct for every argument, batched or not)
        return jax.pure_callback(_host(fn), result_shapes, *args, vmap_method="sequential")
    if _on_gpu(leaves[0]):
        import cupy

        for a in leaves:  # JAX and CuPy work on different streams: hand over finished buffers only
            a.block_until_ready()
        results = fn(*jax.tree_util.tree_map(cupy.from_dlpack, args))
        cupy.cuda.get_current_stream().synchronize()
        return tuple(jax.dlpack.from_dlpack(r) for r in results)
    results = fn(*jax.tree_util.tree_map(np.asarray, args))
    return tuple(jax.numpy.asarray(r) for r in results)


def _lse_shape(q):
    """``(batch, heads_q, seqlen_q)``, or ``(heads_q, total_q)`` for packed ``(total_q, heads_q, d)`` q."""
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    if q.ndim == 3:
        return jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), lse_dtype)
    batch, seqlen_q, heads_q, _ = q.shape
    return jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), lse_dtype)


def _shape_of(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _stand_in(a):
    """A NumPy array of ``a``'s shape and dtype (one row broadcast, contiguous last axis), values zero."""
    return np.broadcast_to(np.zeros(np.shape(a)[-1:], a.dtype), np.shape(a))


def _check(q, k, v, bias, arrays, options):
    """cuflash's checks of shapes, dtypes and options, before anything is traced or called back.

    Under ``jit`` the work runs in a callback, where an error would surface only when the compiled
    function runs. Shapes and dtypes are known at trace time, so the checks run on NumPy stand-ins of
    that shape and dtype; the variant arrays are read when they are concrete (a device-to-host copy of
    a few integers on a GPU), else only their shapes and dtypes are checked here. ``bias`` and
    ``attn_mask`` are never read: their checks need only their shapes and dtypes.
    """
    options = dict(options)
    _validate.backward_order(None, options.pop("deterministic"))
    by_shape = ("attn_mask",)
    traced = _is_traced(*(a for name, a in zip(_api.ARRAY_OPTIONS, arrays) if a is not None and name not in by_shape))
    array_options = {name: None if a is None else (_stand_in(a) if traced or name in by_shape else np.asarray(a))
                     for name, a in zip(_api.ARRAY_OPTIONS, arrays)}
    array_options["bias"] = None if bias is None else _stand_in(bias)
    mod_arrays = arrays[len(_api.ARRAY_OPTIONS)]  # read by the expressions when the call runs: checked by shape
    array_options["mod_arrays"] = ({name: _stand_in(a) if hasattr(a, "dtype") else a for name, a in mod_arrays.items()}
                                   if isinstance(mod_arrays, dict) else mod_arrays)
    _api._prepare(*(_stand_in(a) for a in (q, k, v)), softmax_scale=options.pop("softmax_scale"),
                  algorithm=options.pop("algorithm"), block_q=options.pop("block_q"), block_k=options.pop("block_k"),
                  variant_options={**options, **array_options}, read_values=not traced)


def _check_dropout_seed(dropout_p, dropout_seed) -> None:
    """A positive ``dropout_p`` without a seed: say where a JAX user gets one (cuflash's check says the rest)."""
    if dropout_seed is None and isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) \
            and 0 < dropout_p < 1:
        raise ValueError(
            f"cuflash.jax.attention: dropout_p={float(dropout_p)} needs an explicit integer dropout_seed in "
            f"[0, 2**64) (JAX has no global random generator; draw one from a key outside the function, e.g. "
            f"int(jax.random.randint(key, (), 0, 2**31 - 1))); got dropout_seed=None"
        )
    if isinstance(dropout_seed, jax.Array):
        raise TypeError(
            "cuflash.jax.attention: dropout_seed must be a Python integer (a static value: the mask is drawn "
            "on the host from it); got a JAX array, convert a concrete one with int(...)"
        )


def _keywords(options, arrays):
    """The keywords of cuflash.attention from the static options and the variant arrays (``mod_arrays`` last)."""
    return {**{key: val for key, val in options if key != "deterministic"}, **dict(zip(_api.ARRAY_OPTIONS, arrays)),
            "mod_arrays": arrays[len(_api.ARRAY_OPTIONS)]}


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, bias, arrays, options):
    out, _ = _forward(q, k, v, bias, arrays, options)
    return out


def _forward(q, k, v, bias, arrays, options):
    def fn(q, k, v, bias, arrays):
        return cuflash.attention(q, k, v, return_lse=True, bias=bias, **_keywords(options, arrays))

    out_shape = jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype)  # v's head dim may differ from q's
    return _call(fn, (out_shape, _lse_shape(q)), q, k, v, bias, arrays)


def _attention_fwd(q, k, v, bias, arrays, options):
    out, lse = _forward(q, k, v, bias, arrays, options)
    return out, (q, k, v, bias, arrays, out, lse)


def _attention_bwd(options, saved, dout):
    q, k, v, bias, arrays, out, lse = saved
    deterministic = dict(options)["deterministic"]

    def fn(do, q, k, v, out, lse, bias, arrays):
        return cuflash.attention_backward(do, q, k, v, out, lse, deterministic=deterministic, bias=bias,
                                          **_keywords(options, arrays))

    shapes = tuple(_shape_of(a) for a in (q, k, v) + (() if bias is None else (bias,)))
    grads = _call(fn, shapes, dout, q, k, v, out, lse, bias, arrays)
    dbias = None if bias is None else grads[3]
    return grads[0], grads[1], grads[2], dbias, None  # the other variant arrays (slopes, bounds, mask): none


_attention.defvjp(_attention_fwd, _attention_bwd)


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
    deterministic: bool = False,
):
    """Differentiable :func:`cuflash.attention` on JAX arrays ``(batch, seqlen, heads, head_dim)``, or
    packed ``(total, heads, head_dim)`` with ``cu_seqlens_q`` and ``cu_seqlens_k``.

    Arguments as :func:`cuflash.attention`; ``deterministic`` selects the backward without atomics.
    Gradients flow to ``q``, ``k``, ``v`` and ``bias`` (summed over the axes it broadcasts over);
    ``alibi_slopes``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k`` and ``attn_mask`` (JAX or NumPy
    arrays) get none. Under ``jax.jit`` the values of ``cu_seqlens_q``,
    ``cu_seqlens_k`` and ``seqused_k`` are checked when the compiled function runs.

    ``dropout_p > 0`` needs an explicit Python integer ``dropout_seed`` in ``[0, 2**64)`` (static under
    ``jit``: a new seed retraces; JAX has no global generator to draw it from); the mask is
    ``cuflash.dropout_mask(..., dropout_p, dropout_seed, dropout_offset)``, the same as NumPy's.

    ``score_mod`` and ``mask_mod`` (CUDA C expressions, static under ``jit``) and ``mod_arrays`` (a dict of
    names to 1-D int32 / float32 arrays, no gradient, read when the call runs) as in :func:`cuflash.attention`.

    ``softmax_scale`` may be any finite real (0: uniform attention; negative allowed), as in
    :func:`cuflash.attention`. Inputs are not scanned for NaN or infinities; ``CUFLASH_CHECK_FINITE=1`` in the
    environment scans them when the call runs (under ``jit``: inside the callback, where the error surfaces).
    """
    options = (
        ("causal", causal), ("softmax_scale", softmax_scale), ("causal_align", causal_align),
        ("window_size", window_size), ("softcap", softcap), ("max_seqlen_q", max_seqlen_q),
        ("max_seqlen_k", max_seqlen_k), ("algorithm", algorithm), ("block_q", block_q), ("block_k", block_k),
        ("dropout_p", dropout_p), ("dropout_seed", dropout_seed), ("dropout_offset", dropout_offset),
        ("score_mod", score_mod), ("mask_mod", mask_mod), ("deterministic", deterministic),
    )
    _check_dropout_seed(dropout_p, dropout_seed)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a is None or not hasattr(a, "shape"):
            got = "None" if a is None else f"{type(a).__module__}.{type(a).__name__}"
            raise TypeError(f"cuflash.jax.attention: {name} must be an array (a jax.Array, or a numpy.ndarray); "
                            f"got {got}")
    q, k, v = (jax.numpy.asarray(a) for a in (q, k, v))  # NumPy inputs too, as any JAX function
    given = dict(alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 seqused_k=seqused_k, attn_mask=attn_mask)
    arrays = tuple(None if given[name] is None else jax.numpy.asarray(given[name]) for name in _api.ARRAY_OPTIONS)
    if isinstance(mod_arrays, dict):  # anything else reaches cuflash's check as it is
        mod_arrays = {name: jax.numpy.asarray(a) if hasattr(a, "dtype") else a for name, a in mod_arrays.items()}
    arrays += (mod_arrays,)
    bias = None if bias is None else jax.numpy.asarray(bias)
    _check(q, k, v, bias, arrays, options)
    if isinstance(window_size, list):  # static under jit: hashable
        options = tuple((key, tuple(val) if key == "window_size" else val) for key, val in options)
    return _attention(q, k, v, bias, arrays, options)
