"""Tile tables tuned per device (cuflash._cuda.tuning, ``python -m cuflash tune``): the candidates, the table file,
the launcher reading it over the packaged table. CPU tests: the device is a stand-in; the measuring run is a GPU
test."""

from __future__ import annotations

import json

import pytest

from cuflash.cli import main as cli
from cuflash._ops import api as _api
from cuflash._cuda import attention, tuning
from cuflash._cuda.spec import TILES, Tile
from cuflash._cuda.spec import spec as kernel_spec

H100_SMEM = 227 * 1024


@pytest.mark.parametrize("direction", sorted(tuning.TUNABLE))
def test_candidates_are_tiles_the_kernels_take_and_fit(direction):
    family, dims = tuning.TUNABLE[direction]
    dtype = "float32" if direction.startswith("fwd_tf32") else "bfloat16"
    for d in dims:
        packaged = TILES.get((direction, "sm80", d))
        tiles = tuning.candidates(direction, d, H100_SMEM, packaged)
        assert tiles and len(set(tiles)) == len(tiles), (direction, d)
        if packaged is not None:
            assert tiles[0] == packaged  # the packaged tile is timed first (the baseline of the gain)
        for t in tiles:
            attention.check_tile(direction, d, t)  # raises for a tile the kernel static_asserts against
            assert kernel_spec(family, dtype, d, t).smem <= H100_SMEM, (direction, d, t)
    # a smaller shared memory leaves fewer (and never more) candidates
    small = tuning.candidates(direction, dims[-1], 48 * 1024)
    assert all(kernel_spec(family, dtype, dims[-1], t).smem <= 48 * 1024 for t in small)
    assert len(small) <= len(tuning.candidates(direction, dims[-1], H100_SMEM))


def test_candidates_refuse_an_unknown_direction():
    with pytest.raises(ValueError, match="direction must be one of"):
        tuning.candidates("sideways", 64, H100_SMEM)


def _rows():
    return [{"direction": "fwd", "head_dim": 96, "tile": (64, 32, 4, 2), "us": 100.0, "packaged_us": 120.0},
            {"direction": "bwd", "head_dim": 64, "tile": (64, 64, 4, 2), "us": 300.0, "packaged_us": None}]


def test_a_table_round_trips_and_its_bad_rows_are_left_out(tmp_path):
    path = tuning.write_table(tmp_path / "t.json", _rows(), "Test GPU", 80)
    assert tuning.read_table(path) == {("fwd", 96): Tile(64, 32, 4, 2), ("bwd", 64): Tile(64, 64, 4, 2)}
    data = json.loads(path.read_text())
    assert data["device"] == "Test GPU" and data["compute_capability"] == 80 and data["format"] == 1
    data["rows"].append({"direction": "fwd", "head_dim": 64, "tile": [48, 32, 4, 2]})   # not a multiple of 16 x warps
    data["rows"].append({"direction": "bwd", "head_dim": 64})                          # no tile
    data["rows"].append({"direction": "nope", "head_dim": 64, "tile": [64, 64, 4, 2]})  # no such kernel
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="not a valid tile, left out") as caught:
        table = tuning.read_table(path)
    assert len(caught) == 3 and set(table) == {("fwd", 96), ("bwd", 64)}
    # a row that would not fit the device's shared memory is left out too
    with pytest.warns(UserWarning, match="not a valid tile"):
        assert ("bwd", 64) not in tuning.read_table(path, smem_limit=16 * 1024)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="cannot be read"):
        assert tuning.read_table(path) == {}


def test_table_paths_name_the_device(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    assert tuning.table_path("NVIDIA H100 80GB HBM3", 90) == tmp_path / "tiles-nvidia-h100-80gb-hbm3-sm90.json"
    monkeypatch.delenv(tuning.ENV_DIR)
    assert tuning.table_path("A100", 80).parent.name == "cuflash"


@pytest.fixture
def stand_in_device(monkeypatch, tmp_path):
    """An A100-class device (cc 80) named "Test GPU" whose tables live in tmp_path."""
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(tuning, "_ordinal", lambda: 0)
    monkeypatch.setattr(tuning, "_device", lambda: (0, "Test GPU", 80, 163 * 1024))
    monkeypatch.setattr(attention, "device_info", lambda: (80, 163 * 1024))
    tuning.forget_tables()
    yield tmp_path
    tuning.forget_tables()


def test_the_launcher_reads_the_device_table_over_the_packaged_one(stand_in_device):
    packaged = TILES[("fwd", "sm80", 96)]
    assert attention.plan_tile("fwd", 96, None, None) == packaged  # no table yet
    tuning.write_table(tuning.table_path("Test GPU", 80), _rows(), "Test GPU", 80)
    assert attention.plan_tile("fwd", 96, None, None) == packaged  # tables are read once per process ...
    tuning.forget_tables()
    assert attention.plan_tile("fwd", 96, None, None) == Tile(64, 32, 4, 2)  # ... or after forget_tables
    assert attention.plan_tile("fwd", 80, None, None) == Tile(64, 32, 4, 2)  # (d 80 runs the d 96 row)
    assert attention.plan_tile("bwd", 64, None, None) == Tile(64, 64, 4, 2)
    assert attention.plan_tile("fwd", 128, None, None) == TILES[("fwd", "sm80", 128)]  # no row: packaged
    # the caller's block sizes still win
    assert attention.plan_tile("fwd", 96, 128, 64).block_m == 128


def test_trying_a_tile_plans_it_and_forgets_remembered_plans(stand_in_device):
    _api._checked_calls.put(("a", "key"), object())
    with tuning.trying("fwd", 96, Tile(128, 32, 8, 1)):
        assert len(_api._checked_calls) == 0
        assert attention.plan_tile("fwd", 96, None, None) == Tile(128, 32, 8, 1)
        _api._checked_calls.put(("a", "key"), object())
    assert len(_api._checked_calls) == 0
    assert attention.plan_tile("fwd", 96, None, None) == TILES[("fwd", "sm80", 96)]


def test_tune_command_lists_candidates_without_a_gpu(capsys):
    assert cli.main(["tune", "--dry-run", "--directions", "bwd", "--head-dims", "64"]) == 0
    out = capsys.readouterr().out
    packaged = TILES[("bwd", "sm80", 64)]
    assert out.startswith(f"bwd d 64: {len(tuning.candidates('bwd', 64, H100_SMEM))} candidates: "
                          f"{packaged.block_m}x{packaged.block_n}/{packaged.warps}w/{packaged.stages}s")


def test_tune_command_without_a_gpu_says_so(capsys, monkeypatch):
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    assert cli.main(["tune"]) == 2
    assert "tuning needs CuPy and a CUDA GPU" in capsys.readouterr().err
    assert "tune" in cli.USAGE


@pytest.mark.gpu
def test_tune_measures_and_the_launcher_runs_the_table(tmp_path, monkeypatch):
    """On a GPU: tuning one direction at one head dim times its candidates, writes a row, and the forward then
    runs the tuned tile with results equal to the packaged tile's within rounding."""
    cupy = pytest.importorskip("cupy")
    if not cli.gpu_available():
        pytest.skip("needs a CUDA GPU")
    import cuflash

    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    d = 96  # (no wgmma kernel at d 96: the mma.sync forward runs everywhere)
    calls, seen = [], []

    def timer(fn):  # every candidate runs; later ones "faster", so that the table holds another tile than packaged
        fn()
        calls.append(1)
        return 1.0 / len(calls)

    rows = tuning.tune(["fwd"], [d], batch=1, heads=2, seqlen=256, timer=timer, say=seen.append)
    assert len(rows) == 1 and rows[0]["direction"] == "fwd" and rows[0]["head_dim"] == d
    _, name, cc, smem = tuning._device()
    packaged = TILES[("fwd", attention.arch_class(cc), d)]
    # (a candidate that does not compile or launch here is reported in `seen` and skipped)
    assert 1 < len(calls) <= len(tuning.candidates("fwd", d, smem, packaged)), seen
    tuned = Tile(*rows[0]["tile"])
    assert tuned != packaged and rows[0]["packaged"] == tuple(packaged)
    path = tuning.write_table(tuning.table_path(name, cc), rows, name, cc)
    assert tuning.read_table(path) == {("fwd", d): tuned}
    tuning.forget_tables()
    assert attention.plan_tile("fwd", d, None, None) == tuned
    rng = cupy.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 300, 2, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    want = cuflash.attention(q, k, v, causal=True)
    tuning.forget_tables()
    _api._checked_calls.clear()
    got = cuflash.attention(q, k, v, causal=True)
    assert float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max()) < 2e-3
    tuning.forget_tables()
    _api._checked_calls.clear()
