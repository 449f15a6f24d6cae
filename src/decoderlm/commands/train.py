"""`decoderlm train`: train a model into a run directory (decoderlm.training.run resolves it,
decoderlm.training.trainer trains it).

With no arguments this is the main job: prepare the Python standard library (BPE, cached), train
the llama-tiny model for about five minutes, save the run and print samples. With
`--init-from MODEL --data chat.jsonl` it fine-tunes MODEL on conversations (the loss on the
assistant's tokens; `--lora-rank R` trains LoRA adapters instead of every weight). Every ModelConfig and
TrainConfig field is a flag (`--d-model 256`, `--max-steps 2000`, `--compile`/`--no-compile`);
values come from, in increasing priority: the defaults, --preset, the TOML --config, the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import shlex
import typing
from typing import Any

from decoderlm.errors import ConfigError
from decoderlm.files import add_overwrite_argument
from decoderlm.model.config import ModelConfig

HELP = "train a model (no arguments: ~5 minutes on the Python stdlib, the main job)"

# Model fields that are not flags: the vocabulary follows the data, `extra` is free-form notes.
MODEL_FIELDS_SKIPPED = ("vocab_size", "extra")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decoderlm.training.train_config import TrainConfig

    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with [model] and [train] tables"
    )
    parser.add_argument("--preset", metavar="NAME", help="model preset (default: llama-tiny)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--data",
        metavar="DIR|FILE.jsonl",
        help='a prepared data directory, or a chat file (.jsonl: one {"messages": [...]} a '
        "line) to fine-tune the --init-from model on, the loss on the assistant's tokens",
    )
    source.add_argument(
        "--input", nargs="+", metavar="PATH", help="text files/directories, prepared into OUT/data"
    )
    parser.add_argument("--out", metavar="DIR", help="run directory (default: runs/<date-time>)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue OUT's latest checkpoint (default: newest run)",
    )
    add_overwrite_argument(parser)
    parser.add_argument(
        "--init-from",
        metavar="CHECKPOINT",
        help="start from this model's weights: a run or Hugging Face directory, a GGUF file or a "
        "model name (smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--held-out",
        metavar="FRACTION",
        help="chat data: the share of conversations held out for validation (default 0.1)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="bpe|char|FILE",
        help="tokenizer for --input or the stdlib corpus (default: bpe)",
    )
    parser.add_argument(
        "--vocab-size",
        metavar="N",
        help="BPE vocabulary size for --input/the stdlib (default: 8192)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or evaluation lines")
    _add_field_flags(parser.add_argument_group("model (ModelConfig fields)"), ModelConfig)
    _add_field_flags(parser.add_argument_group("training (TrainConfig fields)"), TrainConfig)


def run(args: argparse.Namespace) -> int:
    from decoderlm.training.finetune import ChatTrainer, is_chat_run
    from decoderlm.training.run import resolve_run
    from decoderlm.training.train_config import TrainConfig, read_config_file
    from decoderlm.training.trainer import train_run

    file = read_config_file(args.config) if args.config else {}
    inputs = args.input or file.get("input")
    vocab_size = args.vocab_size or file.get("vocab_size")
    run = resolve_run(
        args.out or file.get("out"),
        resume=args.resume,
        overwrite=args.overwrite,
        init_from=args.init_from,
        preset=args.preset or file.get("preset"),
        model={**file.get("model", {}), **_flag_values(args, ModelConfig)},
        train={**file.get("train", {}), **_flag_values(args, TrainConfig)},
        data_dir=args.data or file.get("data"),
        inputs=[inputs] if isinstance(inputs, str) else inputs,
        tokenizer=args.tokenizer or file.get("tokenizer"),
        vocab_size=None if vocab_size is None else _parse(int, "vocab_size", vocab_size),
        held_out=None if args.held_out is None else _parse(float, "held_out", args.held_out),
        progress=not args.quiet,
    )
    trainer = ChatTrainer if is_chat_run(run) else None
    summary = train_run(run, progress=not args.quiet, trainer_class=trainer)
    if summary["rank"] == 0:  # under torchrun, one report for the job
        _print_summary(summary)
    return 130 if summary["stopped"] == "interrupted" else 0


def _print_summary(s: dict[str, Any]) -> None:
    minutes, seconds = divmod(int(s["time"]), 60)
    why = "interrupted" if s["stopped"] == "interrupted" else f"stopped by {s['stopped']}"
    print(
        f"{why} after {s['step']:,} steps, {s['tokens']:,} tokens, "
        f"{minutes}:{seconds:02d} of training ({s['tokens_per_s']:,.0f} tokens/s this session), "
        f"{s['parameters'] / 1e6:.2f}M parameters"
    )
    if "trained_tokens" in s:
        meta = s["chat_meta"]
        print(
            f"trained on {s['trained_tokens']:,} assistant tokens (the train split holds "
            f"{meta['train_trained_tokens']:,} in {meta['train_conversations']:,} conversations)"
        )
    if "val_loss" in s:
        bpb = f" | {s['val_bpb']:.3f} bits per byte" if "val_bpb" in s else ""
        print(f"val loss {s['val_loss']:.4f} | perplexity {s['val_ppl']:.2f}{bpb}")
    print(f"saved {s['run_dir']} (checkpoint {s['checkpoint']})")
    if s["stopped"] == "interrupted":
        print(f"continue with: decoderlm train --resume --out {s['run_dir']}")
    for i, sample in enumerate(s["samples"], start=1):
        print(f"--- sample {i} ---\n{sample}")
    if s["samples"] and "trained_tokens" in s:  # a chat model
        print(f"--- more: decoderlm chat --checkpoint {s['run_dir']}")
    elif s["samples"]:
        prompt = shlex.quote(s["sample_prompt"] or "TEXT")
        print(f"--- more: decoderlm generate --checkpoint {s['run_dir']} --prompt {prompt}")


# ---- flags generated from the dataclass fields ------------------------------------------------


def _add_field_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    comments = _field_comments(cls)
    for field in dataclasses.fields(cls):
        if field.name in MODEL_FIELDS_SKIPPED:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(cls, field.name)
        default = "the preset's" if cls is ModelConfig else field.default
        text = f"{comments.get(field.name, '')} (default: {default})".strip()
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            # Parsed in run(), so that a bad value is a one-line DecoderLMError, like the rest.
            group.add_argument(flag, default=None, metavar=kind.__name__.upper(), help=text)


def _flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    values = {}
    for field in dataclasses.fields(cls):
        raw = getattr(args, field.name, None)
        if raw is None or field.name in MODEL_FIELDS_SKIPPED:
            continue
        kind = _base_type(cls, field.name)
        values[field.name] = raw if kind is bool else _parse(kind, field.name, raw)
    return values


def _base_type(cls: type, name: str) -> type:
    """int for `int` and `int | None`, dict for `dict[str, Any] | None`, ..."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return typing.get_origin(args[0]) or args[0]


def _parse(kind: type, name: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        if kind is dict:
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError
            return value
        return kind(raw)
    except ValueError:
        what = {int: "an integer", float: "a number", dict: "a JSON object"}.get(kind, str(kind))
        raise ConfigError(f"{name}={raw!r} must be {what}") from None


def _field_comments(cls: type) -> dict[str, str]:
    """The comment beside each field in the class's source: the flag's help text."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments = re.findall(r"^    (\w+): [^=\n]+=[^#\n]*#\s*(.+)$", source, flags=re.MULTILINE)
    module = inspect.getmodule(cls)

    def choices(match: re.Match[str]) -> str:  # "one of MLP_KINDS" → "one of gelu, swiglu, ..."
        return "one of " + ", ".join(getattr(module, match.group(1), [match.group(1)]))

    return {name: re.sub(r"one of ([A-Z_]+)", choices, text) for name, text in comments}
