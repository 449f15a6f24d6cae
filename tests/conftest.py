import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def float32_matmul_precision():
    """torch's float32 matmul precision as each test found it, whatever the test (or a command it
    runs in-process: --matmul-precision) set."""
    precision = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(precision)


@pytest.fixture
def one_thread():
    """Tiny shapes run faster on one thread than on two fighting other tests for a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def json_run(tmp_path_factory):
    """A tiny random model whose byte-level BPE tokenizer spells any JSON (merges learned from
    JSON text), saved as a run directory: structured output's tests sample it at temperature 1."""
    from decoderlm import DecoderLM, ModelConfig
    from decoderlm.checkpoint import save_model
    from decoderlm.tokenizer import Tokenizer

    text = '{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "v": null, "f": -1.5e3}\n'
    tokenizer = Tokenizer.train_bpe([text * 20], vocab_size=320)
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=tokenizer.vocab_size,
        context_length=256,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
    )
    run = tmp_path_factory.mktemp("json-run")
    save_model(run, DecoderLM(config).eval(), tokenizer)
    return run
