"""NVRTC compilation and the module cache: a :class:`~.spec.KernelSpec` in, a launchable kernel out.

The CUDA sources in :mod:`cuflash_kernels` are compiled at run time by NVRTC through ``cupy.RawModule``:
one module per instantiation actually used, cached per (device, source, options, name expression) in this
process and on disk by CuPy, so a kernel costs a compile only the first time any process uses it.
"""

from __future__ import annotations

import importlib.resources
import re
import threading

from .spec import KernelSpec, prelude_of

__all__ = ["compile_source_for_nvrtc", "kernel", "device_info", "arch_class", "check_smem"]

_INCLUDE_RE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def _read_kernel_file(name: str) -> str:
    return importlib.resources.files("cuflash_kernels").joinpath(name).read_text(encoding="utf-8")


def compile_source_for_nvrtc(source: str) -> str:
    """The full text NVRTC compiles for ``source`` (e.g. "forward.cu"): the file with its local
    ``#include "...cuh"`` lines replaced by the headers' text, so no include path is needed."""

    def expand(m: re.Match) -> str:
        return f"// ---- begin {m.group(1)}\n{_read_kernel_file(m.group(1))}\n// ---- end {m.group(1)}"

    return _INCLUDE_RE.sub(expand, _read_kernel_file(source))


_lock = threading.Lock()
_modules: dict = {}
_launchable: dict = {}  # (device, id of an interned spec) -> (function, block, shared memory): the per-call path
_sources: dict = {}
_device_cache: dict = {}


def device_info() -> tuple[int, int]:
    """(compute capability as an int, opt-in shared memory per block) of the current device, cached."""
    import cupy

    dev_id = cupy.cuda.runtime.getDevice()
    info = _device_cache.get(dev_id)
    if info is None:
        dev = cupy.cuda.Device(dev_id)
        info = _device_cache[dev_id] = (int(dev.compute_capability), int(dev.attributes["MaxSharedMemoryPerBlockOptin"]))
    return info


def arch_class(cc: int) -> str:
    """The tile table's arch class of a compute capability."""
    if cc >= 90:
        return "sm90"
    if cc in (80, 87):
        return "sm80"
    return "sm86"


def check_smem(spec: KernelSpec) -> None:
    _, optin = device_info()
    if spec.smem > optin:
        raise RuntimeError(
            f"{spec.name} needs {spec.smem} bytes of shared memory per block; this GPU allows {optin}; "
            "choose smaller block_q / block_k"
        )


def kernel(spec: KernelSpec):
    """The compiled kernel of ``spec`` for the current device (compiled once, then cached), with its
    dynamic shared-memory limit raised to what the spec needs."""
    import cupy

    smem = spec.smem
    dev = cupy.cuda.runtime.getDevice()
    key = (dev, spec.source, spec.options, spec.name)
    with _lock:
        entry = _modules.get(key)
        if entry is None:
            check_smem(spec)
            text = _sources.get(spec.source)
            if text is None:
                text = _sources[spec.source] = compile_source_for_nvrtc(spec.source)
            prelude = prelude_of(spec.name)  # a user mod's generated policy type, if the variant has one
            try:
                module = cupy.RawModule(code=text + prelude, options=spec.options, name_expressions=[spec.name])
                entry = _modules[key] = [module.get_function(spec.name), 0]
            except cupy.cuda.compiler.CompileException as exc:
                if not prelude:
                    raise
                said = "\n".join(line for line in prelude.splitlines() if line.startswith(("// score_mod", "// mask_mod")))
                raise ValueError(f"score_mod / mask_mod did not compile with NVRTC:\n{said}\nNVRTC said:\n{exc}") from exc
        if smem > 48 * 1024 and entry[1] < smem:
            entry[0].max_dynamic_shared_size_bytes = smem
            entry[1] = smem
    return entry[0]


def launch(spec: KernelSpec, grid: tuple[int, ...], args: tuple) -> None:
    """Run ``spec`` (interned: from :func:`.spec.spec`) on the current stream with its thread count and shared
    memory."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), id(spec))
    entry = _launchable.get(key)
    if entry is None:
        entry = _launchable[key] = (kernel(spec), (spec.threads,), spec.smem)
    entry[0](grid, entry[1], args, shared_mem=entry[2])
