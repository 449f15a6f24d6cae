"""Generation: padded batches, the sampling rules (against definitions and transformers), streaming."""

import pytest
import torch

import decoderlm
from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.cpu import decode as decode_step
from decoderlm.cpu.decode import CPULinearKernels
from decoderlm.inference.generate import evaluating, generate
from decoderlm.inference.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    draw,
    greedy_tokens,
    sample_next,
    top_k_filter,
    top_p_filter,
)
from decoderlm.inference.stream import IncrementalDecoder, StopMatcher, generate_text, stream
from decoderlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(
    position: str = "rope", dtype: torch.dtype = torch.float64, seed: int = 0, **overrides
) -> DecoderLM:
    torch.manual_seed(seed)
    config = dict(
        vocab_size=101,
        context_length=96,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp="swiglu",
        norm="rmsnorm",
        position=position,
        bias=False,
        tie_embeddings=False,
    )
    return DecoderLM(ModelConfig(**{**config, **overrides})).to(dtype).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"
    return Tokenizer.train_bpe([text * 20], vocab_size=300)


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal"])
def test_padded_batch_gives_the_same_tokens_as_each_prompt_alone(position):
    model = tiny_model(position)
    prompts = [[5, 6, 7], list(range(10, 27)), [3], [8, 1, 8, 1, 8]]
    alone = [generate(model, [p], 25, temperature=0)[0] for p in prompts]
    # float64: rows differ from their solo runs only by rounding (~1e-15), far below any argmax gap.
    assert generate(model, prompts, 25, temperature=0) == alone


def test_tensor_prompt_and_list_prompt_agree_and_keep_the_prompt():
    model = tiny_model()
    ids = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])
    out = generate(model, ids, 6, temperature=0)
    assert out == generate(model, ids.tolist(), 6, temperature=0)
    assert [row[:4] for row in out] == ids.tolist() and all(len(row) == 10 for row in out)
    assert generate(model, [1, 2, 3, 4], 6, temperature=0) == out[:1]  # one flat id list = one row
    assert decoderlm.generate(model, ids, 6, temperature=0) == out  # the package-level call


def test_top_k_never_yields_a_token_outside_the_top_k():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)).expand(4000, 50)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    draws = sample_next(logits, SamplingParams(top_k=5), generator=torch.Generator().manual_seed(1))
    assert set(draws.tolist()) == top5  # all draws inside the top 5, and each of the 5 is reachable


def test_draw_picks_each_token_in_proportion_to_its_probability():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 1e-9, 0.0])  # unnormalised is allowed: ×2 below
    n = 200_000
    draws = draw((2 * probs).expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0  # never a token of probability 0, the last one included
    # Binomial counts: within 5 standard deviations (√(n p (1 − p)) ≤ 224) of n p.
    assert (counts - n * probs.double()).abs().max() < 5 * 224


def test_top_p_keeps_the_smallest_set_with_mass_at_least_p():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(3, 40, generator=g, dtype=torch.float64) * 2
        p = float(torch.rand((), generator=g, dtype=torch.float64)) * 0.98 + 0.01
        probs = logits.softmax(-1)
        for row in range(3):
            ranked = probs[row].sort(descending=True)
            mass = ranked.values.cumsum(0)
            m = int((mass < p).sum()) + 1  # smallest m with the top-m mass ≥ p
            assert (mass[m - 1] - p).abs() > 1e-9, "p on a boundary: ambiguous case"
            kept = torch.isfinite(top_p_filter(logits, p)[row]).nonzero().flatten()
            assert set(kept.tolist()) == set(ranked.indices[:m].tolist())


def test_top_k_top_p_and_repetition_penalty_match_transformers():
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=g) * 3
    ids = torch.randint(0, 64, (4, 10), generator=g)
    seen = torch.zeros(4, 64, dtype=torch.bool).scatter_(1, ids, True)
    torch.testing.assert_close(top_k_filter(logits, 7), TopKLogitsWarper(7)(ids, logits.clone()))
    torch.testing.assert_close(
        top_p_filter(logits, 0.8), TopPLogitsWarper(0.8)(ids, logits.clone())
    )
    torch.testing.assert_close(
        apply_repetition_penalty(logits, seen, 1.3),
        RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone()),
    )


def test_repetition_penalty_follows_ctrl():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    # seen: positive logits divided by the penalty, negative ones multiplied; unseen unchanged.
    expected = torch.tensor([[1.0, -4.0, 1.0, -1.0]])
    assert torch.equal(apply_repetition_penalty(logits, seen, 2.0), expected)


def test_fixed_seed_reproduces_and_another_seed_differs():
    model = tiny_model()
    run = lambda seed: generate(model, [[1, 2, 3]], 30, temperature=1.0, top_p=0.95, seed=seed)  # noqa: E731
    assert run(7) == run(7)
    assert run(7) != run(8)  # 30 draws from ~100 tokens: equal by chance with probability ≈ 0


def test_temperature_zero_is_greedy_whatever_the_other_settings():
    model = tiny_model()
    greedy = generate(model, [[4, 5, 6]], 20, temperature=0)
    assert generate(model, [[4, 5, 6]], 20, temperature=0, top_k=3, top_p=0.5, seed=1) == greedy
    logits = torch.randn(5, 101)
    assert torch.equal(sample_next(logits, SamplingParams(temperature=0)), logits.argmax(-1))


def test_num_samples_gives_rows_per_prompt_in_order():
    model = tiny_model()
    out = generate(model, [[1, 2], [3, 4, 5]], 8, seed=0, num_samples=3)
    assert len(out) == 6
    assert [row[:2] for row in out[:3]] == [[1, 2]] * 3 and all(r[:3] == [3, 4, 5] for r in out[3:])
    assert len({tuple(row) for row in out[:3]}) == 3  # three different samples of prompt 0


def test_a_row_stops_after_its_end_of_text_token():
    model = tiny_model()
    free = generate(model, [[1, 2, 3], [7, 7]], 20, temperature=0)
    eos = free[0][3 + 5]  # the 6th new token of row 0 (taken as the end-of-text id)
    out = generate(model, [[1, 2, 3], [7, 7]], 20, temperature=0, eos_id=eos)
    first = free[0].index(eos, 3)
    assert out[0] == free[0][: first + 1]  # up to and including the first eos
    second = free[1].index(eos, 2) if eos in free[1][2:] else len(free[1]) - 1
    assert out[1] == free[1][: second + 1]


def test_generate_puts_back_the_training_mode():
    model = tiny_model(dropout=0.5)
    model.train()
    out = generate(model, [[1, 2, 3]], 10, temperature=0)
    assert model.training  # restored...
    assert out == generate(model.eval(), [[1, 2, 3]], 10, temperature=0)  # ...and no dropout inside


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=[[]]), "empty prompt"),
        (dict(prompt=[[1, 2], []]), "empty prompt"),
        (dict(prompt=[[1, 101]]), "outside the vocabulary"),
        (dict(prompt=torch.ones(1, 3)), "integer token ids"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_k=0), "top_k=0"),
        (dict(temperature=-1.0), "temperature"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(num_samples=0), "num_samples"),
        (dict(prompt=[list(range(97))]), "more than the model's context_length=96"),
    ],
)
def test_bad_arguments_raise_one_line_errors(kwargs, message):
    args = {"prompt": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(DecoderLMError, match=message) as info:
        generate(tiny_model(), **args)
    assert "\n" not in str(info.value)


def test_stream_yields_the_decoded_tokens_of_generate(tokenizer):
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    prompt = "To be, or not"
    pieces = list(stream(model, tokenizer, prompt, 40, seed=3))
    ids = tokenizer.encode(prompt)
    new = generate(model, [ids], 40, seed=3, eos_id=tokenizer.eot_id)[0][len(ids) :]
    new = new[:-1] if new[-1] == tokenizer.eot_id else new
    assert (
        "".join(pieces)
        == tokenizer.decode(new)
        == generate_text(model, tokenizer, prompt, 40, seed=3)
    )
    assert len(pieces) > 1  # streamed, not one block at the end


def test_stream_checks_its_arguments_before_the_first_piece(tokenizer):
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    with pytest.raises(DecoderLMError, match="empty prompt"):
        stream(model, tokenizer, "", 5)  # raised by the call, not by the first next()
    with pytest.raises(DecoderLMError, match="top_p"):
        stream(model, tokenizer, "To", 5, top_p=2.0)


def test_incremental_decoder_never_splits_a_multibyte_character(tokenizer):
    text = "naïve café — 日本語 🙂 ok"  # not in the training text: spelled with byte tokens
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # several tokens per character somewhere
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_stop_strings_cut_before_the_stop_even_across_pieces():
    matcher = StopMatcher(["o w", "END"])
    out = [matcher.feed(p) for p in ["Hel", "lo", " wo", "rld"]]
    assert "".join(out) == "Hell" and matcher.stopped
    matcher = StopMatcher(["abc"])
    assert [matcher.feed("xa"), matcher.feed("bd")] == ["x", "abd"]  # "a" held back, then released
    assert matcher.feed("ab") == "" and matcher.flush() == "ab" and not matcher.stopped


def test_stream_stops_before_a_stop_string(tokenizer):
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    full = generate_text(model, tokenizer, "To be", 30, temperature=0)
    stop = full[5:8]
    cut = generate_text(model, tokenizer, "To be", 30, temperature=0, stop=[stop])
    assert cut == full[: full.index(stop)]


def test_cpu_linear_kernels_compute_the_same_linear_maps():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in [(3, 7, 48), (80, 48), (80,)])
    expected = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    with torch.inference_mode(), CPULinearKernels():  # float32, eager: oneDNN's linear
        several = torch.nn.functional.linear(x, w, b)
        one_eager = torch.nn.functional.linear(x[:1, :1], w, b)
    with CPULinearKernels(compiling=True):  # one row (for torch.compile): a product and a row sum
        one = torch.nn.functional.linear(x[:1, :1], w, b)
    # float32 sums of 48 products of unit-scale numbers: rounding errors ~1e-6.
    torch.testing.assert_close(several, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(one_eager, expected[:1, :1], rtol=0, atol=1e-5)
    torch.testing.assert_close(one, expected[:1, :1], rtol=0, atol=1e-5)


def test_cpu_linear_kernels_leave_autograd_to_f_linear():
    w = torch.randn(8, 4, requires_grad=True)
    with CPULinearKernels():
        y = torch.nn.functional.linear(torch.randn(3, 4), w)
    y.sum().backward()  # oneDNN's inference kernel has no backward: F.linear must have run
    assert w.grad is not None and w.grad.shape == (8, 4)


def test_compiled_decoding_gives_the_eager_tokens_for_each_model_and_batch_shape(
    tmp_path, monkeypatch
):
    # The compiled step takes the weights as inputs: two models of one architecture share one
    # library on disk (model 1 would decode with model 0's weights if they were baked in), and a
    # second batch shape gets a library of its own.
    monkeypatch.setattr(decode_step, "_cache_dir", lambda: tmp_path)
    models = [tiny_model(dtype=torch.float32, seed=seed) for seed in (0, 1)]
    for model, prompts in [
        (models[0], [[5, 6, 7]]),
        (models[1], [[5, 6, 7]]),
        (models[0], [[3], [8, 1, 8]]),
    ]:
        eager = generate(model, prompts, 12, temperature=0)
        # float32, same weights: the compiled step only reorders sums (~1e-6) below the argmax gaps.
        assert generate(model, prompts, 12, temperature=0, compile=True) == eager
    assert len(list(tmp_path.glob("step-*.pt2"))) == 2


def test_compiled_prefill_pads_prompts_and_gives_the_eager_tokens():
    # Compiled prefill left-pads the prompts to a multiple of 64 (3 → 64, 70 → 128); checked in
    # float32, where the compiled graphs only reorder sums (~1e-6) below the argmax gaps.
    model = tiny_model(dtype=torch.float32, seed=2)
    for prompts in ([[5, 6, 7], list(range(1, 71))], [list(range(1, 65))]):
        eager = generate(model, prompts, 10, temperature=0)
        assert generate(model, prompts, 10, temperature=0, compile=True) == eager


def test_sampling_options_as_params_or_keywords_give_the_same_tokens():
    model = tiny_model()
    params = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2)
    by_params = generate(model, [[1, 2, 3]], 15, params, seed=4)
    assert by_params == generate(
        model, [[1, 2, 3]], 15, temperature=0.7, top_k=5, repetition_penalty=1.2, seed=4
    )
    # Keywords replace only the fields they name: greedy, still with params' repetition penalty.
    assert generate(model, [[1, 2, 3]], 15, params, temperature=0) == generate(
        model, [[1, 2, 3]], 15, temperature=0, repetition_penalty=1.2
    )


def test_an_unknown_option_raises_one_line_naming_the_sampling_options(tokenizer):
    allowed = "temperature, top_k, top_p, repetition_penalty"
    with pytest.raises(DecoderLMError, match=f"unknown option temprature=0.5; .*{allowed}") as info:
        generate(tiny_model(), [[1, 2]], 3, temprature=0.5)
    assert "\n" not in str(info.value)
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    with pytest.raises(DecoderLMError, match="unknown option topk=3"):
        stream(model, tokenizer, "To", 3, topk=3)
    with pytest.raises(DecoderLMError, match="must be a SamplingParams"):
        generate(tiny_model(), [[1, 2]], 3, 0.8)  # a temperature where params goes


def test_cpu_kernels_switch_routes_linears_to_onednn_or_leaves_them(monkeypatch):
    if not decode_step.onednn.AVAILABLE:
        pytest.skip("this torch build has no oneDNN linear")
    calls = []
    kernel = decode_step.onednn.onednn_linear
    monkeypatch.setattr(
        decode_step.onednn, "onednn_linear", lambda *args: calls.append(1) or kernel(*args)
    )
    model = tiny_model(dtype=torch.float32, seed=3)
    prompts = [[5, 6, 7, 8], [9, 10]]
    plain = generate(model, prompts, 10, temperature=0, cpu_kernels=False)
    assert calls == []  # off: every linear map is F.linear
    # float32: oneDNN only reorders the sums (~1e-6), far below the argmax gaps.
    assert generate(model, prompts, 10, temperature=0) == plain
    assert calls  # on (the default): the prefill's linears went to oneDNN


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=5e-324),  # rounds to 0 in float32
        SamplingParams(temperature=1e-300),  # l / T overflows float32
        SamplingParams(repetition_penalty=1e-300),  # l / penalty overflows float32
    ],
)
def test_extreme_sampling_values_still_draw_a_valid_token(params):
    """Values at the edge of float32 never give NaN probabilities or an id outside the vocabulary:
    the most likely token survives top-p, and a vanishing temperature behaves as greedy."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, -2.0, 4.0, 0.0]])
    seen = torch.ones_like(logits, dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    # A vanishing penalty sends every positive logit to the same (largest) value: any of them.
    allowed = [{1}, {2}] if params.repetition_penalty == 1.0 else [{0, 1, 2}, {0, 2}]
    for _ in range(20):
        token = sample_next(logits, params, seen, generator).tolist()
        assert all(t in ok for t, ok in zip(token, allowed, strict=True)), token


def test_evaluating_switches_only_training_modules_and_restores_each_mode():
    model = DecoderLM(ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, dropout=0.5))
    model.train()
    model.blocks[1].eval()  # a mixed model: one block already in eval mode
    before = [m.training for m in model.modules()]
    x = torch.randint(0, 16, (1, 8))
    with evaluating(model):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(x), model(x))  # dropout is off
        assert torch.is_inference_mode_enabled()
    assert [m.training for m in model.modules()] == before
    model.eval()
    with evaluating(model):  # nothing to switch
        pass
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("vocab", [5, 128, 300, 32000])
def test_greedy_tokens_equal_argmax_with_ties_for_any_vocabulary_size(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[1] = 0.0  # all tied: the first index
    logits[2, -1] = logits[2].max() + 1  # the maximum in the partial last slice
    logits[3, [vocab // 3, vocab - 1]] = 10.0  # a tie across slices: the first of the two
    ties = torch.randint(0, 3, (6, vocab), generator=g).float()  # many ties in every row
    for rows in (logits, ties, logits.bfloat16(), logits[:1]):
        assert torch.equal(greedy_tokens(rows), rows.argmax(dim=-1))
