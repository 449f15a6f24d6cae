"""Attention on the CPU: the explicit formula a block of queries at a time, where it beats SDPA.

Blockwise evaluation of softmax(QKᵀ/√d_k + M)V (Rabe & Staats, 2021, "Self-attention does not
need O(n²) memory"; the query blocking of FlashAttention, Dao et al., 2022) without the online
softmax: each block of queries is scored only against the keys it may see. `cpu_attend` has the
signature of `decoderlm.model.attention.attend` and replaces it in every `CausalSelfAttention`
(`decoderlm.cpu.optimize`); it calls the blockwise formula on the CPU shapes where
`blockwise_is_faster` says so and the model's `attend` everywhere else.

torch's fused CPU kernel runs a causal attention of T queries over their own T keys 1.3-2.2×
slower where T is not a multiple of 16 (bfloat16 and float32; benchmarks/README.md, a prompt of
93 tokens 150 µs a layer against 70 at 96): `padded_self_attention` pads T to the next multiple
with zeros at the end, which no real query sees (they come after it), and drops the padded
queries' rows. Inference only; a prompt's first chunk is this shape. On a CPU with AMX or
AVX512-BF16 a bfloat16 prompt's causal attention goes to the kernel of `decoderlm.cpu.bf16_attention`
instead, and a float32 prompt's to that of `decoderlm.cpu.f32_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from decoderlm.cpu import bf16_attention, f32_attention
from decoderlm.model.attention import attend, scaled_dot_product_attention
from decoderlm.model.masks import MaskedSoftmax, build_mask, effective_window, masked_softmax


def softmax_zero_if_empty(scores: Tensor) -> Tensor:
    """softmax over the last dim, with zeros for a row whose scores are all −∞ (every key masked).

    softmax(s)_j = e^(s_j − m) / Σ_k e^(s_k − m) for any m; m = max_k s_k keeps it finite, and m needs
    no gradient. A row with a finite score has Σ ≥ e^0 = 1; in a row of −∞ every e^(s_j − m) is 0,
    so a finite m and Σ clamped to ≥ 1 make its weights (and their gradients) 0, not 0/0.
    """
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (..., 1)
    exp = torch.exp(scores - row_max.clamp_min(torch.finfo(scores.dtype).min))
    return exp / exp.sum(dim=-1, keepdim=True).clamp_min(1.0)


def additive_masked_softmax(scores: Tensor, keep: Tensor | None) -> Tensor:
    """softmax(scores + M) as torch.compile fuses it best (see benchmarks/cpu_attention.py).

    M is added (its backward is the identity, where a masked_fill's needs the mask again), and
    `softmax_zero_if_empty` guards the rows with every key masked by per-row scalars.
    """
    if keep is not None:
        mask = torch.where(keep, 0.0, float("-inf")).to(scores.dtype)  # M = 0 or −∞
        scores = scores + mask  # (B, H, Tq, Tk)
    return softmax_zero_if_empty(scores)


def _softmax() -> MaskedSoftmax:
    """The masked softmax for the formula: torch's fused softmax eagerly, the additive one traced."""
    return additive_masked_softmax if torch.compiler.is_compiling() else masked_softmax


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    block_size: int = 128,
    dropout_p: float = 0.0,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """`scaled_dot_product_attention`, `block_size` queries at a time (no weights returned).

    Each block of queries is scored only against the keys it may see: with a causal mask, those
    up to its last query (bottom-right alignment, as `causal_mask`), and with a sliding window
    those from its first query's first key. About half of the masked upper triangle is never
    computed at long T, and no tensor larger than (B, H, block, Tk) is held.
    q (B, H, Tq, D), k/v (B, Hkv, Tk, D), key_padding_mask (B, Tk) → (B, H, Tq, D).
    """
    t_q, t_k = q.shape[2], k.shape[2]
    window = effective_window(causal, window, t_k)
    softmax = _softmax()
    outs = []
    for start in range(0, t_q, block_size):
        stop = min(start + block_size, t_q)
        seen = stop + t_k - t_q if causal else t_k  # keys visible to the block's last query
        first = 0 if window is None else max(0, start + t_k - t_q - window + 1)  # 1st query's 1st
        keys = None if key_padding_mask is None else key_padding_mask[:, first:seen]
        mask = build_mask(stop - start, seen - first, causal, keys, q.device, window)
        q_block, k_seen, v_seen = q[:, :, start:stop], k[:, :, first:seen], v[:, :, first:seen]
        out, _ = scaled_dot_product_attention(
            q_block, k_seen, v_seen, mask, scale=scale, dropout_p=dropout_p, softmax=softmax
        )
        outs.append(out)  # (B, H, stop − start, D)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, Tq, D)


def blockwise_is_faster(q: Tensor, t_k: int) -> bool:
    """Whether `blockwise_attention` beats torch's fused SDPA kernel for this shape.

    The rule of `python benchmarks/cpu_attention.py` (which prints, for each shape, the measured
    times and the path this rule picks), run on an Intel CPU with avx512_bf16 and on an AMD EPYC
    with AVX2 only; elsewhere, and on accelerators, the fused kernel is used.
    - Training: torch's CPU flash-attention backward is slow at short context in bf16/fp16; under
      torch.compile the formula wins up to T = 256 in every dtype, eagerly up to T = 128 in
      bf16/fp16 only.
    - Decoding one token: the fused kernel (a GQA group's query heads as rows against their one
      K/V head, `decoderlm.model.attention.attend`) in every dtype, eager and compiled, except
      compiled over long caches, where inductor's fused formula wins: measured at 2048 and
      16384 keys, hence the bound 4096 between them.
    - Prefill: the formula wins in bf16/fp16 under torch.compile.
    """
    if q.device.type != "cpu":
        return False
    reduced = q.dtype in (torch.bfloat16, torch.float16)
    compiling = torch.compiler.is_compiling()
    if q.requires_grad:
        return t_k <= 256 if compiling else reduced and t_k <= 128
    if q.shape[2] == 1:
        return compiling and t_k > 4096
    return reduced and compiling


PAD_MULTIPLE = 16


def pads(
    q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None, window: int | None
) -> bool:
    """Whether `padded_self_attention` takes this attention: on the CPU, without gradients,
    outside torch.compile, causal over its own keys only (Tq = Tk > 1, no mask, no window), of a
    length the fused kernel runs slowly."""
    t = q.shape[2]
    return (
        q.device.type == "cpu"
        and causal
        and key_padding_mask is None
        and window is None
        and k.shape[2] == t > 1
        and t % PAD_MULTIPLE != 0
        and not (torch.is_grad_enabled() and q.requires_grad)
        and not torch.compiler.is_compiling()
    )


def padded_self_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Causal SDPA of T queries over their T keys with T padded to a multiple of PAD_MULTIPLE:
    q (B, H, T, D), k/v (B, Hkv, T, D) → (B, H, T, D). The padded keys lie after every real
    query, so the causal mask hides them; only the order of the kernel's sums changes (within
    one rounding of the unpadded result)."""
    t = q.shape[2]
    pad = (0, 0, 0, -t % PAD_MULTIPLE)  # zeros after the T positions
    out = F.scaled_dot_product_attention(
        F.pad(q, pad),
        F.pad(k, pad),
        F.pad(v, pad),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # (B, H, T', D)
    return out[:, :, :t]


def cpu_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    backend: str = "sdpa",
    dropout_p: float = 0.0,
    need_weights: bool = False,
    scale: float | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`attend`, with the CPU's faster paths: q (B, H, Tq, D), k/v (B, Hkv, Tk, D) → (out, weights).

    backend "sdpa": `blockwise_attention` where `blockwise_is_faster`, the bfloat16 kernel
    (`decoderlm.cpu.bf16_attention`) or the float32 one (`decoderlm.cpu.f32_attention`) where it
    `takes` the call (a prompt's causal attention), `padded_self_attention` where it `pads`;
    backend "math" (or need_weights) on the CPU: the formula with the softmax torch.compile fuses
    best; otherwise the model's `attend`.
    """
    if q.device.type == "cpu" and (need_weights or backend == "math"):
        mask = build_mask(q.shape[2], k.shape[2], causal, key_padding_mask, q.device, window)
        return scaled_dot_product_attention(
            q, k, v, mask, scale=scale, dropout_p=dropout_p, softmax=_softmax()
        )
    if backend == "sdpa" and blockwise_is_faster(q, k.shape[2]):
        out = blockwise_attention(
            q,
            k,
            v,
            causal=causal,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
            scale=scale,
            window=window,
        )
        return out, None
    call = dict(
        causal=causal, key_padding_mask=key_padding_mask, window=window, dropout_p=dropout_p
    )
    if backend == "sdpa" and bf16_attention.takes(q, k, v, **call):
        return bf16_attention.attention(q, k, v, scale), None
    if backend == "sdpa" and f32_attention.takes(q, k, v, **call):
        return f32_attention.attention(
            q, k, v, q.shape[-1] ** -0.5 if scale is None else scale
        ), None
    if backend == "sdpa" and dropout_p == 0.0 and pads(q, k, causal, key_padding_mask, window):
        return padded_self_attention(q, k, v, scale), None
    return attend(
        q,
        k,
        v,
        causal=causal,
        key_padding_mask=key_padding_mask,
        backend=backend,
        dropout_p=dropout_p,
        need_weights=need_weights,
        scale=scale,
        window=window,
    )
