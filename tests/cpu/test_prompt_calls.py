"""The prompt-attention kernels (`bf16_attention`, `f32_attention`) take a prompt's causal attention
in their dtype and nothing else: each change of such a call (the other dtype, a gradient, a key
padding mask, a window, one query, a head dim off the kernel's multiple, no causal mask) leaves it
to SDPA."""

from __future__ import annotations

import pytest
import torch

from decoderlm.cpu import bf16_attention, f32_attention

KERNELS = {  # module: (its dtype, another, a head dim it cannot take)
    bf16_attention: (torch.bfloat16, torch.float32, 48),
    f32_attention: (torch.float32, torch.bfloat16, 40),
}
CHANGES = ["dtype", "gradient", "mask", "window", "one query", "head dim", "not causal"]


@pytest.mark.parametrize("module", list(KERNELS), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("change", CHANGES)
def test_takes_only_what_the_kernel_computes(module, change):
    dtype, other, bad_dim = KERNELS[module]
    if module is bf16_attention and not bf16_attention.kernels():
        pytest.skip("no AMX-BF16 or AVX512-BF16 here, or no C compiler")
    if module is f32_attention and not f32_attention.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)

    def inputs(d: int, kind: torch.dtype) -> list[torch.Tensor]:
        shapes = [(1, 4, 32, d), (1, 2, 32, d), (1, 2, 32, d)]
        return [torch.randn(*s, generator=g).to(kind) for s in shapes]

    plain = dict(causal=True, key_padding_mask=None, window=None, dropout_p=0.0)
    assert module.takes(*inputs(64, dtype), **plain)  # the call unchanged
    q, k, v = inputs(bad_dim if change == "head dim" else 64, other if change == "dtype" else dtype)
    keywords = dict(plain, causal=change != "not causal")
    if change == "gradient":
        q.requires_grad_(True)
    if change == "mask":
        keywords["key_padding_mask"] = torch.ones(1, 32, dtype=torch.bool)
    if change == "window":
        keywords["window"] = 8
    if change == "one query":
        q = q[:, :, -1:]
    assert not module.takes(q, k, v, **keywords)
