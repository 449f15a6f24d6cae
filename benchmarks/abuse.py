"""One abusive client against `decoderlm serve`: does the server stay responsive for everyone else?

A real `decoderlm serve` (a subprocess on 127.0.0.1, as a user runs it) serves a small random
model. For each case, 16 normal clients stream greedy completions while one abusive client sends
the case's request, and a prober asks GET /health every 100 ms. Reported per case: /health latency
(p50, max, and how many probes took over 1 s or timed out at 10 s), the p99 inter-token latency of
the 16 normal streams (from their SSE chunks), and what the abusive request got back.

Cases (the requests of issue "Nothing lost, nothing frozen", §2):
- none: the 16 streams alone, the yardstick;
- big-body: a 50 MB JSON body (one prompt string);
- many-prompts: 2,000 prompts with echo, logprobs 5 and max_tokens 1;
- template-bomb: a chat request to a checkpoint whose chat template renders `'x' * 10**8`
  (a second server, with that template);
- template-range: the same server, a template that loops over `range(10**9)`;
- engine-stopped: the engine process stopped (SIGSTOP) for 5 s while a client asks GET /metrics.

    HF_HUB_OFFLINE=1 python benchmarks/abuse.py [--cases none big-body ...] [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.checkpoint import save_model
from decoderlm.cpu.features import cpu_name
from decoderlm.tokenizer import Tokenizer

CASES = ("none", "big-body", "many-prompts", "template-bomb", "template-range", "engine-stopped")
TEMPLATES = {
    "template-bomb": "{{ 'x' * 100000000 }}",
    "template-range": "{% for i in range(1000000000) %}{{ i }}{% endfor %}",
}
HEALTH_TIMEOUT_S = 10.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`decoderlm serve --checkpoint run` in a subprocess on a free loopback port."""

    def __init__(self, run: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "decoderlm", "serve", "--checkpoint", str(run)]
        command += ["--port", str(self.port), *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.process.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy in 120 s")

    def engine_pid(self) -> int | None:
        """The engine's child process (`decoderlm serve` runs the engine in one), if any."""
        tasks = Path(f"/proc/{self.process.pid}/task")
        for children in tasks.glob("*/children"):
            for pid in children.read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                    return int(pid)
        return None

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def normal_stream(api: httpx.AsyncClient, seed: int, gaps: list[float], until: float) -> None:
    """Greedy streamed completions back to back until `until`; inter-chunk gaps into `gaps`."""
    while time.monotonic() < until:
        body = {"prompt": "To be or not" + " to be" * seed, "max_tokens": 48, "temperature": 0}
        last = None
        try:
            async with api.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
        except httpx.HTTPError:
            await asyncio.sleep(0.1)


async def prober(base: str, latencies: list[float], until: float) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=HEALTH_TIMEOUT_S) as api:
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                await api.get("/health")
                latencies.append(time.monotonic() - start)
            except httpx.HTTPError:
                latencies.append(float("inf"))
            await asyncio.sleep(0.1)


async def abusive(server: Server, case: str) -> str:
    """Send the case's request; what came back, as 'status: message' (or the error)."""
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=server.base, timeout=timeout) as api:
        try:
            if case == "big-body":
                body = json.dumps({"prompt": "a" * 50_000_000, "max_tokens": 1})
                r = await api.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
            elif case == "many-prompts":
                prompts = ["To be " + "or not " * (i % 40) for i in range(2000)]
                body = {"prompt": prompts, "echo": True, "logprobs": 5, "max_tokens": 1}
                r = await api.post("/v1/completions", json=body)
            elif case in TEMPLATES:
                messages = [{"role": "user", "content": "hi"}]
                r = await api.post("/v1/chat/completions", json={"messages": messages})
            elif case == "engine-stopped":
                pid = server.engine_pid()
                if pid is None:
                    return "no engine process"
                os.kill(pid, signal.SIGSTOP)
                try:
                    r = await api.get("/metrics", timeout=10)
                    await asyncio.sleep(max(0.0, 5 - r.elapsed.total_seconds()))
                finally:
                    os.kill(pid, signal.SIGCONT)
            else:
                return "-"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}"
        message = r.text[:70].replace("\n", " ")
        return f"{r.status_code}: {message}"


async def run_case(server: Server, case: str, seconds: float) -> dict:
    until = time.monotonic() + seconds
    gaps: list[float] = []
    health: list[float] = []
    async with httpx.AsyncClient(base_url=server.base, timeout=60) as api:
        normal = [normal_stream(api, i, gaps, until) for i in range(16)]
        await asyncio.sleep(0)
        started = time.monotonic()
        results = await asyncio.gather(prober(server.base, health, until), abusive(server, case),
                                       *normal)  # fmt: skip
    return {
        "case": case,
        "health_p50": percentile(health, 0.5),
        "health_max": max(health) if health else float("nan"),
        "health_slow": sum(h > 1.0 for h in health),
        "probes": len(health),
        "itl_p99": percentile(gaps, 0.99),
        "reply": results[1],
        "wall": time.monotonic() - started,
    }


def make_run(root: Path, name: str, template: str | None) -> Path:
    torch.manual_seed(0)
    corpus = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
    text = corpus.read_text()[:20000] if corpus.exists() else "To be or not to be, that is it."
    tokenizer = Tokenizer.train_char([text])
    config = ModelConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size,
                                     context_length=512)  # fmt: skip
    run = save_model(root / name, DecoderLM(config).eval(), tokenizer)
    if template is not None:
        (run / "chat_template.jinja").write_text(template)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--seconds", type=float, default=6.0, help="per case")
    parser.add_argument("--serve-args", default="", help="extra flags for decoderlm serve")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'case':<15} {'health p50':>10} {'max':>8} {'>1s':>4} {'probes':>6} "
          f"{'ITL p99':>8}  abusive reply")  # fmt: skip
    extra = args.serve_args.split()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        plain = make_run(root, "plain", None)
        for case in args.cases:
            run = make_run(root, case, TEMPLATES[case]) if case in TEMPLATES else plain
            server = Server(run, extra)
            try:
                r = asyncio.run(run_case(server, case, args.seconds))
            finally:
                server.stop()
            ms = 1000
            print(f"{r['case']:<15} {r['health_p50'] * ms:>8.0f}ms {r['health_max'] * ms:>6.0f}ms "
                  f"{r['health_slow']:>4} {r['probes']:>6} {r['itl_p99'] * ms:>6.0f}ms  "
                  f"{r['reply']}")  # fmt: skip


if __name__ == "__main__":
    main()
