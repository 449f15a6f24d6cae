"""Time to first token of one request sent to an idle engine, by prompt length: the prompt in passes
of the step's whole budget (the scheduler's policy when no sequence decodes) against passes of one
prefill chunk each.

    HF_HUB_OFFLINE=1 python benchmarks/prompt_ttft.py --checkpoint MODEL_DIR [--dtype bfloat16]
        [--prompts 128 512 1024 2048] [--rounds 5]

`Engine(model, tokenizer)` with its defaults (`prefill_chunk` 128, `max_batched_tokens` 2,048, the
CPU speed paths) against the same engine with `max_batched_tokens=128`, where a lone prompt runs
in chunks of 128 tokens, one pass each, its later chunks attending the keys of the earlier ones
from the pool. Each cell: the median over --rounds of the two engines in turn (interleaved), of
the milliseconds from `submit` to the first token's event, the engine stepped on this thread; a
prompt of random token ids, one greedy token; prefix caching off, so no round reuses another's
blocks. MODEL_DIR: e.g. the HF directory `decoderlm convert --to-hf` writes from
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
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams


def ttft_ms(engine: Engine, prompt: list[int]) -> float:
    """Milliseconds from submitting `prompt` to its first token, the engine otherwise idle."""
    first: list[float] = []
    params = RequestParams(1, SamplingParams(temperature=0), ignore_eos=True)
    begin = time.perf_counter()
    engine.submit(prompt, params, on_event=lambda event: first.append(time.perf_counter()))
    while engine.step():
        pass
    return 1000 * (first[0] - begin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if has_native_bf16() else "float32")
    model, tokenizer = decoderlm.load(args.checkpoint, dtype=dtype)
    engines = {
        budget: Engine(
            model,
            tokenizer,
            kv_cache_memory="1GiB",
            max_batched_tokens=budget,
            prefix_caching=False,
        )
        for budget in (2048, 128)
    }
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, {args.checkpoint} {dtype}, load average "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| prompt tokens | passes of the budget (2,048) ms | chunks of 128 ms | ratio |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for n in args.prompts:
        times: dict[int, list[float]] = {budget: [] for budget in engines}
        for _ in range(args.rounds + 1):  # the first round warms up
            prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
            for budget, engine in engines.items():
                times[budget].append(ttft_ms(engine, prompt))
        whole, chunked = (statistics.median(times[b][1:]) for b in (2048, 128))
        print(f"| {n:,} | {whole:,.0f} | {chunked:,.0f} | {whole / chunked:.2f}× |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
