"""Hugging Face state dict ↔ ours: one table of name rules serves both directions and shape checks.

Our attention has one fused projection, rows [q (n_heads·hd) | k (n_kv·hd) | v (n_kv·hd)]; the Llama
family stores q_proj/k_proj/v_proj apart and GPT-2 stores one c_attn. GPT-2's `Conv1D` keeps weights
as (in, out), the transpose of `nn.Linear`. RoPE is rotate-half in both HF and here, so no row
permutation is needed (unlike Meta's original Llama checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM

# Buffers some HF checkpoints carry that are not weights: GPT-2's causal-mask buffers, old RoPE tables.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


@dataclass(frozen=True)
class Rule:
    """Our tensor `ours` ↔ HF tensors `theirs`: "copy" (same), "t" (Conv1D transpose), "split" (fused qkv)."""

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"


def rules(config: ModelConfig) -> list[Rule]:
    """The name rules of the HF family our config maps onto (GPT-2 for learned positions, else Llama)."""
    return _gpt2_rules(config) if config.position == "learned" else _llama_rules(config)


def _gpt2_rules(c: ModelConfig) -> list[Rule]:
    out = [
        Rule("tok_emb.weight", ("transformer.wte.weight",)),
        Rule("pos_emb.weight", ("transformer.wpe.weight",)),
    ]
    for i in range(c.n_layers):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, kind in (
            ("norm1", "ln_1", "copy"),
            ("norm2", "ln_2", "copy"),
            ("attn.qkv", "attn.c_attn", "t"),
            ("attn.proj", "attn.c_proj", "t"),
            ("mlp.up", "mlp.c_fc", "t"),
            ("mlp.down", "mlp.c_proj", "t"),
        ):
            out.append(Rule(f"{ours}{a}.weight", (f"{hf}{b}.weight",), kind))
            out.append(Rule(f"{ours}{a}.bias", (f"{hf}{b}.bias",)))
    out += [
        Rule("norm.weight", ("transformer.ln_f.weight",)),
        Rule("norm.bias", ("transformer.ln_f.bias",)),
    ]
    if not c.tie_embeddings:
        out.append(Rule("head.weight", ("lm_head.weight",)))
    return out


def _llama_rules(c: ModelConfig) -> list[Rule]:
    out = [Rule("tok_emb.weight", ("model.embed_tokens.weight",))]
    for i in range(c.n_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        qkv = tuple(f"{hf}self_attn.{p}_proj" for p in "qkv")
        out.append(Rule(f"{ours}attn.qkv.weight", tuple(f"{n}.weight" for n in qkv), "split"))
        if c.qkv_bias:
            out.append(Rule(f"{ours}attn.qkv.bias", tuple(f"{n}.bias" for n in qkv), "split"))
        linears = [("attn.proj", "self_attn.o_proj")]
        linears += [(f"mlp.{p}", f"mlp.{p}_proj") for p in ("gate", "up", "down")]
        for a, b in linears:
            out.append(Rule(f"{ours}{a}.weight", (f"{hf}{b}.weight",)))
            if c.bias:
                out.append(Rule(f"{ours}{a}.bias", (f"{hf}{b}.bias",)))
        norms = [("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")]
        if c.qk_norm:
            norms += [("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")]
        out += [Rule(f"{ours}{a}.weight", (f"{hf}{b}.weight",)) for a, b in norms]
    out.append(Rule("norm.weight", ("model.norm.weight",)))
    if not c.tie_embeddings:
        out.append(Rule("head.weight", ("lm_head.weight",)))
    return out


def _qkv_sizes(c: ModelConfig) -> list[int]:
    return [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]


def _to_theirs(rule: Rule, tensor: Tensor, c: ModelConfig) -> list[Tensor]:
    if rule.kind == "t":
        return [tensor.t().contiguous()]  # (out, in) → Conv1D (in, out)
    if rule.kind == "split":
        return [part.clone() for part in tensor.split(_qkv_sizes(c), dim=0)]  # [q | k | v] rows
    return [tensor]


def _to_ours(rule: Rule, tensors: list[Tensor]) -> Tensor:
    if rule.kind == "t":
        return tensors[0].t().contiguous()
    if rule.kind == "split":
        return torch.cat(tensors, dim=0)
    return tensors[0]


def state_dict_to_hf(state: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Our weights (as stored: a tied head absent or ignored) → HF names and layouts."""
    out: dict[str, Tensor] = {}
    for rule in rules(config):
        out.update(zip(rule.theirs, _to_theirs(rule, state[rule.ours], config), strict=True))
    return out


def state_dict_from_hf(
    hf_state: Mapping[str, Tensor], config: ModelConfig, source: str = "the checkpoint"
) -> dict[str, Tensor]:
    """HF weights → our names, checking every tensor is present and has the shape `config` implies.

    The HF shapes expected are our parameter shapes sent through the same rules. Unknown tensors are
    an error too: they mean the config and the weights disagree.
    """
    hf_state = _normalise_names(hf_state, config)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        our_shapes = {k: v.shape for k, v in DecoderLM(config).state_dict().items()}
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for rule in rules(config):
        expected = _to_theirs(rule, torch.empty(our_shapes[rule.ours], device="meta"), config)
        tensors = []
        for name, want in zip(rule.theirs, expected, strict=True):
            if name not in hf_state:
                raise DecoderLMError(f"tensor {name!r} is missing from {source}")
            if hf_state[name].shape != want.shape:
                raise DecoderLMError(
                    f"tensor {name!r} in {source} has shape {tuple(hf_state[name].shape)}; "
                    f"config.json implies {tuple(want.shape)}"
                )
            tensors.append(hf_state[name])
            used.add(name)
        out[rule.ours] = _to_ours(rule, tensors)
    unexpected = sorted(
        n
        for n in set(hf_state) - used
        if not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and config.tie_embeddings)
    )
    if unexpected:
        raise DecoderLMError(
            f"{source} has {len(unexpected)} tensor(s) that config.json does not account for, "
            f"e.g. {unexpected[0]!r}"
        )
    return out


def _normalise_names(hf_state: Mapping[str, Tensor], config: ModelConfig) -> Mapping[str, Tensor]:
    """GPT-2 checkpoints exist with and without the `transformer.` prefix (GPT2Model vs GPT2LMHeadModel)."""
    if config.position != "learned" or any(k.startswith("transformer.") for k in hf_state):
        return hf_state
    return {k if k == "lm_head.weight" else f"transformer.{k}": v for k, v in hf_state.items()}
