"""The CuPy backend: tile table, NVRTC module cache and kernel launches.

Implements the backend interface of ``docs/architecture.md``::

    forward(q, k, v, *, scale, causal_offset, algorithm, block_q, block_k) -> (out, lse)
    backward(do, q, k, v, out, lse, *, scale, causal_offset, algorithm, block_q, block_k, order)
        -> (dq, dk, dv)

Arguments arrive validated and normalized from the front door (:mod:`cuflash._api`); only internal
assertions live here. The CUDA sources in :mod:`cuflash_kernels` are compiled at run time by NVRTC through
``cupy.RawModule``: one module per kernel instantiation actually used, cached per (device, source, options,
name expression) in this process and on disk by CuPy. Every template argument (dtype, head dim, causal,
tile sizes, warps, stages) comes from the one tile table below, :data:`TILES`.

Paths:
- float16 / bfloat16, head dim 32, 64, 96, 128, 256 (backward up to 128): tensor-core kernels
  (``mma.sync``), sm_80 or newer. Backward at head dim 256 runs the float32 path on upcast inputs.
  On sm_90 (H100/H200) the forward and the backward's dK/dV(+dQ) kernel at head dim 64 and 128 run the
  Hopper kernels (``forward_sm90.cu``, ``backward_sm90.cu``: ``wgmma``, compiled for sm_90a) instead,
  unless the caller chooses block sizes.
- float32: plain SIMT float32 kernels (no tensor cores, no TF32; key/value tiles through shared memory): as
  accurate as float32 allows, ~40x slower than the 16-bit tensor-core kernels.
- ``algorithm="naive"``: the materialized reference computation with CuPy matmuls (O(N^2) memory).
- ``algorithm="fa1"``: FlashAttention-1 kernels (``fa1.cu``): one thread block per (batch, head), key/value
  tiles outer, the running O, m, l (forward) and dQ (backward) read-modify-written in float32 global
  memory at every step; float32 inputs run FA1-order float32 kernels of the same file (one query row per
  warp step), and the fp16/bf16 backward at head dim 256 runs them on upcast inputs.

Backward orders: ``"kv_outer"`` (default) is FlashAttention-2's: key/value tiles outer, dQ accumulated in a
float32 workspace with atomicAdd (float32 inputs too). ``"split"`` (deterministic) and ``"q_outer"`` run two passes: dK/dV with
key/value tiles outer, then dQ with query tiles outer; no atomics, bitwise reproducible. GQA/MQA: dK and dV
are computed per query head into a float32 workspace (batch, heads_q, seqlen_k, d) and summed over each
group in a fixed order by a small reduction kernel (deterministic in every order).
"""

from __future__ import annotations

import importlib.resources
import re
import threading
from typing import NamedTuple

import numpy as np

__all__ = [
    "TILES",
    "Tile",
    "forward",
    "backward",
    "check_supported",
    "instantiations",
    "compile_source_for_nvrtc",
    "NVRTC_OPTIONS",
]

# Options given to NVRTC (CuPy appends the -arch of the current device).
NVRTC_OPTIONS = ("-std=c++17",)
# The Hopper forward (forward_sm90.cu: wgmma, sm_90a only) names its target; CuPy still appends the
# device's -arch=sm_90, and NVRTC keeps the architecture-specific sm_90a (hopper_tiles.cuh #errors otherwise).
SM90A_OPTIONS = NVRTC_OPTIONS + ("-arch=sm_90a",)
# On sm_90 devices the forward runs flash_fwd_sm90_kernel where TILES has a ("fwd", "sm90a", d) row, and the
# backward flash_bwd_dkdv_sm90_kernel where it has a ("bwd", "sm90a", d) row (switches for benchmarks).
SM90A_FORWARD = True
SM90A_BACKWARD = True

HEAD_DIMS = (32, 64, 96, 128, 256)
BWD_HEAD_DIMS = (32, 64, 96, 128)
_LOG2E = 1.4426950408889634


class Tile(NamedTuple):
    """Template arguments of one kernel: tile rows (block_m queries, block_n keys), warps, stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int


# The tile table: (direction, arch class, head dim) -> Tile, shared by float16 and bfloat16.
# direction "fwd": flash_fwd_kernel (block_m = 16 or 32 query rows per warp).
# direction "bwd": flash_bwd_dkdv_kernel (block_n key rows in groups of 32, warps / (block_n / 32) warps per
# group splitting the query columns and the head dim; block_m streamed query rows; stages >= 2).
# direction "bwd_dq": flash_bwd_dq_kernel of the split order (block_m = 16 * warps query rows).
# Arch classes: "sm90" (H100/H200: 227 KiB shared memory per block), "sm80" (A100: 163 KiB),
# "sm86" (sm_86/87/89 consumer and workstation parts: 99 KiB).
TILES: dict[tuple[str, str, int], Tile] = {
    ("fwd", "sm90", 32): Tile(128, 128, 4, 2),
    ("fwd", "sm90", 64): Tile(128, 64, 4, 2),
    ("fwd", "sm90", 96): Tile(128, 64, 4, 2),
    ("fwd", "sm90", 128): Tile(128, 128, 8, 2),
    ("fwd", "sm90", 256): Tile(128, 64, 8, 2),
    ("fwd", "sm80", 32): Tile(128, 128, 4, 2),
    ("fwd", "sm80", 64): Tile(128, 64, 4, 2),
    ("fwd", "sm80", 96): Tile(128, 64, 4, 2),
    ("fwd", "sm80", 128): Tile(128, 32, 4, 2),
    ("fwd", "sm80", 256): Tile(64, 32, 4, 2),
    ("fwd", "sm86", 32): Tile(128, 128, 8, 2),
    ("fwd", "sm86", 64): Tile(128, 128, 8, 2),
    ("fwd", "sm86", 96): Tile(64, 64, 4, 2),
    ("fwd", "sm86", 128): Tile(64, 64, 4, 2),
    ("fwd", "sm86", 256): Tile(64, 32, 4, 1),
    # ("fwd", "sm90a", d): flash_fwd_sm90_kernel (wgmma; block_m = 64 query rows per warpgroup of 4 warps).
    ("fwd", "sm90a", 64): Tile(128, 64, 8, 2),
    ("fwd", "sm90a", 128): Tile(128, 128, 8, 2),
    # ("bwd", "sm90a", d): flash_bwd_dkdv_sm90_kernel (wgmma; block_n = 64 key rows per warpgroup of 4 warps,
    # block_m = 64 streamed query rows, 2 query buffers).
    ("bwd", "sm90a", 64): Tile(64, 128, 8, 2),
    ("bwd", "sm90a", 128): Tile(64, 128, 8, 2),
    ("bwd", "sm90", 32): Tile(64, 128, 8, 2),
    ("bwd", "sm90", 64): Tile(64, 64, 4, 2),
    ("bwd", "sm90", 96): Tile(64, 64, 4, 2),
    ("bwd", "sm90", 128): Tile(64, 128, 8, 2),
    ("bwd", "sm80", 32): Tile(64, 128, 8, 2),
    ("bwd", "sm80", 64): Tile(64, 64, 4, 2),
    ("bwd", "sm80", 96): Tile(64, 64, 4, 2),
    ("bwd", "sm80", 128): Tile(64, 128, 8, 2),
    ("bwd", "sm86", 32): Tile(64, 128, 8, 2),
    ("bwd", "sm86", 64): Tile(64, 64, 4, 2),
    ("bwd", "sm86", 96): Tile(64, 64, 4, 2),
    ("bwd", "sm86", 128): Tile(32, 64, 4, 2),
    ("bwd_dq", "sm90", 32): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm90", 64): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm90", 96): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm90", 128): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm80", 32): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm80", 64): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm80", 96): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm80", 128): Tile(64, 64, 4, 2),
    ("bwd_dq", "sm86", 32): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm86", 64): Tile(64, 128, 4, 2),
    ("bwd_dq", "sm86", 96): Tile(64, 64, 4, 1),
    ("bwd_dq", "sm86", 128): Tile(64, 64, 4, 1),
    # direction "fa1_fwd": fa1_fwd_kernel (block_m = 16 query rows per warp tile, block_n key rows held by
    # the block, warps taking query tiles in turn, stages = query buffers per warp).
    # direction "fa1_bwd": fa1_bwd_kernel (block_n = 16 * warps key rows outer, block_m query rows inner).
    ("fa1_fwd", "sm90", 32): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm90", 64): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm90", 96): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm90", 128): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm90", 256): Tile(16, 32, 4, 2),
    ("fa1_fwd", "sm80", 32): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm80", 64): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm80", 96): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm80", 128): Tile(16, 64, 8, 2),
    ("fa1_fwd", "sm80", 256): Tile(16, 32, 4, 2),
    ("fa1_fwd", "sm86", 32): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm86", 64): Tile(16, 128, 8, 2),
    ("fa1_fwd", "sm86", 96): Tile(16, 64, 8, 1),
    ("fa1_fwd", "sm86", 128): Tile(16, 64, 8, 1),
    ("fa1_fwd", "sm86", 256): Tile(16, 32, 4, 1),
    ("fa1_bwd", "sm90", 32): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm90", 64): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm90", 96): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm90", 128): Tile(32, 128, 8, 2),
    ("fa1_bwd", "sm80", 32): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm80", 64): Tile(64, 128, 8, 2),
    ("fa1_bwd", "sm80", 96): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm80", 128): Tile(32, 128, 8, 2),
    ("fa1_bwd", "sm86", 32): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm86", 64): Tile(64, 64, 4, 2),
    ("fa1_bwd", "sm86", 96): Tile(64, 64, 4, 1),
    ("fa1_bwd", "sm86", 128): Tile(32, 64, 4, 2),
    # Arch class "f32": the FA1 float32 kernels (fa1_fwd_f32_kernel, fa1_bwd_f32_kernel; any GPU), 4 warps,
    # block_m = 1 query row per warp step; block_n key rows (forward: one lane per key, at most 32;
    # backward: block_n / 4 key rows per warp, their dK and dV in registers).
    **{("fa1_fwd", "f32", d): Tile(1, 32, 4, 1) for d in HEAD_DIMS},
    # ("fwd", "f32", d): FA2's float32 forward (flash_fwd_f32_kernel): block_m query rows, 4 warps of
    # block_m / 4 rows each, block_n <= 32 key rows (one lane per key).
    **{("fwd", "f32", d): Tile(16, 32, 4, 1) for d in HEAD_DIMS},
    # ("bwd", "f32", d): FA2's float32 dK/dV(+dQ) kernel (flash_bwd_dkdv_f32_kernel), one key tile of block_n
    # rows per block, as the FA1 float32 backward's tiles.
    **{("bwd", "f32", d): Tile(1, 32 if d <= 128 else 16, 4, 1) for d in HEAD_DIMS},
    **{("fa1_bwd", "f32", d): Tile(1, 32 if d <= 128 else 16, 4, 1) for d in HEAD_DIMS},
}

_CXX_TYPE = {"float16": "cuflash::fp16", "bfloat16": "cuflash::bf16"}


def _arch_class(cc: int) -> str:
    if cc >= 90:
        return "sm90"
    if cc in (80, 87):
        return "sm80"
    return "sm86"


def _bool(b: bool) -> str:
    return "true" if b else "false"


# ---------------------------------------------------------------------------------------------------
# Name expressions and shared-memory sizes (one place each).


def _fwd_name(ctype: str, d: int, t: Tile, causal: bool) -> str:
    return f"cuflash::flash_fwd_kernel<{ctype}, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, {_bool(causal)}>"


def _fwd_smem(d: int, t: Tile) -> int:
    return 2 * d * (t.block_m + 2 * t.stages * t.block_n)


def _fwd_f32_name(d: int, t: Tile, causal: bool) -> str:
    return f"cuflash::flash_fwd_f32_kernel<{d}, {t.block_m}, {t.block_n}, {_bool(causal)}>"


def _fwd_f32_smem(d: int, t: Tile) -> int:
    return 4 * (t.block_n * (2 * d + 1) + t.block_m * d)  # K (rows padded by one float), V; the query tile


def _fwd_sm90_name(ctype: str, d: int, t: Tile, causal: bool) -> str:
    return (f"cuflash::flash_fwd_sm90_kernel<{ctype}, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, "
            f"{_bool(causal)}>")


def _fwd_sm90_smem(d: int, t: Tile) -> int:
    # + 1024: the kernel aligns its base to 1024 bytes; + 128: the mbarriers of the warp-specialized variant
    return 2 * d * (t.block_m + 2 * t.stages * t.block_n) + 1024 + 128


def _dkdv_name(ctype: str, d: int, t: Tile, causal: bool, has_dq: bool) -> str:
    return (
        f"cuflash::flash_bwd_dkdv_kernel<{ctype}, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, "
        f"{_bool(causal)}, {_bool(has_dq)}>"
    )


def _dkdv_smem(d: int, t: Tile, has_dq: bool) -> int:
    tiles = 2 * t.block_n * d + 2 * t.stages * t.block_m * d + 2 * t.block_n * t.block_m  # K, V; Q, dO; P^T, dS^T
    return 2 * tiles + 4 * 2 * t.stages * t.block_m  # 16-bit tiles + float32 lse and D per stage


def _dkdv_f32_name(d: int, t: Tile, causal: bool, has_dq: bool) -> str:
    return f"cuflash::flash_bwd_dkdv_f32_kernel<{d}, {t.block_n}, {_bool(causal)}, {_bool(has_dq)}>"


def _bwd_f32_smem(d: int, t: Tile) -> int:
    # bwd_f32_key_tile (fa1_bwd_f32_kernel, flash_bwd_dkdv_f32_kernel): K, V; one Q and dO row; a dQ row per warp
    return 4 * d * (2 * t.block_n + 2 + t.warps)


def _dkdv_sm90_name(ctype: str, d: int, t: Tile, causal: bool, has_dq: bool) -> str:
    return (
        f"cuflash::flash_bwd_dkdv_sm90_kernel<{ctype}, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, "
        f"{_bool(causal)}, {_bool(has_dq)}>"
    )


def _dkdv_sm90_smem(d: int, t: Tile) -> int:
    # Sm90BwdConfig::kSmemBytes: K, V; 2 x (Q, dO); dS^T (16-bit); 2 x (lse, D) float32; + 1024 for alignment
    return 2 * (2 * t.block_n * d + 4 * t.block_m * d + t.block_n * t.block_m) + 16 * t.block_m + 1024


def _dkdv_ok(d: int, t: Tile) -> bool:
    """The shape constraints flash_bwd_dkdv_kernel static_asserts (warp grid of S^T, dK/dV and dQ)."""
    if t.block_n % 32 or t.block_m % 32 or t.stages < 2 or t.warps % (t.block_n // 32 or 1):
        return False
    wm = t.warps // (t.block_n // 32)
    if wm < 1 or (t.block_m // wm) % 16 or (d // wm) % 16 or t.block_m % wm or d % wm:
        return False
    wqm = t.block_m // 32
    rows = 32 if t.warps % wqm == 0 and d % (16 * (t.warps // wqm)) == 0 else 16
    wqm = t.block_m // rows
    return t.warps % wqm == 0 and (d // (t.warps // wqm)) % 16 == 0 and d % (t.warps // wqm) == 0


def _dq_name(ctype: str, d: int, t: Tile, causal: bool) -> str:
    return f"cuflash::flash_bwd_dq_kernel<{ctype}, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, {_bool(causal)}>"


def _dq_smem(d: int, t: Tile) -> int:
    return 2 * d * (2 * t.block_m + 2 * t.stages * t.block_n)


def _check_tile(direction: str, d: int, t: Tile) -> None:
    """The constraints each kernel static_asserts, checked before compiling a user-chosen tile."""
    ok = t.block_m % 16 == 0 and t.block_n % 16 == 0 and t.stages >= 1 and 1 <= t.warps <= 16
    if direction == "fwd":
        ok = ok and t.block_m % (16 * t.warps) == 0 and t.block_m // (16 * t.warps) in (1, 2)
    elif direction == "bwd_dq":
        ok = ok and t.block_m == 16 * t.warps
    else:
        ok = ok and _dkdv_ok(d, t)
    if not ok:
        raise ValueError(
            f"block sizes block_q={t.block_m if direction != 'bwd' else t.block_m}, "
            f"block_k={t.block_n} are not a valid CUDA tile for the {direction} kernel at head_dim {d}: "
            "the CUDA kernels need multiples of 16 with 16 rows per warp (forward: block_q = 16 * warps, "
            "up to 256; backward: block_k and block_q multiples of 32, head_dim / 2 a multiple of 16 for "
            "two warps per 32 key rows)"
        )


# ---------------------------------------------------------------------------------------------------
# Sources and the module cache.

_INCLUDE_RE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def _read_kernel_file(name: str) -> str:
    return importlib.resources.files("cuflash_kernels").joinpath(name).read_text(encoding="utf-8")


def compile_source_for_nvrtc(source: str) -> str:
    """The full text NVRTC compiles for ``source`` ("forward.cu" or "backward.cu"): the file with its
    local ``#include "...cuh"`` lines replaced by the headers' text, so no include path is needed."""

    def expand(m: re.Match) -> str:
        return f"// ---- begin {m.group(1)}\n{_read_kernel_file(m.group(1))}\n// ---- end {m.group(1)}"

    return _INCLUDE_RE.sub(expand, _read_kernel_file(source))


def instantiations() -> list[tuple[str, str, tuple[str, ...]]]:
    """Every shipped kernel instantiation as (source file, name expression, NVRTC options)."""
    out: list[tuple[str, str, tuple[str, ...]]] = []
    seen = set()

    def add(src: str, name: str, options: tuple[str, ...] = NVRTC_OPTIONS) -> None:
        if (src, name) not in seen:
            seen.add((src, name))
            out.append((src, name, options))

    for (direction, _arch, d), t in TILES.items():
        for ctype in _CXX_TYPE.values():
            for causal in (False, True):
                if direction == "fwd" and _arch == "sm90a":
                    add("forward_sm90.cu", _fwd_sm90_name(ctype, d, t, causal), SM90A_OPTIONS)
                elif direction == "fwd" and _arch == "f32":
                    add("forward.cu", _fwd_f32_name(d, t, causal))
                elif direction == "bwd" and _arch == "f32":
                    for has_dq in (True, False):
                        add("backward.cu", _dkdv_f32_name(d, t, causal, has_dq))
                elif direction == "fwd":
                    add("forward.cu", _fwd_name(ctype, d, t, causal))
                elif direction == "bwd" and _arch == "sm90a":
                    for has_dq in (True, False):
                        add("backward_sm90.cu", _dkdv_sm90_name(ctype, d, t, causal, has_dq), SM90A_OPTIONS)
                elif direction == "bwd":
                    for has_dq in (True, False):
                        add("backward.cu", _dkdv_name(ctype, d, t, causal, has_dq))
                elif direction in ("fa1_fwd", "fa1_bwd") and _arch == "f32":
                    add("fa1.cu", _fa1_name(direction, "float", d, t, causal))
                elif direction in ("fa1_fwd", "fa1_bwd"):
                    add("fa1.cu", _fa1_name(direction, ctype, d, t, causal))
                else:
                    add("backward.cu", _dq_name(ctype, d, t, causal))
    for d in HEAD_DIMS:
        for causal in (False, True):
            add("backward.cu", f"cuflash::flash_bwd_dq_f32_kernel<{d}, {_bool(causal)}>")
        add("backward.cu", f"cuflash::flash_bwd_preprocess_f32_kernel<{d}>")
        for ctype in _CXX_TYPE.values():
            add("backward.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {d}>")
            add("backward.cu", f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {d}>")
            add("backward.cu", f"cuflash::flash_bwd_reduce_dkv_kernel<{ctype}, {d}>")
    return out


_lock = threading.Lock()
_modules: dict = {}
_sources: dict = {}


def _kernel(source: str, name: str, smem: int = 0, options: tuple[str, ...] = NVRTC_OPTIONS):
    """The compiled kernel ``name`` of ``source`` for the current device (compiled once, then cached)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    key = (dev, source, options, name)
    with _lock:
        entry = _modules.get(key)
        if entry is None:
            text = _sources.get(source)
            if text is None:
                text = _sources[source] = compile_source_for_nvrtc(source)
            module = cupy.RawModule(code=text, options=options, name_expressions=[name])
            entry = _modules[key] = [module.get_function(name), 0]
        if smem > 48 * 1024 and entry[1] < smem:
            entry[0].max_dynamic_shared_size_bytes = smem
            entry[1] = smem
    return entry[0]


_device_cache: dict = {}


def _device_info():
    """(compute capability as an int, opt-in shared memory per block) of the current device, cached."""
    import cupy

    dev_id = cupy.cuda.runtime.getDevice()
    info = _device_cache.get(dev_id)
    if info is None:
        dev = cupy.cuda.Device(dev_id)
        info = _device_cache[dev_id] = (int(dev.compute_capability), int(dev.attributes["MaxSharedMemoryPerBlockOptin"]))
    return info


# ---------------------------------------------------------------------------------------------------
# Checks.


def check_supported(problem, algorithm: str) -> None:
    """Refuse, before any launch, what the CUDA backend cannot run."""
    dtype = np.dtype(problem.dtype).name
    if algorithm == "naive":
        return
    if dtype == "float64":
        raise TypeError(
            f"float64 is not supported by the CUDA kernels (algorithm='{algorithm}'); use float32, "
            "algorithm='naive', or NumPy arrays"
        )
    if problem.head_dim not in HEAD_DIMS:
        raise RuntimeError(
            f"head_dim {problem.head_dim} is not supported by the CUDA kernels; "
            f"supported: {', '.join(map(str, HEAD_DIMS))}"
        )
    if dtype in _CXX_TYPE:
        cc, _ = _device_info()
        if cc < 80:
            raise RuntimeError(
                f"the float16/bfloat16 CUDA kernels need compute capability 8.0 or newer (mma.sync bf16, "
                f"cp.async); this GPU is sm_{cc}"
            )


def _tile(direction: str, d: int, block_q, block_k) -> Tile:
    cc, smem_optin = _device_info()
    t = TILES.get((direction, _arch_class(cc), d))
    assert t is not None, (direction, cc, d)
    if block_q is not None or block_k is not None:
        bm = block_q if block_q is not None else t.block_m
        bn = block_k if block_k is not None else t.block_n
        if direction == "bwd":
            warps = 2 * max(bn // 32, 1)  # two warps per group of 32 key rows
        elif direction == "fwd" and bm % (16 * t.warps) == 0 and bm // (16 * t.warps) in (1, 2):
            warps = t.warps
        else:
            warps = bm // 16
        t = Tile(bm, bn, max(warps, 1), t.stages)
        _check_tile(direction, d, t)
    return t


def _smem_check(smem: int, name: str) -> None:
    _, optin = _device_info()
    if smem > optin:
        raise RuntimeError(
            f"{name} needs {smem} bytes of shared memory per block; this GPU allows {optin}; "
            "choose smaller block_q / block_k"
        )


# ---------------------------------------------------------------------------------------------------
# Launch helpers.


def _strides(a) -> tuple[np.int64, np.int64, np.int64]:
    """(batch, seq, head) strides in elements."""
    it = a.itemsize
    return tuple(np.int64(s // it) for s in a.strides[:3])


def _aligned(a) -> "object":
    """``a`` itself when its tiles can be copied with 16-byte cp.async (base and every stride a multiple
    of 16 bytes); otherwise a contiguous copy (rare: views with odd offsets or strides)."""
    import cupy

    if a.data.ptr % 16 == 0 and all((s % 16 == 0) or n == 1 for s, n in zip(a.strides[:3], a.shape[:3])):
        return a
    return cupy.ascontiguousarray(a)


def _i32(x) -> np.int32:
    return np.int32(x)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------
# Forward.


def forward(q, k, v, *, scale, causal_offset, algorithm, block_q, block_k):
    import cupy

    if algorithm == "fa1" and np.dtype(q.dtype).name in (*_CXX_TYPE, "float32"):
        return _fa1_forward(q, k, v, scale=scale, causal_offset=causal_offset, block_q=block_q, block_k=block_k)
    if algorithm == "naive":
        return _naive_forward(q, k, v, scale=scale, causal_offset=causal_offset)
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    assert Hq % Hkv == 0 and d in HEAD_DIMS
    group = Hq // Hkv
    causal = causal_offset is not None
    off = np.int32(causal_offset if causal else 0)
    dtype = np.dtype(q.dtype).name
    out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    scale_log2 = np.float32(scale * _LOG2E)
    if dtype == "float32":
        t = TILES[("fwd", "f32", d)]
        smem = _fwd_f32_smem(d, t)
        name = _fwd_f32_name(d, t, causal)
        _smem_check(smem, name)
        kern = _kernel("forward.cu", name, smem)
        kern((_cdiv(Nq, t.block_m), Hq, B), (32 * t.warps,), (
            q, k, v, out, lse, _i32(Nq), _i32(Nk), _i32(Hq), _i32(group),
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), scale_log2, off), shared_mem=smem)
        return out, lse
    assert dtype in _CXX_TYPE, dtype
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    t = TILES.get(("fwd", "sm90a", d))
    if SM90A_FORWARD and t is not None and block_q is None and block_k is None and _device_info()[0] == 90:
        smem = _fwd_sm90_smem(d, t)
        name = _fwd_sm90_name(_CXX_TYPE[dtype], d, t, causal)
        _smem_check(smem, name)
        kern = _kernel("forward_sm90.cu", name, smem, SM90A_OPTIONS)
    else:
        t = _tile("fwd", d, block_q, block_k)
        smem = _fwd_smem(d, t)
        name = _fwd_name(_CXX_TYPE[dtype], d, t, causal)
        _smem_check(smem, name)
        kern = _kernel("forward.cu", name, smem)
    kern((_cdiv(Nq, t.block_m), Hq, B), (32 * t.warps,), (
        q, k, v, out, lse, _i32(Nq), _i32(Nk), _i32(Hq), _i32(group),
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), scale_log2, off), shared_mem=smem)
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Backward.


def backward(do, q, k, v, out, lse, *, scale, causal_offset, algorithm, block_q, block_k, order):
    import cupy

    if algorithm == "fa1" and (np.dtype(q.dtype) == np.float32 or q.shape[3] in BWD_HEAD_DIMS):
        return _fa1_backward(do, q, k, v, out, lse, scale=scale, causal_offset=causal_offset, block_q=block_q,
                             block_k=block_k)
    if algorithm == "naive":
        return _naive_backward(do, q, k, v, scale=scale, causal_offset=causal_offset)
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    causal = causal_offset is not None
    off = np.int32(causal_offset if causal else 0)
    dtype = np.dtype(q.dtype).name
    if dtype in _CXX_TYPE and d not in BWD_HEAD_DIMS:
        # No tensor-core backward at this head dim (dK and dV of 16 key rows would not fit in registers):
        # run the float32 kernels on upcast inputs, cast the gradients back.
        f32 = [a.astype(cupy.float32) for a in (do, q, k, v, out)]
        grads = backward(*f32, lse, scale=scale, causal_offset=causal_offset, algorithm=algorithm,
                         block_q=None, block_k=None, order=order)
        return tuple(g.astype(q.dtype) for g in grads)

    if dtype == "float32":
        return _backward_f32(do, q, k, v, out, lse, scale=scale, causal_offset=causal_offset, fa1=False,
                             split=order in ("split", "q_outer"), block_k=None)

    lse = cupy.ascontiguousarray(lse)
    delta = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    dq = cupy.empty(q.shape, dtype=q.dtype)
    dk = cupy.empty(k.shape, dtype=k.dtype)
    dv = cupy.empty(v.shape, dtype=v.dtype)
    fscale = np.float32(scale)

    assert dtype in _CXX_TYPE, dtype
    ctype = _CXX_TYPE[dtype]
    q, k, v, do = _aligned(q), _aligned(k), _aligned(v), _aligned(do)
    # [bwd 0] D = rowsum(dO * O)
    pre = _kernel("backward.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {d}>")
    pre((_cdiv(Nq, 4), Hq, B), (128,), (do, out, delta, _i32(Nq), _i32(Hq), *_strides(do), *_strides(out)))

    split = order in ("split", "q_outer")
    t = TILES.get(("bwd", "sm90a", d))
    if SM90A_BACKWARD and t is not None and block_q is None and block_k is None and _device_info()[0] == 90:
        smem = _dkdv_sm90_smem(d, t)
        name = _dkdv_sm90_name(ctype, d, t, causal, not split)
        _smem_check(smem, name)
        kdkdv = _kernel("backward_sm90.cu", name, smem, SM90A_OPTIONS)
    else:
        t = _tile("bwd", d, block_q, block_k)
        smem = _dkdv_smem(d, t, not split)
        name = _dkdv_name(ctype, d, t, causal, not split)
        _smem_check(smem, name)
        kdkdv = _kernel("backward.cu", name, smem)
    dq_accum = None if split else cupy.zeros((B, Hq, Nq, d), dtype=cupy.float32)
    dkv_accum = cupy.empty((2, B, Hq, Nk, d), dtype=cupy.float32) if group > 1 else None
    null = np.uintp(0)
    kdkdv((_cdiv(Nk, t.block_n), Hq, B), (32 * t.warps,), (
        q, k, v, do, lse, delta,
        dq_accum if dq_accum is not None else null, dk, dv, dkv_accum if dkv_accum is not None else null,
        _i32(Nq), _i32(Nk), _i32(Hq), _i32(group),
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        fscale, off), shared_mem=smem)

    if split:
        tq = _tile("bwd_dq", d, None, None)
        smem_q = _dq_smem(d, tq)
        name_q = _dq_name(ctype, d, tq, causal)
        _smem_check(smem_q, name_q)
        kdq = _kernel("backward.cu", name_q, smem_q)
        kdq((_cdiv(Nq, tq.block_m), Hq, B), (32 * tq.warps,), (
            q, k, v, do, lse, delta, dq, _i32(Nq), _i32(Nk), _i32(Hq), _i32(group),
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), fscale, off),
            shared_mem=smem_q)
    else:
        conv = _kernel("backward.cu", f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {d}>")
        conv((_cdiv(Nq * d // 2, 256), Hq, B), (256,), (dq_accum, dq, _i32(Nq), _i32(Hq), *_strides(dq), fscale))

    if group > 1:
        red = _kernel("backward.cu", f"cuflash::flash_bwd_reduce_dkv_kernel<{ctype}, {d}>")
        red((_cdiv(Nk * d // 2, 256), Hkv, B), (256,), (
            dkv_accum, dk, dv, _i32(Nk), _i32(group), np.int64(B * Hq * Nk * d), *_strides(dk), *_strides(dv)))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# algorithm="naive": the materialized computation with CuPy (float32 accumulation, float64 for float64).


def _acc_dtype(dtype):
    import cupy

    return cupy.float64 if np.dtype(dtype) == np.float64 else cupy.float32


def _naive_scores(q, k, scale, causal_offset):
    import cupy

    acc = _acc_dtype(q.dtype)
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    qh = q.astype(acc).transpose(0, 2, 1, 3)  # (B, Hq, Nq, d)
    kh = cupy.repeat(k.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    s = scale * (qh @ kh.transpose(0, 1, 3, 2))
    if causal_offset is not None:
        i = cupy.arange(Nq)[:, None]
        j = cupy.arange(Nk)[None, :]
        s = cupy.where(j <= i + causal_offset, s, -cupy.inf)
    return s


def _naive_probs(s):
    import cupy

    m = s.max(axis=-1, keepdims=True)
    m = cupy.where(cupy.isfinite(m), m, 0)
    e = cupy.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = cupy.where(l > 0, e / cupy.where(l > 0, l, 1), 0)
    lsum = l[..., 0]
    lse = cupy.where(lsum > 0, m[..., 0] + cupy.log(cupy.where(lsum > 0, lsum, 1)), -cupy.inf)
    return p, lse


def _naive_forward(q, k, v, *, scale, causal_offset):
    import cupy

    acc = _acc_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    p, lse = _naive_probs(_naive_scores(q, k, scale, causal_offset))
    vh = cupy.repeat(v.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    out = (p @ vh).transpose(0, 2, 1, 3).astype(q.dtype)
    return cupy.ascontiguousarray(out), lse.astype(acc)


def _naive_backward(do, q, k, v, *, scale, causal_offset):
    import cupy

    acc = _acc_dtype(q.dtype)
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    p, _ = _naive_probs(_naive_scores(q, k, scale, causal_offset))
    qh = q.astype(acc).transpose(0, 2, 1, 3)
    kh = cupy.repeat(k.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    vh = cupy.repeat(v.astype(acc).transpose(0, 2, 1, 3), group, axis=1)
    doh = do.astype(acc).transpose(0, 2, 1, 3)
    dv = p.transpose(0, 1, 3, 2) @ doh
    dp = doh @ vh.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = scale * (ds @ kh)
    dk = scale * (ds.transpose(0, 1, 3, 2) @ qh)

    def to_kv(g):
        return g.reshape(B, Hkv, group, Nk, d).sum(axis=2).transpose(0, 2, 1, 3)

    return (
        cupy.ascontiguousarray(dq.transpose(0, 2, 1, 3).astype(q.dtype)),
        cupy.ascontiguousarray(to_kv(dk).astype(k.dtype)),
        cupy.ascontiguousarray(to_kv(dv).astype(v.dtype)),
    )


# ---------------------------------------------------------------------------------------------------
# algorithm="fa1" (fa1.cu): one thread block per (batch, query head), key/value tiles outer.


def _fa1_name(direction: str, ctype: str, d: int, t: Tile, causal: bool) -> str:
    """fa1.cu's kernel for ``ctype`` (a 16-bit type, or "float" for the float32 kernels)."""
    assert direction in ("fa1_fwd", "fa1_bwd"), direction
    if ctype == "float":
        return f"cuflash::{direction}_f32_kernel<{d}, {t.block_n}, {_bool(causal)}>"
    return f"cuflash::{direction}_kernel<{ctype}, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, {_bool(causal)}>"


def _fa1_fwd_smem(d: int, t: Tile, f32: bool = False) -> int:
    if f32:  # K (rows padded by one float), V, one query row per warp
        return 4 * (t.block_n * (d + 1) + t.block_n * d + t.warps * d)
    return 2 * d * (2 * t.block_n + t.block_m * t.warps * t.stages)  # K, V + per warp stages x Q


def _fa1_bwd_smem(d: int, t: Tile) -> int:
    tiles = 2 * t.block_n * d + 2 * t.stages * t.block_m * d + t.block_n * t.block_m  # K, V; Q, dO; dS^T
    return 2 * tiles + 4 * 2 * t.stages * t.block_m  # 16-bit tiles + float32 lse and D per stage


def _fa1_tile(direction: str, d: int, block_q, block_k, f32: bool = False) -> Tile:
    """The table's FA1 tile, or one with the user's block sizes (forward: block_q must be 16, the rows of
    a warp's query tile; backward: block_k = 16 * warps key rows, block_q a multiple of 32). The float32
    kernels step one query row per warp, so only block_k applies to them (forward: up to 32 keys, one per
    lane; backward: a multiple of 4, block_k / 4 * head_dim / 32 <= 32 registers of dK and of dV)."""
    cc, _ = _device_info()
    t = TILES[(direction, "f32" if f32 else _arch_class(cc), d)]
    if block_k is None and (block_q is None or f32):
        return t
    if f32:
        bn = block_k
        if direction == "fa1_fwd":
            ok, rule = 1 <= bn <= 32, "the float32 forward needs 1 <= block_k <= 32 (one lane per key)"
        else:
            ok = bn % 4 == 0 and (bn // 4) * (d // 32) <= 32
            rule = (f"the float32 backward needs block_k a multiple of 4 with block_k / 4 * head_dim / 32 <= 32 "
                    f"(at most {32 * 4 // (d // 32)} at head_dim {d})")
        if not ok:
            raise ValueError(f"block_k={bn} is not a valid CUDA tile for algorithm='fa1' on float32 inputs: {rule}")
        return Tile(t.block_m, bn, t.warps, t.stages)
    bm = block_q if block_q is not None else t.block_m
    bn = block_k if block_k is not None else t.block_n
    if direction == "fa1_fwd":
        t = Tile(bm, bn, t.warps, t.stages)
        ok = bm == 16 and bn % 16 == 0 and 16 <= bn <= 128
    else:
        t = Tile(bm, bn, max(bn // 16, 1), t.stages)
        mt = bm // 16
        ok = bn % 16 == 0 and 1 <= t.warps <= 16 and bm % 32 == 0 and t.warps % mt == 0
        ok = ok and (d // (t.warps // mt)) % 16 == 0
    if not ok:
        raise ValueError(
            f"block sizes block_q={bm}, block_k={bn} are not a valid CUDA tile for algorithm='fa1' at head_dim "
            f"{d}: the forward needs block_q = 16 and block_k a multiple of 16 up to 128; the backward "
            "block_k = 16 * warps (up to 256) and block_q a multiple of 32"
        )
    return t


def _fa1_forward(q, k, v, *, scale, causal_offset, block_q, block_k):
    """FA1 forward (fa1_fwd_kernel, or fa1_fwd_f32_kernel for float32): grid (heads_q, batch). The running
    output (normalized, float32), row max m (log2 units) and row sum l live in global memory between
    key/value tiles, as in reference.fa1_forward; nothing is read from them on the first key tile, so they
    need no zeroing."""
    import cupy

    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    causal = causal_offset is not None
    f32 = np.dtype(q.dtype) == np.float32
    ctype = "float" if f32 else _CXX_TYPE[np.dtype(q.dtype).name]
    if not f32:
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
    out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    o_run = cupy.empty((B, Hq, Nq, d), dtype=cupy.float32)
    ml_run = cupy.empty((2, B, Hq, Nq), dtype=cupy.float32)
    t = _fa1_tile("fa1_fwd", d, block_q, block_k, f32)
    smem = _fa1_fwd_smem(d, t, f32)
    name = _fa1_name("fa1_fwd", ctype, d, t, causal)
    _smem_check(smem, name)
    kern = _kernel("fa1.cu", name, smem)
    kern((Hq, B), (32 * t.warps,), (
        q, k, v, out, lse, o_run, ml_run[0], ml_run[1], _i32(Nq), _i32(Nk), _i32(Hq), _i32(Hq // Hkv),
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), np.float32(scale * _LOG2E),
        np.int32(causal_offset if causal else 0)), shared_mem=smem)
    return out, lse


def _fa1_backward(do, q, k, v, out, lse, *, scale, causal_offset, block_q, block_k):
    """FA1 backward (fa1_bwd_kernel): grid (heads_q, batch), key/value tiles outer, dQ read-modify-written
    in a zeroed float32 workspace without atomics (one block owns a (batch, head)). D, the dQ scale/cast
    and the GQA dK/dV group sum are backward.cu's small kernels, shared with FA2."""
    import cupy

    if np.dtype(q.dtype) == np.float32:
        return _backward_f32(do, q, k, v, out, lse, scale=scale, causal_offset=causal_offset, fa1=True, split=False,
                             block_k=block_k)
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    causal = causal_offset is not None
    ctype = _CXX_TYPE[np.dtype(q.dtype).name]
    q, k, v, do = _aligned(q), _aligned(k), _aligned(v), _aligned(do)
    lse = cupy.ascontiguousarray(lse)
    delta = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    dq = cupy.empty(q.shape, dtype=q.dtype)
    dk = cupy.empty(k.shape, dtype=k.dtype)
    dv = cupy.empty(v.shape, dtype=v.dtype)
    # [bwd 0] D = rowsum(dO * O)
    pre = _kernel("backward.cu", f"cuflash::flash_bwd_preprocess_kernel<{ctype}, {d}>")
    pre((_cdiv(Nq, 4), Hq, B), (128,), (do, out, delta, _i32(Nq), _i32(Hq), *_strides(do), *_strides(out)))

    t = _fa1_tile("fa1_bwd", d, block_q, block_k)
    smem = _fa1_bwd_smem(d, t)
    name = _fa1_name("fa1_bwd", ctype, d, t, causal)
    _smem_check(smem, name)
    kern = _kernel("fa1.cu", name, smem)
    dq_accum = cupy.zeros((B, Hq, Nq, d), dtype=cupy.float32)
    dkv_accum = cupy.empty((2, B, Hq, Nk, d), dtype=cupy.float32) if group > 1 else None
    kern((Hq, B), (32 * t.warps,), (
        q, k, v, do, lse, delta, dq_accum, dk, dv, dkv_accum if dkv_accum is not None else np.uintp(0),
        _i32(Nq), _i32(Nk), _i32(Hq), _i32(group),
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        np.float32(scale), np.int32(causal_offset if causal else 0)), shared_mem=smem)

    conv = _kernel("backward.cu", f"cuflash::flash_bwd_convert_dq_kernel<{ctype}, {d}>")
    conv((_cdiv(Nq * d // 2, 256), Hq, B), (256,), (dq_accum, dq, _i32(Nq), _i32(Hq), *_strides(dq), np.float32(scale)))
    if group > 1:
        red = _kernel("backward.cu", f"cuflash::flash_bwd_reduce_dkv_kernel<{ctype}, {d}>")
        red((_cdiv(Nk * d // 2, 256), Hkv, B), (256,), (
            dkv_accum, dk, dv, _i32(Nk), _i32(group), np.int64(B * Hq * Nk * d), *_strides(dk), *_strides(dv)))
    return dq, dk, dv


def _backward_f32(do, q, k, v, out, lse, *, scale, causal_offset, fa1, split, block_k):
    """The float32 backward (SIMT): D; then dK, dV (+ dQ) by key/value tiles through shared memory, either
    FA1's (fa1_bwd_f32_kernel: grid (heads_q, batch), every key tile per block, dQ read-modify-written) or
    FA2's (flash_bwd_dkdv_f32_kernel: one key tile per block, dQ by atomicAdd, or for the split order
    without dQ, then the row-wise flash_bwd_dq_f32_kernel, no atomics). dQ accumulates in the zeroed
    float32 output itself; dK and dV per query head into a float32 workspace, summed over each GQA group
    here (a fixed order)."""
    import cupy

    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    causal = causal_offset is not None
    off, fscale = np.int32(causal_offset if causal else 0), np.float32(scale)
    lse = cupy.ascontiguousarray(lse)
    delta = cupy.empty((B, Hq, Nq), dtype=cupy.float32)
    # [bwd 0] D = rowsum(dO * O)
    pre = _kernel("backward.cu", f"cuflash::flash_bwd_preprocess_f32_kernel<{d}>")
    pre((_cdiv(Nq, 4), Hq, B), (128,), (do, out, delta, _i32(Nq), _i32(Hq), *_strides(do), *_strides(out)))
    dq = cupy.zeros(q.shape, dtype=cupy.float32)
    dkv = cupy.empty((2, B, Hq, Nk, d), dtype=cupy.float32)
    if fa1:
        t = _fa1_tile("fa1_bwd", d, None, block_k, f32=True)
        name, source, grid = _fa1_name("fa1_bwd", "float", d, t, causal), "fa1.cu", (Hq, B)
    else:
        t = TILES[("bwd", "f32", d)]
        name = _dkdv_f32_name(d, t, causal, not split)
        source, grid = "backward.cu", (_cdiv(Nk, t.block_n), Hq, B)
    smem = _bwd_f32_smem(d, t)
    _smem_check(smem, name)
    _kernel(source, name, smem)(grid, (32 * t.warps,), (
        q, k, v, do, lse, delta, dq, dkv, _i32(Nq), _i32(Nk), _i32(Hq), _i32(group),
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), fscale, off), shared_mem=smem)
    if split:
        kq = _kernel("backward.cu", f"cuflash::flash_bwd_dq_f32_kernel<{d}, {_bool(causal)}>")
        kq((_cdiv(Nq, 4), Hq, B), (128,), (
            q, k, v, do, lse, delta, dq, _i32(Nq), _i32(Nk), _i32(Hq), _i32(group),
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), fscale, off))
    dkv = dkv.reshape(2, B, Hkv, group, Nk, d).sum(axis=3).transpose(0, 1, 3, 2, 4)  # (2, B, Nk, Hkv, d)
    return dq, cupy.ascontiguousarray(dkv[0]), cupy.ascontiguousarray(dkv[1])
