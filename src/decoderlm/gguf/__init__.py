"""GGUF files (llama.cpp's format): read one as a decoderlm model, tokenizer and chat template.

The adapter lives outside the model, each field mapping written once:

- `reader`: the file, opened with gguf-py's `GGUFReader` (memory-mapped), every declared size
  checked against the file;
- `config`: metadata ↔ the Hugging Face config.json it stands for, which `decoderlm.hf` maps to a
  ModelConfig (RoPE scaling included);
- `tensors`: GGUF tensor names and layouts ↔ ours, one table for both directions;
- `tokenizer`: `tokenizer.ggml.*` ↔ a `tokenizers.Tokenizer`;
- `files`: `load_gguf`, whose quantized weights stay in their blocks (`decoderlm.quant.blocks`),
  and `import_gguf` (a run directory);
- `writer`: `export_gguf`, a model and tokenizer as a GGUF file llama.cpp and transformers read.

    model, tokenizer = decoderlm.gguf.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tokenizer = decoderlm.load("SmolLM2-135M-Instruct.Q4_1.gguf")  # the same
    decoderlm.gguf.export_gguf(model, tokenizer, "copy.gguf")  # its blocks byte for byte
"""

from decoderlm.gguf.files import (
    DEQUANTIZED_TYPES,
    KEPT_TYPES,
    SUPPORTED_TYPES,
    import_gguf,
    load_gguf,
    read_gguf_config,
)
from decoderlm.gguf.reader import GGUFFile, open_gguf
from decoderlm.gguf.tokenizer import read_chat_template
from decoderlm.gguf.writer import TYPES, export_gguf

__all__ = [
    "DEQUANTIZED_TYPES",
    "KEPT_TYPES",
    "SUPPORTED_TYPES",
    "TYPES",
    "GGUFFile",
    "export_gguf",
    "import_gguf",
    "load_gguf",
    "open_gguf",
    "read_chat_template",
    "read_gguf_config",
]
