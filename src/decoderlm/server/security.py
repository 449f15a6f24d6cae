"""Who may call the server: the `Host` check against DNS rebinding and the `--api-key` check.

`Guard` is a pure-ASGI middleware (`app.add_middleware(Guard, policy=...)`) that answers before
any route runs, in OpenAI's error shape:

- 421 when the request's `Host` is not one the server answers to. A web page of another site
  whose name was made to resolve to 127.0.0.1 (DNS rebinding) sends its own name as `Host`, so a
  server on loopback that accepts only `127.0.0.1`, `localhost` and `::1` cannot be read by it.
  Ports are not compared (only the name is), as Starlette's `TrustedHostMiddleware` does.
- 401 when the server has an API key and the request to a protected path does not carry it as
  `Authorization: Bearer KEY` (compared in constant time), as vLLM's `--api-key`. Protected are
  every `/v1` path, /tokenize and /detokenize; open are /health, /metrics, /openapi.json and the
  playground's page and static files (the page holds no secret: it asks for the key).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from decoderlm.errors import DecoderLMError
from decoderlm.server.http import APIError
from decoderlm.server.openapi import error_response

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # besides every path under /v1
ENV_API_KEY = "DECODERLM_API_KEY"
AUTHENTICATE = {"WWW-Authenticate": "Bearer"}


def _host_name(host: str) -> str:
    """The name of a `Host` value or an --allowed-hosts entry, lower-case, without port or
    brackets: "[::1]:8000" → "::1", "LocalHost:80" → "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") > 1:  # a bare IPv6 address
        return host
    return host.partition(":")[0]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str, allowed: str | None) -> frozenset[str] | None:
    """The host names the server answers to (None: any), from --host and --allowed-hosts.

    --allowed-hosts "a,b" is those names, "*" any. Without it: the loopback names when bound to
    loopback, the bound name when bound to one address, and any host when bound to every
    address (0.0.0.0 or ::), where `decoderlm serve` warns that a proxy's name should be given.
    """
    if allowed is not None:
        names = {_host_name(h) for h in allowed.split(",") if h.strip()}
        return None if "*" in names else frozenset(names)
    bind = _host_name(bind)
    if bind in WILDCARD_BINDS:
        return None
    return LOOPBACK_HOSTS | {bind} if _is_loopback(bind) else frozenset({bind})


def is_protected(path: str) -> bool:
    """Whether a request to `path` needs the API key (when the server has one)."""
    return path == "/v1" or path.startswith("/v1/") or path in PROTECTED_PATHS


@dataclass(frozen=True)
class Policy:
    """The server's API key (None: no key) and the host names it answers to (None: any)."""

    api_key: str | None = None
    hosts: frozenset[str] | None = LOOPBACK_HOSTS

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise DecoderLMError("the API key is empty: give a key, or none for an open server")

    def refusal(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> APIError | None:
        """The error for a request with this path and these headers, or None to let it in."""
        found = {name.lower(): value for name, value in headers}
        if self.hosts is not None:
            host = found.get(b"host", b"").decode("latin-1")
            if _host_name(host) not in self.hosts:
                message = f"this server does not answer to the host {host!r}"
                return APIError(421, message, code="invalid_host")
        if self.api_key is not None and is_protected(path):
            scheme, _, token = found.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(
                token.strip(), self.api_key.encode()
            ):
                message = "a missing or wrong API key: send it as 'Authorization: Bearer KEY'"
                return APIError(401, message, code="invalid_api_key", headers=AUTHENTICATE)
        return None

    def document(self, schema: dict[str, Any]) -> None:
        """Add this policy's answers (401 on protected paths, 421 everywhere) to an OpenAPI
        document."""
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if self.hosts is not None:
                    responses["421"] = error_response("the Host is not one this server serves")
                if self.api_key is not None and is_protected(path):
                    responses["401"] = error_response("a missing or wrong API key", AUTHENTICATE)


class Guard:
    """The ASGI middleware that refuses the HTTP requests `policy` refuses."""

    def __init__(self, app: ASGIApp, policy: Policy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.policy.refusal(scope["path"], scope["headers"])
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
