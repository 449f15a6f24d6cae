"""Fitting a verifier head (`decoderlm.search.head_verifier.VerifierHead`) on a frozen model's
hidden states: the policy's own samples, labelled by a task's checker
(`decoderlm.search.labelling`), are the examples.

Features: for every example, the residual stream after block L at each of its solution's tokens
(`solution_states`: one pass a batch reads every candidate layer). Fit: logistic regression at
every solution token toward the example's label, each example weighing the same however long:

    L = −(1/N) Σ_i (1/n_i) Σ_t [y_i·log σ(s_it) + (1 − y_i)·log(1 − σ(s_it))]

by full-batch AdamW with weight decay; the base model is never changed. `fit_verifier` fits one
head per candidate layer and keeps the one with the lowest validation loss at the final token,
what a search reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from decoderlm.model.lm import DecoderLM
from decoderlm.search.head_verifier import BATCH, VerifierHead, trunk
from decoderlm.search.verifier import Example, padded_batch
from decoderlm.tokenizer import Tokenizer
from decoderlm.training.verifier import encode_example


@dataclass(frozen=True)
class HeadFit:
    """How a head is fit: AdamW `steps` full-batch steps at `lr` with `weight_decay`."""

    steps: int = 300
    lr: float = 1e-2
    weight_decay: float = 1e-2
    seed: int = 0


def solution_states(
    model: DecoderLM, tokenizer: Tokenizer, examples: Sequence[Example], layers: Sequence[int]
) -> dict[int, list[Tensor]]:
    """Per layer, each example's hidden states after that block at its labelled positions (its
    solution's tokens, `encode_example`), (n_i, d_model) float32; one pass a batch of BATCH."""
    part = trunk(model, max(layers))
    captured: dict[int, Tensor] = {}
    hooks = [
        part.blocks[layer - 1].register_forward_hook(
            lambda module, args, out, layer=layer: captured.__setitem__(layer, out)
        )
        for layer in layers
    ]
    states: dict[int, list[Tensor]] = {layer: [] for layer in layers}
    try:
        for start in range(0, len(examples), BATCH):
            encoded = [
                encode_example(tokenizer, e, model.config.context_length)
                for e in examples[start : start + BATCH]
            ]
            ids, last = padded_batch([row for row, _ in encoded])  # (B, T), (B,)
            with torch.inference_mode():
                part(ids)
            for layer in layers:
                for i, (_, first) in enumerate(encoded):
                    states[layer].append(captured[layer][i, first : int(last[i]) + 1].float())
    finally:
        for hook in hooks:
            hook.remove()
    return states


def fit_head(
    states: Sequence[Tensor],
    targets: Sequence[float],
    layer: int,
    fit: HeadFit,
    weights: Sequence[float] | None = None,
) -> VerifierHead:
    """A head on block `layer`'s states, (n_i, d) per example, fit toward `targets` (L above,
    example i's term scaled by weights[i] when given)."""
    torch.manual_seed(fit.seed)
    x = torch.cat(list(states))  # (P, d): every labelled position
    y = torch.cat([torch.full((len(s),), float(t)) for s, t in zip(states, targets, strict=True)])
    weights = [1.0] * len(states) if weights is None else weights
    w = torch.cat([torch.full((len(s),), v / len(s)) for s, v in zip(states, weights, strict=True)])
    head = VerifierHead(x.shape[1], layer)
    head.mean.copy_(x.mean(0))
    head.scale.copy_(x.std(0).clamp_min(1e-6))
    rate = torch.tensor(sum(targets) / len(targets)).clamp(1e-3, 1 - 1e-3)
    torch.nn.init.zeros_(head.linear.weight)
    torch.nn.init.constant_(head.linear.bias, float(torch.logit(rate)))  # the base rate
    opt = torch.optim.AdamW(head.linear.parameters(), lr=fit.lr, weight_decay=fit.weight_decay)
    for _ in range(fit.steps):
        loss = (w * F.binary_cross_entropy_with_logits(head(x), y, reduction="none")).sum()
        opt.zero_grad()
        (loss / w.sum()).backward()
        opt.step()
    return head.eval()


@torch.no_grad()
def judge(head: VerifierHead, states: Sequence[Tensor], targets: Sequence[float]) -> dict[str, Any]:
    """The head at each example's final token: BCE, accuracy (σ > 0.5 against target > 0.5), AUC
    (`auc`) and the share of positive targets (the base rate)."""
    s = head(torch.stack([h[-1] for h in states]))  # (N,)
    y = torch.tensor([float(t) for t in targets])
    return {
        "loss": float(F.binary_cross_entropy_with_logits(s, y)),
        "accuracy": float(((s > 0) == (y > 0.5)).float().mean()),
        "auc": auc(s.tolist(), [t > 0.5 for t in targets]),
        "base_rate": float(y.mean()),
        "examples": len(targets),
    }


def ranked_pairs(scores: Sequence[float], labels: Sequence[bool]) -> tuple[float, int]:
    """(positive-negative pairs the positive wins, ties counting one half; all such pairs)."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins, len(positives) * len(negatives)


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """The area under the ROC curve: the chance that a random positive outscores a random
    negative, ties counting one half (Mann-Whitney U / (n₊·n₋)); None without both classes."""
    wins, pairs = ranked_pairs(scores, labels)
    return wins / pairs if pairs else None


def fit_verifier(
    model: DecoderLM,
    tokenizer: Tokenizer,
    train: Sequence[Example],
    val: Sequence[Example],
    layers: Sequence[int],
    fit: HeadFit,
    weights: Sequence[float] | None = None,
) -> tuple[VerifierHead, list[dict[str, Any]]]:
    """A head for each candidate layer, fit on `train` (weighted by `weights`, as `fit_head`
    takes them); (the one with the lowest validation loss, every layer's validation
    judgement)."""
    train_states = solution_states(model, tokenizer, train, layers)
    val_states = solution_states(model, tokenizer, val, layers)
    heads, table = [], []
    for layer in layers:
        head = fit_head(train_states[layer], [e.target for e in train], layer, fit, weights)
        heads.append(head)
        table.append({"layer": layer, **judge(head, val_states[layer], [e.target for e in val])})
    best = min(range(len(layers)), key=lambda i: table[i]["loss"])
    return heads[best], table
