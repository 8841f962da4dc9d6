"""The plan/run split of decoding with a KV cache: :func:`cuflash.plan_kvcache` makes a :class:`DecodePlan`.

A served model repeats one decode call every step with the same shapes: only the arrays' contents change (the new
token's q, k, v; the cache lengths; maybe the block table). Everything else, validation included, can be done
once. A plan is made from the first step's arguments (checked as :func:`cuflash.attention_with_kvcache` checks
them); :meth:`DecodePlan.run` takes the arrays of each step, compares their layouts with the plan's and launches
(CuPy: :class:`cuflash._cuda.decode.DecodeLaunch`, a few microseconds of host time; NumPy: the reference, with
every check, so that a program can use one API on both).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .kvcache import uniform_seqlens

__all__ = ["DecodePlan"]

# The arrays of a step, in the order of DecodeLaunch.run's arguments.
_ARRAYS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table",
           "alibi_slopes", "rotary_cos", "rotary_sin")


def _layout(a):
    """What a plan fixes about an array: its type, shape, strides and dtype (None: not given)."""
    return None if a is None else (type(a), a.shape, a.strides, a.dtype)


def _spell(layout) -> str:
    kind, shape, strides, dtype = layout
    return (f"a {kind.__module__.split('.')[0]}.{kind.__name__} of shape {tuple(shape)}, strides {tuple(strides)} "
            f"and dtype {np.dtype(dtype).name}")


class DecodePlan:
    """One decode call planned for its shapes, strides, dtype and options; :meth:`run` it every step.

    Made by :func:`cuflash.plan_kvcache` (which takes :func:`cuflash.attention_with_kvcache`'s arguments). On CuPy
    arrays the plan holds the compiled kernels, their grids, the split count, a float32 workspace for the splits'
    partial results and the kernels' parameter record; a step writes the arrays' addresses into the record and
    launches, with no allocation (given ``out`` and ``lse``), no host synchronization and no other host work, so it
    can be captured in a CUDA graph (CuPy's stream capture, ``torch.cuda.CUDAGraph``). The workspace serves one step
    at a time: run a plan on one stream, or make one plan per stream.

    Attributes
    ----------
    out_shape, lse_shape : tuple
        ``(batch, seqlen_q, heads_q, head_dim_v)`` and ``(batch, heads_q, seqlen_q)``.
    out_dtype, lse_dtype : numpy.dtype
        q's dtype, and float32 (float64 for float64 inputs).
    num_splits : int
        The parts each sequence's keys are split into (after the automatic choice; 1: no merge).
    """

    def __init__(self, layouts: tuple, runner: Callable, *, out_layout, lse_layout, num_splits: int, xp,
                 checker: Callable | None = None, launch=None):
        self._layouts = layouts
        self._runner = runner
        self._checker = checker
        self._out_layout, self._lse_layout = out_layout, lse_layout
        self._out_contiguous = out_layout[2] == _contiguous(out_layout[1], np.dtype(out_layout[3]).itemsize)
        self._xp = xp
        self.out_shape, self.out_dtype = out_layout[1], np.dtype(out_layout[3])
        self.lse_shape, self.lse_dtype = lse_layout[1], np.dtype(lse_layout[3])
        self.num_splits = num_splits
        # A CUDA launch (cuflash._cuda.decode.DecodeLaunch) compares the step's layouts itself, only those of arrays
        # that are not the very objects of the step before, and calls _check to name a mismatch; otherwise (the
        # NumPy reference, or the debug mode's checks of device values) every step is checked here.
        self._check_each_step = launch is None or checker is not None
        if launch is not None and checker is None:
            launch.expect(layouts, out_layout, lse_layout, self._check)

    def run(self, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, cache_leftpad=None, cache_batch_idx=None,
            block_table=None, alibi_slopes=None, rotary_cos=None, rotary_sin=None, out=None, lse=None):
        """One decode step: ``(out, lse)``, appending ``k`` and ``v`` into the caches first (in place).

        The arguments are those of :func:`cuflash.attention_with_kvcache`, each with the shape, strides and dtype
        it had when the plan was made (given or not as then); their values are the step's. ``cache_seqlens`` may
        also be an int (converted to an array: an allocation). ``out`` ``(batch, seqlen_q, heads_q, head_dim_v)``
        and ``lse`` ``(batch, heads_q, seqlen_q)`` (contiguous, float32) receive the results when given, else are
        allocated. As for :func:`cuflash.attention_with_kvcache`, the values of CuPy index arrays are not read
        (``CUFLASH_CHECK_DEVICE_VALUES=1`` when the plan is made: every step checks them, with a synchronization).
        On CuPy, a step compares the layouts of only those arrays that are not the very objects of the step before
        (a CuPy array's memory, strides and dtype cannot change; its shape only by an in-place reshape of the same
        memory, ``a.shape = ...``, which the step reads as planned) and writes only their addresses: the same
        arrays every step only launch; a model's new q, k, v cost three comparisons.
        """
        if type(cache_seqlens) is int:
            cache_seqlens = uniform_seqlens(self._xp, self.lse_shape[0], cache_seqlens)
        if self._check_each_step:
            self._check(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                        alibi_slopes, rotary_cos, rotary_sin, out, lse)
        return self._runner(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                            alibi_slopes, rotary_cos, rotary_sin, out, lse)

    def _check(self, *arrays) -> None:
        """A step's arrays (in :data:`_ARRAYS` order, then out and lse) against the plan's layouts."""
        *arrays, out, lse = arrays
        if tuple(map(_layout, arrays)) != self._layouts:
            self._refuse(arrays)
        if out is None:
            if not self._out_contiguous:
                raise ValueError(f"out must be given: the plan was made with an out of strides {self._out_layout[2]}; "
                                 f"got None")
        elif _layout(out) != self._out_layout:
            raise ValueError(f"out must be {_spell(self._out_layout)} as when the plan was made; got "
                             f"{_spell(_layout(out))}")
        if lse is not None and _layout(lse) != self._lse_layout:
            raise ValueError(f"lse must be {_spell(self._lse_layout)} (contiguous); got {_spell(_layout(lse))}")
        if self._checker is not None:
            self._checker(*arrays)

    def _refuse(self, arrays) -> None:
        for name, a, planned in zip(_ARRAYS, arrays, self._layouts):
            got = _layout(a)
            if got == planned:
                continue
            if planned is None:
                raise ValueError(f"{name} was not given when the plan was made; got {_spell(got)} (make a plan with "
                                 f"it: cuflash.plan_kvcache)")
            if got is None:
                raise ValueError(f"{name} was given when the plan was made, so every step needs it; got None")
            raise ValueError(f"{name} must be {_spell(planned)} as when the plan was made (a plan is for one "
                             f"layout: make another with cuflash.plan_kvcache); got {_spell(got)}")


def _contiguous(shape, itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def layouts_of(*arrays) -> tuple:
    """The layouts of a step's arrays (in :data:`_ARRAYS` order), as a plan records them."""
    return tuple(map(_layout, arrays))


def contiguous_layout(xp, shape, dtype):
    """The layout of a C-contiguous array of ``xp`` with this shape and dtype (what run allocates)."""
    dtype = np.dtype(dtype)
    return (xp.ndarray, tuple(shape), _contiguous(shape, dtype.itemsize), dtype)
