"""Running a study: every (variant, seed) run trained, measured and collected into results.json.

Layout of the output directory:

    OUT/data/                      the prepared --input files (char-level)
    OUT/runs/<variant>/seed<k>/    a training run directory (decoderlm.training) + lab.json
    OUT/recall/<mix>/h<heads>/seed<k>.json   a recall run (measure "recall")
    OUT/results.json               every run's numbers and the per-variant summaries

Without --data or --input the study trains on the Python standard library, char-level, prepared
once into the cache by `decoderlm.data.prepare_default_corpus` (the corpus `decoderlm train`
uses by default): it is on every machine that runs decoderlm.

Every run is classified healthy, stuck, diverged or NaN (`measure.classify`, against the data's
unigram baseline); the summaries of quality are over the healthy runs only.

Resume: a run with a lab.json is finished and is re-used as it is (its configs must be the ones
the study asks for now); a run with a checkpoint but no lab.json continues from it
(`train(resume=True)`); anything else in its directory is cleared and the run starts over.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from decoderlm import __version__, checkpoint, data, gqa
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
# summarised over the healthy runs (quality) and over every run that has them (speed)
QUALITY = ("val_loss", "val_bpb", "val_loss_pooled", "loss_1x", "loss_2x", "loss_4x")
QUALITY += ("loss_rise_4x", "final_train_loss")
SPEED = ("train_tokens_per_s", "decode_tps_b1", "decode_tps_b16")


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
    ran_at = environment()  # the commit whose code runs, not the one checked out at the end
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prepared = _data(out, data_dir, inputs, progress)
    meta = data.read_meta(prepared)
    val = data.load_split(prepared, "val")[:EVAL_TOKENS]
    baseline = measure.unigram_loss(data.load_split(prepared, "train"), val, meta["vocab_size"])
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
                result = json_safe(_run(spec, variant, seed, run_dir, out, prepared, meta, val))
                write_json(run_dir / RUN_RESULT_FILE, result)
            runs.append({**result, **_health(result, baseline)})
            bar.update(weight)
    init_stats = None
    attention = _attention(runs, out, val) if "attention" in spec.measures else None
    recalled = _recall(spec, out, progress) if "recall" in spec.measures else None
    if spec.init_stats is not None:
        d_ks = tuple(spec.init_stats.get("d_k", INIT_D_KS))
        init_stats = [measure.attention_init_stats(d_ks, seed) for seed in range(spec.seeds)]
    results = {
        "study": spec.name,
        "description": spec.description,
        "spec": dataclasses.asdict(spec),
        "command": command or "decoderlm.lab.runner.run_study (from Python)",
        "environment": ran_at,
        "data": {
            "source": data_source(meta, default=data_dir is None and not inputs),
            **{k: meta[k] for k in ("vocab_size", "train_tokens")},
            "unigram_loss": baseline,
        },
        "eval_tokens": len(val),
        "runs": runs,
        "summary": summary(spec, runs),
        "init_stats": init_stats,
        "attention": attention,
        "recall": recalled,
        "wall_s": time.perf_counter() - start,  # this invocation
        "runs_wall_s": sum(r["wall_s"] for r in runs),  # all runs, across resumed invocations
    }
    write_json(out / RESULTS_FILE, json_safe(results))
    return results


def summary(spec: StudySpec, runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: params, KV bytes/token, recurrent state bytes, the runs of each health class,
    and mean/spread/n of each quality metric over its healthy runs, of each speed over all."""
    table = {}
    for variant in spec.variants:
        mine = [r for r in runs if r["variant"] == variant.name]
        row: dict[str, Any] = {k: mine[0][k] for k in ("params", "kv_bytes_per_token")}
        row["kv_max_context"] = mine[0]["kv_max_context"]
        row["state_bytes"] = mine[0].get("state_bytes", 0)  # results from before the field: 0
        row["health"] = {c: sum(r["health"] == c for r in mine) for c in measure.HEALTH_CLASSES}
        for key in QUALITY + SPEED:
            counted = [key in SPEED or r["health"] == measure.HEALTHY for r in mine]
            values = [r.get(key) if c else None for r, c in zip(mine, counted, strict=True)]
            if any(v is not None for v in values):
                row[key] = dataclasses.asdict(summarise(values))
        table[variant.name] = row
    return table


def _health(result: dict[str, Any], baseline: float) -> dict[str, Any]:
    """The run's health class (`measure.classify`) and, if it diverged, the step of its lowest
    loss: computed from its recorded curves, so a changed rule needs no retraining."""
    health, step = measure.classify(
        result["curves"]["train_loss"],
        result["val_loss"],
        result["stopped"] == "non-finite",
        baseline,
    )
    return {"health": health, "lowest_step": step}


def data_source(meta: dict[str, Any], default: bool) -> str:
    """Where the prepared data came from, without this machine's paths: the standard library
    (`default`), or the names of the files it was prepared from."""
    if default:
        return f"the Python {platform.python_version()} standard library (*.py)"
    inputs = meta.get("source", {}).get("inputs", [])
    return ", ".join(Path(p).name for p in inputs) or "a prepared data directory"


def environment() -> dict[str, str]:
    """Date, git commit, CPU, Python, torch and decoderlm versions: what a reader needs to
    reproduce the numbers."""
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
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": commit or "unknown",
        "cpu": cpu_name(),
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "decoderlm": __version__,
        "platform": platform.platform(),
    }


def _data(
    out: Path,
    data_dir: str | Path | None,
    inputs: Sequence[str | Path] | None,
    progress: bool = False,
) -> Path:
    """The prepared data: `data_dir`; else `inputs` prepared (char-level) into OUT/data once;
    else the standard library, char-level, prepared once into the cache."""
    if data_dir is not None:
        data.read_meta(data_dir)  # a one-line error if it is not a prepared directory
        return Path(data_dir)
    if not inputs:
        return data.prepare_default_corpus("char", progress=progress)
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
    except NonFiniteLossError as exc:  # a NaN run is a result, not a failure of the study
        nonfinite_step = exc.step
        summary = {"stopped": "non-finite", "step": nonfinite_step - 1}
    if summary["stopped"] == "interrupted":
        raise KeyboardInterrupt
    config = checkpoint.read_run_config(run_dir)
    result = _measure(spec, run_dir, config, val, meta, nonfinite_step)
    return {
        "variant": variant.name,
        "seed": seed,
        "group": variant.group,
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
        "curves": measure.curves(rows),
        "val_loss": math.nan,
        "val_bpb": math.nan,
    }
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
        if result["loss_4x"] is not None:  # how much the loss rises from 1× to 4× the context
            result["loss_rise_4x"] = result["loss_4x"] - result["loss_1x"]
    return result


def _recall(spec: StudySpec, out: Path, progress: bool) -> dict[str, Any]:
    """Measure "recall": for each head count of the task, each of its mixes and each seed, a fresh
    model (d_ff matched to the all-attention reference's size at that head count) trained on the
    task and scored at each pair count. A finished run (its JSON, for the same task and model)
    is reused."""
    task = spec.recall_task()
    threads = spec.train_config(spec.variants[0], 0).threads  # the LM runs' own setting
    reference = next(iter(task.mixes))
    mixes = [
        Variant(n, model={"layer_types": list(m), "n_layers": len(m)}, match_params=n != reference)
        for n, m in task.mixes.items()
    ]
    sized = {  # per head count: the study's base model at the task's width, the mixes as variants
        h: dataclasses.replace(
            spec,
            model={**spec.model, "d_model": task.d_model, "n_heads": h, "n_kv_heads": h},
            variants=mixes,
            reference=reference,
        )
        for h in task.heads
    }
    plan = [
        (h, name, seed) for h in task.heads for name in task.mixes for seed in range(spec.seeds)
    ]
    runs = []
    for heads, name, seed in tqdm(plan, desc="recall", unit="run", disable=not progress):
        study = sized[heads]
        config = recall.recall_config(
            study.model_config(study.variant(name), task.vocab_size), task
        )
        want = json_safe({"task": dataclasses.asdict(task), "model": config.to_dict()})
        path = out / "recall" / name / f"h{heads}" / f"seed{seed}.json"
        result = json.loads(path.read_text()) if path.is_file() else None
        if result is None or {k: result.get(k) for k in want} != want:
            start = time.perf_counter()
            seed_of_run = spec.train_config(spec.variants[0], seed).seed  # the LM runs' seeds
            scores = recall.train_and_score(config, task, seed_of_run, threads)
            result = {
                **want,
                "variant": name,
                "heads": heads,
                "seed": seed,
                **scores,
                "params": count_params(config),
                "state_bytes": recurrent_state_bytes(config),
                "wall_s": time.perf_counter() - start,
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, json_safe(result))
        runs.append({k: v for k, v in result.items() if k not in want})
    return {"task": dataclasses.asdict(task), "runs": runs}


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
    """The heat-maps of the best healthy run (lowest val loss; None if no run is healthy)."""
    finite = [r for r in runs if r["health"] == measure.HEALTHY]
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
