"""Speculative decoding: greedy output equals plain greedy's, token for token; rejection sampling
keeps the target's distribution; prompt lookup accepts on a repeating prompt; clear refusals."""

import copy

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.checkpoint import save_model
from decoderlm.cli import main
from decoderlm.inference.generate import generate
from decoderlm.inference.sampling import SamplingParams, token_probs
from decoderlm.inference.speculative import (
    AdaptiveK,
    PromptLookup,
    SpeculativeStats,
    accept,
)
from decoderlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7], list(range(10, 27)), [3], [8, 1, 8, 1, 8, 1, 8, 1]]


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> DecoderLM:
    torch.manual_seed(seed)
    config = dict(
        vocab_size=61,
        context_length=96,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        tie_embeddings=False,
    )
    return DecoderLM(ModelConfig(**{**config, **overrides})).to(dtype).eval()


def shallow_copy_of(model: DecoderLM, n_layers: int) -> DecoderLM:
    """A draft of fewer layers: the target's first n_layers blocks, its embeddings and head."""
    types = model.config.layer_types
    config = ModelConfig(
        **{
            **model.config.to_dict(),
            "n_layers": n_layers,
            "layer_types": None if types is None else types[:n_layers],
        }
    )
    draft = DecoderLM(config).to(model.tok_emb.weight.dtype).eval()
    state = {k: v for k, v in model.state_dict().items() if k in draft.state_dict()}
    draft.load_state_dict(state)
    return draft


def recurrent_model(layer_types: tuple[str, ...], seed: int = 0) -> DecoderLM:
    """A small float64 model of `layer_types` (Gated DeltaNet, Mamba-2, linear attention,
    attention), chunk 4 so that the prompts' prefills take the chunked form."""
    torch.manual_seed(seed)
    config = ModelConfig(
        **{
            **ModelConfig.from_preset("hybrid-tiny", vocab_size=61).to_dict(),
            "layer_types": layer_types,
            "n_layers": len(layer_types),
            "recurrent_chunk": 4,
        }
    )
    return DecoderLM(config).to(torch.float64).eval()


RECURRENT_MIXES = {
    "hybrid-tiny": ("gdn", "gdn", "gdn", "attention"),
    "recurrent-tiny": ("gdn",) * 4,
    "mamba2-linear": ("mamba2", "attention", "linear_attention"),
}


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("draft_kind", ["self", "shallow", "other", "prompt-lookup"])
def test_greedy_speculative_output_is_plain_greedy_output(n_kv_heads, draft_kind):
    model = tiny_model(n_kv_heads=n_kv_heads)
    draft = {
        "self": copy.deepcopy(model),
        "shallow": shallow_copy_of(model, 1),
        "other": tiny_model(seed=1, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1),
        "prompt-lookup": "prompt-lookup",
    }[draft_kind]
    plain = generate(model, PROMPTS, 30, temperature=0)
    stats = SpeculativeStats()
    fast = generate(
        model,
        PROMPTS,
        30,
        temperature=0,
        draft=draft,
        num_speculative_tokens=3,
        speculative_stats=stats,
    )
    # float64: the K+1-token verification differs from one-token steps by rounding (~1e-15) only.
    assert fast == plain
    assert stats.tokens == 30 * len(PROMPTS)
    if draft_kind == "self":
        assert stats.acceptance_rate == 1.0
        assert stats.steps < 30 * len(PROMPTS) / 2


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_with_an_int8_cache_and_a_repetition_penalty(k):
    model = tiny_model()
    kwargs = dict(temperature=0, kv_cache_dtype="int8", repetition_penalty=1.3)
    plain = generate(model, PROMPTS, 20, **kwargs)
    for draft in (copy.deepcopy(model), "prompt-lookup"):
        assert generate(model, PROMPTS, 20, draft=draft, num_speculative_tokens=k, **kwargs) == (
            plain
        )


def test_speculative_stops_at_eos_like_plain_generate():
    model = tiny_model()
    plain = generate(model, PROMPTS, 30, temperature=0)
    eos = plain[1][len(PROMPTS[1]) + 4]  # the fifth new token of row 1
    expected = generate(model, PROMPTS, 30, temperature=0, eos_id=eos)
    got = generate(model, PROMPTS, 30, temperature=0, eos_id=eos, draft=copy.deepcopy(model))
    assert got == expected


def test_prompt_lookup_accepts_tokens_on_a_repeating_prompt():
    model = tiny_model()
    # The model's own greedy continuation, repeated: the lookup proposes what the model will say.
    start = [3, 9, 4]
    text = generate(model, [start], 40, temperature=0)[0]
    prompt = text + start
    stats = SpeculativeStats()
    out = generate(
        model,
        [prompt],
        30,
        temperature=0,
        draft="prompt-lookup",
        num_speculative_tokens=5,
        speculative_stats=stats,
    )
    assert out == generate(model, [prompt], 30, temperature=0)
    assert stats.accepted > 0
    assert stats.mean_accepted_length > 1


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(max_ngram=2)
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3], 2) == ([5, 6], None)
    assert lookup.propose([1, 2, 7, 2], 3) == ([7, 2], None)  # a 1-gram match
    assert lookup.propose([1, 2, 3], 3) == ([], None)


def test_adaptive_k_backs_off_after_failures_and_grows_after_successes():
    schedule = AdaptiveK(4)
    assert schedule.next() == 4
    schedule.update(4, 0)
    assert (schedule.k, schedule.wait) == (3, 1)
    assert schedule.next() == 0  # a plain step
    schedule.update(3, 0)
    assert schedule.wait == 3
    for _ in range(3):
        assert schedule.next() == 0
    schedule.update(2, 2)
    assert (schedule.k, schedule.wait, schedule.next()) == (4, 0, 4)


def _tv(counts: torch.Tensor, exact: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - exact).abs().sum())


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-model", "prompt-lookup"])
def test_rejection_sampling_keeps_the_target_distribution(deterministic):
    """Two tokens over a toy vocabulary V = 4, with K = 2, in 10⁵ rows at once.

    The toy target and draft are fixed tables: p1 (V,) the first token's distribution,
    p2 (V, V) the second's given the first, p3 (V, V, V) the third's given both; the same for the
    draft's q (prompt lookup: the drafts fixed tokens, q one-hot). Each row draws d1 ~ q1,
    d2 ~ q2(·|d1) and runs `accept` on (p1, p2(·|d1), p3(·|d1, d2)); its first two tokens are d1, d2
    (both accepted), d1 and the corrected token (one accepted), or the corrected token and a draw
    from p2(·|it) (none accepted: the next step). The total-variation distance between the
    empirical joint distribution of the two tokens (16 cells) and the exact p1(a)·p2(b|a) is ≤ 0.01
    (its sampling noise is ~0.005 at 10⁵ samples)."""
    v, n = 4, 100_000
    g = torch.Generator().manual_seed(0)

    def table(*shape: int) -> torch.Tensor:
        return torch.softmax(2 * torch.randn(*shape, v, generator=g, dtype=torch.float64), -1)

    p1, p2, p3 = table(), table(v), table(v, v)
    q1, q2 = table(), table(v)
    if deterministic:
        d1 = torch.full((n,), 2)
        d2 = torch.full((n,), 1)
        q = None
    else:
        d1 = torch.multinomial(q1, n, replacement=True, generator=g)  # (n,)
        d2 = torch.multinomial(q2[d1], 1, generator=g)[:, 0]  # (n,)
        q = torch.stack([q1.expand(n, v), q2[d1]], dim=1)  # (n, 2, V)
    p = torch.stack([p1.expand(n, v), p2[d1], p3[d1, d2]], dim=1)  # (n, 3, V)
    accepted, token = accept(torch.stack([d1, d2], dim=1), p, q, g)
    first = torch.where(accepted == 0, token, d1)
    after_rejection = torch.multinomial(p2[first], 1, generator=g)[:, 0]
    second = torch.where(accepted == 0, after_rejection, torch.where(accepted == 1, token, d2))
    counts = torch.bincount(first * v + second, minlength=v * v)
    exact = (p1[:, None] * p2).flatten()  # (V·V,) p1(a)·p2(b|a)
    assert _tv(counts, exact) <= 0.01
    if not deterministic:
        assert 0 < float((accepted == 2).double().mean()) < 1  # every branch was taken


def test_token_probs_is_what_sampling_draws_from():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    probs = token_probs(logits, SamplingParams(temperature=0.7, top_k=5))
    assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    assert int((probs[0] > 0).sum()) == 5
    greedy = token_probs(logits, SamplingParams(temperature=0))
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and bool((greedy.sum(-1) == 1).all())


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_sampled_speculative_decoding_is_seeded_and_within_bounds(kind):
    model = tiny_model() if kind == "attention" else recurrent_model(RECURRENT_MIXES["hybrid-tiny"])
    kwargs = dict(temperature=0.9, top_p=0.9, seed=3, draft=shallow_copy_of(model, 1))
    first = generate(model, PROMPTS, 15, **kwargs)
    assert first == generate(model, PROMPTS, 15, **kwargs)
    assert [len(r) - len(p) for r, p in zip(first, PROMPTS, strict=True)] == [15] * len(PROMPTS)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(draft="nope"), "must be a DecoderLM or 'prompt-lookup'"),
        (dict(draft="prompt-lookup", num_speculative_tokens=0), "must be an integer ≥ 1"),
        (dict(num_speculative_tokens=2), "needs a draft"),
        (dict(draft="prompt-lookup", compile=True), "does not support compile"),
        (dict(draft="prompt-lookup", refill_past_context=True), "refill_past_context"),
    ],
)
def test_bad_speculative_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(DecoderLMError, match=message):
        generate(tiny_model(), PROMPTS, 5, **kwargs)


def test_a_draft_of_another_vocabulary_is_refused():
    with pytest.raises(DecoderLMError, match="must share a vocabulary"):
        generate(tiny_model(), PROMPTS, 5, draft=tiny_model(vocab_size=62))


@pytest.mark.parametrize("layers", [None, (0,)], ids=["every-layer", "mixed"])
@pytest.mark.parametrize("draft_kind", ["self", "shallow", "prompt-lookup"])
def test_sliding_window_models_decode_speculatively_as_plain_greedy(layers, draft_kind):
    """Windows of 6 slots, prompts and outputs well past them (the mixed model's full layer, and
    its rings, in int8): once a ring is full it rolls back at most 1 token, so the proposals
    shrink to what it can forget (`rollback_room`)."""
    model = tiny_model(sliding_window=6, sliding_window_layers=layers, context_length=64)
    draft = {
        "self": copy.deepcopy(model),
        "shallow": shallow_copy_of(model, 1),
        "prompt-lookup": "prompt-lookup",
    }[draft_kind]
    # The 4th prompt repeats: prompt lookup proposes, and is accepted, while the ring is full.
    kwargs = dict(temperature=0, kv_cache_dtype="int8" if layers else None)
    plain = generate(model, PROMPTS, 30, **kwargs)
    stats = SpeculativeStats()
    got = generate(
        model, PROMPTS, 30, draft=draft, num_speculative_tokens=4, speculative_stats=stats, **kwargs
    )
    assert got == plain
    assert stats.verifications > 0


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 8


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    tokenizer = Tokenizer.train_char([TEXT])
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=tokenizer.vocab_size, context_length=64, d_model=64, n_layers=2
    )
    save_model(run, DecoderLM(config).eval(), tokenizer)
    return run


@pytest.mark.parametrize("draft", ["prompt-lookup", "run"])
def test_generate_command_with_a_draft_prints_the_plain_greedy_text(capsys, run_dir, draft):
    argv = ["generate", "--checkpoint", str(run_dir), "--prompt", "All: All: All:"]
    argv += ["--max-new-tokens", "12", "--temperature", "0"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    draft_flags = ["--draft", str(run_dir) if draft == "run" else draft]
    assert main([*argv, *draft_flags, "--num-speculative-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    # float32: the 4-token verification reorders sums (~1e-6), below 12 greedy tokens' argmax gaps.
    assert out == plain
    assert "acceptance rate" in err
    if draft == "run":
        assert "acceptance rate 1.000" in err


@pytest.mark.parametrize("mix", RECURRENT_MIXES)
@pytest.mark.parametrize("draft_kind", ["prompt-lookup", "shallow", "other"])
def test_recurrent_models_decode_speculatively_as_plain_greedy_with_rejections(mix, draft_kind):
    """Random models reject most proposals, so the recurrent states go back to their checkpoints
    and the accepted tokens are written again (the old refusal, "cannot roll back", is gone);
    prompts of different lengths, the 4th repetitive (prompt lookup proposes on it). float64: the
    verification passes differ from one-token steps by rounding (~1e-15) only."""
    model = recurrent_model(RECURRENT_MIXES[mix])
    draft = {
        "prompt-lookup": "prompt-lookup",
        "shallow": shallow_copy_of(model, 2),  # recurrent layers of its own to roll back
        "other": recurrent_model(("gdn", "attention"), seed=1),
    }[draft_kind]
    plain = generate(model, PROMPTS, 24, temperature=0)
    stats = SpeculativeStats()
    got = generate(
        model,
        PROMPTS,
        24,
        temperature=0,
        draft=draft,
        num_speculative_tokens=3,
        speculative_stats=stats,
    )
    assert got == plain
    assert stats.accepted < stats.proposed  # some rejected: rolled back to a checkpoint
    if draft_kind != "other":  # an unrelated random draft may have none accepted
        assert stats.accepted > 0  # some accepted: written again after the checkpoint
    assert stats.tokens == 24 * len(PROMPTS)


def test_a_recurrent_self_draft_is_accepted_whole_without_writing_tokens_again():
    """The draft is the target: every proposal is accepted, nothing is rolled back in the target,
    so it takes no pass beyond its verifications (steps ≤ tokens / 2)."""
    model = recurrent_model(RECURRENT_MIXES["hybrid-tiny"])
    stats = SpeculativeStats()
    got = generate(
        model,
        PROMPTS,
        24,
        temperature=0,
        draft=copy.deepcopy(model),
        num_speculative_tokens=3,
        speculative_stats=stats,
    )
    assert got == generate(model, PROMPTS, 24, temperature=0)
    assert stats.acceptance_rate == 1.0
    assert stats.steps == stats.verifications < 24 * len(PROMPTS) / 2
