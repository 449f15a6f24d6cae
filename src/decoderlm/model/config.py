"""Model configuration: one dataclass, validated at construction, plus named presets.

Presets are plain data; the comment above each says where its numbers come from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from decoderlm.errors import ConfigError

# "none": no MLP, the block is its token mixer alone (Mamba-2).
MLP_KINDS = ("gelu", "gelu_tanh", "swiglu", "relu2", "none")
# "rmsnorm_1p": RMSNorm whose gain is stored as an offset from 1, y = x̂·(1 + g) (Qwen3.5).
NORM_KINDS = ("layernorm", "rmsnorm", "rmsnorm_1p")
NORM_PLACEMENTS = ("pre", "post")
POSITION_KINDS = ("sinusoidal", "learned", "rope", "none")
ATTN_BACKENDS = ("math", "sdpa", "flash")
# A layer's token mixer: softmax attention, or a recurrent layer with a fixed-size state
# (decoderlm.model.linear_attention, .gated_deltanet, .mamba2).
LAYER_TYPES = ("attention", "linear_attention", "gdn", "mamba2")
# The score scale: the seeds' 1/√d_k keeps var(q·k) ≈ 1 at any head_dim; "none" is the ablation.
ATTN_SCALES = ("1/sqrt(head_dim)", "none")
# Keys of each rope_scaling type besides "type" (or "rope_type"), named as in transformers:
# (required, optional). Their meaning: decoderlm.model.positional.
ROPE_SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        ("factor", "attention_factor"),
    ),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
}
ROPE_SCALING_TYPES = tuple(ROPE_SCALING_KEYS)

T = TypeVar("T")


@dataclass
class ModelConfig:
    vocab_size: int = 50257  # GPT-2's byte-level BPE vocabulary
    context_length: int = 1024  # longest sequence the positions (and KV cache) are built for
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None = n_heads (MHA); 1 = MQA; a divisor in between = GQA
    head_dim: int | None = None  # None = d_model // n_heads
    mlp: str = "gelu"  # one of MLP_KINDS
    d_ff: int | None = None  # None = 4·d_model, or ≈ 8/3·d_model (rounded up to 64) for swiglu
    norm: str = "layernorm"  # one of NORM_KINDS
    norm_eps: float = 1e-5
    norm_placement: str = "pre"  # "pre" (GPT-2 and later) or "post" (Vaswani et al., 2017)
    position: str = "learned"  # one of POSITION_KINDS
    rope_theta: float = 10000.0  # RoPE base: θ_i = rope_theta^(-2i/head_dim)
    rope_scaling: dict[str, Any] | None = None  # e.g. {"type": "llama3", "factor": 32.0, ...}
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of a head; None = head_dim
    bias: bool = True  # biases in every linear layer and norm
    qkv_bias: bool | None = None  # None = bias; Qwen2 has q/k/v biases and no others
    qk_norm: bool = False  # per-head norm of q and k before RoPE (Qwen3, OLMo 2)
    attn_output_gate: bool = False  # attention output ⊙ sigmoid(x W_G) before W_O (Qwen3.5)
    tie_embeddings: bool = True  # LM head shares the token-embedding matrix
    dropout: float = 0.0  # on embeddings, attention weights and residual branches
    attn_backend: str = "sdpa"  # one of ATTN_BACKENDS
    attn_scale: str = "1/sqrt(head_dim)"  # one of ATTN_SCALES: softmax(QKᵀ·scale + M)V
    # Sliding-window attention (Mistral, Qwen2): query i attends keys i − W < j ≤ i; None = all j ≤ i.
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None  # layers with the window; None = all
    # The mixer of each layer, one of LAYER_TYPES per layer; None = attention everywhere.
    layer_types: tuple[str, ...] | None = None
    # The recurrent layers' shape (`recurrent_dims`): heads H (GDN: value heads; Mamba-2: heads),
    # key heads H_k shared by H / H_k heads each (GDN: key heads; Mamba-2: n_groups), key dim d_k
    # (Mamba-2: state_size) and value dim d_v (Mamba-2: head_dim); None = n_heads, H, head_dim,
    # head_dim. The state per layer and sequence is H · d_k · d_v numbers.
    recurrent_heads: int | None = None
    recurrent_key_heads: int | None = None
    recurrent_key_dim: int | None = None
    recurrent_value_dim: int | None = None
    recurrent_conv: int = 4  # the short causal conv's kernel (GDN, Mamba-2)
    recurrent_chunk: int = 64  # tokens per chunk of the chunked (training, prefill) form
    init_std: float = 0.02  # GPT-2 initialisation; residual projections get init_std/√(2·n_layers)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (e.g. the preset name)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value > 0,
                f"{name}={value!r}",
                "must be a positive integer",
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                    "(or set head_dim explicitly)"
                )
            self.head_dim = self.d_model // self.n_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.d_ff is None:
            self.d_ff = _default_d_ff(self.d_model, self.mlp)
        if isinstance(self.sliding_window_layers, list):  # from JSON
            self.sliding_window_layers = tuple(self.sliding_window_layers)
        if isinstance(self.layer_types, list):  # from JSON
            self.layer_types = tuple(self.layer_types)
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the first field whose value is not allowed."""
        _require(
            1 <= self.n_kv_heads <= self.n_heads,
            f"n_kv_heads={self.n_kv_heads}",
            f"must be between 1 and n_heads={self.n_heads}",
        )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        _require(self.head_dim > 0, f"head_dim={self.head_dim}", "must be a positive integer")
        _require(self.d_ff > 0, f"d_ff={self.d_ff}", "must be a positive integer")
        _choice(self, "mlp", MLP_KINDS)
        _choice(self, "norm", NORM_KINDS)
        _choice(self, "norm_placement", NORM_PLACEMENTS)
        _choice(self, "position", POSITION_KINDS)
        _choice(self, "attn_backend", ATTN_BACKENDS)
        _choice(self, "attn_scale", ATTN_SCALES)
        _require(self.norm_eps > 0, f"norm_eps={self.norm_eps}", "must be > 0")
        _require(0.0 <= self.dropout < 1.0, f"dropout={self.dropout}", "must be in [0, 1)")
        _require(self.init_std > 0, f"init_std={self.init_std}", "must be > 0")
        self._validate_sliding_window()
        self._validate_layer_types()
        if self.attn_backend == "flash" and self.dropout > 0:
            raise ConfigError(
                f"attn_backend='flash' has no attention dropout, but dropout={self.dropout}; "
                "set dropout=0 or use attn_backend='sdpa'"
            )
        if self.position == "rope":
            _require(self.head_dim % 2 == 0, f"head_dim={self.head_dim}", "must be even for RoPE")
            _require(
                self.rotary_dim is None
                or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0),
                f"rotary_dim={self.rotary_dim}",
                f"must be even and in (0, head_dim={self.head_dim}]",
            )
            _require(self.rope_theta > 0, f"rope_theta={self.rope_theta}", "must be > 0")
        if self.position == "sinusoidal":
            _require(
                self.d_model % 2 == 0,
                f"d_model={self.d_model}",
                "must be even for sinusoidal positions",
            )
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.rope_dim)

    def _validate_sliding_window(self) -> None:
        window, layers = self.sliding_window, self.sliding_window_layers
        _require(
            window is None
            or (isinstance(window, int) and not isinstance(window, bool) and window > 0),
            f"sliding_window={window!r}",
            "must be a positive integer or None",
        )
        if layers is None:
            return
        _require(window is not None, f"sliding_window_layers={layers!r}", "needs sliding_window")
        _require(
            isinstance(layers, tuple)
            and all(isinstance(i, int) and 0 <= i < self.n_layers for i in layers)
            and list(layers) == sorted(set(layers)),
            f"sliding_window_layers={layers!r}",
            f"must be increasing layer indices in [0, n_layers={self.n_layers})",
        )

    def _validate_layer_types(self) -> None:
        types = self.layer_types
        if types is not None:
            bad = [t for t in types if t not in LAYER_TYPES]
            _require(
                isinstance(types, tuple) and not bad,
                f"layer_types value {bad[0]!r}" if bad else f"layer_types={types!r}",
                f"is not allowed; choose from: {', '.join(LAYER_TYPES)}",
            )
            _require(
                len(types) == self.n_layers,
                f"layer_types has {len(types)} entries and",
                f"must have one per layer (n_layers={self.n_layers})",
            )
        for name in (
            "recurrent_heads",
            "recurrent_key_heads",
            "recurrent_key_dim",
            "recurrent_value_dim",
        ):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, int) and value > 0),
                f"{name}={value!r}",
                "must be a positive integer or None",
            )
        heads, key_heads, _, _ = self.recurrent_dims
        _require(
            heads % key_heads == 0,
            f"recurrent_heads={heads}",
            f"must be divisible by recurrent_key_heads={key_heads}",
        )
        _require(self.recurrent_conv >= 2, f"recurrent_conv={self.recurrent_conv}", "must be ≥ 2")
        _require(
            self.recurrent_chunk >= 1, f"recurrent_chunk={self.recurrent_chunk}", "must be ≥ 1"
        )
        _require(
            self.sliding_window is None or not self.has_recurrent_layers,
            f"sliding_window={self.sliding_window}",
            "is not supported with recurrent layer_types yet",
        )

    def layer_type(self, layer: int) -> str:
        """The mixer of layer `layer`: one of LAYER_TYPES."""
        return "attention" if self.layer_types is None else self.layer_types[layer]

    @property
    def n_attention_layers(self) -> int:
        """The layers that attend, keeping K/V (a recurrent layer keeps a fixed-size state)."""
        return sum(self.layer_type(i) == "attention" for i in range(self.n_layers))

    @property
    def has_recurrent_layers(self) -> bool:
        return self.n_attention_layers < self.n_layers

    @property
    def recurrent_dims(self) -> tuple[int, int, int, int]:
        """(H, H_k, d_k, d_v) of the recurrent layers, the None fields resolved."""
        heads = self.recurrent_heads or self.n_heads
        return (
            heads,
            self.recurrent_key_heads or heads,
            self.recurrent_key_dim or self.head_dim,
            self.recurrent_value_dim or self.head_dim,
        )

    @property
    def recurrent_conv_channels(self) -> int:
        """The channels of a recurrent layer's short convolution, 2·H_k·d_k + H·d_v: GDN convolves
        q, k and v; Mamba-2 B, C (H_k = n_groups, d_k = state_size) and x."""
        heads, key_heads, d_k, d_v = self.recurrent_dims
        return 2 * key_heads * d_k + heads * d_v

    @property
    def decodes_past_context(self) -> bool:
        """Whether every attention layer has a sliding window (or there is none: a recurrent
        layer's state does not grow): its cache then decodes past `context_length` (with RoPE or
        no positions: no table to run out of; recurrent layers use no positions)."""
        every_layer = all(
            self.layer_window(i) is not None or self.layer_type(i) != "attention"
            for i in range(self.n_layers)
        )
        return every_layer and self.position in ("rope", "none")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None where it attends every earlier key."""
        layers = self.sliding_window_layers
        return self.sliding_window if layers is None or layer in layers else None

    @property
    def rope_dim(self) -> int:
        """The dimensions of a head that RoPE rotates (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per K/V head: 1 for MHA, n_heads for MQA."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return dataclass_from_dict(cls, data, "model")

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
        data = {**PRESETS[name], **overrides}
        data["extra"] = {**data.get("extra", {}), "preset": name}
        return cls.from_dict(data)


def dataclass_from_dict(cls: type[T], data: dict[str, Any], kind: str) -> T:
    """cls(**data), with a one-line error naming the first unknown field and listing the allowed ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown {kind} config field {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
        )
    return cls(**data)


def _default_d_ff(d_model: int, mlp: str) -> int:
    if mlp == "swiglu":
        # LLaMA: 2/3 of 4·d keeps the parameter count of a 4·d two-matrix MLP with three matrices.
        return 64 * math.ceil(8 * d_model / 3 / 64)
    return 4 * d_model


def _require(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{name} {rule}")


def _choice(cfg: ModelConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _check_rope_scaling(scaling: dict[str, Any], head_dim: int) -> None:
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(
            f"rope_scaling type={kind!r} is not supported; allowed: {', '.join(ROPE_SCALING_TYPES)}"
        )
    required, optional = ROPE_SCALING_KEYS[kind]
    given = set(scaling) - {"type", "rope_type"}
    missing = [key for key in required if key not in given]
    if missing:
        raise ConfigError(f"rope_scaling type={kind!r} needs {', '.join(missing)}")
    unknown = sorted(given - set(required) - set(optional))
    if unknown:
        raise ConfigError(
            f"rope_scaling key {unknown[0]!r} is not used by type={kind!r}; allowed: "
            f"{', '.join(required + optional)}"
        )
    factor = scaling.get("factor")
    if factor is not None:
        _require(
            isinstance(factor, int | float) and factor > 0,
            f"rope_scaling factor={factor!r}",
            "must be a number > 0",
        )
    original = scaling.get("original_max_position_embeddings")
    if original is not None:
        _require(
            isinstance(original, int) and original > 1,
            f"rope_scaling original_max_position_embeddings={original!r}",
            "must be an integer > 1",
        )
    for name in ("short_factor", "long_factor"):
        if name in scaling:
            _require(
                len(scaling[name]) == head_dim // 2,
                f"rope_scaling {name} has {len(scaling[name])} entries and",
                f"must have head_dim/2={head_dim // 2}",
            )


_GPT2 = dict(
    vocab_size=50257,
    context_length=1024,
    mlp="gelu_tanh",
    norm="layernorm",
    position="learned",
    bias=True,
    tie_embeddings=True,
)
_LLAMA = dict(
    mlp="swiglu",
    norm="rmsnorm",
    position="rope",
    bias=False,
    tie_embeddings=False,
)
# The llama-tiny shape, which decoderlm's own recurrent presets share.
_LLAMA_TINY = dict(
    _LLAMA,
    vocab_size=2048,
    context_length=256,
    d_model=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    d_ff=344,
)

PRESETS: dict[str, dict[str, Any]] = {
    # The canonical block of the seed material: d_model 256, 8 heads, MLP ratio 4, GELU, LayerNorm,
    # Pre-LN, dropout 0.1, sinusoidal positions; 6 layers as in Vaswani et al. (2017), GPT-2 vocabulary.
    "seed": dict(
        vocab_size=50257,
        context_length=512,
        d_model=256,
        n_layers=6,
        n_heads=8,
        d_ff=1024,
        mlp="gelu",
        norm="layernorm",
        norm_placement="pre",
        position="sinusoidal",
        dropout=0.1,
    ),
    # GPT-2 family, Radford et al. (2019); shapes from the released configs
    # (huggingface.co/openai-community/gpt2{,-medium,-large,-xl}/config.json).
    "gpt2": dict(_GPT2, d_model=768, n_layers=12, n_heads=12),  # 124M
    "gpt2-medium": dict(_GPT2, d_model=1024, n_layers=24, n_heads=16),  # 355M
    "gpt2-large": dict(_GPT2, d_model=1280, n_layers=36, n_heads=20),  # 774M
    "gpt2-xl": dict(_GPT2, d_model=1600, n_layers=48, n_heads=25),  # 1.5B
    # LLaMA-style (Touvron et al., 2023): RMSNorm, SwiGLU, RoPE, GQA, no bias.
    # ~1.2M parameters: small enough for unit tests and CPU demos.
    "llama-tiny": _LLAMA_TINY,
    # decoderlm's own small hybrid: llama-tiny with Gated DeltaNet in three of every four layers and
    # attention in the fourth (the 3:1 ratio of Qwen3-Next), GDN heads 4 of 32 (keys shared by 2).
    "hybrid-tiny": dict(
        _LLAMA_TINY,
        layer_types=("gdn", "gdn", "gdn", "attention"),
        recurrent_key_heads=2,
    ),
    # decoderlm's own pure recurrent model: the same shape with Gated DeltaNet in every layer; no
    # attention, so it decodes past context_length.
    "recurrent-tiny": dict(
        _LLAMA_TINY,
        layer_types=("gdn",) * 4,
        recurrent_key_heads=2,
    ),
    # ~15M: the llama2.c TinyStories 15M shape (github.com/karpathy/llama2.c), tied embeddings,
    # with GQA 6→2 (14.5M instead of 15.2M).
    "llama-15m": dict(
        _LLAMA,
        vocab_size=32000,
        context_length=256,
        d_model=288,
        n_layers=6,
        n_heads=6,
        n_kv_heads=2,
        d_ff=768,
        tie_embeddings=True,
    ),
    # ~55M: the shape of the decode benchmark (benchmarks/decode.py), 8 query heads, 2 K/V heads.
    "llama-55m": dict(
        _LLAMA,
        vocab_size=32000,
        context_length=2048,
        d_model=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        d_ff=1376,
    ),
    # ~110M: the llama2.c 110M shape (tied embeddings), with GQA 12→4.
    "llama-110m": dict(
        _LLAMA,
        vocab_size=32000,
        context_length=1024,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        d_ff=2048,
        tie_embeddings=True,
    ),
    # ~1.2B: Llama 3.2 1B (huggingface.co/meta-llama/Llama-3.2-1B/config.json).
    "llama-1b": dict(
        _LLAMA,
        vocab_size=128256,
        context_length=131072,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_embeddings=True,
    ),
}
