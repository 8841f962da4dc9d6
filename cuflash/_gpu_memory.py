"""Peak device memory of a piece of CuPy work, measured by a CuPy memory hook.

CuPy's pool keeps freed blocks and splits its chunks, so the growth of the pool during a call misses
allocations that fit in blocks it already held. A memory hook sees every allocation from the pool and
every return to it: the running sum of their sizes is the memory the work holds, and its maximum is the
peak. Used by ``python -m cuflash demo`` and the GPU benchmark.
"""

from __future__ import annotations


def peak_bytes(fn):
    """``(result, peak)``: ``fn()``'s result and the most bytes it held at once beyond what was held before.

    Sizes are the pool's rounded block sizes. Memory freed during the call that was allocated before it
    lowers the running sum, so the peak counts what the call itself added.
    """
    import cupy

    class _Peak(cupy.cuda.MemoryHook):
        name = "cuflash-peak"

        def __init__(self):
            super().__init__()
            self.live = 0
            self.peak = 0

        def malloc_postprocess(self, **kwargs):
            self.live += kwargs["mem_size"]
            self.peak = max(self.peak, self.live)

        def free_postprocess(self, **kwargs):
            self.live -= kwargs["mem_size"]

    hook = _Peak()
    with hook:
        result = fn()
        cupy.cuda.Device().synchronize()
    return result, hook.peak
