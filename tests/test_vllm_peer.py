"""benchmarks/vllm_peer.py's pure parts (no vLLM needed): reading /metrics counters and bench
results, the table, grounded prompts that reach both servers as the same token ids, the code
edits a chat model is asked for (speculative.py's), and both servers' dtype and instruction-set
caps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from gguf_decode import AVX2_ENV
from llama_cpp import llama_tokenizer_files
from speculative import EDITS, code_edit_requests
from vllm_peer import (
    FILE_TOKENS,
    FIRST_CHARACTER,
    INSTRUCTION_TOKENS,
    REPEAT,
    Measured,
    add_peer_arguments,
    command,
    comparison_table,
    counter,
    grounded_prompts,
    measured,
    server_env,
    source_file,
    speculative_table,
)

VLLM_METRICS = """# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llama-55m"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="llama-55m"} 80.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llama-55m"} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 50.0
vllm:spec_decode_num_accepted_tokens_created{engine="0"} 1.7e9
"""


def test_counter_sums_label_sets_of_exactly_that_name():
    assert counter(VLLM_METRICS, "vllm:spec_decode_num_draft_tokens_total") == 200.0
    # ..._per_pos_total and ..._created share the prefix but are other metrics.
    assert counter(VLLM_METRICS, "vllm:spec_decode_num_accepted_tokens_total") == 90.0
    assert counter(VLLM_METRICS, "decoderlm_speculative_proposed_tokens_total") == 0.0


def test_measured_takes_acceptance_over_the_pass_only():
    before = "decoderlm_speculative_proposed_tokens_total 100.0\n"
    before += "decoderlm_speculative_accepted_tokens_total 40.0\n"
    after = "decoderlm_speculative_proposed_tokens_total 300.0\n"
    after += "decoderlm_speculative_accepted_tokens_total 190.0\n"
    result = {"output_throughput": 512.5, "median_itl_ms": 20.0, "p99_ttft_ms": 700.0}
    record = {"result": {**result, "completed": 32, "failed": 0}}
    m = measured({**record, "metrics_before": before, "metrics_after": after}, "decoderlm")
    assert m == Measured(512.5, 20.0, 700.0, 32, 0, acceptance=150 / 200)
    plain = measured({**record, "metrics_before": "", "metrics_after": ""}, "vLLM")
    assert plain.acceptance is None


def test_comparison_table_ratio_is_decoderlm_over_vllm():
    rows = {
        16: {
            "vLLM": Measured(1000.0, 14.0, 200.0, 32, 0),
            "decoderlm": Measured(550.0, 23.0, 800.0, 32, 0),
        }
    }
    assert comparison_table(rows).splitlines()[-1] == (
        "| 16 | 1,000 | 550 | 0.55× | 14.0 / 23.0 | 200 / 800 |"
    )


def test_speculative_table_counts_completions_equal_to_plain():
    plain = Measured(500.0, 20.0, 700.0, 3, 0, texts=("ab", "cd", "ef"))
    spec = Measured(750.0, 40.0, 600.0, 3, 0, acceptance=0.5, texts=("ab", "cx", "ef"))
    row = speculative_table({"decoderlm": {"plain": plain, "speculative": spec}}, 4).splitlines()
    assert row[0].startswith("| server (K = 4) |")
    assert row[-1] == "| decoderlm | 500 | 750 | 1.50× | 0.50 | 20.0 / 40.0 | 2 of 3 |"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama-tokenizer")
    llama_tokenizer_files(directory, 32000)
    return directory


def test_grounded_prompts_encode_to_instruction_file_and_its_opening(tokenizer_dir: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    file = source_file().tolist()
    prompts = grounded_prompts(tokenizer_dir, source_file(), 3, seed=0)
    assert len(set(prompts)) == 3  # different instructions
    for text in prompts:
        ids = tokenizer.encode(text).ids
        assert len(ids) == 1 + INSTRUCTION_TOKENS + FILE_TOKENS + REPEAT
        assert ids[0] == FIRST_CHARACTER - 1  # the normalizer's "▁"
        assert ids[1 + INSTRUCTION_TOKENS :] == file + file[:REPEAT]
    assert len(set(file)) == FILE_TOKENS and min(file) >= FIRST_CHARACTER
    assert grounded_prompts(tokenizer_dir, source_file(), 3, seed=0) == prompts  # deterministic


def test_code_edit_requests_each_quote_a_whole_function_the_same_for_a_seed():
    import ast

    requests = code_edit_requests(40, 0)  # 16 warm-up and 32 timed ones in one serve.py run
    assert requests == code_edit_requests(40, 0) != code_edit_requests(40, 1)
    assert len(set(requests)) == 40
    for i, request in enumerate(requests):
        instruction, code = request.split("\n\n```python\n")
        assert instruction == EDITS[i % len(EDITS)] and code.endswith("\n```")
        (function,) = ast.parse(code.removesuffix("\n```")).body
        assert isinstance(function, ast.FunctionDef)
        assert 300 <= len(code) - 4 <= 1200
    with pytest.raises(ValueError, match=r"100 code edits asked for, of \d+ functions"):
        code_edit_requests(100, 0)


@pytest.mark.parametrize("flags", [[], ["--peer-dtype", "float32", "--peer-avx2"]])
def test_both_servers_get_the_same_dtype_and_instruction_set_caps(flags):
    parser = argparse.ArgumentParser()
    add_peer_arguments(parser)
    args = parser.parse_args(["--peer", "vllm", *flags])
    dtype = "float32" if flags else "bfloat16"
    for side in ("vLLM", "decoderlm"):
        cmd = command(args, side, Path("/models/smollm2"), 8000, None)
        assert cmd[cmd.index("--dtype") + 1] == dtype
        env = server_env(args, side)
        assert all(env.get(name) == value for name, value in AVX2_ENV.items()) == bool(flags)
    assert server_env(args, "vLLM")["VLLM_CPU_OMP_THREADS_BIND"] == args.vllm_omp_bind
