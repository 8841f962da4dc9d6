"""Keep the draft Hopper backward (cuflash_kernels/backward_sm90.cu) compiling, without a GPU.

The kernel is not dispatched (it has not run on a GPU yet; see docs/kernel-notes.md, "Hopper backward
draft"), so ``cuflash._cuda.instantiations()`` does not list it; this test names its own small set: bfloat16
at head dims 64 and 128, causal and not, with the dQ product (the instantiations tools/sm90_bwd_check.py
runs), plus the key-split dQ variant at both head dims. Compiled for sm_90a with ``--ptxas-options=-v``;
fails on a compile error or any register spill. Skips cleanly without cuda-bindings / NVRTC.
"""

from __future__ import annotations

import pytest

from cuflash import _cuda
from test_nvrtc_compile import _nvrtc, assert_compiles_without_spills

SOURCE = "backward_sm90.cu"
TILE = "64, 128, 8, 2"  # block_m, block_n, warps, stages (tools/sm90_bwd_check.py TILES)


def _name(d: int, causal: bool) -> str:
    return f"cuflash::flash_bwd_dkdv_sm90_kernel<cuflash::bf16, {d}, {TILE}, {'true' if causal else 'false'}, true>"


CASES = {
    "dq_split_columns": ((), [_name(d, c) for d in (64, 128) for c in (False, True)]),
    "dq_split_keys": (("-DCUFLASH_SM90_BWD_DQ_KEY_SPLIT=1",), [_name(d, True) for d in (64, 128)]),
}


@pytest.mark.parametrize("variant", sorted(CASES))
def test_sm90_backward_draft_compiles_without_spills(variant):
    nvrtc = _nvrtc()
    extra, names = CASES[variant]
    text = _cuda.compile_source_for_nvrtc(SOURCE)
    assert_compiles_without_spills(nvrtc, text, names, _cuda.SM90A_OPTIONS + extra, "sm_90a",
                                   f"{SOURCE} ({variant})")


def test_sm90_backward_draft_is_marked_and_not_dispatched():
    text = _cuda.compile_source_for_nvrtc(SOURCE)
    assert '#include "' not in text
    assert "STATUS: draft, compiled but not yet run on a GPU; not dispatched" in text
    names = [name for _, name, _ in _cuda.instantiations()]
    assert not any("flash_bwd_dkdv_sm90_kernel" in n for n in names)
