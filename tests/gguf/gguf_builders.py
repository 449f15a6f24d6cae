"""GGUF files written in the tests as llama.cpp's `convert_hf_to_gguf.py` writes them, from tiny
random `transformers` models: gguf-py's own HF → GGUF name map (`gguf.get_tensor_name_map`),
llama's q/k rows permuted (`LlamaModel.permute`), GPT-2's Conv1D weights transposed and its head
written out, 2-D weights quantized by gguf-py, norms and biases F32; and the vocabularies:
byte-level BPE (trained here) and SentencePiece-style (pieces with scores, byte tokens).
Independent of decoderlm's own mapping, which the tests check against transformers' GGUF loader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType as T

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome!",
    "def add(a, b):\n    return a + b  # 12345 + 678 = 13023\n\n",
    "    indented    text\twith\ttabs\n\n\n  and   runs   of   spaces  ",
    "Ünïcödé: naïve café, 東京, Москва, 🙂👍 — “quotes” and ‘single’ ones.",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 3.14; }",
    "I'm sure you'll see they've done it; it's 2024-05-17 at 09:30.",
] * 3
SAMPLES = [
    "The capital of France is",
    "def f(x):\n    return x ** 2  # 1234567890",
    "   leading spaces and\ttabs\n\n\nnew   lines   ",
    "naïve café 東京 🙂 Ünïcödé",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "digits 3.14159 and 1,000,000 and 2024",
    "I'm, you'll, they've DONE it",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n'"
    " }}{% endif %}"
)


@dataclass
class Vocab:
    """What a GGUF file says of its tokenizer."""

    model: str  # "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    pre: str = "default"
    bos: int | None = None
    eos: int | None = None
    add_bos: bool | None = None
    chat_template: str | None = CHATML

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.model == "gpt2":
            w.add_tokenizer_pre(self.pre)
            w.add_token_merges(self.merges)
        else:
            w.add_token_scores(self.scores)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.bos is not None:
            w.add_bos_token_id(self.bos)
        if self.eos is not None:
            w.add_eos_token_id(self.eos)
        if self.add_bos is not None:
            w.add_add_bos_token(self.add_bos)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)


def bpe_vocab(pre: str = "smollm", size: int = 400) -> Vocab:
    """A byte-level BPE trained on CORPUS, specials first (ids 0-2, typed control)."""
    from decoderlm.gguf.tokenizer import PRE_TOKENIZERS

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return Vocab("gpt2", tokens, types, merges=merges, pre=pre, bos=1, eos=2, add_bos=False)


def spm_vocab(size: int = 400) -> Vocab:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then pieces
    ("▁" for a space) of a BPE trained on CORPUS, each scored by its rank (earlier is better)."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=size, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    vocab = backend.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return Vocab("llama", tokens, types, scores=scores, bos=1, eos=2, add_bos=True)


def write_gguf(
    path: Path,
    hf_model: torch.nn.Module,
    arch: str,
    vocab: Vocab,
    qtype: T = T.F32,
    types: dict[str, T] | None = None,
    name: str = "tiny",
    extra: dict[str, np.ndarray] | None = None,
    raw: dict[str, tuple[np.ndarray, T]] | None = None,
) -> Path:
    """`hf_model` as llama.cpp's converter writes it: 2-D weights in `qtype` (or `types[name]`),
    the rest F32; the `extra` tensors (F32), such as llama.cpp's `rope_freqs`; and in place of a
    tensor, `raw[name]`: its rows of blocks (bytes) of a type (K-quants, which gguf-py cannot
    quantize)."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    if arch == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(head_dim)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_vocab_size(cfg.vocab_size)
    vocab.write(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    state = hf_model.state_dict()
    tied = cfg.tie_word_embeddings and arch != "gpt2"
    for hf_name, tensor in state.items():
        if (tied and hf_name == "lm_head.weight") or hf_name.endswith(
            (".attn.bias", "masked_bias")
        ):
            continue
        base, suffix = hf_name.rsplit(".", 1)
        new = f"{names.get_name(base)}.{suffix}"
        data = tensor.detach().float().numpy()
        if arch == "gpt2" and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            data = data.T  # Conv1D (in, out) → (out, in)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            data = permute(data, heads)
        kind = (types or {}).get(new, qtype)
        if data.ndim != 2 or data.shape[-1] % 32:
            kind = T.F32
        if new in (raw or {}):
            blocks, kind = raw[new]
            w.add_tensor(new, blocks, raw_dtype=kind)
            continue
        w.add_tensor(new, gguf.quants.quantize(np.ascontiguousarray(data), kind), raw_dtype=kind)
    for extra_name, values in (extra or {}).items():
        w.add_tensor(extra_name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows from rotate-half to interleaved order."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights N(0, 0.2²), norm gains 1 + N(0, 0.2²) (as tests/test_hf.py: so that every part moves
    the logits by O(1))."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * 0.2
            p.copy_(
                noise
                + (
                    1.0
                    if "norm" in name
                    or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
                    else 0.0
                )
            )
    return model.eval()
