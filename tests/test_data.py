"""Data directories and batch sampling: meta checks, exact resume, the distributed contract."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from decoderlm import data
from decoderlm.cli import main
from decoderlm.data import (
    BatchSampler,
    load_split,
    preparation,
    prepare,
    prepare_default_corpus,
    read_meta,
    stdlib_dir,
)
from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer import Tokenizer

EOT = Tokenizer.EOT


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
    states, stream = [], []
    for _ in range(70):  # crosses epochs (312 windows, 8 per batch) and chunks (64 batches)
        states.append(json.loads(json.dumps(original.state_dict())))  # as through a checkpoint
        stream.append(original.next_batch())
    assert all(not torch.equal(a[0], b[0]) for a, b in itertools.pairwise(stream))
    for step in (5, 63, 64):
        resumed = BatchSampler(TOKENS, 8, 32, **kwargs)
        resumed.load_state_dict(states[step])
        for x, y in stream[step:]:
            a, b = resumed.next_batch()
            assert torch.equal(a, x) and torch.equal(b, y)


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
    for _ in range(70):  # 312 windows, 12 per global batch: crosses epochs and chunks of 64 too
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


# ---------------------------------------------------------------- prepare


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Files, a nested directory, a binary file, a file the globs leave out, a hidden directory."""
    root = tmp_path / "corpus"
    (root / "pkg" / "deep").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b_notes.txt").write_text("To be, or not to be: that is the question.\n" * 30)
    (root / "a_intro.md").write_text("# Título\n\nUnicode — ‘quotes’ and emoji 😀.\n" * 20)
    (root / "pkg" / "mod.py").write_text("def f(x):\n    return x * 2\n" * 40)
    (root / "pkg" / "deep" / "util.py").write_text("import os\nprint(os.getcwd())\n" * 25)
    (root / "pkg" / "logo.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")  # binary
    (root / "pkg" / "latin1.txt").write_bytes("café".encode("latin-1"))  # not UTF-8
    (root / "pkg" / "data.bin").write_bytes(b"not included: no glob matches .bin")
    (root / ".git" / "HEAD.txt").write_text("hidden directories are skipped")
    (root / "empty.txt").write_text("")
    return root


DOCS_IN_ORDER = ["a_intro.md", "b_notes.txt", "pkg/deep/util.py", "pkg/mod.py"]  # sorted paths


def decoded_split(out: Path, split: str) -> str:
    return Tokenizer.from_file(out / "tokenizer.json").decode(load_split(out, split).tolist())


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_prepare_tokenizes_the_corpus_in_sorted_order(corpus: Path, tmp_path, kind: str) -> None:
    out = tmp_path / "out"
    with pytest.warns(UserWarning) as caught:
        meta = prepare([corpus], out, tokenizer=kind, vocab_size=300, progress=False)
    assert [str(w.message) for w in caught] == [
        f"skipping {corpus / 'pkg' / 'latin1.txt'}: not UTF-8 text",
        f"skipping {corpus / 'pkg' / 'logo.txt'}: a binary file",
    ]
    assert meta == read_meta(out)
    docs = [(corpus / name).read_text() for name in DOCS_IN_ORDER]
    train, val = decoded_split(out, "train"), decoded_split(out, "val")
    # Every document is followed by <|endoftext|>; the document at the 90% cut is cut in two.
    assert (train + val).replace(EOT, "") == "".join(docs)
    assert train.count(EOT) + val.count(EOT) == len(docs) + 1
    assert val.endswith(docs[-1][-50:] + EOT)
    total = sum(len(d) for d in docs)
    assert len(train.replace(EOT, "")) == int(0.9 * total)  # nanoGPT's n_train = int(n · 0.9)
    assert meta["train_bytes"] == len(train.replace(EOT, "").encode("utf-8"))
    assert meta["val_bytes"] == len(val.replace(EOT, "").encode("utf-8"))
    assert meta["train_bytes"] + meta["val_bytes"] == sum(len(d.encode()) for d in docs)
    assert (meta["train_tokens"], meta["val_tokens"]) == (
        len(load_split(out, "train")),
        len(load_split(out, "val")),
    )
    assert meta["n_documents"] == 4 and meta["dtype"] == "uint16"
    skipped = [str(corpus / "pkg" / name) for name in ("latin1.txt", "logo.txt")]
    assert meta["source"]["skipped"] == skipped
    assert meta["source"]["files"] == 7  # 4 documents, the binary, the latin-1 and the empty file
    assert meta["eot_id"] == Tokenizer.from_file(out / "tokenizer.json").eot_id
    if kind == "bpe":
        assert meta["vocab_size"] == 300


def test_prepare_is_deterministic(corpus: Path, tmp_path) -> None:
    outs = [tmp_path / "one", tmp_path / "two"]
    for out in outs:
        with pytest.warns(UserWarning):
            prepare([corpus], out, tokenizer="bpe", vocab_size=400, progress=False)
    for name in ("train.bin", "val.bin", "meta.json", "tokenizer.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_include_globs_and_explicit_files(corpus: Path, tmp_path) -> None:
    meta = prepare(
        [corpus / "pkg", corpus / "b_notes.txt"],
        tmp_path / "out",
        tokenizer="char",
        include=["*.py"],
        progress=False,
    )
    assert meta["n_documents"] == 3  # two .py files under pkg/ and the file given by name
    assert "To be, or not" in decoded_split(tmp_path / "out", "train")


def test_prepare_with_a_saved_tokenizer_file(corpus: Path, tmp_path) -> None:
    tok = Tokenizer.train_bpe(["some unrelated text"] * 5, vocab_size=270)
    tok.save(tmp_path / "tok.json")
    meta = prepare(
        [corpus / "pkg" / "mod.py"],
        tmp_path / "out",
        tokenizer=tmp_path / "tok.json",
        progress=False,
    )
    assert meta["vocab_size"] == 270 and meta["source"]["tokenizer"] == str(tmp_path / "tok.json")
    ids = np.concatenate(
        [load_split(tmp_path / "out", "train"), load_split(tmp_path / "out", "val")]
    )
    text = (corpus / "pkg" / "mod.py").read_text()
    assert tok.decode(ids.tolist()).replace(EOT, "") == text


def test_large_vocabulary_is_stored_as_uint32(tmp_path) -> None:
    # 70,000 distinct characters (surrogates excluded): a char vocabulary past uint16's 65,536 ids.
    chars = [chr(c) for c in range(0x100, 0x100 + 72_048) if not 0xD800 <= c < 0xE000]
    (tmp_path / "wide.txt").write_text("".join(chars))
    meta = prepare([tmp_path / "wide.txt"], tmp_path / "out", tokenizer="char", progress=False)
    assert meta["vocab_size"] == 70_001 and meta["dtype"] == "uint32"
    train = load_split(tmp_path / "out", "train")
    assert train.dtype == np.dtype("<u4") and int(train.max()) > 65_535
    assert decoded_split(tmp_path / "out", "train").startswith("".join(chars[:100]))
    with pytest.raises(DecoderLMError, match="70001 tokens does not fit in uint16"):
        prepare(
            [tmp_path / "wide.txt"],
            tmp_path / "o2",
            tokenizer="char",
            dtype="uint16",
            progress=False,
        )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such file or directory: .*missing"),
        ("only_binary", "no readable text found in .*only_binary"),
        ("val_fraction", r"val_fraction=1\.0 must be between 0 and 1"),
        ("tokenizer", "tokenizer='bp' must be 'bpe', 'char' or an existing tokenizer.json"),
        ("inputs", "inputs='corpus' must be a non-empty list of paths, or None"),
    ],
)
def test_prepare_errors_are_one_line(case: str, message: str, corpus: Path, tmp_path) -> None:
    (tmp_path / "only_binary").mkdir()
    (tmp_path / "only_binary" / "x.txt").write_bytes(b"\x00\x01\x02")
    args = {
        "missing": ([tmp_path / "missing"], {}),
        "only_binary": ([tmp_path / "only_binary"], {}),
        "val_fraction": ([corpus], {"val_fraction": 1.0}),
        "tokenizer": ([corpus], {"tokenizer": "bp"}),
        "inputs": ("corpus", {}),
    }
    inputs, kwargs = args[case]
    with pytest.raises(DecoderLMError, match=message) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepare(inputs, tmp_path / "out", progress=False, **kwargs)
    assert "\n" not in str(info.value)


def test_interrupted_prepare_leaves_no_valid_looking_directory(corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare([corpus / "b_notes.txt"], out, tokenizer="char", progress=False)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparation, "_write_tokens", killed)
    with pytest.raises(KeyboardInterrupt):  # a second prepare over it dies while encoding
        prepare([corpus / "a_intro.md"], out, tokenizer="char", progress=False)
    with pytest.raises(DecoderLMError, match=r"meta\.json is missing"):
        load_split(out, "train")  # not the new tokenizer with the old token files


def test_default_corpus_is_the_stdlib_without_tests(tmp_path) -> None:
    meta = prepare(None, tmp_path / "out", tokenizer="char", max_files=5, progress=False)
    files = data.collect_files([stdlib_dir()], ["*.py"], skip_dirs=data.STDLIB_SKIP_DIRS)
    assert len(files) > 500  # ~730 modules in CPython 3.11 without its tests
    assert not any({"test", "tests", "idle_test", "site-packages"} & set(f.parts) for f in files)
    assert meta["source"]["inputs"] == [str(stdlib_dir())] and meta["source"]["files"] == 5
    first = [f.read_text(encoding="utf-8") for f in files[:5]]
    assert meta["train_bytes"] + meta["val_bytes"] == sum(len(t.encode()) for t in first)


def test_default_corpus_is_prepared_once_into_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path / "cache"))
    path = prepare_default_corpus(vocab_size=300, max_files=4, progress=False)
    assert path.parent == tmp_path / "cache" / "data" and path.name.startswith("stdlib-py")
    assert read_meta(path)["vocab_size"] == 300
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind

    def must_not_run(*args, **kwargs):
        raise AssertionError("prepared again")

    with monkeypatch.context() as patch:
        patch.setattr(preparation, "_prepare_files", must_not_run)
        assert prepare_default_corpus(vocab_size=300, max_files=4, progress=False) == path
    # Other settings are another cache entry beside it.
    assert prepare_default_corpus(vocab_size=300, max_files=3, progress=False) != path
    assert len(list(path.parent.iterdir())) == 2


# ---------------------------------------------------------------- the command line


def test_cli_prepare_writes_a_data_directory(corpus: Path, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["prepare", "--input", str(corpus), "--out", str(out), "--tokenizer", "char", "--quiet"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out
    assert "decoderlm: warning: skipping" in captured.err and "logo.txt" in captured.err
    assert read_meta(out)["n_documents"] == 4


def test_cli_missing_input_is_one_line_exit_2(tmp_path) -> None:
    missing = tmp_path / "no" / "such.txt"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "decoderlm",
            "prepare",
            "--input",
            str(missing),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == f"decoderlm: error: no such file or directory: {missing}\n"
    assert not (tmp_path / "meta.json").exists()
