import math

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig, next_token_loss
from decoderlm.model.block import Block


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, context_length=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    return ModelConfig(**{**base, **overrides})


def test_forward_returns_logits_over_the_vocabulary():
    model = DecoderLM(ModelConfig.from_preset("llama-tiny"))
    assert model(torch.randint(0, 2048, (3, 10))).shape == (3, 10, 2048)


def test_gpt2_init_scales_residual_projections():
    cfg = tiny(n_layers=8, d_model=256, n_heads=8, n_kv_heads=8, vocab_size=512)
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    residual_std = 0.02 / math.sqrt(2 * 8)  # N(0, 0.02/√(2·n_layers)) for attn.proj and mlp.down
    assert model.blocks[3].attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[3].mlp.down.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[3].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(model.blocks[0].attn.qkv.bias == 0)


def test_initial_loss_is_close_to_uniform_prediction():
    torch.manual_seed(0)
    model = DecoderLM(tiny())
    idx = torch.randint(0, 97, (4, 33))
    loss = next_token_loss(model(idx[:, :-1]), idx[:, 1:])
    assert loss.item() == pytest.approx(math.log(97), abs=0.05)  # small init → near-uniform logits


def test_tied_head_shares_the_embedding_matrix_and_untied_does_not():
    tied, untied = DecoderLM(tiny()), DecoderLM(tiny(tie_embeddings=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 97 * 32


def test_num_params_without_embeddings_and_flops_per_token():
    cfg = tiny(position="learned", tie_embeddings=False)
    model = DecoderLM(cfg)
    assert model.num_params() - model.num_params(exclude_embeddings=True) == 97 * 32 + 64 * 32
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # forward: 2 FLOPs per weight + QKᵀ and AV: 2·2·n_layers·n_heads·head_dim·T; training ×3
    assert model.flops_per_token(16, training=False) == 2 * n_matmul + 4 * 2 * 4 * 8 * 16
    assert model.flops_per_token(16) == 3 * model.flops_per_token(16, training=False)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_computes_the_norm_placement_equations(placement):
    torch.manual_seed(0)
    block = Block(tiny(norm_placement=placement)).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        if placement == "pre":  # x + Attn(LN(x)), then + MLP(LN(·))
            h = x + block.attn(block.norm1(x))
            expected = h + block.mlp(block.norm2(h))
        else:  # LN(x + Attn(x)), then LN(· + MLP(·))
            h = block.norm1(x + block.attn(x))
            expected = block.norm2(h + block.mlp(h))
        torch.testing.assert_close(block(x), expected)


def test_post_ln_model_has_no_final_norm_and_trains_a_step():
    model = DecoderLM(tiny(norm_placement="post", position="sinusoidal", norm="layernorm"))
    assert isinstance(model.norm, torch.nn.Identity)
    idx = torch.randint(0, 97, (2, 12))
    next_token_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_longer_than_context_is_a_clear_error():
    with pytest.raises(DecoderLMError, match="sequence length 65 exceeds context_length=64"):
        DecoderLM(tiny())(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal"])
def test_left_padded_row_with_shifted_positions_equals_unpadded_row(position):
    torch.manual_seed(0)
    model = DecoderLM(tiny(position=position, qk_norm=True, mlp="swiglu", norm="rmsnorm")).eval()
    idx = torch.randint(0, 97, (1, 9))
    pad = 4
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), idx], dim=1)
    positions = (torch.arange(pad + 9) - pad).clamp(min=0).unsqueeze(0)  # (B, T)
    key_padding_mask = (
        torch.arange(pad + 9).unsqueeze(0) >= pad
    )  # (B, Tk): padding keys are invalid
    with torch.no_grad():
        alone = model(idx)
        batched = model(padded, positions=positions, key_padding_mask=key_padding_mask)
    torch.testing.assert_close(batched[:, pad:], alone, rtol=1e-5, atol=1e-5)


def test_dropout_only_acts_in_training_mode():
    model = DecoderLM(tiny(dropout=0.5))
    idx = torch.randint(0, 97, (2, 8))
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_backends_give_the_same_model_in_float64(backend):
    torch.manual_seed(0)
    reference = DecoderLM(tiny(attn_backend="sdpa")).double().eval()
    other = DecoderLM(tiny(attn_backend=backend)).double().eval()
    other.load_state_dict(reference.state_dict())
    idx = torch.randint(0, 97, (2, 23))
    with torch.no_grad():
        torch.testing.assert_close(other(idx), reference(idx), rtol=1e-10, atol=1e-10)
