"""Tile tables tuned per device.

The packaged table (:data:`.spec.TILES`) holds one tile per (direction, arch class, head dim), measured on the
project's GPUs. ``python -m cuflash tune`` measures the candidate tiles of the mma.sync FlashAttention-2 kernels on
the current GPU and writes the fastest per (direction, head dim) to a JSON table for that device; the launcher
(:func:`.attention.plan_tile`) reads it, by device name and compute capability, over the packaged rows. Tiles
that the caller chooses (``block_q``, ``block_k``) still win; the Hopper (wgmma) kernels' tiles are fixed by their
structure and are not tuned.

Where tables live: ``$CUFLASH_TILES_DIR`` if set, else ``~/.cache/cuflash``; one file per device,
``tiles-<device name>-sm<cc>.json``. A file that cannot be read, or a row that is not a valid tile for its kernel,
is ignored with a warning: the packaged table runs instead.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import threading
import warnings
from pathlib import Path

from .spec import BWD_HEAD_DIMS, HEAD_DIMS, TF32_HEAD_DIMS, TILES, Tile
from .spec import spec as kernel_spec

__all__ = ["TUNABLE", "candidates", "table_path", "read_table", "write_table", "tile_for", "trying", "tune"]

# Direction (plan_tile's, and the table's) -> the kernel family its tile runs, and the head dims it is tuned at.
TUNABLE = {
    "fwd": ("fwd", HEAD_DIMS),
    "bwd": ("bwd_dkdv", BWD_HEAD_DIMS),
    "bwd_dq": ("bwd_dq", BWD_HEAD_DIMS),
    "fwd_tf32x3": ("fwd_tf32x3", TF32_HEAD_DIMS),
    "fwd_tf32": ("fwd_tf32", TF32_HEAD_DIMS),
}
ENV_DIR = "CUFLASH_TILES_DIR"
_FORMAT = 1

_lock = threading.Lock()
_tables: dict = {}        # device ordinal -> {(direction, head dim): Tile} (empty: no table)
_trying: dict = {}        # (direction, head dim) -> Tile: the candidate the tune command is timing


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "gpu"


def table_path(device_name: str, cc: int, directory: str | os.PathLike | None = None) -> Path:
    """The table file of a device: ``tiles-<name>-sm<cc>.json`` in ``directory``, ``$CUFLASH_TILES_DIR`` or
    ``~/.cache/cuflash``."""
    base = Path(directory or os.environ.get(ENV_DIR) or Path.home() / ".cache" / "cuflash")
    return base / f"tiles-{_slug(device_name)}-sm{cc}.json"


def _dtype_of(direction: str) -> str:
    return "float32" if direction.startswith("fwd_tf32") else "bfloat16"


def _valid(direction: str, d: int, t: Tile, smem_limit: int) -> bool:
    from .attention import check_tile

    try:
        check_tile(direction, d, t)
    except ValueError:
        return False
    family = TUNABLE[direction][0]
    return kernel_spec(family, _dtype_of(direction), d, t).smem <= smem_limit


def candidates(direction: str, d: int, smem_limit: int, packaged: Tile | None = None) -> list[Tile]:
    """The tiles worth timing for a kernel at head dim ``d`` (each one compiled, so a short list): 32 to 128 query
    rows (the forward 64 to 256), 32 to 128 keys, 4 or 8 warps, 1 or 2 stages, each a valid tile for the kernel
    (:func:`.attention.check_tile`) whose shared memory fits ``smem_limit``; ``packaged`` (the packaged table's
    tile) first, when given."""
    if direction not in TUNABLE:
        raise ValueError(f"direction must be one of {sorted(TUNABLE)}; got {direction!r}")
    rows = (64, 128, 256) if direction.startswith("fwd") else (32, 64, 128)
    out = [Tile(block_m, block_n, warps, stages) for block_m in rows for block_n in (32, 64, 128) for warps in (4, 8)
           for stages in (1, 2)]
    out = [t for t in out if _valid(direction, d, t, smem_limit)]
    first = [packaged] if packaged is not None and _valid(direction, d, packaged, smem_limit) else []
    return first + [t for t in out if t not in first]


def read_table(path: str | os.PathLike, smem_limit: int | None = None) -> dict:
    """``{(direction, head dim): Tile}`` of a table file; rows that are not valid tiles (or do not fit
    ``smem_limit``) are left out with a warning, as is a file that cannot be read."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        rows = data["rows"]
        if data.get("format") != _FORMAT or not isinstance(rows, list):
            raise ValueError(f"format {data.get('format')!r}, expected {_FORMAT}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"cuflash: the tile table {path} cannot be read ({exc}); the packaged tiles run", stacklevel=2)
        return {}
    table = {}
    for row in rows:
        try:
            direction, d, tile = row["direction"], int(row["head_dim"]), Tile(*(int(x) for x in row["tile"]))
            ok = direction in TUNABLE and _valid(direction, d, tile, smem_limit or 1 << 30)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            warnings.warn(f"cuflash: the tile table {path} has a row that is not a valid tile, left out: {row!r}",
                          stacklevel=2)
            continue
        table[(direction, d)] = tile
    return table


def write_table(path: str | os.PathLike, rows: list[dict], device_name: str, cc: int) -> Path:
    """Write ``rows`` (as :func:`tune` returns them) to ``path`` as a table of this device; returns the path."""
    from .. import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": _FORMAT, "device": device_name, "compute_capability": cc, "cuflash": __version__,
            "date": datetime.date.today().isoformat(),
            "rows": [{"direction": r["direction"], "head_dim": r["head_dim"], "tile": list(r["tile"]),
                      "us": r["us"], "packaged_us": r.get("packaged_us")} for r in rows]}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def _ordinal() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def _device() -> tuple[int, str, int, int]:
    """(ordinal, name, compute capability, opt-in shared memory per block) of the current device."""
    import cupy

    from .compile import device_info

    ordinal = cupy.cuda.runtime.getDevice()
    cc, smem = device_info()
    name = cupy.cuda.runtime.getDeviceProperties(ordinal)["name"]
    return ordinal, name.decode() if isinstance(name, bytes) else str(name), cc, smem


def tile_for(direction: str, d: int) -> Tile | None:
    """The tile the current device's table (or the tune command's candidate) gives for ``direction`` at the
    instantiated head dim ``d``, or None (the packaged table's row runs)."""
    if _trying:
        hit = _trying.get((direction, d))
        if hit is not None:
            return hit
    try:
        ordinal = _ordinal()
    except Exception:  # (no device to have a table of)
        return None
    table = _tables.get(ordinal)
    if table is None:
        with _lock:
            table = _tables.get(ordinal)
            if table is None:
                try:
                    _, name, cc, smem = _device()
                except Exception:  # (a runtime without device properties: a stand-in)
                    name = None
                path = None if name is None else table_path(name, cc)
                table = _tables[ordinal] = read_table(path, smem) if path is not None and path.exists() else {}
    return table.get((direction, d))


def forget_tables() -> None:
    """Read the tables again at the next call (after the tune command wrote one, or ``$CUFLASH_TILES_DIR`` moved)."""
    with _lock:
        _tables.clear()


def _forget_plans() -> None:
    """The front door's remembered plans hold their tiles: forgotten when the tile of a call changes."""
    from .._ops import api as _api

    _api._checked_calls.clear()


@contextlib.contextmanager
def trying(direction: str, d: int, tile: Tile):
    """Within: calls plan ``tile`` for ``direction`` at head dim ``d`` (the tune command's measurement)."""
    _forget_plans()
    _trying[(direction, d)] = tile
    try:
        yield
    finally:
        _trying.pop((direction, d), None)
        _forget_plans()


def _call(direction: str, d: int, *, batch: int, heads: int, seqlen: int, causal: bool):
    """A call that runs ``direction``'s mma.sync kernel at head dim ``d`` (the Hopper kernels off), and what it
    needs, as a function of no arguments."""
    import cupy
    import numpy as np

    import cuflash

    dtype = np.float32 if direction.startswith("fwd_tf32") else cupy.float16
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, seqlen, heads, d), dtype=cupy.float32).astype(dtype) for _ in range(3))
    precision = {"fwd_tf32x3": "tf32x3", "fwd_tf32": "tf32"}.get(direction, "tf32x3")
    if direction.startswith("fwd"):
        return lambda: cuflash.attention(q, k, v, causal=causal, fp32_precision=precision)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    do = rng.standard_normal(out.shape, dtype=cupy.float32).astype(dtype)
    order = "split" if direction == "bwd_dq" else "kv_outer"
    return lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, order=order)


def tune(directions, head_dims=None, *, batch: int = 2, heads: int = 16, seqlen: int = 4096, causal: bool = False,
         timer, say=print) -> list[dict]:
    """Time every candidate tile of each direction at each head dim (the direction's own head dims when
    ``head_dims`` is None) with ``timer(fn) -> seconds``, on the current GPU; returns a row per (direction, head
    dim): the fastest tile, its time and the packaged tile's. The Hopper kernels are switched off meanwhile (their
    tiles are not tuned); a candidate that fails to compile or launch is reported and skipped."""
    from . import attention
    from .compile import arch_class

    _, name, cc, smem = _device()
    hopper = {"fwd": "fwd", "bwd": "bwd"}  # (directions whose head dims with a wgmma row run it on sm_90)
    rows = []
    saved = attention.SM90A_FORWARD, attention.SM90A_BACKWARD
    attention.SM90A_FORWARD = attention.SM90A_BACKWARD = False
    try:
        for direction in directions:
            dims = TUNABLE[direction][1] if head_dims is None else [d for d in head_dims if d in TUNABLE[direction][1]]
            for d in dims:
                if (cc == 90 and (hopper.get(direction), "sm90a", d) in TILES
                        and attention._sm90_row(hopper[direction], d)):
                    say(f"{direction} d {d}: runs the wgmma kernel on this GPU (its tile is not tuned); skipped")
                    continue
                fn = _call(direction, d, batch=batch, heads=heads, seqlen=seqlen, causal=causal)
                packaged = TILES.get((direction, arch_class(cc), d))
                times = {}
                for tile in candidates(direction, d, smem, packaged):
                    try:
                        with trying(direction, d, tile):
                            times[tile] = timer(fn)
                    except Exception as exc:  # (a tile the kernel cannot run here: reported, not chosen)
                        say(f"  {direction} d {d} {tuple(tile)}: {type(exc).__name__}: {str(exc)[:100]}")
                        continue
                    say(f"  {direction} d {d} {tuple(tile)}: {times[tile] * 1e6:9.1f} us")
                if not times:
                    continue
                best = min(times, key=times.get)
                row = {"direction": direction, "head_dim": d, "tile": tuple(best), "us": times[best] * 1e6,
                       "packaged": None if packaged is None else tuple(packaged),
                       "packaged_us": times[packaged] * 1e6 if packaged in times else None}
                rows.append(row)
                gain = f", {row['packaged_us'] / row['us']:.2f}x the packaged tile" if row["packaged_us"] else ""
                say(f"{direction} d {d}: {tuple(best)} {row['us']:.1f} us{gain}")
    finally:
        attention.SM90A_FORWARD, attention.SM90A_BACKWARD = saved
        forget_tables()
    return rows


def _event_timer(rep_ms: float):
    """Seconds per call: CUDA events around each call after a first untimed one, until ``rep_ms`` are spent (3
    calls at least); the median."""
    import statistics

    import cupy

    def timed(fn) -> float:
        fn()
        cupy.cuda.get_current_stream().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times: list = []
        while sum(times) < rep_ms or len(times) < 3:
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        return statistics.median(times) * 1e-3
    return timed


def main(argv=None, prog: str = "python -m cuflash tune") -> int:
    """``python -m cuflash tune``: time the candidate tiles on this GPU and write its table."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=(
        "Time the candidate tiles of the mma.sync FlashAttention-2 kernels on this GPU and write the fastest per "
        "(direction, head dim) to this device's tile table, which the launcher reads over the packaged one."))
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=sorted(TUNABLE))
    p.add_argument("--head-dims", type=int, nargs="+", default=None,
                   help="head dims to tune (default: every one the direction's kernel is built at)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rep-ms", type=float, default=50.0, help="time spent per candidate")
    p.add_argument("--out", default=None, help="the table file (default: this device's, where the launcher looks)")
    p.add_argument("--dry-run", action="store_true", help="list the candidate tiles and exit (no GPU needed)")
    p.add_argument("--smem", type=int, default=227 * 1024,
                   help="--dry-run: the shared memory a block may use (default: an H100's 227 KiB)")
    args = p.parse_args(argv)
    if args.dry_run:
        for direction in args.directions:
            dims = TUNABLE[direction][1] if args.head_dims is None else args.head_dims
            for d in dims:
                tiles = candidates(direction, d, args.smem, TILES.get((direction, "sm80", d)))
                print(f"{direction} d {d}: {len(tiles)} candidates: " + " ".join(
                    f"{t.block_m}x{t.block_n}/{t.warps}w/{t.stages}s" for t in tiles))
        return 0
    from ..cli.main import _cupy_status, gpu_available

    if not gpu_available():
        print(f"{prog}: error: tuning needs CuPy and a CUDA GPU ({_cupy_status()[1]}); --dry-run lists the "
              f"candidates", file=__import__("sys").stderr)
        return 2
    _, name, cc, _ = _device()
    rows = tune(args.directions, args.head_dims, batch=args.batch, heads=args.heads, seqlen=args.seqlen,
                causal=args.causal, timer=_event_timer(args.rep_ms))
    path = write_table(args.out or table_path(name, cc), rows, name, cc)
    print(f"wrote {path}: {len(rows)} rows for {name} (sm_{cc}); new processes on this device read it")
    return 0
