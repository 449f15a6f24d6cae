"""The verifier of both test-time studies (`decoderlm.lab.test_time`, `.test_time_real`): a head
on the policy's frozen hidden states (`decoderlm.training.head_verifier`; Cobbe et al., 2021,
trained a verifier on the policy's own labelled samples), fit on labelled samples of train-split
problems, judged on held-out problems and then on the study's pooled test samples; and the
report's section on it.

AUC within problems (the chance that a problem's correct sample outscores its wrong one) is what
best-of-N reads. At 0.5 the verifier ranks at random, and since identical samples score alike it
picks about uniformly among the N samples' distinct texts, not among the samples: where the
right samples repeat one text and the wrong ones differ, that is below one sample's accuracy and
falls as N grows (benchmarks/verifier_picks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from decoderlm.errors import DecoderLMError
from decoderlm.lab.report import markdown_table
from decoderlm.model.lm import DecoderLM
from decoderlm.search.head_verifier import HeadVerifier, trunk
from decoderlm.search.verifier import Example
from decoderlm.tokenizer import Tokenizer
from decoderlm.training.head_verifier import HeadFit, auc, fit_verifier, ranked_pairs

VAL_SHARE = 10  # every 10th problem's samples validate the head


def fit_head_verifier(
    model: DecoderLM,
    tokenizer: Tokenizer,
    labelled: Sequence[Sequence[Example]],
    layers: Sequence[int],
    steps: int,
    within: bool = False,
) -> tuple[HeadVerifier, dict[str, Any]]:
    """A head per candidate layer fit on the samples of `labelled` (one list a problem), every
    VAL_SHARE-th problem's held out; the verifier of the layer with the lowest validation loss,
    and what the fit recorded. `within`: fit only on problems with correct and wrong samples,
    each class of a problem weighing one half (`within_weights`)."""
    val = [e for i, group in enumerate(labelled) if i % VAL_SHARE == VAL_SHARE - 1 for e in group]
    groups = [g for i, g in enumerate(labelled) if i % VAL_SHARE != VAL_SHARE - 1]
    if within:
        kept = [(e, w) for g in groups for e, w in zip(g, within_weights(g), strict=True) if w]
        train, weights = [e for e, _ in kept], [w for _, w in kept]
    else:
        train, weights = [e for g in groups for e in g], None
    if not train:
        raise DecoderLMError("no train problem has both correct and wrong samples to fit on")
    head, table = fit_verifier(model, tokenizer, train, val, layers, HeadFit(steps=steps), weights)
    info = {
        "train_examples": len(train),
        "val_examples": len(val),
        "train_correct_share": sum(e.target for e in train) / len(train),
        "layers": table,
        "layer": head.layer,
        "within": within,
    }
    return HeadVerifier(trunk(model, head.layer), tokenizer, head), info


def within_weights(group: Sequence[Example]) -> list[float]:
    """One problem's samples weighted so that its correct ones and its wrong ones weigh the same
    (n/2 each, n the samples), none if it has only one kind: what is left to learn is what tells
    one problem's correct samples from its wrong ones, not which problems are easy (a verifier
    that learns difficulty prefers the wrong samples that look like an easy problem's)."""
    right = sum(e.target > 0.5 for e in group)
    wrong = len(group) - right
    if not right or not wrong:
        return [0.0] * len(group)
    return [len(group) / 2 / (right if e.target > 0.5 else wrong) for e in group]


def classifier(pools: Sequence[Sequence[tuple[float, bool]]]) -> dict[str, Any]:
    """The verifier on the test samples, (score, the checker's verdict) of each sample of each
    pool (one problem's samples under one seed): AUC over all samples, AUC within pools (the
    ranking best-of-N reads: only pairs of one problem's samples count), accuracy at 0.5, the
    share correct."""
    judged = [j for pool in pools for j in pool]
    if not judged:
        return {}
    right = sum((v > 0.5) == c for v, c in judged)
    counted = [ranked_pairs([v for v, _ in pool], [c for _, c in pool]) for pool in pools]
    wins, pairs = sum(w for w, _ in counted), sum(n for _, n in counted)
    return {"test_samples": len(judged), "test_auc": auc([v for v, _ in judged],
            [c for _, c in judged]), "test_auc_within": wins / pairs if pairs else None,
            "test_accuracy": right / len(judged),
            "test_correct_share": sum(c for _, c in judged) / len(judged)}  # fmt: skip


def verifier_section(verifier: dict[str, Any], model: str) -> list[str]:
    """The report's section: how the head was fit, each layer's validation judgement, and the
    test samples' AUC. `model` names whose states it reads ("the policy", "the model")."""
    rows = [
        [str(r["layer"]), f"{r['loss']:.3f}", f"{r['accuracy']:.1%}",
         "—" if r["auc"] is None else f"{r['auc']:.3f}"]
        for r in verifier["layers"]
    ]  # fmt: skip
    v = verifier
    within = v.get("test_auc_within")
    test = (
        f"On the pooled test samples ({v['test_samples']:,}, {v['test_correct_share']:.1%} "
        f"correct) it has AUC {v['test_auc']:.3f} and accuracy {v['test_accuracy']:.1%} at 0.5"
        + (f"; among one problem's samples, what best-of-N ranks, AUC {within:.3f}."
           if within is not None else ".")
        if v.get("test_auc") is not None
        else ""
    )  # fmt: skip
    return [
        "## The verifier",
        "",
        f"A logistic-regression head on {model}'s frozen residual stream, fit at every solution "
        f"token on {v['train_examples']:,} of its own samples of train-split problems "
        f"({v['train_correct_share']:.1%} correct), judged at the final token on "
        f"{v['val_examples']:,} samples of held-out problems; the layer kept is the one with the "
        f"lowest validation loss: {v['layer']}. {test}",
        "",
        *markdown_table(["after block", "val loss", "val accuracy", "val AUC"], rows),
    ]
