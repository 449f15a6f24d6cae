"""How a language-modelling run judges its model while it trains: the mean loss over validation
batches, its perplexity exp(loss) and bits per byte (`decoderlm.inference.evaluate.bits_per_byte`),
and samples continuing the run's prompt."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from decoderlm import data
from decoderlm.inference.evaluate import bits_per_byte
from decoderlm.inference.generate import generate
from decoderlm.model.lm import DecoderLM
from decoderlm.tokenizer import Tokenizer
from decoderlm.training.train_config import TrainConfig

PPL_MAX_LOSS = 700.0  # exp(loss) of a larger loss overflows a float: the perplexity is capped there


@torch.no_grad()
def mean_batch_loss(
    forward: Callable[[Tensor], Tensor],
    batch_loss: Callable[[Tensor, Tensor], Tensor],
    sampler: data.BatchSampler,
    iters: int,
    autocast: AbstractContextManager[Any],
    device: torch.device,
) -> Tensor:
    """The mean of `batch_loss(forward(x), y)` over the next `iters` batches (x, y) of `sampler`,
    on this process (a scalar on `device`)."""
    total = torch.zeros((), device=device)
    for _ in range(iters):
        x, y = sampler.next_batch()
        with autocast:
            outputs = forward(x.to(device))
        total += batch_loss(outputs, y.to(device))
    return total / iters


def lm_metrics(loss: float, meta: dict[str, Any]) -> dict[str, float]:
    """The validation loss, its perplexity and bits per byte (the data's meta.json gives the val
    split's tokens and bytes)."""
    bpb = bits_per_byte(loss, meta["val_tokens"], meta["val_bytes"])
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, PPL_MAX_LOSS)), "val_bpb": bpb}


def sample_texts(
    model: DecoderLM, tokenizer: Tokenizer, cfg: TrainConfig, max_new_tokens: int, n: int = 1
) -> list[str]:
    """`n` continuations of `cfg.sample_prompt` (none: from end-of-text, or a newline), sampled
    with the config's temperature, top-k and seed, each up to one of the model's stop ids (not
    shown)."""
    eot = tokenizer.eot_id
    prompt = tokenizer.encode(cfg.sample_prompt) if cfg.sample_prompt else []
    if not prompt:
        prompt = [eot] if eot is not None else tokenizer.encode("\n")
    rows = generate(  # in the weights' float32: the KV cache takes the model's dtype
        model,
        [prompt],
        max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k or None,
        seed=cfg.seed,
        eos_id=tokenizer.stop_ids,
        num_samples=n,
        refill_past_context=True,
    )
    start = 1 if prompt == [eot] else 0
    return [tokenizer.decode(_strip(row[start:], tokenizer.stop_ids)) for row in rows]


def _strip(ids: list[int], stops: tuple[int, ...]) -> list[int]:
    """ids without a final stop id (where a sample stopped)."""
    return ids[:-1] if ids and ids[-1] in stops else ids
