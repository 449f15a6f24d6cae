"""Attention: the formula, its masks, MHA/GQA/MQA, and every backend against a float64 reference."""

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.model.attention import CausalSelfAttention, attend, scaled_dot_product_attention
from decoderlm.model.block import Block
from decoderlm.model.masks import build_mask, causal_mask

BACKENDS = ["math", "sdpa", "flash"]


@pytest.mark.parametrize("d_k", [64, 256])
def test_dot_product_variance_grows_with_dk_and_scaling_restores_unit_variance(d_k):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(200_000, d_k, generator=g, dtype=torch.float64)
    k = torch.randn(200_000, d_k, generator=g, dtype=torch.float64)
    dots = (q * k).sum(-1)
    # var(q·k) = d_k for independent unit-variance entries; 200k samples → relative error ~0.3%.
    assert dots.var().item() == pytest.approx(d_k, rel=0.02)
    assert (dots / d_k**0.5).var().item() == pytest.approx(1.0, rel=0.02)


def test_causal_weights_rows_sum_to_one_and_upper_triangle_is_zero():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 64) for _ in range(3))
    out, weights = scaled_dot_product_attention(q, k, v, causal_mask(8, 8))
    assert out.shape == (2, 4, 8, 64) and weights.shape == (2, 4, 8, 8)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 8))
    assert torch.all(weights.triu(diagonal=1) == 0)
    assert torch.all(weights[..., causal_mask(8, 8)] > 0)


def test_additive_mask_equals_boolean_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    keep = causal_mask(5, 5)
    additive = torch.zeros(5, 5).masked_fill(~keep, float("-inf"))  # M = 0 or −∞
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, additive)[0],
        scaled_dot_product_attention(q, k, v, keep)[0],
    )


def test_seed_float_keep_mask_gives_causal_weights_and_the_float64_output():
    torch.manual_seed(0)
    T = 6
    q, k, v = (torch.randn(2, 3, T, 16) for _ in range(3))
    mask = torch.tril(torch.ones(T, T)).unsqueeze(0).unsqueeze(0)  # the seed's: 1 = attend
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert torch.all(weights.triu(diagonal=1) == 0)
    q64, k64, v64 = q.double(), k.double(), v.double()
    scores = (q64 @ k64.transpose(-2, -1)) / 16**0.5
    ref = torch.softmax(scores.masked_fill(mask == 0, float("-inf")), dim=-1) @ v64
    # float32 against float64, T = 6 terms of O(1): rounding ~1e-7.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_float_masks_of_zeros_are_additive_and_other_values_are_refused():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    unmasked, _ = scaled_dot_product_attention(q, k, v)
    all_zero, _ = scaled_dot_product_attention(q, k, v, torch.zeros(4, 4))  # M = 0: no 1, additive
    torch.testing.assert_close(all_zero, unmasked, rtol=0, atol=0)
    for values in ([0.0, 0.5], [1.0, float("-inf")]):  # neither convention
        bad = torch.tensor(values).repeat(4, 2)  # (4, 4)
        with pytest.raises(DecoderLMError, match=r"values \{.*\}.*keep-mask.*additive") as info:
            scaled_dot_product_attention(q, k, v, bad)
        assert "\n" not in str(info.value)


def _additive(keep: torch.Tensor) -> torch.Tensor:
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))  # M = 0 or −∞


@pytest.mark.parametrize(
    "as_mask", [torch.Tensor.bool, torch.Tensor.float, _additive], ids=["bool", "float", "additive"]
)
def test_row_with_every_key_masked_has_zero_weights_output_and_gradients(as_mask):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 5, 8, generator=g, requires_grad=True) for _ in range(2))
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1] = False  # query 1 sees no key
    out, weights = scaled_dot_product_attention(q, k, v, as_mask(keep))
    out.backward(torch.randn(out.shape, generator=g))
    assert torch.all(weights[:, :, 1] == 0) and torch.all(out[:, :, 1] == 0)
    assert torch.all(q.grad[:, :, 1] == 0)
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    torch.testing.assert_close(weights[:, :, [0, 2]].sum(-1), torch.ones(1, 2, 2))


def test_causal_mask_is_bottom_right_aligned_for_cached_queries():
    # 2 queries that are the last 2 of 5 positions: query 0 is position 3, it sees keys 0..3.
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 5), expected)


def test_seed_block_maps_shape_to_itself():
    block = Block(ModelConfig.from_preset("seed"))
    x = torch.randn(8, 64, 256)
    assert block(x).shape == (8, 64, 256)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_positions_or_mask_attention_is_permutation_equivariant(backend):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, attn_backend=backend
    )
    attn = CausalSelfAttention(cfg).eval()
    x = torch.randn(2, 9, 32)
    perm = torch.randperm(9)
    with torch.no_grad():
        y = attn(x, causal=False)
        y_perm = attn(x[:, perm], causal=False)
    torch.testing.assert_close(y_perm, y[:, perm], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_equals_mha_with_repeated_kv(n_kv_heads):
    torch.manual_seed(0)
    h, hd, d = 4, 8, 32
    gqa_cfg = ModelConfig(
        vocab_size=16, d_model=d, n_layers=1, n_heads=h, n_kv_heads=n_kv_heads, attn_backend="math"
    )
    mha_cfg = ModelConfig(vocab_size=16, d_model=d, n_layers=1, n_heads=h, attn_backend="math")
    gqa, mha = CausalSelfAttention(gqa_cfg), CausalSelfAttention(mha_cfg)
    wq, wk, wv = gqa.qkv.weight.split(gqa.split_sizes)
    bq, bk, bv = gqa.qkv.bias.split(gqa.split_sizes)
    group = h // n_kv_heads

    def repeat(
        w,
    ):  # (Hkv·hd, …) → (H·hd, …): K/V head j serves query heads j·group … (j+1)·group − 1
        return w.unflatten(0, (n_kv_heads, hd)).repeat_interleave(group, 0).flatten(0, 1)

    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([wq, repeat(wk), repeat(wv)]))
        mha.qkv.bias.copy_(torch.cat([bq, repeat(bk), repeat(bv)]))
        mha.proj.load_state_dict(gqa.proj.state_dict())
    x = torch.randn(2, 7, d)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-6)


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation made while fn() runs, inside operators included."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize(("h_kv", "t_q"), [(2, 1), (1, 1), (2, 16)])
def test_gqa_formula_reads_kv_heads_without_copying_them_per_query_head(h_kv, t_q):
    b, h, t_k, d = 2, 8, 512, 32
    q, k, v = torch.randn(b, h, t_q, d), torch.randn(b, h_kv, t_k, d), torch.randn(b, h_kv, t_k, d)
    mask = torch.ones(b, t_k, dtype=torch.bool)
    mask[0, :100] = False
    with torch.inference_mode():
        largest = _largest_allocation(
            lambda: attend(q, k, v, causal=True, key_padding_mask=mask, backend="math")
        )
    # The largest is the float32 scores (B, H, Tq, Tk); K broadcast to the G = H / Hkv query
    # heads of its group would be copied into G·|K| bytes (as a broadcasting matmul does).
    scores, k_bytes = b * h * t_q * t_k * 4, k.nbytes
    assert largest <= max(scores, k_bytes) < (h // h_kv) * k_bytes


def _reference_and_inputs(b, h, h_kv, t_q, t_k, d, dtype, seed=0):
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


CASES = [  # (b, h, h_kv, t_q, t_k, causal, padded)
    (2, 4, 4, 1, 1, True, False),
    (2, 4, 2, 7, 7, True, False),
    (1, 4, 1, 129, 129, True, False),
    (1, 4, 2, 129, 129, False, False),
    (1, 2, 1, 1000, 1000, True, False),
    (2, 4, 2, 33, 33, True, True),
    (2, 4, 2, 5, 40, True, True),  # queries are the last 5 of 40 cached positions
    (2, 4, 2, 1, 40, False, True),  # one decode step over a key mask
    (2, 8, 2, 1, 40, True, True),  # a causal decode step, four query heads per K/V head
    (1, 4, 1, 1, 40, True, False),  # MQA decode step
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("b", "h", "h_kv", "t_q", "t_k", "causal", "padded"), CASES)
def test_backend_matches_float64_reference(backend, b, h, h_kv, t_q, t_k, causal, padded):
    d = 16
    (q, k, v), (q64, k64, v64), do64 = _reference_and_inputs(b, h, h_kv, t_q, t_k, d, torch.float32)
    key_padding_mask = _left_padding(b, t_k) if padded else None
    out, _ = attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask, backend=backend)
    out.backward(do64.float())
    ref_inputs = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    ref, _ = scaled_dot_product_attention(
        *ref_inputs, build_mask(t_q, t_k, causal, key_padding_mask, q.device)
    )
    ref.backward(do64)
    # float32 against float64: outputs to 1e-5, gradients (a longer chain of float32 sums) to 5e-5.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip((q, k, v), ref_inputs, strict=True):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_bf16_stays_close_to_float64(backend):
    (q, k, v), (q64, k64, v64), _ = _reference_and_inputs(1, 4, 2, 100, 100, 32, torch.bfloat16)
    out, _ = attend(q, k, v, causal=True, backend=backend)
    ref, _ = scaled_dot_product_attention(q64, k64, v64, causal_mask(100, 100))
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 0.002) in inputs and output.
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("t", [64, 200])
def test_sdpa_backend_bf16_training_gradients_stay_close_to_float64(t):
    (q, k, v), (q64, k64, v64), do64 = _reference_and_inputs(2, 4, 2, t, t, 32, torch.bfloat16)
    out, _ = attend(q, k, v, causal=True, backend="sdpa")
    out.backward(do64.to(torch.bfloat16))
    refs = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    ref, _ = scaled_dot_product_attention(*refs, causal_mask(t, t))
    ref.backward(do64)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    for ours, theirs in zip((q, k, v), refs, strict=True):
        # Gradients sum T bf16-rounded products: relative error a few × 2^-9, on values of O(1).
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal", "none"])
def test_model_is_causal_changing_token_j_leaves_earlier_logits_unchanged(backend, position):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50,
        context_length=32,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        position=position,
        attn_backend=backend,
    )
    model = DecoderLM(cfg).eval()
    idx = torch.randint(0, 50, (2, 20))
    changed = idx.clone()
    j = 11
    changed[:, j] = (idx[:, j] + 1) % 50
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
    assert (a[:, j:] - b[:, j:]).abs().amax() > 1e-3


def test_attention_module_returns_weights_with_math_path():
    cfg = ModelConfig(
        vocab_size=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, attn_backend="sdpa"
    )
    attn = CausalSelfAttention(cfg)
    out, weights = attn(torch.randn(1, 6, 32), need_weights=True)
    assert out.shape == (1, 6, 32) and weights.shape == (1, 4, 6, 6)
    assert torch.all(weights.triu(1) == 0)


def test_attn_scale_none_multiplies_scores_by_one_in_every_backend():
    """attn_scale="none" is softmax(QKᵀ + M)V: each backend equals the float64 formula with scale 1."""
    torch.manual_seed(0)
    base = dict(vocab_size=32, context_length=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    x = torch.randint(0, 32, (2, 16))
    logits = {}
    for backend in ("math", "sdpa", "flash"):
        torch.manual_seed(0)
        model = DecoderLM(ModelConfig(**base, attn_backend=backend, attn_scale="none")).double()
        logits[backend] = model(x)
    torch.manual_seed(0)
    scaled = DecoderLM(ModelConfig(**base)).double()(x)
    for backend in ("sdpa", "flash"):
        torch.testing.assert_close(logits[backend], logits["math"], rtol=1e-10, atol=1e-10)
    assert (logits["math"] - scaled).abs().max() > 1e-3  # the scale matters: not a no-op

    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    out, weights = scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(weights, torch.softmax(q @ k.transpose(-2, -1), dim=-1))
    torch.testing.assert_close(out, weights @ v)
