"""Where a served model's cores go: `decoderlm serve` or vLLM's CPU server, C streaming clients,
and the CPU seconds each process of the server used over the timed requests.

Each side starts as `benchmarks/serve.py --peer vllm` starts it (`vllm_peer`: 1 GiB of KV cache,
bfloat16, vLLM's threads bound to cores 0-1), takes C warm-up requests, then 2·C completions of other
~110-token prompts (100 random common words), `max_tokens` --new, greedy, `ignore_eos`, streamed,
C at a time (httpx, in this process). Printed per C: output tokens/s (each stream's usage), TTFT
p50/p99, and for each process of the server's tree (the HTTP process and the engine's process;
vLLM's API server, EngineCore and Worker) its CPU seconds and cores over the run. --new 1 times
prefill alone.

    HF_HUB_OFFLINE=1 python benchmarks/serve_cpu_split.py decoderlm MODEL_DIR [--concurrency 1 16 64]
        [--serve-arg=--max-batched-tokens=2048]
    HF_HUB_OFFLINE=1 python benchmarks/serve_cpu_split.py vllm MODEL_DIR --vllm-python VENV/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import vllm_peer

TICK = os.sysconf("SC_CLK_TCK")
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by")


def tree(pid: int) -> list[int]:
    """pid and its descendants (children of any of its threads)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += tree(int(child))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:70].decode()
    except FileNotFoundError:
        return "?"


async def one(api: httpx.AsyncClient, model: str, prompt: str, new: int) -> tuple[float, int]:
    """(seconds to the first token, output tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, tokens = time.perf_counter(), None, 0
    async with api.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return first or 0.0, tokens


async def drive(port: int, model: str, prompts: list[str], new: int, c: int) -> tuple[float, list]:
    """(wall seconds, per request (TTFT, tokens)) of `prompts` sent c at a time."""
    limit = asyncio.Semaphore(c)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as api:

        async def bounded(prompt: str) -> tuple[float, int]:
            async with limit:
                return await one(api, model, prompt, new)

        start = time.perf_counter()
        done = await asyncio.gather(*(bounded(p) for p in prompts))
        return time.perf_counter() - start, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("side", choices=["decoderlm", "vllm"])
    parser.add_argument("model", type=Path, help="an HF model directory (bf16 weights)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new", type=int, default=128, help="output tokens a request")
    parser.add_argument("--vllm-python", default="python", help="the Python of vLLM's venv")
    parser.add_argument("--serve-arg", action="append", default=[], help="more `serve` options")
    args = parser.parse_args()
    port = vllm_peer.free_port()
    if args.side == "vllm":
        cmd = vllm_peer.vllm_command(args.vllm_python, args.model, port, None)
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    else:
        cmd, env = vllm_peer.decoderlm_command(args.model, port, None) + args.serve_arg, {}
    rng = random.Random(0)
    log = Path(f"/tmp/serve_cpu_split_{args.side}.log")
    with vllm_peer.server(cmd, port, log, env) as startup:
        pgrep = ["pgrep", "-f", "-o", "--", f"--port {port}"]
        root = int(subprocess.check_output(pgrep).split()[0])
        print(f"{args.side} {' '.join(args.serve_arg)} up in {startup:.0f} s; load average "
              f"{os.getloadavg()[0]:.2f}")  # fmt: skip
        gc.collect()
        gc.freeze()  # as `vllm bench serve` does: no pauses of the client's collector in a run
        for c in args.concurrency:
            # c warm-up prompts, then 2c others: none of the timed ones in the prefix cache
            prompts = [" ".join(rng.choice(WORDS) for _ in range(100)) for _ in range(3 * c)]
            warm_up, prompts = prompts[:c], prompts[c:]
            asyncio.run(drive(port, args.model.name, warm_up, 16, c))
            before = {pid: cpu_seconds(pid) for pid in tree(root)}
            wall, done = asyncio.run(drive(port, args.model.name, prompts, args.new, c))
            ttft = sorted(t for t, _ in done)
            p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
            print(f"C={c}: {sum(n for _, n in done) / wall:.1f} tok/s, wall {wall:.1f} s, TTFT "
                  f"p50 {statistics.median(ttft) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")  # fmt: skip
            for pid in tree(root):
                used = cpu_seconds(pid) - before.get(pid, 0.0)
                if used > 0.05:
                    print(f"    {used:6.1f} CPU s  {used / wall:4.2f} cores  {name(pid)}")


if __name__ == "__main__":
    main()
