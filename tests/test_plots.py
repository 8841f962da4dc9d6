"""The benchmark plots draw from plain rows of numbers (no GPU needed to redraw a saved run)."""

import pytest

pytest.importorskip("matplotlib")

from cuflash.plots import plot_memory, plot_throughput  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_throughput_plot(tmp_path):
    rows = [
        {"dtype": dt, "d": d, "causal": c, "N": n, "cuflash fwd": 100 + n / 100, "torch-flash fwd": 90.0,
         "cuflash fwd+bwd": 80.0, "torch-flash fwd+bwd": float("nan")}
        for dt in ("bfloat16", "float16") for d in (64, 128) for c in (False, True) for n in (512, 1024, 2048)
    ]
    path = tmp_path / "throughput.png"
    plot_throughput(rows, path, title="test")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_memory_plot_skips_out_of_memory_points(tmp_path):
    points = [{"N": n, "cuflash forward": 2**20 * n, "naive": float("inf") if n > 2048 else 2**10 * n * n}
              for n in (512, 1024, 2048, 4096)]
    path = tmp_path / "memory.png"
    plot_memory(points, path)
    assert path.read_bytes()[:8] == PNG_MAGIC
