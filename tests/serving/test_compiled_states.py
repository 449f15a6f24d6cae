"""The engine's compiled decode pass over recurrent layers (`decoderlm.cpu.paged_step`): the rows'
states, gathered from their pages (`decoderlm.engine.state_pool`), updated in place by the pass
and written back, give the eager pass's logits and states — for hybrids, whose states lie in rows
of the K/V pools (Gated DeltaNet; linear attention without a conv state and Mamba-2), and a pure
recurrent model, whose states have slots of their own; one row and rows of different lengths, a
sequence's first token among them (its pages' old bytes never reach its state) — write no byte
outside the rows' slots and pages, and serve greedy requests equal to their solo `generate`. Each
model's two libraries are compiled once per machine (about half a minute each on one core), then
loaded from the disk cache."""

from __future__ import annotations

import pytest
import torch
from test_engine_recurrent import prompts, run, solo, tiny

from conftest import COMPILED_PASS
from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import paged_step
from decoderlm.engine.engine import Engine
from decoderlm.engine.passes import Row
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.scheduler import Sequence
from decoderlm.inference.generate import next_logits
from decoderlm.tokenizer import Tokenizer

pytestmark = COMPILED_PASS
BLOCK = 4
MEMORY = "2MiB"
ATOL = 1e-4  # float32: the compiled pass sums in another order (measured ≤ 1.3e-5 here)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_char(["abcdefghijklmnopqrstuvwxyz .,\n"])


def mixed(vocab_size: int) -> DecoderLM:
    """Linear attention (no conv state), attention and Mamba-2 layers, float32."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "hybrid-tiny", vocab_size=vocab_size, context_length=64, d_model=32, d_ff=64,
        n_heads=4, n_layers=3, layer_types=("linear_attention", "attention", "mamba2"),
        recurrent_chunk=8, init_std=0.5,
    )  # fmt: skip
    return DecoderLM(config).eval()


@pytest.fixture(scope="module", params=["hybrid-tiny", "recurrent-tiny", "mixed"])
def runner(request, tok) -> ModelRunner:
    """A float32 runner whose compiled pass takes up to 8 rows (the engine's compiles one row in
    float32: `runner.COMPILED_ROWS`): both libraries under test. The models: Gated DeltaNet in
    three layers of four and attention in the fourth, in all four, or `mixed`."""
    if request.param == "mixed":
        model = mixed(tok.vocab_size)
    else:
        model = tiny(request.param, tok.vocab_size, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tests' (`one_thread`, which starts after this fixture)
    try:
        runner = ModelRunner(
            model, kv_cache_memory=MEMORY, block_size=BLOCK, kv_cache_dtype=None,
            cpu_kernels=True, compile=True,
        )  # fmt: skip
        assert runner.step is not None and runner.states is not None
        keys, values = ([getattr(layer, p) for layer in runner.cache.layers] for p in "kv")
        runner.step = paged_step.CompiledPagedStep(
            model, keys, values, next_logits, width=runner.width, max_batch=8,
            parts=runner.states.parts,
        )  # fmt: skip
        return runner
    finally:
        torch.set_num_threads(threads)


def prefilled(runner: ModelRunner, lengths: list[int]) -> list[Sequence]:
    """Sequences of these prompt lengths + 1 token, their prompts run eagerly (length 0: its first
    token still to run), their blocks and state pages (or slots) taken from the end backwards,
    every page first filled with bytes of 0x3f (a state left by an earlier sequence, 0.75 as
    float32)."""
    g = torch.Generator().manual_seed(0)
    budget, seqs = runner.budget, []
    free = list(range(runner.num_blocks))[::-1]  # (a pure recurrent model's: bookkeeping only)
    slots = free if budget.num_slots is None else list(range(budget.num_slots))[::-1]
    for tensor in runner.states.tensors:
        tensor.view(torch.uint8).fill_(0x3F)
    for n in lengths:
        seq = Sequence(torch.randint(0, 30, (n + 1,), generator=g).tolist(), max(n, 1), 128)
        seq.blocks = [free.pop(0) for _ in range(-(-(n + 1) // BLOCK))]
        seq.state_pages = [slots.pop(0) for _ in range(budget.state_pages)]
        if n:
            with runner.running():
                runner.forward([Row.of(seq, n)])
        seq.n_computed = n
        seqs.append(seq)
    runner.states.write_back()  # the pages hold every state (a one-token prompt's pass kept its)
    return seqs


def states_of(runner: ModelRunner, seq: Sequence) -> dict[str, torch.Tensor]:
    """The sequence's states as its pages hold them: {"layer.part": tensor (1, ...)}."""
    runner.states.seek([seq.state_pages], torch.tensor([seq.n_computed + 1]))
    return {
        f"{p.layer}.{p.name}": t
        for p, t in zip(runner.states.parts, runner.states.layer_states(), strict=True)
    }


@pytest.mark.parametrize("lengths", [[6], [0], [3, 9, 0, 13], [1, 4, 8, 12, 15]])
def test_the_compiled_pass_gives_the_eager_logits_and_states(runner, lengths):
    seqs = prefilled(runner, lengths)
    before = [t.clone() for t in runner.states.tensors]
    rows = [Row.of(s, 1) for s in seqs]
    with runner.running():
        compiled = runner.forward(rows)  # (B, V)
        compiled_states = [states_of(runner, s) for s in seqs]
        for tensor, old in zip(runner.states.tensors, before, strict=True):
            tensor.copy_(old)  # the pages back to their states before the pass
        step, runner.step = runner.step, None
        try:
            eager = runner.forward(rows)
        finally:
            runner.step = step
    assert compiled.shape == (len(lengths), runner.model.config.vocab_size)
    assert torch.allclose(compiled, eager, atol=ATOL, rtol=0), (compiled - eager).abs().max()
    for seq, got in zip(seqs, compiled_states, strict=True):
        for name, value in states_of(runner, seq).items():
            assert torch.allclose(got[name], value, atol=ATOL, rtol=0), name


def test_the_compiled_pass_keeps_its_states_then_writes_back_the_rows_pages_and_nothing_else(
    runner,
):
    seqs = prefilled(runner, [2, 7, 0, 10])
    before = [t.clone() for t in runner.states.tensors]
    with runner.running():
        runner.forward([Row.of(s, 1) for s in seqs])
    written = torch.zeros(len(before[0]), dtype=torch.bool)  # the pages (pool rows) written
    for seq in seqs:
        written[seq.state_pages] = True
    for old, new in zip(before, runner.states.tensors, strict=True):
        assert torch.equal(old[written], new[written])  # a decode pass keeps its states
    runner.states.write_back()
    for old, new in zip(before, runner.states.tensors, strict=True):
        assert not torch.equal(old[written], new[written])  # the new states landed
        if runner.budget.num_slots is not None:
            assert torch.equal(old[~written], new[~written])  # every other slot as it was
    if runner.budget.num_slots is None:  # a hybrid's pools: besides the pages, the new K/V slots
        for seq in seqs:
            written[seq.blocks[seq.n_computed // BLOCK]] = True
        for old, new in zip(before, runner.states.tensors, strict=True):
            assert torch.equal(old[~written], new[~written])


def test_a_compiled_engine_serves_greedy_requests_equal_to_their_solo_generate(tok, runner):
    model = runner.model  # the runner's model: its one-row library is found in this process
    engine = Engine(model, tok, kv_cache_memory=MEMORY, block_size=BLOCK, compile=True)
    assert engine.runner.step is not None and engine.runner.states is not None
    requests = prompts(6, tok.vocab_size)
    # float32: the compiled and eager passes differ by rounding (~1e-5), far below these argmax
    # gaps: the same tokens, exactly.
    for prompt, got in zip(requests, run(engine, requests), strict=True):
        assert got == solo(model, prompt, 12)
