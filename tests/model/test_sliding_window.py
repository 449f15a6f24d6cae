"""Sliding-window attention: the mask rule, every backend against float64, O(T·W) work, the ring cache.

The mask is checked against transformers' own rule (`sliding_window_causal_mask_function`); every
backend is then compared with the float64 formula under that mask. Tolerances: as in
tests/model/test_flash.py, fp32 inputs against float64, atol 2e-5 / rtol 1e-4 (measured errors
≤ 1e-6; a wrong tile or window edge gives errors ~1e-1). Ring-cache decoding is compared with full
recomputation of every prefix in fp32: atol 1e-5 on O(1) logits (measured ~1e-6). The Triton
kernels run in a child process under TRITON_INTERPRET=1 (this file run as a script), as in
tests/model/test_flash_triton.py, or in-process on a CUDA device.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from decoderlm.cpu.attention import blockwise_attention, cpu_attend
from decoderlm.errors import ConfigError, DecoderLMError
from decoderlm.model import flash
from decoderlm.model.attention import attend, scaled_dot_product_attention
from decoderlm.model.cache import CacheStep, RingKVCache
from decoderlm.model.config import ModelConfig
from decoderlm.model.flash import flash_attention
from decoderlm.model.lm import DecoderLM
from decoderlm.model.masks import build_mask, causal_mask

FP32_TOL = dict(atol=2e-5, rtol=1e-4)
LOGITS_ATOL = 1e-5

CASES = {  # id: (B, Hq, Hkv, Tq, Tk, D, W); tiles of 16 queries × 32 keys (see _small_tiles)
    "t77-gqa-w5-smaller-than-a-tile": (2, 4, 2, 77, 77, 16, 5),
    "t77-mqa-w1-itself-only": (1, 4, 1, 77, 77, 8, 1),
    "t101-mha-w40-crosses-tiles": (2, 2, 2, 101, 101, 16, 40),
    "t53-gqa-w53-equals-t": (1, 4, 2, 53, 53, 16, 53),
    "t53-gqa-w200-exceeds-t": (1, 4, 2, 53, 53, 16, 200),
    "tq9-tk131-cache-w17": (2, 4, 2, 9, 131, 16, 17),
    "tq1-tk131-decode-w33": (2, 4, 1, 1, 131, 16, 33),
    "tq9-tk4-more-queries-than-keys-w2": (1, 2, 1, 9, 4, 8, 2),
}


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough that test-sized inputs cross many of them, skipped and masked alike."""
    monkeypatch.setattr(flash, "BLOCK_Q", 16)
    monkeypatch.setattr(flash, "BLOCK_K", 32)


def _inputs(b, hq, hkv, t_q, t_k, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t_q, d, generator=g)
    k, v = (torch.randn(b, hkv, t_k, d, generator=g) for _ in range(2))
    do = torch.randn(b, hq, t_q, d, generator=g)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _padding(b, t_k, seed=0):
    """(B, Tk) key mask with ~20% of the keys hidden, the last key of each row always real."""
    mask = torch.rand(b, t_k, generator=torch.Generator().manual_seed(seed)) > 0.2
    mask[:, -1] = True
    return mask


def _reference(q, k, v, do, window, key_padding_mask=None):
    """out, dq, dk, dv of softmax(QKᵀ/√d + M)V in float64, M the causal window mask."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    mask = build_mask(q.shape[2], k.shape[2], True, key_padding_mask, q.device, window)
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    return (out, *torch.autograd.grad(out, (q, k, v), do.double()))


def _grads(fn, q, k, v, do):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _assert_close(got, want):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, **FP32_TOL, msg=name)


def test_window_mask_is_transformers_sliding_window_rule():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    for t_q, t_k, w in [(9, 9, 3), (4, 11, 5), (1, 11, 4), (6, 6, 1), (5, 5, 8)]:
        rule = masking_utils.sliding_window_causal_mask_function(w)
        shift = t_k - t_q  # our queries are the last t_q of t_k positions
        i, j = torch.arange(t_q)[:, None] + shift, torch.arange(t_k)[None, :]
        expected = rule(torch.tensor(0), torch.tensor(0), i, j)  # (t_q, t_k)
        assert torch.equal(causal_mask(t_q, t_k, window=w), expected), (t_q, t_k, w)
    # i − W < j ≤ i: query 5 of a window of 3 sees keys 3, 4, 5.
    assert causal_mask(6, 6, window=3)[5].nonzero().flatten().tolist() == [3, 4, 5]


def test_a_window_of_at_least_the_keys_changes_nothing_and_a_bad_window_is_refused():
    assert build_mask(1, 8, True, None, "cpu", window=8) is None  # one query, every key visible
    assert torch.equal(build_mask(5, 8, True, None, "cpu", window=8), causal_mask(5, 8))
    assert build_mask(5, 8, False, None, "cpu", window=2) is None  # a window narrows causal only
    for bad in (0, -3, 2.5, True):
        with pytest.raises(DecoderLMError, match=rf"sliding window={bad!r} must be a positive"):
            build_mask(4, 4, True, None, "cpu", window=bad)


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "key-padding"])
@pytest.mark.parametrize("case", list(CASES))
def test_windowed_flash_forward_and_backward_match_float64(small_tiles, case, padded):
    b, hq, hkv, t_q, t_k, d, w = CASES[case]
    q, k, v, do = _inputs(b, hq, hkv, t_q, t_k, d)
    pad = _padding(b, t_k) if padded else None

    def windowed(q, k, v):
        return flash_attention(q, k, v, causal=True, key_padding_mask=pad, window=w)

    _assert_close(_grads(windowed, q, k, v, do), _reference(q, k, v, do, w, pad))


def test_windowed_flash_with_default_tiles_matches_float64():
    q, k, v, do = _inputs(1, 4, 2, 700, 700, 16)  # 6 query tiles of 128, W < BLOCK_K = 512
    for w in (37, 300):

        def windowed(q, k, v, w=w):
            return flash_attention(q, k, v, causal=True, window=w)

        _assert_close(_grads(windowed, q, k, v, do), _reference(q, k, v, do, w))


# id: (B, Hq, Hkv, Tq, Tk, W, key padding); the interpreter's tiles are 16–32 rows, head_dim 16.
TRITON_CASES = {
    "t77-gqa-w5-smaller-than-a-tile": (1, 4, 2, 77, 77, 5, False),
    "t77-mqa-w1-padded": (1, 4, 1, 77, 77, 1, True),
    "t70-mha-w40": (1, 2, 2, 70, 70, 40, True),
    "t50-w70-exceeds-t": (1, 2, 1, 50, 50, 70, False),
    "tq17-tk100-cache-w9": (1, 4, 2, 17, 100, 9, True),
    "tq1-tk50-decode-w7": (2, 2, 1, 1, 50, 7, False),
    "tq40-tk10-more-queries-than-keys-w3": (1, 2, 1, 40, 10, 3, False),
}


def _triton_excess(device: str) -> dict[str, list[float]]:
    """Per case, max(|ours − float64| − rtol·|float64|) of out, dq, dk, dv: ≤ atol passes."""
    from decoderlm.model.kernels import flash_triton as ft

    torch.set_float32_matmul_precision("highest")  # IEEE fp32 tl.dot on a GPU, as interpreted
    results = {}
    for name, (b, hq, hkv, t_q, t_k, w, padded) in TRITON_CASES.items():
        q, k, v, do = (x.detach().to(device) for x in _inputs(b, hq, hkv, t_q, t_k, 16))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        pad = _padding(b, t_k).to(device) if padded else None

        def windowed(q, k, v, pad=pad, w=w):
            return ft.flash_attention_triton(q, k, v, causal=True, key_padding_mask=pad, window=w)

        got = _grads(windowed, q, k, v, do)
        want = _reference(q, k, v, do, w, pad)
        results[name] = [
            ((a.double() - r).abs() - FP32_TOL["rtol"] * r.abs()).max().item()
            for a, r in zip(got, want, strict=True)
        ]
    return results


@pytest.fixture(scope="module")
def triton_excess() -> dict[str, list[float]]:
    pytest.importorskip(
        "triton", reason="triton is not installed (pip install 'decoderlm[triton]')"
    )
    if torch.cuda.is_available():
        return _triton_excess("cuda")
    child = subprocess.run(
        [sys.executable, __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, f"interpreter run failed:\n{child.stderr[-6000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_windowed_triton_kernels_match_float64(triton_excess, case):
    for name, excess in zip(("out", "dq", "dk", "dv"), triton_excess[case], strict=True):
        assert excess <= FP32_TOL["atol"], f"{name}: {excess:.2e} beyond rtol·|ref| + atol"


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize(("t_q", "t_k"), [(45, 45), (6, 45), (1, 45)])
def test_every_backend_applies_the_window(backend, t_q, t_k):
    q, k, v, do = _inputs(2, 4, 2, t_q, t_k, 16)
    pad = _padding(2, t_k)
    for key_padding_mask in (None, pad):

        def windowed(q, k, v, kpm=key_padding_mask):
            return attend(q, k, v, key_padding_mask=kpm, backend=backend, window=7)[0]

        _assert_close(_grads(windowed, q, k, v, do), _reference(q, k, v, do, 7, key_padding_mask))


@pytest.mark.parametrize(("t_q", "t_k"), [(45, 45), (6, 45), (1, 45)])
def test_cpu_blockwise_attention_and_cpu_attend_apply_the_window(t_q, t_k):
    q, k, v, do = _inputs(2, 4, 2, t_q, t_k, 16)
    pad = _padding(2, t_k)

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, key_padding_mask=pad, block_size=8, window=7)

    _assert_close(_grads(blockwise, q, k, v, do), _reference(q, k, v, do, 7, pad))
    for backend in ("math", "sdpa"):

        def fast(q, k, v, backend=backend):
            return cpu_attend(q, k, v, key_padding_mask=pad, backend=backend, window=7)[0]

        _assert_close(_grads(fast, q, k, v, do), _reference(q, k, v, do, 7, pad))


def _forward_flops(t: int, window: int | None) -> int:
    q, k, v, _ = _inputs(1, 2, 1, t, t, 16)
    with FlopCounterMode(display=False) as counter:
        flash_attention(q.detach(), k.detach(), v.detach(), causal=True, window=window)
    return counter.get_total_flops()


def test_windowed_flash_work_grows_as_t_times_w(monkeypatch):
    monkeypatch.setattr(flash, "BLOCK_Q", 32)
    monkeypatch.setattr(flash, "BLOCK_K", 128)
    # A query tile [i0, i0 + 32) reads keys (i0 − W, i0 + 32) only: ≤ 31 + W of them, where plain
    # causal attention reads on average (T + 32)/2 keys (528 at T = 1024).
    w16_512, w16_1k = _forward_flops(512, 16), _forward_flops(1024, 16)
    assert w16_1k <= 2.05 * w16_512  # linear in T (plain causal: ×3.9)
    assert w16_1k <= 0.1 * _forward_flops(1024, None)  # 47 / 528 = 0.089
    assert 1.2 * w16_1k <= _forward_flops(1024, 32) <= 1.4 * w16_1k  # (32 + 31)/(32 + 15) = 1.34


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_windowed_flash_keeps_no_t_by_t_tensor_forward_or_backward(monkeypatch):
    monkeypatch.setattr(flash, "BLOCK_Q", 128)
    monkeypatch.setattr(flash, "BLOCK_K", 512)
    t, w = 2048, 16
    q, k, v, do = _inputs(1, 2, 1, t, t, 16)
    with _LargestTensor() as largest:
        out = flash_attention(q, k, v, causal=True, window=w)
        torch.autograd.grad(out, (q, k, v), do)
    # The largest tensors: q, O, dQ (B·Hq·T·D = 65536 elements) and the scratch score tiles of
    # (B·Hkv, G·128 rows, 128 + W − 1 keys) = 36608; a (T, T) score matrix would be 4194304.
    assert largest.numel == max(q.numel(), 1 * 2 * 128 * (128 + w - 1)) == 65536


def _model(**overrides) -> DecoderLM:
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
        sliding_window=5,
    )
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(**{**config, **overrides})).eval()


def _full_logits(model, idx, valid):
    """Logits of the last position, recomputed over every token so far (no cache)."""
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # (B, T): 0 at each row's first token
    return model(idx, positions=positions, key_padding_mask=valid)[:, -1]


def _decode_with_ring(model, prompt, valid, n_new, chunks=(None,)):
    """Greedy decoding with a RingKVCache; after each token, the ring's logits and the full ones."""
    b, n = prompt.shape
    cache = RingKVCache(model.config, b, max_len=n + n_new)
    starts = [0, *(c for c in chunks if c is not None), n]
    idx, pairs = prompt, []
    with torch.no_grad():
        for s0, s1 in itertools.pairwise(starts):  # the prefill, in chunks
            positions = (valid.long().cumsum(1) - 1).clamp(min=0)[:, s0:s1]
            real = None if valid.all() else valid[:, s0:s1]  # None: all real
            cache.seek(CacheStep.span(s0, s1 - s0, "cpu", real))
            logits = model(prompt[:, s0:s1], positions, valid[:, :s1], cache)[:, -1]
        for _ in range(n_new):
            pairs.append((logits, _full_logits(model, idx, valid)))
            token = logits.argmax(-1, keepdim=True)  # (B, 1)
            slot = torch.tensor([idx.shape[1]])
            position = valid.sum(1, keepdim=True)  # (B, 1)
            idx, valid = torch.cat([idx, token], 1), torch.cat([valid, torch.ones_like(token)], 1)
            valid = valid.bool()
            cache.seek(CacheStep(slot, idx.shape[1]))
            logits = model(token, position, valid, cache)[:, -1]
    return cache, pairs


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("chunks", [(None,), (4,)], ids=["one-prefill", "chunked-prefill"])
def test_ring_cache_decoding_equals_full_recomputation_with_the_window(backend, chunks):
    model = _model(attn_backend=backend)
    prompt = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False  # row 1 is left-padded: 6 tokens
    cache, pairs = _decode_with_ring(model, prompt, valid, n_new=30, chunks=chunks)
    for ring, full in pairs:
        torch.testing.assert_close(ring, full, atol=LOGITS_ATOL, rtol=0)
    # Only the last W = 5 positions are kept, whatever the generated length (9 + 30 tokens).
    assert all(layer.k.shape == (2, 2, 5, 8) for layer in cache.layers)
    assert cache.nbytes == 2 * 2 * (2 * 2 * 5 * 8) * 4  # K and V · layers · (B·Hkv·W·hd) · fp32


def test_ring_cache_with_full_attention_layers_equals_full_recomputation():
    model = _model(n_layers=3, sliding_window=4, sliding_window_layers=[1, 2])  # Qwen2's layout
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    cache, pairs = _decode_with_ring(model, prompt, torch.ones(1, 7, dtype=torch.bool), n_new=20)
    for ring, full in pairs:
        torch.testing.assert_close(ring, full, atol=LOGITS_ATOL, rtol=0)
    assert [tuple(layer.k.shape[2:3]) for layer in cache.layers] == [(27,), (4,), (4,)]


def test_ring_cache_decodes_past_context_length_without_refill():
    # position="none": the cache and attention are all that could stop at context_length.
    model = _model(position="none", context_length=16, sliding_window=6)
    prompt = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    ones = torch.ones(1, 10, dtype=torch.bool)
    cache, pairs = _decode_with_ring(
        model, prompt, ones, n_new=40
    )  # up to 50 tokens: 3× the context
    for ring, full in pairs:
        torch.testing.assert_close(ring, full, atol=LOGITS_ATOL, rtol=0)
    assert cache.nbytes == 2 * 2 * (1 * 2 * 6 * 8) * 4


def test_ring_cache_refuses_a_model_without_a_window_or_full_layers_without_max_len():
    with pytest.raises(DecoderLMError, match="needs a model with a sliding_window"):
        RingKVCache(_model(sliding_window=None).config, 1, 8)
    with pytest.raises(DecoderLMError, match="needs max_len for the layers without"):
        RingKVCache(_model(sliding_window_layers=[1]).config, 1)


def test_a_window_at_least_the_sequence_gives_the_unwindowed_model():
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = _model(sliding_window=None)(idx)
        assert torch.equal(_model(sliding_window=12)(idx), plain)
        windowed = _model(sliding_window=3)(idx)
    # Positions 0..2 see at most 3 keys either way; from position 3 on the window hides some.
    torch.testing.assert_close(windowed[:, :3], plain[:, :3], atol=1e-6, rtol=0)
    assert (windowed[:, 3:] - plain[:, 3:]).abs().amax(dim=(0, 2)).min() > 1e-3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(sliding_window=0), "sliding_window=0 must be a positive integer or None"),
        (dict(sliding_window=2.0), "sliding_window=2.0 must be a positive integer or None"),
        (dict(sliding_window_layers=[0]), "sliding_window_layers=(0,) needs sliding_window"),
        (
            dict(sliding_window=4, sliding_window_layers=[2]),
            "sliding_window_layers=(2,) must be increasing layer indices in [0, n_layers=2)",
        ),
        (
            dict(sliding_window=4, sliding_window_layers=[1, 0]),
            "sliding_window_layers=(1, 0) must be increasing",
        ),
    ],
)
def test_invalid_window_config_gives_one_line_error(overrides, message):
    base = dict(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4)
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{**base, **overrides})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_window_config_round_trips_through_json(tmp_path):
    config = _model(n_layers=3, sliding_window=4, sliding_window_layers=[1, 2]).config
    config.to_json(tmp_path / "c.json")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert (saved["sliding_window"], saved["sliding_window_layers"]) == (4, [1, 2])
    back = ModelConfig.from_json(tmp_path / "c.json")
    assert back == config and back.sliding_window_layers == (1, 2)
    assert [back.layer_window(i) for i in range(3)] == [None, 4, 4]


if __name__ == "__main__":  # the interpreter run of the Triton cases (see `triton_excess`)
    print(json.dumps(_triton_excess("cpu")))
