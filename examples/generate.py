"""Generate tokens with a tiny random-weight decoder through a paged KV cache, checking every step.

Model (random weights; nothing is trained, the point is the cache):

    x = embed[token] + pos_embed[position]                       (d_model)
    for each layer:
        x = x + MHA(rms(x))                                       grouped-query attention, causal (cuflash.mha)
        x = x + tanh(rms(x) W_1) W_2                              a small MLP
    logits = rms(x) W_out

Serving, the way an inference engine lays out its memory:

- every layer has a paged cache ``(num_pages, page_size, heads_kv, head_dim)`` for K and one for V; a shuffled pool
  of free pages hands out a page whenever a sequence's length reaches a page boundary, and one ``block_table``
  ``(batch, max_pages)`` maps each sequence's slots to pages (the same for every layer);
- all sequences start with the same system prompt: its full pages are prefilled once and shared by every
  sequence's block table (read, never written); the rest of each prompt is prefilled per sequence
  (``cuflash.attention_with_kvcache`` with the prompt as q and as new keys, causal);
- decoding is batched: one new token per sequence per step, appended in place by the same call that attends.

After the prefill and after every decode step, each sequence is recomputed from scratch (``cuflash.mha_forward``
over its whole token sequence, causal) and the logits of its last position compared with the decoded ones.
Tokens per second count the decode steps only, not the checks.

``--device cpu`` (the default) runs NumPy arrays, so the NumPy reference; ``--device gpu`` runs CuPy arrays, so the
CUDA decode kernels (and the forward kernels for the recomputation), in float16 with head dim 32 (the GPU kernels
start at 32). The block table and the lengths live on the host, where pages are handed out, and are copied to the
device for each call (a serving engine would update its device table in place).

Run:  python examples/generate.py [--tokens 24] [--batch 3] [--page-size 4] [--dtype float32] [--seed 0]
                                  [--device cpu|gpu]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cuflash
from cuflash.mha import init_mha_params, mha_forward

VOCAB = 64
D_MODEL = 64
NUM_HEADS, NUM_KV_HEADS = 8, 2
HEAD_DIM = 8               # (32 on the GPU)
LAYERS = 2
SYSTEM_PROMPT = 9          # tokens every sequence starts with
MAX_LEN = 128              # positions the model knows


def rms(x):
    xp = np if isinstance(x, np.ndarray) else sys.modules["cupy"]  # (a CuPy array: CuPy is imported)
    return x / xp.sqrt((x.astype(xp.float64) ** 2).mean(axis=-1, keepdims=True) + 1e-6).astype(x.dtype)


class Model:
    """Random weights of the decoder; :meth:`full` runs a whole sequence, :meth:`step` new tokens over the cache.
    ``xp``: the array module of the weights and of every array the model makes (NumPy or CuPy)."""

    def __init__(self, rng, dtype, xp=np, head_dim=HEAD_DIM):
        def weight(*shape, fan_in):
            return xp.asarray((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype))

        self.dtype, self.xp, self.head_dim = dtype, xp, head_dim
        self.embed = weight(VOCAB, D_MODEL, fan_in=1)
        self.pos_embed = weight(MAX_LEN, D_MODEL, fan_in=4)
        self.layers = [
            dict(attn=init_mha_params(D_MODEL, NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, dtype=dtype,
                                      rng=rng, xp=xp),
                 w_1=weight(D_MODEL, 2 * D_MODEL, fan_in=D_MODEL), w_2=weight(2 * D_MODEL, D_MODEL, fan_in=2 * D_MODEL))
            for _ in range(LAYERS)
        ]
        self.w_out = weight(D_MODEL, VOCAB, fan_in=D_MODEL)

    def _input(self, tokens, positions):
        xp = self.xp
        return self.embed[xp.asarray(tokens)] + self.pos_embed[xp.asarray(positions)]

    def _mlp(self, layer, x):
        return self.xp.tanh(rms(x) @ layer["w_1"]) @ layer["w_2"]

    def full(self, tokens):
        """Logits of every position of one sequence, recomputed from scratch (no cache): the check."""
        tokens = np.asarray(tokens)
        x = self._input(tokens, np.arange(len(tokens)))[None]
        for layer in self.layers:
            y, _ = mha_forward(rms(x), layer["attn"], num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, causal=True)
            x = x + y
            x = x + self._mlp(layer, x)
        return (rms(x) @ self.w_out)[0]

    def step(self, tokens, positions, caches, cache_seqlens, block_table):
        """New tokens ``(batch, n)`` at ``positions`` ``(batch, n)``: their K and V are appended to every layer's
        cache at slots ``cache_seqlens[b] ..`` and they attend over the cache. Returns ``(batch, n, VOCAB)`` logits.
        ``cache_seqlens`` and ``block_table`` come from the host and go to the model's device here."""
        batch, n = tokens.shape
        xp, d = self.xp, self.head_dim
        cache_seqlens, block_table = xp.asarray(cache_seqlens), xp.asarray(block_table)
        x = self._input(tokens, positions)
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            p = layer["attn"]
            h = rms(x)
            q = (h @ p.w_q).reshape(batch, n, NUM_HEADS, d)
            k = (h @ p.w_k).reshape(batch, n, NUM_KV_HEADS, d)
            v = (h @ p.w_v).reshape(batch, n, NUM_KV_HEADS, d)
            out = cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                 block_table=block_table, causal=True)
            x = x + out.reshape(batch, n, NUM_HEADS * d) @ p.w_o
            x = x + self._mlp(layer, x)
        return rms(x) @ self.w_out


class PagedCache:
    """One K and one V cache per layer in pages (on the model's device), a shuffled pool of free pages and the
    block table (on the host)."""

    def __init__(self, rng, batch, page_size, max_len, dtype, xp=np, head_dim=HEAD_DIM):
        self.page_size = page_size
        self.max_pages = -(-max_len // page_size)
        num_pages = batch * self.max_pages + 2
        shape = (num_pages, page_size, NUM_KV_HEADS, head_dim)
        self.caches = [(xp.zeros(shape, dtype), xp.zeros(shape, dtype)) for _ in range(LAYERS)]
        self.free = list(rng.permutation(num_pages))
        self.block_table = np.full((batch, self.max_pages), -1, np.int32)   # -1: not allocated (never read)
        self.lengths = np.zeros(batch, np.int32)

    def reserve(self, b, new_tokens):
        """Give sequence ``b`` pages for ``new_tokens`` more slots."""
        for slot in range(int(self.lengths[b]), int(self.lengths[b]) + new_tokens):
            if self.block_table[b, slot // self.page_size] < 0:
                self.block_table[b, slot // self.page_size] = self.free.pop()


def generate(tokens=24, batch=3, page_size=4, dtype=np.float32, seed=0, verbose=True, device="cpu"):
    """Prefill ``batch`` prompts (a shared system prompt, then a prompt of its own each) and decode ``tokens`` tokens
    per sequence. Returns a dict: the sequences, the largest logit error against recomputation, tokens per second.
    ``device="gpu"``: CuPy arrays (the CUDA kernels), head dim 32, float16."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if device == "gpu":
        import cupy as xp

        if dtype not in (np.float16,):
            raise ValueError(f"dtype: the GPU decode kernels run float16 here (bfloat16 too, which CuPy cannot "
                             f"multiply); got {dtype.name}")
        head_dim = 32
    elif device == "cpu":
        xp, head_dim = np, HEAD_DIM
    else:
        raise ValueError(f"device must be 'cpu' or 'gpu'; got {device!r}")
    model = Model(rng, dtype, xp, head_dim)
    system = rng.integers(0, VOCAB, size=SYSTEM_PROMPT)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(1, 8))) for _ in range(batch)]
    max_len = SYSTEM_PROMPT + max(len(p) for p in prompts) + tokens
    assert max_len <= MAX_LEN, "more tokens than positions"
    cache = PagedCache(rng, batch, page_size, max_len, dtype, xp, head_dim)
    # float16: decoding and recomputation round differently (other kernels, other orders of summation)
    tolerance = {np.float64: 1e-10, np.float32: 1e-5, np.float16: 3e-2}[dtype.type]
    worst = 0.0

    def host(a):
        return a.get() if hasattr(a, "get") else a

    def compare(b, sequence, logits):
        nonlocal worst
        truth = host(model.full(sequence)[-1]).astype(np.float64)
        logits = host(logits)
        error = float(np.abs(logits.astype(np.float64) - truth).max() / max(1.0, np.abs(truth).max()))
        worst = max(worst, error)
        assert error <= tolerance, f"sequence {b} at length {len(sequence)}: logits off by {error:.2e} (relative)"

    # The system prompt's full pages: prefilled once (as sequence 0), then shared by every block table.
    shared = (SYSTEM_PROMPT // page_size) * page_size
    if shared:
        cache.reserve(0, shared)
        model.step(system[None, :shared], np.arange(shared)[None], cache.caches, np.zeros(1, np.int32),
                   cache.block_table[:1])
        cache.block_table[1:, :shared // page_size] = cache.block_table[0, :shared // page_size]
        cache.lengths[:] = shared
    # The rest of each prompt, one sequence at a time (their lengths differ), causal over the cache.
    sequences, next_tokens = [], np.zeros((batch, 1), np.int64)
    for b in range(batch):
        rest = np.concatenate([system[shared:], prompts[b]])
        cache.reserve(b, len(rest))
        positions = cache.lengths[b] + np.arange(len(rest))
        logits = host(model.step(rest[None], positions[None], cache.caches, cache.lengths[b:b + 1],
                                 cache.block_table[b:b + 1])[0, -1])
        cache.lengths[b] += len(rest)
        sequences.append(list(system) + list(prompts[b]))
        compare(b, sequences[b], logits)
        next_tokens[b, 0] = _sample(rng, logits)

    # Decoding: one token per sequence per step, all sequences in one call per layer.
    decode_time = 0.0
    for _ in range(tokens):
        for b in range(batch):
            sequences[b].append(int(next_tokens[b, 0]))
            cache.reserve(b, 1)
        start = time.perf_counter()
        logits = host(model.step(next_tokens, cache.lengths[:, None].astype(np.int64), cache.caches, cache.lengths,
                                 cache.block_table)[:, 0])  # (on the host: the step has finished)
        decode_time += time.perf_counter() - start
        cache.lengths += 1
        for b in range(batch):
            compare(b, sequences[b], logits[b])
            next_tokens[b, 0] = _sample(rng, logits[b])
    rate = batch * tokens / decode_time if decode_time > 0 else float("inf")
    if verbose:
        for b, sequence in enumerate(sequences):
            print(f"sequence {b}: prompt {SYSTEM_PROMPT}+{len(prompts[b])} tokens, generated "
                  f"{' '.join(map(str, sequence[-tokens:]))}")
        pages_used = int((cache.block_table >= 0).sum()) - (batch - 1) * (shared // page_size)
        print(f"{batch * tokens} tokens decoded in {decode_time * 1e3:.1f} ms: {rate:.0f} tokens/s "
              f"({'CUDA kernels' if device == 'gpu' else 'NumPy reference'}, {dtype.name}, head dim {head_dim}, "
              f"page size {page_size}, {pages_used} pages in use, "
              f"{shared // page_size} shared)")
        print(f"max |logits - recomputed| / max(1, |logits|) over every step: {worst:.2e} (tolerance {tolerance:.0e})")
    return {"sequences": sequences, "max_error": worst, "tokens_per_s": rate, "block_table": cache.block_table.copy()}


def _sample(rng, logits):
    logits = logits.astype(np.float64)
    p = np.exp(logits - logits.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--dtype", default=None, choices=["float16", "float32", "float64"],
                        help="default: float32 on the CPU, float16 on the GPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    args = parser.parse_args(argv)
    dtype = np.dtype(args.dtype or ("float16" if args.device == "gpu" else "float32"))
    generate(args.tokens, args.batch, args.page_size, dtype, args.seed, device=args.device)


if __name__ == "__main__":
    main()
