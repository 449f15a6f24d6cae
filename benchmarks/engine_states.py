"""A recurrent model's engine decode steps: what copying its recurrent states costs, with the
decode passes' states kept between steps (`decoderlm.engine.state_pool`: `StatePool.seek(keep=
True)`, the engine's way) against every pass gathering its rows' states from their pages and
writing them back (`keep=False` forced), with the decode passes compiled (`Engine(compile=True)`,
the server's default) and eager.

The hybrid (Gated DeltaNet in three of four layers, attention in the fourth: "hybrid-tiny") keeps
its states in pages of the KV pool, the pure recurrent model ("recurrent-tiny") in slots of their
own. Both at d_model 512 with 8 heads (a GDN layer's state: 128 KB a sequence), bfloat16, random
weights, 100-token prompts. At each batch size B:
- steady: B requests at once, 10 decode steps to warm up, then the mean of 30 (the same rows
  step after step), and the ms of those steps in `StatePool.seek` and `store`;
- churn: B streams kept busy, each request generating a number of tokens drawn from 16..112 and
  replaced by a new one when it ends (its prompt prefilled in the same steps): generated tokens/s
  over 200 steps after 100, rows joining and leaving the decode passes every few steps.
The four ways (compiled or eager, kept or copied) take turns, --rounds times.

    python benchmarks/engine_states.py [--presets hybrid-tiny recurrent-tiny] [--batch 1 16 64]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.features import cpu_name
from decoderlm.engine import state_pool
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams, TokenEvent
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

SPENT: dict[str, float] = collections.defaultdict(float)  # seconds in seek / store
GREEDY = SamplingParams(temperature=0)
KEEP = {"kept": True}  # whether decode passes keep their states (False: "copied")


def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def run(self: state_pool.StatePool, *args: Any, **kwargs: Any) -> Any:
        if name == "seek" and not KEEP["kept"]:
            kwargs["keep"] = False
        begin = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - begin

    return run


def prompt(g: torch.Generator, tok: Tokenizer) -> list[int]:
    return torch.randint(1, tok.vocab_size, (100,), generator=g).tolist()


def steady(engine: Engine, b: int, g: torch.Generator, tok: Tokenizer) -> tuple[float, float]:
    """Mean ms of a decode step of b rows, and of its seek + store."""
    params = RequestParams(60, GREEDY, ignore_eos=True)
    for _ in range(b):
        engine.submit(prompt(g, tok), params, on_event=lambda event: None)
    for _ in range(10):  # the prompts, then the first decode steps
        engine.step()
    SPENT.clear()
    begin, n = time.perf_counter(), 30
    for _ in range(n):
        engine.step()
    step = (time.perf_counter() - begin) / n
    while engine.step():  # the rest of these requests
        pass
    return 1e3 * step, 1e3 * (SPENT["seek"] + SPENT["store"]) / n


def churn(engine: Engine, b: int, g: torch.Generator, tok: Tokenizer, rng: random.Random) -> float:
    """Generated tokens/s of b streams kept busy (see the module docstring)."""
    live, tokens = [0], [0]

    def on_event(event: TokenEvent) -> None:
        tokens[0] += event.token_id is not None
        live[0] -= event.finish_reason is not None

    def step() -> None:
        while live[0] < b:
            params = RequestParams(rng.randint(16, 112), GREEDY, ignore_eos=True)
            engine.submit(prompt(g, tok), params, on_event=on_event)
            live[0] += 1
        engine.step()

    for _ in range(100):
        step()
    tokens[0], begin = 0, time.perf_counter()
    for _ in range(200):
        step()
    rate = tokens[0] / (time.perf_counter() - begin)
    while engine.step():  # the streams still running, to their ends
        pass
    return rate


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
    print("| model | B | pass | states | steady step ms | seek + store ms | churn tok/s |")
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
        for b in args.batch:
            for r in range(args.rounds):
                for way, engine in engines.items():
                    for states in ("kept", "copied"):
                        KEEP["kept"] = states == "kept"
                        g, rng = torch.Generator().manual_seed(r), random.Random(r)
                        step, copies = steady(engine, b, g, tok)
                        rate = churn(engine, b, g, tok, rng)
                        print(f"| {preset} | {b} | {way} | {states} | {step:.2f} | {copies:.2f} "
                              f"({copies / step:.0%}) | {rate:,.0f} |", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
