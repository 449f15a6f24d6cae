"""Batch-invariant serving (`Engine(batch_invariant=True)`, `decoderlm serve --batch-invariant`): a
request's tokens and log-probabilities are bit-identical alone or among others, in bfloat16 and
float32, through chunked prefill, prefix caching, preemption and speculation, and in the compiled
decode pass as in the eager ones; the linear kernel's every output is the same whatever the rows
beside it (and through its op); models and pools it cannot make invariant are refused in one
line."""

from __future__ import annotations

import pytest
import torch
from block_models import in_blocks

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.cpu import block_linear, invariant
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams
from decoderlm.model.cache import kv_cache_bytes_per_token
from decoderlm.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not invariant.available(), reason="no C compiler for the kernel"),
]

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_char([ALPHABET])


def model(tok: Tokenizer, dtype: torch.dtype, d_model: int = 32, **overrides) -> DecoderLM:
    """A tiny Llama with a sharp head (greedy far from ties is not what is tested: bits are)."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=tok.vocab_size, context_length=128, d_model=d_model,
        n_layers=2, n_heads=4, n_kv_heads=2, **overrides,
    )  # fmt: skip
    return DecoderLM(config).to(dtype).eval()


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


PARAMS = RequestParams(16, SamplingParams(temperature=0), ignore_eos=True, logprobs=2)


def alone_and_together(engine: Engine, requests: list[list[int]], params=PARAMS):
    together = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in requests]
    return together, alone


# d_model 32: bfloat16 linears on AMX tiles where the CPU has them; 40 (not a multiple of 32): the
# C kernel everywhere
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d_model", [32, 40])
def test_every_request_is_bit_identical_alone_and_among_sixteen(tok, dtype, d_model):
    lm = model(tok, dtype, d_model)
    blocks = 40  # of 4 tokens: the longest request fits, sixteen at once do not (preemptions)
    memory = blocks * 4 * kv_cache_bytes_per_token(lm.config, dtype)
    engine = Engine(lm, tok, block_size=4, prefill_chunk=8, max_batched_tokens=24,
                    kv_cache_memory=memory, batch_invariant=True)  # fmt: skip
    requests = prompts(16, tok.vocab_size)
    requests += [requests[0] + requests[1]]  # a prefix the cache holds
    together, alone = alone_and_together(engine, requests)
    for crowd, solo in zip(together, alone, strict=True):
        assert crowd.token_ids == solo.token_ids
        assert crowd.logprobs == solo.logprobs and crowd.top_logprobs == solo.top_logprobs
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens > 0


@pytest.mark.skipif(not block_linear.available(), reason="no C compiler for the block kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_gguf_models_requests_are_bit_identical_alone_and_among_sixteen(tok, dtype, kind):
    """Every linear in ggml's blocks, as a GGUF file loads them: passes of 1 to 24 rows on the
    strips and tiles of one arithmetic (AVX-512 VNNI), else on the block kernel; without
    batch_invariant the same requests' log-probabilities differ (the kernel sums in other orders
    than the tiles and the prompt's GEMM)."""
    lm = in_blocks(model(tok, torch.float32, d_model=64, d_ff=160), kind).to(dtype)  # 5 blocks
    memory = 40 * 4 * kv_cache_bytes_per_token(lm.config, dtype)
    requests = prompts(16, tok.vocab_size)
    differ = 0
    for batch_invariant in (True, False):
        engine = Engine(lm, tok, block_size=4, prefill_chunk=8, max_batched_tokens=24,
                        kv_cache_memory=memory, batch_invariant=batch_invariant)  # fmt: skip
        together, alone = alone_and_together(engine, requests)
        pairs = zip(together, alone, strict=True)
        same = [c.token_ids == s.token_ids and c.logprobs == s.logprobs for c, s in pairs]
        differ = same.count(False)
        assert all(same) or not batch_invariant
    assert differ > 0 or not block_linear.integer_panels(kind)  # measured 9 to 16 of 16 differ


@pytest.mark.parametrize("kind", [None, "Q4_1"])
def test_seeded_sampling_and_speculation_stay_bit_identical(tok, kind):
    if kind and not block_linear.available():
        pytest.skip("no C compiler for the block kernels")
    lm = model(tok, torch.bfloat16, **({"d_model": 64, "d_ff": 160} if kind else {}))
    lm = in_blocks(lm, kind).to(torch.bfloat16) if kind else lm  # a GGUF file's blocks
    engine = Engine(lm, tok, block_size=4, batch_invariant=True,
                    draft="prompt-lookup", num_speculative_tokens=3)  # fmt: skip
    grounded = [p * 3 for p in prompts(8, tok.vocab_size)]  # repeats: lookup finds drafts
    sampled = RequestParams(
        16, SamplingParams(temperature=0.9, top_p=0.95), seed=7, ignore_eos=True
    )
    for params in (PARAMS, sampled):
        together, alone = alone_and_together(engine, grounded, params)
        assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert engine.stats().speculative_accepted > 0


class Counted:
    """A compiled decode pass that records how many rows each call runs."""

    def __init__(self, step) -> None:
        self.step, self.max_batch, self.rows = step, step.max_batch, []

    def __call__(self, token, *rest):
        self.rows.append(len(token))
        return self.step(token, *rest)


# float32 at d_model 40: Inductor's own RMSNorm and RoPE in the compiled pass change the logits of
# every request here (bfloat16 rounding hides most such changes); bfloat16 at 32: the linears on
# `bf16_linear`'s kernel where the CPU has one; Q4_1: a GGUF file's blocks on the op
# decoderlm::block_linear.
@pytest.mark.parametrize(
    ("dtype", "d_model", "kind"),
    [(torch.float32, 40, None), (torch.bfloat16, 32, None), (torch.bfloat16, 64, "Q4_1")],
)
def test_the_compiled_decode_pass_gives_each_request_the_eager_passes_bits(
    tok, dtype, d_model, kind
):
    lm = model(tok, dtype, d_model, **({"d_ff": 160} if kind else {}))
    lm = in_blocks(lm, kind).to(dtype) if kind else lm
    compiled = Engine(lm, tok, block_size=4, batch_invariant=True, compile=True)
    if compiled.runner.step is None:
        pytest.skip("no C++ compiler for the ops of the compiled pass")
    compiled.runner.step = counted = Counted(compiled.runner.step)
    requests = prompts(12, tok.vocab_size)
    together, alone = alone_and_together(compiled, requests)
    eager = Engine(lm, tok, block_size=4, batch_invariant=True).generate(requests, PARAMS)
    for crowd, solo, plain in zip(together, alone, eager, strict=True):
        assert crowd.token_ids == solo.token_ids == plain.token_ids
        assert crowd.logprobs == solo.logprobs == plain.logprobs
    assert 1 in counted.rows and max(counted.rows) > 1  # alone and among others, by the library


def test_the_kernel_gives_each_row_the_same_bits_in_any_batch_close_to_float64():
    g = torch.Generator().manual_seed(0)
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 0.5)):
        for n, k in ((67, 45), (128, 96)):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(37, k, generator=g).to(dtype)
            packed = invariant.pack(w)  # (⌈n/P⌉, k, P)
            whole = invariant.linear(x, packed, n)  # (37, n)
            for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(33, 37)):
                assert torch.equal(invariant.linear(x[rows], packed, n), whole[rows])
            exact = x.double() @ w.double().T  # bf16: the sum rounded to bfloat16 (|y| < 50)
            torch.testing.assert_close(whole.double(), exact, atol=atol, rtol=0)
            if invariant.ops_available():  # the op a compiled pass calls: the same bits
                strided = torch.stack([x, x], dim=1)[:, 0]  # (37, k) at a stride of 2k
                op = torch.ops.decoderlm.invariant_linear(strided, packed, n)
                assert torch.equal(op, whole)
            panels = packed.shape[0] * packed.shape[2]  # more outputs than the pack holds: refused
            with pytest.raises(ValueError, match=f"{panels + 1} outputs for"):
                invariant.linear(x, packed, panels + 1)
            with pytest.raises(ValueError, match=r"x \(37, \d+\) for a pack"):
                invariant.linear(torch.cat([x, x], dim=1), packed, n)


@pytest.mark.parametrize(
    ("overrides", "engine", "reason"),
    [
        ({"layer_types": ("gdn", "attention")}, {}, "recurrent layers"),
        ({"sliding_window": 8}, {}, "a sliding window"),
        ({}, {"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'"),
    ],
)
def test_what_it_cannot_make_invariant_is_a_one_line_error(tok, overrides, engine, reason):
    with pytest.raises(DecoderLMError, match=f"batch_invariant does not support {reason}") as err:
        Engine(model(tok, torch.float32, **overrides), tok, batch_invariant=True, **engine)
    assert "\n" not in str(err.value)


def test_quantized_linears_and_gelu_mlps_are_refused(tok):
    from decoderlm.quant import quantize

    with pytest.raises(
        DecoderLMError,
        match=r"batch_invariant does not support .*Int8Linear has no batch-invariant form",
    ):
        Engine(quantize(model(tok, torch.float32), "int8"), tok, batch_invariant=True)
    with pytest.raises(DecoderLMError, match="batch_invariant does not support mlp: a gelu MLP"):
        Engine(model(tok, torch.float32, mlp="gelu"), tok, batch_invariant=True)
