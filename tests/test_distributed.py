"""cuflash.distributed on CPU processes over gloo: ring (zigzag, contiguous) and all-gather attention against
``cuflash.torch.attention`` on the full sequence, outputs and q/k/v gradients, in float64 (and two float32 and one
bfloat16 case): causal or not, sliding windows, packed documents (``cu_seqlens``; the truth is the packed varlen
call). In one process: the band plan against the full mask (every visible score computed once), its skipped pairs,
the merge of a block where some rows see no key, and the errors.

Each world size is one spawn of its processes (2 and 4), which run every case of that size and write what each
case gave (``ok`` or the traceback) to a file per rank; the tests then read those files, one test per case. A
FileStore in a temporary directory rendezvouses the processes (no TCP port to collide), and the parent gives up
after a deadline (a hung collective fails the tests instead of hanging CI).
"""

import datetime
import importlib
import json
import math
import time
import traceback
import types

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
    # sliding windows (chunks of 3 tokens with zigzag, 6 contiguous): inside a chunk, across chunks, two-sided,
    # one-sided non-causal ((-1, 1): causal plus one; (0, -1): the keys at and after the query)
    "ring-zigzag-causal-window-2": ("ring", "zigzag", True, 4, 2, "float64", {"window_size": (2, 0)}),
    "ring-zigzag-causal-window-7": ("ring", "zigzag", True, 2, 1, "float64", {"window_size": (7, -1)}),
    "ring-zigzag-window-4-3": ("ring", "zigzag", False, 2, 2, "float64", {"window_size": (4, 3)}),
    "ring-contiguous-window-1-5": ("ring", "contiguous", False, 2, 1, "float64", {"window_size": (1, 5)}),
    "ring-contiguous-causal-window-softcap": ("ring", "contiguous", True, 2, 2, "float64",
                                              {"window_size": (4, 0), "softcap": 2.0}),
    "ring-zigzag-window-causal-plus-one": ("ring", "zigzag", False, 2, 2, "float64", {"window_size": (-1, 1)}),
    "ring-zigzag-window-anticausal": ("ring", "zigzag", False, 2, 2, "float64", {"window_size": (0, -1)}),
    "ring-zigzag-window-float32": ("ring", "zigzag", False, 4, 2, "float32", {"window_size": (5, 2)}),
    "allgather-zigzag-window-3-2": ("allgather", "zigzag", False, 4, 2, "float64", {"window_size": (3, 2)}),
    "allgather-contiguous-window-anticausal": ("allgather", "contiguous", False, 2, 1, "float64",
                                               {"window_size": (0, 4)}),
    # packed documents (cu_seqlens of the full sequence, _documents): a one-token and an empty document, documents
    # across chunks and ranks
    "ring-zigzag-causal-docs": ("ring", "zigzag", True, 4, 2, "float64", {"cu_seqlens": "docs"}),
    "ring-contiguous-docs": ("ring", "contiguous", False, 2, 2, "float64", {"cu_seqlens": "docs"}),
    "ring-zigzag-docs-window": ("ring", "zigzag", False, 2, 1, "float64", {"cu_seqlens": "docs", "window_size": (2, 3)}),
    "allgather-zigzag-causal-docs-window": ("allgather", "zigzag", True, 4, 2, "float64",
                                            {"cu_seqlens": "docs", "window_size": (4, 0)}),
    "allgather-contiguous-docs": ("allgather", "contiguous", False, 2, 2, "float64", {"cu_seqlens": "docs"}),
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


def _documents(seqlen: int) -> list[int]:
    """Document boundaries of a full sequence: a one-token document, an empty one, documents across chunks."""
    return [0, 1, 5, 5, seqlen // 2 + 1, seqlen - 4, seqlen]


def _reference(q, k, v, causal: bool, options: dict):
    """``cuflash.torch.attention`` on the full sequences; ``cu_seqlens`` as the packed layout of the batch (each
    batch entry's documents one after the other), lse back as ``(batch, heads, seqlen)``."""
    cu = options.get("cu_seqlens")
    if cu is None:
        return cuflash.torch.attention(q, k, v, causal=causal, return_lse=True, **options)
    options = {key: val for key, val in options.items() if key != "cu_seqlens"}
    batch, seqlen = q.shape[:2]
    cu_packed = torch.tensor([0] + [b * seqlen + x for b in range(batch) for x in cu[1:]], dtype=torch.int32)
    longest = max(y - x for x, y in zip(cu, cu[1:]))
    out, lse = cuflash.torch.attention(
        *(t.reshape(batch * seqlen, *t.shape[2:]) for t in (q, k, v)), causal=causal, return_lse=True,
        cu_seqlens_q=cu_packed, cu_seqlens_k=cu_packed, max_seqlen_q=longest, max_seqlen_k=longest, **options)
    return out.reshape(batch, seqlen, *out.shape[1:]), lse.reshape(lse.shape[0], batch, seqlen).transpose(0, 1)


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
    if options.get("cu_seqlens") == "docs":
        options["cu_seqlens"] = _documents(q.shape[1])
    if entry == "shard":
        for lay in cd.LAYOUTS:
            local = cd.shard(q, layout=lay)
            assert local.shape == (q.shape[0], q.shape[1] // world, *q.shape[2:]), local.shape
            assert torch.equal(cd.unshard(local, layout=lay), q), f"unshard(shard(q)) != q for layout={lay!r}"
        return
    # truth: single-process attention on the full sequence
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_full, lse_full = _reference(*full, causal, options)
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


def _call_mask(call, q_chunks, k_chunks, doc_ids, n: int) -> np.ndarray:
    """The scores ``(global query, global key)`` that one call of a plan computes, by the operator's rules: the
    window around the block's diagonal (``causal_align``), causal capping its right edge, the document mask."""
    q_pos = np.concatenate([np.arange(a, a + m) for a, m in q_chunks])[call.q_rows]
    k_pos = np.concatenate([np.arange(a, a + m) for a, m in k_chunks])[call.k_rows]
    i, j = np.arange(len(q_pos))[:, None], np.arange(len(k_pos))[None, :]
    diag = i + (len(k_pos) - len(q_pos) if call.align == "bottom-right" else 0)
    left, right = call.window
    if call.causal:
        right = 0 if right == -1 else min(right, 0)
    seen = np.ones((len(q_pos), len(k_pos)), dtype=bool)
    if left != -1:
        seen &= j >= diag - left
    if right != -1:
        seen &= j <= diag + right
    if call.docs is not None:
        assert (call.docs[0], call.docs[1]) == (q_pos[0], k_pos[0]), (call, q_pos, k_pos)
        seen &= doc_ids[q_pos][:, None] == doc_ids[k_pos][None, :]
    mask = np.zeros((n, n), dtype=np.int64)
    mask[np.ix_(q_pos, k_pos)] = seen
    return mask


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("docs", [False, True])
def test_band_plan_computes_every_visible_score_once(layout, docs):
    """Over all ranks and ring steps, the calls of the band plan compute each score of the full sequence's mask
    exactly once and no other (windows in and across chunks, one- and two-sided, causal or not, documents), and
    the all-gather plan does on the gathered keys; every call has some visible score (empty pairs are skipped)."""
    from cuflash import distributed as cd

    world, local = 4, 6
    n = world * local
    cu = tuple(_documents(n)) if docs else None
    doc_ids = np.searchsorted(np.array(cu[1:]), np.arange(n), side="right") if docs else None
    pos = np.arange(n)
    windows = [(-1, -1), (0, 0), (2, 0), (3, -1), (7, 2), (4, 3), (0, -1), (-1, 1), (1, 9), (30, 30)]
    for window in windows:
        for causal in (False, True):
            left, right = (None if x == -1 else x for x in window)
            if causal:
                right = 0 if right is None else min(right, 0)
            truth = np.ones((n, n), dtype=bool)
            if left is not None:
                truth &= pos[None, :] >= pos[:, None] - left
            if right is not None:
                truth &= pos[None, :] <= pos[:, None] + right
            if docs:
                truth &= doc_ids[:, None] == doc_ids[None, :]
            opts = types.SimpleNamespace(band=(left, right), cu=cu)
            for rank in range(world):
                q_chunks = cd._chunks(layout, world, rank, local)
                ring = np.zeros((n, n), dtype=np.int64)
                for src in range(world):
                    k_chunks = cd._chunks(layout, world, src, local)
                    for call in cd._plan(q_chunks, k_chunks, opts):
                        part = _call_mask(call, q_chunks, k_chunks, doc_ids, n)
                        assert part.any(), (window, causal, rank, src, call)
                        ring += part
                gathered = sum(_call_mask(call, q_chunks, [(0, n)], doc_ids, n)
                               for call in cd._band_plan(q_chunks, [(0, n)], (left, right), cu))
                rows = np.concatenate([np.arange(a, a + m) for a, m in q_chunks])
                for what, got in (("ring", ring), ("all-gather", gathered)):
                    assert np.array_equal(got[rows], truth[rows].astype(np.int64)), (what, window, causal, rank)


def test_a_row_that_sees_no_key_of_a_block_merges_as_nothing():
    """A block where some query rows see no key (documents: the rows of another document than the keys') gives
    those rows lse -inf and output 0, and merging it leaves their accumulators as they were."""
    from cuflash import distributed as cd

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn((1, 4, 2, 8), generator=gen, dtype=torch.float64) for _ in range(3))
    opts = types.SimpleNamespace(scale=0.3, softcap=0.0, deterministic=False,
                                 doc_ids=torch.tensor([0, 0, 1, 1, 1, 1, 1, 1], dtype=torch.int32))
    # queries at global 4..7 (document 1), keys at 0..3 (documents 0 and 1): only keys 2, 3 are visible
    call = cd._Call(slice(0, 4), slice(0, 4), docs=(4, 0))
    out_b, lse_b = cd._block_fwd(q, k, v, call, opts)
    want, want_lse = cuflash.torch.attention(q, k[:, 2:], v[:, 2:], softmax_scale=0.3, return_lse=True)
    torch.testing.assert_close(out_b, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_b, want_lse, rtol=0, atol=1e-12)
    # the other way: queries 0..3 (rows 0, 1 in document 0, rows 2, 3 in 1) against keys 0, 1 of document 0
    call = cd._Call(slice(0, 4), slice(0, 2), docs=(0, 0))
    out_b, lse_b = cd._block_fwd(q, k, v, call, opts)
    assert torch.isneginf(lse_b[:, :, 2:]).all() and not torch.isinf(lse_b[:, :, :2]).any(), lse_b
    assert torch.equal(out_b[:, 2:], torch.zeros_like(out_b[:, 2:]))
    out_acc, lse_acc = out_b.clone(), lse_b.clone()
    out_acc[:, 2:], lse_acc[:, :, 2:] = 1.5, 0.25
    cd._merge_into(out_acc, lse_acc, slice(0, 4), out_b, lse_b)
    assert torch.equal(out_acc[:, 2:], torch.full_like(out_acc[:, 2:], 1.5))
    assert torch.equal(lse_acc[:, :, 2:], torch.full_like(lse_acc[:, :, 2:], 0.25))
    # both parts empty: the row stays empty (lse -inf, output 0), no NaN
    out_acc, lse_acc = torch.zeros_like(out_b), torch.full_like(lse_b, -math.inf)
    cd._merge_into(out_acc, lse_acc, slice(0, 4), out_b, lse_b)
    assert torch.isneginf(lse_acc[:, :, 2:]).all() and torch.equal(out_acc[:, 2:], torch.zeros_like(out_acc[:, 2:]))
    assert not torch.isnan(out_acc).any()


def test_band_plan_skips_pairs_outside_the_window():
    """Zigzag, causal window (2, 0), 4 ranks of 2 chunks of 3: a pair of chunks more than 2 positions apart gets no
    call; a block that the window cuts gets the window moved to its diagonal; the rank's own K/V is two causal calls on
    its two chunks, where the window reaches past the chunk start (left 2 = chunk length - 1: no window left)."""
    from cuflash import distributed as cd

    world, local = 4, 6
    opts = types.SimpleNamespace(band=(2, 0), cu=None)
    plan = lambda rank, src: cd._plan(cd._chunks("zigzag", world, rank, local),  # noqa: E731
                                      cd._chunks("zigzag", world, src, local), opts)
    assert plan(0, 3) == []  # chunks 0, 7 against 3, 4: nothing within 2 positions
    # rank 1 holds chunks 1 (3..5) and 6 (18..20); rank 0 chunks 0 (0..2) and 7 (21..23)
    # queries 3, 4 see keys 1..3 and 2..4: keys 1, 2 of chunk 0, key j visible from row i when j >= i
    assert plan(1, 0) == [cd._Call(slice(0, 2), slice(1, 3), False, "bottom-right", (0, -1))]
    assert plan(1, 1) == [cd._Call(slice(0, 3), slice(0, 3), True), cd._Call(slice(3, 6), slice(3, 6), True)]
    # window (1, 0): the diagonal chunks keep a window of 1
    opts.band = (1, 0)
    assert plan(1, 1) == [cd._Call(slice(0, 3), slice(0, 3), True, "bottom-right", (1, -1)),
                          cd._Call(slice(3, 6), slice(3, 6), True, "bottom-right", (1, -1))]


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
    with pytest.raises(ValueError, match=r"window_size entries must be >= -1 .*; got \(-2, 0\)"):
        cd.ring_attention(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"cu_seqlens must be .*ending at the full length 6; got \[0, 4, 5\]"):
        cd.ring_attention(q, q, q, cu_seqlens=[0, 4, 5])
    with pytest.raises(ValueError, match=r"cu_seqlens must be .*non-decreasing.*; got \[0, 4, 2, 6\]"):
        cd.all_gather_attention(q, q, q, cu_seqlens=torch.tensor([0, 4, 2, 6]))
    with pytest.raises(TypeError, match=r"cu_seqlens must be a 1-D integer tensor .*; got a torch.float32 tensor"):
        cd.ring_attention(q, q, q, cu_seqlens=torch.tensor([0.0, 6.0]))
    with pytest.raises(TypeError, match=r"cu_seqlens must be a 1-D integer tensor .*; got builtins.str"):
        cd.ring_attention(q, q, q, cu_seqlens="0,6")
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
    with pytest.raises(TypeError, match=r"for CuPy arrays use cuflash.distributed_cupy.ring_attention .*from_dlpack\(q\)"):
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



def test_cp_bench_runs_on_cpu_processes(tmp_path):
    """tools/cp_bench.py (issue 15's benchmark, run on two GPUs in docs/distributed.md) on two CPU processes over
    gloo: it runs ring and all-gather against the one-device call and writes its rows, errors within float32's
    reach of the one-device output. Its times mean nothing here."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "cp_bench.py"), "--cpu", "--seqlens", "64",
                           "--heads", "2", "--heads-kv", "1", "--head-dim", "16", "--reps", "1", "--deadline", "120",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [r for r in json.loads((tmp_path / "cp_bench.json").read_text()) if "mode" in r]
    assert {r["mode"] for r in rows} == {"ring", "all-gather"} and {r["rank"] for r in rows} == {0, 1}
    assert all(r["max_err"] < 1e-5 and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows), rows
    assert "| 64 | ring |" in done.stdout
