"""SpeedPaths: each call site's set of CPU paths, switchable as a whole and one by one, applied by
one context manager that puts the model back as it was."""

import gc

import pytest
import torch
from torch import nn

from decoderlm import DecoderLM, DecoderLMError, ModelConfig, generate
from decoderlm.cpu.attention import cpu_attend
from decoderlm.cpu.embedding import CPUEmbedding
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.model.attention import attend


def tiny() -> DecoderLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         context_length=64, position="rope", norm="rmsnorm", mlp="swiglu")  # fmt: skip
    return DecoderLM(config).eval()


def test_each_call_site_states_its_paths():
    generate_paths = SpeedPaths.for_generate()
    assert generate_paths == SpeedPaths(
        embedding=True, attention=True, linear_kernels=True, in_place_attention=True
    )
    assert SpeedPaths.for_engine() == SpeedPaths(
        attention=True,
        in_place_attention=True,
        packed_linears=True,
        fused_ops=True,
        keep_freed_memory=True,
    )
    assert SpeedPaths.for_training() == SpeedPaths(
        embedding=True, attention=True, keep_freed_memory=True
    )
    for site in (SpeedPaths.for_generate, SpeedPaths.for_engine, SpeedPaths.for_training):
        assert site(enabled=False) == SpeedPaths.none() == SpeedPaths()


def test_cpu_kernels_resolve_to_the_default_none_or_the_given_paths():
    default = SpeedPaths.for_engine()
    assert SpeedPaths.resolve(True, default) is default
    assert SpeedPaths.resolve(False, default) == SpeedPaths.none()
    mine = SpeedPaths(attention=True)
    assert SpeedPaths.resolve(mine, default) is mine
    with pytest.raises(DecoderLMError, match="cpu_kernels='yes' must be True, False or a"):
        SpeedPaths.resolve("yes", default)


def test_without_switches_paths_off_one_by_one():
    paths = SpeedPaths.for_generate().without("attention", "linear_kernels")
    assert paths == SpeedPaths(embedding=True, in_place_attention=True)
    with pytest.raises(DecoderLMError, match=r"unknown speed path\(s\) \['atention'\]"):
        paths.without("atention")


def test_paths_are_cpu_paths_only():
    assert SpeedPaths.for_generate().on(torch.device("meta")) == SpeedPaths.none()
    assert SpeedPaths.for_generate().on(torch.device("cpu")) == SpeedPaths.for_generate()


def test_applied_swaps_only_the_chosen_paths_and_restores_the_model():
    model = tiny()
    attentions = [block.attn for block in model.blocks]
    applied = SpeedPaths(attention=True).applied(model)
    for _ in range(2):  # reusable: one engine step after another
        with applied:
            assert type(model.tok_emb) is nn.Embedding  # embedding path off
            assert all(a.attend is cpu_attend for a in attentions)
        assert all(a.attend is attend for a in attentions)
    with SpeedPaths.for_generate().applied(model):
        assert isinstance(model.tok_emb, CPUEmbedding)
    assert type(model.tok_emb) is nn.Embedding


def test_apply_keeps_the_paths_for_the_models_life():
    model = SpeedPaths.for_training(enabled=True).apply(tiny())
    gc.collect()  # nothing left to undo them when collected
    assert isinstance(model.tok_emb, CPUEmbedding)
    assert all(block.attn.attend is cpu_attend for block in model.blocks)
    with pytest.raises(DecoderLMError, match="packed_linears are applied per pass"):
        SpeedPaths.for_engine().apply(tiny())


def test_generate_gives_the_same_tokens_with_any_subset_of_its_paths():
    model, prompts = tiny(), [[1, 2, 3, 4, 5], [6, 7]]
    expected = generate(model, prompts, 12, temperature=0, cpu_kernels=False)
    for paths in (
        SpeedPaths.for_generate(),
        SpeedPaths.for_generate().without("linear_kernels"),
        SpeedPaths(embedding=True),
        SpeedPaths.none(),
    ):
        assert generate(model, prompts, 12, temperature=0, cpu_kernels=paths) == expected
