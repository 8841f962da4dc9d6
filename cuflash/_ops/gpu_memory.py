"""Device memory helpers: the peak of a piece of CuPy work (a CuPy memory hook), and per-stream scratch buffers.

Peak: 
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


class StreamSinks:
    """Buffers written by launches and never read (an lse that no caller asked for), one per key (a device and a
    stream), each grown to the largest asked for, so that such a launch allocates nothing. The launches that write one
    are ordered by its stream; one freed when it grows returns to its allocator's pool for that stream. At most
    ``size`` keys (the oldest dropped). The allocator (CuPy's, torch's) is the caller's."""

    def __init__(self, size: int = 16):
        self.size = size
        self._sinks: dict = {}  # key -> (buffer, elements, address)

    def address(self, key, count: int, allocate) -> int:
        """The address of ``key``'s buffer of at least ``count`` elements; ``allocate(key, count)`` gives ``(buffer,
        address)`` for a new one."""
        entry = self._sinks.get(key)
        if entry is None or entry[1] < count:
            if entry is None and len(self._sinks) >= self.size:
                self._sinks.pop(next(iter(self._sinks), None), None)
            buffer, ptr = allocate(key, count)
            entry = self._sinks[key] = (buffer, count, ptr)
        return entry[2]

    def buffer(self, key):
        """``key``'s buffer, or None."""
        entry = self._sinks.get(key)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._sinks)
