"""Which attention path is faster on this CPU: torch's fused SDPA kernel or our blockwise formula.

    python benchmarks/cpu_attention.py [--quick] [--threads N] [--repeats R] [--json PATH]

With the CPU paths applied (`decoderlm.cpu.optimize`), a model's attention with backend "sdpa" is
`decoderlm.cpu.attention.cpu_attend`, which sends a CPU call to `blockwise_attention` (the explicit
softmax(QKᵀ/√d + M)V a block of 128 queries at a time, causal blocks skipping the keys they cannot
see) when `blockwise_is_faster` says so, and to the model's `attend` (torch's SDPA) otherwise. This
prints the measurements behind that rule, for the shapes the library meets:

- train: forward + backward of a causal batch (B·H = 48 heads of dimension 32 at T = 64, the
  nanoGPT CPU recipe; the same number of tokens at T = 128 and 256);
- prefill: forward of one 512- or 2048-token causal prompt, 8 query heads sharing 2 K/V heads of
  dimension 64 (the llama-55m preset of benchmarks/decode.py), under inference_mode;
- decode: one query against a 256- or 2048-slot KV cache half filled (a key mask hides the empty
  slots, as `decoderlm.inference.generate` does with a static cache), under inference_mode;

each in float32 and bfloat16, eager and under torch.compile. Times are the best of --repeats
rounds (this CPU is shared), in milliseconds; "rule" is the path `blockwise_is_faster` picks.
--quick: the smallest shape of each kind, one round.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from decoderlm.cpu.attention import blockwise_attention, blockwise_is_faster
from decoderlm.cpu.features import has_native_bf16
from decoderlm.model.attention import attend

# (name, B, H, Hkv, Tq, Tk, head_dim, training)
SHAPES = [
    ("train T=64", 12, 4, 4, 64, 64, 32, True),
    ("train T=128", 6, 4, 4, 128, 128, 32, True),
    ("train T=256", 3, 4, 4, 256, 256, 32, True),
    ("prefill T=512", 1, 8, 2, 512, 512, 64, False),
    ("prefill T=2048", 1, 8, 2, 2048, 2048, 64, False),
    ("decode Tk=256", 1, 8, 2, 1, 256, 64, False),
    ("decode Tk=2048", 1, 8, 2, 1, 2048, 64, False),
    ("decode Tk=16384", 1, 8, 2, 1, 16384, 64, False),
]
DTYPES = (torch.float32, torch.bfloat16)


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    return attend(q, k, v, causal=True, key_padding_mask=mask)[0]  # the model's SDPA dispatch


def blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    return blockwise_attention(q, k, v, causal=mask is None, key_padding_mask=mask)


def best_ms(fn: Callable[[], object], repeats: int, budget_s: float = 0.2) -> float:
    fn()
    fn()  # warm-up (and compilation)
    start = time.perf_counter()
    fn()
    n = max(1, int(budget_s / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return 1e3 * best


def measure(shape: tuple, dtype: torch.dtype, repeats: int) -> dict:
    name, b, h, h_kv, t_q, t_k, d, training = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, t_q, d, generator=g).to(dtype).requires_grad_(training)
    k = torch.randn(b, h_kv, t_k, d, generator=g).to(dtype).requires_grad_(training)
    v = torch.randn(b, h_kv, t_k, d, generator=g).to(dtype).requires_grad_(training)
    d_out = torch.randn(b, h, t_q, d, generator=g).to(dtype)
    mask = None
    if t_q == 1:  # a half-filled static cache
        mask = torch.zeros(b, t_k, dtype=torch.bool)
        mask[:, : t_k // 2] = True
    row = {"shape": name, "dtype": str(dtype).removeprefix("torch.")}
    for compiled in (False, True):
        for path, fn in (("sdpa", fused), ("blockwise", blockwise)):
            run = torch.compile(fn, dynamic=False) if compiled else fn
            if training:

                def step(run=run) -> None:
                    run(q, k, v, mask).backward(d_out)

            else:

                def step(run=run) -> None:
                    with torch.inference_mode():
                        run(q, k, v, mask)

            row[f"{path}{' compiled' if compiled else ''}"] = best_ms(step, repeats)
        with torch.inference_mode(mode=not training):
            probe = q.detach().requires_grad_(training)
            rule = (
                torch.compile(blockwise_is_faster, fullgraph=True)
                if compiled
                else blockwise_is_faster
            )
            picks = rule(probe, t_k)
        row[f"rule{' compiled' if compiled else ''}"] = "blockwise" if picks else "sdpa"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kind, one round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shapes = SHAPES
    if args.quick:
        shapes = [s for s in SHAPES if s[0] in ("train T=64", "prefill T=512", "decode Tk=256")]
        args.repeats = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one graph per shape and dtype
    # Without native bf16 (AVX512-BF16/AMX), oneDNN's bf16 matmuls run at ~0.3 GFLOP/s: skip them.
    dtypes = DTYPES if has_native_bf16() else (torch.float32,)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, native bf16 "
        f"{has_native_bf16()}; ms, best of {args.repeats}"
    )
    print(
        "| shape | dtype | eager sdpa | eager blockwise | rule | compiled sdpa "
        "| compiled blockwise | rule |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            r = measure(shape, dtype, args.repeats)
            rows.append(r)
            print(
                f"| {r['shape']} | {r['dtype']} | {r['sdpa']:.2f} | {r['blockwise']:.2f} | "
                f"{r['rule']} | {r['sdpa compiled']:.2f} | {r['blockwise compiled']:.2f} | "
                f"{r['rule compiled']} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
