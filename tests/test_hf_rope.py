"""RoPE context extension: parity with `transformers` past the original length, export, fine-tuning.

For dynamic, yarn and longrope, tiny random Llama and Qwen2 models are built in transformers with an
original length L₀ = 16, saved, imported, and run on 64 positions: logits within 1e-4 (fp32) and 32
greedy tokens with a KV cache equal to transformers' `generate`. Transformers' dynamic RoPE keeps
state (the longest sequence seen), so every comparison loads a fresh transformers model.
"""

from __future__ import annotations

import json
import shlex
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

# As in tests/test_hf.py: O(1) fp32 logits, rounding differences ~1e-6, the bar of 1e-4.
LOGITS_ATOL = 1e-4
VOCAB = 96
ORIGINAL = 16  # L₀: every sequence below runs well past it
LENGTH = 64
# head_dim 16: 8 frequencies, so yarn's ramp and longrope's factor lists have room to vary.
SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=VOCAB,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0]
LONG = [1.0, 1.3, 1.8, 2.5, 3.2, 3.9, 4.5, 5.0]

# (max_position_embeddings, rope_parameters): transformers' spelling of each scaling type.
ROPE = {
    "dynamic": (ORIGINAL, {"rope_type": "dynamic", "factor": 4.0}),
    "yarn": (
        LENGTH,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    ),
    "yarn-explicit": (
        LENGTH,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            "attention_factor": 1.25,
            "beta_fast": 4.0,
            "beta_slow": 0.25,
            "truncate": False,
        },
    ),
    "longrope": (
        LENGTH,
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
}
CASES = [
    (family, rope)
    for family in ("llama", "qwen2")
    for rope in ("dynamic", "yarn", "longrope")
    if (family, rope) != ("qwen2", "yarn")
] + [("qwen2", "yarn-explicit")]
IDS = [f"{family}-{rope}" for family, rope in CASES]


def _hf_config(family: str, rope: str) -> transformers.PretrainedConfig:
    max_positions, params = ROPE[rope]
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    return cls(
        **SHAPE,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_theta": 10000.0, **params},
    )


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights from N(0, 0.2²), norm gains 1 + N(0, 0.2²): RoPE angles then shape the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(noise + 1.0 if p.dim() == 1 and "norm" in name else noise)


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def hf_dir(request, tmp_path_factory) -> tuple[Path, str]:
    """(a directory written by save_pretrained, its scaling type's name in ROPE)."""
    family, rope = request.param
    path = tmp_path_factory.mktemp(f"{family}-{rope}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family, rope))
    _randomize(model, seed=len(rope))
    model.save_pretrained(path)
    return path, rope


def _fresh(path: Path) -> torch.nn.Module:
    """transformers' model from `path`, with none of the dynamic RoPE state of earlier calls."""
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _tokens(t: int, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _logits_diff(ours: DecoderLM, theirs: torch.nn.Module, idx: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(idx) - theirs(idx).logits).abs().max().item()


def test_import_keeps_every_parameter_and_the_extended_context(hf_dir):
    path, rope = hf_dir
    ours, _ = hf.load_hf(path)
    params = dict(ROPE[rope][1])
    expected = {"type": params.pop("rope_type"), **params, "original_max_position_embeddings": 16}
    assert ours.config.rope_scaling == expected
    assert ours.config.context_length == LENGTH  # dynamic: factor 4 × max_position_embeddings 16


def test_logits_past_the_original_length_match_transformers(hf_dir):
    path, _ = hf_dir
    ours, _ = hf.load_hf(path)
    idx = _tokens(LENGTH)
    assert _logits_diff(ours, _fresh(path), idx) <= LOGITS_ATOL
    # The scaling is what is being compared: without it the logits past L₀ move by O(1).
    plain = DecoderLM(ModelConfig.from_dict({**ours.config.to_dict(), "rope_scaling": None}))
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        moved = (plain.eval()(idx) - ours(idx))[:, ORIGINAL:].abs().max().item()
    assert moved > 1e-2


@pytest.mark.parametrize("prompt_length", [8, 24], ids=["prompt-within-L0", "prompt-past-L0"])
def test_greedy_32_tokens_with_kv_cache_match_transformers_generate(hf_dir, prompt_length):
    # Both decode with a cache whose keys keep the rotation of the step that made them; for dynamic
    # and longrope that is not what one uncached forward over the whole sequence computes.
    path, _ = hf_dir
    ours, _ = hf.load_hf(path)
    prompt = _tokens(prompt_length, b=1, seed=1)
    with torch.no_grad():
        expected = _fresh(path).generate(prompt, max_new_tokens=32, do_sample=False)
    assert expected.shape[1] == prompt_length + 32 > ORIGINAL
    assert generate(ours, prompt, max_new_tokens=32, temperature=0.0) == expected.tolist()


def test_transformers_cached_generate_is_not_its_uncached_greedy_for_dynamic(tmp_path):
    # Why the test above compares with cached `generate`: transformers rotates each cached key
    # with the base of the step that made it, so recomputing the whole sequence differs.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config("llama", "dynamic"))
    _randomize(model, seed=7)
    model.save_pretrained(tmp_path)
    prompt = _tokens(8, b=1, seed=1)
    with torch.no_grad():
        cached = _fresh(tmp_path).generate(prompt, max_new_tokens=32, do_sample=False)
        uncached = _fresh(tmp_path).generate(
            prompt, max_new_tokens=32, do_sample=False, use_cache=False
        )
    assert not torch.equal(cached, uncached)
    ours, _ = hf.load_hf(tmp_path)
    assert generate(ours, prompt, max_new_tokens=32, temperature=0.0) == cached.tolist()


def test_export_of_import_loads_in_transformers_with_same_logits(hf_dir, tmp_path):
    path, _ = hf_dir
    ours, _ = hf.load_hf(path)
    hf.export_hf(ours, tmp_path)
    reloaded = _fresh(tmp_path)
    original = _fresh(path)
    assert reloaded.config.rope_parameters == original.config.rope_parameters
    assert reloaded.config.max_position_embeddings == original.config.max_position_embeddings
    assert _logits_diff(ours, reloaded, _tokens(LENGTH)) <= LOGITS_ATOL


@pytest.mark.parametrize("rope", list(ROPE))
@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_v4_rope_scaling_and_v5_rope_parameters_give_the_same_config(rope, key):
    v5 = _hf_config("llama", rope).to_dict()
    params = {
        k: v for k, v in v5["rope_parameters"].items() if k not in ("rope_type", "rope_theta")
    }
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling={key: ROPE[rope][1]["rope_type"], **params})
    assert hf.config_from_hf(v4) == hf.config_from_hf(v5)


# Our own models with each scaling type, exported and read back.
OURS = {
    "dynamic": {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 8.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "longrope": {
        "type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": ORIGINAL,
        "factor": 4.0,
    },
}


def _our_model(scaling: dict, qkv_bias: bool = False) -> DecoderLM:
    config = ModelConfig(
        vocab_size=VOCAB,
        context_length=LENGTH,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_ff=48,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        qkv_bias=qkv_bias,
        rope_scaling=scaling,
    )
    model = DecoderLM(config)
    _randomize(model, seed=7)
    return model.eval()


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
@pytest.mark.parametrize("rope", list(OURS))
def test_export_round_trip_keeps_config_and_weights_and_matches_transformers(
    rope, qkv_bias, tmp_path
):
    ours = _our_model(OURS[rope], qkv_bias)
    hf.export_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_scaling"]["rope_type"] == rope
    back, _ = hf.load_hf(tmp_path)
    assert back.config.rope_scaling == OURS[rope]
    assert back.config.context_length == ours.config.context_length
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())
    assert _logits_diff(ours, _fresh(tmp_path), _tokens(LENGTH)) <= LOGITS_ATOL


def test_unsupported_and_incomplete_hf_rope_parameters_are_one_line_errors():
    base = _hf_config("llama", "yarn").to_dict()
    without_factor = {"rope_type": "yarn", "original_max_position_embeddings": ORIGINAL}
    with pytest.raises(DecoderLMError, match=r"rope_scaling type='yarn' needs factor$"):
        hf.config_from_hf({**base, "rope_parameters": without_factor})
    short = {**ROPE["longrope"][1], "short_factor": [1.0, 1.0]}
    with pytest.raises(DecoderLMError, match=r"short_factor has 2 entries.*head_dim/2=8"):
        hf.config_from_hf({**base, "rope_parameters": short})


# ---- context extension by fine-tuning: --init-from RUN --context-length 4× --rope-scaling ----


_MODEL = shlex.split("--preset llama-tiny --d-model 32 --n-layers 1 --n-heads 2 --n-kv-heads 1")
_TRAIN = shlex.split(
    "--batch-size 2 --max-steps 1 --lr 1e-12 --min-lr 0 --warmup-steps 0 --eval-interval 0 "
    "--sample-tokens 0 --threads 1 --quiet"
)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[Path, Path]:
    """(a prepared char-level data directory, a 1-step run on it with context 16)."""
    root = tmp_path_factory.mktemp("extend")
    text = "\n".join(f"line {i} of the corpus, with some words in it." for i in range(400))
    (root / "corpus.txt").write_text(text)
    data = root / "data"
    argv = ["prepare", "--input", str(root / "corpus.txt"), "--out", str(data), "--quiet"]
    assert main([*argv, "--tokenizer", "char"]) == 0
    run = root / "short"
    where = ["--data", str(data), "--out", str(run), "--context-length", "16"]
    assert main(["train", *_MODEL, *_TRAIN, *where]) == 0
    return data, run


def test_init_from_extends_the_context_with_rope_scaling_and_keeps_the_weights(short_run, tmp_path):
    data, run = short_run
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    argv = ["train", "--init-from", str(run), "--data", str(data), "--out", str(tmp_path / "long")]
    flags = ["--context-length", "64", "--rope-scaling", json.dumps(scaling)]
    assert main([*argv, *flags, *_TRAIN]) == 0
    long, short = checkpoint.load_model(tmp_path / "long"), checkpoint.load_model(run)
    assert long.config.context_length == 64 and long.config.rope_scaling == scaling
    # One step at lr 1e-12 moves a weight by ~1e-12: the short run's weights were loaded.
    for (name, p), q in zip(long.state_dict().items(), short.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9, msg=name)


def test_init_from_still_refuses_fields_that_shape_the_weights(short_run, tmp_path, capsys):
    data, run = short_run
    argv = ["train", "--init-from", str(run), "--data", str(data), "--out", str(tmp_path / "x")]
    assert main([*argv, "--d-model", "64", *_TRAIN]) == 2
    err = capsys.readouterr().err
    assert "model field d_model=64 differs" in err
    assert "only context_length and rope_scaling may change" in err and err.count("\n") == 1
