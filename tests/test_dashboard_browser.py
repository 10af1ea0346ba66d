"""The dashboard in a real browser: headless Chromium on /dashboard of a real ./server.sh under load.

Skipped, with the reason, only where Playwright or a Chromium binary is missing; `.ci/run`
installs both.
"""

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from client import browser
from client.launch import running_server

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))

KEY = "s3cret"
CLIENTS = 30
DEADLINE_MS = 60_000
# Waits use Playwright's locator assertions, which poll without evaluating strings in the page:
# the page's Content-Security-Policy forbids that, and the test keeps it in force.


def number(page, selector: str) -> int:
    return int(page.inner_text(selector))


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "2048", "API_KEY": KEY}
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **settings) as url:
        yield url


def test_dashboard_draws_the_loop_while_requests_run(url):
    from playwright.sync_api import expect

    expect.set_options(timeout=DEADLINE_MS)
    stop, answered = threading.Event(), []

    def client(i: int) -> None:  # keeps one request in flight until told to stop
        headers = {"Authorization": f"Bearer {KEY}"}
        while not stop.is_set():
            body = {"prompt": f"request {i}: the lighthouse keeper", "num_tokens": 100 + 5 * i}
            answered.append(requests.post(f"{url}/inference", json=body, headers=headers, timeout=120).status_code)

    problems: list[str] = []

    def console(message) -> None:
        if message.type == "error":
            problems.append(f"console error: {message.text}")

    with ThreadPoolExecutor(CLIENTS) as pool, browser.chromium() as chromium:
        page = chromium.new_page(viewport={"width": 1400, "height": 1400})
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.on("console", console)
        try:
            load = [pool.submit(client, i) for i in range(CLIENTS)]
            page.goto(f"{url}/dashboard")
            # The page asks for the key before it fetches anything, then keeps it for the tab.
            expect(page.locator("#key-form")).to_be_visible()
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            expect(page.locator("#step-count")).to_have_text(re.compile(r"^[1-9]\d*$"))
            first = number(page, "#step-count")
            expect(page.locator("#step-count")).not_to_have_text(str(first))
            assert number(page, "#step-count") > first
            assert page.text_content("#mode") == "dynamic"
            assert page.inner_text("#model") == requests.get(f"{url}/health", timeout=10).json()["model"]
            assert page.evaluate("sessionStorage.length") == 1
            # The charts hold data: bars for steps, rows of request phases, lines over time.
            expect(page.locator("#requests-chart rect.seg.decoding").first).to_be_attached()
            assert page.locator("#steps-chart rect.bar.decode").count() > 0
            assert page.locator("#step-time-chart rect.bar.forward").count() > 0
            assert page.locator("#queue-chart path.line.running").count() == 1
            assert page.locator("#kv-chart path.line.used").count() == 1
            assert number(page, "#tile-running") > 0
        finally:
            stop.set()
        for future in load:
            future.result()
        # Once the load is over, every row ends: the page shows requests finishing, and the queue empty.
        expect(page.locator("#requests-chart rect.end.finished").first).to_be_attached()
        expect(page.locator("#tile-running")).to_have_text("0")
        assert page.locator("#latency-chart path.line.tps").count() == 1
        page.reload()  # the key is still there: no form, straight to the data
        expect(page.locator("#step-count")).to_have_text(re.compile(r"^[1-9]\d*$"))
        assert page.locator("#key-form").is_hidden()
    assert problems == []
    assert set(answered) == {200} and len(answered) >= CLIENTS


def test_a_wrong_key_is_asked_for_again(url):
    from playwright.sync_api import expect

    with browser.chromium() as chromium:
        page = chromium.new_page()
        page.goto(f"{url}/dashboard")
        page.fill("#key-input", "wrong")
        page.click("#key-form button")
        expect(page.locator("#key-problem")).to_contain_text("refused", timeout=DEADLINE_MS)
        expect(page.locator("#key-form")).to_be_visible()
        assert page.evaluate("sessionStorage.length") == 0
