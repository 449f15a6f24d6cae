"""One serving-engine forward pass, timed with the engine's CPU speed paths and with each one off:
where a prefill chunk's and a wide decode step's time goes.

`ModelRunner.forward` over B rows of n tokens each, all starting at position `start` (a prefill
chunk: n > 1; a decode step: n = 1 over `start` cached tokens, whose K/V is whatever the pool
holds), in --dtype, with `SpeedPaths.for_engine()` and with each of its paths switched off in
turn (`without`), then with none; first the decode shapes through the engine's compiled pass
(`ModelRunner(compile=True)`: any number of rows where the linears run on AMX tiles, else one).
Each cell: the median of --runs passes after two warm-ups, ms.
Then a step's prefill chunks of different lengths (--ragged C: C prompts of 100-130 tokens),
with the engine's paths: as one pass of segments (`ModelRunner`'s rows of different lengths), and
as one pass per length (how the engine ran them before).

    HF_HUB_OFFLINE=1 python benchmarks/engine_passes.py --checkpoint MODEL_DIR
        [--shapes 4x128@0 1x512@0 16x128@0 22x93@0 16x1@200 64x1@200] [--dtype bfloat16]

MODEL_DIR: float weights (the packed linears take plain nn.Linear layers; a GGUF file's
quantized blocks stay quantized), e.g. the HF directory `decoderlm convert --to-hf` writes from
SmolLM2-135M-Instruct's GGUF file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import decoderlm
from decoderlm.cpu.features import cpu_name, has_native_bf16
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.engine.passes import Row
from decoderlm.engine.runner import ModelRunner

PATHS = ("attention", "packed_linears", "fused_ops", "in_place_attention")  # each off in turn


def parse_shape(text: str) -> tuple[int, int, int]:
    """ "BxN@S" → (rows, tokens a row, start)."""
    rows, rest = text.split("x")
    tokens, start = rest.split("@")
    return int(rows), int(tokens), int(start)


def make_rows(model: torch.nn.Module, lengths: list[int], start: int) -> list[Row]:
    """One row per length, from position `start`, each in blocks of its own."""
    g = torch.Generator().manual_seed(0)
    rows, block = [], 0
    for n in lengths:
        need = -(-(start + n) // 16)  # blocks of 16 tokens
        tokens = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        rows.append(Row(list(range(block, block + need)), start, tokens))
        block += need
    return rows


def median_ms(runner: ModelRunner, groups: list[list[Row]], runs: int) -> float:
    """Median milliseconds of running every group of rows, one forward each."""
    times = []
    with runner.running():
        for i in range(runs + 2):
            begin = time.perf_counter()
            for rows in groups:
                runner.forward(rows)
            if i >= 2:
                times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def runner_for(model: torch.nn.Module, paths: SpeedPaths, compile: bool = False) -> ModelRunner:
    return ModelRunner(model, kv_cache_memory="1GiB", block_size=16, kv_cache_dtype=None,
                       cpu_kernels=paths, compile=compile)  # fmt: skip


def time_pass(model: torch.nn.Module, paths: SpeedPaths, shape: tuple[int, int, int], runs: int) -> float:  # fmt: skip
    """Median milliseconds of one forward over `shape`'s rows with `paths`."""
    b, n, start = shape
    return median_ms(runner_for(model, paths), [make_rows(model, [n] * b, start)], runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a model of float weights")
    parser.add_argument("--shapes", nargs="+", default=["4x128@0", "1x512@0", "16x128@0", "22x93@0", "16x1@200", "64x1@200"])  # fmt: skip
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--ragged",
        type=int,
        nargs="*",
        default=[8, 16],
        help="prompts a step (≤ 2,048 tokens: a step's budget)",
    )
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if has_native_bf16() else "float32")
    model, _ = decoderlm.load(args.checkpoint, dtype=dtype)
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, {args.checkpoint} {dtype}, load average "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    variants = [("engine's paths", SpeedPaths.for_engine())]
    variants += [(f"without {p}", SpeedPaths.for_engine().without(p)) for p in PATHS]
    variants += [("none", SpeedPaths.none())]
    print("| paths | " + " | ".join(f"{s} ms" for s in args.shapes) + " |")
    print("|---" * (len(args.shapes) + 1) + "|")
    compiled = runner_for(model, SpeedPaths.for_engine(), compile=True)
    shapes = list(map(parse_shape, args.shapes))
    if compiled.step is not None and any(
        n == 1 and b <= compiled.step.max_batch for b, n, _ in shapes
    ):
        cells = [
            f"{median_ms(compiled, [make_rows(model, [n] * b, start)], args.runs):.1f}"
            if n == 1 and b <= compiled.step.max_batch
            else "–"
            for b, n, start in shapes
        ]
        label = f"compiled decode pass (≤ {compiled.step.max_batch} rows)"
        print(f"| {label} | " + " | ".join(cells) + " |")
    for label, paths in variants:
        cells = [time_pass(model, paths, parse_shape(s), args.runs) for s in args.shapes]
        print(f"| {label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print("\n| prompts of 100-130 tokens | one pass of segments ms | one pass per length ms |")
    print("|---|---|---|")
    runner = runner_for(model, SpeedPaths.for_engine())
    for c in args.ragged:
        rows = make_rows(model, [100 + (31 * i) // c for i in range(c)], 0)  # spread over 100-130
        by_length: dict[int, list[Row]] = {}
        for row in rows:
            by_length.setdefault(len(row.tokens), []).append(row)
        one, per_length = median_ms(runner, [rows], args.runs), median_ms(runner, list(by_length.values()), args.runs)  # fmt: skip
        print(f"| {c} ({len(by_length)} lengths) | {one:.0f} | {per_length:.0f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
