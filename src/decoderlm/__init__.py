"""decoderlm: decoder-only Transformer language models, from the attention formula to a working LM."""

from decoderlm.errors import ConfigError, DecoderLMError
from decoderlm.inference.generate import generate
from decoderlm.inference.sampling import SamplingParams
from decoderlm.loading import load
from decoderlm.model import PRESETS, DecoderLM, ModelConfig, next_token_loss
from decoderlm.model.attention import scaled_dot_product_attention
from decoderlm.model.flash import flash_attention
from decoderlm.serving.engine import Engine
from decoderlm.serving.types import RequestParams

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ConfigError",
    "DecoderLM",
    "DecoderLMError",
    "Engine",
    "ModelConfig",
    "RequestParams",
    "SamplingParams",
    "__version__",
    "flash_attention",
    "generate",
    "load",
    "next_token_loss",
    "scaled_dot_product_attention",
]
