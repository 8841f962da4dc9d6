"""The Hopper forward's V^T entry point (forward_sm90.cu's flash_fwd_sm90_vt_kernel) for element types whose wgmma
reads its B operand K-major only, so that P V needs V transposed:

- [fp8] e4m3 q, k, v (CuPy ``uint8`` arrays of e4m3 bits: CuPy has no e4m3 dtype), O in bfloat16, with the descale
  factors (FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale``: float32, one per (batch, key/value head),
  passed as one (3, batch, heads_kv) array);
- [tf32] float32 q, k, v with one TF32 product (``fp32_precision="tf32"``), O in float32
  (:data:`.attention.TF32_WGMMA`).

Each run first writes V^T, ``(batch, heads_kv, head_dim, keys_16)`` (keys rounded up to 16, zeros past them, each
group of keys in the P fragment's order: :data:`KEY_ORDER`) with transpose_v_kernel, then runs the kernel.

The same entry point also takes [f16x2]: float32 q, k, v with ``fp32_precision="fp16x3"``
(:data:`.attention.F16X2_WGMMA`), each split in two fp16 parts after a power of two (:func:`split_f16x2`), V read as
it is (fp16 wgmma reads it MN-major), three fp16 products a matrix product; O in float32."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np

from .._ops.variant import Variant, VariantArrays
from . import tensor_map
from .._ops.api import CallMemo
from .attention import (_c_strides, _element_strides, _mappable, _Plan, _tensor_map, _VariantArgs, call_context, cdiv,
                        i32, rows_map, shape_of, strides)
from .compile import PackedLaunch, check_smem, device_info
from .spec import FP8_HEAD_DIMS, TILES, TRANSPOSE_V_KEYS, VARIANT_POINTER_FIELDS, variant_type
from .spec import spec as kernel_spec

_LOG2E = 1.4426950408889634

# [vt p] Position p of each group of V^T's keys holds key KEY_ORDER[dtype][p] (hopper_tiles.cuh's vt_key: the P
# fragment's k = 4t + i holds the thread's own key 2t + (i & 1) + 8 (i >> 1) for e4m3, k = t (+ 4) key 2t (+ 1) for tf32).
KEY_ORDER = {"float8_e4m3fn": np.array([2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1) for p in range(16)], np.int64),
             "float32": np.array([2 * (p & 3) + (p >> 2) for p in range(8)], np.int64)}
# Per input dtype: (family, tile row's arch class, output dtype).
_KINDS = {"float8_e4m3fn": ("fwd_sm90_fp8", "sm90a_fp8", np.dtype(ml_dtypes.bfloat16)),
          "float32": ("fwd_sm90_tf32", "sm90a_tf32", np.dtype(np.float32)),
          "f16x2": ("fwd_sm90_f16x2", "sm90a_f16x2", np.dtype(np.float32))}
# [f16x2] The factor of the low parts of q and k (S's cross products, an accumulator of their own), and of v's.
F16X2_LO_SCALES = (2048.0, 2048.0, 1.0)


def f16x2_exponent(max_abs: float) -> int:
    """[f16x2] e of the power of two 2^e a tensor of largest magnitude ``max_abs`` is multiplied by before its split
    (hopper_tiles.cuh's f16x2_exponent): its largest scaled value below 2^14; 0 for zeros, NaN or infinity."""
    m = float(np.float32(max_abs))
    if not m > 0 or m == np.inf:
        return 0
    bits = int(np.float32(m).view(np.uint32))
    return min(max(14 - (max(bits >> 23, 1) - 126), -120), 120)


def split_f16x2(x, lo_scale: float):
    """[f16x2] The split of float32 ``x`` (batch, rows, heads, d) by CuPy's operations (the definition
    split_f16x2_kernel, which the plans run, is tested against): ``(pairs, e)``, ``pairs`` the C-contiguous float32
    array of x's shape whose rows hold x * 2^e's d fp16 high parts (rounded to nearest even) then its d low parts
    ((x * 2^e - high) * lo_scale, rounded), ``e`` from x's largest magnitude (:func:`f16x2_exponent`)."""
    import cupy

    e = f16x2_exponent(float(cupy.abs(x).max()))
    xs = x.astype(cupy.float32) * np.float32(2.0 ** e)
    hi = xs.astype(cupy.float16)
    lo = ((xs - hi.astype(cupy.float32)) * np.float32(lo_scale)).astype(cupy.float16)
    return cupy.ascontiguousarray(cupy.concatenate([hi, lo], axis=-1)).view(cupy.float32), e


def transposed_v(v, dtype: str = "float8_e4m3fn"):
    """V^T as the kernel reads it, by CuPy's operations (the definition transpose_v_kernel, which the plans run, is
    tested against): ``(batch, heads_kv, head_dim, keys_16)``, each group of keys in :data:`KEY_ORDER`'s order, zeros
    past the keys. ``v``: uint8 e4m3 bits (``dtype`` "float8_e4m3fn") or float32 ("float32", rounded to TF32: to
    nearest, ties away from zero)."""
    import cupy

    if dtype == "float32":
        v = ((v.view(cupy.uint32) + cupy.uint32(0x1000)) & cupy.uint32(0xFFFFE000)).view(cupy.float32)
    order = KEY_ORDER[dtype]
    b, n, h, d = v.shape
    n16 = -(-n // 16) * 16
    if n16 != n:
        v = cupy.concatenate([v, cupy.zeros((b, n16 - n, h, d), v.dtype)], axis=1)
    keys = cupy.asarray((np.arange(n16).reshape(-1, len(order))[:, order]).reshape(-1))
    return cupy.ascontiguousarray(v[:, keys].transpose(0, 2, 3, 1))


class VtForwardPlan(_Plan):
    """The V^T entry point's forward of one call's layouts (``dtype``: q's, "float8_e4m3fn" or "float32", or "f16x2":
    float32 split in fp16 parts): V^T's transpose (or [f16x2]'s split) and the kernel, their grids and packed
    arguments. :meth:`run` as :class:`.attention.ForwardPlan`'s, with the descale array (FP8) or None."""

    def __init__(self, q, k, v, *, scale: float, variant: Variant, dtype: str):
        super().__init__()
        shp = shape_of(q, k, variant)
        d = shp.head_dim
        family, arch, self.dtype = _KINDS[dtype]
        nbytes = np.dtype(q.dtype).itemsize
        assert v.shape[-1] == d and not variant.is_varlen and variant.seqused_k is None
        t = TILES[("fwd", arch, d)]
        spec = kernel_spec(family, "float32" if dtype == "f16x2" else dtype, d, t, variant_type(variant))
        check_smem(spec)
        self.out_shape, self.lse_shape = (*q.shape[:-1], d), (shp.batch, shp.heads_q, shp.rows_q)
        self._lse_size = int(np.prod(self.lse_shape))
        n16 = -(-shp.rows_k // 16) * 16
        b, hq, hkv = shp.batch, shp.heads_q, shp.heads_kv
        # V^T (C-contiguous (batch, heads_kv, d, keys_16)) read as (batch, rows d, heads, columns the keys)
        row = n16 * nbytes
        # [tf32 qk] float32 q and k read from C-contiguous copies rounded to TF32 by round_tf32_kernel
        self._rounds = ()
        if dtype == "float32":
            self._rounds = tuple(
                (a.shape, PackedLaunch(self._rt, kernel_spec("round_tf32", dtype, d),
                                       (cdiv(a.shape[1] * a.shape[2] * d // 4, 256), a.shape[0], 1),
                                       (None, None, i32(a.shape[1]), i32(a.shape[2]),
                                        *(np.int64(x) for x in a.strides[:3]))))
                for a in (q, k))
        self._write_rounds = tuple(launch.writer((launch.word(0), launch.word(1))) for _, launch in self._rounds)
        self._split = dtype == "f16x2"
        if self._split:  # [f16x2] q, k and v split into C-contiguous copies of pairs of parts, their maps
            self._setup_split(q, k, v)
        qk_maps = tuple(rows_map(a.shape, [x * nbytes for x in _c_strides(a.shape)], rows, nbytes) if self._rounds
                        or self._split else _tensor_map(a, rows) for a, rows in ((q, t.block_m), (k, t.block_n)))
        v_map = (rows_map(v.shape, [x * nbytes for x in _c_strides(v.shape)], t.block_n, nbytes) if self._split
                 else rows_map((b, d, hkv, n16), (hkv * d * row, row, d * row), d, nbytes))
        self._maps = (*qk_maps, v_map)
        # [fp8 v] V^T by transpose_v_kernel (v's strides: multiples of 16 bytes, the caller's check)
        self.vt_shape, self._vt_dtype = (b, hkv, d, n16), q.dtype
        self._transpose = None if self._split else PackedLaunch(self._rt, kernel_spec("transpose_v", dtype, d),
                                       (cdiv(n16, TRANSPOSE_V_KEYS[dtype]), hkv, b),
                                       (None, None, i32(shp.rows_k), i32(n16), i32(hkv),
                                        *(np.int64(s) for s in (v.strides[0], v.strides[1], v.strides[2]))))
        self._write_transpose = None if self._split else self._transpose.writer(
            (self._transpose.word(0), self._transpose.word(1)))
        self._variant = _VariantArgs(variant, scale, shp, spec)
        qk_strides = ((*_element_strides(q.shape), *_element_strides(k.shape)) if self._rounds or self._split
                      else (*strides(q), *strides(k)))
        args = (None, None, None, None, None, i32(shp.rows_q), i32(shp.rows_k), i32(hq), i32(shp.group),
                *qk_strides, *(np.int64(0),) * 3, *_element_strides(self.out_shape),
                np.float32(scale * _LOG2E), None, self._variant.params)
        self._launch = PackedLaunch(self._rt, spec, (cdiv(shp.max_q, t.block_m), hq, b), args,
                                    tuple(m.address for m in self._maps))
        vp = len(args) - 1  # (the descale pointer just before VariantParams)
        self._write = self._launch.writer(tuple(self._launch.word(i) for i in (0, 1, 2, 3, 4, vp - 1)))
        self._write_variant = None if self._variant.constant else self._launch.writer(
            tuple(self._launch.word(vp, offset) for offset in VARIANT_POINTER_FIELDS))

    def _setup_split(self, q, k, v) -> None:
        """[f16x2] The split's launches: the workspace of the three largest magnitudes' bits (zeroed at each run, then
        maxed by absmax_f32_kernel), and split_f16x2_kernel into one allocation of three pair arrays (C-contiguous,
        the inputs' shapes in float32 words), read from the inputs' strides."""
        import cupy

        d = q.shape[-1]
        self._memset = cupy.cuda.runtime.memsetAsync
        # (q's, k's, v's; 16 bytes) kept with the launches' counters; under a capture where no chunk has room, an
        # array of the plan's own
        self._max_bits = None
        self._max_bits_ptr = self._kept_counters(4)
        if self._max_bits_ptr is None:
            self._max_bits = self._zeros((4,), dtype=np.uint32)
            self._max_bits_ptr = self._max_bits.data.ptr
        self._pair_offsets, total = [], 0
        for a in (q, k, v):
            self._pair_offsets.append(4 * total)
            total += int(np.prod(a.shape))
        self._pair_words = total
        self._splits = []
        for i, a in enumerate((q, k, v)):
            vectors = a.shape[1] * a.shape[2] * d // 4  # (float4 of one batch)
            shape_args = (i32(a.shape[1]), i32(a.shape[2]), *(np.int64(x) for x in a.strides[:3]))
            bits = np.uint64(self._max_bits_ptr + 4 * i)
            absmax = PackedLaunch(self._rt, kernel_spec("absmax_f32", "float32", d),
                                  (max(1, min(cdiv(vectors, 256), 1024 // a.shape[0])), a.shape[0], 1),
                                  (None, bits, *shape_args))
            split = PackedLaunch(self._rt, kernel_spec("split_f16x2", "float32", d), (cdiv(vectors, 256), a.shape[0], 1),
                                 (None, None, bits, np.float32(F16X2_LO_SCALES[i]), *shape_args))
            self._splits.append((absmax, absmax.writer((absmax.word(0),)), split,
                                 split.writer((split.word(0), split.word(1)))))

    def _run_split(self, q, k, v, stream: int) -> tuple[int, int, int]:
        """[f16x2] The split's launches on ``stream`` (the caller holds the lock): the addresses of the pair arrays
        the kernel reads."""
        pairs = self._empty((self._pair_words,), dtype=np.float32)
        self._memset(self._max_bits_ptr, 0, 12, stream)
        for (absmax, write, _, _), a in zip(self._splits, (q, k, v)):
            write(a.data.ptr)
            absmax.run(stream)
        ptrs = tuple(pairs.data.ptr + offset for offset in self._pair_offsets)
        for (_, _, split, write), a, ptr in zip(self._splits, (q, k, v), ptrs):
            write(a.data.ptr, ptr)
            split.run(stream)
        return ptrs  # (pairs may be freed: the stream orders its memory's next use after the kernel)

    def flat_call(self):
        """None: the V^T entry point has no flat twin (cuflash.jax takes its buffer route)."""
        return None

    def run(self, q, k, v, arrays: VariantArrays = VariantArrays(), stream: int | None = None, lse: bool = True,
            out=None, lse_out=None, descale=None):
        """``(out, lse)`` (``lse`` False: ``(out, None)``, the lse still written), or None where an input's address
        is not a multiple of 16 bytes (the caller runs the call on an aligned copy)."""
        if (q.data.ptr | k.data.ptr | v.data.ptr) & 15:
            return None
        if threading.get_ident() not in self._threads:
            self._enter()
        if stream is None:
            stream = self._stream().ptr
        vt = None if self._split else self._empty(self.vt_shape, dtype=self._vt_dtype)
        if out is None:
            out = self._empty(self.out_shape, dtype=self.dtype)
        lse_array, lse_ptr = self._lse_target(lse, lse_out, stream)
        inputs = (q, k)
        if self._rounds:  # [tf32 qk] the kernel reads rounded copies
            q, k = (self._empty(shape, dtype=np.float32) for shape, _ in self._rounds)
        with self._lock:
            for (_, launch), write, src, dst in zip(self._rounds, self._write_rounds, inputs, (q, k)):
                write(src.data.ptr, dst.data.ptr)
                launch.run(stream)
            if self._split:  # [f16x2] the kernel reads the pairs, and the largest magnitudes' bits as its descale
                reads = self._run_split(q, k, v, stream)
                descale_ptr = self._max_bits_ptr
            else:
                self._write_transpose(v.data.ptr, vt.data.ptr)
                self._transpose.run(stream)
                reads = (q.data.ptr, k.data.ptr, vt.data.ptr)
                descale_ptr = 0 if descale is None else descale.data.ptr
            self._write(*reads, out.data.ptr, lse_ptr, descale_ptr)
            for m, ptr in zip(self._maps, reads):
                m.point(ptr)
            if self._write_variant is not None:
                self._write_variant(*self._variant.pointers(arrays))
            self._launch.run(stream)
        return out, lse_array


def supported() -> bool:
    """Whether this device runs the V^T entry point (the FP8 forward, [tf32]): sm_90 and a driver that encodes tensor
    maps."""
    return device_info()[0] == 90 and tensor_map.available()


def takes(q, k, v, variant: Variant) -> bool:
    """Whether the V^T entry point runs this call's layouts: :func:`supported`; padded batches (no key counts); q and
    k mappable (contiguous rows, strides of multiples of 16 bytes: v is read by the transpose with 16-byte loads
    too)."""
    return (supported() and not variant.is_varlen and variant.seqused_k is None and q.ndim == 4
            and _mappable((q, k, v)))


# Plans of recent calls, by everything a plan depends on but the arrays' addresses (a plan encodes no address but at a
# run; ALiBi's slopes are the run's too).
_PLANS = CallMemo(32)


def plan(q, k, v, scale: float, variant: Variant, dtype: str) -> VtForwardPlan:
    key = (*call_context(), dtype, q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, scale,
           variant_type(variant), variant.causal, variant.bottom_right, variant.window_left, variant.window_right,
           variant.softcap)
    found = _PLANS.get(key)
    if found is None:
        found = VtForwardPlan(q, k, v, scale=scale, variant=variant, dtype=dtype)
        _PLANS.put(key, found)
    return found


_ONES: dict = {}  # (device, batch, heads_kv) -> a float32 array of ones: the factor of a descale not given


def stacked_descale(descales, shape: tuple, stream: int | None = None):
    """The (3, batch, heads_kv) float32 array the kernel reads (q's, k's and v's factors; 1 for one not given), or
    None when none is given: a new array, each factor copied in by one device-to-device ``cudaMemcpyAsync`` on
    ``stream`` (the current one by default; a few microseconds of host time each, where stacking by array operations
    took ~100) where it is C-contiguous, by CuPy's stack otherwise."""
    import cupy

    if all(a is None for a in descales):
        return None
    if not all(a is None or a.flags.c_contiguous for a in descales):
        return cupy.stack([cupy.ones(shape, np.float32) if a is None else a for a in descales])
    device = cupy.cuda.runtime.getDevice()
    ones = _ONES.get((device, *shape))
    if ones is None and any(a is None for a in descales):
        ones = _ONES[(device, *shape)] = cupy.ones(shape, np.float32)
    out = cupy.empty((3, *shape), np.float32)
    nbytes = out.nbytes // 3
    if stream is None:
        stream = cupy.cuda.get_current_stream().ptr
    for i, a in enumerate(descales):
        cupy.cuda.runtime.memcpyAsync(out.data.ptr + i * nbytes, (ones if a is None else a).data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice, stream)
    return out


def _require_supported():
    if not supported():
        raise NotImplementedError(
            "FP8 (float8_e4m3fn) attention runs on sm_90 GPUs (H100, H200) with a driver that encodes tensor maps; "
            f"this device is sm_{device_info()[0]}")


def plan_fp8(q, k, v, *, scale: float, variant: Variant) -> VtForwardPlan | None:
    """The FP8 plan of arrays the kernel reads as they are (mappable strides; the front door remembers it with the
    call), or None (:func:`forward_fp8` runs such a call on copies)."""
    _require_supported()
    return plan(q, k, v, scale, variant, "float8_e4m3fn") if _mappable((q, k, v)) else None


def forward_fp8(q, k, v, *, scale: float, variant: Variant, descale=None):
    """``(out, lse)`` of the FP8 forward (the caller validated the call: :func:`cuflash._ops.api.attention`'s FP8
    path); ``descale``: a C-contiguous float32 (3, batch, heads_kv) CuPy array or None."""
    import cupy

    _require_supported()
    q, k, v = (a if _mappable((a,)) and a.data.ptr % 16 == 0 else cupy.ascontiguousarray(a) for a in (q, k, v))
    return plan(q, k, v, scale, variant, "float8_e4m3fn").run(q, k, v, variant.arrays, descale=descale)


__all__ = ["FP8_HEAD_DIMS", "KEY_ORDER", "VtForwardPlan", "forward_fp8", "plan", "plan_fp8", "stacked_descale",
           "supported", "takes", "transposed_v"]
