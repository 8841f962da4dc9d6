"""cuflash.torch on CUDA tensors: one memory pool (torch's), torch's current stream, CUDA graphs.

- Memory: a forward and backward hold nothing in CuPy's memory pool; outputs and workspaces come from torch's
  caching allocator (torch's peak covers the float32 workspaces dq_accum and dkv_accum), and torch's allocated
  memory returns to its starting value once the results are freed.
- CUDA graphs: ``torch.cuda.CUDAGraph`` (capture_error_mode "global": a synchronization, a host read of device
  memory or an allocation outside torch's allocator during the capture raises) captures a forward, and a forward
  and backward, through ``cuflash.torch.attention``; replays after new values were copied into the static inputs
  equal eager calls on those values; CuPy's pool is not touched by capture or replay. What a replay could not
  repeat (dropout's seed, packed batches, bias, masks) is refused with ``NotImplementedError`` naming it. The
  decode operator ``cuflash::attention_with_kvcache`` replays decode steps (append and attention) bit for bit.
  (torch.compile's mode="reduce-overhead" and the capture of the issue's own example are in
  ``tests/test_torch_compile.py``.)

Every test needs CuPy, a CUDA device (the ``gpu`` marker, conftest.py) and a CUDA build of torch; all skip
cleanly otherwise.
"""

import pytest

torch = pytest.importorskip("torch")

import cuflash.torch as cft  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp(requires_gpu):
    """CuPy, with torch seeing the GPU too (a CPU build of torch beside CuPy skips)."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return requires_gpu


def _rand(g, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(device="cuda", dtype=dtype)


def _pool_state(cp):
    pool = cp.get_default_memory_pool()
    return pool.used_bytes(), pool.total_bytes()


def _warm_up(fn, iterations=2):
    """Run ``fn`` on a side stream first, as torch asks before a capture (kernels compiled, caches filled)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------
# One memory pool
# ---------------------------------------------------------------------------------------------------

# (batch, seqlen, heads_q, heads_kv, head_dim, dtype, keywords); a bias case (dbias in float32, the parameter
# block of the variant) and a head dim that runs on padded copies (head dim 80 on the kernels of 96).
MEMORY_CASES = {
    "gqa-causal-bf16-d128": (2, 1024, 16, 4, 128, torch.bfloat16, dict(causal=True)),
    "bias-fp16-d64": (2, 512, 8, 8, 64, torch.float16, dict(bias=(1, 8, 512, 512))),
    "headdim80-gqa-fp16": (2, 640, 8, 2, 80, torch.float16, dict(causal=True, window_size=(100, 0))),
}


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_forward_and_backward_take_memory_from_torch_not_cupy(cp, case):
    batch, n, hq, hkv, d, dtype, kw = MEMORY_CASES[case]
    g = torch.Generator().manual_seed(1)
    q = _rand(g, batch, n, hq, d, dtype=dtype).requires_grad_()
    k, v = (_rand(g, batch, n, hkv, d, dtype=dtype).requires_grad_() for _ in range(2))
    do = _rand(g, batch, n, hq, d, dtype=dtype)
    if "bias" in kw:
        kw["bias"] = _rand(g, *kw["bias"], dtype=torch.float32).requires_grad_()
    leaves = [q, k, v, *(t for t in kw.values() if isinstance(t, torch.Tensor))]

    def step():
        out = cft.attention(q, k, v, **kw)
        out.backward(do)
        return out

    step()  # kernels compiled and loaded, first launches
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    pool = _pool_state(cp)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    assert _pool_state(cp) == pool, f"CuPy's pool grew: (used, total) {pool} -> {_pool_state(cp)}"
    # The backward's float32 workspaces (dq_accum, and dkv_accum under GQA, at the kernel's head dim) were live
    # together with out: torch's peak covers them only if they came from torch's allocator.
    kd = next(x for x in (32, 64, 96, 128, 256) if x >= d)
    workspaces = batch * hq * n * kd * 4 * (1 + (2 if hkv < hq else 0))
    peak = torch.cuda.max_memory_allocated() - start
    assert peak >= workspaces + out.numel() * out.element_size(), (peak, workspaces)
    assert out.dtype == dtype and out.is_contiguous() and q.grad.is_contiguous() and q.grad.dtype == dtype
    del out
    for t in leaves:
        t.grad = None
    assert torch.cuda.memory_allocated() == start, "memory still held after the results were freed"


def test_results_are_torch_allocations_on_the_current_stream(cp):
    """Work queued on a side stream before the call (q written there) is seen by the kernels, which run on that
    stream: no synchronization with the default stream is needed, and none is added."""
    g = torch.Generator().manual_seed(2)
    q0, k, v = _rand(g, 1, 2048, 8, 64), _rand(g, 1, 2048, 8, 64), _rand(g, 1, 2048, 8, 64)
    want = cft.attention(q0, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # hold the side stream: a kernel on another stream would read q too early
        q = q0 * 1  # written on the side stream, after the sleep
        out = cft.attention(q, k, v, causal=True)
    side.synchronize()
    assert torch.equal(out, want)


# ---------------------------------------------------------------------------------------------------
# torch.cuda.CUDAGraph
# ---------------------------------------------------------------------------------------------------

# (batch, seqlen, heads_q, heads_kv, head_dim, dtype, keywords; "alibi" becomes a float32 slopes tensor)
GRAPH_CASES = {
    "causal-window-softcap-gqa-bf16-d128": (2, 512, 16, 4, 128, torch.bfloat16,
                                            dict(causal=True, window_size=(128, 0), softcap=30.0)),
    "alibi-fp16-d64": (1, 300, 8, 8, 64, torch.float16, dict(alibi_slopes="alibi")),
    "headdim80-causal-fp16": (2, 200, 4, 2, 80, torch.float16, dict(causal=True)),
}


def _graph_case(case, g):
    batch, n, hq, hkv, d, dtype, kw = GRAPH_CASES[case]
    kw = dict(kw)
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = torch.rand(hq, generator=g).mul(0.3).cuda()
    shapes = ((batch, n, hq, d), (batch, n, hkv, d), (batch, n, hkv, d))
    return shapes, dtype, kw


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_graph_captures_the_forward(cp, case):
    g = torch.Generator().manual_seed(3)
    shapes, dtype, kw = _graph_case(case, g)
    q, k, v = (_rand(g, *s, dtype=dtype) for s in shapes)
    _warm_up(lambda: cft.attention(q, k, v, **kw))
    pool = _pool_state(cp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode "global"
        out = cft.attention(q, k, v, **kw)
    for trial in range(3):
        new = [_rand(g, *s, dtype=dtype) for s in shapes]
        for static, fresh in zip((q, k, v), new):
            static.copy_(fresh)
        graph.replay()
        want = cft.attention(*new, **kw)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {trial} differs from eager"
    assert _pool_state(cp) == pool


def test_graph_captures_forward_and_backward_with_atomics(cp):
    """The default backward (dQ accumulated with float32 atomics, GQA) captured with the forward: replays with new
    values match eager within a rounding of the last bit (the atomics' order differs from run to run). The
    deterministic backward, bit for bit: test_torch_compile.py::test_cuda_graph_captures_forward_and_backward."""
    g = torch.Generator().manual_seed(4)
    shapes = ((2, 384, 8, 64), (2, 384, 2, 64), (2, 384, 2, 64))
    q, k, v = (_rand(g, *s, dtype=torch.float16).requires_grad_() for s in shapes)
    do = _rand(g, *shapes[0], dtype=torch.float16)
    kw = dict(causal=True, softcap=20.0)

    def step():
        out = cft.attention(q, k, v, **kw)
        out.backward(do)
        return out

    _warm_up(step, iterations=3)
    for t in (q, k, v):
        t.grad = None
    pool = _pool_state(cp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        new = [_rand(g, *s, dtype=torch.float16) for s in (*shapes, shapes[0])]
        with torch.no_grad():
            for static, fresh in zip((q, k, v, do), new):
                static.copy_(fresh)
        graph.replay()
        leaves = [t.clone().requires_grad_() for t in new[:3]]
        want = cft.attention(*leaves, **kw)
        grads = torch.autograd.grad(want, leaves, new[3])
        torch.cuda.synchronize()
        assert torch.equal(out, want.detach()), trial
        for name, t, w in zip("qkv", (q, k, v), grads):
            torch.testing.assert_close(t.grad, w, rtol=4e-3, atol=1e-4,
                                       msg=lambda m, name=name: f"d{name}, replay {trial}: {m}")
    assert _pool_state(cp) == pool


def _packed(g):
    cu = torch.tensor([0, 100, 160], dtype=torch.int32, device="cuda")
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100, max_seqlen_k=100), (160, 4, 64)


@pytest.mark.parametrize("case, match", [
    ("dropout", r"dropout_p cannot be captured in a CUDA graph yet: the dropout seed .* got dropout_p=0\.1"),
    ("varlen", r"cu_seqlens_q cannot be captured in a CUDA graph yet: .* host"),
    ("seqused_k", r"seqused_k cannot be captured in a CUDA graph yet"),
    ("bias", r"bias cannot be captured in a CUDA graph yet: .* got a bias tensor of shape \(1, 4, 64, 64\)"),
    ("attn_mask", r"attn_mask cannot be captured in a CUDA graph yet"),
    ("mask_mod", r"score_mod / mask_mod cannot be captured in a CUDA graph yet: .* mask_mod='kv_idx <= q_idx'"),
])
def test_capture_refuses_what_a_replay_cannot_repeat(cp, case, match):
    g = torch.Generator().manual_seed(5)
    shape, kw = (1, 64, 4, 64), {}
    if case == "dropout":
        kw = dict(dropout_p=0.1)
    elif case == "varlen":
        kw, shape = _packed(g)
    elif case == "seqused_k":
        kw = dict(seqused_k=torch.tensor([40], dtype=torch.int32, device="cuda"))
    elif case == "bias":
        kw = dict(bias=_rand(g, 1, 4, 64, 64, dtype=torch.float32))
    elif case == "attn_mask":
        kw = dict(attn_mask=torch.ones(64, 64, dtype=torch.bool, device="cuda"))
    else:
        kw = dict(mask_mod="kv_idx <= q_idx")
    q, k, v = (_rand(g, *shape, dtype=torch.float16) for _ in range(3))
    cft.attention(q, k, v, **kw)  # eagerly: runs
    torch.cuda.synchronize()
    with pytest.raises(NotImplementedError, match=match):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cft.attention(q, k, v, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(cft.attention(q, k, v, **kw).float()).all()  # eager calls still run afterwards


def test_graph_captures_decode_steps(cp):
    """cuflash::attention_with_kvcache captured once (append into the caches, split-KV attention, merge) and replayed
    for three decode steps, the lengths advanced on the device between replays: out, lse and the caches equal eager
    steps on copies, bit for bit."""
    g = torch.Generator().manual_seed(6)
    batch, heads_q, heads_kv, d, capacity = 2, 16, 2, 128, 1024
    dtype = torch.bfloat16
    q = _rand(g, batch, 1, heads_q, d, dtype=dtype)
    k_new, v_new = (_rand(g, batch, 1, heads_kv, d, dtype=dtype) for _ in range(2))
    caches = [_rand(g, batch, capacity, heads_kv, d, dtype=dtype) for _ in range(2)]
    lens = torch.tensor([17, 900], dtype=torch.int32, device="cuda")
    eager_caches, eager_lens = [c.clone() for c in caches], lens.clone()
    kw = dict(causal=True, return_lse=True)

    scratch = [c.clone() for c in caches]
    _warm_up(lambda: cft.attention_with_kvcache(q, *scratch, k_new, v_new, cache_seqlens=lens.clone(), **kw))
    pool = _pool_state(cp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = cft.attention_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=lens, **kw)
    for step in range(3):
        new = [_rand(g, *t.shape, dtype=dtype) for t in (q, k_new, v_new)]
        for static, fresh in zip((q, k_new, v_new), new):
            static.copy_(fresh)
        graph.replay()
        want, want_lse = cft.attention_with_kvcache(new[0], *eager_caches, new[1], new[2], cache_seqlens=eager_lens,
                                                    **kw)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse), step
        for c, e in zip(caches, eager_caches):
            assert torch.equal(c, e), step
        lens += 1
        eager_lens += 1
    assert _pool_state(cp) == pool
