"""Decode and prefill speed on the CPU: decoderlm vs Hugging Face `transformers` on the same weights.

A LLaMA-shaped model of ~55M parameters (preset "llama-55m": d_model 512, 8 layers, 8 heads sharing
2 K/V heads, d_ff 1376, vocab 32000, untied), random init, converted to `LlamaForCausalLM` with
`decoderlm.hf.to_hf`; both models are checked to produce the same greedy tokens first.

- decode tok/s, batch 1: a 16-token prompt, N new tokens (greedy). Each side is timed generating
  N + 1 and 1 tokens; N / (t(N + 1) − t(1)) removes the prefill and per-call overheads. Medians
  of --runs runs, the two libraries interleaved so that both see the same load on a shared CPU;
  "× HF" is the median of the runs' ratios (each run times both sides back to back).
- prefill tok/s: a 512-token prompt, 512 / (time to the first new token). Ours runs with
  `compile=True` as for decoding: the prefill is compiled too (prompts left-padded to a multiple
  of 64), float32 linears calling oneDNN (see `decoderlm.cpu.decode.CPULinearKernels`).
- the memory-bandwidth floor: decoding one token reads every weight once, so it takes at least
  weight bytes / bandwidth. Two floors are shown:
  - the issue's: all the weights over the copy bandwidth (bytes read + written by a 256 MiB tensor
    copy, divided by its time);
  - the strict one: the weights read per token (the token-embedding table is only gathered from,
    one row per token) over the read bandwidth (a sum over the same 256 MiB). A stream that only
    reads runs faster than a copy, so a decoder at the memory limit beats the issue's floor.
  The copy and the sum are timed among the other runs, under the same load.

    HF_HUB_OFFLINE=1 python benchmarks/decode.py [--new-tokens 128] [--runs 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.features import has_native_bf16
from decoderlm.hf import to_hf
from decoderlm.inference.generate import generate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


COPY_BYTES = 256 * 2**20  # far larger than the last-level cache


def bandwidth_fns() -> tuple[Callable[[], object], Callable[[], object]]:
    """A large tensor copy (COPY_BYTES read and COPY_BYTES written) and a sum (COPY_BYTES read)."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), src.sum


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_times(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, list[float]]:
    """Seconds of each function in each run, interleaved run by run (after one warm-up call each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return times


def per_token(times: dict[str, list[float]], side: str, n: int) -> list[float]:
    """Decode tok/s of each run: n / (t(n + 1) − t(1))."""
    return [n / (tn - t1) for tn, t1 in zip(times[f"{side}_n"], times[f"{side}_1"], strict=True)]


def median_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median over runs of ours/theirs, each pair measured in the same run: the shared CPU's slow
    and fast spells move both sides of a pair together, where a ratio of medians mixes spells."""
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def build_models(preset: str) -> tuple[DecoderLM, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ours = DecoderLM(ModelConfig.from_preset(preset)).eval()
    hf_config, hf_state = to_hf(ours)
    hf_config.pop("architectures", None)
    theirs = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
    theirs.load_state_dict(hf_state)
    return ours, theirs


def hf_generate(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-55m")
    parser.add_argument("--new-tokens", type=int, default=128, help="decoded tokens per run")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=list(DTYPES), help="default: fp32, and bf16 where native"
    )
    args = parser.parse_args()
    # Without native bf16 (AVX512-BF16/AMX), oneDNN's bf16 matmuls run at ~0.3 GFLOP/s: a bf16
    # prefill of 512 tokens would take minutes.
    args.dtypes = args.dtypes or (list(DTYPES) if has_native_bf16() else ["fp32"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    ours, theirs = build_models(args.preset)
    g = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=g)
    long_prompt = torch.randint(0, vocab, (1, args.prefill_tokens), generator=g)
    same = generate(ours, prompt, 16, temperature=0)[0] == hf_generate(theirs, prompt, 16)
    copy, read = bandwidth_fns()
    n_params = ours.num_params()
    n_read = n_params - ours.tok_emb.weight.numel() + ours.config.d_model  # one embedding row

    n = args.new_tokens
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        ours.to(dtype)
        theirs.to(dtype)
        size = torch.empty((), dtype=dtype).element_size()

        def ours_fn(k: int, p: torch.Tensor = prompt, compile: bool = True) -> Callable[[], object]:
            return lambda: generate(ours, p, k, temperature=0, compile=compile)

        def hf_fn(k: int, p: torch.Tensor = prompt) -> Callable[[], object]:
            return lambda: hf_generate(theirs, p, k)

        times = run_times(
            {
                "hf_1": hf_fn(1),
                "hf_n": hf_fn(n + 1),
                "eager_1": ours_fn(1, compile=False),
                "eager_n": ours_fn(n + 1, compile=False),
                "ours_1": ours_fn(1),
                "ours_n": ours_fn(n + 1),
                "hf_prefill": hf_fn(1, long_prompt),
                "ours_prefill": ours_fn(1, long_prompt),
                "copy": copy,
                "read": read,
            },
            args.runs,
        )
        median = statistics.median
        bandwidth = 2 * COPY_BYTES / median(times["copy"])  # among the runs, under the same load
        read_bandwidth = COPY_BYTES / median(times["read"])
        hf, ours_decode = per_token(times, "hf", n), per_token(times, "ours", n)
        hf_prefill = [args.prefill_tokens / t for t in times["hf_prefill"]]
        ours_prefill = [args.prefill_tokens / t for t in times["ours_prefill"]]
        rows.append(
            {
                "dtype": name,
                "bandwidth": bandwidth,
                "read_bandwidth": read_bandwidth,
                "hf": median(hf),
                "eager": median(per_token(times, "eager", n)),
                "ours": median(ours_decode),
                "x_hf": median_ratio(ours_decode, hf),
                "floor_all": bandwidth / (n_params * size),
                "floor_strict": read_bandwidth / (n_read * size),
                "hf_prefill": median(hf_prefill),
                "ours_prefill": median(ours_prefill),
                "x_hf_prefill": median_ratio(ours_prefill, hf_prefill),
            }
        )

    print(
        f"{args.preset}: {n_params / 1e6:.1f}M parameters ({n_read / 1e6:.1f}M read per token), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {load_before:.1f} → {os.getloadavg()[0]:.1f}"
    )
    print(f"same greedy tokens as transformers: {'yes' if same else 'NO'}")
    print(
        f"decode: batch 1, {args.prompt_tokens}-token prompt, {n} new tokens, median of "
        f"{args.runs}; prefill: {args.prefill_tokens}-token prompt"
    )
    header = (
        "| dtype | HF decode tok/s | ours eager | ours compiled | × HF | floor tok/s (issue / "
        "strict) | % of floor (issue / strict) | copy / read GB/s | HF prefill tok/s | "
        "ours prefill | × HF |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['hf']:.1f} | {r['eager']:.1f} | {r['ours']:.1f} | "
            f"{r['x_hf']:.2f} | {r['floor_all']:.0f} / {r['floor_strict']:.0f} | "
            f"{100 * r['ours'] / r['floor_all']:.0f}% / "
            f"{100 * r['ours'] / r['floor_strict']:.0f}% | "
            f"{r['bandwidth'] / 1e9:.1f} / {r['read_bandwidth'] / 1e9:.1f} | "
            f"{r['hf_prefill']:.0f} | {r['ours_prefill']:.0f} | "
            f"{r['x_hf_prefill']:.2f} |"
        )


if __name__ == "__main__":
    main()
