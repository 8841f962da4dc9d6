"""Helpers shared by the device scripts in tools/ (gpu_check.py, fa1_check.py, variants_check.py, mla_ab.py,
bwd_ab.py): PyTorch inputs and the naive reference attention on the GPU, the NaN-poisoned CuPy memory pool, and the
builds' A/B rounds.
Run the scripts as ``python3 tools/<script>.py``: this directory is then first on ``sys.path``."""


def log(*a):
    print(*a, flush=True)


def make_inputs(torch, B, Nq, Nk, Hq, Hkv, d, dtype, layout, seed):
    """q, k, v, do as (B, N, H, d) CUDA tensors; layout "bhnd": (B, H, N, d) memory seen as (B, N, H, d)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(n, h):
        if layout == "bhnd":  # a (B, H, N, d) tensor viewed as (B, N, H, d): non-contiguous
            return torch.randn(B, h, n, d, generator=g, device="cuda", dtype=torch.float32).to(dtype).transpose(1, 2)
        return torch.randn(B, n, h, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    return rnd(Nq, Hq), rnd(Nk, Hkv), rnd(Nk, Hkv), rnd(Nq, Hq)


def ref_attention(torch, q, k, v, scale, offset, upcast, return_lse=False):
    """Naive attention on (B, N, H, d) tensors: float64 when upcast, else in the inputs' dtype with a
    float32 softmax (P cast back to the dtype before P V), as flash-attention's attention_ref. With
    return_lse: (out, the logsumexp of the scaled scores)."""
    dt = torch.float64 if upcast else q.dtype
    qh, kh, vh = (x.to(dt).transpose(1, 2) for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    s = qh @ kh.transpose(-1, -2)
    s = (s if upcast else s.float()) * scale
    if offset is not None:
        i = torch.arange(s.shape[-2], device=s.device)[:, None]
        j = torch.arange(s.shape[-1], device=s.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # rows that see no key
    out = (p.to(dt) @ vh).transpose(1, 2)
    return (out, torch.logsumexp(s, dim=-1)) if return_lse else out


def poison_pool(cp, nbytes=1 << 30):
    """Fill what the memory pool will hand out next with NaN, so unwritten outputs show."""
    x = cp.full((nbytes // 4,), cp.nan, dtype=cp.float32)
    del x


def variant_for(offset, seqlen_q, seqlen_k):
    """The backends' Variant of the older scripts' causal offset (None, seqlen_k - seqlen_q or 0)."""
    from cuflash._ops.variant import Variant

    if offset is None:
        return Variant()
    return Variant(causal=True, bottom_right=offset == seqlen_k - seqlen_q)


def back_to_back(torch, fn) -> float:
    """Seconds a call of ``fn``: 20 calls enqueued back to back between two CUDA events (the kernels' time, the host's
    hidden behind them), as bench-decode times them."""
    from cuflash.cli.bench_decode import _back_to_back

    return _back_to_back(torch, fn, reps=1)


def ab_parser(description: str, experiment: str):
    """The argument parser of an A/B tool: ``--builds`` (``CUFLASH_DEFINES`` values; default the shipped build and
    ``experiment``), ``--rounds`` and ``--one`` (the per-process worker); the tool adds its own options."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--builds", nargs="+", default=["", experiment])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", action="store_true", help="(the per-process worker)")
    return p


def ab_run(parser, one, describe):
    """Parse an A/B tool's command line (:func:`ab_parser`'s and the tool's options); with ``--one`` run ``one(args)``
    (this process is a worker) and return ``(args, None)``, else run the rounds (:func:`ab_rounds`, workers started
    from the running script) and return ``(args, results)``."""
    import sys

    args = parser.parse_args()
    if args.one:
        one(args)
        return args, None
    return args, ab_rounds(sys.argv[0], args.builds, args.rounds, describe)


def ab_report(results: dict, title: str, cell) -> None:
    """Print ``title``, then a line per build that ran: ``cell(i, rows)`` for each row index ``i`` of its worker's
    list, ``rows`` that row of every round (:func:`ab_rounds`' results)."""
    print(title)
    for b, runs in results.items():
        if runs:
            cells = [cell(i, [run[i] for run in runs]) for i in range(len(runs[0]))]
            print(f"  {b or 'shipped':28s} " + " | ".join(cells))


def ab_rounds(script: str, builds: list, rounds: int, describe) -> dict:
    """Run ``script`` with its own command line and ``--one`` (its per-process worker) once per build
    (``CUFLASH_DEFINES`` values) in each of ``rounds`` alternating rounds; each run's last stdout line is its JSON
    list of rows. Returns build -> [rows per round]; ``describe(rows)`` is printed per run."""
    import json
    import os
    import subprocess
    import sys

    results: dict = {b: [] for b in builds}
    for r in range(rounds):
        for b in builds:
            done = subprocess.run([sys.executable, script, *sys.argv[1:], "--one"],
                                  env=dict(os.environ, CUFLASH_DEFINES=b), capture_output=True, text=True)
            if done.returncode:
                print(f"build {b!r} failed:\n{done.stderr[-3000:]}")
                continue
            rows = json.loads(done.stdout.strip().splitlines()[-1])
            results[b].append(rows)
            print(f"round {r} build {b or 'shipped'!r}: {describe(rows)}", flush=True)
    return results
