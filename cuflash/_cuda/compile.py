"""NVRTC compilation and the module cache: a :class:`~.spec.KernelSpec` in, a launchable kernel out.

The CUDA sources in :mod:`cuflash_kernels` are compiled at run time by NVRTC through ``cupy.RawModule``:
one module per instantiation actually used, cached per (device, source, options, name expression) in this
process and on disk by CuPy, so a kernel costs a compile only the first time any process uses it.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
import struct
import threading
import warnings

import numpy as np

from .spec import KernelSpec, prelude_of

__all__ = ["compile_source_for_nvrtc", "nvrtc_offline", "kernel", "flat_ptx", "device_info", "sm_count", "arch_class",
           "check_smem", "launch", "PackedLaunch", "programmatic_config", "unpack_config", "launch_kernel_ex"]

# Debug builds (docs/testing.md), read once, at import. CUFLASH_LINEINFO=1: line information, so that
# compute-sanitizer and ncu name source lines. CUFLASH_RACECHECK=1: that, and the build racecheck can follow (a
# warpgroup's bar.arrive handovers made waits too: decode_sm90.cu's named_bar_arrive)
# CUFLASH_DEFINES="NAME=VALUE,...": compile-time switches of the kernels set for an experiment (e.g.
# CUFLASH_FWD_PINGPONG=0), in every kernel this process compiles.
_DEBUG_OPTIONS = (("-lineinfo",) if os.environ.get("CUFLASH_LINEINFO") or os.environ.get("CUFLASH_RACECHECK") else ()) + (
    ("-DCUFLASH_RACECHECK",) if os.environ.get("CUFLASH_RACECHECK") else ()) + tuple(
    f"-D{d.strip()}" for d in os.environ.get("CUFLASH_DEFINES", "").split(",") if d.strip())


def define(name: str, default: int) -> int:
    """The value of a kernels' compile-time switch as this process builds them: ``CUFLASH_DEFINES``'s, else the
    kernels' default (given here as theirs is): for a launcher whose launches depend on the switch."""
    for option in _DEBUG_OPTIONS:
        key, _, value = option[2:].partition("=")
        if option.startswith("-D") and key == name:
            return int(value or 1)
    return default


_INCLUDE_RE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def _read_kernel_file(name: str) -> str:
    return importlib.resources.files("cuflash_kernels").joinpath(name).read_text(encoding="utf-8")


def compile_source_for_nvrtc(source: str) -> str:
    """The full text NVRTC compiles for ``source`` (e.g. "forward.cu"): the file with its local
    ``#include "..."`` lines replaced by the files' text, recursively and each file once (a header included again
    is left out, as its ``#pragma once`` would have it), so no include path is needed."""
    seen = {source}

    def expand(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return f"// ---- {name} (included above)"
        seen.add(name)
        return f"// ---- begin {name}\n{_INCLUDE_RE.sub(expand, _read_kernel_file(name))}\n// ---- end {name}"

    return _INCLUDE_RE.sub(expand, _read_kernel_file(source))


def nvrtc_offline(text: str, names: list[str], options: tuple[str, ...], arch: str) -> dict:
    """Compile the name expressions ``names`` of ``text`` with NVRTC for ``arch`` (a real sm_XX), no GPU needed
    (cuda-bindings, the ``nvrtc`` extra): ``ok``, ptxas's ``-v`` ``log``, and when ok the ``lowered`` (mangled)
    names, the ``ptx`` and the ``cubin``. For the compile tests and tools; the launcher compiles through CuPy. The
    environment's debug options and ``CUFLASH_DEFINES`` apply as they do to the launcher's builds."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), b"cuflash.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        for name in names:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, name.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, (err, name)
        # (--split-compile=0: NVVM's and ptxas' work on the program's kernels spread over every core; CI's compile
        # checks take about 60 % of their serial time on two cores, the same kernels and report)
        opts = [o.encode() for o in (*options, *_DEBUG_OPTIONS)] + [f"-arch={arch}".encode(), b"--ptxas-options=-v",
                                                                     b"--split-compile=0"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        out = dict(ok=err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log=log.decode(errors="replace").rstrip("\x00"))
        if out["ok"]:
            out["lowered"] = {name: nvrtc.nvrtcGetLoweredName(prog, name.encode())[1].decode() for name in names}
            _, size = nvrtc.nvrtcGetPTXSize(prog)
            ptx = b" " * size
            nvrtc.nvrtcGetPTX(prog, ptx)
            _, size = nvrtc.nvrtcGetCUBINSize(prog)
            cubin = b" " * size
            nvrtc.nvrtcGetCUBIN(prog, cubin)
            out.update(ptx=ptx.decode().rstrip("\x00"), cubin=cubin)
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


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


def sm_count() -> int:
    """The current device's multiprocessor count, cached (the persistent kernels' grids)."""
    import cupy

    dev_id = cupy.cuda.runtime.getDevice()
    count = _sm_counts.get(dev_id)
    if count is None:
        count = _sm_counts[dev_id] = int(cupy.cuda.Device(dev_id).attributes["MultiProcessorCount"])
    return count


_sm_counts: dict = {}


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


def _source_text(source: str) -> str:
    """The NVRTC text of kernel file ``source`` (:func:`compile_source_for_nvrtc`), read once per process."""
    text = _sources.get(source)
    if text is None:
        text = _sources[source] = compile_source_for_nvrtc(source)
    return text


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
            text = _source_text(spec.source)
            prelude = prelude_of(spec.name)  # a user mod's generated policy type, if the variant has one
            try:
                module = cupy.RawModule(code=text + prelude, options=spec.options + _DEBUG_OPTIONS,
                                         name_expressions=[spec.name])
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


_flat: dict = {}  # (spec name, compute capability) -> (PTX, lowered name)


def flat_ptx(spec: KernelSpec, cc: int, name: str | None = None) -> tuple[str, str]:
    """The PTX of ``spec``'s flat entry point (:attr:`.spec.KernelSpec.flat_name`; ``name``: that or another
    name expression of the spec's source, such as the spec's own for kernels without a VariantParams) for compute
    capability ``cc`` (sm_90a for the wgmma kernels), and its lowered (mangled) name: for launchers that load the
    kernel themselves from PTX and pass its parameters one by one (jaxlib's kernel call, :mod:`cuflash.jax`). NVRTC
    through CuPy's bindings; cached per process."""
    name = name or spec.flat_name
    if name is None:
        raise ValueError(f"{spec.name} has no flat entry point")
    key = (name, cc)
    hit = _flat.get(key)
    if hit is not None:
        return hit
    from cupy_backends.cuda.libs import nvrtc

    options = [o for o in spec.options if not o.startswith("-arch=")]
    arch = next((o.split("=sm_")[1] for o in spec.options if o.startswith("-arch=sm_")), str(cc))
    text = _source_text(spec.source)
    prog = nvrtc.createProgram(text + prelude_of(name), "cuflash.cu", [], [])
    try:
        # (CuPy's binding: addNameExpression; some versions spelled it addAddNameExpression)
        (getattr(nvrtc, "addNameExpression", None) or nvrtc.addAddNameExpression)(prog, name)
        try:
            nvrtc.compileProgram(prog, [*options, *_DEBUG_OPTIONS, f"-arch=compute_{arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for {name}:\n{nvrtc.getProgramLog(prog)[-4000:]}") from exc
        ptx, lowered = nvrtc.getPTX(prog), nvrtc.getLoweredName(prog, name)  # (str, or bytes in some CuPy versions)
        hit = _flat[key] = tuple(x.decode().rstrip("\0") if isinstance(x, bytes) else x for x in (ptx, lowered))
    finally:
        nvrtc.destroyProgram(prog)
    return hit


def launch(spec: KernelSpec, grid: tuple[int, ...], args: tuple) -> None:
    """Run ``spec`` (interned: from :func:`.spec.spec`) on the current stream with its thread count and shared
    memory."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), id(spec))
    entry = _launchable.get(key)
    if entry is None:
        entry = _launchable[key] = (kernel(spec), (spec.threads,), spec.smem)
    entry[0](grid, entry[1], args, shared_mem=entry[2])


class PackedLaunch:
    """One kernel launch planned for repeated runs: the kernel's function handle, grid, block and shared memory,
    and its arguments packed once as ``cuLaunchKernel`` takes them (each in its own 8-byte-aligned slot of one host
    buffer, and the array of the slots' addresses). A run writes the pointers that change into their 64-bit words
    and launches through the driver: none of CuPy's per-argument conversion, which costs more host time than the
    rest of a planned call.

    ``args`` as :func:`launch` takes them, with None for a pointer written at each run (a null pointer until then);
    ``more``: the host addresses of further arguments kept by the caller (a :class:`.tensor_map.TensorMap`'s),
    after ``args``; ``runtime``: :class:`.decode.CupyRuntime` or a stand-in. ``cuLaunchKernel`` copies the arguments
    when it is called, so the buffer may be rewritten as soon as :meth:`run` returns.
    """

    def __init__(self, runtime, spec: KernelSpec, grid: tuple[int, int, int], args: tuple, more: tuple[int, ...] = ()):
        self.fn, self._module = runtime.function(spec)  # (the module object keeps the function loaded)
        self.spec = spec
        self.grid, self.threads, self.smem = tuple(int(g) for g in grid), spec.threads, spec.smem
        self._launch = runtime.launch
        self._runtime = runtime
        self._config = None  # (run_after_prior's CUlaunchConfig, made at its first run)
        values = [np.zeros((), np.uint64) if a is None else a if isinstance(a, np.generic) else np.uint64(a.data.ptr)
                  for a in args]
        self.offsets, size = [], 0
        for value in values:
            self.offsets.append(size)
            size += -(-value.dtype.itemsize // 8) * 8
        self._buffer = np.zeros(max(size, 8), np.uint8)
        for value, offset in zip(values, self.offsets):
            raw = np.asarray(value).reshape(1).view(np.uint8)
            self._buffer[offset:offset + raw.size] = raw
        base = self._buffer.ctypes.data
        self._argv = np.array([*(base + offset for offset in self.offsets), *more], np.uint64)
        self._argv_ptr = int(self._argv.ctypes.data)
        self.words = memoryview(self._buffer).cast("Q")  # (item assignment: the cheapest write there is)

    def word(self, index: int, field_offset: int = 0) -> int:
        """The index in :attr:`words` of argument ``index`` (a pointer), or of the pointer field at byte
        ``field_offset`` of a structured argument (VariantParams)."""
        offset = self.offsets[index] + field_offset
        assert offset % 8 == 0, offset
        return offset // 8

    def writer(self, words: tuple[int, ...]):
        """``write(*values)``: writes a run's 64-bit values (pointers), one for each of ``words`` (indices in
        :attr:`words`), into the packed arguments, with one ``struct.pack_into`` per stretch of consecutive words.
        One stretch (a forward's array pointers): a single C call."""
        stretches, start = [], 0
        for i in range(1, len(words) + 1):
            if i == len(words) or words[i] != words[i - 1] + 1:
                stretches.append((struct.Struct(f"<{i - start}Q").pack_into, 8 * words[start], start, i))
                start = i
        buffer = self._buffer
        if len(stretches) == 1:  # (a C callable: no Python frame)
            pack, offset, _, _ = stretches[0]
            return functools.partial(pack, buffer, offset)

        def write(*values):
            for pack, offset, first, stop in stretches:
                pack(buffer, offset, *values[first:stop])
        return write

    def run(self, stream: int) -> None:
        gx, gy, gz = self.grid
        self._launch(self.fn, gx, gy, gz, self.threads, 1, 1, self.smem, stream, self._argv_ptr, 0)

    def prepare_after_prior(self) -> None:
        """[pdl] Make :meth:`run_after_prior`'s CUlaunchConfig and bind the driver's entry point now (a planning step's
        failure, not a run's)."""
        if self._config is None:
            self._runtime.prepare_programmatic()
            self._config = programmatic_config(self.grid, self.threads, self.smem)

    def run_after_prior(self, stream: int) -> bool:
        """[pdl] :meth:`run` with programmatic stream serialization: the kernel may start while the kernel launched
        before it on ``stream`` runs (``cuLaunchKernelEx``). Only for a kernel that waits for that one before reading
        what it writes (:attr:`.spec.Family.waits_for_prior_grid` with key counts). Where the driver refuses the
        launch, the ordinary one runs in its place (the same order, without the overlap), with a warning, and this
        returns False (the caller stops asking); else True."""
        self.prepare_after_prior()
        words = self._config[1]
        words[4] = stream
        try:
            self._runtime.launch_programmatic(self._config[2], self.fn, self._argv_ptr)
        except RuntimeError as exc:
            warnings.warn(f"programmatic dependent launch refused ({exc}); launching the ordinary way",
                          RuntimeWarning, stacklevel=2)
            self.run(stream)
            return False
        return True


# [pdl] cuLaunchKernelEx's CUlaunchConfig (cuda.h): grid x, y, z, block x, y, z and the dynamic shared memory as seven
# uint32, the stream at byte 32, the attributes' address at 40 and their count at 48 (56 bytes); then its one
# CUlaunchAttribute (72 bytes: the id at 0, the value at 8): programmatic stream serialization, allowed.
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CONFIG_BYTES, _ATTRIBUTE_BYTES = 56, 72


def programmatic_config(grid: tuple[int, int, int], threads: int, smem: int):
    """``(buffer, its uint64 words, its address)``: a CUlaunchConfig of one launch with programmatic stream
    serialization, the stream (word 4) written by each run."""
    buffer = np.zeros((_CONFIG_BYTES + _ATTRIBUTE_BYTES) // 8, np.uint64)
    address = int(buffer.ctypes.data)
    struct.pack_into("<7I", buffer, 0, *grid, threads, 1, 1, smem)
    struct.pack_into("<QI", buffer, 40, address + _CONFIG_BYTES, 1)
    struct.pack_into("<II", buffer, _CONFIG_BYTES, _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 0)
    struct.pack_into("<I", buffer, _CONFIG_BYTES + 8, 1)
    return buffer, memoryview(buffer).cast("B").cast("Q"), address


def unpack_config(address: int) -> tuple:
    """``(grid, block, shared memory, stream)`` of a CUlaunchConfig at ``address`` (stand-in runtimes read it)."""
    import ctypes

    raw = ctypes.string_at(address, _CONFIG_BYTES)
    gx, gy, gz, bx, by, bz, smem = struct.unpack_from("<7I", raw, 0)
    return (gx, gy, gz), (bx, by, bz), smem, struct.unpack_from("<Q", raw, 32)[0]


@functools.cache
def launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx(config, function, kernelParams, extra)`` through ctypes (CuPy does not wrap
    it): ``launch(config address, function handle, argv address)``, raising on an error."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def launch(config: int, function: int, argv: int) -> None:
        result = fn(config, function, argv, None)
        if result:
            name = ctypes.c_char_p()
            lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'CUresult').decode()} ({result})")
    return launch
