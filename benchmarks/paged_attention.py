"""Decode attention over a paged KV pool: gather the blocks + SDPA, or read them in place.

Two tables, each an interleaved A/B in this one process (this machine's speed drifts by up to 2×
within minutes, so every figure sits beside its peer from the same moment):

1. One layer's decode attention, µs per call (best of --rounds, 200 calls each): 16 rows of 128-255
   keys in 16-token blocks spread over the pool, 8 query heads of 64, with 8, 2 and 1 K/V heads;
   "gather + SDPA" is the engine's fallback (`PagedLayerCache.update`, then torch's SDPA with the
   key mask), "in place" is `decoderlm.cpu.paged_attention`. Beside them, each one's largest error
   against the same attention in float64.
2. `Engine.generate` of 16 prompts of 128 random tokens × 128 greedy new tokens on the "llama-55m"
   preset (tok/s per round), the engine's layers switched between the two paths, and how many of
   the 16 rows came out with identical tokens both ways (bfloat16 near-ties flip some).

    python benchmarks/paged_attention.py [--dtype bfloat16 float32] [--rounds 3] [--no-engine]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.features import cpu_name
from decoderlm.cpu.paged_attention import available, paged_decode_attention
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

ROWS, HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16


def layer_case(h_kv: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(h_kv)
    lengths = torch.randint(128, 256, (ROWS,), generator=g)
    width = -(-int(lengths.max()) // BLOCK)
    k, v = (torch.randn(400, BLOCK, h_kv, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(400, generator=g)[: ROWS * width].view(ROWS, width)
    q = torch.randn(ROWS, HEADS, 1, HEAD_DIM, generator=g).to(dtype)
    n = int(lengths.max())
    mask = (torch.arange(n)[None, :] < lengths[:, None])[:, None, None]  # (B, 1, 1, Tk)

    def gather_sdpa(q=q, k=k, v=v):
        keys = k.index_select(0, table.flatten()).view(ROWS, -1, h_kv, HEAD_DIM)[:, :n]
        values = v.index_select(0, table.flatten()).view(ROWS, -1, h_kv, HEAD_DIM)[:, :n]
        fold = q.reshape(ROWS, h_kv, HEADS // h_kv, HEAD_DIM)  # the engine's GQA fold
        out = F.scaled_dot_product_attention(
            fold, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
        )
        return out.reshape(q.shape)

    def in_place():
        return paged_decode_attention(q, k, v, table, lengths, HEAD_DIM**-0.5)

    exact = gather_sdpa(q.double(), k.double(), v.double())
    return gather_sdpa, in_place, exact


def per_call_us(fn, calls: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def layer_table(dtypes: list[torch.dtype], rounds: int) -> None:
    print(f"one layer, {ROWS} rows × 128-255 keys, {HEADS} heads of {HEAD_DIM}, µs per call")
    print(f"{'dtype':>9} {'K/V heads':>9} {'gather+SDPA':>12} {'in place':>9} {'err g+S':>9} "
          f"{'err i.p.':>9}")  # fmt: skip
    for dtype in dtypes:
        for h_kv in (8, 2, 1):
            gather_sdpa, in_place, exact = layer_case(h_kv, dtype)
            times = {gather_sdpa: [], in_place: []}
            for _ in range(rounds):
                for fn in times:
                    times[fn].append(per_call_us(fn))
            errors = [(fn().double() - exact).abs().max().item() for fn in times]
            print(f"{str(dtype)[6:]:>9} {h_kv:>9} {min(times[gather_sdpa]):>12.0f} "
                  f"{min(times[in_place]):>9.0f} {errors[0]:>9.1e} {errors[1]:>9.1e}")  # fmt: skip


def engine_table(dtypes: list[torch.dtype], rounds: int) -> None:
    tokenizer = Tokenizer.train_char(["".join(chr(0x4E00 + i) for i in range(31999))])
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(128)] for _ in range(ROWS)]
    params = RequestParams(128, SamplingParams(temperature=0), logprobs=0)
    print(f"\nEngine.generate, {ROWS} prompts × 128 new tokens, tok/s per round")
    for dtype in dtypes:
        for h_kv in (8, 2, 1):
            torch.manual_seed(0)
            config = ModelConfig.from_preset("llama-55m", n_kv_heads=h_kv, context_length=1024)
            engine = Engine(DecoderLM(config).eval().to(dtype), tokenizer, kv_cache_memory="64MiB")
            engine.generate(prompts[:1], RequestParams(8, params.sampling))  # first-call costs
            speeds: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, list[list[int]]] = {}
            for _ in range(rounds):
                for in_place in (False, True):
                    for layer in engine.runner.cache.layers:
                        layer.in_place = in_place
                    start = time.perf_counter()
                    done = engine.generate(prompts, params)
                    elapsed = time.perf_counter() - start
                    speeds[in_place].append(sum(len(c.token_ids) for c in done) / elapsed)
                    tokens[in_place] = [c.token_ids for c in done]
            same = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True))
            print(f"{str(dtype)[6:]:>9}, {h_kv} K/V heads: gather+SDPA "
                  f"{' / '.join(f'{s:.0f}' for s in speeds[False])}, in place "
                  f"{' / '.join(f'{s:.0f}' for s in speeds[True])}; identical rows {same}/{ROWS}",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-engine", action="store_true", help="only the one-layer table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, name) for name in args.dtype]
    print(f"CPU: {cpu_name()} ({args.threads} threads), torch {torch.__version__}")
    if not all(available(d, torch.device("cpu")) for d in dtypes):
        raise SystemExit("the in-place kernel is not available here (a C compiler builds it)")
    with torch.inference_mode():
        layer_table(dtypes, args.rounds)
    if not args.no_engine:
        engine_table(dtypes, args.rounds)


if __name__ == "__main__":
    main()
