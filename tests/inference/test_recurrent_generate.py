"""Generation over recurrent layers' state: `generate`, `stream` and `evaluate` on a hybrid (GDN +
attention) and on pure recurrent models (GDN, Mamba-2, linear attention), through the one cache
`make_cache` builds; padded batches equal each prompt alone; a pure recurrent model decodes past
its context; `compile=True` equals eager decoding; and `decoderlm info` shows
the state bytes. The serving engine's side is tests/serving/test_engine_recurrent.py."""

import json

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig, generate
from decoderlm.cli import main
from decoderlm.inference.evaluate import evaluate_tokens
from decoderlm.inference.stream import stream
from decoderlm.model.cache import recurrent_state_bytes
from decoderlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_TYPES = {
    "hybrid": ("gdn", "attention", "mamba2"),
    "gdn": ("gdn",) * 3,
    "mamba2": ("mamba2",) * 3,
    "linear_attention": ("linear_attention",) * 3,
}


def tiny(kind: str, context_length: int = 48, vocab_size: int = 61) -> DecoderLM:
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=vocab_size,
        context_length=context_length,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        layer_types=LAYER_TYPES[kind],
        recurrent_key_heads=2,
        recurrent_chunk=4,
    )
    return DecoderLM(config).double().eval()


def greedy_reference(model: DecoderLM, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation by a full forward pass over everything so far, at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids])
            logits = model(x, positions=torch.arange(len(ids)))
            ids.append(int(logits[0, -1].argmax()))
    return ids


PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9], [7, 1], [2, 7, 18, 28, 18]]


@pytest.mark.parametrize("kind", list(LAYER_TYPES))
def test_greedy_generate_equals_full_forward_passes(kind: str) -> None:
    model = tiny(kind)
    for prompt in PROMPTS:
        assert generate(model, [prompt], 12, temperature=0) == [greedy_reference(model, prompt, 12)]


@pytest.mark.parametrize("kind", ["hybrid", "mamba2"])
def test_a_padded_batch_equals_each_prompt_alone(kind: str) -> None:
    model = tiny(kind)
    batch = generate(model, PROMPTS, 10, temperature=0)
    alone = [generate(model, [p], 10, temperature=0)[0] for p in PROMPTS]
    assert batch == alone


@pytest.mark.parametrize("kind", ["hybrid", "gdn"])
def test_sampling_and_num_samples(kind: str) -> None:
    model = tiny(kind)
    rows = generate(model, PROMPTS[:2], 8, seed=3, num_samples=3, temperature=1.0, top_k=20)
    assert len(rows) == 6 and all(len(r) == len(PROMPTS[i // 3]) + 8 for i, r in enumerate(rows))
    assert rows == generate(model, PROMPTS[:2], 8, seed=3, num_samples=3, temperature=1.0, top_k=20)


def test_a_pure_recurrent_model_decodes_past_its_context() -> None:
    model = tiny("gdn", context_length=16)
    assert model.config.decodes_past_context
    out = generate(model, [PROMPTS[0]], 30, temperature=0)[0]
    assert out == greedy_reference(model, PROMPTS[0], 30)  # 39 tokens > 16


def test_a_hybrid_is_bounded_by_its_context_unless_it_refills() -> None:
    model = tiny("hybrid", context_length=16)
    with pytest.raises(DecoderLMError, match="context"):
        generate(model, [PROMPTS[0]], 30, temperature=0)
    out = generate(model, [PROMPTS[0]], 30, temperature=0, refill_past_context=True)[0]
    assert len(out) == 39
    assert out[:16] == greedy_reference(model, PROMPTS[0], 7)  # before the first refill


def test_stream_and_evaluate_run_on_a_hybrid() -> None:
    tokenizer = Tokenizer.train_char(["abcdefghij klmnop"])
    model = tiny("hybrid", vocab_size=tokenizer.vocab_size)
    text = "".join(stream(model, tokenizer, "abc", 6, temperature=0, ignore_eos=True))
    ids = tokenizer.encode("abc")
    expected = greedy_reference(model, ids, 6)[len(ids) :]
    assert tokenizer.encode(text) == expected
    tokens = torch.randint(0, tokenizer.vocab_size, (100,))
    plain = evaluate_tokens(model, tokens, context_length=32)
    cached = evaluate_tokens(model, tokens, context_length=32, kv_cache_dtype="int8")
    assert plain.loss == pytest.approx(cached.loss, rel=1e-2)


@pytest.mark.parametrize("preset", ["hybrid-tiny", "recurrent-tiny"])
def test_compiled_decoding_equals_eager_token_for_token(preset: str) -> None:
    # float32, a padded batch, 40 new tokens: the compiled step carries the recurrent states
    # (and the hybrid's K/V) exactly as the eager one does; greedy and seeded sampling alike.
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_preset(preset, vocab_size=61)).float().eval()
    greedy = {c: generate(model, PROMPTS, 40, temperature=0, compile=c) for c in (False, True)}
    assert greedy[True] == greedy[False]
    sampled = {
        c: generate(model, PROMPTS, 40, temperature=1.0, top_k=20, seed=5, compile=c)
        for c in (False, True)
    }
    assert sampled[True] == sampled[False]


def test_info_shows_the_state_bytes_beside_the_kv_bytes(capsys) -> None:
    assert main(["info", "--preset", "hybrid-tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    config = ModelConfig.from_preset("hybrid-tiny")
    # 3 GDN layers: state 4 heads · 32 · 32 and conv (2·2·32 + 4·32) channels · 3, float32
    assert info["recurrent_state_bytes"]["float32"] == 3 * 4 * (4 * 32 * 32 + 256 * 3)
    assert info["recurrent_state_bytes"]["float32"] == recurrent_state_bytes(config)
    kv = {row["variant"]: row for row in info["kv_cache"]}["model"]
    assert kv["bytes_per_token"] == 2 * 1 * 2 * 32 * 4  # K and V of the one attention layer
    assert main(["info", "--preset", "hybrid-tiny"]) == 0
    assert "recurrent state, 3 layers" in capsys.readouterr().out


def test_hugging_face_export_refuses_a_hybrid_no_hf_family_holds() -> None:
    from decoderlm.hf.config import hf_model_type

    # GDN layers with plain attention: Qwen3.5's layout has gated attention and 1 + w norms.
    with pytest.raises(DecoderLMError, match="no HF model family has"):
        hf_model_type(ModelConfig.from_preset("hybrid-tiny"))
