"""The FP8 forward (forward_sm90.cu's [fp8]: flash_fwd_sm90_fp8_kernel) on CuPy arrays of e4m3 (ml_dtypes'
``float8_e4m3fn``): q and k read as they are through tensor maps; v first written transposed (``(batch, heads_kv,
head_dim, keys)``, keys in :data:`KEY_ORDER` inside every 16, zeros past the last key), because an 8-bit wgmma reads
its B operand K-major only; O in bfloat16. The descale factors (FlashAttention-3's ``q_descale``, ``k_descale``,
``v_descale``: float32, one per (batch, key/value head)) reach the kernel as one (3, batch, heads_kv) array."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np

from .._variant import Variant, VariantArrays
from . import tensor_map
from .attention import _element_strides, _mappable, _Plan, _VariantArgs, cdiv, i32, shape_of, strides
from .compile import PackedLaunch, check_smem, device_info
from .spec import FP8_HEAD_DIMS, TILES, VARIANT_POINTER_FIELDS, variant_type
from .spec import spec as kernel_spec

_LOG2E = 1.4426950408889634
_BF16 = np.dtype(ml_dtypes.bfloat16)

# [fp8 p] Position p of each 16 keys of V^T holds key KEY_ORDER[p] (hopper_tiles.cuh's p_to_e4m3: the A fragment's
# k = 4t + i holds the thread's own key 2t + (i & 1) + 8 (i >> 1)).
KEY_ORDER = np.array([2 * (p // 4) + (p % 4 & 1) + 8 * (p % 4 >> 1) for p in range(16)], np.int64)


def transposed_v(v):
    """V^T as the kernel reads it: ``(batch, heads_kv, head_dim, keys_16)`` bytes, ``keys_16`` the keys rounded up to a
    multiple of 16 (zeros past them), each 16 in :data:`KEY_ORDER`: CuPy's operations, the definition that
    fp8_transpose_v_kernel (what the plans run) is tested against."""
    import cupy

    b, n, h, d = v.shape
    n16 = -(-n // 16) * 16
    raw = v.view(cupy.uint8)
    if n16 != n:
        raw = cupy.concatenate([raw, cupy.zeros((b, n16 - n, h, d), cupy.uint8)], axis=1)
    order = cupy.asarray((np.arange(n16).reshape(-1, 16)[:, KEY_ORDER]).reshape(-1))
    return cupy.ascontiguousarray(raw[:, order].transpose(0, 2, 3, 1))


def _map(dims, byte_strides, box):
    """A 4-d byte map (dims innermost first; an axis of one element is never stepped along: its stride given as 16)."""
    steps = tuple(s if n > 1 else 16 for n, s in zip(dims[1:], byte_strides))
    return tensor_map.TensorMap(dims, steps, box, element_bytes=1)


class Fp8ForwardPlan(_Plan):
    """The FP8 forward of one call's layouts: its kernel, grid and packed arguments; :meth:`run` takes q, k, v (e4m3)
    and the descale array (or None) and returns ``(out, lse)``, out bfloat16."""

    def __init__(self, q, k, v, *, scale: float, variant: Variant):
        super().__init__()
        shp = shape_of(q, k, variant)
        d = shp.head_dim
        assert d in FP8_HEAD_DIMS and v.shape[-1] == d and not variant.is_varlen and variant.seqused_k is None
        t = TILES[("fwd", "sm90a_fp8", d)]
        spec = kernel_spec("fwd_sm90_fp8", "float8_e4m3fn", d, t, variant_type(variant))
        check_smem(spec)
        self.out_shape, self.lse_shape = (*q.shape[:-1], d), (shp.batch, shp.heads_q, shp.rows_q)
        n16 = -(-shp.rows_k // 16) * 16
        b, hq, hkv = shp.batch, shp.heads_q, shp.heads_kv

        def qk_map(a, rows):  # (batch, rows, heads, d): columns d, then rows, heads, batch
            return _map((d, a.shape[1], a.shape[2], b), (a.strides[1], a.strides[2], a.strides[0]), (128, rows, 1, 1))

        # V^T (transposed_v, C-contiguous (batch, heads_kv, d, keys_16)): columns the keys, then rows d, heads, batch
        self._maps = (qk_map(q, t.block_m), qk_map(k, t.block_n),
                      _map((n16, d, hkv, b), (n16, d * n16, hkv * d * n16), (128, d, 1, 1)))
        # [fp8 v] V^T by fp8_transpose_v_kernel (v's strides: multiples of 16 bytes, the caller's check)
        self.vt_shape = (b, hkv, d, n16)
        self._transpose = PackedLaunch(self._rt, kernel_spec("fp8_transpose_v", "float8_e4m3fn", d),
                                       (cdiv(n16, 64), hkv, b), (None, None, i32(shp.rows_k), i32(n16), i32(hkv),
                                                                 *(np.int64(s) for s in (v.strides[0], v.strides[1],
                                                                                         v.strides[2]))))
        self._write_transpose = self._transpose.writer((self._transpose.word(0), self._transpose.word(1)))
        self._variant = _VariantArgs(variant, scale, shp, spec)
        args = (None, None, None, None, None, i32(shp.rows_q), i32(shp.rows_k), i32(hq), i32(shp.group),
                *strides(q), *strides(k), *(np.int64(0),) * 3, *_element_strides(self.out_shape),
                np.float32(scale * _LOG2E), None, self._variant.params)
        self._launch = PackedLaunch(self._rt, spec, (cdiv(shp.max_q, t.block_m), hq, b), args,
                                    tuple(m.address for m in self._maps))
        vp = len(args) - 1  # (the descale pointer just before VariantParams)
        self._write = self._launch.writer(tuple(self._launch.word(i) for i in (0, 1, 2, 3, 4, vp - 1)))
        self._write_variant = None if self._variant.constant else self._launch.writer(
            tuple(self._launch.word(vp, offset) for offset in VARIANT_POINTER_FIELDS))

    def run(self, q, k, v, descale, arrays: VariantArrays = VariantArrays()):
        if threading.get_ident() not in self._threads:
            self._enter()
        vt = self._empty(self.vt_shape, dtype=np.uint8)
        out = self._empty(self.out_shape, dtype=_BF16)
        lse = self._empty(self.lse_shape, dtype=np.float32)
        stream = self._stream().ptr
        with self._lock:
            self._write_transpose(v.data.ptr, vt.data.ptr)
            self._transpose.run(stream)
            self._write(q.data.ptr, k.data.ptr, vt.data.ptr, out.data.ptr, lse.data.ptr,
                        0 if descale is None else descale.data.ptr)
            for m, ptr in zip(self._maps, (q.data.ptr, k.data.ptr, vt.data.ptr)):
                m.point(ptr)
            if self._write_variant is not None:
                self._write_variant(*self._variant.pointers(arrays))
            self._launch.run(stream)
        return out, lse


def supported() -> bool:
    """Whether this device runs the FP8 forward: sm_90 and a driver that encodes tensor maps."""
    return device_info()[0] == 90 and tensor_map.available()


# Plans of recent calls, by everything a plan depends on but the arrays' addresses (a plan encodes no address but at a
# run; ALiBi's slopes are the run's too), at most _PLANS_SIZE.
_PLANS: dict = {}
_PLANS_SIZE = 32


def _plan(q, k, v, scale: float, variant: Variant) -> Fp8ForwardPlan:
    from .attention import call_context

    key = (*call_context(), q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, scale, variant_type(variant),
           variant.causal, variant.bottom_right, variant.window_left, variant.window_right, variant.softcap)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_SIZE:
            _PLANS.pop(next(iter(_PLANS)))
        plan = _PLANS[key] = Fp8ForwardPlan(q, k, v, scale=scale, variant=variant)
    return plan


def forward(q, k, v, *, scale: float, variant: Variant, descale=None):
    """``(out, lse)`` of the FP8 forward (the caller validated the call: :func:`cuflash._api.attention`'s FP8 path);
    ``descale``: a C-contiguous float32 (3, batch, heads_kv) CuPy array or None."""
    import cupy

    if not supported():
        raise NotImplementedError(
            "FP8 (float8_e4m3fn) attention runs on sm_90 GPUs (H100, H200) with a driver that encodes tensor maps; "
            f"this device is sm_{device_info()[0]}")
    q, k, v = (a if _mappable((a,)) and a.data.ptr % 16 == 0 else cupy.ascontiguousarray(a) for a in (q, k, v))
    return _plan(q, k, v, scale, variant).run(q, k, v, descale, variant.arrays)
