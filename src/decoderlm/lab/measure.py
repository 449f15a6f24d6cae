"""What a study measures on a finished run, and the attention statistics at initialisation.

- quality: val loss and bits/byte (`decoderlm.inference.evaluate.evaluate_tokens`);
- decode speed: new tokens per second of greedy `decoderlm.inference.generate.generate`;
- extrapolation: loss per position bucket of windows 1×, 2×, 4× the training context (Press et
  al., 2022, ALiBi §2: sinusoidal/RoPE models degrade past the length they were trained on);
- health (`classify`): whether a run trained, or is stuck, diverged or NaN (Xiong et al., 2020:
  Post-LN without warmup); the context-free baseline it is judged against (`unigram_loss`);
- attention: the mean attention entropy per layer on a val snippet
  (`decoderlm.inference.attention_maps`), and for the study's best run the heat-maps of every
  head (`decoderlm.plot_attention`);
- init statistics (Vaswani et al., 2017, footnote 4): for q, k with independent unit-variance
  components, q·k = Σᵢ qᵢkᵢ has mean 0 and variance d_k, so unscaled logits grow as √d_k, the
  softmax saturates (entropy → 0) and its Jacobian diag(p) − ppᵀ vanishes; q·k/√d_k has variance 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from decoderlm.checkpoint import METRICS_FILE
from decoderlm.inference.attention_maps import attention_maps
from decoderlm.inference.generate import generate
from decoderlm.loading import load
from decoderlm.model.lm import DecoderLM
from decoderlm.plot_attention import plot_attention

# Run health (`classify`), in nats of the loss:
STUCK_MARGIN = 0.1  # stuck: final val loss not below the unigram baseline by this much
DIVERGED_RISE = 0.5  # diverged: final train loss this far above the run's lowest
SMOOTHING = 0.1  # train losses are averaged over windows of this share of the logged rows
HEALTHY, STUCK, DIVERGED, NAN = "healthy", "stuck", "diverged", "NaN"
HEALTH_CLASSES = (HEALTHY, STUCK, DIVERGED, NAN)
HEALTH_RULE = (
    "Run health: NaN — the loss became non-finite (the trainer stops); diverged — the final "
    f"train loss (mean over the last {SMOOTHING:.0%} of the logged steps) is more than "
    f"{DIVERGED_RISE:g} nats above the lowest such mean of the run; stuck — the final val loss is "
    f"not at least {STUCK_MARGIN:g} nats below the unigram baseline (the loss of the train "
    "split's token frequencies, which ignore the context: every run passes it early, and "
    "a model at initialisation is above it); healthy — none of these."
)
EXTRAPOLATION_FACTORS = (1, 2, 4)  # window lengths, in training contexts
BUCKETS_PER_CONTEXT = 4  # position buckets per training context length
ATTENTION_TOKENS = 48  # the val snippet (its first tokens) whose attention is measured and drawn


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl of a run (a torn last line skipped; no file: no rows)."""
    path = run_dir / METRICS_FILE
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def curves(rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """[step, value] pairs of the logged series: val loss, train loss and the gradient norm."""
    series = {"val_loss": "val_loss", "train_loss": "train_loss", "grad_norm": "grad_norm"}
    return {name: [[r["step"], r[key]] for r in rows if key in r] for name, key in series.items()}


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) on `val` of the train split's token frequencies, add-one smoothed:
    −mean log p(x), p(v) = (count(v) + 1) / (N + V); the best loss without the context."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size) + 1.0
    return float(-np.log(counts / counts.sum())[np.asarray(val, dtype=np.int64)].mean())


def classify(
    train_losses: list[list[float]], val_loss: float | None, nonfinite: bool, baseline: float
) -> tuple[str, int | None]:
    """A run's health by HEALTH_RULE: (HEALTHY, STUCK, DIVERGED or NAN; the step where the
    smoothed train loss was lowest, for DIVERGED, else None). `train_losses`: [step, loss] rows."""
    losses = [loss for _, loss in train_losses]
    if nonfinite or val_loss is None or not all(map(math.isfinite, [*losses, val_loss])):
        return NAN, None
    if losses:
        width = max(1, round(SMOOTHING * len(losses)))
        smooth = np.convolve(losses, np.ones(width) / width, mode="valid")  # (rows − width + 1,)
        lowest = int(smooth.argmin())
        if smooth[-1] > smooth[lowest] + DIVERGED_RISE:
            return DIVERGED, int(train_losses[lowest + width - 1][0])
    if val_loss > baseline - STUCK_MARGIN:
        return STUCK, None
    return HEALTHY, None


@torch.no_grad()
def decode_tokens_per_s(
    model: DecoderLM, batch_size: int, new_tokens: int, prompt_len: int = 8
) -> float:
    """Generated tokens per second (all rows) of greedy decoding from `prompt_len`-token prompts,
    after one untimed warm-up call."""
    prompt = [[i % model.config.vocab_size for i in range(prompt_len)]] * batch_size
    new_tokens = min(new_tokens, model.config.context_length - prompt_len)
    generate(model, prompt, 2, temperature=0.0)
    start = time.perf_counter()
    generate(model, prompt, new_tokens, temperature=0.0)
    return batch_size * new_tokens / (time.perf_counter() - start)


@torch.no_grad()
def position_losses(model: DecoderLM, tokens: np.ndarray, max_windows: int) -> dict[str, Any]:
    """Mean loss per position bucket of windows of factor × the training context, per factor.

    The model is rebuilt at the longer context (sinusoidal tables and RoPE angles are functions of
    the position, not parameters); a learned table has no rows past the training context, so
    those factors are None. Returns {"bucket": tokens per bucket, "<factor>x": [loss per bucket]
    or None, "<factor>x_mean": the window's mean loss or None}.
    """
    cfg = model.config
    width = max(1, cfg.context_length // BUCKETS_PER_CONTEXT)
    out: dict[str, Any] = {"bucket": width}
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    for factor in EXTRAPOLATION_FACTORS:
        length = factor * cfg.context_length
        n_windows = min(max_windows, (ids.numel() - 1) // length)
        if (cfg.position == "learned" and factor > 1) or n_windows < 1:
            out[f"{factor}x"] = out[f"{factor}x_mean"] = None
            continue
        long = DecoderLM(dataclasses.replace(cfg, context_length=length))
        long.load_state_dict(model.state_dict())
        long.eval()
        windows = ids[: n_windows * length + 1]
        x = windows[:-1].view(n_windows, length)  # (W, L)
        y = windows[1:].view(n_windows, length)  # (W, L)
        nats = torch.cat(
            [
                F.cross_entropy(long(xb).flatten(0, 1), yb.flatten(), reduction="none").view_as(yb)
                for xb, yb in zip(x.split(8), y.split(8), strict=True)
            ]
        )  # (W, L): −log p(x_{t+1} | x_≤t)
        per_position = nats.mean(0)  # (L,)
        out[f"{factor}x"] = per_position.view(-1, width).mean(1).tolist()  # (L / width,)
        out[f"{factor}x_mean"] = float(per_position.mean())
    return out


def attention_init_stats(
    d_ks: tuple[int, ...],
    seed: int,
    d_model: int = 256,
    n_queries: int = 256,
    n_keys: int = 64,
) -> list[dict[str, float]]:
    """var(q·k) and var(q·k/√d_k), softmax entropy and ‖∂softmax/∂s‖_F, per d_k, at initialisation.

    Inputs x ~ N(0, I) (what a LayerNorm hands the attention), projections W ~ N(0, 1/d_model)
    (LeCun), so each component of q = xW_Q and k = xW_K has unit variance; every query attends
    `n_keys` keys of other tokens.
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d_k in d_ks:
        w_q = torch.randn(d_model, d_k, generator=g) / math.sqrt(d_model)  # (d, d_k)
        w_k = torch.randn(d_model, d_k, generator=g) / math.sqrt(d_model)  # (d, d_k)
        q = torch.randn(n_queries, d_model, generator=g) @ w_q  # (N, d_k)
        k = torch.randn(n_queries, n_keys, d_model, generator=g) @ w_k  # (N, T, d_k)
        s = torch.einsum("nd,ntd->nt", q, k)  # q·k: (N, T)
        row = {"d_k": d_k, "var_qk": float(s.var()), "var_qk_scaled": float((s / d_k**0.5).var())}
        for name, scores in (("raw", s), ("scaled", s / math.sqrt(d_k))):  # QKᵀ vs QKᵀ/√d_k
            row[f"entropy_{name}"] = float(softmax_entropy(scores).mean())
            row[f"grad_norm_{name}"] = float(softmax_jacobian_norm(scores).mean())
        rows.append(row)
    return rows


def softmax_entropy(scores: torch.Tensor) -> torch.Tensor:
    """H(p) = −Σ p log p of p = softmax(scores) over the last dim, in nats: (..., T) → (...)."""
    logp = torch.log_softmax(scores, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def softmax_jacobian_norm(scores: torch.Tensor) -> torch.Tensor:
    """‖J‖_F of J = ∂softmax(s)/∂s = diag(p) − ppᵀ: ‖J‖²_F = Σp² − 2Σp³ + (Σp²)²; (..., T) → (...)."""
    p = torch.softmax(scores, dim=-1)
    p2, p3 = (p**2).sum(-1), (p**3).sum(-1)
    return (p2 - 2 * p3 + p2**2).clamp_min(0).sqrt()


def attention_snippet(model: DecoderLM, val: np.ndarray) -> list[int]:
    """The val tokens whose attention is measured: the first ATTENTION_TOKENS, within the context."""
    return val[: min(ATTENTION_TOKENS, model.config.context_length)].tolist()


def attention_entropy(model: DecoderLM, val: np.ndarray) -> list[float]:
    """Mean attention entropy (nats) of each layer, over heads and query rows, on the snippet."""
    return attention_maps(model, attention_snippet(model, val)).entropy.tolist()


def attention_figures(run_dir: Path, val: np.ndarray, out: Path) -> tuple[list[str], int]:
    """OUT/attention_layer<L>.png: every head of layer L of the run in `run_dir` on the snippet,
    the tokens on the axes. Returns the file names and the snippet's length."""
    model, tokenizer = load(run_dir)
    ids = attention_snippet(model, val)
    weights = attention_maps(model, ids).weights  # (n_layers, 1, H, T, T)
    tokens = [tokenizer.decode([i]) for i in ids]
    names = []
    for layer in range(weights.shape[0]):
        path = plot_attention(weights[layer, 0], tokens, out / f"attention_layer{layer}.png", layer)
        names.append(path.name)
    return names, len(ids)
