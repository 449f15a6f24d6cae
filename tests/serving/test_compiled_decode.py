"""The engine's decode pass compiled ahead of time (`decoderlm.cpu.paged_step`, `Engine(compile=
True)`): the same logits as the eager pass for one row (the one-row library, the engine's) and for
several rows of different lengths (the library of any batch size, which the engine takes
wherever every linear is packed: its linears by the op decoderlm::invariant_linear in float32,
decoderlm::bf16_linear in bfloat16 on AMX tiles or AVX512-BF16, decoderlm::block_linear for a
GGUF file's block linears), writes to no slot but the rows' own, and greedy requests equal to their solo `generate`. The libraries are
compiled once per machine (about a minute each on 2 shared cores) and loaded from the disk cache
after."""

from __future__ import annotations

import pytest
import torch
from block_models import in_blocks
from test_engine import (
    GREEDY,
    engine_bytes,
    mixed_requests,
    near_tie_gap,
    random_prompts,
    run_staggered,
    tiny_model,
    token_ids,
)
from torch import Tensor

from conftest import COMPILED_PASS
from decoderlm import DecoderLMError, generate
from decoderlm.cpu import bf16_linear, block_linear, paged_step
from decoderlm.engine.engine import Engine
from decoderlm.engine.passes import Row
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.scheduler import Sequence
from decoderlm.engine.types import RequestParams
from decoderlm.inference.generate import next_logits
from decoderlm.model.lm import DecoderLM
from decoderlm.tokenizer import Tokenizer

pytestmark = COMPILED_PASS
BLOCK = 4
ATOL = 1e-5  # float32: the compiled pass sums in another order (measured ≤ 1e-7 here)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_char(["abcdefghijklmnopqrstuvwxyz .,\n"])


@pytest.fixture(scope="module")
def runner(tok) -> ModelRunner:
    """A float32 runner whose compiled pass takes one row and any number up to MAX_BATCH (every
    linear packed for the fixed-order kernel): both libraries under test."""
    model = tiny_model(tok, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tests' (`one_thread`, which starts after this fixture)
    try:
        return many_rows_runner(model)
    finally:
        torch.set_num_threads(threads)


def prefilled(runner: ModelRunner, lengths: list[int]) -> list[Sequence]:
    """Sequences of these prompt lengths + 1 token, their prompts' K/V in the pool (eagerly), in
    blocks taken from the end of the pool backwards so that tables are not in order."""
    g = torch.Generator().manual_seed(0)
    seqs, free = [], list(range(runner.num_blocks))[::-1]
    for n in lengths:
        seq = Sequence(torch.randint(0, 30, (n + 1,), generator=g).tolist(), n, 128)
        seq.blocks = [free.pop(0) for _ in range(-(-(n + 1) // BLOCK))]
        with runner.running():
            runner.forward([Row.of(seq, n)])
        seq.n_computed = n
        seqs.append(seq)
    return seqs


def compiled_and_eager(runner: ModelRunner, rows: list[Row]) -> tuple[Tensor, Tensor, set[str]]:
    """Logits (B, V) of a decode pass over `rows` by the runner's compiled library and eagerly,
    and the ops the compiled pass called."""
    with runner.running():
        with torch.profiler.profile() as prof:
            compiled = runner.forward(rows)
        step, runner.step = runner.step, None
        try:
            eager = runner.forward(rows)
        finally:
            runner.step = step
    return compiled, eager, {event.key for event in prof.key_averages()}


def many_rows_runner(model: DecoderLM) -> ModelRunner:
    """The engine's runner of `model`, compiled, asserted to take passes of any number of rows."""
    runner = ModelRunner(
        model, kv_cache_memory="64KiB", block_size=BLOCK, kv_cache_dtype=None,
        cpu_kernels=True, compile=True,
    )  # fmt: skip
    assert runner.step is not None and runner.step.max_batch == paged_step.MAX_BATCH
    return runner


@pytest.mark.parametrize("lengths", [[6], [3, 9, 13], [1, 4, 8, 12, 15]])
def test_the_compiled_pass_gives_the_eager_logits_for_one_row_and_rows_of_different_lengths(
    runner, lengths
):
    assert runner.compile_s > 0
    rows = [Row.of(s, 1) for s in prefilled(runner, lengths)]
    compiled, eager, ops = compiled_and_eager(runner, rows)  # (B, V) each
    assert compiled.shape == (len(lengths), runner.model.config.vocab_size)
    assert "decoderlm::invariant_linear" in ops  # (one row too)
    assert torch.allclose(compiled, eager, atol=ATOL, rtol=0), (compiled - eager).abs().max()


@pytest.mark.skipif(
    not (
        bf16_linear.supports(torch.zeros(1, 32, dtype=torch.bfloat16))
        and bf16_linear.op_available()
    ),
    reason="no AMX-BF16 or AVX512-BF16 here, or no C/C++ compiler for the op",
)
def test_on_bf16_kernels_the_engine_compiles_every_batch_and_gives_the_eager_logits(tok):
    # every linear's inputs a multiple of 32, as the kernel takes them
    runner = many_rows_runner(tiny_model(tok, torch.bfloat16, d_ff=64))
    rows = [Row.of(s, 1) for s in prefilled(runner, [3, 9, 13, 6])]
    compiled, eager, ops = compiled_and_eager(runner, rows)  # (B, V) each
    assert "decoderlm::bf16_linear" in ops
    # The same tile products; the norms, RoPE and SiLU fused by inductor round differently from
    # the eager C kernels: a few bfloat16 steps of the largest logit (measured 1 step).
    step_size = torch.finfo(torch.bfloat16).eps * eager.abs().max()
    assert (compiled - eager).abs().max() <= 4 * step_size


def q8_0_model(tok: Tokenizer) -> DecoderLM:
    """tiny_model in float32, every linear a Q8_0 BlockLinear (gguf-py's blocks), as a GGUF file
    of Q8_0 loads."""
    model = tiny_model(tok, torch.float32, d_ff=64)  # every linear's inputs whole blocks of 32
    return in_blocks(model, "Q8_0")


@pytest.mark.skipif(not block_linear.available(), reason="no C compiler for the block kernels")
def test_a_block_models_passes_of_many_rows_compile_and_give_the_eager_logits(tok):
    runner = many_rows_runner(q8_0_model(tok))
    rows = [Row.of(s, 1) for s in prefilled(runner, [3, 9, 13, 6])]
    compiled, eager, ops = compiled_and_eager(runner, rows)  # (B, V) each
    assert "decoderlm::block_linear" in ops
    assert torch.allclose(compiled, eager, atol=ATOL, rtol=0), (compiled - eager).abs().max()


def test_the_compiled_pass_writes_each_rows_slot_and_no_other(runner):
    seqs = prefilled(runner, [2, 7, 10])
    pools = [p for layer in runner.cache.layers for p in (layer.k, layer.v)]
    before = [p.clone() for p in pools]
    with runner.running():
        runner.forward([Row.of(s, 1) for s in seqs])
    written = torch.zeros(runner.num_blocks, BLOCK, dtype=torch.bool)
    for seq in seqs:
        written[seq.blocks[seq.n_computed // BLOCK], seq.n_computed % BLOCK] = True
    for old, new in zip(before, pools, strict=True):
        assert torch.equal(old[~written], new[~written])  # every other slot as it was
        assert not torch.equal(old[written], new[written])  # the new K/V landed


def test_compiled_engine_greedy_requests_equal_their_solo_generate(tok, runner):
    model = runner.model  # the runner's model: its libraries are found in this process
    engine = Engine(model, tok, kv_cache_memory="64KiB", block_size=BLOCK, compile=True)
    assert engine.runner.step is not None
    prompts = random_prompts(6, tok.vocab_size, (3, 20))
    requests = [(p, RequestParams(12, GREEDY, ignore_eos=True)) for p in prompts]
    for (prompt, params), got in zip(requests, run_staggered(engine, requests), strict=True):
        solo = generate(model, [prompt], params.max_tokens, temperature=0)[0][len(prompt) :]
        assert token_ids(got) == solo


def test_compiled_engine_under_preemption_and_prefix_sharing_equals_solo_up_to_near_ties(
    tok, runner
):
    """float32: the compiled pass sums in another order than `generate`'s eager one, so a greedy
    choice may flip where two logits tie within rounding (as in test_engine's float32 test)."""
    model = runner.model
    memory = 40 * BLOCK * engine_bytes(model)  # 40 blocks: 16 requests preempt each other
    engine = Engine(model, tok, kv_cache_memory=memory, block_size=BLOCK, compile=True)
    assert engine.runner.step is not None
    requests = mixed_requests(tok, 16)
    for (prompt, params), got in zip(requests, run_staggered(engine, requests), strict=True):
        solo = generate(model, [prompt], params.max_tokens, temperature=0)[0][len(prompt) :]
        near_tie_gap(model, prompt, token_ids(got), solo)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens >= 12


def test_the_compiled_pass_refuses_a_windowed_model_in_one_line(tok):
    model = tiny_model(tok, torch.float32, sliding_window=8)
    pool = torch.zeros(4, BLOCK, 2, 8)
    with pytest.raises(DecoderLMError, match="sliding window") as info:
        paged_step.CompiledPagedStep(model, [pool] * 2, [pool] * 2, next_logits, width=32)
    assert "\n" not in str(info.value)
    runner = ModelRunner(
        model, kv_cache_memory="64KiB", block_size=BLOCK, kv_cache_dtype=None,
        cpu_kernels=True, compile=True,
    )  # fmt: skip
    assert runner.step is None  # the engine runs such a model eagerly
