"""The playground of `decoderlm serve`: its JSON endpoints over HTTP, then the page in a real
headless chromium (selenium): streamed tokens, their alternatives, the attention heat-maps, stop.

The browser tests need Debian's `chromium` and `chromium-driver` (.ci/run installs them); without
them they are skipped with a reason that says so, except under CI=true, where they fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import make_served, wait_healthy
from decoderlm import DecoderLM
from decoderlm.server.app import create_app
from decoderlm.server.playground import MAX_ATTENTION_TOKENS, STATIC
from decoderlm.server.security import Policy

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(
    os.environ.get("DECODERLM_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts")
)
BEARER = {"Authorization": "Bearer sk-1"}
VIRIDIS_0, VIRIDIS_1 = (68, 1, 84), (253, 231, 37)  # the heat-map's colours of weight 0 and 1


def sdpa_weights(model: DecoderLM, ids: list[int], layer: int) -> torch.Tensor:
    """(H, T, T): the layer's own `need_weights=True` path (scaled_dot_product_attention), fed the
    input its attention receives in a plain forward pass (captured by a pre-hook)."""
    attn = model.blocks[layer].attn
    seen = []
    hook = attn.register_forward_pre_hook(lambda _m, args: seen.append(args[:2]))
    with torch.no_grad():
        model(torch.tensor([ids]))
        hook.remove()
        _, weights = attn(*seen[0], need_weights=True)  # (1, H, T, T)
    return weights[0]


def attention(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/attention", json=body, timeout=60)


@pytest.mark.parametrize("server", ["thread", "process"], indirect=True)
def test_attention_endpoint_weights_equal_sdpa_weights_of_that_layer_and_head(server, loaded):
    base, _ = server
    model, tokenizer = loaded
    prompt = "The cat sat on the mat."
    ids = tokenizer.encode(prompt)
    r = attention(base, prompt=prompt, layer=1, head=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_ids"] == ids and body["tokens"] == list(prompt) and body["heads"] == [2]
    assert body["truncated"] is False and body["n_layers"] == 2 and len(body["entropy"]) == 2
    weights = torch.tensor(body["weights"][0], dtype=torch.float64)  # (T, T)
    expected = sdpa_weights(model, ids, layer=1)[2].double()
    torch.testing.assert_close(weights, expected, rtol=0, atol=10 ** -body["decimals"])
    rounding = 0.5 * 10 ** -body["decimals"]  # each weight's, in the JSON
    ones = torch.ones(len(ids), dtype=torch.float64)
    torch.testing.assert_close(weights.sum(-1), ones, rtol=0, atol=len(ids) * rounding)
    assert (weights.triu(1) == 0).all()


def test_attention_endpoint_gives_every_head_of_a_chat_rendered_text(server, loaded):
    base, _ = server
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    body = attention(base, messages=messages, layer=0).json()
    text = httpx.post(
        f"{base}/tokenize", json={"messages": messages, "add_generation_prompt": False}
    )
    assert body["token_ids"] == text.json()["tokens"] and body["heads"] == [0, 1, 2, 3]
    expected = sdpa_weights(loaded[0], body["token_ids"], layer=0)
    torch.testing.assert_close(torch.tensor(body["weights"]), expected, rtol=0, atol=1e-5)


def test_attention_endpoint_keeps_the_first_256_tokens_and_says_so(run_dir, loaded, start_server):
    model, tokenizer = loaded
    torch.manual_seed(0)
    config = dataclasses.replace(model.config, context_length=320, n_layers=1)
    served = make_served(run_dir, (DecoderLM(config).eval(), tokenizer), kv_cache_memory="1MiB")
    base = start_server(create_app(lambda: served, grace_s=0))
    wait_healthy(base)
    body = attention(base, prompt="ab" * 150).json()
    assert (body["n_tokens"], body["prompt_tokens"], body["max_tokens"]) == (256, 300, 256)
    assert body["truncated"] is True and body["tokens"] == list("ab" * 128)
    assert len(body["weights"][0]) == MAX_ATTENTION_TOKENS == 256


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"prompt": "ab", "layer": 2},
            "layer",
            "layer=2 is out of range: the model has 2 layers, numbered 0..1",
        ),
        (
            {"prompt": "ab", "head": -1},
            "head",
            "head=-1 is out of range: the model has 4 heads, numbered 0..3",
        ),
        ({"prompt": "", "layer": 0}, "prompt", "prompt is empty: give at least one token"),
        ({"layer": 0}, "prompt", "give exactly one of prompt and messages"),
    ],
)
def test_attention_endpoint_refuses_bad_fields_with_openai_shaped_400s(
    server, body, param, message
):
    r = attention(server[0], **body)
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }


@pytest.mark.parametrize("server", ["thread", "process"], indirect=True)
def test_model_card_gives_the_shape_and_kv_cache_costs_vs_mha_and_mqa(server, loaded):
    card = httpx.get(f"{server[0]}/v1/model_card").json()
    assert card["parameters"] == loaded[0].num_params()
    assert {k: card[k] for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "attention")} == {
        "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "attention": "GQA",
    }  # fmt: skip
    assert (card["position"], card["context_length"], card["dtype"]) == ("rope", 96, "float32")
    # 2 (K, V) · 2 layers · n_kv_heads · 8 (head_dim) · 4 bytes
    per_token = {row["attention"]: row["bytes_per_token"] for row in card["kv_cache"]}
    assert (
        per_token == {"GQA": 256, "MHA": 512, "MQA": 128}
        and card["kv_cache_bytes_per_token"] == 256
    )
    assert card["kv_cache"][0]["bytes_at"] == {
        "4096": 4096 * 256,
        "32768": 32768 * 256,
        "131072": 131072 * 256,
    }


def test_engine_stats_answers_the_engines_snapshot(server):
    stats = httpx.get(f"{server[0]}/v1/engine_stats").json()
    assert stats["kv_blocks_total"] == server[1].engine.stats().kv_blocks_total > 0
    assert {"running", "waiting", "kv_blocks_used", "tokens_per_s"} <= set(stats)


def test_page_and_its_files_are_served_and_fetch_nothing_from_the_network(server):
    base, _ = server
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{base}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    for path in STATIC.iterdir():  # no CDN, no web font, no remote anything
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", path.read_text()), path.name


API_JS = """
const vm = require("vm"), fs = require("fs");
const [file, key] = process.argv.slice(-2);
const calls = [], elements = {"api-key": {value: key}};
const context = {
  document: {getElementById: (id) => elements[id], addEventListener: () => {}},
  fetch: (url, options) => calls.push({url, headers: options.headers, method: options.method}),
};
vm.createContext(context);
vm.runInContext(fs.readFileSync(file, "utf8"), context);
context.api("/v1/completions", {method: "POST", headers: {"Content-Type": "application/json"}});
context.api("/v1/model_card");
console.log(JSON.stringify(calls));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_page_script_sends_the_api_key_as_a_bearer_header_on_every_fetch():
    script = (STATIC / "app.js").read_text()
    assert len(re.findall(r"\bfetch\(", script)) == 1  # every request goes through api()

    def calls(key: str) -> list[dict]:
        args = ["node", "-e", API_JS, str(STATIC / "app.js"), key]
        return json.loads(subprocess.run(args, capture_output=True, check=True, text=True).stdout)

    json_type = {"Content-Type": "application/json"}
    assert calls(" sk-1 ") == [
        {"url": "/v1/completions", "method": "POST", "headers": json_type | BEARER},
        {"url": "/v1/model_card", "headers": BEARER},
    ]
    assert [c["headers"] for c in calls("")] == [json_type, {}]  # no key, no header


# ---- In a real browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).is_file()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = (
            f"browser tests need {', '.join(missing)}: apt-get install chromium chromium-driver"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--window-size=1400,1200",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def until(driver, condition, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: condition(d))


def open_page(driver, base: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(base)
    until(
        driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#layer option")) == 2
    )  # card read


def fill(driver, values: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By

    for field, value in values.items():
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)


CANVAS_PIXELS = """
const c = arguments[0], cell = Number(c.dataset.cell), m = Number(c.dataset.margin);
const ctx = c.getContext("2d");
const at = (i, j) => Array.from(ctx.getImageData(m + j * cell, m + i * cell, 1, 1).data.slice(0, 3));
const all = ctx.getImageData(0, 0, c.width, c.height).data;
let painted = 0;
for (let k = 3; k < all.length; k += 4) painted += all[k] > 0;
return {tokens: Number(c.dataset.tokens), cell, painted, first: at(0, 0), above: at(0, 1)};
"""


def test_page_streams_a_completion_shows_alternatives_and_draws_attention(browser, server, loaded):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    base, _ = server
    open_page(browser, base)
    fill(browser, {"prompt": "Once upon a time", "temperature": "0", "max_tokens": "24"})
    browser.find_element(By.ID, "generate").click()
    until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#output .tok"))  # streamed text
    until(browser, lambda d: d.find_element(By.ID, "output").get_attribute("data-done") == "true")
    greedy = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0},
    ).json()
    n = greedy["usage"]["completion_tokens"]
    assert browser.find_element(By.ID, "status").text.startswith(f"Done: {n} tokens, finish_reason")
    tokens = browser.find_elements(By.CSS_SELECTOR, "#output .tok")
    assert "".join(t.get_attribute("textContent") for t in tokens) == greedy["choices"][0]["text"]

    ActionChains(browser).move_to_element(tokens[3]).perform()
    tip = browser.find_element(By.ID, "tip")
    until(browser, lambda d: tip.is_displayed())
    rows = tip.find_elements(By.CSS_SELECTOR, "tr")
    assert len(rows) == 5
    probabilities = [float(r.find_elements(By.TAG_NAME, "td")[1].text.rstrip("%")) for r in rows]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 100.05
    chosen = tip.find_element(By.CSS_SELECTOR, "tr.chosen td").text  # greedy: the most likely
    assert chosen == rows[0].find_element(By.TAG_NAME, "td").text
    assert (
        rows[0].find_elements(By.TAG_NAME, "td")[1].text
        == f"{100 * float(tokens[3].get_attribute('data-p')):.1f}%"
    )

    browser.find_element(By.ID, "attention-button").click()
    until(
        browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#maps canvas")) == 4
    )  # all heads
    text = browser.find_element(By.ID, "output").get_attribute("textContent")
    assert text == "Once upon a time" + greedy["choices"][0]["text"]
    n_tokens = attention(base, prompt=text).json()["n_tokens"]
    assert n_tokens == len(loaded[1].encode(text))
    for canvas in browser.find_elements(By.CSS_SELECTOR, "#maps canvas"):
        pixels = browser.execute_script(CANVAS_PIXELS, canvas)
        assert (
            pixels["tokens"] == n_tokens and pixels["painted"] >= (n_tokens * pixels["cell"]) ** 2
        )
        # query 0 sees only key 0: weight 1 on the diagonal, 0 above it
        assert tuple(pixels["first"]) == VIRIDIS_1 and tuple(pixels["above"]) == VIRIDIS_0
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#maps canvas")) == 1)
    assert "entropy" in browser.find_element(By.ID, "entropy").text
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    Select(browser.find_element(By.ID, "head")).select_by_value("all")
    ActionChains(browser).move_to_element(tokens[5]).perform()
    assert browser.save_screenshot(str(ARTIFACTS / "playground.png"))


def test_page_splits_a_chunk_of_several_tokens_into_one_span_each(browser, server):
    # A stream that falls behind the engine gets several tokens per chunk (responses.RequestStream.stream).
    open_page(browser, server[0])
    top = [{"a": -0.1}, {"🙂": -0.2}, {"c": -0.3}]
    completion = {"text": "a🙂cd", "finish_reason": "length", "logprobs": {
        "tokens": ["a", "🙂", "cd"], "token_logprobs": [-0.1, -0.2, -0.3], "top_logprobs": top,
        "text_offset": [7, 8, 9]}}  # fmt: skip
    pieces = browser.execute_script("return completionPieces(arguments[0])", completion)
    assert [(p["text"], p["token"], p["finish"]) for p in pieces] == [
        ("a", "a", None), ("🙂", "🙂", None), ("cd", "cd", "length")]  # fmt: skip
    assert pieces[1]["top"] == [{"token": "🙂", "logprob": -0.2}]

    def entry(token: str) -> dict:
        return {"token": token, "logprob": -1.0, "top_logprobs": []}

    chat = {"delta": {"content": "xy"}, "logprobs": {"content": [entry("x"), entry("y")]}}
    texts = browser.execute_script("return chatPieces(arguments[0]).map((p) => p.text)", chat)
    assert texts == ["x", "y"]
    chat["delta"]["content"] = "x"  # "y" held back (the start of a stop string?): no split
    texts = browser.execute_script("return chatPieces(arguments[0]).map((p) => p.text)", chat)
    assert texts == ["", "x"]


def test_page_chat_mode_streams_a_reply_and_stop_cancels_it(browser, server, monkeypatch):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    base, served = server
    engine = served.engine
    step, cancel, cancelled = engine.step, engine.cancel, []

    def slow_step():  # slow enough to press Stop mid-reply
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    monkeypatch.setattr(engine, "cancel", lambda rid: (cancelled.append(rid), cancel(rid)))
    open_page(browser, base)
    browser.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="chat"]').click()
    fill(browser, {"max_tokens": "80", "temperature": "1", "seed": "3"})
    fill(browser, {"prompt": "hello"})
    browser.find_element(By.ID, "prompt").send_keys(Keys.CONTROL, Keys.ENTER)  # keyboard submit
    until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#output .turn .tok")) >= 3)
    browser.find_element(By.ID, "stop-button").click()
    until(browser, lambda d: d.find_element(By.ID, "output").get_attribute("data-done") == "true")
    assert browser.find_element(By.ID, "status").text.startswith("Stopped after")
    turns = [
        t.get_attribute("textContent") for t in browser.find_elements(By.CSS_SELECTOR, ".turn")
    ]
    assert turns[0] == "user: hello" and turns[1].startswith("assistant: ") and len(turns) == 2
    until(browser, lambda d: cancelled and engine.stats().running == 0, timeout=10)
    assert cancelled[0].startswith("chatcmpl-") and engine.stats().waiting == 0


def test_page_asks_for_the_api_key_then_streams_with_it(browser, run_dir, loaded, start_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")
    base = start_server(create_app(lambda: served, grace_s=1.0, policy=Policy("sk-1")))
    wait_healthy(base)
    browser.get(base)
    status = browser.find_element(By.ID, "status")
    until(browser, lambda d: status.text.startswith("This server needs its API key"))
    browser.find_element(By.ID, "api-key").send_keys("sk-1", Keys.TAB)
    until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#layer option")) == 2)
    assert status.text == "Ready."
    fill(browser, {"prompt": "Hi", "max_tokens": "4", "temperature": "0"})
    browser.find_element(By.ID, "generate").click()
    until(browser, lambda d: d.find_element(By.ID, "output").get_attribute("data-done") == "true")
    assert status.text.startswith("Done: ")
