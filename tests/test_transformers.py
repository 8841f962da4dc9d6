"""cuflash.integrations.transformers: attn_implementation="cufa" in Hugging Face transformers models.

Small random-weight Llama (GQA 4/2), Qwen2 (GQA, q/k/v biases, one sliding-window layer) and Gemma 2 (GQA,
softcap, alternating sliding-window and full layers) models built here (no download), float32 on the CPU (the
NumPy reference runs the attention). Each is compared with transformers' own "sdpa" and "eager"
implementations on the same weights: logits, padded batches (left and right padding) against unpadded single
sequences, a training step's loss and gradients, greedy generation with the model's DynamicCache.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.0")

import cuflash.integrations.transformers as cti  # noqa: E402
import cuflash.torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

NAME = cti.NAME
VOCAB = 128
# float32 on the CPU: the implementations differ only in summation order. Logits are O(1)-O(10) here.
ATOL = 2e-4

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, attention_dropout=0.0)


def _config(family: str, **overrides):
    if family == "llama":
        return transformers.LlamaConfig(**{**_COMMON, **overrides})
    if family == "qwen2":  # layer 0 full attention, layer 1 a sliding window of 4 tokens
        return transformers.Qwen2Config(**{**_COMMON, "use_sliding_window": True, "sliding_window": 4,
                                           "max_window_layers": 1, **overrides})
    if family == "gemma2":  # layer 0 a sliding window of 4 tokens, layer 1 full; softcap small enough to matter
        return transformers.Gemma2Config(**{**_COMMON, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
                                            "attn_logit_softcapping": 2.0, "final_logit_softcapping": None,
                                            **overrides})
    raise ValueError(family)


_MODEL = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
_cache: dict = {}


def _models(family: str, impls, **overrides) -> dict:
    """One random-weight model per implementation, all with the same weights (copies of one model)."""
    key = (family, tuple(sorted(overrides.items())))
    if key not in _cache:
        torch.manual_seed(0)
        cls = getattr(transformers, _MODEL[family])
        _cache[key] = cls._from_config(_config(family, **overrides), attn_implementation="eager",
                                       dtype=torch.float32).eval()
    out = {}
    for impl in impls:
        model = copy.deepcopy(_cache[key])
        model.set_attn_implementation(impl)
        assert model.config._attn_implementation == impl
        out[impl] = model
    return out


def _references(family: str) -> tuple[str, ...]:
    # transformers has no "sdpa" for Gemma 2 (_supports_sdpa is False; its sdpa function also refuses softcap)
    return ("eager",) if family == "gemma2" else ("sdpa", "eager")


def _ids(batch, seqlen, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


FAMILIES = ["llama", "qwen2", "gemma2"]


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments and shapes of every cuflash.torch.attention and cuflash.torch.attention_with_kvcache
    call the integration makes (the latter with ``decode=True``, ``k`` the cache's shape), and of every step
    cuflash.torch.decode_heads_first runs (as the latter, with ``heads_first=True``)."""
    seen = []
    real, real_decode = cuflash.torch.attention, cuflash.torch.attention_with_kvcache

    def spy(q, k, v, **kw):
        seen.append(dict(q=tuple(q.shape), k=tuple(k.shape), **kw))
        return real(q, k, v, **kw)

    def decode_spy(q, k_cache, v_cache, **kw):
        seen.append(dict(q=tuple(q.shape), k=tuple(k_cache.shape), decode=True, **kw))
        return real_decode(q, k_cache, v_cache, **kw)

    real_heads_first = cuflash.torch.decode_heads_first

    def heads_first_spy(q, k, v, cache_leftpad, *args):  # (a step it runs, in the layout the others are seen in)
        out = real_heads_first(q, k, v, cache_leftpad, *args)
        if out is not None:
            seen.append(dict(q=tuple(q.transpose(1, 2).shape), k=tuple(k.transpose(1, 2).shape), decode=True,
                             cache_seqlens=k.shape[2], cache_leftpad=cache_leftpad, causal=args[0],
                             window_size=args[1], softcap=args[2], softmax_scale=args[3], heads_first=True))
        return out

    monkeypatch.setattr(cti.cuflash_torch, "attention", spy)
    monkeypatch.setattr(cti.cuflash_torch, "attention_with_kvcache", decode_spy)
    monkeypatch.setattr(cti.cuflash_torch, "decode_heads_first", heads_first_spy)
    return seen


# ---------------------------------------------------------------------------------------------------
# Registration and the mask function
# ---------------------------------------------------------------------------------------------------

def test_registered_and_idempotent():
    assert "flash" not in NAME
    assert AttentionInterface._global_mapping[NAME] is cti.attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is cti.attention_mask
    assert cti.register() == NAME and cti.register() == NAME
    assert AttentionInterface._global_mapping[NAME] is cti.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[NAME] is cti.attention_mask


def test_register_refuses_flash_names():
    with pytest.raises(ValueError, match="flash"):
        cti.register("cuflash")
    assert "cuflash" not in AttentionInterface._global_mapping


def test_mask_function_returns_padding_not_dense():
    kw = dict(batch_size=2, q_length=5, kv_length=5)
    assert cti.attention_mask(**kw) is None
    assert cti.attention_mask(**kw, attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    got = cti.attention_mask(**kw, attention_mask=pad)
    assert got.shape == (2, 5) and torch.equal(got, pad)
    # a decode step with a DynamicCache: one query, the last of 9 keys
    pad9 = torch.cat([pad, torch.ones(2, 4, dtype=torch.bool)], 1)
    got = cti.attention_mask(batch_size=2, q_length=1, kv_length=10, q_offset=9, attention_mask=torch.cat(
        [pad9, torch.ones(2, 1, dtype=torch.bool)], 1))
    assert got.shape == (2, 10)
    assert not hasattr(got, "_cuflash_leftpad")  # row 1 has a hole (right padding, then generated tokens)
    # a sliding-window cache layer: the keys are the last 4 of 10 positions (offset 6), the mask is sliced to them
    sliding = sliding_window_causal_mask_function(4)
    full = torch.ones(2, 10, dtype=torch.bool)
    full[0, 7] = False
    got = cti.attention_mask(batch_size=2, q_length=1, kv_length=4, q_offset=9, kv_offset=6, mask_function=sliding,
                             attention_mask=full)
    assert torch.equal(got, full[:, 6:])


@pytest.mark.parametrize("case", ["chunked", "custom-and", "static-cache", "caller-wants-mask"])
def test_mask_function_falls_back_to_dense(case):
    pad = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=6, kv_length=6, attention_mask=pad)
    if case == "chunked":
        kw["mask_function"] = chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    elif case == "custom-and":
        kw.update(mask_function=and_masks(causal_mask_function, lambda b, h, q, k: k != 2), use_vmap=True)
    elif case == "static-cache":  # keys past the queries (unused slots); the offset is a tensor
        kw.update(kv_length=8, q_offset=torch.tensor(0), attention_mask=torch.nn.functional.pad(pad, (0, 2)))
    else:
        kw["allow_is_causal_skip"] = False
    got = cti.attention_mask(**kw)
    assert got.dim() == 4 and got.dtype == torch.bool
    assert torch.equal(got, sdpa_mask(**{**kw, "allow_is_causal_skip": False}))


# ---------------------------------------------------------------------------------------------------
# The attention function on its own: conventions against explicit dense masks
# ---------------------------------------------------------------------------------------------------

class _Module(torch.nn.Module):
    is_causal = True


def _qkv(batch, nq, nk, heads_q=4, heads_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads_q, nq, d, generator=g), torch.randn(batch, heads_kv, nk, d, generator=g),
            torch.randn(batch, heads_kv, nk, d, generator=g))


def _sdpa_reference(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("nq", [7, 1])
def test_sliding_window_convention(window, nq):
    """transformers' window of N tokens (the current one included) is cuflash's window_size=(N - 1, 0)."""
    q, k, v = _qkv(2, nq, 7)
    mask = sdpa_mask(batch_size=2, q_length=nq, kv_length=7, q_offset=7 - nq,
                     mask_function=sliding_window_causal_mask_function(window), allow_is_causal_skip=False)
    out, weights = cti.attention_forward(_Module(), q, k, v, None, sliding_window=window)
    assert weights is None and out.shape == (2, nq, 4, 16)
    assert _max_diff(out, _sdpa_reference(q, k, v, mask)) < 1e-5


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_unpads(side, calls):
    q, k, v = _qkv(3, 6, 6)
    pad = torch.ones(3, 6, dtype=torch.bool)
    if side == "left":
        pad[0, :2] = pad[2, :5] = False
    else:
        pad[0, 4:] = pad[2, 1:] = False
    out, _ = cti.attention_forward(_Module(), q, k, v, pad, sliding_window=3)
    assert "cu_seqlens_q" in calls[-1] and "attn_mask" not in calls[-1]
    assert calls[-1]["k"] == (int(pad.sum()), 2, 16)  # packed, the key/value heads not expanded
    dense = sdpa_mask(batch_size=3, q_length=6, kv_length=6, mask_function=sliding_window_causal_mask_function(3),
                      attention_mask=pad, allow_is_causal_skip=False)
    ref = _sdpa_reference(q, k, v, dense)
    assert _max_diff(out[pad], ref[pad]) < 1e-5
    assert not out[~pad].any()  # padding queries get zeros


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_with_cached_keys(side, calls):
    """3 queries, the last of 8 keys (a chunk after a cached prefix), padded: unpadded, each query at its
    position. Left: the chunk's first query is padding too. Right: a prompt of 3, two padding tokens, then
    generated ones (without a window: across the hole, a window counts tokens, not positions, as transformers'
    flash-attention path does)."""
    q, k, v = _qkv(2, 3, 8)
    pad = torch.ones(2, 8, dtype=torch.bool)
    if side == "left":
        pad[0, :6] = False
        window, pattern = 4, sliding_window_causal_mask_function(4)
    else:
        pad[0, 3:5] = False
        window, pattern = None, causal_mask_function
    out, _ = cti.attention_forward(_Module(), q, k, v, pad, sliding_window=window)
    assert calls[-1]["q"][0] == int(pad[:, 5:].sum()) and calls[-1]["k"][0] == int(pad.sum())
    dense = sdpa_mask(batch_size=2, q_length=3, kv_length=8, q_offset=5, attention_mask=pad,
                      mask_function=pattern, allow_is_causal_skip=False)
    ref = _sdpa_reference(q, k, v, dense)
    keep = pad[:, 5:]
    assert _max_diff(out[keep], ref[keep]) < 1e-5
    assert not out[~keep].any()


@pytest.mark.parametrize("dtype", [torch.bool, torch.long])
def test_mask_function_marks_left_padding_of_a_decode_step(dtype):
    """A decode step over left padding only: the 2-D mask carries each row's first token (attention_with_kvcache's
    cache_leftpad); a prefill (several queries), a hole, or a row of padding only carry nothing."""
    pad = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], dtype=dtype)
    got = cti.attention_mask(batch_size=3, q_length=1, kv_length=7, q_offset=6, attention_mask=pad)
    assert torch.equal(got, pad) and got._cuflash_leftpad.tolist() == [3, 0, 1]
    assert got._cuflash_leftpad.dtype == torch.int32
    prefill = cti.attention_mask(batch_size=3, q_length=7, kv_length=7, attention_mask=pad)
    assert not hasattr(prefill, "_cuflash_leftpad")
    for bad in ([1, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]):
        holed = pad.clone()
        holed[1] = torch.tensor(bad, dtype=dtype)
        got = cti.attention_mask(batch_size=3, q_length=1, kv_length=7, q_offset=6, attention_mask=holed)
        assert not hasattr(got, "_cuflash_leftpad"), bad


def test_decode_step_runs_the_decode_operator(calls, monkeypatch):
    """One query against the keys: through attention_with_kvcache over the whole cache (cache_seqlens = the keys,
    cache_leftpad from the mask function), the same output as SDPA with the dense mask; with the switch off, or
    when the caller wants gradients, through cuflash.torch.attention."""
    q, k, v = _qkv(3, 1, 9)
    pad = torch.ones(3, 9, dtype=torch.bool)
    pad[0, :4] = pad[2, :1] = False
    mask = cti.attention_mask(batch_size=3, q_length=1, kv_length=9, q_offset=8, attention_mask=pad)
    out, _ = cti.attention_forward(_Module(), q, k, v, mask, sliding_window=6, scaling=0.3, softcap=5.0)
    call = calls[-1]
    assert call["decode"] and call["cache_seqlens"] == 9 and call["cache_leftpad"].tolist() == [4, 0, 1]
    assert call["window_size"] == (5, 0) and call["softcap"] == 5.0 and call["softmax_scale"] == 0.3
    dense = sdpa_mask(batch_size=3, q_length=1, kv_length=9, q_offset=8, attention_mask=pad,
                      mask_function=sliding_window_causal_mask_function(6), allow_is_causal_skip=False)
    groups = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(groups, 1) for t in (k, v))
    scores = 5.0 * torch.tanh(0.3 * q @ kr.transpose(-1, -2) / 5.0)
    ref = (scores.masked_fill(~dense, float("-inf")).softmax(-1) @ vr).transpose(1, 2)
    assert _max_diff(out, ref) < 1e-5
    no_mask, _ = cti.attention_forward(_Module(), q, k, v, None)
    assert calls[-1]["decode"] and calls[-1]["cache_leftpad"] is None
    assert _max_diff(no_mask, _sdpa_reference(q, k, v, None)) < 1e-5

    monkeypatch.setattr(cti, "DECODE_WITH_KVCACHE", False)
    again, _ = cti.attention_forward(_Module(), q, k, v, mask, sliding_window=6, scaling=0.3, softcap=5.0)
    assert "decode" not in calls[-1] and calls[-1]["attn_mask"].shape == (3, 1, 1, 9)
    assert _max_diff(again, out) < 1e-5
    monkeypatch.setattr(cti, "DECODE_WITH_KVCACHE", True)
    cti.attention_forward(_Module(), q.requires_grad_(), k, v, None)
    assert "decode" not in calls[-1]  # the decode operator has no gradient


def test_decode_step_with_padding_uses_key_mask(calls):
    """A 2-D mask that the mask function did not mark (a caller's own): the mask of one query, as attn_mask."""
    q, k, v = _qkv(2, 1, 9)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, :3] = False
    out, _ = cti.attention_forward(_Module(), q, k, v, pad)
    assert calls[-1]["attn_mask"].shape == (2, 1, 1, 9) and calls[-1]["k"] == (2, 9, 2, 16)
    assert _max_diff(out, _sdpa_reference(q, k, v, pad[:, None, None, :])) < 1e-5


def test_raw_padding_mask_of_another_length():
    """A 2-D mask handed over as is (not from the mask function): longer than the keys, its last columns are
    theirs (a sliding-window layer's keys); shorter, the keys past it are not attended (a static cache's unused
    slots), as transformers' flash-attention path reads it."""
    q, k, v = _qkv(2, 3, 6)
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, 4] = 0
    longer, _ = cti.attention_forward(_Module(), q, k, v, pad)
    assert torch.equal(longer, cti.attention_forward(_Module(), q, k, v, pad[:, -6:].bool())[0])
    shorter, _ = cti.attention_forward(_Module(), q, k, v, pad[:, :4])
    assert torch.equal(shorter, cti.attention_forward(_Module(), q, k[:, :, :4], v[:, :, :4], pad[:, :4].bool())[0])


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_dense_mask(kind):
    q, k, v = _qkv(2, 5, 5)
    keep = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[..., 0] = True
    mask = keep if kind == "bool" else torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    out, _ = cti.attention_forward(_Module(), q, k, v, mask)
    assert _max_diff(out, _sdpa_reference(q, k, v, mask)) < 1e-5


def test_unsupported_features_raise():
    q, k, v = _qkv(1, 3, 3)
    with pytest.raises(NotImplementedError, match="sinks"):
        cti.attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(4))


# ---------------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_sdpa_and_eager(family, calls):
    models = _models(family, (NAME, *_references(family)))
    ids = _ids(2, 16)
    with torch.no_grad():
        logits = {impl: m(ids).logits for impl, m in models.items()}
    assert calls, "the cufa model never called cuflash"
    assert all(c["k"][2] == 2 and c["q"][2] == 4 for c in calls)  # GQA: 2 key/value heads, not expanded
    if family in ("qwen2", "gemma2"):
        assert {c["window_size"] for c in calls} == {(-1, -1), (3, 0)}
    if family == "gemma2":
        assert all(c["softcap"] == 2.0 for c in calls)
    for ref in _references(family):
        assert _max_diff(logits[NAME], logits[ref]) < ATOL, ref
    if "sdpa" in logits:  # no further from sdpa than eager is, give or take float32 rounding
        assert _max_diff(logits[NAME], logits["sdpa"]) <= 4 * _max_diff(logits["eager"], logits["sdpa"]) + 1e-5


def test_tests_are_sensitive_to_window_and_softcap():
    """The comparisons above would see a wrong window or a missing softcap: both change the logits by far more
    than ATOL on these models."""
    ids = _ids(2, 16)
    with torch.no_grad():
        base = _models("gemma2", ["eager"])["eager"](ids).logits
        no_cap = _models("gemma2", ["eager"], attn_logit_softcapping=None)["eager"](ids).logits
        wider = _models("gemma2", ["eager"], sliding_window=5)["eager"](ids).logits
    assert _max_diff(base, no_cap) > 100 * ATOL
    assert _max_diff(base, wider) > 100 * ATOL


def _padded_batch(lengths, side, seed=2):
    """Sequences of the given lengths padded to the longest, the 2-D mask and the position ids (counted from
    each sequence's first token, as generate() does)."""
    n = max(lengths)
    seqs = [_ids(1, length, seed=seed + i)[0] for i, length in enumerate(lengths)]
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(n - len(s), n) if side == "left" else slice(0, len(s))
        ids[i, cols] = s
        mask[i, cols] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return seqs, ids, mask, position_ids


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_single_sequences(family, side, calls):
    models = _models(family, (NAME, *_references(family)))
    seqs, ids, mask, position_ids = _padded_batch([11, 7, 3], side)
    with torch.no_grad():
        batched = {impl: m(ids, attention_mask=mask, position_ids=position_ids).logits for impl, m in models.items()}
        singles = [models[NAME](s[None]).logits[0] for s in seqs]
    assert any("cu_seqlens_q" in c for c in calls)  # the padded batch ran unpadded, not with a dense mask
    assert not any(c.get("attn_mask") is not None for c in calls)
    keep = mask.bool()
    for i, single in enumerate(singles):
        assert _max_diff(batched[NAME][i][keep[i]], single) < ATOL, i
    for ref in _references(family):
        assert _max_diff(batched[NAME][keep], batched[ref][keep]) < ATOL, ref


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_matches(family, padded):
    """Loss and every parameter's gradient of one training step agree with sdpa (eager for Gemma 2)."""
    models = _models(family, (NAME, _references(family)[0]))
    if padded:
        _, ids, mask, position_ids = _padded_batch([12, 9, 5], "right", seed=5)
        labels = ids.masked_fill(mask == 0, -100)
        kw = dict(attention_mask=mask, position_ids=position_ids)
    else:
        ids = _ids(3, 12, seed=5)
        labels, kw = ids, {}
    results = {}
    for impl, model in models.items():
        model.train()
        model.zero_grad()
        loss = model(ids, labels=labels, **kw).loss
        loss.backward()
        results[impl] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (loss_a, grads_a), (loss_b, grads_b) = results.values()
    assert abs(loss_a - loss_b) < 1e-5
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        scale = grads_b[name].abs().max().item()
        assert _max_diff(grads_a[name], grads_b[name]) <= 1e-4 * max(scale, 1e-3), name


def test_training_with_dropout_is_reproducible():
    """Dropout draws its seed from torch's generator: the same manual_seed gives the same loss and gradients,
    another seed another loss."""
    model = _models("llama", [NAME], attention_dropout=0.3)[NAME].train()
    ids = _ids(2, 10, seed=7)

    def step(seed):
        torch.manual_seed(seed)
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.item(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    (a, ga), (b, gb), (c, _) = step(0), step(0), step(1)
    assert a == b and torch.equal(ga, gb) and a != c
    model.eval()
    with torch.no_grad():  # evaluation passes dropout=0
        ref = _models("llama", ["sdpa"], attention_dropout=0.3)["sdpa"]
        assert _max_diff(model(ids).logits, ref(ids).logits) < ATOL


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches(family, padded, calls):
    """8 greedy tokens with the model's DynamicCache: the same tokens as sdpa (eager for Gemma 2), decode steps
    being one query against the cache (bottom-right causal), past the sliding window of 4."""
    models = _models(family, (NAME, _references(family)[0]))
    if padded:  # generation pads on the left
        _, ids, mask, _ = _padded_batch([9, 6, 3], "left", seed=11)
    else:
        ids = _ids(3, 9, seed=11)
        mask = torch.ones_like(ids)
    out = {impl: m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
           for impl, m in models.items()}
    a, b = out.values()
    assert a.shape == (3, 17)
    assert torch.equal(a, b)
    decode = [c for c in calls if c["q"][1] == 1]
    assert len(decode) == 7 * 2  # 7 decode steps x 2 layers (the first new token comes from the prefill)
    # every step through the decode operator, over the whole cache transformers appended to (no append here)
    assert all(c.get("decode") and c["cache_seqlens"] == c["k"][1] for c in decode)
    assert all(c["causal"] for c in decode)
    if padded:
        # left padding as cache_leftpad (each row's first token); a sliding-window layer gets none once its window
        # has moved past the padding (its mask is then all True: None)
        masked = [c for c in decode if c["cache_leftpad"] is not None]
        assert all(c["cache_leftpad"].tolist() == [0, 3, 6] for c in masked if c["k"][1] > 9)
        if family == "llama":  # no sliding-window layer: every step is masked, the keys grow with every step
            assert len(masked) == len(decode)
            assert [c["k"][1] for c in decode[::2]] == list(range(10, 17))
        else:
            assert {c["k"][1] for c in decode if c["window_size"] == (3, 0)} == {4}  # w - 1 cached + the new one
    else:
        assert all(c["cache_leftpad"] is None for c in decode)


@pytest.mark.parametrize("family", ["llama"])
def test_padded_generation_matches_single_sequences(family):
    """Each sequence of a left-padded batch generates what it generates alone."""
    model = _models(family, [NAME])[NAME]
    seqs, ids, mask, _ = _padded_batch([9, 6, 3], "left", seed=11)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), max_new_tokens=8,
                               do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, -8:], alone[0, -8:]), i


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_continuation_matches(family, calls):
    """A left-padded prompt into a DynamicCache, then 4 tokens at once against it (queries the last of the keys,
    some sequences still in their padding): the same logits as the reference implementation."""
    models = _models(family, (NAME, _references(family)[0]))
    _, ids, mask, position_ids = _padded_batch([9, 5, 2], "left", seed=13)
    cut = 5  # the third sequence's 2 tokens and part of its padding are in the continuation
    logits = {}
    for impl, model in models.items():
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            first = model(ids[:, :cut], attention_mask=mask[:, :cut], position_ids=position_ids[:, :cut],
                          past_key_values=cache, use_cache=True)
            second = model(ids[:, cut:], attention_mask=mask, position_ids=position_ids[:, cut:],
                           past_key_values=first.past_key_values, use_cache=True)
        logits[impl] = torch.cat([first.logits, second.logits], 1)
    assert any(c["q"][0] < c["k"][0] and "cu_seqlens_q" in c for c in calls)  # fewer queries than keys
    keep = mask.bool()
    a, b = logits.values()
    assert _max_diff(a[keep], b[keep]) < ATOL


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_generation_matches(padded, calls):
    """A StaticCache (keys past the queries, a tensor offset) gets transformers' dense mask: still right."""
    models = _models("llama", (NAME, "sdpa"))
    if padded:
        _, ids, mask, _ = _padded_batch([9, 6, 3], "left", seed=17)
    else:
        ids = _ids(3, 9, seed=17)
        mask = torch.ones_like(ids)
    out = [m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                      cache_implementation="static") for m in models.values()]
    assert torch.equal(*out)
    assert calls and all(c.get("attn_mask") is not None and c["attn_mask"].dim() == 4 for c in calls)


def test_compiled_model_fullgraph():
    """torch.compile(model, fullgraph=True) traces the cufa model with no graph break: without padding through
    the custom operator, with padding through transformers' dense mask (the mask function does not read a traced
    mask's values to unpad)."""
    model = _models("llama", [NAME])[NAME]
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _, ids, mask, position_ids = _padded_batch([9, 5], "left", seed=19)
    with torch.no_grad():
        assert _max_diff(compiled(ids).logits, model(ids).logits) < 1e-5
        got = compiled(ids, attention_mask=mask, position_ids=position_ids).logits
        want = model(ids, attention_mask=mask, position_ids=position_ids).logits
    assert _max_diff(got[mask.bool()], want[mask.bool()]) < 1e-5


@pytest.mark.parametrize("boundaries", [False, True])
def test_packed_sequences(boundaries, calls):
    """Padding-free training batches (DataCollatorWithFlattening: one row, position ids restarting at each
    sequence): each sequence attends to itself only. With the collator's cu_seq_lens_* keywords the row runs as
    a packed batch; without them transformers finds the packing in position_ids and builds a dense mask."""
    model = _models("llama", [NAME])[NAME]
    seqs = [_ids(1, n, seed=23 + n)[0] for n in (7, 4, 9)]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=boundaries)
    batch = collator([{"input_ids": s.tolist()} for s in seqs])
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]  # a cache turns the detection off
        alone = torch.cat([model(s[None]).logits[0] for s in seqs])
    assert _max_diff(packed, alone) < ATOL
    if boundaries:
        assert all("cu_seqlens_q" in c and c["q"] == (20, 4, 16) for c in calls[:2])
    else:
        assert calls[0]["attn_mask"].shape == (1, 1, 20, 20)


# ---------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): decode steps through the decode kernels
# ---------------------------------------------------------------------------------------------------

def _gpu_config(family: str):
    """Small models with the head dims of real ones: Llama d 128 GQA 8/2; Qwen2 d 64 GQA 8/2, a sliding window of
    32 in layer 1; Gemma 2 d 128, softcap, sliding window 32 in layer 0."""
    common = dict(vocab_size=VOCAB, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=1024, attention_dropout=0.0)
    if family == "llama":
        return transformers.LlamaConfig(**common, hidden_size=1024)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, hidden_size=512, use_sliding_window=True, sliding_window=32,
                                        max_window_layers=1)
    return transformers.Gemma2Config(**common, hidden_size=512, head_dim=128, query_pre_attn_scalar=128,
                                     sliding_window=32, attn_logit_softcapping=50.0, final_logit_softcapping=None)


def _decode_logits(model, prompt, mask, tokens):
    """Prefill ``prompt`` into a DynamicCache, then feed ``tokens`` one at a time (teacher forcing, so that every
    implementation sees the same inputs): the logits of each decode step, (batch, steps, vocab), float32."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache,
              use_cache=True)
        logits = []
        for t in range(tokens.shape[1]):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out = model(tokens[:, t:t + 1], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_the_reference_cuda(family, padded, calls):
    """bf16 models on the GPU, 40 decode steps after a prompt of 60 (left-padded to 60 from 60, 37 and 5 tokens,
    past the sliding window): every step runs the decode operator, and its logits are no further from a float32
    run of the reference implementation than the reference in bf16 is (twice, plus a floor)."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.manual_seed(0)
    cls = getattr(transformers, _MODEL[family])
    base = cls._from_config(_gpu_config(family), attn_implementation="eager", dtype=torch.float32).eval().cuda()
    reference = _references(family)[0]
    g = torch.Generator().manual_seed(31)
    prompt = torch.randint(0, VOCAB, (3, 60), generator=g).cuda()
    tokens = torch.randint(0, VOCAB, (3, 40), generator=g).cuda()
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :23] = mask[2, :55] = 0
    results = {}
    for name, impl, dtype in (("truth", reference, torch.float32), ("reference", reference, torch.bfloat16),
                              (NAME, NAME, torch.bfloat16)):
        model = copy.deepcopy(base).to(dtype)
        model.set_attn_implementation(impl)
        results[name] = _decode_logits(model, prompt, mask, tokens)
        del model
    decode = [c for c in calls if c["q"][1] == 1]
    assert len(decode) == 40 * 2 and all(c.get("decode") for c in decode)
    assert sum(bool(c.get("heads_first")) for c in decode) >= 40  # (the layers' steps after their first)
    if padded:
        assert any(c["cache_leftpad"] is not None for c in decode)
    err = _max_diff(results[NAME], results["truth"])
    ref = _max_diff(results["reference"], results["truth"])
    floor = 1e-2 * results["truth"].abs().max().item()
    assert err <= 2 * ref + floor, f"max|cufa - truth| = {err:.3g}; {reference} in bf16: {ref:.3g}; floor {floor:.3g}"


@pytest.mark.gpu
def test_decode_step_paths_timing_cuda():
    """Not a pass/fail benchmark: the numbers behind the integration's choice for decode steps (printed; run
    pytest with -rP or -s to see them). One step of a DynamicCache decode loop, whose keys grow by one token per
    step (a new shape at every call, as transformers' cache concatenates), through cuflash.torch.attention (what
    decode steps ran before), through the decode operator, through the decode operator with a fixed shape (a
    static cache: the front door's remembered launch), and through torch's SDPA (enable_gqa). Host: the time to
    enqueue a call; wall: enqueued and finished, per call, over 20 calls. Each path's result is checked against
    SDPA first."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import time

    import torch.nn.functional as F

    rows = []
    for batch, context in ((1, 512), (1, 4096), (1, 16384), (8, 4096)):
        reps, heads_q, heads_kv, d = 20, 16, 4, 128
        g = torch.Generator().manual_seed(batch + context)
        q = torch.randn(batch, heads_q, 1, d, generator=g).to("cuda", torch.bfloat16)
        k_buf, v_buf = (torch.randn(batch, heads_kv, context + reps, d, generator=g).to("cuda", torch.bfloat16)
                        for _ in range(2))
        step = iter(range(10**9))

        def grown():  # the keys of the next step: one more token (a new shape), transformers' (B, H, S, d) layout
            n = context + next(step) % reps
            return k_buf[:, :, :n], v_buf[:, :, :n]

        def sdpa():
            k, v = grown()
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)

        def attention():
            k, v = grown()
            return cuflash.torch.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)

        def decode():
            k, v = grown()
            return cuflash.torch.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        cache_seqlens=k.shape[2], causal=True)

        def decode_fixed():
            k, v = k_buf[:, :, :context], v_buf[:, :, :context]
            return cuflash.torch.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        cache_seqlens=context, causal=True)

        for name, fn in (("sdpa", sdpa), ("cuflash.torch.attention", attention), ("attention_with_kvcache", decode),
                         ("attention_with_kvcache, fixed shape", decode_fixed)):
            step = iter(range(10**9))
            want, got = sdpa(), None
            step = iter(range(10**9))
            got = fn()
            assert _max_diff(got, want) < 2e-2, name
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            host = (time.perf_counter() - t0) / reps
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / reps
            rows.append(f"batch {batch:2d} context {context:6d}  {name:38s} host {host * 1e6:8.1f} us  "
                        f"wall {wall * 1e6:8.1f} us")
    print("\n" + "\n".join(rows))


def test_the_benchmark_script_runs_on_the_cpu(capsys):
    """tools/transformers_bench.py --smoke (tiny float32 models, the NumPy backend): every implementation prefills
    with the reference's logits and generates, and a cufa-over-best-sdpa line per model and measure is printed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "transformers_bench.py"
    spec = importlib.util.spec_from_file_location("transformers_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count("speed / best") == 4 and "refused" not in out
    diffs = [float(line.rsplit(" ", 1)[1].rstrip(")")) for line in out.splitlines() if "max |logits" in line]
    assert len(diffs) == 4 and max(diffs) < 1e-4


def _tool(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_profile_script_runs_on_the_cpu(capsys):
    """tools/transformers_profile.py --smoke (a tiny float32 Llama, the NumPy backend): the synchronizations of cufa
    and sdpa, cProfile's tables of the decode loop, torch.profiler's attention operators for both; decode steps on
    plain tensors call the implementation directly (no cuflash operator in the profile of the decode loop)."""
    assert _tool("transformers_profile").main(["--smoke", "--top", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("(a) ") == 4 and out.count(": cProfile of generate") == 2 and out.count("(c) ") == 4, out
    assert "cuflash::attention_with_kvcache" not in out and "aten::scaled_dot_product_attention" in out
    assert len(out.splitlines()) < 60  # (compact: read in a log)


def test_the_host_profile_of_a_decode_call_runs_without_a_gpu(capsys):
    """tools/transformers_profile.py --host: a decode step's attention call at three entry points, the CUDA path
    emulated with the stand-in CuPy; it leaves cuflash as it found it."""
    import cuflash.torch as cft
    from cuflash._ops import api as _api

    before = cft._to_array, cft._backend_call, _api._kvcache_launches
    assert _tool("transformers_profile").main(["--host", "--steps", "3", "--top", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith(("transformers ", "cuflash."))]
    assert len(rows) == 3 and all(line.rstrip().split()[-1].isdigit() for line in rows), out
    assert (cft._to_array, cft._backend_call, _api._kvcache_launches) == before


def _posed_cuda(monkeypatch, backend: str):
    """The stand-in CuPy installed and CPU tensors posed as CUDA ones (tools/transformers_profile.py), and a list
    that the ``remember`` argument of each call of ``cuflash.torch``'s ``backend`` (the calls that go through the front
    door) is appended to: ``(recorder of the launches, that list)``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _fake_cupy import install

    cp, recorder = install(monkeypatch)
    _tool("transformers_profile").pose_cpu_as_cuda(monkeypatch, cp)
    through_front_door = []
    real = getattr(cuflash.torch, backend)

    def spy(*args, **kwargs):
        through_front_door.append(kwargs.get("remember"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cuflash.torch, backend, spy)
    return recorder, through_front_door


def test_a_decode_step_like_one_already_run_goes_straight_to_its_launch(monkeypatch):
    """cuflash.torch on (stand-in) CUDA tensors: the first decode call of a layout runs the front door and keeps its
    launch; the next ones, over caches one token longer each (a DynamicCache's new tensors, seen transposed), run
    that launch directly, without crossing into CuPy: one launch each on torch's stream, whose parameter record holds
    this call's addresses (q, the caches, the lengths, out and lse, which come back), slot count and strides. Another
    option, another stream or a length past the slots goes through the front door (which refuses the last)."""
    import numpy as np

    from cuflash._ops import kvcache as _kvcache
    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE

    recorder, through_front_door = _posed_cuda(monkeypatch, "_kvcache_backend")
    ct = cuflash.torch
    batch, heads_q, heads_kv, d = 2, 8, 2, 64
    q = torch.randn(batch, 1, heads_q, d).to(torch.bfloat16)

    def caches(n):  # (batch, heads, slots, d) tensors as transformers keeps them, seen as (batch, slots, heads, d)
        return tuple(torch.randn(batch, heads_kv, n, d).to(torch.bfloat16).transpose(1, 2) for _ in range(2))

    def step(n, **kw):
        k_cache, v_cache = caches(n)
        recorder.take()
        kw.setdefault("cache_seqlens", n)
        out, lse = ct.attention_with_kvcache(q, k_cache, v_cache, causal=True, return_lse=True, **kw)
        return k_cache, v_cache, out, lse, recorder.take()

    step(40)
    assert len(through_front_door) == 1 and len(ct._decode_launches) == 1
    for n in (41, 43):
        k_cache, v_cache, out, lse, launches = step(n)
        assert len(through_front_door) == 1, "a step like the first one went through the front door"
        assert out.shape == (batch, 1, heads_q, d) and out.dtype == torch.bfloat16
        assert lse.shape == (batch, heads_q, 1) and lse.dtype == torch.float32
        assert len(launches) == 1 and launches[0][4] == 0  # one launch, on the (posed) device's current stream
        record = np.frombuffer(launches[0][5][0], dtype=DECODE_PARAMS_DTYPE)[0]
        rows = _kvcache._SEQLEN_TABLES[(0, batch)]
        assert (record["q"], record["k_cache"], record["v_cache"], record["out"], record["lse"]) == (
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), lse.data_ptr())
        assert record["cache_seqlens"] == rows[n].data.ptr and (np.asarray(rows[n]) == n).all()
        assert (record["capacity"], record["k_sb"], record["k_ss"], record["k_sh"]) == (n, *k_cache.stride()[:3])
        assert (record["v_sb"], record["v_ss"], record["v_sh"]) == v_cache.stride()[:3]
    lens = torch.tensor([30, 44], dtype=torch.int32)
    step(44, cache_seqlens=lens)
    _, _, _, _, launches = step(45, cache_seqlens=lens)
    assert len(through_front_door) == 2  # (a tensor cache_seqlens: a key of its own, then direct)
    assert np.frombuffer(launches[0][5][0], dtype=DECODE_PARAMS_DTYPE)[0]["cache_seqlens"] == lens.data_ptr()
    step(46, window_size=(8, 0))
    assert len(through_front_door) == 3
    monkeypatch.setattr(ct, "_stream_address", lambda index: 7)
    step(47)
    assert len(through_front_door) == 4
    with pytest.raises(ValueError, match="cache_seqlens"):
        step(48, cache_seqlens=49)
    assert len(through_front_door) == 5


def test_a_transformers_decode_step_like_one_already_run_goes_straight_to_its_launch(monkeypatch):
    """cufa's attention_forward on (stand-in) CUDA tensors heads first, as a DynamicCache hands them over: the first
    decode step of a layout goes through the front door and its launch is kept under the heads-first key; the next
    ones (a cache one token longer each, new tensors) run it from cuflash.torch.decode_heads_first, with no transposed
    views: one launch whose record holds this call's addresses (q, the caches, out), slot count and the caches'
    strides in (batch, slots, heads) order, and outputs that are distinct views. Left padding (the mask function's
    attribute) has a key of its own; another window goes through the front door."""
    import numpy as np

    import cuflash.integrations.transformers as cti
    from cuflash._cuda.decode import DECODE_PARAMS_DTYPE

    recorder, through_front_door = _posed_cuda(monkeypatch, "_kvcache_backend")
    ct = cuflash.torch
    batch, heads_q, heads_kv, d = 2, 8, 2, 64

    class Layer(torch.nn.Module):
        is_causal = True

    layer = Layer()
    query = torch.randn(batch, heads_q, 1, d).to(torch.bfloat16)

    def step(n, mask=None, **kw):
        key, value = (torch.randn(batch, heads_kv, n, d).to(torch.bfloat16) for _ in range(2))
        recorder.take()
        with torch.no_grad():
            out, weights = cti.attention_forward(layer, query, key, value, mask, scaling=0.125, **kw)
        assert weights is None and out.shape == (batch, 1, heads_q, d) and out.dtype == torch.bfloat16
        return key, value, out, recorder.take()

    step(40)
    assert len(through_front_door) == 1 and len(ct._heads_first_steps) == 1
    outs = []
    for n in (41, 43, 44):
        key, value, out, launches = step(n)
        assert len(through_front_door) == 1, "a step like the first one went through the front door"
        assert len(launches) == 1 and launches[0][4] == 0
        record = np.frombuffer(launches[0][5][0], dtype=DECODE_PARAMS_DTYPE)[0]
        assert (record["q"], record["k_cache"], record["v_cache"], record["out"]) == (
            query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr())
        assert (record["capacity"], record["k_sb"], record["k_ss"], record["k_sh"]) == (
            n, key.stride(0), key.stride(2), key.stride(1))
        assert (record["v_sb"], record["v_ss"], record["v_sh"]) == (value.stride(0), value.stride(2), value.stride(1))
        assert out.is_contiguous()
        outs.append(out)
    assert len({o.data_ptr() for o in outs}) == len(outs)  # (each step its own output)
    # left padding: the 2-D mask with the mask function's attribute, a key of its own, then direct
    mask = torch.ones(batch, 45, dtype=torch.bool)
    mask[0, :3] = False
    leftpad = torch.tensor([3, 0], dtype=torch.int32)
    setattr(mask, cti._LEFTPAD, leftpad)
    step(45, mask)
    assert len(through_front_door) == 2
    mask46 = torch.ones(batch, 46, dtype=torch.bool)
    mask46[0, :3] = False
    setattr(mask46, cti._LEFTPAD, leftpad)
    _, _, _, launches = step(46, mask46)
    assert len(through_front_door) == 2
    assert np.frombuffer(launches[0][5][0], dtype=DECODE_PARAMS_DTYPE)[0]["cache_leftpad"] == leftpad.data_ptr()
    step(47, sliding_window=8)  # (another window: the front door, then remembered)
    assert len(through_front_door) == 3
    monkeypatch.setattr(ct, "DIRECT_CALLS", False)
    step(48)
    assert len(through_front_door) == 4


def test_a_transformers_inference_call_like_one_already_run_goes_straight_to_its_plan(monkeypatch):
    """cufa's attention_forward on (stand-in) CUDA tensors heads first, no mask, no gradient (a prefill): the first
    call of a layout goes through the front door and its plan is kept under the heads-first key; the next ones with new
    tensors run it from cuflash.torch.forward_heads_first, one launch whose arguments hold this call's addresses (q, k,
    v, out) and the stream's lse buffer. Another option, or a gradient wanted, goes through the front door."""
    import numpy as np

    import cuflash.integrations.transformers as cti

    recorder, through_front_door = _posed_cuda(monkeypatch, "_forward_backend")
    ct = cuflash.torch

    class Layer(torch.nn.Module):
        is_causal = True

    layer = Layer()

    def call(grad=False, **kw):
        q = torch.randn(2, 4, 64, 64).to(torch.bfloat16).requires_grad_(grad)
        k, v = (torch.randn(2, 2, 64, 64).to(torch.bfloat16) for _ in range(2))
        recorder.take()
        with torch.set_grad_enabled(grad):
            out, _ = cti.attention_forward(layer, q, k, v, None, scaling=0.125, **kw)
        assert out.shape == (2, 64, 4, 64) and out.dtype == torch.bfloat16
        return (q, k, v), out, recorder.take()

    call()
    assert len(through_front_door) == 1 and len(ct._heads_first_plans) == 1
    lse_words = set()
    for _ in range(2):
        tensors, out, launches = call()
        assert len(through_front_door) == 1, "a call like the first one went through the front door"
        assert len(launches) == 1 and launches[0][4] == 0
        words = {int(x) for arg in launches[0][5] if len(arg) == 8 for x in np.frombuffer(arg, np.uint64)}
        assert {t.data_ptr() for t in (*tensors, out)} <= words
        lse_words.add(frozenset(words - {t.data_ptr() for t in (*tensors, out)}))
    assert len(lse_words) == 1  # (the same lse buffer, the stream's, at every call)
    call(sliding_window=16)
    assert len(through_front_door) == 2
    call(grad=True)
    assert len(through_front_door) == 3


def test_an_inference_call_like_one_already_run_goes_straight_to_its_plan(monkeypatch):
    """cuflash.torch.attention on (stand-in) CUDA tensors with no gradient wanted: the first call of a layout runs the
    front door and keeps its plan; the next ones with new tensors of that layout run the plan directly, one launch
    whose arguments hold this call's addresses (q, k, v, and out and lse, which come back). A gradient wanted,
    another option, a bias or another stream goes through the front door."""
    import numpy as np

    recorder, through_front_door = _posed_cuda(monkeypatch, "_forward_backend")
    ct = cuflash.torch

    def qkv(requires_grad=False):
        return tuple(torch.randn(2, 64, 4, 64).to(torch.bfloat16).requires_grad_(requires_grad) for _ in range(3))

    def call(tensors, **kw):
        recorder.take()
        out, lse = ct.attention(*tensors, return_lse=True, **{"causal": True, **kw})
        return out, lse, recorder.take()

    call(qkv())
    assert len(through_front_door) == 1 and len(ct._forward_plans) == 1
    for _ in range(2):
        tensors = qkv()
        out, lse, launches = call(tensors)
        assert len(through_front_door) == 1, "an inference call like the first one went through the front door"
        assert out.shape == (2, 64, 4, 64) and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 64)
        assert len(launches) == 1 and launches[0][4] == 0  # one launch, on the (posed) device's current stream
        words = {int(x) for arg in launches[0][5] if len(arg) == 8 for x in np.frombuffer(arg, np.uint64)}
        assert {t.data_ptr() for t in (*tensors, out, lse)} <= words
    call(qkv(requires_grad=True))  # (a gradient wanted: the operator, which does not remember)
    assert len(through_front_door) == 2 and through_front_door[-1] is None and len(ct._forward_plans) == 1
    call(qkv(), causal=False)
    assert len(through_front_door) == 3 and len(ct._forward_plans) == 2
    call(qkv(), bias=torch.zeros(2, 4, 64, 64).to(torch.bfloat16))
    assert len(through_front_door) == 4 and through_front_door[-1] is None  # (a bias: not remembered)
    monkeypatch.setattr(ct, "_stream_address", lambda index: 7)
    call(qkv())
    assert len(through_front_door) == 5


def test_the_profile_script_names_the_cuflash_frame_of_a_synchronization():
    """(a)'s bookkeeping: a synchronization warning is counted under the innermost frame in cuflash's package (not
    the script's, whatever the repository's directory is called), a host read of a CuPy-like array through
    cuflash's _validate._to_host too, a NumPy one not; and the patched functions are restored."""
    import collections
    import os
    import warnings

    import numpy as np

    import cuflash
    from cuflash._ops import validate as _validate

    tool = _tool("transformers_profile")
    where = os.path.join(os.path.dirname(cuflash.__file__), "_sync_example.py")
    namespace = {"warnings": warnings}
    exec(compile("def step():\n    warnings.warn('called a synchronizing CUDA operation')\n", where, "exec"), namespace)

    class DeviceArray:
        def get(self):
            return np.zeros(2)

    found = collections.Counter()
    to_host = _validate._to_host
    with tool._synchronizations(torch, found):
        namespace["step"]()
        namespace["step"]()
        _validate._to_host(DeviceArray())
        _validate._to_host(np.zeros(2))
    assert _validate._to_host is to_host
    (what, culprit), count = found.most_common(1)[0]
    assert count == 2 and "synchronizing" in what and culprit.startswith("cuflash/_sync_example.py:2 step"), found
    reads = [(key, n) for key, n in found.items() if "_to_host" in key[0]]
    assert len(reads) == 1 and reads[0][1] == 1 and "test_transformers.py" in reads[0][0][1], found
