"""`decoderlm chat`: a terminal chat with a checkpoint on the serving engine, streamed as it is generated.

Each turn renders the conversation with the checkpoint's chat template (see decoderlm.chat_template);
when it outgrows the context, the oldest exchanges are dropped. `/reset` starts over, `/quit` (or
end of input) leaves.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from decoderlm.commands.serve import (
    add_engine_arguments,
    announce_compile,
    announce_dtype,
    check_engine_arguments,
    load_served,
)
from decoderlm.errors import DecoderLMError

HELP = "chat with a checkpoint in the terminal (streamed replies; /reset, /quit)"
DEFAULT_TEMPERATURE = 0.8  # a chat's, where the model's files give none


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--system", metavar="TEXT", help="a system message that opens each chat")
    parser.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="longest reply (default: the rest of the context)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help=f"0 = greedy (default: the model's, else {DEFAULT_TEMPERATURE})",
    )
    parser.add_argument(
        "--top-k", type=int, metavar="K", help="sample from the K most likely tokens"
    )
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling, P in (0, 1]")
    parser.add_argument(
        "--repetition-penalty", type=float, metavar="R", help="> 1 discourages repeats (default 1)"
    )
    parser.add_argument("--seed", type=int, help="seed for reproducible replies")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from decoderlm.server.protocol import ChatRequest

    check_engine_arguments(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    try:  # the same checks and defaults as the HTTP API
        body = ChatRequest(
            messages=system or [{"role": "user", "content": ""}],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        raise DecoderLMError(
            f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}"
        ) from None
    announce_dtype(args)
    announce_compile(args)
    served = load_served(args)
    try:
        asyncio.run(_chat(served, body, system))
    finally:
        served.engine.shutdown(0)
    return 0


async def _chat(served: Any, body: Any, system: list[dict[str, str]]) -> None:
    from decoderlm.server import protocol

    messages = list(system)
    print(f"chatting with {served.model_name} — /reset starts over, /quit leaves")
    while True:
        try:
            line = await asyncio.to_thread(input, "> ")
        except EOFError:
            print()
            return
        if line.strip() == "/quit":
            return
        if line.strip() == "/reset":
            messages = list(system)
            print("(new conversation)")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = _fit(served, messages, len(system))
        except DecoderLMError as exc:
            print(f"({exc})")
            messages.pop()
            continue
        room = served.context_length - len(ids)
        max_tokens = room if body.max_tokens is None else min(body.max_tokens, room)
        defaults = {"temperature": DEFAULT_TEMPERATURE} | served.sampling_defaults
        params = protocol.to_params(body, max_tokens, None, served.chat_template.stop, defaults)
        reply = []
        async for event in served.engine.stream(ids, params):
            print(event.text, end="", flush=True)
            reply.append(event.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply).strip()})


def _fit(served: Any, messages: list[dict[str, str]], keep: int) -> list[int]:
    """The prompt ids of `messages`, dropping the oldest exchanges (after the first `keep`) to fit."""
    while True:
        ids = served.tokenizer.encode(served.chat_template.render(messages))  # the template's BOS
        if len(ids) < served.context_length:
            return ids
        if len(messages) - keep <= 1:
            raise DecoderLMError(
                f"that message is {len(ids)} tokens, more than the context of "
                f"{served.context_length} holds; say less"
            )
        del messages[keep : keep + 2]
