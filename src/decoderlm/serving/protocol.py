"""OpenAI's request bodies as pydantic models, and the JSON of its responses and stream chunks.

Field names, ranges and defaults follow OpenAI's API reference for /v1/completions and
/v1/chat/completions, plus vLLM's extensions `top_k`, `repetition_penalty`, `ignore_eos` and
/tokenize, /detokenize. Unknown fields are ignored. `to_params` maps a body to the engine's `RequestParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from decoderlm.inference.sampling import SamplingParams
from decoderlm.serving.types import RequestParams, TokenEvent

MAX_LOGPROBS = 20
MAX_STOPS = 4
MAX_N = 16
# The API's bounds, as vLLM's: sampling itself is safe at any positive value (it keeps the top token
# and works in float64), but values this small only mean "greedy", which GREEDY_BELOW makes exact.
GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-5
MIN_REPETITION_PENALTY = 0.01

# StrictInt: JSON true is not the integer 1, nor "5" the integer 5.
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class Generation(_Body):
    """The fields shared by completions and chat completions; null means the default.

    Fields this server does not know are kept (`model_extra`), unused, so that the server can
    name them in its log: OpenAI clients send newer fields it need not refuse, but a misspelt one
    (`max_token`) should not pass unseen."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy; default 1")
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1)
    top_k: StrictInt | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=10, description="> 1 discourages repeats"
    )
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: StrictInt | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(
        False, description="go on past the end-of-text token, until max_tokens or a stop string"
    )


Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class CompletionRequest(Generation):
    prompt: Prompt
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        """{"role", "content"} with the text parts joined, as chat templates read a message."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatRequest(Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="the newer max_tokens")
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    """Either a prompt or chat messages (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


def to_params(
    body: Generation, max_tokens: int, logprobs: int | None, stop: tuple[str, ...] = ()
) -> RequestParams:
    """The engine's parameters for a request (its n sequences; sequence j draws from seed + j)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    sampling = SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
    )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return RequestParams(
        max_tokens=max_tokens,
        sampling=sampling,
        stop=tuple(stops) + stop,
        seed=body.seed,
        logprobs=logprobs,
        n=body.n,
        stop_at_eot=not body.ignore_eos,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(events: list[TokenEvent], token_text: Any, offset: int) -> dict[str, list]:
    """The completions API's logprobs: tokens, their logprobs, the top ones, and text offsets.

    `offset` is where the first event's text starts in the choice's text.
    """
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for event in events:
        if event.token_id is not None:
            out["tokens"].append(token_text(event.token_id))
            out["token_logprobs"].append(event.logprob)
            top = {t.text: t.logprob for t in event.top_logprobs}
            out["top_logprobs"].append(
                None if event.logprob is None else top
            )  # an echoed 1st token
            out["text_offset"].append(offset)
        offset += len(event.text)
    return out


def chat_logprobs(events: list[TokenEvent], token_text: Any) -> dict[str, list]:
    """The chat API's logprobs: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""

    def entry(text: str, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        entry(token_text(e.token_id), e.logprob)
        | {"top_logprobs": [entry(t.text, t.logprob) for t in e.top_logprobs]}
        for e in events
        if e.token_id is not None
    ]
    return {"content": content}
