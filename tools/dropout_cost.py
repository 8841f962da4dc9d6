"""Instruction counts of attention dropout, without a GPU (issue 11: dropout <= 10 % over dense per FLOP).

    PYTHONPATH=. python3 tools/dropout_cost.py [--json FILE] [--sass | --ptx]

Compiles with NVRTC (CPU only) and counts instructions two ways:

1. Probes: a small kernel per score layout that runs ``dropout_scores`` (the forward's normal layout) or
   ``dropout_bits`` plus two uses of ``kept`` (the backward's transposed layout: P^T and dP^T) on one
   lane's fragment of a tile, in a loop over column tiles like the kernels' (row index fixed per warp,
   column index moving), once with ``Has_dropout`` and once without. The loop body's instruction count,
   dropout minus dense, is the dropout cost per tile per lane; divided by the lane's scores it is the cost
   per score. Opcode classes (IMAD.WIDE, LOP3, ISETP, SHFL, ...) show where it goes.
2. Kernels: the shipped instantiations that an H100 runs at bf16, d 128 (and the mma.sync ones of an A100),
   causal with and without dropout: registers and spills from ptxas's report, total static instructions and
   those of the kernel's largest loop (its per-tile loop), dropout minus dense.

SASS comes from ``nvdisasm`` (found on PATH, as $NVDISASM, or from the pip package nvidia-cuda-nvdisasm);
without it the counts are of PTX instructions, which say less (ptxas fuses mul.hi/mul.lo pairs into one
IMAD.WIDE.U32, three-input XORs into one LOP3, and hoists or rematerializes as registers allow).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuflash import _cuda  # noqa: E402
from cuflash._cuda.compile import nvrtc_offline  # noqa: E402
from cuflash._cuda.spec import TILES, KernelSpec, _policy  # noqa: E402

CAUSAL = (False, True, False, False, False, False, False, False)
CAUSAL_DROPOUT = (False, True, False, False, False, False, False, True)

# The probes: kNT n8 tiles of 16 rows per lane, as the kernels hold them (label, transposed, kNT, arch).
PROBES = (
    ("fwd sm90 (wgmma 16 x 128 per warp)", False, 16, "sm_90a"),
    ("fwd mma.sync (16 x 32, A100 d 128)", False, 4, "sm_80"),
    ("bwd sm90 dK/dV (S^T 16 x 64 per warp)", True, 8, "sm_90a"),
    ("bwd mma.sync dK/dV (S^T 16 x 32 per m tile)", True, 4, "sm_80"),
)

PROBE_SOURCE = r"""
namespace cuflash {
// One lane's fragment of kNT n8 tiles (16 rows), dropout applied n_tiles times as the kernels do: the rows
// stay (a warp's queries in the forward, its keys in the backward), the columns move by one tile.
template <class V, bool kTransposed, int kNT>
__global__ void dropout_probe(float* out, const VariantParams vp, int row_base, int col_base, int n_tiles) {
    const BlockInfo<V> bi(vp, blockIdx.z, blockIdx.y, 1 << 20, 1 << 20);
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
    for (int it = 0; it < n_tiles; ++it) {
        float s[kNT][4], dp[kNT][4];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = fmaf((float)(4 * nt + e), 0.25f, (float)(lane + it));  // float arithmetic: the
                dp[nt][e] = fmaf((float)(4 * nt + e), 0.5f, (float)(lane - it));  // selects stay FSEL
            }
        }
        const int col = col_base + it * 8 * kNT;
        if constexpr (!kTransposed) {  // the forward: P dropped after the row sum
            dropout_scores<false>(s, bi, row_base, col, lane, 1.f);
        } else if constexpr (V::Has_dropout) {  // the backward: keep bits once, used for P^T and dP^T
            u32 bits[(4 * kNT + 31) / 32];
            dropout_bits<true, kNT>(bits, bi, row_base, col, lane);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = kept<kNT>(bits, nt, e) ? s[nt][e] * bi.keep_scale : 0.f;
                    dp[nt][e] = kept<kNT>(bits, nt, e) ? dp[nt][e] * bi.keep_scale : 0.f;
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc += s[nt][e] * dp[nt][e];
        }
    }
    out[blockIdx.x * 32 + lane] = acc;
}
}  // namespace cuflash
"""

# The kernels an H100 runs at bf16, d 128 (the wgmma ones), and the A100's mma.sync ones.
KERNELS = (
    ("fwd_sm90", ("fwd", "sm90a", 128), "sm_90a", False),
    ("bwd_dkdv_sm90", ("bwd", "sm90a", 128), "sm_90a", True),
    ("fwd", ("fwd", "sm80", 128), "sm_80", False),
    ("bwd_dkdv", ("bwd", "sm80", 128), "sm_80", True),
    ("bwd_dq", ("bwd_dq", "sm80", 128), "sm_80", False),
)


def find_nvdisasm() -> str | None:
    """nvdisasm from $NVDISASM, PATH, or the nvidia-cuda-nvdisasm wheel (any site-packages on sys.path)."""
    if os.environ.get("NVDISASM"):
        return os.environ["NVDISASM"]
    found = shutil.which("nvdisasm")
    if found:
        return found
    for base in sys.path:
        for path in glob.glob(os.path.join(base, "nvidia", "*", "bin", "nvdisasm")):
            return path
    return None


def nvrtc_compile(text: str, names: list[str], options: tuple[str, ...], arch: str) -> dict:
    """PTX, cubin and ptxas's -v log of ``names`` compiled from ``text`` for ``arch`` (a real sm_XX)."""
    out = nvrtc_offline(text, names, options, arch)
    if not out["ok"]:
        raise RuntimeError(f"NVRTC failed:\n{out['log'][-4000:]}")
    return out


def resources(log: str) -> dict[str, dict]:
    """ptxas -v per mangled kernel name: registers, spill stores / loads (bytes)."""
    out = {}
    for block in log.split("Compiling entry function '")[1:]:
        fn = block.split("'", 1)[0]
        regs = re.search(r"Used (\d+) registers", block)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        out[fn] = dict(regs=int(regs.group(1)) if regs else None,
                       spill_stores=int(spill.group(1)) if spill else 0, spill_loads=int(spill.group(2)) if spill else 0)
    return out


# --- SASS -------------------------------------------------------------------------------------------

_SASS_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_functions(cubin: bytes, nvdisasm: str) -> dict[str, list[tuple[int, str, str]]]:
    """Mangled function name -> [(address, opcode with modifiers, operands)], labels as (address, "LABEL", name)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run([nvdisasm, "-c", path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    funcs: dict[str, list] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        if current is None:
            continue
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            current.append((current[-1][0] + 1 if current else 0, "LABEL", m.group(1)))
            continue
        m = _SASS_RE.search(line)
        if m:
            current.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return funcs


def sass_largest_loop(ins: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the largest backward-branch range [label, branch] (the per-tile loop)."""
    labels = {operands: n for n, (_, op, operands) in enumerate(ins) if op == "LABEL"}
    best: list = []
    for n, (_, op, operands) in enumerate(ins):
        if op.startswith("BRA"):
            m = re.search(r"\((\.L_x_\d+)\)", operands)
            target = labels.get(m.group(1)) if m else None
            if target is not None and target < n:
                body = [x for x in ins[target:n + 1] if x[1] != "LABEL"]
                if len(body) > len(best):
                    best = body
    return best


# --- PTX --------------------------------------------------------------------------------------------

def ptx_functions(ptx: str) -> dict[str, list[tuple[int, str, str]]]:
    """Mangled entry name -> [(index, opcode, operands)] of its PTX instructions; labels as ("LABEL", name)."""
    funcs: dict[str, list] = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\n\}", ptx, re.DOTALL):
        body = m.group(2).split(")", 1)[1] if ")" in m.group(2) else m.group(2)
        ins = []
        for line in body.splitlines():
            line = line.split("//")[0].strip()
            if not line or line.startswith((".", "{", "}")):
                continue
            lab = re.match(r"^(\$?\w+):", line)
            if lab:
                ins.append((len(ins), "LABEL", lab.group(1)))
                continue
            mm = re.match(r"^(@!?%p\d+\s+)?([a-z][\w.]*)\s*(.*?);?$", line)
            if mm:
                ins.append((len(ins), mm.group(2), mm.group(3)))
        funcs[m.group(1)] = ins
    return funcs


def ptx_largest_loop(ins: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    labels = {operands: n for n, op, operands in ins if op == "LABEL"}
    best: list = []
    for n, op, operands in ins:
        if op.startswith("bra"):
            target = labels.get(operands.strip().rstrip(";"))
            if target is not None and target < n:
                body = [x for x in ins[target:n + 1] if x[1] != "LABEL"]
                if len(body) > len(best):
                    best = body
    return best


def opclass(op: str, sass: bool) -> str:
    """A coarse class of an opcode (what the dropout code is made of)."""
    if sass:
        for prefix in ("IMAD.WIDE", "IMAD.HI", "IMAD.SHL", "IMAD.MOV", "IMAD.IADD", "IMAD", "LOP3", "IADD3", "ISETP",
                       "SEL", "FSEL", "SHF", "PRMT", "SHFL", "LEA", "FMUL", "FFMA", "FADD", "HMMA", "MOV", "R2P", "P2R",
                       "PLOP3", "VIMNMX", "LDL", "STL"):
            if op.startswith(prefix):
                return prefix
        return "other"
    base = op.split(".")[0]
    if op.startswith(("mul.hi", "mul.lo", "mul.wide", "mad.hi", "mad.lo", "mad.wide")):
        return op.split(".")[0] + "." + op.split(".")[1]
    return base if base in ("xor", "and", "or", "add", "setp", "selp", "shl", "shr", "prmt", "shfl", "lop3", "mov",
                            "cvt", "fma", "mul", "bfe", "bfi", "not", "sub", "st", "ld") else "other"


def count(ins, sass: bool) -> Counter:
    return Counter(opclass(op, sass) for _, op, _ in ins if op != "LABEL")


def diff(a: Counter, b: Counter) -> dict[str, int]:
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] - b[k]))
    return {k: a[k] - b[k] for k in keys if a[k] != b[k]}


def variants_text() -> str:
    """forward.cu's includes (tiles, user mods, variants) and the probe, as one NVRTC source."""
    text = _cuda.compile_source_for_nvrtc("forward.cu")
    return text + PROBE_SOURCE


def run_probes(nvdisasm: str | None, use_sass: bool) -> list[dict]:
    rows = []
    text = variants_text()
    for label, transposed, nt, arch in PROBES:
        names = {flag: f"cuflash::dropout_probe<{_policy((False,) * 7 + (flag,))}, {str(transposed).lower()}, {nt}>"
                 for flag in (False, True)}
        options = _cuda.NVRTC_OPTIONS + (("-arch=sm_90a",) if arch == "sm_90a" else ())
        options = tuple(o for o in options if not o.startswith("-arch"))
        out = nvrtc_compile(text, list(names.values()), options, arch)
        res = resources(out["log"])
        body = {}
        for flag, name in names.items():
            fn = out["lowered"][name]
            if use_sass:
                body[flag] = sass_largest_loop(sass_functions(out["cubin"], nvdisasm)[fn])
            else:
                body[flag] = ptx_largest_loop(ptx_functions(out["ptx"])[fn])
        c_drop, c_dense = count(body[True], use_sass), count(body[False], use_sass)
        scores = 4 * nt
        n = sum(c_drop.values()) - sum(c_dense.values())
        rows.append(dict(probe=label, arch=arch, scores_per_lane=scores, instructions=n, per_score=n / scores,
                         classes=diff(c_drop, c_dense),
                         regs=res.get(out["lowered"][names[True]], {}).get("regs")))
    return rows


def run_kernels(nvdisasm: str | None, use_sass: bool) -> list[dict]:
    rows = []
    for family, row, arch, has_dq in KERNELS:
        tile = TILES[row]
        specs = {flag: KernelSpec(family, "bfloat16", 128, tile, _policy(flags), has_dq, row[1])
                 for flag, flags in ((False, CAUSAL), (True, CAUSAL_DROPOUT))}
        text = _cuda.compile_source_for_nvrtc(specs[True].source)
        options = tuple(o for o in specs[True].options if not o.startswith("-arch"))
        out = nvrtc_compile(text, [s.name for s in specs.values()], options, arch)
        res = resources(out["log"])
        funcs = sass_functions(out["cubin"], nvdisasm) if use_sass else ptx_functions(out["ptx"])
        loop = sass_largest_loop if use_sass else ptx_largest_loop
        r = dict(kernel=family, tile=list(tile), arch=arch)
        for flag, spec in specs.items():
            fn = out["lowered"][spec.name]
            key = "dropout" if flag else "dense"
            r[key] = dict(total=sum(count(funcs[fn], use_sass).values()), loop=sum(count(loop(funcs[fn]), use_sass).values()),
                          **res.get(fn, {}))
        rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx", action="store_true", help="count PTX instructions even when nvdisasm is there")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--no-kernels", action="store_true", help="the probes only (the kernels take minutes)")
    args = ap.parse_args()
    nvdisasm = None if args.ptx else find_nvdisasm()
    use_sass = nvdisasm is not None
    unit = "SASS" if use_sass else "PTX"
    print(f"# dropout cost in {unit} instructions ({nvdisasm or 'nvdisasm not found: PTX'})")
    probes = run_probes(nvdisasm, use_sass)
    print("\n## Probes: dropout minus dense, one lane, one tile (loop body)\n")
    print("| layout | arch | scores/lane | instructions | per score | regs | main classes |")
    print("|---|---|---|---|---|---|---|")
    for p in probes:
        top = ", ".join(f"{k} {v}" for k, v in list(p["classes"].items())[:8])
        print(f"| {p['probe']} | {p['arch']} | {p['scores_per_lane']} | {p['instructions']} | {p['per_score']:.2f} | "
              f"{p['regs']} | {top} |")
    kernels = [] if args.no_kernels else run_kernels(nvdisasm, use_sass)
    if kernels:
        print("\n## Kernels (bf16, d 128, causal): dropout vs dense\n")
        print("| kernel | tile | arch | regs dense/dropout | spills (B) | static instr dense/dropout | "
              "largest loop dense/dropout | loop delta |")
        print("|---|---|---|---|---|---|---|---|")
        for k in kernels:
            a, b = k["dense"], k["dropout"]
            print(f"| {k['kernel']} | {tuple(k['tile'])} | {k['arch']} | {a.get('regs')}/{b.get('regs')} | "
                  f"{a.get('spill_stores', 0)}/{b.get('spill_stores', 0)} | {a['total']}/{b['total']} | "
                  f"{a['loop']}/{b['loop']} | {b['loop'] - a['loop']:+d} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(unit=unit, probes=probes, kernels=kernels), f, indent=1)


if __name__ == "__main__":
    main()
