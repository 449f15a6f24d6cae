"""The fused RMSNorm, RoPE and SwiGLU-gate kernels (`decoderlm.cpu.fused`): RoPE bit-identical to
the model's formula in float32 and bfloat16, RMSNorm and silu(g) ⊙ u within float32 rounding of
float64 (and RMSNorm bit-identical to the module on all but a few bfloat16 elements), every
element the same bits wherever its row lies (batch invariance), the ops a compiled pass calls
giving the ctypes kernels' bits, and `FusedOps` swapped into a model and out again, its logits
those of the plain model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import fused
from decoderlm.cpu.fused import FusedOps, FusedRMSNorm, FusedSwiGLU
from decoderlm.model.layers import RMSNorm
from decoderlm.model.positional import apply_rope

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler for the kernels")
DTYPES = [torch.float32, torch.bfloat16]


def rope_tables(rows: int, t: int, r: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (rows, T, R) of positions 3 + b + t, as `RotaryEmbedding` lays them out."""
    positions = torch.arange(t)[None] + 3 + torch.arange(rows)[:, None]  # (rows, T)
    angles = positions[..., None] * 10000.0 ** (-torch.arange(0, r, 2) / r)  # (rows, T, R/2)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [64, 24])  # full and partial RoPE (the rest passed through)
def test_rope_is_bit_identical_to_the_formula_on_a_strided_view(dtype, rotary):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 10, 7 * 64, generator=g).to(dtype)  # a fused projection's output
    q = qkv[..., : 5 * 64].view(3, 10, 5, 64).transpose(1, 2)  # (B, H, T, D), not contiguous
    cos, sin = rope_tables(3, 10, rotary, dtype)
    for c, s in ((cos, sin), (cos[:1], sin[:1]), (cos[0], sin[0])):  # per row, (1, T, R), (T, R)
        expected = apply_rope(q, c, s)
        out = fused.apply_rope(q, c, s)
        assert out.shape == expected.shape and torch.equal(out, expected)
    assert fused.apply_rope(q, cos, sin).transpose(1, 2).is_contiguous()  # laid out (B, T, H, D)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_float64_and_the_module(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 200, generator=g) * 3).to(dtype)  # 200: not a multiple of the lanes
    norm = RMSNorm(200, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(200, generator=g).to(dtype)
    with torch.no_grad():
        expected = norm(x)
        out = FusedRMSNorm(norm)(x)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)
    else:  # two roundings to bfloat16 (2⁻⁸ each), as the module: equal but where a sum's order tips one
        torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-6)
        assert (out != expected).float().mean() <= 0.01


def test_rms_norm_with_an_offset_gain_and_strided_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 96, generator=g)[:, 1]  # rows 192 elements apart
    norm = RMSNorm(96, eps=1e-6, offset=1.0)  # y = x̂ · (1 + w)
    norm.weight.data = torch.randn(96, generator=g) * 0.1
    with torch.no_grad():
        torch.testing.assert_close(FusedRMSNorm(norm)(x), norm(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_close_to_float64_and_each_element_the_same_wherever_it_lies(dtype):
    """A vectorised loop computes a row's last elements by a scalar path that rounds differently;
    here they are masked lanes of the same instructions, so a column's bits do not depend on the
    row's length nor on the rows around it."""
    g = torch.Generator().manual_seed(0)
    x, u = (torch.randn(5, 1000, generator=g) * 4).to(dtype), torch.randn(5, 1000, generator=g).to(dtype)  # fmt: skip
    whole = fused.silu_mul(x, u)
    for end in (1, 7, 333, 999):
        assert torch.equal(fused.silu_mul(x[:, :end], u[:, :end]), whole[:, :end])
    for rows in (slice(0, 1), slice(2, 5)):
        assert torch.equal(fused.silu_mul(x[rows], u[rows]), whole[rows])
    exact = F.silu(x.double()) * u.double()
    if dtype == torch.float32:  # e^x and 1/a within 2 ulp each
        torch.testing.assert_close(whole.double(), exact, rtol=1e-6, atol=1e-6)
    else:  # rounded after silu and after the product, as F.silu(g) * u
        torch.testing.assert_close(whole.double(), exact, rtol=2**-7, atol=1e-6)
        assert (whole != F.silu(x) * u).float().mean() <= 0.01


def test_rms_norm_rows_are_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 576, generator=g).bfloat16()
    weight = torch.randn(576, generator=g).bfloat16()
    whole = fused.rms_norm(x, weight, 1e-5)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 40)):
        assert torch.equal(fused.rms_norm(x[rows], weight, 1e-5), whole[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_ops_a_compiled_pass_calls_give_the_eager_kernels_bits(dtype):
    if not fused.ops_available():
        pytest.skip("no C++ compiler for the ops")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 100, generator=g).to(dtype)[:, 1, :96]  # rows at a stride
    weight = torch.randn(96, generator=g).to(dtype)
    ops = torch.ops.decoderlm
    assert torch.equal(
        ops.fused_rms_norm(x, weight, 1e-5, 1.0), fused.rms_norm(x, weight, 1e-5, 1.0)
    )
    q = torch.randn(3, 5, 7, 64, generator=g).to(dtype).transpose(1, 2)  # (B, H, T, D), strided
    cos, sin = rope_tables(3, 5, 24, dtype)
    for c, s in ((cos, sin), (cos[0], sin[0])):
        assert torch.equal(ops.fused_rope(q, c, s).transpose(1, 2), fused.apply_rope(q, c, s))
    u = torch.randn(6, 96, generator=g).to(dtype)
    assert torch.equal(ops.fused_silu_mul(x, u), fused.silu_mul(x, u))


def tiny(dtype: torch.dtype) -> DecoderLM:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=50, context_length=64, d_model=64,
                                     n_layers=2, n_heads=4, n_kv_heads=2)  # fmt: skip
    return DecoderLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_ops_swap_in_and_out_and_keep_the_logits(dtype):
    model = tiny(dtype)
    idx = torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(0))
    plain_modules = list(model.modules())
    with torch.no_grad():
        expected = model(idx).float()
        ops = FusedOps(model)
        for _ in range(2):  # re-entered per pass
            with ops:
                assert isinstance(model.blocks[0].norm1, FusedRMSNorm)
                assert isinstance(model.blocks[0].mlp, FusedSwiGLU)
                assert model.blocks[0].attn.apply_rope is fused.apply_rope
                logits = model(idx).float()
    assert list(model.modules()) == plain_modules
    assert model.blocks[0].attn.apply_rope is apply_rope
    if dtype == torch.float32:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    else:  # where a rounding tips, by at most a bfloat16 step at the logits' scale
        ulp = 2**-7 * expected.abs().max().item()
        torch.testing.assert_close(logits, expected, rtol=0, atol=ulp)


def test_a_pass_that_needs_gradients_takes_the_models_own_formulas():
    model = tiny(torch.float32)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with FusedOps(model):
        loss = model(idx).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
