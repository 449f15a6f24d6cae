"""LoRA (`decoderlm.lora`) on tiny random models: B = 0 leaves the logits exactly the base's,
merged and unmerged forwards agree, only the adapters train, adapters saved alone load back onto a
fresh base, over float and quantized linears alike (int8, int4, and ggml's Q8_0 and Q4_1 blocks:
QLoRA over a GGUF file's weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.lora import (
    ADAPTER_CONFIG_FILE,
    LoRALinear,
    apply_lora,
    load_adapters,
    merge_lora,
    merged_state_dict,
    save_adapters,
    target_names,
)
from decoderlm.quant import BlockLinear, quantize
from decoderlm.quant.apply import set_module

# Merged weights W + (α/r)·B·A computed once in float32 against the two matmuls of the adapted
# forward: different roundings of the same sums, ~1e-7 relative on logits of O(1).
MERGE_ATOL = 1e-5
# A GGUF block linear's products round its activations to 16 bits where no gradient flows through
# them (decoderlm.cpu.block_linear; its first layers here): logits move by ~1e-5 (measured 1.3e-5).
BLOCK_MERGE_ATOL = 1e-4


def _model(seed: int = 0, **fields: object) -> DecoderLM:
    torch.manual_seed(seed)
    shape = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, context_length=16, d_ff=64)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=64, **{**shape, **fields})
    return DecoderLM(config).eval()


def _randomize_b(model: torch.nn.Module) -> None:
    """Non-zero B everywhere, as after some training."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0, 0.1)


def _quantized(model: DecoderLM, kind: str | None) -> DecoderLM:
    """The model's linears quantized: decoderlm's int8 / int4, or ggml's Q8_0 / Q4_1 blocks as a
    GGUF file holds them (made by gguf-py)."""
    if kind in ("int8", "int4"):
        return quantize(model, kind, 32 if kind == "int4" else None)
    if kind in ("Q8_0", "Q4_1"):
        import gguf
        from gguf.quants import quantize as ggml_quantize

        for name, linear in list(model.named_modules()):
            if isinstance(linear, torch.nn.Linear) and name != "head":
                w = linear.weight.detach().numpy()
                blocks = ggml_quantize(w, gguf.GGMLQuantizationType[kind])
                new = BlockLinear(w.shape[1], w.shape[0], kind, blocks=torch.from_numpy(blocks))
                set_module(model, name, new)
    return model


QUANTIZED = [None, "int8", "int4", "Q8_0", "Q4_1"]
IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("quantized", QUANTIZED)
def test_zero_b_gives_the_base_logits_exactly(quantized: str | None) -> None:
    model = _quantized(_model(), quantized)
    with torch.no_grad():  # the same products with and without LoRA (kernels take no gradients)
        base = model(IDS)
        apply_lora(model, rank=4, alpha=8, dropout=0.0)
        assert torch.equal(model(IDS), base)


@pytest.mark.parametrize("quantized", QUANTIZED)
def test_merged_and_unmerged_forwards_agree(quantized: str | None) -> None:
    model = _quantized(_model(), quantized)
    apply_lora(model, rank=4, alpha=8)
    _randomize_b(model)
    adapted = model(IDS)
    plain = _model(seed=5)  # other weights: everything must come from the state dict
    plain.load_state_dict(merged_state_dict(model))
    atol = BLOCK_MERGE_ATOL if quantized in ("Q8_0", "Q4_1") else MERGE_ATOL
    assert (plain(IDS) - adapted).abs().max() <= atol
    assert (adapted - model(IDS)).abs().max() == 0  # merged_state_dict leaves the model as it was
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert (model(IDS) - adapted).abs().max() <= atol


def test_only_the_adapters_require_gradients_and_get_them() -> None:
    model = _model()
    apply_lora(model, rank=2, alpha=4, targets=("qkv", "down"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"blocks.{i}.{layer}.lora_{ab}"
        for i in range(2)
        for layer in ("attn.qkv", "mlp.down")
        for ab in "AB"
    }
    model(IDS).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    # B = 0: A's gradient is zero at the first step, B's is not (Hu et al.: ΔW starts at 0).
    grads = dict(model.named_parameters())
    assert grads["blocks.0.attn.qkv.lora_B"].grad.abs().sum() > 0


def test_an_unknown_target_is_one_line_naming_the_valid_ones() -> None:
    with pytest.raises(DecoderLMError) as err:
        apply_lora(_model(), rank=2, alpha=4, targets=("q_proj",))
    assert str(err.value) == (
        "LoRA target 'q_proj' is not a linear layer of this model; valid: down, gate, proj, qkv, up"
    )
    assert target_names(_model(mlp="gelu")) == ["down", "proj", "qkv", "up"]


@pytest.mark.parametrize("rank", [0, -1, 1.5])
def test_a_bad_rank_is_refused(rank: object) -> None:
    with pytest.raises(DecoderLMError, match="LoRA rank="):
        apply_lora(_model(), rank=rank, alpha=4)  # type: ignore[arg-type]


def test_adapters_saved_alone_load_onto_a_fresh_base(tmp_path: Path) -> None:
    model = _model()
    apply_lora(model, rank=4, alpha=16, dropout=0.1, targets=("qkv", "up"))
    _randomize_b(model)
    expected = model(IDS)
    save_adapters(model, tmp_path, base="some/base")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adapter.safetensors",
        ADAPTER_CONFIG_FILE,
    ]
    fresh = load_adapters(_model(), tmp_path).eval()
    assert torch.equal(fresh(IDS), expected)


def test_adapters_of_another_shape_are_refused_with_one_line(tmp_path: Path) -> None:
    model = _model()
    apply_lora(model, rank=4, alpha=8)
    save_adapters(model, tmp_path)
    with pytest.raises(DecoderLMError, match="has shape"):
        load_adapters(_model(d_model=64), tmp_path)


def test_the_frozen_base_backward_is_the_gradient_of_its_forward() -> None:
    """∂L/∂x through a LoRALinear (its base's backward makes Ŵ again) against finite
    differences, in float64."""
    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(6, 5).double().requires_grad_(False), 2, 4.0).double()
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))
