"""The CuPy backend: CUDA kernels compiled at run time by NVRTC.

Implements the backend interface of ``docs/architecture.md``::

    forward(q, k, v, *, scale, variant, algorithm, block_q, block_k, fp32_precision) -> (out, lse)
    backward(do, q, k, v, out, lse, *, scale, variant, algorithm, block_q, block_k, order) -> (dq, dk, dv)
    check_supported(problem, algorithm, variant)
    forward_kvcache(q, k_cache, v_cache, k, v, *, cache, scale, variant, out=None) -> (out, lse)
    plan_kvcache(q, k_cache, v_cache, k, v, *, cache, scale, variant, out=None) -> a launch with .run(...)
    plan_forward(q, k, v, *, scale, variant, algorithm, block_q, block_k, fp32_precision) -> a plan with .run(q, k, v, arrays), or None
    plan_backward(do, q, k, v, out, lse, *, scale, variant, algorithm, block_q, block_k, order) -> the same, or None
    call_context() -> what decides a plan besides the arguments (device, stream)

Layers, one module each:

- :mod:`.spec`: one :class:`KernelSpec` per kernel instantiation (family, dtype, head dim, tile, variant
  policy); its name expression, NVRTC options and shared memory derive from it; the tuned tile table
  :data:`TILES`; the variant's C++ policy type and runtime ``VariantParams``; the list CI compiles.
- :mod:`.compile`: NVRTC through ``cupy.RawModule``, the module cache, device properties, launches.
- :mod:`.attention`: FlashAttention-2 planning (which spec, grid and arguments) for every variant.
- :mod:`.fa1`, :mod:`.naive`: the FA1-order kernels and the materialized CuPy computation (dense, causal).
- :mod:`.decode`: decoding with a KV cache (``decode.cu``: append, split-KV attention, merge), planned once per
  shape and launched through the driver at every step.

Paths:
- float16 / bfloat16, head dim 32, 64, 96, 128, 160, 192, 224, 256 (backward up to 128): tensor-core kernels
  (``mma.sync``), sm_80 or newer. Backward above head dim 128 runs the float32 path on upcast inputs.
  On sm_90 (H100/H200) the forward and the backward's dK/dV(+dQ) kernel at head dim 64 and 128 run the
  Hopper kernels (``forward_sm90.cu``, ``backward_sm90.cu``: ``wgmma``, compiled for sm_90a) instead,
  unless the caller chooses block sizes.
- float32: the forward runs ``flash_fwd_kernel`` on TF32 fragments (``tf32_tiles.cuh``: 3xTF32 by default,
  float32 accuracy; one TF32 product with ``fp32_precision="tf32"``) on sm_80 or newer at head dims up to 128;
  elsewhere, with ``fp32_precision="ieee"``, and in the backward, plain SIMT float32 kernels (no tensor cores;
  key/value tiles through shared memory).
- ``algorithm="naive"``: the materialized reference computation with CuPy matmuls (O(N^2) memory).
- ``algorithm="fa1"``: FlashAttention-1 kernels (``fa1.cu``): one thread block per (batch, head),
  key/value tiles outer, the running O, m, l (forward) and dQ (backward) read-modify-written in float32
  global memory at every step.

Backward orders: ``"kv_outer"`` (default) is FlashAttention-2's: key/value tiles outer, dQ accumulated in a
float32 workspace with atomics. ``"split"`` (deterministic) and ``"q_outer"`` run two passes: dK/dV with
key/value tiles outer, then dQ with query tiles outer; no atomics, bitwise reproducible. GQA/MQA: dK and dV
are computed per query head into a float32 workspace and summed over each group in a fixed order.
"""

from __future__ import annotations

from . import attention
from .attention import backward, call_context, check_supported, forward, plan_backward, plan_forward
from .compile import compile_source_for_nvrtc
from .decode import forward_kvcache, plan_kvcache
from .spec import BWD_HEAD_DIMS, HEAD_DIMS, NVRTC_OPTIONS, SM90A_OPTIONS, TILES, KernelSpec, Tile, instantiations

__all__ = [
    "forward", "backward", "check_supported", "plan_forward", "plan_backward", "call_context", "forward_kvcache", "plan_kvcache", "instantiations",
    "compile_source_for_nvrtc", "attention",
    "KernelSpec", "Tile", "TILES", "HEAD_DIMS", "BWD_HEAD_DIMS", "NVRTC_OPTIONS", "SM90A_OPTIONS",
]
