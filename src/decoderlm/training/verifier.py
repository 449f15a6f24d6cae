"""Training a learned verifier (`decoderlm.search.verifier`) on labelled texts: the policy's own
samples, labelled by a task's checker (`decoderlm.search.labelling`).

`VerifierTrainer` is the project's `Trainer` with its objective hooks overridden: the model is
the policy's network with a scalar head (its weights loaded, the LM head dropped), a batch is
labelled texts, and the loss is the binary cross-entropy of the logits s_t at a text's labelled
positions, L = −mean_t [y·log σ(s_t) + (1 − y)·log(1 − σ(s_t))]: every solution token of an
outcome example (Cobbe et al., 2021, §4.2: a value at every prefix, and more signal per text than
its last token alone), the final token of a step prefix. Validation judges the final token, what
a verifier's score reads. `train_verifier` writes the texts into OUT/data
and trains into the run directory OUT (`decoderlm verifier`).

The texts are split by problem: every VAL_SHARE-th problem's samples are the validation set.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from decoderlm import checkpoint
from decoderlm.errors import DecoderLMError
from decoderlm.files import ANY_ENTRY, refuse_overwrite
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.search.verifier import (
    Example,
    LearnedVerifier,
    encode_text,
    padded_batch,
    scalar_head_model,
)
from decoderlm.tokenizer import Tokenizer
from decoderlm.training import distributed
from decoderlm.training.run import Run
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.trainer import Trainer, train_run

VAL_SHARE = 10  # every 10th problem's texts are validation texts
IGNORE = -1.0  # the target of a position the loss skips
DATA_DIR = "data"  # OUT/data/{train,val}.jsonl: the labelled texts, and tokenizer.json


def write_examples(
    labelled: Sequence[Sequence[Example]], data_dir: Path, tokenizer_file: Path
) -> None:
    """OUT/data: train.jsonl and val.jsonl (split by problem) and the policy's tokenizer.json."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        rows = [
            json.dumps(dataclasses.asdict(e))
            for i, examples in enumerate(labelled)
            if (i % VAL_SHARE == VAL_SHARE - 1) == (split == "val")
            for e in examples
        ]
        (data_dir / f"{split}.jsonl").write_text("".join(r + "\n" for r in rows))
    shutil.copyfile(tokenizer_file, data_dir / checkpoint.TOKENIZER_FILE)


def read_examples(data_dir: Path, split: str) -> list[Example]:
    lines = (data_dir / f"{split}.jsonl").read_text().splitlines()
    return [Example(**json.loads(line)) for line in lines]


class ExampleBatches:
    """Batches of labelled texts in a seeded order, reshuffled every epoch: x (B, T) right-padded
    ids, y (B, T) the target at each text's labelled positions (from its first labelled index to
    its last token) and IGNORE elsewhere. The state is the number of batches drawn, so a resumed
    run continues the same stream."""

    def __init__(
        self,
        rows: list[list[int]],
        targets: list[float],
        firsts: list[int],
        batch_size: int,
        seed: int,
    ):
        """firsts: each row's first labelled index (its last index: only the final token)."""
        if not rows:
            raise DecoderLMError("no labelled texts to train the verifier on")
        self.rows, self.targets, self.firsts = rows, targets, firsts
        self.batch_size, self.seed = batch_size, seed
        self.step = 0  # batches drawn

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.rows)
        first = self.step * self.batch_size
        picks = [self._order(k // n)[k % n] for k in range(first, first + self.batch_size)]
        self.step += 1
        x, last = padded_batch([self.rows[i] for i in picks])  # (B, T), (B,)
        y = torch.full(x.shape, IGNORE)  # (B, T)
        for row, i in enumerate(picks):
            y[row, self.firsts[i] : int(last[row]) + 1] = self.targets[i]
        return x, y

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def encode_example(tokenizer: Tokenizer, example: Example, context: int) -> tuple[list[int], int]:
    """The token ids of an example's text (its last `context`) and the index of its first labelled
    token: the solution's first token when `solution_start` is given, else the final token."""
    row = encode_text(tokenizer, example.text, context)
    last = len(row) - 1
    if example.solution_start is None:
        return row, last
    dropped = len(tokenizer.encode(example.text)) - len(row)  # cut from the front
    prompt = len(tokenizer.encode(example.text[: example.solution_start]))
    return row, min(max(prompt - dropped, 0), last)


class VerifierTrainer(Trainer):
    """The Trainer on labelled texts: a scalar head over the policy's network, binary
    cross-entropy of its logits at the labelled positions (one process; not under torchrun)."""

    def build_model(self) -> DecoderLM:
        kind = self.model_config.extra["verifier"]
        model = scalar_head_model(self.model_config, kind)
        if self.run.init_from is not None:  # the policy: every weight but its LM head
            weights = checkpoint.read_weights(self.run.init_from / checkpoint.WEIGHTS_FILE)
            weights = {k: v for k, v in weights.items() if not k.startswith("head.")}
            missing = set(model.state_dict()) - set(weights) - {"head.weight", "head.bias"}
            if missing:
                raise DecoderLMError(
                    f"{self.run.init_from} lacks {sorted(missing)[:3]}: not the policy"
                )
            model.load_state_dict(weights, strict=False)
        return model

    def _encoded(self, split: str) -> tuple[list[list[int]], list[float], list[int]]:
        """Each text's token ids, target and first labelled index."""
        examples = read_examples(self.data_dir, split)
        context = self.model_config.context_length
        encoded = [encode_example(self.tokenizer, e, context) for e in examples]
        rows, firsts = [row for row, _ in encoded], [first for _, first in encoded]
        return rows, [e.target for e in examples], firsts

    def batches(self, split: str) -> ExampleBatches:  # type: ignore[override]
        return ExampleBatches(*self._encoded(split), self.micro_batch, self.cfg.seed)

    def batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean BCE of s_t over the labelled positions: outputs (B, T, 1) logits, targets (B, T)."""
        labelled = targets >= 0  # (B, T)
        s = outputs[..., 0][labelled].float()  # (labelled positions,)
        return F.binary_cross_entropy_with_logits(s, targets[labelled])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """BCE and accuracy (σ(s_T) > 0.5 against target > 0.5) over all validation texts."""
        rows, targets, _ = self._encoded("val")
        s = LearnedVerifier(self.model.eval(), self.tokenizer).row_logits(rows)  # (N,)
        self.model.train()
        y = torch.tensor(targets)
        loss = float(F.binary_cross_entropy_with_logits(s, y)) if len(rows) else math.nan
        accuracy = float(((s > 0) == (y > 0.5)).float().mean()) if len(rows) else math.nan
        return {"val_loss": loss, "val_accuracy": accuracy}

    def sample(self, max_new_tokens: int, n: int = 1) -> list[str]:
        return ["(a verifier writes no text)"] * n


def verifier_config(steps: int, batch_size: int, lr: float, seed: int) -> TrainConfig:
    """The verifier's training: `steps` AdamW steps of `batch_size` texts, a cosine from `lr` to
    lr/10 after a 10% warmup, in float32; evaluated a few times, one checkpoint at the end."""
    return TrainConfig(
        batch_size=batch_size,
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=max(1, steps // 10),
        max_steps=steps,
        eval_interval=max(1, steps // 4),
        checkpoint_interval=0,
        log_interval=max(1, steps // 50),
        dtype="fp32",
        seed=seed,
        peak_flops=1e12,  # MFU means nothing here: skip measuring the peak
    )


def train_verifier(
    policy: str | Path,
    labelled: Sequence[Sequence[Example]],
    out: str | Path,
    train_config: TrainConfig,
    *,
    kind: str = "outcome",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a verifier initialised from the `policy` run on `labelled` texts into `out`."""
    out, policy = Path(out), Path(policy)
    refuse_overwrite(out, overwrite=overwrite, inside=ANY_ENTRY)
    for name in (DATA_DIR, checkpoint.CHECKPOINTS_DIR) if overwrite else ():
        shutil.rmtree(out / name, ignore_errors=True)  # the run files are written over
    data_dir = out / DATA_DIR
    write_examples(labelled, data_dir, policy / checkpoint.TOKENIZER_FILE)
    model = ModelConfig.from_dict(checkpoint.read_run_config(policy)["model"])
    model = scalar_head_model(model, kind).config
    tokenizer = Tokenizer.from_file(data_dir / checkpoint.TOKENIZER_FILE)
    tokens = sum(len(tokenizer.encode(e.text)) for e in read_examples(data_dir, "train"))
    run = Run(
        out=out,
        model_config=model,
        train_config=train_config,
        data_dir=data_dir,
        meta={"train_tokens": tokens},
        info=distributed.init_distributed(train_config.device),
        init_from=policy,
    )
    return train_run(run, progress=progress, trainer_class=VerifierTrainer)
