"""Plain-torch float64 attention of one sequence, shared by the torch front end's tests (test_torch.py,
test_flash_attn.py): the scaled scores after softcap and ALiBi, and the band (causal bottom-right, window) of
docs/variants.md. Import after ``pytest.importorskip("torch")``."""

from __future__ import annotations

import torch


def packed_lengths(lens) -> torch.Tensor:
    """int32 prefix sums ``[0, l0, l0 + l1, ...]`` of sequence lengths (``cu_seqlens``)."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def sequence_scores(qb, kb, vb, *, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """``(s, visible, vb)`` of one sequence: ``s`` (heads_q, len_q, len_k) the scaled scores with softcap and
    ALiBi (``slopes``: the sequence's (heads_q,) slopes), ``visible`` the (len_q, len_k) band, and ``vb`` with its
    key/value heads repeated to the query heads (GQA). Differentiable."""
    len_q, len_k, heads_q = qb.shape[0], kb.shape[0], qb.shape[1]
    kb, vb = (x.repeat_interleave(heads_q // x.shape[1], dim=1) for x in (kb, vb))
    s = scale * torch.einsum("qhd,khd->hqk", qb, kb)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    diagonal = torch.arange(len_q)[:, None] + (len_k - len_q)
    cols = torch.arange(len_k)[None, :]
    if slopes is not None:
        s = s - slopes[:, None, None].double() * (diagonal - cols).abs()
    left, right = window
    right = 0 if causal and right == -1 else (min(right, 0) if causal else right)
    visible = torch.ones(len_q, len_k, dtype=torch.bool)
    if right != -1:
        visible &= cols <= diagonal + right
    if left != -1:
        visible &= cols >= diagonal - left
    return s, visible, vb
