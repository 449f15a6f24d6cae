"""Multi-query associative recall (MQAR; Arora et al., 2023, "Zoology", §3): can a model look up a
value it was shown earlier in its context?

A sequence holds N key-value pairs, then the N keys again in a random order, each followed by its
value: k₁ v₁ k₂ v₂ … k_N v_N k_{π(1)} v_{π(1)} … k_{π(N)} v_{π(N)}. Keys are distinct within a
sequence, drawn from `n_keys` tokens; values from `n_values` others (with repeats). The loss and
the accuracy count only the N answers, the values after the repeated keys (the pairs themselves
are random: nothing to learn there). Attention solves it with an induction head (look back for
the same key, copy the token after it); a recurrent layer must have written every pair into its
fixed-size state, which Zoology finds is where gated convolutions and linear attention fall short.

Data are drawn from a torch.Generator: the training batches from the run's seed, the test set
from `TEST_SEED` (the same for every run), so every variant sees the same examples. Training
reuses the trainer's optimizer pieces (`decoderlm.training.optim`): AdamW, warmup + cosine, clipping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM, next_token_loss
from decoderlm.training.optim import clip_and_step, learning_rate, make_optimizer
from decoderlm.training.runtime import cpu_threads
from decoderlm.training.train_config import TrainConfig

IGNORE = -100  # next_token_loss's ignore_index: positions that are not answers
TEST_SEED = 10_000  # the test set's generator seed (training batches use the run's seed)


@dataclass(frozen=True)
class RecallTask:
    """The task's shape and its short training run."""

    n_pairs: int = 16  # N key-value pairs (and N queries) per sequence: length 4N
    n_keys: int = 64  # key tokens 0 … n_keys − 1
    n_values: int = 64  # value tokens n_keys … n_keys + n_values − 1
    steps: int = 600  # optimizer steps of the training run
    batch_size: int = 32
    lr: float = 3e-3
    test_examples: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.n_pairs <= self.n_keys:
            raise DecoderLMError(
                f"n_pairs={self.n_pairs} must be in [1, n_keys={self.n_keys}] (keys are distinct)"
            )
        for name in ("n_values", "steps", "batch_size", "test_examples"):
            if getattr(self, name) < 1:
                raise DecoderLMError(f"recall {name}={getattr(self, name)} must be ≥ 1")

    @property
    def vocab_size(self) -> int:
        return self.n_keys + self.n_values

    @property
    def length(self) -> int:
        return 4 * self.n_pairs


def make_examples(task: RecallTask, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """n sequences as (inputs, targets), each (n, 4N − 1): targets are the next tokens at the N
    answer positions and IGNORE elsewhere."""
    pairs = task.n_pairs
    # distinct keys per row: the first N of a random permutation of the key tokens
    keys = torch.rand(n, task.n_keys, generator=generator).argsort(1)[:, :pairs]  # (n, N)
    values = task.n_keys + torch.randint(task.n_values, (n, pairs), generator=generator)  # (n, N)
    order = torch.rand(n, pairs, generator=generator).argsort(1)  # (n, N): the query order
    shown = torch.stack([keys, values], 2).flatten(1)  # (n, 2N): k₁ v₁ … k_N v_N
    asked = torch.stack([keys.gather(1, order), values.gather(1, order)], 2).flatten(1)  # (n, 2N)
    seq = torch.cat([shown, asked], 1)  # (n, 4N)
    targets = torch.full_like(seq[:, 1:], IGNORE)  # (n, 4N − 1): target t is seq[t + 1]
    answers = torch.arange(2 * pairs, 4 * pairs - 1, 2)  # input positions holding a repeated key
    targets[:, answers] = seq[:, answers + 1]
    return seq[:, :-1], targets


def recall_config(config: ModelConfig, task: RecallTask) -> ModelConfig:
    """The variant's model for the task: its shape, the task's vocabulary and length (and chunks
    no longer than a sequence: the chunked scans pad the last chunk, and the result does not
    depend on the chunk)."""
    return dataclasses.replace(
        config,
        vocab_size=task.vocab_size,
        context_length=task.length,
        recurrent_chunk=min(config.recurrent_chunk, task.length),
        extra={},
    )


@torch.no_grad()
def accuracy(model: DecoderLM, task: RecallTask) -> float:
    """Share of the test set's answers whose greedy prediction (argmax) is the value."""
    model.eval()
    x, y = make_examples(task, task.test_examples, torch.Generator().manual_seed(TEST_SEED))
    answer = y != IGNORE  # (n, 4N − 1)
    hits = torch.cat([model(xb).argmax(-1) for xb in x.split(64)]) == y
    return float(hits[answer].float().mean())


def train_and_score(
    config: ModelConfig, task: RecallTask, seed: int, threads: int = 0
) -> dict[str, float]:
    """Train a fresh model of `config`'s shape on the task (`task.steps` batches drawn from
    `seed`), then score it: {"recall_accuracy", "recall_final_loss"}. CPU threads as the
    trainer's (`threads`, 0: `cpu_threads`, the cores not busy now); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or cpu_threads())
    try:
        return _train_and_score(config, task, seed)
    finally:
        torch.set_num_threads(before)


def _train_and_score(config: ModelConfig, task: RecallTask, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    model = DecoderLM(recall_config(config, task))
    cfg = TrainConfig(
        lr=task.lr,
        min_lr=task.lr / 10,
        warmup_steps=max(1, task.steps // 10),
        max_steps=task.steps,
        batch_size=task.batch_size,
    )
    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.zeros(())
    for step in range(task.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step, 0.0)
        x, y = make_examples(task, task.batch_size, generator)
        loss = next_token_loss(model(x), y, ignore_index=IGNORE)
        loss.backward()
        clip_and_step(optimizer, scaler, cfg.grad_clip)
        optimizer.zero_grad(set_to_none=True)
    return {"recall_accuracy": accuracy(model, task), "recall_final_loss": float(loss.detach())}
