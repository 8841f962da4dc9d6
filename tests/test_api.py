"""The front door: every user-facing error, raised before any computation, with a message that names
the argument, what was expected and what was given."""

import re

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._ops import api as _api

from _helpers import small_qkv as _qkv


class _FakeDeviceArray:
    """Looks like a CuPy array to the validation (module name, shape, dtype, strides, device)."""

    __module__ = "cupy"

    class _Device:
        def __init__(self, id):
            self.id = id

    def __init__(self, like, device_id):
        self._a = like
        self.shape, self.ndim, self.dtype, self.size = like.shape, like.ndim, like.dtype, like.size
        self.strides, self.itemsize = like.strides, like.itemsize
        self.device = self._Device(device_id)

    def get(self):
        """The device-to-host copy (cupy.ndarray.get)."""
        return self._a


def test_wrong_rank(no_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(batch, seqlen, heads, head_dim\); got 3 dimensions with shape \(2, 5, 32\)"):
        cuflash.attention(q.reshape(2, 5, 32), k, v)
    with pytest.raises(ValueError, match=r"v must have 4 dimensions .* got 5 dimensions"):
        cuflash.attention(q, k, v[..., None])


def test_head_dims_differ(no_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=re.escape(
            "q and k must have the same head_dim (last axis; v's may differ); got q 4, k 8")):
        cuflash.attention(q[..., :4], k, v)
    with pytest.raises(ValueError, match=re.escape(
            "q and k must have the same head_dim (last axis; v's may differ); got q 8, k 4")):
        cuflash.attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match=re.escape("v's head_dim (last axis) must be positive; got 0")):
        cuflash.attention(q, k, v[..., :0])


def test_k_v_shapes_differ(no_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=re.escape(
            "k and v must have the same shape but for the last axis (v's head_dim may differ); "
            "got k (2, 7, 2, 8) and v (2, 6, 2, 4)")):
        cuflash.attention(q, k, v[:, :6, :, :4])


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
    with pytest.raises(TypeError, match=r"q must be an array \(a numpy.ndarray, or a cupy.ndarray for the CUDA kernels\); "
                                        r"got builtins.list; convert it with numpy.asarray"):
        cuflash.attention(q.tolist(), k.tolist(), v.tolist())


def test_different_devices(no_backend):
    q, k, v = (_FakeDeviceArray(a, 0) for a in _qkv())
    k = _FakeDeviceArray(k._a, 1)
    with pytest.raises(ValueError, match="q and k must be on the same device; got q on cuda:0 and k on cuda:1"):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("scale", [float("inf"), -float("inf"), float("nan")])
def test_bad_scale_value(no_backend, scale):
    with pytest.raises(ValueError, match=r"softmax_scale must be finite \(any sign; 0 gives uniform attention\); got"):
        cuflash.attention(*_qkv(), softmax_scale=scale)


def test_bad_scale_type(no_backend):
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None; got str"):
        cuflash.attention(*_qkv(), softmax_scale="0.1")


def test_unknown_algorithm(no_backend):
    with pytest.raises(ValueError, match=r"algorithm must be one of 'fa2', 'fa1', 'naive'; got 'fa3'"):
        cuflash.attention(*_qkv(), algorithm="fa3")


@pytest.mark.parametrize("value", ["3xtf32", "fp32", None, 1])
def test_unknown_fp32_precision(no_backend, value):
    with pytest.raises(ValueError, match=rf"fp32_precision must be one of 'tf32x3', 'fp16x3', 'tf32', 'ieee'; got {value!r}"):
        cuflash.attention(*_qkv(), fp32_precision=value)


def test_fp32_precision_leaves_numpy_in_ieee_float32():
    """NumPy arrays compute float32 in IEEE arithmetic whatever fp32_precision says (the option is the CUDA kernels')."""
    q, k, v = (x.astype(np.float32) for x in _qkv())
    outs = [cuflash.attention(q, k, v, causal=True, fp32_precision=p) for p in ("tf32x3", "fp16x3", "tf32", "ieee")]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


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


# ---------------------------------------------------------------------------------------------------
# Variant options: window_size, softcap, alibi_slopes, cu_seqlens / max_seqlen (packed batches), seqused_k
# ---------------------------------------------------------------------------------------------------


def _packed(lens_q=(3, 0, 4), lens_k=(5, 2, 6), heads_q=4, heads_kv=2, head_dim=8, seed=0):
    """Packed q, k, v and their cu_seqlens (int32)."""
    rng = np.random.default_rng(seed)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((int(cu_q[-1]), heads_q, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((int(cu_k[-1]), heads_kv, head_dim)).astype(np.float32) for _ in range(2))
    options = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return q, k, v, options


@pytest.mark.parametrize("value, error, message", [
    (5, TypeError, r"window_size must be a pair of integers \(left, right\), -1 for unlimited; got int 5"),
    ((1, 2, 3), ValueError, r"window_size must be a pair of integers .*; got 3 entries \(1, 2, 3\)"),
    ((1.5, -1), TypeError, r"window_size must be a pair of integers .*; got \(float 1.5, int -1\)"),
    ((True, 0), TypeError, r"window_size must be a pair of integers .*; got \(bool True, int 0\)"),
    ((-2, 0), ValueError, r"window_size entries must be >= -1 \(-1: unlimited on that side\); got \(-2, 0\)"),
])
def test_bad_window_size(no_backend, value, error, message):
    with pytest.raises(error, match=message):
        cuflash.attention(*_qkv(), window_size=value)


def test_bad_softcap(no_backend):
    with pytest.raises(TypeError, match=r"softcap must be a real number \(0 for none\); got str '1'"):
        cuflash.attention(*_qkv(), softcap="1")
    for value in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"softcap must be finite and >= 0 \(0 for none\); got"):
            cuflash.attention(*_qkv(), softcap=value)


def test_bad_alibi_slopes(no_backend):
    q, k, v = _qkv()  # batch 2, 4 query heads
    with pytest.raises(ValueError, match=re.escape(
            "alibi_slopes must have shape (heads_q,) = (4,) or (batch, heads_q) = (2, 4); got (2,)")):
        cuflash.attention(q, k, v, alibi_slopes=np.ones(2, np.float32))
    with pytest.raises(TypeError, match=r"alibi_slopes must have dtype float32 \(as flash-attention\); got float64"):
        cuflash.attention(q, k, v, alibi_slopes=np.ones(4))
    with pytest.raises(ValueError, match=r"alibi_slopes must have a contiguous last axis .*got strides \(32, 8\)"):
        cuflash.attention(q, k, v, alibi_slopes=np.ones((2, 8), np.float32)[:, ::2])
    with pytest.raises(TypeError, match=r"alibi_slopes must be an array \(a numpy.ndarray, or a cupy.ndarray for the "
                                        r"CUDA kernels\); got builtins.list; convert it with numpy.asarray"):
        cuflash.attention(q, k, v, alibi_slopes=[0.5] * 4)


def test_cu_seqlens_come_together_with_max_seqlen(no_backend):
    q, k, v, packed = _packed()
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_k must be given together "
                                         r"\(a packed variable-length batch\); got cu_seqlens_q without cu_seqlens_k"):
        cuflash.attention(q, k, v, cu_seqlens_q=packed["cu_seqlens_q"], max_seqlen_q=4, max_seqlen_k=6)
    with pytest.raises(ValueError, match="got cu_seqlens_k without cu_seqlens_q"):
        cuflash.attention(q, k, v, cu_seqlens_k=packed["cu_seqlens_k"])
    with pytest.raises(ValueError, match=r"max_seqlen_k is required with cu_seqlens_q and cu_seqlens_k "
                                         r"\(the longest sequence's length, as in flash_attn_varlen_func\); got None"):
        cuflash.attention(q, k, v, **{**packed, "max_seqlen_k": None})
    with pytest.raises(ValueError, match=r"max_seqlen_q is only used with cu_seqlens_q and cu_seqlens_k "
                                         r"\(a packed variable-length batch\); got max_seqlen_q=5 without them"):
        cuflash.attention(*_qkv(), max_seqlen_q=5)


def test_rank_follows_the_layout(no_backend):
    q, k, v, packed = _packed()
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total, heads, head_dim\) with cu_seqlens_q "
                                         r"and cu_seqlens_k; got 4 dimensions with shape \(1, 7, 4, 8\)"):
        cuflash.attention(q[None], k, v, **packed)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(batch, seqlen, heads, head_dim\); got 3 "
                                         r"dimensions with shape \(7, 4, 8\); packed \(total, heads, head_dim\) "
                                         r"arrays need cu_seqlens_q and cu_seqlens_k"):
        cuflash.attention(q, k, v)
    with pytest.raises(ValueError, match=r"must divide the number of query heads \(axis 1\); got 4 query heads and 3"):
        cuflash.attention(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1), **packed)


@pytest.mark.parametrize("name, value, error, message", [
    ("cu_seqlens_q", np.array([[0, 3], [3, 7]], np.int32), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\); got \(2, 2\)"),
    ("cu_seqlens_k", np.array([0, 5, 7, 13]), TypeError, "cu_seqlens_k must have dtype int32; got int64"),
    ("cu_seqlens_q", np.array([0, 0, 3, 3, 7, 7], np.int32)[::2], ValueError,
     r"cu_seqlens_q must be contiguous \(stride 4 bytes\); got strides \(8,\)"),
    ("cu_seqlens_q", np.zeros(0, np.int32), ValueError,
     r"cu_seqlens_q must have batch \+ 1 >= 1 entries, starting with 0; got shape \(0,\)"),
    ("cu_seqlens_q", np.array([2, 3, 3, 7], np.int32), ValueError, r"cu_seqlens_q must start at 0; got cu_seqlens_q\[0\] = 2"),
    ("cu_seqlens_k", np.array([0, 5, 3, 13], np.int32), ValueError,
     r"cu_seqlens_k must be non-decreasing \(sequence b is rows cu_seqlens_k\[b\]:cu_seqlens_k\[b \+ 1\]\); "
     r"got cu_seqlens_k\[2\] = 3 < cu_seqlens_k\[1\] = 5"),
    ("cu_seqlens_q", np.array([0, 3, 3, 6], np.int32), ValueError,
     r"cu_seqlens_q must end at the number of rows of q, 7; got cu_seqlens_q\[-1\] = 6"),
    ("cu_seqlens_k", np.array([0, 13], np.int32), ValueError,
     r"cu_seqlens_q and cu_seqlens_k must have the same length, batch \+ 1; got 4 and 2"),
    ("max_seqlen_q", 4.0, TypeError, "max_seqlen_q must be a positive integer; got float 4.0"),
    ("max_seqlen_q", 0, ValueError, "max_seqlen_q must be a positive integer; got 0"),
    ("max_seqlen_k", 5, ValueError, "max_seqlen_k must be at least the longest key sequence, 6; got 5"),
    ("max_seqlen_q", 3, ValueError, "max_seqlen_q must be at least the longest query sequence, 4; got 3"),
])
def test_bad_packed_batch(no_backend, name, value, error, message):
    q, k, v, packed = _packed()
    with pytest.raises(error, match=message):
        cuflash.attention(q, k, v, **{**packed, name: value})


def test_cu_seqlens_values_are_read_from_the_device(no_backend):
    """CuPy cu_seqlens are copied to the host to check their values (.get())."""
    q, k, v, packed = _packed()
    on_device = {name: _FakeDeviceArray(a, 0) for name, a in packed.items() if name.startswith("cu")}
    on_device["cu_seqlens_q"] = _FakeDeviceArray(np.array([0, 3, 2, 7], np.int32), 0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing .*got cu_seqlens_q\[2\] = 2"):
        cuflash.attention(*(_FakeDeviceArray(a, 0) for a in (q, k, v)), max_seqlen_q=4, max_seqlen_k=6, **on_device)
    with pytest.raises(TypeError, match=r"q and cu_seqlens_q must come from the same array library; got "
                                        r"numpy.ndarray for q and cupy._FakeDeviceArray for cu_seqlens_q"):
        cuflash.attention(q, k, v, **{**packed, "cu_seqlens_q": on_device["cu_seqlens_q"]})


def test_bad_seqused_k(no_backend):
    q, k, v = _qkv()  # batch 2, 7 keys
    with pytest.raises(ValueError, match=re.escape("seqused_k must have shape (batch,) = (2,); got (3,)")):
        cuflash.attention(q, k, v, seqused_k=np.array([1, 2, 3], np.int32))
    with pytest.raises(TypeError, match="seqused_k must have dtype int32; got uint32"):
        cuflash.attention(q, k, v, seqused_k=np.array([1, 2], np.uint32))
    with pytest.raises(ValueError, match=re.escape("seqused_k must lie in [0, seqlen_k] = [0, 7]; got seqused_k[1] = 8")):
        cuflash.attention(q, k, v, seqused_k=np.array([7, 8], np.int32))
    with pytest.raises(ValueError, match=re.escape("got seqused_k[0] = -1")):
        cuflash.attention(q, k, v, seqused_k=np.array([-1, 0], np.int32))
    q, k, v, packed = _packed()  # keys per sequence: 5, 2, 6
    with pytest.raises(ValueError, match=re.escape(
            "seqused_k[b] must lie in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]] (the keys of sequence b); "
            "got seqused_k[1] = 3 for a sequence of 2 keys")):
        cuflash.attention(q, k, v, seqused_k=np.array([5, 3, 0], np.int32), **packed)


def test_packed_backward_checks():
    q, k, v, packed = _packed()
    out, lse = cuflash.attention(q, k, v, return_lse=True, **packed)
    assert lse.shape == (4, 7)
    with pytest.raises(ValueError, match=re.escape("lse must have shape (heads, total_q) = (4, 7); got (1, 4, 7)")):
        cuflash.attention_backward(out, q, k, v, out, lse[None], **packed)
    with pytest.raises(ValueError, match=re.escape("do must have the shape of q, (7, 4, 8); got (6, 4, 8)")):
        cuflash.attention_backward(out[:6], q, k, v, out, lse, **packed)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must be given together"):
        cuflash.attention_backward(out, q, k, v, out, lse, cu_seqlens_q=packed["cu_seqlens_q"])


def test_backends_receive_the_variant(monkeypatch):
    """check_supported and forward get one normalized Variant (the backend interface of docs/architecture.md)."""
    calls = {}

    class Backend:
        @staticmethod
        def check_supported(problem, algorithm, variant):
            calls["check"] = (problem, algorithm, variant)

        @staticmethod
        def forward(q, k, v, *, scale, variant, algorithm, block_q, block_k, fp32_precision):
            calls["forward"] = variant
            return np.zeros(q.shape, q.dtype), np.zeros((4, q.shape[0]), np.float32)

    monkeypatch.setattr(_api, "_backend", lambda library: Backend)
    q, k, v, packed = _packed()
    cuflash.attention(q, k, v, causal=True, causal_align="top-left", window_size=(3, 5), softcap=2.5, **packed)
    problem, algorithm, variant = calls["check"]
    assert variant is calls["forward"] and algorithm == "fa2"
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.total_q, problem.total_k) == (3, 4, 6, 7, 13)
    assert (variant.causal, variant.bottom_right, variant.window_left, variant.window_right, variant.right) == (
        True, False, 3, 5, 0)
    assert variant.softcap == 2.5 and variant.is_varlen and (variant.max_seqlen_q, variant.max_seqlen_k) == (4, 6)
    assert variant.cu_seqlens_q is packed["cu_seqlens_q"] and variant.seqused_k is None
    cuflash.attention(*_qkv(), window_size=(-1, 2))
    assert calls["forward"].window_left is None and calls["forward"].window_right == 2


# ---------------------------------------------------------------------------------------------------
# bias and attn_mask
# ---------------------------------------------------------------------------------------------------

_SCORES = "(batch, heads_q, seqlen_q, seqlen_k) = (2, 4, 5, 7)"


@pytest.mark.parametrize("name, value, error, message", [
    ("bias", np.ones((2, 4, 5, 7), np.int32), TypeError,
     "bias must have a floating dtype (one of float16, bfloat16, float32, float64); got int32"),
    ("bias", np.ones((5, 7), bool), TypeError,
     "bias must have a floating dtype (one of float16, bfloat16, float32, float64); got bool; "
     "a boolean mask goes in attn_mask"),
    ("attn_mask", np.ones((5, 7), np.float32), TypeError,
     "attn_mask must have dtype bool (True: the key is seen, as in torch's scaled_dot_product_attention); "
     "got float32; an additive floating mask goes in bias"),
    ("bias", np.ones(7, np.float32), ValueError,
     f"bias must be broadcastable to {_SCORES}, with batch and heads_q full or 1 and seqlen_q, seqlen_k full "
     "(2-D (seqlen_q, seqlen_k) and 3-D (heads_q, seqlen_q, seqlen_k) arrays get leading axes of 1); "
     "got 1 dimensions with shape (7,)"),
    ("attn_mask", np.ones((1, 2, 4, 5, 7), bool), ValueError,
     f"attn_mask must be broadcastable to {_SCORES}, .*; got 5 dimensions with shape (1, 2, 4, 5, 7)"),
    ("bias", np.ones((3, 4, 5, 7), np.float32), ValueError, f"bias must be broadcastable to {_SCORES}, .*; got (3, 4, 5, 7)"),
    ("bias", np.ones((2, 5, 7), np.float32), ValueError, f"bias must be broadcastable to {_SCORES}, .*; got (2, 5, 7)"),
    ("attn_mask", np.ones((5, 1), bool), ValueError, f"attn_mask must be broadcastable to {_SCORES}, .*; got (5, 1)"),
    ("bias", np.ones((2, 4, 7, 5), np.float32), ValueError, f"bias must be broadcastable to {_SCORES}, .*; got (2, 4, 7, 5)"),
    ("bias", np.ones((5, 14), np.float32)[:, ::2], ValueError,
     r"bias must have a contiguous last axis (stride 4 bytes, one element); got strides (56, 8) for shape (5, 7)"),
    ("attn_mask", [[True] * 7] * 5, TypeError,
     "attn_mask must be an array (a numpy.ndarray, or a cupy.ndarray for the CUDA kernels); got builtins.list; "
     "convert it with numpy.asarray"),
])
def test_bad_bias_and_attn_mask(no_backend, name, value, error, message):
    pattern = ".*".join(re.escape(part) for part in message.split(".*"))
    with pytest.raises(error, match=pattern):
        cuflash.attention(*_qkv(), **{name: value})


def test_bias_and_attn_mask_need_padded_arrays(no_backend):
    q, k, v, packed = _packed()
    for given in (dict(bias=np.zeros((4, 6), np.float32)), dict(bias=np.zeros((4, 6), np.float32),
                                                                 attn_mask=np.ones((4, 6), bool))):
        names = " and ".join(given)
        with pytest.raises(ValueError, match=re.escape(
                f"{names} cannot be used with cu_seqlens_q and cu_seqlens_k: a packed batch has no (seqlen_q, seqlen_k) "
                "grid of scores; use padded (batch, seqlen, heads, head_dim) arrays (with seqused_k for key padding)")):
            cuflash.attention(q, k, v, **given, **packed)


def test_bias_on_another_device(no_backend):
    q, k, v = (_FakeDeviceArray(a, 0) for a in _qkv())
    bias = _FakeDeviceArray(np.zeros((5, 7), np.float32), 1)
    with pytest.raises(ValueError, match="q and bias must be on the same device; got q on cuda:0 and bias on cuda:1"):
        cuflash.attention(q, k, v, bias=bias)


def test_return_dbias_checks():
    q, k, v = _qkv()
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=re.escape(
            "return_dbias=True needs the bias whose gradient it returns; got bias=None")):
        cuflash.attention_backward(out, q, k, v, out, lse, return_dbias=True)
    with pytest.raises(TypeError, match="return_dbias must be a bool or None; got int 1"):
        cuflash.attention_backward(out, q, k, v, out, lse, bias=np.zeros((5, 7), np.float32), return_dbias=1)
    with pytest.raises(TypeError, match="attn_mask must have dtype bool"):
        cuflash.attention_backward(out, q, k, v, out, lse, attn_mask=np.zeros((5, 7), np.int8))


@pytest.mark.parametrize("keywords, error, message", [
    (dict(dropout_p=1.0, dropout_seed=0), ValueError,
     "dropout_p must lie in [0, 1) (the probability of zeroing a score); got 1.0"),
    (dict(dropout_p=-0.1, dropout_seed=0), ValueError,
     "dropout_p must lie in [0, 1) (the probability of zeroing a score); got -0.1"),
    (dict(dropout_p=True, dropout_seed=0), TypeError, "dropout_p must be a real number in [0, 1); got bool True"),
    (dict(dropout_p="0.1", dropout_seed=0), TypeError, "dropout_p must be a real number in [0, 1); got str '0.1'"),
    (dict(dropout_p=0.1), ValueError,
     "dropout_p=0.1 needs an explicit dropout_seed (an integer in [0, 2**64)), and the backward the same "
     "dropout_seed and dropout_offset, so that it regenerates the forward's mask; got dropout_seed=None"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed must be an integer in [0, 2**64); got -1"),
    (dict(dropout_p=0.1, dropout_seed=2**64), ValueError,
     f"dropout_seed must be an integer in [0, 2**64); got {2**64}"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed must be an integer in [0, 2**64); got float 1.5"),
    (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=-3), ValueError,
     "dropout_offset must be an integer in [0, 2**64); got -3"),
    (dict(dropout_offset=None), TypeError, "dropout_offset must be an integer in [0, 2**64); got NoneType None"),
])
def test_dropout_options(no_backend, keywords, error, message):
    q, k, v = _qkv()
    with pytest.raises(error, match=re.escape(message)):
        cuflash.attention(q, k, v, **keywords)
    out, lse = np.zeros_like(q), np.zeros((2, 4, 5), np.float32)
    with pytest.raises(error, match=re.escape(message)):
        cuflash.attention_backward(out, q, k, v, out, lse, **keywords)


def test_dropout_mask_checks():
    with pytest.raises(ValueError, match=re.escape(
            "shape must be 4 non-negative integers (batch, heads_q, seqlen_q, seqlen_k); got (2, 3)")):
        cuflash.dropout_mask((2, 3), 0.5, seed=1)
    with pytest.raises(ValueError, match=re.escape("dropout_p=0.5 needs an explicit dropout_seed")):
        cuflash.dropout_mask((1, 1, 2, 2), 0.5, seed=None)
    with pytest.raises(ValueError, match=re.escape("dropout_p must lie in [0, 1)")):
        cuflash.dropout_mask((1, 1, 2, 2), 1.5, seed=1)
