"""The static KV cache: its size, and decoding with it equals recomputing the whole sequence."""

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.inference.generate import generate
from decoderlm.model.cache import (
    CacheStep,
    StaticKVCache,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    kv_cache_table,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(n_kv_heads: int = 2, position: str = "rope", **overrides) -> ModelConfig:
    """llama-tiny in miniature: 2 layers, 4 query heads of 16."""
    base = dict(
        vocab_size=101,
        context_length=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        mlp="swiglu",
        norm="rmsnorm",
        position=position,
        bias=False,
        tie_embeddings=False,
    )
    return ModelConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, **config) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_config(**config)).to(dtype).eval()


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_cache_bytes_are_kv_heads_over_heads_of_the_mha_cache(n_kv_heads):
    cfg = tiny_config(n_kv_heads)
    mha = StaticKVCache(tiny_config(4), batch_size=3, max_len=50, dtype=torch.bfloat16)
    cache = StaticKVCache(cfg, batch_size=3, max_len=50, dtype=torch.bfloat16)
    assert cache.nbytes * cfg.n_heads == mha.nbytes * n_kv_heads
    # 2 (K, V) · 2 layers · n_kv_heads · 16 (head_dim) · 2 bytes per token and row.
    assert cache.nbytes == 3 * 50 * 2 * 2 * n_kv_heads * 16 * 2
    assert cache.nbytes == kv_cache_bytes(cfg, 50, batch_size=3, dtype=torch.bfloat16)
    assert cache[0].k.shape == (3, n_kv_heads, 50, 16)


def test_kv_bytes_per_token_of_the_benchmark_shape():
    cfg = ModelConfig.from_preset("llama-55m")  # 8 layers, 2 KV heads of 64
    assert kv_cache_bytes_per_token(cfg) == 2 * 8 * 2 * 64 * 4 == 8192
    assert kv_cache_bytes_per_token(cfg, torch.bfloat16) == 4096
    rows = {row["variant"]: row for row in kv_cache_table(cfg, (4096,))}
    assert rows["model"]["attention"] == "GQA"
    assert rows["MHA"]["bytes_per_token"] == 4 * rows["model"]["bytes_per_token"]  # 8 vs 2 heads
    assert rows["MQA"]["bytes_per_token"] * 2 == rows["model"]["bytes_per_token"]  # 1 vs 2 heads
    assert rows["model"]["bytes_at"][4096] == 4096 * 8192  # 32 MiB at 4k context


def greedy_by_recomputation(model: DecoderLM, prompt: list[int], n: int) -> list[int]:
    """Reference decoding: run the whole sequence through the model for every new token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq


def cached_logits(model: DecoderLM, seq: list[int], n_prompt: int) -> torch.Tensor:
    """Logits (len(seq), V) from a prefill of seq[:n_prompt], then one cached token at a time."""
    cache = StaticKVCache(model.config, 1, len(seq), model.tok_emb.weight.dtype)
    ids = torch.tensor([seq])
    with torch.no_grad():
        cache.seek(CacheStep.span(0, n_prompt, "cpu"))
        out = [model(ids[:, :n_prompt], torch.arange(n_prompt), None, cache)[0]]
        for i in range(n_prompt, len(seq)):
            cache.seek(CacheStep(torch.tensor([i]), i + 1))
            out.append(model(ids[:, i : i + 1], torch.tensor([i]), None, cache)[0])
    return torch.cat(out)


@pytest.mark.parametrize("position", ["rope", "sinusoidal", "learned"])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_cached_decoding_equals_full_recomputation(n_kv_heads, position):
    model = tiny_model(n_kv_heads=n_kv_heads, position=position)
    prompt = [5, 17, 3, 99, 42]
    expected = greedy_by_recomputation(model, prompt, 100)
    # float64 on both sides: a greedy tie would need logits equal to ~1e-15, so tokens must match.
    assert generate(model, [prompt], 100, temperature=0)[0] == expected
    with torch.no_grad():
        full = model(torch.tensor([expected]))[0]  # (T, V)
    # Same math in a different order (a prefix of keys per step instead of one masked matrix):
    # float64 rounding, ~1e-15 relative, leaves the logits equal far below 1e-10.
    torch.testing.assert_close(cached_logits(model, expected, 5), full, rtol=0, atol=1e-10)


def test_float32_generation_follows_full_recomputation():
    # float32 prefills go through oneDNN and decoding steps through a GEMV: a different summation
    # order than the full forward, ~1e-6 on the logits, far below the gaps between the top logits.
    model = tiny_model(dtype=torch.float32)
    prompts = [[5, 17, 3, 99, 42], [7, 1, 2]]
    expected = [greedy_by_recomputation(model, p, 40) for p in prompts]
    assert generate(model, prompts, 40, temperature=0) == expected


def test_cached_logits_match_in_float32_and_bfloat16():
    seq = [int(t) for t in torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(1))]
    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 0.1)]:
        model = tiny_model(dtype=dtype)
        with torch.no_grad():
            full = model(torch.tensor([seq]))[0].float()
        # float32: only the summation order differs (errors ~1e-6 on logits of size ~1).
        # bfloat16: 8 mantissa bits, ~0.4% per rounding through 2 layers, on logits of size ~1.
        torch.testing.assert_close(cached_logits(model, seq, 8).float(), full, rtol=0, atol=tol)


def test_compiled_one_token_step_decodes_like_eager():
    model = tiny_model(dtype=torch.float32, n_layers=1)
    prompt = [[1, 2, 3], [7, 8, 9, 10, 11]]  # padded batch through the compiled step
    assert generate(model, prompt, 20, temperature=0, compile=True) == generate(
        model, prompt, 20, temperature=0
    )


def test_beyond_context_is_an_error_by_default():
    model = tiny_model(context_length=32)
    with pytest.raises(DecoderLMError, match="exceeds context_length=32"):
        generate(model, [[1, 2, 3]], 30, temperature=0)
    with pytest.raises(DecoderLMError, match="more than the model's context_length=32"):
        generate(model, [list(range(33))], 1, temperature=0)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_refill_past_context_keeps_generating_past_the_context(position):
    context, prompt, n = 32, [4, 8, 15, 16, 23, 42], 70
    model = tiny_model(context_length=context, position=position)
    keep = context - context // 4  # the window keeps the newest 3/4 of a context when full
    seq, start = list(prompt), 0
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq[start:]]))[0, -1].argmax()))
            if len(seq) - start > context:
                start = len(seq) - keep
    out = generate(model, [prompt], n, temperature=0, refill_past_context=True)[0]
    assert len(out) == len(prompt) + n > 2 * context
    assert out == seq
