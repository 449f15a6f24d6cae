"""`generate(batch_invariant=True)`: every row's logits, at every step, are bit for bit those of the
row alone, whatever the rows beside it and its prompt's left padding, in bfloat16 and float32, over
plain and GGUF-block linears; they are the bits `Engine(batch_invariant=True)` gives the same
request, and `decoderlm generate --batch-invariant` prints the engine's text; seeded samples are
each prompt's alone and the engine's; the compiled one-token
step gives the eager steps' bits; what it cannot make invariant is a one-line error."""

from __future__ import annotations

import pytest
import torch
from block_models import in_blocks

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.checkpoint import save_model
from decoderlm.cli import main
from decoderlm.cpu import block_linear, decode, fused, invariant
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference import generate as generation
from decoderlm.inference.options import DecodeOptions
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not invariant.available(), reason="no C compiler for the kernels"),
]

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_char(["abcdefghijklmnopqrstuvwxyz .,\n"])


def model(tok: Tokenizer, dtype: torch.dtype, kind: str | None = None, **overrides) -> DecoderLM:
    """A tiny Llama (d_model 64, d_ff 160: whole blocks of 32), its linears in a GGUF file's
    blocks of `kind` where given and then its embedding in Q8_0's, as SmolLM2's file has them."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=tok.vocab_size, context_length=128, d_model=64, d_ff=160,
        n_layers=2, n_heads=4, n_kv_heads=2, **overrides,
    )  # fmt: skip
    lm = DecoderLM(config).eval()
    return (in_blocks(lm, kind, embedding="Q8_0") if kind else lm).to(dtype)


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def step_logits(monkeypatch, lm: DecoderLM, rows: list[list[int]], **options) -> torch.Tensor:
    """Greedy `generate`; the logits (B, NEW_TOKENS, V) its sampler received at each step."""
    seen = []

    def sample_next(logits, *args):
        seen.append(logits.clone())
        return sampled(logits, *args)

    sampled = generation.sample_next
    monkeypatch.setattr(generation, "sample_next", sample_next)
    generation.generate(lm, rows, NEW_TOKENS, temperature=0, **options)
    monkeypatch.setattr(generation, "sample_next", sampled)
    return torch.stack(seen, dim=1)


def rows_alone_and_together(monkeypatch, lm, rows, **options) -> list[bool]:
    """For each row: whether its logits among `rows` equal, bit for bit, its logits alone."""
    together = step_logits(monkeypatch, lm, rows, **options)
    return [
        torch.equal(step_logits(monkeypatch, lm, [row], **options)[0], logits)
        for row, logits in zip(rows, together, strict=True)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", [None, "Q4_1", "Q8_0"])
def test_every_rows_logits_are_its_bits_alone(monkeypatch, tok, dtype, kind):
    if kind and not block_linear.available():
        pytest.skip("no C compiler for the block kernels")
    lm = model(tok, dtype, kind)
    rows = prompts(12, tok.vocab_size)  # 2 to 39 tokens: up to 37 of left padding
    assert all(rows_alone_and_together(monkeypatch, lm, rows, batch_invariant=True))
    if kind is None and dtype == torch.float32:  # measured: every row's logits differ
        assert not all(rows_alone_and_together(monkeypatch, lm, rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", [None, "Q4_1"])
def test_its_log_probabilities_are_the_engines_bits(monkeypatch, tok, dtype, kind):
    if kind and not block_linear.available():
        pytest.skip("no C compiler for the block kernels")
    lm = model(tok, dtype, kind)
    rows = prompts(8, tok.vocab_size)
    logprobs = torch.log_softmax(step_logits(monkeypatch, lm, rows, batch_invariant=True), -1)
    params = RequestParams(NEW_TOKENS, SamplingParams(temperature=0), ignore_eos=True, logprobs=0)
    served = Engine(lm, tok, block_size=4, batch_invariant=True).generate(rows, params)
    for b, output in enumerate(served):
        ours = [float(logprobs[b, t, token]) for t, token in enumerate(output.token_ids)]
        assert output.logprobs == ours


@pytest.mark.parametrize(("dtype", "kind"), [(torch.float32, None), (torch.bfloat16, "Q4_1")])
def test_seeded_samples_are_the_prompts_alone_and_the_engines(tok, dtype, kind):
    """Sampled rows (temperature, top-k, top-p, repetition penalty), 2 samples of each of 6
    prompts with seed 3: sample s of a prompt is the prompt alone with seed 3 + s, and the
    engine's sample s of a request with seed 3. One generator for the batch (the default) does
    not give that."""
    if kind and not block_linear.available():
        pytest.skip("no C compiler for the block kernels")
    lm = model(tok, dtype, kind)
    rows = prompts(6, tok.vocab_size)
    sampling = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, repetition_penalty=1.2)

    def run(prompts: list[list[int]], seed: int, **options) -> list[list[int]]:
        new = generation.generate(lm, prompts, NEW_TOKENS, sampling, seed=seed, **options)
        return [
            row[len(prompts[i // options.get("num_samples", 1)]) :] for i, row in enumerate(new)
        ]

    together = run(rows, 3, num_samples=2, batch_invariant=True)
    alone = [run([row], 3 + s, batch_invariant=True)[0] for row in rows for s in range(2)]
    assert together == alone
    assert together[0::2] != together[1::2]  # the samples of a prompt draw apart
    params = RequestParams(NEW_TOKENS, sampling, ignore_eos=True, seed=3, n=2)
    served = Engine(lm, tok, block_size=4, batch_invariant=True).generate(rows, params)
    assert [output.token_ids for output in served] == together
    assert run(rows, 3, num_samples=2) != together  # one generator: rows draw in batch order


@pytest.mark.parametrize(("dtype", "kind"), [(torch.float32, None), (torch.bfloat16, "Q4_1")])
def test_the_compiled_step_gives_the_eager_steps_bits(monkeypatch, tok, dtype, kind):
    if not (invariant.ops_available() and fused.ops_available() and block_linear.available()):
        pytest.skip("no C++ compiler for the ops of the compiled step")
    lm = model(tok, dtype, kind)
    rows = prompts(6, tok.vocab_size)
    eager = step_logits(monkeypatch, lm, rows, batch_invariant=True)
    calls = []
    run = decode.CompiledStep.__call__
    monkeypatch.setattr(decode.CompiledStep, "__call__", lambda *a: calls.append(1) or run(*a))
    compiled = step_logits(monkeypatch, lm, rows, batch_invariant=True, compile=True)
    assert len(calls) == NEW_TOKENS - 1  # every step after the prompt's, by the library
    # without Inductor's eager roundings the Q8_0 embedding's bfloat16 rows went into the
    # residual sum unrounded (0.003 off)
    assert torch.equal(compiled, eager)


def test_compiled_its_prompts_are_padded_to_the_longest_only(tok):
    """The prompts run eagerly in batch-invariant mode, so compiling pads them to the longest
    (36 tokens), not to a multiple of 64 as the compiled prefill's graph sharing does; the cache
    keeps the compiled step's rounding."""
    rows = prompts(12, tok.vocab_size)
    assert max(len(row) for row in rows) == 36
    invariant = DecodeOptions.of(compile=True, batch_invariant=True)
    assert generation._fill_lengths(rows, NEW_TOKENS, 256, invariant) == (36, 256)
    default = DecodeOptions.of(compile=True)
    assert generation._fill_lengths(rows, NEW_TOKENS, 256, default) == (64, 256)


@pytest.mark.parametrize(
    ("overrides", "options", "reason"),
    [
        ({"layer_types": ("gdn", "attention")}, {}, "recurrent layers"),
        ({"sliding_window": 8}, {}, "a sliding window"),
        ({}, {"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'"),
        ({"mlp": "gelu"}, {}, "mlp: a gelu MLP"),
        ({}, {"draft": "prompt-lookup"}, "batch_invariant=True with a draft"),
    ],
)
def test_what_it_cannot_make_invariant_is_a_one_line_error(tok, overrides, options, reason):
    lm = model(tok, torch.float32, **overrides)
    with pytest.raises(DecoderLMError, match=reason) as err:
        generation.generate(lm, [[1, 2, 3]], 4, batch_invariant=True, **options)
    assert "\n" not in str(err.value)


def test_the_generate_command_prints_the_engines_text(capsys, tmp_path, tok):
    """`decoderlm generate --batch-invariant` (bfloat16 weights): the text the engine gives the
    same request in batch-invariant mode; with --draft, one line and exit code 2."""
    lm = model(tok, torch.bfloat16)
    save_model(tmp_path, lm, tok)
    prompt = "the sea is calm, the"
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", prompt, "--ignore-eos",
            "--max-new-tokens", "24", "--temperature", "0", "--batch-invariant"]  # fmt: skip
    assert main(argv) == 0
    params = RequestParams(24, SamplingParams(temperature=0), ignore_eos=True)
    served = Engine(lm, tok, batch_invariant=True).generate([tok.encode_prompt(prompt)], params)
    assert capsys.readouterr().out == prompt + tok.decode(served[0].token_ids) + "\n"
    assert main([*argv, "--draft", "prompt-lookup"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "batch_invariant=True with a draft" in err
