"""GGUF files read by decoderlm give transformers' GGUF loader's logits (float32 products on the
dequantized weights ≤ 1e-4, the block products within their activations' rounding) and greedy
continuations, for each architecture and tensor type, with the quantized weights kept in their
blocks; Llama 3's RoPE scaling comes back from `rope_freqs`."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf_builders import randomize, write_gguf
from gguf_reference import NO_SPECIALS, float32_linears, reference

import decoderlm
from decoderlm.gguf import read_gguf_config
from decoderlm.quant import BlockEmbedding, BlockLinear

# Both sides compute in float32 from bit-equal weights; they differ by summation order (~1e-6).
LOGITS_ATOL = 1e-4
# The block products round each activation to within max|x| / (127 · 256) of its block of 32
# (tests/cpu/test_block_linear.py bounds them): these models' logits, up to 7.8, move by up to
# 3.6e-3 (measured, Q4_1 and Q5_1; 5e-4 to 1.5e-3 for the other types).
BLOCK_LOGITS_ATOL = 1e-2
# Mamba-2's selective scan carries that rounding through its recurrence and its exponentials:
# its Q8_0 logits move by up to 0.04 (measured over 13 random models).
MAMBA2_BLOCK_LOGITS_ATOL = 0.1
CASES = [
    *[("llama", t) for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)],
    *[("qwen2", t) for t in (T.F32, T.Q8_0, T.Q4_1, T.Q5_0)],
    *[("qwen3", t) for t in (T.F16, T.Q4_0, T.Q5_0)],
    *[("gpt2", t) for t in (T.F32, T.Q8_0, T.Q4_1)],
    ("mistral", T.Q8_0),
]


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{t.name}" for a, t in CASES])
def test_logits_and_greedy_continuation_equal_transformers_gguf_loader(tiny_gguf, arch, qtype):
    _, path = tiny_gguf(arch, qtype)
    ours, _ = decoderlm.load(path)
    theirs = reference(path)
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = theirs(ids).logits
        torch.testing.assert_close(float32_linears(ours)(ids), expected, atol=LOGITS_ATOL, rtol=0)
        torch.testing.assert_close(ours(ids), expected, atol=BLOCK_LOGITS_ATOL, rtol=0)
        expected = theirs.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)[0].tolist()
    assert decoderlm.generate(ours, [ids[0, :8].tolist()], 8, temperature=0)[0] == expected


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_quantized_weights_stay_in_their_blocks(tiny_gguf, qtype):
    _, path = tiny_gguf("llama", qtype)
    model, _ = decoderlm.load(path)
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 2 * 5 + 1  # qkv, proj, gate, up, down per layer and the tied head
    assert {m.ggml_type for m in linears} == {qtype.name}
    assert isinstance(model.tok_emb, BlockEmbedding) and model.tok_emb.ggml_type == qtype.name
    assert model.head.blocks.data_ptr() == model.tok_emb.blocks.data_ptr()  # tied: one copy
    floats = sum(p.numel() for p in model.parameters())
    assert floats == 2 * 2 * 64 + 64  # only the RMSNorm gains are floats


def test_blocks_stay_and_the_lookup_follows_model_to_bfloat16(tiny_gguf):
    _, path = tiny_gguf("llama", T.Q4_1)
    model, _ = decoderlm.load(path, dtype="bfloat16")
    assert model.tok_emb.blocks.dtype == torch.uint8
    assert model.tok_emb(torch.tensor([[1, 2]])).dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


def test_the_embedding_dequantizes_only_the_rows_it_reads(tiny_gguf, monkeypatch):
    _, path = tiny_gguf("llama", T.Q8_0)
    model, _ = decoderlm.load(path)
    rows = []
    original = decoderlm.quant.blocks.dequantize_rows
    monkeypatch.setattr(
        decoderlm.quant.blocks,
        "dequantize_rows",
        lambda blocks, kind, k: rows.append(blocks.shape[0]) or original(blocks, kind, k),
    )
    ids = torch.tensor([[5, 7, 5]])
    out = model.tok_emb(ids)
    assert rows == [3]
    table = original(model.tok_emb.blocks, "Q8_0", 64)
    assert torch.equal(out[0], table[[5, 7, 5]])


def llama_cpp_rope_freqs(theta, head_dim, factor, low, high, original):
    """llama.cpp's `LlamaModel.generate_extra_tensors` (Llama 3.1's scaling as frequency divisors)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path, vocab):
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)  # fmt: skip
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, vocab_size=len(vocab.tokens), max_position_embeddings=16384,
        rope_parameters=rope, **NO_SPECIALS,
    )  # fmt: skip
    hf = randomize(transformers.LlamaForCausalLM(config))
    path = write_gguf(tmp_path / "llama3.gguf", hf, "llama", vocab, T.Q8_0)
    freqs = llama_cpp_rope_freqs(500000.0, 64, 8.0, 1.0, 4.0, 8192)
    with_freqs = write_gguf(tmp_path / "llama3-rope.gguf", hf, "llama", vocab, T.Q8_0,
                            extra={"rope_freqs.weight": freqs})  # fmt: skip
    scaling = read_gguf_config(with_freqs).rope_scaling
    assert scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    ours, _ = decoderlm.load(with_freqs)
    theirs = reference(path)  # the same Q8_0 weights; transformers' GGUF loader ignores rope_freqs
    ids = torch.randint(0, len(vocab.tokens), (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100, 140)  # where float32 angles (transformers') are still exact
    with torch.no_grad():
        logits = float32_linears(ours)(ids, positions=positions)
        unscaled = theirs(ids, position_ids=positions[None]).logits
        theirs.config.rope_parameters = rope
        theirs.model.rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
            theirs.config
        )
        scaled = theirs(ids, position_ids=positions[None]).logits
    torch.testing.assert_close(logits, scaled, atol=LOGITS_ATOL, rtol=0)
    assert (logits - unscaled).abs().max() > 100 * LOGITS_ATOL  # the scaling is there to see


def test_a_llama_named_mistral_is_mistral_without_a_window(tiny_gguf):
    _, path = tiny_gguf("mistral", T.Q8_0)
    config = read_gguf_config(path)
    assert config.extra["hf_model_type"] == "mistral" and config.sliding_window is None


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers: no mamba_ssm kernels on a CPU
@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0])
def test_mamba2_files_give_transformers_mamba2s_logits(tmp_path, vocab, qtype):
    """transformers' GGUF loader reads no Mamba-2, so the reference is the HF model the file was
    written from (llama.cpp's Mamba2Model layout), its quantized weights rounded as the file's."""
    config = transformers.Mamba2Config(
        vocab_size=len(vocab.tokens), hidden_size=64, num_hidden_layers=2, num_heads=4,
        head_dim=32, state_size=16, n_groups=2, chunk_size=16, **NO_SPECIALS,
    )  # fmt: skip
    hf = randomize(transformers.Mamba2ForCausalLM(config))
    with torch.no_grad():
        for layer in hf.backbone.layers:
            layer.mixer.A_log.uniform_(-1, 1)  # A = −exp(A_log): decays of every speed
    path = write_gguf(tmp_path / "mamba2.gguf", hf, "mamba2", vocab, qtype)
    with torch.no_grad():  # the weights as the file holds them
        for p in hf.parameters():
            if p.dim() == 2 and p.shape[-1] % 32 == 0:
                quantized = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(quantized, qtype)))
    ours, _ = decoderlm.load(path)
    assert ours.config.layer_types == ("mamba2", "mamba2") and ours.config.recurrent_key_heads == 2
    ids = torch.randint(0, len(vocab.tokens), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(float32_linears(ours)(ids), expected, atol=LOGITS_ATOL, rtol=0)
        torch.testing.assert_close(ours(ids), expected, atol=MAMBA2_BLOCK_LOGITS_ATOL, rtol=0)
    if qtype != T.F32:
        assert isinstance(ours.blocks[0].mixer.in_proj, BlockLinear)
