"""TrainConfig: the training hyperparameters (validated), and the TOML run description.

`read_config_file` reads a TOML run description; `decoderlm.training.run.resolve_run` merges it,
the flags and, when resuming, the run's saved configuration.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoderlm import dtypes
from decoderlm.errors import ConfigError, DecoderLMError
from decoderlm.files import require_file
from decoderlm.model.config import dataclass_from_dict
from decoderlm.training import distributed

DTYPES = ("auto", *dtypes.DTYPES)  # auto: bf16 where native, else fp32 (`runtime.resolve_dtype`)
DEFAULT_MAX_TIME = 300.0  # seconds: the time limit of a run given no step limit (the main job)


@dataclass
class TrainConfig:
    batch_size: int = 16  # sequences per optimizer step, summed over micro-steps and processes
    grad_accum: int = 1  # micro-steps per optimizer step (each batch_size / grad_accum sequences)
    lr: float = 2e-3  # peak learning rate, reached after warmup (small models take large rates)
    min_lr: float = 2e-4  # the cosine's floor at the end of the run (lr/10, as in Chinchilla)
    warmup_steps: int = 50  # linear warmup from lr/warmup_steps to lr
    weight_decay: float = 0.1  # decoupled (AdamW), on linear-layer weights only
    beta1: float = 0.9
    beta2: float = 0.95  # GPT-3/Llama: faster-adapting second moment than 0.999 for LMs
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    max_steps: int = 0  # stop after this many optimizer steps; 0 = no step limit
    max_time: float | None = None  # seconds over resumes; 0 = none; unset: 300 without max_steps
    decay_steps: int = 0  # steps of the cosine decay (nanoGPT's lr_decay_iters); 0 = max_steps
    eval_interval: int = 100  # steps between evaluations (val loss, perplexity, bits/byte, sample)
    eval_iters: int = 10  # val batches per evaluation
    checkpoint_interval: int = 100  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # checkpoints kept besides the best one
    log_interval: int = 10  # steps between metrics.jsonl lines and progress-bar updates
    sample_tokens: int = 64  # tokens generated for the sample shown at each evaluation
    sample_prompt: str = ""  # "" = from end-of-text (the main job: "def")
    temperature: float = 0.8  # sampling temperature of the samples
    top_k: int = 50  # sample among the k most likely tokens; 0 = all
    seed: int = 1337  # model init, data order and sampling all follow from it
    device: str = "auto"  # auto (CUDA if available), cpu, cuda, cuda:N
    dtype: str = "auto"  # autocast: auto (bf16 where native), fp32, bf16, fp16 (CUDA only)
    compile: bool = False  # torch.compile the training forward pass
    threads: int = 0  # CPU threads for torch; 0 = auto: the cores not already busy (`cpu_threads`)
    cpu_kernels: bool = True  # CPU only: SpeedPaths.for_training (embedding grad, attention, heap)
    strategy: str = "none"  # data parallelism under torchrun: none, ddp, fsdp
    without_replacement: bool = False  # each epoch visits every non-overlapping window once
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 = measure a matmul at the start
    lora_rank: int = (
        0  # LoRA adapters of this rank on the base of --init-from; 0 = train all weights
    )
    lora_alpha: float = 16.0  # LoRA's α: the adapters' update is scaled by α / rank
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = "qkv,proj,gate,up,down"  # comma-separated linear layers to adapt

    def __post_init__(self) -> None:
        hints = {f.name: f.type for f in dataclasses.fields(self)}
        for name, kind in hints.items():
            value = getattr(self, name)
            if kind.endswith(" | None") and value is None:
                continue
            kind = kind.removesuffix(" | None")
            if kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif kind == "float":
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            else:
                ok = isinstance(value, str)
            if not ok:
                raise ConfigError(f"{name}={value!r} must be of type {kind}")
        positive = ("batch_size", "grad_accum", "eval_iters", "keep_last", "log_interval")
        for name in positive:
            _require(getattr(self, name) >= 1, name, getattr(self, name), "must be ≥ 1")
        non_negative = (
            *("warmup_steps", "max_steps", "max_time", "decay_steps", "eval_interval"),
            *("checkpoint_interval", "sample_tokens", "weight_decay", "grad_clip", "top_k"),
            *("threads", "lora_rank"),
        )
        for name in non_negative:
            value = getattr(self, name)
            _require(value is None or value >= 0, name, value, "must be ≥ 0")
        _require(self.lr > 0, "lr", self.lr, "must be > 0")
        _require(
            0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, f"must be in [0, lr={self.lr}]"
        )
        for name in ("beta1", "beta2"):
            _require(0 <= getattr(self, name) < 1, name, getattr(self, name), "must be in [0, 1)")
        _require(self.eps > 0, "eps", self.eps, "must be > 0")
        _require(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "must be > 0")
        _require(0 <= self.lora_dropout < 1, "lora_dropout", self.lora_dropout, "must be in [0, 1)")
        _require(self.temperature >= 0, "temperature", self.temperature, "must be ≥ 0")
        _require(self.seed >= 0, "seed", self.seed, "must be ≥ 0")
        _require(self.peak_flops >= 0, "peak_flops", self.peak_flops, "must be ≥ 0")
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        strategies = distributed.STRATEGIES
        _require(
            self.strategy in strategies,
            "strategy",
            self.strategy,
            f"must be one of {', '.join(strategies)}",
        )
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}"
            )
        if not self.max_steps and not self.time_limit:
            raise ConfigError("max_steps=0 and max_time=0: set at least one to end the run")

    @property
    def time_limit(self) -> float:
        """Seconds of training before the run stops (0: none): max_time, or when it is not set,
        DEFAULT_MAX_TIME for a run without max_steps and no limit for one with it, so that a
        step budget's run, schedule included, depends on the steps alone."""
        if self.max_time is not None:
            return self.max_time
        return 0.0 if self.max_steps else DEFAULT_MAX_TIME

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        """lora_targets as names: "qkv, up" → ("qkv", "up")."""
        return tuple(name.strip() for name in self.lora_targets.split(",") if name.strip())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return dataclass_from_dict(cls, values, "train")


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} {rule}")


# ---- configuration from files -----------------------------------------------------------------

CONFIG_FILE_KEYS = ("preset", "data", "input", "out", "tokenizer", "vocab_size", "model", "train")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML run description: [model] and [train] tables of fields, plus optional top-level keys
    preset, data, input (a list of paths), out, tokenizer and vocab_size (as the CLI flags)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    path = Path(path)
    if path.exists():
        require_file(path)  # a directory or a FIFO (which would block the read): say so
    try:
        values = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DecoderLMError(f"no such config file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DecoderLMError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DecoderLMError(f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(values) - set(CONFIG_FILE_KEYS))
    if unknown:
        raise DecoderLMError(
            f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(CONFIG_FILE_KEYS)}"
        )
    for table in ("model", "train"):
        if not isinstance(values.get(table, {}), dict):
            raise DecoderLMError(f"{path}: {table!r} must be a table ([{table}])")
    return values
