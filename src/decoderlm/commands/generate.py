"""`decoderlm generate`: stream a continuation of a prompt to stdout (logic in decoderlm.inference.generate)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from decoderlm.commands import CHECKPOINT_HELP
from decoderlm.data import read_text_file
from decoderlm.errors import DecoderLMError

if TYPE_CHECKING:
    from decoderlm.inference.sampling import SamplingParams
    from decoderlm.model.lm import DecoderLM
    from decoderlm.tokenizer import Tokenizer

HELP = "generate text from a checkpoint, streamed to stdout as the tokens arrive"

# Without --max-new-tokens: continue up to this many tokens, or until the context is full.
DEFAULT_MAX_NEW_TOKENS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 file")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help=f"tokens to generate (default: {DEFAULT_MAX_NEW_TOKENS}, or up to the context length)",
    )
    add_sampling_arguments(parser)
    parser.add_argument("--seed", type=int, help="seed for reproducible sampling")
    parser.add_argument(
        "--num-samples", type=int, default=1, metavar="N", help="samples to draw (default 1)"
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop before this text (repeatable)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past the model's stop ids (its end-of-sequence and end-of-turn tokens)",
    )
    parser.add_argument(
        "--refill-past-context",
        action="store_true",
        help="keep generating past the context length: drop the oldest quarter, refill the cache",
    )
    add_weights_arguments(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the one-token step (AOTInductor) and the prefill (torch.compile)",
    )
    add_cpu_kernels_argument(parser)
    add_kv_cache_dtype_argument(parser)
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute as `decoderlm serve --batch-invariant` does: the same logits, bit for bit, "
        "as the server's for the same request",
    )
    parser.add_argument(
        "--draft",
        metavar="RUN|prompt-lookup",
        help="speculative decoding: a draft model (run or Hugging Face directory, same "
        "vocabulary) or prompt-lookup; the output is printed whole, the acceptance to stderr",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="tokens proposed per step with --draft (default 4)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p, --repetition-penalty, and --generation-config: whether
    the ones left out take the model's defaults (`sampling_from_args`)."""
    parser.add_argument(
        "--temperature", type=float, help="0 = greedy (default: the model's, or 1.0)"
    )
    parser.add_argument(
        "--top-k", type=int, metavar="K", help="sample from the K most likely tokens"
    )
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling, P in (0, 1]")
    parser.add_argument(
        "--repetition-penalty", type=float, metavar="R", help="> 1 discourages repeats (default 1)"
    )
    add_generation_config_argument(parser)


def add_generation_config_argument(parser: argparse.ArgumentParser) -> None:
    """--generation-config auto|vllm, as vLLM's."""
    parser.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="auto (default): sampling options left out take the model's generation_config.json "
        "defaults; vllm: they take the built-in ones (temperature 1, no top-k/top-p, penalty 1)",
    )


def sampling_from_args(args: argparse.Namespace, tokenizer: Any) -> SamplingParams:
    """The sampling flags, those left out taken from the model's generation config (unless
    --generation-config vllm), then the built-in defaults."""
    from decoderlm.inference.sampling import SamplingParams

    defaults = {} if args.generation_config == "vllm" else tokenizer.generation.defaults
    given = {
        name: getattr(args, name)
        for name in ("temperature", "top_k", "top_p", "repetition_penalty")
        if getattr(args, name) is not None
    }
    return SamplingParams(**(defaults | given))


def add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype, --device and --matmul-precision: where `load_model_and_tokenizer` puts the weights
    and how float32 products may run (generate and eval)."""
    parser.add_argument(
        "--dtype", default=None, help="weights dtype: float32 (default), bfloat16, float16"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    add_matmul_precision_argument(parser)


def add_matmul_precision_argument(parser: argparse.ArgumentParser) -> None:
    """--matmul-precision: torch's float32 matmul precision (generate, eval, serve and chat)."""
    parser.add_argument(
        "--matmul-precision",
        choices=("highest", "high", "medium"),
        default="highest",
        help="torch.set_float32_matmul_precision: highest (default) multiplies float32 exactly "
        "(but for a GGUF file's quantized weights, whose products round each activation to 16 "
        "bits); medium lets a product round its inputs to bfloat16 where that is faster (a "
        "prompt's products on a GGUF file's weights in float32, on a CPU with AVX512-BF16, as "
        "llama.cpp does for BF16 weights)",
    )


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[DecoderLM, Tokenizer]:
    """The model of --checkpoint, with --device and --dtype, and its tokenizer (which it must
    have: the commands that call this encode text)."""
    import torch

    from decoderlm.loading import load

    torch.set_float32_matmul_precision(args.matmul_precision)
    model, tokenizer = load(args.checkpoint, device=args.device, dtype=args.dtype)
    if tokenizer is None:
        raise DecoderLMError(f"{args.checkpoint} has no tokenizer.json, so text cannot be encoded")
    return model, tokenizer


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype: the `kv_cache_dtype` of decoderlm.inference (generate and eval)."""
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("int8",),
        default=None,
        help="int8: quantize the KV cache, one scale per token and head (default: the weights' dtype)",
    )


def add_cpu_kernels_argument(parser: argparse.ArgumentParser) -> None:
    """--no-cpu-kernels: the `cpu_kernels=False` of decoderlm.inference (generate and eval)."""
    parser.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="run the model as defined, without decoderlm.cpu's attention and linear kernels",
    )


def run(args: argparse.Namespace) -> int:
    from decoderlm.inference.stream import stream

    prompt = _read_prompt(args)
    if args.num_samples < 1:
        raise DecoderLMError(f"--num-samples={args.num_samples} must be ≥ 1")
    model, tokenizer = load_model_and_tokenizer(args)
    params = sampling_from_args(args, tokenizer)
    max_new = args.max_new_tokens
    if max_new is None:  # the default stops where the context is full, unless it may slide
        room = model.config.context_length - len(tokenizer.encode_prompt(prompt))
        max_new = (
            DEFAULT_MAX_NEW_TOKENS
            if args.refill_past_context
            else max(0, min(DEFAULT_MAX_NEW_TOKENS, room))
        )
    if args.draft is not None:
        return _speculate(args, model, tokenizer, prompt, params, max_new)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} of {args.num_samples} ---", flush=True)
        pieces = stream(
            model,
            tokenizer,
            prompt,
            max_new,
            params,
            seed=None if args.seed is None else args.seed + i,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            refill_past_context=args.refill_past_context,
            compile=args.compile,
            cpu_kernels=args.cpu_kernels,
            kv_cache_dtype=args.kv_cache_dtype,
            batch_invariant=args.batch_invariant,
        )  # checks its arguments before anything is printed
        sys.stdout.write(prompt)
        for piece in pieces if max_new else ():  # 0 new tokens: the prompt, unchanged
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def _speculate(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    prompt: str,
    params: Any,
    max_new: int,
) -> int:
    """--draft: each sample generated speculatively, printed whole (up to the first --stop), and
    the acceptance counts of all samples to stderr."""
    from decoderlm.inference.generate import generate
    from decoderlm.inference.speculative import PROMPT_LOOKUP, SpeculativeStats
    from decoderlm.loading import load_draft

    draft = args.draft
    if draft != PROMPT_LOOKUP:
        draft = load_draft(args.draft, model, tokenizer, args.dtype)
    ids = tokenizer.encode_prompt(prompt)
    stops = () if args.ignore_eos else tokenizer.stop_ids
    stats = SpeculativeStats()
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} of {args.num_samples} ---", flush=True)
        row = generate(
            model,
            [ids],
            max_new,
            params,
            seed=None if args.seed is None else args.seed + i,
            eos_id=stops,
            refill_past_context=args.refill_past_context,
            compile=args.compile,
            cpu_kernels=args.cpu_kernels,
            kv_cache_dtype=args.kv_cache_dtype,
            batch_invariant=args.batch_invariant,
            draft=draft,
            num_speculative_tokens=args.num_speculative_tokens,
            speculative_stats=stats,
        )[0]
        new = [t for t in row[len(ids) :] if t not in stops]
        text = tokenizer.decode(new, skip_special_tokens=True)
        end = min((text.find(stop) for stop in args.stop if stop in text), default=len(text))
        print(prompt + text[:end], flush=True)
    print(stats, file=sys.stderr)
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    prompt = args.prompt if args.prompt is not None else read_text_file(args.prompt_file)
    if not prompt:
        raise DecoderLMError("empty prompt: give some text to continue")
    return prompt
