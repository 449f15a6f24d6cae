"""The recurrent mixers (linear attention, Gated DeltaNet, Mamba-2) in a model: the chunked prefill
equals token-by-token decoding through the state cache, a state carried across a split prompt equals
the whole prompt, left padding never enters the state, gradients flow, the config validates
`layer_types`, and the GDN and Mamba-2 layers match transformers' torch paths weight for weight."""

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.errors import ConfigError
from decoderlm.model.cache import CacheStep, HybridCache, RecurrentLayerCache, make_cache
from decoderlm.model.lm import next_token_loss

pytestmark = pytest.mark.usefixtures("one_thread")

RECURRENT = ["linear_attention", "gdn", "mamba2"]


def model(kind: str, dtype: torch.dtype = torch.float64, **overrides) -> DecoderLM:
    config = dict(
        vocab_size=64,
        context_length=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        layer_types=(kind, "attention"),
        recurrent_key_heads=2,
        recurrent_key_dim=6,
        recurrent_value_dim=5,
        recurrent_chunk=4,
    )
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(**{**config, **overrides})).to(dtype).eval()


def prefill(m: DecoderLM, cache: HybridCache, ids: torch.Tensor, start: int = 0, valid=None):
    """Logits (B, T, V) of ids (B, T) at positions start.., through the cache."""
    t = ids.shape[1]
    cache.seek(CacheStep.span(start, t, ids.device, valid))
    positions = torch.arange(start, start + t)
    mask = (
        None
        if valid is None
        else torch.cat([torch.ones(ids.shape[0], start, dtype=torch.bool), valid], 1)
    )
    return m(ids, positions, mask, cache)


@pytest.mark.parametrize("kind", RECURRENT)
@pytest.mark.parametrize("t", [1, 5, 8, 11])
def test_prefill_then_steps_equal_the_plain_forward(kind: str, t: int) -> None:
    m = model(kind)
    ids = torch.randint(0, 64, (2, t + 6))
    expected = m(ids)
    cache = make_cache(m.config, 2, 32, torch.float64)
    assert isinstance(cache, HybridCache)
    got = [prefill(m, cache, ids[:, :t])]
    for i in range(t, t + 6):
        got.append(prefill(m, cache, ids[:, i : i + 1], start=i))
    torch.testing.assert_close(torch.cat(got, dim=1), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", RECURRENT)
@torch.no_grad()
def test_fp32_chunked_form_within_1e5_of_float64_steps(kind: str) -> None:
    m64 = model(kind, layer_types=(kind, kind))
    m32 = model(kind, torch.float32, layer_types=(kind, kind))
    ids = torch.randint(0, 64, (2, 19))
    cache = make_cache(m64.config, 2, 32, torch.float64)
    steps = torch.cat([prefill(m64, cache, ids[:, i : i + 1], start=i) for i in range(19)], 1)
    chunked = m32(ids)
    error = float((chunked.double() - steps).norm() / steps.norm())
    assert error <= 1e-5, error


@pytest.mark.parametrize("kind", RECURRENT)
@pytest.mark.parametrize("split", [3, 4, 9])
def test_a_split_prompt_equals_the_whole(kind: str, split: int) -> None:
    m = model(kind)
    ids = torch.randint(0, 64, (2, 13))
    whole_cache, split_cache = (make_cache(m.config, 2, 32, torch.float64) for _ in "ab")
    whole = prefill(m, whole_cache, ids)
    parts = [
        prefill(m, split_cache, ids[:, :split]),
        prefill(m, split_cache, ids[:, split:], split),
    ]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-10, atol=1e-10)
    for a, b in zip(whole_cache.layers, split_cache.layers, strict=True):
        if isinstance(a, RecurrentLayerCache):
            torch.testing.assert_close(a.state, b.state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", RECURRENT)
def test_left_padding_never_enters_the_state(kind: str) -> None:
    m = model(kind)
    short, long = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :4] = False
    cache = make_cache(m.config, 2, 32, torch.float64)
    cache.seek(CacheStep.span(0, 9, "cpu", valid))
    positions = (torch.arange(9)[None] - torch.tensor([[4], [0]])).clamp(min=0)
    padded = m(batch, positions, valid, cache)[:, -1]
    alone = make_cache(m.config, 1, 32, torch.float64)
    expected = prefill(m, alone, short)[:, -1]
    torch.testing.assert_close(padded[0], expected[0], rtol=1e-10, atol=1e-10)
    for a, b in zip(cache.layers, alone.layers, strict=True):
        if isinstance(a, RecurrentLayerCache):
            torch.testing.assert_close(a.state[:1], b.state, rtol=1e-10, atol=1e-10)
            if a.conv is not None:
                torch.testing.assert_close(a.conv[:1], b.conv)


@pytest.mark.parametrize("kind", RECURRENT)
def test_gradients_flow_and_pass_gradcheck(kind: str) -> None:
    m = model(kind, d_model=8, n_heads=2, n_kv_heads=1, recurrent_key_dim=3, recurrent_value_dim=2)
    mixer = m.blocks[0].mixer
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mixer(x), (x,))
    m.train()
    ids = torch.randint(0, 64, (2, 9))
    next_token_loss(m(ids[:, :-1]), ids[:, 1:]).backward()
    assert all(p.grad is not None for p in mixer.parameters())


@pytest.mark.parametrize("kind", RECURRENT)
def test_a_rollback_restores_the_checkpoint_and_the_kept_tokens_written_again_are_exact(
    kind: str,
) -> None:
    """Checkpoint after 5 tokens, write 4, drop the last 3: the cache forgets all 4 (the state
    cannot forget fewer), every layer as far; writing the kept one again and 3 new tokens gives
    the logits and states of the 9 tokens written straight (float64, ≤ 1e-12)."""
    m = model(kind)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    other = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(1))
    straight, cache = (make_cache(m.config, 1, 16, torch.float64) for _ in "ab")
    expected = prefill(m, straight, ids)
    prefill(m, cache, ids[:, :5])
    cache.checkpoint()
    prefill(m, cache, torch.cat([ids[:, 5:6], other], 1), start=5)
    assert cache.rollback(3) == 4
    got = prefill(m, cache, ids[:, 5:], start=5)
    torch.testing.assert_close(got, expected[:, 5:], rtol=0, atol=1e-12)
    for a, b in zip(cache.layers, straight.layers, strict=True):
        if isinstance(a, RecurrentLayerCache):
            torch.testing.assert_close(a.state, b.state, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", RECURRENT)
def test_state_rollback_without_a_checkpoint_and_bidirectional_use_are_refused(kind: str) -> None:
    m = model(kind)
    cache = make_cache(m.config, 1, 8, torch.float64)
    prefill(m, cache, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(DecoderLMError, match=r"cannot roll back 1 tokens: .* checkpoint only"):
        cache.rollback(1)
    cache.checkpoint()
    prefill(m, cache, torch.zeros(1, 2, dtype=torch.long), start=3)
    with pytest.raises(DecoderLMError, match=r"checkpoint only \(2 tokens since"):
        cache.layers[0].rollback(1)  # the layer alone: back to the checkpoint or not at all
    assert cache.rollback(1) == 2  # the whole cache: both tokens since, every layer
    with pytest.raises(DecoderLMError, match="causal"):
        m(torch.zeros(1, 3, dtype=torch.long), causal=False)


def test_layer_types_are_validated_in_one_line() -> None:
    with pytest.raises(ConfigError, match="layer_types value 'rnn' is not allowed; choose from: "):
        model("rnn")
    with pytest.raises(ConfigError, match="one per layer"):
        model("gdn", layer_types=("gdn",))
    with pytest.raises(ConfigError, match="sliding_window"):
        model("gdn", sliding_window=4)
    default = ModelConfig(n_layers=2)
    assert default.layer_types is None and not default.has_recurrent_layers
    assert ModelConfig.from_dict(model("gdn").config.to_dict()).layer_types == ("gdn", "attention")


def test_recurrent_layers_add_no_position_limit() -> None:
    assert model("gdn", layer_types=("gdn", "mamba2")).config.decodes_past_context
    assert not model("gdn").config.decodes_past_context
    assert not model(
        "gdn", layer_types=("gdn", "gdn"), position="learned"
    ).config.decodes_past_context


def test_gated_deltanet_matches_transformers_qwen3_5() -> None:
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    m = model("gdn", torch.float32)
    ours = m.blocks[0].mixer
    hf_config = Qwen3_5TextConfig(
        hidden_size=32,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=6,
        linear_value_head_dim=5,
        linear_conv_kernel_dim=4,
        rms_norm_eps=m.config.norm_eps,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    theirs = qwen.Qwen3_5GatedDeltaNet(hf_config, 0).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        expected = theirs(x)
        got = ours(x)
    assert float((got - expected).norm() / expected.norm()) <= 1e-5


def test_mamba2_matches_transformers_mamba2_mixer() -> None:
    mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    from transformers.models.mamba2.configuration_mamba2 import Mamba2Config

    m = model("mamba2", torch.float32, recurrent_heads=8, recurrent_value_dim=8)  # d_inner 2·d
    ours = m.blocks[0].mixer
    hf_config = Mamba2Config(
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        state_size=6,
        n_groups=2,
        expand=2,
        conv_kernel=4,
        chunk_size=4,
        layer_norm_epsilon=m.config.norm_eps,
        num_hidden_layers=1,
    )
    theirs = mamba2.Mamba2Mixer(hf_config, 0).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        expected = theirs(x)
        got = ours(x)
    assert float((got - expected).norm() / expected.norm()) <= 1e-5


@pytest.mark.parametrize("name", ["hybrid-tiny", "recurrent-tiny"])
def test_the_recurrent_presets_build_and_run(name: str) -> None:
    config = ModelConfig.from_preset(name)
    assert config.has_recurrent_layers
    m = DecoderLM(config)
    kinds = [block.kind for block in m.blocks]
    assert kinds == list(config.layer_types)
    assert m(torch.randint(0, 2048, (1, 70))).shape == (1, 70, 2048)


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_the_config_counts_what_the_model_builds(kind: str) -> None:
    """n_attention_layers and recurrent_conv_channels, the one home of each count, are the
    built model's: its attention blocks, its mixer's conv, and the cache's conv state."""
    m = model(kind, n_layers=3, layer_types=(kind, "attention", kind))
    config = m.config
    assert config.n_attention_layers == 1 == sum(b.kind == "attention" for b in m.blocks)
    conv = m.blocks[0].mixer.conv1d
    channels = 2 * 2 * 6 + 4 * 5  # 2·H_k·d_k + H·d_v
    assert conv.in_channels == config.recurrent_conv_channels == channels
    cache = HybridCache(config, batch_size=3, max_len=8)
    assert cache.layers[0].conv.shape == (3, channels, config.recurrent_conv - 1)
