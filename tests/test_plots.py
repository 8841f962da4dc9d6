"""The benchmark plots draw from plain rows of numbers (no GPU needed to redraw a saved run)."""

import pytest

pytest.importorskip("matplotlib")

from cuflash.cli.plots import plot_memory, plot_throughput  # noqa: E402

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


def _ink_at_edges(path) -> bool:
    """True when any pixel of the image's outermost rows or columns is not the white background: something
    drawn was cut at the edge (a title wider than the figure, as the one-panel CPU plot had)."""
    import matplotlib.image

    image = matplotlib.image.imread(path)[..., :3]
    edges = (image[0], image[-1], image[:, 0], image[:, -1])
    return any(bool((edge < 0.99).any()) for edge in edges)


LONG_TITLE = "cuflash NumPy reference, forward, float32, batch 1, heads 2, a title wider than one panel"


def test_one_panel_throughput_plot_is_not_clipped(tmp_path):
    """The CPU sweep's figure (one panel, GFLOP/s) keeps its whole title inside the image."""
    rows = [{"dtype": "float32", "d": 64, "causal": False, "N": n, "naive fwd": 10.0 + n / 1000,
             "fa2 fwd": 5.0 + n / 900, "fa1 fwd": 4.0 + n / 800} for n in (256, 512, 1024, 2048, 4096)]
    path = tmp_path / "cpu-throughput.png"
    plot_throughput(rows, path, title=LONG_TITLE, unit="GFLOP/s")
    assert not _ink_at_edges(path)


def test_memory_plot_is_not_clipped(tmp_path):
    points = [{"N": n, "naive": 8 * n * n, "fa2": 1000 * n} for n in (256, 1024, 4096)]
    path = tmp_path / "cpu-memory.png"
    plot_memory(points, path, title=LONG_TITLE)
    assert not _ink_at_edges(path)


@pytest.mark.parametrize("kind", ["fp8", "float32"])
def test_fp8_and_float32_tables_plot(tmp_path, kind):
    """bench-gpu --fp8 / --float32 --plot: their rows (FP8's name no dtype) drawn as the throughput panels."""
    from cuflash.cli.bench_gpu import plot_special

    if kind == "fp8":
        rows = [{"d": d, "causal": c, "N": n, "maxdiff": 0.01, "cuflash fp8 fwd": 700.0 + n / 100,
                 "cuflash bf16 fwd": 600.0, "torch-cudnn bf16 fwd": 620.0}
                for d in (128, 256) for c in (False, True) for n in (1024, 4096)]
    else:
        rows = [{"dtype": "float32", "d": d, "causal": c, "N": n, "cuflash tf32x3 fwd": 33.0, "cuflash tf32 fwd": 300.0,
                 "torch efficient fwd": float("nan")} for d in (64, 128) for c in (False, True) for n in (1024, 4096)]
    path = tmp_path / f"{kind}.png"
    plot_special(rows, path, "a GPU")
    assert path.read_bytes()[:8] == PNG_MAGIC
