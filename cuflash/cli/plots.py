"""Plots of benchmark results (matplotlib, imported on demand: ``pip install cuflash[bench]``).

Both functions take plain rows of numbers, as the benchmarks print and save them as JSON, so a plot can
be redrawn from a saved run without a GPU. Figures are saved with ``bbox_inches="tight"``: a title or legend
wider than the axes enlarges the image instead of being cut at its edge.
"""

from __future__ import annotations

from collections.abc import Sequence

_PASSES = ("fwd", "fwd+bwd")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _systems(rows: Sequence[dict]) -> list[str]:
    """System names, in first-seen order, from keys of the form ``"<system> <pass>"``."""
    names: list[str] = []
    for row in rows:
        for key in row:
            system, _, pass_ = key.rpartition(" ")
            if pass_ in _PASSES and system not in names:
                names.append(system)
    return names


def plot_throughput(rows: Sequence[dict], path, *, title: str = "", unit: str = "TFLOP/s") -> None:
    """Throughput against sequence length: one panel per (dtype, pass) row and (head_dim, causal) column.

    ``rows`` hold ``dtype``, ``d``, ``causal``, ``N`` and ``"<system> fwd"`` / ``"<system> fwd+bwd"`` in
    ``unit`` (as :func:`cuflash.cli.bench_gpu.run_grid` returns them); every system and pass found is drawn.
    """
    plt = _pyplot()
    dtypes = sorted({r["dtype"] for r in rows})
    columns = sorted({(r["d"], r["causal"]) for r in rows})
    systems = _systems(rows)
    passes = [p for p in _PASSES if any(f"{s} {p}" in r for r in rows for s in systems)]
    panels = [(dt, p) for dt in dtypes for p in passes]
    # At least 5.5 inches wide: a one-panel figure (the CPU sweep) still has room for its title.
    fig, axes = plt.subplots(len(panels), len(columns), squeeze=False,
                             figsize=(max(3.6 * len(columns), 5.5), 2.8 * len(panels)), sharex=True)
    for i, (dtype, pass_) in enumerate(panels):
        for j, (d, causal) in enumerate(columns):
            ax = axes[i][j]
            cell = sorted((r for r in rows if r["dtype"] == dtype and r["d"] == d and r["causal"] == causal),
                          key=lambda r: r["N"])
            for system in systems:
                key = f"{system} {pass_}"
                points = [(r["N"], r[key]) for r in cell if key in r and r[key] == r[key]]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=system, linewidth=2.2 if system == "cuflash" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{dtype} d={d}{' causal' if causal else ''} {pass_}", fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(unit)
            if i == len(panels) - 1:
                ax.set_xlabel("sequence length")
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing clipped: titles wider than the axes grow the image
    plt.close(fig)


def plot_memory(points: Sequence[dict], path, *, title: str = "", unit: str = "MiB") -> None:
    """Peak memory against sequence length, one line per measured quantity (log-log).

    ``points`` hold ``N`` and any number of ``label: bytes`` entries (a missing or infinite value, e.g.
    an out-of-memory naive run, is left out of its line).
    """
    plt = _pyplot()
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    labels = [key for key in dict.fromkeys(k for p in points for k in p) if key != "N"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label in labels:
        line = sorted((p["N"], p[label] / scale) for p in points
                      if label in p and 0 < p[label] < float("inf"))
        if line:
            xs, ys = zip(*line)
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel(f"peak extra memory ({unit})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing clipped: titles wider than the axes grow the image
    plt.close(fig)
