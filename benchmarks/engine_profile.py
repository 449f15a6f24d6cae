"""Where one serving-engine step goes: the time of each phase at 1, 16 and 64 running sequences.

The "llama-55m" preset (random weights, GQA-2), or the model --checkpoint names (a run, a Hugging
Face directory, a GGUF file or a model's name, e.g. smollm2-135m-instruct), in --dtype (bfloat16 where the CPU has native bf16,
float32 elsewhere), `Engine` stepped on this thread without HTTP. C requests of a --prompt-tokens
prompt each decode --new-tokens greedy tokens; only the steps in which every running sequence
decodes (no prefill chunk) are counted. Each phase is timed by wrapping the function that does it:

- schedule: `EngineCore.schedule` (the scheduler's plan, block allocation);
- inputs: `ModelRunner.forward` less the model: the step's tensors and `PagedKVCache.seek`
  (block tables, slots, masks);
- model: the forward pass itself (`DecoderLM.forward` over the paged cache, or the compiled
  pass's library);
- sample: `sampler.sample` (masks, greedy argmax or sampling, log-probs);
- output: `SequenceOutput.event` (detokenizing, stop strings, finish reasons);
- other: the rest of `Engine.step` (locks, the speed paths' context, bookkeeping, events).

Each is measured with the engine's decode pass eager and compiled (`Engine(compile=True)`,
`decoderlm.cpu.paged_step`; --compile off / on / both). TTFT p99: the first tokens of the C
requests, all submitted at once, from their submission (the scheduler's admission). The last
lines compare the engine's single stream with `generate(compile=True)` on the same weights, one
sequence (the engine's per-step costs beside the bare decode loop).

    HF_HUB_OFFLINE=1 python benchmarks/engine_profile.py [--concurrency 1 16 64] [--threads 2]
        [--compile both] [--checkpoint smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import decoderlm
from decoderlm import DecoderLM, ModelConfig, generate
from decoderlm.cpu.features import cpu_name, has_native_bf16
from decoderlm.engine import core as core_module
from decoderlm.engine import output as output_module
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

PHASES = ("schedule", "inputs", "model", "sample", "output", "other")


class Clock:
    """Seconds spent in each phase, and whether the step being timed is all decode."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - start

        return wrapper


def profile(engine: Engine, prompts: list[list[int]], params: RequestParams) -> dict[str, float]:
    """Milliseconds per all-decode step in each phase, the step's total, and tokens/s."""
    clock = Clock()
    core, runner, model = engine.core, engine.runner, engine.runner.model
    sample, event = core_module.sample, output_module.SequenceOutput.event
    core.schedule = clock.timed("schedule", core.schedule)  # instance attributes, deleted after
    runner.forward = clock.timed("run", runner.forward)
    model.forward = clock.timed("model", model.forward)
    compiled = getattr(runner, "step", None)  # the compiled decode pass, if any (its libraries)
    runs = {} if compiled is None else dict(compiled.runs)
    if compiled is not None:
        compiled.runs = {size: clock.timed("model", run) for size, run in runs.items()}
    core_module.sample = clock.timed("sample", sample)
    output_module.SequenceOutput.event = clock.timed("output", event)
    submitted, firsts = time.perf_counter(), {}  # request → the time of its first event
    for i, ids in enumerate(prompts):
        engine.submit(
            ids, params, on_event=lambda event, i=i: firsts.setdefault(i, time.perf_counter())
        )
    totals: dict[str, float] = defaultdict(float)
    steps = tokens = 0
    elapsed = 0.0
    try:
        while core.live:
            decoding = all(s.n_pending == 1 for s in core.scheduler.running) and not (
                core.scheduler.waiting
            )
            before = dict(clock.spent)
            generated = core.counters.generated
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            if decoding and core.scheduler.running:
                steps += 1
                elapsed += step
                tokens += core.counters.generated - generated
                for phase, spent in clock.spent.items():
                    totals[phase] += spent - before.get(phase, 0.0)
                totals["step"] += step
    finally:
        del core.schedule, runner.forward, model.forward  # the classes' methods again
        if compiled is not None:
            compiled.runs = runs
        core_module.sample, output_module.SequenceOutput.event = sample, event
    totals["inputs"] = totals["run"] - totals["model"]
    inside = sum(totals[p] for p in PHASES if p != "other")
    totals["other"] = totals["step"] - inside
    result = {phase: 1000 * totals[phase] / max(steps, 1) for phase in (*PHASES, "step")}
    result["tok_s"] = tokens / elapsed if elapsed else 0.0
    result["steps"] = steps
    waits = sorted(1000 * (t - submitted) for t in firsts.values())
    result["ttft_p99"] = waits[min(len(waits) - 1, int(0.99 * len(waits)))]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--checkpoint", help="a model to load instead of the random llama-55m")
    parser.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="both",
        help="the engine's compiled decode pass (Engine(compile=...)); both: a row each",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if has_native_bf16() else "float32")
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    if args.checkpoint:
        model, tokenizer = decoderlm.load(args.checkpoint, dtype=dtype)
        name = args.checkpoint
    else:
        config = ModelConfig.from_preset("llama-55m", n_kv_heads=2, context_length=1024)
        model = DecoderLM(config).eval().to(dtype)
        tokenizer = Tokenizer.train_char(
            ["".join(chr(0x4E00 + i) for i in range(config.vocab_size - 1))]
        )
        name = "llama-55m GQA-2"
    config = model.config
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, {name} {dtype_name}, prompt "
          f"{args.prompt_tokens}, {args.new_tokens} new tokens (greedy)")  # fmt: skip
    params = RequestParams(args.new_tokens, SamplingParams(temperature=0), ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    header = " | ".join(f"{p} ms (%)" for p in PHASES)
    print(f"| compiled | running | step ms | {header} | tok/s | TTFT p99 ms |")
    print("|---" * (len(PHASES) + 5) + "|")
    single: dict[bool, float] = {}
    for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
        for c in args.concurrency:
            start = time.perf_counter()
            on = {"compile": True} if compiled else {}  # (runs against an older engine too)
            engine = Engine(model, tokenizer, kv_cache_memory="1GiB", max_queue=max(64, c), **on)
            if compiled and c == args.concurrency[0]:
                print(f"(the compiled pass: {time.perf_counter() - start:.1f} s at the start)")
            warm = [torch.randint(0, config.vocab_size - 1, (16,), generator=g).tolist()]
            profile(engine, warm, RequestParams(4, SamplingParams(temperature=0)))  # first calls
            prompts = [
                torch.randint(0, config.vocab_size - 1, (args.prompt_tokens,), generator=g).tolist()
                for _ in range(c)
            ]
            r = profile(engine, prompts, params)
            cells = " | ".join(f"{r[p]:.2f} ({100 * r[p] / r['step']:.0f}%)" for p in PHASES)
            mode = "yes" if compiled else "no"
            print(
                f"| {mode} | {c} | {r['step']:.2f} | {cells} | {r['tok_s']:.0f} "
                f"| {r['ttft_p99']:.0f} |"
            )
            if c == 1:
                single[compiled] = r["tok_s"]
    prompt = torch.randint(0, config.vocab_size - 1, (1, args.prompt_tokens), generator=g)
    generate(model, prompt, 8, temperature=0, compile=True)  # compiles the step
    compiled_tok_s = 0.0
    for _ in range(3):  # the best of 3: the machine may be shared
        start = time.perf_counter()
        generate(model, prompt, args.new_tokens + 1, temperature=0, compile=True)
        with_prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(model, prompt, 1, temperature=0, compile=True)
        seconds = with_prefill - (time.perf_counter() - start)
        compiled_tok_s = max(compiled_tok_s, args.new_tokens / seconds)
    for compiled, tok_s in single.items():
        print(f"engine single stream{' compiled' if compiled else ''} {tok_s:.0f} tok/s = "
              f"{100 * tok_s / compiled_tok_s:.0f}% of generate(compile=True)'s "
              f"{compiled_tok_s:.0f} tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
