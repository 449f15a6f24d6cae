"""Chat data (`decoderlm.data.chat`): the assistant mask comes from the template's rendering and
counts exactly the assistant's tokens; bad chat files are one-line errors naming the line, or
counted skips, and never clear what OUT holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from chat_helpers import chat_tokenizer, conversation

from decoderlm import checkpoint
from decoderlm.chat_template import load_chat_template
from decoderlm.cli import main
from decoderlm.data.chat import encode_conversation, load_chat_split
from decoderlm.data.chat_batches import ChatBatches

pytest_plugins = ["chat_fixtures"]  # the fixtures chat_base and chat_file

# A multi-turn conversation with a system prompt and a tool turn.
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "time?"},
    {"role": "assistant", "content": "calling clock"},
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "content": "noon"},
]
FLAGS = [
    *("--max-steps", "2", "--batch-size", "4", "--eval-interval", "2", "--eval-iters", "1"),
    *("--sample-tokens", "2", "--dtype", "fp32", "--peak-flops", "1e12", "--threads", "1"),
    "--quiet",
]


def test_the_mask_counts_exactly_the_assistant_tokens(chat_base: Path) -> None:
    tokenizer = chat_tokenizer()
    ids, trained = encode_conversation(MESSAGES, load_chat_template(chat_base), tokenizer)
    # By hand: each turn's text, then <|im_end|> (one token) and the newline the template ends
    # a turn with; one character a token: 5 + 2, 13 + 2, 4 + 2.
    assert sum(trained) == 7 + 15 + 6 == 28
    picked = tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t])
    assert picked == "hello<|im_end|>\ncalling clock<|im_end|>\nnoon<|im_end|>\n"
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_batches_train_the_next_token_only_where_it_is_the_assistants(
    chat_base: Path, chat_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(chat_base), "--data", str(chat_file),
                 "--out", str(out), *FLAGS]) == 0  # fmt: skip
    split = load_chat_split(out / "data", "train")
    batches = ChatBatches(split, micro_batch=4, grad_accum=1, seed=0, pad_id=0)
    _, y = batches.next_batch()
    for row in range(4):
        reply = chat_tokenizer().decode([t for t in y[row].tolist() if t >= 0])
        assert reply.startswith('{"sum": ') and reply.endswith("}<|im_end|>\n")
    # The step's loss scale: one over its trained targets.
    assert batches.loss_scale == 1 / int((y >= 0).sum())


def _chat(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps(conversation(1, 2))


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"messages": [', "bad.jsonl:3: not valid JSON: "),
        (
            json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),
            "bad.jsonl:3: message 0 has role 'robot'; allowed: system, user, assistant, tool",
        ),
        (json.dumps({"text": "hi"}), 'bad.jsonl:3: expected {"messages": '),
        (
            json.dumps({"messages": [{"role": "user", "content": 3}]}),
            "bad.jsonl:3: message 0 (user) has no text content",
        ),
    ],
)
def test_a_bad_line_is_one_line_naming_it_and_out_is_left_as_it_was(
    chat_base: Path,
    chat_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    line: str,
    error: str,
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(chat_base), "--data", str(chat_file),
                 "--out", str(out), *FLAGS]) == 0  # fmt: skip
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    bad = _chat(tmp_path, GOOD, "", line, GOOD)  # line 2 is blank
    capsys.readouterr()
    argv = ["train", "--init-from", str(chat_base), "--data", str(bad), "--out", str(out)]
    assert main([*argv, *FLAGS, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"decoderlm: error: {bad.parent}/{error}"), err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert checkpoint.latest_checkpoint(out) is not None


def test_no_assistant_and_too_long_conversations_are_counted(
    chat_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    silent = {"messages": [{"role": "user", "content": "anyone?"}]}
    long_reply = conversation(1, 2)
    long_reply["messages"][1]["content"] = "x" * 200  # past the context of 128
    long_question = conversation(1, 2)
    long_question["messages"][0]["content"] = "y" * 200  # the reply starts past the context
    lines = [GOOD] * 4 + [json.dumps(c) for c in (silent, long_reply, long_question)]
    out = tmp_path / "run"
    argv = ["train", "--init-from", str(chat_base), "--data", str(_chat(tmp_path, *lines))]
    assert main([*argv, "--out", str(out), *FLAGS]) == 0
    err = capsys.readouterr().err
    assert (
        "decoderlm: chat data: 7 conversations (1 without an assistant turn skipped; 1 with no "
        "assistant token within the context skipped; 1 cut to the context, context 128 tokens)"
    ) in err
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert (meta["no_assistant"], meta["too_long"], meta["truncated"]) == (1, 1, 1)
    assert meta["train_conversations"] + meta["val_conversations"] == 5
    for split in ("train", "val"):
        rows = load_chat_split(out / "data", split)
        assert max(rows.offsets[1:] - rows.offsets[:-1]) <= 129  # context + 1


def test_chat_data_without_init_from_is_one_line(
    chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["train", "--data", str(chat_file), "--out", str(tmp_path / "r"), *FLAGS]) == 2
    err = capsys.readouterr().err
    assert err == (
        "decoderlm: error: chat data is rendered with the chat template of the model it "
        "fine-tunes: give that model with --init-from\n"
    )


def test_resuming_with_another_chat_file_is_refused(
    chat_base: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--init-from", str(chat_base), "--out", str(out), *FLAGS]
    assert main([*argv, "--data", str(chat_file)]) == 0
    other = tmp_path / "other.jsonl"
    shutil.copyfile(chat_file, other)
    with other.open("a") as f:
        f.write(GOOD + "\n")
    capsys.readouterr()
    assert main([*argv, "--data", str(other), "--resume", "--max-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{other} differs from the chat data in {out / 'data'}" in err
    assert "in its contents" in err
