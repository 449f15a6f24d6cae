"""Prefill attention on the CPU's bfloat16 dot products, each kernel that runs here (AMX tiles,
AVX512-BF16): as close to float64 as torch's SDPA for causal self-attention
of any length, GQA, queries aligned to the last keys, strided views; a query's output does not
depend on the queries computed beside it; `cpu_attend` routes the shapes it takes to it (which
those are: test_prompt_calls.py)."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference, sdpa

from decoderlm.cpu import bf16_attention
from decoderlm.cpu.attention import cpu_attend

needs_kernel = pytest.mark.skipif(
    not bf16_attention.kernels(), reason="no AMX-BF16 or AVX512-BF16 here, or no C compiler"
)


@pytest.fixture(params=bf16_attention.kernels() or ["none"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel that runs here in turn, as the one `attention` takes."""
    monkeypatch.setattr(bf16_attention, "kernel", lambda: request.param)
    return request.param


def inputs(b, h, h_kv, t_q, t_k, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d, generator=g).bfloat16()
    k, v = (torch.randn(b, h_kv, t_k, d, generator=g).bfloat16() for _ in range(2))
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(
    "b, h, h_kv, t_q, t_k, d",
    [
        (1, 9, 3, 128, 128, 64),  # a prompt of SmolLM2's heads: whole tiles
        (1, 9, 3, 93, 93, 64),  # a last tile of 13 queries, keys not a multiple of 32
        (2, 4, 2, 37, 50, 64),  # a chunk after 13 cached keys, two sequences
        (1, 8, 8, 2, 300, 128),  # MHA, two queries over many keys, D = 128
        (1, 6, 1, 65, 65, 32),  # MQA, D = 32
        (1, 4, 2, 700, 700, 64),  # rows of scores past one 4-block group of keys
    ],
)
def test_kernel_is_as_close_to_float64_as_sdpa(kernel, b, h, h_kv, t_q, t_k, d):
    q, k, v = inputs(b, h, h_kv, t_q, t_k, d)
    exact = reference(q, k, v)
    got = bf16_attention.attention(q, k, v)
    assert got.shape == (b, h, t_q, d) and got.dtype == torch.bfloat16
    error, sdpa_error = ((x.double() - exact).abs() for x in (got, sdpa(q, k, v)))
    # the same rounding points as SDPA's kernel (P and the output in bfloat16), sums in another order
    assert error.max() <= 1.25 * sdpa_error.max()
    assert error.mean() <= 1.1 * sdpa_error.mean()


@needs_kernel
def test_takes_strided_views_and_returns_the_output_projections_layout(kernel):
    """q, k, v as a layer's projections give them: (B, T, H, D) storage viewed as (B, H, T, D)."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 40, 9 + 3 + 3, 64, generator=g).bfloat16()  # (B, T, heads, D)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([9, 3, 3], dim=2))
    got = bf16_attention.attention(q, k, v)
    assert torch.equal(got, bf16_attention.attention(*(x.contiguous() for x in (q, k, v))))
    assert got.transpose(1, 2).is_contiguous()  # (B, T, H, D): reshapes to (B, T, H·D) in place
    assert (got.double() - reference(q, k, v)).abs().max() <= 1.25 * (
        sdpa(q, k, v).double() - reference(q, k, v)
    ).abs().max()


@needs_kernel
def test_a_query_gets_the_same_bits_whatever_the_queries_beside_it(kernel):
    """Each query's scores, softmax and product with V depend on its own visible keys only: a
    prompt's last 16 queries as a chunk after its first ones give the bits they get in the whole
    prompt, and a sequence's output is the same alone or in a batch of three."""
    q, k, v = inputs(3, 6, 2, 77, 77, 64, seed=2)
    whole = bf16_attention.attention(q, k, v)
    assert torch.equal(bf16_attention.attention(q[:, :, -16:], k, v), whole[:, :, -16:])
    assert torch.equal(bf16_attention.attention(q[1:2], k[1:2], v[1:2]), whole[1:2])


@needs_kernel
def test_cpu_attend_routes_prefill_shapes_to_the_kernel(kernel):
    q, k, v = inputs(1, 9, 3, 40, 40, 64, seed=3)
    out, _ = cpu_attend(q, k, v, causal=True)
    assert torch.equal(out, bf16_attention.attention(q, k, v))
