"""OpenAI's request bodies as pydantic models, and the JSON of its responses and stream chunks.

Field names, ranges and defaults follow OpenAI's API reference for /v1/completions and
/v1/chat/completions (`response_format` and the completions' `best_of` included), plus vLLM's
extensions `top_k`, `repetition_penalty`, `ignore_eos`, `structured_outputs` (and its older
`guided_*` fields), `use_beam_search` and `length_penalty` (server/ranked.py runs those two and
`best_of`, on chat completions too, as vLLM's chat endpoint takes them), and /tokenize,
/detokenize. Unknown fields are ignored. `to_params` maps a body to the engine's `RequestParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from decoderlm.engine.types import RequestParams, TokenEvent
from decoderlm.errors import DecoderLMError
from decoderlm.inference.sampling import SamplingParams
from decoderlm.inference.structured import StructuredOutput

MAX_LOGPROBS = 20
MAX_STOPS = 4
MAX_N = 16
MAX_STOP_TOKEN_IDS = 64
# |length_penalty| at most: L^α overflows a float once α·log2(L) > 1024 (at α = 1000 for any
# L ≥ 3, a 500 before this bound); at 10 no context comes near it, and no beam search wants more.
MAX_LENGTH_PENALTY = 10.0
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


JSONValue = dict[str, Any] | str  # a JSON schema: an object, or its JSON text


class JSONSchemaFormat(_Body):
    """OpenAI's response_format.json_schema. `strict` is accepted; the schema is always enforced."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs (vLLM ≥ 0.10): one of a JSON schema, a regular expression, a
    list of choices, an EBNF grammar, or any JSON object."""

    json_: JSONValue | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
        False,
        description="go on past the model's stop ids (its end-of-sequence and end-of-turn "
        "tokens), until max_tokens, a stop string or stop_token_ids",
    )
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="more token ids that end the output (vLLM's)"
    )
    min_tokens: StrictInt = Field(
        0, ge=0, description="no stop id or stop string ends the output before this many tokens"
    )
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(
        True,
        description="vLLM's option for slow tokenizers; decoderlm's fast tokenizers join the "
        "pieces as their decoder does, whatever it says",
    )
    include_stop_str_in_output: bool = Field(
        False, description="end the text with the stop string that ended it (else cut before)"
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JSONValue | None = None  # vLLM < 0.10's names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    best_of: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_N,
        description="sample best_of (≥ n), return the n of highest mean log-probability; "
        "with use_beam_search, the beam width",
    )
    use_beam_search: bool = Field(
        False, description="beam search of width best_of (default n), returning the n best beams"
    )
    length_penalty: float = Field(
        1.0,
        ge=-MAX_LENGTH_PENALTY,
        le=MAX_LENGTH_PENALTY,
        description="beam search's score, as vLLM's: log-probability / L^length_penalty, "
        "L = prompt + generated tokens, less one if the last is end-of-text",
    )

    def stops(self) -> tuple[str, ...]:
        """The stop strings asked for: `stop` as a tuple."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def structured(self) -> StructuredOutput | None:
        """The one structured output the body asks for, or None; DecoderLMError naming the
        fields if it asks for more than one, or for a bad one."""
        asked: list[tuple[str, str, Any]] = []  # (field, kind, spec)
        fmt, vllm = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", "json_object", None))
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise DecoderLMError("response_format of type json_schema needs its json_schema")
            asked.append(("response_format", "json", fmt.json_schema.schema_))
        if vllm is not None:
            given = zip(
                ("json", "regex", "choice", "grammar"),
                (vllm.json_, vllm.regex, vllm.choice, vllm.grammar),
                strict=True,
            )
            asked += [(f"structured_outputs.{k}", k, v) for k, v in given if v is not None]
            if vllm.json_object:
                asked.append(("structured_outputs.json_object", "json_object", None))
        for kind in ("json", "regex", "choice", "grammar"):
            spec = getattr(self, f"guided_{kind}")
            if spec is not None:
                asked.append((f"guided_{kind}", kind, spec))
        if len(asked) > 1:
            raise DecoderLMError(
                f"give one structured output, not {' and '.join(name for name, _, _ in asked)}"
            )
        return StructuredOutput(asked[0][1], asked[0][2]) if asked else None


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
    body: Generation,
    max_tokens: int,
    logprobs: int | None,
    stop: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
) -> RequestParams:
    """The engine's parameters for a request (its n sequences; sequence j draws from seed + j);
    the sampling fields it leaves out take `defaults` (the model's generation config), then the
    API's (temperature 1, no top-k or top-p, no repetition penalty)."""
    given = {
        name: getattr(body, name)
        for name in ("temperature", "top_k", "top_p", "repetition_penalty")
        if getattr(body, name) is not None
    }
    chosen = {"temperature": 1.0} | (defaults or {}) | given
    if chosen["temperature"] < GREEDY_BELOW:
        chosen["temperature"] = 0.0
    sampling = SamplingParams(**chosen)
    return RequestParams(
        max_tokens=max_tokens,
        sampling=sampling,
        stop=body.stops() + stop,
        seed=body.seed,
        logprobs=logprobs,
        n=body.n,
        structured=body.structured(),
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
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
