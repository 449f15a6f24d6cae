"""decoderlm: decoder-only Transformer language models, from the attention formula to a working LM."""

from decoderlm import generate  # a callable module: decoderlm.generate(model, prompt, ...)
from decoderlm.config import PRESETS, ModelConfig
from decoderlm.errors import ConfigError, DecoderLMError
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
