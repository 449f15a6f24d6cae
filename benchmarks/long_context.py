"""Long context and quantization on the CPU: prefill, decode and peak memory at T = 4k-64k for full
and windowed attention over fp32 / bf16 / int8 KV caches; the same for attention, a Gated DeltaNet
hybrid and a pure Gated DeltaNet model; quality and speed of one trained model with fp32, bf16,
int8 and int4 weights.

    python benchmarks/long_context.py [--quick] [--json PATH] [--threads N]
        [--parts long quant hybrid] [--contexts 1024 4096 16384 32768] [--decode-steps 24]
        [--mixes attention "hybrid 3:1" "Gated DeltaNet"] [--hybrid-parts decode prefill]
        [--seq-lens 4096 16384 65536] [--window 1024] [--new-tokens 32] [--max-prefill-s 480]
        [--caches fp32 bf16 int8] [--checkpoint RUN [--eval-data DIR]] [--train-s 90] [--runs 3]

--quick (a smoke run): T = 1024 with window 512, 8 new tokens; 15 s of training, 8192 val tokens.

Part "long": preset "llama-55m" (d_model 512, 8 layers, 8 query heads sharing 2 K/V heads, vocab
32000), random init, context_length T + new tokens; a random T-token prompt, then --new-tokens
greedy tokens by `decoderlm.generate` (eager: compile=False, which int8 caches need). Attention
"full": backend sdpa (torch's fused causal kernel, no (T, T) tensor); "window": sliding_window
--window with backend flash (`decoderlm.model.flash`, which skips the key tiles outside the
window). Cache: fp32 and bf16 are the model's dtype (the cache follows it); int8 is
kv_cache_dtype="int8" on the bf16 model (on fp32 where the CPU has no native bf16; bf16 rows are
then left out, as oneDNN's bf16 fallback would take hours). A combination that generate refuses is
printed as n/a with the library's message.

Columns: prefill s, from the call to the end of the first forward pass (a forward hook), and
prefill tok/s = T / that; decode tok/s = (forward passes − 1) / (time from the end of the first to
the end of the last), every one-token step with its sampling; "× full": the same cache with full
attention at the same T; "× fp32": the same attention with the fp32 cache at the same T. KV cache:
the class and the bytes (`nbytes`) of the cache object generate hands the model (a forward
pre-hook): the StaticKVCache of T + n slots for full attention (int8 storage for int8; tables
from before the cache package name that case Int8KVCache), the RingKVCache of W slots for a
window. Peak RSS: the process's resident-set high-water mark during the generate call;
"added": peak − the RSS just before it, which already holds torch, the weights and the prompt.

Memory: each configuration runs in a fresh interpreter (this script with a hidden --one), so peaks
do not mix, and after a short warm-up generate the kernel's high-water mark is reset to the current
RSS ("5" > /proc/self/clear_refs, Linux ≥ 4.0; "?" where that fails). RSS counts what the allocator
keeps as well as live tensors; torch's memory profiler would count tensors only, but records an
event per allocation, hundreds of thousands in a 64k flash prefill.

Time limit: a full-attention prefill grows as T², a windowed one as T. A configuration is skipped
when its prefill, extrapolated so from the same configuration at the previous T of this run, would
exceed --max-prefill-s (0: run all). With the default the 64k fp32 full prefill (about a quarter
of an hour on 2 shared cores) is skipped, so that the run fits in about 20 minutes.

Part "hybrid": the same shape (random init, fp32) with three mixes of layers (`layer_types`):
"attention" (every layer), "hybrid 3:1" (Gated DeltaNet in three of every four layers, attention in
the fourth, Qwen3-Next's ratio) and "Gated DeltaNet" (every layer; GDN heads = the 8 query heads,
d_k = d_v = head_dim 64). Decode: ms per one-token step at --contexts tokens of context, each mix
in its own fresh process: the model's eager forward (`last_only`, then the argmax, as a greedy
step of generate) over the cache `make_cache` builds, seeked to that many tokens already held —
no prefill of them: their K/V values (zeros) and the recurrent state do not change a step's work,
and prefilling 32k tokens of attention would take minutes; median of --decode-steps steps after 2
warm-up steps, the contexts interleaved step by step (one step at each in turn), "÷ 1k" the ratio
to the same mix at the first context. Prefill: as part "long"
(generate with a T-token prompt and --new-tokens tokens, fresh process per row, peak RSS) at
--seq-lens; the cache column is the bytes of the model's cache (KV buffers of T + n slots in the
attention layers, the fixed conv and matrix states in the recurrent ones). A row is skipped when
its prefill, extrapolated from the same mix at the smaller T of this run (t = aT + bT² through two
points, t ∝ T² from one with attention, t ∝ T without), would exceed --max-prefill-s.

Part "quant": one trained model, by default a char-level Llama on Tiny Shakespeare
(../shared/data/tinyshakespeare.txt; last 10% = val split) trained --train-s seconds by
`decoderlm.training.trainer.train`, or --checkpoint RUN (its val split: --eval-data DIR, else the
data directory its trainer state recorded). Rows: fp32 weights; bf16 (where native); bf16 weights
under fp32 activations; int8 and
int4 (group 64) from `decoderlm.quant.quantize` (activations in --quant-dtype); fp32 weights over
an int8 KV cache. Columns: weight MiB (parameters and buffers), val loss and perplexity over the
first --eval-tokens of the val split (`evaluate_tokens`: non-overlapping windows of the model's
context), Δ ppl against fp32, decode tok/s at batch B = 1 and 16 (prompts of --prompt-tokens val
tokens, N = --quant-new-tokens greedy tokens per row, B·N / (t(N + 1) − t(1)) as in
benchmarks/decode.py: the tokens of all rows, median of --runs runs interleaved across the rows),
"× fp32" the median of the runs' ratios to the fp32 row, and "greedy = fp32": the mean over the
16 rows of the share of the N tokens generated before the first that differs from fp32's.

The CPU is shared: the load average is printed with each table. On an oversubscribed CPU prefer
--threads 1 (OpenMP workers spin-wait for each other; see benchmarks/attention.py).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from decode import median_ratio, per_token, run_times
from shakespeare_char import DEFAULT_DATA

from decoderlm import (
    DecoderLM,
    DecoderLMError,
    ModelConfig,
    checkpoint,
    data,
    generate,
    load,
    trainer_state,
)
from decoderlm.cpu.features import cpu_name, has_native_bf16
from decoderlm.inference.evaluate import evaluate_tokens
from decoderlm.model.cache import CacheStep, make_cache
from decoderlm.quant import quantize
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.trainer import train

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CACHES = ("fp32", "bf16", "int8")
ATTENTIONS = ("full", "window")
SEQ_LENS = (4096, 16384, 65536)
QUICK_SEQ_LENS = (1024,)
CONTEXTS = (1024, 4096, 16384, 32768)  # part "hybrid": decode at these contexts
QUICK_CONTEXTS = (256, 1024)
MIXES = ("attention", "hybrid 3:1", "Gated DeltaNet")  # part "hybrid": the layers' mixers
WARMUP_TOKENS = 64  # prompt of the warm-up generate before each measured one
RESULT = "RESULT "  # prefix of the line a --one child prints its measurement on
MiB = 2**20


def header(title: str) -> None:
    """What the figures depend on, above each table."""
    print(
        f"\n## {title}\n\n{cpu_name()}, torch {torch.__version__}, native bf16 "
        f"{has_native_bf16()}, {torch.get_num_threads()} thread(s), load average "
        f"{os.getloadavg()[0]:.1f}\n"
    )


def print_table(columns: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}"


# --- part "long": one configuration per process ---------------------------------------------


def rss_status(field: str) -> int | None:
    """VmRSS or VmHWM (the high-water mark) of this process in bytes, from /proc/self/status."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Set the kernel's RSS high-water mark to the current RSS (Linux ≥ 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class ForwardLog:
    """End time of each forward pass of a model, and the KV cache the first one was given."""

    def __init__(self, model: DecoderLM) -> None:
        self.ends: list[float] = []
        self.cache: Any = None
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after)

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.cache is None:  # DecoderLM.forward(idx, positions, key_padding_mask, kv_caches)
            self.cache = args[3] if len(args) > 3 else kwargs.get("kv_caches")

    def _after(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.ends.append(time.perf_counter())


def layer_types(mix: str, n_layers: int) -> tuple[str, ...] | None:
    """A mix of MIXES as `ModelConfig.layer_types` for n_layers layers (None: attention only)."""
    if mix == "attention":
        return None
    if mix == "Gated DeltaNet":
        return ("gdn",) * n_layers
    return tuple("attention" if i % 4 == 3 else "gdn" for i in range(n_layers))  # 3:1


def long_config(
    preset: str, t: int, new_tokens: int, attention: str, window: int, mix: str = "attention"
) -> ModelConfig:
    windowed = attention == "window"
    n_layers = ModelConfig.from_preset(preset).n_layers
    return ModelConfig.from_preset(
        preset,
        context_length=t + new_tokens,
        sliding_window=window if windowed else None,
        attn_backend="flash" if windowed else "sdpa",
        layer_types=layer_types(mix, n_layers),
    )


def measure_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Prefill and decode one configuration in this process: times, cache, peak RSS."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if "contexts" in spec:
        return measure_decode(spec)
    t, n = spec["T"], spec["new_tokens"]
    mix = spec.get("mix", "attention")
    cfg = long_config(spec["preset"], t, n, spec["attention"], spec["window"], mix)
    torch.manual_seed(0)
    model = DecoderLM(cfg).to(DTYPES[spec["model_dtype"]]).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (t,), generator=g).tolist()
    kv_cache_dtype = "int8" if spec["cache"] == "int8" else None
    try:  # a combination generate does not support (yet) raises here, in the warm-up
        generate(model, [prompt[:WARMUP_TOKENS]], 2, temperature=0, kv_cache_dtype=kv_cache_dtype)
    except DecoderLMError as exc:
        return {"error": str(exc)}
    log = ForwardLog(model)
    reset = reset_peak_rss()
    before = rss_status("VmRSS")
    start = time.perf_counter()
    generate(model, [prompt], n, temperature=0, kv_cache_dtype=kv_cache_dtype)
    peak = rss_status("VmHWM") if reset else None
    first, last = log.ends[0], log.ends[-1]
    return {
        "prefill_s": first - start,
        "decode_tok_s": (len(log.ends) - 1) / (last - first),
        "cache_class": type(log.cache).__name__,
        "cache_bytes": getattr(log.cache, "nbytes", None),
        "peak_rss": peak,
        "added_rss": None if peak is None or before is None else peak - before,
    }


@torch.no_grad()
def measure_decode(spec: dict[str, Any]) -> dict[str, Any]:
    """ms per greedy one-token step of the mix at each context of spec["contexts"] (this process),
    the contexts interleaved step by step, so that a change in the machine's load reaches all."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    steps, contexts = spec["decode_steps"], spec["contexts"]
    cfg = long_config(spec["preset"], max(contexts), steps + 2, "full", 0, spec["mix"])
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    caches = {c: make_cache(cfg, 1, c + steps + 2) for c in contexts}
    tokens = {c: torch.zeros(1, 1, dtype=torch.long) for c in contexts}  # (B, 1) each
    times: dict[int, list[float]] = {c: [] for c in contexts}
    for i in range(steps + 2):  # the first 2 rounds: warm-up
        for c in contexts:
            caches[c].seek(CacheStep.span(c + i, 1, "cpu"))  # c tokens held before the first step
            start = time.perf_counter()
            logits = model(tokens[c], torch.tensor([c + i]), None, caches[c], last_only=True)
            tokens[c] = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            times[c].append(time.perf_counter() - start)
    ms = {c: 1000 * statistics.median(times[c][2:]) for c in contexts}
    return {"ms": ms, "params": model.num_params()}


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """`measure_one(spec)` in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"failed (exit {done.returncode}): {tail}"}
    return json.loads(lines[-1].removeprefix(RESULT))


def model_dtype_of(cache: str) -> str:
    """The model's dtype for a cache row: the cache's own, or for int8 bf16 where native."""
    if cache == "int8":
        return "bf16" if has_native_bf16() else "fp32"
    return cache


def estimate_prefill_s(done: list[dict], row: dict) -> float | None:
    """The prefill time of `row` extrapolated from the same configuration at the largest smaller
    T measured: × (T/T₀)² for full attention, × T/T₀ for a window."""
    earlier = [
        r
        for r in done
        if (r["attention"], r["cache"]) == (row["attention"], row["cache"])
        and r.get("prefill_s") is not None
    ]
    if not earlier:
        return None
    last = max(earlier, key=lambda r: r["T"])
    power = 2 if row["attention"] == "full" else 1
    return last["prefill_s"] * (row["T"] / last["T"]) ** power


def long_part(args: argparse.Namespace) -> list[dict]:
    caches = [c for c in args.caches if c != "bf16" or has_native_bf16()]
    header(
        f"Long context: {args.preset}, window {args.window}, {args.new_tokens} new tokens, "
        "batch 1, one fresh process per row"
    )
    rows: list[dict] = []
    for t, attention, cache in itertools.product(args.seq_lens, ATTENTIONS, caches):
        row = {"T": t, "attention": attention, "cache": cache, "model_dtype": model_dtype_of(cache)}
        estimate = estimate_prefill_s(rows, row)
        if args.max_prefill_s and estimate is not None and estimate > args.max_prefill_s:
            row["error"] = f"skipped: prefill est. {estimate:.0f} s > --max-prefill-s"
        else:
            spec = {
                **row,
                "preset": args.preset,
                "window": args.window,
                "new_tokens": args.new_tokens,
                "threads": args.threads,
            }
            row.update(run_one(spec))
        rows.append(row)
        print(f"  {t:6d} {attention:6s} {cache:4s} " + json.dumps(row), flush=True)
    print(f"  load average at the end {os.getloadavg()[0]:.1f}\n")
    print_long_table(rows)
    return rows


def print_long_table(rows: list[dict]) -> None:
    measured = [r for r in rows if "error" not in r]

    def peer(r: dict, **changes: str) -> dict:
        """The measured row of r's T with r's attention and cache, but for `changes`."""
        want = {"T": r["T"], "attention": r["attention"], "cache": r["cache"], **changes}
        return next((p for p in measured if all(p[k] == v for k, v in want.items())), {})

    def prefill_rate(r: dict) -> float | None:
        return r["T"] / r["prefill_s"] if r else None

    def mib(x: int | None) -> str:
        return "?" if x is None else f"{x / MiB:,.0f}"

    table = []
    for r in rows:
        cells = [f"{r['T']:,}", r["attention"], r["cache"], r["model_dtype"]]
        if "error" in r:
            table.append([*cells, f"n/a ({r['error']})", *[""] * 9])
            continue
        full = {} if r["attention"] == "full" else peer(r, attention="full")
        fp32 = {} if r["cache"] == "fp32" else peer(r, cache="fp32")
        table.append(
            [
                *cells,
                f"{r['prefill_s']:.1f}",
                f"{prefill_rate(r):,.0f}",
                ratio(prefill_rate(r), prefill_rate(full)),
                ratio(prefill_rate(r), prefill_rate(fp32)),
                f"{r['decode_tok_s']:.1f}",
                ratio(r["decode_tok_s"], full.get("decode_tok_s")),
                ratio(r["decode_tok_s"], fp32.get("decode_tok_s")),
                f"{r['cache_class']} {mib(r['cache_bytes'])}",
                mib(r["peak_rss"]),
                mib(r["added_rss"]),
            ]
        )
    print_table(
        [
            "T",
            "attention",
            "cache",
            "model",
            "prefill s",
            "prefill tok/s",
            "× full",
            "× fp32",
            "decode tok/s",
            "× full",
            "× fp32",
            "KV cache MiB",
            "peak RSS MiB",
            "added MiB",
        ],
        table,
    )


# --- part "hybrid": attention, a Gated DeltaNet hybrid and pure Gated DeltaNet ---------------


def estimate_mix_prefill_s(done: list[dict], mix: str, t: int) -> float | None:
    """The mix's prefill time at T from its rows measured so far: t = aT + bT² (b ≥ 0) through the
    last two, else ∝ T² (with attention layers) or ∝ T (without) from one."""
    points = [(r["T"], r["prefill_s"]) for r in done if r["mix"] == mix and "prefill_s" in r]
    if not points:
        return None
    if len(points) == 1:
        (t0, s0), power = points[0], 1 if mix == "Gated DeltaNet" else 2
        return s0 * (t / t0) ** power
    (t1, s1), (t2, s2) = points[-2:]
    # s = a·T + b·T² through (t1, s1), (t2, s2): s/T = a + b·T is a line in T
    b = max(0.0, (s2 / t2 - s1 / t1) / (t2 - t1))
    a = s2 / t2 - b * t2
    return max(a * t + b * t * t, s2 * t / t2)


def hybrid_part(args: argparse.Namespace) -> dict:
    header(
        f"Recurrent and hybrid layers: {args.preset} shape, fp32, batch 1, random init, "
        "one fresh process per row"
    )
    base = {"preset": args.preset, "threads": args.threads, "attention": "full", "window": 0}
    decode = {}
    for mix in args.mixes if "decode" in args.hybrid_parts else ():
        spec = {**base, "mix": mix, "contexts": args.contexts, "decode_steps": args.decode_steps}
        decode[mix] = run_one(spec)
        print(f"  decode {mix}: " + json.dumps(decode[mix]), flush=True)
    prefill: list[dict] = []
    lengths = args.seq_lens if "prefill" in args.hybrid_parts else ()
    for t, mix in itertools.product(lengths, args.mixes):
        row = {"T": t, "mix": mix, "model_dtype": "fp32", "cache": "fp32"}
        estimate = estimate_mix_prefill_s(prefill, mix, t)
        if args.max_prefill_s and estimate is not None and estimate > args.max_prefill_s:
            row["error"] = f"skipped: prefill est. {estimate:.0f} s > --max-prefill-s"
        else:
            row.update(run_one({**base, **row, "new_tokens": args.new_tokens}))
        prefill.append(row)
        print(f"  prefill {t:6d} {mix}: " + json.dumps(row), flush=True)
    print(f"  load average at the end {os.getloadavg()[0]:.1f}\n")
    print_decode_table(decode, args.contexts)
    print()
    print_prefill_table(prefill)
    return {"decode": decode, "prefill": prefill}


def print_decode_table(decode: dict[str, dict], contexts: list[int]) -> None:
    columns = ["mix", "params"] + [f"ms/token at {c:,}" for c in contexts]
    columns += [f"{contexts[-1]:,} ÷ {contexts[0]:,}"]
    rows = []
    for mix, r in decode.items():
        if "error" in r:
            rows.append([mix, f"n/a ({r['error']})", *[""] * len(contexts)])
            continue
        ms = {int(c): v for c, v in r["ms"].items()}  # JSON keys are strings
        cells = [mix, f"{r['params'] / 1e6:.1f}M", *(f"{ms[c]:.1f}" for c in contexts)]
        rows.append([*cells, f"{ms[contexts[-1]] / ms[contexts[0]]:.2f}"])
    print_table(columns, rows)


def print_prefill_table(rows: list[dict]) -> None:
    def mib(x: int | None) -> str:
        return "?" if x is None else f"{x / MiB:,.0f}"

    table = []
    for r in rows:
        if "error" in r:
            table.append([f"{r['T']:,}", r["mix"], f"n/a ({r['error']})", *[""] * 5])
            continue
        full = next(
            (p for p in rows if (p["T"], p["mix"]) == (r["T"], "attention") and "error" not in p),
            {},
        )
        table.append(
            [
                f"{r['T']:,}",
                r["mix"],
                f"{r['prefill_s']:.1f}",
                f"{r['T'] / r['prefill_s']:,.0f}",
                "—" if r["mix"] == "attention" else ratio(full.get("prefill_s"), r["prefill_s"]),
                f"{r['cache_class']} {r['cache_bytes'] / MiB:,.1f}",
                mib(r["peak_rss"]),
                mib(r["added_rss"]),
            ]
        )
    columns = ["T", "mix", "prefill s", "prefill tok/s", "× attention (speed)", "cache MiB"]
    print_table([*columns, "peak RSS MiB", "added MiB"], table)


# --- part "quant": one trained model, float and quantized -----------------------------------


def char_model(vocab_size: int) -> ModelConfig:
    """A Llama of ~0.8M parameters (the shape of shakespeare_char.py's recipe; d_ff a multiple of
    64 so that int4 groups of 64 divide every linear layer's inputs)."""
    return ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=vocab_size,
        context_length=128,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=384,
        tie_embeddings=True,
    )


def trained_run(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path, str]:
    """(run directory, data directory of its val split, description)."""
    if args.checkpoint is not None:
        if args.eval_data is not None:
            return args.checkpoint, args.eval_data, f"--checkpoint {args.checkpoint}"
        latest = checkpoint.latest_checkpoint(args.checkpoint)
        if latest is None:
            raise DecoderLMError(f"{args.checkpoint} has no checkpoint: give --eval-data DIR")
        data_dir = Path(trainer_state.load_trainer_state(latest)["data_dir"])
        return args.checkpoint, data_dir, f"--checkpoint {args.checkpoint}"
    data_dir = tmp / "data"
    data.prepare([args.data], data_dir, tokenizer="char", val_fraction=0.1, progress=False)
    cfg = TrainConfig(
        batch_size=32,
        lr=5e-3,
        min_lr=5e-4,
        warmup_steps=50,
        max_time=args.train_s,
        eval_interval=10**9,
        checkpoint_interval=0,
        log_interval=50,
        threads=args.threads or torch.get_num_threads(),
    )
    summary = train(
        char_model(data.read_meta(data_dir)["vocab_size"]),
        cfg,
        data_dir,
        tmp / "run",
        progress=False,
    )
    about = (
        f"char Llama, {summary['parameters'] / 1e6:.2f}M parameters, {summary['step']} steps "
        f"in {args.train_s:.0f} s"
    )
    return tmp / "run", data_dir, about


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))


def variants(base: DecoderLM, args: argparse.Namespace) -> dict[str, tuple[DecoderLM, str | None]]:
    """name → (model, kv_cache_dtype): the float model, its bf16 and bf16-weights copies,
    int8/int4 copies."""
    quant_dtype = DTYPES[args.quant_dtype]
    rows = {"fp32": (base, None)}
    if has_native_bf16():
        rows["bf16"] = (copy.deepcopy(base).to(torch.bfloat16), None)
    rows["bf16 weights"] = (quantize(copy.deepcopy(base), to="bf16"), None)  # fp32 activations
    rows["int8"] = (quantize(copy.deepcopy(base), to="int8").to(quant_dtype), None)
    int4 = quantize(copy.deepcopy(base), to="int4", group_size=args.group_size)
    rows[f"int4 (group {args.group_size})"] = (int4.to(quant_dtype), None)
    rows["fp32 + int8 KV cache"] = (base, "int8")
    return rows


def greedy_agreement(ours: list[list[int]], ref: list[list[int]], n: int) -> float:
    """Mean over rows of the share of the last n tokens before the first that differs from ref."""
    shares = []
    for a, b in zip(ours, ref, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a[-n:], b[-n:], strict=True)) if x != y), n)
        shares.append(same / n)
    return statistics.fmean(shares)


def quant_part(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        run, data_dir, about = trained_run(args, Path(tmp))
        base, _ = load(run)
        val = np.array(data.load_split(data_dir, "val")[: args.eval_tokens], dtype=np.int64)
    models = variants(base, args)
    n, p = args.quant_new_tokens, args.prompt_tokens
    prompts = {b: [val[i * p : (i + 1) * p].tolist() for i in range(b)] for b in (1, 16)}
    rows, ref = [], None
    for name, (model, kv) in models.items():
        result = evaluate_tokens(model, val, kv_cache_dtype=kv)
        out = generate(model, prompts[16], n, temperature=0, kv_cache_dtype=kv)
        ref = ref or out  # the first row's: fp32
        rows.append(
            {
                "weights": name,
                "weight_bytes": weight_bytes(model),
                "val_loss": result.loss,
                "perplexity": result.perplexity,
                "greedy_agreement": greedy_agreement(out, ref, n),
            }
        )
    header(
        f"Quantization: {about}; val split {len(val):,} tokens; decode {p}-token prompts, "
        f"{n} new tokens, median of {args.runs}"
    )
    fns: dict[str, Callable[[], object]] = {}
    for (name, (model, kv)), b, k in itertools.product(models.items(), prompts, (1, n + 1)):
        fns[f"{name} B={b}_{'1' if k == 1 else 'n'}"] = lambda m=model, kv=kv, b=b, k=k: generate(
            m, prompts[b], k, temperature=0, kv_cache_dtype=kv
        )
    times = run_times(fns, args.runs)
    for row, b in itertools.product(rows, prompts):
        tok_s = per_token(times, f"{row['weights']} B={b}", b * n)  # tokens of all b rows
        row[f"decode_b{b}"] = statistics.median(tok_s)
        row[f"x_fp32_b{b}"] = median_ratio(tok_s, per_token(times, f"fp32 B={b}", b * n))
    print_quant_table(rows)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return {"model": about, "rows": rows}


def print_quant_table(rows: list[dict]) -> None:
    fp32_ppl = rows[0]["perplexity"]
    columns = ["weights", "weight MiB", "val loss", "perplexity", "Δ ppl"]
    columns += ["decode tok/s B=1", "× fp32", "decode tok/s B=16", "× fp32", "greedy = fp32"]
    print_table(
        columns,
        [
            [
                r["weights"],
                f"{r['weight_bytes'] / MiB:.2f}",
                f"{r['val_loss']:.4f}",
                f"{r['perplexity']:.3f}",
                f"{r['perplexity'] - fp32_ppl:+.3f}",
                f"{r['decode_b1']:.0f}",
                f"{r['x_fp32_b1']:.2f}",
                f"{r['decode_b16']:.0f}",
                f"{r['x_fp32_b16']:.2f}",
                f"{100 * r['greedy_agreement']:.0f}%",
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (≤ 2 minutes)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--parts", nargs="+", choices=("long", "quant", "hybrid"), default=["long", "quant"]
    )
    parser.add_argument("--preset", default="llama-55m", help="part long: the model shape")
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", help=f"prompt lengths, default {SEQ_LENS}"
    )
    parser.add_argument("--window", type=int, help="sliding window (default 1024; quick 512)")
    parser.add_argument("--new-tokens", type=int, help="part long: decoded tokens (32; quick 8)")
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    parser.add_argument(
        "--contexts", type=int, nargs="+", help=f"part hybrid: decode contexts, default {CONTEXTS}"
    )
    parser.add_argument("--decode-steps", type=int, default=24, help="part hybrid: timed steps")
    parser.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    parser.add_argument(
        "--hybrid-parts", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"]
    )
    parser.add_argument(
        "--max-prefill-s", type=float, default=480.0, help="skip longer prefills (0: none)"
    )
    parser.add_argument("--checkpoint", type=Path, help="part quant: a run instead of training")
    parser.add_argument("--eval-data", type=Path, help="prepared data dir whose val split to use")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="tinyshakespeare.txt")
    parser.add_argument("--train-s", type=float, help="training seconds (default 90; quick 15)")
    parser.add_argument("--eval-tokens", type=int, help="val tokens scored (131072; quick 8192)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--quant-new-tokens", type=int, help="part quant: decoded (64; quick 16)")
    parser.add_argument("--runs", type=int, help="part quant: timed runs (3; quick 2)")
    parser.add_argument("--group-size", type=int, default=64, help="int4 group size")
    parser.add_argument("--quant-dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(RESULT + json.dumps(measure_one(json.loads(args.one))))
        return 0
    quick = args.quick
    args.seq_lens = args.seq_lens or list(QUICK_SEQ_LENS if quick else SEQ_LENS)
    args.contexts = args.contexts or list(QUICK_CONTEXTS if quick else CONTEXTS)
    args.window = args.window or (512 if quick else 1024)
    args.new_tokens = args.new_tokens or (8 if quick else 32)
    args.train_s = args.train_s or (15.0 if quick else 90.0)
    args.eval_tokens = args.eval_tokens or (8192 if quick else 131072)
    args.quant_new_tokens = args.quant_new_tokens or (16 if quick else 64)
    args.runs = args.runs or (2 if quick else 3)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: must be ≥ 2 (one prefill, then steps)")
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    try:
        if "long" in args.parts:
            results["long_context"] = long_part(args)
        if "quant" in args.parts:
            results["quantization"] = quant_part(args)
        if "hybrid" in args.parts:
            results["hybrid"] = hybrid_part(args)
    except DecoderLMError as exc:
        parser.error(str(exc))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"rows: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
