"""A recurrent model's engine decode steps: how much of a step gathering and writing back the
recurrent states takes (`decoderlm.engine.state_pool`: `StatePool.seek` before the forward pass,
`StatePool.store` after it), with the decode passes compiled (`Engine(compile=True)`, the
server's default) and eager.

The hybrid (Gated DeltaNet in three of four layers, attention in the fourth: "hybrid-tiny") keeps
its states in pages of the KV pool, the pure recurrent model ("recurrent-tiny") in slots of their
own. Both at d_model 512 with 8 heads (a GDN layer's state: 128 KB a sequence), bfloat16, random
weights, 100-token prompts; at each batch size B, 10 decode steps to warm up, then the mean of 30;
the compiled and eager engines take turns, --rounds times.

    python benchmarks/engine_states.py [--presets hybrid-tiny recurrent-tiny] [--batch 1 16 64]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.features import cpu_name
from decoderlm.engine import state_pool
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

SPENT: dict[str, float] = collections.defaultdict(float)  # seconds in seek / store


def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        begin = time.perf_counter()
        try:
            return method(*args)
        finally:
            SPENT[name] += time.perf_counter() - begin

    return run


def steps(engine: Engine, b: int, g: torch.Generator, tok: Tokenizer) -> tuple[float, ...]:
    """Mean ms of a decode step of b rows, of its seek and of its store."""
    params = RequestParams(60, SamplingParams(temperature=0), ignore_eos=True)
    for _ in range(b):
        prompt = torch.randint(1, tok.vocab_size, (100,), generator=g).tolist()
        engine.submit(prompt, params, on_event=lambda event: None)
    for _ in range(10):  # the prompts, then the first decode steps
        engine.step()
    SPENT.clear()
    begin, n = time.perf_counter(), 30
    for _ in range(n):
        engine.step()
    step = (time.perf_counter() - begin) / n
    while engine.step():  # the rest of these requests
        pass
    return 1e3 * step, 1e3 * SPENT["seek"] / n, 1e3 * SPENT["store"] / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["hybrid-tiny", "recurrent-tiny"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for name in ("seek", "store"):
        setattr(state_pool.StatePool, name, timed(name, getattr(state_pool.StatePool, name)))
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| model | B | pass | step ms | seek ms | store ms | seek + store |")
    print("|---|---|---|---|---|---|---|")
    tok = Tokenizer.train_char(["abcdefghijklmnopqrstuvwxyz .,\n"])
    for preset in args.presets:
        torch.manual_seed(0)
        config = ModelConfig.from_preset(preset, vocab_size=tok.vocab_size, d_model=512,
                                         n_heads=8, context_length=1024)  # fmt: skip
        model = DecoderLM(config).bfloat16().eval()
        engines = {
            way: Engine(model, tok, kv_cache_memory="512MiB", compile=way == "compiled")
            for way in ("compiled", "eager")
        }
        g = torch.Generator().manual_seed(0)
        for b in args.batch:
            for _ in range(args.rounds):
                for way, engine in engines.items():
                    step, seek, store = steps(engine, b, g, tok)
                    print(f"| {preset} | {b} | {way} | {step:.2f} | {seek:.2f} | {store:.2f} "
                          f"| {(seek + store) / step:.0%} |", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
