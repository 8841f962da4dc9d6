"""Multi-head self-attention: the projection chain around :func:`cuflash.attention`, forward and a
manual backward (no autograd).

With the names of seed 000 (equations (6)-(10) and its appendix), for one sequence
``Z̃ in R^{T x d_model}``::

    Q = Z̃ W_Q + b_Q,   K = Z̃ W_K + b_K,   V = Z̃ W_V + b_V       (6)
    [Q_1 ... Q_H] = Q,  [K_1 ... K_H'] = K,  [V_1 ... V_H'] = V    (heads: column blocks of width d)
    O_h = softmax(scale * Q_h K_g(h)^T) V_g(h)                     (7)-(9), by cuflash.attention
    O = [O_1 ... O_H]
    Z̃^out = O W_O + b_O                                            (10)

``H'`` key/value heads serve ``H`` query heads (grouped-query attention, seed 001 section 3.1);
query head ``h`` reads key/value head ``g(h) = h // (H // H')``. ``H' = H`` is ordinary multi-head
attention. The heads are views of the projections, ``(batch, seqlen, heads, head_dim)``, so splitting
and concatenating costs no copy.

The code is written against the array namespace of its inputs (``array_api_compat``), so the same
functions run on NumPy arrays (the NumPy block algorithm) and CuPy arrays (the CUDA kernels).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import array_api_compat
import numpy as np

from ._ops import validate as _validate
from ._ops.api import attention, attention_backward

__all__ = ["MHAParams", "MHAGrads", "MHACache", "init_mha_params", "mha_forward", "mha_backward"]


class MHAParams(NamedTuple):
    """Trainable parameters of one multi-head self-attention layer.

    ``w_q``: ``(d_model, H * d)``; ``w_k``, ``w_v``: ``(d_model, H' * d)``; ``w_o``: ``(H * d, d_out)``
    (usually ``d_out = d_model``). Each bias is ``None`` (no bias) or a vector as wide as its weight's
    columns: ``b_q`` ``(H * d,)``, ``b_k``, ``b_v`` ``(H' * d,)``, ``b_o`` ``(d_out,)``.
    """

    w_q: Any
    w_k: Any
    w_v: Any
    w_o: Any
    b_q: Any = None
    b_k: Any = None
    b_v: Any = None
    b_o: Any = None


class MHAGrads(NamedTuple):
    """Gradients of the loss with respect to the layer input and every parameter.

    ``dz`` has the shape of the input; each ``dw_*`` / ``db_*`` the shape of its parameter, and a bias
    gradient is ``None`` exactly when that bias is ``None``.
    """

    dz: Any
    dw_q: Any
    dw_k: Any
    dw_v: Any
    dw_o: Any
    db_q: Any = None
    db_k: Any = None
    db_v: Any = None
    db_o: Any = None


class MHACache(NamedTuple):
    """What :func:`mha_backward` needs from :func:`mha_forward`.

    Attributes
    ----------
    z : array
        The layer input Z̃, ``(batch, seqlen, d_model)``; gives dW_Q, dW_K, dW_V.
    q : array
        ``(batch, seqlen, H, d)``, the query heads (a view of Q = Z̃ W_Q + b_Q).
    k, v : array
        ``(batch, seqlen, H', d)``, the key and value heads.
    out : array
        ``(batch, seqlen, H, d)``, the attention output O before W_O; gives dW_O and D = rowsum(dO * O).
    lse : array
        ``(batch, H, seqlen)``, logsumexp of the scaled scores; the backward recomputes P from it.
    options : dict
        The keyword arguments given to :func:`cuflash.attention` (``causal``, ``softmax_scale``,
        ``causal_align``, ``algorithm``, ``block_q``, ``block_k``), passed unchanged to
        :func:`cuflash.attention_backward`.

    Nothing of size ``seqlen x seqlen`` is kept: memory is O(batch * seqlen * (d_model + H * d)).
    """

    z: Any
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    options: dict


def _namespace(z, params: MHAParams):
    return array_api_compat.array_namespace(z, *(p for p in params if p is not None))


def _shape(a) -> tuple[int, ...]:
    return tuple(int(s) for s in a.shape)


def _head_count(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive integer; got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer; got {int(value)}")
    return int(value)


def _check_layer(z, params: MHAParams, num_heads, num_kv_heads) -> tuple[int, int]:
    """Validate the input against the parameters; return ``(num_kv_heads, head_dim)``."""
    num_heads = _head_count("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _head_count("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_kv_heads must divide num_heads (grouped-query attention); "
            f"got num_heads {num_heads}, num_kv_heads {num_kv_heads}"
        )
    if len(_shape(z)) != 3:
        raise ValueError(f"z must have shape (batch, seqlen, d_model); got shape {_shape(z)}")
    d_model = _shape(z)[2]
    for name in ("w_q", "w_k", "w_v", "w_o"):
        w = getattr(params, name)
        if len(_shape(w)) != 2:
            raise ValueError(f"params.{name} must be a matrix; got shape {_shape(w)}")
    width_q = _shape(params.w_q)[1]
    if _shape(params.w_q)[0] != d_model or width_q % num_heads != 0 or width_q == 0:
        raise ValueError(
            f"params.w_q must have shape (d_model, num_heads * head_dim) = ({d_model}, {num_heads} * head_dim); "
            f"got {_shape(params.w_q)}"
        )
    head_dim = width_q // num_heads
    width_kv = num_kv_heads * head_dim
    expected = {
        "w_k": (d_model, width_kv),
        "w_v": (d_model, width_kv),
        "w_o": (width_q, _shape(params.w_o)[1]),
        "b_q": (width_q,),
        "b_k": (width_kv,),
        "b_v": (width_kv,),
        "b_o": (_shape(params.w_o)[1],),
    }
    for name, shape in expected.items():
        a = getattr(params, name)
        if a is not None and _shape(a) != shape:
            raise ValueError(
                f"params.{name} must have shape {shape} (d_model {d_model}, num_heads {num_heads}, "
                f"num_kv_heads {num_kv_heads}, head_dim {head_dim}); got {_shape(a)}"
            )
    for name, a in zip(MHAParams._fields, params):
        if a is not None and a.dtype != z.dtype:
            raise TypeError(f"params.{name} must have the dtype of z, {z.dtype}; got {a.dtype}")
    return num_kv_heads, head_dim


def _matmul(xp, a, b):
    """``a @ b`` in the operands' dtype. NumPy's matmul on ``ml_dtypes.bfloat16`` accumulates in and
    returns float32; rounding back keeps the whole layer in the caller's dtype (as the kernels do:
    accumulate in float32, store in the input dtype)."""
    c = xp.matmul(a, b)
    dtype = xp.result_type(a, b)
    return c if c.dtype == dtype else xp.astype(c, dtype)


def _column_sum(xp, x):
    """Sum over the rows of a matrix, accumulated in float32 (float64 for float64), in ``x``'s dtype.
    A bias gradient sums batch * seqlen rows; summed in bfloat16 it would stall at 256 ones."""
    acc = xp.float64 if x.dtype == xp.float64 else xp.float32
    s = xp.sum(x, axis=0, dtype=acc)
    return s if s.dtype == x.dtype else xp.astype(s, x.dtype)


def _affine(xp, x, w, b):
    """``x W + b`` over the last axis of ``x``; ``b`` may be ``None``."""
    y = _matmul(xp, x, w)
    return y if b is None else y + b


def init_mha_params(
    d_model: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    d_out: int | None = None,
    bias: bool = False,
    dtype=None,
    rng=None,
    xp=None,
) -> MHAParams:
    """Random parameters for a layer of ``num_heads`` query heads and ``num_kv_heads`` key/value heads.

    Each weight is drawn uniformly from ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` (the default of a linear
    layer in common frameworks); biases, when ``bias=True``, start at zero.

    Parameters
    ----------
    d_model : width of the layer input.
    num_heads, num_kv_heads : query heads H and key/value heads H' (default H; must divide H).
    head_dim : d, the width of one head; default ``d_model // num_heads`` (which must then divide).
    d_out : width of the layer output; default ``d_model``.
    bias : whether to create ``b_q, b_k, b_v, b_o``.
    dtype : dtype of every parameter; default float32.
    rng : ``numpy.random.Generator`` or seed; the values are drawn on the host by NumPy.
    xp : array namespace to place the parameters in (``numpy``, ``cupy``, ...); default NumPy.
    """
    d_model = _head_count("d_model", d_model)
    num_heads = _head_count("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _head_count("num_kv_heads", num_kv_heads)
    head_dim = None if head_dim is None else _head_count("head_dim", head_dim)
    d_out = None if d_out is None else _head_count("d_out", d_out)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_kv_heads must be a positive divisor of num_heads; "
            f"got num_heads {num_heads}, num_kv_heads {num_kv_heads}"
        )
    if head_dim is None:
        if d_model % num_heads != 0:
            raise ValueError(
                f"num_heads must divide d_model when head_dim is not given; got d_model {d_model}, "
                f"num_heads {num_heads}"
            )
        head_dim = d_model // num_heads
    d_out = d_model if d_out is None else d_out
    xp = np if xp is None else xp
    dtype = xp.float32 if dtype is None else dtype
    rng = np.random.default_rng(rng)

    def weight(fan_in, fan_out):
        bound = 1.0 / math.sqrt(fan_in)
        return xp.asarray(rng.uniform(-bound, bound, size=(fan_in, fan_out)), dtype=dtype)

    def zeros(width):
        return xp.zeros((width,), dtype=dtype) if bias else None

    width_q, width_kv = num_heads * head_dim, num_kv_heads * head_dim
    return MHAParams(
        w_q=weight(d_model, width_q),
        w_k=weight(d_model, width_kv),
        w_v=weight(d_model, width_kv),
        w_o=weight(width_q, d_out),
        b_q=zeros(width_q),
        b_k=zeros(width_kv),
        b_v=zeros(width_kv),
        b_o=zeros(d_out),
    )


def mha_forward(
    z,
    params: MHAParams,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    causal_align: str = "bottom-right",
    algorithm: str = "fa2",
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Any, MHACache]:
    """Multi-head self-attention ``Z̃^out = Concat(head_1, ..., head_H) W_O + b_O``.

    Parameters
    ----------
    z : array, shape (batch, seqlen, d_model)
        The layer input Z̃ (NumPy or CuPy, the dtype of the parameters).
    params : MHAParams
    num_heads : int
        H, the number of query heads; the head width is ``w_q.shape[1] // num_heads``.
    num_kv_heads : int, optional
        H', the number of key/value heads (grouped-query attention); default ``num_heads``.
    causal, softmax_scale, causal_align, algorithm, block_q, block_k :
        Passed to :func:`cuflash.attention` (``softmax_scale`` defaults to ``1 / sqrt(head_dim)``).

    Returns
    -------
    y : array, shape (batch, seqlen, d_out)
        Z̃^out.
    cache : MHACache
        Everything :func:`mha_backward` needs (see :class:`MHACache`).
    """
    xp = _namespace(z, params)
    num_kv_heads, head_dim = _check_layer(z, params, num_heads, num_kv_heads)
    batch, seqlen, _ = _shape(z)
    # The attention core checks these too, but only after the projections: check them first.
    _validate.softmax_scale(softmax_scale, head_dim)
    _validate.causal_options(causal, causal_align)
    _validate.algorithm(algorithm)
    _validate.block_size("block_q", block_q)
    _validate.block_size("block_k", block_k)

    # (6) Q = Z̃ W_Q + b_Q, K = Z̃ W_K + b_K, V = Z̃ W_V + b_V. Head h is the column block
    # [h*d, (h+1)*d): reshaping the last axis to (heads, d) splits the heads without a copy.
    q = xp.reshape(_affine(xp, z, params.w_q, params.b_q), (batch, seqlen, num_heads, head_dim))
    k = xp.reshape(_affine(xp, z, params.w_k, params.b_k), (batch, seqlen, num_kv_heads, head_dim))
    v = xp.reshape(_affine(xp, z, params.w_v, params.b_v), (batch, seqlen, num_kv_heads, head_dim))

    # (7)-(9) S = scale * Q_h K_g(h)^T, P = softmax(S), O_h = P V_g(h), for every head at once, block by
    # block; lse is what the backward needs to recompute P.
    options = dict(
        causal=causal,
        softmax_scale=softmax_scale,
        causal_align=causal_align,
        algorithm=algorithm,
        block_q=block_q,
        block_k=block_k,
    )
    out, lse = attention(q, k, v, return_lse=True, **options)

    # (10) Z̃^out = O W_O + b_O with O = [O_1 ... O_H], the heads side by side again.
    o_concat = xp.reshape(out, (batch, seqlen, num_heads * head_dim))
    y = _affine(xp, o_concat, params.w_o, params.b_o)
    return y, MHACache(z=z, q=q, k=k, v=v, out=out, lse=lse, options=options)


def mha_backward(
    dy,
    cache: MHACache,
    params: MHAParams,
    *,
    order: str | None = None,
    deterministic: bool = False,
) -> MHAGrads:
    """Gradients of the loss through :func:`mha_forward`, given ``dy = dL/dZ̃^out``.

    Parameters
    ----------
    dy : array, shape (batch, seqlen, d_out)
        Gradient of the loss with respect to the layer output.
    cache : MHACache
        The second result of :func:`mha_forward`.
    params : MHAParams
        The parameters the forward ran with.
    order, deterministic :
        Backward loop order of the attention core, passed to :func:`cuflash.attention_backward`.

    Returns
    -------
    MHAGrads
        ``dz`` and the gradient of every parameter (``None`` for an absent bias).
    """
    xp = _namespace(dy, params)
    z, q, k, v, out = cache.z, cache.q, cache.k, cache.v, cache.out
    batch, seqlen, num_heads, head_dim = _shape(q)
    num_kv_heads = _shape(k)[2]
    d_model, d_out = _shape(z)[2], _shape(params.w_o)[1]
    # The parameters must be the forward's: check them against the cache before any product.
    if _check_layer(z, params, num_heads, num_kv_heads)[1] != head_dim:
        raise ValueError(
            f"params.w_q must have shape {(d_model, num_heads * head_dim)} as in the forward; "
            f"got {_shape(params.w_q)}"
        )
    if _shape(dy) != (batch, seqlen, d_out):
        raise ValueError(
            f"dy must have the shape of the forward's output, {(batch, seqlen, d_out)}; got {_shape(dy)}"
        )
    if dy.dtype != out.dtype:
        raise TypeError(f"dy must have the dtype of the forward's output, {out.dtype}; got {dy.dtype}")
    _validate.backward_order(order, deterministic)
    # Every product below sums over the batch and sequence together: one (batch * seqlen)-row matrix.
    rows = batch * seqlen
    dy2 = xp.reshape(dy, (rows, d_out))

    # (10) Z̃^out = O W_O + b_O has the form of (9), O = P V, so (appendix, "Gradient with respect to
    # W_O and O"):  dW_O = O^T dZ̃^out,  dO = dZ̃^out W_O^T,  and db_O = column sums of dZ̃^out.
    o2 = xp.reshape(out, (rows, num_heads * head_dim))
    dw_o = _matmul(xp, o2.T, dy2)
    db_o = None if params.b_o is None else _column_sum(xp, dy2)
    do = xp.reshape(_matmul(xp, dy2, params.w_o.T), (batch, seqlen, num_heads, head_dim))

    # (7)-(9) backward per head: D = rowsum(dO * O), P recomputed from lse, dV = P^T dO, dP = dO V^T,
    # dS = P * (dP - D), dQ = scale * dS K, dK = scale * dS^T Q. With grouped-query attention dK and dV
    # of a key/value head already sum the contributions of every query head in its group.
    dq, dk, dv = attention_backward(
        do, q, k, v, out, cache.lse, order=order, deterministic=deterministic, **cache.options
    )

    # (6) Q = Z̃ W_Q + b_Q has the form of (9) again (appendix, "Gradients with respect to W_Q, W_K
    # and W_V"):  dW_Q = Z̃^T dQ,  dW_K = Z̃^T dK,  dW_V = Z̃^T dV;  db_Q = column sums of dQ, etc.
    z2 = xp.reshape(z, (rows, d_model))
    dq2 = xp.reshape(dq, (rows, num_heads * head_dim))
    dk2 = xp.reshape(dk, (rows, num_kv_heads * head_dim))
    dv2 = xp.reshape(dv, (rows, num_kv_heads * head_dim))
    z2_t = z2.T
    dw_q = _matmul(xp, z2_t, dq2)
    dw_k = _matmul(xp, z2_t, dk2)
    dw_v = _matmul(xp, z2_t, dv2)
    db_q = None if params.b_q is None else _column_sum(xp, dq2)
    db_k = None if params.b_k is None else _column_sum(xp, dk2)
    db_v = None if params.b_v is None else _column_sum(xp, dv2)

    # (84) Z̃ reaches the loss through row i of Q, K and V alike, so the three paths add:
    # dZ̃ = dQ W_Q^T + dK W_K^T + dV W_V^T.
    dz2 = _matmul(xp, dq2, params.w_q.T) + _matmul(xp, dk2, params.w_k.T) + _matmul(xp, dv2, params.w_v.T)
    dz = xp.reshape(dz2, (batch, seqlen, d_model))

    return MHAGrads(
        dz=dz, dw_q=dw_q, dw_k=dw_k, dw_v=dw_v, dw_o=dw_o, db_q=db_q, db_k=db_k, db_v=db_v, db_o=db_o
    )
