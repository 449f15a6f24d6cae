"""The seeds: the decoder's mechanisms, and nothing of training, serving, Hugging Face or the CLI.

config (ModelConfig + presets), attention (the SDPA formula, MHA/GQA/MQA, backend dispatch), masks
(causal, sliding-window and padding masks), positional (sinusoidal, learned, RoPE + scaling), layers
(norms, MLPs), block (Pre-LN / Post-LN), lm (DecoderLM), the recurrent mixers (linear_attention,
gated_deltanet, mamba2, over scans and recurrent), cache/ (per-layer inference state: the
`LayerCache` contract, `CacheStep`, the static and ring KV caches, recurrent state, int8 storage,
their sizes), flash (FlashAttention-2 in PyTorch) and flash_inputs (its input checks), kernels/
(Triton).
This package imports nothing of decoderlm outside itself but `decoderlm.errors` (import-linter
checks it: pyproject.toml).
"""

from decoderlm.model.config import PRESETS, ModelConfig
from decoderlm.model.lm import DecoderLM, next_token_loss

__all__ = ["PRESETS", "DecoderLM", "ModelConfig", "next_token_loss"]
