"""decoderlm: decoder-only Transformer language models, from the attention formula to a working LM."""

from decoderlm.config import PRESETS, ModelConfig
from decoderlm.errors import ConfigError, DecoderLMError
from decoderlm.generate import generate
from decoderlm.loading import load
from decoderlm.model import DecoderLM, next_token_loss

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ConfigError",
    "DecoderLM",
    "DecoderLMError",
    "ModelConfig",
    "__version__",
    "generate",
    "load",
    "next_token_loss",
]
