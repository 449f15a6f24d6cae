"""Hugging Face state dict ↔ ours: one table of name rules serves both directions and shape checks.

Our attention has one fused projection, rows [q (n_heads·hd) | k (n_kv·hd) | v (n_kv·hd)]; the Llama
family stores q_proj/k_proj/v_proj apart and GPT-2 stores one c_attn. GPT-2's `Conv1D` keeps weights
as (in, out), the transpose of `nn.Linear`. RoPE is rotate-half in both HF and here, so no row
permutation is needed (unlike Meta's original Llama checkpoints). Qwen3.5's q_proj holds each head's
query rows followed by its output-gate rows; ours holds all query rows, then all gate rows. The
recurrent mixers' parameters have transformers' names and layouts: copied under the family's prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.hf.recurrent import recurrent_family
from decoderlm.model.block import RECURRENT_MIXERS
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM

# Buffers some HF checkpoints carry that are not weights: GPT-2's causal-mask buffers, old RoPE tables.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
_QWEN3_5_NESTED = "model.language_model."  # a qwen3_5 checkpoint's language model
_QWEN3_5_DROPPED = ("model.visual.", "mtp.")


@dataclass(frozen=True)
class Rule:
    """Our tensor `ours` ↔ HF tensors `theirs`: "copy" (same), "t" (Conv1D transpose), "split"
    (fused qkv), "gated_split" (fused qkv with the output gate, Qwen3.5's q_proj head by head)."""

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"


def rules(config: ModelConfig) -> list[Rule]:
    """The name rules of the HF family our config maps onto: a recurrent family's
    (`recurrent_family`), else GPT-2 for learned positions, else Llama."""
    family = recurrent_family(config)
    if family is not None:
        return _pre_ln_rules(config, LAYOUTS[family])
    return (
        _gpt2_rules(config)
        if config.position == "learned"
        else _pre_ln_rules(config, LAYOUTS["llama"])
    )


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


@dataclass(frozen=True)
class Layout:
    """Where a Pre-LN family keeps its tensors: the prefix of the embedding, the layers and the final
    norm, and each block part's name (None: the family has no such part)."""

    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    norm1: str = "input_layernorm"
    norm2: str | None = "post_attention_layernorm"
    mlp: str | None = "mlp"
    attn: str | None = "self_attn"
    mixer: str | None = None


LAYOUTS = {
    "llama": Layout(),
    "mamba2": Layout(
        embed="backbone.embeddings",
        layers="backbone.layers",
        final_norm="backbone.norm_f",
        norm1="norm",
        norm2=None,
        mlp=None,
        attn=None,
        mixer="mixer",
    ),
    "bamba": Layout(
        final_norm="model.final_layernorm",
        norm2="pre_ff_layernorm",
        mlp="feed_forward",
        mixer="mamba",
    ),
    "qwen3_5_text": Layout(mixer="linear_attn"),
}


def _pre_ln_rules(c: ModelConfig, layout: Layout) -> list[Rule]:
    """The rules of a Llama-like family: per block norm1, attention or a recurrent mixer, norm2 and
    a SwiGLU MLP (when the layout has one)."""
    out = [Rule("tok_emb.weight", (f"{layout.embed}.weight",))]
    mixer_names = _mixer_parameters(c)
    for i in range(c.n_layers):
        ours, hf = f"blocks.{i}.", f"{layout.layers}.{i}."
        norms = [("norm1", layout.norm1)]
        linears = []
        if c.layer_type(i) == "attention":
            attn = f"{hf}{layout.attn}."
            qkv = tuple(f"{attn}{p}_proj" for p in "qkv")
            kind = "gated_split" if c.attn_output_gate else "split"
            out.append(Rule(f"{ours}attn.qkv.weight", tuple(f"{n}.weight" for n in qkv), kind))
            if c.qkv_bias:
                out.append(Rule(f"{ours}attn.qkv.bias", tuple(f"{n}.bias" for n in qkv), kind))
            linears.append(("attn.proj", f"{layout.attn}.o_proj"))
            if c.qk_norm:
                norms += [(f"attn.{n}", f"{layout.attn}.{n}") for n in ("q_norm", "k_norm")]
        else:
            out += [
                Rule(f"{ours}mixer.{n}", (f"{hf}{layout.mixer}.{n}",))
                for n in mixer_names[c.layer_type(i)]
            ]
        if layout.mlp is not None:
            norms.append(("norm2", layout.norm2))
            linears += [(f"mlp.{p}", f"{layout.mlp}.{p}_proj") for p in ("gate", "up", "down")]
        for a, b in linears:
            out.append(Rule(f"{ours}{a}.weight", (f"{hf}{b}.weight",)))
            if c.bias:
                out.append(Rule(f"{ours}{a}.bias", (f"{hf}{b}.bias",)))
        out += [Rule(f"{ours}{a}.weight", (f"{hf}{b}.weight",)) for a, b in norms]
    out.append(Rule("norm.weight", (f"{layout.final_norm}.weight",)))
    if not c.tie_embeddings:
        out.append(Rule("head.weight", ("lm_head.weight",)))
    return out


def _mixer_parameters(c: ModelConfig) -> dict[str, list[str]]:
    """The parameter names of each recurrent mixer kind the config uses (the same as transformers')."""
    kinds = {c.layer_type(i) for i in range(c.n_layers)} - {"attention"}
    with torch.device("meta"):
        return {kind: list(RECURRENT_MIXERS[kind](c).state_dict()) for kind in kinds}


def _qkv_sizes(c: ModelConfig) -> list[int]:
    q = c.n_heads * c.head_dim * (2 if c.attn_output_gate else 1)  # [W_Q | W_G] with the gate
    return [q, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]


def _interleave_gate(q: Tensor, n_heads: int, to_theirs: bool) -> Tensor:
    """Our [W_Q | W_G] rows (all heads' q, then all heads' gates) ↔ Qwen3.5's q_proj rows, head by
    head [q_h | g_h]."""
    shape = (2, n_heads, -1) if to_theirs else (n_heads, 2, -1)
    return q.reshape(*shape, *q.shape[1:]).transpose(0, 1).reshape(q.shape).contiguous()


def _to_theirs(rule: Rule, tensor: Tensor, c: ModelConfig) -> list[Tensor]:
    if rule.kind == "t":
        return [tensor.t().contiguous()]  # (out, in) → Conv1D (in, out)
    if rule.kind in ("split", "gated_split"):
        parts = [part.clone() for part in tensor.split(_qkv_sizes(c), dim=0)]  # [q | k | v] rows
        if rule.kind == "gated_split":
            parts[0] = _interleave_gate(parts[0], c.n_heads, to_theirs=True)
        return parts
    return [tensor]


def _to_ours(rule: Rule, tensors: list[Tensor], c: ModelConfig) -> Tensor:
    if rule.kind == "t":
        return tensors[0].t().contiguous()
    if rule.kind == "gated_split":
        return torch.cat([_interleave_gate(tensors[0], c.n_heads, False), *tensors[1:]], dim=0)
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
        out[rule.ours] = _to_ours(rule, tensors, config)
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
    """GPT-2 checkpoints exist with and without the `transformer.` prefix (GPT2Model vs GPT2LMHeadModel).
    A Qwen3.5 checkpoint with a vision tower keeps its language model under `model.language_model.`;
    its tower and its multi-token-prediction head (`mtp.`) are dropped, as transformers'
    Qwen3_5ForCausalLM does."""
    if recurrent_family(config) == "qwen3_5_text":
        return {
            k.replace(_QWEN3_5_NESTED, "model.", 1): v
            for k, v in hf_state.items()
            if not k.startswith(_QWEN3_5_DROPPED)
        }
    if config.position != "learned" or any(k.startswith("transformer.") for k in hf_state):
        return hf_state
    return {k if k == "lm_head.weight" else f"transformer.{k}": v for k, v in hf_state.items()}
