"""One serving-engine forward pass, timed with the engine's CPU speed paths and with each one off:
where a prefill chunk's and a wide decode step's time goes.

`ModelRunner.forward` over B rows of n tokens each, all starting at position `start` (a prefill
chunk: n > 1; a decode step: n = 1 over `start` cached tokens, whose K/V is whatever the pool
holds), in --dtype, with `SpeedPaths.for_engine()` and with each of its paths switched off in
turn (`without`), then with none. Each cell: the median of --runs passes after two warm-ups, ms.

    HF_HUB_OFFLINE=1 python benchmarks/engine_passes.py --checkpoint MODEL_DIR
        [--shapes 4x128@0 1x512@0 16x1@200 64x1@200] [--dtype bfloat16]

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

PATHS = ("packed_linears", "fused_ops", "in_place_attention")  # each switched off in turn


def parse_shape(text: str) -> tuple[int, int, int]:
    """ "BxN@S" → (rows, tokens a row, start)."""
    rows, rest = text.split("x")
    tokens, start = rest.split("@")
    return int(rows), int(tokens), int(start)


def time_pass(model: torch.nn.Module, paths: SpeedPaths, shape: tuple[int, int, int], runs: int) -> float:  # fmt: skip
    """Median milliseconds of one forward over `shape`'s rows with `paths`."""
    b, n, start = shape
    runner = ModelRunner(model, kv_cache_memory="1GiB", block_size=16, kv_cache_dtype=None,
                         cpu_kernels=paths)  # fmt: skip
    per_row = -(-(start + n) // 16)  # blocks a row needs
    g = torch.Generator().manual_seed(0)
    rows = [
        Row(list(range(r * per_row, (r + 1) * per_row)), start,
            torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist())
        for r in range(b)
    ]  # fmt: skip
    times = []
    with runner.running():
        for i in range(runs + 2):
            begin = time.perf_counter()
            runner.forward(rows)
            if i >= 2:
                times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a model of float weights")
    parser.add_argument("--shapes", nargs="+", default=["4x128@0", "1x512@0", "16x1@200", "64x1@200"])  # fmt: skip
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--runs", type=int, default=7)
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
    for label, paths in variants:
        cells = [time_pass(model, paths, parse_shape(s), args.runs) for s in args.shapes]
        print(f"| {label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
