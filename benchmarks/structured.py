"""What structured output costs the engine per step: the grammar's mask (xgrammar's bitmask fill
for each constrained sequence + applying it to the logits, `decoderlm.inference.structured.
mask_logits`) as a fraction of the engine step, at 1 / 8 / 16 running sequences.

A LLaMA-shaped model of ~55M parameters (preset "llama-55m", random init) with a byte-level BPE
tokenizer of --vocab tokens learned from this repository's text, so that the mask covers a real
vocabulary; every sequence samples a JSON array of long strings at temperature 1, which stays open
for all --steps decode steps. Each decode step is timed as a whole (`Engine.step`) and its
`mask_logits` call within it; the table shows medians over the decode steps (prefill steps left
out), the step of the same batch without a grammar, and the median mask over the fastest step
(a bound that holds when other work on a shared CPU slows the steps). Target: mask ≤ 5% of the
step.

    HF_HUB_OFFLINE=1 python benchmarks/structured.py [--vocab 8192] [--steps 32] [--threads N]
        [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.features import cpu_name
from decoderlm.engine import sampler
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference import structured
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

SCHEMA = {  # ≥ 20 strings of ≥ 5 characters: open for well over --steps tokens
    "type": "array",
    "items": {"type": "string", "minLength": 5, "maxLength": 40},
    "minItems": 20,
    "maxItems": 40,
}
ROOT = Path(__file__).resolve().parents[1]


def repo_text() -> list[str]:
    paths = sorted([*ROOT.glob("src/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"])
    return [p.read_text(encoding="utf-8") for p in paths]


def timed_steps(engine: Engine, n: int, spec: structured.StructuredOutput | None, steps: int):
    """(step seconds, mask seconds) of each decode step of n sequences."""
    masks: list[float] = []
    timed_mask = structured.mask_logits

    def mask_logits(logits, matchers):
        start = time.perf_counter()
        timed_mask(logits, matchers)
        masks.append(time.perf_counter() - start)

    sampler.mask_logits = mask_logits
    try:
        params = RequestParams(
            steps + 1, SamplingParams(temperature=1.0), seed=0, n=n, structured=spec
        )
        engine.submit("Answer in JSON:", params, on_event=lambda event: None)
        times = []
        while engine.core.scheduler.running or engine.core.scheduler.waiting:
            decoding = len(engine.core.scheduler.running) == n and all(
                len(s.tokens) > s.n_prompt for s in engine.core.scheduler.running
            )
            before = len(masks)
            start = time.perf_counter()
            engine.step()
            if decoding and len(engine.core.scheduler.running) == n:
                times.append((time.perf_counter() - start, sum(masks[before:])))
        return times
    finally:
        sampler.mask_logits = timed_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1024 tokens, 4 steps")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.steps = 1024, 4
    torch.set_num_threads(args.threads)
    tok = Tokenizer.train_bpe(repo_text(), vocab_size=args.vocab)
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_preset("llama-55m", vocab_size=tok.vocab_size)).eval()
    engine = Engine(model, tok, kv_cache_memory="512MiB", max_queue=64)
    spec = structured.StructuredOutput("json", SCHEMA)
    start = time.perf_counter()
    structured.compile_structured(tok, spec)
    compile_ms = (time.perf_counter() - start) * 1e3
    print(f"CPU: {cpu_name()} ({args.threads} threads), torch {torch.__version__}")
    print(
        f"llama-55m, byte-level BPE of {tok.vocab_size} tokens; "
        f"schema compiled in {compile_ms:.0f} ms (then cached)\n"
    )
    print(
        "| sequences | step, no grammar (ms) | step, JSON schema (ms) | mask (ms) | mask / step "
        "| mask / fastest step |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    timed_steps(engine, 16, spec, 4)  # warm-up: the linears' packing, the allocator
    for n in (1, 8, 16):
        free = timed_steps(engine, n, None, args.steps)
        constrained = timed_steps(engine, n, spec, args.steps)
        step = statistics.median(t for t, _ in constrained)
        mask = statistics.median(m for _, m in constrained)
        fraction = statistics.median(m / t for t, m in constrained)
        print(
            f"| {n} | {statistics.median(t for t, _ in free) * 1e3:.2f} | {step * 1e3:.2f} "
            f"| {mask * 1e3:.3f} | {fraction:.1%} | {mask / min(t for t, _ in constrained):.1%} |"
        )


if __name__ == "__main__":
    main()
