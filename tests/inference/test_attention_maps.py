"""attention_maps: each layer's weights are scaled_dot_product_attention's, recomputed here from the
layer's input; entropy; the swap of `attend` is undone and thread-local; `decoderlm attention`."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.checkpoint import save_model
from decoderlm.cli import main
from decoderlm.inference.attention_maps import attention_maps, recorded_attention
from decoderlm.model.attention import attend, scaled_dot_product_attention
from decoderlm.model.masks import causal_mask
from decoderlm.model.positional import apply_rope
from decoderlm.tokenizer import Tokenizer

SHAPE = dict(vocab_size=40, context_length=32, d_model=32, n_layers=2, n_heads=4)
CONFIGS = {
    "llama GQA, RoPE, qk-norm": dict(SHAPE, position="rope", n_kv_heads=2, qk_norm=True),
    "gpt2 MHA, learned, post-LN": dict(SHAPE, norm_placement="post"),
    "MQA, sliding window 3 in layer 1": dict(
        SHAPE, position="rope", n_kv_heads=1, sliding_window=3, sliding_window_layers=(1,)
    ),
}


def model_of(config: dict, dtype: torch.dtype = torch.float64) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(**config)).to(dtype).eval()


def layer_inputs(model: DecoderLM, idx: torch.Tensor) -> list[tuple]:
    """(x, rope) that each layer's attention receives in a plain forward pass."""
    seen: list[tuple] = []
    hooks = [
        block.attn.register_forward_pre_hook(lambda _m, args: seen.append(args[:2]))
        for block in model.blocks
    ]
    with torch.no_grad():
        model(idx)
    for hook in hooks:
        hook.remove()
    return seen


def recomputed_weights(attn, x: torch.Tensor, rope) -> torch.Tensor:
    """(B, H, T, T) weights of `attn` for input x: q, k from its own weights, then the formula."""
    b, t, _ = x.shape
    q, k, v = attn.qkv(x).split(attn.split_sizes, dim=-1)
    q = q.view(b, t, attn.n_heads, attn.head_dim)
    k = k.view(b, t, attn.n_kv_heads, attn.head_dim)
    v = v.view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd), (B, Hkv, T, hd)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    mask = causal_mask(t, t, window=attn.window)
    _, weights = scaled_dot_product_attention(q, k, v, mask)  # (B, H, T, T)
    # The same by hand: softmax over the keys each query may see, K/V heads repeated per group.
    k_rep = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # (B, H, T, hd)
    scores = (q @ k_rep.transpose(-2, -1)) / math.sqrt(attn.head_dim)  # QKᵀ/√d_k
    by_hand = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(weights, by_hand, rtol=0, atol=1e-12)
    return weights


@pytest.mark.parametrize("name", CONFIGS)
def test_each_layers_weights_equal_sdpa_weights_recomputed_from_its_input(name):
    model = model_of(CONFIGS[name])
    idx = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(1))
    maps = attention_maps(model, idx)
    assert maps.weights.shape == (2, 2, 4, 11, 11) and maps.weights.dtype == torch.float64
    with torch.no_grad():
        for layer, (block, (x, rope)) in enumerate(
            zip(model.blocks, layer_inputs(model, idx), strict=True)
        ):
            expected = recomputed_weights(block.attn, x, rope)
            torch.testing.assert_close(maps.weights[layer], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(maps.weights.sum(-1), torch.ones(2, 2, 4, 11).double())
    assert (maps.weights.triu(1) == 0).all()


def test_sliding_window_layer_gives_no_weight_beyond_its_window():
    maps = attention_maps(model_of(CONFIGS["MQA, sliding window 3 in layer 1"]), list(range(9)))
    assert (maps.weights[1].tril(-3) == 0).all() and (maps.weights[0].tril(-3) > 0).any()


def test_uniform_attention_has_mean_entropy_of_log_i_plus_1():
    model = model_of(CONFIGS["gpt2 MHA, learned, post-LN"])
    q_size = model.config.n_heads * model.config.head_dim
    with torch.no_grad():
        for block in model.blocks:  # q = 0: every score 0, each query uniform over its keys
            block.attn.qkv.weight[:q_size] = 0
            block.attn.qkv.bias[:q_size] = 0
    t = 7
    maps = attention_maps(model, list(range(t)))
    expected = sum(math.log(i + 1) for i in range(t)) / t
    torch.testing.assert_close(
        maps.entropy, torch.full((2,), expected, dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        maps.weights[0, 0, 0, 3, :4], torch.full((4,), 0.25, dtype=torch.float64)
    )


def test_recording_leaves_the_logits_and_restores_each_attend():
    model = model_of(CONFIGS["llama GQA, RoPE, qk-norm"], torch.float32)
    idx = torch.arange(10)[None]
    with torch.no_grad():
        plain = model(idx)
        with recorded_attention(model) as records:
            recorded = model(idx)
    torch.testing.assert_close(recorded, plain, rtol=1e-5, atol=1e-6)  # math vs sdpa kernel
    assert len(records) == 2 and all(b.attn.attend is attend for b in model.blocks)


def test_other_threads_running_the_model_meanwhile_are_not_recorded():
    model = model_of(CONFIGS["llama GQA, RoPE, qk-norm"])
    idx = torch.arange(5)[None]
    with torch.no_grad(), recorded_attention(model) as records:
        other = threading.Thread(target=model, args=(idx,))
        other.start()
        other.join()
        assert records == []
        model(idx)
    assert [r.shape for r in records] == [(1, 4, 5, 5)] * 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tokenizer = Tokenizer.train_char(["abcdefgh ij\n"])
    run = tmp_path_factory.mktemp("run")
    config = dict(CONFIGS["llama GQA, RoPE, qk-norm"], vocab_size=tokenizer.vocab_size)
    save_model(run, model_of(config, torch.float32), tokenizer)
    return run


@pytest.mark.parametrize("head", [None, 3])
def test_cli_writes_a_png_and_prints_each_layers_entropy(run_dir, tmp_path, capsys, head):
    out = tmp_path / "map.png"
    argv = ["attention", "--checkpoint", str(run_dir), "--prompt", "abc de\nf", "--out", str(out)]
    assert main([*argv, "--layer", "1"] + ([] if head is None else ["--head", str(head)])) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"wrote {out}" and [line.split(":")[0] for line in lines[1:]] == [
        "layer 0",
        "layer 1",
    ]


def test_cli_refuses_a_head_out_of_range_in_one_line(run_dir, tmp_path, capsys):
    argv = ["attention", "--checkpoint", str(run_dir), "--prompt", "ab", "--out", "x.png"]
    assert main([*argv, "--head", "4"]) == 2
    err = capsys.readouterr().err
    assert err == "decoderlm: error: head=4 is out of range: the model has 4 heads, numbered 0..3\n"
