"""The optimizer step: gradient clipping, AdamW over two parameter groups, warmup + cosine schedule.

The Trainer averages the gradients of one optimizer step (`grad_accum` micro-steps on each of
`world_size` processes), g = 1/(A·N) Σ ∇ℓ(micro-batch). Then
- gradient clipping: g ← g · min(1, grad_clip / ‖g‖₂) (Pascanu et al., 2013), see `clip_and_step`;
- AdamW (Loshchilov & Hutter, 2019): θ ← θ − lr·(m̂ / (√v̂ + ε) + λθ), with the decay λ only on the
  weights of linear layers (see `param_groups`);
- the learning rate: linear warmup, then cosine decay to a floor (Loshchilov & Hutter, 2017),
  lr(p) = min_lr + ½(lr − min_lr)(1 + cos πp), p ∈ [0, 1] the fraction of the run done (by steps,
  or by time when a time limit ends the run).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from decoderlm.training.train_config import TrainConfig


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on the weights of linear layers, none elsewhere.

    Decayed: every matrix used in a matmul (attention and MLP projections, the LM head, and so a
    tied token embedding, which is the head's weight). Not decayed: norms' gains, biases, and
    untied embedding tables (token or learned positions): a table row gets a gradient only when
    its token/position occurs, but decay would shrink it every step, pulling rare tokens to 0.
    """
    linear = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    params = [p for p in module.parameters() if p.requires_grad]  # shared tensors once
    return [
        {"params": [p for p in params if id(p) in linear], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in linear], "weight_decay": 0.0},
    ]


def make_optimizer(module: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `param_groups`, with the fused (single-kernel) implementation on CPU and CUDA."""
    return torch.optim.AdamW(
        param_groups(module, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=device.type in ("cpu", "cuda"),
    )


def clip_and_step(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, max_norm: float
) -> Tensor | None:
    """Clip the gradients to the global norm `max_norm` (0: no clipping), then step; returns ‖g‖₂
    before clipping, or None without clipping. Call it after `scaler.unscale_(optimizer)`.

    With the fused AdamW on plain tensors and no fp16 scaler, the clip rides in the step: the fused
    kernel divides each gradient by `optimizer.grad_scale` (the hook torch's GradScaler uses), here
    max(1, (‖g‖ + 10⁻⁶) / max_norm), the inverse of the factor `clip_grad_norm_` multiplies by:
    one pass over the gradients less (see benchmarks/shakespeare_char.py).
    Otherwise (FSDP's DTensors, an fp16 GradScaler, unfused AdamW) `clip_grad_norm_` scales first.
    """
    if not max_norm:
        scaler.step(optimizer)
        return None
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    folded = optimizer.defaults.get("fused") and not scaler.is_enabled()
    if not folded or any(isinstance(p.grad, DTensor) for p in params):
        norm = nn.utils.clip_grad_norm_(params, max_norm)
        scaler.step(optimizer)
        return norm
    norm = nn.utils.get_total_norm([p.grad for p in params])
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp_min(1.0)  # g ← g / grad_scale
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm


def learning_rate(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """lr for optimizer step `step` (0-based): linear warmup, then cosine down to min_lr.

    p, the fraction of the decay done, counts the steps after warmup up to decay_steps (default
    max_steps), or the seconds of the run's time limit (`TrainConfig.time_limit`, none for a step
    budget without --max-time), whichever is further along. `elapsed` counts the seconds of
    earlier sessions too, so a resumed time budget continues its schedule.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = 0.0
    horizon = cfg.decay_steps or cfg.max_steps
    if horizon:
        progress = (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    if cfg.time_limit:
        progress = max(progress, elapsed / cfg.time_limit)
    progress = min(max(progress, 0.0), 1.0)
    # lr(p) = min_lr + ½(lr − min_lr)(1 + cos πp)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
