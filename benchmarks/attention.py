"""Attention benchmark: forward+backward time and peak extra memory of the three backends.

    python benchmarks/attention.py [--quick] [--out PNG] [--json PATH]

Backends, all called through `decoderlm.model.attention.attend` as the model calls them: `math` (our
explicit softmax(QKᵀ/√d + M)V, which materialises the (T, T) weights), `sdpa` (torch's fused
`scaled_dot_product_attention`) and `flash` (our FlashAttention-2 in PyTorch, `decoderlm.model.flash`).
Shapes: batch 1, 8 query heads sharing 2 K/V heads (GQA), head_dim 64, causal, T ∈ {512, …, 8192},
float32 and bfloat16. `math` is skipped where its (T, T) tensors would exceed --math-limit-gib.
The CPU paths of `decoderlm.cpu` are not applied here (benchmarks/cpu_attention.py measures them).

Time: one warm-up step, then the best of --repeats steps (forward, then backward of a fixed random
dO). The minimum, because this CPU is shared: it is the run least disturbed by other processes.
On a machine with more runnable threads than cores, prefer --threads 1: `flash` issues a few
thousand short tile ops per step and OpenMP workers spin-wait between them, so with several
threads it slows down far more than SDPA's single fused kernel (seen here at load ~4 on 2 cores:
`flash` 3–37 s per T = 4096 fp32 step, 1.2–2.3 s with OMP_WAIT_POLICY=passive, SDPA 1.1–1.2 s).

Peak extra memory: torch has no peak counter for CPU memory (torch.cuda.max_memory_allocated has
no CPU twin), so one more step runs under `torch.profiler.profile(profile_memory=True)`, which
records every allocation and free made while it is on as a "[memory]" event with its address and
signed size. Replaying those events in time order, counting each free only if its block was
allocated during the step (the previous step's gradients, freed as the step begins, are not), gives
the bytes held by tensors the step created — output, tensors saved for backward, temporaries, the
gradients dq, dk, dv; their maximum is the peak extra memory. Inputs and dO exist beforehand and are
not counted. It measures tensor bytes asked of the allocator, not the process's RSS, which also
moves with allocator caching and with what other libraries do.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from decoderlm.model.attention import attend

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 1, 8, 2, 64
SEQ_LENS = (512, 1024, 2048, 4096, 8192)
QUICK_SEQ_LENS = (256, 512)
BACKENDS = ("math", "sdpa", "flash")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MATH_TT_COPIES = 6  # the math path peaks at ~5.3 fp32 (B, H, T, T) tensors (measured, T = 4096)
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "attention.png"
MiB = 2**20


def make_inputs(t: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q (B, Hq, T, D), k, v (B, Hkv, T, D) requiring grad, and dO (B, Hq, T, D)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, Q_HEADS, t, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    k = torch.randn(BATCH, KV_HEADS, t, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    v = torch.randn(BATCH, KV_HEADS, t, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    d_out = torch.randn(BATCH, Q_HEADS, t, HEAD_DIM, generator=g).to(dtype)
    return q, k, v, d_out


def make_step(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor
) -> Callable[[], None]:
    """One forward+backward step; gradients are reset first so every step allocates them anew."""

    def step() -> None:
        q.grad = k.grad = v.grad = None
        out, _ = attend(q, k, v, causal=True, backend=backend)
        out.backward(d_out)

    return step


def best_time(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up: first-call dispatch, thread pool start, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def peak_extra_bytes(step: Callable[[], None]) -> int:
    """Peak of the running sum of allocations minus frees recorded by the profiler during `step`."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            events = json.load(f)["traceEvents"]
    memory = sorted(
        (
            (e["ts"], e["args"]["Bytes"], e["args"]["Addr"])
            for e in events
            if e.get("name") == "[memory]"
        ),
        key=lambda e: e[0],
    )
    live = peak = 0
    born: set[int] = set()  # addresses allocated during this step and not yet freed
    for _, size, addr in memory:
        if size > 0:
            born.add(addr)
        elif addr in born:
            born.remove(addr)
        else:  # a tensor from before the step (e.g. the last step's grads): not ours to count
            continue
        live += size
        peak = max(peak, live)
    return peak


def math_fits(t: int, limit_gib: float) -> bool:
    return MATH_TT_COPIES * BATCH * Q_HEADS * t * t * 4 <= limit_gib * 2**30


def run(
    seq_lens: tuple[int, ...], dtypes: list[str], repeats: int, math_limit_gib: float
) -> list[dict]:
    """Measure every (dtype, T, backend); print each row as it is measured."""
    rows = []
    for dtype_name in dtypes:
        for t in seq_lens:
            for backend in BACKENDS:
                if backend == "math" and not math_fits(t, math_limit_gib):
                    continue
                step = make_step(backend, *make_inputs(t, DTYPES[dtype_name]))
                seconds = best_time(step, repeats)
                peak = peak_extra_bytes(step)
                rows.append(
                    dict(dtype=dtype_name, T=t, backend=backend, seconds=seconds, peak=peak)
                )
                print(
                    f"  {dtype_name} T={t:5d} {backend:5s} {seconds:8.3f} s {peak / MiB:9.1f} MiB"
                )
    return rows


def format_table(rows: list[dict]) -> str:
    sdpa = {(r["dtype"], r["T"]): r for r in rows if r["backend"] == "sdpa"}
    lines = [
        f"{'dtype':5s} {'T':>5s} {'backend':7s} {'fwd+bwd s':>10s} {'peak MiB':>9s} "
        f"{'time/sdpa':>9s} {'mem/sdpa':>8s}"
    ]
    for r in rows:
        ref = sdpa.get((r["dtype"], r["T"]))
        time_ratio = f"{r['seconds'] / ref['seconds']:.2f}" if ref else "-"
        mem_ratio = f"{r['peak'] / ref['peak']:.2f}" if ref and ref["peak"] else "-"
        lines.append(
            f"{r['dtype']:5s} {r['T']:5d} {r['backend']:7s} {r['seconds']:10.3f} "
            f"{r['peak'] / MiB:9.1f} {time_ratio:>9s} {mem_ratio:>8s}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], dtypes: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(dtypes), 2, figsize=(11, 4 * len(dtypes)), squeeze=False)
    for (ax_time, ax_mem), dtype_name in zip(axes, dtypes, strict=True):
        for backend in BACKENDS:
            pts = [r for r in rows if r["dtype"] == dtype_name and r["backend"] == backend]
            if not pts:
                continue
            ts = [r["T"] for r in pts]
            ax_time.plot(ts, [r["seconds"] for r in pts], marker="o", label=backend)
            ax_mem.plot(ts, [r["peak"] / MiB for r in pts], marker="o", label=backend)
        for ax, ylabel in (
            (ax_time, "forward+backward time (s)"),
            (ax_mem, "peak extra memory (MiB)"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(ylabel)
            ax.set_title(
                f"{dtype_name}: B={BATCH}, Hq={Q_HEADS}, Hkv={KV_HEADS}, d={HEAD_DIM}, causal"
            )
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T in (256, 512), one timed step")
    parser.add_argument("--seq-lens", type=int, nargs="+", help=f"default {SEQ_LENS}")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=3, help="timed steps; the best is kept")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--math-limit-gib", type=float, default=4.0, help="skip math above this")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG plot path")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    seq_lens = tuple(args.seq_lens or (QUICK_SEQ_LENS if args.quick else SEQ_LENS))
    repeats = 1 if args.quick else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} (the CPU may be shared; times: best of {repeats})"
    )
    rows = run(seq_lens, args.dtypes, repeats, args.math_limit_gib)
    print(f"load average at the end {os.getloadavg()[0]:.1f}\n")
    print(format_table(rows))
    plot(rows, args.dtypes, args.out)
    print(f"\nplot: {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
        print(f"rows: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
