"""How many concurrent greedy requests give the tokens they give alone: the engine and `generate`
with a batch, by default and with `batch_invariant=True`, on a real chat model.

N chat prompts ("Write two sentences about ...", each rendered by the model's own chat template)
decode --new-tokens greedy tokens each, all N submitted at once to `Engine(compile=True)`, then
each alone on the same engine; a request matches where its tokens (and, as a second count, its
log-probabilities) are the same both ways. Then the same prompts as one left-padded batch of
`generate(compile=True)` against each prompt alone (tokens only: it returns no
log-probabilities); batch-invariant, a third count says how many equal the engine's. The last
column: the batch's new tokens a second in `generate`, timed in a second call (what
batch invariance costs there). Default mode: a row's sums change with the rows beside
it (the block kernels of a few rows against the integer tiles of many, a prompt's GEMM, Inductor's
fused norms; for `generate`, also a prompt's padding in its attention), enough to flip greedy
near-ties; batch-invariant mode: every reduction in one order at every number of rows
(`decoderlm.cpu.invariant`), each query attending its own keys. Exits non-zero where a
batch-invariant request does not match.

    HF_HUB_OFFLINE=1 python benchmarks/batch_invariance.py [--checkpoint smollm2-135m-instruct]
        [--dtype bfloat16 float32] [--requests 32] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from decoderlm.chat_template import load_chat_template
from decoderlm.cpu.features import cpu_name
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.generate import generate
from decoderlm.inference.sampling import SamplingParams
from decoderlm.loading import load, resolve_checkpoint

TOPICS = ("the sea", "a cat", "bread", "rain", "a clock", "the moon", "trains", "chess", "tea",
          "snow", "a river", "bees", "a lamp", "winter", "music", "a bridge")  # fmt: skip


def prompts(checkpoint: str, tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts, the topics in turn, every third one ending in a full stop or two."""
    template = load_chat_template(resolve_checkpoint(checkpoint))
    texts = [
        template.render([{"role": "user", "content": f"Write two sentences about "
                                                     f"{TOPICS[i % len(TOPICS)]}{'.' * (i % 3)}"}])
        for i in range(count)
    ]  # fmt: skip
    return [tokenizer.encode(text) for text in texts]


def matches(engine: Engine, requests: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """(requests whose tokens match alone and together, those whose log-probabilities do too)."""
    params = RequestParams(new_tokens, SamplingParams(temperature=0), ignore_eos=True, logprobs=1)
    together = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in requests]
    pairs = list(zip(together, alone, strict=True))
    tokens = sum(c.token_ids == s.token_ids for c, s in pairs)
    return tokens, sum(c.token_ids == s.token_ids and c.logprobs == s.logprobs for c, s in pairs)


def generate_matches(
    model, requests: list[list[int]], new_tokens: int, invariant: bool
) -> tuple[int, list[list[int]], float]:
    """(requests whose tokens in one `generate` batch match their tokens alone, the batch's, the
    batch's new tokens a second in a second call: the compiled step's library made or loaded)."""
    options = dict(temperature=0, compile=True, batch_invariant=invariant)
    together = generate(model, requests, new_tokens, **options)
    alone = [generate(model, [r], new_tokens, **options)[0] for r in requests]
    start = time.perf_counter()
    generate(model, requests, new_tokens, **options)
    speed = len(requests) * new_tokens / (time.perf_counter() - start)
    return sum(c == s for c, s in zip(together, alone, strict=True)), together, speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", nargs="+", choices=["bfloat16", "float32"],
                        default=["bfloat16", "float32"])  # fmt: skip
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    load_avg = os.getloadavg()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"load average {load_avg[0]:.2f}")  # fmt: skip
    print(f"{args.checkpoint}: {args.requests} concurrent greedy requests of {args.new_tokens} "
          "tokens, each against itself alone")  # fmt: skip
    print("| dtype | entry | mode | tokens match | log-probabilities match too | batch tok/s |")
    print("|---|---|---|---|---|---|")
    failed = False
    for dtype in args.dtype:
        model, tokenizer = load(args.checkpoint, dtype=getattr(torch, dtype))
        requests = prompts(args.checkpoint, tokenizer, args.requests)
        n, served = len(requests), []
        for invariant in (False, True):
            engine = Engine(model, tokenizer, compile=True, batch_invariant=invariant)
            tokens, logprobs = matches(engine, requests, args.new_tokens)
            mode = "batch-invariant" if invariant else "default"
            print(f"| {dtype} | Engine | {mode} | {tokens} of {n} | {logprobs} of {n} | |")
            failed |= invariant and logprobs < n
            served = engine.generate(requests, RequestParams(
                args.new_tokens, SamplingParams(temperature=0), ignore_eos=True))  # fmt: skip
        for invariant in (False, True):
            tokens, rows, speed = generate_matches(model, requests, args.new_tokens, invariant)
            mode = "batch-invariant" if invariant else "default"
            cell = "(none returned)"
            if invariant:
                same = sum(row == r + s.token_ids for row, r, s in zip(rows, requests, served, strict=True))  # fmt: skip
                cell += f"; {same} of {n} the engine's tokens"
                failed |= same < n
            print(f"| {dtype} | generate | {mode} | {tokens} of {n} | {cell} | {speed:.1f} |")
            failed |= invariant and tokens < n
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
