"""PackedLinear: the same products as F.linear (to rounding), a row's bits the same alone or among
others on the fixed-order kernel, swapped in and out from outside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.packed_linear import PackedLinear, can_pack, pack_linears
from decoderlm.cpu.swap import swapped

DTYPES = [d for d in (torch.float32, torch.bfloat16) if can_pack(d)]


@pytest.mark.skipif(not DTYPES, reason="no C compiler for the packed kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48), (130, 48)])
def test_packed_linear_is_as_close_to_float64_as_f_linear(dtype, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 300).to(dtype)
    x = torch.randn(*shape).to(dtype)
    exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    with torch.inference_mode():
        got = PackedLinear(linear)(x)
    plain_error = (F.linear(x, linear.weight, linear.bias).double() - exact).abs().max()
    assert got.shape == exact.shape and got.dtype == dtype
    # the same products in another order: within 2× F.linear's own rounding error (+1 ulp of 1)
    ulp = torch.finfo(dtype).eps
    assert (got.double() - exact).abs().max() <= 2 * plain_error + ulp


@pytest.mark.skipif(not DTYPES, reason="no C compiler for the packed kernels")
def test_a_float32_packed_linears_row_has_the_same_bits_alone_and_among_others():
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(48, 70))
    x = torch.randn(37, 48)
    with torch.inference_mode():
        together = packed(x)
        for rows in (slice(0, 1), slice(3, 20), slice(36, 37)):
            assert torch.equal(packed(x[rows]), together[rows])


@pytest.mark.skipif(not DTYPES, reason="no C compiler for the packed kernels")
def test_packing_swaps_every_plain_linear_for_a_block_and_puts_them_back():
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=32, n_layers=2, n_heads=4))
    names = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    keys = list(model.state_dict())
    swap = pack_linears(model)
    assert {n for n, m in model.named_modules() if type(m) is nn.Linear} == names  # not applied
    idx = torch.randint(0, model.config.vocab_size, (3, 9))
    with torch.inference_mode():
        plain = model(idx)
        with swapped(swap):
            assert not any(type(m) is nn.Linear for m in model.modules() if m not in _inner(swap))
            assert sum(isinstance(m, PackedLinear) for m in model.modules()) == len(names)
            fast = model(idx)
    assert {n for n, m in model.named_modules() if type(m) is nn.Linear} == names
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def _inner(swap):
    return {pack.linear for _, _, _, pack in swap}
