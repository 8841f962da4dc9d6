"""cuflash: FlashAttention for CuPy and NumPy.

CuPy arrays run tiled FlashAttention CUDA kernels compiled at run time by NVRTC; NumPy arrays run a NumPy
implementation of the same block algorithm, which is also the reference the kernels are tested against.
"""

from ._api import attention, attention_backward

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "__version__"]
