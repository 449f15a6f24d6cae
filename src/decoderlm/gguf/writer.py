"""Writing a checkpoint as a GGUF file in llama.cpp's layout (`decoderlm convert --to-gguf`).

The metadata is the architecture's (`config.gguf_metadata`: our config's config.json through the
same field table the reader uses), the tokenizer's (`tokenizer.tokenizer_metadata`) and the chat
template; the tensors go through the reader's rules the other way (q, k and v split, llama's q and
k rows permuted back to interleaved order). As llama.cpp's converter does, 1-D tensors (norms,
biases) are F32 and the 2-D weights take the file type: `TYPES`, quantized by gguf-py. Weights the
model already holds in ggml blocks (a model loaded from a GGUF file) are written as they are, byte
for byte, unless another type is asked for; then they are dequantized and quantized again.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write
from decoderlm.gguf.config import ROPE_FREQS, gguf_metadata
from decoderlm.gguf.tensors import llama_rows, part_heads, qkv_rows, rules
from decoderlm.gguf.tokenizer import tokenizer_metadata
from decoderlm.model.lm import DecoderLM
from decoderlm.quant.blocks import BlockEmbedding, BlockLinear
from decoderlm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# --type → (the 2-D weights' ggml type, general.file_type)
TYPES = {
    "f32": (T.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (T.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (T.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (T.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (T.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
}
_FILE_TYPES = {kind: file_type for kind, file_type in TYPES.values()} | {
    T.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    T.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
}


def export_gguf(
    model: DecoderLM,
    tokenizer: Tokenizer,
    out: str | Path,
    type_name: str | None = None,
    name: str = "decoderlm",
    chat_template: str | None = None,
) -> Path:
    """Write `model` and `tokenizer` as the GGUF file `out` (atomically); `type_name` one of
    TYPES, None: blocks as they are and the float weights in F32."""
    check_type(type_name)
    arch, meta, rope_freqs = gguf_metadata(model.config, name)
    meta.update(tokenizer_metadata(tokenizer))
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    tensors = list(_tensors(model, arch, None if type_name is None else TYPES[type_name][0]))
    if rope_freqs is not None:
        tensors.append((ROPE_FREQS, rope_freqs.numpy(), T.F32))
    counts = Counter(kind for _, data, kind in tensors if data.ndim == 2)
    meta["general.file_type"] = int(_FILE_TYPES.get(counts.most_common(1)[0][0], 0))
    meta["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    out = Path(out)
    atomic_write(out, lambda tmp: _write(tmp, arch, meta, tensors))
    return out


def check_type(type_name: str | None) -> None:
    if type_name is not None and type_name not in TYPES:
        raise DecoderLMError(f"--type {type_name!r} must be one of {', '.join(TYPES)}")


def _write(path: Path, arch: str, meta: dict[str, Any], tensors: list[tuple[str, Any, T]]) -> None:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        _add(writer, key, value)
    for name, data, kind in tensors:
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata entry, typed as llama.cpp types it (counts UINT32, token types INT32)."""
    V = gguf.GGUFValueType
    if isinstance(value, list):
        item = V.STRING if value and isinstance(value[0], str) else V.INT32
        writer.add_key_value(key, value, V.ARRAY, sub_type=item)
    elif isinstance(value, bool):
        writer.add_key_value(key, value, V.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, V.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, V.FLOAT32)
    else:
        writer.add_key_value(key, str(value), V.STRING)


def _tensors(model: DecoderLM, arch: str, kind: T | None) -> Any:
    """(GGUF name, data, ggml type) of every tensor: our tensors through the rules."""
    state = model.state_dict()
    for rule in rules(model.config, arch):
        module_name, _, param = rule.ours.rpartition(".")
        module = model.get_submodule(module_name)
        if param == "weight" and isinstance(module, BlockLinear | BlockEmbedding):
            source, held = module.blocks, T[module.ggml_type]
            if kind not in (None, held):  # another type asked for: through floats
                source, held = (
                    module.dequantized() if isinstance(module, BlockLinear) else module.weight,
                    None,
                )
        else:
            source, held = state[rule.ours].detach().float(), None
        for name, part in zip(rule.theirs, _parts(rule, source, model), strict=True):
            yield name, *_encode(name, part, held, kind)


def _parts(rule: Any, tensor: torch.Tensor, model: DecoderLM) -> list[torch.Tensor]:
    """Our tensor (rows of floats or of blocks) as the GGUF parts: itself, or q, k, v with
    llama's q and k rows in interleaved order."""
    if rule.kind == "copy":
        return [tensor]
    parts = list(tensor.split(qkv_rows(model.config), dim=0))
    if rule.permuted:
        for i, heads in enumerate(part_heads(model.config)[:2]):
            parts[i] = parts[i][llama_rows(heads, model.config.head_dim)]
    return parts


def _encode(name: str, part: torch.Tensor, held: T | None, kind: T | None) -> tuple[Any, T]:
    """(data, ggml type): blocks as they are; floats 1-D in F32, 2-D in `kind` (F32 when None,
    or when the rows do not split into its blocks)."""
    if held is not None:
        return part.contiguous().numpy(), held
    values = np.ascontiguousarray(part.numpy(), dtype=np.float32)
    target = T.F32 if kind is None or values.ndim != 2 else kind
    block = gguf.GGML_QUANT_SIZES[target][0]
    if values.shape[-1] % block:
        log.warning(f"{name}: rows of {values.shape[-1]} are not {target.name} blocks; written F32")
        target = T.F32
    return gguf.quants.quantize(values, target), target
