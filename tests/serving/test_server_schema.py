"""Schemathesis against the app's own OpenAPI schema: no request, valid or not, gets a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error


@pytest.fixture(scope="module")
def api_schema(server):
    base, _ = server
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_the_schema_allows_or_forbids_gets_a_server_error(case):
    case.call_and_validate(checks=[not_a_server_error])
