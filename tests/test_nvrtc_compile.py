"""Compile every shipped CUDA kernel instantiation with NVRTC, without a GPU.

For each target (sm_80, sm_90a) and each source file, one NVRTC program holds all of that file's shipped
name expressions (``cuflash._cuda.instantiations()``: every tile-table row dense and causal, and every
variant policy flag once in every FlashAttention-2 kernel family) and is compiled to a cubin with
``--ptxas-options=-v``; the test fails on a compile error or on any register spill in ptxas's resource
report. Skips cleanly when cuda-bindings or the CUDA headers/NVRTC library are not installed
(``pip install -e .[nvrtc]``).
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from cuflash import _cuda
from cuflash._cuda.spec import policy_args, prelude_of

TARGETS = ("sm_80", "sm_90a")
SOURCES = ("forward.cu", "backward.cu", "forward_sm90.cu", "backward_sm90.cu", "fa1.cu", "block_map.cu", "decode.cu",
           "decode_sm90.cu")
FA2_FAMILIES = ("fwd", "fwd_sm90", "fwd_f32", "fwd_tf32x3", "fwd_tf32", "bwd_dkdv", "bwd_dkdv_sm90", "bwd_dkdv_f32",
                "bwd_dq", "bwd_dq_f32")

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
    """Compile ``names`` of ``source_text`` to a cubin for ``arch``; returns (ok, log). (``nvrtc``: the module
    _nvrtc() found usable.)"""
    out = _cuda.compile.nvrtc_offline(source_text, names, options, arch)
    return out["ok"], out["log"]


def parse_resources(log: str) -> list[dict]:
    """One dict per kernel in ptxas's -v report: fn, arch, regs, stack, spill stores, spill loads."""
    rows = []
    for block in log.split("ptxas info    : Compiling entry function")[1:]:
        m = _RESOURCE_RE.search("Compiling entry function" + block)
        if m:
            rows.append({k: (int(v) if v.isdigit() else v) for k, v in m.groupdict().items()})
    return rows


# Known spills, each bounded (bytes of spill stores; docs/variants.md, "On the GPU"); anything larger fails:
# the wgmma backward with softcap keeps S^T, dP^T, dK, dV and the tanh derivative live at once; the wgmma
# forward at d 128 spills only with softcap, ALiBi, a window and packed sequences all at once; a bias read
# from global memory straight into the score fragments (one value per score, loads hoisted by the compiler:
# the mma.sync kernels, and the wgmma ones where its rows are not 16-byte aligned); a staged bias ("bias tile":
# read from shared memory, [variant bias tile]) only in the d 64 wgmma forward, built for two blocks per SM (128
# registers, of which the dense kernel takes 126): 32 to 40 bytes, where reading global memory spilled 84 to 104.
KNOWN_SPILLS = {("flash_bwd_dkdv_sm90_kernel", "softcap"): 64, ("flash_fwd_sm90_kernel", "softcap"): 32,
                ("flash_fwd_sm90_kernel", "bias tile"): 48,
                **{(kernel, "bias"): 256 for kernel in ("flash_fwd_kernel", "flash_fwd_sm90_kernel", "flash_bwd_dq_kernel",
                                                        "flash_bwd_dkdv_kernel", "flash_bwd_dkdv_sm90_kernel")},
                # dropout's keep bits and dropped P beside dK, dV; the larger bounds are for its
                # every-flag combinations (dropout with bias, softcap, ALiBi and a window at once)
                ("flash_bwd_dkdv_kernel", "dropout"): 128, ("flash_bwd_dkdv_sm90_kernel", "dropout"): 384,
                ("flash_fwd_kernel", "dropout"): 64, ("flash_fwd_sm90_kernel", "dropout"): 192,
                ("flash_bwd_dq_kernel", "dropout"): 32,
                # a user score_mod / mask_mod: user code in the score loop
                **{(kernel, "user_mod"): 64 for kernel in ("flash_fwd_kernel", "flash_fwd_sm90_kernel", "flash_bwd_dq_kernel",
                                                           "flash_bwd_dkdv_kernel", "flash_bwd_dkdv_sm90_kernel")},
                # the 3xTF32 forward (first version) at d 96 / 128: big and small fragments and each k8 step's sum from zero
                # beside S and O; spills with ALiBi in a window, a bias, dropout, user mods, and in sm_80 code at the
                # sm_86 tiles (64 x 32, 4 warps), up to 176 bytes (docs/performance.md, "float32 on the tensor cores")
                ("flash_fwd_kernel", "tf32x3"): 192,
                # the backward's TMA entry point: the same body (spilling less: no address arithmetic for Q and dO)
                **{("flash_bwd_dkdv_sm90_tma_kernel", flag): limit for flag, limit in
                   (("softcap", 64), ("bias", 256), ("dropout", 384), ("user_mod", 64))},
                # the mma.sync dK/dV kernel above head dim 128 (d 192, 256): dK and dV of 48 or 64 columns a warp beside
                # S and dP, 20-40 bytes with dQ's atomics
                ("flash_bwd_dkdv_kernel", "wide"): 64}
_VARIANT_FLAGS = ("left", "right", "varlen", "seqused", "softcap", "alibi", "bias", "dropout")


def variant_flags(name: str) -> set[str]:
    """The policy flags that are on in a kernel's name expression (``_VARIANT_FLAGS``; "bias" for a bias read from
    global memory, "bias tile" for a staged one; "user_mod" for a generated user-mod type; "wide" for a 16-bit kernel
    above head dim 128)."""
    if "cuflash::Variant<" not in name:
        return set()
    wide = re.match(r"[\w:]+<cuflash::(?:bf16|fp16), (\d+),", name)
    policy = name[name.index("cuflash::Variant<"):]
    args = policy_args(policy[:_closing(policy, policy.index("<")) + 1])
    flags = {f for f, arg in zip(_VARIANT_FLAGS, args) if arg == "true"}
    if args[6].startswith("cuflash::BiasArray<"):
        flags.add("bias tile" if policy_args(args[6])[1] == "true" else "bias")
    if "UserMod_" in name:
        flags.add("user_mod")
    if "cuflash::tf32x3" in name:
        flags.add("tf32x3")
    if wide and int(wide.group(1)) > 128:
        flags.add("wide")
    return flags


def _closing(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        depth += text[i] == "<"
        depth -= text[i] == ">"
        if depth == 0:
            return i
    raise ValueError(text)


def _known_spill(row, names: dict[str, str]) -> bool:
    """Whether ``row``'s spill is a bounded KNOWN_SPILLS one (``names``: mangled name -> name expression)."""
    m = re.search(r"cuflash\d+(\w+?_kernel)I", row["fn"])
    if not m or row["fn"] not in names:
        return False
    flags = variant_flags(names[row["fn"]])
    return any(kernel == m.group(1) and flag in flags and row["stores"] <= limit
               for (kernel, flag), limit in KNOWN_SPILLS.items())


def assert_compiles_without_spills(nvrtc, text, names, options, arch, label):
    """Compile ``names`` from ``text``; fail on a compile error, wgmma serialized by ptxas, a missing resource line or
    any spill (beyond the bounded KNOWN_SPILLS)."""
    out = _cuda.compile.nvrtc_offline(text, names, options, arch)
    ok, log = out["ok"], out["log"]
    assert ok, f"NVRTC failed for {label}:\n{log[-6000:]}"
    # ptxas serializes wgmma where it cannot prove an accumulator untouched while a product is in flight (warnings
    # C7510 and up, "Potential Performance Loss: wgmma.mma_async instructions are serialized"): a kernel that
    # compiles but runs its products one by one
    serialized = [line for line in log.splitlines() if "wgmma.mma_async instructions are serialized" in line]
    assert not serialized, f"{label}: ptxas serialized wgmma:\n" + "\n".join(serialized[:4])
    rows = parse_resources(log)
    assert len(rows) >= len(names), f"expected a resource line per kernel; log:\n{log[-3000:]}"
    by_mangled = {mangled: name for name, mangled in out["lowered"].items()}
    spills = [r for r in rows if (r["stores"] or r["loads"]) and not _known_spill(r, by_mangled)]
    assert not spills, "register spills:\n" + "\n".join(
        f"{r['fn']}: {r['regs']} regs, {r['stores']} B spill stores, {r['loads']} B spill loads" for r in spills
    )


def _groups():
    groups = defaultdict(list)
    for spec in _cuda.instantiations():
        for target in spec.targets:
            groups[(spec.source, spec.options, target)].append(spec.name)
    return sorted(groups.items())


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_instantiation_compiles_without_spills(arch, source):
    """Each instantiation for the targets whose GPUs run it (sm_80 for the A100 and consumer tiles, sm_90a
    for the H100/H200 tiles and the wgmma kernels, both for the SIMT float32 kernels)."""
    nvrtc = _nvrtc()
    text = _cuda.compile_source_for_nvrtc(source)
    groups = [(opts, names) for (src, opts, target), names in _groups() if src == source and target == arch]
    if not groups:
        pytest.skip(f"no {source} instantiation targets {arch}")
    for options, names in groups:
        full = text + prelude_of(*names)  # the generated user-mod types these name
        assert_compiles_without_spills(nvrtc, full, names, options, arch, f"{source} ({arch})")


def test_racecheck_build_of_the_mla_kernel_compiles():
    """The CUFLASH_RACECHECK=1 build (docs/testing.md: the MLA kernel's bar.arrive handovers made waits) compiles,
    so that racecheck can run on it; its PTX has no bar.arrive left, the shipped build's has."""
    _nvrtc()
    names = [s.name for s in _cuda.instantiations() if s.family == "decode_mla_sm90"][:2]
    assert names, "no MLA sm90 instantiation listed"
    text = _cuda.compile_source_for_nvrtc("decode_sm90.cu")
    shipped = _cuda.compile.nvrtc_offline(text, names, _cuda.SM90A_OPTIONS, "sm_90a")
    debug = _cuda.compile.nvrtc_offline(text, names, _cuda.SM90A_OPTIONS + ("-DCUFLASH_RACECHECK",), "sm_90a")
    assert shipped["ok"] and debug["ok"], debug["log"][-3000:]
    assert "bar.arrive" in shipped["ptx"] and "bar.arrive" not in debug["ptx"]


def test_decode_occupancy_build_asks_three_blocks_of_the_contiguous_kernel_only():
    """[decode occupancy] (off) With CUFLASH_DECODE_MIN_BLOCKS=3 the contiguous-cache decode kernel's launch bounds ask
    three blocks an SM (.minnctapersm 3 in its PTX) and ptxas keeps it within 168 registers; the paged kernel and the
    shipped build ask one."""
    _nvrtc()
    names = [s.name for s in _cuda.instantiations() if s.family == "decode" and s.head_dim == 128
             and s.dtype == "bfloat16"]
    assert sorted(n.endswith("true>") for n in names) == [False, True], names
    text = _cuda.compile_source_for_nvrtc("decode.cu")
    options = _cuda.SM90A_OPTIONS + ("-Xptxas=-v",)
    shipped = _cuda.compile.nvrtc_offline(text, names, options, "sm_90a")
    built = _cuda.compile.nvrtc_offline(text, names, options + ("-DCUFLASH_DECODE_MIN_BLOCKS=3",), "sm_90a")
    assert shipped["ok"] and built["ok"], built["log"][-3000:]
    assert shipped["ptx"].count(".minnctapersm 1") == 2 and ".minnctapersm 3" not in shipped["ptx"]
    assert built["ptx"].count(".minnctapersm 3") == 1 and built["ptx"].count(".minnctapersm 1") == 1
    regs = {r["fn"]: r["regs"] for r in parse_resources(built["log"])}
    contiguous = next(n for n in names if n.endswith("false>"))
    assert regs[built["lowered"][contiguous]] <= 168


@pytest.mark.parametrize("level", [1, 2])
def test_decode_l2_hints_compile_without_spills(level):
    """[decode l2] (off) With CUFLASH_DECODE_L2=1 the decode kernels' cache copies ask 256-byte L2 fetches
    (cp.async ... .L2::256B), with 2 also an evict-first policy (createpolicy, .L2::cache_hint); no spills; the
    shipped build has neither."""
    nvrtc = _nvrtc()
    names = [s.name for s in _cuda.instantiations() if s.family == "decode" and s.head_dim == 128
             and s.dtype == "bfloat16"]  # (contiguous and paged)
    text = _cuda.compile_source_for_nvrtc("decode.cu")
    shipped = _cuda.compile.nvrtc_offline(text, names, _cuda.SM90A_OPTIONS, "sm_90a")
    assert shipped["ok"] and "L2::256B" not in shipped["ptx"] and "createpolicy" not in shipped["ptx"]
    options = _cuda.SM90A_OPTIONS + (f"-DCUFLASH_DECODE_L2={level}",)
    assert_compiles_without_spills(nvrtc, text, names, options, "sm_90a", f"decode.cu with CUFLASH_DECODE_L2={level}")
    ptx = _cuda.compile.nvrtc_offline(text, names, options, "sm_90a")["ptx"]
    assert "cp.async.cg.shared.global" + (".L2::cache_hint" if level == 2 else "") + ".L2::256B" in ptx
    assert ("createpolicy.fractional.L2::evict_first" in ptx) == (level == 2)


@pytest.mark.parametrize("switch", ["CUFLASH_MLA_EARLY_S0=0", "CUFLASH_MLA_P0_FIRST=1"])
def test_mla_kernel_schedules_compile_without_spills(switch):
    """The MLA kernel's other schedules (decode_sm90.cu): [mla early s0] off (both warpgroups' S at the top of each
    pair, the comparison build) and the [mla p0 first] experiment compile for sm_90a without spills or serialized
    wgmma, as the shipped build does (test_every_instantiation_compiles_without_spills)."""
    nvrtc = _nvrtc()
    names = [s.name for s in _cuda.instantiations() if s.family == "decode_mla_sm90"][:2]
    assert names, "no MLA sm90 instantiation listed"
    text = _cuda.compile_source_for_nvrtc("decode_sm90.cu")
    assert_compiles_without_spills(nvrtc, text, names, _cuda.SM90A_OPTIONS + (f"-D{switch}",), "sm_90a",
                                   f"decode_sm90.cu with {switch}")


def test_fp8_exponentials_on_the_16_bit_path_compile_without_spills():
    """[fp8 exp16] (forward_sm90.cu, an experiment, off): the FP8 forward built with its exponentials as
    ex2.approx.f16x2 compiles for sm_90a without spills or serialized wgmma, and only that build has the instruction."""
    nvrtc = _nvrtc()
    names = [s.name for s in _cuda.instantiations() if s.family == "fwd_sm90_fp8"][:2]
    assert names, "no FP8 forward instantiation listed"
    text = _cuda.compile_source_for_nvrtc("forward_sm90.cu")
    options = _cuda.SM90A_OPTIONS + ("-DCUFLASH_FP8_EXP16=1",)
    assert_compiles_without_spills(nvrtc, text, names, options, "sm_90a", "forward_sm90.cu with CUFLASH_FP8_EXP16=1")
    shipped = _cuda.compile.nvrtc_offline(text, names, _cuda.SM90A_OPTIONS, "sm_90a")
    assert "ex2.approx.f16x2" not in shipped["ptx"]
    assert "ex2.approx.f16x2" in _cuda.compile.nvrtc_offline(text, names, options, "sm_90a")["ptx"]


_BWD_SCHEDULE_DEFAULTS = {"CUFLASH_BWD_DQ_FIRST": 1, "CUFLASH_BWD_FLOW": 1, "CUFLASH_BWD_DQ_TILE": 1}


@pytest.mark.parametrize("changes", [{"CUFLASH_BWD_DQ_TILE": 0}, {"CUFLASH_BWD_DQ_FIRST": 0, "CUFLASH_BWD_DQ_TILE": 0},
                                     {"CUFLASH_BWD_FLOW": 0},
                                     {"CUFLASH_BWD_FLOW": 0, "CUFLASH_BWD_DQ_FIRST": 0, "CUFLASH_BWD_DQ_TILE": 0}],
                         ids=lambda c: ",".join(f"{k[len('CUFLASH_BWD_'):]}={v}" for k, v in c.items()))
def test_other_schedules_of_the_tma_backward_compile_without_spills(changes):
    """The backward's TMA entry point built with its dQ schedules (backward_sm90.cu) other than the shipped ones:
    [bwd dq first] (dQ's product issued before dV's and dK's, waited for alone: wait_group 2; on),
    [bwd flow] (lse and D copies counted by the query buffers' mbarriers, cp.async.mbarrier.arrive, instead of a block
    barrier; on) and [bwd dq tile] (one bulk reduction a query tile, issued by one thread after a named barrier; on;
    off, dQ's red.global.add) compile for sm_90a without spills, each schedule's instructions present exactly where it
    is on."""
    nvrtc = _nvrtc()
    names = [s.name for s in _cuda.instantiations() if s.family == "bwd_dkdv_sm90_tma" and s.has_dq
             and not variant_flags(s.name)][:2]
    assert names, "no TMA dK/dV instantiation with dQ listed"
    text = _cuda.compile_source_for_nvrtc("backward_sm90.cu")

    def check(ptx, settings):
        bulk = settings["CUFLASH_BWD_DQ_TILE"]
        assert ("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx) == bool(bulk)
        assert ("red.global.add" in ptx) == (not bulk)
        assert ("bar.arrive" in ptx) == bool(bulk)
        assert ("wgmma.wait_group.sync.aligned 2;" in ptx) == bool(settings["CUFLASH_BWD_DQ_FIRST"])
        assert ("cp.async.mbarrier.arrive.noinc" in ptx) == bool(settings["CUFLASH_BWD_FLOW"])

    shipped = _cuda.compile.nvrtc_offline(text, names, _cuda.SM90A_OPTIONS, "sm_90a")
    assert shipped["ok"], shipped["log"][-3000:]
    check(shipped["ptx"], _BWD_SCHEDULE_DEFAULTS)
    options = _cuda.SM90A_OPTIONS + tuple(f"-D{m}={v}" for m, v in changes.items())
    assert_compiles_without_spills(nvrtc, text, names, options, "sm_90a", f"backward_sm90.cu with {changes}")
    check(_cuda.compile.nvrtc_offline(text, names, options, "sm_90a")["ptx"], {**_BWD_SCHEDULE_DEFAULTS, **changes})


@pytest.mark.parametrize("family,count", [("fwd", 38), ("fwd_sm90", 38), ("fwd_tf32x3", 38), ("bwd_dkdv", 50),
                                          ("bwd_dkdv_sm90", 50), ("bwd_dq", 43)])
def test_flat_entry_points_compile_with_their_parameters_one_by_one(family, count):
    """The flat entry points (cuflash.jax's kernel calls: VariantParams' fields as separate parameters) compile for
    the same targets as the launcher's entry points, with the same registers, and take the launcher's parameters
    with VariantParams' 16 fields in its place (the forward: q, k, v, out, lse, 4 sizes, 12 strides, the scale;
    dK/dV: 10 buffers, 5 sizes, 18 strides, the scale; dQ: 7 buffers, 4 sizes, 15 strides, the scale)."""
    _nvrtc()
    spec = next(s for s in _cuda.instantiations() if s.family == family)
    names = [spec.name, spec.flat_name]
    text = _cuda.compile_source_for_nvrtc(spec.source) + prelude_of(*names)
    out = _cuda.compile.nvrtc_offline(text, names, spec.options, spec.targets[-1])
    assert out["ok"], out["log"][-3000:]
    regs = {r["fn"]: (r["regs"], r["stores"], r["loads"]) for r in parse_resources(out["log"])}
    launcher, flat = (regs[out["lowered"][n]] for n in names)
    assert flat == launcher and flat[1:] == (0, 0)
    entry = out["ptx"][out["ptx"].index(".entry " + out["lowered"][spec.flat_name]):]
    assert entry[:entry.index(")")].count(".param") == count


def test_instantiation_list_covers_the_tile_table_and_every_policy():
    specs = _cuda.instantiations()
    names = [spec.name for spec in specs]
    assert len(names) == len(set(names))
    keys = {(s.family, s.dtype, s.head_dim, s.tile) for s in specs}
    for (direction, arch, d), t in _cuda.TILES.items():
        assert any(k[2:] == (d, t) and k[0].startswith(direction.split("_")[0]) for k in keys), (direction, arch, d)
    # Every variant policy flag is compiled on in every FA2 family; the bias in its three dtypes, and staged
    # ([variant bias tile]) in the wgmma families.
    for fam in FA2_FAMILIES:
        flags = [variant_flags(s.name) for s in specs if s.family == fam]
        assert flags and all(any(flag in f for f in flags) for flag in _VARIANT_FLAGS if flag != "bias"), fam
        assert any("bias" in f for f in flags), fam
        biases = {policy_args(policy_args(s.variant)[6])[0] for s in specs
                  if s.family == fam and "BiasArray" in s.variant}
        assert biases == {"float", "cuflash::fp16", "cuflash::bf16"}, (fam, biases)
        assert any("bias tile" in f for f in flags) == fam.endswith("sm90"), fam
    # The forward's TMA entry point: every flag, a bias read from global memory (never staged, never with dropout), a
    # user mod.
    tma = [variant_flags(s.name) for s in specs if s.family == "fwd_sm90_tma"]
    assert not any("bias tile" in f or {"bias", "dropout"} <= f for f in tma)
    assert all(any(flag in f for f in tma) for flag in {*_VARIANT_FLAGS, "user_mod"})


def test_source_text_is_self_contained():
    for source in SOURCES:
        text = _cuda.compile_source_for_nvrtc(source)
        assert '#include "' not in text
        assert "namespace cuflash" in text


def _layout_asserts(struct: str, dtype, rename=None) -> str:
    """static_asserts that C++'s ``struct`` has the size and field offsets of the NumPy ``dtype`` the launcher
    packs it with (``rename``: dtype field -> C++ member path where they differ)."""
    rename = rename or {}
    lines = [f'static_assert(sizeof(cuflash::{struct}) == {dtype.itemsize}, "{struct}: size");']
    for name, (_, offset) in dtype.fields.items():
        member = rename.get(name, name)
        lines.append(f'static_assert(__builtin_offsetof(cuflash::{struct}, {member}) == {offset}, "{struct}.{member}");')
    return "\n".join(lines) + "\n"


def test_parameter_structs_match_the_launchers_layouts():
    """VariantParams, ExtraParams, DecodeParams, CascadeParams, RotaryParams and PrefillAppend are packed by NumPy
    structured dtypes: C++ must agree on every offset, or a kernel would read one field as another."""
    from cuflash._cuda.cascade import CASCADE_PARAMS_DTYPE
    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE, ROTARY_PARAMS_DTYPE
    from cuflash._cuda.spec import EXTRA_PARAMS_DTYPE, PREFILL_APPEND_DTYPE, VARIANT_PARAMS_DTYPE

    nvrtc = _nvrtc()
    probe = 'struct S { int a; double b; };\nstatic_assert(__builtin_offsetof(S, b) == 8, "offsetof");\n'
    if not compile_with_nvrtc(nvrtc, probe, [], _cuda.NVRTC_OPTIONS, "sm_80")[0]:
        pytest.skip("this NVRTC has no __builtin_offsetof (the NVRTC of the nvrtc extra, CI's, checks the layouts)")
    text = _cuda.compile_source_for_nvrtc("forward.cu") + _layout_asserts("VariantParams", VARIANT_PARAMS_DTYPE)
    text += _layout_asserts("ExtraParams", EXTRA_PARAMS_DTYPE, {"mod_ptr": "mods.ptr", "mod_len": "mods.len"})
    ok, log = compile_with_nvrtc(nvrtc, text, [], _cuda.NVRTC_OPTIONS, "sm_80")
    assert ok, log[-3000:]
    text = _cuda.compile_source_for_nvrtc("decode.cu") + _layout_asserts("DecodeParams", DECODE_PARAMS_DTYPE)
    text += _layout_asserts("CascadeParams", CASCADE_PARAMS_DTYPE)
    text += _layout_asserts("RotaryParams", ROTARY_PARAMS_DTYPE)
    ok, log = compile_with_nvrtc(nvrtc, text, [], _cuda.NVRTC_OPTIONS, "sm_80")
    assert ok, log[-3000:]
    text = _cuda.compile_source_for_nvrtc("forward_sm90.cu") + _layout_asserts("PrefillAppend", PREFILL_APPEND_DTYPE)
    ok, log = compile_with_nvrtc(nvrtc, text, [], _cuda.SM90A_OPTIONS, "sm_90a")
    assert ok, log[-3000:]
