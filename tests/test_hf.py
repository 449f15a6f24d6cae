"""Hugging Face interop: parity with `transformers` on random-init tiny models, export, round trips, errors.

Every model here is built locally from transformers' config classes (HF_HUB_OFFLINE=1, see conftest).
Weights are re-drawn from N(0, 0.2²) (norm gains from 1 + N(0, 0.2²)) rather than kept at HF's
N(0, 0.02²) init, so that attention patterns, RoPE angles and every norm gain actually shape the
logits: a mapping mistake then moves them by O(1), far above the tolerances.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from decoderlm import checkpoint, hf  # noqa: E402
from decoderlm.cli import main  # noqa: E402
from decoderlm.errors import DecoderLMError  # noqa: E402
from decoderlm.inference.generate import generate  # noqa: E402
from decoderlm.model.config import ModelConfig  # noqa: E402
from decoderlm.model.lm import DecoderLM  # noqa: E402
from decoderlm.tokenizer import Tokenizer  # noqa: E402

# fp32 logits of O(1) through 2 layers: both sides round differently (fused SDPA, RoPE angles in
# float32 in HF vs float64 here) at ~1e-6; 1e-4 is the bar and leaves a 100× margin.
LOGITS_ATOL = 1e-4
VOCAB = 96
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, vocab_size=VOCAB)
NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, **NO_SPECIALS
    ),
    "llama": lambda: transformers.LlamaConfig(
        **SHAPE,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **NO_SPECIALS,
    ),
    # Llama 3.1-style RoPE scaling with a short "original" context, so it changes most frequencies;
    # biases everywhere and a tied head.
    "llama3-scaled-biased-tied": lambda: transformers.LlamaConfig(
        **SHAPE,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        **NO_SPECIALS,
    ),
    "mistral": lambda: transformers.MistralConfig(
        **SHAPE,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **NO_SPECIALS,
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **SHAPE,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        **NO_SPECIALS,
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **SHAPE,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # explicit: n_heads·head_dim = 64 ≠ hidden_size
        max_position_embeddings=64,
        **NO_SPECIALS,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            is_gain = p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight")
            p.copy_(noise + 1.0 if is_gain else noise)


def _save_hf(family: str, path: Path, seed: int = 0, **save_options) -> torch.nn.Module:
    """A random transformers model of `family`, saved to `path` by save_pretrained; returned in eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[family]())
    _randomize(model, seed)
    model.save_pretrained(path, **save_options)
    return model.eval()


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def hf_dir(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(directory written by save_pretrained, the transformers model) per family."""
    path = tmp_path_factory.mktemp(request.param)
    return path, _save_hf(request.param, path, seed=len(request.param))


def _tokens(t: int = 48, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _max_diff(ours: DecoderLM, theirs: torch.nn.Module, idx: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(idx) - theirs(idx).logits).abs().max().item()


def test_imported_logits_match_transformers(hf_dir):
    path, theirs = hf_dir
    ours, _ = hf.load_hf(path)
    assert _max_diff(ours, theirs, _tokens()) <= LOGITS_ATOL


def test_greedy_32_tokens_with_kv_cache_match_transformers_generate(hf_dir):
    path, theirs = hf_dir
    ours, _ = hf.load_hf(path)
    prompt = _tokens(t=8, b=1, seed=1)
    with torch.no_grad():
        expected = theirs.generate(prompt, max_new_tokens=32, do_sample=False)
    assert generate(ours, prompt, max_new_tokens=32, temperature=0.0) == expected.tolist()


def test_export_of_import_loads_in_transformers_with_same_logits(hf_dir, tmp_path):
    path, theirs = hf_dir
    ours, _ = hf.load_hf(path)
    hf.export_hf(ours, tmp_path)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert type(reloaded) is type(theirs)
    assert _max_diff(ours, reloaded.eval(), _tokens()) <= LOGITS_ATOL


# Our own architectures that map onto each HF family (random init, then exported).
OUR_CONFIGS = {
    "gpt2": dict(position="learned", mlp="gelu_tanh", norm="layernorm", bias=True),
    "gpt2-erf-gelu-untied": dict(
        position="learned", mlp="gelu", norm="layernorm", bias=True, tie_embeddings=False
    ),
    "llama-gqa": dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, n_kv_heads=2),
    "llama-mqa-linear-rope-scaling": dict(
        position="rope",
        mlp="swiglu",
        norm="rmsnorm",
        bias=False,
        n_kv_heads=1,
        rope_scaling={"type": "linear", "factor": 2.0},
    ),
    "qwen2-qkv-bias": dict(
        position="rope", mlp="swiglu", norm="rmsnorm", bias=False, qkv_bias=True, n_kv_heads=2
    ),
    "qwen3-qk-norm": dict(
        position="rope", mlp="swiglu", norm="rmsnorm", bias=False, qk_norm=True, head_dim=16
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
        tie_embeddings=OUR_CONFIGS[name].get("tie_embeddings", True),
        **{k: v for k, v in OUR_CONFIGS[name].items() if k != "tie_embeddings"},
    )
    model = DecoderLM(config)
    _randomize(model, seed)
    return model.eval()


@pytest.mark.parametrize("name", list(OUR_CONFIGS))
def test_export_loads_in_transformers_with_same_logits(name, tmp_path):
    ours = _our_model(name)
    hf.export_hf(ours, tmp_path)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert theirs.config.model_type == hf.hf_model_type(ours.config)
    assert _max_diff(ours, theirs.eval(), _tokens()) <= LOGITS_ATOL


@pytest.mark.parametrize("name", list(OUR_CONFIGS))
def test_round_trip_ours_hf_ours_is_identical(name, tmp_path):
    ours = _our_model(name)
    hf.export_hf(ours, tmp_path)
    back, _ = hf.load_hf(tmp_path)
    expected, got = ours.state_dict(), back.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    structural = ("extra", "dropout", "init_std", "attn_backend")
    original = {k: v for k, v in ours.config.to_dict().items() if k not in structural}
    assert {k: v for k, v in back.config.to_dict().items() if k not in structural} == original


def _v4_layout(path: Path, out: Path) -> None:
    """Rewrite a v5 config.json (rope_parameters, dtype) in the v4 layout (rope_theta, rope_scaling, torch_dtype)."""
    shutil.copytree(path, out)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    (out / "config.json").write_text(json.dumps(config))


def test_v4_config_layout_gives_the_same_model_as_v5(tmp_path):
    theirs = _save_hf("llama3-scaled-biased-tied", tmp_path / "v5", seed=3)
    _v4_layout(tmp_path / "v5", tmp_path / "v4")
    v4 = json.loads((tmp_path / "v4" / "config.json").read_text())
    assert "rope_parameters" not in v4 and v4["rope_scaling"]["rope_type"] == "llama3"
    from_v5 = hf.config_from_hf(hf.read_hf_config(tmp_path / "v5"))
    from_v4 = hf.config_from_hf(v4)
    assert from_v4 == from_v5
    assert from_v4.rope_theta == 500000.0 and from_v4.rope_scaling["type"] == "llama3"
    ours, _ = hf.load_hf(tmp_path / "v4")
    assert _max_diff(ours, theirs.eval(), _tokens()) <= LOGITS_ATOL


def test_sharded_safetensors_checkpoint_loads(tmp_path):
    theirs = _save_hf("qwen3", tmp_path, seed=4, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours, _ = hf.load_hf(tmp_path)
    assert _max_diff(ours, theirs.eval(), _tokens()) <= LOGITS_ATOL


def test_gpt2_keys_without_transformer_prefix_load_identically(tmp_path):
    path = tmp_path / "gpt2"
    _save_hf("gpt2", path)
    shutil.copytree(path, tmp_path / "bare")
    state = load_file(str(path / "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in state.items()}
    save_file(bare, str(tmp_path / "bare" / "model.safetensors"), metadata={"format": "pt"})
    a, b = hf.load_hf(path)[0].state_dict(), hf.load_hf(tmp_path / "bare")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pickle_is_refused_unless_allowed(tmp_path):
    theirs = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS["llama"]())
    _randomize(theirs, seed=5)
    theirs.config.save_pretrained(tmp_path)
    torch.save(theirs.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(DecoderLMError, match=r"pytorch_model\.bin.*--allow-pickle"):
        hf.load_hf(tmp_path)
    ours, _ = hf.load_hf(tmp_path, allow_pickle=True)
    assert _max_diff(ours, theirs.eval(), _tokens()) <= LOGITS_ATOL


def test_unsupported_model_type_names_it_and_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(DecoderLMError, match=r"'bert'.*gpt2, llama, mistral, qwen2, qwen3"):
        hf.load_hf(tmp_path)


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    path = tmp_path / "llama"
    _save_hf("llama", path)
    state = load_file(str(path / "model.safetensors"))
    shutil.copytree(path, tmp_path / "m")
    target = tmp_path / "m" / "model.safetensors"
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, str(target), metadata={"format": "pt"})
    with pytest.raises(DecoderLMError, match=rf"{name}.*missing"):
        hf.load_hf(tmp_path / "m")
    save_file({**state, name: state[name][:-1]}, str(target), metadata={"format": "pt"})
    with pytest.raises(DecoderLMError, match=rf"{name}.*shape \(15, 32\).*\(16, 32\)"):
        hf.load_hf(tmp_path / "m")


def test_unsupported_rope_type_and_bias_mix_are_refused():
    base = HF_CONFIGS["llama"]().to_dict()
    supported = "default, linear, dynamic, yarn, longrope, llama3"
    with pytest.raises(DecoderLMError, match=rf"rope_type='proportional'.*{supported}"):
        hf.config_from_hf({**base, "rope_parameters": {"rope_type": "proportional"}})
    with pytest.raises(DecoderLMError, match=r"attention_bias=True.*mlp_bias=False"):
        hf.config_from_hf({**base, "attention_bias": True, "mlp_bias": False})


def test_config_without_a_required_field_names_it():
    config = {k: v for k, v in HF_CONFIGS["qwen2"]().to_dict().items() if k != "hidden_size"}
    with pytest.raises(DecoderLMError, match=r"qwen2 config.json has no 'hidden_size'"):
        hf.config_from_hf(config)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(position="sinusoidal"), "position='sinusoidal'"),
        (dict(position="none"), "position='none'"),
        (dict(norm_placement="post"), "Post-LN"),
        (dict(mlp="relu2"), "mlp='relu2'"),
        (dict(position="rope", n_kv_heads=2), "n_kv_heads=2"),
    ],
)
def test_export_refuses_architectures_without_hf_equivalent(change, reason):
    config = ModelConfig(vocab_size=VOCAB, context_length=64, d_model=32, n_layers=1, n_heads=4)
    config = ModelConfig.from_dict({**config.to_dict(), **change})
    if (
        change.get("position") == "rope"
    ):  # a RoPE model with GPT-2's layernorm/gelu has no home either
        reason = "norm='layernorm'"
    with pytest.raises(DecoderLMError, match=rf"cannot export to Hugging Face.*{reason}"):
        hf.to_hf(DecoderLM(config))


def test_is_hf_checkpoint_tells_hf_dirs_from_run_dirs(tmp_path):
    path = tmp_path / "hf"
    _save_hf("qwen2", path)
    checkpoint.save_model(tmp_path / "run", _our_model("gpt2"))
    assert hf.is_hf_checkpoint(path)
    assert not hf.is_hf_checkpoint(tmp_path / "run")
    assert not hf.is_hf_checkpoint(tmp_path / "nothing")


def _tokenizer() -> Tokenizer:
    return Tokenizer.train_char(
        ["To be, or not to be, that is the question: Whether 'tis nobler in the mind"]
    )


def test_cli_export_then_import_keeps_weights_and_tokenizer(tmp_path, capsys):
    ours, tokenizer = _our_model("llama-gqa"), _tokenizer()
    checkpoint.save_model(tmp_path / "run", ours, tokenizer=tokenizer)
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    text = "Whether 'tis nobler in the mind"
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert (
        main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    )
    back = checkpoint.load_model(tmp_path / "back")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())
    assert Tokenizer.from_file(tmp_path / "back" / "tokenizer.json").encode(
        text
    ) == tokenizer.encode(text)
    _, loaded_tokenizer = hf.load_hf(tmp_path / "hf")
    assert loaded_tokenizer is not None and loaded_tokenizer.encode(text) == tokenizer.encode(text)


def test_cli_errors_are_one_line_with_exit_status_2(tmp_path, capsys):
    checkpoint.save_model(tmp_path / "run", _our_model("gpt2"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("precious")
    cases = [
        (["--from-hf", str(tmp_path / "nope")], "no such directory"),
        (["--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "busy")], "not empty"),
        (["--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "run")], "source directory"),
        (["--from-hf", str(tmp_path / "run")], "no 'model_type'"),
    ]
    for argv, message in cases:
        out = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "new")]
        assert main(["convert", *out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decoderlm: error: ") and message in err and err.count("\n") == 1
    assert (tmp_path / "busy" / "keep.txt").read_text() == "precious"


def test_cli_from_hf_dtype_sets_the_stored_dtype(tmp_path):
    theirs = _save_hf("qwen2", tmp_path / "hf", seed=6)
    argv = ["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    stored = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    expected = {k: v.to(torch.bfloat16) for k, v in theirs.state_dict().items()}
    assert torch.equal(stored["tok_emb.weight"], expected["model.embed_tokens.weight"])
