"""Fixtures of the fine-tuning tests (`pytest_plugins = ["chat_fixtures"]`): `chat_base`, a random
2-layer chat model (a run directory with the ChatML template), and `chat_file`, 60 conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from chat_helpers import CHATML, chat_tokenizer, conversation

from decoderlm import DecoderLM, ModelConfig, checkpoint
from decoderlm.chat_template import TOKENIZER_CONFIG_FILE


@pytest.fixture(scope="session")
def chat_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory: the random tiny model, its tokenizer and the ChatML template."""
    out = tmp_path_factory.mktemp("chat") / "base"
    tokenizer = chat_tokenizer()
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        context_length=128,
    )
    checkpoint.save_model(out, DecoderLM(config), tokenizer)
    template = {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(template))
    return out


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 conversations."""
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    rng = random.Random(0)
    rows = [conversation(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(60)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
