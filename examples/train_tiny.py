"""Train a tiny attention model on CPU with cuflash's manual backward (no autograd framework).

Task (previous-token copy): a sequence of random tokens; at every position i >= 1 the model must output
the token at position i - 1. One causal multi-head self-attention layer can solve it by attending from
each position to the one before it, which it has to learn from the positional part of its input.

Model:
    Z̃ = [one_hot(token), one_hot(position)]            (batch, seqlen, vocab + seqlen), fixed
    Y = MHA(Z̃)                                          cuflash.mha_forward, causal, grouped-query
    logits = Y W_r + b_r                                 linear readout to the vocabulary
    L = mean over positions i >= 1 of cross_entropy(logits_i, token_{i-1})

Backward by hand: dlogits = (softmax(logits) - one_hot(target)) / count, dW_r = Y^T dlogits,
db_r = column sums, dY = dlogits W_r^T, then cuflash.mha_backward for the layer. The update is Adam,
written out below.

Run:  python examples/train_tiny.py [--steps 60] [--algorithm fa2] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from cuflash.mha import MHAParams, init_mha_params, mha_backward, mha_forward

VOCAB = 8
SEQLEN = 8
BATCH = 32
NUM_HEADS, NUM_KV_HEADS = 4, 2
HEAD_DIM = 8


def make_batch(rng):
    """Random tokens, the fixed input embedding Z̃ and the previous-token targets."""
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQLEN))
    z = np.concatenate(
        [np.eye(VOCAB)[tokens], np.broadcast_to(np.eye(SEQLEN), (BATCH, SEQLEN, SEQLEN))], axis=-1
    )
    return z, tokens[:, :-1]


def loss_and_grads(params, z, targets, algorithm):
    """Forward and manual backward of the whole model; returns the loss and a dict of gradients."""
    layer, w_r, b_r = params["layer"], params["w_r"], params["b_r"]
    y, cache = mha_forward(z, layer, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, causal=True,
                           algorithm=algorithm)
    logits = y @ w_r + b_r
    # Position 0 has no previous token: only positions 1..SEQLEN-1 enter the loss.
    scored = logits[:, 1:]
    shifted = scored - scored.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    one_hot = np.eye(VOCAB)[targets]
    count = targets.size
    loss = -float(np.sum(one_hot * log_probs)) / count

    # Cross-entropy through softmax: dlogits = (softmax - one_hot) / count; zero at position 0.
    dlogits = np.zeros_like(logits)
    dlogits[:, 1:] = (np.exp(log_probs) - one_hot) / count
    rows = BATCH * SEQLEN
    y2, dlogits2 = y.reshape(rows, -1), dlogits.reshape(rows, VOCAB)
    dy = (dlogits2 @ w_r.T).reshape(y.shape)
    layer_grads = mha_backward(dy, cache, layer)
    grads = {
        "layer": MHAParams(*(getattr(layer_grads, "d" + name) for name in MHAParams._fields)),
        "w_r": y2.T @ dlogits2,
        "b_r": dlogits2.sum(axis=0),
    }
    return loss, grads


class Adam:
    """Adam (Kingma & Ba) over the leaves of the parameter dict; ``None`` leaves (absent biases) stay None."""

    def __init__(self, params, lr=0.03, beta1=0.9, beta2=0.999, eps=1e-8):
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.step_count = 0
        self.m = _map(np.zeros_like, params)
        self.v = _map(np.zeros_like, params)

    def step(self, params, grads):
        self.step_count += 1
        t = self.step_count
        correction = math.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t)

        def update(p, g, m, v):
            m *= self.beta1
            m += (1 - self.beta1) * g
            v *= self.beta2
            v += (1 - self.beta2) * g * g
            return p - self.lr * correction * m / (np.sqrt(v) + self.eps)

        return _map(update, params, grads, self.m, self.v)


def _map(fn, *trees):
    """Apply ``fn`` leaf by leaf to dicts whose values are arrays or MHAParams (skipping None leaves)."""
    out = {}
    for key, first in trees[0].items():
        leaves = [tree[key] for tree in trees]
        if isinstance(first, MHAParams):
            out[key] = MHAParams(*(
                None if parts[0] is None else fn(*parts) for parts in zip(*leaves)
            ))
        else:
            out[key] = fn(*leaves)
    return out


def train(steps=60, algorithm="fa2", seed=0, log_every=10, verbose=True):
    """Train from scratch; returns the list of per-step losses."""
    rng = np.random.default_rng(seed)
    d_model = VOCAB + SEQLEN
    params = {
        "layer": init_mha_params(d_model, NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, bias=True,
                                 dtype=np.float64, rng=rng),
        "w_r": rng.uniform(-1, 1, size=(d_model, VOCAB)) / math.sqrt(d_model),
        "b_r": np.zeros(VOCAB),
    }
    optimizer = Adam(params)
    losses = []
    for step in range(steps):
        z, targets = make_batch(rng)
        loss, grads = loss_and_grads(params, z, targets, algorithm)
        params = optimizer.step(params, grads)
        losses.append(loss)
        if verbose and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}")
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--algorithm", default="fa2", choices=["fa2", "fa1", "naive"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    losses = train(steps=args.steps, algorithm=args.algorithm, seed=args.seed)
    elapsed = time.perf_counter() - start
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps ({elapsed:.2f} s); "
          f"chance level ln({VOCAB}) = {math.log(VOCAB):.4f}")
    assert losses[-1] < 0.5 * losses[0], f"the loss did not halve: {losses[0]:.4f} -> {losses[-1]:.4f}"


if __name__ == "__main__":
    main()
