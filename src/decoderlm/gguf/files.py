"""GGUF files as decoderlm models: `load_gguf` reads one into a DecoderLM and its Tokenizer;
`import_gguf` writes them as a run directory (`decoderlm convert --from-gguf`).

The model is built on the meta device, so nothing is allocated for weights the file holds; each
tensor then comes from the memory-mapped file:

- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16 and BF16 weights of the linear layers and of the token
  embedding stay in their blocks (`decoderlm.quant.BlockLinear`, `BlockEmbedding`), a view of the
  file where no rows are reordered or joined (q, k and v are joined into our fused projection);
  a tied head reads the embedding's blocks;
- F32 tensors are views of the file too;
- K-quants (Q2_K … Q6_K) are dequantized by gguf-py to float32, with a one-line note: float32
  is what gguf-py's `dequantize` gives and what transformers' GGUF loader runs, so the logits are
  the reference's; `--dtype bfloat16` halves them;
- any other type is a one-line error listing the supported ones.

Every tensor's shape is checked against the one the metadata implies, and a tensor the metadata
does not account for is an error, as in `decoderlm.hf.state_dict_from_hf`.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor, nn

from decoderlm import checkpoint
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write, write_json
from decoderlm.gguf.config import ROPE_FREQS, read_config
from decoderlm.gguf.reader import GGUFFile, open_gguf
from decoderlm.gguf.tensors import Rule, llama_rows, part_heads, qkv_rows, rules
from decoderlm.gguf.tokenizer import read_chat_template, tokenizer_from_gguf
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.quant.apply import materialize, quantization_of, set_module
from decoderlm.quant.blocks import (
    BLOCK_TYPES,
    BlockEmbedding,
    BlockLinear,
    dequantize_rows,
)
from decoderlm.quant.io import save_quantized
from decoderlm.tokenizer import TOKENIZER_CONFIG, Tokenizer

log = logging.getLogger(__name__)

KEPT_TYPES = tuple(BLOCK_TYPES)  # stay in their blocks
DEQUANTIZED_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # to float32 when loaded
SUPPORTED_TYPES = ("F32", *KEPT_TYPES, *DEQUANTIZED_TYPES)


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file, without reading its tensors."""
    return read_config(open_gguf(path))


def load_gguf(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[DecoderLM, Tokenizer]:
    """(model in eval mode, tokenizer) of a GGUF file; `dtype` casts the float tensors (the
    blocks stay as they are)."""
    file = open_gguf(path)
    config = read_config(file)
    tokenizer = tokenizer_from_gguf(file)
    model = build_model(file, config)
    model.to(device=device, dtype=dtype)
    return model.eval(), tokenizer


def import_gguf(path: str | Path, run_dir: str | Path) -> Path:
    """A run directory of the GGUF file: its blocks kept (a quantized run, `decoderlm.quant.io`),
    tokenizer.json, and tokenizer_config.json with the special tokens and the chat template."""
    model, tokenizer = load_gguf(path)
    run_dir = Path(run_dir)
    if quantization_of(model) is None:  # an F32 file
        checkpoint.save_model(run_dir, model, tokenizer)
    else:
        save_quantized(run_dir, model)
        atomic_write(run_dir / checkpoint.TOKENIZER_FILE, lambda tmp: tokenizer.save(tmp))
    source = read_chat_template(path)[0]
    texts = {
        key: tokenizer.backend.id_to_token(i)
        for key, i in (("bos_token", tokenizer.special.bos), ("eos_token", tokenizer.special.eos),
                       ("pad_token", tokenizer.special.pad))
        if i is not None
    }  # fmt: skip
    write_json(
        run_dir / TOKENIZER_CONFIG, {**texts, **({"chat_template": source} if source else {})}
    )
    return run_dir


def build_model(file: GGUFFile, config: ModelConfig) -> DecoderLM:
    """The DecoderLM of `config` holding the file's tensors (see the module docstring)."""
    tensors = file.tensors
    _check_types(file, tensors)
    with torch.device("meta"):  # shapes only: the file holds the weights
        model = DecoderLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    floats: dict[str, Tensor] = {}
    dequantized: Counter[str] = Counter()
    used = {ROPE_FREQS}  # read by the config (Llama 3's RoPE scaling)
    for rule in rules(config, file.architecture):
        parts = [_tensor(file, tensors, name) for name in rule.theirs]
        used.update(rule.theirs)
        _check_shapes(file, rule, parts, shapes[rule.ours], config)
        module_name, _, param = rule.ours.rpartition(".")
        module = model.get_submodule(module_name)
        kinds = {p.tensor_type.name for p in parts}
        kind = kinds.pop() if len(kinds) == 1 else None
        if (
            param == "weight"
            and isinstance(module, nn.Linear | nn.Embedding)
            and kind in KEPT_TYPES
        ):
            _swap(model, module_name, module, kind, _join(rule, [_raw(p) for p in parts], config))
        else:
            floats[rule.ours] = _join(rule, [_floats(p) for p in parts], config)
            dequantized.update(
                p.tensor_type.name for p in parts if p.tensor_type.name in DEQUANTIZED_TYPES
            )
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise DecoderLMError(
            f"{file.path} has {len(unexpected)} tensor(s) its metadata does not account for, "
            f"e.g. {unexpected[0]!r}"
        )
    materialize(model, floats)
    if dequantized:
        count, kinds = sum(dequantized.values()), ", ".join(sorted(dequantized))
        log.warning(
            f"{file.path.name}: {count} tensors of {kinds} dequantized to float32 (decoderlm keeps "
            f"{', '.join(KEPT_TYPES)} in their blocks); --dtype bfloat16 halves them"
        )
    return model


def _check_types(file: GGUFFile, tensors: dict[str, Any]) -> None:
    for name, t in tensors.items():
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise DecoderLMError(
                f"{file.path}: tensor {name!r} has type {t.tensor_type.name}, which decoderlm does "
                f"not read; supported: {', '.join(SUPPORTED_TYPES)}"
            )


def _tensor(file: GGUFFile, tensors: dict[str, Any], name: str) -> Any:
    if name not in tensors:
        raise DecoderLMError(f"{file.path} has no tensor {name!r}, which its metadata implies")
    return tensors[name]


def _shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF stores dims fastest-moving first)."""
    return tuple(int(d) for d in reversed(t.shape))


def _check_shapes(
    file: GGUFFile, rule: Rule, parts: list[Any], ours: tuple[int, ...], config: ModelConfig
) -> None:
    wants = [ours] if rule.kind == "copy" else [(n, *ours[1:]) for n in qkv_rows(config)]
    for name, part, want in zip(rule.theirs, parts, wants, strict=True):
        if _shape(part) != want:
            raise DecoderLMError(
                f"{file.path}: tensor {name!r} has shape {_shape(part)}; the metadata implies {want}"
            )


def _raw(t: Any) -> Tensor:
    """A kept tensor's rows of blocks (rows, row bytes) uint8: a view of the file."""
    shape = _shape(t)
    rows = int(np.prod(shape[:-1]))
    return torch.from_numpy(t.data.view(np.uint8).reshape(rows, -1))


def _floats(t: Any) -> Tensor:
    """A tensor's values in float32: F32 a view of the file, the others dequantized."""
    shape, kind = _shape(t), t.tensor_type.name
    if kind == "F32":
        return torch.from_numpy(t.data).view(shape)
    if kind in KEPT_TYPES:
        return dequantize_rows(_raw(t), kind, shape[-1]).view(shape)
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).view(shape)


def _join(rule: Rule, parts: list[Tensor], config: ModelConfig) -> Tensor:
    """Our tensor from the GGUF parts (rows: blocks or floats): one as it is, or q, k, v joined,
    llama's q and k rows put back in rotate-half order."""
    if rule.kind == "copy":
        return parts[0]
    if rule.permuted:  # q and k: GGUF row r is our row llama_rows[r]
        for i, heads in enumerate(part_heads(config)[:2]):
            parts[i] = parts[i][torch.argsort(llama_rows(heads, config.head_dim))]
    return torch.cat(parts, dim=0)


def _swap(model: DecoderLM, name: str, module: nn.Module, kind: str, blocks: Tensor) -> None:
    """Put a BlockLinear or BlockEmbedding holding `blocks` where `module` is."""
    if isinstance(module, nn.Embedding):
        new: nn.Module = BlockEmbedding(module.num_embeddings, module.embedding_dim, kind, blocks)
    else:
        bias = module.bias is not None
        new = BlockLinear(module.in_features, module.out_features, kind, bias, blocks)
    set_module(model, name, new)
