"""The seeds: the decoder's mechanisms, and nothing of training, serving, Hugging Face or the CLI.

config (ModelConfig + presets), attention (the SDPA formula, MHA/GQA/MQA, sliding windows,
backend dispatch), positional (sinusoidal, learned, RoPE + scaling), layers (norms, MLPs), block
(Pre-LN / Post-LN), lm (DecoderLM), kv_cache (static cache), ring_cache (sliding-window cache),
int8_cache (int8 K/V), flash (FlashAttention-2 in PyTorch), kernels/ (Triton).
This package imports nothing of decoderlm outside itself but `decoderlm.errors` (import-linter
checks it: pyproject.toml).
"""

from decoderlm.model.config import PRESETS, ModelConfig
from decoderlm.model.lm import DecoderLM, next_token_loss

__all__ = ["PRESETS", "DecoderLM", "ModelConfig", "next_token_loss"]
