"""What a training process runs on: the autocast dtype, CPU threads, the matmul peak, RNG states.

Mixed precision: parameters and optimizer state stay float32; the forward pass runs under bf16
autocast on CPUs with native bf16 (AVX512-BF16/AMX) and on CUDA; fp16 only on CUDA, with a
GradScaler; never fp16 on the CPU, which has no fast fp16 matmul kernels.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decoderlm.cpu import features
from decoderlm.dtypes import parse_dtype
from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM

TORCH_DEFAULT_THREADS = torch.get_num_threads()  # one per core this process may use (at import)
TRAINING_BYTES_PER_PARAMETER = 16  # float32 weights, gradients and AdamW's two moments


# ---- precision ----------------------------------------------------------------------------------


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for `name` on `device` ("auto": bf16 where it is fast, else fp32); fp16
    only on CUDA and bf16 on a CPU only where native, the others having no fast kernels."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and features.has_native_bf16():
            return torch.bfloat16
        return torch.float32
    dtype = parse_dtype(name)
    if dtype == torch.float16 and device.type != "cuda":
        raise DecoderLMError(
            f"dtype={name!r} needs a CUDA device (this run is on {device.type}, where fp16 has no "
            "fast kernels): use bf16 or fp32"
        )
    if dtype == torch.bfloat16 and device.type == "cpu" and not features.has_native_bf16():
        raise DecoderLMError(  # without the instructions oneDNN emulates bf16 matmuls
            f"dtype={name!r} needs a CPU with native bf16 (AVX512-BF16 or AMX); on this one a bf16 "
            "matmul is hundreds of times slower than fp32: use fp32 or auto"
        )
    return dtype


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype, size: int = 0, repeats: int = 4
) -> float:
    """Achievable dense matmul FLOP/s on `device` in `dtype`: the best of `repeats` n×n products."""
    n = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best  # an n×n×n matmul is n³ multiply-adds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- memory -------------------------------------------------------------------------------------


def check_training_memory(config: ModelConfig, device: torch.device, shards: int = 1) -> None:
    """A one-line error, before anything is allocated, if training `config` on `device` needs more
    memory than the device has: weights, gradients and AdamW moments alone (activations aside),
    split into `shards` (FSDP's processes)."""
    with torch.device("meta"):  # shapes only
        parameters = DecoderLM(config).num_params()
    need = parameters * TRAINING_BYTES_PER_PARAMETER // shards
    have = device_memory(device)
    if have and need > have:
        raise DecoderLMError(
            f"the model has {parameters:,} parameters: training needs at least {need / 2**30:,.1f} "
            f"GiB ({TRAINING_BYTES_PER_PARAMETER} bytes per parameter: weights, gradients, AdamW "
            f"moments), more than the {have / 2**30:,.1f} GiB of this {device.type} device; "
            "choose a smaller model"
        )


def device_memory(device: torch.device) -> int:
    """Bytes of memory of `device` (a CUDA GPU's, else the machine's RAM); 0 if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return 0


# ---- threads ------------------------------------------------------------------------------------


def cpu_threads() -> int:
    """Threads for torch's CPU kernels: one per core that other processes are not using right now.

    torch's OpenMP threads spin-wait for each other at every parallel region; on an oversubscribed
    CPU a thread is often descheduled while its partner spins, so two threads on two busy cores
    run slower than one. So: cores minus the cores busy now, at least 1.
    """
    cores = TORCH_DEFAULT_THREADS
    return max(1, min(cores, round(cores - busy_cores())))


def busy_cores(window_s: float = 0.25) -> float:
    """Cores busy over the next `window_s` seconds (Linux /proc/stat), else the 1-minute load average.

    The load average lags by minutes: right after a heavy job (say a `pip install`) it would take
    cores from a run that has the machine to itself.
    """
    try:
        before = _cpu_jiffies()
        time.sleep(window_s)
        after = _cpu_jiffies()
    except (OSError, ValueError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy, total = after[0] - before[0], after[1] - before[1]
    return (os.cpu_count() or 1) * busy / total if total > 0 else 0.0


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine from the first line of /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


# ---- random number generators -------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout: torch; user code: numpy, random)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNGs from `rng_state()`'s dict."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
