"""Integrations of cuflash into other libraries, each imported on demand (their dependencies stay optional).

- :mod:`cuflash.integrations.transformers`: an attention implementation for Hugging Face transformers
  (``attn_implementation="cufa"``).
"""
