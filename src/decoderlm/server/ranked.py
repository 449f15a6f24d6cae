"""Completions that rank candidates: OpenAI's `best_of` and vLLM's `use_beam_search`, on
/v1/completions and /v1/chat/completions alike (vLLM's chat endpoint takes both), by the same code
with the endpoint's response format.

- `best_of`: the prompt's best_of sampled completions (candidate j draws from seed + j, as the
  n of a plain request do), of which the n with the highest mean log-probability per token are
  returned, best first, as OpenAI's completions API does; `usage` counts every candidate's tokens.
  The score is `decoderlm.search`'s `mean_logprob`, the scorer of its best-of-N.
- `use_beam_search`: `decoderlm.search.strategies.beam_search` itself, of width best_of (as vLLM
  ≤ 0.6's) or else n (as its later `beam_width=n`), returning its n best beams by
  log-probability / L^length_penalty, L as vLLM's `get_beam_search_score` (vllm/beam_search.py)
  counts it: prompt and generated tokens, less one if the last is end-of-text. A beam ends at
  end-of-text or a stop string (a chat's also at its template's); `usage` counts one generated
  token per beam and step, what the search asked the engine for. With `logprobs` each returned
  token has its log-probability and its step's k likeliest tokens (the step requests ask the
  engine for max(width, k): exact, and no more steps).

Where the search runs: in the HTTP process, over the `EngineClient`'s submit API
(`decoderlm.search.lm.ClientLM`), not as a request kind inside the engine. The same code then
serves an `Engine` in this process and an `EngineProcess` alike (the search needs only requests'
tokens and log-probabilities, never the model); the engine stays a scheduler of plain requests
that other work leaves untouched; and the answer is the Python strategy's by construction. Each
search step is one engine request per live beam (the prompt's KV blocks are shared by prefix
caching), run on a worker thread that waits for it while the engine steps it among other requests.
A search is in flight for the server's drain (`ServerState.inflight`) as a stream is: it may finish
within the grace period, and is cancelled (503) when that ends.

Exact under concurrency: a best_of candidate is a seeded sequence and a beam step a greedy
request for the top-k next tokens, each of which the engine answers the same alone or in a crowd.
Both need every candidate before they can answer, so neither streams (vLLM does not stream them
either); beam search ranks the model's own log-probabilities, so it takes no sampling options.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from fastapi.responses import JSONResponse

from decoderlm.engine.output import SequenceOutput
from decoderlm.engine.types import EngineStoppedError, RequestParams, TokenEvent, TopLogprob
from decoderlm.search.lm import ClientLM, Sample
from decoderlm.search.strategies import Candidate, SearchResult, beam_search, mean_logprob
from decoderlm.server import protocol
from decoderlm.server.http import APIError, Served, ServerState
from decoderlm.server.protocol import GREEDY_BELOW, Generation
from decoderlm.server.responses import Format, RequestStream, collect, envelope, streams_usage

STRUCTURED = (  # the fields that ask for a structured output
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def candidates(body: Generation) -> int:
    """Sequences per prompt: best_of (≥ n), else n; with use_beam_search, the beam width."""
    return body.best_of or body.n


def selects(body: Generation) -> bool:
    """Whether the response keeps only some sampled candidates (best_of > n, no beam search)."""
    return candidates(body) > body.n and not body.use_beam_search


def check(body: Generation) -> None:
    """400 naming the field for a best_of or a beam search the server cannot run."""
    if body.best_of is not None and body.best_of < body.n:
        raise APIError(400, f"best_of={body.best_of} must be ≥ n={body.n}", param="best_of")
    if body.stream and (body.use_beam_search or selects(body)):
        field = "use_beam_search" if body.use_beam_search else "best_of"
        raise APIError(
            400,
            f"{field} cannot stream: its choices are known once every candidate has ended; "
            "send stream=false",
            param=field,
        )
    if not body.use_beam_search:
        return
    if body.temperature is not None and body.temperature >= GREEDY_BELOW:
        raise APIError(
            400,
            f"use_beam_search needs temperature 0 or none (got {body.temperature}): "
            "beam search keeps the likeliest tokens, it does not sample",
            param="temperature",
        )
    options = {
        "top_p": body.top_p not in (None, 1),
        "top_k": body.top_k is not None,
        "repetition_penalty": body.repetition_penalty not in (None, 1),
        "ignore_eos": body.ignore_eos,
    }
    options |= {name: getattr(body, name) is not None for name in STRUCTURED}
    if body.response_format is not None and body.response_format.type == "text":
        options["response_format"] = False
    refused = [name for name, given in options.items() if given]
    if refused:
        raise APIError(
            400,
            f"use_beam_search takes no {refused[0]} (got {getattr(body, refused[0])!r}): "
            "beam search ranks the model's own log-probabilities",
            param=refused[0],
        )


def engine_params(params: RequestParams, body: Generation) -> RequestParams:
    """A request's engine parameters: for a best_of that selects, best_of sequences with their
    log-probabilities (what `best_of` ranks by); otherwise `params` as they are."""
    if not selects(body):
        return params
    logprobs = 0 if params.logprobs is None else params.logprobs
    return dataclasses.replace(params, n=candidates(body), logprobs=logprobs)


def _mean_logprob(events: list[TokenEvent]) -> float:
    tokens = [e for e in events if e.token_id is not None]
    ids, logprobs = (e.token_id for e in tokens), (e.logprob for e in tokens)
    return mean_logprob("", Sample("", tuple(ids), tuple(logprobs), ""))


async def best_of(
    request_id: str,
    created: int,
    served: Served,
    streams: list[RequestStream],
    fmt: Format,
    n: int,
) -> JSONResponse:
    """The response of a best_of request whose streams (best_of sequences each) have started:
    each prompt's n candidates of the highest mean log-probability, best first (the first of
    equals), formatted by `fmt` (n choices a prompt)."""
    events = await collect(served, streams)
    groups = (events[s.first_choice : s.first_choice + s.params.n] for s in streams)
    best = [e for group in groups for e in sorted(group, key=_mean_logprob, reverse=True)[:n]]
    choices = [fmt.choice(i, e, whole=True) for i, e in enumerate(best)]
    whole = envelope(request_id, created, served, fmt.object, choices)
    return JSONResponse(whole | {"usage": streams_usage(streams)})


async def beam(
    state: ServerState,
    request_id: str,
    created: int,
    body: Generation,
    prompts: list[list[int]],
    max_tokens: list[int],
    stop: tuple[str, ...],
    logprobs: int | None,
    fmt: Callable[[list[int]], Format],
) -> JSONResponse:
    """The response of a beam search request: each prompt's ids searched to at most its
    max_tokens, on a thread of its own, its n best beams returned, best first (fewer if the prompt
    has fewer sequences of at most max_tokens tokens), formatted by `fmt(owners)`, the response's
    format given the prompt of each choice. The search counts as in flight for a drain."""
    served, width = state.ready(), candidates(body)
    lm = ClientLM(served.engine, served.tokenizer, served.vocab_size)

    def search(ids: list[int], tokens: int) -> SearchResult:
        return beam_search(
            lm,
            ids,
            width * tokens,  # a budget it never reaches: ≤ width beams a step
            width=width,
            max_tokens=tokens,
            alpha=body.length_penalty,
            length="sequence",  # as vLLM's length_penalty
            stop=stop,
            top=logprobs or 0,
            extract=lambda text: None,
        )

    state.inflight[request_id] = lm.cancel
    try:
        searches = (
            asyncio.to_thread(search, ids, n) for ids, n in zip(prompts, max_tokens, strict=True)
        )
        results = await asyncio.gather(*searches)
    except EngineStoppedError:
        if not state.draining:
            raise
        message = "the server is shutting down: the beam search outlasted the grace period"
        raise APIError(503, message, "service_unavailable") from None
    finally:
        state.inflight.pop(request_id, None)
        lm.cancel()  # stops the searches still running if this request ended first
    best = [
        (p, c)
        for p, result in enumerate(results)
        for c in sorted(result.candidates, key=lambda c: c.score, reverse=True)[: body.n]
    ]
    shape = fmt([p for p, _ in best])
    choices = [
        shape.choice(i, beam_events(served, prompts[p], stop, c), whole=True)
        for i, (p, c) in enumerate(best)
    ]
    usage = protocol.usage(sum(len(ids) for ids in prompts), sum(r.tokens for r in results))
    return JSONResponse(
        envelope(request_id, created, served, shape.object, choices) | {"usage": usage}
    )


def beam_events(
    served: Served, prompt_ids: list[int], stop: tuple[str, ...], beam: Candidate
) -> list[TokenEvent]:
    """A beam's tokens as the events a sequence streams (their text cut at the stop string, as
    `SequenceOutput` cuts it), with their log-probabilities and likeliest alternatives."""
    output = SequenceOutput.create(served.tokenizer, RequestParams(stop=stop), 0, prompt_ids)
    last = len(beam.token_ids) - 1
    return [
        dataclasses.replace(
            output.event(token, None, full=i == last),
            logprob=logprob,
            top_logprobs=tuple(TopLogprob(t, served.token_text(t), lp) for t, lp in top),
        )
        for i, (token, logprob, top) in enumerate(
            zip(beam.token_ids, beam.logprobs, beam.tops, strict=True)
        )
    ]
