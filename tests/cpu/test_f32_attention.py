"""Prefill attention in float32 on the CPU (`decoderlm.cpu.f32_attention`), each build of its kernel
(this CPU's, AVX2 + FMA, plain C): within 2e-6 of float64 for causal self-attention of any length,
GQA, MQA, queries aligned to the last keys, strided views, as close as torch's SDPA; a query's
output does not depend on the queries computed beside it; `cpu_attend` routes the shapes it
takes to it (which those are: test_prompt_calls.py), eagerly and in a compiled pass."""

from __future__ import annotations

import platform

import pytest
import torch
from attention_reference import reference, sdpa

from decoderlm.cpu import f32_attention, features
from decoderlm.cpu.attention import cpu_attend

needs_kernel = pytest.mark.skipif(not f32_attention.available(), reason="no C compiler")
X86 = platform.machine() in ("x86_64", "AMD64")
BUILDS = {"this CPU's": ()} | (
    {cap: features.ISA_CAPS[cap][1] for cap in ("avx2", "portable")} if X86 else {}
)


@pytest.fixture(params=list(BUILDS))
def run(request: pytest.FixtureRequest):
    """`attention` on each build of the kernel in turn."""
    built = f32_attention.library(BUILDS[request.param])
    if built is None:
        pytest.skip(f"the {request.param} build does not build here")
    return lambda q, k, v: f32_attention.run(built, q, k, v, q.shape[-1] ** -0.5)


def inputs(b, h, h_kv, t_q, t_k, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d, generator=g)
    k, v = (torch.randn(b, h_kv, t_k, d, generator=g) for _ in range(2))
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(
    "b, h, h_kv, t_q, t_k, d",
    [
        (1, 9, 3, 128, 128, 64),  # a prompt of SmolLM2's heads: whole groups of 6 queries
        (1, 9, 3, 93, 93, 64),  # a last group of 3 queries, keys not a multiple of 16
        (2, 4, 2, 37, 50, 64),  # a chunk after 13 cached keys, two sequences
        (1, 8, 8, 2, 300, 128),  # MHA, two queries over many keys, D = 128
        (1, 6, 1, 65, 65, 16),  # MQA, D = 16: one vector of dims
        (1, 4, 2, 700, 700, 48),  # rows of scores past one step of keys, D = 48: 3 vectors
    ],
)
def test_kernel_is_within_2e_6_of_float64_as_sdpa_is(run, b, h, h_kv, t_q, t_k, d):
    q, k, v = inputs(b, h, h_kv, t_q, t_k, d)
    exact = reference(q, k, v)
    got = run(q, k, v)
    assert got.shape == (b, h, t_q, d) and got.dtype == torch.float32
    error, sdpa_error = ((x.double() - exact).abs() for x in (got, sdpa(q, k, v)))
    # float32 sums in another order than SDPA's, and vec.h's exponential (2 ulp): errors of the
    # same size, a few float32 ulps of outputs of magnitude ~1
    assert error.max() <= 2e-6
    assert error.mean() <= 1.5 * sdpa_error.mean()


@needs_kernel
def test_takes_strided_views_and_returns_the_output_projections_layout(run):
    """q, k, v as a layer's projections give them: (B, T, H, D) storage viewed as (B, H, T, D)."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 40, 9 + 3 + 3, 64, generator=g)  # (B, T, heads, D)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([9, 3, 3], dim=2))
    got = run(q, k, v)
    assert torch.equal(got, run(*(x.contiguous() for x in (q, k, v))))
    assert got.transpose(1, 2).is_contiguous()  # (B, T, H, D): reshapes to (B, T, H·D) in place
    assert (got.double() - reference(q, k, v)).abs().max() <= 2e-6


@needs_kernel
def test_a_query_gets_the_same_bits_whatever_the_queries_beside_it(run):
    """Each query's scores, softmax and product with V depend on its own visible keys only: a
    prompt's last 16 queries as a chunk after its first ones give the bits they get in the whole
    prompt, and a sequence's output is the same alone or in a batch of three."""
    q, k, v = inputs(3, 6, 2, 77, 77, 64, seed=2)
    whole = run(q, k, v)
    assert torch.equal(run(q[:, :, -16:], k, v), whole[:, :, -16:])
    assert torch.equal(run(q[1:2], k[1:2], v[1:2]), whole[1:2])


@needs_kernel
def test_cpu_attend_routes_prefill_shapes_to_the_kernel_eager_and_compiled():
    q, k, v = inputs(1, 9, 3, 40, 40, 64, seed=3)
    expected = f32_attention.attention(q, k, v, 64**-0.5)
    assert torch.equal(cpu_attend(q, k, v, causal=True)[0], expected)
    compiled = torch.compile(lambda q, k, v: cpu_attend(q, k, v, causal=True)[0], fullgraph=True)
    assert torch.equal(compiled(q, k, v), expected)  # the op, not a graph break
