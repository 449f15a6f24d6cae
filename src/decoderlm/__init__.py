"""decoderlm: decoder-only Transformer language models, from the attention formula to a working LM.

`import decoderlm` loads the model (torch and `decoderlm.model`) only. The names that need more —
`generate` (the CPU speed paths, torch.compile), `Engine` (the serving engine), `load` — are
imported on first use (PEP 562 `__getattr__`), so a script that only builds a model starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from decoderlm.compiler_cache import separate_compiler_cache

separate_compiler_cache()  # first: the imports below ask Inductor where its cache is

from decoderlm.errors import ConfigError, DecoderLMError  # noqa: E402
from decoderlm.model import PRESETS, DecoderLM, ModelConfig, next_token_loss  # noqa: E402
from decoderlm.model.attention import scaled_dot_product_attention  # noqa: E402
from decoderlm.model.flash import flash_attention  # noqa: E402

if TYPE_CHECKING:
    from decoderlm.engine.engine import Engine
    from decoderlm.engine.types import RequestParams
    from decoderlm.inference.generate import generate
    from decoderlm.inference.sampling import SamplingParams
    from decoderlm.loading import load

__version__ = "0.1.0"

# name → the module that defines it, imported when the name is first asked for.
_LAZY = {
    "generate": "decoderlm.inference.generate",
    "SamplingParams": "decoderlm.inference.sampling",
    "load": "decoderlm.loading",
    "Engine": "decoderlm.engine.engine",
    "RequestParams": "decoderlm.engine.types",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'decoderlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next lookup finds it without calling this
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


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
