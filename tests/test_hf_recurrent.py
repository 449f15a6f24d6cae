"""Hugging Face interop of the recurrent and hybrid families (Mamba-2, Bamba, Qwen3.5): parity with
`transformers` on random tiny models, greedy decoding, export, exact round trips, refusals.

Every parameter is re-drawn — norm gains from 1 + N(0, 0.2²) (Qwen3.5's 1 + w norms: w from
N(0, 0.2²)), everything else (A_log, dt_bias, D,
conv weights and biases, projections) from N(0, 0.2²) — so that a wrong mapping of any of them
moves the logits far above the tolerance. Chunks of 16 tokens on both sides make the 48-token
prompts span three chunks of the chunked forms.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from decoderlm import checkpoint, hf  # noqa: E402
from decoderlm.cli import main  # noqa: E402
from decoderlm.errors import DecoderLMError  # noqa: E402
from decoderlm.inference.generate import generate  # noqa: E402
from decoderlm.model.config import ModelConfig  # noqa: E402
from decoderlm.model.lm import DecoderLM  # noqa: E402

# fp32 logits of O(1): the chunked scans and the recurrent forms round differently at ~1e-6.
LOGITS_ATOL = 1e-4
VOCAB = 96
NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
MAMBA = dict(hidden_size=32, num_hidden_layers=3, vocab_size=VOCAB)
QWEN3_5_TEXT = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    max_position_embeddings=64,
    vocab_size=VOCAB,
    **NO_SPECIALS,
)

HF_CONFIGS = {
    "mamba2": lambda: transformers.Mamba2Config(
        **MAMBA, num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=16, **NO_SPECIALS
    ),
    # In/out projection biases, one group, a tied head.
    "mamba2-biased-tied": lambda: transformers.Mamba2Config(
        **MAMBA,
        num_heads=8,
        head_dim=8,
        state_size=16,
        n_groups=1,
        chunk_size=16,
        use_bias=True,
        tie_word_embeddings=True,
        **NO_SPECIALS,
    ),
    "bamba": lambda: transformers.BambaConfig(
        **MAMBA,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=16,
        max_position_embeddings=64,
        **NO_SPECIALS,
    ),
    "bamba-biased": lambda: transformers.BambaConfig(
        **MAMBA,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=1,
        attn_layer_indices=[0, 2],
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=16,
        attention_bias=True,
        mlp_bias=True,
        mamba_proj_bias=True,
        max_position_embeddings=64,
        **NO_SPECIALS,
    ),
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**QWEN3_5_TEXT),
    "qwen3_5": lambda: transformers.Qwen3_5Config(
        text_config=QWEN3_5_TEXT,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2),
        tie_word_embeddings=True,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            # A gain initialised to 1 gets 1 + noise; Qwen3.5's gains, stored as offsets from 1
            # (initialised to 0), get noise.
            is_gain = p.dim() == 1 and "norm" in name and bool((p == 1).all())
            p.copy_(noise + 1.0 if is_gain else noise)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def hf_dir(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    """(family, directory written by save_pretrained, the transformers model in eval mode)."""
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    config = HF_CONFIGS[request.param]()
    if request.param == "qwen3_5":
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, len(request.param))
    model.save_pretrained(path)
    return request.param, path, model.eval()


def _tokens(t: int = 48, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _max_diff(ours: DecoderLM, theirs: torch.nn.Module, idx: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(idx) - theirs(input_ids=idx).logits).abs().max().item()


def test_imported_logits_match_transformers(hf_dir):
    _, path, theirs = hf_dir
    ours, _ = hf.load_hf(path)
    assert _max_diff(ours, theirs, _tokens()) <= LOGITS_ATOL


def test_greedy_tokens_with_recurrent_cache_match_transformers_generate(hf_dir):
    _, path, theirs = hf_dir
    ours, _ = hf.load_hf(path)
    prompt = _tokens(t=8, b=1, seed=1)
    with torch.no_grad():
        expected = theirs.generate(input_ids=prompt, max_new_tokens=16, do_sample=False)
    assert generate(ours, prompt, max_new_tokens=16, temperature=0.0) == expected.tolist()


def test_export_of_import_loads_in_transformers_with_same_logits_and_weights(hf_dir, tmp_path):
    family, path, theirs = hf_dir
    ours, _ = hf.load_hf(path)
    hf.export_hf(ours, tmp_path)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    expected_type = "Qwen3_5ForCausalLM" if family == "qwen3_5" else type(theirs).__name__
    assert type(reloaded).__name__ == expected_type
    assert _max_diff(ours, reloaded.eval(), _tokens()) <= LOGITS_ATOL
    back, _ = hf.load_hf(tmp_path)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())


def test_qwen3_5_checkpoint_imports_its_language_model_and_notes_the_vision_tower(tmp_path, caplog):
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(HF_CONFIGS["qwen3_5"]())
    model.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        ours, _ = hf.load_hf(tmp_path)
    assert "vision tower is ignored" in caplog.text
    assert ours.config.layer_types == ("gdn", "attention", "gdn")
    assert ours.config.tie_embeddings and ours.config.attn_output_gate


# Our own architectures that map onto each family (random init, then exported).
OUR_CONFIGS = {
    "mamba2": dict(
        mlp="none",
        norm="rmsnorm",
        position="none",
        bias=False,
        layer_types=("mamba2",) * 2,
        recurrent_heads=4,
        recurrent_key_heads=2,
        recurrent_key_dim=8,
        recurrent_value_dim=16,
        recurrent_chunk=16,
    ),
    "bamba": dict(
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        rotary_dim=4,
        bias=False,
        n_kv_heads=2,
        layer_types=("attention", "mamba2"),
        recurrent_heads=4,
        recurrent_key_heads=1,
        recurrent_key_dim=8,
        recurrent_value_dim=16,
        recurrent_chunk=16,
    ),
    "qwen3_5_text": dict(
        mlp="swiglu",
        norm="rmsnorm_1p",
        position="rope",
        rotary_dim=2,
        bias=False,
        qk_norm=True,
        attn_output_gate=True,
        n_kv_heads=1,
        layer_types=("gdn", "attention"),
        recurrent_heads=4,
        recurrent_key_heads=2,
        recurrent_key_dim=8,
        recurrent_value_dim=8,
        recurrent_chunk=16,
    ),
}


def _our_model(name: str, seed: int = 0) -> DecoderLM:
    config = ModelConfig(
        vocab_size=VOCAB,
        context_length=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=48,
        tie_embeddings=False,
        **OUR_CONFIGS[name],
    )
    model = DecoderLM(config)
    _randomize(model, seed)
    return model.eval()


@pytest.mark.parametrize("name", list(OUR_CONFIGS))
def test_export_loads_in_transformers_and_round_trips_exactly(name, tmp_path):
    ours = _our_model(name)
    hf.export_hf(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == name
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert _max_diff(ours, theirs.eval(), _tokens()) <= LOGITS_ATOL
    back, _ = hf.load_hf(tmp_path)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())


def test_cli_convert_from_hf_and_back(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS["bamba"]())
    _randomize(model, 0)
    model.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")]) == 0
    run = checkpoint.load_model(tmp_path / "run")
    back, _ = hf.load_hf(tmp_path / "hf2")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in run.state_dict().items())


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("mamba2", dict(use_conv_bias=False), "use_conv_bias=False is not supported"),
        (
            "mamba2",
            dict(time_step_limit=(0.0, 1.0)),
            re.escape("time_step_limit=[0.0, 1.0] is not supported"),
        ),
        ("bamba", dict(mlp_bias=True), "not all equal is not supported"),
        ("qwen3_5_text", dict(attention_bias=True), "attention_bias=True is not supported"),
    ],
)
def test_unsupported_variants_are_named(family, change, message):
    hf_config = {**HF_CONFIGS[family]().to_dict(), **change}
    with pytest.raises(DecoderLMError, match=message) as info:
        hf.config_from_hf(hf_config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        ("mamba2", dict(layer_types=("mamba2", "attention")), "attention layers without MLPs"),
        ("bamba", dict(rotary_dim=None), "rotary_dim=8"),
        ("qwen3_5_text", dict(layer_types=("gdn", "mamba2")), "one recurrent kind only"),
        ("qwen3_5_text", dict(norm="rmsnorm"), "norm='rmsnorm'"),
    ],
)
def test_export_refuses_what_the_family_cannot_hold(name, change, reason):
    config = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, **{**OUR_CONFIGS[name], **change}
    )
    with pytest.raises(DecoderLMError, match=reason):
        hf.hf_model_type(config)


def test_linear_attention_layers_and_attention_without_mlps_have_no_hf_family():
    config = ModelConfig.from_preset("hybrid-tiny", layer_types=("linear_attention",) * 4)
    with pytest.raises(DecoderLMError, match="no HF model family has layer_types"):
        hf.hf_model_type(config)
    config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, mlp="none")
    with pytest.raises(DecoderLMError, match="mlp='none'"):
        hf.hf_model_type(config)
