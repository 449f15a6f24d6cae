import json

import pytest

from decoderlm import PRESETS, ConfigError, DecoderLM, ModelConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(n_heads=6, n_kv_heads=4, d_model=48), "n_heads=6 must be divisible by n_kv_heads=4"),
        (dict(d_model=100, n_heads=8), "d_model=100 must be divisible by n_heads=8"),
        (dict(position="alibi"), "position='alibi' is not allowed; choose one of: sinusoidal"),
        (dict(mlp="tanh"), "mlp='tanh' is not allowed"),
        (dict(norm="batchnorm"), "norm='batchnorm' is not allowed"),
        (dict(norm_placement="middle"), "norm_placement='middle' is not allowed"),
        (dict(attn_backend="xformers"), "attn_backend='xformers' is not allowed"),
        (dict(n_kv_heads=0), "n_kv_heads=0 must be between 1 and n_heads=4"),
        (dict(n_kv_heads=8), "n_kv_heads=8 must be between 1 and n_heads=4"),
        (dict(vocab_size=0), "vocab_size=0 must be a positive integer"),
        (dict(dropout=1.5), "dropout=1.5 must be in [0, 1)"),
        (dict(attn_backend="flash", dropout=0.1), "attn_backend='flash' has no attention dropout"),
        (dict(position="rope", head_dim=15), "head_dim=15 must be even for RoPE"),
        (
            dict(rope_scaling={"type": "su", "factor": 2.0}),
            "rope_scaling type='su' is not supported",
        ),
    ],
)
def test_invalid_config_gives_one_line_error_naming_field(overrides, message):
    base = dict(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=4)
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{**base, **overrides})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_field_and_unknown_preset_are_rejected():
    with pytest.raises(ConfigError, match="unknown model config field 'n_layer'"):
        ModelConfig.from_dict({"n_layer": 2})
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'; allowed: seed, gpt2"):
        ModelConfig.from_preset("gpt5")


def test_defaults_are_derived():
    cfg = ModelConfig(vocab_size=64, d_model=96, n_heads=6, n_layers=1)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.qkv_bias) == (6, 16, 384, True)
    swiglu = ModelConfig(vocab_size=64, d_model=96, n_heads=6, n_layers=1, mlp="swiglu")
    assert swiglu.d_ff == 256  # 8/3·96 = 256, already a multiple of 64
    assert (
        ModelConfig(vocab_size=64, d_model=96, n_heads=6, n_layers=1, n_kv_heads=2).group_size == 3
    )


def test_json_round_trip(tmp_path):
    cfg = ModelConfig.from_preset("llama-1b")
    cfg.to_json(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())["rope_scaling"]["type"] == "llama3"
    assert ModelConfig.from_json(tmp_path / "c.json") == cfg


@pytest.mark.parametrize(
    ("name", "millions"),
    [
        ("seed", 17.6),
        ("gpt2", 124.4),
        ("llama-tiny", 1.25),
        ("llama-15m", 14.5),
        ("llama-55m", 54.9),
    ],
)
def test_preset_parameter_counts(name, millions):
    model = DecoderLM(ModelConfig.from_preset(name))
    assert model.num_params() / 1e6 == pytest.approx(millions, rel=0.01)


def test_large_presets_have_the_published_parameter_counts():
    # Counted from the config without building the model: GPT-2 XL has 1.56B, Llama 3.2 1B has 1.24B.
    def count(cfg: ModelConfig) -> int:
        d, L, hd = cfg.d_model, cfg.n_layers, cfg.head_dim
        attn = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d
        mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_ff
        emb = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
        pos = cfg.context_length * d if cfg.position == "learned" else 0
        return L * (attn + mlp) + emb + pos

    assert count(ModelConfig.from_preset("gpt2-xl")) / 1e9 == pytest.approx(1.56, rel=0.01)
    assert count(ModelConfig.from_preset("llama-1b")) / 1e9 == pytest.approx(1.24, rel=0.01)
    assert set(PRESETS) >= {
        "seed",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "llama-tiny",
        "llama-1b",
    }
