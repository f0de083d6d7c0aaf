"""The playground (`GET /`) and the fleet page (`GET /fleet`) in a real headless Chromium, driven
by Playwright, against a real fleet. Screenshots of both pages are written to
$SHOAL_TEST_ARTIFACTS (default: test-artifacts/)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import extra_gateway

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("SHOAL_TEST_ARTIFACTS", "test-artifacts"))
# Debian's Chromium as root in a container, with no network: no sandbox, and nothing that phones
# home (without these flags it keeps trying to reach Google's hosts).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                                reason="Debian's chromium is not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM, "CI installs Debian's chromium (.ci/run)"
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    # A phone-sized viewport: the pages must be usable on a narrow screen.
    context = browser.new_context(viewport={"width": 390, "height": 844})
    yield context.new_page()
    context.close()


def _fleet_status(url: str) -> dict:
    return httpx.get(url + "/v1/fleet", timeout=10).json()


def _record_reply_steps(page) -> None:
    page.evaluate("""() => {
        window.__steps = [];
        new MutationObserver(() => window.__steps.push(document.getElementById('reply').textContent))
            .observe(document.getElementById('reply'), {childList: true, characterData: true, subtree: true});
    }""")


def test_playground_streams_the_greedy_reply(fleet, page):
    prompt, max_tokens = "Name three colours of fish.", 24
    expected = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0}).json()["choices"][0]["message"]["content"]
    page.goto(fleet["url"] + "/")
    # The model control lists the fleet's models (/v1/models), the first chosen.
    names = [m["id"] for m in httpx.get(fleet["url"] + "/v1/models", timeout=10).json()["data"]]
    model = page.get_by_label("Model")
    sync_api.expect(model.locator("option")).to_have_text(names)
    sync_api.expect(model).to_have_value(names[0])
    # Keyboard only: labels name the fields, Ctrl+Enter sends.
    page.get_by_label("Message").fill(prompt)
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Temperature").fill("0")
    _record_reply_steps(page)
    page.get_by_label("Message").press("Control+Enter")
    status = page.get_by_role("status")
    sync_api.expect(status).to_contain_text("Done", timeout=120_000)
    assert page.locator("#reply").text_content() == expected
    steps = page.evaluate("window.__steps")
    distinct = [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]]
    assert len(distinct) > 1, "the reply arrived in one piece, not streamed"
    assert all(expected.startswith(s) for s in distinct)
    assert "TTFT" in status.text_content() and "tokens/s" in status.text_content()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)


def test_playground_asks_for_a_json_reply(fleet, page):
    """The reply format control sends `response_format: json_object`: the reply the page shows is
    the API's constrained one, and JSON."""
    prompt = "Return a JSON object with one key, answer, holding the capital of France."
    expected = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_object"}}).json()["choices"][0]["message"]["content"]
    page.goto(fleet["url"] + "/")
    page.get_by_label("Message").fill(prompt)
    page.get_by_label("Max tokens").fill("64")
    page.get_by_label("Reply format").select_option("json_object")
    page.get_by_label("Message").press("Control+Enter")
    sync_api.expect(page.get_by_role("status")).to_contain_text("Done", timeout=120_000)
    assert page.locator("#reply").text_content() == expected
    assert isinstance(json.loads(expected), dict)


def test_stop_cancels_the_request_and_frees_its_blocks(fleet, page):
    page.goto(fleet["url"] + "/")
    page.get_by_label("Message").fill("Tell me a very long story about a fish who sails the sea.")
    page.get_by_label("Max tokens").fill("400")
    page.get_by_role("button", name="Send").click()
    reply = page.locator("#reply")
    sync_api.expect(reply).not_to_have_text("", timeout=120_000)  # streaming has begun
    busy = _fleet_status(fleet["url"])["workers"]
    page.get_by_role("button", name="Stop").click()
    sync_api.expect(page.get_by_role("status")).to_have_text("Stopped")
    stopped_at = len(reply.text_content())
    deadline = time.monotonic() + 30
    while True:  # the worker's next heartbeat shows the request gone and its blocks back
        w = next(x for x in _fleet_status(fleet["url"])["workers"] if x["worker_id"] == "w0")
        if w["num_running"] == 0 and w["num_free_blocks"] == w["num_total_blocks"]:
            break
        assert time.monotonic() < deadline, f"request not cancelled: {w} (while busy: {busy})"
        time.sleep(0.5)
    time.sleep(1)
    assert len(reply.text_content()) == stopped_at  # nothing arrives after Stop
    assert page.get_by_role("button", name="Send").is_enabled()


def test_fleet_page_shows_the_worker_and_its_kv_bar(fleet, page):
    page.goto(fleet["url"] + "/fleet")
    card = page.locator("li.worker", has_text="w0")
    sync_api.expect(card).to_be_visible(timeout=10_000)
    bar = card.get_by_label("K/V blocks in use on w0")
    sync_api.expect(bar).to_be_visible()
    status = _fleet_status(fleet["url"])
    w0 = next(x for x in status["workers"] if x["worker_id"] == "w0")
    assert bar.get_attribute("max") == str(w0["num_total_blocks"])
    sync_api.expect(card).to_contain_text(f"of {w0['num_total_blocks']}")
    sync_api.expect(page.locator("#model")).to_have_text(status["model"])
    sync_api.expect(page.locator("#waiting")).to_have_text(str(status["num_waiting"]))
    heartbeat = card.locator("dd").nth(5)
    sync_api.expect(heartbeat).to_contain_text("s ago")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "fleet.png"), full_page=True)


def test_pages_work_with_an_api_key(fleet, page):
    key = "sk-pages-5e1d"
    with extra_gateway(fleet, "--api-key", key) as url:
        page.goto(url + "/fleet")
        sync_api.expect(page.get_by_role("status")).to_contain_text("invalid API key")
        page.get_by_label("API key").fill(key)
        page.get_by_label("API key").press("Tab")  # "change" fires: kept in sessionStorage
        sync_api.expect(page.locator("li.worker", has_text="w0")).to_be_visible()
        page.goto(url + "/")  # the same tab's session carries the key to the playground
        assert page.get_by_label("API key").input_value() == key
        page.get_by_label("Message").fill("Hi")
        page.get_by_label("Max tokens").fill("3")
        page.get_by_role("button", name="Send").click()
        sync_api.expect(page.get_by_role("status")).to_contain_text("Done", timeout=60_000)
        assert page.locator("#reply").text_content()
