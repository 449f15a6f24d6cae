"""Running a study: every (variant, seed) run trained, measured and collected into results.json.

Layout of the output directory:

    OUT/data/                      the prepared corpus (unless --data names one)
    OUT/runs/<variant>/seed<k>/    a training run directory (decoderlm.training) + lab.json
    OUT/results.json               every run's numbers and the per-variant summaries

Resume: a run with a lab.json is finished and is re-used as it is (its configs must be the ones
the study asks for now); a run with a checkpoint but no lab.json continues from it
(`train(resume=True)`); anything else in its directory is cleared and the run starts over.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from decoderlm import checkpoint, data, gqa
from decoderlm.cpu.features import cpu_name
from decoderlm.errors import DecoderLMError, NonFiniteLossError
from decoderlm.files import write_json
from decoderlm.inference.evaluate import bits_per_byte, evaluate_tokens
from decoderlm.lab import measure, recall
from decoderlm.lab.spec import StudySpec, Variant, count_params
from decoderlm.lab.stats import summarise
from decoderlm.model.cache import kv_cache_bytes_per_token, recurrent_state_bytes
from decoderlm.training.trainer import train

RESULTS_FILE = "results.json"
RUN_RESULT_FILE = "lab.json"
EVAL_TOKENS = 32_768  # val tokens scored per run (the split's first ones: the same for every run)
DECODE_BATCHES = (1, 16)
DECODE_TOKENS = 32
EXTRAPOLATION_WINDOWS = 16
INIT_D_KS = (16, 32, 64, 128, 256)
SUMMARISED = ("val_loss", "val_bpb", "train_tokens_per_s", "decode_tps_b1", "decode_tps_b16")
SUMMARISED += ("val_loss_pooled", "loss_1x", "loss_2x", "loss_4x", "final_train_loss")
SUMMARISED += ("recall_accuracy",)


def run_study(
    spec: StudySpec,
    out: str | Path,
    data_dir: str | Path | None = None,
    inputs: Sequence[str | Path] | None = None,
    progress: bool = True,
    command: str = "",
) -> dict[str, Any]:
    """Train and measure every run of `spec` not already finished in `out`; write results.json."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = _data(out, data_dir, inputs)
    meta = data.read_meta(data_dir)
    val = data.load_split(data_dir, "val")[:EVAL_TOKENS]
    plan = [(v, seed) for v in spec.variants for seed in range(spec.seeds)]
    weights = [_weight(spec, v, seed) for v, seed in plan]
    unit = "tok" if spec.budget_tokens is not None else "s"
    runs = []
    with tqdm(
        total=sum(weights), desc=spec.name, unit=unit, unit_scale=True, disable=not progress
    ) as bar:
        for (variant, seed), weight in zip(plan, weights, strict=True):
            bar.set_postfix_str(f"{variant.name} seed {seed}")
            run_dir = _run_dir(out, variant.name, seed)
            result = _finished(spec, variant, seed, run_dir, meta)
            if (
                result is not None
                and "attention" in spec.measures
                and "attention_entropy" not in result
                and _trained(result)
            ):  # finished before the study asked for attention
                model = checkpoint.load_model(run_dir)
                result["attention_entropy"] = measure.attention_entropy(model, val)
                write_json(run_dir / RUN_RESULT_FILE, result)
            if result is None:
                result = json_safe(_run(spec, variant, seed, run_dir, out, data_dir, meta, val))
                write_json(run_dir / RUN_RESULT_FILE, result)
            runs.append(result)
            bar.update(weight)
    init_stats = None
    attention = _attention(runs, out, val) if "attention" in spec.measures else None
    if spec.init_stats is not None:
        d_ks = tuple(spec.init_stats.get("d_k", INIT_D_KS))
        init_stats = [measure.attention_init_stats(d_ks, seed) for seed in range(spec.seeds)]
    results = {
        "study": spec.name,
        "description": spec.description,
        "spec": dataclasses.asdict(spec),
        "command": command or " ".join(sys.argv),
        "environment": environment(),
        "data": {"dir": str(data_dir), **{k: meta[k] for k in ("vocab_size", "train_tokens")}},
        "eval_tokens": len(val),
        "runs": runs,
        "summary": summary(spec, runs),
        "init_stats": init_stats,
        "attention": attention,
        "wall_s": time.perf_counter() - start,  # this invocation
        "runs_wall_s": sum(r["wall_s"] for r in runs),  # all runs, across resumed invocations
    }
    write_json(out / RESULTS_FILE, json_safe(results))
    return results


def summary(spec: StudySpec, runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: params, KV bytes/token, recurrent state bytes, and mean/spread/n of each
    summarised metric."""
    table = {}
    for variant in spec.variants:
        mine = [r for r in runs if r["variant"] == variant.name]
        row: dict[str, Any] = {k: mine[0][k] for k in ("params", "kv_bytes_per_token")}
        row["kv_max_context"] = mine[0]["kv_max_context"]
        row["state_bytes"] = mine[0].get("state_bytes", 0)  # results from before the field: 0
        row["diverged"] = sum(r["diverged_step"] is not None for r in mine)
        for key in SUMMARISED:
            values = [r.get(key) for r in mine]
            if any(v is not None for v in values):
                row[key] = dataclasses.asdict(summarise(values))
        table[variant.name] = row
    return table


def environment() -> dict[str, str]:
    """git commit, CPU, Python and torch versions: what a reader needs to reproduce the numbers."""
    import torch

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "git_commit": commit or "unknown",
        "cpu": cpu_name(),
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _data(out: Path, data_dir: str | Path | None, inputs: Sequence[str | Path] | None) -> Path:
    """The prepared data: `data_dir`, else `inputs` prepared (char-level) into OUT/data once."""
    if data_dir is not None:
        data.read_meta(data_dir)  # a one-line error if it is not a prepared directory
        return Path(data_dir)
    if not inputs:
        raise DecoderLMError("give the study's data: --data DIR or --input PATH...")
    prepared = out / "data"
    if not (prepared / data.META_FILE).is_file():
        data.prepare(list(inputs), prepared, tokenizer="char", progress=False)
    return prepared


def _weight(spec: StudySpec, variant: Variant, seed: int) -> float:
    """A run's share of the progress bar: its training tokens (or seconds)."""
    cfg = spec.train_config(variant, seed)
    if spec.budget_tokens is None:
        return cfg.max_time
    return cfg.max_steps * cfg.batch_size * spec.model_config(variant).context_length


def _configs(spec: StudySpec, variant: Variant, seed: int, vocab: int) -> dict[str, Any]:
    model = spec.model_config(variant, vocab)
    if variant.pool_kv_heads is not None:
        model = dataclasses.replace(model, n_kv_heads=variant.pool_kv_heads)
    return {"model": model.to_dict(), "train": spec.train_config(variant, seed).to_dict()}


def _finished(
    spec: StudySpec, variant: Variant, seed: int, run_dir: Path, meta: dict[str, Any]
) -> dict[str, Any] | None:
    """The run's lab.json if it is finished with the configs the study asks for now."""
    path = run_dir / RUN_RESULT_FILE
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    want = json_safe(_configs(spec, variant, seed, meta["vocab_size"]))  # tuples as JSON lists
    have = {"model": dict(result["model"]), "train": result["train"]}
    have["model"]["extra"] = want["model"]["extra"]  # notes (gqa_from_n_kv_heads) aside
    if "recall" in spec.measures:  # the recall model is trained beside the run: its task too
        want["recall_task"] = dataclasses.asdict(spec.recall_task())
        have["recall_task"] = result.get("recall_task")
    if have != want:
        raise DecoderLMError(
            f"{run_dir} was trained with other settings than variant {variant.name!r} asks for "
            "now; use a new --out (or delete that run to retrain it)"
        )
    return result


def _run(
    spec: StudySpec,
    variant: Variant,
    seed: int,
    run_dir: Path,
    out: Path,
    data_dir: Path,
    meta: dict[str, Any],
    val: Any,
) -> dict[str, Any]:
    """Train (or continue) one run and measure it; the run's lab.json content."""
    start = time.perf_counter()
    model_config = spec.model_config(variant, meta["vocab_size"])
    train_config = spec.train_config(variant, seed)
    resume = checkpoint.latest_checkpoint(run_dir) is not None
    if not resume and run_dir.exists():
        shutil.rmtree(run_dir)  # died before its first checkpoint: start over
    init_from, pooled_loss = None, None
    if variant.init_from is not None:
        model_config = None  # the model is the one initialised from (or resumed)
        init_from = _run_dir(out, variant.init_from, seed)
        if variant.pool_kv_heads is not None:
            pooled = out / "runs" / variant.name / f"seed{seed}-pooled"
            if not (pooled / checkpoint.CONFIG_FILE).is_file():  # save_model writes it last
                gqa.convert_run(init_from, pooled, variant.pool_kv_heads)
            init_from = pooled
            pooled_loss = evaluate_tokens(checkpoint.load_model(pooled), val).loss
        if resume:
            init_from = None  # the run's own checkpoint holds the weights
    nonfinite_step = None
    try:
        summary = train(
            model_config,
            train_config,
            data_dir,
            run_dir,
            resume=resume,
            init_from=init_from,
            progress=False,
        )
    except NonFiniteLossError as exc:  # a diverged run is a result, not a failure of the study
        nonfinite_step = exc.step
        summary = {"stopped": "diverged", "step": nonfinite_step - 1}
    if summary["stopped"] == "interrupted":
        raise KeyboardInterrupt
    config = checkpoint.read_run_config(run_dir)
    result = _measure(spec, run_dir, config, val, meta, nonfinite_step, train_config.seed)
    return {
        "variant": variant.name,
        "seed": seed,
        "group": variant.group,
        "run_dir": str(run_dir),
        "model": config["model"],
        "train": train_config.to_dict(),
        "steps": summary["step"],
        "stopped": summary["stopped"],
        "val_loss_pooled": pooled_loss,
        **result,
        "wall_s": time.perf_counter() - start,
    }


def _measure(
    spec: StudySpec,
    run_dir: Path,
    config: dict[str, Any],
    val: Any,
    meta: dict[str, Any],
    nonfinite_step: int | None,
    seed: int,
) -> dict[str, Any]:
    from decoderlm.model.config import ModelConfig

    model_config = ModelConfig.from_dict(config["model"])
    rows = measure.read_rows(run_dir)
    kv = kv_cache_bytes_per_token(model_config)
    state = recurrent_state_bytes(model_config)
    speeds = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    result: dict[str, Any] = {
        "params": count_params(model_config),
        "kv_bytes_per_token": kv,
        "state_bytes": state,
        "kv_max_context": max_context(spec.kv_budget_bytes, kv, state),
        "train_tokens_per_s": speeds[len(speeds) // 2] if speeds else None,  # the median row
        "final_train_loss": losses[-1] if losses and nonfinite_step is None else math.nan,
        "diverged_step": measure.first_divergent_step(rows, nonfinite_step),
        "curves": measure.curves(rows),
        "val_loss": math.nan,
        "val_bpb": math.nan,
    }
    if "recall" in spec.measures:  # a fresh model of this shape: independent of the run's weights
        threads = spec.train_config(spec.variants[0], 0).threads  # the runs' own setting
        task = spec.recall_task()
        result.update(recall.train_and_score(model_config, task, seed, threads))
        result["recall_task"] = dataclasses.asdict(task)
    if nonfinite_step is not None:
        return result  # no final weights to measure
    model = checkpoint.load_model(run_dir)
    loss = evaluate_tokens(model, val).loss
    result["val_loss"] = loss
    result["val_bpb"] = bits_per_byte(loss, meta["val_tokens"], meta["val_bytes"])
    if "decode" in spec.measures:
        for batch in DECODE_BATCHES:
            result[f"decode_tps_b{batch}"] = measure.decode_tokens_per_s(
                model, batch, DECODE_TOKENS
            )
    if "attention" in spec.measures:
        result["attention_entropy"] = measure.attention_entropy(model, val)
    if "extrapolation" in spec.measures:
        positions = measure.position_losses(model, val, EXTRAPOLATION_WINDOWS)
        result["positions"] = positions
        for factor in measure.EXTRAPOLATION_FACTORS:
            result[f"loss_{factor}x"] = positions[f"{factor}x_mean"]
    return result


def max_context(budget: int, kv_per_token: int, state: int) -> int | None:
    """The longest context whose cache fits one sequence in `budget` bytes: ⌊(budget − state) /
    KV bytes per token⌋ (0 if the state alone exceeds it); None (unbounded) without attention."""
    if kv_per_token == 0:
        return None if state <= budget else 0
    return max(0, budget - state) // kv_per_token


def _run_dir(out: Path, variant: str, seed: int) -> Path:
    return out / "runs" / variant / f"seed{seed}"


def _trained(result: dict[str, Any]) -> bool:
    """Whether a run has final weights: a finite val loss (None in lab.json when it diverged)."""
    return result["val_loss"] is not None and math.isfinite(result["val_loss"])


def _attention(runs: list[dict[str, Any]], out: Path, val: Any) -> dict[str, Any] | None:
    """The heat-maps of the best run (lowest val loss; None if every run diverged)."""
    finite = [r for r in runs if _trained(r)]
    if not finite:
        return None
    best = min(finite, key=lambda r: r["val_loss"])
    run_dir = _run_dir(out, best["variant"], best["seed"])  # wherever `out` is now
    files, n_tokens = measure.attention_figures(run_dir, val, out)
    return {"variant": best["variant"], "seed": best["seed"], "tokens": n_tokens, "files": files}


def json_safe(value: Any) -> Any:
    """NaN/inf → None (strict JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
