"""Evaluation (loss, perplexity, bits per byte), `decoderlm.load`, and the generate/eval/info commands."""

import json
import math
import re

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig, load, next_token_loss
from decoderlm.checkpoint import save_model
from decoderlm.cli import main
from decoderlm.inference.evaluate import (
    bits_per_byte,
    evaluate_file,
    evaluate_text,
    evaluate_tokens,
    window_plan,
)
from decoderlm.inference.stream import generate_text
from decoderlm.tokenizer import Tokenizer

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 8


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(vocab_size: int = 97, context_length: int = 32, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=vocab_size, context_length=context_length, d_model=64, n_layers=2
    )
    return DecoderLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_char([TEXT + "é"])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer):
    run = tmp_path_factory.mktemp("run")
    save_model(run, tiny_model(tokenizer.vocab_size, context_length=64), tokenizer)
    return run


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "eval.txt"
    path.write_text(TEXT + "é\n", encoding="utf-8")
    return path


def test_bits_per_byte_is_total_bits_over_bytes():
    assert bits_per_byte(math.log(2), 10, 10) == pytest.approx(1.0, rel=1e-12)
    assert bits_per_byte(2 * math.log(2), 100, 50) == pytest.approx(4.0, rel=1e-12)
    with pytest.raises(DecoderLMError, match="n_bytes"):
        bits_per_byte(1.0, 10, 0)


@pytest.mark.parametrize(("n", "context", "stride"), [(100, 16, 16), (100, 16, 5), (17, 16, 16)])
def test_windows_score_every_token_once_with_enough_context(n, context, stride):
    scored = []
    for start, end, first in window_plan(n, context, stride):
        assert end - start <= context and start < first <= end
        scored += range(first, end + 1)
        if start > 0:  # later windows see at least context − stride tokens before a scored one
            assert first - start >= context - stride
    assert scored == list(range(1, n))  # tokens 1..n−1 each predicted exactly once


def test_non_overlapping_eval_equals_the_mean_next_token_loss():
    model = tiny_model()
    ids = torch.randint(0, 97, (3 * 32 + 1,), generator=torch.Generator().manual_seed(0))
    windows = torch.stack([ids[i * 32 : i * 32 + 33] for i in range(3)])  # (3, 33)
    with torch.no_grad():
        expected = next_token_loss(model(windows[:, :-1]), windows[:, 1:]).item()
    result = evaluate_tokens(model, ids, batch_size=2)
    # Same logits; only the order of the float32 sum over 96 tokens differs.
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.n_tokens == 96 and result.perplexity == pytest.approx(
        math.exp(expected), rel=1e-5
    )


def test_a_model_that_knows_nothing_scores_log_vocab():
    model = tiny_model()
    torch.nn.init.zeros_(model.head.weight)  # equal logits: p = 1/V for every token
    ids = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(0))
    result = evaluate_tokens(model, ids, stride=8)
    assert result.loss == pytest.approx(math.log(97), rel=1e-6)
    assert result.perplexity == pytest.approx(97, rel=1e-5)


def test_strided_windows_see_more_context_and_score_the_same_tokens():
    model = tiny_model()
    ids = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(1))
    full, strided = evaluate_tokens(model, ids), evaluate_tokens(model, ids, stride=8)
    assert full.n_tokens == strided.n_tokens == 149
    assert strided.stride == 8 and full.stride == full.context_length == 32


def test_loss_per_position_bucket_is_the_mean_over_the_targets_at_those_window_positions():
    model = tiny_model()
    ids = torch.randint(0, 97, (3 * 32 + 1,), generator=torch.Generator().manual_seed(0))
    windows = torch.stack([ids[i * 32 : i * 32 + 33] for i in range(3)])  # (3, 33)
    with torch.no_grad():
        logits = model(windows[:, :-1]).double()  # (3, 32, V)
    nats = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), windows[:, 1:], reduction="none"
    )  # (3, 32): the loss at each window position
    result = evaluate_tokens(model, ids, bucket_width=12)  # buckets [0, 12), [12, 24), [24, 32)
    assert result.bucket_width == 12 and result.bucket_tokens == (36, 36, 24)
    expected = [nats[:, :12].mean(), nats[:, 12:24].mean(), nats[:, 24:].mean()]
    assert result.bucket_losses == pytest.approx([float(e) for e in expected], rel=1e-5)
    pairs = zip(result.bucket_losses, result.bucket_tokens, strict=True)
    weighted = sum(loss * n for loss, n in pairs)
    assert weighted / result.n_tokens == pytest.approx(result.loss, rel=1e-12)
    # Strided windows score only their last 8 targets, at positions 24–31, after the first
    # window's 32: the early buckets hold the first window's targets alone.
    strided = evaluate_tokens(model, ids, stride=8, bucket_width=8)
    assert strided.bucket_tokens == (8, 8, 8, 8 + 64) and sum(strided.bucket_tokens) == 96
    assert evaluate_tokens(model, ids).bucket_width == 4  # default: T/8
    with pytest.raises(DecoderLMError, match="bucket_width=33 must be between 1 and"):
        evaluate_tokens(model, ids, bucket_width=33)


def test_text_eval_counts_every_byte_when_the_tokenizer_has_an_end_of_text(tokenizer):
    model = tiny_model(tokenizer.vocab_size)
    text = TEXT + "é"
    result = evaluate_text(model, tokenizer, text)
    assert result.n_bytes == len(text.encode("utf-8")) == len(text) + 1  # é is two bytes
    assert result.n_tokens == len(tokenizer.encode(text))  # every character scored (after <eot>)
    assert result.bits_per_byte == pytest.approx(
        result.loss * result.n_tokens / (math.log(2) * result.n_bytes), rel=1e-12
    )


def test_eval_rejects_bad_input(tmp_path, tokenizer):
    model = tiny_model(tokenizer.vocab_size)
    with pytest.raises(DecoderLMError, match="no such file"):
        evaluate_file(model, tokenizer, tmp_path / "missing.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DecoderLMError, match="not UTF-8"):
        evaluate_file(model, tokenizer, tmp_path / "bin.txt")
    with pytest.raises(DecoderLMError, match="stride=40"):
        evaluate_tokens(model, list(range(50)), stride=40)
    with pytest.raises(DecoderLMError, match="token ids must be in"):
        evaluate_tokens(model, [1, 2, 500])


def test_load_returns_the_saved_model_and_tokenizer(run_dir, tokenizer):
    model, loaded_tokenizer = load(run_dir)
    reference = tiny_model(tokenizer.vocab_size, context_length=64)
    ids = torch.tensor([tokenizer.encode("Speak, speak.")])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    assert loaded_tokenizer.encode("All:") == tokenizer.encode("All:")
    model16, _ = load(run_dir, dtype="bf16")
    assert model16.tok_emb.weight.dtype == torch.bfloat16
    with pytest.raises(DecoderLMError, match=r"no such checkpoint: .*nope; give a run or Hugging"):
        load(run_dir / "nope")
    with pytest.raises(DecoderLMError, match="dtype='float8'"):
        load(run_dir, dtype="float8")


def test_load_reads_a_hugging_face_directory(run_dir, tmp_path, tokenizer):
    from decoderlm.hf import export_hf

    hf_dir = export_hf(run_dir, tmp_path / "hf")
    model, hf_tokenizer = load(hf_dir)
    ours, _ = load(run_dir)
    ids = torch.tensor([tokenizer.encode("Before we proceed")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ours(ids), rtol=0, atol=1e-6)  # same weights
    assert hf_tokenizer.encode("speak") == tokenizer.encode("speak")


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_command_streams_the_greedy_continuation(capsys, run_dir):
    argv = ["generate", "--checkpoint", run_dir, "--prompt", "All:", "--max-new-tokens", 12]
    code, out, err = cli(capsys, *argv, "--temperature", 0)
    assert code == 0, err
    model, tokenizer = load(run_dir)
    assert out == "All:" + generate_text(model, tokenizer, "All:", 12, temperature=0) + "\n"


def test_generate_command_draws_several_reproducible_samples(capsys, run_dir, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Speak", encoding="utf-8")
    args = ["generate", "--checkpoint", run_dir, "--prompt-file", prompt_file, "--max-new-tokens"]
    args += [8, "--num-samples", 2, "--seed", 5, "--top-k", 10, "--top-p", 0.9]
    first, second = cli(capsys, *args), cli(capsys, *args)
    assert first == second and first[0] == 0
    assert first[1].count("--- sample") == 2 and first[1].count("Speak") >= 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt", ""], "empty prompt"),
        (["--prompt", "Speak, " * 20], "more than the model's context_length=64"),
        (["--prompt", "All:", "--top-p", "1.5"], r"top_p=1.5 must be in \(0, 1\]"),
        (["--prompt", "All:", "--top-p", "0"], r"top_p=0.0 must be in \(0, 1\]"),
        (["--prompt", "All:", "--max-new-tokens", "100"], "exceeds context_length=64"),
        (["--prompt", "ẞ"], "not in the character vocabulary"),
    ],
)
def test_generate_command_bad_input_is_one_line_and_exit_2(capsys, run_dir, extra, message):
    code, out, err = cli(capsys, "generate", "--checkpoint", run_dir, *extra)
    assert code == 2 and out == ""
    assert err.startswith("decoderlm: error: ") and err.count("\n") == 1
    assert re.search(message, err), err


def test_commands_reject_an_unknown_checkpoint(capsys, tmp_path, text_file):
    for argv in (
        ["generate", "--checkpoint", tmp_path / "none", "--prompt", "x"],
        ["eval", "--checkpoint", tmp_path / "none", "--input", text_file],
        ["info", "--checkpoint", tmp_path / "none"],
    ):
        code, _, err = cli(capsys, *argv)
        kinds = "a run or Hugging Face directory, a .gguf file, or a model name"
        assert code == 2 and err.startswith(f"decoderlm: error: no such checkpoint: {argv[2]}; ")
        assert kinds in err and err.count("\n") == 1


def test_eval_command_reports_what_the_library_computes(capsys, run_dir, text_file):
    code, out, err = cli(capsys, "eval", "--checkpoint", run_dir, "--input", text_file, "--json")
    assert code == 0, err
    report = json.loads(out)
    model, tokenizer = load(run_dir)
    expected = evaluate_file(model, tokenizer, text_file)
    assert report["loss"] == pytest.approx(expected.loss, rel=1e-9)
    assert report["bits_per_byte"] == pytest.approx(expected.bits_per_byte, rel=1e-9)
    assert report["n_bytes"] == len(text_file.read_bytes())
    assert report["bucket_losses"] == pytest.approx(list(expected.bucket_losses), rel=1e-9)
    code, out, _ = cli(capsys, "eval", "--checkpoint", run_dir, "--input", text_file)
    assert code == 0 and "bits per byte" in out and "non-overlapping windows of 64" in out
    code, out, _ = cli(
        capsys, "eval", "--checkpoint", run_dir, "--input", text_file, "--bucket-width", "32"
    )
    rows = re.findall(r"positions +(\d+)–(\d+) +([\d.]+) +\(([\d,]+) tokens\)", out)
    by_32 = evaluate_file(model, tokenizer, text_file, bucket_width=32)
    assert [(int(a), int(b)) for a, b, _, _ in rows] == [(0, 31), (32, 63)]
    assert [float(x) for _, _, x, _ in rows] == pytest.approx(by_32.bucket_losses, abs=5e-5)
    code, _, err = cli(capsys, "eval", "--checkpoint", run_dir, "--input", text_file.parent / "x")
    assert code == 2 and "no such file" in err


def test_info_command_counts_parameters_and_kv_cache(capsys, run_dir):
    code, out, _ = cli(capsys, "info", "--preset", "llama-55m", "--json")
    assert code == 0
    info = json.loads(out)
    with torch.device("meta"):
        model = DecoderLM(ModelConfig.from_preset("llama-55m"))
    assert info["parameters"] == model.num_params() == 54_927_872
    assert info["forward_flops_per_token"] == model.flops_per_token(training=False)
    kv = {row["variant"]: row for row in info["kv_cache"]}
    # 2 (K, V) · 8 layers · n_kv_heads · 64 · 4 bytes: GQA 2 heads, MHA 8, MQA 1.
    assert [kv[v]["bytes_per_token"] for v in ("model", "MHA", "MQA")] == [8192, 32768, 4096]
    assert kv["MHA"]["bytes_at"]["131072"] == 131072 * 32768  # 4 GiB at 128k
    code, out, _ = cli(capsys, "info", "--checkpoint", run_dir, "--dtype", "bf16")
    assert code == 0 and "parameters" in out and "bfloat16" in out and "128k" in out


def test_eval_with_and_without_cpu_kernels_agree():
    model = tiny_model()
    ids = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(2))
    fast, plain = evaluate_tokens(model, ids), evaluate_tokens(model, ids, cpu_kernels=False)
    # float32 either way; the kernels only reorder the sums of each linear map (~1e-6 relative).
    assert fast.loss == pytest.approx(plain.loss, rel=1e-5) and fast.n_tokens == plain.n_tokens


def test_commands_give_the_same_results_with_no_cpu_kernels(capsys, run_dir, text_file):
    argv = ["generate", "--checkpoint", run_dir, "--prompt", "All:", "--max-new-tokens", 12]
    argv += ["--temperature", 0]
    # float32: the kernels only reorder sums (~1e-6), below the argmax gaps of 12 greedy tokens.
    assert cli(capsys, *argv, "--no-cpu-kernels") == cli(capsys, *argv)
    argv = ["eval", "--checkpoint", run_dir, "--input", text_file, "--json"]
    plain, fast = (
        json.loads(cli(capsys, *argv, *extra)[1]) for extra in (["--no-cpu-kernels"], [])
    )
    assert plain["loss"] == pytest.approx(fast["loss"], rel=1e-5)
