"""Convert multi-head attention to grouped-query or multi-query attention by mean-pooling K/V heads.

Ainslie et al. (2023), "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints", §2.1: the key and value projection matrices of the heads in each group are replaced by
their mean, W_K^(g) = 1/|g| Σ_{h∈g} W_K^(h) (same for W_V), and the model is then up-trained for a
small fraction (α ≈ 5%) of the original steps.

Since a head's keys are linear in its projection, k^(g) = W_K^(g) x + b^(g) = mean_{h∈g}(W_K^(h) x + b^(h)):
the pooled key is the mean of the group's keys, so biases are pooled with the same mean. RoPE rotates
every head by the same angle, so pooling before or after it is the same. A q/k norm (Qwen3, OLMo 2)
has ONE weight shared by all heads, so there is nothing to pool: it stays as it is, and renormalises
the pooled key (whose RMS a mean shrinks) back to the scale the queries were trained against.
Groups are contiguous, as in the attention: K/V head g serves query heads [g·n/G, (g+1)·n/G).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from decoderlm import checkpoint
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM


def pool_kv(tensor: torch.Tensor, config: ModelConfig, n_kv_heads: int) -> torch.Tensor:
    """Fused qkv weight (rows, d_model) or bias (rows,) of `config` → the same with `n_kv_heads` K/V heads.

    Query rows (and output-gate rows) are kept; each new K (and V) head is the mean of the old K (V)
    heads it replaces.
    """
    _check_groups(config, n_kv_heads)
    hd, old = config.head_dim, config.n_kv_heads
    q_rows = config.n_heads * hd * (2 if config.attn_output_gate else 1)
    q, k, v = tensor.split([q_rows, old * hd, old * hd], dim=0)

    def mean_pool(w: torch.Tensor) -> torch.Tensor:
        grouped = w.reshape(n_kv_heads, old // n_kv_heads, hd, *w.shape[1:])  # (G, old/G, hd, ...)
        pooled = grouped.mean(dim=1)  # W^(g) = mean_{h∈g} W^(h): (G, hd, ...)
        return pooled.reshape(n_kv_heads * hd, *w.shape[1:])

    return torch.cat([q, mean_pool(k), mean_pool(v)], dim=0)


def to_gqa(model: DecoderLM, n_kv_heads: int) -> DecoderLM:
    """A new model with `n_kv_heads` K/V heads (1 = MQA), K/V projections mean-pooled within each group."""
    _check_groups(model.config, n_kv_heads)
    config = dataclasses.replace(
        model.config, n_kv_heads=n_kv_heads, extra=dict(model.config.extra)
    )
    config.extra["gqa_from_n_kv_heads"] = model.config.n_kv_heads
    state = checkpoint.model_state_dict(model)
    for name, tensor in state.items():
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            state[name] = pool_kv(tensor, model.config, n_kv_heads)
    param = next(model.parameters())
    pooled = DecoderLM(config).to(device=param.device, dtype=param.dtype)
    pooled.load_state_dict(state, strict=not config.tie_embeddings)
    return pooled.train(model.training)


def convert_run(src_run: str | Path, out_run: str | Path, n_kv_heads: int) -> Path:
    """`decoderlm convert --to-gqa G SRC --out OUT`: pool a run's K/V heads into a new run directory."""
    src_run, out_run = Path(src_run), Path(out_run)
    model = checkpoint.load_model(src_run)
    checkpoint.save_model(out_run, to_gqa(model, n_kv_heads))
    tokenizer = src_run / checkpoint.TOKENIZER_FILE
    if tokenizer.is_file():
        atomic_write(
            out_run / checkpoint.TOKENIZER_FILE, lambda tmp: shutil.copyfile(tokenizer, tmp)
        )
    return out_run


def _check_groups(config: ModelConfig, n_kv_heads: int) -> None:
    old = config.n_kv_heads
    if not isinstance(n_kv_heads, int) or n_kv_heads < 1 or old % n_kv_heads:
        divisors = [g for g in range(1, old + 1) if old % g == 0]
        raise DecoderLMError(
            f"cannot pool {old} K/V heads into n_kv_heads={n_kv_heads!r}: it must divide {old}; "
            f"allowed: {', '.join(map(str, divisors))}"
        )
