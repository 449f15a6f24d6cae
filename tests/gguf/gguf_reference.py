"""The transformers side of the GGUF tests: tiny configs of each family and transformers' own GGUF
loader as the reference. A module of its own (not conftest) so that the tests import it by a name
no other test directory uses."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from torch import nn

from decoderlm.quant import BlockLinear
from decoderlm.quant.apply import set_module

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(arch: str, vocab_size: int):
    """A tiny config of each family: GQA, a tied head (llama), biases (qwen2), q/k norms and a
    head_dim apart from d_model / heads (qwen3: transformers' GGUF loader keeps its default 128),
    GPT-2 with its 1024 positions (transformers' GGUF loader reads no n_positions)."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=vocab_size)
    common = dict(max_position_embeddings=128, **NO_SPECIALS, **shape)
    if arch in ("llama", "mistral"):
        kind = transformers.LlamaConfig if arch == "llama" else transformers.MistralConfig
        return kind(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=arch == "llama",
            **common,
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **common
        )
    if arch == "qwen3":
        return transformers.Qwen3Config(
            num_attention_heads=2, num_key_value_heads=1, head_dim=128, **common
        )
    return transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=1024,
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=None,
    )


def reference(path: Path):
    """transformers' GGUF loader on the file (float32, dequantized)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name
    ).eval()


def float32_linears(model: nn.Module) -> nn.Module:
    """A copy of `model` whose block linears are nn.Linear on their dequantized weights: float32
    products, as transformers' GGUF loader computes (the block products round activations)."""
    exact = copy.deepcopy(model)
    for name, layer in list(exact.named_modules()):
        if isinstance(layer, BlockLinear):
            linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            linear.weight.data = layer.dequantized()
            if layer.bias is not None:
                linear.bias.data = layer.bias.data
            set_module(exact, name, linear)
    return exact
