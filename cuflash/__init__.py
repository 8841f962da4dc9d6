"""cuflash: FlashAttention for CuPy and NumPy.

CuPy arrays run tiled FlashAttention CUDA kernels compiled at run time by NVRTC; NumPy arrays run a NumPy
implementation of the same block algorithm, which is also the reference the kernels are tested against.
PyTorch and JAX users go through :mod:`cuflash.torch` and :mod:`cuflash.jax` (imported on demand only).
"""

from ._ops.api import (attention, attention_backward, attention_with_kvcache, cascade_attention, dropout_mask,
                       merge_states, plan_kvcache)
from ._ops.decode_plan import DecodePlan
from ._ops.mods import BlockMask
from .mha import MHACache, MHAGrads, MHAParams, init_mha_params, mha_backward, mha_forward

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "dropout_mask",
    "BlockMask",
    "attention_with_kvcache",
    "plan_kvcache",
    "DecodePlan",
    "merge_states",
    "cascade_attention",
    "MHAParams",
    "MHAGrads",
    "MHACache",
    "init_mha_params",
    "mha_forward",
    "mha_backward",
    "__version__",
]
