"""MHA → GQA/MQA conversion by mean-pooling K/V heads (Ainslie et al., 2023)."""

from __future__ import annotations

import pytest
import torch

from decoderlm import checkpoint
from decoderlm.cli import main
from decoderlm.errors import DecoderLMError
from decoderlm.gqa import pool_kv, to_gqa
from decoderlm.inference.generate import generate
from decoderlm.model.cache import CacheStep, StaticKVCache
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.tokenizer import Tokenizer

N_HEADS, HEAD_DIM, D_MODEL = 4, 8, 32


def _model(seed: int = 0, **overrides) -> DecoderLM:
    """A tiny random model; qkv biases on so that bias pooling is exercised too."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=64,
        context_length=32,
        d_model=D_MODEL,
        n_layers=2,
        n_heads=N_HEADS,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        qkv_bias=True,
    )
    model = DecoderLM(ModelConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _kv_heads(tensor: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows of a fused qkv weight/bias, split per head: each (n_kv_heads, head_dim, ...)."""
    q = config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    k, v = tensor[q : q + kv], tensor[q + kv :]
    return (
        k.reshape(config.n_kv_heads, config.head_dim, *tensor.shape[1:]),
        v.reshape(config.n_kv_heads, config.head_dim, *tensor.shape[1:]),
    )


@pytest.mark.parametrize(("n_kv_before", "n_kv_after"), [(4, 2), (4, 1), (2, 1), (4, 4)])
def test_pooled_kv_heads_equal_the_mean_of_their_group(n_kv_before, n_kv_after):
    mha = _model(n_kv_heads=n_kv_before)
    pooled = to_gqa(mha, n_kv_after)
    assert pooled.config.n_kv_heads == n_kv_after
    group = n_kv_before // n_kv_after
    before, after = mha.state_dict(), pooled.state_dict()
    for name in before:
        if not name.endswith(("qkv.weight", "qkv.bias")):
            assert torch.equal(before[name], after[name]), name
            continue
        q_rows = N_HEADS * HEAD_DIM
        assert torch.equal(before[name][:q_rows], after[name][:q_rows])  # queries untouched
        for old, new in zip(
            _kv_heads(before[name], mha.config), _kv_heads(after[name], pooled.config), strict=True
        ):
            for g in range(n_kv_after):
                # closed form: W^(g) = (1/|g|) Σ_{h ∈ [g·group, (g+1)·group)} W^(h)
                expected = sum(old[h] for h in range(g * group, (g + 1) * group)) / group
                torch.testing.assert_close(new[g], expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(qk_norm=True),  # the shared k_norm is kept: norm of identical heads is still identical
        dict(position="learned", mlp="gelu_tanh", norm="layernorm", bias=True),
    ],
)
def test_pooling_is_exact_when_the_heads_of_each_group_are_identical(overrides):
    """If the K/V heads within a group already agree, GQA computes exactly what MHA did."""
    mha = _model(**overrides).double()
    with torch.no_grad():
        for block in mha.blocks:
            for tensor in (block.attn.qkv.weight, block.attn.qkv.bias):
                k, v = _kv_heads(tensor, mha.config)  # views into the fused tensor
                k[1::2], v[1::2] = k[0::2].clone(), v[0::2].clone()  # heads 2g+1 := heads 2g
    gqa = to_gqa(mha, 2)
    idx = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        # float64 throughout: only the summation order differs (GQA shares a head that MHA repeats).
        torch.testing.assert_close(gqa(idx), mha(idx), rtol=0, atol=1e-12)


def test_pooling_changes_the_function_when_heads_differ():
    """The counterpart: with ordinary (distinct) heads, pooling is an approximation, not a no-op."""
    mha = _model()
    idx = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        assert (to_gqa(mha, 1)(idx) - mha(idx)).abs().max() > 1e-2


@pytest.mark.parametrize("groups", [2, 1])
def test_converted_model_runs_with_a_kv_cache_of_g_over_n_heads_the_size(groups):
    mha = _model()
    gqa = to_gqa(mha, groups)
    mha_cache = StaticKVCache(mha.config, batch_size=2, max_len=32)
    gqa_cache = StaticKVCache(gqa.config, batch_size=2, max_len=32)
    assert gqa_cache.layers[0].k.shape == (2, groups, 32, HEAD_DIM)
    assert gqa_cache.nbytes * N_HEADS == mha_cache.nbytes * groups  # size ratio G / n_heads
    idx = torch.randint(0, 64, (2, 12))
    gqa_cache.seek(CacheStep.span(0, 12, "cpu"))
    with torch.no_grad():
        # Prefill through the cache = the plain forward; fp32, tiny model: 1e-5 covers SDPA rounding.
        torch.testing.assert_close(gqa(idx, kv_caches=gqa_cache), gqa(idx), rtol=0, atol=1e-5)
    out = generate(gqa, idx, max_new_tokens=8, temperature=0.0)
    assert [len(row) for row in out] == [20, 20]


@pytest.mark.parametrize("groups", [3, 0, 8, -1])
def test_group_count_that_does_not_divide_the_heads_is_refused(groups):
    with pytest.raises(DecoderLMError, match=rf"n_kv_heads={groups}.*allowed: 1, 2, 4"):
        to_gqa(_model(), groups)
    gqa = _model(n_kv_heads=2)  # a GQA model can be pooled further, into a divisor of its 2 heads
    with pytest.raises(DecoderLMError, match=rf"n_kv_heads={groups}.*allowed: 1, 2$"):
        pool_kv(gqa.blocks[0].attn.qkv.weight, gqa.config, groups)


def test_cli_to_gqa_writes_a_loadable_run_with_the_tokenizer(tmp_path, capsys):
    mha = _model()
    tokenizer = Tokenizer.train_char(["abcdefgh"])
    checkpoint.save_model(tmp_path / "mha", mha, tokenizer=tokenizer)
    argv = ["convert", "--to-gqa", "1", str(tmp_path / "mha"), "--out", str(tmp_path / "mqa")]
    assert main(argv) == 0
    mqa = checkpoint.load_model(tmp_path / "mqa")
    assert mqa.config.n_kv_heads == 1
    expected = to_gqa(mha, 1).state_dict()
    assert all(torch.equal(v, mqa.state_dict()[k]) for k, v in expected.items())
    assert (tmp_path / "mqa" / "tokenizer.json").read_bytes() == (
        tmp_path / "mha" / "tokenizer.json"
    ).read_bytes()
    assert (
        main(["convert", "--to-gqa", "3", str(tmp_path / "mha"), "--out", str(tmp_path / "x")]) == 2
    )
    assert "n_kv_heads=3" in capsys.readouterr().err
    assert main(["convert", "--to-gqa", "2", "--out", str(tmp_path / "y")]) == 2
    assert "needs the source run directory" in capsys.readouterr().err
