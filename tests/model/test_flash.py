"""Our FlashAttention-2 (`decoderlm.model.flash`) against the float64 formula, forward and backward.

Every case compares out, dq, dk, dv with `scaled_dot_product_attention` + `build_mask` run on
float64 copies of the same inputs, so only the kernel's own rounding is measured.
Tolerances. fp32: measured errors are ≤ 4e-6 (T = 1000 sums a thousand fp32 products per entry,
each off by ~1e-7); atol 2e-5 / rtol 1e-4 leaves 5× headroom and still catches any wrong tile,
mask or rescaling (those give errors ~1e-2 and up). bf16: the tile math is fp32 and only the result
is rounded, so `out` must be within one bf16 ulp (rtol 2⁻⁸; rounding alone is ≤ 2⁻⁹). The
gradients cannot be held to that: like FlashAttention-2 we form D = rowsum(dO ∘ O) from the saved
bf16 O, and dP − D cancels, so they follow the FlashAttention repository's rule instead: max error
at most 2× that of torch's own SDPA run in bf16 on the same inputs (measured: ours is 0.3–1×
torch's, i.e. 5e-4 to 1.5e-2), plus a 1e-5 floor for cases where both are exact (T = 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from decoderlm.errors import DecoderLMError
from decoderlm.model import flash
from decoderlm.model.attention import scaled_dot_product_attention
from decoderlm.model.flash import flash_attention
from decoderlm.model.masks import build_mask

FP32_TOL = dict(atol=2e-5, rtol=1e-4)
BF16_OUT_TOL = dict(atol=1e-5, rtol=2**-8)

CASES = {  # id: (B, Hq, Hkv, Tq, Tk, D, causal)
    "t1-causal-mha": (2, 2, 2, 1, 1, 16, True),
    "t7-causal-gqa": (2, 4, 2, 7, 7, 16, True),
    "t7-noncausal-mqa": (2, 4, 1, 7, 7, 16, False),
    "t129-causal-mqa": (2, 4, 1, 129, 129, 16, True),
    "t129-noncausal-gqa": (2, 4, 2, 129, 129, 16, False),
    "t1000-causal-gqa": (1, 4, 2, 1000, 1000, 16, True),
    "t1000-noncausal-mqa": (1, 2, 1, 1000, 1000, 16, False),
    "tq1-tk129-decode-gqa": (2, 4, 2, 1, 129, 16, True),
    "tq7-tk600-cache-causal": (2, 4, 2, 7, 600, 16, True),
    "tq9-tk4-more-queries-than-keys": (1, 2, 1, 9, 4, 8, True),
}


def _inputs(b, hq, hkv, t_q, t_k, d, dtype=torch.float32, seed=0, bthd=False):
    g = torch.Generator().manual_seed(seed)
    if bthd:  # the layout attention.py hands over: (B, T, H, D) transposed to (B, H, T, D)
        q = torch.randn(b, t_q, hq, d, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, t_q, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, t_k, d, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(b, hq, t_q, d, generator=g).to(dtype)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _reference(q, k, v, do, causal, key_padding_mask):
    """out, dq, dk, dv of softmax(QKᵀ/√d + M)V in float64."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    mask = build_mask(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    return (out, *torch.autograd.grad(out, (q, k, v), do.double()))


def _torch_sdpa(q, k, v, do, causal, key_padding_mask):
    """out, dq, dk, dv of torch's fused SDPA in the inputs' own dtype."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    mask = build_mask(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _flash(q, k, v, do, causal, key_padding_mask):
    out = flash_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _assert_matches_reference(q, k, v, do, causal, key_padding_mask=None):
    got = _flash(q, k, v, do, causal, key_padding_mask)
    want = _reference(q, k, v, do, causal, key_padding_mask)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == q.dtype and a.shape == b.shape, name
    if q.dtype == torch.float32:
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(a.double(), b, **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")
        return
    torch.testing.assert_close(got[0].double(), want[0], **BF16_OUT_TOL)
    theirs = _torch_sdpa(q, k, v, do, causal, key_padding_mask)
    for name, a, t, b in zip(("dq", "dk", "dv"), got[1:], theirs[1:], want[1:], strict=True):
        ours_err, torch_err = (
            (a.double() - b).abs().max().item(),
            (t.double() - b).abs().max().item(),
        )
        assert ours_err <= 2 * torch_err + 1e-5, (
            f"{name}: error {ours_err:.2e}, torch {torch_err:.2e}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_output_and_gradients_match_float64_reference(case, dtype):
    *shape, causal = case
    _assert_matches_reference(*_inputs(*shape, dtype=dtype), causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_padding_mask_with_fully_masked_rows_matches_reference(causal):
    q, k, v, do = _inputs(2, 4, 2, 129, 129, 16, seed=1)
    key_padding_mask = torch.ones(2, 129, dtype=torch.bool)
    key_padding_mask[1, :5] = (
        False  # left padding: causal queries 0..4 of sequence 1 have no valid key
    )
    key_padding_mask[0, 60:70] = False  # a hole in the middle
    _assert_matches_reference(q, k, v, do, causal, key_padding_mask)


def test_query_with_no_valid_key_gives_zero_output_and_zero_finite_gradients():
    q, k, v, do = _inputs(2, 4, 2, 33, 33, 16, seed=2)
    key_padding_mask = torch.ones(2, 33, dtype=torch.bool)
    key_padding_mask[1] = False  # sequence 1: every key is padding
    out, dq, dk, dv = _flash(q, k, v, do, False, key_padding_mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all()
        assert torch.equal(grad[1], torch.zeros_like(grad[1]))
    assert out[0].abs().sum() > 0 and dq[0].abs().sum() > 0  # the valid sequence is untouched


def test_transposed_bthd_inputs_match_reference():
    q, k, v, do = _inputs(2, 4, 2, 129, 129, 16, seed=3, bthd=True)
    assert not q.is_contiguous()
    _assert_matches_reference(q, k, v, do, True)


@pytest.mark.parametrize(
    "t_q, t_k, causal", [(77, 77, True), (13, 100, True), (77, 77, False), (100, 13, True)]
)
def test_results_do_not_depend_on_tile_boundaries(monkeypatch, t_q, t_k, causal):
    # Tiles of 8 queries × 16 keys: many diagonal tiles, ragged last tiles, rows of a GQA group.
    monkeypatch.setattr(flash, "BLOCK_Q", 8)
    monkeypatch.setattr(flash, "BLOCK_K", 16)
    q, k, v, do = _inputs(2, 4, 2, t_q, t_k, 8, seed=4)
    key_padding_mask = torch.rand(2, t_k, generator=torch.Generator().manual_seed(5)) > 0.2
    _assert_matches_reference(q, k, v, do, causal, key_padding_mask)


def test_gradcheck_float64_multi_tile(monkeypatch):
    monkeypatch.setattr(flash, "BLOCK_Q", 2)
    monkeypatch.setattr(flash, "BLOCK_K", 3)
    q, k, v, _ = _inputs(1, 4, 2, 5, 8, 4, dtype=torch.float64, seed=6)
    key_padding_mask = torch.tensor([[False, True, True, True, True, False, True, True]])
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention(q, k, v, causal=True, key_padding_mask=key_padding_mask),
        (q, k, v),
    )


def _saved_shapes(fn, *args):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return shapes


def test_no_tq_by_tk_tensor_is_saved_for_backward():
    t_q, t_k = 96, 160  # distinct from every other dimension, so the check cannot mistake one
    q, k, v, _ = _inputs(2, 4, 2, t_q, t_k, 16)

    def saves_scores(shapes):
        return any(t_q in s and t_k in s for s in shapes)

    def math(q, k, v):
        return scaled_dot_product_attention(q, k, v, build_mask(t_q, t_k, True, None, q.device))[0]

    assert saves_scores(_saved_shapes(math, q, k, v))  # the check sees the math path's weights
    shapes = _saved_shapes(lambda *a: flash_attention(*a, causal=True), q, k, v)
    assert shapes and not saves_scores(shapes), shapes
    # Only O(T·d) is kept: q, k, v, O and the log-sum-exp L (B, Hq, Tq).
    assert sorted(shapes) == sorted(
        [(2, 4, t_q, 16), (2, 2, t_k, 16), (2, 2, t_k, 16), (2, 4, t_q, 16), (2, 4, t_q)]
    )


def test_causal_skips_key_tiles_above_the_diagonal(monkeypatch):
    monkeypatch.setattr(flash, "BLOCK_Q", 128)
    monkeypatch.setattr(flash, "BLOCK_K", 512)
    q, k, v, _ = _inputs(1, 4, 2, 1024, 1024, 16)

    def forward_flops(causal):
        with FlopCounterMode(display=False) as counter:
            flash_attention(q.detach(), k.detach(), v.detach(), causal=causal)
        return counter.get_total_flops()

    # A tile of queries [i0, i0 + 128) computes keys [0, i0 + 128) only: on average 576 of the
    # 1024 keys (56% of the work); computing the masked keys as well would be 100%.
    assert forward_flops(True) <= 0.6 * forward_flops(False)


@pytest.mark.parametrize(
    "q_shape, kv_shape, mask_shape, match",
    [
        ((1, 3, 4, 8), (1, 2, 4, 8), None, "multiple of key/value heads 2"),
        ((1, 2, 4, 8), (1, 2, 4, 16), None, "share batch and head_dim"),
        ((2, 4, 8), (2, 4, 8), None, "must be 4-D"),
        (
            (1, 2, 4, 8),
            (1, 2, 4, 8),
            (1, 5),
            r"key_padding_mask must be bool of shape \(B, Tk\) = \(1, 4\)",
        ),
    ],
)
def test_bad_shapes_raise_one_line_errors(q_shape, kv_shape, mask_shape, match):
    mask = None if mask_shape is None else torch.ones(mask_shape, dtype=torch.bool)
    with pytest.raises(DecoderLMError, match=match):
        flash_attention(
            torch.randn(q_shape),
            torch.randn(kv_shape),
            torch.randn(kv_shape),
            key_padding_mask=mask,
        )
