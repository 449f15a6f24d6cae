"""The README's Python examples run as tests (sybil), in a folder holding the runs they name.

`pytest` collects README.md (pyproject.toml: testpaths); each ```python block runs in order in one
namespace (but a block after `<!-- skip: next -->`: the OpenAI client example needs a running
server, which tests/serving/test_server.py starts for the same calls; the fine-tuning example
minutes of training on the real model, which tests/training/test_finetune.py runs on a tiny one),
in a temporary working directory where `runs/mine` (a tiny random run with a character
tokenizer), `runs/mha`, `path/to/hf_dir` (its Hugging Face export) and `val.txt` exist.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

TEXT = "def add(a, b):\n    return a + b\n\n" * 40


def _workspace(namespace: dict[str, Any]) -> None:
    import tempfile

    import torch

    from decoderlm import DecoderLM, ModelConfig, checkpoint, hf
    from decoderlm.tokenizer import Tokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(tempfile.mkdtemp(prefix="decoderlm-readme-"))
    namespace["_previous_cwd"] = os.getcwd()
    os.chdir(workdir)
    tokenizer = Tokenizer.train_char([TEXT])
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=tokenizer.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        context_length=256,
    )
    model = DecoderLM(config)
    for run in ("runs/mine", "runs/mha"):
        checkpoint.save_model(run, model, tokenizer)
    hf.export_hf("runs/mine", "path/to/hf_dir")
    Path("val.txt").write_text(TEXT)


def _teardown(namespace: dict[str, Any]) -> None:
    os.chdir(namespace["_previous_cwd"])


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md"],
    setup=_workspace,
    teardown=_teardown,
).pytest()
