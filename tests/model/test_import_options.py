"""The model options the recurrent Hugging Face families need, each off by default: blocks without
an MLP, partial RoPE, the attention output gate and RMSNorm with its gain stored as 1 + w."""

from __future__ import annotations

import pytest
import torch

from decoderlm.errors import ConfigError
from decoderlm.model.attention import CausalSelfAttention
from decoderlm.model.config import ModelConfig
from decoderlm.model.layers import RMSNorm, make_norm
from decoderlm.model.lm import DecoderLM
from decoderlm.model.positional import apply_rope

TINY = dict(vocab_size=32, context_length=16, d_model=16, n_layers=2, n_heads=2)


def test_defaults_leave_the_model_as_before():
    config = ModelConfig(**TINY)
    assert (config.mlp, config.rotary_dim, config.attn_output_gate) == ("gelu", None, False)
    names = set(DecoderLM(config).state_dict())
    assert "blocks.0.mlp.up.weight" in names and "blocks.0.norm2.weight" in names
    assert DecoderLM(config).blocks[0].attn.qkv.weight.shape == (3 * 16, 16)


def test_mlp_none_builds_blocks_of_the_mixer_alone():
    model = DecoderLM(ModelConfig(**TINY, mlp="none"))
    assert not any(".mlp." in n or ".norm2." in n for n in model.state_dict())
    block, x = model.blocks[0], torch.randn(1, 5, 16)
    expected = x + block.attn(block.norm1(x))
    torch.testing.assert_close(block(x), expected)


def test_partial_rope_rotates_the_first_dims_and_passes_the_rest():
    x = torch.randn(1, 2, 5, 8)
    angles = torch.rand(5, 2) * 3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4], apply_rope(x[..., :4], cos, sin))


@pytest.mark.parametrize("rotary_dim", [0, 3, 10])
def test_rotary_dim_must_be_even_and_within_the_head(rotary_dim):
    with pytest.raises(ConfigError, match=f"rotary_dim={rotary_dim}"):
        ModelConfig(**TINY, position="rope", rotary_dim=rotary_dim)


def test_output_gate_multiplies_the_heads_by_sigmoid_of_its_projection():
    config = ModelConfig(**TINY, attn_output_gate=True, bias=False)
    attn = CausalSelfAttention(config).eval()
    assert attn.qkv.weight.shape == (4 * 16, 16)  # W_Q | W_G | W_K | W_V
    x = torch.randn(1, 5, 16)
    gate = torch.sigmoid(x @ attn.qkv.weight[16:32].t())
    plain = CausalSelfAttention(ModelConfig(**TINY, bias=False)).eval()
    with torch.no_grad():
        plain.qkv.weight.copy_(torch.cat([attn.qkv.weight[:16], attn.qkv.weight[32:]]))
        plain.proj.weight.copy_(attn.proj.weight)
        heads = {}  # the input of W_O: the heads' outputs, concatenated
        plain.proj.register_forward_hook(lambda _m, inputs, _o: heads.update(o=inputs[0]))
        plain(x)
        torch.testing.assert_close(attn(x), plain.proj(heads["o"] * gate))


def test_rmsnorm_1p_stores_the_gain_as_an_offset_from_one():
    config = ModelConfig(**TINY, norm="rmsnorm_1p")
    norm = make_norm(config)
    assert isinstance(norm, RMSNorm) and torch.equal(norm.weight, torch.zeros(16))
    plain = RMSNorm(16, config.norm_eps)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
        plain.weight.copy_(1 + norm.weight)
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), plain(x))
    model = DecoderLM(config)  # init_weights keeps a gain of 1
    assert torch.equal(model.blocks[0].norm1.weight, torch.zeros(16))
