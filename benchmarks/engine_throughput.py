"""The engine alone, without HTTP: generated tokens/s of `Engine.generate` at 1, 16 and 64 streams
for an attention model and a hybrid one of the same shape.

Models: the "llama-55m" preset (d_model 512, 8 layers, 8 heads sharing 2 K/V heads, vocab 32000,
random init, seed 0) and the same shape as a 3:1 Gated DeltaNet hybrid (GDN, GDN, GDN, attention,
twice), in --dtype. For C streams, C requests of --prompt-tokens random tokens each run at once
(submitted together), each generating --new-tokens greedy tokens (no end-of-text stop); tokens/s
= C · new tokens / wall time, prefill included. With --batch-invariant the attention model runs
again in `Engine(batch_invariant=True)`: what the mode costs. --compile on (the server's
default) runs decode passes by the libraries compiled ahead of time (`Engine(compile=True)`), off
eagerly, both each model both ways. --checkpoint runs a model of one's own instead (a run, a
Hugging Face directory, a GGUF file or a model's name, e.g. smollm2-135m-instruct: its Q4_1 file,
in --dtype activations on its blocks). Every (model, C) runs --rounds times, interleaved
with the others, and the best round is kept (a shared CPU's speed drifts; the best of interleaved
rounds gives each case the same chance of a quiet moment). The table prints the CPU, the threads
and the load average before and after.

    HF_HUB_OFFLINE=1 python benchmarks/engine_throughput.py [--dtype bfloat16] [--streams 1 16 64]
        [--rounds 3] [--compile on|off|both] [--batch-invariant] [--checkpoint MODEL] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.features import cpu_name
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams
from decoderlm.loading import load

HYBRID = ("gdn", "gdn", "gdn", "attention") * 2


class Vocabulary:
    """A tokenizer stand-in: token i is the character chr(0x4E00 + i) (the engine detokenizes)."""

    def __init__(self, size: int) -> None:
        self.vocab_size, self.eot_id = size, None

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x4E00 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)  # (it has no special tokens)


def model(kind: str, dtype: torch.dtype) -> DecoderLM:
    torch.manual_seed(0)
    layers = {"attention": None, "hybrid": HYBRID}[kind]
    config = ModelConfig.from_preset("llama-55m", n_kv_heads=2, layer_types=layers)
    return DecoderLM(config).to(dtype).eval()


def loaded(kind: str, dtype: torch.dtype, checkpoint: str | None) -> tuple:
    """(model, tokenizer) of the case `kind`: the --checkpoint's own, or a random one."""
    if checkpoint is None:
        return model(kind, dtype), Vocabulary(32000)
    return load(checkpoint, dtype=dtype)


def tokens_per_s(engine: Engine, streams: int, prompt: int, new: int) -> float:
    g = torch.Generator().manual_seed(streams)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(streams)]
    params = RequestParams(new, SamplingParams(temperature=0), ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert sum(len(c.token_ids) for c in done) == streams * new
    return streams * new / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--compile", choices=["on", "off", "both"], default="on")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also the attention model in Engine(batch_invariant=True)",
    )
    parser.add_argument(
        "--checkpoint", metavar="MODEL", help="this model instead of the random attention/hybrid"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 and 4 streams, 8 tokens"
    )
    args = parser.parse_args()
    if args.quick:
        args.streams, args.new_tokens, args.prompt_tokens, args.rounds = [1, 4], 8, 16, 1
    dtype = getattr(torch, args.dtype)
    load = os.getloadavg()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{args.dtype}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    memory = args.kv_cache_memory
    ways = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
    kinds = [args.checkpoint] if args.checkpoint else ["attention", "hybrid"]
    cases = [(kind, False) for kind in kinds]
    cases += [(kinds[0], True)] if args.batch_invariant else []
    engines = {
        kind
        + (", batch-invariant" if invariant else "")
        + (", compiled" if compile and args.compile == "both" else ""): Engine(
            *loaded(kind, dtype, args.checkpoint),
            kv_cache_memory=memory,
            compile=compile,
            batch_invariant=invariant,
        )
        for kind, invariant in cases
        for compile in ways
    }
    for engine in engines.values():  # warm-up: the first steps build kernels and caches
        tokens_per_s(engine, 2, args.prompt_tokens, 4)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for kind, engine in engines.items():
            for c in args.streams:
                rate = tokens_per_s(engine, c, args.prompt_tokens, args.new_tokens)
                best[kind, c] = max(best.get((kind, c), 0.0), rate)
    print(f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens per stream, "
          f"best of {args.rounds} rounds")  # fmt: skip
    print("| model | " + " | ".join(f"{c} streams tok/s" for c in args.streams) + " |")
    print("|---" * (len(args.streams) + 1) + "|")
    for kind in engines:
        print(f"| {kind} | " + " | ".join(f"{best[kind, c]:.1f}" for c in args.streams) + " |")
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
