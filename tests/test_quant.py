"""Weight-only int8 / int4 / bf16 quantization: each layer equals its dequantized reference, the
rounding error is at most half a step, quantized runs reload exactly, and the logits stay close."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decoderlm import checkpoint, hf
from decoderlm.cli import main
from decoderlm.errors import DecoderLMError
from decoderlm.inference.generate import generate
from decoderlm.loading import load
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.quant import (
    Bf16Linear,
    Int4Linear,
    Int8Linear,
    load_quantized,
    quantization_of,
    quantize,
    save_quantized,
)
from decoderlm.tokenizer import Tokenizer

D_MODEL, D_FF, VOCAB = 128, 256, 256


def _model(seed: int = 0, **overrides) -> DecoderLM:
    """A tiny random model with N(0, 0.1) matrices (logits of std ≈ 1)."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=VOCAB,
        context_length=64,
        d_model=D_MODEL,
        n_layers=2,
        n_heads=4,
        d_ff=D_FF,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        tie_embeddings=False,
    )
    model = DecoderLM(ModelConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model.eval()


def _linear(k: int = 128, n: int = 48, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.05)
        linear.weight[3] = 0.0  # an all-zero row: scale 1, q 0, no division by zero
    return linear


def test_int8_weights_round_to_the_nearest_of_255_levels_per_row():
    linear = _linear()
    q = Int8Linear.from_linear(linear)
    w = linear.weight.detach().double()
    scale = w.abs().amax(1) / 127  # s_n = max_k |W_nk| / 127
    assert torch.allclose(q.scale.double()[scale > 0], scale[scale > 0], rtol=1e-6)
    assert q.weight_q.abs().max() == 127
    error = (q.dequantized(torch.float64) - w).abs()
    assert (error <= q.scale.double()[:, None] / 2 * (1 + 1e-5)).all()
    assert torch.equal(q.dequantized()[3], torch.zeros(128))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_weights_round_to_the_nearest_of_16_levels_per_group(group_size):
    linear = _linear()
    q = Int4Linear.from_linear(linear, group_size)
    assert q.weight_q.shape == (48, 64) and q.weight_q.dtype == torch.uint8  # two per byte
    w = linear.weight.detach().double().view(48, 128 // group_size, group_size)
    w_hat = q.dequantized(torch.float64).view_as(w)
    error = (w_hat - w).abs()
    assert (error <= q.scale.double()[..., None] / 2 * (1 + 1e-5)).all()
    # The group's minimum and maximum are levels 0 and 15, hence represented (almost) exactly.
    assert torch.allclose(w_hat.amin(-1), w.amin(-1), atol=1e-7)
    assert torch.allclose(w_hat.amax(-1), w.amax(-1), atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [Int8Linear.from_linear, lambda m: Int4Linear.from_linear(m, 32), Bf16Linear.from_linear],
    ids=["int8", "int4", "bf16"],
)
@pytest.mark.parametrize("shape", [(5, 128), (2, 3, 128), (1, 128)])
def test_quantized_linear_equals_its_dequantized_reference_in_float32(make, shape):
    linear = _linear()
    q = make(linear)
    x = torch.randn(shape)
    expected = F.linear(x.double(), q.dequantized(torch.float64), linear.bias.detach().double())
    y = q(x)
    assert y.shape == (*shape[:-1], 48) and y.dtype == torch.float32
    assert (y.double() - expected).norm() / expected.norm() <= 1e-5


@pytest.mark.parametrize("rows", [1, 4, 16])  # the int8 kernel (≤ 8 rows) and the converted matmul
def test_int8_linear_in_bfloat16_matches_the_float64_reference_to_bfloat16_precision(rows):
    q = Int8Linear.from_linear(_linear()).to(torch.bfloat16)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    expected = F.linear(x.double(), q.dequantized(torch.float64), q.bias.double())
    y = q(x)
    assert y.dtype == torch.bfloat16
    assert (y.double() - expected).norm() / expected.norm() <= 1e-2  # bfloat16: 8 mantissa bits


def test_bf16_weights_are_the_nearest_bfloat16_and_survive_a_cast_of_the_model():
    linear = _linear()
    q = Bf16Linear.from_linear(linear)
    w = linear.weight.detach()
    assert torch.equal(q.weight, w.to(torch.bfloat16))
    half_ulp = w.abs() * 2.0**-8  # bfloat16: 8 significant bits, so half an ulp ≤ 2⁻⁸ |w|
    assert ((q.dequantized() - w).abs() <= half_ulp).all()
    model = quantize(_model(), "bf16").to(torch.float64)  # activations follow the model's dtype
    assert (
        model.head.weight_bits.dtype == torch.int16 and model.tok_emb.weight.dtype == torch.float64
    )


def _logits_error(model: DecoderLM, quantized: DecoderLM) -> tuple[float, float, float]:
    """(max |Δlogit|, ‖Δlogits‖ / ‖logits‖, top-1 agreement) over the float model's 32-token
    greedy continuation of an 8-token prompt, fed to both models (teacher forcing)."""
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor(generate(model, prompt, 32, temperature=0))  # (1, 40)
    with torch.no_grad():
        a, b = model(tokens)[:, 8:], quantized(tokens)[:, 8:]  # (1, 32, V)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return (a - b).abs().max().item(), ((a - b).norm() / a.norm()).item(), agree


@pytest.mark.parametrize("tie", [False, True])
def test_int8_logits_stay_within_5_percent_of_the_float_model(tie):
    # Measured (this model, seed 0): max |Δlogit| ≈ 0.16 on logits of std ≈ 1.1, relative error
    # ≈ 0.027, top-1 agreement ≈ 0.97.
    model = _model(tie_embeddings=tie)
    max_err, rel_err, agree = _logits_error(model, quantize(copy.deepcopy(model), "int8"))
    assert max_err < 0.5 and rel_err < 0.05 and agree >= 0.85


def test_bf16_weights_under_float32_activations_beat_a_bfloat16_model():
    # Measured (this model, seed 0): relative logit error ≈ 0.0067 with bf16 weights and float32
    # activations, ≈ 0.0138 with the whole model in bfloat16, whose activations round too.
    model = _model()
    bf16_weights = _logits_error(model, quantize(copy.deepcopy(model), "bf16"))[1]
    bf16_model = _logits_error(model, copy.deepcopy(model).to(torch.bfloat16))[1]
    assert bf16_weights < 0.75 * bf16_model and bf16_weights < 0.01


def test_int4_error_is_an_order_above_int8_and_smaller_with_smaller_groups():
    # The caveat, measured on this random model: relative logit error ≈ 0.30 (G=32) and ≈ 0.40
    # (G=128), top-1 agreement ≈ 0.5 — int4 hurts small models much more than 7B ones.
    model = _model()
    int8 = _logits_error(model, quantize(copy.deepcopy(model), "int8"))[1]
    g32 = _logits_error(model, quantize(copy.deepcopy(model), "int4", 32))[1]
    g128 = _logits_error(model, quantize(copy.deepcopy(model), "int4", 128))[1]
    assert 5 * int8 < g32 < g128 < 0.6


def test_all_linear_layers_are_swapped_the_head_stays_int8_and_the_embedding_float():
    model = quantize(_model(tie_embeddings=True), "int4", 64)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.head, Int8Linear) and isinstance(model.blocks[0].mlp.down, Int4Linear)
    assert model.tok_emb.weight.dtype == torch.float32
    assert quantization_of(model) == {"to": "int4", "group_size": 64}


@pytest.mark.parametrize(("to", "group_size"), [("int8", None), ("int4", 32), ("bf16", None)])
def test_quantized_run_reloads_bit_exactly(tmp_path, to, group_size):
    model = quantize(_model(tie_embeddings=True), to, group_size)
    save_quantized(tmp_path / "q", model)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"to": to, "group_size": group_size}
    loaded, tokenizer = load(tmp_path / "q")
    assert tokenizer is None
    assert quantization_of(loaded) == quantization_of(model)
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(v, got[k]) and v.dtype == got[k].dtype for k, v in expected.items())
    idx = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx), loaded(idx))


def test_bfloat16_load_casts_scales_but_keeps_the_integer_weights(tmp_path):
    save_quantized(tmp_path / "q", quantize(_model(), "int8"))
    model = load_quantized(tmp_path / "q", dtype=torch.bfloat16)
    assert model.head.weight_q.dtype == torch.int8 and model.head.scale.dtype == torch.bfloat16
    tokens = generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0)[0]
    assert len(tokens) == 7


def test_bad_settings_and_requantizing_are_refused_in_one_line():
    model = _model(d_ff=96)  # mlp.down has 96 inputs: not a multiple of 64
    with pytest.raises(DecoderLMError, match="must be one of int8, int4, bf16"):
        quantize(model, "int3")
    with pytest.raises(DecoderLMError, match="must be one of 32, 64, 128"):
        quantize(model, "int4", 48)
    with pytest.raises(DecoderLMError, match="applies to int4 only"):
        quantize(model, "int8", 32)
    with pytest.raises(
        DecoderLMError, match=r"does not divide the 96 inputs of blocks\.0\.mlp\.down"
    ):
        quantize(model, "int4", 64)
    assert quantization_of(model) is None  # nothing swapped before the check
    quantize(model, "int8")
    with pytest.raises(DecoderLMError, match="already quantized"):
        quantize(model, "int8")


def test_float_loaders_refuse_a_quantized_run(tmp_path):
    save_quantized(tmp_path / "q", quantize(_model(), "int8"))
    with pytest.raises(DecoderLMError, match="holds quantized weights"):
        checkpoint.load_model(tmp_path / "q")


def test_cli_quantizes_a_run_and_a_hf_directory(tmp_path, capsys):
    tokenizer = Tokenizer.train_char(["abcdefgh"])
    checkpoint.save_model(tmp_path / "run", _model(vocab_size=tokenizer.vocab_size), tokenizer)
    hf.export_hf(tmp_path / "run", tmp_path / "hf")
    for source, to in (("run", "int8"), ("hf", "int4"), ("run", "bf16")):
        out = tmp_path / f"{source}-{to}"
        assert main(["quantize", str(tmp_path / source), "--to", to, "--out", str(out)]) == 0
        model, loaded_tokenizer = load(out)
        assert quantization_of(model)["to"] == to and loaded_tokenizer is not None
    errors = {
        ("run", "--to", "int2"): "--to 'int2' must be one of int8, int4",
        ("run", "--to", "int4", "--group-size", "100"): "must be one of 32, 64, 128",
        ("missing", "--to", "int8"): "no such directory",
        ("run-int8", "--to", "int8"): "already quantized",
    }
    for n, (args, message) in enumerate(errors.items()):
        argv = ["quantize", str(tmp_path / args[0]), *args[1:], "--out", str(tmp_path / f"x{n}")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
