"""The int8 KV cache: the quantizer's error bound, exact byte counts, and the logit error and greedy
agreement of decoding through it against the float32 and bfloat16 caches."""

from collections.abc import Callable

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.model.cache import (
    CacheStep,
    StaticKVCache,
    check_kv_cache_dtype,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    kv_cache_table,
)
from decoderlm.model.cache.storage import dequantize, quantize

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 3, 99, 42, 7, 1, 8]
N_NEW = 128


def tiny_config(n_kv_heads: int = 2, **overrides) -> ModelConfig:
    """2 layers, 4 query heads of 16; init_std 0.1 so that greedy decoding is not one repeated
    token (31 distinct tokens in 128 at seed 0) while logits stay of size ~3."""
    base = dict(
        vocab_size=101,
        context_length=160,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        tie_embeddings=False,
        init_std=0.1,
    )
    return ModelConfig(**{**base, **overrides})


def tiny_model(dtype: torch.dtype, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_config()).to(dtype).eval()


def test_quantizer_keeps_each_element_within_half_a_step_of_its_vector_scale():
    x = torch.randn(3, 2, 7, 16, generator=torch.Generator().manual_seed(0)) * 5
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 0, values 0
    x_q, s = quantize(x)
    assert x_q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 2, 7, 1)
    torch.testing.assert_close(s, x.abs().amax(-1, keepdim=True) / 127, rtol=0, atol=0)
    assert int(x_q.abs().max()) == 127 and bool((x_q.abs().amax(-1)[s[..., 0] > 0] == 127).all())
    # |x − s·x_q| ≤ s/2 (rounding to the nearest step), plus float32 rounding of x/s (~1e-7 · 127 s).
    error = (x - dequantize(x_q, s, torch.float32)).abs()
    assert bool((error <= s * (0.5 + 1e-4)).all())
    assert bool((dequantize(x_q, s, torch.float32)[0, 0, 0] == 0).all())


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_int8_cache_bytes_are_half_the_bf16_cache_plus_the_scales(n_kv_heads):
    cfg = tiny_config(n_kv_heads)
    batch, max_len = 3, 50
    int8 = StaticKVCache(cfg, batch, max_len, torch.bfloat16, kv_cache_dtype="int8")
    bf16 = StaticKVCache(cfg, batch, max_len, torch.bfloat16)
    # One float32 scale per (row, token, layer, K or V, head).
    scales = batch * max_len * 2 * cfg.n_layers * n_kv_heads * 4
    assert int8.nbytes == bf16.nbytes // 2 + scales
    # 2 (K, V) · 2 layers · n_kv_heads · (16 int8 values + a 4-byte scale) per token and row.
    assert kv_cache_bytes_per_token(cfg, "int8") == 2 * 2 * n_kv_heads * (16 + 4)
    assert (
        int8.nbytes
        == kv_cache_bytes(cfg, max_len, batch, "int8")
        == batch * max_len * (2 * 2 * n_kv_heads * 20)
    )
    layer = int8[0]
    assert layer.k.values.dtype == torch.int8 and layer.k.values.shape == (3, n_kv_heads, 50, 16)
    assert layer.k.scales.dtype == torch.float32 and layer.k.scales.shape == (3, n_kv_heads, 50, 1)


def test_kv_table_counts_int8_scales_and_windows():
    cfg = ModelConfig.from_preset("llama-55m")  # 8 layers, 2 KV heads of 64, 8 query heads
    rows = {row["variant"]: row for row in kv_cache_table(cfg, (4096, 32768), "int8", 4096)}
    assert rows["model"]["bytes_per_token"] == 2 * 8 * 2 * (64 + 4) == 2176
    assert (
        rows["MHA"]["bytes_per_token"] == 2 * 8 * 8 * 68 and rows["MQA"]["bytes_per_token"] == 1088
    )
    assert rows["model"]["bytes_at"][32768] == 32768 * 2176
    assert rows["model"]["bytes_at_windowed"] == {4096: 4096 * 2176, 32768: 4096 * 2176}
    # The window in 2 of the 8 layers: 2 layers keep 4096 tokens, the other 6 all of them.
    (half,) = [
        r for r in kv_cache_table(cfg, (32768,), torch.float32, 4096, 2) if r["n_kv_heads"] == 2
    ]
    per_layer = 8192 // 8
    assert half["bytes_at_windowed"][32768] == per_layer * (2 * 4096 + 6 * 32768)


def test_update_returns_the_dequantized_keys_in_the_model_dtype():
    cfg = tiny_config()
    cache = StaticKVCache(cfg, 2, 10, torch.bfloat16, "cpu", "int8")
    k, v = (torch.randn(2, 2, 4, 16).bfloat16() for _ in range(2))
    cache.seek(CacheStep.span(0, 4, "cpu"))
    k_all, v_all = cache[0].update(k, v)
    assert k_all.dtype == torch.bfloat16 and k_all.shape == (2, 2, 4, 16)
    torch.testing.assert_close(k_all, dequantize(*quantize(k), torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(v_all, dequantize(*quantize(v), torch.bfloat16), rtol=0, atol=0)
    cache.seek(CacheStep(torch.tensor([4])))  # end None: the whole buffer, unfilled slots are zeros
    k_all, _ = cache[0].update(k[:, :, :1], v[:, :, :1])
    assert k_all.shape == (2, 2, 10, 16) and bool((k_all[:, :, 5:] == 0).all())


def test_unknown_kv_cache_dtype_is_refused_in_one_line():
    with pytest.raises(DecoderLMError, match="kv_cache_dtype='fp8' must be None") as info:
        check_kv_cache_dtype("fp8")
    assert "\n" not in str(info.value)


class Bf16RoundedCache(StaticKVCache):
    """A float32 cache whose K/V are rounded to bfloat16 as they are written: the error of a bf16
    cache alone, without bf16 arithmetic anywhere else."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for layer in self.layers:
            update = layer.update
            layer.update = lambda k, v, update=update: update(
                k.bfloat16().float(), v.bfloat16().float()
            )


def greedy(model: DecoderLM) -> list[int]:
    """PROMPT and N_NEW greedy tokens from a plain-cache decoding, recomputing nothing."""
    seq = list(PROMPT)
    logits = decoded_logits(model, StaticKVCache, seq, extend=True)
    assert len(logits) == N_NEW
    return seq


def decoded_logits(
    model: DecoderLM, cache_type: Callable[..., StaticKVCache], seq: list[int], extend: bool = False
):
    """Logits (N_NEW, V) in float32 predicting seq[len(PROMPT):], from a prefill of PROMPT and one
    cached step per token; with `extend`, seq grows by the greedy token of each step."""
    cache = cache_type(model.config, 1, len(PROMPT) + N_NEW, model.tok_emb.weight.dtype)
    n, out = len(PROMPT), []
    with torch.no_grad():
        cache.seek(CacheStep.span(0, n, "cpu"))
        logits = model(torch.tensor([seq[:n]]), torch.arange(n), None, cache)[0, -1]
        for i in range(n, n + N_NEW):
            out.append(logits.float())
            if extend:
                seq.append(int(logits.argmax()))
            if i + 1 < n + N_NEW:
                cache.seek(CacheStep(torch.tensor([i]), i + 1))
                logits = model(torch.tensor([seq[i : i + 1]]), torch.tensor([i]), None, cache)[
                    0, -1
                ]
    return torch.stack(out)


def int8_cache(*args, **kwargs) -> StaticKVCache:
    """A `StaticKVCache` over int8 storage."""
    return StaticKVCache(*args, **kwargs, kv_cache_dtype="int8")


def compare(
    model: DecoderLM, cache_type: Callable[..., StaticKVCache] = int8_cache
) -> tuple[float, float, torch.Tensor]:
    """(max |Δlogit|, greedy agreement, top-2 gaps where they disagree) of `cache_type` against
    the model-dtype cache, both teacher-forced over the latter's own 128 greedy tokens."""
    seq = greedy(model)
    ref = decoded_logits(model, StaticKVCache, seq)  # (N_NEW, V)
    other = decoded_logits(model, cache_type, seq)
    top2 = ref.topk(2).values  # (N_NEW, 2)
    differ = ref.argmax(-1) != other.argmax(-1)
    agreement = 1.0 - float(differ.float().mean())
    return float((ref - other).abs().max()), agreement, (top2[:, 0] - top2[:, 1])[differ]


def test_int8_cache_logit_error_and_greedy_agreement_in_float32():
    """float32 model, int8 cache vs the float32 cache over 128 decoded tokens (seed 0):
    max |Δlogit| measured 0.023 (logits up to ~3.3), bound 0.05; a bf16-rounded cache measured
    0.009, so int8 costs ~2.5× a bf16 cache: bound 4×. Greedy agreement measured 127/128, bound
    ≥ 124/128; each disagreement is a near-tie, top-2 gap ≤ 2 · max |Δlogit| (measured 0.0046)."""
    model = tiny_model(torch.float32)
    error, agreement, gaps = compare(model)
    bf16_error, _, _ = compare(model, Bf16RoundedCache)
    assert 0 < error <= 0.05
    assert error <= 4 * bf16_error
    assert agreement >= 124 / 128
    assert bool((gaps <= 2 * error).all())


def test_int8_cache_logit_error_and_greedy_agreement_against_the_bf16_cache():
    """bfloat16 model, int8 cache vs the bf16 cache over 128 decoded tokens (seed 0): max |Δlogit|
    measured 0.047 (bf16 logits near 3 are 0.016 apart), bound 0.1; greedy agreement measured
    126/128, bound ≥ 122/128; each disagreement is a near-tie, top-2 gap ≤ 2 · max |Δlogit|
    (measured 0.047 and 0.008)."""
    model = tiny_model(torch.bfloat16)
    error, agreement, gaps = compare(model)
    assert 0 < error <= 0.1
    assert agreement >= 122 / 128
    assert bool((gaps <= 2 * error).all())
