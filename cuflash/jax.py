"""JAX front end: :func:`attention` as a ``jax.custom_vjp`` function.

Concrete arrays cross into cuflash through DLPack without copies: GPU arrays into CuPy (the CUDA
kernels), CPU arrays into NumPy (the NumPy block algorithm). Under ``jax.jit`` the inputs are tracers,
which no foreign library can read; there the call goes through ``jax.pure_callback`` to the host
implementation (correct everywhere, but on a GPU it copies through host memory: call the function
outside ``jit`` for the kernels). The forward saves the logsumexp for the backward.

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
    """``fn`` on NumPy copies of JAX arrays, returning NumPy arrays (for ``jax.pure_callback``)."""

    def call(*arrays):
        return fn(*(np.asarray(a) for a in arrays))

    return call


def _call(fn, result_shapes, *arrays):
    """Run a cuflash function on JAX arrays: zero-copy through DLPack when concrete, else a callback."""
    if _is_traced(*arrays):
        return jax.pure_callback(_host(fn), result_shapes, *arrays)
    if _on_gpu(arrays[0]):
        import cupy

        for a in arrays:  # JAX and CuPy work on different streams: hand over finished buffers only
            a.block_until_ready()
        results = fn(*(cupy.from_dlpack(a) for a in arrays))
        cupy.cuda.get_current_stream().synchronize()
        return tuple(jax.dlpack.from_dlpack(r) for r in results)
    results = fn(*(np.asarray(a) for a in arrays))
    return tuple(jax.numpy.asarray(r) for r in results)


def _lse_shape(q):
    batch, seqlen_q, heads_q, _ = q.shape
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    return jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), lse_dtype)


def _shape_of(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _check(q, k, v, options):
    """cuflash's checks of shapes, dtypes and options, before anything is traced or called back.

    Under ``jit`` the work runs in a callback, where an error would surface only when the compiled
    function runs. Shapes and dtypes are known at trace time, so the checks run on NumPy stand-ins of
    that shape and dtype (one row broadcast, contiguous last axis).
    """
    stand_ins = [np.broadcast_to(np.zeros(np.shape(a)[-1:], a.dtype), np.shape(a)) for a in (q, k, v)]
    options = dict(options)
    _validate.backward_order(None, options.pop("deterministic"))
    _api._prepare(*stand_ins, **options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, options):
    out, _ = _forward(q, k, v, options)
    return out


def _forward(q, k, v, options):
    forward_options = {key: val for key, val in options if key != "deterministic"}
    fn = lambda q, k, v: cuflash.attention(q, k, v, return_lse=True, **forward_options)  # noqa: E731
    return _call(fn, (_shape_of(q), _lse_shape(q)), q, k, v)


def _attention_fwd(q, k, v, options):
    out, lse = _forward(q, k, v, options)
    return out, (q, k, v, out, lse)


def _attention_bwd(options, saved, dout):
    q, k, v, out, lse = saved
    fn = lambda do, q, k, v, out, lse: cuflash.attention_backward(do, q, k, v, out, lse, **dict(options))  # noqa: E731
    return _call(fn, (_shape_of(q), _shape_of(k), _shape_of(v)), dout, q, k, v, out, lse)


_attention.defvjp(_attention_fwd, _attention_bwd)


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
    deterministic: bool = False,
):
    """Differentiable :func:`cuflash.attention` on JAX arrays ``(batch, seqlen, heads, head_dim)``.

    Arguments as :func:`cuflash.attention`; ``deterministic`` selects the backward without atomics.
    """
    options = (
        ("causal", causal), ("softmax_scale", softmax_scale), ("causal_align", causal_align),
        ("algorithm", algorithm), ("block_q", block_q), ("block_k", block_k),
        ("deterministic", deterministic),
    )
    q, k, v = (jax.numpy.asarray(a) for a in (q, k, v))  # NumPy inputs too, as any JAX function
    _check(q, k, v, options)
    return _attention(q, k, v, options)
