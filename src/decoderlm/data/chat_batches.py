"""Batches of conversations for fine-tuning: `ChatBatches`.

Padded, not packed: each micro-batch is its conversations right-padded to the longest of them.
With right padding the causal mask alone keeps every real token from seeing the padding (which
comes after it), so the model's forward needs no mask at all, its positions are 0 … T − 1 as at
inference, and nothing about a conversation depends on what it shares a batch with. Packing
several into one row would need attention kept inside each (a block-diagonal mask the model's
forward does not take: it takes a key-padding mask and positions); short chat conversations
padded to their batch's longest waste little.

The loss is the mean over the optimizer step's trained tokens, not a mean of micro-batch means:
every rank draws the same global stream of conversations (a seeded permutation per epoch), takes
its rows of each global micro-batch, and knows how many trained tokens the whole step holds, N.
`loss_scale` = A·W / N (A micro-steps, W ranks) turns a micro-batch's summed cross-entropy into
its share of Σ ℓ / N once the trainer has divided by A and the ranks' gradients are averaged, so
one process and W processes with the same global batch compute the same gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from decoderlm.data.chat import IGNORE, ChatSplit
from decoderlm.errors import DecoderLMError


class ChatBatches:
    """(x, y) micro-batches of conversations: x (B, T) ids right-padded with `pad_id`, y (B, T)
    the next token where it is trained, IGNORE elsewhere; T the longest of the B. The state is the
    number of micro-batches drawn, so a resumed run continues the same stream."""

    def __init__(
        self,
        split: ChatSplit,
        micro_batch: int,
        grad_accum: int,
        seed: int,
        pad_id: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if len(split) == 0:
            raise DecoderLMError("no conversations to train on")
        self.split, self.micro_batch, self.grad_accum = split, micro_batch, grad_accum
        self.seed, self.pad_id, self.rank, self.world_size = seed, pad_id, rank, world_size
        self.global_micro = micro_batch * world_size  # conversations per micro-step, all ranks
        self.targets = np.array([split.targets(k) for k in range(len(split))])
        self.step = 0  # micro-batches drawn
        self.loss_scale = 1.0  # A·W / trained tokens of the current optimizer step
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) of the next micro-batch; sets `loss_scale` for its optimizer step."""
        step_start = self.step - self.step % self.grad_accum  # the step's first micro-batch
        size = self.grad_accum * self.global_micro
        in_step = self._indices(step_start * self.global_micro, size)
        self.loss_scale = (
            self.grad_accum * self.world_size / max(int(self.targets[in_step].sum()), 1)
        )
        first = self.step * self.global_micro + self.rank * self.micro_batch
        self.step += 1
        return self.batch(self._indices(first, self.micro_batch))

    def batch(self, picks: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the conversations `picks`, right-padded to the longest."""
        rows = [self.split.conversation(int(k)) for k in picks]
        t = max(len(ids) for ids, _ in rows) - 1
        x = torch.full((len(rows), t), self.pad_id, dtype=torch.int64)  # (B, T)
        y = torch.full((len(rows), t), IGNORE, dtype=torch.int64)  # (B, T)
        for row, (ids, trained) in enumerate(rows):
            ids_t = torch.from_numpy(ids.astype(np.int64))
            n = len(ids) - 1
            x[row, :n] = ids_t[:-1]
            target = ids_t[1:].clone()
            target[torch.from_numpy(trained[1:] == 0)] = IGNORE  # y_t = x_{t+1} where trained
            y[row, :n] = target
        return x, y

    def _indices(self, position: int, count: int) -> np.ndarray:
        """Conversations at [position, position + count) of the stream of epochs' permutations."""
        n = len(self.split)
        out = np.empty(count, dtype=np.int64)
        for i in range(count):
            epoch, offset = divmod(position + i, n)
            if epoch != self._epoch:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n)
                self._epoch = epoch
            out[i] = self._order[offset]
        return out

    def targets_drawn(self) -> int:
        """Trained targets in every micro-batch drawn so far, all ranks' rows."""
        drawn = self._indices(0, self.step * self.global_micro)
        return int(self.targets[drawn].sum())

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seed": self.seed,
            "conversations": len(self.split),
            "global_micro": self.global_micro,
            "grad_accum": self.grad_accum,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream of `state`; the data and the batch geometry must match."""
        mine = self.state_dict()
        for key in ("conversations", "global_micro", "grad_accum"):
            if state.get(key) != mine[key]:
                raise DecoderLMError(
                    f"cannot resume the chat data stream: it was saved with {key}="
                    f"{state.get(key)!r}, this run has {key}={mine[key]!r}"
                )
        self.seed, self.step = int(state["seed"]), int(state["step"])
        self._epoch = -1
