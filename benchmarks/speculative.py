"""Speculative decoding: decode tokens/s with and without it, greedy, on the CPU: at batch 1 in
`generate`, and with `--engine` through the serving engine at 1 and 16 streams.

Models (LLaMA-shaped, float32): a target of d_model 256, 4 layers, 4 heads sharing 2 K/V heads,
vocab 512, context 1024.

- input-grounded: a "source file" of 200 distinct random tokens; the target is the random-init
  model rewritten (`ground`, nothing trained) so that it continues the file as it was written: its
  greedy continuation of a prompt ending in the file's opening repeats the file, as an answer
  quoting code from its prompt does. The prompt: 40 random "instruction" tokens, the whole file,
  then its first 8 tokens again.
  - prompt lookup (`draft="prompt-lookup"`, K = --k);
  - a draft model: the target's first layer, its embeddings and head (fewer layers of the same
    config, weights copied), K = --k.
- worst case: the same target, a random prompt of the same length, prompt lookup: the target
  continues the file, which the prompt does not hold, so the lookup's proposals (what followed the
  last token in the random prompt) are rejected; `AdaptiveK`'s back-off keeps the cost of trying
  small (≥ 0.95× is the goal).

Each side is timed generating N and 1 new tokens, --runs times, plain and speculative interleaved;
decode tok/s = (N − 1) / (t(N) − t(1)), the prefill removed, from the fastest of each; speedup =
speculative / plain. Times are the process's CPU time (`time.process_time`) on one thread: on a
shared CPU, other jobs double the wall time of a run at random, not its CPU time (the same on an
idle machine). The outputs are checked to be equal first.

With `--engine`: the same cases through `Engine.generate` (continuous batching, one engine per
side, kept across runs), at 1 stream and at --streams streams; each stream's prompt has its own
random instruction and ends at its own place in the file (the worst case: its own random prompt),
and decode tok/s = streams · (N − 1) / (t(N) − t(1)); the speedup is the median over runs of each
run's ratio (both sides of a run see about the same load: steadier than the ratio of the fastest
on a CPU shared with other jobs).

With `--engine --model NAME|PATH` (a chat model: `smollm2-135m-instruct`, a GGUF file, a
directory), the model in bfloat16 is the target, both engines compiled (`Engine(compile=True)`),
and each stream asks it to edit a function of Python's standard library shown in its prompt
(`code_edit_requests`: rename an argument, drop the docstring, add a comment), rendered in its
chat template: prompt lookup, and a draft of the target's first --draft-layers layers (its
embeddings, final norm and head; nothing trained). Greedy outputs are counted equal to plain,
not asserted: a compiled pass of one row and one of several round differently (bfloat16), which
may turn a near tie.

    HF_HUB_OFFLINE=1 python benchmarks/speculative.py [--new-tokens 256] [--k 4] [--runs 9]
    HF_HUB_OFFLINE=1 python benchmarks/speculative.py --engine [--streams 16] [--new-tokens 64]
    HF_HUB_OFFLINE=1 python benchmarks/speculative.py --engine --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import heapq
import inspect
import shlex
import statistics
import textwrap
import time
from typing import Any

import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.chat_template import load_chat_template
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.generate import generate
from decoderlm.inference.options import float_probe
from decoderlm.inference.sampling import SamplingParams
from decoderlm.inference.speculative import SpeculativeStats
from decoderlm.loading import load, resolve_checkpoint
from decoderlm.tokenizer import Tokenizer

VOCAB = 512
FILE_TOKENS = 200  # the "source file": distinct random tokens


def config(n_layers: int = 4) -> ModelConfig:
    return ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=VOCAB,
        context_length=1024,
        d_model=256,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
    )


def ground(model: DecoderLM, file: torch.Tensor) -> DecoderLM:
    """The model rewritten (nothing trained) so that its greedy next token after each of the file's
    tokens is the one that follows it in the file: the token embeddings scaled ×10 dominate the
    random blocks' residual updates, and the head's row of token file[i + 1] is the direction of
    file[i]'s embedding (logit ≈ 4·|e| for the successor, ~N(0, 16) for the rest)."""
    with torch.no_grad():
        embeddings = model.tok_emb.weight.mul_(10)  # (V, d)
        rows = embeddings[file] / embeddings[file].norm(dim=1, keepdim=True)  # (F, d)
        model.head.weight[torch.roll(file, -1)] = 4 * rows
    return model


def shallow_draft(model: DecoderLM, n_layers: int) -> DecoderLM:
    """The target's first n_layers blocks with its embeddings, final norm and head: a draft of
    the same shape and dtype, nothing trained."""
    draft = DecoderLM(dataclasses.replace(model.config, n_layers=n_layers))
    draft.to(float_probe(model).dtype).eval()
    draft.load_state_dict({k: v for k, v in model.state_dict().items() if k in draft.state_dict()})
    return draft


EDITS = (
    "Rename the argument `self` to `this` in this Python function and show the whole function:",
    "Remove the docstring from this Python function and show the rest unchanged:",
    "Add a comment above the first line of this Python function and show the whole function:",
)


def code_edit_requests(n: int, seed: int) -> list[str]:
    """n user messages, each an edit of a function of Python's standard library (of 300-1,200
    characters, from a few modules: fixed for a Python version): the answer quotes the prompt,
    as prompt lookup expects."""
    functions = []
    for module in (heapq, shlex, statistics, textwrap):
        source = inspect.getsource(module)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                text = textwrap.dedent(ast.get_source_segment(source, node, padded=True))
                functions += [text] if 300 <= len(text) <= 1200 else []
    if n > len(functions):
        raise ValueError(f"{n} code edits asked for, of {len(functions)} functions")
    order = torch.randperm(len(functions), generator=torch.Generator().manual_seed(seed))
    return [
        f"{EDITS[i % len(EDITS)]}\n\n```python\n{functions[j]}\n```"
        for i, j in enumerate(order.tolist()[:n])
    ]


def seconds(model: DecoderLM, prompt: list[int], n: int, **kw: Any) -> float:
    """CPU time of this process for one greedy generation of n tokens (one thread)."""
    start = time.process_time()
    generate(model, [prompt], n, temperature=0, **kw)
    return time.process_time() - start


def compare(
    name: str, model: DecoderLM, prompt: list[int], draft: Any, args: argparse.Namespace
) -> dict[str, Any]:
    plain = generate(model, [prompt], args.new_tokens, temperature=0)
    stats = SpeculativeStats()
    fast = generate(
        model,
        [prompt],
        args.new_tokens,
        temperature=0,
        draft=draft,
        num_speculative_tokens=args.k,
        speculative_stats=stats,
    )
    assert fast == plain, f"{name}: speculative output differs from plain greedy"
    spec = dict(draft=draft, num_speculative_tokens=args.k)
    times: dict[str, list[float]] = {"plain 1": [], "plain N": [], "spec 1": [], "spec N": []}
    for _ in range(args.runs):  # interleaved: both sides see the same load
        for side, kw in (("plain", {}), ("spec", spec)):
            times[f"{side} 1"].append(seconds(model, prompt, 1, **kw))
            times[f"{side} N"].append(seconds(model, prompt, args.new_tokens, **kw))
    best = {key: min(values) for key, values in times.items()}
    rate = {
        side: (args.new_tokens - 1) / (best[f"{side} N"] - best[f"{side} 1"])
        for side in ("plain", "spec")
    }
    return {
        "case": name,
        "plain": rate["plain"],
        "spec": rate["spec"],
        "speedup": rate["spec"] / rate["plain"],
        "acceptance": stats.acceptance_rate,
        "mean_len": stats.mean_accepted_length,
        "tokens_per_step": (stats.tokens - 1) / max(stats.steps, 1),
    }


def grounded_prompt(file: torch.Tensor, at: int, g: torch.Generator) -> list[int]:
    """40 random "instruction" tokens, the whole file, then its 8 tokens from `at` again."""
    instruction = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    return instruction + file.tolist() + torch.roll(file, -at)[:8].tolist()


def engine_seconds(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """CPU time of this process for `engine` to generate n greedy tokens after each prompt."""
    params = RequestParams(n, SamplingParams(temperature=0), ignore_eos=True)
    start = time.process_time()
    engine.generate(prompts, params)
    return time.process_time() - start


def compare_engine(
    name: str,
    model: DecoderLM,
    prompts: list[list[int]] | list[str],
    draft: Any,
    args: argparse.Namespace,
    tokenizer: Tokenizer | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Decode tok/s of `prompts` as concurrent streams, plain and speculative, as `compare`;
    `options`: the engines' (a real model's `compile`), whose greedy outputs may then differ
    where a rounding turns a near tie (counted in "equal")."""
    if tokenizer is None:
        tokenizer = Tokenizer.train_char(["".join(chr(0x4E00 + i) for i in range(VOCAB - 1))])
    options = {"kv_cache_memory": "64MiB", **options}
    engines = {
        "plain": Engine(model, tokenizer, **options),
        "spec": Engine(model, tokenizer, **options, draft=draft, num_speculative_tokens=args.k),
    }
    params = RequestParams(args.new_tokens, SamplingParams(temperature=0), ignore_eos=True)
    outputs = {side: engine.generate(prompts, params) for side, engine in engines.items()}
    plain, fast = ([c.token_ids for c in outputs[side]] for side in ("plain", "spec"))
    equal = sum(map(list.__eq__, plain, fast))
    if not options.get("compile"):  # the same kernels for every pass: the same tokens
        assert fast == plain, f"{name}: speculative output differs from plain greedy"
    before = engines["spec"].stats()
    times: dict[str, list[float]] = {"plain 1": [], "plain N": [], "spec 1": [], "spec N": []}
    for _ in range(args.runs):  # interleaved: both sides see the same load
        for side, engine in engines.items():
            times[f"{side} 1"].append(engine_seconds(engine, prompts, 1))
            times[f"{side} N"].append(engine_seconds(engine, prompts, args.new_tokens))
    best = {key: min(values) for key, values in times.items()}
    rate = {
        side: len(prompts) * (args.new_tokens - 1) / (best[f"{side} N"] - best[f"{side} 1"])
        for side in engines
    }
    ratios = [  # each run's plain decode time / speculative decode time
        (pn - p1) / (sn - s1)
        for pn, p1, sn, s1 in zip(
            times["plain N"], times["plain 1"], times["spec N"], times["spec 1"], strict=True
        )
    ]
    stats = engines["spec"].stats()
    proposed = stats.speculative_proposed - before.speculative_proposed
    accepted = stats.speculative_accepted - before.speculative_accepted
    verifications = stats.speculative_verifications - before.speculative_verifications
    return {
        "case": f"{name}, {len(prompts)} stream{'s' if len(prompts) > 1 else ''}",
        "plain": rate["plain"],
        "spec": rate["spec"],
        "speedup": statistics.median(ratios),
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_len": accepted / verifications if verifications else 0.0,
        "equal": f"{equal} of {len(prompts)}",
    }


def engine_table(
    target: DecoderLM, file: torch.Tensor, g: torch.Generator, args: argparse.Namespace
) -> None:
    n = args.streams
    grounded = [grounded_prompt(file, 13 * i, g) for i in range(n)]
    length = len(grounded[0])
    random_prompts = [torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(n)]
    draft = shallow_draft(target, 1)
    print(
        f"target: {target.num_params() / 1e6:.1f}M parameters; prompts of {length} tokens, "
        f"{args.new_tokens} new tokens per stream, K = {args.k}, 1 thread, the engine"
    )
    cases = [
        ("prompt lookup, input-grounded", grounded, "prompt-lookup"),
        ("draft model (1 of 4 layers)", grounded, draft),
        ("worst case: prompt lookup", random_prompts, "prompt-lookup"),
    ]
    rows = [
        compare_engine(name, target, streams, proposer, args)
        for name, prompts, proposer in cases
        for streams in (prompts[:1], prompts)
    ]
    print_engine_rows(rows)


def real_model_table(args: argparse.Namespace) -> None:
    """--engine --model NAME|PATH: a chat model in bfloat16, its engines compiled, asked to edit
    code (`code_edit_requests`), by prompt lookup and by a draft of its first --draft-layers."""
    path = resolve_checkpoint(args.model)
    target, tokenizer = load(path, dtype=torch.bfloat16)
    template = load_chat_template(path)
    prompts = [  # as text, through the chat template, as a server renders a chat request
        template.render([{"role": "user", "content": m}])
        for m in code_edit_requests(args.streams, 0)
    ]
    layers = args.draft_layers
    print(
        f"target: {path.name} in bfloat16, {target.num_params() / 1e6:.1f}M parameters; code "
        f"edits of {min(map(len, prompts))}-{max(map(len, prompts))} characters in its chat "
        f"template, {args.new_tokens} new tokens per stream, K = {args.k}, 1 thread, the "
        "engine compiled"
    )
    cases = [
        ("prompt lookup, code edits", "prompt-lookup"),
        (
            f"draft model ({layers} of {target.config.n_layers} layers)",
            shallow_draft(target, layers),
        ),
    ]
    rows = [
        compare_engine(name, target, streams, proposer, args, tokenizer, compile=True)
        for name, proposer in cases
        for streams in (prompts[:1], prompts)
    ]
    print_engine_rows(rows)


def print_engine_rows(rows: list[dict[str, Any]]) -> None:
    print(
        "| case | plain tok/s | speculative tok/s | speedup | acceptance | mean accepted | "
        "outputs equal to plain |"
    )
    print("|" + "---|" * 7)
    for r in rows:
        print(
            f"| {r['case']} | {r['plain']:.0f} | {r['spec']:.0f} | {r['speedup']:.2f}× | "
            f"{r['acceptance']:.2f} | {r['mean_len']:.2f} | {r['equal']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256; 64 --engine")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--runs", type=int, default=None, help="default 9; 3 with --engine")
    parser.add_argument("--engine", action="store_true", help="through the serving engine")
    parser.add_argument("--streams", type=int, default=16, help="with --engine (default 16)")
    parser.add_argument(
        "--model",
        help="with --engine: a chat model (name, GGUF file or directory) in place of the toy target",
    )
    parser.add_argument("--draft-layers", type=int, default=8, help="with --model (default 8)")
    args = parser.parse_args()
    args.new_tokens = args.new_tokens or (64 if args.engine else 256)
    args.runs = args.runs or (3 if args.engine else 9)
    torch.set_num_threads(1)  # CPU time is the run's time only on one thread
    if args.engine and args.model:
        real_model_table(args)
        return
    g = torch.Generator().manual_seed(0)
    file = torch.randperm(VOCAB, generator=g)[:FILE_TOKENS]
    grounded = grounded_prompt(file, 0, g)
    random_prompt = torch.randint(0, VOCAB, (len(grounded),), generator=g).tolist()

    torch.manual_seed(0)
    target = ground(DecoderLM(config()).eval(), file)
    if args.engine:
        engine_table(target, file, g, args)
        return
    print(
        f"target: {target.num_params() / 1e6:.1f}M parameters; prompts of {len(grounded)} tokens, {args.new_tokens} new tokens, K = {args.k}, "
        "1 thread"
    )
    rows = [
        compare("prompt lookup, input-grounded", target, grounded, "prompt-lookup", args),
        compare("draft model (1 of 4 layers)", target, grounded, shallow_draft(target, 1), args),
        compare(
            "worst case: prompt lookup, random prompt", target, random_prompt, "prompt-lookup", args
        ),
    ]
    header = "| case | plain tok/s | speculative tok/s | speedup | acceptance | mean accepted | tokens/step |"
    print(header)
    print("|" + "---|" * 7)
    for r in rows:
        print(
            f"| {r['case']} | {r['plain']:.0f} | {r['spec']:.0f} | {r['speedup']:.2f}× | "
            f"{r['acceptance']:.2f} | {r['mean_len']:.2f} | {r['tokens_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
