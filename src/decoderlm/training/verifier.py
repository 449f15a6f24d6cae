"""Training a learned verifier (`decoderlm.search.verifier`) on labelled texts: the policy's own
samples, labelled by a task's checker (`decoderlm.search.labelling`).

`VerifierTrainer` is the project's `Trainer` with its objective hooks overridden: the model is
the policy's network with a scalar head (its weights loaded, the LM head dropped), a batch is
labelled texts, and the loss is the binary cross-entropy of the final token's logit s_T,
L = −[y·log σ(s_T) + (1 − y)·log(1 − σ(s_T))]. `train_verifier` writes the texts into OUT/data
and trains into the run directory OUT (`decoderlm verifier`).

The texts are split by problem: every VAL_SHARE-th problem's samples are the validation set.
"""

from __future__ import annotations

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
from decoderlm.training.trainer import Trainer

VAL_SHARE = 10  # every 10th problem's texts are validation texts
IGNORE = -1.0  # the target of every position but a text's last
DATA_DIR = "data"  # OUT/data/{train,val}.jsonl: the labelled texts, and tokenizer.json


def write_examples(
    labelled: Sequence[Sequence[Example]], data_dir: Path, tokenizer_file: Path
) -> None:
    """OUT/data: train.jsonl and val.jsonl (split by problem) and the policy's tokenizer.json."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        rows = [
            json.dumps({"text": e.text, "target": e.target})
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
    ids, y (B, T) the target at each text's final position and IGNORE elsewhere. The state is the
    number of batches drawn, so a resumed run continues the same stream."""

    def __init__(self, rows: list[list[int]], targets: list[float], batch_size: int, seed: int):
        if not rows:
            raise DecoderLMError("no labelled texts to train the verifier on")
        self.rows, self.targets, self.batch_size, self.seed = rows, targets, batch_size, seed
        self.step = 0  # batches drawn

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.rows)
        first = self.step * self.batch_size
        picks = [self._order(k // n)[k % n] for k in range(first, first + self.batch_size)]
        self.step += 1
        x, last = padded_batch([self.rows[i] for i in picks])  # (B, T), (B,)
        y = torch.full(x.shape, IGNORE)  # (B, T)
        y[torch.arange(len(picks)), last] = torch.tensor([self.targets[i] for i in picks])
        return x, y

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class VerifierTrainer(Trainer):
    """The Trainer on labelled texts: a scalar head over the policy's network, binary
    cross-entropy on the final token's logit (one process; not under torchrun)."""

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

    def _encoded(self, split: str) -> tuple[list[list[int]], list[float]]:
        examples = read_examples(self.data_dir, split)
        context = self.model_config.context_length
        rows = [encode_text(self.tokenizer, e.text, context) for e in examples]
        return rows, [e.target for e in examples]

    def batches(self, split: str) -> ExampleBatches:  # type: ignore[override]
        rows, targets = self._encoded(split)
        return ExampleBatches(rows, targets, self.micro_batch, self.cfg.seed)

    def batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean BCE of s_T over the texts: outputs (B, T, 1) logits, targets (B, T)."""
        labelled = targets >= 0  # (B, T): each text's last position
        s = outputs[..., 0][labelled].float()  # (B,)
        return F.binary_cross_entropy_with_logits(s, targets[labelled])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """BCE and accuracy (σ(s_T) > 0.5 against target > 0.5) over all validation texts."""
        rows, targets = self._encoded("val")
        s = LearnedVerifier(self.model.eval(), self.tokenizer).row_logits(rows)  # (N,)
        self.model.train()
        y = torch.tensor(targets)
        loss = float(F.binary_cross_entropy_with_logits(s, y)) if len(rows) else math.nan
        if math.isfinite(loss) and (self.best_val_loss is None or loss < self.best_val_loss):
            self.best_val_loss = loss
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
    trainer = VerifierTrainer(run, progress=progress)
    try:
        return trainer.fit()
    finally:
        trainer.close()
