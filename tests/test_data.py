"""Data directories and batch sampling: meta checks, exact resume, the distributed contract."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from decoderlm.data import BatchSampler, load_split, read_meta
from decoderlm.errors import DecoderLMError


def write_data_dir(path: Path, train: np.ndarray, val: np.ndarray, dtype: str = "uint16") -> Path:
    """A data directory written by hand (independent of `prepare`), for the readers' tests."""
    path.mkdir(parents=True, exist_ok=True)
    train.astype(dtype).tofile(path / "train.bin")
    val.astype(dtype).tofile(path / "val.bin")
    meta = {
        "vocab_size": int(max(train.max(), val.max())) + 1,
        "dtype": dtype,
        "tokenizer": "tokenizer.json",
        "eot_id": None,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "train_bytes": len(train),
        "val_bytes": len(val),
        "n_documents": 1,
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path


# ---------------------------------------------------------------- read_meta / load_split


def test_load_split_returns_the_written_tokens_as_memmap(tmp_path) -> None:
    train, val = np.arange(1000) % 70000, np.arange(50)
    data = write_data_dir(tmp_path / "d", train, val, dtype="uint32")
    loaded = load_split(data, "train")
    assert isinstance(loaded, np.memmap) and loaded.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(loaded, train)
    np.testing.assert_array_equal(load_split(data, "val"), val)


def test_read_meta_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(DecoderLMError, match="no such data directory"):
        read_meta(tmp_path / "nope")
    with pytest.raises(DecoderLMError, match=r"meta\.json is missing"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{truncated")
    with pytest.raises(DecoderLMError, match="not valid JSON"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(DecoderLMError, match="lacks dtype"):
        read_meta(tmp_path)


def test_load_split_detects_a_truncated_bin_file(tmp_path) -> None:
    data = write_data_dir(tmp_path, np.arange(100), np.arange(10))
    with open(data / "train.bin", "r+b") as f:
        f.truncate(150)  # a prepare killed mid-write, or a copy cut short
    with pytest.raises(
        DecoderLMError, match=r"has 150 bytes but meta\.json says 100 uint16 tokens"
    ):
        load_split(data, "train")
    with pytest.raises(DecoderLMError, match="split='test'"):
        load_split(data, "test")


# ---------------------------------------------------------------- BatchSampler

TOKENS = np.arange(10_000, dtype=np.uint16)  # token i has value i: windows are easy to check


@pytest.mark.parametrize("without_replacement", [False, True])
def test_batches_are_windows_with_targets_shifted_by_one(without_replacement: bool) -> None:
    sampler = BatchSampler(TOKENS, 4, 16, seed=3, without_replacement=without_replacement)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # y_t = x_{t+1}, since TOKENS[i] = i
    assert torch.equal(x - x[:, :1], torch.arange(16).expand(4, 16))  # contiguous windows


@pytest.mark.parametrize("without_replacement", [False, True])
def test_resumed_sampler_continues_the_exact_stream(without_replacement: bool) -> None:
    kwargs = dict(seed=7, without_replacement=without_replacement)
    original = BatchSampler(TOKENS, 8, 32, **kwargs)
    for _ in range(5):
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))  # as it travels through a checkpoint
    resumed = BatchSampler(TOKENS, 8, 32, **kwargs)
    resumed.load_state_dict(state)
    for _ in range(50):  # crosses epochs without replacement: 312 windows, 8 per batch
        a, b = original.next_batch(), resumed.next_batch()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_different_seeds_give_different_batches() -> None:
    a = BatchSampler(TOKENS, 8, 32, seed=0).next_batch()[0]
    b = BatchSampler(TOKENS, 8, 32, seed=1).next_batch()[0]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("without_replacement", [False, True])
def test_ranks_slice_the_single_process_global_batch(without_replacement: bool) -> None:
    world, batch = 3, 4
    kwargs = dict(seed=11, without_replacement=without_replacement)
    single = BatchSampler(TOKENS, batch * world, 32, **kwargs)
    ranks = [
        BatchSampler(TOKENS, batch, 32, rank=r, world_size=world, **kwargs) for r in range(world)
    ]
    for _ in range(40):  # 312 windows, 12 per global batch: crosses epoch boundaries too
        x, y = single.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))


def test_without_replacement_uses_each_window_once_per_epoch() -> None:
    tokens = np.arange(16 * 10 + 1, dtype=np.uint16)  # exactly 10 non-overlapping windows of 16
    sampler = BatchSampler(tokens, 3, 16, seed=5, without_replacement=True)
    starts = [int(s) for _ in range(10) for s in sampler.next_batch()[0][:, 0]]  # 3 epochs
    for epoch in range(3):
        assert sorted(starts[10 * epoch : 10 * epoch + 10]) == list(range(0, 160, 16))
    assert starts[:10] != starts[10:20]  # a fresh permutation each epoch
    assert sampler.state_dict()["epoch"] == 3


def test_with_replacement_reaches_the_last_window() -> None:
    tokens = np.arange(20, dtype=np.uint16)  # starts 0..3 for context 16
    sampler = BatchSampler(tokens, 64, 16, seed=0)
    assert set(sampler.next_batch()[0][:, 0].tolist()) == {0, 1, 2, 3}


def test_short_split_raises_a_clear_error(tmp_path) -> None:
    data = write_data_dir(tmp_path, np.arange(100), np.arange(10))
    with pytest.raises(DecoderLMError, match=r"val\.bin has 10 tokens, fewer than context_length"):
        BatchSampler(load_split(data, "val"), 2, 64)
    assert BatchSampler(np.arange(65), 2, 64).next_batch()[0].shape == (2, 64)  # just enough


def test_resume_with_a_different_geometry_is_refused() -> None:
    state = BatchSampler(TOKENS, 8, 32).state_dict()
    with pytest.raises(DecoderLMError, match="global_batch=8"):
        BatchSampler(TOKENS, 4, 32).load_state_dict(state)
    BatchSampler(TOKENS, 4, 32, world_size=2).load_state_dict(state)  # same global batch: fine


def test_bad_sampler_arguments_are_named() -> None:
    with pytest.raises(DecoderLMError, match="batch_size=0"):
        BatchSampler(TOKENS, 0, 32)
    with pytest.raises(DecoderLMError, match="rank=2"):
        BatchSampler(TOKENS, 1, 32, rank=2, world_size=2)
