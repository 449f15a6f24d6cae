"""`decoderlm serve`: an OpenAI-compatible HTTP server for a checkpoint (logic in decoderlm.server and decoderlm.engine).

The model loads after the server is up (GET /health answers 503 until it is ready). With --api-key
the OpenAI routes need `Authorization: Bearer KEY`; a request whose Host is not one the server
answers to gets 421 (server/security.py). On SIGTERM the server stops accepting connections, lets
running streams finish for --grace-period seconds, cancels what is left (those streams end with
finish_reason "cancelled") and exits with status 0.

What one request may cost is bounded before any work (--max-request-bytes, --max-prompts-per-request,
--max-tokens-per-request, --max-template-chars, --template-timeout; `server.limits`).

If the engine's process dies (killed, out of memory, a crash), the server does not restart it: its
requests in flight end with an error (503), it answers 503 while it shuts down, and it exits with
status 2 and a one-line error. A supervisor (systemd's Restart=, Kubernetes, a shell loop) restarts
it, with its own back-off and a fresh process: an engine that died once for a reason the server
cannot know (a bad host, memory) is better replaced whole than revived beside a server process
whose state may hold the cause, and a restart loop inside the server would hide a crash loop from
the one component that can see and limit it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from decoderlm.commands import CHECKPOINT_HELP
from decoderlm.commands.generate import (
    add_generation_config_argument,
    add_kv_cache_dtype_argument,
    add_matmul_precision_argument,
)
from decoderlm.errors import DecoderLMError

HELP = (
    "serve a checkpoint over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)"
)


# What one request may cost: each `server.limits.Limits` field's flag and what it bounds (the
# defaults are Limits()'s).
LIMIT_FLAGS = {
    "max_request_bytes": (
        "--max-request-bytes",
        "larger request bodies are refused with 413 before they are read",
    ),
    "max_prompts_per_request": (
        "--max-prompts-per-request",
        "prompts one completion request may hold",
    ),
    "max_tokens_per_request": (
        "--max-tokens-per-request",
        "prompt tokens one request may hold, summed over its prompts, times n",
    ),
    "max_template_chars": (
        "--max-template-chars",
        "characters a chat template may render for one request",
    ),
    "template_timeout_s": ("--template-timeout", "seconds a chat template may take to render"),
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `serve` and `chat` share: the checkpoint, the engine's sizes, and whether
    requests take the model's sampling defaults."""
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    add_generation_config_argument(parser)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="weights dtype: auto (default: bfloat16 where the CPU has native bf16, AVX512-BF16 or "
        "AMX, as train does; float32 elsewhere), float32, bfloat16, float16",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default="256MiB",
        metavar="SIZE",
        help="memory of the paged KV cache, e.g. 256MiB, 2GiB (default 256MiB)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait for KV room; more are refused with 429 (default 64)",
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="the most tokens one engine step runs: the decoding sequences' first, then chunks "
        "of waiting prompts (vLLM's --max-num-batched-tokens; default 2048, as vLLM's on the CPU)",
    )
    add_kv_cache_dtype_argument(parser)
    add_matmul_precision_argument(parser)
    parser.add_argument(
        "--draft",
        default=None,
        metavar="RUN|prompt-lookup",
        help="speculative decoding: each sequence proposes tokens with a draft model (a run or "
        "Hugging Face directory with the same tokenizer, its KV cache inside --kv-cache-memory) "
        "or by prompt lookup",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="tokens proposed per step with --draft (default 4)",
    )
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the engine's decode passes eagerly, not by the libraries compiled ahead of "
        "time when the engine starts (minutes the first time on a machine, then loaded from the "
        "disk cache; CPU float32/bfloat16 models without a sliding window: any number of "
        "sequences where every linear is packed for the CPU's kernels or is a GGUF file's "
        "block linear, and with --batch-invariant; one sequence with decoderlm.quant's int8 "
        "and int4 linears)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens bit-identical alone or among any others, in bfloat16 too: "
        "linears summed in a fixed order, every pass through the in-place attention kernel, the "
        "compiled decode pass calling the same kernels (float weights or a GGUF file's blocks, "
        "attention layers without a sliding window)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument(
        "--engine",
        choices=("process", "thread"),
        default="process",
        help="run the engine in a process of its own (default: the HTTP server cannot hold the "
        "GIL its steps need) or in a thread of the server's process (one copy of the tokenizer, "
        "one process to debug)",
    )
    from decoderlm.server.limits import Limits

    limits = Limits()
    for field, (flag, bounds) in LIMIT_FLAGS.items():
        default = getattr(limits, field)
        parser.add_argument(
            flag,
            dest=field,
            type=type(default),
            default=default,
            metavar="SECONDS" if isinstance(default, float) else "N",
            help=f"{bounds} (default {default})",
        )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running streams may go on before they are cancelled (default 30)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: "
        "$DECODERLM_API_KEY; none if unset); /health, /metrics and the playground page stay open",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOSTS",
        help="comma-separated Host names to answer (others get 421), '*' for any; for a reverse "
        "proxy's name. Default: 127.0.0.1, localhost, ::1 on loopback; the --host name; any "
        "host (with a warning) when --host is 0.0.0.0 or ::",
    )


def load_served(
    args: argparse.Namespace,
    engine_process: bool = False,
    on_death: Callable[[str], None] | None = None,
) -> Any:
    """The `Served` of a checkpoint: its tokenizer, chat template and an engine, started in a
    process of its own (`decoderlm.engine.engine_process`, which calls `on_death(why)` if it
    dies) or, without `engine_process`, on a thread of this one that loaded it and steps it."""
    from decoderlm.chat_template import load_chat_template
    from decoderlm.cpu.heap import freeze_startup_objects
    from decoderlm.engine.engine_process import EngineProcess, EngineSpec, build_engine_thread
    from decoderlm.server.http import Served

    options = {
        "kv_cache_memory": args.kv_cache_memory,
        "max_queue": args.max_queue,
        "max_batched_tokens": args.max_batched_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
        "draft": args.draft,
        "num_speculative_tokens": args.num_speculative_tokens,
        "compile": args.compile,
        "batch_invariant": args.batch_invariant,
    }
    spec = EngineSpec(str(args.checkpoint), args.dtype, options, args.matmul_precision)
    if engine_process:
        engine: Any = EngineProcess(spec, on_death)
        engine.start()  # loads the checkpoint in the child
        tokenizer, vocab_size = engine.facts.tokenizer, engine.facts.vocab_size
    else:
        engine = build_engine_thread(spec)
        tokenizer, vocab_size = engine.tokenizer, engine.inputs.vocab_size
    eos = tokenizer.special.eos if tokenizer.special.eos is not None else tokenizer.eot_id
    eos_text = "" if eos is None else tokenizer.decode([eos])
    # this process's startup heap (the app, the tokenizer, on a thread the engine) out of the
    # collector; here, not in the app, which a caller may run inside a process of its own
    freeze_startup_objects()
    return Served(
        engine=engine,
        tokenizer=tokenizer,
        model_name=Path(args.checkpoint).resolve().name,
        context_length=engine.max_sequence,
        vocab_size=vocab_size,
        chat_template=load_chat_template(args.checkpoint, eos_token=eos_text),
        sampling_defaults={}
        if args.generation_config == "vllm"
        else dict(tokenizer.generation.defaults),
    )


def check_engine_arguments(args: argparse.Namespace) -> None:
    """Refuse bad sizes before anything loads."""
    from decoderlm.engine.kv_pool import parse_bytes
    from decoderlm.loading import checkpoint_path

    args.checkpoint = str(checkpoint_path(args.checkpoint))  # a model's name: its file
    args.dtype_chosen = args.dtype == "auto"  # said by `announce_dtype` once every check passed
    args.dtype = serving_dtype(args.dtype)
    parse_bytes(args.kv_cache_memory)
    for flag, value in (("--max-queue", args.max_queue),
                        ("--max-batched-tokens", args.max_batched_tokens)):  # fmt: skip
        if value < 1:
            raise DecoderLMError(f"{flag}={value} must be ≥ 1")
    if args.draft not in (None, "prompt-lookup") and not Path(args.draft).is_dir():
        raise DecoderLMError(
            f"--draft {args.draft}: no such directory (give a run or Hugging Face directory, "
            "or prompt-lookup)"
        )
    k = args.num_speculative_tokens
    if k is not None and (args.draft is None or k < 1):
        raise DecoderLMError(f"--num-speculative-tokens={k} needs --draft and must be ≥ 1")


def serving_dtype(name: str) -> str:
    """The weights' dtype for --dtype `name`: "auto" is bfloat16 on a CPU with native bf16
    (AVX512-BF16 or AMX: several times float32's batched throughput, at a relative logits error
    of ~2e-2) and float32 elsewhere (where a bf16 matmul is emulated, hundreds of times slower)."""
    from decoderlm.cpu.features import has_native_bf16
    from decoderlm.dtypes import parse_dtype

    if name != "auto":
        return str(parse_dtype(name)).removeprefix("torch.")
    return "bfloat16" if has_native_bf16() else "float32"


def announce_dtype(args: argparse.Namespace) -> None:
    """On stderr, the dtype `--dtype auto` chose, so a user sees what they serve."""
    if args.dtype_chosen:
        why = "native bf16 on this CPU" if args.dtype == "bfloat16" else "no native bf16 here"
        print(f"decoderlm: serving in {args.dtype} ({why}; --dtype to choose)", file=sys.stderr)


def announce_compile(args: argparse.Namespace) -> None:
    """On stderr, that the engine's decode pass is compiled at the start (the wait before /health
    answers 200), unless --no-compile."""
    if args.compile:
        print(
            "decoderlm: compiling the engine's decode pass before serving (minutes the first time "
            "on a machine, then loaded from the disk cache; --no-compile to skip)",
            file=sys.stderr,
        )


def policy(args: argparse.Namespace) -> Any:
    """The server's `Policy` from --api-key (or $DECODERLM_API_KEY), --host and --allowed-hosts;
    warns on stderr when a server bound to every address answers to any host."""
    from decoderlm.server.security import ENV_API_KEY, Policy, allowed_hosts

    api_key = args.api_key if args.api_key is not None else os.environ.get(ENV_API_KEY)
    hosts = allowed_hosts(args.host, args.allowed_hosts)
    if hosts is None and args.allowed_hosts is None:
        print(
            f"decoderlm serve: warning: bound to {args.host or 'every address'} without "
            "--allowed-hosts, so any Host header is accepted (no DNS-rebinding protection); "
            "give --allowed-hosts NAMES, or '*' to silence this",
            file=sys.stderr,
        )
    return Policy(api_key, hosts)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from decoderlm.server.app import create_app, drain
    from decoderlm.server.limits import Limits

    check_engine_arguments(args)
    if not 0 <= args.port <= 65535:
        raise DecoderLMError(f"--port={args.port} must be in [0, 65535]")
    if args.grace_period < 0:
        raise DecoderLMError(f"--grace-period={args.grace_period} must be ≥ 0")
    limits = Limits(**{field: getattr(args, field) for field in LIMIT_FLAGS})
    announce_dtype(args)
    announce_compile(args)
    failures: list[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    def on_engine_death(why: str) -> None:
        failures.append(DecoderLMError(f"{why}; exiting for a supervisor to restart the server"))
        drain(app, 0.0)
        server.should_exit = True

    app = create_app(
        lambda: load_served(args, args.engine == "process", on_engine_death),
        on_load_error,
        grace_s=args.grace_period,
        policy=policy(args),
        limits=limits,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                drain(app, args.grace_period)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=int(args.grace_period) + 5,  # a backstop: drain cancels first
    )
    server = Server(config)
    # uvicorn re-raises the SIGTERM it handled once it has shut down; a no-op handler makes that
    # a clean exit (status 0) instead of death by the signal.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failures:
        exc = failures[0]
        raise exc if isinstance(exc, DecoderLMError) else DecoderLMError(f"loading failed: {exc}")
    return 0
