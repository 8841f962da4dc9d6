"""Device memory helpers: the peak of a piece of CuPy work (a CuPy memory hook), per-stream scratch buffers and the
launches' counters (both never freed: CUDA graphs keep their addresses).

Peak: 
CuPy's pool keeps freed blocks and splits its chunks, so the growth of the pool during a call misses
allocations that fit in blocks it already held. A memory hook sees every allocation from the pool and
every return to it: the running sum of their sizes is the memory the work holds, and its maximum is the
peak. Used by ``python -m cuflash demo`` and the GPU benchmark.
"""

from __future__ import annotations

import threading


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


def stream_owner(stream: int) -> int | None:
    """The thread whose stream a stream handle is where that handle is CUDA's per-thread default stream (2: one
    handle, a stream per thread, whose launches can overlap another thread's), else None: what keys a plan or launch
    with a workspace (a tile counter, split partials) besides the handle, so that each such stream gets its own."""
    return threading.get_ident() if stream == 2 else None


class StreamSinks:
    """Buffers written by launches and never read (an lse that no caller asked for), one per key (a device and a
    stream), each grown to the largest asked for, so that such a launch allocates nothing. The launches that write one
    are ordered by its stream. A buffer is never freed: one that a grown or newer one replaces is kept, since a CUDA
    graph that captured a launch writing it goes on writing its address at every replay (growth at least doubles, so
    what is kept stays below twice what is in use). At most ``size`` keys in use (the oldest retired, kept as well).
    ``allocate`` is the caller's (device memory of its own outside a capture: see ``CupyRuntime.kept``)."""

    def __init__(self, size: int = 16):
        self.size = size
        self._sinks: dict = {}  # key -> (buffer, elements, address)
        self._made: list = []   # every buffer ever made: kept, never freed (also when two threads grow one key at once)

    def address(self, key, count: int, allocate) -> int:
        """The address of ``key``'s buffer of at least ``count`` elements; ``allocate(key, count)`` gives ``(buffer,
        address)`` for a new one."""
        entry = self._sinks.get(key)
        if entry is None or entry[1] < count:
            if entry is None and len(self._sinks) >= self.size:
                self._sinks.pop(next(iter(self._sinks), None), None)
            if entry is not None:
                count = max(count, 2 * entry[1])
            buffer, ptr = allocate(key, count)
            self._made.append(buffer)
            entry = self._sinks[key] = (buffer, count, ptr)
        return entry[2]

    def buffer(self, key):
        """``key``'s buffer, or None."""
        entry = self._sinks.get(key)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._sinks)


class CounterArena:
    """Zeroed int32 counters that launches use and leave at zero (the persistent forward's tile counter), taken from
    device chunks that are never freed: a CUDA graph that captured a launch reads its counter's address at every
    replay, whatever becomes of the plan that took it (the front door's memory drops plans). A chunk is zeroed and
    the stream synchronized before any counter of it is handed out, so it is zero for every stream; none is made
    during a CUDA graph capture (the caller plans without a counter then)."""

    def __init__(self, chunk: int = 4096):
        self.chunk = chunk
        self._chunks: dict = {}   # device -> [array, counters handed out]
        self._kept: list = []     # every chunk ever made
        self._lock = threading.Lock()

    def take(self, device: int, count: int, zeros, synchronize, grow: bool = True) -> int | None:
        """The address of ``count`` zeroed int32 counters on ``device``, the current one: ``zeros(n)`` makes a zeroed
        int32 device array of ``n`` there, ``synchronize()`` waits for the current stream. None where the current
        chunk is used up and ``grow`` is False (a CUDA graph capture: no chunk can be made and zeroed then). The
        chunk is made outside the lock (its synchronize must not hold up other threads' plans)."""
        with self._lock:
            ptr = self._slot(device, count)
        if ptr is not None or not grow:
            return ptr
        array = zeros(max(self.chunk, count))
        synchronize()
        with self._lock:
            self._kept.append(array)
            ptr = self._slot(device, count)  # (another thread's new chunk meanwhile: this one stays spare)
            if ptr is None:
                self._chunks[device] = [array, 0]
                ptr = self._slot(device, count)
            return ptr

    def _slot(self, device: int, count: int) -> int | None:
        entry = self._chunks.get(device)
        if entry is None or entry[1] + count > entry[0].size:
            return None
        ptr = int(entry[0].data.ptr) + 4 * entry[1]
        entry[1] += count
        return ptr
