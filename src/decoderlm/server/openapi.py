"""The OpenAPI document says what the server answers: each route's `responses=` (its 200's JSON
schema and the `APIError` statuses it may answer, with their headers), and `document`, which
replaces FastAPI's 422 for a bad body by the 400 the server sends. schemathesis' conformance checks
hold the server to it (tests/serving/test_server_schema.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from decoderlm.server.http import retry_headers

ERROR_SCHEMA = {  # the JSON schema of APIError's body
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ERRORS = {  # what each status of an APIError means, in the OpenAPI document
    400: "a bad field, or a prompt that leaves no room in the context",
    404: "the model is not served here",
    413: "the request body is larger than the server's --max-request-bytes",
    429: "the queue is full",
    500: "the engine failed on this request",
    503: "the model is loading, the engine has stopped or the server is shutting down",
}


def error_response(description: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """An OpenAPI response of an APIError, with its headers."""
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": ERROR_SCHEMA}},
    }
    if headers:
        response["headers"] = {
            name: {"required": True, "schema": {"type": "string", "const": value}}
            for name, value in headers.items()
        }
    return response


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: the APIErrors of these statuses that it may answer."""
    return {status: error_response(ERRORS[status], retry_headers(status)) for status in statuses}


def json_response(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI response with a JSON body of this schema."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def json_object(**properties: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of an object that has (at least) these properties."""
    return {"type": "object", "required": list(properties), "properties": properties}


INT, STR = {"type": "integer"}, {"type": "string"}
HEALTH = json_object(status=STR)
MODELS = json_object(
    object={"const": "list"},
    data={"type": "array", "items": json_object(id=STR, created=INT, max_model_len=INT)},
)
TOKENS = json_object(tokens={"type": "array", "items": INT}, count=INT, max_model_len=INT)


def completion_responses(obj: str) -> dict[str, Any]:
    """A route's `responses=` for a completion (`object` obj) or, with stream=true, its chunks."""
    usage = json_object(prompt_tokens=INT, completion_tokens=INT, total_tokens=INT)
    schema = json_object(
        id=STR,
        object={"const": obj},
        created=INT,
        model=STR,
        choices={"type": "array", "items": json_object(index=INT, finish_reason={})},
        usage=usage,
    )
    # each server-sent event (`data: {chunk JSON}` or `data: [DONE]`), as schemathesis parses them
    stream = {"text/event-stream": {"schema": json_object(data=STR)}}
    whole = json_response(
        "the completion, or with stream=true its chunks as server-sent events", schema
    )
    return errors(404, 413, 429, 500, 503) | {200: whole | {"content": whole["content"] | stream}}


def document(app: FastAPI, extend: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """FastAPI's OpenAPI document of `app`, saying what the server answers: a bad body is a 400
    (FastAPI says 422), and `extend` adds the rest (the security policy's 401 and 421)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                if operation["responses"].pop("422", None) is not None:
                    operation["responses"]["400"] = error_response(ERRORS[400])
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        extend(schema)
        app.openapi_schema = schema
    return app.openapi_schema
