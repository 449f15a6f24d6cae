"""Dtype names: the one table from the names a user types to torch dtypes.

Every `--dtype` flag and `dtype=` argument goes through `parse_dtype`; training's "auto" (bf16
where it is fast, else fp32) is resolved for a device in `decoderlm.training.runtime`.
"""

from __future__ import annotations

import torch

from decoderlm.errors import DecoderLMError

# The short names first: error messages list them in this order.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype named `dtype` ("fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DecoderLMError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
