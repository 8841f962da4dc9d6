"""ptxas's registers and spills of the attention kernels with an additive bias, without a GPU (issue 11).

    PYTHONPATH=. python3 tools/bias_ptxas.py [--json FILE]

Compiles with NVRTC (CPU only), for the kernels the launcher runs at bf16, head dims 64 and 128, not causal and
causal: the wgmma kernels of the H100 (forward, dK/dV with and without dQ) with the bias staged in shared memory
([variant bias tile]; bfloat16, float16 with a float32 gradient, float32 at the tile the launcher gives it) and read
from global memory (bfloat16, float32: biases whose rows are not 16-byte aligned), and the mma.sync kernels of the
A100 (forward, dK/dV, the split order's dQ), which read it from global memory. Beside each, the same kernel dense.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuflash import _cuda  # noqa: E402
from cuflash._cuda.compile import nvrtc_offline  # noqa: E402
from cuflash._cuda.spec import NO_BIAS, TILES, KernelSpec, _policy, bias_policy  # noqa: E402

_RESOURCE_RE = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
    r".*?Used (?P<regs>\d+) registers", re.DOTALL)

# (label, family, tile row (direction, arch class), has_dq, target)
KERNELS = (
    ("wgmma fwd", "fwd_sm90", ("fwd", "sm90a"), False, "sm_90a"),
    ("wgmma dK/dV+dQ", "bwd_dkdv_sm90", ("bwd", "sm90a"), True, "sm_90a"),
    ("wgmma dK/dV", "bwd_dkdv_sm90", ("bwd", "sm90a"), False, "sm_90a"),
    ("mma.sync fwd", "fwd", ("fwd", "sm80"), False, "sm_80"),
    ("mma.sync dK/dV+dQ", "bwd_dkdv", ("bwd", "sm80"), True, "sm_80"),
    ("mma.sync dQ (split)", "bwd_dq", ("bwd_dq", "sm80"), False, "sm_80"),
)
BIASES = (
    ("dense", NO_BIAS),
    ("f32 global", bias_policy("float32")),
    ("bf16 global", bias_policy("bfloat16")),
    ("bf16 staged", bias_policy("bfloat16", True)),
    ("f16 staged, f32 grad", bias_policy("float16", True, "float32")),
    ("f32 staged", bias_policy("float32", True)),
)


def resources(spec: KernelSpec, target: str) -> dict:
    out = nvrtc_offline(_cuda.compile_source_for_nvrtc(spec.source), [spec.name], spec.options, target)
    if not out["ok"]:
        raise RuntimeError(f"{spec.name}:\n{out['log'][-3000:]}")
    m = _RESOURCE_RE.search(out["log"].split("Compiling entry function")[-1])
    return {k: int(v) for k, v in m.groupdict().items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    print("| kernel | d | causal | bias | tile | regs | spill stores / loads (B) | shared memory (B) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, family, row, has_dq, target in KERNELS:
        for d in (64, 128):
            tile = TILES[(*row, d)]
            for causal in (False, True):
                for name, bias in BIASES:
                    staged = "staged" in name
                    if staged and family not in ("fwd_sm90", "bwd_dkdv_sm90"):
                        continue  # (the mma.sync kernels read a bias from global memory)
                    t = tile
                    if name == "f32 staged" and (family, d) != ("fwd_sm90", 128):
                        continue  # (the launcher reads it from global memory: attention._staged_bias_spec)
                    if name == "f32 staged":
                        t = tile._replace(block_n=64)  # (the launcher's tile for it: attention._staged_bias_spec)
                    policy = _policy((False, causal, False, False, False, False, bias, False))
                    spec = KernelSpec(family, "bfloat16", d, t, policy, has_dq)
                    r = resources(spec, target)
                    rows.append(dict(kernel=label, d=d, causal=causal, bias=name, tile=list(t), smem=spec.smem, **r))
                    print(f"| {label} | {d} | {'yes' if causal else 'no'} | {name} | {t.block_m}x{t.block_n} | "
                          f"{r['regs']} | {r['stores']} / {r['loads']} | {spec.smem} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
