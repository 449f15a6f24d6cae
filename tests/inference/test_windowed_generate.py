"""Generation with sliding-window models: the ring cache decodes past context_length exactly."""

import pytest
import torch

import decoderlm
from decoderlm import DecoderLM, DecoderLMError, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def windowed_model(**overrides) -> DecoderLM:
    torch.manual_seed(0)
    config = dict(
        vocab_size=48,
        context_length=16,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        sliding_window=5,
        init_std=0.5,  # varied greedy tokens, so that agreement means something
        attn_backend="math",
    )
    return DecoderLM(ModelConfig(**{**config, **overrides})).double().eval()


def greedy_by_recomputation(model: DecoderLM, prompt: list[int], n: int) -> list[int]:
    """Each token from a forward pass over the whole sequence so far (explicit positions, the window
    mask of every layer), no cache: the definition the ring cache must reproduce."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids])
            logits = model(x, positions=torch.arange(len(ids)))  # (1, T, V)
            ids.append(int(logits[0, -1].argmax()))
    return ids


@pytest.mark.parametrize("position", ["rope", "none"])
def test_ring_cache_decodes_past_the_context_as_full_recomputation(position):
    model = windowed_model(position=position)
    prompt = [3, 17, 5, 9, 30, 2, 11]
    n = 3 * model.config.context_length  # 48 tokens: three contexts past the prompt
    out = decoderlm.generate(model, [prompt], n, temperature=0)[0]
    assert len(out) == len(prompt) + n
    assert out == greedy_by_recomputation(model, prompt, n)
    assert len(set(out[len(prompt) :])) > 3  # not one repeated token


def test_padded_windowed_batch_gives_each_prompt_its_solo_tokens():
    model = windowed_model()
    prompts = [[3, 17, 5], [9, 30, 2, 11, 7, 7, 1, 4, 40], [8]]
    together = decoderlm.generate(model, prompts, 30, temperature=0)
    alone = [decoderlm.generate(model, [p], 30, temperature=0)[0] for p in prompts]
    assert together == alone


def test_a_model_with_some_full_layers_still_stops_at_its_context():
    model = windowed_model(sliding_window_layers=(0,))
    with pytest.raises(DecoderLMError, match="exceeds context_length=16"):
        decoderlm.generate(model, [[1, 2, 3]], 20, temperature=0)
    out = decoderlm.generate(model, [[1, 2, 3]], 13, temperature=0)[0]
    assert out == greedy_by_recomputation(model, [1, 2, 3], 13)


def test_windowed_decoding_refuses_compile_with_one_line():
    with pytest.raises(DecoderLMError, match="ring KV cache") as info:
        decoderlm.generate(windowed_model(), [[1, 2]], 4, temperature=0, compile=True)
    assert "\n" not in str(info.value)


def test_engine_serves_a_windowed_model_past_its_window_exactly():
    from decoderlm.engine.engine import Engine
    from decoderlm.engine.types import RequestParams
    from decoderlm.tokenizer import Tokenizer

    model = windowed_model(sliding_window=12, context_length=40)  # the engine stops at the context
    tokenizer = Tokenizer.train_char(["abcdefghijklmnopqrstuvwxyz .,;:!?ABCDEFGHIJKLMN"])  # 48 ids
    engine = Engine(model, tokenizer, kv_cache_memory="1MiB")
    assert engine.max_sequence == model.config.context_length
    greedy = decoderlm.SamplingParams(temperature=0)
    params = RequestParams(max_tokens=20, sampling=greedy, ignore_eos=True)  # as the reference
    prompts = [[3, 17, 5], [9, 30, 2, 11, 7]]
    for prompt, completion in zip(prompts, engine.generate(prompts, params), strict=True):
        assert len(prompt) + len(completion.token_ids) == len(prompt) + 20  # past the window
        assert prompt + completion.token_ids == greedy_by_recomputation(model, prompt, 20)
