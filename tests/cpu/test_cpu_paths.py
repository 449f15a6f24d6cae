"""The CPU paths compute what the plain model computes, and `optimize`/`optimized` switch them;
prompts padded to the fused kernel's lengths attend as closely to float64 as unpadded ones."""

import pytest
import torch
from torch import nn

from decoderlm import DecoderLM, ModelConfig, next_token_loss
from decoderlm.cpu import attention as cpu_attention
from decoderlm.cpu import f32_attention, optimize, optimized
from decoderlm.cpu.attention import (
    blockwise_attention,
    blockwise_is_faster,
    cpu_attend,
    padded_self_attention,
    pads,
    softmax_zero_if_empty,
)
from decoderlm.cpu.embedding import CPUEmbedding
from decoderlm.model.attention import attend, scaled_dot_product_attention
from decoderlm.model.masks import build_mask, causal_mask


def _inputs(b, h, h_kv, t_q, t_k, d, dtype, seed=0):
    """q (b, h, t_q, d), k/v (b, h_kv, t_k, d) requiring grad, and float64 copies and dO."""
    g = torch.Generator().manual_seed(seed)
    q64 = torch.randn(b, h, t_q, d, generator=g, dtype=torch.float64)
    k64 = torch.randn(b, h_kv, t_k, d, generator=g, dtype=torch.float64)
    v64 = torch.randn(b, h_kv, t_k, d, generator=g, dtype=torch.float64)
    do64 = torch.randn(b, h, t_q, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q64, k64, v64)], (q64, k64, v64), do64


def _left_padding(b: int, t_k: int) -> torch.Tensor:
    """(b, t_k) key mask: row 0 starts with t_k // 3 padding keys, as a shorter prompt in a batch."""
    key_padding_mask = torch.ones(b, t_k, dtype=torch.bool)
    key_padding_mask[0, : t_k // 3] = False
    return key_padding_mask


@pytest.mark.parametrize("compiled", [False, True])
def test_embedding_gradient_sums_the_rows_of_repeated_tokens_as_torch_does(compiled):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 7, (3, 20), generator=g)  # few rows: every token repeats
    emb = CPUEmbedding.from_embedding(nn.Embedding(7, 5, dtype=torch.float64))
    upstream = torch.randn(3, 20, 5, generator=g, dtype=torch.float64)
    lookup = torch.compile(emb, fullgraph=True) if compiled else emb
    out = lookup(idx)
    (out * upstream).sum().backward()
    expected = torch.zeros(7, 5, dtype=torch.float64).index_add_(
        0, idx.flatten(), upstream.flatten(0, 1)
    )
    torch.testing.assert_close(out, emb.weight.detach()[idx], rtol=0, atol=0)
    torch.testing.assert_close(emb.weight.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("t_q", "t_k", "causal", "padded"),
    [
        (13, 13, True, False),
        (13, 13, True, True),
        (7, 13, True, True),  # the last 7 of 13 cached positions
        (1, 13, True, True),  # one decode step
        (13, 13, False, True),
    ],
)
def test_blockwise_attention_equals_the_formula(t_q, t_k, causal, padded):
    (q, k, v), _, _ = _inputs(2, 4, 2, t_q, t_k, 8, torch.float64)
    key_padding_mask = _left_padding(2, t_k) if padded else None
    expected, _ = scaled_dot_product_attention(
        q, k, v, build_mask(t_q, t_k, causal, key_padding_mask, q.device)
    )
    out = blockwise_attention(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask, block_size=5
    )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_softmax_zero_if_empty_is_softmax_with_zero_rows_and_zero_gradients_where_all_masked():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 9, generator=g, dtype=torch.float64)
    hidden = torch.rand(3, 4, 9, generator=g) < 0.5
    hidden[..., 0] = False  # every row keeps key 0 visible,
    hidden[0, 1] = True  # but this one, whose keys are all masked
    visible = ~hidden.all(-1)
    masked = scores.masked_fill(hidden, float("-inf")).requires_grad_()
    weights = softmax_zero_if_empty(masked)
    expected = torch.softmax(masked.detach()[visible], -1)
    torch.testing.assert_close(weights[visible], expected, rtol=1e-12, atol=1e-15)
    assert torch.all(weights[0, 1] == 0)
    upstream = torch.randn(3, 4, 9, generator=g, dtype=torch.float64)
    (weights * upstream).sum().backward()
    ref = masked.detach()[visible].requires_grad_()
    (torch.softmax(ref, -1) * upstream[visible]).sum().backward()
    torch.testing.assert_close(masked.grad[visible], ref.grad, rtol=1e-12, atol=1e-15)
    assert torch.all(masked.grad[0, 1] == 0)


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_formula_matches_eager_forward_and_backward(padded):
    # Traced, the formula uses softmax_zero_if_empty; eagerly torch.softmax.
    (q, k, v), _, do64 = _inputs(2, 4, 2, 12, 12, 8, torch.float32)
    key_padding_mask = _left_padding(2, 12) if padded else None

    def run(fn):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*inputs, causal=True, key_padding_mask=key_padding_mask)
        out.backward(do64.float())
        return out, [t.grad for t in inputs]

    eager, eager_grads = run(blockwise_attention)
    compiled, compiled_grads = run(torch.compile(blockwise_attention, fullgraph=True))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [64, 200])  # blockwise (bf16 training, T ≤ 128), torch's fused kernel
def test_cpu_attend_bf16_training_gradients_stay_close_to_float64(t):
    (q, k, v), (q64, k64, v64), do64 = _inputs(2, 4, 2, t, t, 32, torch.bfloat16)
    assert blockwise_is_faster(q, t) == (t <= 128)
    out, _ = cpu_attend(q, k, v, causal=True, backend="sdpa")
    out.backward(do64.to(torch.bfloat16))
    refs = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    ref, _ = scaled_dot_product_attention(*refs, causal_mask(t, t))
    ref.backward(do64)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    for ours, theirs in zip((q, k, v), refs, strict=True):
        # Gradients sum T bf16-rounded products: relative error a few × 2^-9, on values of O(1).
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=5e-2, atol=5e-2)


def test_cpu_attend_returns_the_weights_of_the_formula():
    (q, k, v), _, _ = _inputs(1, 4, 2, 6, 6, 8, torch.float32)
    with torch.no_grad():
        out, weights = cpu_attend(q, k, v, need_weights=True)
        expected_out, expected_weights = attend(q, k, v, need_weights=True)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)


def _model() -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=13, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
    )
    return DecoderLM(cfg)


def _logits_and_grads(model: DecoderLM, idx: torch.Tensor, run=None) -> tuple[torch.Tensor, dict]:
    """Logits and the next-token loss's gradients of `model`, called through `run` (or itself)."""
    model.zero_grad(set_to_none=True)
    logits = (model if run is None else run)(idx[:, :-1])
    next_token_loss(logits, idx[:, 1:]).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_optimized_model_gives_the_plain_logits_and_gradients_eager_and_compiled(monkeypatch):
    blockwise_calls = []

    def counted_blockwise(*args, **kwargs):
        blockwise_calls.append(1)  # traced once per layer under torch.compile
        return blockwise_attention(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "blockwise_attention", counted_blockwise)
    plain = _model()
    idx = torch.randint(0, 13, (3, 25), generator=torch.Generator().manual_seed(1))
    expected_logits, expected_grads = _logits_and_grads(plain, idx)
    fast = optimize(_model())
    # Eagerly in fp32 the CPU path is the embedding's gradient kernel; compiled, it is also the
    # blockwise formula (fp32 training, T ≤ 256), in both of the 2 layers.
    for run, n_blockwise in ((fast, 0), (torch.compile(fast), 2)):
        blockwise_calls.clear()
        logits, grads = _logits_and_grads(fast, idx, run)
        assert len(blockwise_calls) == n_blockwise
        # fp32 with sums in another order: logits of O(1) and gradients of O(0.1) differ by ~2e-7.
        torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_optimize_keeps_the_tie_and_state_dict_and_enabled_false_restores_the_plain_model():
    model = _model()
    keys = list(model.state_dict())
    weight = model.tok_emb.weight
    assert optimize(model) is model
    swapped = model.tok_emb
    assert type(swapped) is CPUEmbedding and model.tok_emb.weight is weight
    assert model.head.weight is model.tok_emb.weight  # the tie survives
    assert all(block.attn.attend is cpu_attend for block in model.blocks)
    assert list(model.state_dict()) == keys
    optimize(model)  # idempotent
    assert model.tok_emb is swapped
    optimize(model, enabled=False)
    assert type(model.tok_emb) is nn.Embedding and model.tok_emb.weight is weight
    assert model.head.weight is model.tok_emb.weight
    assert all(block.attn.attend is attend for block in model.blocks)
    assert list(model.state_dict()) == keys


def test_optimized_applies_its_setting_and_restores_the_previous_state_on_exit():
    model = _model()
    plain_emb = model.tok_emb
    with optimized(model) as same:
        assert same is model and type(model.tok_emb) is CPUEmbedding
        assert model.blocks[0].attn.attend is cpu_attend
        with optimized(model, enabled=False):
            assert type(model.tok_emb) is nn.Embedding
            assert model.blocks[0].attn.attend is attend
        assert type(model.tok_emb) is CPUEmbedding
        assert model.blocks[0].attn.attend is cpu_attend
    assert model.tok_emb is plain_emb and model.head.weight is plain_emb.weight
    assert all(block.attn.attend is attend for block in model.blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [7, 93, 100])
def test_a_padded_prompt_attends_as_closely_to_float64_as_the_fused_kernel(dtype, t, monkeypatch):
    monkeypatch.setattr(f32_attention, "available", lambda: False)  # SDPA's path, as without it
    (q, k, v), (q64, k64, v64), _ = _inputs(3, 6, 2, t, t, 16, dtype)
    q, k, v = (x.detach() for x in (q, k, v))
    exact = torch.nn.functional.scaled_dot_product_attention(
        q64, k64, v64, is_causal=True, enable_gqa=True
    )
    fused = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    with torch.no_grad():
        assert pads(q, k, True, None, None)
        got, _ = cpu_attend(q, k, v)  # (3, 6, t, 16): padded to a multiple of 16, cut back
    assert got.shape == fused.shape and torch.equal(got, padded_self_attention(q, k, v, None))
    ulp = torch.finfo(dtype).eps * exact.abs().max()
    fused_error = (fused.double() - exact).abs().max()
    assert (got.double() - exact).abs().max() <= 2 * fused_error + ulp


def test_only_causal_self_attention_of_other_lengths_without_gradients_is_padded():
    q, k = torch.randn(1, 4, 93, 8), torch.randn(1, 2, 93, 8)
    with torch.no_grad():
        assert pads(q, k, True, None, None)
        assert not pads(q[:, :, :80], k[:, :, :80], True, None, None)  # a multiple of 16
        assert not pads(q[:, :, :1], k[:, :, :1], True, None, None)  # one query
        assert not pads(q, k, False, None, None)  # not causal
        assert not pads(q[:, :, :50], k, True, None, None)  # a later chunk: Tq < Tk
        assert not pads(q, k, True, torch.ones(1, 93, dtype=torch.bool), None)  # a key mask
        assert not pads(q, k, True, None, 32)  # a sliding window
    assert not pads(q.requires_grad_(), k, True, None, None)  # training
