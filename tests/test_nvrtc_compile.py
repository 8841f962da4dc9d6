"""Compile every shipped CUDA kernel instantiation with NVRTC, without a GPU.

For each target (sm_80, sm_90a) and each source file, one NVRTC program holds all of that file's shipped
name expressions (``cuflash._cuda.instantiations()``) and is compiled to a cubin with
``--ptxas-options=-v``; the test fails on a compile error or on any register spill in ptxas's resource
report. Skips cleanly when cuda-bindings or the CUDA headers/NVRTC library are not installed
(``pip install -e .[nvrtc]``).
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from cuflash import _cuda

TARGETS = ("sm_80", "sm_90a")
SOURCES = ("forward.cu", "backward.cu", "forward_sm90.cu", "backward_sm90.cu", "fa1.cu")

_RESOURCE_RE = re.compile(
    r"Compiling entry function '(?P<fn>[^']+)' for '(?P<arch>sm_\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
    r".*?Used (?P<regs>\d+) registers",
    re.DOTALL,
)


def _nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings not installed (pip install .[nvrtc])")
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the Python bindings are there but libnvrtc is not
        pytest.skip(f"NVRTC library not loadable: {exc}")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        pytest.skip(f"NVRTC not usable: {err}")
    return nvrtc


def compile_with_nvrtc(nvrtc, source_text: str, names: list[str], options: tuple[str, ...], arch: str):
    """Compile ``names`` of ``source_text`` to a cubin for ``arch``; returns (ok, log)."""
    err, prog = nvrtc.nvrtcCreateProgram(source_text.encode(), b"cuflash.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        for name in names:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, name.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, (err, name)
        opts = [o.encode() for o in options] + [f"-arch={arch}".encode(), b"--ptxas-options=-v"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        return err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace").rstrip("\x00")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def parse_resources(log: str) -> list[dict]:
    """One dict per kernel in ptxas's -v report: fn, arch, regs, stack, spill stores, spill loads."""
    rows = []
    for block in log.split("ptxas info    : Compiling entry function")[1:]:
        m = _RESOURCE_RE.search("Compiling entry function" + block)
        if m:
            rows.append({k: (int(v) if v.isdigit() else v) for k, v in m.groupdict().items()})
    return rows


def assert_compiles_without_spills(nvrtc, text, names, options, arch, label):
    """Compile ``names`` from ``text``; fail on a compile error, a missing resource line or any spill."""
    ok, log = compile_with_nvrtc(nvrtc, text, names, options, arch)
    assert ok, f"NVRTC failed for {label}:\n{log[-6000:]}"
    rows = parse_resources(log)
    assert len(rows) >= len(names), f"expected a resource line per kernel; log:\n{log[-3000:]}"
    spills = [r for r in rows if r["stores"] or r["loads"]]
    assert not spills, "register spills:\n" + "\n".join(
        f"{r['fn']}: {r['regs']} regs, {r['stores']} B spill stores, {r['loads']} B spill loads" for r in spills
    )


def _groups():
    groups = defaultdict(list)
    for source, name, options in _cuda.instantiations():
        groups[(source, options)].append(name)
    return sorted(groups.items())


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_instantiation_compiles_without_spills(arch, source):
    nvrtc = _nvrtc()
    text = _cuda.compile_source_for_nvrtc(source)
    groups = [(opts, names) for (src, opts), names in _groups() if src == source]
    assert groups
    # Instantiations that name their own target (the sm_90a-only Hopper kernels) compile for that one only.
    groups = [(o, n) for o, n in groups if all(not x.startswith("-arch=") or x == f"-arch={arch}" for x in o)]
    if not groups:
        pytest.skip(f"no {source} instantiation targets {arch}")
    for options, names in groups:
        assert_compiles_without_spills(nvrtc, text, names, options, arch, f"{source} ({arch})")


def test_instantiation_list_covers_the_tile_table():
    names = [name for _, name, _ in _cuda.instantiations()]
    assert len(names) == len(set(names))
    for (direction, _arch, d), t in _cuda.TILES.items():
        stem = {"fwd": "flash_fwd_kernel", "bwd": "flash_bwd_dkdv_kernel", "bwd_dq": "flash_bwd_dq_kernel",
                "fa1_fwd": "fa1_fwd_kernel", "fa1_bwd": "fa1_bwd_kernel"}[direction]
        if _arch == "sm90a":
            stem = {"fwd": "flash_fwd_sm90_kernel", "bwd": "flash_bwd_dkdv_sm90_kernel"}[direction]
        want = f"cuflash::{stem}<cuflash::bf16, {d}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, true"
        if _arch == "f32":
            tile = f"{t.block_m}, {t.block_n}" if direction == "fwd" else f"{t.block_n}"
            want = f"cuflash::{stem.replace('_kernel', '_f32_kernel')}<{d}, {tile}, true"
        assert any(n.startswith(want) for n in names), want


def test_source_text_is_self_contained():
    for source in SOURCES:
        text = _cuda.compile_source_for_nvrtc(source)
        assert '#include "' not in text
        assert "namespace cuflash" in text
