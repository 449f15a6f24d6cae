import math

import pytest
import torch

from decoderlm.model.positional import (
    RotaryEmbedding,
    apply_rope,
    rope_inverse_frequencies,
    sinusoidal_table,
)


def test_sinusoidal_values_match_the_formula():
    table = sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def _rotate(x: torch.Tensor, pos: int, rope: RotaryEmbedding) -> torch.Tensor:
    cos, sin = (t.to(x.dtype) for t in rope(torch.tensor([pos])))
    return apply_rope(x.view(1, 1, 1, -1), cos, sin).view(-1)


def test_rope_inner_product_depends_only_on_relative_position():
    rope = RotaryEmbedding(
        256, 32
    )  # cos/sin tables are stored in float32: ~1e-7 relative error each
    g = torch.Generator().manual_seed(0)
    q = torch.randn(32, generator=g, dtype=torch.float64)
    k = torch.randn(32, generator=g, dtype=torch.float64)
    for m, n in [(5, 2), (103, 100), (250, 247)]:  # m − n = 3 every time
        dot = _rotate(q, m, rope) @ _rotate(k, n, rope)
        assert dot.item() == pytest.approx(
            (_rotate(q, 3, rope) @ _rotate(k, 0, rope)).item(), abs=1e-5
        )
    far = _rotate(q, 40, rope) @ _rotate(k, 0, rope)
    assert abs(far.item() - (_rotate(q, 3, rope) @ _rotate(k, 0, rope)).item()) > 1e-3


def test_rope_rotation_preserves_norms():
    rope = RotaryEmbedding(64, 16)
    x = torch.randn(2, 3, 64, 16)
    cos, sin = rope(torch.arange(64))
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


def test_rope_at_position_zero_is_identity_and_per_row_positions_broadcast():
    rope = RotaryEmbedding(16, 8)
    x = torch.randn(2, 4, 3, 8)
    torch.testing.assert_close(apply_rope(x, *rope(torch.zeros(3, dtype=torch.long))), x)
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])  # (B, T): a left-padded second row
    rows = apply_rope(x, *rope(positions))
    torch.testing.assert_close(rows[1], apply_rope(x[1:], *rope(torch.arange(5, 8)))[0])


def test_llama3_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inverse_frequencies(64, 500000.0, scaling)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)
