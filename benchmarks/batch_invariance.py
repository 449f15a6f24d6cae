"""How many concurrent greedy requests give the tokens they give alone: the engine by default and
with `batch_invariant=True`, on a real chat model.

N chat prompts ("Write two sentences about ...", each rendered by the model's own chat template)
decode --new-tokens greedy tokens each, all N submitted at once to `Engine(compile=True)`, then
each alone on the same engine; a request matches where its tokens (and, as a second count, its
log-probabilities) are the same both ways. Default mode: a row's sums change with the rows beside
it (the block kernels of a few rows against the integer tiles of many, a prompt's GEMM, Inductor's
fused norms), enough to flip greedy near-ties; batch-invariant mode: every reduction in one order
at every number of rows (`decoderlm.cpu.invariant`). Exits non-zero where a batch-invariant
request does not match.

    HF_HUB_OFFLINE=1 python benchmarks/batch_invariance.py [--checkpoint smollm2-135m-instruct]
        [--dtype bfloat16 float32] [--requests 32] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from decoderlm.chat_template import load_chat_template
from decoderlm.cpu.features import cpu_name
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
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
    print("| dtype | mode | tokens match | log-probabilities match too |")
    print("|---|---|---|---|")
    failed = False
    for dtype in args.dtype:
        model, tokenizer = load(args.checkpoint, dtype=getattr(torch, dtype))
        requests = prompts(args.checkpoint, tokenizer, args.requests)
        for invariant in (False, True):
            engine = Engine(model, tokenizer, compile=True, batch_invariant=invariant)
            tokens, logprobs = matches(engine, requests, args.new_tokens)
            mode = "batch-invariant" if invariant else "default"
            print(
                f"| {dtype} | {mode} | {tokens} of {len(requests)} | {logprobs} of {len(requests)} |"
            )
            failed |= invariant and logprobs < len(requests)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
