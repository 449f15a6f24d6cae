"""Weight-only quantization for inference: int8 per output channel, int4 per group of inputs, and
bfloat16 weights under float32 activations.

The weights of every nn.Linear are stored as small integers and a float scale, and are turned
back into floats inside the matmul; activations, the KV cache, norms and the embedding lookup stay
in floating point (weight-only quantization, as in gpt-fast's `WeightOnlyInt8QuantHandler` and
llama.cpp's Q8_0 / Q4 formats; Dettmers et al., 2022, and Frantar et al., 2023, on its accuracy).

- `linear`: `Int8Linear`, `Int4Linear` and `Bf16Linear`, the modules holding the quantized weights;
- `blocks`: `BlockLinear` and `BlockEmbedding`, weights in ggml's block formats (Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1, F16, BF16) as a GGUF file stores them (`decoderlm.gguf` loads them);
- `apply`: `quantize(model, to, group_size)`, which swaps a model's nn.Linear modules from outside;
- `io`: quantized run directories (`save_quantized`, `load_quantized`).

    model, tokenizer = decoderlm.load("runs/mine")
    quantize(model, to="int4", group_size=64)
    save_quantized("runs/mine-int4", model, tokenizer_file="runs/mine/tokenizer.json")
    model, tokenizer = decoderlm.load("runs/mine-int4")      # generate, eval, serve as usual
"""

from decoderlm.quant.apply import quantization_of, quantize
from decoderlm.quant.blocks import BlockEmbedding, BlockLinear
from decoderlm.quant.io import load_quantized, save_quantized
from decoderlm.quant.linear import Bf16Linear, Int4Linear, Int8Linear

__all__ = [
    "Bf16Linear",
    "BlockEmbedding",
    "BlockLinear",
    "Int4Linear",
    "Int8Linear",
    "load_quantized",
    "quantization_of",
    "quantize",
    "save_quantized",
]
