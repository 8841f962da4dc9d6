"""The front door: every user-facing error, raised before any computation, with a message that names
the argument, what was expected and what was given."""

import re

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _api


def _qkv(batch=2, seqlen_q=5, seqlen_k=7, heads_q=4, heads_kv=2, head_dim=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dtype)
    return q, k, v


@pytest.fixture
def no_backend(monkeypatch):
    """Fail the test if validation lets a call reach a backend."""

    def refuse(library):
        raise AssertionError(f"validation should have failed before the {library} backend was chosen")

    monkeypatch.setattr(_api, "_backend", refuse)


class _FakeDeviceArray:
    """Looks like a CuPy array to the validation (module name, shape, dtype, strides, device)."""

    __module__ = "cupy"

    class _Device:
        def __init__(self, id):
            self.id = id

    def __init__(self, like, device_id):
        self._a = like
        self.shape, self.ndim, self.dtype = like.shape, like.ndim, like.dtype
        self.strides, self.itemsize = like.strides, like.itemsize
        self.device = self._Device(device_id)


def test_wrong_rank(no_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(batch, seqlen, heads, head_dim\); got 3 dimensions with shape \(2, 5, 32\)"):
        cuflash.attention(q.reshape(2, 5, 32), k, v)
    with pytest.raises(ValueError, match=r"v must have 4 dimensions .* got 5 dimensions"):
        cuflash.attention(q, k, v[..., None])


def test_head_dims_differ(no_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"same head_dim \(last axis\); got q 4, k and v 8"):
        cuflash.attention(q[..., :4], k, v)


def test_k_v_shapes_differ(no_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=re.escape("k and v must have the same shape; got k (2, 7, 2, 8) and v (2, 6, 2, 8)")):
        cuflash.attention(q, k, v[:, :6])


def test_batch_differs(no_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"same batch size \(axis 0\); got q 1, k 2"):
        cuflash.attention(q[:1], k, v)


def test_dtypes_differ(no_backend):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="same dtype; got q float32, k float16, v float32"):
        cuflash.attention(q, k.astype(np.float16), v)


def test_dtypes_differ_in_byte_order_only():
    # The messages named the dtypes only ("got q float32, k float32, v float32"), which hid the difference.
    swapped = np.dtype(np.float32).newbyteorder()
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"same dtype; got q float32, k float32 \(non-native byte order\), v float32"):
        cuflash.attention(q, k.astype(swapped), v)
    do, q, k, v, out, lse = _backward_args()
    with pytest.raises(TypeError, match=r"do must have the dtype of q, float32; got float32 \(non-native byte order\)"):
        cuflash.attention_backward(do.astype(swapped), q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"lse must have dtype float32 for float32 inputs .*; got float32 \(non-native byte order\)"):
        cuflash.attention_backward(do, q, k, v, out, lse.astype(swapped))


def test_dtype_not_floating(no_backend):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must have a floating dtype .*; got int32"):
        cuflash.attention(q.astype(np.int32), k.astype(np.int32), v.astype(np.int32))
    with pytest.raises(TypeError, match="k must have a floating dtype .*; got complex64"):
        cuflash.attention(q, k.astype(np.complex64), v)


def test_heads_kv_must_divide_heads_q(no_backend):
    q, k, v = _qkv(heads_q=6, heads_kv=4)
    with pytest.raises(ValueError, match="must divide the number of query heads .*; got 6 query heads and 4 key/value heads"):
        cuflash.attention(q, k, v)


def test_last_axis_must_be_contiguous(no_backend):
    q, k, v = _qkv(head_dim=16)
    with pytest.raises(ValueError, match=r"k must have a contiguous last axis .*got strides"):
        cuflash.attention(q[..., ::2].copy(), k[..., ::2], v[..., ::2].copy())


def test_different_libraries(no_backend):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q and v must come from the same array library; got numpy.ndarray for q and cupy._FakeDeviceArray for v"):
        cuflash.attention(q, k, _FakeDeviceArray(v, 0))
    with pytest.raises(TypeError, match=r"q must be a numpy.ndarray or cupy.ndarray; got builtins.list"):
        cuflash.attention(q.tolist(), k.tolist(), v.tolist())


def test_different_devices(no_backend):
    q, k, v = (_FakeDeviceArray(a, 0) for a in _qkv())
    k = _FakeDeviceArray(k._a, 1)
    with pytest.raises(ValueError, match="q and k must be on the same device; got q on cuda:0 and k on cuda:1"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale_value(no_backend, scale):
    with pytest.raises(ValueError, match="softmax_scale must be finite and positive; got"):
        cuflash.attention(*_qkv(), softmax_scale=scale)


def test_bad_scale_type(no_backend):
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None; got str"):
        cuflash.attention(*_qkv(), softmax_scale="0.1")


def test_unknown_algorithm(no_backend):
    with pytest.raises(ValueError, match=r"algorithm must be one of 'fa2', 'fa1', 'naive'; got 'fa3'"):
        cuflash.attention(*_qkv(), algorithm="fa3")


def test_unknown_causal_align(no_backend):
    with pytest.raises(ValueError, match=r"causal_align must be one of 'bottom-right', 'top-left'; got 'diagonal'"):
        cuflash.attention(*_qkv(), causal=True, causal_align="diagonal")


def test_causal_must_be_bool(no_backend):
    with pytest.raises(TypeError, match="causal must be a bool; got str 'yes'"):
        cuflash.attention(*_qkv(), causal="yes")


@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("value", [0, -3])
def test_block_size_not_positive(no_backend, name, value):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer or None; got {value}"):
        cuflash.attention(*_qkv(), **{name: value})


@pytest.mark.parametrize("value", [2.0, True, "16"])
def test_block_size_not_integer(no_backend, value):
    with pytest.raises(TypeError, match="block_k must be a positive integer or None; got"):
        cuflash.attention(*_qkv(), block_k=value)


def _backward_args(seed=1):
    q, k, v = _qkv(seed=seed)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    do = np.random.default_rng(seed + 1).standard_normal(q.shape).astype(q.dtype)
    return do, q, k, v, out, lse


def test_backward_shape_and_dtype_checks():
    do, q, k, v, out, lse = _backward_args()
    with pytest.raises(ValueError, match=r"do must have the shape of q, \(2, 5, 4, 8\); got \(2, 4, 4, 8\)"):
        cuflash.attention_backward(do[:, :4], q, k, v, out, lse)
    with pytest.raises(TypeError, match="out must have the dtype of q, float32; got float64"):
        cuflash.attention_backward(do, q, k, v, out.astype(np.float64), lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads, seqlen_q\) = \(2, 4, 5\); got \(2, 5, 4\)"):
        cuflash.attention_backward(do, q, k, v, out, lse.transpose(0, 2, 1))
    with pytest.raises(TypeError, match="lse must have dtype float32 for float32 inputs .*; got float16"):
        cuflash.attention_backward(do, q, k, v, out, lse.astype(np.float16))


def test_backward_order_checks():
    args = _backward_args()
    with pytest.raises(ValueError, match=r"order must be None or one of 'kv_outer', 'q_outer', 'split'; got 'ij'"):
        cuflash.attention_backward(*args, order="ij")
    with pytest.raises(ValueError, match=r"deterministic=True runs the 'split' order .*; got order='kv_outer'"):
        cuflash.attention_backward(*args, order="kv_outer", deterministic=True)


def test_torch_like_input_points_to_the_wrapper(no_backend):
    class Tensor:
        __module__ = "torch"

    with pytest.raises(TypeError, match=r"use cuflash.torch.attention"):
        cuflash.attention(Tensor(), Tensor(), Tensor())


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize(
    "shape_q, shape_kv",
    [((0, 5, 4, 8), (0, 7, 2, 8)), ((2, 0, 4, 8), (2, 7, 2, 8)), ((2, 5, 4, 8), (2, 0, 2, 8))],
)
def test_empty_inputs(dtype, shape_q, shape_kv):
    rng = np.random.default_rng(3)
    q = rng.standard_normal(shape_q).astype(dtype)
    k, v = (rng.standard_normal(shape_kv).astype(dtype) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (shape_q[0], shape_q[2], shape_q[1])
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv = cuflash.attention_backward(q, q, k, v, out, lse, causal=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert np.all(dq == 0)


def test_return_lse_flag():
    q, k, v = _qkv()
    out = cuflash.attention(q, k, v)
    out2, lse = cuflash.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, out2)
    assert lse.shape == (2, 4, 5)
