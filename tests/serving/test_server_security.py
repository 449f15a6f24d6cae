"""Who may call `decoderlm serve`: the API key on the OpenAI routes (401 in OpenAI's shape) and the
Host check against DNS rebinding (421), over HTTP; how `decoderlm serve`'s flags set them."""

from __future__ import annotations

from argparse import Namespace
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import live_server, make_served, wait_healthy
from decoderlm.commands.serve import policy
from decoderlm.errors import DecoderLMError
from decoderlm.server.app import create_app
from decoderlm.server.security import LOOPBACK_HOSTS, Policy, allowed_hosts

KEY = "sk-test-0123"
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/model_card", None),
    ("GET", "/v1/engine_stats", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/attention", {"prompt": "hi"}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]
OPEN = ["/health", "/metrics", "/", "/static/app.js", "/static/style.css", "/openapi.json"]


@pytest.fixture(scope="module")
def keyed(run_dir, loaded):
    """The base URL of a server whose API key is KEY."""
    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")
    with live_server(create_app(lambda: served, grace_s=1.0, policy=Policy(KEY))) as base:
        wait_healthy(base)
        yield base


def call(base: str, method: str, path: str, body: dict | None, **headers: str) -> httpx.Response:
    return httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=60)


def assert_openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_protected_routes_answer_401_without_the_key_and_200_with_it(keyed, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = call(keyed, method, path, body, **headers)
        assert_openai_error(r, 401, "invalid_api_key")
        assert r.headers["WWW-Authenticate"] == "Bearer"
    for scheme in ("Bearer", "bearer"):
        r = call(keyed, method, path, body, Authorization=f"{scheme} {KEY}")
        assert r.status_code == 200, r.text


def test_open_routes_need_no_key(keyed):
    for path in OPEN:
        assert httpx.get(f"{keyed}{path}").status_code == 200, path
    assert httpx.get(f"{keyed}/v1/nowhere").status_code == 401  # all of /v1, routes or not


def test_a_server_without_a_key_needs_none(server):
    base, _ = server
    assert httpx.get(f"{base}/v1/models").status_code == 200
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 200


def test_loopback_server_answers_its_loopback_names_and_refuses_others_with_421(server):
    base, _ = server
    port = urlsplit(base).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{base}/health", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "127.0.0.1.evil.example", f"[::2]:{port}"):
        for path in ("/health", "/", "/v1/models"):
            r = httpx.get(f"{base}{path}", headers={"Host": host})
            assert_openai_error(r, 421, "invalid_host")


def test_any_host_is_answered_when_the_policy_allows_any(run_dir, loaded, start_server):
    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")
    base = start_server(create_app(lambda: served, policy=Policy(hosts=None)))
    wait_healthy(base)
    assert httpx.get(f"{base}/health", headers={"Host": "proxy.example"}).status_code == 200


def test_a_wrong_method_gets_405_with_allow(server):
    r = httpx.put(f"{server[0]}/v1/completions", json={})
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert r.json()["error"]["message"]


def test_openapi_declares_400_not_422_and_the_policys_401_and_421(server, keyed):
    for base, keyed_server in ((server[0], False), (keyed, True)):
        paths = httpx.get(f"{base}/openapi.json").json()["paths"]
        completions = paths["/v1/completions"]["post"]["responses"]
        assert "422" not in completions and {"400", "404", "421", "429", "503"} <= set(completions)
        assert ("401" in completions) is keyed_server
        assert "401" not in paths["/health"]["get"]["responses"]
        assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == [
            httpx.get(f"{base}/metrics").headers["content-type"]
        ]
    assert httpx.get(f"{keyed}/docs").status_code == 404  # its page needs a CDN: turned off


@pytest.mark.parametrize(
    ("bind", "flag", "expected"),
    [
        ("127.0.0.1", None, LOOPBACK_HOSTS),
        ("localhost", None, LOOPBACK_HOSTS),
        ("::1", None, LOOPBACK_HOSTS),
        ("127.0.0.2", None, LOOPBACK_HOSTS | {"127.0.0.2"}),
        ("10.1.2.3", None, {"10.1.2.3"}),
        ("0.0.0.0", None, None),
        ("::", None, None),
        ("0.0.0.0", "api.example.com, [fd00::1]:8000,Other:80", {"api.example.com", "fd00::1", "other"}),
        ("127.0.0.1", "*", None),
    ],
)  # fmt: skip
def test_allowed_hosts_from_the_bind_address_and_the_flag(bind, flag, expected):
    assert allowed_hosts(bind, flag) == (None if expected is None else frozenset(expected))


def serve_args(**kwargs) -> Namespace:
    return Namespace(**({"host": "127.0.0.1", "api_key": None, "allowed_hosts": None} | kwargs))


def test_serve_flags_and_environment_make_the_policy(monkeypatch, capsys):
    monkeypatch.delenv("DECODERLM_API_KEY", raising=False)
    assert policy(serve_args()) == Policy(None, LOOPBACK_HOSTS)
    monkeypatch.setenv("DECODERLM_API_KEY", "from-env")
    assert policy(serve_args()).api_key == "from-env"
    assert policy(serve_args(api_key="from-flag")).api_key == "from-flag"
    assert capsys.readouterr().err == ""
    assert policy(serve_args(host="0.0.0.0")).hosts is None
    assert "--allowed-hosts" in capsys.readouterr().err  # any host: warned
    assert policy(serve_args(host="0.0.0.0", allowed_hosts="*")).hosts is None
    assert capsys.readouterr().err == ""  # any host, asked for
    with pytest.raises(DecoderLMError, match="empty"):
        policy(serve_args(api_key=""))
