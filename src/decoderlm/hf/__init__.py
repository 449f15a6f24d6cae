"""Hugging Face interop: import GPT-2 / Llama / Mistral / Qwen2 / Qwen3 / Mamba-2 / Bamba / Qwen3.5
checkpoints, export ours.

The adapter lives outside the model, which knows nothing of HF names:

- `config`: HF config.json ↔ `ModelConfig` (transformers v4 and v5 layouts); `recurrent` for the
  recurrent and hybrid families, `fields` for what every family reads alike;
- `weights`: HF state dict ↔ ours (names, GPT-2's transposed Conv1D, the fused q|k|v projection);
- `files`: HF directories on disk (safetensors, shards, opt-in pickle, tokenizer files).

    model, tokenizer = decoderlm.hf.load_hf("path/to/hf_dir")
    hf_config, hf_state = decoderlm.hf.to_hf(model)          # e.g. to build LlamaForCausalLM
    decoderlm.hf.export_hf("runs/mine", "exported/")         # from_pretrained("exported/") works
"""

from decoderlm.hf.config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf, hf_model_type
from decoderlm.hf.files import (
    export_hf,
    import_hf,
    is_hf_checkpoint,
    load_hf,
    read_hf_config,
    read_hf_weights,
    to_hf,
)
from decoderlm.hf.weights import state_dict_from_hf, state_dict_to_hf

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "export_hf",
    "hf_model_type",
    "import_hf",
    "is_hf_checkpoint",
    "load_hf",
    "read_hf_config",
    "read_hf_weights",
    "state_dict_from_hf",
    "state_dict_to_hf",
    "to_hf",
]
