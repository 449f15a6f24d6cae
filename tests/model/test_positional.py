import math

import pytest
import torch

from decoderlm.errors import ConfigError
from decoderlm.model.config import ModelConfig
from decoderlm.model.positional import (
    RotaryEmbedding,
    apply_rope,
    rope_attention_factor,
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


# ---- context extension: dynamic NTK, YaRN, LongRoPE against transformers.modeling_rope_utils ----

LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(64)],
    "long_factor": [1.0 + 0.5 * i for i in range(64)],
    "original_max_position_embeddings": 4096,
}
# head_dim 128, theta 1e6 and a 4096 original length: yarn's ramp spans frequencies 13..31 of 64.
EXTENSIONS = {
    "dynamic": {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-mscale": {
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "truncate": False,
    },
    "longrope": LONGROPE,
    "longrope-factor": {**LONGROPE, "factor": 8.0},
}


def _transformers_rope(scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """transformers' (inv_freq, attention_factor) for `scaling` at head_dim 128, theta 1e6."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in scaling.items() if k != "type"}
    original = params.pop("original_max_position_embeddings")
    if scaling["type"] != "dynamic":  # dynamic's original length is max_position_embeddings
        params["original_max_position_embeddings"] = original
    config = transformers.LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        max_position_embeddings=original * (1 if scaling["type"] == "dynamic" else 4),
        rope_parameters={"rope_type": scaling["type"], "rope_theta": 1e6, **params},
    )
    return ROPE_INIT_FUNCTIONS[scaling["type"]](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("seq_len", [None, 2048, 4097, 12000])
@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_extended_inverse_frequencies_and_attention_factor_match_transformers(name, seq_len):
    # transformers computes in float32 (relative rounding ~1e-7), ours in float64.
    scaling = EXTENSIONS[name]
    theirs, factor = _transformers_rope(scaling, seq_len)
    ours = rope_inverse_frequencies(128, 1e6, scaling, seq_len)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling, 4 * 4096) == pytest.approx(factor, rel=1e-12)


def test_yarn_default_attention_factor_is_0_1_ln_factor_plus_1_and_scales_cos_sin():
    scaling = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}
    a = 0.1 * math.log(8.0) + 1
    assert rope_attention_factor(scaling, 128) == pytest.approx(a, rel=1e-15)
    cos, sin = RotaryEmbedding(128, 16, 10000.0, scaling)(torch.arange(128))
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, a**2))


def _reference(positions: torch.Tensor, scaling: dict, seq_len: int, a: float = 1.0):
    """cos/sin in float64 from rope_inverse_frequencies at this sequence length."""
    inv_freq = rope_inverse_frequencies(16, 10000.0, scaling, seq_len)
    angles = positions[..., None].double() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * a).float(), (angles.sin() * a).float()


DYNAMIC = {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}


def test_dynamic_rescales_the_base_by_the_calls_largest_position():
    rope = RotaryEmbedding(64, 16, 10000.0, DYNAMIC)
    plain = RotaryEmbedding(64, 16, 10000.0)
    # Within L₀ = 16 it is plain RoPE; angles up to 64 rad in float32 round to ~4e-6.
    within = torch.arange(16)
    torch.testing.assert_close(rope(within), plain(within), rtol=0, atol=1e-5)
    # One KV-cached step at position 40 of a row: the base is that of a 41-token sequence...
    step = torch.tensor([[40]])
    torch.testing.assert_close(rope(step), _reference(step, DYNAMIC, 41), rtol=0, atol=1e-5)
    # ...and a row's positions follow the longest row of the batch, as in transformers.
    rows = torch.tensor([[0, 1, 2], [38, 39, 40]])
    torch.testing.assert_close(rope(rows), _reference(rows, DYNAMIC, 41), rtol=0, atol=1e-5)
    assert (rope(step)[0] - plain(step)[0]).abs().max() > 0.1


def test_longrope_uses_the_long_factors_once_a_call_reaches_the_original_length():
    scaling = {
        "type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [1.0 + i for i in range(8)],
        "original_max_position_embeddings": 16,
    }
    rope = RotaryEmbedding(64, 16, 10000.0, scaling)
    a = math.sqrt(1 + math.log(64 / 16) / math.log(16))  # factor = context_length / L₀
    for positions, seq_len in [
        (torch.arange(16), 16),
        (torch.arange(17), 17),
        (torch.tensor([[20]]), 21),
    ]:
        expected = _reference(positions, scaling, seq_len, a)
        torch.testing.assert_close(rope(positions), expected, rtol=0, atol=1e-6)
    short, long = rope(torch.arange(16)), rope(torch.arange(17))
    assert (short[0] - long[0][:16]).abs().max() > 0.1  # the factor set switched


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        (
            {"type": "su", "factor": 2.0},
            r"rope_scaling type='su' is not supported; allowed: linear, dynamic, yarn, longrope, llama3",
        ),
        (
            {"type": "dynamic", "factor": 2.0},
            r"type='dynamic' needs original_max_position_embeddings",
        ),
        (
            {**DYNAMIC, "beta_fast": 32},
            r"rope_scaling key 'beta_fast' is not used by type='dynamic'; allowed: factor, original",
        ),
        ({**DYNAMIC, "factor": -1.0}, r"rope_scaling factor=-1.0 must be a number > 0"),
        (
            {
                "type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0] * 8,
                "original_max_position_embeddings": 16,
            },
            r"short_factor has 1 entries and must have head_dim/2=8",
        ),
    ],
)
def test_bad_rope_scaling_is_a_one_line_config_error(scaling, message):
    with pytest.raises(ConfigError, match=message) as error:
        ModelConfig(d_model=32, n_heads=2, position="rope", rope_scaling=scaling)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_sequence_dependent_rope_traces_into_one_graph_without_host_sync(name):
    # Compiled decoding (generate(compile=True)) traces the one-token step: choosing the
    # frequencies from positions.max() must stay on the device, with no data-dependent branch.
    torch._dynamo.reset()
    scaling = {**EXTENSIONS[name], "original_max_position_embeddings": 16}
    if name == "longrope":
        scaling.update(short_factor=[1.0] * 8, long_factor=[1.0 + i for i in range(8)])
    rope = RotaryEmbedding(64, 16, 10000.0, scaling)
    compiled = torch.compile(rope, fullgraph=True, backend="eager")
    for positions in (torch.tensor([[3]]), torch.tensor([[40]])):  # within and past L₀
        torch.testing.assert_close(compiled(positions), rope(positions), rtol=0, atol=0)
