"""cuflash.torch: the autograd wrapper against torch's own scaled_dot_product_attention.

CPU tensors run the NumPy block algorithm (always, in CI); CUDA tensors run the kernels (on a GPU only).
"""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cuflash.torch as cft  # noqa: E402

from _torch_truth import packed_lengths, sequence_scores  # noqa: E402


def _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device="cpu", seed=0):
    """q, k, v in torch's (B, H, N, d) layout, requiring grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda n, h: torch.randn(batch, h, n, head_dim, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = make(seqlen_q, heads_q), make(seqlen_k, heads_kv), make(seqlen_k, heads_kv)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def _sdpa(q, k, v, causal, gqa):
    """torch's attention on (B, H, N, d) tensors; is_causal there is aligned top-left."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _ours(q, k, v, causal, **kw):
    """cuflash on the same (B, H, N, d) tensors, passed as transposed (B, N, H, d) views."""
    out = cft.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        causal=causal, causal_align="top-left", **kw)
    return out.transpose(1, 2)


def _compare(shape, causal, dtype, tol, device="cpu", **kw):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    q, k, v = _inputs(*shape, dtype, device=device)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    do = torch.randn(batch, heads_q, seqlen_q, head_dim, dtype=torch.float64).to(device=device, dtype=dtype)
    ref = _sdpa(q, k, v, causal, heads_q != heads_kv)
    ref.backward(do)
    out = _ours(q2, k2, v2, causal, **kw)
    out.backward(do)
    for name, a, b in (("out", out, ref), ("dq", q2.grad, q.grad), ("dk", k2.grad, k.grad), ("dv", v2.grad, v.grad)):
        err = (a.double() - b.double()).abs().max().item()
        assert err <= tol, f"{name}: max |cuflash - torch| = {err:.3g} > {tol:g}"
        assert a.dtype == b.dtype and a.shape == b.shape


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
@pytest.mark.parametrize(
    "shape",
    [(2, 64, 64, 4, 4, 32), (1, 37, 75, 4, 2, 16), (2, 75, 37, 3, 1, 8)],
    ids=["square", "gqa-cross", "mqa-longer-q"],
)
def test_matches_sdpa_cpu(shape, causal, algorithm):
    _compare(shape, causal, torch.float64, 1e-10, algorithm=algorithm, block_q=16, block_k=24)
    _compare(shape, causal, torch.float32, 2e-5, algorithm=algorithm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_error_budget_cpu(dtype, causal):
    _compare_with_budget((1, 70, 90, 4, 2, 32), causal, dtype, device="cpu")


def test_gradcheck_cpu_float64():
    q, k, v = _inputs(1, 9, 13, 2, 1, 4, torch.float64, seed=3)
    fn = lambda q, k, v: cft.attention(q, k, v, causal=True, block_q=4, block_k=5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))


def test_bfloat16_cpu_roundtrip():
    q, k, v = _inputs(1, 40, 40, 2, 2, 16, torch.bfloat16, seed=5)
    out = _ours(q, k, v, causal=False)
    out.float().sum().backward()
    ref = _sdpa(q.double(), k.double(), v.double(), False, False)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() < 3e-2
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))


def test_return_lse_matches_logsumexp():
    q, k, v = _inputs(1, 17, 23, 2, 2, 8, torch.float64, seed=7)
    out, lse = cft.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), return_lse=True)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
    assert not lse.requires_grad


def test_rejects_non_tensors():
    q, k, v = _inputs(1, 4, 4, 1, 1, 4, torch.float32)
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor \(CPU: the NumPy reference, CUDA: the kernels\); "
                                        r"got numpy.ndarray"):
        cft.attention(q, k.detach().numpy(), v)


def test_double_backward_raises_instead_of_dropping_terms():
    # The backward runs outside autograd: a gradient taken with create_graph=True must not come back
    # as a constant, which would silently drop every term of a loss built from it.
    q, k, v = _inputs(1, 5, 5, 2, 2, 4, torch.float64, seed=11)
    out = _ours(q, k, v, causal=False)
    (dq,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        torch.autograd.grad((out**2).sum() + (dq**2).sum(), q)


def test_rejects_bad_deterministic_before_the_forward_runs():
    q, k, v = _inputs(1, 4, 4, 1, 1, 4, torch.float32)
    with pytest.raises(TypeError, match="deterministic must be a bool; got str"):
        cft.attention(q, k, v, deterministic="yes")


def _outputs_modifiable_in_place(device):
    """The operators' outputs are tensors of their own, not views of a buffer (autograd forbids modifying in place a
    view that a custom function returned, and a gradient is modified in place by every optimizer): out and lse,
    and the gradients, which in-place arithmetic then changes as it would any tensor."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in _inputs(1, 33, 40, 2, 1, 64, dtype, device))
        out, lse = cft.attention(q, k, v, causal=True, return_lse=True)
        assert out._base is None and lse._base is None
        out.float().sum().backward()
        for t in (q, k, v):
            assert t.grad._base is None
            before = t.grad.clone()
            t.grad.mul_(2)
            torch.testing.assert_close(t.grad, 2 * before)
        with torch.no_grad():
            out = cft.attention(q, k, v, causal=True)
            want = 3 * out
            out.mul_(3)  # an inference result, modified in place
            assert torch.equal(out, want)


def test_outputs_are_not_views_cpu():
    _outputs_modifiable_in_place("cpu")


@pytest.mark.gpu
def test_outputs_are_not_views_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    _outputs_modifiable_in_place("cuda")


def test_importing_cuflash_does_not_import_torch():
    code = "import sys, cuflash; assert 'torch' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_cuda(dtype, causal):
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for shape in [(2, 128, 128, 4, 4, 64), (1, 113, 203, 4, 2, 128)]:
        _compare_with_budget(shape, causal, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inference_calls_like_one_already_run_cuda(dtype, monkeypatch):
    """Inference calls (no gradient) of one layout: the first goes through the front door, the next ones with new
    tensors run its plan directly (cuflash.torch._forward_plans); each result, poisoned memory around it reused by
    torch's allocator, equals the full path's bit for bit and is within the budget of SDPA's against the float64
    truth; a call with grad wanted still differentiates."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    batch, n, heads_q, heads_kv, d = 2, 300, 8, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    through_front_door = []
    real = cft._forward_backend
    monkeypatch.setattr(cft, "_forward_backend", lambda *a, **kw: through_front_door.append(1) or real(*a, **kw))
    for step in range(3):
        q = torch.randn(batch, n, heads_q, d, device="cuda", generator=gen).to(dtype)
        k, v = (torch.randn(batch, n, heads_kv, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
        torch.full((batch, n, heads_q, d), float("nan"), device="cuda", dtype=dtype)  # (freed: poison for the next)
        with torch.no_grad():
            direct = cft.attention(q, k, v, causal=True)
            cft.DIRECT_CALLS = False
            try:
                full = cft.attention(q, k, v, causal=True)
            finally:
                cft.DIRECT_CALLS = True
        assert len(through_front_door) == step + 2  # (the full path's call each step, and the first direct one)
        assert torch.equal(direct, full), f"step {step}: the direct path differs from the full one"
        truth = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
        theirs = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                                enable_gqa=True).transpose(1, 2)
        floor = torch.finfo(dtype).eps * truth.abs().max().item()
        assert (direct.double() - truth).abs().max().item() <= 2 * (theirs.double() - truth).abs().max().item() + floor
    q.requires_grad_()
    cft.attention(q, k, v, causal=True).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _forward_backward(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _compare_with_budget(shape, causal, dtype, device):
    """Low precision: cuflash and torch's SDPA in the same dtype, each against the float64 truth.

    STYLE.md's budget: max|cuflash - truth| <= 2x (out) / 3x (grads) max|torch same dtype - truth| + one
    rounding of the truth to the dtype. Two low-precision results are never compared with each other.
    """
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    gqa = heads_q != heads_kv
    q, k, v = _inputs(*shape, torch.float64, device=device)
    do = torch.randn(batch, heads_q, seqlen_q, head_dim, dtype=torch.float64, device=device)
    low = [t.to(dtype) for t in (q, k, v, do)]
    truth = _forward_backward(lambda *a: _sdpa(*a, causal, gqa), *(t.double() for t in low))
    theirs = _forward_backward(lambda *a: _sdpa(*a, causal, gqa), *low)
    ours = _forward_backward(lambda *a: _ours(*a, causal), *low)
    eps = torch.finfo(dtype).eps
    for name, factor, o, t, x in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), ours, theirs, truth):
        assert o.dtype == dtype and o.shape == x.shape
        err_ours = (o.double() - x).abs().max().item()
        err_theirs = (t.double() - x).abs().max().item()
        floor = eps * x.abs().max().item()
        assert err_ours <= factor * err_theirs + floor, (
            f"{name}: max|cuflash - truth| = {err_ours:.3g} > {factor} x max|torch {dtype} - truth| "
            f"({err_theirs:.3g}) + {floor:.3g}")


# ---------------------------------------------------------------------------------------------------
# Variants: a packed batch (causal, window, softcap, ALiBi, GQA) and key padding, against plain torch
# ---------------------------------------------------------------------------------------------------


def _torch_variant_attention(q, k, v, cu_q, cu_k, *, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
                             seqused_k=None):
    """float64 attention of docs/variants.md in plain torch, one sequence of the packed arrays at a time;
    torch's autograd gives its gradients. Rows that see no key output 0."""
    outs = []
    for b in range(len(cu_q) - 1):
        len_k = int(cu_k[b + 1] - cu_k[b]) if seqused_k is None else int(seqused_k[b])
        keys = slice(int(cu_k[b]), int(cu_k[b]) + len_k)
        s, visible, vb = sequence_scores(q[cu_q[b]:cu_q[b + 1]], k[keys], v[keys], scale=scale, causal=causal,
                                         window=window, softcap=softcap, slopes=None if slopes is None else slopes[b])
        p = torch.softmax(torch.where(visible, s, -1e30), dim=-1) * visible  # 0 for a row that sees nothing
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
    return torch.cat(outs)


@pytest.mark.parametrize("case", ["packed-causal-window-softcap-alibi", "padded-seqused-alibi"])
def test_variants_match_plain_torch_cpu(case):
    g = torch.Generator().manual_seed(13)
    slopes = torch.rand(3, 4, generator=g, dtype=torch.float32) * 0.3
    if case.startswith("packed"):
        cu_q, cu_k = packed_lengths([9, 1, 14]), packed_lengths([12, 5, 14])
        q = torch.randn(int(cu_q[-1]), 4, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(int(cu_k[-1]), 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        ours_kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=14, max_seqlen_k=14, causal=True,
                       window_size=(4, -1), softcap=2.0, alibi_slopes=slopes)
        ref_kw = dict(causal=True, window=(4, -1), softcap=2.0, slopes=slopes)
        to_packed = from_packed = lambda t: t  # noqa: E731
    else:
        q = torch.randn(3, 10, 4, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(3, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        used = torch.tensor([16, 3, 0], dtype=torch.int32)
        ours_kw = dict(seqused_k=used, alibi_slopes=slopes[0], causal=True)
        ref_kw = dict(seqused_k=used, slopes=slopes[:1].expand(3, 4), causal=True)
        cu_q, cu_k = torch.arange(0, 31, 10), torch.arange(0, 49, 16)
        to_packed = lambda t: t.flatten(0, 1)  # noqa: E731
        from_packed = lambda t: t.unflatten(0, (3, -1))  # noqa: E731
    do = torch.randn(q.shape, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cft.attention(*leaves, softmax_scale=0.4, block_q=4, block_k=3, **ours_kw)
    out.backward(do)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = from_packed(_torch_variant_attention(*(to_packed(t) for t in ref_leaves), cu_q, cu_k, scale=0.4, **ref_kw))
    ref.backward(do)
    assert out.shape == q.shape
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), (ref, *(t.grad for t in ref_leaves))):
        err = (a - b).abs().max().item()
        assert err < 1e-10, f"{name}: max |cuflash - torch| = {err:.3g}"


def test_variants_gradcheck_cpu_float64():
    cu = packed_lengths([4, 6])
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(10, 2, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.3, 0.7])

    def fn(q, k, v):
        return cft.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6, causal=True,
                             window_size=(2, -1), softcap=1.5, alibi_slopes=slopes.float(), block_q=2, block_k=3)

    assert torch.autograd.gradcheck(fn, (q, k, v))
    out, lse = cft.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6,
                             return_lse=True)
    assert lse.shape == (2, 10) and lse.dtype == torch.float64 and not lse.requires_grad


# ---------------------------------------------------------------------------------------------------
# bias (with its gradient) and attn_mask, against plain torch autograd in float64
# ---------------------------------------------------------------------------------------------------


def _torch_biased_attention(q, k, v, bias, attn_mask, *, scale, causal, softcap):
    """float64 attention of docs/variants.md in plain torch on (B, H, N, d) tensors: softcap, then the bias,
    then the causal (bottom-right) and boolean masks. Rows that see no key output 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s + bias
    len_q, len_k = s.shape[-2:]
    visible = attn_mask & (torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + len_k - len_q
                           if causal else True)
    p = torch.softmax(torch.where(visible, s, -1e30), dim=-1) * visible
    return p @ v


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("causal, softcap", [(False, 0.0), (True, 3.0)])
def test_bias_and_mask_match_plain_torch_cpu(dtype, tol, causal, softcap):
    g = torch.Generator().manual_seed(23)
    batch, heads_q, heads_kv, len_q, len_k, d = 2, 4, 2, 11, 14, 8
    q = torch.randn(batch, heads_q, len_q, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, heads_kv, len_k, d, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(1, heads_q, len_q, len_k, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, 1, len_q, len_k, generator=g) < 0.7
    mask[1, 0, 4] = False  # a row that sees no key
    do = torch.randn(batch, heads_q, len_q, d, generator=g, dtype=torch.float64)
    ours = [t.to(dtype).clone().requires_grad_() for t in (q, k, v, bias)]
    out = cft.attention(*(t.transpose(1, 2) for t in ours[:3]), bias=ours[3], attn_mask=mask, causal=causal,
                        softcap=softcap, softmax_scale=0.3, block_q=4, block_k=5).transpose(1, 2)
    out.backward(do.to(dtype))
    ref = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    expected = _torch_biased_attention(*ref, mask, scale=0.3, causal=causal, softcap=softcap)
    expected.backward(do)
    assert not out[1, :, 4].any() and not ours[3].grad[0, :, 4][mask[1, 0, 4].expand(4, -1)].any()
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), (out, *(t.grad for t in ours)),
                          (expected, *(t.grad for t in ref))):
        assert a.dtype == dtype and a.shape == b.shape
        err = (a.double() - b).abs().max().item()
        assert err < tol, f"{name}: max |cuflash - torch| = {err:.3g}"


def test_bias_gradcheck_cpu_float64():
    g = torch.Generator().manual_seed(29)
    q = torch.randn(1, 5, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 6, 1, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 6, generator=g) < 0.8

    def fn(q, k, v, bias):
        return cft.attention(q, k, v, bias=bias, attn_mask=mask, softcap=2.0, window_size=(3, 1), block_q=2, block_k=4)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_dbias_only_when_bias_requires_grad(monkeypatch):
    asked = []
    real = cft.cuflash.attention_backward

    def spy(*args, return_dbias=None, **kwargs):
        asked.append(return_dbias)
        return real(*args, return_dbias=return_dbias, **kwargs)

    monkeypatch.setattr(cft.cuflash, "attention_backward", spy)
    q, k, v = (t.transpose(1, 2) for t in _inputs(1, 6, 6, 2, 2, 4, torch.float32))
    bias = torch.randn(2, 6, 6)
    cft.attention(q, k, v, bias=bias).sum().backward()
    cft.attention(q, k, v, bias=bias.requires_grad_()).sum().backward()
    assert asked == [False, True] and bias.grad.shape == bias.shape
    with pytest.raises(TypeError, match="bias must be a torch.Tensor \\(on the device of q\\) or None; got ndarray"):
        cft.attention(q, k, v, bias=bias.detach().numpy())


def test_fp32_precision_reaches_the_front_door_and_not_the_backward():
    """``fp32_precision`` is cuflash.attention's (CPU tensors: the NumPy reference computes IEEE float32 whatever it
    says; the backward has none): every value gives the default's output and gradients, a bad one is refused in the
    front door's words before anything runs."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=g, requires_grad=True) for _ in range(3))
    ref = cft.attention(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for precision in ("tf32x3", "fp16x3", "tf32", "ieee"):
        out = cft.attention(q, k, v, causal=True, fp32_precision=precision)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    with pytest.raises(ValueError, match="fp32_precision must be one of 'tf32x3', 'fp16x3', 'tf32', 'ieee'; got 'x'"):
        cft.attention(q, k, v, fp32_precision="x")


def test_direct_call_keys_name_the_thread_on_the_per_thread_default_stream(monkeypatch):
    """cuflash.torch's keys of calls it runs straight from a kept plan or launch (forward and decode) name the thread
    where the stream's handle is 2 (CUDA's per-thread default stream: a stream per thread, so the plans' workspaces
    must not be shared), and not on another stream. (CPU tensors posing as CUDA ones on device 0.)"""
    import threading

    import cuflash.torch as ct

    monkeypatch.setattr(ct, "_gpu_index", lambda t: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q = torch.zeros(1, 4, 8, 64, dtype=torch.float16)
    k = torch.zeros(1, 16, 2, 64, dtype=torch.float16)

    def keys():
        got = []

        def make():
            got.append((ct._forward_key(q, k, k, True, None, "bottom-right", (-1, -1), 0.0, None, None, 0.0, None, 0,
                                        "fa2", None, None, "tf32x3"),
                        ct._decode_key(q[:, :1], k, k, 16, None, None, True, True, (-1, -1), 0.0, None, 0)))

        make()
        worker = threading.Thread(target=make)
        worker.start()
        worker.join()
        return got

    with torch.no_grad():
        for handle, per_thread in ((2, True), (7, False)):
            monkeypatch.setattr(ct, "_stream_address", lambda index, handle=handle: handle)
            (mine_fwd, mine_dec), (theirs_fwd, theirs_dec) = keys()
            assert None not in (mine_fwd, mine_dec, theirs_fwd, theirs_dec)
            assert (mine_fwd != theirs_fwd) == per_thread and (mine_dec != theirs_dec) == per_thread, handle
