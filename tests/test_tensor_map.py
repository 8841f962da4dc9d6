"""The TMA descriptors of the MLA decode kernel (cuflash._cuda.tensor_map) and when the launcher uses them, on the
CPU (the GPU tests in test_cuda_decode.py run the kernel's TMA copies against its cp.async ones and the truth)."""

from __future__ import annotations

import pytest


def test_tensor_maps_and_when_the_mla_kernel_copies_by_tma(monkeypatch):
    """(CPU) A TensorMap's 128 bytes are 64-byte aligned (cuTensorMapEncodeTiled's requirement), an unused one is
    never encoded; the MLA kernel copies by TMA only where every 64-key tile lies whole in one page or the contiguous
    cache's row (no append, no left padding, pages of a multiple of 64), the switch is on and the driver encodes
    maps."""
    import types

    from cuflash._cuda import decode, spec, tensor_map

    unused = tensor_map.TensorMap(None)
    assert unused.address % 64 == 0 and unused.words.nbytes == 128 and not unused.mapped
    unused.point(0x1000)  # (no driver call: nothing to encode)
    mapped = tensor_map.TensorMap((576, 64, 10), (1152, 73728), (64, 64, 1))
    assert mapped.mapped and mapped.address % 64 == 0
    with pytest.raises(AssertionError):
        tensor_map.TensorMap((576, 64, 10), (1152, 73730), (64, 64, 1))  # (strides of multiples of 16 bytes)

    monkeypatch.setattr(tensor_map, "available", lambda: True)

    def fits(seqlen_new=0, leftpad=None, page=64, switch=True):
        monkeypatch.setattr(spec, "TMA_DECODE", switch)
        cache = types.SimpleNamespace(seqlen_new=seqlen_new, cache_leftpad=leftpad)
        k_cache = types.SimpleNamespace(shape=(8, page or 700, 1, 576))
        return decode._tma_tiles(cache, k_cache, paged=page is not None)

    assert fits() and fits(page=128) and fits(page=None)
    assert not fits(seqlen_new=1) and not fits(leftpad=object()) and not fits(page=16) and not fits(switch=False)
    monkeypatch.setattr(tensor_map, "available", lambda: False)
    assert not fits()
