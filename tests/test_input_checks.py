"""The newcomer's findings of issue 13: None for an array, tensors on different devices, softmax_scale of 0
or below, NaN and infinities in the inputs. Every message names the argument, what was expected and what was
given; every refusal comes before any computation."""

import re
import types

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._ops import api as _api

from _helpers import small_qkv as _qkv

ARRAY_KINDS = "(a numpy.ndarray, or a cupy.ndarray for the CUDA kernels)"
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def _f64(a):
    return np.asarray(a, np.float64)


# ---------------------------------------------------------------------------------------------------
# None (or a list) for an array
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_none_for_an_array_of_the_forward(no_backend, name):
    arrays = dict(zip("qkv", _qkv()))
    arrays[name] = None
    # named first, before a bad option or a packed-batch mismatch would be
    with pytest.raises(TypeError, match=re.escape(f"{name} must be an array {ARRAY_KINDS}; got None")):
        cuflash.attention(**arrays, softmax_scale=float("nan"), cu_seqlens_q=np.zeros(3, np.int32))


@pytest.mark.parametrize("name", ["do", "q", "k", "v", "out", "lse"])
def test_none_for_an_array_of_the_backward(no_backend, name):
    q, k, v = _qkv()
    lse = np.zeros((2, 4, 5), np.float32)
    arrays = dict(do=np.zeros_like(q), q=q, k=k, v=v, out=np.zeros_like(q), lse=lse)
    arrays[name] = None
    with pytest.raises(TypeError, match=re.escape(f"{name} must be an array {ARRAY_KINDS}; got None")):
        cuflash.attention_backward(*arrays.values())


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache"])
def test_none_for_an_array_of_attention_with_kvcache(name):
    arrays = dict(q=np.zeros((1, 1, 2, 8), np.float32), k_cache=np.zeros((1, 4, 2, 8), np.float32),
                  v_cache=np.zeros((1, 4, 2, 8), np.float32))
    arrays[name] = None
    with pytest.raises(TypeError, match=re.escape(f"{name} must be an array {ARRAY_KINDS}; got None")):
        cuflash.attention_with_kvcache(*arrays.values(), cache_seqlens=1)


def test_none_for_an_array_of_merge_states():
    o, lse = np.zeros((1, 2, 3, 4)), np.zeros((1, 3, 2))
    with pytest.raises(TypeError, match=re.escape(f"lse_a must be an array {ARRAY_KINDS}; got None")):
        cuflash.merge_states(o, None, o, lse)


def test_a_scalar_for_an_optional_array_is_named(no_backend):
    with pytest.raises(TypeError, match=re.escape(f"alibi_slopes must be an array {ARRAY_KINDS}; got builtins.float")):
        cuflash.attention(*_qkv(), alibi_slopes=0.5)
    with pytest.raises(TypeError, match=re.escape(f"bias must be an array {ARRAY_KINDS}; got builtins.tuple; "
                                                  "convert it with numpy.asarray")):
        cuflash.attention(*_qkv(), bias=(0.0,))


# ---------------------------------------------------------------------------------------------------
# torch: None, and tensors on different devices
# ---------------------------------------------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("call, name", [("attention", "q"), ("attention", "k"), ("attention", "v"),
                                        ("attention_with_kvcache", "q"), ("attention_with_kvcache", "k_cache"),
                                        ("attention_with_kvcache", "v_cache")])
def test_torch_none_for_an_array(call, name):
    torch = _torch()
    import cuflash.torch as cft

    if call == "attention":
        arrays, options = dict(q=torch.zeros(1, 4, 2, 8), k=torch.zeros(1, 4, 2, 8), v=torch.zeros(1, 4, 2, 8)), {}
    else:
        arrays = dict(q=torch.zeros(1, 1, 2, 8), k_cache=torch.zeros(1, 4, 2, 8), v_cache=torch.zeros(1, 4, 2, 8))
        options = dict(cache_seqlens=1)
    arrays[name] = None
    with pytest.raises(TypeError, match=re.escape(f"{name} must be a torch.Tensor (CPU: the NumPy reference, CUDA: "
                                                  "the kernels); got None")):
        getattr(cft, call)(*arrays.values(), **options)


def _device_message(first, first_device, name, device):
    return re.escape(f"{first} and {name} must be on the same device (cuflash copies nothing between devices: CPU "
                     f"tensors run the NumPy reference, CUDA tensors the kernels); got {first} on {first_device} and "
                     f"{name} on {device}")


@pytest.mark.parametrize("name", ["k", "v", "bias", "alibi_slopes", "attn_mask", "seqused_k"])
def test_torch_tensors_on_different_devices(name):
    # meta tensors stand in for a second device (there is no GPU here): the front end names both
    torch = _torch()
    import cuflash.torch as cft

    q, k, v = (torch.zeros(1, 4, 2, 8) for _ in range(3))
    given = dict(k=k, v=v, bias=torch.zeros(1, 2, 4, 4), alibi_slopes=torch.zeros(2), attn_mask=torch.ones(4, 4, dtype=bool),
                 seqused_k=torch.full((1,), 4, dtype=torch.int32))
    given[name] = given[name].to("meta")
    keywords = {key: given[key] for key in ("bias", "alibi_slopes", "attn_mask", "seqused_k") if key == name}
    with pytest.raises(ValueError, match=_device_message("q", "cpu", name, "meta")):
        cft.attention(q, given["k"], given["v"], **keywords)


def test_torch_packed_lengths_on_another_device():
    torch = _torch()
    import cuflash.torch as cft

    q, k, v = (torch.zeros(4, 2, 8, device="meta") for _ in range(3))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=_device_message("q", "meta", "cu_seqlens_q", "cpu")):
        cft.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)


def test_torch_operator_checks_devices_too():
    # called directly, torch.ops.cuflash.attention_fwd names the devices (here through its fake implementation)
    torch = _torch()
    import cuflash.torch  # noqa: F401  (registers the operators)

    q, k, v = torch.zeros(1, 4, 2, 8, device="meta"), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    scalars = [False, None, "bottom-right", -1, -1, 0.0, None, None, 0.0, 0, None, None, "", "fa2", None, None, "tf32x3",
               False]
    with pytest.raises(ValueError, match=_device_message("q", "meta", "k", "cpu")):
        torch.ops.cuflash.attention_fwd(q, k, v, None, None, None, None, None, None, [], None, *scalars)


def test_torch_cuda_and_cpu_named():
    # the check reads .device only: a CUDA tensor stands in as an object with a CUDA device
    torch = _torch()
    import cuflash.torch as cft

    q = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=_device_message("q", "cuda:0", "k", "cpu")):
        cft._check_devices(q=q, k=torch.zeros(1), v=None)


# ---------------------------------------------------------------------------------------------------
# softmax_scale: any finite real
# ---------------------------------------------------------------------------------------------------


def _truth(q, k, v, scale, *, softcap=0.0, causal=False, slopes=None, bias=None):
    """float64 attention straight from the definitions, softcap applied to ``scale * q . k``."""
    q, k, v = (_f64(a) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = scale * np.einsum("bihd,bjhd->bhij", q, k)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    n, m = s.shape[-2:]
    i, j = np.arange(n)[:, None] + (m - n), np.arange(m)[None, :]
    if slopes is not None:
        s = s - slopes[None, :, None, None] * np.abs(i - j)
    if bias is not None:
        s = s + bias
    if causal:
        s = np.where(j > i, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, v)


@pytest.mark.parametrize("scale", [0.0, -0.0, -0.35, -3.0, 1e-30])
@pytest.mark.parametrize("variant", ["plain", "causal", "softcap", "alibi+bias"])
def test_non_positive_scales_match_the_definition(scale, variant):
    q, k, v = _qkv(dtype=np.float64)
    options = dict(causal=dict(causal=True), softcap=dict(softcap=1.5), plain={},
                   **{"alibi+bias": dict(alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32),
                                         bias=np.random.default_rng(1).standard_normal((5, 7)))})[variant]
    truth = _truth(q, k, v, scale, softcap=options.get("softcap", 0.0), causal=options.get("causal", False),
                   slopes=options.get("alibi_slopes"), bias=options.get("bias"))
    for algorithm in ("fa2", "fa1", "naive"):
        out = cuflash.attention(q, k, v, softmax_scale=scale, algorithm=algorithm, block_q=2, block_k=3, **options)
        np.testing.assert_allclose(out, truth, rtol=1e-12, atol=1e-12, err_msg=algorithm)


def test_scale_zero_is_uniform_attention_over_the_visible_keys():
    q, k, v = _qkv(seqlen_q=7, dtype=np.float64)
    out = cuflash.attention(q, k, v, softmax_scale=0.0, causal=True)
    v_full = np.repeat(v, 2, axis=2)
    counts = np.arange(1, 8)[None, :, None, None]
    np.testing.assert_allclose(out, np.cumsum(v_full, axis=1) / counts, rtol=1e-12)


@pytest.mark.parametrize("scale", [0.0, -0.6])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_non_positive_scales_against_torch(scale, softcap):
    # torch's scaled_dot_product_attention takes any finite scale: values and gradients agree (float64)
    torch = _torch()
    import cuflash.torch as cft

    q, k, v = (torch.tensor(a, requires_grad=True) for a in _qkv(heads_kv=4, dtype=np.float64))
    out = cft.attention(q, k, v, softmax_scale=scale, softcap=softcap, causal=True)
    if softcap:  # flash-attention's softcap: softcap * tanh(scale * q . k / softcap), before the softmax
        s = scale * torch.einsum("bihd,bjhd->bhij", q, k)
        s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(5)[:, None] + 2, torch.arange(7)[None, :]
        s = s.masked_fill(j > i, -torch.inf)
        truth = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)
    else:
        mask = torch.ones(5, 7, dtype=bool).tril(diagonal=2)
        truth = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale).transpose(1, 2)
    torch.testing.assert_close(out, truth)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    truths = torch.autograd.grad(truth, (q, k, v), do)
    for name, g, t in zip("qkv", grads, truths):
        torch.testing.assert_close(g, t, msg=lambda m, name=name: f"d{name}: {m}")


def test_non_positive_scales_in_jax():
    jax = pytest.importorskip("jax")
    import cuflash.jax as cfj

    q, k, v = (jax.numpy.asarray(a) for a in _qkv(heads_kv=4))

    def truth(q, k, v, scale):
        s = scale * jax.numpy.einsum("bihd,bjhd->bhij", q, k)
        return jax.numpy.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), v)

    for scale in (0.0, -0.8):
        np.testing.assert_allclose(cfj.attention(q, k, v, softmax_scale=scale), truth(q, k, v, scale), rtol=1e-5,
                                   atol=1e-6)
        grads = jax.grad(lambda q, k, v: (cfj.attention(q, k, v, softmax_scale=scale) ** 2).sum(), (0, 1, 2))(q, k, v)
        wants = jax.grad(lambda q, k, v: (truth(q, k, v, scale) ** 2).sum(), (0, 1, 2))(q, k, v)
        for g, w in zip(grads, wants):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_kvcache_takes_non_positive_scales():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 1, 4, 8))
    k_cache = rng.standard_normal((2, 6, 2, 8))
    v_cache = rng.standard_normal((2, 6, 2, 8))
    for scale in (0.0, -0.5):
        out = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=6, softmax_scale=scale)
        np.testing.assert_allclose(out, _truth(q, k_cache, v_cache, scale), rtol=1e-12)


@pytest.mark.parametrize("scale", [float("inf"), -float("inf"), float("nan")])
def test_scale_must_be_finite(no_backend, scale):
    with pytest.raises(ValueError, match=re.escape(f"softmax_scale must be finite (any sign; 0 gives uniform attention); "
                                                   f"got {scale!r}")):
        cuflash.attention(*_qkv(), softmax_scale=scale)


# The CUDA kernels take positive scales only (they keep raw scores and convert softcap, ALiBi and the bias with
# 1 / scale): the front door hands them -q or 0 * q with a positive scale. Checked here by routing the NumPy
# reference through the same mapping, which must change nothing.

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.0, -0.45])
@pytest.mark.parametrize("options", [
    dict(causal=True, softcap=2.0),
    dict(alibi_slopes=np.array([0.3, 0.1, 0.2, 0.05], np.float32), window_size=(3, 1)),
    dict(bias=np.linspace(-1, 1, 35, dtype=np.float32).reshape(5, 7), attn_mask=np.tri(5, 7, 2, dtype=bool)),
    dict(score_mod="score * 0.5 + (q_idx - kv_idx) * 0.01", causal=True),
    dict(dropout_p=0.25, dropout_seed=7),
], ids=["causal+softcap", "alibi+window", "bias+mask", "score_mod", "dropout"])
def test_positive_scale_mapping_is_exact(monkeypatch, dtype, scale, options):
    q, k, v = _qkv(dtype=dtype)
    do = np.random.default_rng(5).standard_normal((2, 5, 4, 8)).astype(dtype)
    out, lse = cuflash.attention(q, k, v, softmax_scale=scale, return_lse=True, **options)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, softmax_scale=scale, **options)
    monkeypatch.setattr(_api, "_POSITIVE_SCALE_ONLY", ("numpy",))
    seen = []
    forward = cuflash.reference.forward
    monkeypatch.setattr(cuflash.reference, "forward", lambda *a, **kw: seen.append(kw["scale"]) or forward(*a, **kw))
    out2, lse2 = cuflash.attention(q, k, v, softmax_scale=scale, return_lse=True, **options)
    grads2 = cuflash.attention_backward(do, q, k, v, out, lse, softmax_scale=scale, **options)
    assert seen == [-scale or 1.0]  # the backend saw a positive scale
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], (out, lse, *grads), (out2, lse2, *grads2)):
        np.testing.assert_allclose(_f64(b), _f64(a), rtol=1e-6, atol=1e-6, err_msg=name)
        assert b.dtype == a.dtype


def test_positive_scale_mapping_of_a_decode_call(monkeypatch):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
    caches = [rng.standard_normal((2, 9, 2, 8)).astype(np.float32) for _ in range(2)]
    k, v = (rng.standard_normal((2, 2, 2, 8)).astype(np.float32) for _ in range(2))
    cos, sin = np.cos(np.arange(24.0).reshape(12, 2)), np.sin(np.arange(24.0).reshape(12, 2))
    for scale in (0.0, -0.7):
        results = []
        for libraries in (("cupy",), ("numpy",)):
            monkeypatch.setattr(_api, "_POSITIVE_SCALE_ONLY", libraries)
            k_cache, v_cache = (c.copy() for c in caches)
            results.append(cuflash.attention_with_kvcache(
                q, k_cache, v_cache, k, v, cache_seqlens=5, rotary_cos=cos, rotary_sin=sin, causal=True,
                softmax_scale=scale, return_lse=True))
        for a, b in zip(*results):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.0, -0.125])
@pytest.mark.parametrize("options", [dict(causal=True, softcap=2.0), dict(alibi_slopes="heads", bias="full")],
                         ids=["causal+softcap", "alibi+bias"])
def test_non_positive_scales_on_the_gpu(requires_gpu, scale, options):
    """The kernels on the mapped call against the float64 truth with the error budget (test_cuda_variants)."""
    from test_cuda_variants import _inputs, _resolve, check_variant

    from _gpu_helpers import DTYPES as GPU_DTYPES

    rng = np.random.default_rng(11)
    q, k, v, do = _inputs(rng, (2, 300, 4, 64), (2, 333, 2, 64), GPU_DTYPES["bfloat16"])
    check_variant(requires_gpu, q, k, v, do, softmax_scale=scale, **_resolve(options, rng, 2, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_times_minus_one_and_zero_through_the_bits(dtype):
    a = np.array([1.5, -2.0, 0.0, -0.0, np.inf, -np.inf, np.nan], dtype)
    minus = _api._times(a, -1)
    np.testing.assert_array_equal(_f64(minus), -_f64(a))
    np.testing.assert_array_equal(np.signbit(_f64(minus[:4])), ~np.signbit(_f64(a[:4])))
    zero = _f64(_api._times(a, 0))
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(zero, 0 * _f64(a))  # 0 * inf and 0 * nan are nan
    np.testing.assert_array_equal(np.signbit(zero[:4]), np.signbit(_f64(a[:4])))
    assert _api._times(a, 0).dtype == a.dtype


# ---------------------------------------------------------------------------------------------------
# NaN and infinities: not scanned unless asked (check_finite=True, CUFLASH_CHECK_FINITE=1)
# ---------------------------------------------------------------------------------------------------


def _finite_message(name, expected, kind, index):
    return re.escape(f"{name} must be {expected}; got {kind} at {name}[{', '.join(map(str, index))}] "
                     f"(check_finite=True or CUFLASH_CHECK_FINITE=1 scans the inputs before any computation)")


def test_nan_propagates_without_the_check(monkeypatch):
    monkeypatch.delenv("CUFLASH_CHECK_FINITE", raising=False)
    q, k, v = _qkv()
    q[1, 2, 3, 4] = np.nan
    with np.errstate(invalid="ignore"):
        out = cuflash.attention(q, k, v)
    assert np.isnan(out[1, 2, 3]).all()  # the row of the NaN query (as IEEE arithmetic: every output of the row)
    assert np.isfinite(np.delete(out[1], 2, axis=0)).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, value, kind", [("q", np.nan, "nan"), ("k", np.inf, "inf"), ("v", -np.inf, "-inf")])
def test_check_finite_names_the_array_and_the_index(no_backend, dtype, name, value, kind):
    arrays = dict(zip("qkv", _qkv(dtype=dtype)))
    index = (1, 3, 1, 6) if name != "q" else (1, 2, 3, 4)
    arrays[name][index] = value
    arrays[name][1, 4, 1, 0] = value  # a later one: the first in C order is named
    with pytest.raises(ValueError, match=_finite_message(name, "finite", kind, index)):
        cuflash.attention(**arrays, check_finite=True)


def test_check_finite_through_the_environment(no_backend, monkeypatch):
    q, k, v = _qkv()
    v[0, 0, 0, 0] = np.nan
    monkeypatch.setenv("CUFLASH_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match=_finite_message("v", "finite", "nan", (0, 0, 0, 0))):
        cuflash.attention(q, k, v)


def test_check_finite_of_the_bias_and_slopes(no_backend):
    q, k, v = _qkv()
    bias = np.zeros((1, 4, 5, 7), np.float32)
    bias[0, 1, 2, :3] = -np.inf  # masks: allowed
    bias = np.broadcast_to(bias, (2, 4, 5, 7))  # a broadcast batch axis: its index 0 is named
    slopes = np.full(4, 0.1, np.float32)
    with pytest.raises(AssertionError, match="before the numpy backend"):  # passes the check, reaches the backend
        cuflash.attention(q, k, v, bias=bias, alibi_slopes=slopes, check_finite=True)
    bad = bias.copy()
    bad[1, 3, 4, 6] = np.inf
    with pytest.raises(ValueError, match=_finite_message("bias", "finite or -inf (which masks a score)", "inf",
                                                         (1, 3, 4, 6))):
        cuflash.attention(q, k, v, bias=bad, check_finite=True)
    bad = np.broadcast_to(np.where(np.arange(7) == 5, np.nan, 0).astype(np.float32), (5, 7))
    with pytest.raises(ValueError, match=_finite_message("bias", "finite or -inf (which masks a score)", "nan", (0, 5))):
        cuflash.attention(q, k, v, bias=bad, check_finite=True)
    slopes[2] = -np.inf
    with pytest.raises(ValueError, match=_finite_message("alibi_slopes", "finite", "-inf", (2,))):
        cuflash.attention(q, k, v, alibi_slopes=slopes, check_finite=True)


@pytest.mark.parametrize("name", ["do", "out", "lse"])
def test_check_finite_of_the_backward(name):
    q, k, v = _qkv()
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True, causal_align="top-left")
    arrays = dict(do=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse)
    lse_with_empty_row = lse.copy()
    lse_with_empty_row[0, 0, 0] = -np.inf  # a row that sees no key: allowed
    cuflash.attention_backward(*{**arrays, "lse": lse_with_empty_row}.values(), check_finite=True)
    arrays[name] = arrays[name].copy()
    arrays[name][(1, 2, 3) if name == "lse" else (1, 2, 3, 4)] = np.inf if name == "lse" else np.nan
    expected = "finite or -inf (a row that sees no key)" if name == "lse" else "finite"
    index, kind = ((1, 2, 3), "inf") if name == "lse" else ((1, 2, 3, 4), "nan")
    with pytest.raises(ValueError, match=_finite_message(name, expected, kind, index)):
        cuflash.attention_backward(*arrays.values(), check_finite=True)


def test_check_finite_must_be_a_bool(no_backend):
    with pytest.raises(TypeError, match=re.escape("check_finite must be a bool; got str 'yes'")):
        cuflash.attention(*_qkv(), check_finite="yes")


def test_check_finite_in_torch_through_the_environment(monkeypatch):
    torch = _torch()
    import cuflash.torch as cft

    q, k, v = (torch.tensor(a) for a in _qkv())
    k[0, 6, 1, 2] = torch.inf
    monkeypatch.setenv("CUFLASH_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match=_finite_message("k", "finite", "inf", (0, 6, 1, 2))):
        cft.attention(q, k, v)


def test_check_finite_in_jax_through_the_environment(monkeypatch):
    jax = pytest.importorskip("jax")
    import cuflash.jax as cfj

    q, k, v = _qkv()
    q[0, 1, 2, 3] = np.nan
    monkeypatch.setenv("CUFLASH_CHECK_FINITE", "1")
    with pytest.raises(ValueError, match=_finite_message("q", "finite", "nan", (0, 1, 2, 3))):
        cfj.attention(jax.numpy.asarray(q), jax.numpy.asarray(k), jax.numpy.asarray(v))
