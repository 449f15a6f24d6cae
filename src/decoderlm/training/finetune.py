"""Supervised fine-tuning on conversations: the loss on the assistant's tokens only.

`ChatTrainer` is the project's `Trainer` with its objective hooks overridden for chat data
(`decoderlm.data.chat`, prepared into OUT/data by `decoderlm.training.run_data`):

- batches: whole conversations, right-padded (`decoderlm.data.chat_batches.ChatBatches`);
- loss: L = Σ_t m_t · −log p(x_{t+1} | x_≤t) / Σ_t m_t over the optimizer step's global batch,
  m_t = 1 where x_{t+1} is an assistant token (its text and end-of-turn marker);
- validation: the same loss over every held-out conversation, and its perplexity;
- sample: the model's reply to the first held-out conversation's first user turn, ended at the
  chat template's end-of-turn token.

The model is what `decoderlm.training.model_init` builds: all weights (full fine-tuning) or LoRA
adapters over a frozen base (`--lora-rank`). `finetune` is the Python entry point; the CLI's
`decoderlm train --init-from MODEL --data chat.jsonl` picks this trainer for a chat file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from decoderlm.chat_template import load_chat_template
from decoderlm.data.chat import IGNORE, load_chat_split
from decoderlm.data.chat_batches import ChatBatches
from decoderlm.inference.generate import generate
from decoderlm.training import distributed
from decoderlm.training.run import Run, resolve_run
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.trainer import Trainer, train_run


def is_chat_run(run: Run) -> bool:
    """Whether a resolved run trains on chat data (its trainer is `ChatTrainer`)."""
    return run.meta.get("kind") == "chat"


class ChatTrainer(Trainer):
    """The Trainer on conversations: next-token loss on the assistant's tokens only."""

    def batches(self, split: str) -> ChatBatches:  # type: ignore[override]
        pad = self.tokenizer.eot_id or 0  # any id: padding is neither attended nor trained
        return ChatBatches(
            load_chat_split(self.data_dir, split),
            self.micro_batch,
            self.cfg.grad_accum,
            self.cfg.seed,
            pad,
            rank=self.info.rank,
            world_size=self.info.world_size,
        )

    def step_tokens(self) -> int:
        """batch_size × the mean conversation length of the train split (padding not counted)."""
        split = self.sampler.split
        return round(self.cfg.batch_size * (split.offsets[-1] / len(split) - 1))

    def batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the step's mean loss over trained tokens: Σ ℓ_t · scale,
        outputs (B, T, V) logits, targets (B, T) with IGNORE where not trained."""
        logits = outputs.flatten(0, 1).to(torch.promote_types(outputs.dtype, torch.float32))
        total = F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return total * self.sampler.loss_scale

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The mean loss over every held-out assistant token (each rank a share of the
        conversations, the sums added) and its perplexity."""
        val = self.batches("val")
        mine = list(range(self.info.rank, len(val.split), self.info.world_size))
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        self.wrapped.eval()
        for i in range(0, len(mine), self.micro_batch):
            x, y = val.batch(mine[i : i + self.micro_batch])
            with self.autocast:
                logits = self.forward(x.to(self.device))  # (B, T, V)
            logits = logits.flatten(0, 1).float()
            y = y.flatten().to(self.device)
            total += F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum").double().cpu()
            count += int((y != IGNORE).sum())
        self.wrapped.train()
        # Both means over the same ranks: their ratio is the ratio of the sums.
        total_mean = distributed.all_reduce_mean(total, self.info)
        count_mean = distributed.all_reduce_mean(float(count), self.info)
        loss = total_mean / count_mean if count_mean else math.nan
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}

    def sample(self, max_new_tokens: int, n: int = 1) -> list[str]:
        """`n` replies to the first held-out conversation up to its first assistant turn."""
        ids, trained = load_chat_split(self.data_dir, "val").conversation(0)
        prompt = ids[: int(trained.argmax())].tolist()  # the rendering up to the generation prompt
        template = load_chat_template(self.data_dir, eos_token=self.tokenizer.EOT)
        end = self.tokenizer.backend.token_to_id(template.eos_token) if template.eos_token else None
        end = end if end is not None else self.tokenizer.eot_id
        was_training = self.model.training
        rows = generate(
            self.model.eval(),
            [prompt],
            max_new_tokens,
            temperature=self.cfg.temperature,
            top_k=self.cfg.top_k or None,
            seed=self.cfg.seed,
            eos_id=end,
            num_samples=n,
        )
        self.model.train(was_training)
        replies = [row[len(prompt) :] for row in rows]
        return [self.tokenizer.decode(r[:-1] if r and r[-1] == end else r) for r in replies]

    def _summary(self, *args: Any) -> dict[str, Any]:
        """Trainer's summary, with the trained (assistant) tokens seen in the run so far."""
        summary = super()._summary(*args)
        summary["trained_tokens"] = self.sampler.targets_drawn()
        summary["chat_meta"] = self.meta
        return summary


def finetune(
    init_from: str | Path,
    chat_file: str | Path,
    out_dir: str | Path,
    train_config: TrainConfig | dict[str, Any] | None = None,
    *,
    model: dict[str, Any] | None = None,
    held_out: float | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune the model of `init_from` (a run or Hugging Face directory, a GGUF file or a model
    name) on the conversations
    of `chat_file` into the run directory `out_dir`; LoRA when `train_config` has lora_rank > 0.
    `model`: free fields of its config (context_length). Returns the trainer's summary."""
    run = resolve_run(
        out_dir,
        resume=resume,
        overwrite=overwrite,
        init_from=init_from,
        model=model,
        train=train_config,
        data_dir=chat_file,
        held_out=held_out,
        progress=progress,
    )
    return train_run(run, progress=progress, trainer_class=ChatTrainer)
