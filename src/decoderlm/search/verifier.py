"""A learned verifier: a `DecoderLM` whose head gives one score, the logit that a (partial)
solution is, or leads to, a correct one (Cobbe et al., 2021, "Training Verifiers to Solve Math
Word Problems": an outcome verifier; Wang et al., 2023, "Math-Shepherd": a process verifier, its
step labels estimated by rollouts). Its texts are labelled by `decoderlm.search.labelling`, and
it is trained by `decoderlm.training.verifier`.

The scalar head replaces the LM head of the policy's network: head(norm(h_t)) = w·norm(h_t) + b,
one logit s_t per position, (B, T, 1); the verifier's score of a text is σ(s_T) at its final
token. It is a run directory like any other (config.json, model.safetensors, tokenizer.json);
its model config has `tie_embeddings` off and `extra["verifier"]` set, which `load_verifier`
checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from decoderlm import checkpoint
from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.tokenizer import Tokenizer

VERIFIER_KEY = "verifier"  # ModelConfig.extra[VERIFIER_KEY]: "outcome" or "process"
KINDS = ("outcome", "process")
PAD_ID = 0  # right padding: a causal model's last real token never sees it


@dataclass(frozen=True)
class Example:
    """A labelled text: the prompt and a (partial) solution; target in [0, 1].

    solution_start: where the solution begins in `text` (characters). Given, the verifier is
    trained toward the target at every token from there on, as Cobbe et al. (2021, §4.2) train
    theirs: s_t then estimates, at each prefix of a solution, the chance that it ends correct,
    which step-level search asks of partial solutions. None: at the final token only (a step
    prefix's own value, as `labelling` gives a process verifier)."""

    text: str
    target: float
    solution_start: int | None = None


def scalar_head_model(config: ModelConfig, kind: str) -> DecoderLM:
    """A `DecoderLM` of `config` whose head maps each position's hidden state to one logit."""
    if kind not in KINDS:
        raise DecoderLMError(f"verifier kind {kind!r}; the kinds are {', '.join(KINDS)}")
    extra = {**config.extra, VERIFIER_KEY: kind}
    config = dataclasses.replace(config, tie_embeddings=False, extra=extra)
    model = DecoderLM(config)
    model.head = nn.Linear(config.d_model, 1)  # (d_model → 1): the scalar head
    nn.init.normal_(model.head.weight, 0.0, config.init_std)
    nn.init.zeros_(model.head.bias)
    return model


def load_verifier(run_dir: str | Path, device: str | torch.device = "cpu") -> LearnedVerifier:
    """The verifier saved in `run_dir` (made by `decoderlm train-verifier`), in eval mode."""
    config = ModelConfig.from_dict(checkpoint.read_run_config(run_dir)["model"])
    kind = config.extra.get(VERIFIER_KEY)
    if kind is None:
        raise DecoderLMError(f"{run_dir} holds a language model, not a verifier")
    model = scalar_head_model(config, kind)
    checkpoint.load_weights(model, Path(run_dir) / checkpoint.WEIGHTS_FILE)
    tokenizer = Tokenizer.from_file(Path(run_dir) / checkpoint.TOKENIZER_FILE)
    return LearnedVerifier(model.to(device).eval(), tokenizer)


def padded_batch(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-padded into (B, T) ids, and each row's last index (B,)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)  # (B, T)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return ids, torch.as_tensor([len(r) - 1 for r in rows])


def encode_text(tokenizer: Tokenizer, text: str, context_length: int) -> list[int]:
    """The last `context_length` token ids of `text` (at least one)."""
    return (tokenizer.encode(text) or [PAD_ID])[-context_length:]


class LearnedVerifier:
    """A `Verifier`: σ(s_T), the scalar head's logit at the text's final token (its last
    context_length tokens when it is longer)."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, batch_size: int = 64) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.kind = model.config.extra[VERIFIER_KEY]

    def __call__(self, prompt: str, solution: str) -> float:
        return self.scores([prompt + solution])[0]

    @torch.no_grad()
    def logits(self, texts: Sequence[str]) -> torch.Tensor:
        """s_T of each text, (N,)."""
        context = self.model.config.context_length
        return self.row_logits([encode_text(self.tokenizer, t, context) for t in texts])

    @torch.no_grad()
    def row_logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """s_T of each row of token ids, (N,)."""
        out = [torch.zeros(0)]
        device = next(self.model.parameters()).device
        for start in range(0, len(rows), self.batch_size):
            ids, last = padded_batch(rows[start : start + self.batch_size])  # (B, T), (B,)
            s = self.model(ids.to(device))[..., 0]  # (B, T): s_t at every position
            out.append(s[torch.arange(len(last)), last.to(device)].float().cpu())  # (B,)
        return torch.cat(out)

    def scores(self, texts: Sequence[str]) -> list[float]:
        """σ(s_T) of each text: the estimated probability that it is (or leads to) a correct one."""
        return torch.sigmoid(self.logits(texts)).tolist()
