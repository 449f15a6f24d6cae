"""Schemathesis against the app's own OpenAPI schema: no request, valid or not, gets a 5xx, and
every answer is one the schema declares (status, content type, body schema, headers), with and
without an API key."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    allow_header_conformance,
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import live_server, make_served, wait_healthy
from decoderlm.server.app import create_app
from decoderlm.server.security import Policy

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    allow_header_conformance,
]


@pytest.fixture(scope="module")
def api_schema(server):
    base, _ = server
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


@pytest.fixture(scope="module")
def keyed_schema(run_dir, loaded):
    """The schema of a server with an API key; its requests do not send the key."""
    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")
    with live_server(create_app(lambda: served, grace_s=1.0, policy=Policy("sekret"))) as base:
        wait_healthy(base)
        yield schemathesis.openapi.from_url(f"{base}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")
keyed = schemathesis.pytest.from_fixture("keyed_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_to_any_request_is_one_the_schema_declares(case):
    case.call_and_validate(checks=CHECKS)


@keyed.parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_server_with_an_api_key_declares_its_401s(case):
    case.call_and_validate(checks=CHECKS)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2},
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_and_its_server_sent_events_are_as_the_schema_declares(
    api_schema, path, body, stream
):
    case = api_schema[path]["POST"].Case(body=body | {"stream": stream})
    response = case.call_and_validate(checks=CHECKS)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith(
        "text/event-stream" if stream else "application/json"
    )
