"""The operations and their validation: the front door (:mod:`.api`, re-exported by :mod:`cuflash`), the checks
(:mod:`.validate`), the variant description every backend reads (:mod:`.variant`), user modifications and block
masks (:mod:`.mods`, :mod:`.blocks`), the decoding operations (KV cache, plans, cascade, chunked prefill), merging
partial results, the ring of context parallelism, the dropout counters. The NumPy reference (:mod:`cuflash.reference`)
and the CUDA launcher (:mod:`cuflash._cuda`) are the backends it calls."""
