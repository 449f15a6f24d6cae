"""DecoderLM: a decoder-only Transformer language model (Radford et al., 2018/2019; Touvron et al., 2023).

token embedding (+ absolute positions) → n_layers × Block → final norm → LM head. The model knows
nothing of training, distribution, checkpoints or Hugging Face names; those adapt it from outside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.block import Block
from decoderlm.model.cache.protocol import LayerCache
from decoderlm.model.config import ModelConfig
from decoderlm.model.layers import RMSNorm, make_norm
from decoderlm.model.positional import LearnedPositions, RotaryEmbedding, SinusoidalPositions


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d)
        self.pos_emb: nn.Module | None = None
        if config.position == "learned":
            self.pos_emb = LearnedPositions(config.context_length, d)
        elif config.position == "sinusoidal":
            self.pos_emb = SinusoidalPositions(config.context_length, d)
        self.rope = rotary_embedding(config)
        # Vaswani et al. (2017), §3.4: embeddings are multiplied by √d_model before adding the fixed
        # sinusoids, so that the table (values in [−1, 1]) does not drown the 0.02-scale embeddings.
        self.emb_scale = math.sqrt(d) if config.position == "sinusoidal" else 1.0
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        # Post-LN blocks already end in a norm; Pre-LN stacks need one before the head.
        self.norm = make_norm(config) if config.norm_placement == "pre" else nn.Identity()
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, init_std) everywhere, residual projections N(0, init_std/√(2·n_layers))."""
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith(("attn.proj", "mixer.out_proj", "mlp.down"))
                nn.init.normal_(
                    module.weight,
                    0.0,
                    std / math.sqrt(2 * self.config.n_layers) if is_residual else std,
                )
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding | LearnedPositions):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.constant_(module.weight, 1.0 - module.offset)  # a gain of 1

    def forward(
        self,
        idx: Tensor,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        kv_caches: Sequence[LayerCache] | None = None,
        causal: bool = True,
        last_only: bool = False,
        keep: Tensor | None = None,
    ) -> Tensor:
        """idx (B, T) token ids → logits (B, T, vocab_size).

        positions: (T,) or (B, T) absolute positions (default 0..T−1); needed with a KV cache and for
        left-padded batches. key_padding_mask: (B, Tk) bool, False for padding keys. kv_caches: one per layer.
        last_only: logits of the last position only, (B, 1, vocab_size): all that sampling needs.
        keep: (K,) positions whose logits are returned, (B, K, vocab_size): the tokens sampled from
        when several sequences' tokens lie in one row (vLLM's logits indices).
        """
        t = idx.shape[1]
        if positions is None:
            if t > self.config.context_length:
                raise DecoderLMError(
                    f"sequence length {t} exceeds context_length={self.config.context_length}"
                )
            positions = torch.arange(t, device=idx.device)  # (T,)
        x = self.tok_emb(idx) * self.emb_scale  # (B, T, d_model)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)  # (B, T, d_model)
        x = self.drop(x)
        rope = None
        if self.rope is not None:
            cos, sin = self.rope(positions)  # (T, hd) or (B, T, hd)
            rope = (cos.to(x.dtype), sin.to(x.dtype))
        for i, block in enumerate(self.blocks):
            x = block(
                x, rope, key_padding_mask, None if kv_caches is None else kv_caches[i], causal
            )
        if keep is not None:
            x = x[:, keep]  # (B, K, d_model)
        if last_only:
            x = x[:, -1:]  # (B, 1, d_model)
        return self.head(self.norm(x))  # (B, T, vocab_size)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (shared tensors once); optionally without token/position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel() if not self.config.tie_embeddings else 0
            n -= self.pos_emb.weight.numel() if isinstance(self.pos_emb, LearnedPositions) else 0
        return n

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> int:
        """Matmul FLOPs per token (Kaplan et al., 2020; PaLM appendix B): forward 2N + 4·L·H·hd·T,
        L the attention layers (a recurrent layer's scan is not counted).

        N counts the weights used in matmuls (the LM head included, tied or not); training is 3×
        the forward (backward = 2× forward).
        """
        cfg = self.config
        t = cfg.context_length if seq_len is None else seq_len
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        forward = 2 * n_matmul + 4 * cfg.n_attention_layers * cfg.n_heads * cfg.head_dim * t
        return 3 * forward if training else forward


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding | None:
    """The RoPE tables of `config` (None without RoPE): non-persistent buffers, which a model built
    on the meta device gets back from here."""
    if config.position != "rope":
        return None
    return RotaryEmbedding(
        config.context_length,
        config.rope_dim,
        config.rope_theta,
        config.rope_scaling,
        unbounded=config.decodes_past_context,
    )


def next_token_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy −log p(x_{t+1} | x_≤t) in ≥ float32; logits (B, T, V), targets (B, T)."""
    logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.flatten(), ignore_index=ignore_index)
