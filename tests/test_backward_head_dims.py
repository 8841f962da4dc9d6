"""Which backward kernels a 16-bit call runs at each head dim, on the CPU (a stand-in CuPy records the launches):
the tensor-core dK/dV kernels at 32..128 and, where the GPU has tiles for them, 192 and 256 (head dims between read
in place on the next one); the float32 kernels on upcast copies elsewhere; FA1 keeps its own head dims."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash._cuda import attention, compile, spec, tuning

from _fake_cupy import install
from conftest import gpu_skip_reason


@pytest.fixture
def fake(monkeypatch):
    gpu_skip_reason()  # (decided before the stand-in is in sys.modules)
    return install(monkeypatch)


SMEM = {90: 227 * 1024, 80: 163 * 1024, 86: 99 * 1024, 120: 99 * 1024}


@pytest.mark.parametrize(("cc", "wide"), [(90, (192, 256)), (80, (192,)), (86, ()), (120, ())])
def test_each_gpu_runs_the_backward_head_dims_it_has_tiles_for(cc, wide):
    """(sm_120: the sm90 class's rows, which need more than its 99 KiB of shared memory above 128)"""
    assert attention.bwd_head_dims(cc, SMEM[cc]) == (32, 64, 96, 128, *wide)


def test_a_tuned_table_adds_a_head_dim_with_both_its_tiles(monkeypatch):
    tuned = {("bwd", 192): spec.Tile(32, 32, 2, 2)}
    monkeypatch.setattr(tuning, "tile_for", lambda direction, d: tuned.get((direction, d)))
    assert 192 not in attention.bwd_head_dims(86, SMEM[86])  # (its dQ pass has no tile)
    tuned[("bwd_dq", 192)] = spec.Tile(32, 32, 2, 2)
    assert attention.bwd_head_dims(86, SMEM[86]) == (32, 64, 96, 128, 192)


def _kernels(recorder):
    return [launch[0].split("<")[0].removeprefix("cuflash::") for launch in recorder.take()]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (the upcast path casts uninitialized memory)
@pytest.mark.parametrize(("cc", "d", "kernel"), [
    (90, 256, "flash_bwd_dkdv_sm90_kernel"), (90, 200, "flash_bwd_dkdv_kernel"), (90, 160, "flash_bwd_dkdv_kernel"),
    (80, 192, "flash_bwd_dkdv_kernel"), (80, 256, "flash_bwd_dkdv_f32_kernel"), (86, 192, "flash_bwd_dkdv_f32_kernel"),
    (120, 256, "flash_bwd_dkdv_f32_kernel"),
    (90, 128, "flash_bwd_dkdv_sm90_kernel")])  # (no driver to encode maps: not its TMA entry point)
def test_the_16_bit_backward_runs_the_tensor_core_kernels_where_it_can(fake, monkeypatch, cc, d, kernel):
    """The dK/dV launch of a bf16 backward (causal, GQA) by compute capability and head dim (sm_90's d 256: the wgmma
    kernel, [bwd shared keys]); at 160 and 200 the launch names the next head dim's mma.sync kernel (192, 256: no
    driver here to encode the TMA entry point's maps, which a padded head dim needs) and its VariantParams the
    arrays' head dims."""
    cp, recorder = fake
    monkeypatch.setitem(compile._device_cache, 0, (cc, SMEM[cc]))
    rng = np.random.default_rng(d)

    def arr(*shape, dtype=ml_dtypes.bfloat16):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    q, do, out = arr(1, 96, 4, d), arr(1, 96, 4, d), arr(1, 96, 4, d)
    k, v = arr(1, 96, 2, d), arr(1, 96, 2, d)
    lse = arr(1, 4, 96, dtype=np.float32)
    recorder.take()
    cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    dkdv = [name for name in _kernels(recorder) if "dkdv" in name]
    assert dkdv == [kernel], dkdv
    if kernel == "flash_bwd_dkdv_kernel":
        kd = next(x for x in attention.bwd_head_dims(cc, SMEM[cc]) if x >= d)
        cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
        launch = next(lc for lc in recorder.take() if "dkdv" in lc[0])
        assert launch[0].startswith(f"cuflash::flash_bwd_dkdv_kernel<cuflash::bf16, {kd}, ")
    # FA1 keeps its head dims: above 128 its float32 kernels
    if d > 128:
        cuflash.attention_backward(do, q, k, v, out, lse, causal=True, algorithm="fa1")
        assert not any(name.startswith("flash_bwd_dkdv_kernel") for name in _kernels(recorder))
