"""The built-in studies (`STUDIES`, the one list `decoderlm lab` offers): six `StudySpec`s over
small char-level models, and the test-time compute studies, each with its own runner and report:
on a policy trained for its task (`decoderlm.lab.test_time`) and on SmolLM2-135M-Instruct, the real
model (`decoderlm.lab.test_time_real`).

Default budgets are sized for ≤ 40 minutes per study on 2 CPU cores with FULL_SEEDS seeds (the
verdict rule of `decoderlm.lab.stats` needs 3), `quick` for ≤ 3 minutes (smaller models, fewer
tokens, QUICK_SEEDS seeds: too few for a verdict); both are token budgets, so the numbers do not
depend on the machine's load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from decoderlm.errors import DecoderLMError
from decoderlm.lab.spec import StudySpec, Variant
from decoderlm.model.config import ModelConfig
from decoderlm.training.train_config import TrainConfig

if TYPE_CHECKING:
    from decoderlm.lab.test_time import TestTimeSpec
    from decoderlm.lab.test_time_real import TestTimeRealSpec

SCALE_FIELD = "attn_scale"  # ModelConfig: "1/sqrt(head_dim)" (default) or "none"
UPTRAIN_FRACTION = 0.05  # α of Ainslie et al. (2023): up-training steps / original steps
UPTRAIN_SEED_OFFSET = 1000  # up-training draws new batches (the original saw the first ones)
FULL_SEEDS, QUICK_SEEDS = 3, 2
TEST_TIME = "test-time-compute"
TEST_TIME_REAL = "test-time-real"
TEST_TIME_STUDIES = (TEST_TIME, TEST_TIME_REAL)  # the studies that are not `StudySpec`s


def base_model(quick: bool) -> dict[str, Any]:
    """Llama-style (RoPE, RMSNorm, SwiGLU, no biases) char model: 8 heads, 4 layers × 64 wide
    (quick: 2 × 32), context 128 (quick: 64)."""
    return dict(
        context_length=64 if quick else 128,
        d_model=32 if quick else 64,
        n_layers=2 if quick else 4,
        n_heads=8,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        dropout=0.0,
    )


def base_train() -> dict[str, Any]:
    return dict(
        batch_size=16,
        lr=3e-3,
        min_lr=3e-4,
        checkpoint_interval=0,  # the final checkpoint only (and one on Ctrl-C)
        eval_iters=4,
        sample_tokens=8,
        dtype="fp32",  # bf16 autocast costs more than it saves at this width on a CPU
        peak_flops=1e12,  # MFU is not used here: skip measuring the peak at each run's start
    )


def budget(quick: bool, full: int, fast: int) -> int:
    return fast if quick else full


def seeds(quick: bool) -> int:
    return QUICK_SEEDS if quick else FULL_SEEDS


def kv_name(heads: int, kv_heads: int) -> str:
    """Attention by its K/V heads: MHA-H (as many as query heads), MQA (one), else GQA-G."""
    return f"MHA-{heads}" if kv_heads == heads else "MQA" if kv_heads == 1 else f"GQA-{kv_heads}"


def attention_variants(quick: bool) -> StudySpec:
    heads = base_model(quick)["n_heads"]
    mha = kv_name(heads, heads)
    return StudySpec(
        name="attention-variants",
        description=(
            "Multi-head vs grouped-query (4 and 2 K/V heads) vs multi-query attention "
            "(Shazeer, 2019; Ainslie et al., 2023) at matched size: quality, speed and KV memory."
        ),
        model=base_model(quick),
        train=base_train(),
        variants=[
            Variant(kv_name(heads, g), model={"n_kv_heads": g}, match_params=g != heads)
            for g in (heads, 4, 2, 1)
        ],
        budget_tokens=budget(quick, 1_000_000, 120_000),
        seeds=seeds(quick),
        reference=mha,
        measures=("decode", "attention"),
    )


def positions(quick: bool) -> StudySpec:
    kinds = ("sinusoidal", "learned", "rope", "none")
    return StudySpec(
        name="positions",
        description=(
            "Sinusoidal (Vaswani et al., 2017) vs learned (GPT-2) vs rotary (Su et al., 2021) vs no "
            "positions (NoPE, Kazemnejad et al., 2023): loss at the training context and at 2× "
            "and 4× it."
        ),
        model=base_model(quick),
        train=base_train(),
        variants=[Variant(kind, model={"position": kind}) for kind in kinds],
        budget_tokens=budget(quick, 1_000_000, 120_000),
        seeds=seeds(quick),
        measures=("extrapolation", "attention"),
        notes=["learned positions add context_length × d_model parameters (not matched)"],
    )


def scaling(quick: bool) -> StudySpec:
    variants = []
    notes = []
    if SCALE_FIELD in {f.name for f in dataclasses.fields(ModelConfig)}:
        for d_k in (64, 256):
            for scale, label in (("1/sqrt(head_dim)", "scaled"), ("none", "unscaled")):
                model = {"n_heads": 2, "head_dim": d_k, SCALE_FIELD: scale}
                variants.append(Variant(f"d_k={d_k} {label}", model=model, group=f"d_k={d_k}"))
    else:
        notes.append(
            f"trained with/without scale: skipped, ModelConfig has no {SCALE_FIELD!r} field yet"
        )
    return StudySpec(
        name="scaling",
        description=(
            "Why attention divides by √d_k (Vaswani et al., 2017, §3.2.1): q·k statistics at "
            "initialisation against d_k, then training with and without the scale."
        ),
        model=base_model(quick),
        train=base_train(),
        variants=variants,
        budget_tokens=budget(quick, 600_000, 80_000),
        seeds=seeds(quick),
        init_stats={"d_k": [16, 32, 64, 128, 256]},
        notes=notes,
    )


def norm_placement(quick: bool) -> StudySpec:
    depths = (2, 4) if quick else (2, 6)
    variants = []
    for placement in ("pre", "post"):
        for depth in depths:
            for lr in (1e-3, 1e-2):
                for warmup in (True, False):
                    name = f"{placement}-LN L{depth} lr{lr:g} {'warmup' if warmup else 'no-warmup'}"
                    train: dict[str, Any] = {"lr": lr, "min_lr": lr / 10}
                    if not warmup:
                        train["warmup_steps"] = 0
                    model = {"norm_placement": placement, "n_layers": depth}
                    group = f"L{depth} lr{lr:g}"  # a panel of the plots: placement × warmup
                    variants.append(Variant(name, model=model, train=train, group=group))
    return StudySpec(
        name="norm-placement",
        description=(
            "Pre-LN vs Post-LN (Xiong et al., 2020) at increasing depth and learning rate, with "
            "and without warmup: final loss, divergence and gradient norms."
        ),
        model={**base_model(quick), "norm": "layernorm"},
        # grad_clip huge: clipping effectively off (it would hide divergence), yet the trainer
        # still computes and logs the gradient norm; every step logged to catch divergence.
        train={**base_train(), "grad_clip": 1e6, "log_interval": 1},
        variants=variants,
        budget_tokens=budget(quick, 200_000, 12_000),
        seeds=seeds(quick),
        measures=("divergence",),
        warmup_fraction=0.2,
    )


def uptrain_gqa(quick: bool, fraction: float = UPTRAIN_FRACTION) -> StudySpec:
    """MHA-H pre-trained, pooled to GQA-4/GQA-2/MQA and up-trained for `fraction` (α) of its steps;
    the controls: MHA-H continued as long, and each shape from scratch for 1 + α."""
    if not 0 < fraction <= 1:
        raise DecoderLMError(f"up-training fraction={fraction:g} must be in (0, 1]")
    heads = base_model(quick)["n_heads"]
    mha = kv_name(heads, heads)
    # The paper's recipe (§2.1): up-train with the pre-training recipe (its peak lr, warmup and
    # cosine decay, over the up-training's own steps) for α of the pre-training steps, on batches
    # the original did not see.
    up = {"seed": TrainConfig.seed + UPTRAIN_SEED_OFFSET}
    variants = [Variant(mha, model={"n_kv_heads": heads})]
    variants.append(
        Variant(
            f"{mha} continued",
            model={"n_kv_heads": heads},
            train=up,
            budget_scale=fraction,
            init_from=mha,
        )
    )
    for g in (4, 2, 1):
        name = kv_name(heads, g)
        variants.append(
            Variant(
                f"{name} up-trained",
                model={"n_kv_heads": heads},
                train=up,
                budget_scale=fraction,
                init_from=mha,
                pool_kv_heads=g,
                group=name,
            )
        )
        variants.append(
            Variant(
                f"{name} scratch",
                model={"n_kv_heads": g},
                budget_scale=1 + fraction,
                group=name,
            )
        )
    return StudySpec(
        name="uptrain-gqa",
        description=(
            f"The GQA recipe (Ainslie et al., 2023, §2.1): train {mha}, mean-pool its K/V heads to "
            f"GQA/MQA, up-train for α = {fraction:.0%} of the pre-training steps with the "
            "pre-training recipe; against GQA/MQA trained from scratch on the same total steps "
            f"(1 + α), and {mha} continued under the same up-training as the control."
        ),
        model=base_model(quick),
        train=base_train(),
        variants=variants,
        budget_tokens=budget(quick, 1_800_000, 120_000),
        seeds=seeds(quick),
    )


# The token mixer of each of 4 layers (`ModelConfig.layer_types`): attention, the three recurrent
# layers alone, and Gated DeltaNet hybrids with attention in every 4th (Qwen3-Next's 3:1) or every
# 2nd layer.
LAYER_MIXES = (
    ("attention", ("attention",) * 4),
    ("linear attention", ("linear_attention",) * 4),
    ("Gated DeltaNet", ("gdn",) * 4),
    ("Mamba-2", ("mamba2",) * 4),
    ("hybrid 3:1", ("gdn", "gdn", "gdn", "attention")),
    ("hybrid 1:1", ("gdn", "attention", "gdn", "attention")),
)


def hybrid(quick: bool) -> StudySpec:
    # MQAR (decoderlm.lab.recall): two-layer models of each mix at d_model 64, 4 heads and 1
    # (the recurrent state 4× larger); in this many steps attention solves it (≥ 0.9 at every N)
    recall: dict[str, Any] = (
        dict(pairs=(2, 4), d_model=32, heads=(2,), steps=150, test_examples=64)
        if quick
        else dict(pairs=(2, 4, 8), d_model=64, heads=(4, 1), steps=1200)
    )
    return StudySpec(
        name="hybrid",
        description=(
            "Softmax attention vs causal linear attention (Katharopoulos et al., 2020), Gated "
            "DeltaNet (Yang et al., 2024) and Mamba-2 (Dao & Gu, 2024), and Gated DeltaNet hybrids "
            "with attention in 1 of 4 and 2 of 4 layers, at matched size: language-model quality, "
            "multi-query associative recall against the number of pairs and the state size "
            "(Arora et al., 2023), memory per sequence and training speed."
        ),
        model={**base_model(quick), "n_layers": 4},  # four layers: room for a 3:1 mix
        train=base_train(),
        variants=[
            Variant(name, model={"layer_types": list(mix)}, match_params=name != "attention")
            for name, mix in LAYER_MIXES
        ],
        budget_tokens=budget(quick, 400_000, 48_000),
        seeds=seeds(quick),
        reference="attention",
        measures=("recall",),
        recall=recall,
        notes=[
            "recurrent layers: H = n_heads heads (keys not shared), d_k = d_v = head_dim, conv "
            "kernel 4, chunks of 64 tokens; no decode measure (benchmarks/long_context.py "
            "times decoding at long context)"
        ],
    )


def _test_time(quick: bool) -> TestTimeSpec:
    from decoderlm.lab import test_time  # the search engine: imported when the study runs

    return test_time.quick_spec() if quick else test_time.TestTimeSpec()


def _test_time_real(quick: bool) -> TestTimeRealSpec:
    from decoderlm.lab import test_time_real  # loads the real model: imported when it runs

    return test_time_real.quick_spec() if quick else test_time_real.TestTimeRealSpec()


# Every built-in study: its name → its spec (full, or quick).
STUDIES: dict[str, Callable[[bool], StudySpec | TestTimeSpec | TestTimeRealSpec]] = {
    "attention-variants": attention_variants,
    "positions": positions,
    "scaling": scaling,
    "norm-placement": norm_placement,
    "uptrain-gqa": uptrain_gqa,
    "hybrid": hybrid,
    TEST_TIME: _test_time,
    TEST_TIME_REAL: _test_time_real,
}


def builtin(name: str, quick: bool = False) -> StudySpec | TestTimeSpec | TestTimeRealSpec:
    if name not in STUDIES:
        raise DecoderLMError(f"unknown study {name!r}; allowed: {', '.join(STUDIES)}")
    study = STUDIES[name](quick)
    return dataclasses.replace(study, builtin=True) if isinstance(study, StudySpec) else study
