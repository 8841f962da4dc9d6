"""cuflash.distributed on CPU processes over gloo: ring (zigzag, contiguous) and all-gather attention against
``cuflash.torch.attention`` on the full sequence, outputs and q/k/v gradients, in float64 (and one float32 and one
bfloat16 case).

Each world size is one spawn of its processes (2 and 4), which run every case of that size and write what each
case gave (``ok`` or the traceback) to a file per rank; the tests then read those files, one test per case. A
FileStore in a temporary directory rendezvouses the processes (no TCP port to collide), and the parent gives up
after a deadline (a hung collective fails the tests instead of hanging CI).
"""

import datetime
import importlib
import json
import time
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import cuflash.torch  # noqa: E402

# name: (entry, layout, causal, heads_q, heads_kv, dtype, options)
CASES = {
    "ring-zigzag-causal": ("ring", "zigzag", True, 4, 4, "float64", {}),
    "ring-zigzag-causal-gqa": ("ring", "zigzag", True, 4, 2, "float64", {}),
    "ring-zigzag-gqa": ("ring", "zigzag", False, 4, 1, "float64", {}),
    "ring-contiguous-causal-gqa": ("ring", "contiguous", True, 4, 2, "float64", {}),
    "ring-contiguous-softcap": ("ring", "contiguous", False, 2, 2, "float64", {"softcap": 2.0}),
    "ring-zigzag-causal-scale-softcap": ("ring", "zigzag", True, 2, 1, "float64",
                                         {"softcap": 1.5, "softmax_scale": 0.7}),
    "ring-zigzag-causal-float32": ("ring", "zigzag", True, 4, 2, "float32", {}),
    "ring-zigzag-causal-bfloat16": ("ring", "zigzag", True, 4, 2, "bfloat16", {}),
    "allgather-zigzag-causal-gqa": ("allgather", "zigzag", True, 4, 2, "float64", {}),
    "allgather-zigzag": ("allgather", "zigzag", False, 2, 2, "float64", {}),
    "allgather-contiguous-causal": ("allgather", "contiguous", True, 4, 1, "float64", {}),
    "allgather-contiguous-causal-window": ("allgather", "contiguous", True, 4, 2, "float64",
                                           {"window_size": (4, 0)}),
    "allgather-zigzag-causal-window-softcap": ("allgather", "zigzag", True, 2, 2, "float64",
                                               {"window_size": (3, 0), "softcap": 2.0}),
    "shard-unshard": ("shard", None, False, 2, 2, "float64", {}),
    # two groups of two ranks each (world 4 only): peers are global ranks that differ from the group's ranks
    "ring-subgroups": ("ring", "zigzag", True, 4, 2, "float64", {"subgroups": True}),
    "allgather-subgroups": ("allgather", "zigzag", True, 4, 2, "float64", {"subgroups": True}),
}
WORLDS = (2, 4)
DEADLINE_S = 240


def _full_inputs(world: int, heads_q: int, heads_kv: int, dtype: torch.dtype, seed: int):
    """The same full-sequence q, k, v, dout on every rank (seeded); the length 2R * 3 + ... divides into 2R chunks."""
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, d = 2, 2 * world * 3, 8
    def draw(heads):
        return torch.randn((batch, seqlen, heads, d), generator=gen, dtype=torch.float64).to(dtype)
    return draw(heads_q), draw(heads_kv), draw(heads_kv), draw(heads_q)


def _check_case(name: str, world: int) -> str | None:
    """Run one case on this rank; raise when it differs from single-process attention, or say why it skipped."""
    from cuflash import distributed as cd

    entry, layout, causal, heads_q, heads_kv, dtype_name, options = CASES[name]
    dtype = getattr(torch, dtype_name)
    group, options = None, dict(options)
    if options.pop("subgroups", False):
        if world < 4:
            return "skip: two groups of two ranks need 4 processes"
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        group, world = groups[dist.get_rank() // 2], 2
    q, k, v, dout = _full_inputs(world, heads_q, heads_kv, dtype, seed=len(name) + 100 * world)
    if entry == "shard":
        for lay in cd.LAYOUTS:
            local = cd.shard(q, layout=lay)
            assert local.shape == (q.shape[0], q.shape[1] // world, *q.shape[2:]), local.shape
            assert torch.equal(cd.unshard(local, layout=lay), q), f"unshard(shard(q)) != q for layout={lay!r}"
        return
    # truth: single-process attention on the full sequence
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_full, lse_full = cuflash.torch.attention(*full, causal=causal, return_lse=True, **options)
    out_full.backward(dout)
    # the sharded run
    local = [cd.shard(t, group, layout=layout).requires_grad_() for t in (q, k, v)]
    fn = cd.ring_attention if entry == "ring" else cd.all_gather_attention
    out, lse = fn(*local, group=group, causal=causal, layout=layout, return_lse=True, **options)
    out.backward(cd.shard(dout, group, layout=layout))
    # float64: rounding only; float32: the same; bfloat16: the merge of per-step outputs rounded to bfloat16
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    pairs = [("out", out, out_full), ("lse", lse, lse_full.transpose(1, 2))]
    pairs += [(f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", local, full)]
    for what, got, want in pairs:
        if what == "lse":
            got = got.transpose(1, 2)
        want = cd.shard(want, group, layout=layout)
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
        err = (got.double() - want.double()).abs().max().item()
        scale = want.double().abs().max().item()
        assert err <= tol * max(1.0, scale), f"{what}: max |distributed - single| = {err:.3g} > {tol:g} (max |x| {scale:.3g})"


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEADLINE_S // 2))
    results = {}
    try:
        for name in CASES:
            try:
                results[name] = _check_case(name, world) or "ok"
            except Exception:
                results[name] = traceback.format_exc()
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    """``{world: {case: [result of each rank]}}``: one spawn of ``world`` gloo processes per world size."""
    # Forked from this process with torch, cuflash.torch and what the operators' first call imports already loaded
    # (a spawned process spends seconds importing them again; CI has 2 cores); spawned where fork does not exist.
    warm = torch.zeros((1, 2, 1, 8), dtype=torch.float64)
    cuflash.torch.attention(warm, warm, warm)
    importlib.import_module("cuflash.distributed")
    start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    results = {}
    for world in WORLDS:
        base = tmp_path_factory.mktemp(f"world{world}")
        context = mp.start_processes(_worker, args=(world, str(base / "store"), str(base)), nprocs=world,
                                     join=False, start_method=start_method)
        deadline = time.monotonic() + DEADLINE_S
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for p in context.processes:
                    if p.is_alive():
                        p.terminate()
                pytest.fail(f"the {world} gloo processes did not finish within {DEADLINE_S} s")
        per_rank = [json.loads((base / f"rank{r}.json").read_text()) for r in range(world)]
        results[world] = {name: [res.get(name, "not run") for res in per_rank] for name in CASES}
    return results


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(distributed_results, case, world):
    results = distributed_results[world][case]
    if all(res.startswith("skip: ") for res in results):
        pytest.skip(results[0][len("skip: "):])
    failures = [f"rank {r}:\n{res}" for r, res in enumerate(results) if res != "ok"]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------
# In one process: the step plans, a group of one, and the errors
# ---------------------------------------------------------------------------------------------------


def test_zigzag_plan_balances_causal_work():
    """Every rank computes the same number of score entries over the ring steps (zigzag, causal); contiguous does
    not. Counted from the plans: a causal block counts half its entries plus the diagonal."""
    from cuflash import distributed as cd

    world, local = 4, 8
    def work(layout, rank):
        total = 0
        for src in range(world):
            for q_rows, k_rows, causal in cd._step_plan(cd._chunks(layout, world, rank, local),
                                                        cd._chunks(layout, world, src, local), True):
                nq, nk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
                total += nq * nk - (nq * (nq - 1) // 2 if causal else 0)
        return total
    zigzag = [work("zigzag", r) for r in range(world)]
    assert len(set(zigzag)) == 1, zigzag
    n = world * local
    assert sum(zigzag) == n * (n + 1) // 2, (sum(zigzag), n)
    contiguous = [work("contiguous", r) for r in range(world)]
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1], contiguous


def test_zigzag_plan_is_one_call_per_step():
    """Zigzag causal: the own shard is one causal call, an earlier rank's K/V one unmasked call on its first chunk,
    a later rank's one unmasked call of the second query chunk: as flash-attention's zigzag ring."""
    from cuflash import distributed as cd

    world, rank, local = 4, 1, 6
    plan = lambda src: cd._step_plan(cd._chunks("zigzag", world, rank, local), cd._chunks("zigzag", world, src, local),
                                     True)
    assert plan(1) == [(slice(0, 6), slice(0, 6), True)]
    assert plan(0) == [(slice(0, 6), slice(0, 3), False)]
    assert plan(2) == [(slice(3, 6), slice(0, 6), False)]


@pytest.fixture
def group_of_one(tmp_path):
    """A default process group of this process alone (gloo), destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("entry", ["ring_attention", "all_gather_attention"])
def test_group_of_one_is_plain_attention(group_of_one, entry):
    from cuflash import distributed as cd

    q, k, v, dout = _full_inputs(1, 2, 1, torch.float64, seed=5)
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = getattr(cd, entry)(*local, causal=True)
    ref = cuflash.torch.attention(*full, causal=True)
    out.backward(dout)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(local, full):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


def test_errors_name_the_argument(group_of_one):
    from cuflash import distributed as cd

    q = torch.zeros((1, 6, 2, 8), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"layout must be one of \('zigzag', 'contiguous'\); got 'ring'"):
        cd.ring_attention(q, q, q, layout="ring")
    with pytest.raises(TypeError, match="k must be a torch.Tensor .*; got numpy.ndarray"):
        cd.ring_attention(q, np.zeros((1, 6, 2, 8)), q)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions .*; got shape \(6, 2, 8\)"):
        cd.all_gather_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match=r"same batch and local sequence length .* got q \(1, 6, 2, 8\), k \(1, 4, 2, 8\)"):
        cd.ring_attention(q, q[:, :4], q[:, :4])
    with pytest.raises(ValueError, match="even local sequence length .*layout='zigzag'.*; got 5"):
        cd.ring_attention(q[:, :5], q[:, :5], q[:, :5])
    with pytest.raises(NotImplementedError, match=r"ring_attention has no sliding window .*window_size=\(4, 0\)"):
        cd.ring_attention(q, q, q, causal=True, window_size=(4, 0))
    with pytest.raises(NotImplementedError, match=r"causal=True only .*window_size=\(2, 2\) with causal=False"):
        cd.all_gather_attention(q, q, q, window_size=(2, 2))
    with pytest.raises(TypeError, match="causal must be a bool; got int 1"):
        cd.ring_attention(q, q, q, causal=1)
    with pytest.raises(ValueError, match=r"x must have a sequence length \(dim 1\) divisible by 2 .*; got 5"):
        cd.shard(q[:, :5])


def test_needs_a_process_group():
    from cuflash import distributed as cd

    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    q = torch.zeros((1, 4, 1, 8))
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        cd.ring_attention(q, q, q)


def test_cupy_arrays_are_refused_with_the_way_round():
    from cuflash import distributed as cd

    fake = type("ndarray", (), {"__module__": "cupy"})()
    with pytest.raises(NotImplementedError, match=r"CuPy entry over cupy.cuda.nccl is not implemented .*from_dlpack\(q\)"):
        cd.ring_attention(fake, fake, fake)


def test_import_cuflash_does_not_import_the_module():
    import subprocess
    import sys

    code = "import sys, cuflash; assert 'cuflash.distributed' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------------
# Two GPUs over NCCL (skipped without them)
# ---------------------------------------------------------------------------------------------------


def _gpu_worker(rank: int, world: int, store_path: str) -> None:
    from cuflash import distributed as cd

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEADLINE_S // 2))
    try:
        gen = torch.Generator().manual_seed(0)
        shape = (2, 1024, 8, 128)
        q, dout = (torch.randn(shape, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        k, v = (torch.randn((2, 1024, 2, 128), generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cuflash.torch.attention(*full, causal=True)
        ref.backward(dout)
        for fn in (cd.ring_attention, cd.all_gather_attention):
            local = [cd.shard(t).requires_grad_() for t in (q, k, v)]
            out = fn(*local, causal=True)
            out.backward(cd.shard(dout))
            for what, got, want in [("out", out, ref)] + [(f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", local, full)]:
                err = (got.float() - cd.shard(want).float()).abs().max().item()
                assert err <= 2e-2 * max(1.0, want.float().abs().max().item()), (fn.__name__, what, err)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_two_gpus_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA devices and NCCL")
    context = mp.start_processes(_gpu_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1):
        assert time.monotonic() < deadline, f"the 2 NCCL processes did not finish within {DEADLINE_S} s"

