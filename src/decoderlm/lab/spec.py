"""What a study is: a base ModelConfig/TrainConfig, the variants (field overrides), seeds and a budget.

A study compares variants under one protocol: every run trains on the same data, the same token
budget (or seconds), the same seeds and so the same batches (`decoderlm.data.BatchSampler` draws
them from the seed, the batch size and the context length, which variants share). A variant may
start from another variant's finished run (`init_from`), optionally mean-pooled to fewer K/V heads
(the GQA up-training recipe, `decoderlm.gqa`).

Equal size: `match_d_ff` widens (or narrows) the MLP so that a variant's parameter count is within
`PARAM_TOLERANCE` of a target: with fewer K/V heads the attention loses 2·(H − G)·hd·d_model
weights per layer, which d_ff, linear in the count, gives back; so it does the difference between a
recurrent layer's projections (gates, conv, state heads) and attention's.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoderlm.errors import ConfigError, DecoderLMError
from decoderlm.lab.recall import RecallTask
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.training.train_config import TrainConfig

PARAM_TOLERANCE = 0.02  # |Δparams| / target allowed for "matched size"
VOCAB_PLACEHOLDER = 256  # the vocabulary used to size models before the data fixes it
EVAL_POINTS = 10  # evaluations per run (the val-loss curve), when the budget is in tokens
LOG_POINTS = 50  # logged rows per run (train loss, gradient norm)
# extra per-run measurements
MEASURES = ("decode", "extrapolation", "divergence", "attention", "recall")


@dataclass
class Variant:
    """One arm of a study: field overrides over the study's base configs."""

    name: str
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields over the base
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields over the base
    budget_scale: float = 1.0  # this run's budget / the study's budget (up-training: α)
    init_from: str | None = None  # a variant (same seed) whose final weights this run starts from
    pool_kv_heads: int | None = None  # with init_from: mean-pool its K/V heads into this many
    match_params: bool = False  # resize d_ff so its parameters match the study's reference
    group: str = ""  # rows sharing a group are plotted/compared together (e.g. the depth)


@dataclass
class StudySpec:
    name: str
    description: str
    model: dict[str, Any]  # the base ModelConfig fields (vocab_size follows the data)
    train: dict[str, Any]  # the base TrainConfig fields
    variants: list[Variant]
    seeds: int = 3
    budget_tokens: int | None = 200_000  # training tokens per run (the default budget)
    budget_seconds: float | None = None  # or seconds of training per run
    reference: str | None = None  # the variant whose parameter count matched variants aim at
    measures: tuple[str, ...] = ()  # names from MEASURES
    kv_budget_bytes: int = 1 << 30  # "longest context that fits": KV cache of one sequence
    notes: list[str] = field(default_factory=list)  # lines for the report (e.g. skipped parts)
    recall: dict[str, Any] = field(default_factory=dict)  # measure "recall": RecallTask fields
    init_stats: dict[str, Any] | None = None  # scaling study: attention statistics at init
    builtin: bool = False  # one of decoderlm.lab.studies (its conclusion is templated)
    warmup_fraction: float = 0.1  # warmup steps / steps, where no warmup_steps is given

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        if not names and self.init_stats is None:
            raise DecoderLMError(f"study {self.name!r} has no variants")
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate:
            raise DecoderLMError(f"study {self.name!r}: variant name {duplicate!r} is repeated")
        for v in self.variants:
            if v.init_from is not None and v.init_from not in names[: names.index(v.name)]:
                raise DecoderLMError(
                    f"variant {v.name!r}: init_from={v.init_from!r} must name an earlier variant"
                )
        unknown = sorted(set(self.measures) - set(MEASURES))
        if unknown:
            raise DecoderLMError(
                f"measure {unknown[0]!r} is unknown; allowed: {', '.join(MEASURES)}"
            )
        if self.seeds < 1:
            raise DecoderLMError(f"seeds={self.seeds} must be ≥ 1")
        if "recall" in self.measures:
            self.recall_task()  # a bad field is an error now, not after the first run
        if (self.budget_tokens is None) == (self.budget_seconds is None):
            raise DecoderLMError("give exactly one budget: tokens or seconds")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise DecoderLMError(f"budget_tokens={self.budget_tokens} must be ≥ 1")
        if self.budget_seconds is not None and self.budget_seconds <= 0:
            raise DecoderLMError(f"budget_seconds={self.budget_seconds} must be > 0")

    def with_budget(
        self, tokens: int | None = None, seconds: float | None = None, seeds: int | None = None
    ) -> StudySpec:
        """The same study with the budget and/or seed count given (the CLI's flags)."""
        spec = dataclasses.replace(self, seeds=seeds or self.seeds)
        if tokens is not None or seconds is not None:
            spec = dataclasses.replace(spec, budget_tokens=tokens, budget_seconds=seconds)
        return spec

    def recall_task(self) -> RecallTask:
        """The associative-recall task of measure "recall", from the `recall` fields."""
        unknown = sorted(set(self.recall) - {f.name for f in dataclasses.fields(RecallTask)})
        if unknown:
            allowed = ", ".join(f.name for f in dataclasses.fields(RecallTask))
            raise DecoderLMError(f"recall: unknown field {unknown[0]!r}; allowed: {allowed}")
        return RecallTask(**self.recall)

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def model_config(self, variant: Variant, vocab_size: int = VOCAB_PLACEHOLDER) -> ModelConfig:
        """The variant's ModelConfig, d_ff matched to the reference's size if asked."""
        config = ModelConfig.from_dict({**self.model, **variant.model, "vocab_size": vocab_size})
        if variant.match_params and self.reference is not None:
            reference = self.model_config(self.variant(self.reference), vocab_size)
            config = match_d_ff(config, count_params(reference))
        return config

    def train_config(self, variant: Variant, seed: int) -> TrainConfig:
        """The variant's TrainConfig for one seed, its step or time limit from the budget."""
        values = {**self.train, **variant.train}
        values["seed"] = values.get("seed", TrainConfig.seed) + seed
        if self.budget_tokens is not None:
            context = self.model_config(variant).context_length
            batch = values.get("batch_size", TrainConfig.batch_size)
            tokens = self.budget_tokens * variant.budget_scale
            # steps = ⌈budget / (batch · context)⌉: every variant sees the same tokens
            steps = max(1, math.ceil(tokens / (batch * context)))
            values.update(max_steps=steps, max_time=0.0)
            # Relative to the run's length (an up-training run is short): warmup, 10 evaluations
            # and 50 logged rows, unless the study sets them.
            values.setdefault("warmup_steps", max(1, round(self.warmup_fraction * steps)))
            values.setdefault("eval_interval", max(1, steps // EVAL_POINTS))
            values.setdefault("log_interval", max(1, steps // LOG_POINTS))
        else:
            values.update(max_time=self.budget_seconds * variant.budget_scale, max_steps=0)
        return TrainConfig.from_dict(values)


def count_params(config: ModelConfig) -> int:
    """Parameters of a model of this config (built on the meta device: no memory, no init cost)."""
    with torch.device("meta"):
        return DecoderLM(config).num_params()


def match_d_ff(config: ModelConfig, target: int, tolerance: float = PARAM_TOLERANCE) -> ModelConfig:
    """`config` with the d_ff whose parameter count is closest to `target`.

    The count is affine in d_ff, N(f) = N(f₀) + (f − f₀)·ΔN, so f = f₀ + (target − N(f₀)) / ΔN,
    rounded; raises when even that misses by more than `tolerance` (relative).
    """
    base = count_params(config)
    slope = count_params(dataclasses.replace(config, d_ff=config.d_ff + 1)) - base  # ΔN per unit
    d_ff = max(1, round(config.d_ff + (target - base) / slope))
    matched = dataclasses.replace(config, d_ff=d_ff)
    n = count_params(matched)
    if abs(n - target) > tolerance * target:
        raise DecoderLMError(
            f"cannot match {target:,} parameters by d_ff: d_ff={d_ff} gives {n:,} "
            f"(more than {tolerance:.0%} off)"
        )
    return matched


SPEC_KEYS = ("name", "description", "seeds", "budget_tokens", "budget_seconds", "reference")
SPEC_KEYS += ("measures", "kv_budget_bytes", "warmup_fraction", "model", "train", "variants")
SPEC_KEYS += ("recall",)
VARIANT_KEYS = tuple(f.name for f in dataclasses.fields(Variant))


def load_spec(path: str | Path) -> StudySpec:
    """A study from TOML: top-level keys SPEC_KEYS, [model] and [train] base tables, and one
    [[variants]] table per variant (name, model = {...}, train = {...}, match_params, ...)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    path = Path(path)
    try:
        values = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DecoderLMError(f"no such study file: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise DecoderLMError(f"cannot read study file {path}: {exc}") from None
    _known(values, SPEC_KEYS, str(path))
    variants = []
    for i, table in enumerate(values.pop("variants", [])):
        _known(table, VARIANT_KEYS, f"{path} variants[{i}]")
        if "name" not in table:
            raise DecoderLMError(f"{path} variants[{i}] has no name")
        variants.append(Variant(**table))
    if "budget_seconds" in values and "budget_tokens" not in values:
        values["budget_tokens"] = None
    values.setdefault("name", path.stem)
    values.setdefault("description", f"the study of {path}")
    values.setdefault("model", {})
    values.setdefault("train", {})
    values["measures"] = tuple(values.get("measures", ()))
    spec = StudySpec(**values, variants=variants)
    try:
        for variant in spec.variants:  # every config valid before anything trains
            spec.model_config(variant)
            spec.train_config(variant, 0)
    except ConfigError as exc:
        raise DecoderLMError(f"{path}: variant {variant.name!r}: {exc}") from None
    return spec


def _known(table: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise DecoderLMError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(allowed)}")
