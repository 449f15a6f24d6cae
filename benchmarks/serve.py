"""`decoderlm serve` under load: streaming clients at several concurrencies, vs transformers one at a time.

The "llama-55m" preset (d_model 512, 8 layers, 8 heads, vocab 32000, random init) with 8, 2 and 1
K/V heads, in --dtype (float32 or bfloat16: bfloat16 is the fast one on CPUs with AMX or
AVX512-BF16 and ~700× slower on AVX2-only ones), served over HTTP on 127.0.0.1 (uvicorn in a thread
of this process, the engine in a process of its own as `decoderlm serve` runs it, or with
--engine thread in a thread of this one; the clients in a process of their own) with one fixed KV
budget
(--kv-cache-memory), so fewer K/V heads let more sequences run at once: "fit" is how many whole
sequences (prompt + new tokens) the budget holds, ⌊blocks / blocks per sequence⌋, exactly in the
ratio of K/V heads; "max running" the most the engine ran at once (it admits on the blocks a
sequence holds now and preempts when the pool runs out, so it can exceed "fit"). For each
concurrency C, 2·C requests (C in flight at a time) of --prompt-tokens random tokens each stream
--new-tokens greedy tokens; reported: aggregate generated tokens/s, time to first token and
inter-token latency (p50/p99 over all requests and tokens, as the client sees the SSE chunks),
and the most sequences the engine ran at once. The baseline runs the same prompts through
`transformers`' `LlamaForCausalLM.generate` (the same weights, via `decoderlm.hf.to_hf`), one at a
time, in the same dtype. A vocabulary of 32000 distinct characters stands in for a tokenizer,
so the clients count a chunk's tokens as its characters, and ask for no log-probabilities.
The "engine" row runs the last load level's requests (C at a time) once more through
`Engine.generate` on the benchmark's thread, without HTTP: the gap to the HTTP row is what the
server and its clients on the same cores cost. With --rounds R every measurement (each load
level, the engine row, transformers) runs R times, interleaved, and each row shows its best round:
this machine's speed drifts by up to 2× within minutes, and the best of interleaved rounds gives
each side the same chance of a fast moment. Below the table: per K/V-head count, the
aggregate at 16 clients over the engine's own single stream and over transformers one at a time.

    HF_HUB_OFFLINE=1 python benchmarks/serve.py [--dtype bfloat16] [--concurrency 1 4 16 64]
        [--rounds 3] [--engine process|thread] [--quick]

With --capacity [BUDGET] (default 1GiB) it serves nothing and prints how many sequences of 4k and
32k tokens one KV budget holds for the same 55M shape as MHA, GQA-2, a 3:1 Gated DeltaNet hybrid
(GDN, GDN, GDN, attention, twice) and pure Gated DeltaNet, in float32 and bfloat16: the engine's
own admission arithmetic (`ModelRunner` built on the meta device, its `state_pool.split_budget`),
no decoding.

With --peer vllm, instead: vLLM's CPU server against `decoderlm serve` on the same weights, driven
by vLLM's own client (vllm_peer.py; vLLM in a venv of its own, never in CI):

    python benchmarks/serve.py --peer vllm [--vllm-python VENV/bin/python] [--speculative]

With --peer llama.cpp: llama.cpp's server against `decoderlm serve` on one GGUF file, the same
client (llama_server_peer.py):

    python benchmarks/serve.py --peer llama.cpp --llama-cpp LLAMA [--peer-gguf FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import torch
from llama_server_peer import add_llama_server_arguments, run_llama_server_peer
from vllm_peer import add_peer_arguments, run_peer

from decoderlm import DecoderLM, ModelConfig
from decoderlm.chat_template import ChatTemplate
from decoderlm.checkpoint import save_model
from decoderlm.cpu.features import cpu_name
from decoderlm.engine.engine import Engine
from decoderlm.engine.engine_process import EngineProcess, EngineSpec
from decoderlm.engine.kv_pool import blocks_for
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.types import RequestParams
from decoderlm.hf import to_hf
from decoderlm.inference.sampling import SamplingParams
from decoderlm.server.app import create_app
from decoderlm.server.http import Served
from decoderlm.tokenizer import Tokenizer


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_request(
    api: httpx.AsyncClient, ids: list[int], new: int
) -> tuple[float, list[float], int]:
    """(TTFT, inter-token gaps, tokens) of one streamed completion."""
    body = {"prompt": ids, "max_tokens": new, "temperature": 0, "stream": True}
    start = time.perf_counter()
    times = []
    async with api.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text = chunk["choices"][0]["text"] if chunk["choices"] else ""
                times += [time.perf_counter()] * len(text)  # one character per token
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return times[0] - start, gaps, len(times)


def run_load(base: str, prompts: list[list[int]], new: int, concurrency: int) -> dict:
    """`load_level` in the clients' process."""
    return asyncio.run(load_level(base, prompts, new, concurrency))


async def load_level(base: str, prompts: list[list[int]], new: int, concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600) as api:

        async def bounded(ids):
            async with limit:
                return await one_request(api, ids, new)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        elapsed = time.perf_counter() - start
    ttft = [r[0] for r in results]
    itl = [g for r in results for g in r[1]]
    return {"tok_s": sum(r[2] for r in results) / elapsed, "ttft": ttft, "itl": itl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2, 1])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--engine", choices=["process", "thread"], default="process")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every measurement; best kept")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny loads, 8/1 heads")
    parser.add_argument("--capacity", nargs="?", const="1GiB", default=None, metavar="BUDGET",
                        help="print the sequences one KV budget holds per variant, and exit")  # fmt: skip
    add_peer_arguments(parser)
    add_llama_server_arguments(parser)
    args = parser.parse_args()
    if args.capacity is not None:
        capacity(args.capacity)
        return
    if args.peer == "llama.cpp":
        return run_llama_server_peer(args)
    if args.peer:
        return run_peer(args)
    if args.quick:
        args.concurrency, args.kv_heads = [1, 4], [8, 1]
        args.prompt_tokens, args.new_tokens, args.rounds = 16, 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.train_char(["".join(chr(0x4E00 + i) for i in range(31999))])
    rng = random.Random(0)
    print(f"CPU: {cpu_name()} ({torch.get_num_threads()} threads), torch {torch.__version__}")
    print(f"{args.dtype}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new (greedy), "
          f"KV budget {args.kv_cache_memory}")  # fmt: skip
    header = f"{'kv heads':>8} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
    print(header + f"{'ITL p50':>8} {'ITL p99':>8} {'fit':>5} {'max running':>11}")
    dtype = getattr(torch, args.dtype)
    summary = []
    # The clients run in a process of their own, as they would on other machines: in this one
    # they would hold the GIL that the engine's thread needs between its tensor operations.
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    scratch = tempfile.TemporaryDirectory()  # the run directories the engine processes load
    for kv_heads in args.kv_heads:
        torch.manual_seed(0)
        config = ModelConfig.from_preset("llama-55m", n_kv_heads=kv_heads, context_length=1024)
        model = DecoderLM(config).eval().to(dtype)
        run = save_model(Path(scratch.name) / f"kv{kv_heads}", model, tokenizer)
        loads = {c: [[rng.randrange(31999) for _ in range(args.prompt_tokens)]
                     for _ in range(2 * c)] for c in args.concurrency}  # fmt: skip
        c = args.concurrency[-1]  # the engine row: the last load level's requests, without HTTP
        hf_prompts = loads[args.concurrency[0]][: max(2, args.concurrency[0] * 2)]
        best: dict = {}  # measurement → its best round: the machine's speed drifts between rounds
        for _ in range(args.rounds):
            for concurrency, prompts in loads.items():
                r = serve_load(args, run, model, tokenizer, config, clients, prompts, concurrency)
                if concurrency not in best or r[0]["tok_s"] > best[concurrency][0]["tok_s"]:
                    best[concurrency] = r
            alone = engine_alone(model, tokenizer, args.kv_cache_memory, loads[c], c,
                                 args.new_tokens)  # fmt: skip
            hf = transformers_one_at_a_time(model, hf_prompts, args.new_tokens)
            best["engine"], best["hf"] = (
                max(best.get("engine", 0), alone),
                max(best.get("hf", 0), hf),
            )
        per_seq = blocks_for(args.prompt_tokens + args.new_tokens, best[c][1].kv_block_size)
        ms = 1000
        for concurrency in args.concurrency:
            r, stats = best[concurrency]
            print(f"{kv_heads:>8} {concurrency:>7} {r['tok_s']:>8.1f} "
                  f"{percentile(r['ttft'], 0.5) * ms:>7.0f}ms {percentile(r['ttft'], 0.99) * ms:>7.0f}ms "
                  f"{percentile(r['itl'], 0.5) * ms:>6.1f}ms {percentile(r['itl'], 0.99) * ms:>6.1f}ms "
                  f"{stats.kv_blocks_total // per_seq:>5} {stats.max_running_seen:>11}")  # fmt: skip
        print(f"{kv_heads:>8} {'engine':>7} {best['engine']:>8.1f}  ({c} at a time, "
              "Engine.generate, no HTTP)")  # fmt: skip
        print(
            f"{kv_heads:>8} {'HF 1×1':>7} {best['hf']:>8.1f}  (transformers generate, one at a time)"
        )
        tok_s = {k: v[0]["tok_s"] for k, v in best.items() if isinstance(k, int)}
        if 1 in tok_s and 16 in tok_s:
            summary.append(f"{kv_heads} K/V heads: 16 clients = {tok_s[16] / tok_s[1]:.1f}× the "
                           f"single stream, {tok_s[16] / best['hf']:.1f}× transformers 1×1")  # fmt: skip
    clients.shutdown()
    scratch.cleanup()
    print("\n".join(summary))


CAPACITY_VARIANTS = {  # the llama-55m shape (8 layers, 8 heads of 64) as four kinds of model
    "MHA": dict(n_kv_heads=8),
    "GQA-2": dict(n_kv_heads=2),
    "hybrid 3:1 (GDN + GQA-2)": dict(
        n_kv_heads=2, layer_types=("gdn", "gdn", "gdn", "attention") * 2, recurrent_key_heads=4
    ),
    "Gated DeltaNet": dict(layer_types=("gdn",) * 8, recurrent_key_heads=4),
}


def capacity(budget: str, contexts: tuple[int, ...] = (4096, 32768), block_size: int = 16) -> None:
    """The table of --capacity: per variant the KV bytes per token, the state bytes per sequence,
    and the sequences of each context the engine admits at once under `budget`."""
    dtypes = (torch.float32, torch.bfloat16)
    cols = [f"{n // 1024}k {str(d).removeprefix('torch.')}" for d in dtypes for n in contexts]
    print(f"KV budget {budget}, block_size {block_size}; sequences admitted at once")
    print("| variant | KV bytes/token (fp32) | state bytes/seq (fp32) | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (2 + len(cols)))
    for name, overrides in CAPACITY_VARIANTS.items():
        fits, budgets = [], {}
        for dtype in dtypes:
            for n in contexts:
                config = ModelConfig.from_preset("llama-55m", context_length=n, **overrides)
                with torch.device("meta"):  # no memory: only the pools' arithmetic is wanted
                    model = DecoderLM(config).to(dtype)
                runner = ModelRunner(model, kv_cache_memory=budget, block_size=block_size,
                                     kv_cache_dtype=None, cpu_kernels=False)  # fmt: skip
                budgets[dtype] = runner.budget
                fits.append(f"{runner.budget.sequences_at(n, block_size):,}")
        fp32 = budgets[torch.float32]
        print(f"| {name} | {fp32.block_bytes // block_size:,} | {fp32.state_bytes:,} | "
              + " | ".join(fits) + " |")  # fmt: skip


def serve_load(args, run, model, tokenizer, config, clients, prompts, concurrency) -> tuple:
    """(the clients' measurements, the engine's final stats) of one load level over HTTP."""
    options = {"kv_cache_memory": args.kv_cache_memory, "max_queue": 256}
    if args.engine == "process":
        engine = EngineProcess(EngineSpec(str(run), args.dtype, options, args.threads))
        engine.start()
    else:
        engine = Engine(model, tokenizer, **options)
    served = Served(engine, tokenizer, "llama-55m", config.context_length, config.vocab_size,
                    ChatTemplate())  # fmt: skip
    with live_server(create_app(lambda: served, grace_s=0)) as base:
        warm_up = [prompts[0][::-1]]
        clients.submit(run_load, base, warm_up, 8, 1).result()  # first-call costs
        r = clients.submit(run_load, base, prompts, args.new_tokens, concurrency).result()
    stats = engine.stats()
    engine.shutdown(0)
    return r, stats


def engine_alone(
    model: DecoderLM, tokenizer: Tokenizer, memory: str, prompts: list[list[int]], c: int, new: int
) -> float:
    """Generated tokens/s of `Engine.generate` on the prompts, c at a time, on this thread: what
    the engine does without the HTTP server and its clients on the same cores."""
    engine = Engine(model, tokenizer, kv_cache_memory=memory, max_queue=256)
    sampling = SamplingParams(temperature=0)
    params = RequestParams(new, sampling)  # as the clients ask: no log-probabilities
    engine.generate(prompts[:1], replace(params, max_tokens=8))  # not timed: first-call costs
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), c):
        tokens += sum(len(done.token_ids) for done in engine.generate(prompts[i : i + c], params))
    return tokens / (time.perf_counter() - start)


def transformers_one_at_a_time(model: DecoderLM, prompts: list[list[int]], new: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config, hf_state = to_hf(model)
    hf_config.pop("architectures", None)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config)).eval().to(model.tok_emb.weight.dtype)
    hf.load_state_dict(hf_state)
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)  # fmt: skip
    return len(prompts) * new / (time.perf_counter() - start)


def live_server(app):
    """uvicorn on a free loopback port in a thread (as tests/serving/conftest.py does)."""
    import contextlib
    import socket
    import threading

    import uvicorn

    @contextlib.contextmanager
    def running():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        base = f"http://127.0.0.1:{port}"
        while httpx.get(f"{base}/health").status_code != 200:
            time.sleep(0.01)
        try:
            yield base
        finally:
            server.should_exit = True
            thread.join()

    return running()


if __name__ == "__main__":
    main()
