"""A prompt's causal self-attention: in bfloat16 the kernels of `decoderlm.cpu.bf16_attention` that
run here (AMX tiles, AVX512-BF16), in float32 that of `decoderlm.cpu.f32_attention` (this CPU's
build and, on an AVX-512 CPU, its AVX2 build), against torch's SDPA (the fused CPU
flash-attention kernel `cpu_attend` called before), per call.

    python benchmarks/prefill_attention.py [--dtype bfloat16|float32] [--heads 9 --kv-heads 3
        --head-dim 64] [--rounds 7]

Shapes: one prompt of T tokens (T = 93, 128, 512, 2,048; SDPA's call pads a length that is not a
multiple of 16 to the next one, as `cpu_attend` does, `padded_self_attention`), and a prefill
pass's 16 prompts of 100-130 tokens, one call each (the engine's pass of segments). Each cell: the
median over --rounds of the paths in turn (interleaved, so that the machine's drift falls on
both), of the mean of enough calls to fill ~0.1 s; and each path's largest error against float64.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from decoderlm.cpu import bf16_attention, f32_attention, features
from decoderlm.cpu.attention import padded_self_attention
from decoderlm.cpu.features import cpu_name

Inputs = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def mean_us(fn: Callable[[], object], budget_s: float = 0.1) -> float:
    fn()
    calls, begin = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - begin) < budget_s:
        fn()
        calls += 1
    return 1e6 * elapsed / calls


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return padded_self_attention(q, k, v, None)  # the fused kernel, at a multiple of 16


def float64_error(fn: Callable, inputs: Inputs) -> float:
    worst = 0.0
    for q, k, v in inputs:
        group = q.shape[1] // k.shape[1]
        k64, v64 = (x.double().repeat_interleave(group, 1) for x in (k, v))
        exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k64, v64, is_causal=True)  # fmt: skip
        worst = max(worst, (fn(q, k, v).double() - exact).abs().max().item())
    return worst


def kernels(dtype: torch.dtype) -> dict[str, Callable]:
    """The kernels to time against SDPA, by name (none where nothing runs here)."""
    if dtype == torch.bfloat16:
        names = bf16_attention.kernels()
        return {n: functools.partial(bf16_attention.attention, kernel_name=n) for n in names}
    builds = {"f32 kernel": ()}
    if "avx512f" in features.cpu_flags():
        builds["f32 kernel AVX2"] = features.ISA_CAPS["avx2"][1]
    found = {name: f32_attention.library(flags) for name, flags in builds.items()}
    return {
        name: lambda q, k, v, built=built: f32_attention.run(built, q, k, v, q.shape[-1] ** -0.5)
        for name, built in found.items()
        if built is not None
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    found = kernels(dtype)
    if not found:
        raise SystemExit(f"prefill_attention.py: no {args.dtype} kernel runs here (bfloat16: no AMX-BF16 or AVX512-BF16; or no C compiler)")  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def prompt(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(1, args.heads, t, args.head_dim, generator=g).to(dtype)
        k, v = (torch.randn(1, args.kv_heads, t, args.head_dim, generator=g).to(dtype) for _ in "kv")  # fmt: skip
        return q, k, v

    cases = {f"T = {t}": [prompt(t)] for t in (93, 128, 512, 2048)}
    cases["16 prompts of 100-130"] = [prompt(100 + (31 * i) // 16) for i in range(16)]
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, {args.heads} query / {args.kv_heads} K/V heads of "
          f"{args.head_dim}, {args.dtype}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    paths = {"SDPA": sdpa} | found
    print("| shape | " + " | ".join(f"{p} µs" for p in paths) + " | "
          + " | ".join(f"{k} ÷ SDPA" for k in found) + " | "
          + " | ".join(f"{p} max error" for p in paths) + " |")  # fmt: skip
    print("|---" * (2 * len(paths) + len(found) + 1) + "|")
    for name, inputs in cases.items():
        times: dict[str, list[float]] = {label: [] for label in paths}
        for _ in range(args.rounds):
            for label, fn in paths.items():
                times[label].append(mean_us(lambda fn=fn, inputs=inputs: [fn(*x) for x in inputs]))
        us = {label: statistics.median(t) for label, t in times.items()}
        errors = [float64_error(fn, inputs) for fn in paths.values()]
        cells = [f"{us[p]:,.0f}" for p in paths] + [f"{us[k] / us['SDPA']:.2f}×" for k in found]
        print(f"| {name} | " + " | ".join(cells + [f"{e:.1e}" for e in errors]) + " |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
