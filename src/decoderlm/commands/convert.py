"""`decoderlm convert`: Hugging Face and GGUF import/export, MHA → GQA/MQA conversion (logic in
decoderlm.hf, decoderlm.gguf, decoderlm.gqa)."""

from __future__ import annotations

import argparse
from pathlib import Path

from decoderlm.errors import DecoderLMError
from decoderlm.files import ANY_ENTRY, add_overwrite_argument, refuse_overwrite

HELP = (
    "convert checkpoints: --from-hf DIR, --to-hf RUN, --from-gguf FILE, --to-gguf RUN, or "
    "--to-gqa G RUN (mean-pooled K/V heads)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-hf", metavar="DIR", help="import a Hugging Face model directory")
    mode.add_argument(
        "--to-hf", metavar="RUN", help="export a run directory to Hugging Face format"
    )
    mode.add_argument(
        "--from-gguf",
        metavar="FILE",
        help="import a GGUF file (its quantized blocks kept) or a model name, e.g. "
        "smollm2-135m-instruct",
    )
    mode.add_argument(
        "--to-gguf",
        metavar="RUN",
        help="export a checkpoint (a run, a Hugging Face directory, a GGUF file or a model name) "
        "as the GGUF file --out",
    )
    mode.add_argument(
        "--to-gqa",
        metavar="G",
        type=int,
        help="pool the K/V heads of RUN into G groups (1 = MQA; Ainslie et al., 2023)",
    )
    # dest `gqa_run`: `args.run` is taken by the CLI's dispatch (decoderlm.cli).
    parser.add_argument("gqa_run", nargs="?", metavar="RUN", help="the run directory for --to-gqa")
    parser.add_argument(
        "--out", required=True, help="output directory (must be new or empty); --to-gguf: a file"
    )
    parser.add_argument(
        "--type",
        metavar="NAME",
        help="--to-gguf: the 2-D weights' type, f32, f16, bf16, q8_0, q4_0 or q4_1 (default: "
        "ggml blocks a model holds as they are, float weights f32)",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="--from-hf: accept pytorch_model.bin (loaded with torch.load(weights_only=True))",
    )
    parser.add_argument(
        "--dtype",
        metavar="NAME",
        help="--from-hf: weight dtype of the run: float32, bfloat16 or float16 (default float32)",
    )
    add_overwrite_argument(parser, "--force")


def run(args: argparse.Namespace) -> int:
    from decoderlm import gqa, hf
    from decoderlm.dtypes import parse_dtype
    from decoderlm.loading import resolve_checkpoint

    if args.type is not None and not args.to_gguf:
        raise DecoderLMError("--type applies to --to-gguf only")
    if args.to_gguf:
        return _to_gguf(Path(resolve_checkpoint(args.to_gguf)), Path(args.out), args)
    if args.from_gguf:  # a model's name: its installed file
        args.from_gguf = str(resolve_checkpoint(args.from_gguf))
    source = args.from_hf or args.to_hf or args.from_gguf or args.gqa_run
    if args.to_gqa is not None and args.gqa_run is None:
        raise DecoderLMError(
            "--to-gqa G needs the source run directory: convert --to-gqa G RUN --out RUN2"
        )
    if args.to_gqa is None and args.gqa_run is not None:
        raise DecoderLMError(
            f"unexpected argument {args.gqa_run!r}: only --to-gqa takes a RUN argument"
        )
    _check_out(Path(source), Path(args.out), args.overwrite)
    if args.from_hf:
        dtype = parse_dtype(args.dtype) if args.dtype else None
        out = hf.import_hf(args.from_hf, args.out, dtype=dtype, allow_pickle=args.allow_pickle)
    elif args.to_hf:
        out = hf.export_hf(args.to_hf, args.out)
    elif args.from_gguf:
        from decoderlm.gguf import import_gguf

        out = import_gguf(args.from_gguf, args.out)
    else:
        out = gqa.convert_run(args.gqa_run, args.out, args.to_gqa)
    print(f"wrote {out}")
    return 0


def _to_gguf(source: Path, out: Path, args: argparse.Namespace) -> int:
    """--to-gguf: the checkpoint, its tokenizer and chat template as one GGUF file."""
    from decoderlm.chat_template import DEFAULT_CHAT_TEMPLATE, load_chat_template
    from decoderlm.gguf import export_gguf
    from decoderlm.gguf.writer import check_type
    from decoderlm.loading import load

    check_type(args.type)
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        raise DecoderLMError(f"--out {out} is the source; choose a new file")
    refuse_overwrite(out, overwrite=args.overwrite)
    model, tokenizer = load(source)
    if tokenizer is None:
        raise DecoderLMError(f"{source} has no tokenizer.json; a GGUF file needs a tokenizer")
    template = load_chat_template(source).source
    template = None if template == DEFAULT_CHAT_TEMPLATE else template
    name = source.stem if source.is_file() else source.resolve().name
    print(f"wrote {export_gguf(model, tokenizer, out, args.type, name, template)}")
    return 0


def _check_out(source: Path, out: Path, overwrite: bool) -> None:
    if not source.exists():
        raise DecoderLMError(f"no such {'file' if source.suffix else 'directory'}: {source}")
    if out.exists() and out.resolve() == source.resolve():
        raise DecoderLMError(f"--out {out} is the source directory; choose a new directory")
    refuse_overwrite(out, overwrite=overwrite, inside=ANY_ENTRY)
