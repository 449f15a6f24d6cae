"""The model a training run starts from, and what its checkpoints keep of it.

- A new run: a `DecoderLM` of the run's config, randomly initialised.
- `--init-from SOURCE` (fine-tuning): SOURCE is anything `decoderlm.load` reads (a run or Hugging
  Face directory, a quantized run, a GGUF file or a model's name). Full fine-tuning trains every weight in float32, so a
  quantized source is dequantized first (`decoderlm.lora.merged_state_dict`); the model takes the
  run's config, whose free fields (context_length, rope_scaling) may differ from SOURCE's.
- LoRA (`TrainConfig.lora_rank` > 0): the base stays as loaded (a quantized one stays quantized:
  QLoRA) and frozen, and adapters train (`decoderlm.lora.apply_lora`). A resumed LoRA run finds
  its base in the checkpoint's adapter_config.json.

Checkpoints of a LoRA run store the merged float model as model.safetensors, so that every
checkpoint and the run itself are plain runs (generate, chat, serve, convert), and the adapters
beside it (adapter.safetensors, adapter_config.json), which the exact resume reads back onto the
base.
"""

from __future__ import annotations

from pathlib import Path

import torch

from decoderlm import checkpoint, lora
from decoderlm.chat_template import TOKENIZER_CONFIG_FILE
from decoderlm.loading import checkpoint_path, load
from decoderlm.model.lm import DecoderLM
from decoderlm.quant import quantization_of
from decoderlm.training.run import Run


def base_of(run: Run) -> str | None:
    """The source of the run's starting weights: init_from, or for a resumed LoRA run the base
    its checkpoint names (None: random weights, or a resumed full run's own checkpoint)."""
    if run.checkpoint is not None:
        if run.train_config.lora_rank:
            return lora.read_adapter_config(run.checkpoint)["base"]
        return None
    return None if run.init_from is None else str(checkpoint_path(run.init_from).resolve())


def initial_model(run: Run) -> DecoderLM:
    """The model the run trains (see the module docstring), adapters applied under LoRA."""
    cfg = run.train_config
    base = base_of(run)
    if base is None:
        model = DecoderLM(run.model_config)
    else:
        model = _base_model(base, run, keep_quantized=bool(cfg.lora_rank))
    if cfg.lora_rank:
        lora.apply_lora(
            model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_names
        )
    return model


def _base_model(source: str, run: Run, keep_quantized: bool) -> DecoderLM:
    """SOURCE's model: as loaded when it is quantized and kept so, else a float32 DecoderLM of the
    run's config holding its (dequantized) weights."""
    loaded, _ = load(source)
    if keep_quantized and quantization_of(loaded) is not None:
        return loaded
    model = DecoderLM(run.model_config)
    model.load_state_dict(lora.merged_state_dict(loaded))
    return model


def stored_weights(model: DecoderLM, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint stores as model.safetensors: the model's `full` state dict, or under LoRA
    the merged float model's."""
    return lora.merged_state_dict(model) if lora.has_lora(model) else full


def write_beside_weights(model: DecoderLM, directory: Path, out: Path, base: str | None) -> None:
    """The files a checkpoint holds besides the weights and trainer state: the adapters (LoRA) and
    the chat template's tokenizer_config.json (when the run has one)."""
    if lora.has_lora(model):
        lora.save_adapters(model, directory, base=base)
    config = out / TOKENIZER_CONFIG_FILE
    if config.is_file():
        (directory / TOKENIZER_CONFIG_FILE).write_bytes(config.read_bytes())


def publish_adapters(ckpt: Path, out: Path) -> None:
    """OUT/adapter.safetensors and adapter_config.json: the newest checkpoint's (LoRA runs)."""
    for name in (lora.ADAPTER_FILE, lora.ADAPTER_CONFIG_FILE):
        if (ckpt / name).is_file():
            checkpoint.publish(ckpt / name, out / name)


def resumed_weights(model: DecoderLM, ckpt: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """(the tensors to load from `ckpt`, whether they are the whole model): its weights, or under
    LoRA its adapters alone (the base is loaded already, and may be a read-only mapped file)."""
    if lora.has_lora(model):
        tensors = checkpoint.read_weights(ckpt / lora.ADAPTER_FILE)
        lora.load_adapter_tensors(model, tensors, ckpt / lora.ADAPTER_FILE)  # names and shapes
        return tensors, False
    weights = checkpoint.read_weights(ckpt / checkpoint.WEIGHTS_FILE)
    if model.config.tie_embeddings:
        weights["head.weight"] = weights["tok_emb.weight"]
    return weights, True
