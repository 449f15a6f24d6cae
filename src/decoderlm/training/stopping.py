"""When a training run stops: its step limit, its time limit, or a Ctrl-C/SIGTERM, agreed by every
rank (under torchrun each process must stop after the same step)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from decoderlm.training import distributed
from decoderlm.training.train_config import TrainConfig


def stop_reason(
    cfg: TrainConfig, step: int, elapsed: float, interrupted: bool, info: distributed.DistInfo
) -> str | None:
    """Why to stop before the next step ("interrupted", "max_steps", "max_time"), or None; every
    rank reaches the same answer (an interruption on any rank, the mean elapsed time)."""
    if distributed.all_reduce_mean(float(interrupted), info) > 0:
        return "interrupted"
    if cfg.max_steps and step >= cfg.max_steps:
        return "max_steps"
    if cfg.time_limit and distributed.all_reduce_mean(elapsed, info) >= cfg.time_limit:
        return "max_time"
    return None


class StopRequests:
    """While active, Ctrl-C and SIGTERM ask the loop to stop after the current step (and save);
    a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
