"""Multi-query associative recall (MQAR; Arora et al., 2023, "Zoology", §3.1 and App. E): can a
model look up a value it was shown earlier in its context?

A sequence of `length` tokens opens with N key-value pairs k₁ v₁ k₂ v₂ … k_N v_N (keys distinct,
from the first half of the vocabulary; values distinct, from the second half); the rest holds each
key once more, as a query, at an even offset drawn with Zoology's power law (slot i of the
(length − 2N)/2 slots with probability ∝ i^(a − 1), a = POWER_A: most queries come soon after the
pairs), and noise elsewhere. The target at a query is its key's value; the loss and the accuracy
count only those N answer positions. Zoology's noise is any token; here it is a value token, so
that no key appears a second time before its query, which a vocabulary this small would make
frequent.

Attention solves it with an induction head (find the earlier copy of the query, read the token
after it: two layers, Olsson et al., 2022); a recurrent layer must have written all N pairs into
its fixed-size state, so its accuracy falls as N grows and rises with the state (Zoology, Fig. 2).
The models compared (`RecallTask.mixes`) are two layers deep, as Zoology's: each mix of token
mixers at each head count (`RecallTask.heads`; d_model fixed, so a recurrent layer's state
H · (d_model / H)² = d_model² / H grows as the heads get fewer and wider).

Data are drawn from a torch.Generator: the training batches from the run's seed, the test sets
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
TEST_SEED = 10_000  # the test sets' generator seed (training batches use the run's seed)
POWER_A = 0.01  # Zoology's power_a: the query gaps' power law


# The models compared: name → token mixer of each layer (`ModelConfig.layer_types`); the first,
# all attention, is the reference whose parameter count the others match.
MIXES = {
    "attention": ("attention", "attention"),
    "linear attention": ("linear_attention", "linear_attention"),
    "Gated DeltaNet": ("gdn", "gdn"),
    "Mamba-2": ("mamba2", "mamba2"),
    "hybrid 1:1": ("gdn", "attention"),
}


@dataclass(frozen=True)
class RecallTask:
    """The task's shape, the models compared and the short training run of each."""

    vocab_size: int = 64  # keys 0 … V/2 − 1, values V/2 … V − 1
    length: int = 32  # tokens per sequence
    pairs: tuple[int, ...] = (2, 4, 8)  # N: trained on in turn (one per batch), scored on each
    mixes: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(MIXES))
    d_model: int = 64
    heads: tuple[int, ...] = (4, 1)  # n_heads of the models compared: the state grows as H falls
    steps: int = 1200  # optimizer steps of each training run
    batch_size: int = 32
    lr: float = 3e-3
    test_examples: int = 256  # per pair count

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", tuple(self.pairs))  # from JSON: lists
        object.__setattr__(self, "heads", tuple(self.heads))
        object.__setattr__(self, "mixes", {k: tuple(v) for k, v in dict(self.mixes).items()})
        for name in ("steps", "batch_size", "test_examples", "d_model"):
            if getattr(self, name) < 1:
                raise DecoderLMError(f"recall {name}={getattr(self, name)} must be ≥ 1")
        if not self.pairs or min(self.pairs) < 1:
            raise DecoderLMError(f"recall pairs={list(self.pairs)} must be counts ≥ 1")
        if not self.heads or any(h < 1 or self.d_model % h for h in self.heads):
            raise DecoderLMError(
                f"recall heads={list(self.heads)} must divide d_model={self.d_model}"
            )
        if not self.mixes or set(next(iter(self.mixes.values()))) != {"attention"}:
            raise DecoderLMError("recall mixes must start with the all-attention reference")
        if 4 * max(self.pairs) > self.length:
            raise DecoderLMError(
                f"recall length={self.length} must be ≥ 4 × the most pairs ({max(self.pairs)}): "
                "the pairs, then a query slot per key in what is left"
            )
        if max(self.pairs) > self.vocab_size // 2:
            raise DecoderLMError(
                f"recall vocab_size={self.vocab_size} must hold 2 × the most pairs "
                f"({max(self.pairs)}): distinct keys and values"
            )

    @property
    def n_keys(self) -> int:
        return self.vocab_size // 2


def make_examples(
    task: RecallTask, n_pairs: int, n: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """n sequences of N = n_pairs pairs as (inputs, targets), each (n, length): the targets are
    the values at the N query positions and IGNORE elsewhere."""
    keys_n, values_n = task.n_keys, task.vocab_size - task.n_keys
    keys = torch.rand(n, keys_n, generator=generator).argsort(1)[:, :n_pairs]  # (n, N)
    values = keys_n + torch.rand(n, values_n, generator=generator).argsort(1)[:, :n_pairs]
    slots = (task.length - 2 * n_pairs) // 2  # query slots: even offsets after the pairs
    weight = torch.arange(1, slots + 1, dtype=torch.float64) ** (POWER_A - 1)  # (slots,)
    chosen = torch.multinomial(weight.expand(n, slots), n_pairs, generator=generator)  # (n, N)
    x = keys_n + torch.randint(values_n, (n, task.length), generator=generator)  # noise: values
    x[:, 0 : 2 * n_pairs : 2], x[:, 1 : 2 * n_pairs : 2] = keys, values  # k₁ v₁ … k_N v_N
    query = 2 * n_pairs + 2 * chosen  # (n, N): key i asked at query[:, i]
    x.scatter_(1, query, keys)
    y = torch.full_like(x, IGNORE).scatter_(1, query, values)  # target t: the next token's
    return x, y


def recall_config(config: ModelConfig, task: RecallTask) -> ModelConfig:
    """A model of `config`'s shape for the task: its vocabulary and length (and chunks no longer
    than a sequence: the chunked scans pad the last chunk, and the result does not depend on it)."""
    return dataclasses.replace(
        config,
        vocab_size=task.vocab_size,
        context_length=task.length,
        recurrent_chunk=min(config.recurrent_chunk, task.length),
        extra={},
    )


@torch.no_grad()
def accuracy(model: DecoderLM, task: RecallTask, n_pairs: int) -> float:
    """Share of the test set's answers (N = n_pairs) whose greedy prediction is the value."""
    model.eval()
    generator = torch.Generator().manual_seed(TEST_SEED + n_pairs)
    x, y = make_examples(task, n_pairs, task.test_examples, generator)
    answer = y != IGNORE  # (n, length)
    hits = torch.cat([model(xb).argmax(-1) for xb in x.split(64)]) == y
    return float(hits[answer].float().mean())


def train_and_score(
    config: ModelConfig, task: RecallTask, seed: int, threads: int = 0
) -> dict[str, object]:
    """Train a fresh model of `config`'s shape on the task (`task.steps` batches drawn from
    `seed`, the pair counts in turn), then score it: {"accuracy": {str(N): share}, "final_loss":
    the mean loss of the last pass over the pair counts}. CPU threads as the trainer's
    (`threads`, 0: `cpu_threads`, the cores not busy now); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or cpu_threads())
    try:
        return _train_and_score(config, task, seed)
    finally:
        torch.set_num_threads(before)


def _train_and_score(config: ModelConfig, task: RecallTask, seed: int) -> dict[str, object]:
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
    last = []
    for step in range(task.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step, 0.0)
        x, y = make_examples(task, task.pairs[step % len(task.pairs)], task.batch_size, generator)
        loss = next_token_loss(model(x), y, ignore_index=IGNORE)
        loss.backward()
        clip_and_step(optimizer, scaler, cfg.grad_clip)
        optimizer.zero_grad(set_to_none=True)
        last = [*last, float(loss.detach())][-len(task.pairs) :]
    return {
        "accuracy": {str(n): accuracy(model, task, n) for n in task.pairs},
        "final_loss": sum(last) / len(last),
    }
