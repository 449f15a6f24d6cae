"""The playground's router: a web page at `/` (plain HTML, CSS, JS in server/static, no build
step, no network) and the three JSON endpoints it reads besides the OpenAI ones. The page is open
and holds no secret; on a server with an API key it asks for the key and sends it as a Bearer
header on each of its requests.

- GET /v1/model_card: the model's shape (MHA/GQA/MQA, head_dim, positions, context) and what its
  KV cache costs per token and at 4k/32k/128k tokens, beside its MHA and MQA twins
  (`decoderlm.model.cache.kv_cache_table`, as `decoderlm info` prints it), and the bytes of one
  sequence's recurrent state (0 without recurrent layers).
- GET /v1/engine_stats: the engine's `EngineStats` (sequences running and waiting, KV blocks,
  tokens/s), as /metrics exports them.
- POST /v1/attention: the attention weights of one layer (one head or all) for a text of at most
  MAX_ATTENTION_TOKENS tokens, by the exact math path (`decoderlm.inference.attention_maps`), with
  every layer's mean attention entropy. Longer texts keep their first tokens ("truncated": true).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import Field
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.inference.attention_maps import attention_maps, check_index
from decoderlm.model.cache import attention_kind, kv_cache_table
from decoderlm.model.config import ModelConfig
from decoderlm.server.http import (
    APIError,
    ServerState,
    State,
    check_model,
    encode,
    request_text,
)
from decoderlm.server.openapi import errors
from decoderlm.server.protocol import TokenizeRequest

STATIC = Path(__file__).parent / "static"
MAX_ATTENTION_TOKENS = 256  # 256² weights per head: a readable map and a JSON body of a few MB
WEIGHT_DECIMALS = 5  # weights are rounded to this many decimals in the JSON
CONTEXTS = (4096, 32768, 131072)  # the model card's KV-cache sizes


class AttentionRequest(TokenizeRequest):
    """A text (prompt, or chat messages as rendered) and which map: a layer, one head or all."""

    add_generation_prompt: bool = False  # the text as it stands, not awaiting a reply
    layer: int = Field(0, description="0-based layer")
    head: int | None = Field(None, description="0-based head; null: every head of the layer")


def _model_facts(engine: Any) -> tuple[ModelConfig, torch.dtype, int]:
    """(config, weights dtype, parameter count) of the engine's model, read by `Engine.call`."""
    model = engine.model
    return model.config, model.tok_emb.weight.dtype, model.num_params()


def _attention_weights(
    engine: Any, ids: list[int], layer: int, heads: list[int]
) -> tuple[Tensor, Tensor]:
    """The weights (len(heads), T, T) of `layer` and every layer's entropy (n_layers,), computed by
    `Engine.call` on the engine's thread (or in its process), between its steps."""
    maps = attention_maps(engine.model, ids)
    return maps.weights[layer, 0, heads], maps.entropy


async def model_card(state: ServerState) -> dict[str, Any]:
    """The model card of the served model: shape, positions, parameters, KV-cache costs."""
    served = state.ready()
    config, dtype, parameters = await asyncio.wrap_future(served.engine.call(_model_facts))
    stats = await state.stats()
    return {
        "model": served.model_name,
        "parameters": parameters,
        "n_layers": config.n_layers,
        "d_model": config.d_model,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "attention": attention_kind(config),
        "head_dim": config.head_dim,
        "position": config.position,
        "context_length": config.context_length,
        "vocab_size": config.vocab_size,
        "sliding_window": config.sliding_window,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_bytes_per_token": stats.kv_bytes_per_token,
        "state_bytes_per_sequence": stats.state_bytes_per_sequence,  # recurrent layers' state
        "kv_cache": kv_cache_table(config, CONTEXTS, dtype),
    }


def _check_field(name: str, value: int, count: int) -> None:
    """`check_index` as a 400 naming the field."""
    try:
        check_index(name, value, count)
    except DecoderLMError as exc:
        raise APIError(400, str(exc), param=name) from None


async def attention(state: ServerState, body: AttentionRequest) -> dict[str, Any]:
    """The weights of body.layer (body.head, or all heads) for the body's text; runs the model."""
    served = state.ready()
    config, _, _ = await asyncio.wrap_future(served.engine.call(_model_facts))
    _check_field("layer", body.layer, config.n_layers)
    if body.head is not None:
        _check_field("head", body.head, config.n_heads)
    param = "prompt" if body.prompt is not None else "messages"
    text = await request_text(state, served, body)
    ids = await state.work(encode, served, text, param, what="tokenizing the prompt")
    cap = min(MAX_ATTENTION_TOKENS, config.context_length)
    kept = ids[:cap]
    heads = list(range(config.n_heads)) if body.head is None else [body.head]
    weights, entropy = await asyncio.wrap_future(
        served.engine.call(_attention_weights, kept, body.layer, heads)
    )
    return {
        "model": served.model_name,
        "tokens": [served.token_text(t) for t in kept],
        "token_ids": kept,
        "n_tokens": len(kept),
        "prompt_tokens": len(ids),
        "truncated": len(ids) > cap,
        "max_tokens": cap,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "layer": body.layer,
        "heads": heads,
        # (len(heads), T, T): row i, query i; column j, key j
        "weights": weights.double().round(decimals=WEIGHT_DECIMALS).tolist(),
        "decimals": WEIGHT_DECIMALS,
        "entropy": entropy.tolist(),  # (n_layers,) mean attention entropy, nats
    }


router = APIRouter()
router.mount("/static", StaticFiles(directory=STATIC), name="static")


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/v1/model_card", responses=errors(503))
async def get_model_card(state: State) -> dict[str, Any]:
    return await model_card(state)


@router.get("/v1/engine_stats", responses=errors(503))
async def engine_stats(state: State) -> dict[str, Any]:
    return dataclasses.asdict(await state.stats())


@router.post("/v1/attention", responses=errors(404, 503))
async def post_attention(state: State, body: AttentionRequest) -> dict[str, Any]:
    served = state.ready()
    check_model(served, body.model)
    return await attention(state, body)
