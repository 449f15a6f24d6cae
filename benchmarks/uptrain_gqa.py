"""Up-training mean-pooled GQA/MQA checkpoints on char-level Tiny Shakespeare (Ainslie et al., 2023).

The paper's recipe (§2.1): take a multi-head (MHA) checkpoint, mean-pool the K/V projection heads
of each group (`decoderlm.gqa`), then up-train for a fraction α = 5% of the original steps. Here:

1. train a Llama-style MHA char model for `--steps` steps (`decoderlm.training.trainer.train`);
2. pool it into G K/V heads for each `--groups` G and measure the val loss before any training;
3. up-train each pooled model for α·steps with `init_from` (what `decoderlm train --init-from`
   does), on a different data order (seed + 1), and measure again.
A control row trains the MHA model itself for the same α·steps, separating what pooling costs from
what the extra steps give.

Val loss: mean next-token loss in nats over the whole validation split (the last 10% of the text),
non-overlapping windows of the context length (`decoderlm.inference.evaluate.evaluate_tokens`), float32.

    python benchmarks/uptrain_gqa.py                 # ~9 CPU-minutes (~5 min on 2 idle cores)
    python benchmarks/uptrain_gqa.py --quick         # smoke run, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from decoderlm import checkpoint, data, gqa
from decoderlm.inference.evaluate import evaluate_tokens
from decoderlm.model.cache import kv_cache_bytes_per_token
from decoderlm.model.config import ModelConfig
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.trainer import train

DEFAULT_DATA = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"
)


def model_config(quick: bool) -> ModelConfig:
    """Llama-style (RoPE, RMSNorm, SwiGLU), multi-head: 8 heads of 8 dims, 0.22M parameters."""
    return ModelConfig(
        vocab_size=1,  # the trainer sets it from the data
        context_length=64,
        d_model=32 if quick else 64,
        n_layers=2 if quick else 4,
        n_heads=8,
        n_kv_heads=8,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
    )


def train_config(steps: int) -> TrainConfig:
    return TrainConfig(
        batch_size=32,
        lr=2e-3,
        min_lr=2e-4,
        warmup_steps=max(1, steps // 12),
        max_steps=steps,
        max_time=0.0,  # a fixed number of steps, whatever the machine's load
        eval_interval=0,  # val loss measured here, on the whole split
        checkpoint_interval=0,
        log_interval=max(1, steps // 4),
        sample_tokens=8,
        dtype="fp32",  # at this width bf16 autocast costs more than it saves on the CPU
    )


def val_loss(run: Path, val_tokens: np.ndarray) -> float:
    return evaluate_tokens(checkpoint.load_model(run), val_tokens).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a text file")
    parser.add_argument("--steps", type=int, default=500, help="steps of the MHA original")
    parser.add_argument("--fraction", type=float, default=0.05, help="up-training steps / --steps")
    parser.add_argument("--groups", default="4,2,1", help="K/V head counts to pool into (1 = MQA)")
    parser.add_argument(
        "--up-lr", type=float, help="peak learning rate of up-training (default: the original's)"
    )
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary dir)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 40 steps: a smoke run")
    args = parser.parse_args()
    steps = 40 if args.quick else args.steps
    up_steps = max(1, round(args.fraction * steps))
    groups = [int(g) for g in args.groups.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        data_dir = out / "data"
        data.prepare([args.data], data_dir, tokenizer="char", val_fraction=0.1, progress=False)
        val = data.load_split(data_dir, "val")
        base = train_config(steps)
        up = dataclasses.replace(
            base,
            max_steps=up_steps,
            lr=args.up_lr or base.lr,
            min_lr=min(base.min_lr, args.up_lr or base.lr),
            warmup_steps=max(1, round(args.fraction * base.warmup_steps)),
            seed=base.seed + 1,  # new batches: the original run saw the first ones
            log_interval=max(1, up_steps // 2),
        )

        start = time.perf_counter()
        mha_summary = train(model_config(args.quick), base, data_dir, out / "mha", progress=False)
        train_time = time.perf_counter() - start
        cfg = checkpoint.load_model(out / "mha").config
        rows = []
        for g in [cfg.n_heads, *groups]:
            pooled = out / f"kv{g}"
            if g == cfg.n_heads:  # the control: MHA, up-trained like the others
                pooled = out / "mha"
            else:
                gqa.convert_run(out / "mha", pooled, g)
            before = val_loss(pooled, val)
            train(None, up, data_dir, out / f"kv{g}-up", init_from=pooled, progress=False)
            after = val_loss(out / f"kv{g}-up", val)
            kv_bytes = kv_cache_bytes_per_token(dataclasses.replace(cfg, n_kv_heads=g))
            rows.append((g, kv_bytes, before, after))

    print(
        f"\nchar-level Tiny Shakespeare ({args.data.name}), {cfg.n_layers} layers × {cfg.n_heads} "
        f"heads × {cfg.head_dim} dims, d_model {cfg.d_model}, context {cfg.context_length}, "
        f"{mha_summary['parameters'] / 1e6:.2f}M parameters; MHA trained {steps} steps × "
        f"{base.batch_size} sequences in {train_time:.0f} s; up-training {up_steps} steps "
        f"({args.fraction:.0%}).\nval loss (nats/char) over the whole val split "
        f"({len(val):,} chars):\n"
    )
    print("| model | K/V heads | KV cache / token | val loss before up-training | + up-training |")
    print("|-------|----------:|-----------------:|----------------------------:|--------------:|")
    for g, kv_bytes, before, after in rows:
        name = "MHA (original)" if g == cfg.n_heads else "MQA" if g == 1 else f"GQA-{g}"
        print(f"| {name} | {g} | {kv_bytes:,} B | {before:.4f} | {after:.4f} |")


if __name__ == "__main__":
    main()
