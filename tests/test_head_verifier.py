"""The verifier head on a frozen model (`decoderlm.search.head_verifier`, fit by
`decoderlm.training.head_verifier`), on a tiny random model: the trunk's output is the model's
own hidden state after that block; scoring a text that extends a cached one runs only the new
tokens and gives the score of a full pass; the fit separates what is separable, leaves the base
model's weights untouched, and keeps the layer with the lowest validation loss."""

from __future__ import annotations

import math

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.search.head_verifier import HeadVerifier, VerifierHead, trunk
from decoderlm.search.verifier import Example
from decoderlm.tokenizer import Tokenizer
from decoderlm.training.head_verifier import HeadFit, auc, fit_head, fit_verifier, judge

TEXT = "Q: 3 + 4 = ?\nthree plus four\nanswer: 7\nanswer: 9\n" * 20


@pytest.fixture(scope="module")
def tiny() -> tuple[DecoderLM, Tokenizer]:
    tokenizer = Tokenizer.train_bpe([TEXT], vocab_size=300)
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=tokenizer.vocab_size, context_length=128, d_model=32,
        n_layers=3, n_heads=4, n_kv_heads=2,
    )  # fmt: skip
    return DecoderLM(config).eval(), tokenizer


def random_head(layer: int, seed: int = 0) -> VerifierHead:
    torch.manual_seed(seed)
    head = VerifierHead(32, layer)
    head.mean.normal_()
    head.scale.uniform_(0.5, 2.0)
    torch.nn.init.normal_(head.linear.weight)
    return head.eval()


def test_the_trunk_gives_the_models_hidden_state_after_that_block(tiny) -> None:
    model, tokenizer = tiny
    ids = torch.randint(0, tokenizer.vocab_size, (2, 11))
    seen = []
    hook = model.blocks[1].register_forward_hook(lambda m, a, out: seen.append(out) and None)
    with torch.no_grad():
        model(ids)
        hook.remove()
        torch.testing.assert_close(trunk(model, 2)(ids), seen[0], rtol=0, atol=0)
    shared = {id(p) for p in model.parameters()}
    assert {id(p) for p in trunk(model, 2).parameters()} <= shared  # no copy of a weight
    with pytest.raises(DecoderLMError, match=r"layers=4 must be an integer in 1\.\.3"):
        trunk(model, 4)


def test_a_cached_prefix_is_not_run_again_and_the_score_is_a_full_passs(tiny) -> None:
    model, tokenizer = tiny
    verifier = HeadVerifier(trunk(model, 2), tokenizer, random_head(2))
    ran: list[int] = []  # tokens each pass ran
    hook = verifier.part.blocks[0].register_forward_hook(lambda m, a, out: ran.append(len(a[0][0])))
    prompt, steps = "Q: 3 + 4 = ?\n", ["three plus four\n", "answer: 7\n", "answer: 9\n"]
    solutions = ["".join(steps[: i + 1]) for i in range(len(steps))]
    scores = [verifier(prompt, s) for s in solutions]
    full = [len(tokenizer.encode(prompt + s)) for s in solutions]
    assert ran == [full[0], full[1] - full[0], full[2] - full[1]]  # only the new tokens
    assert verifier(prompt, solutions[1]) == scores[1] and len(ran) == 3  # cached: no pass
    fork = verifier.fork()
    assert fork(prompt, solutions[0]) == pytest.approx(scores[0], abs=1e-6) and len(ran) == 4
    hook.remove()
    assert scores == pytest.approx(verifier.scores([prompt + s for s in solutions]), abs=1e-5)


def test_the_cache_holds_at_most_its_bound(tiny) -> None:
    model, tokenizer = tiny
    verifier = HeadVerifier(trunk(model, 1), tokenizer, random_head(1), cached=3)
    for i in range(6):
        verifier("Q:", " 3" * (i + 1))
    assert len(verifier.entries) == 3 and sum(verifier.lengths.values()) == 3


def test_a_head_of_another_layer_is_refused(tiny) -> None:
    model, tokenizer = tiny
    with pytest.raises(DecoderLMError, match="reads block 3's output, the trunk has 2"):
        HeadVerifier(trunk(model, 2), tokenizer, random_head(3))


def test_the_fit_separates_features_a_direction_separates(one_thread) -> None:
    """Every state of a right text leans along one direction, a wrong one's against it."""
    torch.manual_seed(0)
    direction = torch.randn(32)
    targets = [float(torch.rand(()) < 0.3) for _ in range(200)]
    states = [
        torch.randn(int(torch.randint(1, 6, ())), 32) + (2 * t - 1) * 0.5 * direction
        for t in targets
    ]
    head = fit_head(states, targets, 1, HeadFit(steps=300, lr=0.05))
    judged = judge(head, states, targets)
    assert judged["auc"] > 0.99 and judged["accuracy"] > 0.95 and judged["loss"] < 0.2
    assert judged["base_rate"] == pytest.approx(sum(targets) / 200)
    start = judge(fit_head(states, targets, 1, HeadFit(steps=0)), states, targets)
    rate = sum(targets) / 200  # unfit, the head says the base rate to every text
    expected = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert start["loss"] == pytest.approx(expected, abs=1e-4)


def test_auc_counts_ties_as_halves_and_needs_both_classes() -> None:
    assert auc([0.9, 0.1, 0.5, 0.5], [True, False, True, False]) == pytest.approx(0.875)
    assert auc([0.3, 0.4], [True, True]) is None


def test_fitting_a_verifier_keeps_the_base_frozen_and_the_best_layer(tiny, one_thread) -> None:
    model, tokenizer = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = "Q: 3 + 4 = ?\n"
    examples = [
        Example(prompt + f"three plus four\nanswer: {a}", float(a == 7), len(prompt))
        for a in (7, 9) * 12
    ]
    head, layers = fit_verifier(model, tokenizer, examples[:20], examples[20:], (1, 3),
                                HeadFit(steps=200, lr=0.05))  # fmt: skip
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [r["layer"] for r in layers] == [1, 3]
    assert head.layer == min(layers, key=lambda r: r["loss"])["layer"]
    assert all(r["auc"] == 1.0 and r["accuracy"] == 1.0 for r in layers)  # the last token differs
    verifier = HeadVerifier(trunk(model, head.layer), tokenizer, head)
    right, wrong = verifier(prompt, "three plus four\nanswer: 7"), verifier(prompt, "answer: 9")
    assert right > 0.5 > wrong
