"""cuflash.torch's custom operators (cuflash::attention_fwd, cuflash::attention_bwd): torch.compile with
fullgraph=True traces functions that call cuflash.torch.attention with no graph break and matches eager in
values and gradients; torch.library.opcheck passes (schema, fake tensors, autograd registration, AOT
dispatch with dynamic shapes). On the CPU the operators run the NumPy reference; the CUDA tests skip without
a GPU.
"""

import functools

import pytest

torch = pytest.importorskip("torch")

import cuflash.torch as cft  # noqa: E402

FWD = torch.ops.cuflash.attention_fwd.default
BWD = torch.ops.cuflash.attention_bwd.default


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _packed_lengths(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# Each case: (the function compiled and run eagerly, its inputs; those requiring grad get gradients). On the
# GPU: head dim 64 (one the kernels have) and the deterministic backward (no atomics: equal runs).
def _case(name, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(31)
    d = 8 if device == "cpu" else 64
    tiles = dict(block_q=4, block_k=8) if device == "cpu" else dict(deterministic=True)
    if name == "padded-causal-window-gqa-bias-mask":
        q = _randn(g, 2, 12, 4, d, dtype=dtype)
        k, v = _randn(g, 2, 15, 2, d, dtype=dtype), _randn(g, 2, 15, 2, d, dtype=dtype)
        bias = _randn(g, 1, 4, 12, 15, dtype=dtype)
        mask = torch.rand(2, 1, 12, 15, generator=g) < 0.8
        w = _randn(g, 2, 12, 4, d, dtype=dtype)

        def fn(q, k, v, bias, mask, w):
            out = cft.attention(q, k, v, bias=bias, attn_mask=mask, causal=True, window_size=(5, -1), softcap=3.0,
                                **tiles)
            return (out * w).sum()

        tensors = [q, k, v, bias, mask, w]
        grad = [True, True, True, True, False, False]
    elif name == "varlen-causal-alibi-lse":
        cu_q, cu_k = _packed_lengths([9, 1, 13]), _packed_lengths([12, 5, 13])
        q = _randn(g, int(cu_q[-1]), 4, d, dtype=dtype)
        k, v = _randn(g, int(cu_k[-1]), 2, d, dtype=dtype), _randn(g, int(cu_k[-1]), 2, d, dtype=dtype)
        slopes = torch.rand(4, generator=g, dtype=torch.float32) * 0.3
        w = _randn(g, *q.shape, dtype=dtype)

        def fn(q, k, v, cu_q, cu_k, slopes, w):
            out, lse = cft.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=13, max_seqlen_k=13,
                                     causal=True, alibi_slopes=slopes, softmax_scale=0.4, return_lse=True,
                                     deterministic=device != "cpu")
            return (out * w).sum() + lse.sum()

        tensors = [q, k, v, cu_q, cu_k, slopes, w]
        grad = [True, True, True, False, False, False, False]
    elif name == "head-dim-v-seqused":
        q = _randn(g, 3, 10, 4, 8, dtype=dtype)
        k, v = _randn(g, 3, 16, 1, 8, dtype=dtype), _randn(g, 3, 16, 1, 4, dtype=dtype)
        used = torch.tensor([16, 3, 0], dtype=torch.int32)

        def fn(q, k, v, used):
            return cft.attention(q, k, v, seqused_k=used, causal=True, algorithm="fa1").square().sum()

        tensors = [q, k, v, used]
        grad = [True, True, True, False]
    elif name == "mods":
        q = _randn(g, 2, 20, 4, 8, dtype=dtype)
        k, v = _randn(g, 2, 24, 2, 8, dtype=dtype), _randn(g, 2, 24, 2, 8, dtype=dtype)
        doc = torch.arange(4, dtype=torch.int32).repeat_interleave(6)
        head_w = torch.tensor([0.5, -0.25, 0, 1], dtype=torch.float32)

        def fn(q, k, v, doc, head_w):
            out = cft.attention(q, k, v, score_mod="10.0f * tanhf(score / 10.0f) + w[h]",
                                mask_mod="doc[q_idx] == doc[kv_idx] || kv_idx == 0", mod_arrays={"doc": doc, "w": head_w})
            return out.square().sum()

        tensors = [q, k, v, doc, head_w]
        grad = [True, True, True, False, False]
    elif name == "dropout-drawn-seed":
        q = _randn(g, 1, 9, 2, 8, dtype=dtype)
        k, v = _randn(g, 1, 11, 2, 8, dtype=dtype), _randn(g, 1, 11, 2, 8, dtype=dtype)

        def fn(q, k, v):
            return cft.attention(q, k, v, dropout_p=0.3, dropout_offset=2**63 + 5, deterministic=True).square().sum()

        tensors = [q, k, v]
        grad = [True, True, True]
    else:
        raise ValueError(name)
    tensors = [t.to(device).requires_grad_(r) for t, r in zip(tensors, grad)]
    return fn, tensors


CASES = ["padded-causal-window-gqa-bias-mask", "varlen-causal-alibi-lse", "head-dim-v-seqused", "mods",
         "dropout-drawn-seed"]


def _run(fn, tensors, seed=7):
    """The loss and the gradients of the tensors that require grad, from fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    torch.manual_seed(seed)  # the dropout seed is drawn from the default generator
    loss = fn(*leaves)
    grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])
    return loss.detach(), grads


def _assert_same(compiled, eager, rtol=1e-6, atol=1e-6):
    (loss_c, grads_c), (loss_e, grads_e) = compiled, eager
    torch.testing.assert_close(loss_c, loss_e, rtol=rtol, atol=atol)
    assert len(grads_c) == len(grads_e)
    for gc, ge in zip(grads_c, grads_e):
        assert gc.shape == ge.shape and gc.dtype == ge.dtype
        torch.testing.assert_close(gc, ge, rtol=rtol, atol=atol)


def _recording_backend():
    """aot_eager that keeps the forward and backward graphs (None where this torch lacks the helper)."""
    try:
        from torch._dynamo.testing import AotEagerAndRecordGraphs
    except ImportError:
        return "aot_eager", None
    backend = AotEagerAndRecordGraphs()
    return backend, backend


def _targets(graphs):
    return {node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("case", CASES)
def test_compile_fullgraph_matches_eager_cpu(case):
    fn, tensors = _case(case)
    backend, recorder = _recording_backend()
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    _assert_same(_run(compiled, tensors), _run(fn, tensors), rtol=0, atol=0)  # the same NumPy code runs
    if recorder is not None:  # the operators are in the traced graphs, forward and backward
        assert FWD in _targets(recorder.fw_graphs) and BWD not in _targets(recorder.fw_graphs)
        assert BWD in _targets(recorder.bw_graphs)


def test_compile_dropout_seed_follows_manual_seed_cpu():
    fn, tensors = _case("dropout-drawn-seed")
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    first, again, other = _run(compiled, tensors, seed=3), _run(compiled, tensors, seed=3), _run(compiled, tensors, seed=4)
    _assert_same(first, again, rtol=0, atol=0)
    assert first[0] != other[0]


def test_compile_dynamic_shapes_one_graph_cpu():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v):
        return cft.attention(q, k, v, causal=True, window_size=(3, 0)).sum()

    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=True)
    g = torch.Generator().manual_seed(5)
    frames = []
    for seqlen in (12, 19, 30):
        q, k, v = (_randn(g, 3, seqlen, 2, 8).requires_grad_() for _ in range(3))
        _assert_same(_run(compiled, [q, k, v]), _run(fn, [q, k, v]), rtol=0, atol=0)
        frames.append(counter.frame_count)
    # Symbolic sizes: no recompilation for new lengths. (The first call may count 2 frames: dynamo restarts its
    # analysis once to specialize the float defaults, softcap and dropout_p, which the operator takes as floats.)
    assert frames[0] == frames[-1]


@functools.lru_cache(maxsize=None)
def _inductor_skip_reason():
    """None when inductor compiles a trivial CPU function here, else why not."""
    try:
        torch.compile(lambda x: x.sin() + 1, backend="inductor", fullgraph=True)(torch.ones(3))
    except Exception as exc:  # no C++ compiler, an unsupported platform...
        return f"inductor cannot compile on this machine: {type(exc).__name__}: {str(exc)[:200]}"
    return None


@pytest.mark.parametrize("case", ["padded-causal-window-gqa-bias-mask", "varlen-causal-alibi-lse"])
def test_compile_inductor_matches_eager_cpu(case):
    if _inductor_skip_reason():
        pytest.skip(_inductor_skip_reason())
    fn, tensors = _case(case)
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    _assert_same(_run(compiled, tensors), _run(fn, tensors))  # inductor fuses the code around the operators


# ---------------------------------------------------------------------------------------------------
# torch.library.opcheck
# ---------------------------------------------------------------------------------------------------


def _scalars(**changes):
    """The operators' scalar arguments, in schema order, cuflash.attention's defaults but for ``changes``."""
    values = dict(causal=False, softmax_scale=None, causal_align="bottom-right", window_left=-1, window_right=-1,
                  softcap=0.0, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, dropout_offset=0, score_mod=None,
                  mask_mod=None, mod_array_names="", algorithm="fa2", block_q=None, block_k=None,
                  fp32_precision="tf32x3", deterministic=False)
    assert set(changes) <= set(values)
    return [*{**values, **changes}.values()]


def _fwd_args(name):
    """Arguments of cuflash::attention_fwd: q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
    attn_mask, mod_arrays, dropout_seed, then the scalars."""
    g = torch.Generator().manual_seed(41)
    leaf = lambda *shape: _randn(g, *shape, dtype=torch.float64).requires_grad_()  # noqa: E731
    if name == "gqa-bias-causal-softcap":
        return (leaf(2, 6, 4, 8), leaf(2, 7, 2, 8), leaf(2, 7, 2, 4), leaf(4, 6, 7), None, None, None, None, None, [],
                None, *_scalars(causal=True, softcap=2.0, block_q=2, block_k=3))
    if name == "varlen-alibi-window":
        cu = _packed_lengths([4, 7])
        return (leaf(11, 2, 8), leaf(11, 1, 8), leaf(11, 1, 8), None, torch.tensor([0.3, 0.7]), cu, cu, None, None, [],
                None, *_scalars(max_seqlen_q=7, max_seqlen_k=7, window_left=2, window_right=1))
    if name == "dropout-seqused-mask":
        mask = torch.rand(5, 9, generator=g) < 0.7
        return (leaf(2, 5, 2, 8), leaf(2, 9, 2, 8), leaf(2, 9, 2, 8), None, None, None, None,
                torch.tensor([9, 4], dtype=torch.int32), mask, [], torch.tensor(-12345, dtype=torch.int64),
                *_scalars(dropout_p=0.25, dropout_offset=3, softmax_scale=0.5))
    if name == "mods-fa1":
        doc = torch.arange(3, dtype=torch.int32).repeat_interleave(4)
        return (leaf(1, 12, 2, 8), leaf(1, 12, 2, 8), leaf(1, 12, 2, 8), None, None, None, None, None, None, [doc],
                None, *_scalars(mask_mod="doc[q_idx] >= doc[kv_idx]", mod_array_names="doc", algorithm="fa1"))
    raise ValueError(name)


@pytest.mark.parametrize("name", ["gqa-bias-causal-softcap", "varlen-alibi-window", "dropout-seqused-mask", "mods-fa1"])
def test_opcheck_forward(name):
    torch.library.opcheck(FWD, _fwd_args(name))  # raises on the first failing check


@pytest.mark.parametrize("want_dbias", [False, True])
def test_opcheck_backward(want_dbias):
    args = _fwd_args("gqa-bias-causal-softcap")
    q, k, v, bias, *rest = (a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = FWD(q, k, v, bias, *rest)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    torch.library.opcheck(BWD, (dout, q, k, v, out, lse, bias, *rest, want_dbias))
    dq, dk, dv, dbias = BWD(dout, q, k, v, out, lse, bias, *rest, want_dbias)
    assert dbias.shape == (bias.shape if want_dbias else (0,))


def test_operators_match_the_wrapper_and_take_64_bit_seeds():
    """The wrapper's dropout_seed and dropout_offset in [2**63, 2**64) reach the operators as int64 bit patterns."""
    g = torch.Generator().manual_seed(43)
    q, k, v = (_randn(g, 1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    seed, offset = 2**64 - 3, 2**63 + 1
    out, lse = cft.attention(q, k, v, dropout_p=0.5, dropout_seed=seed, dropout_offset=offset, return_lse=True)
    import cuflash

    expected = cuflash.attention(q.numpy(), k.numpy(), v.numpy(), dropout_p=0.5, dropout_seed=seed,
                                 dropout_offset=offset)
    assert torch.equal(out, torch.from_numpy(expected))
    direct = FWD(q, k, v, None, None, None, None, None, None, [], torch.tensor(seed - 2**64),
                 *_scalars(dropout_p=0.5, dropout_offset=offset - 2**64))
    assert torch.equal(direct[0], out) and torch.equal(direct[1], lse)


# ---------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the same through the kernels
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["padded-causal-window-gqa-bias-mask", "varlen-causal-alibi-lse"])
def test_compile_fullgraph_matches_eager_cuda(case):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    fn, tensors = _case(case, device="cuda", dtype=torch.float16)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _assert_same(_run(compiled, tensors), _run(fn, tensors), rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_graph_captures_forward_and_backward():
    """The issue's target: torch.cuda.CUDAGraph captures a forward and backward through the operators (outputs,
    gradients and workspaces from the graph's pool, on the capture stream, no synchronization); each replay after
    new values were copied into the static inputs equals eager on those values, bit for bit (the deterministic
    backward). More capture tests: tests/test_torch_cuda_graphs.py."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    g = torch.Generator().manual_seed(47)
    shapes = [(2, 256, h, 64) for h in (8, 2, 2)]
    q, k, v = (_randn(g, *s, dtype=torch.bfloat16).cuda().requires_grad_() for s in shapes)
    do = _randn(g, *shapes[0], dtype=torch.bfloat16).cuda()
    kw = dict(causal=True, window_size=(64, 0), deterministic=True)

    def step():
        out = cft.attention(q, k, v, **kw)
        out.backward(do)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, caches filled
        for _ in range(2):
            step()
            q.grad = k.grad = v.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the gradients are None here: the captured backward allocates them in the pool
        out = step()
    for trial in range(3):
        new = [_randn(g, *s, dtype=torch.bfloat16).cuda() for s in (*shapes, shapes[0])]
        with torch.no_grad():
            for static, fresh in zip((q, k, v, do), new):
                static.copy_(fresh)
        graph.replay()
        leaves = [t.clone().requires_grad_() for t in new[:3]]
        want = cft.attention(*leaves, **kw)
        want_grads = torch.autograd.grad(want, leaves, new[3])
        torch.cuda.synchronize()
        assert torch.equal(out, want.detach()), trial
        for name, t, w in zip("qkv", (q, k, v), want_grads):
            assert torch.equal(t.grad, w), f"d{name}, replay {trial}"


@pytest.mark.gpu
def test_compile_reduce_overhead_replays_forward_and_backward_cuda():
    """torch.compile(mode="reduce-overhead"): inductor with CUDA graph trees records the forward and the backward
    graph around the operators (no graph skipped for them) and the replays match eager, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if _inductor_skip_reason():
        pytest.skip(_inductor_skip_reason())
    from torch._dynamo.utils import counters

    def fn(q, k, v):
        return cft.attention(q, k, v, causal=True, window_size=(96, 0), softcap=25.0, deterministic=True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(53)
    shapes = [(2, 320, h, 128) for h in (8, 4, 4)]
    for step in range(5):  # trees warm up, record, then replay
        torch.compiler.cudagraph_mark_step_begin()
        leaves = [_randn(g, *s, dtype=torch.bfloat16).cuda().requires_grad_() for s in shapes]
        do = _randn(g, *shapes[0], dtype=torch.bfloat16).cuda()
        out = compiled(*leaves)
        out.backward(do)
        got = [out.detach().clone(), *(t.grad.clone() for t in leaves)]
        eager = [t.detach().clone().requires_grad_() for t in leaves]
        want = fn(*eager)
        want = [want.detach(), *torch.autograd.grad(want, eager, do)]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"{name}, step {step}"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
def test_compile_reduce_overhead_inference_cuda():
    """Inference under torch.compile(mode="reduce-overhead"): a forward without lse (its lse written into a stream's
    sink) and a read-only decode step over a cache (whose launch keeps buffers between calls) are recorded and
    replayed by CUDA graph trees with no graph skipped and no complaint about buffers the pool does not own, and
    match eager bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if _inductor_skip_reason():
        pytest.skip(_inductor_skip_reason())
    from torch._dynamo.utils import counters

    def prefill(q, k, v):
        return cft.attention(q, k, v, causal=True) * 2

    def decode(q, k_cache, v_cache, lens):
        return cft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens) * 2

    torch._dynamo.reset()
    counters.clear()
    compiled = [torch.compile(f, mode="reduce-overhead", fullgraph=True) for f in (prefill, decode)]
    g = torch.Generator().manual_seed(61)
    with torch.no_grad():
        for step in range(5):
            torch.compiler.cudagraph_mark_step_begin()
            q, k, v = (_randn(g, 2, 256, h, 128, dtype=torch.bfloat16).cuda() for h in (8, 4, 4))
            got = compiled[0](q, k, v).clone()
            assert torch.equal(got, prefill(q, k, v)), f"prefill, step {step}"
            caches = [_randn(g, 2, 1024, 4, 128, dtype=torch.bfloat16).cuda() for _ in range(2)]
            qd = _randn(g, 2, 1, 8, 128, dtype=torch.bfloat16).cuda()
            lens = torch.tensor([700, 1024], dtype=torch.int32, device="cuda")
            got = compiled[1](qd, *caches, lens).clone()
            assert torch.equal(got, decode(qd, *caches, lens)), f"decode, step {step}"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


# ---------------------------------------------------------------------------------------------------
# cuflash::attention_with_kvcache (the decode operator, which appends to the caches in place)
# ---------------------------------------------------------------------------------------------------

KVCACHE = torch.ops.cuflash.attention_with_kvcache.default


def _kvcache_args(name):
    """Arguments of cuflash::attention_with_kvcache: q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int,
    rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, then the scalars
    rotary_interleaved, causal, window_left, window_right, softcap, softmax_scale, num_splits."""
    g = torch.Generator().manual_seed(59)
    q = _randn(g, 2, 3, 4, 8, dtype=torch.float64)
    caches = [_randn(g, 2, 16, 2, 8, dtype=torch.float64) for _ in range(2)]
    lens = torch.tensor([4, 9], dtype=torch.int32)
    scalars = [True, True, -1, -1, 0.0, None, 0]
    if name == "append-rotary-leftpad":
        new = [_randn(g, 2, 3, 2, 8, dtype=torch.float64) for _ in range(2)]
        cos, sin = (torch.rand(32, 2, generator=g, dtype=torch.float64) for _ in range(2))
        return (q, *caches, *new, lens, -1, cos, sin, None, torch.tensor([1, 0], dtype=torch.int32), None, None,
                *scalars[:3], 2, 1.5, 0.3, 2)
    if name == "read-paged-alibi-int-lengths":
        table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
        caches = [_randn(g, 4, 8, 2, 8, dtype=torch.float64) for _ in range(2)]
        return (q, *caches, None, None, None, 11, None, None, None, None, table,
                torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float32), *scalars)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["append-rotary-leftpad", "read-paged-alibi-int-lengths"])
def test_opcheck_kvcache(name):
    torch.library.opcheck(KVCACHE, _kvcache_args(name))


def test_kvcache_operator_matches_the_front_door():
    """The operator is cuflash.attention_with_kvcache on NumPy views: the same out, lse and appended caches."""
    import cuflash

    args = _kvcache_args("append-rotary-leftpad")
    q, k_cache, v_cache, k, v, lens, _, cos, sin, _, leftpad = args[:11]
    host = [k_cache.numpy().copy(), v_cache.numpy().copy()]
    out, lse = KVCACHE(*args)
    want, want_lse = cuflash.attention_with_kvcache(
        q.numpy(), *host, k.numpy(), v.numpy(), cache_seqlens=lens.numpy(), rotary_cos=cos.numpy(),
        rotary_sin=sin.numpy(), cache_leftpad=leftpad.numpy(), causal=True, window_size=(-1, 2), softcap=1.5,
        softmax_scale=0.3, num_splits=2, return_lse=True)
    assert torch.equal(out, torch.from_numpy(want)) and torch.equal(lse, torch.from_numpy(want_lse))
    assert torch.equal(k_cache, torch.from_numpy(host[0])) and torch.equal(v_cache, torch.from_numpy(host[1]))


KVCACHE_READONLY = torch.ops.cuflash.attention_with_kvcache_readonly.default


def test_opcheck_kvcache_readonly():
    """The read-only operator (no k, v: nothing appended, nothing mutated): cuflash::attention_with_kvcache's
    arguments without k and v."""
    args = list(_kvcache_args("read-paged-alibi-int-lengths"))
    del args[3:5]
    torch.library.opcheck(KVCACHE_READONLY, tuple(args))
    out, lse = KVCACHE_READONLY(*args)
    want, want_lse = KVCACHE(*_kvcache_args("read-paged-alibi-int-lengths"))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_a_call_without_new_tokens_runs_the_readonly_operator(monkeypatch):
    """cuflash.torch.attention_with_kvcache without k and v runs cuflash::attention_with_kvcache_readonly, which
    declares no mutation (an eager call of an operator that declares one pays for torch's version-counter bump, whose
    cost grows with the square of the schema's arguments) and leaves the caches' versions alone; with k and v, the
    mutating operator, which bumps them. (Plain tensors outside tracing call the implementation directly, without
    either operator: that path, too, bumps the versions only when it appends.)"""
    g = torch.Generator().manual_seed(61)
    q, k_cache, v_cache = _randn(g, 1, 1, 4, 8), _randn(g, 1, 9, 2, 8), _randn(g, 1, 9, 2, 8)
    versions = k_cache._version, v_cache._version
    cft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=9, causal=True)
    assert (k_cache._version, v_cache._version) == versions
    cft.attention_with_kvcache(q, k_cache, v_cache, _randn(g, 1, 1, 2, 8), _randn(g, 1, 1, 2, 8), cache_seqlens=8)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    monkeypatch.setattr(cft, "_runs_eagerly", lambda *tensors: False)  # as when tracing
    seen = []
    for name in ("_attention_with_kvcache", "_attention_with_kvcache_readonly"):
        real = getattr(cft, name)
        monkeypatch.setattr(cft, name, lambda *a, _real=real, _name=name, **kw: seen.append(_name) or _real(*a, **kw))
    g = torch.Generator().manual_seed(60)
    q, k_cache, v_cache = _randn(g, 1, 1, 4, 8), _randn(g, 1, 9, 2, 8), _randn(g, 1, 9, 2, 8)
    versions = k_cache._version, v_cache._version
    out = cft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=9, causal=True)
    assert seen == ["_attention_with_kvcache_readonly"] and (k_cache._version, v_cache._version) == versions
    k, v = _randn(g, 1, 1, 2, 8), _randn(g, 1, 1, 2, 8)
    appended = cft.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=8, causal=True)
    assert seen[1] == "_attention_with_kvcache" and k_cache._version > versions[0]
    assert appended.shape == out.shape and torch.equal(k_cache[:, 8:], k)
    with pytest.raises(ValueError, match="k and v .* must be given together"):  # (the mutating operator's check)
        cft.attention_with_kvcache(q, k_cache, v_cache, k, cache_seqlens=8)


def test_readonly_kvcache_compiles_with_no_graph_break():
    g = torch.Generator().manual_seed(61)
    q, k_cache, v_cache = _randn(g, 2, 1, 4, 8), _randn(g, 2, 11, 2, 8), _randn(g, 2, 11, 2, 8)

    def fn(q, k_cache, v_cache):
        return cft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=k_cache.shape[1], causal=True) * 2

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k_cache, v_cache), fn(q, k_cache, v_cache))
