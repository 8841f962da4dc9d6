"""``python -m cuflash``: the demo runs, checks itself against float64 and says so; errors are clear."""

import subprocess
import sys

import numpy as np
import pytest

import cuflash
from cuflash.cli import main as cli

SMALL = ["--batch", "1", "--seqlen", "70", "--heads", "2", "--head-dim", "16"]


def test_demo_in_process_passes(capsys):
    code = cli.main(["demo", "--backend", "numpy", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "backend numpy" in out
    assert "batch 1, seqlen_q 70, seqlen_k 70, heads 2 (kv 2), head_dim 16, float32" in out
    for name in ("forward", "backward", "tracemalloc peak", "out", "lse", "dq", "dk", "dv"):
        assert name in out
    assert out.rstrip().endswith("PASS")


@pytest.mark.parametrize(
    "extra",
    [
        ["--causal", "--seqlen-k", "45", "--heads", "4", "--heads-kv", "2"],  # GQA, rows that see no key
        ["--causal", "--causal-align", "top-left", "--seqlen-k", "90", "--algorithm", "fa1"],
        ["--dtype", "float64", "--algorithm", "naive"],
        ["--dtype", "float16", "--no-backward"],
    ],
    ids=["causal-gqa-empty-rows", "top-left-fa1", "float64-naive", "float16-forward"],
)
def test_demo_variants_pass(capsys, extra):
    code = cli.main(["demo", "--backend", "numpy", *SMALL, *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.rstrip().endswith("PASS")


def test_demo_as_module_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "cuflash", "demo", "--backend", "numpy", *SMALL, "--causal"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "causal bottom-right" in proc.stdout
    assert proc.stdout.rstrip().endswith("PASS")


def test_demo_fails_when_results_are_wrong(capsys, monkeypatch):
    """The check is real: a wrong output gives exit code 1 and FAIL."""
    real = cuflash.attention

    def off_by_a_bit(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out + np.asarray(0.01, dtype=out.dtype), lse

    monkeypatch.setattr(cuflash, "attention", off_by_a_bit)
    code = cli.main(["demo", "--backend", "numpy", *SMALL, "--no-backward"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL" in out


def test_float64_truth_matches_textbook_formula():
    """The demo's own float64 oracle, on one head: softmax(scale q k^T) v and its gradients."""
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((1, n, 1, 8)) for n in (5, 7, 7, 5))
    scale = 0.3
    out, lse, dq, dk, dv = cli.float64_truth(np, q, k, v, do, scale=scale, causal_offset=None)
    s = scale * q[0, :, 0] @ k[0, :, 0].T
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(out[0, :, 0], p @ v[0, :, 0], rtol=1e-12)
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(s).sum(1)), rtol=1e-12)
    dp = do[0, :, 0] @ v[0, :, 0].T
    ds = p * (dp - (dp * p).sum(1, keepdims=True))
    np.testing.assert_allclose(dq[0, :, 0], scale * ds @ k[0, :, 0], rtol=1e-10)
    np.testing.assert_allclose(dk[0, :, 0], scale * ds.T @ q[0, :, 0], rtol=1e-10)
    np.testing.assert_allclose(dv[0, :, 0], p.T @ do[0, :, 0], rtol=1e-10)


def test_backend_cupy_without_gpu_is_a_clear_error(capsys):
    if cli.gpu_available():
        pytest.skip("CuPy and a GPU are present here")
    code = cli.main(["demo", "--backend", "cupy", *SMALL])
    err = capsys.readouterr().err
    assert code == 2
    assert "--backend cupy needs CuPy and a CUDA GPU" in err


def test_bench_gpu_without_gpu_is_a_clear_error(capsys):
    if cli.gpu_available():
        pytest.skip("CuPy and a GPU are present here")
    code = cli.main(["bench-gpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "bench" in err and ("needs CuPy and a CUDA GPU" in err or "not available" in err)


def test_demo_leaves_tracemalloc_off(capsys):
    """Even when the library raises mid-measurement (here: a refused problem)."""
    import tracemalloc

    assert cli.main(["demo", "--backend", "numpy", *SMALL, "--heads", "3", "--heads-kv", "2"]) == 2
    assert not tracemalloc.is_tracing()
    assert cli.main(["demo", "--backend", "numpy", *SMALL]) == 0
    assert not tracemalloc.is_tracing()


def test_usage_errors(capsys):
    assert cli.main([]) == 2
    assert "usage: python -m cuflash" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli.main(["demo", "--dtype", "int8"]) == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    assert cli.main(["demo", "--backend", "numpy", "--seqlen", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert cli.main(["demo", "--backend", "numpy", *SMALL, "--heads", "3", "--heads-kv", "2"]) == 2
    assert "ValueError: the number of key/value heads must divide the number of query heads" in (
        capsys.readouterr().err
    )
    assert cli.main(["demo", "--help"]) == 0
    assert "--backend" in capsys.readouterr().out


def test_bench_passes_its_arguments_through(monkeypatch):
    """``bench`` picks bench_gpu with CuPy and a GPU, else bench_cpu, and hands it argv unchanged."""
    import types

    calls = []
    for which in ("cpu", "gpu"):
        fake = types.ModuleType(f"cuflash.cli.bench_{which}")
        fake.main = lambda argv, prog, which=which: calls.append((which, argv, prog)) or 0
        monkeypatch.setitem(sys.modules, f"cuflash.cli.bench_{which}", fake)
    expected = "gpu" if cli.gpu_available() else "cpu"
    assert cli.main(["bench", "--seqlen", "512", "--causal"]) == 0
    assert cli.main(["bench-cpu", "--quick"]) == 0
    assert calls == [(expected, ["--seqlen", "512", "--causal"], "python -m cuflash bench"),
                     ("cpu", ["--quick"], "python -m cuflash bench-cpu")]


@pytest.mark.parametrize("command", ["bench", "bench-cpu", "bench-gpu", "bench-decode"])
def test_bench_help_names_the_command(command, capsys):
    """Each bench command's --help shows the command as typed (bench-gpu's too, without a GPU)."""
    assert cli.main([command, "--help"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"usage: python -m cuflash {command} ["), captured.out[:200] + captured.err
    assert "cuflash.bench_" not in captured.out, captured.out


def test_bench_help_as_a_subprocess():
    """The same through the interpreter, as a user types it."""
    for command in ("bench-cpu", "bench-gpu", "bench-decode"):
        result = subprocess.run([sys.executable, "-m", "cuflash", command, "--help"],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: python -m cuflash {command} ["), result.stdout[:200]


def test_bench_decode_on_the_cpu_writes_its_table_and_plot(capsys, tmp_path, monkeypatch):
    """Without a GPU, bench-decode times the NumPy reference at small sizes and still writes JSON and a plot."""
    import json

    from cuflash.cli import main as cli

    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    out_json, out_png = tmp_path / "decode.json", tmp_path / "decode.png"
    code = cli.main(["bench-decode", "--batch", "1", "--cache", "64", "128", "--json", str(out_json),
                     "--plot", str(out_png)])
    assert code == 0
    rows = json.loads(out_json.read_text())
    assert [(r["batch"], r["cache"]) for r in rows] == [(1, 64), (1, 128)]
    assert all(r["numpy_us"] > 0 and r["kv_bytes"] == 2 * r["cache"] * 2 * 32 * 4 for r in rows)
    assert out_png.stat().st_size > 1000
    assert "NumPy reference" in capsys.readouterr().out


def test_bench_decode_mla_on_the_cpu(capsys, tmp_path, monkeypatch):
    """bench-decode --mla without a GPU: MLA's absorbed decoding (576 / 512, page 64) through the NumPy reference."""
    import json

    from cuflash.cli import main as cli

    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    out_json = tmp_path / "mla.json"
    assert cli.main(["bench-decode", "--mla", "--batch", "1", "--cache", "70", "--seqlen-q", "2",
                     "--json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())
    assert (row["head_dim"], row["head_dim_v"], row["page_size"], row["seqlen_q"]) == (576, 512, 64, 2)
    assert row["flops"] == 2 * 2 * 16 * 70 * (576 + 512) and row["numpy_us"] > 0
    assert "MLA batch   1 cache     70 q 2: NumPy reference" in capsys.readouterr().out



def test_the_gpu_table_gives_both_ratios_and_the_cudnn_target_count():
    """bench-gpu's table has cuflash's ratio to torch-flash and to torch-cudnn in every row (FA1's columns only where
    it ran), and its summary counts the cells at or above issue 14's target (1.0; 0.9 at N 512)."""
    from cuflash.cli import bench_gpu

    def row(n, c, f, d):
        return {"dtype": "bfloat16", "d": 128, "causal": False, "N": n, "cuflash fwd": c, "torch-flash fwd": f,
                "torch-cudnn fwd": d, "cuflash fwd+bwd": c / 2, "torch-flash fwd+bwd": f / 2, "torch-cudnn fwd+bwd": d}
    rows = [row(512, 460.0, 300.0, 500.0), row(4096, 600.0, 350.0, 600.0), row(16384, 580.0, 350.0, 640.0)]
    table = bench_gpu.format_table(rows).splitlines()
    assert table[0].endswith("| cuflash / torch-flash | cuflash / torch-cudnn |") and len(table) == 2 + 6
    assert table[2] == "| bfloat16 | 128 | no | fwd | 512 | 460 | 300 | 500 | 1.53 | 0.92 |"
    summary = bench_gpu.summarize(rows)
    assert "fwd     cuflash / torch-cudnn: 0.91-1.00 (median 0.92, 3 cells); at or above target" in summary
    assert "in 2 of 3" in summary.splitlines()[1]  # (0.92 at N 512 meets 0.9; 1.00 meets 1.0; 0.91 does not)
    assert "fwd+bwd cuflash / torch-cudnn: 0.45-0.50 (median 0.46, 3 cells); at or above target (1.0, 0.9 at N <= 512)" \
           " in 0 of 3" in summary
    assert len(summary.splitlines()) == 4  # (one head dim: no lines by head dim)
    rows[2]["d"] = 256  # (by head dim where there are several)
    assert bench_gpu.summarize(rows).splitlines()[-2:] == [
        "d 128    cuflash / torch-cudnn: fwd 0.92-1.00, fwd+bwd 0.46-0.50",
        "d 256    cuflash / torch-cudnn: fwd 0.91-0.91, fwd+bwd 0.45-0.45"]
    rows[0]["cuflash-fa1 fwd"] = 230.0
    assert bench_gpu.format_table(rows).splitlines()[2].endswith("| 0.92 | 230 | 2.0 |")


def test_the_fp8_table_gives_both_ratios_and_the_target_count():
    """bench-gpu --fp8's table: FP8 against cuflash bf16 and torch-cudnn bf16 per row, and per head dim the range of
    FP8 / bf16 with the count of cells at issue 14's 1.5."""
    from cuflash.cli import bench_gpu

    def row(d, n, f8, bf, cu):
        return {"d": d, "causal": n > 2048, "N": n, "cuflash fp8 fwd": f8, "cuflash bf16 fwd": bf,
                "torch-cudnn bf16 fwd": cu}
    rows = [row(128, 1024, 500.0, 500.0, 600.0), row(128, 4096, 800.0, 640.0, 650.0), row(256, 8192, 1200.0, 700.0,
                                                                                            760.0)]
    lines = bench_gpu.format_fp8_table(rows).splitlines()
    assert lines[2] == "| 128 | no | 1024 | 500 | 500 | 600 | 1.00 | 0.83 |"
    assert lines[4] == "| 256 | yes | 8192 | 1200 | 700 | 760 | 1.71 | 1.58 |"
    assert lines[5] == "fp8 / bf16 at d 128: 1.00-1.25 (median 1.12); at or above 1.5 in 0 of 2"
    assert lines[6] == "fp8 / bf16 at d 256: 1.71-1.71 (median 1.71); at or above 1.5 in 1 of 1"


def test_the_float32_table_sums_up_speed_and_error_per_precision():
    """bench-gpu --float32's table: a row per shape, then per float32-class precision (tf32x3, fp16x3) its TFLOP/s
    range, the cells at issue 14's 100 and its error over torch MATH's; a system that failed (NaN) is left out."""
    from cuflash.cli import bench_gpu

    def row(n, t3, f3, err3, errf, err_math):
        return {"d": 128, "causal": False, "N": n, "cuflash tf32x3 fwd": t3, "cuflash fp16x3 fwd": f3,
                "cuflash tf32x3 maxerr": err3, "cuflash fp16x3 maxerr": errf, "torch math maxerr": err_math}
    rows = [row(1024, 33.0, 106.5, 2e-7, 5e-7, 4e-7), row(4096, 34.0, float("nan"), 1e-7, 9e-7, 3e-7)]
    lines = bench_gpu.format_float32_table(rows).splitlines()
    assert len(lines) == 6 and lines[2].startswith(" 128  False   1024 |")
    assert lines[4] == "cuflash tf32x3: 33.0-34.0 TFLOP/s, at or above 100 in 0 of 2; max|error| / torch math's at most 0.50"
    assert lines[5] == "cuflash fp16x3: 106.5-106.5 TFLOP/s, at or above 100 in 1 of 1; max|error| / torch math's at most 3.00"
