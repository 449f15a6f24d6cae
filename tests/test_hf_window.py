"""Sliding windows from and to Hugging Face: Mistral's on every layer, Qwen2's on the last layers.

Tiny random transformers models whose sequences are longer than their window, saved, imported and
compared: fp32 logits within 1e-4 (the issue's bar; rounding differences are ~1e-6) and 32 greedy
tokens with a KV cache equal to transformers' `generate`. Weights are re-drawn from N(0, 0.2²) as
in tests/test_hf.py, so that a wrong window moves the logits by O(1) (checked below: the window
changes transformers' own logits by far more than the tolerance).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from decoderlm import hf  # noqa: E402
from decoderlm.errors import DecoderLMError  # noqa: E402
from decoderlm.inference.generate import generate  # noqa: E402
from decoderlm.model.config import ModelConfig  # noqa: E402
from decoderlm.model.lm import DecoderLM  # noqa: E402

LOGITS_ATOL = 1e-4
VOCAB = 96
WINDOW = 8
SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    vocab_size=VOCAB,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
HF_CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(
        **SHAPE, num_hidden_layers=2, sliding_window=WINDOW
    ),
    # Layers ≥ max_window_layers = 1 use the window: layer 0 full, layers 1 and 2 windowed.
    "qwen2-last-layers": lambda: transformers.Qwen2Config(
        **SHAPE,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    "qwen3-last-layers": lambda: transformers.Qwen3Config(
        **SHAPE,
        num_hidden_layers=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
}
EXPECTED = {  # (sliding_window, sliding_window_layers) of the import
    "mistral": (WINDOW, None),
    "qwen2-last-layers": (WINDOW, (1, 2)),
    "qwen3-last-layers": (WINDOW, (1,)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            is_gain = p.dim() == 1 and "norm" in name and name.endswith("weight")
            p.copy_(noise + 1.0 if is_gain else noise)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def saved(request, tmp_path_factory):
    """(family, directory written by save_pretrained, the transformers model in eval mode)."""
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[request.param]())
    _randomize(model, seed=len(request.param))
    model.save_pretrained(path)
    return request.param, path, model.eval()


def _tokens(t: int = 40, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _max_diff(ours: DecoderLM, theirs: torch.nn.Module, idx: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(idx) - theirs(idx).logits).abs().max().item()


def test_import_maps_the_window_and_keeps_the_context(saved):
    family, path, _ = saved
    ours, _ = hf.load_hf(path)
    assert (ours.config.sliding_window, ours.config.sliding_window_layers) == EXPECTED[family]
    assert ours.config.context_length == 64  # max_position_embeddings, not the window


def _rebuilt(model: DecoderLM, **fields) -> DecoderLM:
    """The same weights in a model whose config has `fields` changed, in eval mode."""
    twin = DecoderLM(ModelConfig.from_dict({**model.config.to_dict(), **fields}))
    twin.load_state_dict(model.state_dict())
    return twin.eval()


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_logits_past_the_window_match_transformers(saved, backend):
    _, path, theirs = saved
    ours, _ = hf.load_hf(path)
    idx = _tokens()  # 40 tokens, 5 windows
    assert _max_diff(_rebuilt(ours, attn_backend=backend), theirs, idx) <= LOGITS_ATOL
    # The window matters here: without it our logits are O(1) away from transformers'.
    unwindowed = _rebuilt(ours, sliding_window=None, sliding_window_layers=None)
    assert _max_diff(unwindowed, theirs, idx) > 0.1


def test_greedy_32_tokens_past_the_window_match_transformers_generate(saved):
    _, path, theirs = saved
    ours, _ = hf.load_hf(path)
    prompt = _tokens(t=12, b=1, seed=1)  # 12 + 32 tokens, windows of 8
    with torch.no_grad():
        expected = theirs.generate(prompt, max_new_tokens=32, do_sample=False)
    assert generate(ours, prompt, max_new_tokens=32, temperature=0.0) == expected.tolist()


def test_export_round_trips_and_loads_in_transformers_with_the_window(saved, tmp_path):
    family, path, theirs = saved
    ours, _ = hf.load_hf(path)
    hf.export_hf(ours, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.sliding_window == WINDOW
    if family != "mistral":  # the same layers windowed
        assert reloaded.config.layer_types == theirs.config.layer_types
    assert _max_diff(ours, reloaded, _tokens()) <= LOGITS_ATOL
    back, _ = hf.load_hf(tmp_path)
    assert back.config == ours.config


# huggingface.co/mistralai/Mistral-7B-v0.1/config.json
MISTRAL_7B_V01 = dict(
    architectures=["MistralForCausalLM"], bos_token_id=1, eos_token_id=2, hidden_act="silu",
    hidden_size=4096, initializer_range=0.02, intermediate_size=14336,
    max_position_embeddings=32768, model_type="mistral", num_attention_heads=32,
    num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=10000.0,
    sliding_window=4096, tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=32000,
)  # fmt: skip


def test_mistral_7b_config_keeps_its_32k_context_and_4k_window():
    ours = hf.config_from_hf(MISTRAL_7B_V01)
    assert (ours.context_length, ours.sliding_window, ours.sliding_window_layers) == (
        32768,
        4096,
        None,
    )
    assert hf.config_to_hf(ours)["sliding_window"] == 4096


def test_a_mistral_window_of_16_runs_a_40_token_input():
    config = transformers.MistralConfig(**SHAPE, num_hidden_layers=1, sliding_window=16)
    ours = DecoderLM(hf.config_from_hf(config.to_dict()))
    assert ours(_tokens(t=40)).shape == (2, 40, VOCAB)  # was refused: context_length = 16


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(use_sliding_window=False, sliding_window=WINDOW, max_window_layers=0), (None, None)),
        (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), (WINDOW, None)),
        (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=4), (None, None)),
        (
            dict(
                use_sliding_window=True,
                sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            ),
            (WINDOW, (0, 2)),
        ),
    ],
    ids=["off", "every-layer", "no-layer", "layer-types"],
)
def test_qwen2_windowed_layers_are_those_transformers_builds(overrides, expected):
    config = transformers.Qwen2Config(**SHAPE, num_hidden_layers=3, **overrides)
    # What transformers' Qwen2Attention of each layer gets: its window, or None.
    windows = [
        config.sliding_window if t == "sliding_attention" else None for t in config.layer_types
    ]
    window, layers = expected
    assert windows == [window if layers is None or i in layers else None for i in range(3)]
    ours = hf.config_from_hf(config.to_dict())
    assert (ours.sliding_window, ours.sliding_window_layers) == expected


def _ours(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB, context_length=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
        d_ff=48, mlp="swiglu", norm="rmsnorm", position="rope", bias=False,
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def test_our_windowed_llama_exports_as_mistral_and_qwen_layers_as_max_window_layers():
    mistral = hf.config_to_hf(_ours(sliding_window=WINDOW))
    assert (mistral["model_type"], mistral["sliding_window"]) == ("mistral", WINDOW)
    qwen = hf.config_to_hf(_ours(qkv_bias=True, sliding_window=WINDOW, sliding_window_layers=[2]))
    assert qwen["model_type"] == "qwen2"
    assert (qwen["use_sliding_window"], qwen["sliding_window"], qwen["max_window_layers"]) == (
        True,
        WINDOW,
        2,
    )
    assert hf.config_to_hf(_ours(qkv_bias=True))["use_sliding_window"] is False


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            dict(qkv_bias=True, sliding_window=WINDOW, sliding_window_layers=[0, 2]),
            r"sliding_window_layers=\(0, 2\) \(Qwen windows the layers from one on\)",
        ),
        (dict(sliding_window=WINDOW, sliding_window_layers=[1]), "Mistral windows every layer"),
        (dict(bias=True, sliding_window=WINDOW), "a sliding_window with biases"),
        (
            dict(
                position="learned",
                mlp="gelu_tanh",
                norm="layernorm",
                bias=True,
                n_kv_heads=4,
                sliding_window=WINDOW,
            ),
            r"a sliding_window \(GPT-2 has none\)",
        ),
    ],
)
def test_export_refuses_windows_no_hf_family_has(overrides, reason):
    with pytest.raises(DecoderLMError, match=rf"cannot export to Hugging Face.*{reason}"):
        hf.config_to_hf(_ours(**overrides))
