"""Chat templates: a list of messages rendered to one prompt string, as Hugging Face renders them.

A checkpoint's template is the `chat_template` of the `tokenizer_config.json` beside it (or its
`chat_template.jinja` file; a GGUF file's `tokenizer.chat_template`), a Jinja2 program run in a sandboxed environment with the globals that
`transformers`' `apply_chat_template` provides: `messages`, `bos_token`, `eos_token`,
`add_generation_prompt`, `raise_exception(message)` and the `tojson` filter.

Runs of ours have none, so they get `DEFAULT_CHAT_TEMPLATE`: plain text that a model trained on
any prose (even a character vocabulary) can encode,

    System: You are terse.

    User: Hi!

    Assistant:

and the next turn's start, "\\nUser:", as a stop string, since such a model never learnt to end a turn.

Rendering is bounded: the output stops past `max_chars` characters, the template stops past
`timeout_s` seconds (checked at each output chunk, call, attribute and operator), a string or list
repeated (`'x' * 10**8`) or a power past the size is refused before it is built, and every error
a template raises (a sandbox violation, `{% include %}`, an undefined name, an OverflowError)
becomes a `TemplateRenderError` that names it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from decoderlm.errors import DecoderLMError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
DEFAULT_STOP = ("\nUser:",)  # the default template's next user turn

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MAX_POWER_BITS = 4096  # the largest integer `**` may build in a template


class TemplateRenderError(DecoderLMError):
    """The chat template failed on these messages (HTTP 400)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja2 chat template with the special tokens it may refer to, and the stops it implies."""

    source: str = DEFAULT_CHAT_TEMPLATE
    bos_token: str = ""
    eos_token: str = ""
    stop: tuple[str, ...] = DEFAULT_STOP

    def __post_init__(self) -> None:
        _compile(self.source)  # a syntax error is reported when the template is loaded

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_chars: int = 4 * 2**20,
        timeout_s: float = 2.0,
    ) -> str:
        """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]), at most
        `max_chars` characters rendered within `timeout_s` seconds; TemplateRenderError if not."""
        import jinja2

        _budget.max_chars, _budget.deadline = max_chars, time.monotonic() + timeout_s
        parts, size = [], 0
        try:
            for part in _compile(self.source).generate(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
            ):
                size += len(part)
                if size > max_chars:
                    raise TemplateRenderError(
                        f"the chat template's output exceeds {max_chars} characters"
                    )
                _check_deadline()
                parts.append(part)
        except TemplateRenderError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(f"the chat template refused the messages: {exc}") from None
        except Exception as exc:  # anything a template may raise: OverflowError, TypeError, ...
            message = f"the chat template failed: {type(exc).__name__}: {exc}"
            raise TemplateRenderError(message) from None
        return "".join(parts)


def load_chat_template(checkpoint_dir: str | Path, eos_token: str = "") -> ChatTemplate:
    """The chat template of a checkpoint (a directory or a GGUF file), or the default one if it
    has none.

    `eos_token` is used where tokenizer_config.json names none (ours: "<|endoftext|>").
    """
    directory = Path(checkpoint_dir)
    if directory.is_file():  # a GGUF file
        from decoderlm.gguf import read_chat_template

        source, bos, eos = read_chat_template(directory)
        if source is None:
            return ChatTemplate(eos_token=eos or eos_token)
        return ChatTemplate(source, bos, eos, stop=())
    config: dict[str, Any] = {}
    config_file = directory / TOKENIZER_CONFIG_FILE
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DecoderLMError(f"{config_file} is not valid JSON: {exc}") from None
    source = config.get("chat_template")
    if isinstance(
        source, list
    ):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default", next(iter(named.values()), None))
    if source is None and (directory / TEMPLATE_FILE).is_file():
        source = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    eos = _token_text(config.get("eos_token")) or eos_token
    if not isinstance(source, str):
        return ChatTemplate(eos_token=eos)
    return ChatTemplate(source, _token_text(config.get("bos_token")), eos, stop=())


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json stores it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


_budget = threading.local()  # this thread's render: max_chars and deadline


def _check_deadline() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateRenderError("the chat template took too long to render")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `seq * n` longer than the output may be and `a ** b` larger than MAX_POWER_BITS."""
    _check_deadline()
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            repeated = isinstance(seq, str | list | tuple) and isinstance(times, int)
            if repeated and len(seq) * times > _budget.max_chars:
                raise TemplateRenderError(
                    f"the chat template builds a sequence of {len(seq) * times} items, more "
                    f"than {_budget.max_chars}"
                )
    elif operator == "**" and _power_bits(left, right) > MAX_POWER_BITS:
        raise TemplateRenderError(f"the chat template computes {left} ** {right}: too large")


def _power_bits(left: Any, right: Any) -> float:
    """About how many bits `left ** right` has, for integers (0 for anything else)."""
    if not (isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1):
        return 0.0
    return right * math.log2(abs(left))


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with the render's budget checked at operators, calls and attributes."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _check_deadline()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            _check_deadline()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _check_deadline()
            return super().getitem(obj, argument)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise DecoderLMError(f"the chat template is not valid Jinja2: {exc}") from None
